//! Request parameters: the same names from the query string, a JSON body or
//! a form body, checked strictly (unknown or repeated parameters are errors).

use std::fmt;
use std::time::Duration;

use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::Deserialize;
use serde::de::{self, DeserializeOwned, Deserializer, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::duration::parse_duration;
use crate::error::Error;
use crate::lock::Name;

/// Largest accepted request body.
pub const MAX_BODY: usize = 64 * 1024;

/// The parameters of a route that takes none: any given is refused.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

/// Parameters of type `T` gathered from the query string and the body.
pub struct Params<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send + 'static> FromRequest<S> for Params<T> {
    type Rejection = Error;

    // Boxed: inline, the body read's state (the request's parts, the
    // collecting body) would size the request's whole future, and an
    // acquire keeps that for as long as it waits.
    fn from_request(req: Request, _state: &S) -> impl Future<Output = Result<Self, Error>> + Send {
        Box::pin(read_params(req))
    }
}

async fn read_params<T: DeserializeOwned>(req: Request) -> Result<Params<T>, Error> {
    let (parts, body) = req.into_parts();
    let bytes = read_body(body).await?;
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    parse(parts.uri.query(), content_type, &bytes).map(Params)
}

/// A request body of at most [`MAX_BODY`] bytes.
///
/// # Errors
/// 413 `body-too-large` past [`MAX_BODY`]; 408 `body-timeout` when it did
/// not come within the server's body timeout; a 400 when it broke off.
pub async fn read_body(body: axum::body::Body) -> Result<axum::body::Bytes, Error> {
    // A Content-Length over the limit says so before any of it comes: not
    // waited for (until the body timeout) to be refused. What the client
    // sends meanwhile is still read, and dropped, behind the answer, as far
    // as a refused body would have been read: a connection closed on
    // unread bytes is reset, and the reset can overtake the answer.
    if usize::try_from(axum::body::HttpBody::size_hint(&body).lower())
        .map_or(true, |n| n > MAX_BODY)
    {
        tokio::spawn(async move {
            let mut body = body;
            let mut read = 0;
            while read <= MAX_BODY {
                match body.frame().await {
                    Some(Ok(frame)) => read += frame.data_ref().map_or(0, |d| d.len()),
                    _ => break,
                }
            }
        });
        return Err(Error::BodyTooLarge { limit: MAX_BODY });
    }
    match Limited::new(body, MAX_BODY).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(Error::BodyTooLarge { limit: MAX_BODY })
        }
        Err(e) => Err(match body_timeout(&*e) {
            Some(timeout) => Error::BodyTimedOut {
                timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            },
            None => Error::InvalidParameter("the request body could not be read".into()),
        }),
    }
}

/// The body-read timeout, when `e` (or an error behind it) says it passed.
fn body_timeout(e: &(dyn std::error::Error + 'static)) -> Option<Duration> {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(t) = e.downcast_ref::<crate::http::server::BodyTimedOut>() {
            return Some(t.timeout);
        }
        next = e.source();
    }
    None
}

/// Parameters of type `T` from a query string and a body of `content_type`
/// (required when the body is not empty): the whole of [`Params`] but
/// reading the body.
///
/// # Errors
/// A 400 `invalid-parameter` (or 415) naming what is wrong.
pub fn parse<T: DeserializeOwned>(
    query: Option<&str>,
    content_type: Option<&str>,
    body: &[u8],
) -> Result<T, Error> {
    let mut params = Map::new();
    if let Some(query) = query {
        check_utf8(query.as_bytes(), "query string")?;
        let pairs: Vec<(String, String)> = serde_urlencoded::from_str(query)
            .map_err(|e| Error::InvalidParameter(format!("query string: {e}")))?;
        merge(
            &mut params,
            pairs.into_iter().map(|(k, v)| (k, Value::String(v))),
            "query string",
        )?;
    }
    if !body.iter().all(u8::is_ascii_whitespace) {
        let body = parse_body(content_type, body)?;
        merge(&mut params, body, "body")?;
    }
    let taken = field_names::<T>();
    if let Some(unknown) = params.keys().find(|k| !taken.contains(&k.as_str())) {
        return Err(Error::InvalidParameter(if taken.is_empty() {
            format!("parameter {unknown:?} is not taken here: this route takes no parameters")
        } else {
            format!(
                "parameter {unknown:?} is not taken here; this route takes {}",
                taken.join(", ")
            )
        }));
    }
    serde_path_to_error::deserialize(Value::Object(params)).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if path == "." || path.is_empty() {
            Error::InvalidParameter(inner)
        } else {
            Error::InvalidParameter(format!("{path}: {inner}"))
        }
    })
}

