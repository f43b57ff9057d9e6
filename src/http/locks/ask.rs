//! What a lock request asks for: the parameters of every route (as the
//! OpenAPI document lists them), and the checks that turn an acquire's
//! parameters into a [`Claim`] within the sidecar's limits.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::clock::ms;
use crate::core::Limits;
use crate::duration::MAX_DURATION;
use crate::error::Error;
use crate::http::params::{Given, count, duration, mode};
use crate::lock::{
    ANONYMOUS, ANONYMOUS_DIGITS, Claim, LockKey, MIN_RENEWED_TTL, Mode, Token, check_plain_text,
};

/// Longest accepted owner identity, in characters.
pub(super) const MAX_OWNER_LEN: usize = 200;

/// Longest accepted force-release reason, in bytes of UTF-8.
pub(super) const MAX_REASON_BYTES: usize = 1024;

// Only a schema (the parameters parse with `duration`): numbers of any size
// are part of it so that API fuzzers try huge ones.
/// A duration: text such as `30s`, or a whole number of milliseconds.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub(crate) enum DurationValue {
    /// `250ms`, `30s`, `5m`, `1h`, `1m30s`.
    Text(String),
    /// Milliseconds.
    Millis(u64),
}

/// Parameters of acquiring or holding a lock (query string, JSON or form body).
#[derive(Debug, Deserialize, IntoParams, ToSchema)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct LockParams {
    /// Lease duration, e.g. `30s` (default `--default-ttl`, at most
    /// `--max-ttl`; a hold stream's at least 100 ms, and its default too).
    #[serde(default, deserialize_with = "duration")]
    #[param(value_type = Option<DurationValue>, inline, example = "30s")]
    #[schema(value_type = Option<DurationValue>, inline, example = "30s")]
    pub ttl: Option<Given<Duration>>,
    /// How long to wait in the queue if the lock is busy (default 0: try once; at most `--max-wait`).
    #[serde(default, deserialize_with = "duration")]
    #[param(value_type = Option<DurationValue>, inline, example = "10s")]
    #[schema(value_type = Option<DurationValue>, inline, example = "10s")]
    pub wait: Option<Given<Duration>>,
    /// Caller identity; the same owner acquiring again in the same mode re-enters.
    /// Plain text: no control, format (bidi, zero-width) or separator characters.
    #[param(min_length = 1, max_length = 200)]
    #[schema(min_length = 1, max_length = 200)]
    pub owner: Option<String>,
    /// `exclusive` (default) or `shared`.
    #[serde(default, deserialize_with = "mode")]
    pub mode: Option<Mode>,
    /// Cap on the total time keepalives and the watchdog may keep the lease alive.
    #[serde(default, deserialize_with = "duration")]
    #[param(value_type = Option<DurationValue>, inline, example = "10m")]
    #[schema(value_type = Option<DurationValue>, inline, example = "10m")]
    pub max_hold: Option<Given<Duration>>,
    /// After a lease ends by expiry or loss, nobody is granted for this long (default `--lock-delay`).
    #[serde(default, deserialize_with = "duration")]
    #[param(value_type = Option<DurationValue>, inline, example = "0s")]
    #[schema(value_type = Option<DurationValue>, inline, example = "0s")]
    pub lock_delay: Option<Given<Duration>>,
}

/// Parameters of acquiring or holding a semaphore permit.
#[derive(Debug, Deserialize, IntoParams, ToSchema)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SemaphoreParams {
    /// Number of permits: required while the semaphore is idle, must match while it is in use.
    #[serde(default, deserialize_with = "count")]
    #[param(value_type = Option<u32>, minimum = 1)]
    #[schema(value_type = Option<u32>, minimum = 1)]
    pub limit: Option<Given<u64>>,
    #[serde(default, deserialize_with = "duration")]
    #[param(value_type = Option<DurationValue>, inline, example = "30s")]
    #[schema(value_type = Option<DurationValue>, inline, example = "30s")]
    pub ttl: Option<Given<Duration>>,
    #[serde(default, deserialize_with = "duration")]
    #[param(value_type = Option<DurationValue>, inline, example = "10s")]
    #[schema(value_type = Option<DurationValue>, inline, example = "10s")]
    pub wait: Option<Given<Duration>>,
    #[param(min_length = 1, max_length = 200)]
    #[schema(min_length = 1, max_length = 200)]
    pub owner: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    #[param(value_type = Option<DurationValue>, inline, example = "10m")]
    #[schema(value_type = Option<DurationValue>, inline, example = "10m")]
    pub max_hold: Option<Given<Duration>>,
    #[serde(default, deserialize_with = "duration")]
    #[param(value_type = Option<DurationValue>, inline, example = "0s")]
    #[schema(value_type = Option<DurationValue>, inline, example = "0s")]
    pub lock_delay: Option<Given<Duration>>,
}

