//! Hold streams and the expiry timer: a hold acquires, then its watchdog
//! renews every ttl/3 until the client leaves; every lease is looked at a
//! safety margin before its expiry, and one the backend no longer has is
//! reported `lost`.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::broadcast;
use tokio::time::sleep_until;
use tokio_util::sync::CancellationToken;

use crate::backend::{Busy, Loss, Status};
use crate::clock::{after, drift_ms, instant_at, ms, now_ms};
use crate::error::Error;
use crate::lock::{Claim, LostReason};

use super::Core;
use super::expiry::{Look, expiry_checkpoint};
use super::lease::{End, Granted, Local, Outcome, Streaming};

/// What a hold stream reports, in order.
pub enum HoldEvent {
    Queued {
        position: usize,
        queue_length: usize,
    },
    // The large variants are boxed: a hold keeps a few events' room.
    Acquired(Box<Granted>),
    Renewed {
        expires_at_ms: u64,
        ttl_ms: u64,
    },
    Lost(LostReason),
    Timeout {
        busy: Box<Busy>,
        waited: Duration,
    },
    Failed(Box<Error>),
}

/// The events of one hold not yet handed to its client, and whether the
/// client is still there.
///
/// A hold has no task or channel of its own: [`Core::hold`] runs inside the
/// client's response stream, which polls it and then hands out what it
/// reported (with ten thousand holds, a task and a channel each were a
/// fifth of the sidecar's memory). The stream leaves when the client
/// closes it, and lets the hold finish elsewhere: stop waiting, or release.
#[derive(Default)]
pub struct HoldEvents {
    /// Reported and not yet handed out, oldest first.
    pub(super) queue: Mutex<VecDeque<HoldEvent>>,
    /// Cancelled when the client has gone.
    pub(super) left: CancellationToken,
}

impl HoldEvents {
    /// Queues `event`. A position update replaces one not yet handed out.
    /// Returns false, queuing nothing, once the client has gone.
    pub fn send(&self, event: HoldEvent) -> bool {
        if self.left.is_cancelled() {
            return false;
        }
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if let (HoldEvent::Queued { .. }, Some(last @ HoldEvent::Queued { .. })) =
            (&event, queue.back_mut())
        {
            *last = event;
        } else {
            queue.push_back(event);
        }
        true
    }

    /// Whether nothing is reported and not yet handed out.
    pub fn is_empty(&self) -> bool {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// The error the hold ended with, when that is the oldest event not
    /// yet handed out (taken out); else nothing changes.
    pub fn take_failure(&self) -> Option<crate::error::Error> {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(queue.front(), Some(HoldEvent::Failed(_))) {
            return None;
        }
        match queue.pop_front() {
            Some(HoldEvent::Failed(e)) => Some(*e),
            _ => None,
        }
    }

    /// The oldest event not yet handed out.
    pub fn next(&self) -> Option<HoldEvent> {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let event = queue.pop_front();
        if queue.is_empty() {
            // A hold spends nearly all its life with nothing to report.
            queue.shrink_to_fit();
        }
        event
    }

    /// Cancelled to mark the client gone: the hold stops waiting or
    /// releases its lease.
    pub fn left(&self) -> &CancellationToken {
        &self.left
    }
}

impl Core {
    /// Runs a hold stream: acquire, then renew every ttl/3 until the client
    /// goes away (release), the lease is lost, or the sidecar shuts down.
    /// Events go to `events`; the stream ends when this returns. Leaving
    /// (cancelling `events.left()`) ends it early: the wait is given up, a
    /// lease released.
    ///
    /// The claim comes boxed: an argument stays part of the hold's state
    /// for as long as the lock is held, a box only while it is acquired.
    pub async fn hold(&self, claim: Box<Claim>, wait: Duration, events: &HoldEvents) {
        // Boxed and dropped once done: inline, the acquire's state and the
        // outcome's would stay part of the hold for as long as the lock is held.
        if let Some((lease, supervise)) = Box::pin(self.start_hold(claim, wait, events)).await {
            self.watchdog(&lease, events, supervise).await;
        }
    }

