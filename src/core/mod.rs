//! The backend-agnostic lock service: queueing, leases, watchdog, events.
//!
//! [`Core`] turns HTTP-level requests into backend calls. It keeps this
//! sidecar's waiters in local queues ([`Wakeups`]) so that a backend wake-up
//! reaches one waiter, tracks every lease granted through this sidecar
//! ([`Local`]) with a timer at its expiry, renews hold-stream leases
//! (watchdog), and publishes [`Event`]s and metrics.

pub mod event;
mod expiry;
pub mod health;

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::broadcast;
use tokio::time::sleep_until;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::wakeups::{Place, Wakeups};
pub use event::{Event, EventType};

use crate::backend::{self, Attempt, Backend, Busy, Grant, Loss, State, Status, Summary, Turn};
use crate::clock::{after, drift_ms, instant_at, ms, now_ms};
use crate::error::Error;
use crate::lock::{Claim, Held, Kind, LockKey, LostReason, Mode, Token};
use crate::metrics::Metrics;

/// Limits and defaults from the configuration.
#[derive(Debug, Clone)]
pub struct Limits {
    pub default_ttl: Duration,
    pub max_ttl: Duration,
    pub max_wait: Duration,
    pub lock_delay: Duration,
    pub stale_after: Duration,
    /// Local waiters per key before acquires are refused with 429.
    pub max_waiters: usize,
    /// Waiting requests (acquires and holds) of this sidecar, over all
    /// keys, before further waits are refused with 429.
    pub max_total_waiters: usize,
    /// Leases held through this sidecar before further acquires are
    /// refused with 429.
    pub max_held: usize,
}

impl Default for Limits {
    /// The defaults of the configuration.
    fn default() -> Self {
        Self {
            default_ttl: Duration::from_secs(30),
            max_ttl: Duration::from_secs(3600),
            max_wait: Duration::from_secs(3600),
            lock_delay: Duration::ZERO,
            stale_after: Duration::from_secs(3600),
            max_waiters: 10_000,
            max_total_waiters: 20_000,
            max_held: 100_000,
        }
    }
}

/// How a lease granted through this sidecar ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Released,
    Lost(LostReason),
}

/// A lease granted through this sidecar.
pub struct Local {
    pub key: LockKey,
    pub token: Token,
    pub owner: String,
    pub mode: Mode,
    pub fence: u64,
    /// The ttl the watchdog renews to.
    pub ttl: Duration,
    pub since_ms: u64,
    /// Renewals stop here (`max_hold`).
    pub cap_ms: Option<u64>,
    /// Current expiry and hold count, as last seen.
    state: Mutex<(u64, u32)>,
    /// A renewal through this sidecar has started and none has succeeded
    /// since: the backend may not have extended the lease.
    renewing: AtomicBool,
    /// How the lease ended; set once.
    end: std::sync::OnceLock<End>,
    /// Cancelled once `end` is set. (A token rather than a watch channel:
    /// every lease has one, and a watch channel is several times larger.)
    ended: CancellationToken,
    /// Where the shared expiry timer has it filed, if it has.
    filing: expiry::Filing,
}

impl Local {
    /// When the lease expires unless renewed.
    pub fn expires_at_ms(&self) -> u64 {
        self.lock_state().0
    }

    /// Hold count.
    pub fn count(&self) -> u32 {
        self.lock_state().1
    }

