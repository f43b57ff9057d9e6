//! Lock and semaphore routes: acquire, release, keepalive, hold, inspect,
//! listing, stale keys, events and admin force-release.
//!
//! * [`ask`]: the parameters of every route and the checks of an acquire.
//! * [`answers`]: the JSON bodies.
//! * [`hold`]: the hold stream, and requests that finish after their client left.
//! * [`operations`]: listing, stale keys, events and force-release.
//!
//! This module has the five routes of each kind (acquire, release,
//! keepalive, hold, inspect), stamped out by one macro.

mod answers;
mod ask;
pub(super) mod hold;
mod operations;

pub use answers::*;
pub use ask::*;
pub use hold::Finishers;
pub use operations::*;

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use tokio_util::sync::CancellationToken;

use crate::clock::ms;
use crate::core::Outcome;
use crate::error::Error;
use crate::http::App;
use crate::http::params::{LockName, NoParams, Params};
use crate::http::problem::Problem;
use crate::http::server::Stall;
use crate::lock::{Kind, LockKey, Name};

use answers::acquired;
use ask::{idempotency_key, require_token};
use hold::{Finishing, hold};

fn key(kind: Kind, name: Name) -> LockKey {
    LockKey { kind, name }
}

/// Acquires in the request's own task. A client that disconnects drops
/// the request; the acquire then finishes in a task of its own
/// ([`Finishing`]): a wait is given up and a grant that raced the departure
/// is released.
///
/// Not an `async fn`: the checks run before the future is made, so the
/// parameters are not part of what a waiting request keeps.
fn acquire(
    app: Arc<App>,
    key: LockKey,
    ask: Ask,
) -> impl Future<Output = Result<Json<Acquired>, Error>> {
    let finishing = ask
        .into_claim(key, &app.core.limits, &app.core.sidecar)
        .and_then(|(claim, wait)| {
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
                    Box::pin(core.release_unclaimed(&g.lease.key, &g.lease.token)).await;
                }
                outcome
            };
            Finishing::new(acquire, left, &app.finishers)
        });
    async move {
        match finishing?.await? {
            Outcome::Granted(g) => Ok(Json(acquired(&g))),
            Outcome::Busy { busy, waited } => Err(Error::Busy {
                busy: Box::new(busy),
                waited_ms: ms(waited),
            }),
            Outcome::Cancelled => Err(Error::ShuttingDown),
        }
    }
}

/// Releases one hold, once per `Idempotency-Key` (`idempotency`). A
/// client that disconnects drops the request: a release without a key is
/// cancelled with it (a statement waiting for a locked row must not keep
/// its connection), one with a key that has started finishes in a task of
/// its own ([`Finishing`]) — cut short after the backend ran it, its answer
/// would not be kept for the client's retry, which would release one hold
/// more; one still waiting for its turn gives up.
async fn release(
    app: &App,
    key: LockKey,
    token: Option<String>,
    idempotency: Option<String>,
) -> Result<Json<Released>, Error> {
    let token = require_token(token)?;
    let count = match idempotency {
        None => app.core.release(&key, &token).await?,
        Some(idempotency) => {
            let (core, left) = (app.core.clone(), CancellationToken::new());
            let gone = left.clone();
            let work = async move { core.release_once(&key, &token, &idempotency, &gone).await };
            Finishing::new(work, left, &app.finishers)?.await?
        }
    };
    Ok(Json(Released {
        released: count == 0,
        count,
    }))
}

async fn keepalive(app: &App, key: LockKey, p: KeepaliveParams) -> Result<Json<Renewed>, Error> {
    let token = require_token(p.token)?;
    let ttl = check_ttl(p.ttl.as_ref(), &app.core.limits)?;
    let own = app.core.lease_ttl(&key, &token);
    let max_hold = app.core.lease_max_hold(&key, &token);
    let (expires_at_ms, renewed_to) = app.core.keepalive_asked(&key, &token, ttl).await?;
    let asked = renewed_to.or(own);
    let mut ttl_ms = expires_at_ms.saturating_sub(crate::clock::now_ms());
    if let Some(ttl) = asked {
        // A backend's clock conversion may round up; never report more than the ttl.
        ttl_ms = ttl_ms.min(ms(ttl));
    }
    if let Some(max_hold) = max_hold {
        ttl_ms = ttl_ms.min(ms(max_hold));
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
        // Not an `async fn`, whose arguments would stay in a waiting request's state.
        pub fn $acquire(
            State(app): State<Arc<App>>,
            LockName(name): LockName,
            Params(p): Params<$params>,
        ) -> impl Future<Output = Result<Json<Acquired>, Error>> {
            acquire(app, key($kind, name), p.into())
        }

        #[utoipa::path(delete, path = concat!($path, "/{name}"), tag = $tag,
            params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,200}$"), TokenParams,
                ("Idempotency-Key" = Option<String>, Header, pattern = r"^[!-~]([ -~]{0,253}[!-~])?$", description = "Optional, 1-255 printable ASCII characters, one per release (X-Idempotency-Key is taken too): the same key again for the same lease answers what the first release answered (for 5 minutes) instead of releasing one hold more")),
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
            headers: axum::http::HeaderMap,
            Params(p): Params<TokenParams>,
        ) -> Result<Json<Released>, Error> {
            let idempotency = idempotency_key(&headers)?;
            release(&app, key($kind, name), p.token, idempotency).await
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
            method: axum::http::Method,
            uri: axum::http::Uri,
            State(app): State<Arc<App>>,
            LockName(name): LockName,
            stall: Option<axum::Extension<Stall>>,
            Params(p): Params<$params>,
        ) -> Result<axum::response::Response, Error> {
            super::refuse_head(&method, &uri)?;
            let stall = stall.map(|axum::Extension(s)| s);
            hold(app, key($kind, name), p.into(), stall).await
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