fn parse_body(content_type: Option<&str>, bytes: &[u8]) -> Result<Vec<(String, Value)>, Error> {
    let Some(content_type) = content_type else {
        return Err(Error::UnsupportedMediaType(
            "the request has a body but no Content-Type; send Content-Type: application/json (or application/x-www-form-urlencoded for a form body)".into(),
        ));
    };
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match essence.as_str() {
        "application/json" => match serde_json::from_slice::<Pairs>(bytes) {
            Ok(Pairs(pairs)) => pairs
                .into_iter()
                .map(|(key, raw)| scalar(&key, &raw).map(|v| (key, v)))
                .collect(),
            Err(e) if e.is_data() => Err(Error::InvalidParameter(
                "the JSON body must be an object of parameters, e.g. {\"ttl\":\"30s\"}".into(),
            )),
            Err(e) => Err(Error::InvalidParameter(format!(
                "the body is not valid JSON (at line {}, column {}); send an object of parameters, e.g. {{\"ttl\":\"30s\"}}",
                e.line(),
                e.column()
            ))),
        },
        // What `curl -d` and `--data-binary` label a JSON text they send.
        "application/x-www-form-urlencoded" if looks_like_json(bytes) => {
            Err(Error::UnsupportedMediaType(
                "the body is JSON but its Content-Type is application/x-www-form-urlencoded (what curl -d and --data-binary send by default); send Content-Type: application/json (curl -H 'Content-Type: application/json')".into(),
            ))
        }
        "application/x-www-form-urlencoded" => {
            check_utf8(bytes, "form body")?;
            let pairs: Vec<(String, String)> = serde_urlencoded::from_bytes(bytes)
                .map_err(|e| Error::InvalidParameter(format!("form body: {e}")))?;
            Ok(pairs
                .into_iter()
                .map(|(k, v)| (k, Value::String(v)))
                .collect())
        }
        _ => Err(Error::UnsupportedMediaType(format!(
            "content type {content_type:?} is not accepted; send application/json or application/x-www-form-urlencoded, or no body"
        ))),
    }
}

/// Checks that every name and value of form-encoded `text` is UTF-8 once
/// percent-decoded: the form decoder turns other bytes into U+FFFD, so
/// owners `Jos%E9` and `Jos%E8` read as one owner, and re-entered each
/// other's exclusive lease.
fn check_utf8(text: &[u8], what: &str) -> Result<(), Error> {
    for pair in text.split(|&b| b == b'&') {
        let mut parts = pair.splitn(2, |&b| b == b'=');
        let name = parts.next().unwrap_or_default();
        let value = parts.next().unwrap_or_default();
        for part in [name, value] {
            if percent_encoding::percent_decode(part)
                .decode_utf8()
                .is_err()
            {
                let name = percent_encoding::percent_decode(name).decode_utf8_lossy();
                return Err(Error::InvalidParameter(format!(
                    "{what}: parameter {name:?} is not UTF-8 text once percent-decoded; \
                     send text as UTF-8, percent-encoded (é is %C3%A9)"
                )));
            }
        }
    }
    Ok(())
}

/// Whether a form body is really a JSON object or array.
fn looks_like_json(bytes: &[u8]) -> bool {
    matches!(
        bytes.iter().find(|b| !b.is_ascii_whitespace()),
        Some(b'{' | b'[')
    )
}

/// A JSON member's value as the parameter it stands for: a string as its
/// text, a number as the digits that were sent (so `{"limit": 7}` means
/// what `?limit=7` means, and a number past every integer type is quoted as
/// written, not as a rounded float), `null` as absent. Anything else names
/// the parameter and what it takes.
fn scalar(key: &str, raw: &RawValue) -> Result<Value, Error> {
    let text = raw.get();
    let wrong = |what: &str| {
        Error::InvalidParameter(format!(
            "{key}: give text or a number, not {what} (JSON {text})"
        ))
    };
    match text.as_bytes().first() {
        Some(b'"') => serde_json::from_str::<String>(text)
            .map(Value::String)
            .map_err(|_| wrong("a string that cannot be read")),
        Some(b'-' | b'0'..=b'9') => Ok(Value::String(text.to_owned())),
        Some(b'n') => Ok(Value::Null),
        Some(b't' | b'f') => Err(wrong("a boolean")),
        Some(b'[') => Err(wrong("an array")),
        _ => Err(wrong("an object")),
    }
}

/// A JSON object's members in order, duplicates kept (so they can be
/// refused), each as the raw text it was sent as.
struct Pairs(Vec<(String, Box<RawValue>)>);

