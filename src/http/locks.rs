//! Lock and semaphore routes: acquire, release, keepalive, hold, inspect,
//! listing, stale keys, events and admin force-release.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{ConnectInfo, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures::Stream;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use utoipa::{IntoParams, ToSchema};

use super::params::{Given, LockName, Params, count, duration, mode};
use super::problem::Problem;
use super::{App, auth};
use crate::backend::{Holder, StaleKey, Waiter};
use crate::clock::ms;
use crate::core::{Granted, HoldEvent, HoldEvents, Limits, Outcome};
use crate::duration::MAX_DURATION;
use crate::error::Error;
use crate::lock::{Claim, Held, Kind, LockKey, Mode, Name, Token, check_plain_text};

/// Keep-alive comments on SSE streams: at least this often.
const SSE_KEEPALIVE: Duration = Duration::from_secs(15);

/// Longest accepted owner identity, in characters.
const MAX_OWNER_LEN: usize = 200;

/// Longest accepted force-release reason, in bytes of UTF-8.
const MAX_REASON_BYTES: usize = 1024;

// Only a schema (the parameters parse with `duration`): numbers of any size
// are part of it so that API fuzzers try huge ones.
/// A duration: text such as `30s`, or a whole number of milliseconds.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum DurationValue {
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
    /// Lease duration, e.g. `30s` (default `--default-ttl`, at most `--max-ttl`).
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
    #[param(required = true)]
    #[schema(required = true)]
    pub token: Option<String>,
}

/// Parameters of a keepalive.
#[derive(Debug, Deserialize, IntoParams, ToSchema)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct KeepaliveParams {
    /// The token from the acquire response.
    #[param(required = true)]
    #[schema(required = true)]
    pub token: Option<String>,
    /// New lease duration from now (default: the lease's own ttl).
    #[serde(default, deserialize_with = "duration")]
    #[param(value_type = Option<DurationValue>, inline, example = "30s")]
    #[schema(value_type = Option<DurationValue>, inline, example = "30s")]
    pub ttl: Option<Given<Duration>>,
}

/// No parameters accepted.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

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

/// A granted lease (acquire's 200 and the hold stream's `acquired` event).
#[derive(Debug, Serialize, ToSchema)]
pub struct Acquired {
    pub name: String,
    pub kind: Kind,
    /// Secret needed to release or renew; keep it private.
    pub token: String,
    /// Strictly increasing per name across all grants; pass it to the protected resource.
    pub fence: u64,
    /// `exclusive` or `shared` for a lock, `permit` for a semaphore.
    pub mode: Held,
    pub owner: String,
    /// Hold count (above 1 after re-entry).
    pub count: u32,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    pub waited_ms: u64,
}

/// Release result.
#[derive(Debug, Serialize, ToSchema)]
pub struct Released {
    /// False while a re-entrant hold count is still above zero.
    pub released: bool,
    /// Remaining hold count.
    pub count: u32,
}

/// Keepalive result (also the hold stream's `renewed` event).
#[derive(Debug, Serialize, ToSchema)]
pub struct Renewed {
    pub expires_at_ms: u64,
    pub ttl_ms: u64,
}

/// The global state of one lock or semaphore.
#[derive(Debug, Serialize, ToSchema)]
pub struct LockView {
    pub name: String,
    pub kind: Kind,
    /// Highest fence granted so far (0 if never).
    pub fence: u64,
    /// Permits of a semaphore in use.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    pub holders: Vec<Holder>,
    pub waiters: Vec<Waiter>,
}

/// One held or contended lock.
#[derive(Debug, Serialize, ToSchema)]
pub struct LockRow {
    pub name: String,
    pub kind: Kind,
    pub holders: usize,
    pub waiters: usize,
    pub fence: u64,
}

/// A page of held or contended locks and semaphores.
#[derive(Debug, Serialize, ToSchema)]
pub struct LockList {
    pub locks: Vec<LockRow>,
    /// Pass as `cursor` for the next page; null on the last page.
    pub next_cursor: Option<String>,
}

/// Stale keys.
#[derive(Debug, Serialize, ToSchema)]
pub struct StaleList {
    pub stale: Vec<StaleKey>,
}