    /// The start of a hold: acquires, and reports the outcome; the lease
    /// and whether the hold supervises its expiry when it is to be kept.
    async fn start_hold(
        &self,
        claim: Box<Claim>,
        wait: Duration,
        events: &HoldEvents,
    ) -> Option<(Arc<Local>, bool)> {
        let outcome = self
            .acquire_for(&claim, wait, &events.left, Some(events))
            .await;
        let granted = match outcome {
            Ok(Outcome::Granted(g)) => g,
            Ok(Outcome::Busy { busy, waited }) => {
                events.send(HoldEvent::Timeout {
                    busy: Box::new(busy),
                    waited,
                });
                return None;
            }
            Ok(Outcome::Cancelled) => {
                if self.shutdown.is_cancelled() {
                    events.send(HoldEvent::Lost(LostReason::Shutdown));
                }
                return None;
            }
            Err(e) => {
                events.send(HoldEvent::Failed(Box::new(e)));
                return None;
            }
        };
        let lease = granted.lease.clone();
        let supervise = granted.supervise_here;
        if self.shutdown.is_cancelled() {
            // Granted by an attempt already in flight when shutdown began.
            // A re-entry of a lease another hold stream holds gives back only
            // its own hold: the rest go once that stream's client lets go.
            if lease.streamed() {
                // Taken first, as `release_fully` takes each: a stream letting
                // go meanwhile must not give this hold back a second time.
                if lease.take_here()
                    && let Ok(Some(0)) = self
                        .op("release", self.backend.release(&lease.key, &lease.token))
                        .await
                {
                    self.end(&lease, End::Released);
                }
            } else {
                self.release_fully(&lease).await;
            }
            events.send(HoldEvent::Lost(LostReason::Shutdown));
            return None;
        }
        if !events.send(HoldEvent::Acquired(Box::new(granted))) {
            // The client left as the grant arrived. Watched from now on:
            // the release may take its time (resent while refused), and
            // the lease, if re-entered, is kept.
            if supervise {
                self.supervise_elsewhere(&lease);
            }
            self.release_left(&lease).await;
            return None;
        }
        Some((lease, supervise))
    }

    // The rare ends (release, shutdown) are boxed: inline, their state
    // would be part of every hold for as long as it waits for the next renewal.
    // With `supervise`, the lease's expiry timer runs here too (its
    // checkpoints and renewals share one timer), and goes to the shared
    // timer if the hold ends before the lease.
    pub(super) async fn watchdog(
        &self,
        lease: &Arc<Local>,
        events: &HoldEvents,
        mut supervise: bool,
    ) {
        let every = lease.watched_ttl() / 3;
        // After a failed renewal, try again sooner: the lease is running out.
        let retry = (every / 3).max(Duration::from_millis(1));
        // A third of the ttl into the lease, not from here: a lease handed
        // over while this sidecar was busy or stopped reaches the hold with
        // its ttl running since the handoff, and may have less than a third
        // left.
        let mut next = after(every).min(instant_at(
            lease
                .expires_at_ms()
                .saturating_sub(ms(every).saturating_mul(2)),
        ));
        // Counted while this renews it: a keepalive then keeps the lease
        // for at least the ttl this renews by.
        let streaming = lease.stream();
        loop {
            if let Some(&end) = lease.end.get() {
                let reason = match end {
                    End::Lost(reason) => reason,
                    End::Released => LostReason::Released,
                };
                events.send(HoldEvent::Lost(reason));
                return;
            }
            let capped = lease.cap_ms.is_some_and(|cap| {
                lease.expires_at_ms().saturating_add(drift_ms(lease.ttl)) >= cap.get()
            });
            let (seen, checkpoint) = expiry_checkpoint(lease);
            let checkpoint = instant_at(checkpoint);
            // The next renewal and the expiry checkpoint share one timer
            // until the renewal starts; then the renewal races the
            // checkpoint, and whether it is under way is read before it is
            // dropped (a dropped renewal no longer counts as under way).
            let tick = async {
                if capped || (supervise && checkpoint <= next) {
                    if !supervise {
                        return std::future::pending().await;
                    }
                    sleep_until(checkpoint).await;
                    return Tick::Checkpoint(lease.renewing.load(Ordering::Relaxed));
                }
                sleep_until(next).await;
                // Boxed: the hold sleeps far more than it renews.
                let to = renew_to(lease);
                let renewal = Box::pin(self.keepalive(&lease.key, &lease.token, Some(to)));
                if !supervise {
                    return Tick::Renewed(renewal.await.ok().map(|e| (e, to)));
                }
                tokio::select! {
                    renewed = renewal => Tick::Renewed(renewed.ok().map(|e| (e, to))),
                    renewing = async {
                        sleep_until(checkpoint).await;
                        lease.renewing.load(Ordering::Relaxed)
                    } => Tick::Checkpoint(renewing),
                }
            };
            // The renewal races the lease's end: a lease given up while a
            // renewal hangs on an unreachable backend is reported at once.
            tokio::select! {
                tick = tick => match tick {
                    Tick::Renewed(Some((expires_at_ms, to))) => {
                        next = after(every);
                        let ttl_ms = expires_at_ms.saturating_sub(now_ms()).min(ms(to));
                        events.send(HoldEvent::Renewed { expires_at_ms, ttl_ms });
                    }
                    // On an error, `ended` fires next if the lease is lost; in an
                    // outage the lease may still be valid and the expiry timer decides.
                    Tick::Renewed(None) => next = after(retry),
                    Tick::Checkpoint(renewing) => {
                        supervise = Box::pin(self.check_expiry(lease, seen, renewing)).await;
                    }
                },
                // The top of the loop reports the end.
                () = lease.ended.cancelled() => {}
                () = events.left.cancelled() => {
                    if supervise {
                        // Watched while the release is resent (refused)
                        // and after (re-entered, or not released).
                        self.supervise_elsewhere(lease);
                    }
                    Box::pin(self.release_left(lease)).await;
                    if self.shutdown.is_cancelled() {
                        // Shutdown came with the client's leaving: the
                        // lease's other holds here go too, with its last
                        // stream, as in `let_go`.
                        drop(streaming);
                        if !lease.streamed() {
                            Box::pin(self.release_fully(lease)).await;
                        }
                        return;
                    }
                    return;
                }
                () = self.shutdown.cancelled() => {
                    events.send(HoldEvent::Lost(LostReason::Shutdown));
                    Box::pin(self.let_go(lease, events, streaming)).await;
                    return;
                }
            }
        }
    }

