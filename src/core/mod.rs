//! The backend-agnostic lock service: queueing, leases, watchdog, events.
//!
//! [`Core`] turns HTTP-level requests into backend calls. It keeps this
//! sidecar's waiters in local queues ([`Wakeups`]) so that a backend wake-up
//! reaches one waiter, tracks every lease granted through this sidecar
//! ([`Local`]) with a timer at its expiry, renews hold-stream leases
//! (watchdog), and publishes [`Event`]s and metrics.
//!
//! # Layout
//!
//! Bottom layer first:
//!
//! * [`event`]: the events published to `/v1/events` and hold streams.
//! * [`health`]: backend health as operators see it.
//! * [`lease`]: the leases granted through this sidecar, and what an
//!   acquire gives back.
//! * [`expiry`]: the shared expiry timer, and when a lease is looked at.
//! * [`hold`]: hold streams, the watchdog and the expiry checks.
//! * [`acquire`]: caps, FIFO waiting, attempts and grants.
//! * [`answered`]: releases answered lately, by their client's key.
//! * [`release`]: release, keepalive and revoked leases.
//! * [`admin`]: inspect, list, stale keys and force-release.
//! * [`election`]: elections over holds — leaders, observers, who leads here.
//! * [`monitor`]: the one sidecar per backend that does backend-wide work.

mod acquire;
mod admin;
mod answered;
pub mod election;
pub mod event;
mod expiry;
pub mod health;
mod hold;
mod lease;
pub mod monitor;
mod release;

pub use admin::shown_stale;
pub use hold::{HoldEvent, HoldEvents};
pub use lease::{Granted, Local, Outcome};

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::clock::{ms, now_ms};
use crate::wakeups::Wakeups;
pub use event::Event;

use crate::backend::{self, Backend};

/// How recent a reply or message from the backend must be for `/readyz` to
/// answer without asking it ([`Core::ready`]).
const READY_EVIDENCE: Duration = Duration::from_secs(15);
use crate::error::Error;
use crate::lock::{LockKey, Token};
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

/// The lock service of one sidecar.
pub struct Core {
    /// This core itself, for the tasks it spawns.
    me: std::sync::Weak<Core>,
    backend: Arc<dyn Backend>,
    wakeups: Wakeups,
    /// This sidecar's id, stored with its leases and waiters.
    pub sidecar: String,
    pub limits: Limits,
    /// Leases granted through this sidecar and not ended.
    leases: Mutex<lease::Leases>,
    /// Leases given up because the backend could not be reached to renew
    /// them, by token: they answer 410 even if the backend comes back before
    /// their expiry, until a task has released them there (its holds taken
    /// here still to release: the lease's `here`).
    revoked: Mutex<HashMap<Token, Arc<Local>>>,
    /// Releases answered lately, by the `Idempotency-Key` of their client.
    answered: Mutex<answered::Answered>,
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
    /// The same per lock, against `max_waiters`: a lock's count is taken
    /// before its first attempt, as `waiting_slots`, so that claims
    /// arriving together cannot all pass the cap before any joins.
    waiting_on: Mutex<HashMap<LockKey, usize>>,
    /// Leases in `leases` plus attempts under way that may add one, against
    /// `max_held`.
    held_slots: AtomicUsize,
    /// When local leases were last checked against the backend at the
    /// `max_held` cap ([`Core::reclaim_gone`]).
    reclaimed_at: Mutex<Option<Instant>>,
    /// Whether the backend answers, from every operation.
    pub health: health::Health,
    /// Election observers and the elections led through this sidecar.
    elections: election::Elections,
    /// Stale-key scans, one at a time and shared.
    stale_scans: admin::StaleScans,
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
            leases: Mutex::new(lease::Leases::default()),
            revoked: Mutex::new(HashMap::new()),
            answered: Mutex::new(answered::Answered::default()),
            events: broadcast::channel(1024).0,
            metrics,
            shutdown,
            tasks: TaskTracker::new(),
            expiries: expiry::Expiries::default(),
            waiting_slots: AtomicUsize::new(0),
            waiting_on: Mutex::new(HashMap::new()),
            held_slots: AtomicUsize::new(0),
            reclaimed_at: Mutex::new(None),
            elections: election::Elections::default(),
            stale_scans: admin::StaleScans::default(),
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

    /// [`Core::op`] for a release, and whether one that failed may have
    /// run ([`backend::Error::may_have_run`]): such a release is not sent
    /// again by the sidecar (a grant given back, a revoked hold), and the
    /// hold a client's release may have taken is no longer counted as one
    /// to release at shutdown.
    async fn release_own(
        &self,
        key: &LockKey,
        token: &Token,
    ) -> (Result<Option<u32>, Error>, bool) {
        let mut may_have_run = false;
        let released = self
            .op("release", async {
                let released = self.backend.release(key, token).await;
                may_have_run = released.as_ref().is_err_and(backend::Error::may_have_run);
                released
            })
            .await;
        (released, may_have_run)
    }

    /// Checks the backend answers (for `/readyz` and the health check).
    pub async fn ping(&self) -> Result<(), Error> {
        self.op("ping", self.backend.ping()).await
    }

    /// Whether the backend answers, for `/readyz`: without asking it when
    /// the connection it sends this sidecar messages on is up and it replied
    /// or sent something within [`READY_EVIDENCE`] (every sidecar hears the
    /// monitor's announcement every 10 s), so that kubelets probing every pod
    /// cost the backend nothing; else by asking ([`Core::ping`]).
    pub async fn ready(&self) -> Result<(), Error> {
        let heard = now_ms().saturating_sub(self.wakeups.heard_at()) < ms(READY_EVIDENCE);
        if self.backend.connected() == Some(true)
            && (heard || self.health.reached_within(READY_EVIDENCE))
            && !self.health.is_down()
        {
            return Ok(());
        }
        self.ping().await
    }

    fn local(&self, token: &Token) -> Option<Arc<Local>> {
        self.lock_leases().get(token).cloned()
    }

    /// The local lease of `token` if it is a lease on `key`: a request about
    /// one name must never touch another name's lease, even with its token.
    fn local_on(&self, key: &LockKey, token: &Token) -> Option<Arc<Local>> {
        self.local(token).filter(|l| l.key == *key)
    }

    fn lock_leases(&self) -> std::sync::MutexGuard<'_, lease::Leases> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_revoked(&self) -> std::sync::MutexGuard<'_, HashMap<Token, Arc<Local>>> {
        self.revoked.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `token` was given up for an unreachable backend and is not
    /// yet released there.
    fn is_revoked(&self, token: &Token) -> bool {
        self.lock_revoked().contains_key(token)
    }

    /// Forgets revoked `lease`, unless its token was granted and revoked
    /// again since (another lease of the token, with a task of its own).
    fn forget_revoked_lease(&self, lease: &Arc<Local>) {
        let mut revoked = self.lock_revoked();
        if revoked
            .get(&lease.token)
            .is_some_and(|l| Arc::ptr_eq(l, lease))
        {
            revoked.remove(&lease.token);
        }
    }

    /// Number of leases held through this sidecar.
    pub fn held(&self) -> usize {
        self.lock_leases().len()
    }

    /// Number of requests of this sidecar waiting in queues.
    pub fn waiting(&self) -> usize {
        self.wakeups.total()
    }
}
