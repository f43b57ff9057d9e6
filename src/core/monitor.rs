//! The monitor: one sidecar per backend does the work that reads the whole
//! keyspace (the stale scan) or tidies it ([`Backend::tidy`]), so that the backend's idle load is the same
//! for one sidecar as for a thousand.
//!
//! The sidecars elect it with their own locks: the monitor holds election
//! [`MONITOR`] (reserved: no client campaigns or observes under it) with a
//! [`TTL`] lease, renews it every [`BEAT`] and announces it then
//! ([`Backend::announce`]), which reaches every sidecar through the
//! subscription it keeps anyway, at no cost per sidecar. The others observe
//! the election and send nothing while they hear it. They look again — one
//! `inspect`, then an attempt if nobody holds it — when the announcements
//! stop for [`SILENCE`], or, where the backend reports the end of a dead
//! holder's lease itself ([`Backend::reports_lease_ends`]), at each change
//! of the election; each after a random delay of up to [`SPREAD`], so that
//! many sidecars do not all look at once. A monitor that shuts down
//! releases the election and announces it.
//!
//! [`Backend::announce`]: crate::backend::Backend::announce
//! [`Backend::tidy`]: crate::backend::Backend::tidy
//! [`Backend::reports_lease_ends`]: crate::backend::Backend::reports_lease_ends

use std::sync::Arc;
use std::time::Duration;

use rand::RngExt;
use tokio::time::{Instant, sleep_until};
use tokio_util::task::AbortOnDropHandle;

use crate::backend::{Attempt, Turn};
use crate::clock::after;
use crate::lock::{Claim, Kind, LockKey, Mode, Name, Token};

use super::Core;
use super::election::Candidate;

/// The election of the monitor.
pub const MONITOR: &str = "sidelock.monitor";
/// The monitor's lease: a monitor that dies is replaced about this long
/// (plus [`SILENCE`]) later, or at once where the backend reports it.
const TTL: Duration = Duration::from_secs(30);
/// How often the monitor renews its lease and announces itself.
const BEAT: Duration = Duration::from_secs(10);
/// Announcements missed for this long: the monitor may be gone.
const SILENCE: Duration = Duration::from_secs(25);
/// The longest a sidecar waits, at random, before it looks.
const SPREAD: Duration = Duration::from_secs(5);
/// Where the backend reports lease ends: the longest a sidecar goes
/// without looking, a safety net for a lost notification.
const RECHECK: Duration = Duration::from_secs(600);
/// How often the monitor scans for stale keys.
pub const STALE_EVERY: Duration = Duration::from_secs(60);

/// The lock key of the monitor's election.
pub fn monitor_key() -> LockKey {
    LockKey {
        kind: Kind::Election,
        name: Name::parse(MONITOR).expect("a valid name"),
    }
}

/// Whether `name` is the reserved election of the monitor.
pub fn is_reserved(name: &Name) -> bool {
    name.as_str() == MONITOR
}

impl Core {
    /// Starts taking part in electing the monitor, and doing its work while
    /// elected, until shutdown.
    pub fn monitor(self: &Arc<Self>) {
        let me = self.clone();
        self.tasks.spawn(async move { me.run_monitor().await });
    }

