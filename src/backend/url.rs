//! Backend URLs: the one place that takes them apart and the one function
//! every URL goes through before it is shown.
//!
//! `scheme://[user[:password]@]host[:port][,host[:port]…][/path][?query]` —
//! several hosts for Redlock, Sentinel, Cluster and ZooKeeper ensembles, which
//! the `url` crate (one host per URL) does not take.

/// A backend URL taken apart as written (nothing is decoded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parts<'a> {
    /// Before `://`.
    pub scheme: &'a str,
    /// Before the last `@` of the authority, when there is one.
    pub userinfo: Option<&'a str>,
    /// The comma-separated hosts (`host:port`), none empty.
    pub hosts: Vec<&'a str>,
    /// After the first `/` of the authority, without it (may be empty).
    pub path: &'a str,
    /// After the first `?`, without it (may be empty).
    pub query: &'a str,
}

impl<'a> Parts<'a> {
    /// Takes `url` apart.
    ///
    /// # Errors
    /// A sentence naming the URL (redacted) when it has no `://` or no host.
    pub fn parse(url: &'a str) -> Result<Self, String> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad_url(url, "missing ://"))?;
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (userinfo, rest) = match rest.rsplit_once('@') {
            Some((u, r)) => (Some(u), r),
            None => (None, rest),
        };
        let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
        let hosts: Vec<&str> = hosts.split(',').filter(|h| !h.is_empty()).collect();
        if hosts.is_empty() {
            return Err(bad_url(url, "no host given"));
        }
        Ok(Self {
            scheme,
            userinfo,
            hosts,
            path,
            query,
        })
    }

    /// Each host with the user info in front (`user:pw@host:port`), for
    /// drivers that take one URL per node.
    pub fn hosts_with_userinfo(&self) -> Vec<String> {
        let at = self.userinfo.map_or(String::new(), |u| format!("{u}@"));
        self.hosts.iter().map(|h| format!("{at}{h}")).collect()
    }

    /// The query's `name=value` pairs (a pair without `=` has an empty value).
    pub fn query_pairs(&self) -> impl Iterator<Item = (&'a str, &'a str)> {
        self.query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| p.split_once('=').unwrap_or((p, "")))
    }
}

/// Removes the raw `key=value` pairs of `keys` from a URL's query, keeping
/// every other byte as it was. Returns the URL and the removed values.
pub fn strip_query(url: &str, keys: &[&str]) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), Vec::new());
    };
    let mut kept = Vec::new();
    let mut removed = Vec::new();
    for pair in query.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if keys.contains(&key) {
            removed.push((key.to_owned(), value.to_owned()));
        } else {
            kept.push(pair);
        }
    }
    if kept.is_empty() {
        (base.to_owned(), removed)
    } else {
        (format!("{base}?{}", kept.join("&")), removed)
    }
}

/// The operator's sentence for what is wrong with `url` (shown redacted).
pub fn bad_url(url: &str, e: impl std::fmt::Display) -> String {
    format!("backend URL {:?}: {e}", redact(url))
}

/// The scheme of `url` (before `://`), or the whole text when it has none.
pub fn scheme(url: &str) -> &str {
    url.split_once("://").map_or(url, |(s, _)| s)
}

/// What [`redact`] shows of a URL it cannot take apart safely.
const HIDDEN: &str = "(not shown: it has an @ after a ?)";

/// Substrings of a query parameter's name (decoded, lower-cased, letters
/// and digits only) that mark its value as a credential.
const CREDENTIAL_WORDS: &[&str] = &[
    "pass",
    "pwd",
    "secret",
    "token",
    "auth",
    "credential",
    "key",
];

