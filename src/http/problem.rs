//! The one mapping of [`Error`] to RFC 9457 `application/problem+json`:
//! status code, problem type, `detail` and extension members.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::{Map, Value, json};
use utoipa::ToSchema;

use crate::error::{Error, HeadFault};

/// Seconds a client should wait before retrying after a 429 or 503.
pub const RETRY_AFTER_SECS: u64 = 1;

/// The body of every error response (RFC 9457), plus extension members.
#[derive(Debug, Serialize, ToSchema)]
pub struct Problem {
    /// `urn:sidelock:problem:<slug>`.
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    /// Extension members: `holders`, `holders_total`, `queue_length`, `parameter`, `min_ms`, `max_ms`, `limit`, `cap`.
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub extensions: Map<String, Value>,
}

impl Error {
    /// Status code and problem slug.
    pub fn status_slug(&self) -> (StatusCode, &'static str) {
        use StatusCode as S;
        match self {
            Error::InvalidName(_) => (S::BAD_REQUEST, "invalid-name"),
            Error::InvalidParameter(_) => (S::BAD_REQUEST, "invalid-parameter"),
            Error::OutOfRange { .. } => (S::BAD_REQUEST, "out-of-range"),
            Error::LimitMismatch { .. } => (S::BAD_REQUEST, "limit-mismatch"),
            Error::BodyTooLarge { .. } => (S::PAYLOAD_TOO_LARGE, "body-too-large"),
            Error::UnsupportedMediaType(_) => (S::UNSUPPORTED_MEDIA_TYPE, "unsupported-media-type"),
            Error::Unsupported(_) => (S::BAD_REQUEST, "unsupported"),
            Error::NotFound(_) => (S::NOT_FOUND, "not-found"),
            Error::MethodNotAllowed { .. } => (S::METHOD_NOT_ALLOWED, "method-not-allowed"),
            Error::Busy { .. } => (S::CONFLICT, "lock-busy"),
            Error::TooManyHolds { .. } => (S::CONFLICT, "too-many-holds"),
            Error::KeyConflict(_) => (S::CONFLICT, "key-conflict"),
            Error::LeaseLost => (S::GONE, "lease-lost"),
            Error::Unauthorized(_) => (S::UNAUTHORIZED, "unauthorized"),
            Error::Forbidden(_) => (S::FORBIDDEN, "forbidden"),
            Error::CrossSite(_) => (S::FORBIDDEN, "cross-site"),
            Error::MisdirectedRequest(_) => (S::MISDIRECTED_REQUEST, "misdirected-request"),
            Error::TooManyWaiters { .. } => (S::TOO_MANY_REQUESTS, "too-many-waiters"),
            Error::TooManyConnections { .. } | Error::TooManyRequests { .. } => {
                (S::TOO_MANY_REQUESTS, "too-many-connections")
            }
            Error::TooManyEventStreams { .. } => (S::TOO_MANY_REQUESTS, "too-many-event-streams"),
            Error::BodyTimedOut { .. } => (S::REQUEST_TIMEOUT, "body-timeout"),
            Error::MalformedHead(fault) => match fault {
                HeadFault::Malformed | HeadFault::Hosts => (S::BAD_REQUEST, "malformed-request"),
                HeadFault::UriTooLong => (S::URI_TOO_LONG, "uri-too-long"),
                HeadFault::TooLarge { .. } => {
                    (S::REQUEST_HEADER_FIELDS_TOO_LARGE, "head-too-large")
                }
            },
            Error::TooManyFailedTokens { .. } => (S::TOO_MANY_REQUESTS, "too-many-failed-tokens"),
            Error::SidecarFull { .. } => (S::TOO_MANY_REQUESTS, "sidecar-full"),
            Error::Unavailable { .. } => (S::SERVICE_UNAVAILABLE, "backend-unavailable"),
            Error::ShuttingDown => (S::SERVICE_UNAVAILABLE, "shutting-down"),
            Error::NotLeader(_) => (S::SERVICE_UNAVAILABLE, "not-leader"),
        }
    }