/// Force-release result.
#[derive(Debug, Serialize, ToSchema)]
pub struct ForceReleased {
    /// Number of leases removed.
    pub released: usize,
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

fn out_of_range(
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
        max_ms: Some(ms(max)),
    }
}

/// The most permits a semaphore may have.
const MAX_PERMITS: u64 = u32::MAX as u64;

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
                    max_ms: None,
                });
            }
            Some(l) => Some(u32::try_from(l.value).map_err(|_| Error::OutOfRange {
                parameter: "limit",
                detail: format!(
                    "limit {:?} is too large: a semaphore has at most {MAX_PERMITS} permits",
                    l.sent
                ),
                max_ms: None,
            })?),
            None => None,
        };
        let owner = match self.owner {
            Some(o) => check_owner(o)?,
            None => format!("anonymous-{}", &Token::generate().expose()[..12]),
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
                max_ms: Some(ms(limits.max_ttl)),
            });
        }
        if ttl.value > limits.max_ttl {
            return Err(out_of_range("ttl", ttl, limits.max_ttl, "--max-ttl"));
        }
    }
    Ok(ttl.map(|t| t.value))
}

fn check_owner(owner: String) -> Result<String, Error> {
    check_plain_text("owner", &owner, MAX_OWNER_LEN).map_err(Error::InvalidParameter)?;
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

fn require_token(token: Option<String>) -> Result<Token, Error> {
    match token {
        Some(t) if !t.is_empty() && t.len() <= 200 => Ok(Token::from_client(t)),
        Some(_) => Err(Error::InvalidParameter(
            "token must be the token string from the acquire response".into(),
        )),
        None => Err(Error::InvalidParameter(
            "token is required: give the token from the acquire response (?token=...)".into(),
        )),
    }
}

fn acquired(g: &Granted) -> Acquired {
    let lease = &g.lease;
    Acquired {
        name: lease.key.name.to_string(),
        kind: lease.key.kind,
        token: lease.token.expose().to_owned(),
        fence: lease.fence,
        mode: Held::of(lease.key.kind, lease.mode),
        owner: lease.owner.clone(),
        count: g.count,
        ttl_ms: ms(lease.ttl),
        expires_at_ms: g.expires_at_ms,
        waited_ms: ms(g.waited),
    }
}

fn key(kind: Kind, name: Name) -> LockKey {
    LockKey { kind, name }
}

/// Acquires in the request's own task. A client that disconnects drops
/// the request; the acquire then finishes in a task of its own
/// ([`Finishing`]): a wait is given up and a grant that raced the departure
/// is released.
async fn acquire(app: Arc<App>, key: LockKey, ask: Ask) -> Result<Json<Acquired>, Error> {
    let (claim, wait) = ask.into_claim(key, &app.core.limits, &app.core.sidecar)?;
    if app.core.shutdown.is_cancelled() {
        return Err(Error::ShuttingDown);
    }
    let left = CancellationToken::new();
    let core = app.core.clone();
    let cancel = left.clone();
    let acquire = async move {
        let outcome = core.acquire(&claim, wait, &cancel).await;
        if cancel.is_cancelled()
            && let Ok(Outcome::Granted(g)) = &outcome
        {
            tracing::debug!(lock = %g.lease.key, "client left before its grant; releasing");
            let _ = core.release(&g.lease.key, &g.lease.token).await;
        }
        outcome
    };
    match Finishing::new(acquire, left, &app.core.tasks).await? {
        Outcome::Granted(g) => Ok(Json(acquired(&g))),
        Outcome::Busy { busy, waited } => Err(Error::Busy {
            busy: Box::new(busy),
            waited_ms: ms(waited),
        }),
        Outcome::Cancelled => Err(Error::ShuttingDown),
    }
}

/// Work a request runs in its own task that must not stop midway (an
/// acquire could lose a grant, a hold its release). Dropped unfinished (the
/// client left), it cancels `left` and finishes in a task, where the work
/// gives up its wait or releases what it got. (A task per request from the
/// start would cost every request a hand-over between tasks, and every hold
/// a task.)
struct Finishing<T: Send + 'static> {
    /// The work until it has returned.
    work: Option<futures::future::BoxFuture<'static, T>>,
    /// Tells the work that its client left.
    left: CancellationToken,
    /// Where unfinished work finishes.
    tasks: tokio_util::task::TaskTracker,
}