/// A backend URL as it may be shown (`/v1/info`, logs, errors, the
/// dashboard): the one function every URL goes through before it is shown.
///
/// Removes the password of the user info (everything up to the last `@`,
/// so a raw `/` or `@` in a password is covered too; a URL with an `@`
/// after a `?` — a `?` in a password, or an `@` in a query — is not shown
/// at all, as neither can be told from the other) and
/// every query parameter whose name, once percent-decoded (repeatedly, so
/// `pass%77ord` and `pass%2577ord` count), looks like a credential (see
/// [`CREDENTIAL_WORDS`]). Works on the text, so multi-host URLs
/// (`redlock://u:pw@a:1,b:2`) and strings that are no URL at all are
/// covered too.
pub fn redact(url: &str) -> String {
    // A scheme is letters, digits, `+`, `.` and `-`: a `://` further on (in
    // a query, after a mistyped `:/`) does not end one.
    let (scheme, rest) = url
        .split_once("://")
        .filter(|(s, _)| {
            s.starts_with(|c: char| c.is_ascii_alphabetic())
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c))
        })
        .map_or(("", url), |(s, r)| (s, r));
    if let (Some(q), Some(a)) = (rest.find('?'), rest.rfind('@'))
        && q < a
    {
        // An `@` after a `?`: a password with a `?` in it, or a query with
        // an `@` (in a value that may be a password): either way, what
        // follows the `?` cannot be told apart from a secret.
        return match scheme.is_empty() {
            false => format!("{scheme}://{HIDDEN}"),
            true => HIDDEN.to_owned(),
        };
    }
    let rest = match rest.rsplit_once('@') {
        Some((userinfo, hosts)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            // A user name cut at a `/`: what follows may be a password. (A
            // `?` before the last `@` was answered above.)
            let user = user.split('/').next().unwrap_or_default();
            let at = if user.is_empty() { "" } else { "@" };
            format!("{user}{at}{hosts}")
        }
        None => rest.to_owned(),
    };
    let (rest, query) = rest
        .split_once('?')
        .map_or((rest.as_str(), None), |(b, q)| (b, Some(q)));
    let base = if scheme.is_empty() {
        rest.to_owned()
    } else {
        format!("{scheme}://{rest}")
    };
    let kept: Vec<&str> = query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter(|pair| !pair.is_empty() && !is_credential(pair.split('=').next().unwrap_or("")))
        .collect();
    if kept.is_empty() {
        base
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

/// Whether a query parameter named `name` (as written) carries a credential.
fn is_credential(name: &str) -> bool {
    let mut name = name.to_owned();
    // Decoding until nothing changes: a parameter encoded twice is still
    // a credential to whoever decodes it twice.
    for _ in 0..4 {
        let decoded: String = url::form_urlencoded::parse(format!("{name}=").as_bytes())
            .next()
            .map_or_else(String::new, |(k, _)| k.into_owned());
        if decoded == name {
            break;
        }
        name = decoded;
    }
    let plain: String = name
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect::<String>()
        .to_ascii_lowercase();
    CREDENTIAL_WORDS.iter().any(|w| plain.contains(w))
}

#[cfg(test)]
mod tests {
    use super::{Parts, redact};

    #[test]
    fn multi_host_urls_come_apart_as_written() {
        let p = Parts::parse("redlock://u:p@ss@a:1,b:2,/3/x?k=v&flag").unwrap();
        assert_eq!(p.scheme, "redlock");
        assert_eq!(p.userinfo, Some("u:p@ss"));
        assert_eq!(p.hosts, ["a:1", "b:2"]);
        assert_eq!(p.path, "3/x");
        assert_eq!(p.hosts_with_userinfo(), ["u:p@ss@a:1", "u:p@ss@b:2"]);
        assert_eq!(
            p.query_pairs().collect::<Vec<_>>(),
            [("k", "v"), ("flag", "")]
        );
        let p = Parts::parse("zk://h:2181").unwrap();
        assert_eq!((p.userinfo, p.path, p.query), (None, "", ""));
        for bad in ["zk://", "zk:///chroot", "redis://:pw@/0", "h:1"] {
            let e = Parts::parse(bad).unwrap_err();
            assert!(!e.contains("pw"), "{e}");
        }
    }

    #[test]
    fn passwords_are_removed_from_urls() {
        assert_eq!(
            redact("postgres://app:secret@db:5432/locks"),
            "postgres://app@db:5432/locks"
        );
        assert_eq!(
            redact("postgresql://db/locks?user=app&password=secret&sslmode=disable"),
            "postgresql://db/locks?user=app&sslmode=disable"
        );
        assert_eq!(
            redact("postgres://postgres@127.0.0.1:5432/postgres"),
            "postgres://postgres@127.0.0.1:5432/postgres"
        );
        assert_eq!(
            redact("redis://:hunter2@127.0.0.1:6379/0"),
            "redis://127.0.0.1:6379/0"
        );
        assert_eq!(
            redact("redlock://u:hunter2@a:1,b:2/3"),
            "redlock://u@a:1,b:2/3"
        );
        assert_eq!(
            redact("zk://a:2181,b:2181/chroot"),
            "zk://a:2181,b:2181/chroot"
        );
    }

    #[test]
    fn credentials_are_removed_in_every_spelling() {
        for (url, shown) in [
            ("postgres://db/x?pass%77ord=pw", "postgres://db/x"),
            (
                "postgres://db/x?PASSWORD=pw&sslmode=require",
                "postgres://db/x?sslmode=require",
            ),
            (
                "postgres://db/x?%70%61%73%73%77%6f%72%64=pw",
                "postgres://db/x",
            ),
            ("postgres://db/x?pass%2577ord=pw", "postgres://db/x"),
            ("postgres://db/x?pass+word=pw", "postgres://db/x"),
            (
                "postgres://db/x?sslpassword=pw&user=app",
                "postgres://db/x?user=app",
            ),
            (
                "redis://h:1/0?auth_token=pw&protocol=resp3",
                "redis://h:1/0?protocol=resp3",
            ),
            ("redis://h:1/0?api%5Fkey=pw&secret=pw", "redis://h:1/0"),
            ("redis://:pa/ss@h:1/0", "redis://h:1/0"),
            (
                "postgres://app:pa?ss@db:5432/locks",
                "postgres://(not shown: it has an @ after a ?)",
            ),
            (
                "redis://:p?a=b&c@h:1/0?protocol=resp3",
                "redis://(not shown: it has an @ after a ?)",
            ),
            (
                "redis://:p?w@h:1/0?password=pw",
                "redis://(not shown: it has an @ after a ?)",
            ),
            ("admin:p?w@h:1", "(not shown: it has an @ after a ?)"),
            (
                "postgres:/u:pw@db/app?sslrootcert=file:///ca.pem",
                "postgres@db/app?sslrootcert=file:///ca.pem",
            ),
            (
                "postgres://db:5432/locks?user=app@tenant&password=pw&sslmode=require",
                "postgres://(not shown: it has an @ after a ?)",
            ),
            (
                "postgres://db/x?password=p@ss&sslmode=require",
                "postgres://(not shown: it has an @ after a ?)",
            ),
            (
                "postgres://db/x?user=a@b&password=se?cret",
                "postgres://(not shown: it has an @ after a ?)",
            ),
            (
                "redis://h:1/0?password=hunter@2",
                "redis://(not shown: it has an @ after a ?)",
            ),
            ("redis://u:p@ss@h:1/0", "redis://u@h:1/0"),
            ("redlock://:pw@a:1,b:2", "redlock://a:1,b:2"),
            ("admin:pw@h:1", "admin@h:1"),
            (
                "zk://a:2181/x?session_timeout=5s&pwd=pw",
                "zk://a:2181/x?session_timeout=5s",
            ),
        ] {
            assert_eq!(redact(url), shown, "{url}");
        }
    }
}
