//! Input errors teach: every wrong parameter a careless or hostile client can
//! send — wrong JSON types, numbers past every integer type, a JSON body sent
//! as a form (what `curl --data-binary '{…}'` does) — gets a problem document
//! that names the parameter, quotes the value as it was sent and says what is
//! allowed, in the API's words: never serde's (`invalid type`, `variant`,
//! `expected string or map`) and never a number the sidecar computed instead
//! of the one the client wrote.

use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::common::api::Body;
use crate::common::*;

/// Words of serde's own messages that mean nothing to a client.
const SERDE_WORDS: [&str; 8] = [
    "invalid type",
    "variant",
    "expected string or map",
    "unknown field",
    "floating point",
    "sequence",
    "invalid value",
    "EOF while parsing",
];

/// One bad request: where it goes, what it sends, and what the answer must say.
struct Case {
    segments: &'static [&'static str],
    query: &'static [(&'static str, &'static str)],
    body: fn() -> Body,
    status: StatusCode,
    slug: &'static str,
    /// Every one of these appears in `detail`.
    says: &'static [&'static str],
}

fn json(value: serde_json::Value) -> Body {
    Body::Json(value)
}

fn raw_json(text: &str) -> Body {
    Body::Raw {
        content_type: "application/json".into(),
        bytes: text.as_bytes().to_vec(),
    }
}