impl<T: Send + 'static> Finishing<T> {
    fn new(
        work: impl Future<Output = T> + Send + 'static,
        left: CancellationToken,
        tasks: &tokio_util::task::TaskTracker,
    ) -> Self {
        Self {
            work: Some(Box::pin(work)),
            left,
            tasks: tasks.clone(),
        }
    }

    fn is_done(&self) -> bool {
        self.work.is_none()
    }
}

impl<T: Send + 'static> Future for Finishing<T> {
    type Output = T;

    /// # Panics
    /// When polled after it returned (the `Future` contract).
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<T> {
        let work = self
            .work
            .as_mut()
            .expect("Finishing polled after it returned");
        let output = std::task::ready!(work.as_mut().poll(cx));
        self.work = None;
        std::task::Poll::Ready(output)
    }
}

impl<T: Send + 'static> Drop for Finishing<T> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else {
            return;
        };
        self.left.cancel();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            self.tasks.spawn_on(
                async move {
                    work.await;
                },
                &runtime,
            );
        }
    }
}

fn sse_json(name: &str, data: &impl Serialize) -> SseEvent {
    SseEvent::default()
        .event(name)
        .json_data(data)
        .unwrap_or_else(|_| SseEvent::default().comment("unserialisable event"))
}

fn hold_event(event: HoldEvent) -> SseEvent {
    match event {
        HoldEvent::Queued {
            position,
            queue_length,
        } => sse_json(
            "queued",
            &serde_json::json!({ "position": position, "queue_length": queue_length }),
        ),
        HoldEvent::Acquired(g) => sse_json("acquired", &acquired(&g)),
        HoldEvent::Renewed {
            expires_at_ms,
            ttl_ms,
        } => sse_json(
            "renewed",
            &Renewed {
                expires_at_ms,
                ttl_ms,
            },
        ),
        HoldEvent::Lost(reason) => sse_json("lost", &serde_json::json!({ "reason": reason })),
        HoldEvent::Timeout { busy, waited } => sse_json(
            "timeout",
            &serde_json::json!({
                "waited_ms": ms(waited),
                "queue_length": busy.queue_length,
                "holders": busy.holders,
            }),
        ),
        HoldEvent::Failed(e) => sse_json("error", &e.problem()),
    }
}

/// Starts a hold: the lease lives as long as the returned stream is open.
fn hold(app: Arc<App>, key: LockKey, ask: Ask) -> Result<axum::response::Response, Error> {
    use axum::response::IntoResponse as _;
    let (claim, wait) = ask.into_claim(key, &app.core.limits, &app.core.sidecar)?;
    if app.core.shutdown.is_cancelled() {
        return Err(Error::ShuttingDown);
    }
    app.core.check_room(!wait.is_zero())?;
    let events = Arc::new(HoldEvents::default());
    let core = app.core.clone();
    let reported = events.clone();
    let claim = Box::new(claim);
    let hold = async move { core.hold(claim, wait, &reported).await };
    let stream = HoldStream {
        hold: Finishing::new(hold, events.left().clone(), &app.core.tasks),
        events,
    };
    let mut response = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(SSE_KEEPALIVE))
        .into_response();
    // hyper keeps a response's header map for the connection's next
    // response, which a hold never sends: sized for the two headers of SSE
    // (hyper writes transfer-encoding itself), not the default six.
    let mut headers = HeaderMap::with_capacity(2);
    headers.extend(response.headers_mut().drain());
    *response.headers_mut() = headers;
    Ok(response)
}

/// A hold's event stream, which also runs the hold: each poll advances it
/// ([`crate::core::Core::hold`]) and then hands out what it reported. The
/// connection's task is the hold's only task; when the client leaves, the
/// hold finishes elsewhere ([`Finishing`]), giving up its wait or releasing
/// its lease.
struct HoldStream {
    hold: Finishing<()>,
    events: Arc<HoldEvents>,
}

