//! Typed HTTP helpers for the sidelock v1 API.

use reqwest::header::{AUTHORIZATION, CONTENT_TYPE};
use reqwest::{Client, Method, RequestBuilder, Response, StatusCode};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use url::Url;

use super::problem::assert_problem;
use super::sse::{HoldStream, SseStream};
use super::{EVENT_TIMEOUT, REQUEST_TIMEOUT, within};

/// Query parameters: `&[("ttl", "300ms"), ("owner", "a")]`.
pub type Params<'a> = &'a [(&'a str, &'a str)];

/// A request body.
#[derive(Debug, Clone)]
pub enum Body {
    Empty,
    /// `application/json`.
    Json(Value),
    /// `application/x-www-form-urlencoded` (what `curl -d` sends).
    Form(Vec<(String, String)>),
    /// Anything else, byte for byte.
    Raw {
        content_type: String,
        bytes: Vec<u8>,
    },
}

/// A client for one sidecar.
#[derive(Clone)]
pub struct Api {
    http: Client,
    base: Url,
    bearer: Option<String>,
}

impl Api {
    pub fn new(base_url: &str) -> Self {
        let http = Client::builder()
            .no_proxy()
            .connect_timeout(std::time::Duration::from_secs(5))
            .build()
            .expect("build HTTP client");
        Self {
            http,
            base: Url::parse(base_url).expect("valid base URL"),
            bearer: None,
        }
    }

    /// The same client, sending `Authorization: Bearer <token>`.
    pub fn with_bearer(&self, token: &str) -> Self {
        Self {
            bearer: Some(token.to_owned()),
            ..self.clone()
        }
    }

    /// `base/seg1/seg2?query`; every segment is percent-encoded, so a name
    /// such as `a/b` stays one segment (`a%2Fb`).
    pub fn url(&self, segments: &[&str], query: Params<'_>) -> Url {
        let mut url = self.base.clone();
        url.path_segments_mut()
            .expect("base URL can have a path")
            .clear()
            .extend(segments);
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        url
    }

    /// A request with the bearer token (if any) and [`REQUEST_TIMEOUT`];
    /// not for SSE streams (see [`Api::open_stream`]).
    pub fn request(&self, method: Method, segments: &[&str], query: Params<'_>) -> RequestBuilder {
        self.request_without_timeout(method, segments, query)
            .timeout(REQUEST_TIMEOUT)
    }

    fn request_without_timeout(
        &self,
        method: Method,
        segments: &[&str],
        query: Params<'_>,
    ) -> RequestBuilder {
        let request = self.http.request(method, self.url(segments, query));
        match &self.bearer {
            Some(token) => request.header(AUTHORIZATION, format!("Bearer {token}")),
            None => request,
        }
    }