    /// The problem document for this error.
    pub fn problem(&self) -> Problem {
        let (status, slug) = self.status_slug();
        let mut extensions = Map::new();
        match self {
            Error::OutOfRange {
                parameter,
                min_ms,
                max_ms,
                ..
            } => {
                extensions.insert("parameter".into(), json!(parameter));
                if let Some(min) = min_ms {
                    extensions.insert("min_ms".into(), json!(min));
                }
                if let Some(max) = max_ms {
                    extensions.insert("max_ms".into(), json!(max));
                }
            }
            Error::LimitMismatch { active } => {
                extensions.insert("limit".into(), json!(active));
            }
            Error::TooManyHolds { max } => {
                extensions.insert("limit".into(), json!(max));
            }
            Error::SidecarFull { cap, limit, .. } => {
                extensions.insert("cap".into(), json!(cap));
                extensions.insert("limit".into(), json!(limit));
            }
            Error::Busy { busy, waited_ms } => {
                extensions.insert("holders".into(), json!(busy.holders));
                if busy.omitted > 0 {
                    let total = busy.holders.len() + busy.omitted;
                    extensions.insert("holders_total".into(), json!(total));
                }
                extensions.insert("queue_length".into(), json!(busy.queue_length));
                extensions.insert("waited_ms".into(), json!(waited_ms));
            }
            Error::Unavailable { backend, cause, .. } => {
                if let Some(b) = backend {
                    extensions.insert("backend".into(), json!(b.kind));
                    extensions.insert("address".into(), json!(b.url));
                }
                extensions.insert("cause".into(), json!(cause.as_str()));
            }
            _ => {}
        }
        let detail = match self {
            Error::Busy {
                busy, waited_ms: 0, ..
            } => busy_detail(busy),
            Error::Busy { waited_ms, .. } => {
                format!("the lock was not granted within the wait of {waited_ms} ms")
            }
            Error::Unavailable {
                backend: Some(b),
                cause: cause @ crate::backend::Cause::PermissionDenied,
                ..
            } => format!(
                "the {} backend at {} refused this sidecar's user a command or channel ({cause}); the README's Redis section lists the rights sidelock needs",
                b.kind, b.url
            ),
            Error::Unavailable {
                backend: Some(b),
                cause,
                ..
            } => format!(
                "the {} backend at {} cannot be reached ({cause}); retry after Retry-After seconds (the sidecar log has the outage)",
                b.kind, b.url
            ),
            other => other.to_string(),
        };
        Problem {
            kind: format!("urn:sidelock:problem:{slug}"),
            title: status.canonical_reason().unwrap_or("Error").to_owned(),
            status: status.as_u16(),
            detail,
            extensions,
        }
    }
}

/// The detail of a try-once refusal: held, or — nobody holding it — why
/// it was not free, and when it may be.
fn busy_detail(busy: &crate::backend::Busy) -> String {
    const QUEUE: &str = "wait=0 (try once); give wait=<duration> to queue for it";
    // A try-once claim is refused while anyone waits, holders or not.
    let queued = match busy.queue_length {
        0 => String::new(),
        n => format!("{n} queued claim(s) go first (FIFO), and "),
    };
    if !busy.holders.is_empty() || busy.omitted > 0 {
        if queued.is_empty() {
            return format!("the lock is held and {QUEUE}");
        }
        return format!("the lock is held, or {queued}{QUEUE}");
    }
    if !queued.is_empty() {
        return format!("nobody holds the lock, but {queued}{QUEUE}");
    }
    let when = busy
        .retry_at_ms
        .map(|at| at.saturating_sub(crate::clock::now_ms()))
        .filter(|&left| left > 0)
        .map(|left| format!(" (it may be granted in about {left} ms)"))
        .unwrap_or_default();
    format!(
        "nobody holds the lock, but it is not free: a lock-delay runs after a lease that ended \
         without a release (expired or force-released), or another claim's grant is under way\
         {when}; {QUEUE}"
    )
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let (status, _) = self.status_slug();
        let body = serde_json::to_vec(&self.problem()).unwrap_or_default();
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        match status {
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
            }
            StatusCode::UNAUTHORIZED => {
                headers.insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"sidelock\""),
                );
            }
            _ => {}
        }
        response
    }
}
