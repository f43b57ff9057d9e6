//! Acquiring: the caps on leases and waiters, the FIFO wait in the local
//! queue (woken by the backend, never polling), attempts, `queued` updates,
//! and recording a grant.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::time::sleep_until;
use tokio_util::sync::CancellationToken;

use futures::StreamExt as _;
use rand::RngExt as _;

use crate::backend::{Attempt, Busy, Grant, SHOWN_HOLDERS, Status, Turn};
use crate::clock::{after, instant_at, ms};
use crate::error::Error;
use crate::lock::{Claim, Kind, LockKey, Mode, Token};
use crate::metrics::Metrics;
use crate::wakeups::{News, Place};

use super::Core;
use super::event::{Event, EventType};
use super::hold::{HoldEvent, HoldEvents};
use super::lease::{Filing, Granted, Local, Outcome, State};

/// One place under a per-sidecar cap, given back when dropped unless kept.
pub(super) struct Slot<'a> {
    count: &'a AtomicUsize,
    /// Whether the place is taken already; a re-entry's is not
    /// ([`Slot::reentry`]).
    taken: bool,
}

impl<'a> Slot<'a> {
    /// A place in `count` if it is below `limit`.
    pub(super) fn take(count: &'a AtomicUsize, limit: usize) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot { count, taken: true })
    }

    /// No place, for a claim expected to re-enter a lease already counted.
    fn reentry(count: &'a AtomicUsize) -> Self {
        Slot {
            count,
            taken: false,
        }
    }

    /// Keeps the place (a new lease's, given back when it ends). A
    /// re-entry whose lease ended here between its grant and this (a
    /// release racing it; [`Core::placed`] saw to the rest) takes one past
    /// the cap: the count stays exact.
    pub(super) fn keep(mut self) {
        if !self.taken {
            self.count.fetch_add(1, Ordering::AcqRel);
        }
        self.taken = false;
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if self.taken {
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// One place among the requests waiting on one lock here (`max_waiters`),
/// given back when dropped; a lock nobody waits on keeps no entry.
pub(super) struct LockSlot<'a> {
    counts: &'a Mutex<HashMap<LockKey, usize>>,
    key: LockKey,
}

impl<'a> LockSlot<'a> {
    /// A place on `key` if fewer than `limit` are taken.
    fn take(
        counts: &'a Mutex<HashMap<LockKey, usize>>,
        key: &LockKey,
        limit: usize,
    ) -> Option<Self> {
        let mut taken = counts.lock().unwrap_or_else(|e| e.into_inner());
        if taken.get(key).copied().unwrap_or(0) >= limit {
            return None;
        }
        *taken.entry(key.clone()).or_default() += 1;
        Some(LockSlot {
            counts,
            key: key.clone(),
        })
    }
}

impl Drop for LockSlot<'_> {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = counts.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

/// Decrements the waiters gauge when a waiter leaves, however it leaves.
pub(super) struct Waiting<'a> {
    pub(super) metrics: &'a Metrics,
    pub(super) kind: Kind,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.metrics
            .waiters
            .with_label_values(&[self.kind.as_str()])
            .dec();
    }
}

/// What a claim that leaves tells the backend: the lease to give back, or
/// the queue entry to take out.
enum Leaving {
    Release(Token),
    Dequeue(crate::backend::Ticket),
}

/// Whether `lease` is the one `claim` would re-enter: the same lock, owner
/// and mode.
fn same_lock(lease: &Local, claim: &Claim) -> bool {
    lease.key == claim.key && lease.owner == claim.owner && lease.mode == claim.mode
}

/// The most holds one lease may have: a re-entry past it is given back
/// and refused (409 `too-many-holds`). One below PostgreSQL's `integer`,
/// so that the backend's count of the re-entry refused still fits every
/// backend's (PostgreSQL's overflowed into a 503, the memory and ZooKeeper
/// backends' `u32` would wrap to no hold at all).
pub(super) const MAX_HOLDS: u32 = i32::MAX as u32 - 1;

