//! Bearer tokens: the API token on every `/v1` route, the admin token on the
//! admin routes. Compared in constant time, through the per-peer
//! [`Throttle`](super::throttle::Throttle) of failed token checks.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::{ConnectInfo, Request};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;
use tower::{Layer, Service};

use super::App;
use super::throttle::{Place, Throttle};
use crate::config::Settings;
use crate::error::Error;

pub(crate) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

pub(crate) fn same(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

/// Whether `presented` is the API token or the admin token (which may do
/// everything the API token may).
pub(crate) fn api_or_admin(s: &Settings, api: &str, presented: &str) -> bool {
    same(presented, api) || s.admin_token.as_deref().is_some_and(|a| same(presented, a))
}

/// The peer of a request (set by the server for every connection).
fn peer(request: &Request) -> SocketAddr {
    request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(SocketAddr::from(([0, 0, 0, 0], 0)), |c| c.0)
}

/// Why a `/v1` request is refused: with an API token configured, requests
/// must carry it (or the admin token). A presented token goes through the
/// peer's throttle.
fn refusal(
    s: &Settings,
    throttle: &Throttle,
    peer: SocketAddr,
    headers: &HeaderMap,
) -> Result<(), Error> {
    let Some(api) = s.api_token.as_deref() else {
        return Ok(());
    };
    match bearer(headers) {
        Some(presented) => {
            if throttle.check(peer, Place::Bearer, || api_or_admin(s, api, presented))? {
                Ok(())
            } else {
                Err(Error::Unauthorized(
                    "the bearer token is not this sidecar's API token",
                ))
            }
        }
        None => Err(Error::Unauthorized(
            "this sidecar requires Authorization: Bearer <api token> on /v1 routes",
        )),
    }
}

/// The layer on `/v1` that answers 401 to requests without the API token,
/// and 429 to a peer throttled for its wrong tokens.
///
/// A layer of its own rather than `middleware::from_fn`, which boxes a
/// future and a clone of the inner service for every request: a waiting
/// acquire keeps both for as long as it waits.
#[derive(Clone)]
pub struct RequireApiToken {
    pub app: Arc<App>,
}

impl<S> Layer<S> for RequireApiToken {
    type Service = ApiTokenChecked<S>;

    fn layer(&self, inner: S) -> ApiTokenChecked<S> {
        ApiTokenChecked {
            inner,
            app: self.app.clone(),
        }
    }
}

/// A service behind [`RequireApiToken`].
#[derive(Clone)]
pub struct ApiTokenChecked<S> {
    inner: S,
    app: Arc<App>,
}

impl<S> Service<Request> for ApiTokenChecked<S>
where
    S: Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Checked<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let app = &self.app;
        match refusal(
            &app.settings,
            &app.throttle,
            peer(&request),
            request.headers(),
        ) {
            Err(refused) => Checked::Refused {
                response: Some(refused.into_response()),
            },
            Ok(()) => Checked::Allowed {
                inner: self.inner.call(request),
            },
        }
    }
}

pin_project_lite::pin_project! {
    /// The 401 answer, or the inner service's response future.
    #[project = CheckedProj]
    pub enum Checked<F> {
        Refused { response: Option<Response> },
        Allowed { #[pin] inner: F },
    }
}

impl<F, E> Future for Checked<F>
where
    F: Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            CheckedProj::Refused { response } => {
                Poll::Ready(Ok(response.take().unwrap_or_default()))
            }
            CheckedProj::Allowed { inner } => inner.poll(cx),
        }
    }
}

/// Checks the admin token of an admin request from `peer`, through the
/// peer's throttle.
///
/// # Errors
/// 403 when no admin token is configured or the API token was presented;
/// 401 when the token is missing or wrong; 429 when the peer is throttled.
pub fn require_admin(app: &App, peer: SocketAddr, headers: &HeaderMap) -> Result<(), Error> {
    let settings = &app.settings;
    let Some(admin) = settings.admin_token.as_deref() else {
        return Err(Error::Forbidden(
            "the admin API is disabled: start the sidecar with SIDELOCK_ADMIN_TOKEN set to enable it",
        ));
    };
    let Some(presented) = bearer(headers) else {
        return Err(Error::Unauthorized(
            "the admin API requires Authorization: Bearer <admin token>",
        ));
    };
    let api = settings.api_token.as_deref();
    // The API token is a known token, not a guess: it is refused, not counted.
    let mut api_token = false;
    let known = app.throttle.check(peer, Place::Admin, || {
        let is_admin = same(presented, admin);
        api_token = !is_admin && api.is_some_and(|a| same(presented, a));
        is_admin || api_token
    })?;
    if api_token {
        Err(Error::Forbidden(
            "the API token may not use the admin API; use the admin token",
        ))
    } else if known {
        Ok(())
    } else {
        Err(Error::Unauthorized(
            "the bearer token is not the admin token",
        ))
    }
}
