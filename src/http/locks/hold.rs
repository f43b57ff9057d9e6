//! The hold stream (`GET …/hold`): an acquire whose lease lives as long as
//! the response, renewed by the sidecar's watchdog, with its events as SSE;
//! and [`Finishing`], which lets a request's work finish after its client
//! left.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures::Stream;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::clock::ms;
use crate::core::{HoldEvent, HoldEvents};
use crate::error::Error;
use crate::http::App;
use crate::http::server::Stall;
use crate::lock::LockKey;

use super::answers::{Renewed, acquired};
use super::ask::Ask;

/// Keep-alive comments on SSE streams: at least this often.
pub(in crate::http) const SSE_KEEPALIVE: Duration = Duration::from_secs(15);

/// Work a request runs in its own task that must not stop midway (an
/// acquire could lose a grant, a hold its release). Dropped unfinished (the
/// client left), it cancels `left` and finishes in a task, where the work
/// gives up its wait or releases what it got. (A task per request from the
/// start would cost every request a hand-over between tasks, and every hold
/// a task.)
///
/// Each counts against [`Finishers`] from its start to the end of its work,
/// wherever that ends.
pub(in crate::http) struct Finishing<T: Send + 'static> {
    /// The work until it has returned.
    work: Option<futures::future::BoxFuture<'static, T>>,
    /// Tells the work that its client left.
    left: CancellationToken,
    /// This work's place among the [`Finishers`] until it has returned.
    place: Option<Place>,
}

impl<T: Send + 'static> Finishing<T> {
    /// # Errors
    /// [`Error::TooManyRequests`] when `finishers` are all in use.
    pub(in crate::http) fn new(
        work: impl Future<Output = T> + Send + 'static,
        left: CancellationToken,
        finishers: &Arc<Finishers>,
    ) -> Result<Self, Error> {
        Ok(Self {
            place: Some(finishers.enter()?),
            work: Some(Box::pin(work)),
            left,
        })
    }

    pub(in crate::http) fn is_done(&self) -> bool {
        self.work.is_none()
    }
}

impl<T: Send + 'static> Future for Finishing<T> {
    type Output = T;

    /// # Panics
    /// When polled after it returned (the `Future` contract).
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<T> {
        let work = self
            .work
            .as_mut()
            .expect("Finishing polled after it returned");
        let output = std::task::ready!(work.as_mut().poll(cx));
        self.work = None;
        self.place = None;
        std::task::Poll::Ready(output)
    }
}

impl<T: Send + 'static> Drop for Finishing<T> {
    fn drop(&mut self) {
        let (Some(work), Some(place)) = (self.work.take(), self.place.take()) else {
            return;
        };
        self.left.cancel();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            place.0.tasks.clone().spawn_on(
                async move {
                    work.await;
                    drop(place);
                },
                &runtime,
            );
        }
    }
}

/// The places of [`Finishing`] work, as many as the sidecar's connection cap.
/// Work in flight has a connection each, so only work whose clients left can
/// fill them: without the cap, clients that send a request and close at
/// once would leave work behind without bound (each ends within its
/// backend's time limits, but their number grows with the rate of closes).
pub struct Finishers {
    /// Where work whose client left finishes.
    tasks: tokio_util::task::TaskTracker,
    /// Work started and not yet returned, here or in `tasks`.
    running: AtomicUsize,
    /// The most work at once.
    most: usize,
}

impl Finishers {
    pub fn new(tasks: tokio_util::task::TaskTracker, most: usize) -> Self {
        Self {
            tasks,
            running: AtomicUsize::new(0),
            most,
        }
    }

    fn enter(self: &Arc<Self>) -> Result<Place, Error> {
        if self.running.fetch_add(1, Ordering::AcqRel) >= self.most {
            self.running.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::TooManyRequests { limit: self.most });
        }
        Ok(Place(self.clone()))
    }
}

/// One [`Finishing`] work's place among the [`Finishers`], given back on drop.
struct Place(Arc<Finishers>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::AcqRel);
    }
}

pub(in crate::http) fn sse_json(name: &str, data: &impl Serialize) -> SseEvent {
    SseEvent::default()
        .event(name)
        .json_data(data)
        .unwrap_or_else(|_| SseEvent::default().comment("unserialisable event"))
}