/// Parameters naming a lease by its token.
#[derive(Debug, Deserialize, IntoParams, ToSchema)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct TokenParams {
    /// The token from the acquire response.
    #[param(required = true, pattern = "^[!-~]{1,200}$")]
    #[schema(required = true, pattern = "^[!-~]{1,200}$")]
    pub token: Option<String>,
}

/// Parameters of a keepalive.
#[derive(Debug, Deserialize, IntoParams, ToSchema)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct KeepaliveParams {
    /// The token from the acquire response.
    #[param(required = true, pattern = "^[!-~]{1,200}$")]
    #[schema(required = true, pattern = "^[!-~]{1,200}$")]
    pub token: Option<String>,
    /// New lease duration from now (default: the lease's own ttl).
    #[serde(default, deserialize_with = "duration")]
    #[param(value_type = Option<DurationValue>, inline, example = "30s")]
    #[schema(value_type = Option<DurationValue>, inline, example = "30s")]
    pub ttl: Option<Given<Duration>>,
}

/// Parameters of the listing.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// Only names starting with this.
    pub prefix: Option<String>,
    /// Page size, 1 to 1000 (default 100).
    #[serde(default, deserialize_with = "count")]
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    pub limit: Option<Given<u64>>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// Parameters of a force-release.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct AdminParams {
    /// Why, for the log: plain text of at most 1 KiB.
    #[param(min_length = 1, max_length = 1024)]
    pub reason: Option<String>,
}

/// The parameters every acquire shares, whichever kind.
pub(crate) struct Ask {
    ttl: Option<Given<Duration>>,
    wait: Option<Given<Duration>>,
    owner: Option<String>,
    mode: Option<Mode>,
    max_hold: Option<Given<Duration>>,
    lock_delay: Option<Given<Duration>>,
    limit: Option<Given<u64>>,
}

impl Ask {
    /// Whether the client gave a `ttl` (rather than taking `--default-ttl`).
    pub(crate) fn gives_ttl(&self) -> bool {
        self.ttl.is_some()
    }

    /// An election campaign's acquire: exclusive, waiting as long as a wait may.
    pub(crate) fn campaign(
        ttl: Option<Given<Duration>>,
        lock_delay: Option<Given<Duration>>,
        owner: Option<String>,
    ) -> Self {
        Ask {
            ttl,
            wait: None,
            owner,
            mode: Some(Mode::Exclusive),
            max_hold: None,
            lock_delay,
            limit: None,
        }
    }
}

impl From<LockParams> for Ask {
    fn from(p: LockParams) -> Self {
        Ask {
            ttl: p.ttl,
            wait: p.wait,
            owner: p.owner,
            mode: p.mode,
            max_hold: p.max_hold,
            lock_delay: p.lock_delay,
            limit: None,
        }
    }
}

impl From<SemaphoreParams> for Ask {
    fn from(p: SemaphoreParams) -> Self {
        Ask {
            ttl: p.ttl,
            wait: p.wait,
            owner: p.owner,
            mode: None,
            max_hold: p.max_hold,
            lock_delay: p.lock_delay,
            limit: p.limit,
        }
    }
}

pub(super) fn out_of_range(
    parameter: &'static str,
    value: &Given<Duration>,
    max: Duration,
    flag: &str,
) -> Error {
    Error::OutOfRange {
        parameter,
        detail: format!(
            "{parameter} {:?} is above the maximum of {} ms ({}, {flag})",
            value.sent,
            ms(max),
            crate::duration::format_duration(max)
        ),
        min_ms: None,
        max_ms: Some(ms(max)),
    }
}

