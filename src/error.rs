//! One error type for the whole request path: what went wrong, in words a
//! client can act on. The HTTP layer maps it to RFC 9457
//! `application/problem+json` in one place (`http::problem`); nothing here
//! knows HTTP.
//!
//! Client errors say what was wrong and what is allowed. Outages carry the
//! backend and the cause, never the driver's internals.

use crate::backend::{self, Busy};

/// What was wrong with a request head the HTTP layer refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadFault {
    /// Not an HTTP/1.x request line and headers.
    Malformed,
    /// A request target longer than the HTTP layer takes.
    UriTooLong,
    /// Request line and headers over the head limit.
    TooLarge { limit: usize },
    /// More than one `Host` header (RFC 9112 §3.2).
    Hosts,
}

impl HeadFault {
    fn detail(self) -> String {
        match self {
            HeadFault::Malformed => "the request is not valid HTTP/1.1: send a request line \
                 `METHOD /path HTTP/1.1`, then `Name: value` header lines of visible ASCII \
                 (no control characters), each ended by CRLF, and an empty line; at most one \
                 Content-Length, a number, and no Transfer-Encoding other than chunked"
                .to_owned(),
            HeadFault::Hosts => "the request has more than one Host header: send exactly \
                 one (RFC 9112 §3.2), Host: localhost"
                .to_owned(),
            HeadFault::UriTooLong => "the request target is over 64 KiB: lock names are at \
                 most 200 characters, and parameters fit in a short query or a JSON body"
                .to_owned(),
            HeadFault::TooLarge { limit } => format!(
                "the request head is too large: send at most 100 headers, and at most {} KiB \
                 of request line and headers",
                limit / 1024
            ),
        }
    }
}

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidName(String),
    #[error("{0}")]
    InvalidParameter(String),
    #[error("{detail}")]
    OutOfRange {
        parameter: &'static str,
        detail: String,
        /// The least the parameter may be, where that is what was broken.
        min_ms: Option<u64>,
        max_ms: Option<u64>,
    },
    #[error("this semaphore is in use with limit {active}; give limit={active} or leave it out")]
    LimitMismatch { active: u32 },
    #[error("request body is larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// The backend cannot keep the guarantee asked for; says why and what to use instead.
    #[error("{0}")]
    Unsupported(String),
    #[error("no such route: {0}")]
    NotFound(String),
    #[error("method {method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    /// The backend holds data at this lock's keys that sidelock did not write.
    #[error("{0}")]
    KeyConflict(String),
    #[error("lock is held")]
    Busy { busy: Box<Busy>, waited_ms: u64 },
    /// A re-entry past the most holds one lease may have.
    #[error(
        "this lease already has {max} holds, the most one lease may have: release one before re-entering it"
    )]
    TooManyHolds { max: u32 },
    #[error(
        "the token does not hold this lock: the lease expired, was released, or was force-released"
    )]
    LeaseLost,
    #[error("{0}")]
    Unauthorized(&'static str),
    #[error("{0}")]
    Forbidden(&'static str),
    #[error("{0}")]
    CrossSite(&'static str),
    #[error("{0}")]
    MisdirectedRequest(String),
    #[error("{limit} requests already wait for this lock here")]
    TooManyWaiters { limit: usize },
    #[error(
        "this sidecar has {limit} connections open, each with a request in flight; retry later, or raise --max-connections"
    )]
    TooManyConnections { limit: usize },
    #[error(
        "this sidecar has {limit} requests in flight, counting those still finishing after their clients left; retry later, or raise --max-connections"
    )]
    TooManyRequests { limit: usize },
    #[error("this sidecar already serves {limit} event streams; close one, or retry later")]
    TooManyEventStreams { limit: usize },
    #[error(
        "the request body did not arrive within the body-read timeout of {timeout_ms} ms; send the whole body at once"
    )]
    BodyTimedOut { timeout_ms: u64 },
    /// The HTTP layer could not take the request head; no route saw it.
    #[error("{}", .0.detail())]
    MalformedHead(HeadFault),
    /// The peer's failed token checks used up its burst; its token was not compared.
    #[error(
        "more than {burst} wrong tokens came from this address recently: its tokens are checked again at one per second (see Retry-After)"
    )]
    TooManyFailedTokens { burst: u32 },
    /// A per-sidecar cap is reached; `cap` is its setting's name.
    #[error("this sidecar already has {limit} {what} (--{flag}); retry later, or raise --{flag}")]
    SidecarFull {
        cap: &'static str,
        flag: &'static str,
        what: &'static str,
        limit: usize,
    },
    /// The backend could not be reached; `backend` is filled in by the
    /// core, which knows which one it is.
    #[error("the lock backend cannot be reached ({cause})")]
    Unavailable {
        backend: Option<backend::Description>,
        cause: backend::Cause,
        op: &'static str,
    },
    #[error("the sidecar is shutting down")]
    ShuttingDown,
    /// `…/ready` of an election no campaign through this sidecar leads.
    #[error("no campaign through this sidecar leads election {0:?}")]
    NotLeader(String),
}

impl From<backend::Error> for Error {
    fn from(e: backend::Error) -> Self {
        match e {
            backend::Error::LimitMismatch { active } => Error::LimitMismatch { active },
            backend::Error::LimitRequired => Error::InvalidParameter(
                "limit is required: this semaphore is not in use, so its number of permits must be given (limit=N, 1 or more)".into(),
            ),
            backend::Error::Unsupported(why) => Error::Unsupported(why),
            e @ backend::Error::KeyConflict { .. } => Error::KeyConflict(e.to_string()),
            ref e @ backend::Error::Unavailable { op, .. } => Error::Unavailable {
                backend: None,
                cause: e.cause().unwrap_or(backend::Cause::Failed),
                op,
            },
        }
    }
}
