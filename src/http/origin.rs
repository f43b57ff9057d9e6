//! Who may call: the `Host` rule against DNS rebinding (421) and the
//! cross-site rule against browsers (403), on every route.
//!
//! A page on another site can make a browser send requests to a sidecar on
//! loopback; with DNS rebinding it can even read the answers. So:
//! * a request must name a loopback host (`localhost`, 127.0.0.0/8, `[::1]`,
//!   any port) or one of `--allowed-hosts` in `Host`, else 421 — except the
//!   read-only probe routes, which kubelets and scrapers reach by pod IP;
//! * a state-changing request (every method but GET, HEAD and OPTIONS, and
//!   the GETs that acquire: `…/hold`, `…/campaign`) that a browser marks
//!   cross-site — an `Origin` of another origin than `Host` and not an
//!   allowed host, or `Sec-Fetch-Site: cross-site` / `same-site` — gets 403.
//!
//! Bodies without `Content-Type` (the third rule of DESIGN.md) are refused
//! where bodies are read, in [`super::params`].

use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::Request;
use axum::http::{HeaderMap, Method, Uri, header};
use axum::response::{IntoResponse, Response};
use tower::{Layer, Service};

use crate::error::Error;

/// Longest `Host` quoted back in a 421.
const QUOTED_HOST: usize = 100;

/// The layer applying both rules, with the allowed host names.
///
/// A layer of its own rather than `middleware::from_fn`, which boxes a
/// future and a clone of the inner service for every request: a waiting
/// acquire keeps both for as long as it waits.
#[derive(Clone)]
pub struct CheckOrigin {
    /// `--allowed-hosts`, lowercase: `name` (any port) or `name:port`.
    pub allowed_hosts: Arc<[String]>,
}

impl<S> Layer<S> for CheckOrigin {
    type Service = OriginChecked<S>;

    fn layer(&self, inner: S) -> OriginChecked<S> {
        OriginChecked {
            inner,
            allowed_hosts: self.allowed_hosts.clone(),
        }
    }
}

/// A service behind [`CheckOrigin`].
#[derive(Clone)]
pub struct OriginChecked<S> {
    inner: S,
    allowed_hosts: Arc<[String]>,
}

impl<S> Service<Request> for OriginChecked<S>
where
    S: Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = super::auth::Checked<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let over_socket = request
            .extensions()
            .get::<super::listener::OverUnixSocket>()
            .is_some();
        match refusal(
            &self.allowed_hosts,
            over_socket,
            request.method(),
            request.uri(),
            request.headers(),
        ) {
            Some(e) => {
                // A head the sidecar and a proxy in front may read two ways
                // ends its connection, as a malformed head does.
                let close = matches!(e, Error::MalformedHead(_));
                let mut response = e.into_response();
                if close {
                    response.headers_mut().insert(
                        header::CONNECTION,
                        axum::http::HeaderValue::from_static("close"),
                    );
                }
                super::auth::Checked::Refused {
                    response: Some(response),
                }
            }
            None => super::auth::Checked::Allowed {
                inner: self.inner.call(request),
            },
        }
    }
}

/// Why a request is refused by the Host or the cross-site rule, if it is.
fn refusal(
    allowed: &[String],
    over_socket: bool,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Option<Error> {
    let path = uri.path();
    // The first of two would be served, where a proxy in front may have
    // routed by the other.
    if headers.get_all(header::HOST).iter().nth(1).is_some() {
        return Some(Error::MalformedHead(crate::error::HeadFault::Hosts));
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| uri.authority().map(|a| a.as_str()));
    if !is_probe(path) && !over_socket {
        match host {
            Some(h) if host_allowed(allowed, h) => {}
            Some(h) => {
                let quoted: String = h.chars().take(QUOTED_HOST).collect();
                return Some(Error::MisdirectedRequest(format!(
                    "Host {quoted:?} is not this sidecar's: call it as localhost, 127.0.0.1 or [::1] (any port), or start it with --allowed-hosts naming this host"
                )));
            }
            None => {
                return Some(Error::MisdirectedRequest(
                    "the request has no Host header; send Host: localhost".into(),
                ));
            }
        }
    }
    if changes_state(method, path) && cross_site(allowed, host, headers) {
        return Some(Error::CrossSite(
            "a browser marked this request cross-site (Origin of another site, or Sec-Fetch-Site: cross-site/same-site); state-changing requests must come from the sidecar's own origin or a non-browser client",
        ));
    }
    None
}

/// The read-only routes kubelets and scrapers reach by pod IP.
fn is_probe(path: &str) -> bool {
    matches!(path, "/healthz" | "/readyz" | "/metrics")
        || path
            .strip_prefix("/v1/elections/")
            .and_then(|rest| rest.strip_suffix("/ready"))
            .is_some_and(|name| !name.is_empty() && !name.contains('/'))
}

/// Whether a request may change state: every method but the safe ones, and
/// the GETs that acquire (hold streams, campaigns).
fn changes_state(method: &Method, path: &str) -> bool {
    if !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return true;
    }
    path.starts_with("/v1/") && (path.ends_with("/hold") || path.ends_with("/campaign"))
}

