//! The operator routes: the listing of held and contended keys, stale keys,
//! the live event stream and admin force-release.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::extract::{ConnectInfo, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures::Stream;
use tokio::sync::broadcast;

use crate::error::Error;
use crate::http::params::{LockName, Params};
use crate::http::problem::Problem;
use crate::http::{App, auth};
use crate::lock::{Kind, LockKey, Name};

use super::answers::{ForceReleased, LockList, LockRow, StaleList};
use super::ask::{AdminParams, ListParams, check_reason};
use super::hold::{SSE_KEEPALIVE, sse_json};
use super::key;
use crate::http::params::NoParams;

pub(super) fn parse_cursor(cursor: &str) -> Result<LockKey, Error> {
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
                min_ms: None,
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
    let (stale, truncated) = crate::core::shown_stale(app.core.stale().await?);
    Ok(Json(StaleList { stale, truncated }))
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
pub(super) const MAX_AGENT_BYTES: usize = 200;

pub(super) async fn force_release(
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