impl<'de> serde::Deserialize<'de> for Pairs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Pairs;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object of parameters")
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Pairs, A::Error> {
                let mut pairs = Vec::new();
                while let Some(entry) = map.next_entry::<String, Box<RawValue>>()? {
                    pairs.push(entry);
                }
                Ok(Pairs(pairs))
            }
        }
        d.deserialize_map(V)
    }
}

fn merge(
    params: &mut Map<String, Value>,
    more: impl IntoIterator<Item = (String, Value)>,
    source: &str,
) -> Result<(), Error> {
    for (key, value) in more {
        match params.get(&key) {
            // Repeating a parameter with the same value changes nothing.
            Some(existing) if same_value(existing, &value) => {}
            Some(_) => {
                return Err(Error::InvalidParameter(format!(
                    "parameter {key:?} is given twice with different values (the second time in the {source}); give each parameter once"
                )));
            }
            None => {
                params.insert(key, value);
            }
        }
    }
    Ok(())
}

/// Whether two given values are the same, across query text and JSON (`5` and `"5"`).
fn same_value(a: &Value, b: &Value) -> bool {
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    a == b || text(a) == text(b)
}

/// The field names of the parameter struct `T`, read from its `Deserialize`
/// (the names serde would accept), so unknown parameters are named in our
/// words with the list of what the route takes.
fn field_names<'de, T: serde::Deserialize<'de>>() -> &'static [&'static str] {
    /// A deserializer that only records the fields a struct asks for.
    struct Fields<'a>(&'a mut &'static [&'static str]);
    impl<'de> Deserializer<'de> for Fields<'_> {
        type Error = de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("fields recorded"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf option unit unit_struct newtype_struct seq tuple
            tuple_struct map enum identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Fields(&mut fields));
    fields
}

/// The `{name}` path segment, validated as a lock name.
pub struct LockName(pub Name);

impl<S: Send + Sync> FromRequestParts<S> for LockName {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Error> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|_| {
                Error::InvalidName(
                    "lock name is not valid UTF-8; use 1 to 200 characters of A-Z a-z 0-9 . _ : -"
                        .into(),
                )
            })?;
        Name::parse(&raw).map(LockName).map_err(Error::InvalidName)
    }
}

/// A parameter's value and the text it was sent as, so that an error about
/// the value quotes what the client wrote (`max_hold "9999999h"`), not a
/// number the sidecar computed from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Given<T> {
    pub value: T,
    pub sent: String,
}

/// Deserializes a duration given as text (`30s`) or a number of milliseconds.
pub fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Given<Duration>>, D::Error> {
    struct V;
    impl Visitor<'_> for V {
        type Value = Option<Given<Duration>>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a duration such as 250ms, 30s, 5m, 1h, or a whole number of milliseconds")
        }
        fn visit_u64<E: de::Error>(self, n: u64) -> Result<Self::Value, E> {
            self.visit_str(&n.to_string())
        }
        fn visit_i64<E: de::Error>(self, n: i64) -> Result<Self::Value, E> {
            self.visit_str(&n.to_string())
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
            parse_duration(s)
                .map(|value| {
                    Some(Given {
                        value,
                        sent: s.to_owned(),
                    })
                })
                .map_err(E::custom)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }
    d.deserialize_any(V)
}

/// Deserializes a whole number of 0 or more given as text or a number. Too
/// many digits for any integer saturate, for the caller's range check to
/// quote what was sent and name the maximum.
pub fn count<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Given<u64>>, D::Error> {
    struct V;
    impl Visitor<'_> for V {
        type Value = Option<Given<u64>>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a whole number such as 3")
        }
        fn visit_u64<E: de::Error>(self, n: u64) -> Result<Self::Value, E> {
            self.visit_str(&n.to_string())
        }
        fn visit_i64<E: de::Error>(self, n: i64) -> Result<Self::Value, E> {
            self.visit_str(&n.to_string())
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(E::custom(format!(
                    "{s:?} is not a whole number; give digits only, e.g. 3"
                )));
            }
            Ok(Some(Given {
                value: s.parse().unwrap_or(u64::MAX),
                sent: s.to_owned(),
            }))
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }
    d.deserialize_any(V)
}

/// Deserializes a lock mode, saying which words there are.
pub fn mode<'de, D: Deserializer<'de>>(d: D) -> Result<Option<crate::lock::Mode>, D::Error> {
    use crate::lock::Mode;
    match Option::<String>::deserialize(d)?.as_deref() {
        None => Ok(None),
        Some("exclusive") => Ok(Some(Mode::Exclusive)),
        Some("shared") => Ok(Some(Mode::Shared)),
        Some(other) => Err(de::Error::custom(format!(
            "{other:?} is not a mode; use exclusive (the default: one holder) or shared (readers together)"
        ))),
    }
}