    /// The end of a hold at shutdown, once it was sent `lost`. Its client
    /// may act as the holder until it reads that, so the lease is released
    /// only once the client lets go (leaves the stream); with the last of
    /// its streams here, its other holds here go too
    /// ([`Core::release_fully`]). Otherwise it is left to lapse unrenewed:
    /// at the expiry known here the stream ends, the lease ends as lost
    /// here, and nothing is released — a keepalive through another sidecar
    /// may have extended it, and a lapse starts its lock-delay, which a
    /// release would skip.
    async fn let_go(&self, lease: &Local, events: &HoldEvents, streaming: Streaming<'_>) {
        let lapse = instant_at(lease.expires_at_ms());
        tokio::select! {
            () = events.left.cancelled() => {}
            () = sleep_until(lapse) => {
                self.end(lease, End::Lost(LostReason::Shutdown));
                return;
            }
            () = lease.ended.cancelled() => return,
        }
        drop(streaming);
        if !lease.streamed() {
            self.release_fully(lease).await;
        }
    }

    /// Releases the holds of a local lease taken through this sidecar and
    /// ends it as lost by shutdown. Its owner may hold the lease through
    /// other sidecars too: those holds are theirs to give back.
    pub(super) async fn release_fully(&self, lease: &Local) {
        while lease.take_here() {
            match self
                .op("release", self.backend.release(&lease.key, &lease.token))
                .await
            {
                Ok(Some(n)) if n > 0 => continue,
                _ => break,
            }
        }
        self.end(lease, End::Lost(LostReason::Shutdown));
    }

    /// Releases everything this sidecar holds (shutdown), except the leases
    /// of hold streams whose clients have not let go since they were told
    /// `lost` ([`Core::let_go`]): those are left to lapse. Returns how many
    /// it released.
    pub async fn release_everything(&self) -> usize {
        let all: Vec<Arc<Local>> = self
            .lock_leases()
            .values()
            .filter(|lease| !lease.streamed())
            .cloned()
            .collect();
        for lease in &all {
            self.release_fully(lease).await;
        }
        all.len()
    }

    /// Hands the expiry timer of `lease` to the shared timer
    /// ([`expiry::Expiries`]), unless it has ended.
    ///
    /// The expiry timer of a lease: a safety margin before its expiry, it
    /// gives the lease up if a renewal through this sidecar is failing or
    /// still under way (the backend is unreachable from here, and may grant
    /// the lock elsewhere at the expiry). At its expiry, it asks the backend
    /// whether the lease still holds (it may have been renewed through
    /// another sidecar) and ends it as expired if not.
    pub(super) fn supervise_elsewhere(&self, lease: &Arc<Local>) {
        self.expiries.file(self, lease);
    }

    /// The expiry timer's look at `lease` at its checkpoint, `seen` its
    /// expiry when the checkpoint was set, `renewing` whether a renewal was
    /// under way there. False once the lease has ended.
    pub(super) async fn check_expiry(&self, lease: &Arc<Local>, seen: u64, renewing: bool) -> bool {
        match self.look(lease, seen, renewing) {
            Look::Ended => false,
            Look::Again => true,
            Look::Ask => self.ask_expired(lease).await,
        }
    }

    /// What [`Core::check_expiry`] can tell without the backend.
    pub(super) fn look(&self, lease: &Arc<Local>, seen: u64, renewing: bool) -> Look {
        if lease.end.get().is_some() {
            return Look::Ended;
        }
        if lease.expires_at_ms() != seen {
            return Look::Again;
        }
        if renewing {
            self.revoke(lease);
            return Look::Ended;
        }
        if seen > now_ms() {
            return Look::Again;
        }
        Look::Ask
    }

