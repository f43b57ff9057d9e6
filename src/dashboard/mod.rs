//! The operator dashboard: `GET /`.
//!
//! The page is rendered on the server with askama (`templates/`), so it is a
//! complete snapshot without JavaScript. With JavaScript, `static/app.js`
//! follows `/v1/events` and re-fetches the live part of the page
//! (`GET /dashboard/live`, the same template) when something changes, with a
//! periodic refresh as the fallback; it also counts TTLs down and drives the
//! force-release button.
//!
//! Auth: without `SIDELOCK_API_TOKEN` the page is open like `/v1`. With it,
//! the page shows nothing about locks until the browser signs in with the
//! API (or admin) token: `POST /dashboard/sign-in` sets an HttpOnly,
//! SameSite=Strict session cookie that authorises the page and its live
//! fragment only (never `/v1`), and the script keeps the token in
//! `sessionStorage` for `/v1/events` and the admin call. Every sign-in gets
//! a session of its own, ended by sign-out or its expiry; wrong tokens are
//! throttled per peer (see [`crate::http::throttle`]).

mod assets;
mod chart;
mod format;
pub mod session;
pub mod stats;
pub mod view;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use askama::Template;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use tower_http::compression::CompressionLayer;
use tower_http::set_header::SetResponseHeaderLayer;

use crate::backend::StaleKey;
use crate::core::Core;
use crate::error::Error;
use crate::http::App;
use crate::http::auth::{api_or_admin, bearer};
use crate::http::throttle::Place;
use crate::metrics::Metrics;
pub use stats::Stats;
use view::{PageQuery, View};

/// How long a stale-key scan is reused by page refreshes.
const STALE_CACHE: Duration = Duration::from_secs(5);

/// Where the page's policy allows content from: this sidecar only.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
    connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

/// The stale keys shown (at most [`crate::core::shown_stale`]'s limit) and
/// whether there were more, or why the scan failed.
pub(crate) type StaleShown = Result<(Vec<StaleKey>, bool), String>;

/// A stale-key scan and when it ran.
type StaleScan = (Instant, StaleShown);

/// The dashboard's state in the app.
pub struct Dashboard {
    /// History for the charts and `/v1/stats`.
    pub stats: Arc<Stats>,
    /// The signed-in browsers' sessions (random per sign-in; never a token).
    sessions: session::Sessions,
    /// Name of the session cookie (per sidecar, so port-forwards of several
    /// sidecars to one host do not overwrite each other's sessions).
    cookie: String,
    stale: Mutex<Option<StaleScan>>,
}

impl Dashboard {
    pub fn new(metrics: &Metrics, sidecar: &str, session_ttl: Duration) -> Self {
        Dashboard {
            stats: Arc::new(Stats::new(metrics)),
            sessions: session::Sessions::new(session_ttl),
            cookie: format!("sidelock_session_{}", assets::short_hash(sidecar)),
            stale: Mutex::new(None),
        }
    }

    /// Stale keys, rescanned at most every [`STALE_CACHE`].
    pub(crate) async fn stale(&self, core: &Core) -> StaleShown {
        {
            let cached = self.stale.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((at, result)) = cached.as_ref()
                && at.elapsed() < STALE_CACHE
            {
                return result.clone();
            }
        }
        let result = core
            .stale()
            .await
            .map(crate::core::shown_stale)
            .map_err(|e| format!("the stale-key scan failed: {e}"));
        *self.stale.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Instant::now(), result.clone()));
        result
    }

    /// Whether a request may see the page: always without an API token;
    /// else with the API or admin token as a bearer, or the session cookie.
    /// A bearer token goes through the peer's throttle.
    ///
    /// # Errors
    /// 429 when a bearer token came from a throttled peer.
    fn authorized(&self, app: &App, peer: SocketAddr, headers: &HeaderMap) -> Result<bool, Error> {
        let settings = &app.settings;
        let Some(api) = settings.api_token.as_deref() else {
            return Ok(true);
        };
        if let Some(presented) = bearer(headers)
            && app.throttle.check(peer, Place::Bearer, || {
                api_or_admin(settings, api, presented)
            })?
        {
            return Ok(true);
        }
        Ok(self
            .presented(headers)
            .any(|value| self.sessions.valid(value)))
    }

    /// The values of this sidecar's session cookie in `headers`.
    fn presented<'h>(&self, headers: &'h HeaderMap) -> impl Iterator<Item = &'h str> {
        let cookie = self.cookie.clone();
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|pair| pair.trim().split_once('='))
            .filter(move |(name, _)| *name == cookie)
            .map(|(_, value)| value)
    }

    fn set_cookie(&self, value: &str, max_age: u64) -> HeaderValue {
        HeaderValue::from_str(&format!(
            "{}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}",
            self.cookie
        ))
        .unwrap_or(HeaderValue::from_static(""))
    }
}