/// At most this many local leases are checked by one
/// [`Core::reclaim_gone`].
const RECLAIM_BATCH: usize = 256;
/// The longest one [`Core::reclaim_gone`] may take.
const RECLAIM_TIME: Duration = Duration::from_secs(1);
/// [`Core::reclaim_gone`] runs at most this often.
const RECLAIM_EVERY: Duration = Duration::from_secs(1);

impl Core {
    pub(super) fn full_of_leases(&self) -> Error {
        Error::SidecarFull {
            cap: "max_held",
            flag: "max-held",
            what: "leases held",
            limit: self.limits.max_held,
        }
    }

    pub(super) fn full_of_waiters(&self) -> Error {
        Error::SidecarFull {
            cap: "max_total_waiters",
            flag: "max-total-waiters",
            what: "requests waiting",
            limit: self.limits.max_total_waiters,
        }
    }

    /// Checks that a new acquire (one that may wait if `waits`) would find
    /// room under this sidecar's caps now, so that a hold can answer 429
    /// before its stream starts. The acquire itself takes the place. A
    /// `claim` re-entering a lease held through this sidecar finds room at
    /// either cap ([`Core::reenters`]).
    ///
    /// # Errors
    /// [`Error::SidecarFull`] naming the cap reached.
    pub async fn check_room(&self, waits: bool, claim: Option<&Claim>) -> Result<(), Error> {
        if waits
            && self.waiting_slots.load(Ordering::Acquire) >= self.limits.max_total_waiters
            && !claim.is_some_and(|c| self.reenters(c))
        {
            return Err(self.full_of_waiters());
        }
        if self.held_slots.load(Ordering::Acquire) >= self.limits.max_held {
            self.reclaim_gone().await;
            if self.held_slots.load(Ordering::Acquire) >= self.limits.max_held
                && !claim.is_some_and(|c| self.reenters(c))
            {
                return Err(self.full_of_leases());
            }
        }
        Ok(())
    }