impl Stream for HoldStream {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        if !self.hold.is_done() {
            let _ = std::pin::Pin::new(&mut self.hold).poll(cx);
        }
        match self.events.next() {
            Some(event) => Poll::Ready(Some(Ok(hold_event(event)))),
            None if self.hold.is_done() => Poll::Ready(None),
            None => Poll::Pending,
        }
    }
}

async fn release(app: &App, key: LockKey, token: Option<String>) -> Result<Json<Released>, Error> {
    let token = require_token(token)?;
    let count = app.core.release(&key, &token).await?;
    Ok(Json(Released {
        released: count == 0,
        count,
    }))
}

async fn keepalive(app: &App, key: LockKey, p: KeepaliveParams) -> Result<Json<Renewed>, Error> {
    let token = require_token(p.token)?;
    let ttl = check_ttl(p.ttl.as_ref(), &app.core.limits)?;
    let asked = ttl.or_else(|| app.core.lease_ttl(&key, &token));
    let expires_at_ms = app.core.keepalive(&key, &token, ttl).await?;
    let mut ttl_ms = expires_at_ms.saturating_sub(crate::clock::now_ms());
    if let Some(ttl) = asked {
        // A backend's clock conversion may round up; never report more than the ttl.
        ttl_ms = ttl_ms.min(ms(ttl));
    }
    Ok(Json(Renewed {
        expires_at_ms,
        ttl_ms,
    }))
}

async fn inspect(app: &App, key: LockKey) -> Result<Json<LockView>, Error> {
    let state = app.core.inspect(&key).await?;
    Ok(Json(LockView {
        name: key.name.to_string(),
        kind: key.kind,
        fence: state.fence,
        limit: state.limit,
        holders: state.holders,
        waiters: state.waiters,
    }))
}

