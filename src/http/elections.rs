//! Election routes: campaign (a hold stream on the election's lock that
//! reports leadership), the election's leader, its changes as SSE, and the
//! readiness probe that answers 200 only where a campaign leads.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures::Stream;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::core::HoldEvent;
use crate::core::HoldEvents;
use crate::core::election::{
    Candidate, ElectionView, Following, Leader, Leading, MAX_VALUE_BYTES, election_key,
};
use crate::duration::MAX_DURATION;
use crate::error::Error;
use crate::http::App;
use crate::http::locks::hold::{
    Finishing, SSE_KEEPALIVE, first_failure, hold_event, limit_stall, limit_stall_to_grant,
    sse_json,
};
use crate::http::locks::{Ask, DurationValue, check_renewed_ttl};
use crate::http::params::{Given, LockName, NoParams, Params, duration};
use crate::http::problem::Problem;
use crate::http::server::Stall;
use crate::lock::{Name, check_plain_text};

/// Open `…/observe` streams per sidecar at most: each observed election
/// costs the backend a read per lease period of its leader, and streams
/// never end by themselves.
pub const MAX_OBSERVE_STREAMS: usize = 1024;

/// Parameters of a campaign.
#[derive(Debug, Deserialize, IntoParams, ToSchema)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct CampaignParams {
    /// What observers see while this campaign leads, e.g. the pod's
    /// address: plain text of at most 1 KiB.
    #[param(min_length = 1, max_length = 1024)]
    #[schema(min_length = 1, max_length = 1024)]
    pub value: Option<String>,
    /// Who campaigns (shown with the leader). Plain text of at most 200 characters.
    #[param(min_length = 1, max_length = 200)]
    #[schema(min_length = 1, max_length = 200)]
    pub owner: Option<String>,
    /// The leadership's lease, renewed every ttl/3 while the stream is open
    /// (default `--default-ttl` or 100 ms if longer; at least 100 ms, at most `--max-ttl`): how long a leader
    /// whose sidecar dies keeps the election.
    #[serde(default, deserialize_with = "duration")]
    #[param(value_type = Option<DurationValue>, inline, example = "15s")]
    #[schema(value_type = Option<DurationValue>, inline, example = "15s")]
    pub ttl: Option<Given<Duration>>,
    /// After a leadership ends by expiry or loss, nobody leads for this long (default `--lock-delay`).
    #[serde(default, deserialize_with = "duration")]
    #[param(value_type = Option<DurationValue>, inline, example = "0s")]
    #[schema(value_type = Option<DurationValue>, inline, example = "0s")]
    pub lock_delay: Option<Given<Duration>>,
}

/// An election as every sidecar sees it.
#[derive(Debug, Serialize, ToSchema)]
pub struct Election {
    pub name: String,
    /// The leader, or null while nobody leads.
    pub leader: Option<Leader>,
    /// Campaigns leading or waiting, across all sidecars.
    pub candidates: usize,
}

/// The `leader` event of a campaign that wins.
#[derive(Debug, Serialize, ToSchema)]
pub struct Leadership {
    /// Strictly greater than every earlier leader's: pass it to the storage you write.
    pub fence: u64,
    pub since_ms: u64,
    pub value: Option<String>,
    /// When the lease ends unless renewed (`renewed` events move it on): a
    /// leader that reaches it without a renewal must stop leading.
    pub expires_at_ms: u64,
    /// The time left until `expires_at_ms`.
    pub ttl_ms: u64,
}

/// `…/ready` while a campaign through this sidecar leads.
#[derive(Debug, Serialize, ToSchema)]
pub struct Ready {
    pub leader: bool,
}

fn check_value(value: Option<String>) -> Result<Option<String>, Error> {
    let Some(value) = value else {
        return Ok(None);
    };
    if value.len() > MAX_VALUE_BYTES {
        return Err(Error::InvalidParameter(format!(
            "value is {} bytes long; at most {MAX_VALUE_BYTES} bytes (1 KiB) of UTF-8 are allowed",
            value.len()
        )));
    }
    check_plain_text("value", &value, MAX_VALUE_BYTES).map_err(Error::InvalidParameter)?;
    Ok(Some(value))
}

#[utoipa::path(get, path = "/v1/elections/{name}/campaign", tag = "elections",
    params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,200}$"), CampaignParams),
    responses(
        (status = 200, content_type = "text/event-stream", description = "SSE: follower {leader} while waiting and whenever the leader changes; leader {fence, since_ms, value, expires_at_ms, ttl_ms} when this campaign wins; renewed {expires_at_ms, ttl_ms} at each of the watchdog's renewals while it leads; lost {reason}. Closing the stream resigns."),
        (status = 400, body = Problem, content_type = "application/problem+json", description = "Bad name or parameter"),
        (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
        (status = 413, body = Problem, content_type = "application/problem+json", description = "Body too large"),
        (status = 415, body = Problem, content_type = "application/problem+json", description = "Unsupported body type"),
        (status = 429, body = Problem, content_type = "application/problem+json", description = "sidecar-full (--max-total-waiters, --max-held) or too-many-failed-tokens (wrong tokens from this address)"),
        (status = 503, body = Problem, content_type = "application/problem+json", description = "Backend unavailable or shutting down"),
    ))]