    /// A place for one more lease under `max_held`, for an attempt on
    /// `claim`; at the cap, after ending the local leases the backend no
    /// longer has, none for a claim that re-enters a lease (which has its
    /// place).
    pub(super) async fn held_slot(&self, claim: &Claim) -> Result<Slot<'_>, Error> {
        if let Some(slot) = Slot::take(&self.held_slots, self.limits.max_held) {
            return Ok(slot);
        }
        self.reclaim_gone().await;
        if let Some(slot) = Slot::take(&self.held_slots, self.limits.max_held) {
            return Ok(slot);
        }
        if self.reenters(claim) {
            return Ok(Slot::reentry(&self.held_slots));
        }
        self.metrics.acquired(&claim.key, "rejected");
        Err(self.full_of_leases())
    }

    /// Whether `claim` would re-enter a lease held through this sidecar: an
    /// exclusive or shared lock its owner holds in the same mode, as every
    /// backend re-enters. Semaphores re-enter nowhere.
    fn reenters(&self, claim: &Claim) -> bool {
        self.lock_leases()
            .may_hold(&claim.key, &claim.owner, claim.mode)
    }

    /// The place of the lease granted as `token` to an attempt on `claim`
    /// that took `slot`. A claim let in at the cap as a re-entry
    /// ([`Slot::reentry`]) that was granted a new lease instead shows that
    /// the local leases it would have re-entered are gone from the backend
    /// (which re-enters any lease of the owner's in the mode): those the
    /// backend confirms gone end, their holders told, and the new lease
    /// takes a place they freed. When none is free after all, the new lease
    /// is given back and the claim refused, so that the cap holds.
    ///
    /// # Errors
    /// [`Error::SidecarFull`] when no place is free for a new lease.
    async fn placed<'a>(
        &'a self,
        claim: &Claim,
        token: &Token,
        slot: Slot<'a>,
    ) -> Result<Slot<'a>, Error> {
        if slot.taken || self.local(token).is_some() {
            return Ok(slot);
        }
        let gone: Vec<Arc<Local>> = self
            .lock_leases()
            .values()
            .filter(|l| l.token != *token && same_lock(l, claim))
            .cloned()
            .collect();
        for lease in gone {
            // Only what the backend confirms gone (an answer lost keeps it).
            let status = self
                .op("status", self.backend.status(&lease.key, &lease.token))
                .await;
            if let Ok(Status::Gone(loss)) = status {
                self.lapsed(&lease, loss);
            }
        }
        if let Some(slot) = Slot::take(&self.held_slots, self.limits.max_held) {
            return Ok(slot);
        }
        self.give_back(&claim.key, token).await;
        self.metrics.acquired(&claim.key, "rejected");
        Err(self.full_of_leases())
    }

    /// Ends local leases the backend no longer has, freeing their places
    /// under `max_held`: nothing tells this sidecar of a release or a
    /// force-release through another, and such a lease kept its place until
    /// its ttl ended (429 `sidecar-full` while holding nothing). Runs at the
    /// cap, at most once a second, on up to [`RECLAIM_BATCH`] leases from a
    /// random point (16 asked at a time, for at most [`RECLAIM_TIME`]), so
    /// that a sidecar really full asks the backend little.
    pub(super) async fn reclaim_gone(&self) {
        {
            let mut last = self
                .reclaimed_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if last.is_some_and(|at| at.elapsed() < RECLAIM_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let sample: Vec<Arc<Local>> = {
            let leases = self.lock_leases();
            let from = rand::rng().random_range(0..leases.len().max(1));
            leases
                .values()
                .cycle()
                .skip(from)
                .take(leases.len().min(RECLAIM_BATCH))
                .cloned()
                .collect()
        };
        let checks = futures::stream::iter(sample)
            .map(|lease| async move {
                let status = self
                    .op("status", self.backend.status(&lease.key, &lease.token))
                    .await;
                if let Ok(Status::Gone(loss)) = status {
                    self.lapsed(&lease, loss);
                }
            })
            .buffer_unordered(16)
            .collect::<()>();
        let _ = tokio::time::timeout(RECLAIM_TIME, checks).await;
    }

    /// Acquires `claim`, waiting up to `wait` in FIFO order. A new lease
    /// is filed with the shared expiry timer.
    ///
    /// # Errors
    /// Backend outages, semaphore limit errors, and 429 when the local queue is full.
    ///
    /// # Cancellation safety
    /// Not cancellation safe: a grant may be lost if the future is dropped.
    /// Cancel through `cancel` instead, which dequeues cleanly.
    pub async fn acquire(
        &self,
        claim: &Claim,
        wait: Duration,
        cancel: &CancellationToken,
    ) -> Result<Outcome, Error> {
        self.acquire_for(claim, wait, cancel, None).await
    }

    /// [`Core::acquire`], for a hold when `hold` is its events: they receive
    /// `queued` updates, and the hold runs the expiry timer of a lease it
    /// creates itself ([`Granted::supervise_here`]).
    pub(super) async fn acquire_for(
        &self,
        claim: &Claim,
        wait: Duration,
        cancel: &CancellationToken,
        progress: Option<&HoldEvents>,
    ) -> Result<Outcome, Error> {
        let started = Instant::now();
        let deadline = tokio::time::Instant::from_std(started)
            .checked_add(wait)
            .unwrap_or_else(|| after(wait));
        let key = &claim.key;
        let queueing = !wait.is_zero();
        // The owner re-entering its own lease does not wait, so the waiter
        // caps do not refuse it; should the backend queue it after all (the
        // lease gone), it takes its place under them then.
        // Taken before the first attempt, so the cap holds however many
        // acquires race; given back when this returns or is dropped.
        // The per-lock place is taken too when there is one; at that cap the
        // first attempt goes without (it may be granted at once: no waiter)
        // and takes one should it have to wait.
        let capped = queueing && !self.reenters(claim);
        let here = match capped {
            true => Some(self.room_here(key)?),
            false => None,
        };
        let on_lock = capped
            .then(|| LockSlot::take(&self.waiting_on, key, self.limits.max_waiters))
            .flatten();
        let turn = if queueing { Turn::Join } else { Turn::Once };
        let slot = self.held_slot(claim).await?;
        let busy = match self.attempt(claim, turn).await? {
            Attempt::Granted(g) => {
                let slot = self.placed(claim, &g.token, slot).await?;
                return Ok(Outcome::Granted(self.granted(
                    claim,
                    g,
                    started,
                    progress.is_some(),
                    slot,
                )));
            }
            Attempt::Busy(busy) => {
                drop(slot);
                busy
            }
        };
        let Some(ticket) = busy.ticket.clone().filter(|_| queueing) else {
            self.metrics.acquired(key, "busy");
            return Ok(Outcome::Busy {
                busy: kept(busy),
                waited: Duration::ZERO,
            });
        };
        let room = match (here, on_lock) {
            (Some(here), Some(on_lock)) => Ok((on_lock, here)),
            (Some(here), None) => self.room_on_lock(key).map(|on_lock| (on_lock, here)),
            (None, _) => self.room_to_wait(key),
        };
        let _room = match room {
            Ok(room) => room,
            Err(e) => {
                let told = self.op("dequeue", self.backend.dequeue(&ticket)).await;
                if matches!(told, Err(Error::Unavailable { .. })) {
                    self.tell_later(key, Leaving::Dequeue(ticket.clone()));
                }
                return Err(e);
            }
        };

        let place = self.wakeups.join(key, ticket.seq, progress.is_some());
        self.metrics
            .waiters
            .with_label_values(&[key.kind.as_str()])
            .inc();
        let _waiting = Waiting {
            metrics: &self.metrics,
            kind: key.kind,
        };
        // The watch races the lock being handed to this waiter, which comes
        // on the sidecar's own channel without it; what else is told
        // meanwhile is read again below (a wake is kept for the head).
        // The wait, the client and shutdown are heeded meanwhile: a watch
        // may take as long as the backend's call limit.
        let mut woken = false;
        let watching = self.op("watch", self.backend.watch(key));
        tokio::pin!(watching);
        let watch = loop {
            tokio::select! {
                biased;
                w = &mut watching => break Ok(Some(w)),
                news = place.news() => {
                    woken |= news.has(News::WOKEN);
                    if place.has_handoff() {
                        break Ok(None);
                    }
                }
                () = cancel.cancelled() => break Err(false),
                () = self.shutdown.cancelled() => break Err(false),
                () = sleep_until(deadline) => break Err(true),
            }
        };
        let watch = match watch {
            Ok(Some(Ok(w))) => Some(w),
            Ok(None) => None,
            Ok(Some(Err(e))) => {
                self.leave_queue(key, place, &ticket).await;
                self.metrics.acquired(key, "error");
                return Err(e);
            }
            // Out of time (`true`), or left.
            Err(late) => {
                self.leave_queue(key, place, &ticket).await;
                self.metrics
                    .acquired(key, if late { "timeout" } else { "cancelled" });
                return Ok(match late {
                    true => Outcome::Busy {
                        busy: kept(busy),
                        waited: started.elapsed(),
                    },
                    false => Outcome::Cancelled,
                });
            }
        };
        let (local_pos, _) = place.position();
        let mut offset = busy.position.unwrap_or(local_pos).saturating_sub(local_pos);
        let mut reported = None;
        self.report_position(&place, offset, &mut reported, busy.queue_length, progress);
        let mut queued = self.claim_event(claim, EventType::Queued);
        queued.position = busy.position;
        self.publish(queued);

        let mut backoff = Duration::ZERO;
        let mut retry_at = not_past(busy.retry_at_ms, &mut backoff);
        // The holder's lease end the head last followed (one told before
        // this waiter joined is the backend's answer's business).
        let mut seen_until = place.holder_until();
        let mut last = kept(busy);
        // Whether the head tries now: at first if it heads the local queue
        // (a release may have come before the watch; one behind others is
        // handed the lock or woken when its turn comes), when woken, or when
        // its timer fires — not when positions or the holder's expiry were
        // merely told.
        let mut try_now = woken || place.is_head();
        let outcome = loop {
            // A wake-up and a cancellation can arrive together (shutdown
            // releases locks, which wakes waiters): cancellation wins.
            if cancel.is_cancelled() || self.shutdown.is_cancelled() {
                break Outcome::Cancelled;
            }
            // The backend handed the lock over by itself (its release passed
            // it to this ticket).
            if let Some(h) = place.take_handoff() {
                let slot = match self.held_slot(claim).await {
                    Ok(slot) => slot,
                    Err(e) => {
                        drop(place);
                        self.give_back(key, &h.token).await;
                        return Err(e);
                    }
                };
                let slot = match self.placed(claim, &h.token, slot).await {
                    Ok(slot) => slot,
                    Err(e) => {
                        drop(place);
                        return Err(e);
                    }
                };
                place.leave_granted(false, h.expires_at_ms);
                drop(watch);
                // The count is the backend's at the handoff: 1, unless its
                // owner re-entered it meanwhile, which the lease already knows.
                let g = Grant {
                    token: h.token,
                    fence: h.fence,
                    count: 0,
                    since_ms: h.since_ms,
                    expires_at_ms: h.expires_at_ms,
                };
                return Ok(Outcome::Granted(self.granted(
                    claim,
                    g,
                    started,
                    progress.is_some(),
                    slot,
                )));
            }
            // A wake-up or timer that came while others were ahead stays
            // pending until this waiter heads the local queue.
            if try_now && place.is_head() {
                try_now = false;
                let slot = match self.held_slot(claim).await {
                    Ok(slot) => slot,
                    Err(e) => {
                        self.leave_queue(key, place, &ticket).await;
                        return Err(e);
                    }
                };
                match self.attempt(claim, Turn::Queued(&ticket)).await {
                    Ok(Attempt::Granted(g)) => {
                        let slot = match self.placed(claim, &g.token, slot).await {
                            Ok(slot) => slot,
                            Err(e) => {
                                drop(place);
                                return Err(e);
                            }
                        };
                        let pass_on = claim.mode == Mode::Shared || key.kind == Kind::Semaphore;
                        place.leave_granted(pass_on, g.expires_at_ms);
                        drop(watch);
                        return Ok(Outcome::Granted(self.granted(
                            claim,
                            g,
                            started,
                            progress.is_some(),
                            slot,
                        )));
                    }
                    Ok(Attempt::Busy(b)) => {
                        retry_at = not_past(b.retry_at_ms, &mut backoff);
                        if let Some(p) = b.position {
                            offset = p.saturating_sub(place.position().0);
                        }
                        self.report_position(
                            &place,
                            offset,
                            &mut reported,
                            b.queue_length,
                            progress,
                        );
                        last = kept(b);
                    }
                    Err(e) => {
                        // `attempt` counted the failure.
                        self.leave_queue(key, place, &ticket).await;
                        return Err(e);
                    }
                }
            }
            // One timer: the retry when it comes no later than the deadline
            // (it goes first), else the deadline.
            let (wake_at, retrying) = match retry_at.map(instant_at) {
                Some(r) if r <= deadline => (r, true),
                _ => (deadline, false),
            };
            tokio::select! {
                biased;
                () = cancel.cancelled() => break Outcome::Cancelled,
                () = self.shutdown.cancelled() => break Outcome::Cancelled,
                news = place.news() => {
                    if news.has(News::WOKEN) {
                        try_now = true;
                    }
                    if news.has(News::MOVED) {
                        self.report_position(&place, offset, &mut reported, 0, progress);
                    }
                    // Only the head follows the holder: a new holder's
                    // lease end is when it may have died.
                    if news.has(News::PROMOTED | News::UNTIL) && place.is_head() {
                        let until = place.holder_until();
                        if until != seen_until {
                            seen_until = until;
                            if until > 0 {
                                retry_at = Some(until);
                            }
                        }
                    }
                }
                () = sleep_until(wake_at) => {
                    if !retrying {
                        break Outcome::Busy { busy: last, waited: started.elapsed() };
                    }
                    retry_at = None;
                    try_now = true;
                }
            }
        };
        self.leave_queue(key, place, &ticket).await;
        drop(watch);
        let result = match &outcome {
            Outcome::Busy { .. } => "timeout",
            _ => "cancelled",
        };
        self.metrics.acquired(key, result);
        Ok(outcome)
    }

    /// A place to wait on `key` under the waiter caps (`--max-waiters` here
    /// per lock, `--max-total-waiters` per sidecar), held until dropped.
    /// Taken before the first attempt where there is room, so that requests
    /// arriving together cannot all pass a cap before any of them joins the
    /// queue.
    ///
    /// # Errors
    /// [`Error::TooManyWaiters`] or [`Error::SidecarFull`] at a cap.
    fn room_to_wait(&self, key: &LockKey) -> Result<(LockSlot<'_>, Slot<'_>), Error> {
        let on_lock = self.room_on_lock(key)?;
        Ok((on_lock, self.room_here(key)?))
    }

    /// A place among the requests waiting on `key` here.
    ///
    /// # Errors
    /// [`Error::TooManyWaiters`] at `--max-waiters`.
    fn room_on_lock(&self, key: &LockKey) -> Result<LockSlot<'_>, Error> {
        LockSlot::take(&self.waiting_on, key, self.limits.max_waiters).ok_or_else(|| {
            self.metrics.acquired(key, "rejected");
            Error::TooManyWaiters {
                limit: self.limits.max_waiters,
            }
        })
    }

    /// A place among the requests waiting here on any lock.
    ///
    /// # Errors
    /// [`Error::SidecarFull`] at `--max-total-waiters`.
    fn room_here(&self, key: &LockKey) -> Result<Slot<'_>, Error> {
        Slot::take(&self.waiting_slots, self.limits.max_total_waiters).ok_or_else(|| {
            self.metrics.acquired(key, "rejected");
            self.full_of_waiters()
        })
    }

    /// Leaves the queue without a grant: a lease the backend handed to this
    /// waiter meanwhile is given back, else the ticket is dequeued.
    ///
    /// When the backend cannot be told (an outage), it keeps being told in
    /// the background until it hears: a lease it handed this waiter, unheard,
    /// would otherwise stay until its ttl, and the owner's next acquire would
    /// re-enter it without knowing — holding on after its release.
    async fn leave_queue(&self, key: &LockKey, place: Place, ticket: &crate::backend::Ticket) {
        match place.leave().map(|h| h.token) {
            Some(token) => self.give_back(key, &token).await,
            None => {
                let told = self.op("dequeue", self.backend.dequeue(ticket)).await;
                if matches!(told, Err(Error::Unavailable { .. })) {
                    self.tell_later(key, Leaving::Dequeue(ticket.clone()));
                }
            }
        }
    }

    /// Releases a lease granted to a claim that cannot keep it (refused
    /// under a cap, or left), telling the backend again later while it is
    /// unreachable: a lease given up but kept would hold the lock, and the
    /// queue behind it, until its ttl.
    async fn give_back(&self, key: &LockKey, token: &Token) {
        match self.release_own(key, token).await {
            // Observers elsewhere may have read it leading (handed over
            // while this sidecar could not take it), and a lease given back
            // with nobody waiting wakes nobody.
            (Ok(_), _) if key.kind == crate::lock::Kind::Election => self.announce_key(key),
            (Err(_), true) => {
                unanswered_release(key);
                // It may have run: observers then look once more.
                if key.kind == crate::lock::Kind::Election {
                    self.announce_key(key);
                }
            }
            (Err(Error::Unavailable { .. }), false) => {
                self.tell_later(key, Leaving::Release(token.clone()));
            }
            _ => {}
        }
    }

    /// Tells the backend of `leaving` in the background, with pauses
    /// doubling to 5 s, until it answers (or shutdown). A release stops
    /// once the longest ttl has passed, when the lease it gives back has
    /// lapsed anyway; a dequeue does not: the backend keeps the ticket of a
    /// waiter whose leaving it has not heard (to give back a lease handed
    /// to it), and would keep it for good.
    fn tell_later(&self, key: &LockKey, leaving: Leaving) {
        let (backend, key) = (self.backend.clone(), key.clone());
        let give_up = matches!(leaving, Leaving::Release(_)).then(|| after(self.limits.max_ttl));
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            let mut pause = Duration::from_millis(250);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(pause) => {}
                }
                if give_up.is_some_and(|at| tokio::time::Instant::now() >= at) {
                    return;
                }
                let told = match &leaving {
                    Leaving::Release(t) => backend.release(&key, t).await.map(drop),
                    Leaving::Dequeue(ticket) => backend.dequeue(ticket).await,
                };
                let released = matches!(leaving, Leaving::Release(_));
                let unanswered = released && told.as_ref().is_err_and(|e| e.may_have_run());
                if unanswered {
                    unanswered_release(&key);
                }
                // Done, or answered (nothing of ours left to give back).
                let done = told.as_ref().err().and_then(|e| e.cause()).is_none();
                if unanswered || done {
                    // As `give_back` does: observers elsewhere may have
                    // read the lease given back leading.
                    if released && key.kind == crate::lock::Kind::Election {
                        let _ = backend.announce(&key).await;
                    }
                    return;
                }
                pause = (pause * 2).min(Duration::from_secs(5));
            }
        });
    }

    /// Sends a `queued` update when the position changed.
    pub(super) fn report_position(
        &self,
        place: &Place,
        offset: usize,
        reported: &mut Option<usize>,
        queue_length: usize,
        progress: Option<&HoldEvents>,
    ) {
        let Some(events) = progress else { return };
        let (local, local_len) = place.position();
        let position = local + offset;
        if *reported == Some(position) {
            return;
        }
        *reported = Some(position);
        let queue_length = queue_length.max(local_len + offset).max(position);
        events.send(HoldEvent::Queued {
            position,
            queue_length,
        });
    }

    /// One acquire attempt; a failure is counted as the acquire's result
    /// (`error` for an outage, `rejected` for a refused claim).
    ///
    /// # Errors
    /// The backend's; [`Error::TooManyHolds`] for a re-entry past
    /// [`MAX_HOLDS`], whose hold is given back.
    pub(super) async fn attempt(&self, claim: &Claim, turn: Turn<'_>) -> Result<Attempt, Error> {
        let mut result = self
            .op("try_acquire", self.backend.try_acquire(claim, turn))
            .await;
        if let Ok(Attempt::Granted(g)) = &result
            && g.count > MAX_HOLDS
        {
            self.give_back(&claim.key, &g.token).await;
            result = Err(Error::TooManyHolds { max: MAX_HOLDS });
        }
        match &result {
            Err(Error::Unavailable { .. }) => self.metrics.acquired(&claim.key, "error"),
            Err(_) => self.metrics.acquired(&claim.key, "rejected"),
            Ok(_) => {}
        }
        result
    }

    pub(super) fn claim_event(&self, claim: &Claim, event: EventType) -> Event {
        Event::new(
            event,
            &claim.key,
            claim.mode,
            &claim.owner,
            &self.sidecar,
            None,
        )
    }

    /// Records a grant of `claim`: the local lease (new, or re-entered),
    /// metrics and the `acquired` event. A new lease's expiry timer goes to
    /// the shared timer ([`Core::supervise_elsewhere`]) unless `inline` (a
    /// hold, which runs it itself). A new lease keeps `slot`, its place
    /// under `max_held`.
    pub(super) fn granted(
        &self,
        claim: &Claim,
        g: Grant,
        started: Instant,
        inline: bool,
        slot: Slot<'_>,
    ) -> Granted {
        let mut supervise_here = false;
        let waited = started.elapsed();
        // A reentrant grant of a token given up earlier holds again, with
        // the holds taken here that were not released since.
        let owed = self
            .lock_revoked()
            .remove(&g.token)
            .map_or(0, |revoked| revoked.take_all_here());
        let lease = {
            let mut leases = self.lock_leases();
            match leases.get(&g.token) {
                // A count of 0 (a handoff) leaves the lease's own.
                Some(local) => {
                    local.set(Some(g.expires_at_ms), (g.count > 0).then_some(g.count));
                    local.promise(g.expires_at_ms, true);
                    local.count_here(true);
                    local.renewing.store(false, Ordering::Relaxed);
                    local.clone()
                }
                None => {
                    let local = Arc::new(Local {
                        key: claim.key.clone(),
                        token: g.token.clone(),
                        owner: claim.owner.clone(),
                        mode: claim.mode,
                        fence: g.fence,
                        ttl: claim.ttl,
                        since_ms: g.since_ms,
                        cap_ms: claim
                            .max_hold
                            .and_then(|m| NonZeroU64::new(g.since_ms.saturating_add(ms(m)))),
                        state: Mutex::new(State::new(
                            g.expires_at_ms,
                            g.count.max(1),
                            owed.saturating_add(1),
                        )),
                        renewing: AtomicBool::new(false),
                        delayed: !claim.lock_delay.is_zero(),
                        end: std::sync::OnceLock::new(),
                        ended: CancellationToken::new(),
                        filing: Filing::default(),
                    });
                    leases.insert(local.clone());
                    slot.keep();
                    self.metrics
                        .held
                        .with_label_values(&[claim.key.kind.as_str()])
                        .inc();
                    if inline {
                        supervise_here = true;
                    } else {
                        self.supervise_elsewhere(&local);
                    }
                    local
                }
            }
        };
        let count = lease.lock_state().count;
        self.metrics.acquired(&claim.key, "granted");
        self.metrics.observe(&self.metrics.wait, &claim.key, waited);
        let mut event = lease.event(EventType::Acquired, &self.sidecar);
        event.count = Some(count);
        event.waited_ms = Some(ms(waited));
        self.publish(event);
        Granted {
            lease,
            count,
            expires_at_ms: g.expires_at_ms,
            ttl: claim.ttl,
            waited,
            supervise_here,
        }
    }
}