/// Stamps out the five routes of one kind (`locks` or `semaphores`), each
/// with its own OpenAPI operation.
macro_rules! kind_routes {
    ($kind:expr, $tag:literal, $path:literal, $params:ty,
     $acquire:ident, $release:ident, $keepalive:ident, $hold:ident, $inspect:ident) => {
        #[utoipa::path(post, path = concat!($path, "/{name}"), tag = $tag,
            params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,200}$"), $params),
            request_body(content = $params, content_type = "application/json", description = "Parameters may also be given in the query string or as a form body"),
            responses(
                (status = 200, body = Acquired, description = "Granted"),
                (status = 400, body = Problem, content_type = "application/problem+json", description = "Bad name or parameter, or unsupported: a claim the backend cannot keep (Redlock: a semaphore limit above 1)"),
                (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
                (status = 409, body = Problem, content_type = "application/problem+json", description = "lock-busy: not granted within wait; key-conflict: a backend key of this lock holds data sidelock did not write"),
                (status = 413, body = Problem, content_type = "application/problem+json", description = "Body too large"),
                (status = 415, body = Problem, content_type = "application/problem+json", description = "Unsupported body type"),
                (status = 429, body = Problem, content_type = "application/problem+json", description = "too-many-waiters (this lock), sidecar-full (--max-total-waiters, --max-held) or too-many-failed-tokens (wrong tokens from this address)"),
                (status = 503, body = Problem, content_type = "application/problem+json", description = "Backend unavailable or shutting down"),
            ))]
        /// Acquire: try once, or wait in the FIFO queue up to `wait`.
        pub async fn $acquire(
            State(app): State<Arc<App>>,
            LockName(name): LockName,
            Params(p): Params<$params>,
        ) -> Result<Json<Acquired>, Error> {
            acquire(app, key($kind, name), p.into()).await
        }

        #[utoipa::path(delete, path = concat!($path, "/{name}"), tag = $tag,
            params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,200}$"), TokenParams),
            responses(
                (status = 200, body = Released, description = "Released one hold; `remaining` holds are left"),
                (status = 400, body = Problem, content_type = "application/problem+json", description = "Bad name or parameter"),
                (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
                (status = 429, body = Problem, content_type = "application/problem+json", description = "too-many-failed-tokens: more than 10 wrong tokens from this address; the token was not compared (Retry-After)"),
                (status = 410, body = Problem, content_type = "application/problem+json", description = "lease-lost: the token no longer holds the lock"),
                (status = 413, body = Problem, content_type = "application/problem+json", description = "Body too large"),
                (status = 415, body = Problem, content_type = "application/problem+json", description = "Unsupported body type"),
                (status = 503, body = Problem, content_type = "application/problem+json", description = "Backend unavailable or shutting down"),
            ))]
        /// Release one hold of a lease.
        pub async fn $release(
            State(app): State<Arc<App>>,
            LockName(name): LockName,
            Params(p): Params<TokenParams>,
        ) -> Result<Json<Released>, Error> {
            release(&app, key($kind, name), p.token).await
        }

        #[utoipa::path(post, path = concat!($path, "/{name}/keepalive"), tag = $tag,
            params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,200}$"), KeepaliveParams),
            responses(
                (status = 200, body = Renewed, description = "Renewed: the new expiry"),
                (status = 400, body = Problem, content_type = "application/problem+json", description = "Bad name or parameter"),
                (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
                (status = 429, body = Problem, content_type = "application/problem+json", description = "too-many-failed-tokens: more than 10 wrong tokens from this address; the token was not compared (Retry-After)"),
                (status = 410, body = Problem, content_type = "application/problem+json", description = "lease-lost"),
                (status = 413, body = Problem, content_type = "application/problem+json", description = "Body too large"),
                (status = 415, body = Problem, content_type = "application/problem+json", description = "Unsupported body type"),
                (status = 503, body = Problem, content_type = "application/problem+json", description = "Backend unavailable or shutting down"),
            ))]
        /// Extend a lease to `ttl` from now.
        pub async fn $keepalive(
            State(app): State<Arc<App>>,
            LockName(name): LockName,
            Params(p): Params<KeepaliveParams>,
        ) -> Result<Json<Renewed>, Error> {
            keepalive(&app, key($kind, name), p).await
        }

        #[utoipa::path(get, path = concat!($path, "/{name}/hold"), tag = $tag,
            params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,200}$"), $params),
            responses(
                (status = 200, content_type = "text/event-stream", description = "SSE: queued, acquired, renewed, lost, timeout (and error). The lease lives while the stream is open."),
                (status = 400, body = Problem, content_type = "application/problem+json", description = "Bad name or parameter"),
                (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
                (status = 413, body = Problem, content_type = "application/problem+json", description = "Body too large"),
                (status = 415, body = Problem, content_type = "application/problem+json", description = "Unsupported body type"),
                (status = 429, body = Problem, content_type = "application/problem+json", description = "sidecar-full (--max-total-waiters, --max-held) or too-many-failed-tokens (wrong tokens from this address)"),
                (status = 503, body = Problem, content_type = "application/problem+json", description = "Backend unavailable or shutting down"),
            ))]
        /// Hold: acquire and keep the lease while the stream is open (watchdog renewal).
        pub async fn $hold(
            State(app): State<Arc<App>>,
            LockName(name): LockName,
            Params(p): Params<$params>,
        ) -> Result<axum::response::Response, Error> {
            hold(app, key($kind, name), p.into())
        }

        #[utoipa::path(get, path = concat!($path, "/{name}"), tag = $tag,
            params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,200}$")),
            responses(
                (status = 200, body = LockView, description = "Holders and waiters across all sidecars"),
                (status = 400, body = Problem, content_type = "application/problem+json", description = "Bad name or parameter"),
                (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
                (status = 429, body = Problem, content_type = "application/problem+json", description = "too-many-failed-tokens: more than 10 wrong tokens from this address; the token was not compared (Retry-After)"),
                (status = 503, body = Problem, content_type = "application/problem+json", description = "Backend unavailable or shutting down"),
            ))]
        /// The global state: holders and waiters across all sidecars.
        pub async fn $inspect(
            State(app): State<Arc<App>>,
            LockName(name): LockName,
            Params(_none): Params<NoParams>,
        ) -> Result<Json<LockView>, Error> {
            inspect(&app, key($kind, name)).await
        }
    };
}

