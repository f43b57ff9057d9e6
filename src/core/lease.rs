//! The leases granted through this sidecar ([`Local`]): their expiry and
//! hold count as last seen, how each ended, where the expiry timer has
//! each filed, and the mark a renewal under way leaves on one; what an
//! acquire gives back ([`Outcome`]).

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::backend::Busy;
use crate::lock::{LockKey, LostReason, Mode, Token};

use super::event::{Event, EventType};

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
    pub(super) state: Mutex<(u64, u32)>,
    /// A renewal through this sidecar has started and none has succeeded
    /// since: the backend may not have extended the lease.
    pub(super) renewing: AtomicBool,
    /// How the lease ended; set once.
    pub(super) end: std::sync::OnceLock<End>,
    /// Cancelled once `end` is set. (A token rather than a watch channel:
    /// every lease has one, and a watch channel is several times larger.)
    pub(super) ended: CancellationToken,
    /// Where the shared expiry timer has it filed, if it has.
    pub(super) filing: Filing,
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

    pub(super) fn set(&self, expires_at_ms: Option<u64>, count: Option<u32>) {
        let mut s = self.lock_state();
        if let Some(e) = expires_at_ms {
            s.0 = e;
        }
        if let Some(c) = count {
            s.1 = c;
        }
    }

    pub(super) fn lock_state(&self) -> std::sync::MutexGuard<'_, (u64, u32)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn event(&self, event: EventType, sidecar: &str) -> Event {
        Event::new(
            event,
            &self.key,
            self.mode,
            &self.owner,
            sidecar,
            Some(self.fence),
        )
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
    pub(super) supervise_here: bool,
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

/// Clears a lease's `renewing` mark when a renewal is dropped unfinished (its
/// client went away): it is no longer under way and may have worked, so the
/// expiry timer asks the backend instead of giving the lease up.
pub(super) struct Underway<'a>(pub(super) Option<&'a AtomicBool>);

impl Drop for Underway<'_> {
    fn drop(&mut self) {
        if let Some(renewing) = self.0 {
            renewing.store(false, Ordering::Relaxed);
        }
    }
}

/// Where the shared expiry timer has a lease filed: its checkpoint (0: not
/// filed) and its id.
#[derive(Default)]
pub(super) struct Filing {
    pub(super) at: AtomicU64,
    pub(super) id: AtomicU64,
}
