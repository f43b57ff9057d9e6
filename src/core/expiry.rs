//! One timer for the expiry checks of every lease that has no hold to run
//! its own (a hold runs its lease's in its watchdog).
//!
//! Leases are filed by their next checkpoint (see [`expiry_checkpoint`]).
//! The timer task sleeps until the earliest, and is woken only when a lease
//! is filed before that: leases of one ttl are filed in the order they are
//! granted, so an acquire costs an ordered-map insert and a release a
//! removal, where a task per lease cost a spawn, and a wake-up at its end.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::sleep_until;

use super::Core;
use super::lease::Local;
use crate::clock::{drift_ms, instant_at, ms, now_ms};

/// Sleeping until this means: until a lease is filed.
const NEVER: u64 = u64::MAX;

/// The leases waiting for their next expiry check, and the timer's wake-up.
pub(super) struct Expiries {
    due: Mutex<Due>,
    /// Wakes the timer when a lease is filed before it would wake.
    wake: Notify,
    /// Numbers leases, so that leases due at the same millisecond differ.
    next_id: AtomicU64,
}

/// The filed leases.
struct Due {
    /// (checkpoint ms, lease id) → the lease and its expiry when filed.
    leases: BTreeMap<(u64, u64), (Arc<Local>, u64)>,
    /// When the timer task wakes next ([`NEVER`] if nothing is filed, or the
    /// task has not started).
    wakes_at: u64,
    /// Whether the timer task has been started.
    started: bool,
}

impl Default for Expiries {
    fn default() -> Self {
        Self {
            due: Mutex::new(Due {
                leases: BTreeMap::new(),
                wakes_at: NEVER,
                started: false,
            }),
            wake: Notify::new(),
            next_id: AtomicU64::new(1),
        }
    }
}

impl Expiries {
    fn lock(&self) -> std::sync::MutexGuard<'_, Due> {
        self.due.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Files `lease` at its next checkpoint, unless it has ended. Starts the
    /// timer task on first use (in `core`'s task tracker).
    pub(super) fn file(&self, core: &Core, lease: &Arc<Local>) {
        let (seen, checkpoint) = expiry_checkpoint(lease);
        let mut due = self.lock();
        // Checked under the lock: `remove` runs after the end is set, so a
        // lease ending now is either not filed or found filed there.
        if lease.end.get().is_some() {
            return;
        }
        let mut id = lease.filing.id.load(Ordering::Relaxed);
        if id == 0 {
            id = self.next_id.fetch_add(1, Ordering::Relaxed);
            lease.filing.id.store(id, Ordering::Relaxed);
        }
        let old = lease.filing.at.swap(checkpoint, Ordering::Relaxed);
        if old != 0 {
            due.leases.remove(&(old, id));
        }
        due.leases.insert((checkpoint, id), (lease.clone(), seen));
        if !due.started {
            due.started = true;
            if let Some(me) = core.me.upgrade() {
                core.tasks.spawn(async move { me.expiries.run(&me).await });
            }
        } else if checkpoint < due.wakes_at {
            due.wakes_at = checkpoint;
            self.wake.notify_one();
        }
    }

    /// Takes an ended lease out.
    pub(super) fn remove(&self, lease: &Local) {
        let mut due = self.lock();
        let at = lease.filing.at.swap(0, Ordering::Relaxed);
        if at != 0 {
            due.leases
                .remove(&(at, lease.filing.id.load(Ordering::Relaxed)));
        }
    }

    /// How many leases are filed.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.lock().leases.len()
    }

    /// The timer task: looks at each lease at its checkpoint, until shutdown.
    async fn run(&self, core: &Arc<Core>) {
        loop {
            let (fired, wakes_at) = {
                let mut due = self.lock();
                let now = now_ms();
                let mut fired = Vec::new();
                while let Some(entry) = due.leases.first_entry() {
                    if entry.key().0 > now {
                        break;
                    }
                    let (lease, seen) = entry.remove();
                    lease.filing.at.store(0, Ordering::Relaxed);
                    fired.push((lease, seen));
                }
                due.wakes_at = due.leases.first_key_value().map_or(NEVER, |(k, _)| k.0);
                (fired, due.wakes_at)
            };
            for (lease, seen) in fired {
                let renewing = lease.renewing.load(Ordering::Relaxed);
                match core.look(&lease, seen, renewing) {
                    Look::Ended => {}
                    Look::Again => self.file(core, &lease),
                    Look::Ask => {
                        let me = core.clone();
                        core.tasks.spawn(async move {
                            if me.ask_expired(&lease).await {
                                me.expiries.file(&me, &lease);
                            }
                        });
                    }
                }
            }
            let sleep = async {
                if wakes_at == NEVER {
                    std::future::pending::<()>().await;
                }
                sleep_until(instant_at(wakes_at)).await;
            };
            tokio::select! {
                // Shutdown releases everything itself.
                () = core.shutdown.cancelled() => return,
                () = self.wake.notified() => {}
                () = sleep => {}
            }
        }
    }
}