kind_routes!(
    Kind::Lock,
    "locks",
    "/v1/locks",
    LockParams,
    acquire_lock,
    release_lock,
    keepalive_lock,
    hold_lock,
    inspect_lock
);
kind_routes!(
    Kind::Semaphore,
    "semaphores",
    "/v1/semaphores",
    SemaphoreParams,
    acquire_semaphore,
    release_semaphore,
    keepalive_semaphore,
    hold_semaphore,
    inspect_semaphore
);

fn parse_cursor(cursor: &str) -> Result<LockKey, Error> {
    LockKey::parse(cursor).ok_or_else(|| {
        Error::InvalidParameter("cursor is not a next_cursor value from this listing".into())
    })
}

#[utoipa::path(get, path = "/v1/locks", tag = "locks", params(ListParams),
    responses(
        (status = 200, body = LockList, description = "One page of held or contended locks"),
        (status = 400, body = Problem, content_type = "application/problem+json", description = "Bad name or parameter"),
        (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
        (status = 429, body = Problem, content_type = "application/problem+json", description = "too-many-failed-tokens: more than 10 wrong tokens from this address; the token was not compared (Retry-After)"),
        (status = 503, body = Problem, content_type = "application/problem+json", description = "Backend unavailable or shutting down"),
    ))]
/// Held or contended locks and semaphores, by kind and name, paginated.
pub async fn list_locks(
    State(app): State<Arc<App>>,
    Params(p): Params<ListParams>,
) -> Result<Json<LockList>, Error> {
    let limit = match p.limit {
        None => 100,
        Some(l) if (1..=1000).contains(&l.value) => l.value,
        Some(l) => {
            return Err(Error::OutOfRange {
                parameter: "limit",
                detail: format!("limit {:?} is outside 1 to 1000", l.sent),
                max_ms: None,
            });
        }
    };
    let prefix = p.prefix.unwrap_or_default();
    if !prefix.is_empty() {
        Name::parse(&prefix).map_err(|e| Error::InvalidParameter(format!("prefix: {e}")))?;
    }
    let after = p.cursor.as_deref().map(parse_cursor).transpose()?;
    let rows = app
        .core
        .list(&prefix, after.as_ref(), limit as usize)
        .await?;
    let next_cursor = (rows.len() == limit as usize)
        .then(|| rows.last().map(|r| r.key.to_string()))
        .flatten();
    Ok(Json(LockList {
        locks: rows
            .into_iter()
            .map(|r| LockRow {
                name: r.key.name.to_string(),
                kind: r.key.kind,
                holders: r.holders,
                waiters: r.waiters,
                fence: r.fence,
            })
            .collect(),
        next_cursor,
    }))
}

#[utoipa::path(get, path = "/v1/stale", tag = "operations",
    responses(
        (status = 200, body = StaleList, description = "Keys an operator should look at"),
        (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
        (status = 429, body = Problem, content_type = "application/problem+json", description = "too-many-failed-tokens: more than 10 wrong tokens from this address; the token was not compared (Retry-After)"),
        (status = 503, body = Problem, content_type = "application/problem+json", description = "Backend unavailable or shutting down"),
    ))]
/// Keys an operator should look at, with the reason.
pub async fn stale(
    State(app): State<Arc<App>>,
    Params(_none): Params<NoParams>,
) -> Result<Json<StaleList>, Error> {
    Ok(Json(StaleList {
        stale: app.core.stale().await?,
    }))
}

/// Open `/v1/events` streams per sidecar at most, so that streams, which
/// never end by themselves, cannot take every connection from probes and
/// lock requests.
pub const MAX_EVENT_STREAMS: usize = 64;

#[utoipa::path(get, path = "/v1/events", tag = "operations",
    responses(
        (status = 200, content_type = "text/event-stream", description = "SSE of this sidecar's lock events; event name = type"),
        (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
        (status = 429, body = Problem, content_type = "application/problem+json", description = "too-many-event-streams: 64 event streams are already open; or too-many-failed-tokens: more than 10 wrong tokens from this address, the token was not compared (Retry-After)"),
    ))]