/// Campaign: stand for leader while the stream is open; closing it resigns.
pub async fn campaign(
    method: axum::http::Method,
    uri: axum::http::Uri,
    State(app): State<Arc<App>>,
    LockName(name): LockName,
    stall: Option<axum::Extension<Stall>>,
    Params(p): Params<CampaignParams>,
) -> Result<axum::response::Response, Error> {
    use axum::response::IntoResponse as _;
    super::refuse_head(&method, &uri)?;
    let stall = stall.map(|axum::Extension(s)| s);
    check_not_reserved(&name)?;
    let value = check_value(p.value)?;
    let ask = Ask::campaign(p.ttl, p.lock_delay, p.owner);
    let given = ask.gives_ttl();
    let (mut claim, _) =
        ask.into_claim(election_key(&name), &app.core.limits, &app.core.sidecar)?;
    check_renewed_ttl(&mut claim, given, &app.core.limits)?;
    // A campaign stands until it leads or leaves: --max-wait does not apply.
    let wait = MAX_DURATION;
    limit_stall(stall.as_ref(), claim.ttl);
    let candidate = Candidate::new(std::mem::take(&mut claim.owner), value);
    claim.owner = candidate.encode();
    if app.core.shutdown.is_cancelled() {
        return Err(Error::ShuttingDown);
    }
    app.core.check_room(true, None).await?;
    let events = Arc::new(HoldEvents::default());
    let core = app.core.clone();
    let reported = events.clone();
    let claim = Box::new(claim);
    let hold = async move { core.hold(claim, wait, &reported).await };
    let mut hold = Finishing::new(hold, events.left().clone(), &app.finishers)?;
    if let Some(e) = first_failure(&mut hold, &events).await {
        return Err(e);
    }
    let stream = CampaignStream {
        hold,
        events,
        app: app.clone(),
        name,
        candidate,
        following: None,
        shown: None,
        leading: None,
        stall,
    };
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(SSE_KEEPALIVE))
        .into_response())
}

/// A campaign's event stream, which also runs its hold (as a hold stream does).
struct CampaignStream {
    hold: Finishing<()>,
    events: Arc<HoldEvents>,
    app: Arc<App>,
    name: Name,
    candidate: Candidate,
    /// The election's observer while this campaign waits.
    following: Option<Following>,
    /// The leader last reported in a `follower` event.
    shown: Option<Option<Leader>>,
    /// Set while this campaign leads.
    leading: Option<Leading>,
    /// The connection's write timeout, shortened for the lease.
    stall: Option<Stall>,
}

/// Whether `leader` is the leadership `shown` last (`None`: nothing shown
/// yet; `Some(None)`: no leader), by [`Leader::same_as`].
fn shown_already(shown: Option<&Option<Leader>>, leader: Option<&Leader>) -> bool {
    match (shown, leader) {
        (Some(Some(shown)), Some(leader)) => shown.same_as(leader),
        (Some(None), None) => true,
        _ => false,
    }
}

impl CampaignStream {
    /// The SSE event for a hold event, if the campaign reports it.
    fn campaign_event(&mut self, event: HoldEvent) -> Option<SseEvent> {
        match event {
            HoldEvent::Queued { .. } => {
                if self.following.is_none() && self.leading.is_none() {
                    self.following = Some(self.app.core.follow(&self.name));
                }
                None
            }
            HoldEvent::Acquired(granted) => {
                self.following = None;
                self.leading = Some(self.app.core.lead(&self.name));
                self.app.core.announce(&self.name);
                let lease = &granted.lease;
                Some(sse_json(
                    "leader",
                    &Leadership {
                        fence: lease.fence,
                        since_ms: lease.since_ms,
                        value: self.candidate.value.clone(),
                        expires_at_ms: granted.expires_at_ms,
                        ttl_ms: granted.expires_at_ms.saturating_sub(crate::clock::now_ms()),
                    },
                ))
            }
            HoldEvent::Lost(_) => {
                self.leading = None;
                Some(hold_event(event))
            }
            other => Some(hold_event(other)),
        }
    }

    /// A `follower` event if the observed leader changed since the last one.
    fn follower_event(&mut self, view: ElectionView) -> Option<SseEvent> {
        // This campaign's own grant is reported by its hold, as `leader`.
        if view.leader_campaign.as_deref() == Some(self.candidate.campaign.as_str()) {
            return None;
        }
        if shown_already(self.shown.as_ref(), view.leader.as_ref()) {
            return None;
        }
        self.shown = Some(view.leader.clone());
        Some(sse_json(
            "follower",
            &serde_json::json!({ "leader": view.leader }),
        ))
    }
}