fn cases() -> Vec<Case> {
    const LOCK: &[&str] = &["v1", "locks", "teach"];
    const SEMAPHORE: &[&str] = &["v1", "semaphores", "teach"];
    const BAD: StatusCode = StatusCode::BAD_REQUEST;
    vec![
        Case {
            segments: LOCK,
            query: &[],
            body: || json(json!({"mode": 5})),
            status: BAD,
            slug: "invalid-parameter",
            says: &["mode", "5", "exclusive", "shared"],
        },
        Case {
            segments: LOCK,
            query: &[("mode", "writer")],
            body: || Body::Empty,
            status: BAD,
            slug: "invalid-parameter",
            says: &["mode", "\"writer\"", "exclusive", "shared"],
        },
        Case {
            segments: LOCK,
            query: &[],
            body: || json(json!({"mode": {"x": 1}})),
            status: BAD,
            slug: "invalid-parameter",
            says: &["mode", "object"],
        },
        Case {
            segments: LOCK,
            query: &[],
            body: || json(json!({"owner": ["a"]})),
            status: BAD,
            slug: "invalid-parameter",
            says: &["owner", "array"],
        },
        Case {
            segments: LOCK,
            query: &[],
            body: || json(json!({"ttl": true})),
            status: BAD,
            slug: "invalid-parameter",
            says: &["ttl", "true", "text or a number"],
        },
        Case {
            segments: LOCK,
            query: &[],
            body: || raw_json(r#"{"ttl": 1.5}"#),
            status: BAD,
            slug: "invalid-parameter",
            says: &["ttl", "1.5", "30s"],
        },
        Case {
            segments: LOCK,
            query: &[],
            body: || raw_json(r#"{"max_hold": 1e30}"#),
            status: BAD,
            slug: "invalid-parameter",
            says: &["max_hold", "1e30"],
        },
        Case {
            segments: LOCK,
            query: &[],
            body: || json(json!({"max_hold": "99999999999999999999h"})),
            status: BAD,
            slug: "out-of-range",
            says: &["max_hold", "\"99999999999999999999h\"", "365 days"],
        },
        Case {
            segments: LOCK,
            query: &[("max_hold", "9999999h")],
            body: || Body::Empty,
            status: BAD,
            slug: "out-of-range",
            says: &["max_hold", "\"9999999h\"", "31536000000 ms"],
        },
        Case {
            segments: LOCK,
            query: &[("ttl", "2h")],
            body: || Body::Empty,
            status: BAD,
            slug: "out-of-range",
            says: &["ttl", "\"2h\"", "--max-ttl"],
        },
        Case {
            segments: SEMAPHORE,
            query: &[("limit", "18446744073709551616")],
            body: || Body::Empty,
            status: BAD,
            slug: "out-of-range",
            says: &["limit", "18446744073709551616", "too large", "4294967295"],
        },
        Case {
            segments: SEMAPHORE,
            query: &[],
            body: || raw_json(r#"{"limit": 18446744073709551616}"#),
            status: BAD,
            slug: "out-of-range",
            says: &["limit", "18446744073709551616", "too large", "4294967295"],
        },
        Case {
            segments: SEMAPHORE,
            query: &[],
            body: || raw_json(r#"{"limit": 2.5}"#),
            status: BAD,
            slug: "invalid-parameter",
            says: &["limit", "2.5", "whole number"],
        },
        Case {
            segments: LOCK,
            query: &[],
            body: || json(json!({"bogus": 1})),
            status: BAD,
            slug: "invalid-parameter",
            says: &["\"bogus\"", "ttl", "lock_delay"],
        },
        Case {
            segments: LOCK,
            query: &[],
            body: || raw_json(r#"{"ttl":"30s""#),
            status: BAD,
            slug: "invalid-parameter",
            says: &["not valid JSON", "line 1"],
        },
        // What `curl --data-binary '{…}'` sends: a JSON text as a form.
        Case {
            segments: LOCK,
            query: &[],
            body: || Body::Raw {
                content_type: "application/x-www-form-urlencoded".into(),
                bytes: br#"{"ttl":"30s"}"#.to_vec(),
            },
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            slug: "unsupported-media-type",
            says: &["Content-Type: application/json"],
        },
        Case {
            segments: &["v1", "locks", "teach", "keepalive"],
            query: &[("token", "x")],
            body: || json(json!({"ttl": [1]})),
            status: BAD,
            slug: "invalid-parameter",
            says: &["ttl", "array"],
        },
        Case {
            segments: &["v1", "locks"],
            query: &[],
            body: || json(json!({"limit": -3})),
            status: BAD,
            slug: "invalid-parameter",
            says: &["limit", "-3"],
        },
    ]
}

#[tokio::test]
async fn wrong_parameters_are_explained_in_the_apis_words() {
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let api = sidecar.api();
    let mut failures = Vec::new();
    for case in cases() {
        let method = if case.segments == ["v1", "locks"] {
            Method::GET
        } else {
            Method::POST
        };
        let body = (case.body)();
        let shown = format!("{method} {:?} {:?} {body:?}", case.segments, case.query);
        let response = api.send(method, case.segments, case.query, body).await;
        let problem = assert_problem(response, case.status, case.slug).await;
        let detail = problem["detail"].as_str().unwrap_or_default().to_owned();
        for word in case.says {
            if !detail.contains(word) {
                failures.push(format!("{shown}: the detail lacks {word:?}: {detail}"));
            }
        }
        for word in SERDE_WORDS {
            if detail.contains(word) {
                failures.push(format!("{shown}: serde's words {word:?}: {detail}"));
            }
        }
    }
    let state = api.lock("teach").inspect().await;
    assert!(state.holders.is_empty(), "nothing was granted: {state:?}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A JSON number is the same parameter as its text in the query string, as
/// the duplicate rule already says: `{"owner": 7}` is owner `7`.
#[tokio::test]
async fn a_json_number_means_what_its_text_means_in_the_query() {
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let lock = sidecar.api().lock(&unique_name("number"));
    let response = sidecar
        .api()
        .send(
            Method::POST,
            &["v1", "locks", lock.name()],
            &[],
            Body::Json(json!({"owner": 7, "ttl": 30000})),
        )
        .await;
    let grant: Grant = crate::common::api::expect_json(response, StatusCode::OK).await;
    assert_eq!(grant.owner, "7");
    assert_eq!(grant.ttl_ms, 30_000);
    lock.release(&grant.token).await;
}

/// A parameter that is not UTF-8 once percent-decoded (a client that
/// encodes Latin-1) is refused, naming it: it was read with U+FFFD in place
/// of the bad bytes, so owners `Jos%E9` and `Jos%E8` were one owner, and
/// the second re-entered the first's exclusive lease (count 2, one token,
/// two clients holding). The same owner sent as UTF-8 is taken.
#[tokio::test]
async fn a_parameter_that_is_not_utf8_is_refused_not_mangled() {
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let api = sidecar.api();
    let name = unique_name("latin");
    let http = reqwest::Client::new();
    let mut sent = Vec::new();
    for query in [
        "owner=Jos%E9&ttl=10s",
        "owner=Jos%E8&ttl=10s",
        "ttl=%FF",
        "own%E9r=x",
    ] {
        let mut url = api.url(&["v1", "locks", &name], &[]);
        url.set_query(Some(query));
        sent.push((query.to_owned(), http.post(url).send().await.expect("send")));
    }
    let form = api
        .send(
            Method::POST,
            &["v1", "locks", &name],
            &[],
            Body::Raw {
                content_type: "application/x-www-form-urlencoded".into(),
                bytes: b"owner=M%FCller".to_vec(),
            },
        )
        .await;
    sent.push(("form body owner=M%FCller".to_owned(), form));
    for (what, answer) in sent {
        let problem = assert_problem(answer, StatusCode::BAD_REQUEST, "invalid-parameter").await;
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("UTF-8"), "{what}: {detail}");
    }
    assert!(api.lock(&name).inspect().await.holders.is_empty());
    let mut url = api.url(&["v1", "locks", &name], &[]);
    url.set_query(Some("owner=Jos%C3%A9&ttl=10s"));
    let grant: Grant =
        crate::common::api::expect_json(http.post(url).send().await.expect("send"), StatusCode::OK)
            .await;
    assert_eq!(grant.owner, "José");
}

/// An `Idempotency-Key` that is too long, holds a control or non-ASCII
/// byte, or comes twice is refused with 400 `invalid-parameter` naming the
/// header and what it may be, and the release does not run.
#[tokio::test]
async fn a_bad_idempotency_key_is_refused_and_releases_nothing() {
    use reqwest::header::HeaderValue;
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let api = sidecar.api();
    let lock = api.lock(&unique_name("bad-key"));
    let grant = lock.acquire(&[("owner", "holder")]).await;
    let path = ["v1", "locks", lock.name()];
    let token = [("token", grant.token.as_str())];
    let bad: [(&str, Vec<HeaderValue>); 4] = [
        (
            "too long",
            vec![HeaderValue::from_str(&"k".repeat(256)).expect("value")],
        ),
        (
            "a tab",
            vec![HeaderValue::from_bytes(b"a\tb").expect("value")],
        ),
        (
            "not ASCII",
            vec![HeaderValue::from_bytes(b"caf\xc3\xa9").expect("value")],
        ),
        (
            "two values",
            vec![HeaderValue::from_static("a"), HeaderValue::from_static("b")],
        ),
    ];
    for (what, values) in bad {
        let mut request = api.request(Method::DELETE, &path, &token);
        // The second value under Go's other name for the header.
        for (i, value) in values.into_iter().enumerate() {
            let name = if i == 0 {
                "idempotency-key"
            } else {
                "x-idempotency-key"
            };
            request = request.header(name, value);
        }
        let answer = request.send().await.expect("send");
        let problem = assert_problem(answer, StatusCode::BAD_REQUEST, "invalid-parameter").await;
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("Idempotency-Key"), "{what}: {detail}");
    }
    assert_eq!(lock.inspect().await.holder_owners(), ["holder"]);
    // The longest key accepted, with spaces inside.
    let longest = format!("a {}", "k".repeat(253));
    assert!(lock.release_with_key(&grant.token, &longest).await.released);
}