pub(in crate::http) fn hold_event(event: HoldEvent) -> SseEvent {
    match event {
        HoldEvent::Queued {
            position,
            queue_length,
        } => sse_json(
            "queued",
            &serde_json::json!({ "position": position, "queue_length": queue_length }),
        ),
        HoldEvent::Acquired(g) => sse_json("acquired", &acquired(&g)),
        HoldEvent::Renewed {
            expires_at_ms,
            ttl_ms,
        } => sse_json(
            "renewed",
            &Renewed {
                expires_at_ms,
                ttl_ms,
            },
        ),
        HoldEvent::Lost(reason) => sse_json("lost", &serde_json::json!({ "reason": reason })),
        HoldEvent::Timeout { busy, waited } => {
            let mut timeout = serde_json::json!({
                "waited_ms": ms(waited),
                "queue_length": busy.queue_length,
                "holders": busy.holders,
            });
            if busy.omitted > 0 {
                timeout["holders_total"] = (busy.holders.len() + busy.omitted).into();
            }
            sse_json("timeout", &timeout)
        }
        HoldEvent::Failed(e) => sse_json("error", &e.problem()),
    }
}

/// Starts a hold: the lease lives as long as the returned stream is open.
pub(super) async fn hold(
    app: Arc<App>,
    key: LockKey,
    ask: Ask,
    stall: Option<Stall>,
) -> Result<axum::response::Response, Error> {
    use axum::response::IntoResponse as _;
    let given = ask.gives_ttl();
    let (mut claim, wait) = ask.into_claim(key, &app.core.limits, &app.core.sidecar)?;
    super::ask::check_renewed_ttl(&mut claim, given, &app.core.limits)?;
    limit_stall(stall.as_ref(), claim.ttl);
    if app.core.shutdown.is_cancelled() {
        return Err(Error::ShuttingDown);
    }
    app.core.check_room(!wait.is_zero(), Some(&claim)).await?;
    let events = Arc::new(HoldEvents::default());
    let core = app.core.clone();
    let reported = events.clone();
    let claim = Box::new(claim);
    let hold = async move { core.hold(claim, wait, &reported).await };
    let mut stream = HoldStream {
        hold: Finishing::new(hold, events.left().clone(), &app.finishers)?,
        events,
        stall,
    };
    if let Some(e) = first_failure(&mut stream.hold, &stream.events).await {
        return Err(e);
    }
    let mut response = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(SSE_KEEPALIVE))
        .into_response();
    // hyper keeps a response's header map for the connection's next
    // response, which a hold never sends: sized for the two headers of SSE
    // (hyper writes transfer-encoding itself), not the default six.
    let mut headers = HeaderMap::with_capacity(2);
    headers.extend(response.headers_mut().drain());
    *response.headers_mut() = headers;
    Ok(response)
}

/// Limits how long a hold's stream may go unread, its socket full, before
/// its connection is reset and the hold released, to a third of `ttl`: the
/// watchdog runs only while the stream is written, and renews every third
/// of the lease's ttl, so the release comes before the lease could lapse
/// unrenewed. Called with the claim's ttl, then with the lease's once
/// granted (a re-entered lease renews at its own ttl, which may be shorter).
pub(in crate::http) fn limit_stall(stall: Option<&Stall>, ttl: Duration) {
    if let Some(stall) = stall {
        stall.limit(ttl / 3);
    }
}

/// [`limit_stall`] for the lease `event` grants, if it does, at the pace
/// the watchdog renews it.
pub(in crate::http) fn limit_stall_to_grant(stall: Option<&Stall>, event: &HoldEvent) {
    if let HoldEvent::Acquired(granted) = event {
        limit_stall(stall, granted.lease.watched_ttl());
    }
}

/// A hold's event stream, which also runs the hold: each poll advances it
/// ([`crate::core::Core::hold`]) and then hands out what it reported. The
/// connection's task is the hold's only task; when the client leaves, the
/// hold finishes elsewhere ([`Finishing`]), giving up its wait or releasing
/// its lease.
pub(super) struct HoldStream {
    hold: Finishing<()>,
    events: Arc<HoldEvents>,
    /// The connection's write timeout, shortened for the lease.
    stall: Option<Stall>,
}

/// Runs `hold` until it reports its first event in `events` or ends, and
/// takes out the error it ended with, if that is its first event: the
/// first attempt answers before the response does, so an error the
/// backend finds in the claim (a semaphore's limit missing or not the one
/// in use, a kind it cannot hold) or an outage is answered with its own
/// status, as an acquire's is, not as a 200 stream that opens with `error`.
pub(in crate::http) async fn first_failure(
    hold: &mut Finishing<()>,
    events: &HoldEvents,
) -> Option<Error> {
    std::future::poll_fn(|cx| {
        if !hold.is_done() {
            let _ = std::pin::Pin::new(&mut *hold).poll(cx);
        }
        if hold.is_done() || !events.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    events.take_failure()
}

impl Stream for HoldStream {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        if !self.hold.is_done() {
            let _ = std::pin::Pin::new(&mut self.hold).poll(cx);
        }
        match self.events.next() {
            Some(event) => {
                limit_stall_to_grant(self.stall.as_ref(), &event);
                Poll::Ready(Some(Ok(hold_event(event))))
            }
            None if self.hold.is_done() => Poll::Ready(None),
            None => Poll::Pending,
        }
    }
}