/// What the expiry timer found at a checkpoint, before asking the backend.
pub(super) enum Look {
    /// The lease has ended (or was given up now).
    Ended,
    /// Not due yet: look again at the next checkpoint.
    Again,
    /// Past its expiry by our clock: ask the backend.
    Ask,
}

/// When the expiry timer next looks at `lease`: its expiry as seen now,
/// and the safety margin before it (the expiry itself once inside the margin).
pub(super) fn expiry_checkpoint(lease: &Local) -> (u64, u64) {
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

#[cfg(test)]
pub(super) mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use crate::backend::memory::Memory;
    use crate::core::event::EventType;
    use crate::core::{Core, Limits, Outcome};
    use crate::lock::{Claim, Kind, LockKey, Mode, Name};
    use crate::metrics::Metrics;
    use crate::wakeups::Wakeups;

    pub(in crate::core) fn core() -> Arc<Core> {
        let wakeups = Wakeups::default();
        let limits = Limits {
            default_ttl: Duration::from_secs(30),
            max_ttl: Duration::from_secs(3600),
            max_wait: Duration::from_secs(3600),
            lock_delay: Duration::ZERO,
            stale_after: Duration::from_secs(3600),
            max_waiters: 100,
            ..Limits::default()
        };
        Core::new(
            Arc::new(Memory::new(wakeups.clone())),
            wakeups,
            "test".into(),
            limits,
            Arc::new(Metrics::new("memory", false)),
            CancellationToken::new(),
        )
    }

    fn claim(name: &str, ttl: Duration) -> Claim {
        Claim {
            key: LockKey {
                kind: Kind::Lock,
                name: Name::parse(name).unwrap(),
            },
            mode: Mode::Exclusive,
            owner: name.into(),
            sidecar: "test".into(),
            ttl,
            limit: None,
            lock_delay: Duration::ZERO,
            max_hold: None,
        }
    }

    async fn grant(core: &Core, name: &str, ttl: Duration) -> Arc<crate::core::Local> {
        match core
            .acquire(&claim(name, ttl), Duration::ZERO, &CancellationToken::new())
            .await
        {
            Ok(Outcome::Granted(g)) => g.lease,
            _ => panic!("{name} not granted"),
        }
    }

    #[tokio::test]
    async fn released_leases_leave_the_timer() {
        let core = core();
        let a = grant(&core, "a", Duration::from_secs(60)).await;
        let b = grant(&core, "b", Duration::from_secs(60)).await;
        assert_eq!(core.expiries.len(), 2);
        core.release(&a.key, &a.token).await.unwrap();
        assert_eq!(core.expiries.len(), 1);
        core.release(&b.key, &b.token).await.unwrap();
        assert_eq!(core.expiries.len(), 0);
    }

    /// The timer sleeps until the 60 s lease's checkpoint when the 300 ms
    /// lease is filed: it must wake for it and report it expired.
    #[tokio::test]
    async fn a_lease_due_sooner_wakes_the_timer() {
        let core = core();
        let mut events = core.subscribe();
        let long = grant(&core, "long", Duration::from_secs(60)).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let short = grant(&core, "short", Duration::from_millis(300)).await;
        let expired = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let e = events.recv().await.unwrap();
                if e.event == EventType::Expired {
                    return e;
                }
            }
        })
        .await
        .expect("the short lease was not reported expired within 5 s");
        assert_eq!(expired.name, "short");
        assert!(short.end.get().is_some());
        assert!(long.end.get().is_none());
        assert_eq!(core.held(), 1);
        assert_eq!(core.expiries.len(), 1);
    }
}