/// What every page's frame needs.
pub struct Shell {
    pub title: String,
    pub assets: &'static str,
    pub api_token_required: bool,
    pub admin_enabled: bool,
}

/// The whole page.
#[derive(Template)]
#[template(path = "index.html")]
pub struct IndexPage<'a> {
    pub shell: Shell,
    pub v: &'a View,
}

/// The part of the page that live updates replace.
#[derive(Template)]
#[template(path = "live.html")]
pub struct LiveFragment<'a> {
    pub v: &'a View,
}

/// Sign-in form (API token configured, no session).
#[derive(Template)]
#[template(path = "signin.html")]
pub struct SignInPage<'a> {
    pub shell: Shell,
    pub error: Option<&'a str>,
}

fn shell(title: String, api_token_required: bool, admin_enabled: bool) -> Shell {
    Shell {
        title,
        assets: assets::base(),
        api_token_required,
        admin_enabled,
    }
}

/// Renders the whole page.
pub fn render_page(v: &View) -> String {
    let title = format!("sidelock · {}", v.sidecar);
    IndexPage {
        shell: shell(title, v.api_token_required, v.admin_enabled),
        v,
    }
    .render()
    .unwrap_or_else(|e| format!("<!doctype html><p>template error: {e}</p>"))
}

/// Renders the live fragment.
pub fn render_live(v: &View) -> String {
    LiveFragment { v }
        .render()
        .unwrap_or_else(|e| format!("<p>template error: {e}</p>"))
}

fn no_store(body: String, status: StatusCode) -> Response {
    (
        status,
        [(header::CACHE_CONTROL, HeaderValue::from_static("no-store"))],
        Html(body),
    )
        .into_response()
}

fn sign_in_page(app: &App, error: Option<&str>) -> Response {
    let page = SignInPage {
        shell: shell(
            "sidelock · sign in".into(),
            true,
            app.settings.admin_token.is_some(),
        ),
        error,
    };
    let body = page
        .render()
        .unwrap_or_else(|e| format!("<!doctype html><p>template error: {e}</p>"));
    let mut response = no_store(body, StatusCode::UNAUTHORIZED);
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"sidelock\""),
    );
    response
}

fn page_query(uri: &Uri) -> PageQuery {
    uri.query().map(page_query_of).unwrap_or_default()
}

/// The page's query read from `query`; one that cannot be read is marked
/// so (the page says why) rather than taken for none.
fn page_query_of(query: &str) -> PageQuery {
    serde_urlencoded::from_str(query).unwrap_or_else(|_| PageQuery {
        unreadable: true,
        ..PageQuery::default()
    })
}

/// `GET /`: the dashboard.
async fn page(
    State(app): State<Arc<App>>,
    Extension(dashboard): Extension<Arc<Dashboard>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    match dashboard.authorized(&app, peer, &headers) {
        Ok(true) => {}
        Ok(false) => return sign_in_page(&app, None),
        Err(throttled) => return throttled.into_response(),
    }
    let v = view::gather(&app, &dashboard, &page_query(&uri)).await;
    no_store(render_page(&v), StatusCode::OK)
}

/// `GET /dashboard/live`: the live part of the page, for the script.
async fn live(
    State(app): State<Arc<App>>,
    Extension(dashboard): Extension<Arc<Dashboard>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    match dashboard.authorized(&app, peer, &headers) {
        Ok(true) => {}
        Ok(false) => {
            return Error::Unauthorized("sign in to the dashboard again: the session has ended")
                .into_response();
        }
        Err(throttled) => return throttled.into_response(),
    }
    let v = view::gather(&app, &dashboard, &page_query(&uri)).await;
    no_store(render_live(&v), StatusCode::OK)
}

