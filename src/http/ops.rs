//! Operational routes: health, readiness, info, metrics and the OpenAPI document.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use serde::Serialize;
use utoipa::ToSchema;

use super::App;
use super::params::{NoParams, Params};
use super::problem::Problem;
use crate::backend::Description;
use crate::clock::{ms, now_ms};
use crate::error::Error;

/// Health answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ok` or `ready`.
    pub status: &'static str,
}

/// Configured limits, in milliseconds.
#[derive(Debug, Serialize, ToSchema)]
pub struct InfoLimits {
    pub default_ttl_ms: u64,
    pub max_ttl_ms: u64,
    pub max_wait_ms: u64,
    pub max_waiters: usize,
    pub max_total_waiters: usize,
    pub max_held: usize,
    pub lock_delay_ms: u64,
    pub stale_after_ms: u64,
}

/// Which tokens are configured (never the tokens).
#[derive(Debug, Serialize, ToSchema)]
pub struct InfoAuth {
    pub api_token: bool,
    pub admin_token: bool,
}

/// What this sidecar is.
#[derive(Debug, Serialize, ToSchema)]
pub struct Info {
    pub sidecar: String,
    pub version: &'static str,
    pub backend: Description,
    pub started_at_ms: u64,
    pub uptime_ms: u64,
    pub limits: InfoLimits,
    pub auth: InfoAuth,
    /// Leases held through this sidecar now.
    pub held: usize,
    /// Requests of this sidecar waiting now.
    pub waiting: usize,
}

#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, body = Health, description = "The process is alive")))]
/// The process is alive.
pub async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, body = Health, description = "The backend answers"),
        (status = 503, body = Problem, content_type = "application/problem+json", description = "Backend unreachable or shutting down"),
    ))]
/// The backend answers and the sidecar is not shutting down.
pub async fn readyz(State(app): State<Arc<App>>) -> Result<Json<Health>, Error> {
    if app.core.shutdown.is_cancelled() {
        return Err(Error::ShuttingDown);
    }
    app.core.ready().await?;
    Ok(Json(Health { status: "ready" }))
}

pub(crate) fn info_of(app: &App) -> Info {
    let l = &app.core.limits;
    Info {
        sidecar: app.core.sidecar.clone(),
        version: env!("CARGO_PKG_VERSION"),
        backend: app.core.backend().describe(),
        started_at_ms: app.started_at_ms,
        uptime_ms: now_ms().saturating_sub(app.started_at_ms),
        limits: InfoLimits {
            default_ttl_ms: ms(l.default_ttl),
            max_ttl_ms: ms(l.max_ttl),
            max_wait_ms: ms(l.max_wait),
            max_waiters: l.max_waiters,
            max_total_waiters: l.max_total_waiters,
            max_held: l.max_held,
            lock_delay_ms: ms(l.lock_delay),
            stale_after_ms: ms(l.stale_after),
        },
        auth: InfoAuth {
            api_token: app.settings.api_token.is_some(),
            admin_token: app.settings.admin_token.is_some(),
        },
        held: app.core.held(),
        waiting: app.core.waiting(),
    }
}

#[utoipa::path(get, path = "/v1/info", tag = "operations",
    responses(
        (status = 200, body = Info, description = "This sidecar, its backend (without credentials) and limits"),
        (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
        (status = 429, body = Problem, content_type = "application/problem+json", description = "too-many-failed-tokens: more than 10 wrong tokens from this address; the token was not compared (Retry-After)"),
    ))]
/// Sidecar id, version, backend and its safety class, limits.
pub async fn info(State(app): State<Arc<App>>, Params(_none): Params<NoParams>) -> Json<Info> {
    Json(info_of(&app))
}

#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, content_type = "text/plain", description = "Prometheus text format")))]
/// Prometheus metrics.
pub async fn metrics(State(app): State<Arc<App>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.core.metrics.render(),
    )
}