    fn set(&self, expires_at_ms: Option<u64>, count: Option<u32>) {
        let mut s = self.lock_state();
        if let Some(e) = expires_at_ms {
            s.0 = e;
        }
        if let Some(c) = count {
            s.1 = c;
        }
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, (u64, u32)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn event(&self, event: EventType, sidecar: &str) -> Event {
        Event {
            event,
            name: self.key.name.to_string(),
            kind: self.key.kind,
            owner: self.owner.clone(),
            sidecar: sidecar.to_owned(),
            mode: Held::of(self.key.kind, self.mode),
            fence: Some(self.fence),
            at_ms: now_ms(),
            reason: None,
            count: None,
            waited_ms: None,
            held_ms: None,
            position: None,
        }
    }
}

/// A successful acquire.
#[derive(Clone)]
pub struct Granted {
    pub lease: Arc<Local>,
    pub count: u32,
    pub expires_at_ms: u64,
    pub waited: Duration,
    /// The lease is new and its expiry timer is the caller's to run (a
    /// hold runs it inside its watchdog); otherwise the shared timer has it
    /// or, re-entered, had one already.
    supervise_here: bool,
}

/// The result of an acquire that did not fail.
pub enum Outcome {
    Granted(Granted),
    /// Not granted within `wait` (`waited` is zero for try-once).
    Busy {
        busy: Busy,
        waited: Duration,
    },
    /// The caller went away or the sidecar is shutting down.
    Cancelled,
}

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
    queue: Mutex<VecDeque<HoldEvent>>,
    /// Cancelled when the client has gone.
    left: CancellationToken,
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

/// The lock service of one sidecar.
pub struct Core {
    /// This core itself, for the tasks it spawns.
    me: std::sync::Weak<Core>,
    backend: Arc<dyn Backend>,
    wakeups: Wakeups,
    /// This sidecar's id, stored with its leases and waiters.
    pub sidecar: String,
    pub limits: Limits,
    /// Leases granted through this sidecar and not ended, by token.
    leases: Mutex<HashMap<Token, Arc<Local>>>,
    /// Tokens of leases given up because the backend could not be reached to
    /// renew them: they answer 410 even if the backend comes back before
    /// their expiry, until a task has released them there.
    revoked: Mutex<HashSet<Token>>,
    events: broadcast::Sender<Event>,
    pub metrics: Arc<Metrics>,
    /// Cancelled on SIGTERM: ends waits, holds and event streams.
    pub shutdown: CancellationToken,
    /// Every background task, so shutdown can wait for them.
    pub tasks: TaskTracker,
    /// The expiry timer of leases without a hold.
    expiries: expiry::Expiries,
    /// Waits under way or about to start (acquires and holds with a
    /// `wait`), against `max_total_waiters`.
    waiting_slots: AtomicUsize,
    /// Leases in `leases` plus attempts under way that may add one, against
    /// `max_held`.
    held_slots: AtomicUsize,
    /// Whether the backend answers, from every operation.
    pub health: health::Health,
}

/// One place under a per-sidecar cap, given back when dropped unless kept.
struct Slot<'a>(Option<&'a AtomicUsize>);

impl<'a> Slot<'a> {
    /// A place in `count` if it is below `limit`.
    fn take(count: &'a AtomicUsize, limit: usize) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(Some(count)))
    }

    /// Keeps the place taken (a new lease's, given back when it ends).
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Some(count) = self.0 {
            count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Clears a lease's `renewing` mark when a renewal is dropped unfinished (its
/// client went away): it is no longer under way and may have worked, so the
/// expiry timer asks the backend instead of giving the lease up.
struct Underway<'a>(Option<&'a AtomicBool>);

impl Drop for Underway<'_> {
    fn drop(&mut self) {
        if let Some(renewing) = self.0 {
            renewing.store(false, Ordering::Relaxed);
        }
    }
}

/// Decrements the waiters gauge when a waiter leaves, however it leaves.
struct Waiting<'a> {
    metrics: &'a Metrics,
    kind: Kind,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.metrics
            .waiters
            .with_label_values(&[self.kind.as_str()])
            .dec();
    }
}

impl Core {
    /// A lock service over `backend`, which wakes waiters through `wakeups`.
    pub fn new(
        backend: Arc<dyn Backend>,
        wakeups: Wakeups,
        sidecar: String,
        limits: Limits,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        let health = health::Health::new(&backend.describe(), metrics.backend_up.clone());
        Arc::new_cyclic(|me| Self {
            me: me.clone(),
            health,
            backend,
            wakeups,
            sidecar,
            limits,
            leases: Mutex::new(HashMap::new()),
            revoked: Mutex::new(HashSet::new()),
            events: broadcast::channel(1024).0,
            metrics,
            shutdown,
            tasks: TaskTracker::new(),
            expiries: expiry::Expiries::default(),
            waiting_slots: AtomicUsize::new(0),
            held_slots: AtomicUsize::new(0),
        })
    }