#[derive(serde::Deserialize)]
struct SignIn {
    #[serde(default)]
    token: String,
}

fn see_other(to: &'static str) -> Response {
    (StatusCode::SEE_OTHER, [(header::LOCATION, to)]).into_response()
}

/// The sign-in form, its body read within the limits of every request's.
///
/// # Errors
/// 413 and 408 as [`crate::http::params::read_body`]; 415 for another
/// media type; 400 for a form that is not one `token`, in words that do not
/// quote what was sent (a token).
async fn sign_in_form(headers: &HeaderMap, body: axum::body::Body) -> Result<SignIn, Error> {
    let bytes = crate::http::params::read_body(body).await?;
    let is_form = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| {
            t.trim()
                .eq_ignore_ascii_case("application/x-www-form-urlencoded")
        });
    if !is_form {
        return Err(Error::UnsupportedMediaType(
            "the sign-in form is sent as application/x-www-form-urlencoded: token=<the API or admin token>".into(),
        ));
    }
    serde_urlencoded::from_bytes(&bytes).map_err(|_| {
        Error::InvalidParameter(
            "the sign-in form takes one parameter, once: token=<the API or admin token>".into(),
        )
    })
}

/// `POST /dashboard/sign-in` (form `token=`): starts a browser session.
async fn sign_in(
    State(app): State<Arc<App>>,
    Extension(dashboard): Extension<Arc<Dashboard>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let form = match sign_in_form(&headers, body).await {
        Ok(form) => form,
        Err(e) => return e.into_response(),
    };
    let s = &app.settings;
    let Some(api) = s.api_token.as_deref() else {
        return see_other("/");
    };
    let token = form.token.trim();
    match app
        .throttle
        .check(peer, Place::SignIn, || api_or_admin(s, api, token))
    {
        Ok(true) => {}
        Ok(false) => {
            return sign_in_page(&app, Some("That is not this sidecar's API token."));
        }
        Err(throttled) => return throttled.into_response(),
    }
    let mut response = see_other("/");
    let cookie = dashboard.set_cookie(
        &dashboard.sessions.start(),
        dashboard.sessions.ttl().as_secs(),
    );
    response.headers_mut().insert(header::SET_COOKIE, cookie);
    response
}

/// `POST /dashboard/sign-out`: ends the browser's session, on the server
/// too, so a copy of the cookie opens nothing any more.
async fn sign_out(Extension(dashboard): Extension<Arc<Dashboard>>, headers: HeaderMap) -> Response {
    for value in dashboard.presented(&headers) {
        dashboard.sessions.end(value);
    }
    let mut response = see_other("/");
    let cookie = dashboard.set_cookie("", 0);
    response.headers_mut().insert(header::SET_COOKIE, cookie);
    response
}

/// The dashboard's routes. Compression and the page's security headers
/// apply here only: never to SSE streams or `/metrics`.
/// The routes of the API the dashboard serves (`/v1/stats`), for the
/// authenticated `/v1` part of the router and the OpenAPI document.
pub fn api(dashboard: Arc<Dashboard>) -> utoipa_axum::router::OpenApiRouter<Arc<App>> {
    utoipa_axum::router::OpenApiRouter::new()
        .routes(utoipa_axum::routes!(stats::stats))
        .layer(Extension(dashboard))
}