    /// Asks the backend about `lease`, past its expiry by our clock; ends it
    /// unless renewed through another sidecar. False once it has ended.
    pub(super) async fn ask_expired(&self, lease: &Arc<Local>) -> bool {
        match self
            .op("status", self.backend.status(&lease.key, &lease.token))
            .await
        {
            Ok(Status::Held { expires_at_ms }) => {
                // Renewed through another sidecar. The floor stops a backend
                // whose clock runs behind ours from making this loop spin.
                lease.set(Some(expires_at_ms.max(now_ms().saturating_add(10))), None);
                true
            }
            Ok(Status::Gone(loss)) => {
                self.lapsed(lease, loss);
                false
            }
            // Past its expiry by our clock and unconfirmable: nobody here renewed it.
            Err(_) => {
                self.lapsed(lease, Loss::Expired);
                false
            }
        }
    }

    /// Starts ending local leases as soon as the backend reports them lost
    /// ([`Backend::losses`]), in a task that stops at shutdown. Without it a
    /// loss reaches holders only at their next renewal or expiry check.
    pub fn follow_losses(self: &Arc<Self>) {
        let Some(mut losses) = self.backend.losses() else {
            return;
        };
        let me = self.clone();
        self.tasks.spawn(async move {
            loop {
                let received = tokio::select! {
                    () = me.shutdown.cancelled() => return,
                    r = losses.recv() => r,
                };
                match received {
                    Ok(token) => {
                        // Past its expiry or cap here, it ended by that
                        // (another sidecar deleted a lease re-entered here
                        // as it expired).
                        if let Some(local) = me.local(&token) {
                            me.end(&local, End::Lost(lapse_reason(&local)));
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        // Some tokens were missed: ask about every lease.
                        let all: Vec<Arc<Local>> = me.lock_leases().values().cloned().collect();
                        for local in all {
                            let status = me
                                .op("status", me.backend.status(&local.key, &local.token))
                                .await;
                            if let Ok(Status::Gone(_)) = status {
                                me.end(&local, End::Lost(LostReason::Backend));
                            }
                        }
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
    }

    /// Marks a lease that the expiry timer found gone.
    pub(super) fn lapsed(&self, lease: &Local, loss: Loss) {
        let reason = match loss {
            Loss::Expired => lapse_reason(lease),
            Loss::Backend => LostReason::Backend,
            Loss::ForceReleased => LostReason::ForceReleased,
        };
        self.end(lease, End::Lost(reason));
    }

    /// Why `lease`, which the backend no longer has, ended: as
    /// [`lapse_reason`]; a lease gone while still valid is asked about, as
    /// a force-release through another sidecar reaches its holder's only as
    /// a lease that has gone.
    pub(super) async fn gone_reason(&self, lease: &Local) -> LostReason {
        let reason = lapse_reason(lease);
        if reason != LostReason::Backend {
            return reason;
        }
        match self
            .op("status", self.backend.status(&lease.key, &lease.token))
            .await
        {
            Ok(Status::Gone(Loss::ForceReleased)) => LostReason::ForceReleased,
            _ => reason,
        }
    }
}

/// What woke a hold's watchdog.
pub(super) enum Tick {
    /// A renewal ended, with the new expiry and the ttl it renewed to if
    /// it worked.
    Renewed(Option<(u64, Duration)>),
    /// The expiry checkpoint came; whether a renewal was under way then.
    Checkpoint(bool),
}

/// The ttl a hold's watchdog renews its lease to: the hold's, or up to
/// the end its clients were told of if that is later. A re-entry or
/// keepalive may have lengthened it (`ttl=60s` over a hold's 3 s), and its
/// client was told the lease runs that long: a renewal never takes that
/// back. (The end promised, not the lease's expiry as last seen: Redlock's
/// view of an expiry is its nodes' less a drift allowance, and renewing to
/// that would take the allowance off again at every renewal. The promised
/// end is such a view too: renewed past it by the allowance, the nodes keep
/// their margin beyond the end a client was told of.)
fn renew_to(lease: &Local) -> Duration {
    let promised = Duration::from_millis(lease.promised_ms().saturating_sub(now_ms()));
    lease
        .watched_ttl()
        .max(promised + Duration::from_millis(drift_ms(promised)))
}

/// Why a lease the backend no longer has ended: `max_hold` if renewals had
/// reached its cap, `expired` if its time was up, else `backend` (it
/// vanished while still valid: key deleted, token overwritten, data lost).
pub(super) fn lapse_reason(lease: &Local) -> LostReason {
    let now = now_ms();
    match lease.cap_ms.map(std::num::NonZeroU64::get) {
        Some(cap) if now.saturating_add(drift_ms(lease.ttl)) >= cap => LostReason::MaxHold,
        _ if now < lease.expires_at_ms() => LostReason::Backend,
        _ => LostReason::Expired,
    }
}