/// Live lock events of this sidecar.
pub async fn events(
    State(app): State<Arc<App>>,
    Params(_none): Params<NoParams>,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, Error> {
    let permit =
        app.event_streams
            .clone()
            .try_acquire_owned()
            .map_err(|_| Error::TooManyEventStreams {
                limit: MAX_EVENT_STREAMS,
            })?;
    let rx = app.core.subscribe();
    let shutdown = app.core.shutdown.clone();
    // The permit lives in the stream's state: dropped with the stream.
    let state = (rx, shutdown, permit);
    let stream = futures::stream::unfold(state, |(mut rx, shutdown, permit)| async move {
        let received = tokio::select! {
            () = shutdown.cancelled() => return None,
            received = rx.recv() => received,
        };
        let event = match received {
            Ok(e) => {
                let name = serde_json::to_value(e.event)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default();
                sse_json(&name, &e)
            }
            Err(broadcast::error::RecvError::Lagged(n)) => {
                SseEvent::default().comment(format!("skipped {n} events"))
            }
            Err(broadcast::error::RecvError::Closed) => return None,
        };
        Some((Ok(event), (rx, shutdown, permit)))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(SSE_KEEPALIVE)))
}

/// How much of a force-releasing client's `User-Agent` is logged.
const MAX_AGENT_BYTES: usize = 200;

async fn force_release(
    app: &App,
    key: LockKey,
    headers: &HeaderMap,
    peer: std::net::SocketAddr,
    reason: Option<String>,
) -> Result<Json<ForceReleased>, Error> {
    auth::require_admin(app, peer, headers)?;
    let reason = check_reason(reason)?;
    // Logged with the release: cut like a reason is bounded (visible ASCII
    // only, so a byte cut is a character cut).
    let agent = headers
        .get(axum::http::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .map_or("-", |a| &a[..a.len().min(MAX_AGENT_BYTES)]);
    let who = format!(
        "admin from {peer} (user-agent {agent:?}, reason {:?})",
        reason.as_deref().unwrap_or("-")
    );
    let released = app.core.force_release(&key, &who).await?;
    Ok(Json(ForceReleased { released }))
}

#[utoipa::path(delete, path = "/v1/admin/locks/{name}", tag = "admin",
    params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,200}$"), AdminParams),
    security(("admin_token" = [])),
    responses(
        (status = 200, body = ForceReleased, description = "Every holder removed"),
        (status = 400, body = Problem, content_type = "application/problem+json", description = "Bad name or parameter"),
        (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
        (status = 429, body = Problem, content_type = "application/problem+json", description = "too-many-failed-tokens: more than 10 wrong tokens from this address; the token was not compared (Retry-After)"),
        (status = 403, body = Problem, content_type = "application/problem+json", description = "No admin token configured, or not the admin token"),
        (status = 503, body = Problem, content_type = "application/problem+json", description = "Backend unavailable or shutting down"),
    ))]
/// Force-release every holder of a lock (admin token required).
pub async fn force_release_lock(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>,
    headers: HeaderMap,
    LockName(name): LockName,
    Params(p): Params<AdminParams>,
) -> Result<Json<ForceReleased>, Error> {
    force_release(&app, key(Kind::Lock, name), &headers, peer, p.reason).await
}

#[utoipa::path(delete, path = "/v1/admin/semaphores/{name}", tag = "admin",
    params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,200}$"), AdminParams),
    security(("admin_token" = [])),
    responses(
        (status = 200, body = ForceReleased, description = "Every holder removed"),
        (status = 400, body = Problem, content_type = "application/problem+json", description = "Bad name or parameter"),
        (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
        (status = 429, body = Problem, content_type = "application/problem+json", description = "too-many-failed-tokens: more than 10 wrong tokens from this address; the token was not compared (Retry-After)"),
        (status = 403, body = Problem, content_type = "application/problem+json", description = "No admin token configured, or not the admin token"),
        (status = 503, body = Problem, content_type = "application/problem+json", description = "Backend unavailable or shutting down"),
    ))]
/// Force-release every holder of a semaphore (admin token required).
pub async fn force_release_semaphore(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>,
    headers: HeaderMap,
    LockName(name): LockName,
    Params(p): Params<AdminParams>,
) -> Result<Json<ForceReleased>, Error> {
    force_release(&app, key(Kind::Semaphore, name), &headers, peer, p.reason).await
}