    /// Sends one request and returns the response, whatever its status.
    pub async fn send(
        &self,
        method: Method,
        segments: &[&str],
        query: Params<'_>,
        body: Body,
    ) -> Response {
        let request = with_body(self.request(method.clone(), segments, query), body);
        request
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} /{}: {e}", segments.join("/")))
    }

    pub async fn get(&self, segments: &[&str], query: Params<'_>) -> Response {
        self.send(Method::GET, segments, query, Body::Empty).await
    }

    /// `GET` that must answer 200 with JSON.
    pub async fn get_json<T: DeserializeOwned>(&self, segments: &[&str], query: Params<'_>) -> T {
        expect_json(self.get(segments, query).await, StatusCode::OK).await
    }

    /// Opens an SSE stream (no overall timeout; each event read has one).
    pub async fn open_stream(&self, segments: &[&str], query: Params<'_>) -> SseStream {
        let response = self.open_stream_raw(segments, query).await;
        SseStream::from_response(response).await
    }

    /// Sends the `GET` for an SSE stream and returns the response as is (for
    /// requests that must fail before streaming).
    pub async fn open_stream_raw(&self, segments: &[&str], query: Params<'_>) -> Response {
        let request = self.request_without_timeout(Method::GET, segments, query);
        within(
            &format!("response headers of /{}", segments.join("/")),
            EVENT_TIMEOUT,
            request.send(),
        )
        .await
        .unwrap_or_else(|e| panic!("GET /{}: {e}", segments.join("/")))
    }

    pub fn lock(&self, name: &str) -> Resource {
        Resource {
            api: self.clone(),
            kind: Kind::Lock,
            name: name.to_owned(),
        }
    }

    pub fn semaphore(&self, name: &str) -> Resource {
        Resource {
            api: self.clone(),
            kind: Kind::Semaphore,
            name: name.to_owned(),
        }
    }

    /// The sum of the samples of the metric `family` whose labels contain
    /// `labels` (`""`: all of them).
    pub async fn metric_sum(&self, family: &str, labels: &str) -> f64 {
        let text = self
            .get(&["metrics"], &[])
            .await
            .text()
            .await
            .expect("metrics");
        let head = format!("{family}{{");
        text.lines()
            .filter(|l| l.starts_with(&head) && l.contains(labels))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// `GET /v1/info`.
    pub async fn info(&self) -> Value {
        self.get_json(&["v1", "info"], &[]).await
    }

    /// The sidecar id reported by `GET /v1/info`.
    pub async fn sidecar_id(&self) -> String {
        let info = self.info().await;
        info["sidecar"]
            .as_str()
            .unwrap_or_else(|| panic!("/v1/info has no string `sidecar`: {info}"))
            .to_owned()
    }

    /// `GET /v1/locks?…`.
    pub async fn list(&self, query: Params<'_>) -> ListPage {
        self.get_json(&["v1", "locks"], query).await
    }

    /// `GET /v1/stale`.
    pub async fn stale(&self) -> Vec<StaleEntry> {
        self.get_json::<StaleList>(&["v1", "stale"], &[])
            .await
            .stale
    }

    /// `GET /v1/events`.
    pub async fn events(&self) -> SseStream {
        self.open_stream(&["v1", "events"], &[]).await
    }
}

fn with_body(request: RequestBuilder, body: Body) -> RequestBuilder {
    match body {
        Body::Empty => request,
        Body::Json(value) => request.json(&value),
        Body::Form(pairs) => {
            let encoded = url::form_urlencoded::Serializer::new(String::new())
                .extend_pairs(pairs)
                .finish();
            request
                .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
                .body(encoded)
        }
        Body::Raw {
            content_type,
            bytes,
        } => request.header(CONTENT_TYPE, content_type).body(bytes),
    }
}

/// Asserts `status` and parses the JSON body, with the body in the message
/// if either fails.
pub async fn expect_json<T: DeserializeOwned>(response: Response, status: StatusCode) -> T {
    let actual = response.status();
    let url = response.url().clone();
    let text = response
        .text()
        .await
        .unwrap_or_else(|e| panic!("{url}: read body: {e}"));
    assert_eq!(actual, status, "{url}: unexpected status; body: {text}");
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{url}: body is not the expected JSON ({e}): {text}"))
}

/// Locks and semaphores share one lifecycle under different paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Lock,
    Semaphore,
}

impl Kind {
    /// The path segment: `locks` or `semaphores`.
    pub fn segment(self) -> &'static str {
        match self {
            Kind::Lock => "locks",
            Kind::Semaphore => "semaphores",
        }
    }

    /// The `kind` value in responses: `lock` or `semaphore`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Lock => "lock",
            Kind::Semaphore => "semaphore",
        }
    }
}

/// One named lock or semaphore on one sidecar. Cheap to clone and `'static`,
/// so it can move into spawned tasks.
#[derive(Clone)]
pub struct Resource {
    api: Api,
    kind: Kind,
    name: String,
}

impl Resource {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn api(&self) -> &Api {
        &self.api
    }