/// The most permits a semaphore may have.
pub(super) const MAX_PERMITS: u64 = u32::MAX as u64;

impl Ask {
    /// Checks the parameters against `limits` and builds the claim of
    /// `sidecar` and its wait.
    pub(crate) fn into_claim(
        self,
        key: LockKey,
        limits: &Limits,
        sidecar: &str,
    ) -> Result<(Claim, Duration), Error> {
        let ttl = check_ttl(self.ttl.as_ref(), limits)?.unwrap_or(limits.default_ttl);
        let wait = match &self.wait {
            Some(w) if w.value > limits.max_wait => {
                return Err(out_of_range("wait", w, limits.max_wait, "--max-wait"));
            }
            Some(w) => w.value,
            None => Duration::ZERO,
        };
        let lock_delay = match &self.lock_delay {
            Some(d) if d.value > limits.max_ttl => {
                return Err(out_of_range("lock_delay", d, limits.max_ttl, "--max-ttl"));
            }
            Some(d) => d.value,
            None => limits.lock_delay,
        };
        let max_hold = match &self.max_hold {
            Some(m) if m.value > MAX_DURATION => {
                return Err(out_of_range(
                    "max_hold",
                    m,
                    MAX_DURATION,
                    "the longest max_hold",
                ));
            }
            Some(m) if m.value.is_zero() => {
                return Err(Error::OutOfRange {
                    parameter: "max_hold",
                    detail: "max_hold must be above 0 (leave it out for no cap)".into(),
                    min_ms: None,
                    max_ms: None,
                });
            }
            m => m.as_ref().map(|m| m.value),
        };
        let limit = match &self.limit {
            Some(l) if l.value == 0 => {
                return Err(Error::OutOfRange {
                    parameter: "limit",
                    detail: "limit must be at least 1".into(),
                    min_ms: None,
                    max_ms: None,
                });
            }
            Some(l) => Some(u32::try_from(l.value).map_err(|_| Error::OutOfRange {
                parameter: "limit",
                detail: format!(
                    "limit {:?} is too large: a semaphore has at most {MAX_PERMITS} permits",
                    l.sent
                ),
                min_ms: None,
                max_ms: None,
            })?),
            None => None,
        };
        let owner = match self.owner {
            Some(o) => check_owner(o)?,
            None => format!(
                "{ANONYMOUS}{}",
                &Token::generate().expose()[..ANONYMOUS_DIGITS]
            ),
        };
        let claim = Claim {
            key,
            mode: self.mode.unwrap_or(Mode::Exclusive),
            owner,
            sidecar: sidecar.to_owned(),
            ttl,
            limit,
            lock_delay,
            max_hold,
        };
        Ok((claim, wait))
    }
}

/// Checks a requested ttl (acquire or keepalive) against `--max-ttl`.
pub(crate) fn check_ttl(
    ttl: Option<&Given<Duration>>,
    limits: &Limits,
) -> Result<Option<Duration>, Error> {
    if let Some(ttl) = ttl {
        if ttl.value.is_zero() {
            return Err(Error::OutOfRange {
                parameter: "ttl",
                detail: "ttl must be above 0".into(),
                min_ms: None,
                max_ms: Some(ms(limits.max_ttl)),
            });
        }
        if ttl.value > limits.max_ttl {
            return Err(out_of_range("ttl", ttl, limits.max_ttl, "--max-ttl"));
        }
    }
    Ok(ttl.map(|t| t.value))
}

