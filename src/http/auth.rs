//! Bearer tokens: the API token on every `/v1` route, the admin token on the
//! admin routes. Compared in constant time.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

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

/// Middleware for `/v1`: with an API token configured, requests must carry
/// it (or the admin token, which may do everything the API token may).
pub async fn require_api_token(
    State(app): State<Arc<App>>,
    request: Request,
    next: Next,
) -> Response {
    let s = &app.settings;
    if let Some(api) = &s.api_token {
        let allowed = bearer(request.headers()).is_some_and(|presented| {
            same(presented, api) || s.admin_token.as_deref().is_some_and(|a| same(presented, a))
        });
        if !allowed {
            let why = if request.headers().contains_key(header::AUTHORIZATION) {
                "the bearer token is not this sidecar's API token"
            } else {
                "this sidecar requires Authorization: Bearer <api token> on /v1 routes"
            };
            return Error::Unauthorized(why).into_response();
        }
    }
    next.run(request).await
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