    /// The backend, for its description.
    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// A live feed of this sidecar's lock events.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    fn publish(&self, event: Event) {
        // No subscribers is fine: events are for whoever watches.
        let _ = self.events.send(event);
    }

    /// Runs one backend operation, counting it and its failure.
    async fn op<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, backend::Error>>,
    ) -> Result<T, Error> {
        let started = Instant::now();
        let result = fut.await;
        let m = &self.metrics;
        m.backend_ops.with_label_values(&[op]).inc();
        m.backend_seconds
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(value) => {
                self.health.reached();
                Ok(value)
            }
            Err(e) => {
                if let Some(cause) = e.cause() {
                    m.backend_errors.with_label_values(&[op]).inc();
                    self.health.unreachable(cause);
                    tracing::debug!(op, %cause, error = %crate::backend::chain(&e), "backend unavailable");
                    return Err(Error::Unavailable {
                        backend: Some(self.backend.describe()),
                        cause,
                        op,
                    });
                }
                // The backend answered (a conflict, a refusal): it is up.
                self.health.reached();
                Err(Error::from(e))
            }
        }
    }

    /// Checks the backend answers (for `/readyz` and the health check).
    pub async fn ping(&self) -> Result<(), Error> {
        self.op("ping", self.backend.ping()).await
    }

    fn local(&self, token: &Token) -> Option<Arc<Local>> {
        self.lock_leases().get(token).cloned()
    }

    /// The local lease of `token` if it is a lease on `key`: a request about
    /// one name must never touch another name's lease, even with its token.
    fn local_on(&self, key: &LockKey, token: &Token) -> Option<Arc<Local>> {
        self.local(token).filter(|l| l.key == *key)
    }

    fn lock_leases(&self) -> std::sync::MutexGuard<'_, HashMap<Token, Arc<Local>>> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_revoked(&self) -> std::sync::MutexGuard<'_, HashSet<Token>> {
        self.revoked.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `token` was given up for an unreachable backend and is not
    /// yet released there.
    fn is_revoked(&self, token: &Token) -> bool {
        self.lock_revoked().contains(token)
    }

    /// Number of leases held through this sidecar.
    pub fn held(&self) -> usize {
        self.lock_leases().len()
    }

    /// Number of requests of this sidecar waiting in queues.
    pub fn waiting(&self) -> usize {
        self.wakeups.total()
    }

    fn full_of_leases(&self) -> Error {
        Error::SidecarFull {
            cap: "max_held",
            flag: "max-held",
            what: "leases held",
            limit: self.limits.max_held,
        }
    }

    fn full_of_waiters(&self) -> Error {
        Error::SidecarFull {
            cap: "max_total_waiters",
            flag: "max-total-waiters",
            what: "requests waiting",
            limit: self.limits.max_total_waiters,
        }
    }

    /// Checks that a new acquire (one that may wait if `waits`) would find
    /// room under this sidecar's caps now, so that a hold can answer 429
    /// before its stream starts. The acquire itself takes the place.
    ///
    /// # Errors
    /// [`Error::SidecarFull`] naming the cap reached.
    pub fn check_room(&self, waits: bool) -> Result<(), Error> {
        if waits && self.waiting_slots.load(Ordering::Acquire) >= self.limits.max_total_waiters {
            return Err(self.full_of_waiters());
        }
        if self.held_slots.load(Ordering::Acquire) >= self.limits.max_held {
            return Err(self.full_of_leases());
        }
        Ok(())
    }

    /// A place for one more lease under `max_held`, for an attempt.
    fn held_slot(&self, key: &LockKey) -> Result<Slot<'_>, Error> {
        Slot::take(&self.held_slots, self.limits.max_held).ok_or_else(|| {
            self.metrics.acquired(key, "rejected");
            self.full_of_leases()
        })
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
    async fn acquire_for(
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
        if queueing && self.wakeups.len(key) >= self.limits.max_waiters {
            self.metrics.acquired(key, "rejected");
            return Err(Error::TooManyWaiters {
                limit: self.limits.max_waiters,
            });
        }
        // Taken before the first attempt, so the cap holds however many
        // acquires race; given back when this returns or is dropped.
        let _waiting_slot = match queueing {
            true => Some(
                Slot::take(&self.waiting_slots, self.limits.max_total_waiters).ok_or_else(
                    || {
                        self.metrics.acquired(key, "rejected");
                        self.full_of_waiters()
                    },
                )?,
            ),
            false => None,
        };
        let turn = if queueing { Turn::Join } else { Turn::Once };
        let slot = self.held_slot(key)?;
        let busy = match self.attempt(claim, turn).await? {
            Attempt::Granted(g) => {
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
                busy,
                waited: Duration::ZERO,
            });
        };

        let place = self.wakeups.join(key, ticket.seq);
        let mut moves = place.moves();
        self.metrics
            .waiters
            .with_label_values(&[key.kind.as_str()])
            .inc();
        let _waiting = Waiting {
            metrics: &self.metrics,
            kind: key.kind,
        };
        let watch = match self.op("watch", self.backend.watch(key)).await {
            Ok(w) => w,
            Err(e) => {
                let _ = self.op("dequeue", self.backend.dequeue(&ticket)).await;
                self.metrics.acquired(key, "error");
                return Err(e);
            }
        };
        let (local_pos, _) = place.position();
        let mut offset = busy.position.unwrap_or(local_pos).saturating_sub(local_pos);
        let mut reported = None;
        self.report_position(&place, offset, &mut reported, busy.queue_length, progress);
        let mut queued = self.claim_event(claim, EventType::Queued);
        queued.position = busy.position;
        self.publish(queued);

        let mut retry_at = busy.retry_at_ms;
        let mut last = busy;
        let outcome = loop {
            // A wake-up and a cancellation can arrive together (shutdown
            // releases locks, which wakes waiters): cancellation wins.
            if cancel.is_cancelled() || self.shutdown.is_cancelled() {
                break Outcome::Cancelled;
            }
            if place.is_head() {
                let slot = match self.held_slot(key) {
                    Ok(slot) => slot,
                    Err(e) => {
                        drop(place);
                        let _ = self.op("dequeue", self.backend.dequeue(&ticket)).await;
                        return Err(e);
                    }
                };
                match self.attempt(claim, Turn::Queued(&ticket)).await {
                    Ok(Attempt::Granted(g)) => {
                        let pass_on = claim.mode == Mode::Shared || key.kind == Kind::Semaphore;
                        place.leave_granted(pass_on);
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
                        retry_at = b.retry_at_ms;
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
                        last = b;
                    }
                    Err(e) => {
                        // `attempt` counted the failure.
                        let _ = self.op("dequeue", self.backend.dequeue(&ticket)).await;
                        return Err(e);
                    }
                }
            }
            let retry = retry_at.map(instant_at);
            tokio::select! {
                biased;
                () = cancel.cancelled() => break Outcome::Cancelled,
                () = self.shutdown.cancelled() => break Outcome::Cancelled,
                () = place.notified() => {}
                () = sleep_until(retry.unwrap_or(deadline)), if retry.is_some() => retry_at = None,
                () = sleep_until(deadline) => break Outcome::Busy { busy: last, waited: started.elapsed() },
                Ok(()) = moves.changed(), if progress.is_some() => {
                    self.report_position(&place, offset, &mut reported, 0, progress);
                }
            }
        };
        drop(place);
        drop(watch);
        let _ = self.op("dequeue", self.backend.dequeue(&ticket)).await;
        let result = match &outcome {
            Outcome::Busy { .. } => "timeout",
            _ => "cancelled",
        };
        self.metrics.acquired(key, result);
        Ok(outcome)
    }

    /// Sends a `queued` update when the position changed.
    fn report_position(
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
    async fn attempt(&self, claim: &Claim, turn: Turn<'_>) -> Result<Attempt, Error> {
        let result = self
            .op("try_acquire", self.backend.try_acquire(claim, turn))
            .await;
        match &result {
            Err(Error::Unavailable { .. }) => self.metrics.acquired(&claim.key, "error"),
            Err(_) => self.metrics.acquired(&claim.key, "rejected"),
            Ok(_) => {}
        }
        result
    }

    fn claim_event(&self, claim: &Claim, event: EventType) -> Event {
        Event {
            event,
            name: claim.key.name.to_string(),
            kind: claim.key.kind,
            owner: claim.owner.clone(),
            sidecar: self.sidecar.clone(),
            mode: Held::of(claim.key.kind, claim.mode),
            fence: None,
            at_ms: now_ms(),
            reason: None,
            count: None,
            waited_ms: None,
            held_ms: None,
            position: None,
        }
    }

    /// Records a grant of `claim`: the local lease (new, or re-entered),
    /// metrics and the `acquired` event. A new lease's expiry timer goes to
    /// the shared timer ([`Core::supervise_elsewhere`]) unless `inline` (a
    /// hold, which runs it itself). A new lease keeps `slot`, its place
    /// under `max_held`.
    fn granted(
        &self,
        claim: &Claim,
        g: Grant,
        started: Instant,
        inline: bool,
        slot: Slot<'_>,
    ) -> Granted {
        let mut supervise_here = false;
        let waited = started.elapsed();
        // A reentrant grant of a token given up earlier holds again.
        self.lock_revoked().remove(&g.token);
        let lease = {
            let mut leases = self.lock_leases();
            match leases.get(&g.token) {
                Some(local) => {
                    local.set(Some(g.expires_at_ms), Some(g.count));
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
                        cap_ms: claim.max_hold.map(|m| g.since_ms.saturating_add(ms(m))),
                        state: Mutex::new((g.expires_at_ms, g.count)),
                        renewing: AtomicBool::new(false),
                        end: std::sync::OnceLock::new(),
                        ended: CancellationToken::new(),
                        filing: expiry::Filing::default(),
                    });
                    leases.insert(g.token.clone(), local.clone());
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
        self.metrics.acquired(&claim.key, "granted");
        self.metrics.observe(&self.metrics.wait, &claim.key, waited);
        let mut event = lease.event(EventType::Acquired, &self.sidecar);
        event.count = Some(g.count);
        event.waited_ms = Some(ms(waited));
        self.publish(event);
        Granted {
            lease,
            count: g.count,
            expires_at_ms: g.expires_at_ms,
            waited,
            supervise_here,
        }
    }

    /// Ends a local lease once: removes it, counts it, publishes the event.
    /// Returns false if it had ended already.
    fn end(&self, local: &Local, end: End) -> bool {
        if local.end.set(end).is_err() {
            return false;
        }
        local.ended.cancel();
        self.expiries.remove(local);
        if self.lock_leases().remove(&local.token).is_some() {
            self.held_slots.fetch_sub(1, Ordering::AcqRel);
        }
        let m = &self.metrics;
        m.held.with_label_values(&[local.key.kind.as_str()]).dec();
        let held = Duration::from_millis(now_ms().saturating_sub(local.since_ms));
        m.observe(&m.hold, &local.key, held);
        let mut event = match end {
            End::Released => local.event(EventType::Released, &self.sidecar),
            End::Lost(reason) => {
                m.lost.with_label_values(&[reason.as_str()]).inc();
                let kind = match reason {
                    LostReason::Expired | LostReason::MaxHold => {
                        m.expirations
                            .with_label_values(&[local.key.kind.as_str()])
                            .inc();
                        EventType::Expired
                    }
                    LostReason::ForceReleased => EventType::ForceReleased,
                    _ => EventType::Lost,
                };
                let mut e = local.event(kind, &self.sidecar);
                e.reason = Some(reason);
                e
            }
        };
        event.held_ms = Some(ms(held));
        self.publish(event);
        true
    }

    /// Releases one hold of a lease by its token.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] when the token holds nothing; backend outages.
    pub async fn release(&self, key: &LockKey, token: &Token) -> Result<u32, Error> {
        if self.is_revoked(token) {
            return Err(Error::LeaseLost);
        }
        let result = self.op("release", self.backend.release(key, token)).await?;
        let local = self.local_on(key, token);
        match (result, local) {
            (Some(0), Some(local)) => {
                self.end(&local, End::Released);
                Ok(0)
            }
            (Some(n), Some(local)) => {
                local.set(None, Some(n));
                Ok(n)
            }
            (Some(n), None) => Ok(n),
            (None, local) => {
                if let Some(local) = local {
                    self.end(&local, End::Lost(LostReason::Expired));
                }
                Err(Error::LeaseLost)
            }
        }
    }

    /// The ttl of a lease on `key` granted through this sidecar.
    pub fn lease_ttl(&self, key: &LockKey, token: &Token) -> Option<Duration> {
        self.local_on(key, token).map(|l| l.ttl)
    }

    /// Extends a lease to `ttl` (default: its own) from now.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] when the token holds nothing; backend outages.
    pub async fn keepalive(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<u64, Error> {
        if self.is_revoked(token) {
            self.metrics.renewals.with_label_values(&["lost"]).inc();
            return Err(Error::LeaseLost);
        }
        let renewal = self.op("renew", self.backend.renew(key, token, ttl));
        let renewed = match self.local_on(key, token) {
            Some(local) => {
                local.renewing.store(true, Ordering::Relaxed);
                let mut underway = Underway(Some(&local.renewing));
                let renewed = tokio::select! {
                    renewed = renewal => renewed,
                    // A renewal hanging on an unreachable backend must not
                    // outlive the lease: its client learns with the others.
                    () = local.ended.cancelled() => {
                        self.metrics.renewals.with_label_values(&["lost"]).inc();
                        return Err(Error::LeaseLost);
                    }
                };
                // Finished: its result decides the mark below.
                underway.0 = None;
                renewed
            }
            None => renewal.await,
        };
        let local = self.local_on(key, token);
        match renewed {
            // Given up while the renewal was under way: the client was told.
            Ok(Some(_)) if local.is_none() && self.is_revoked(token) => {
                self.metrics.renewals.with_label_values(&["lost"]).inc();
                Err(Error::LeaseLost)
            }
            Ok(Some(expires_at_ms)) => {
                self.metrics.renewals.with_label_values(&["ok"]).inc();
                if let Some(local) = local {
                    local.set(Some(expires_at_ms), None);
                    local.renewing.store(false, Ordering::Relaxed);
                }
                Ok(expires_at_ms)
            }
            Ok(None) => {
                self.metrics.renewals.with_label_values(&["lost"]).inc();
                if let Some(local) = local {
                    let reason = lapse_reason(&local);
                    self.end(&local, End::Lost(reason));
                }
                Err(Error::LeaseLost)
            }
            Err(e) => {
                self.metrics.renewals.with_label_values(&["error"]).inc();
                // Too close to its expiry for another try to be safe.
                if let Some(local) = local
                    && now_ms().saturating_add(margin_ms(local.ttl)) >= local.expires_at_ms()
                {
                    self.revoke(&local);
                }
                // Given up now or while the renewal was under way.
                if self.is_revoked(token) {
                    Err(Error::LeaseLost)
                } else {
                    Err(e)
                }
            }
        }
    }

    /// Gives up a lease whose renewals cannot reach the backend, before the
    /// backend can expire it and grant it to someone else: ends it as lost
    /// (the client is told now), answers 410 for its token from here on, and
    /// releases it in the backend once the backend answers again.
    fn revoke(&self, lease: &Arc<Local>) {
        // Marked before the end, so no request sees it neither held nor revoked.
        self.lock_revoked().insert(lease.token.clone());
        if !self.end(lease, End::Lost(LostReason::Unreachable)) {
            // It had ended already, and the client was told how.
            self.lock_revoked().remove(&lease.token);
            return;
        }
        tracing::warn!(
            lock = %lease.key,
            owner = %lease.owner,
            "backend unreachable near the lease's expiry; lease given up"
        );
        if let Some(me) = self.me.upgrade() {
            self.tasks.spawn(me.release_revoked(lease.clone()));
        }
    }

    /// Releases a revoked lease in the backend, retrying until the backend
    /// answers (it may have expired the lease meanwhile) or the token is
    /// granted again.
    async fn release_revoked(self: Arc<Self>, lease: Arc<Local>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            if !self.is_revoked(&lease.token) {
                return;
            }
            match self
                .op("release", self.backend.release(&lease.key, &lease.token))
                .await
            {
                Ok(Some(n)) if n > 0 => continue,
                Ok(_) => {
                    self.lock_revoked().remove(&lease.token);
                    return;
                }
                Err(_) => {}
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = self.shutdown.cancelled() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// The global state of a key.
    ///
    /// # Errors
    /// Backend outages.
    pub async fn inspect(&self, key: &LockKey) -> Result<State, Error> {
        self.op("inspect", self.backend.inspect(key)).await
    }

    /// Held or contended keys.
    ///
    /// # Errors
    /// Backend outages.
    pub async fn list(
        &self,
        prefix: &str,
        after: Option<&LockKey>,
        limit: usize,
    ) -> Result<Vec<Summary>, Error> {
        self.op("list", self.backend.list(prefix, after, limit))
            .await
    }

    /// Keys an operator should look at.
    ///
    /// # Errors
    /// Backend outages.
    pub async fn stale(&self) -> Result<Vec<backend::StaleKey>, Error> {
        let stale = self
            .op("stale", self.backend.stale(self.limits.stale_after))
            .await?;
        self.metrics.stale.set(stale.len() as f64);
        Ok(stale)
    }

    /// Removes every holder of `key`; `who` describes the caller for the log.
    ///
    /// # Errors
    /// Backend outages.
    pub async fn force_release(&self, key: &LockKey, who: &str) -> Result<usize, Error> {
        let tokens = self
            .op("force_release", self.backend.force_release(key))
            .await?;
        tracing::warn!(lock = %key, holders = tokens.len(), who, "force-released");
        self.metrics.force_releases.inc();
        for token in &tokens {
            if let Some(local) = self.local_on(key, token) {
                self.end(&local, End::Lost(LostReason::ForceReleased));
            }
        }
        Ok(tokens.len())
    }

    /// Runs a hold stream: acquire, then renew every ttl/3 until the client
    /// goes away (release), the lease is lost, or the sidecar shuts down.
    /// Events go to `events`; the stream ends when this returns. Leaving
    /// (cancelling `events.left()`) ends it early: the wait is given up, a
    /// lease released.
    ///
    /// The claim comes boxed: an argument stays part of the hold's state
    /// for as long as the lock is held, a box only while it is acquired.
    pub async fn hold(&self, claim: Box<Claim>, wait: Duration, events: &HoldEvents) {
        // Boxed and dropped once done: inline, the acquire's state would
        // stay part of the hold for as long as the lock is held.
        let outcome = Box::pin(async move {
            self.acquire_for(&claim, wait, &events.left, Some(events))
                .await
        })
        .await;
        let granted = match outcome {
            Ok(Outcome::Granted(g)) => g,
            Ok(Outcome::Busy { busy, waited }) => {
                events.send(HoldEvent::Timeout {
                    busy: Box::new(busy),
                    waited,
                });
                return;
            }
            Ok(Outcome::Cancelled) => {
                if self.shutdown.is_cancelled() {
                    events.send(HoldEvent::Lost(LostReason::Shutdown));
                }
                return;
            }
            Err(e) => {
                events.send(HoldEvent::Failed(Box::new(e)));
                return;
            }
        };
        let lease = granted.lease.clone();
        let supervise = granted.supervise_here;
        if self.shutdown.is_cancelled() {
            // Granted by an attempt already in flight when shutdown began.
            Box::pin(self.release_fully(&lease)).await;
            events.send(HoldEvent::Lost(LostReason::Shutdown));
            return;
        }
        if !events.send(HoldEvent::Acquired(Box::new(granted))) {
            // The client left as the grant arrived.
            let _ = Box::pin(self.release(&lease.key, &lease.token)).await;
            if supervise {
                self.supervise_elsewhere(&lease);
            }
            return;
        }
        self.watchdog(&lease, events, supervise).await;
    }

    // The rare ends (release, shutdown) are boxed: inline, their state
    // would be part of every hold for as long as it waits for the next renewal.
    // With `supervise`, the lease's expiry timer runs here too (its
    // checkpoints and renewals share one timer), and goes to the shared
    // timer if the hold ends before the lease.
    async fn watchdog(&self, lease: &Arc<Local>, events: &HoldEvents, mut supervise: bool) {
        let every = (lease.ttl / 3).max(Duration::from_millis(1));
        // After a failed renewal, try again sooner: the lease is running out.
        let retry = (every / 3).max(Duration::from_millis(1));
        let mut next = after(every);
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
                lease.expires_at_ms().saturating_add(drift_ms(lease.ttl)) >= cap
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
                let renewal = Box::pin(self.keepalive(&lease.key, &lease.token, Some(lease.ttl)));
                if !supervise {
                    return Tick::Renewed(renewal.await.ok());
                }
                tokio::select! {
                    renewed = renewal => Tick::Renewed(renewed.ok()),
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
                    Tick::Renewed(Some(expires_at_ms)) => {
                        next = after(every);
                        let ttl_ms = expires_at_ms.saturating_sub(now_ms()).min(ms(lease.ttl));
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
                    let _ = Box::pin(self.release(&lease.key, &lease.token)).await;
                    if supervise {
                        // Still held (re-entered, or the release failed).
                        self.supervise_elsewhere(lease);
                    }
                    return;
                }
                () = self.shutdown.cancelled() => {
                    events.send(HoldEvent::Lost(LostReason::Shutdown));
                    Box::pin(self.release_fully(lease)).await;
                    return;
                }
            }
        }
    }

    /// Releases every hold count of a local lease and ends it as lost by shutdown.
    async fn release_fully(&self, lease: &Local) {
        for _ in 0..=lease.count() {
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

    /// Releases everything this sidecar holds (shutdown). Returns how many.
    pub async fn release_everything(&self) -> usize {
        let all: Vec<Arc<Local>> = self.lock_leases().values().cloned().collect();
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
    fn supervise_elsewhere(&self, lease: &Arc<Local>) {
        self.expiries.file(self, lease);
    }

    /// The expiry timer's look at `lease` at its checkpoint, `seen` its
    /// expiry when the checkpoint was set, `renewing` whether a renewal was
    /// under way there. False once the lease has ended.
    async fn check_expiry(&self, lease: &Arc<Local>, seen: u64, renewing: bool) -> bool {
        match self.look(lease, seen, renewing) {
            Look::Ended => false,
            Look::Again => true,
            Look::Ask => self.ask_expired(lease).await,
        }
    }

    /// What [`Core::check_expiry`] can tell without the backend.
    fn look(&self, lease: &Arc<Local>, seen: u64, renewing: bool) -> Look {
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
    async fn ask_expired(&self, lease: &Arc<Local>) -> bool {
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
                        if let Some(local) = me.local(&token) {
                            me.end(&local, End::Lost(LostReason::Backend));
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
    fn lapsed(&self, lease: &Local, loss: Loss) {
        let reason = match loss {
            Loss::Expired => lapse_reason(lease),
            Loss::ForceReleased => LostReason::ForceReleased,
            Loss::Backend => LostReason::Backend,
        };
        self.end(lease, End::Lost(reason));
    }
}

/// What woke a hold's watchdog.
enum Tick {
    /// A renewal ended, with the new expiry if it worked.
    Renewed(Option<u64>),
    /// The expiry checkpoint came; whether a renewal was under way then.
    Checkpoint(bool),
}

/// What the expiry timer found at a checkpoint, before asking the backend.
enum Look {
    /// The lease has ended (or was given up now).
    Ended,
    /// Not due yet: look again at the next checkpoint.
    Again,
    /// Past its expiry by our clock: ask the backend.
    Ask,
}

/// When the expiry timer next looks at `lease`: its expiry as seen now,
/// and the safety margin before it (the expiry itself once inside the margin).
fn expiry_checkpoint(lease: &Local) -> (u64, u64) {
    let expires_at_ms = lease.expires_at_ms();
    let margin = margin_ms(lease.ttl);
    let checkpoint = if expires_at_ms > now_ms().saturating_add(margin) {
        expires_at_ms - margin
    } else {
        expires_at_ms
    };
    (expires_at_ms, checkpoint)
}

/// How long before a lease's expiry the sidecar gives it up when its
/// renewals cannot reach the backend: the drift allowance plus a tenth of the
/// ttl, so that the holder is told `lost` before the backend can expire the
/// lease and grant it to another sidecar.
pub fn margin_ms(ttl: Duration) -> u64 {
    drift_ms(ttl).saturating_add(ms(ttl) / 10)
}

/// Why a lease the backend no longer has ended: `max_hold` if renewals had
/// reached its cap, `expired` if its time was up, else `backend` (it
/// vanished while still valid: key deleted, token overwritten, data lost).
fn lapse_reason(lease: &Local) -> LostReason {
    let now = now_ms();
    match lease.cap_ms {
        Some(cap) if now.saturating_add(drift_ms(lease.ttl)) >= cap => LostReason::MaxHold,
        _ if now < lease.expires_at_ms() => LostReason::Backend,
        _ => LostReason::Expired,
    }
}