    async fn run_monitor(self: Arc<Self>) {
        let key = monitor_key();
        let claim = Claim {
            key: key.clone(),
            mode: Mode::Exclusive,
            owner: Candidate::new("sidelock".into(), Some(self.sidecar.clone())).encode(),
            sidecar: self.sidecar.clone(),
            ttl: TTL,
            limit: None,
            lock_delay: Duration::ZERO,
            max_hold: None,
        };
        let changed = self.wakeups.observe(&key);
        let reports_ends = self.backend.reports_lease_ends();
        let mut delivery = None;
        // At start-up, look at once: there may be no monitor.
        let mut look_at = Instant::now();
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                () = changed.notified() => {
                    // An announcement: the monitor lives (or, where ends are
                    // reported, the election changed: look soon).
                    look_at = if reports_ends { spread(Duration::ZERO) } else { spread(SILENCE) };
                    continue;
                }
                () = sleep_until(look_at) => {}
            }
            look_at = spread(if reports_ends { RECHECK } else { SILENCE });
            let held = match self.op("inspect", self.backend.inspect(&key)).await {
                Ok(state) => !state.holders.is_empty(),
                Err(_) => continue,
            };
            // After the look, so that an unreachable backend is reported by
            // the plain call's error rather than the subscription's.
            if delivery.is_none() {
                delivery = self.op("observe", self.backend.observe(&key)).await.ok();
            }
            if held {
                continue;
            }
            if let Ok(Attempt::Granted(grant)) = self
                .op("try_acquire", self.backend.try_acquire(&claim, Turn::Once))
                .await
            {
                self.serve_as_monitor(&key, &grant.token).await;
                if self.shutdown.is_cancelled() {
                    return;
                }
                look_at = spread(SILENCE);
            }
        }
    }

    /// The monitor's work while its lease holds: renew, announce and tidy
    /// ([`Backend::tidy`](crate::backend::Backend::tidy)) every [`BEAT`],
    /// scan for stale keys every [`STALE_EVERY`]. Releases the
    /// lease at shutdown.
    async fn serve_as_monitor(self: &Arc<Self>, key: &LockKey, token: &Token) {
        tracing::info!(sidecar = %self.sidecar, "this sidecar is now the monitor");
        self.metrics.monitor.set(1);
        let _ = self.op("announce", self.backend.announce(key)).await;
        let mut beat = tokio::time::interval_at(after(BEAT), BEAT);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut scan = tokio::time::interval(STALE_EVERY);
        scan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The lease holds until this, as far as this sidecar can vouch.
        let mut holds_until = Instant::now() + TTL;
        // The scan under way: it reads every key in use, which takes long
        // on a large keyspace, so it runs beside the beat, which renews the
        // lease, rather than in its way; in a task of its own, because a
        // future the beat's branch left unpolled could hold what the
        // renewal waits for (a connection being made). Aborted when the
        // role ends.
        let mut scanning: Option<AbortOnDropHandle<_>> = None;
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => {
                    let _ = self.op("release", self.backend.release(key, token)).await;
                    let _ = self.op("announce", self.backend.announce(key)).await;
                    break;
                }
                _ = scan.tick(), if scanning.is_none() => {
                    let core = self.clone();
                    let task = tokio::spawn(async move { core.scan_stale().await });
                    scanning = Some(AbortOnDropHandle::new(task));
                }
                found = async { scanning.as_mut().expect("a scan under way").await },
                    if scanning.is_some() =>
                {
                    scanning = None;
                    if let Ok(Ok(stale)) = found {
                        let (shown, _) = super::shown_stale(stale);
                        self.metrics.stale.set(shown.len() as f64);
                    }
                }
                _ = beat.tick() => {
                    let asked = Instant::now();
                    match self.op("renew", self.backend.renew(key, token, None)).await {
                        Ok(Some(_)) => {
                            holds_until = asked + TTL;
                            let _ = self.op("announce", self.backend.announce(key)).await;
                            let _ = self.op("tidy", self.backend.tidy()).await;
                        }
                        Ok(None) => break,
                        // Unreachable: go on trying while the lease may hold.
                        Err(_) if Instant::now() + BEAT < holds_until => {}
                        Err(_) => break,
                    }
                }
            }
        }
        // Only the monitor's count is current: the others export 0.
        self.metrics.monitor.set(0);
        self.metrics.stale.set(0.0);
        tracing::info!(sidecar = %self.sidecar, "this sidecar is no longer the monitor");
    }
}

/// `base` from now plus a random delay of up to [`SPREAD`].
fn spread(base: Duration) -> Instant {
    let jitter = rand::rng().random_range(0..=SPREAD.as_millis() as u64);
    after(base + Duration::from_millis(jitter))
}