/// Checks a hold's or campaign's ttl against [`MIN_RENEWED_TTL`]: one the
/// client asked for (`given`) below it is refused; `--default-ttl` below it
/// is raised to it, since the client asked for nothing it could correct.
pub(crate) fn check_renewed_ttl(
    claim: &mut Claim,
    given: bool,
    limits: &Limits,
) -> Result<(), Error> {
    if claim.ttl >= MIN_RENEWED_TTL {
        return Ok(());
    }
    if !given {
        // Start-up holds --max-ttl at MIN_RENEWED_TTL or above.
        claim.ttl = MIN_RENEWED_TTL.min(limits.max_ttl);
        return Ok(());
    }
    Err(Error::OutOfRange {
        parameter: "ttl",
        detail: format!(
            "ttl {} ms is below the minimum of {} ms for a hold stream or campaign, whose \
             watchdog renews the lease every third of its ttl",
            ms(claim.ttl),
            ms(MIN_RENEWED_TTL)
        ),
        min_ms: Some(ms(MIN_RENEWED_TTL)),
        max_ms: Some(ms(limits.max_ttl)),
    })
}

pub(super) fn check_owner(owner: String) -> Result<String, Error> {
    check_plain_text("owner", &owner, MAX_OWNER_LEN).map_err(Error::InvalidParameter)?;
    // The owner made up for a claim without one is shown (busy answers,
    // listings, events): given back, it would re-enter that claim's lease
    // and answer its token.
    if owner.strip_prefix(ANONYMOUS).is_some_and(|rest| {
        rest.len() == ANONYMOUS_DIGITS
            && rest.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    }) {
        return Err(Error::InvalidParameter(format!(
            "owner {owner:?} has the form of the owners made up for claims sent without one ({ANONYMOUS} and {ANONYMOUS_DIGITS} hex digits), which never re-enter; choose another owner"
        )));
    }
    Ok(owner)
}

/// Checks a force-release reason: plain text of at most [`MAX_REASON_BYTES`].
pub(crate) fn check_reason(reason: Option<String>) -> Result<Option<String>, Error> {
    let Some(reason) = reason else {
        return Ok(None);
    };
    if reason.len() > MAX_REASON_BYTES {
        return Err(Error::InvalidParameter(format!(
            "reason is {} bytes long; at most {MAX_REASON_BYTES} bytes (1 KiB) of UTF-8 are allowed",
            reason.len()
        )));
    }
    check_plain_text("reason", &reason, MAX_REASON_BYTES).map_err(Error::InvalidParameter)?;
    Ok(Some(reason))
}

/// The longest `Idempotency-Key` accepted, in bytes.
const MAX_IDEMPOTENCY_KEY: usize = 255;

/// The `Idempotency-Key` header of a release (or `X-Idempotency-Key`, the
/// other name Go's HTTP client retries on), if its client sent one:
/// printable ASCII (spaces allowed inside) of at most
/// [`MAX_IDEMPOTENCY_KEY`] bytes, one value.
pub(super) fn idempotency_key(headers: &axum::http::HeaderMap) -> Result<Option<String>, Error> {
    let mut values = headers
        .get_all("idempotency-key")
        .iter()
        .chain(headers.get_all("x-idempotency-key").iter());
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.any(|v| v != value) {
        return Err(Error::InvalidParameter(
            "Idempotency-Key is sent with two values: send one per request".into(),
        ));
    }
    match value.to_str() {
        Ok(k)
            if !k.is_empty()
                && k.len() <= MAX_IDEMPOTENCY_KEY
                && k.bytes().all(|b| b == b' ' || b.is_ascii_graphic()) =>
        {
            Ok(Some(k.to_owned()))
        }
        _ => Err(Error::InvalidParameter(format!(
            "Idempotency-Key must be 1-{MAX_IDEMPOTENCY_KEY} printable ASCII characters: a \
             random one per release (a UUID), sent again unchanged when the release is retried"
        ))),
    }
}

pub(super) fn require_token(token: Option<String>) -> Result<Token, Error> {
    match token {
        // Printable ASCII only: sidelock's tokens are hex, and a NUL or a
        // character the database's encoding lacks made PostgreSQL refuse
        // the statement (an error for a request that holds nothing).
        Some(t) if !t.is_empty() && t.len() <= 200 && t.bytes().all(|b| b.is_ascii_graphic()) => {
            Ok(Token::from_client(t))
        }
        Some(_) => Err(Error::InvalidParameter(
            "token must be the token string from the acquire response (1-200 printable ASCII characters)".into(),
        )),
        None => Err(Error::InvalidParameter(
            "token is required: give the token from the acquire response (?token=...)".into(),
        )),
    }
}