impl Stream for CampaignStream {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = &mut *self;
        if !this.hold.is_done() {
            let _ = std::pin::Pin::new(&mut this.hold).poll(cx);
        }
        while let Some(event) = this.events.next() {
            limit_stall_to_grant(this.stall.as_ref(), &event);
            if let Some(sse) = this.campaign_event(event) {
                return Poll::Ready(Some(Ok(sse)));
            }
        }
        if this.hold.is_done() {
            this.following = None;
            this.leading = None;
            return Poll::Ready(None);
        }
        while let Some(Poll::Ready(view)) = this.following.as_mut().map(|f| f.poll_view(cx)) {
            if let Some(sse) = this.follower_event(view) {
                return Poll::Ready(Some(Ok(sse)));
            }
        }
        Poll::Pending
    }
}

#[utoipa::path(get, path = "/v1/elections/{name}", tag = "elections",
    params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,200}$")),
    responses(
        (status = 200, body = Election, description = "The leader (or null) and the number of candidates, across all sidecars"),
        (status = 400, body = Problem, content_type = "application/problem+json", description = "Bad name or parameter"),
        (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
        (status = 503, body = Problem, content_type = "application/problem+json", description = "Backend unavailable or shutting down"),
    ))]
/// The election's leader across all sidecars.
pub async fn election(
    State(app): State<Arc<App>>,
    LockName(name): LockName,
    Params(_none): Params<NoParams>,
) -> Result<Json<Election>, Error> {
    let state = app.core.inspect(&election_key(&name)).await?;
    let view = ElectionView::of(&state);
    Ok(Json(Election {
        name: name.to_string(),
        leader: view.leader,
        candidates: view.candidates,
    }))
}

#[utoipa::path(get, path = "/v1/elections/{name}/observe", tag = "elections",
    params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,200}$")),
    responses(
        (status = 200, content_type = "text/event-stream", description = "SSE: a leader event with the leader (or null) at once, then on every change"),
        (status = 400, body = Problem, content_type = "application/problem+json", description = "Bad name or parameter"),
        (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
        (status = 429, body = Problem, content_type = "application/problem+json", description = "too-many-event-streams: 1024 observe streams are already open; or too-many-failed-tokens (Retry-After)"),
        (status = 503, body = Problem, content_type = "application/problem+json", description = "Shutting down"),
    ))]
/// Observe the election: its leader now and on every change.
pub async fn observe(
    State(app): State<Arc<App>>,
    LockName(name): LockName,
    Params(_none): Params<NoParams>,
) -> Result<axum::response::Response, Error> {
    use axum::response::IntoResponse as _;
    check_not_reserved(&name)?;
    if app.core.shutdown.is_cancelled() {
        return Err(Error::ShuttingDown);
    }
    let permit = app
        .observe_streams
        .clone()
        .try_acquire_owned()
        .map_err(|_| Error::TooManyEventStreams {
            limit: MAX_OBSERVE_STREAMS,
        })?;
    let stream = ObserveStream {
        _permit: permit,
        following: app.core.follow(&name),
        shown: None,
        shutdown: Box::pin(app.core.shutdown.clone().cancelled_owned()),
    };
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(SSE_KEEPALIVE))
        .into_response())
}

/// An observer's event stream: `leader` on every change, until shutdown.
struct ObserveStream {
    /// Counts this stream against [`MAX_OBSERVE_STREAMS`] while it is open.
    _permit: tokio::sync::OwnedSemaphorePermit,
    following: Following,
    /// The leader last reported.
    shown: Option<Option<Leader>>,
    shutdown: std::pin::Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
}

impl Stream for ObserveStream {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        if self.shutdown.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        while let Poll::Ready(view) = self.following.poll_view(cx) {
            if !shown_already(self.shown.as_ref(), view.leader.as_ref()) {
                self.shown = Some(view.leader.clone());
                let event = sse_json("leader", &serde_json::json!(view.leader));
                return Poll::Ready(Some(Ok(event)));
            }
        }
        Poll::Pending
    }
}

#[utoipa::path(get, path = "/v1/elections/{name}/ready", tag = "elections",
    params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,200}$")),
    responses(
        (status = 200, body = Ready, description = "A campaign through this sidecar leads the election"),
        (status = 400, body = Problem, content_type = "application/problem+json", description = "Bad name"),
        (status = 503, body = Problem, content_type = "application/problem+json", description = "not-leader: no campaign through this sidecar leads it"),
    ))]
/// Readiness probe: 200 only on the sidecar whose campaign leads (no token needed).
pub async fn ready(
    State(app): State<Arc<App>>,
    LockName(name): LockName,
    Params(_none): Params<NoParams>,
) -> Result<Json<Ready>, Error> {
    if app.core.leads(&name) {
        Ok(Json(Ready { leader: true }))
    } else {
        Err(Error::NotLeader(name.to_string()))
    }
}

/// Refuses the election the sidecars elect their monitor with: a client's
/// campaign there would stand in for the monitor and do none of its work.
fn check_not_reserved(name: &Name) -> Result<(), Error> {
    if crate::core::monitor::is_reserved(name) {
        return Err(Error::InvalidName(format!(
            "election name {name} is reserved: the sidecars elect under it the one that scans \
             for stale keys (GET /v1/elections/{name} shows which); choose another name"
        )));
    }
    Ok(())
}
