//! HTTP: routes, parameter extraction, auth, SSE and the OpenAPI document.
//!
//! Handlers are thin: they validate parameters into a [`Claim`](crate::lock::Claim)
//! and call [`Core`]. Every error leaves through [`Error`]'s one
//! `IntoResponse`, as `application/problem+json`.

pub mod auth;
pub mod elections;
#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod listener;
pub mod locks;
pub mod ops;
pub mod origin;
pub mod params;
pub mod problem;
pub mod server;
pub mod throttle;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::Router;
use axum::extract::{MatchedPath, Request};
use axum::http::{Method, Uri};
use axum::response::Response;
use axum::routing::get;
use tower::{Layer, Service};
use utoipa::OpenApi;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::Settings;
use crate::core::Core;
use crate::error::Error;
use crate::metrics::Metrics;

/// Shared state of every handler.
pub struct App {
    pub core: Arc<Core>,
    pub settings: Settings,
    pub started_at_ms: u64,
    /// Permits for open `/v1/events` streams, [`locks::MAX_EVENT_STREAMS`] in all.
    pub event_streams: Arc<tokio::sync::Semaphore>,
    /// Permits for open election observe streams,
    /// [`elections::MAX_OBSERVE_STREAMS`] in all.
    pub observe_streams: Arc<tokio::sync::Semaphore>,
    /// Places for requests that finish after their client left.
    pub finishers: Arc<locks::Finishers>,
    /// Failed token checks per peer, shared by every place a token is checked.
    pub throttle: throttle::Throttle,
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
        (name = "elections", description = "Leader election: campaigns, leaders, observers and the leader's readiness probe"),
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
fn routes(
    app: &Arc<App>,
    more_v1: OpenApiRouter<Arc<App>>,
) -> (Router<Arc<App>>, utoipa::openapi::OpenApi) {
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
        .routes(routes!(force_release_lock))
        .routes(routes!(force_release_semaphore))
        .routes(routes!(elections::campaign))
        .routes(routes!(elections::election))
        .routes(routes!(elections::observe))
        .merge(more_v1)
        .split_for_parts();
    let v1 = v1.route_layer(auth::RequireApiToken { app: app.clone() });
    let (open, open_doc) = OpenApiRouter::new()
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(ops::metrics))
        .routes(routes!(elections::ready))
        .split_for_parts();
    let mut doc = ApiDoc::openapi();
    doc.merge(v1_doc);
    doc.merge(open_doc);
    (v1.merge(open), doc)
}

/// The whole HTTP application: the API, `more_v1` routes under `/v1` (with
/// its token check, in the OpenAPI document) and `pages` (the operator
/// page), which the layers above supply.
pub fn router(app: Arc<App>, more_v1: OpenApiRouter<Arc<App>>, pages: Router<Arc<App>>) -> Router {
    let (api, doc) = routes(&app, more_v1);
    // Served as written once: the document's tree is a megabyte of small
    // allocations that would stay for the process's life, its JSON 31 KiB.
    let json = axum::body::Bytes::from(
        serde_json::to_vec(&doc).expect("the OpenAPI document has only string keys"),
    );
    drop(doc);
    let api = api.merge(pages);
    api.route(
        "/openapi.json",
        get(move || {
            let json = json.clone();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        axum::http::HeaderValue::from_static("application/json"),
                    )],
                    json,
                )
            }
        }),
    )
    .fallback(not_found)
    .method_not_allowed_fallback(method_not_allowed)
    .layer(origin::CheckOrigin {
        allowed_hosts: app.settings.allowed_hosts.clone().into(),
    })
    .layer(CountRequests {
        metrics: app.core.metrics.clone(),
    })
    .with_state(app)
}

async fn not_found(uri: Uri) -> Error {
    Error::NotFound(uri.path().to_owned())
}

/// Refuses `HEAD` on a route whose `GET` acts (a hold acquires, a campaign
/// stands): axum answers `HEAD` with the `GET` handler, which ran it all and
/// only dropped the body.
fn refuse_head(method: &Method, uri: &Uri) -> Result<(), Error> {
    if method == Method::HEAD {
        return Err(Error::MethodNotAllowed {
            method: method.to_string(),
            path: uri.path().to_owned(),
        });
    }
    Ok(())
}

async fn method_not_allowed(method: Method, uri: Uri) -> Error {
    Error::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

/// Counts requests by method, route template and status.
///
/// Every label value is drawn from a fixed set: the standard methods and
/// `other`, the route templates and `unmatched`, the status codes.
///
/// A layer of its own rather than `middleware::from_fn`, which boxes a
/// future and a clone of the inner service for every request: a waiting
/// acquire keeps both for as long as it waits.
#[derive(Clone)]
struct CountRequests {
    metrics: Arc<Metrics>,
}

impl<S> Layer<S> for CountRequests {
    type Service = Counted<S>;

    fn layer(&self, inner: S) -> Counted<S> {
        Counted {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

/// A service wrapped by [`CountRequests`].
#[derive(Clone)]
struct Counted<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S> Service<Request> for Counted<S>
where
    S: Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = CountedFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // A static label and a cheap clone of the shared route template, not new strings.
        let method = method_label(request.method());
        let route = request.extensions().get::<MatchedPath>().cloned();
        CountedFuture {
            inner: self.inner.call(request),
            counted: Some(Count {
                metrics: self.metrics.clone(),
                method,
                route,
                started: Instant::now(),
            }),
        }
    }
}

/// What a finished request is counted under.
struct Count {
    metrics: Arc<Metrics>,
    method: &'static str,
    route: Option<MatchedPath>,
    started: Instant,
}

pin_project_lite::pin_project! {
    /// The inner response future, counted when it completes.
    struct CountedFuture<F> {
        #[pin]
        inner: F,
        counted: Option<Count>,
    }
}

impl<F, E> Future for CountedFuture<F>
where
    F: Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = std::task::ready!(this.inner.poll(cx));
        if let (Ok(response), Some(c)) = (&result, this.counted.take()) {
            let route = c.route.as_ref().map_or("unmatched", MatchedPath::as_str);
            let method = c.method;
            c.metrics
                .http_requests
                .with_label_values(&[method, route, response.status().as_str()])
                .inc();
            c.metrics
                .http_seconds
                .with_label_values(&[method, route])
                .observe(c.started.elapsed().as_secs_f64());
        }
        Poll::Ready(result)
    }
}

/// The `method` label of a request: a standard method, or `other` for any
/// extension method, so a client cannot add series by inventing methods.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "other",
    }
}
