//! Bearer tokens: the API token on every `/v1` route, the admin token on the
//! admin routes. Compared in constant time.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::Request;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;
use tower::{Layer, Service};

use super::App;
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

/// Why a `/v1` request is refused: with an API token configured, requests
/// must carry it (or the admin token, which may do everything the API token may).
fn refusal(s: &Settings, headers: &HeaderMap) -> Option<&'static str> {
    let api = s.api_token.as_ref()?;
    let allowed = bearer(headers).is_some_and(|presented| {
        same(presented, api) || s.admin_token.as_deref().is_some_and(|a| same(presented, a))
    });
    if allowed {
        None
    } else if headers.contains_key(header::AUTHORIZATION) {
        Some("the bearer token is not this sidecar's API token")
    } else {
        Some("this sidecar requires Authorization: Bearer <api token> on /v1 routes")
    }
}

/// The layer on `/v1` that answers 401 to requests without the API token.
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
        match refusal(&self.app.settings, request.headers()) {
            Some(why) => Checked::Refused {
                response: Some(Error::Unauthorized(why).into_response()),
            },
            None => Checked::Allowed {
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

/// Checks the admin token of an admin request.
///
/// # Errors
/// 403 when no admin token is configured or the API token was presented;
/// 401 when the token is missing or wrong.
pub fn require_admin(settings: &Settings, headers: &HeaderMap) -> Result<(), Error> {
    let Some(admin) = &settings.admin_token else {
        return Err(Error::Forbidden(
            "the admin API is disabled: start the sidecar with SIDELOCK_ADMIN_TOKEN set to enable it",
        ));
    };
    match bearer(headers) {
        Some(presented) if same(presented, admin) => Ok(()),
        Some(presented)
            if settings
                .api_token
                .as_deref()
                .is_some_and(|a| same(presented, a)) =>
        {
            Err(Error::Forbidden(
                "the API token may not use the admin API; use the admin token",
            ))
        }
        Some(_) => Err(Error::Unauthorized(
            "the bearer token is not the admin token",
        )),
        None => Err(Error::Unauthorized(
            "the admin API requires Authorization: Bearer <admin token>",
        )),
    }
}