    /// `["v1", "locks", name, extra…]`.
    fn segments<'a>(&'a self, extra: &[&'a str]) -> Vec<&'a str> {
        let mut segments = vec!["v1", self.kind.segment(), self.name.as_str()];
        segments.extend_from_slice(extra);
        segments
    }

    /// `POST /v1/{kind}/{name}?params`, any status.
    pub async fn acquire_raw(&self, params: Params<'_>) -> Response {
        self.api
            .send(Method::POST, &self.segments(&[]), params, Body::Empty)
            .await
    }

    /// [`Resource::acquire_raw`] in a task of its own (a waiter), with
    /// its own copy of `params`.
    pub fn spawn_acquire_raw(&self, params: Params<'_>) -> tokio::task::JoinHandle<Response> {
        let me = self.clone();
        let params: Vec<(String, String)> = params
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        tokio::spawn(async move {
            let params: Vec<(&str, &str)> = params
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            me.acquire_raw(&params).await
        })
    }

    /// Acquire that must succeed (200).
    pub async fn acquire(&self, params: Params<'_>) -> Grant {
        expect_json(self.acquire_raw(params).await, StatusCode::OK).await
    }

    /// Acquire that must be refused with 409 `lock-busy`; returns the problem.
    pub async fn acquire_busy(&self, params: Params<'_>) -> Value {
        assert_problem(
            self.acquire_raw(params).await,
            StatusCode::CONFLICT,
            "lock-busy",
        )
        .await
    }

    /// `DELETE /v1/{kind}/{name}?token=…`, any status.
    pub async fn release_raw(&self, token: &str) -> Response {
        self.api
            .send(
                Method::DELETE,
                &self.segments(&[]),
                &[("token", token)],
                Body::Empty,
            )
            .await
    }

    /// `DELETE /v1/{kind}/{name}?token=…` with `Idempotency-Key: key`, any status.
    pub async fn release_with_key_raw(&self, token: &str, key: &str) -> Response {
        self.api
            .request(Method::DELETE, &self.segments(&[]), &[("token", token)])
            .header("idempotency-key", key)
            .send()
            .await
            .unwrap_or_else(|e| panic!("DELETE /{}: {e}", self.segments(&[]).join("/")))
    }

    /// Release with `Idempotency-Key: key` that must succeed (200).
    pub async fn release_with_key(&self, token: &str, key: &str) -> Released {
        expect_json(self.release_with_key_raw(token, key).await, StatusCode::OK).await
    }

    /// Release that must succeed (200).
    pub async fn release(&self, token: &str) -> Released {
        expect_json(self.release_raw(token).await, StatusCode::OK).await
    }

    /// Release that must be refused with 410 `lease-lost`.
    pub async fn release_lost(&self, token: &str) -> Value {
        assert_problem(
            self.release_raw(token).await,
            StatusCode::GONE,
            "lease-lost",
        )
        .await
    }

    /// `POST /v1/{kind}/{name}/keepalive?token=…&params`, any status.
    pub async fn keepalive_raw(&self, token: &str, params: Params<'_>) -> Response {
        let mut query = vec![("token", token)];
        query.extend_from_slice(params);
        self.api
            .send(
                Method::POST,
                &self.segments(&["keepalive"]),
                &query,
                Body::Empty,
            )
            .await
    }

    /// Keepalive that must succeed (200).
    pub async fn keepalive(&self, token: &str, params: Params<'_>) -> Keepalive {
        expect_json(self.keepalive_raw(token, params).await, StatusCode::OK).await
    }

    /// Keepalive that must be refused with 410 `lease-lost`.
    pub async fn keepalive_lost(&self, token: &str) -> Value {
        assert_problem(
            self.keepalive_raw(token, &[]).await,
            StatusCode::GONE,
            "lease-lost",
        )
        .await
    }

    /// `GET /v1/{kind}/{name}`.
    pub async fn inspect(&self) -> LockState {
        self.api.get_json(&self.segments(&[]), &[]).await
    }

    /// `GET /v1/{kind}/{name}` as untyped JSON, for fields `LockState` leaves out.
    pub async fn raw_inspect(&self) -> Value {
        self.api.get_json(&self.segments(&[]), &[]).await
    }

    /// `GET /v1/{kind}/{name}/hold?params`, response as is.
    pub async fn hold_raw(&self, params: Params<'_>) -> Response {
        self.api
            .open_stream_raw(&self.segments(&["hold"]), params)
            .await
    }

    /// Opens a hold stream (must answer 200 `text/event-stream`).
    pub async fn hold(&self, params: Params<'_>) -> HoldStream {
        HoldStream::new(
            self.api
                .open_stream(&self.segments(&["hold"]), params)
                .await,
        )
    }

    /// `DELETE /v1/admin/{kind}/{name}`, any status (uses this client's bearer).
    pub async fn force_release_raw(&self) -> Response {
        self.api
            .send(
                Method::DELETE,
                &["v1", "admin", self.kind.segment(), &self.name],
                &[],
                Body::Empty,
            )
            .await
    }

    /// Force-release that must succeed; returns how many holders it released.
    pub async fn force_release(&self) -> u64 {
        let body: Value = expect_json(self.force_release_raw().await, StatusCode::OK).await;
        body["released"]
            .as_u64()
            .unwrap_or_else(|| panic!("force-release answer has no numeric `released`: {body}"))
    }

    /// Polls inspect until the waiters, in queue order, are exactly `owners`.
    pub async fn wait_for_waiters(&self, owners: &[&str]) -> LockState {
        super::eventually(
            &format!("waiters of {} to be {owners:?}", self.name),
            EVENT_TIMEOUT,
            async || {
                let state = self.inspect().await;
                (state.waiter_owners() == owners).then_some(state)
            },
        )
        .await
    }

    /// Polls inspect until nobody holds this lock.
    pub async fn wait_until_free(&self) -> LockState {
        super::eventually(
            &format!("{} to have no holders", self.name),
            EVENT_TIMEOUT,
            async || {
                let state = self.inspect().await;
                state.holders.is_empty().then_some(state)
            },
        )
        .await
    }
}

/// Acquire's 200 body and the hold stream's `acquired` data.
#[derive(Debug, Clone, Deserialize)]
pub struct Grant {
    pub name: String,
    pub kind: String,
    pub token: String,
    pub fence: u64,
    /// `exclusive` or `shared` for locks; may be absent for semaphores.
    #[serde(default)]
    pub mode: Option<String>,
    pub owner: String,
    pub count: u64,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    pub waited_ms: u64,
}

/// Release's 200 body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct Released {
    pub released: bool,
    pub count: u64,
}

