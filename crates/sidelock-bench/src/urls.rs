//! The backend URLs the bench is given: their hosts (for the backend
//! counters) and their printable form (without passwords).

/// `scheme://user:pass@a:1,b:2/rest` → (`scheme`, [`user:pass@a:1`, `user:pass@b:2`], `rest`).
///
/// # Errors
/// When the URL has no `://` or no host.
pub fn split_hosts(url: &str) -> Result<(String, Vec<String>, String), String> {
    let printable = redact(url);
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| format!("backend URL {printable:?}: missing ://"))?;
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((u, r)) => (format!("{u}@"), r),
        None => (String::new(), rest),
    };
    let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
    let hosts: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(|h| format!("{userinfo}{h}"))
        .collect();
    if hosts.is_empty() {
        return Err(format!("backend URL {printable:?}: no host given"));
    }
    Ok((scheme.to_owned(), hosts, path.to_owned()))
}

/// `url` with the password of its user info and every query parameter
/// after the first `?` removed, for the printed tables and the JSON.
#[must_use]
pub fn redact(url: &str) -> String {
    // An `@` after a `?`: a `?` in the password, or an `@` in the query;
    // either way what follows the `?` may be a secret.
    if let (Some(q), Some(a)) = (url.find('?'), url.rfind('@'))
        && q < a
    {
        let scheme = url.split_once("://").map_or("", |(s, _)| s);
        return format!("{scheme}://(not shown: it has an @ after a ?)");
    }
    let base = url.split_once('?').map_or(url, |(b, _)| b);
    match base.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((userinfo, hosts)) => {
                let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
                format!("{scheme}://{user}@{hosts}")
            }
            None => base.to_owned(),
        },
        None => base.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_keep_the_user_and_printing_drops_the_password() {
        let (scheme, hosts, path) = split_hosts("redlock://u:pw@a:1,b:2/0").unwrap();
        assert_eq!(scheme, "redlock");
        assert_eq!(hosts, ["u:pw@a:1", "u:pw@b:2"]);
        assert_eq!(path, "0");
        assert_eq!(
            redact("postgres://u:pw@h:5432/db?password=x"),
            "postgres://u@h:5432/db"
        );
        assert_eq!(redact("memory://"), "memory://");
        assert_eq!(
            redact("redis://:p?w@h:1"),
            "redis://(not shown: it has an @ after a ?)"
        );
        assert!(split_hosts("redis:///0").is_err());
    }
}