/// Whether a browser marked the request cross-site.
fn cross_site(allowed: &[String], host: Option<&str>, headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site") {
        let site = site.as_bytes();
        if site.eq_ignore_ascii_case(b"cross-site") || site.eq_ignore_ascii_case(b"same-site") {
            return true;
        }
    }
    let Some(origin) = headers.get(header::ORIGIN) else {
        return false;
    };
    let Some(authority) = origin.to_str().ok().and_then(origin_authority) else {
        // `null` (sandboxed frames, redirects, files) or unreadable: not ours.
        return true;
    };
    let same_origin = host.is_some_and(|h| same_authority(&authority, h));
    !(same_origin || in_list(allowed, &authority))
}

/// `host:port` of an `Origin` (`scheme://host[:port]`), lowercase, with
/// the scheme's default port made explicit.
fn origin_authority(origin: &str) -> Option<String> {
    let (scheme, rest) = origin.split_once("://")?;
    if rest.is_empty() || rest.contains(['/', '?', '#', '@']) {
        return None;
    }
    let rest = rest.to_ascii_lowercase();
    let default = match scheme.to_ascii_lowercase().as_str() {
        "http" => "80",
        "https" => "443",
        _ => return None,
    };
    Some(match split_host(&rest).1 {
        Some(_) => rest,
        None => format!("{rest}:{default}"),
    })
}

/// Whether two `host[:port]` values name the same host and port (80 when absent).
fn same_authority(a: &str, b: &str) -> bool {
    let ((ha, pa), (hb, pb)) = (split_host(a), split_host(b));
    ha == hb && pa.unwrap_or("80") == pb.unwrap_or("80")
}

/// `(host, port)` of a `Host` value: lowercase, brackets of an IPv6 address
/// and a trailing dot removed.
fn split_host(value: &str) -> (String, Option<&str>) {
    let value = value.trim();
    let (host, port) = if let Some(rest) = value.strip_prefix('[') {
        match rest.split_once(']') {
            Some((v6, tail)) => (v6, tail.strip_prefix(':')),
            None => (value, None),
        }
    } else {
        match value.rsplit_once(':') {
            Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => (h, Some(p)),
            _ => (value, None),
        }
    };
    let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    (host, port)
}

/// Whether `Host` names loopback or an allowed host.
fn host_allowed(allowed: &[String], value: &str) -> bool {
    let (host, _) = split_host(value);
    let loopback = host == "localhost"
        || host
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() && !is_mapped_v6(&ip));
    loopback || in_list(allowed, &value.to_ascii_lowercase())
}

/// IPv4-mapped IPv6 addresses are not `[::1]`; `is_loopback` is false for
/// them already, this keeps that explicit.
fn is_mapped_v6(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() && *v6 != Ipv6Addr::LOCALHOST)
}

/// Whether `host[:port]` matches an entry of `--allowed-hosts`: a bare name
/// matches any port, `name:port` that port only.
fn in_list(allowed: &[String], value: &str) -> bool {
    let (host, port) = split_host(value);
    allowed.iter().any(|entry| {
        let (e_host, e_port) = split_host(entry);
        e_host == host && (e_port.is_none() || e_port == port)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_in_every_spelling_is_allowed_and_nothing_else() {
        for ok in [
            "localhost",
            "LOCALHOST:1",
            "localhost.",
            "127.0.0.1:7070",
            "127.9.9.9",
            "[::1]:7070",
            "[::1]",
        ] {
            assert!(host_allowed(&[], ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "[::2]",
            "10.0.0.1:7070",
            "[::ffff:127.0.0.1]",
            "",
            "::1",
        ] {
            assert!(!host_allowed(&[], bad), "{bad}");
        }
    }

    #[test]
    fn allowed_hosts_match_by_name_and_port() {
        let list = ["pod.internal".to_owned(), "app:8080".to_owned()];
        assert!(host_allowed(&list, "POD.internal:1"));
        assert!(host_allowed(&list, "app:8080"));
        assert!(!host_allowed(&list, "app:8081"));
        assert!(!host_allowed(&list, "app"));
    }

    #[test]
    fn origins_are_compared_with_the_host() {
        let mut h = HeaderMap::new();
        h.insert(header::ORIGIN, "http://localhost:7070".parse().unwrap());
        assert!(!cross_site(&[], Some("localhost:7070"), &h));
        assert!(cross_site(&[], Some("localhost:7071"), &h));
        h.insert(header::ORIGIN, "http://localhost".parse().unwrap());
        assert!(!cross_site(&[], Some("localhost:80"), &h));
        h.insert(header::ORIGIN, "null".parse().unwrap());
        assert!(cross_site(&[], Some("localhost"), &h));
    }
}