/// Keepalive's 200 body.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct Keepalive {
    pub expires_at_ms: u64,
    pub ttl_ms: u64,
}

/// Inspect's 200 body.
#[derive(Debug, Clone, Deserialize)]
pub struct LockState {
    pub name: String,
    pub kind: String,
    pub fence: u64,
    /// Semaphores only.
    #[serde(default)]
    pub limit: Option<u64>,
    pub holders: Vec<Holder>,
    pub waiters: Vec<Waiter>,
}

impl LockState {
    pub fn holder_owners(&self) -> Vec<&str> {
        let mut owners: Vec<&str> = self.holders.iter().map(|h| h.owner.as_str()).collect();
        owners.sort_unstable();
        owners
    }

    /// Waiter owners in queue order (by `position`).
    pub fn waiter_owners(&self) -> Vec<&str> {
        let mut waiters: Vec<&Waiter> = self.waiters.iter().collect();
        waiters.sort_by_key(|w| w.position);
        waiters.iter().map(|w| w.owner.as_str()).collect()
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct Holder {
    pub owner: String,
    pub sidecar: String,
    #[serde(default)]
    pub mode: Option<String>,
    pub since_ms: u64,
    pub expires_at_ms: u64,
    pub fence: u64,
    pub count: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Waiter {
    pub owner: String,
    pub sidecar: String,
    #[serde(default)]
    pub mode: Option<String>,
    pub position: u64,
    pub since_ms: u64,
}

/// `GET /v1/locks` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ListPage {
    pub locks: Vec<ListedLock>,
    pub next_cursor: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ListedLock {
    pub name: String,
    pub kind: String,
    pub holders: u64,
    pub waiters: u64,
    pub fence: u64,
}

#[derive(Debug, Clone, Deserialize)]
struct StaleList {
    stale: Vec<StaleEntry>,
}

/// One entry of `GET /v1/stale`.
#[derive(Debug, Clone, Deserialize)]
pub struct StaleEntry {
    pub key: String,
    pub reason: String,
    pub age_ms: u64,
}