/// The operator page's routes.
pub fn router(dashboard: Arc<Dashboard>) -> Router<Arc<App>> {
    let header =
        |name, value| SetResponseHeaderLayer::if_not_present(name, HeaderValue::from_static(value));
    Router::new()
        .route("/", get(page))
        .route("/dashboard/live", get(live))
        .route("/dashboard/sign-in", post(sign_in))
        .route("/dashboard/sign-out", post(sign_out))
        .route("/static/{version}/{file}", get(assets::serve))
        .layer(CompressionLayer::new())
        .layer(header(header::CONTENT_SECURITY_POLICY, CSP))
        .layer(header(header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .layer(header(header::REFERRER_POLICY, "no-referrer"))
        .layer(header(header::X_FRAME_OPTIONS, "DENY"))
        .layer(Extension(dashboard))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::stats::{Bucket, Recent, StatsView};
    use super::view::{Filter, Health, Identity, Listing, PageQuery, build};
    use super::*;
    use crate::backend::{Holder, Safety, State, Waiter};
    use crate::lock::{Held, LockKey};

    const NOW: u64 = 1_795_246_486_004;
    const HOSTILE: &str = r#"<script>alert(1)</script>"><img src=x onerror=alert(2)>'&"#;

    fn identity(sidecar: &str) -> Identity {
        Identity {
            sidecar: sidecar.into(),
            backend_url: "memory://".into(),
            safety: Safety::SingleProcess,
            started_at_ms: NOW - 3_600_000,
            held_here: 0,
            waiting_here: 0,
            api_token_required: false,
            admin_enabled: true,
            stale_after: Duration::from_secs(3600),
        }
    }

    fn healthy() -> Health {
        Health {
            ok: true,
            label: "healthy".into(),
            detail: "answered a ping in 0.2 ms".into(),
            ready: true,
            outage: None,
        }
    }

    fn stats(buckets: Vec<Bucket>) -> StatsView {
        StatsView {
            bucket_ms: 5000,
            window_ms: 900_000,
            now_ms: NOW,
            buckets,
        }
    }

    fn key(name: &str) -> LockKey {
        LockKey::lock(name)
    }

    fn holder(owner: &str, sidecar: &str) -> Holder {
        Holder {
            owner: owner.into(),
            sidecar: sidecar.into(),
            mode: Held::Exclusive,
            since_ms: NOW - 65_000,
            expires_at_ms: NOW + 25_000,
            fence: 7,
            count: 1,
        }
    }

    fn waiter(owner: &str, position: usize) -> Waiter {
        Waiter {
            owner: owner.into(),
            sidecar: "other-sidecar".into(),
            mode: Held::Exclusive,
            position,
            since_ms: NOW - 4_000,
        }
    }

    fn render(
        id: Identity,
        query: PageQuery,
        locks: Vec<(LockKey, State)>,
        stale: Vec<StaleKey>,
        buckets: Vec<Bucket>,
    ) -> (View, String, String) {
        let listing = Listing {
            next_cursor: None,
            error: None,
            locks,
        };
        let v = build(
            id,
            Filter::parse(&query),
            healthy(),
            listing,
            Ok((stale, false)),
            &stats(buckets),
            &Recent::default(),
            &Recent::default(),
        );
        let page = render_page(&v);
        let live = render_live(&v);
        (v, page, live)
    }

    /// Every `<script` tag is the external asset, never inline.
    fn only_the_asset_script(page: &str) {
        for (i, _) in page.match_indices("<script") {
            assert!(
                page[i..].starts_with("<script src=\"/static/"),
                "unexpected script tag: {}",
                &page[i..(i + 80).min(page.len())]
            );
        }
    }

    #[test]
    fn empty_state_says_so() {
        let (_, page, live) = render(
            identity("sidecar-a"),
            PageQuery::default(),
            vec![],
            vec![],
            vec![],
        );
        assert!(page.starts_with("<!doctype html>"));
        for text in [
            "No lock is held",
            "Nobody is waiting",
            "Nothing stale",
            "No acquisitions in the last 5 minutes",
            "sidecar-a",
            "memory://",
            "single-process",
            "healthy",
            "1h 00m",
        ] {
            assert!(page.contains(text), "{text} missing");
        }
        assert!(!page.contains("<table class=\"holders\""));
        assert!(!page.contains("Next page"));
        // The fragment is the live part only.
        assert!(!live.contains("<html") && !live.contains("<body"));
        assert!(live.contains("No lock is held"));
        assert!(page.contains(&live), "the page embeds the same fragment");
        only_the_asset_script(&page);
    }

    #[test]
    fn thousands_of_locks_render() {
        let locks: Vec<(LockKey, State)> = (0..5000)
            .map(|i| {
                let state = State {
                    fence: i,
                    limit: None,
                    holders: vec![holder(&format!("worker-{i}"), "sidecar-a")],
                    waiters: if i % 10 == 0 {
                        vec![
                            waiter(&format!("queued-{i}-1"), 1),
                            waiter(&format!("queued-{i}-2"), 2),
                        ]
                    } else {
                        vec![]
                    },
                };
                (key(&format!("job-{i:05}")), state)
            })
            .collect();
        let started = std::time::Instant::now();
        let (v, page, _) = render(
            identity("sidecar-a"),
            PageQuery::default(),
            locks,
            vec![],
            vec![],
        );
        let took = started.elapsed();
        assert_eq!(v.tiles.holders, Some(5000));
        assert_eq!(v.tiles.waiters, Some(1000));
        assert_eq!(page.matches("<tbody class=\"lock\"").count(), 5000);
        assert_eq!(page.matches("data-action=\"force-release\"").count(), 5000);
        assert_eq!(page.matches("<div class=\"queue\"").count(), 500);
        assert!(page.contains("job-04999") && page.contains("queued-4990-2"));
        assert!(took < Duration::from_secs(5), "rendering took {took:?}");
    }

    #[test]
    fn hostile_strings_are_escaped() {
        let mut id = identity(HOSTILE);
        id.backend_url = format!("redis://{HOSTILE}");
        let locks = vec![(
            key("tenant-1"),
            State {
                fence: 1,
                limit: None,
                holders: vec![holder(HOSTILE, HOSTILE)],
                waiters: vec![waiter(HOSTILE, 1)],
            },
        )];
        let stale = vec![StaleKey {
            key: format!("locks/{HOSTILE}"),
            reason: crate::backend::StaleReason::HeldTooLong,
            age_ms: 7_200_000,
            detail: format!("held by owner {HOSTILE:?}"),
        }];
        let query = PageQuery {
            prefix: Some(HOSTILE.into()),
            cursor: Some(HOSTILE.into()),
            ..Default::default()
        };
        let (_, page, live) = render(id, query, locks, stale, vec![]);
        for html in [&page, &live] {
            assert!(!html.contains("<script>alert"), "raw script tag");
            assert!(!html.contains("<img"), "raw img tag");
            assert!(!html.contains("\"><img"), "attribute break-out");
            assert!(!html.contains("onerror=alert(2)>"), "raw markup");
        }
        assert!(page.contains("&#60;script&#62;alert(1)&#60;/script&#62;"));
        only_the_asset_script(&page);
        // The prefix was refused, and shown (escaped) with the reason.
        assert!(page.contains("Filter not applied"));
    }

    #[test]
    fn admin_button_is_disabled_with_a_reason_without_an_admin_token() {
        let mut id = identity("sidecar-a");
        id.admin_enabled = false;
        let locks = vec![(
            key("billing"),
            State {
                fence: 1,
                limit: None,
                holders: vec![holder("worker", "sidecar-a")],
                waiters: vec![],
            },
        )];
        let (_, page, _) = render(id, PageQuery::default(), locks, vec![], vec![]);
        assert!(page.contains("data-admin=\"disabled\""));
        assert!(page.contains("Force-release is disabled"));
        assert!(page.contains("SIDELOCK_ADMIN_TOKEN"));
        let button = &page[page.find("data-action=\"force-release\"").expect("button")..];
        let button = &button[..button.find('>').expect("tag end")];
        assert!(button.contains(" disabled"), "{button}");
    }

    #[test]
    fn charts_draw_the_buckets() {
        let buckets = (0..3)
            .map(|i| Bucket {
                start_ms: NOW - NOW % 5000 - 10_000 + i * 5000,
                partial: i == 2,
                granted: 10 * (i + 1),
                busy: 1,
                timeout: 0,
                other: 0,
                granted_per_second: 2.0 * (i + 1) as f64,
                wait_p50_ms: Some(1.0),
                wait_p90_ms: Some(20.0),
                wait_p99_ms: Some(250.0),
                wait_mean_ms: Some(5.0),
            })
            .collect();
        let (v, page, _) = render(
            identity("sidecar-a"),
            PageQuery::default(),
            vec![],
            vec![],
            buckets,
        );
        assert!(!v.charts.empty);
        assert_eq!(v.charts.bars.len(), 3);
        assert_eq!(page.matches("<rect class=\"granted\"").count(), 3);
        assert_eq!(page.matches("<path class=\"line p99\"").count(), 1);
        assert!(!page.contains("No acquisitions in the last 5 minutes"));
        // The wait axis reaches the highest p99 (250 ms -> 1 s).
        assert!(
            v.charts
                .wait_ticks
                .first()
                .is_some_and(|t| t.label == "1 s")
        );
    }
}