/// Logs a release the sidecar sent on its own that went unanswered: it is
/// not sent again (a second run could take a hold its owner re-entered
/// meanwhile), so the lease, if it did not run, ends with its ttl — a lock
/// held too long, never twice.
fn unanswered_release(key: &LockKey) {
    tracing::info!(
        lock = %key,
        "a lease given back went unanswered; not sent again (a second run could take a \
         re-entered hold): the lease, if any, ends with its ttl"
    );
}

/// `busy` as a waiter keeps it for as long as it waits, for its 409 at the
/// end (holders and queue length), and as a try-once acquire answers it:
/// without its ticket, with its first [`SHOWN_HOLDERS`] holders (the others
/// counted), and with no spare room in its holders, which a backend may
/// have collected with some.
fn kept(mut busy: Busy) -> Busy {
    busy.ticket = None;
    if busy.holders.len() > SHOWN_HOLDERS {
        busy.omitted += busy.holders.len() - SHOWN_HOLDERS;
        busy.holders.truncate(SHOWN_HOLDERS);
    }
    busy.holders.shrink_to_fit();
    busy
}

/// A busy answer's retry time, or — when it is not in the future (a state
/// that lapsed as the answer came back, a clock that moved) — now the first
/// time and then a growing backoff away (50 ms doubling to 2 s; a future one
/// resets it), so that no answer can make a waiter ask again and again.
fn not_past(retry_at_ms: Option<u64>, backoff: &mut Duration) -> Option<u64> {
    let now = crate::clock::now_ms();
    match retry_at_ms {
        // The first time, at once: the state may just have lapsed.
        Some(at) if at <= now && backoff.is_zero() => {
            *backoff = Duration::from_millis(25);
            Some(now)
        }
        Some(at) if at <= now => {
            *backoff = (*backoff * 2).min(Duration::from_secs(2));
            Some(now + ms(*backoff))
        }
        other => {
            *backoff = Duration::ZERO;
            other
        }
    }
}
