//! HTTP: routes, parameter extraction, auth, SSE and the OpenAPI document.
//!
//! Handlers are thin: they validate parameters into a [`Claim`](crate::lock::Claim)
//! and call [`Core`]. Every error leaves through [`Error`]'s one
//! `IntoResponse`, as `application/problem+json`.

pub mod auth;
pub mod locks;
pub mod ops;
pub mod params;

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{Method, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use utoipa::OpenApi;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::Settings;
use crate::core::Core;
use crate::error::Error;

/// Shared state of every handler.
pub struct App {
    pub core: Arc<Core>,
    pub settings: Settings,
    pub started_at_ms: u64,
    /// The operator page's state (chart history, browser session).
    pub dashboard: crate::dashboard::Dashboard,
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "sidelock",
        description = "Distributed-lock sidecar: locks, leases, fencing tokens and semaphores over HTTP. \
            Parameters may be given in the query string, a JSON body or a form body. \
            Durations: 250ms, 30s, 5m, 1h, or a bare integer of milliseconds. \
            Errors are application/problem+json with type urn:sidelock:problem:<slug>."
    ),
    modifiers(&Security),
    tags(
        (name = "locks", description = "Exclusive and shared locks"),
        (name = "semaphores", description = "Counting semaphores"),
        (name = "operations", description = "Inspection, health, metrics"),
        (name = "admin", description = "Force-release (admin token)"),
    )
)]
struct ApiDoc;

struct Security;

impl utoipa::Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        for name in ["api_token", "admin_token"] {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
            );
        }
    }
}

/// The API routes (authenticated when an API token is set) and the OpenAPI
/// document describing every route.
fn routes(app: &Arc<App>) -> (Router<Arc<App>>, utoipa::openapi::OpenApi) {
    use locks::*;
    let (v1, v1_doc) = OpenApiRouter::new()
        .routes(routes!(acquire_lock, release_lock, inspect_lock))
        .routes(routes!(keepalive_lock))
        .routes(routes!(hold_lock))
        .routes(routes!(
            acquire_semaphore,
            release_semaphore,
            inspect_semaphore
        ))
        .routes(routes!(keepalive_semaphore))
        .routes(routes!(hold_semaphore))
        .routes(routes!(list_locks))
        .routes(routes!(stale))
        .routes(routes!(events))
        .routes(routes!(ops::info))
        .routes(routes!(crate::dashboard::stats::stats))
        .routes(routes!(force_release_lock))
        .routes(routes!(force_release_semaphore))
        .split_for_parts();
    let v1 = v1.route_layer(middleware::from_fn_with_state(
        app.clone(),
        auth::require_api_token,
    ));
    let (open, open_doc) = OpenApiRouter::new()
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(ops::metrics))
        .split_for_parts();
    let mut doc = ApiDoc::openapi();
    doc.merge(v1_doc);
    doc.merge(open_doc);
    (v1.merge(open), doc)
}

/// The whole HTTP application.
pub fn router(app: Arc<App>) -> Router {
    let (api, doc) = routes(&app);
    let doc = Arc::new(doc);
    // The operator page at `/`, with its own compression and headers.
    let api = api.merge(crate::dashboard::router());
    api.route(
        "/openapi.json",
        get(move || {
            let doc = doc.clone();
            async move { axum::Json(doc.as_ref().clone()) }
        }),
    )
    .fallback(not_found)
    .method_not_allowed_fallback(method_not_allowed)
    .layer(middleware::from_fn_with_state(app.clone(), count_requests))
    .with_state(app)
}

async fn not_found(uri: Uri) -> Error {
    Error::NotFound(uri.path().to_owned())
}

async fn method_not_allowed(method: Method, uri: Uri) -> Error {
    Error::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

/// Counts requests by method, route template and status.
async fn count_requests(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    // Cheap clones (standard methods and the shared route template), not new strings.
    let method = request.method().clone();
    let route = request.extensions().get::<MatchedPath>().cloned();
    let route = route.as_ref().map_or("unmatched", MatchedPath::as_str);
    let response = next.run(request).await.into_response();
    let m = &app.core.metrics;
    m.http_requests
        .with_label_values(&[method.as_str(), route, response.status().as_str()])
        .inc();
    m.http_seconds
        .with_label_values(&[method.as_str(), route])
        .observe(started.elapsed().as_secs_f64());
    response
}
