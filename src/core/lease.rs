//! The leases granted through this sidecar ([`Local`]): their expiry and
//! hold count as last seen, how each ended, where the expiry timer has
//! each filed, and the mark a renewal under way leaves on one; what an
//! acquire gives back ([`Outcome`]).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::num::NonZeroU64;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::backend::Busy;
use crate::lock::{Kind, LockKey, LostReason, MIN_RENEWED_TTL, Mode, Token};

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
    /// Renewals stop here (`max_hold`). (Never 0: a lease's since is a
    /// time; the niche keeps a lease's allocation in its size class.)
    pub cap_ms: Option<NonZeroU64>,
    /// What changes while the lease lives (see [`State`]).
    pub(super) state: Mutex<State>,
    /// A renewal through this sidecar has started and none has succeeded
    /// since: the backend may not have extended the lease.
    pub(super) renewing: AtomicBool,
    /// The lease has a lock-delay: given up as lost, it is left to expire
    /// in the backend, whose expiry starts the delay (a release would not).
    pub(super) delayed: bool,
    /// How the lease ended; set once.
    pub(super) end: std::sync::OnceLock<End>,
    /// Cancelled once `end` is set. (A token rather than a watch channel:
    /// every lease has one, and a watch channel is several times larger.)
    pub(super) ended: CancellationToken,
    /// Where the shared expiry timer has it filed, if it has.
    pub(super) filing: Filing,
}

/// What changes of a lease while it lives, under one lock.
pub(super) struct State {
    /// When it expires unless renewed, as last seen.
    expires_at_ms: u64,
    /// Its holds, as last seen.
    pub(super) count: u32,
    /// The holds taken through this sidecar less those released through it
    /// (what it gives back at shutdown: its owner may hold the others
    /// through other sidecars).
    here: u32,
    /// The end its clients were last told of (a grant's, a re-entry's, a
    /// keepalive's answer; not a watchdog's renewal): a hold's watchdog
    /// renews to no less, whatever the backend's clock conversions take
    /// off its own view of the expiry.
    promised_ms: u64,
    /// Hold streams running a watchdog on it: a keepalive does not shorten
    /// it below their ttl, which their watchdogs renew by.
    streams: u16,
}

impl State {
    pub(super) fn new(expires_at_ms: u64, count: u32, here: u32) -> Self {
        Self {
            expires_at_ms,
            count,
            here,
            promised_ms: expires_at_ms,
            streams: 0,
        }
    }
}

/// A hold stream's watchdog counted on its lease (see [`State::streams`])
/// until dropped.
pub(super) struct Streaming<'a>(&'a Local);

impl Drop for Streaming<'_> {
    fn drop(&mut self) {
        let mut s = self.0.lock_state();
        s.streams = s.streams.saturating_sub(1);
    }
}

impl Local {
    /// The ttl a hold's watchdog paces its renewals by: the lease's own, or
    /// [`MIN_RENEWED_TTL`] when shorter (a plain lease a hold re-entered
    /// keeps its ttl, which may be shorter than a hold may ask for).
    pub fn watched_ttl(&self) -> Duration {
        self.ttl.max(MIN_RENEWED_TTL)
    }

    /// When the lease expires unless renewed.
    pub fn expires_at_ms(&self) -> u64 {
        self.lock_state().expires_at_ms
    }

    /// Counts a hold stream's watchdog on the lease while the guard lives.
    pub(super) fn stream(&self) -> Streaming<'_> {
        let mut s = self.lock_state();
        s.streams = s.streams.saturating_add(1);
        Streaming(self)
    }

    /// Whether a hold stream's watchdog renews the lease.
    pub(super) fn streamed(&self) -> bool {
        self.lock_state().streams > 0
    }

    /// The end a client was told of: a re-entry's (`lengthen`) never takes
    /// back an earlier one, a keepalive's replaces it.
    pub(super) fn promise(&self, expires_at_ms: u64, lengthen: bool) {
        let mut s = self.lock_state();
        s.promised_ms = if lengthen {
            s.promised_ms.max(expires_at_ms)
        } else {
            expires_at_ms
        };
    }

    /// The end its clients were last told of.
    pub(super) fn promised_ms(&self) -> u64 {
        self.lock_state().promised_ms
    }

    /// One hold more taken (`true`) or released (`false`) through this sidecar.
    pub(super) fn count_here(&self, taken: bool) {
        let mut s = self.lock_state();
        s.here = if taken {
            s.here.saturating_add(1)
        } else {
            s.here.saturating_sub(1)
        };
    }

    /// Takes one hold taken here, to release it: false when none is left
    /// (two releasing at once never take the same one).
    pub(super) fn take_here(&self) -> bool {
        let mut s = self.lock_state();
        let some = s.here > 0;
        s.here = s.here.saturating_sub(1);
        some
    }

    /// Takes every hold taken here still to release (a revoked lease's,
    /// when its token is granted again here: the new lease releases them).
    pub(super) fn take_all_here(&self) -> u32 {
        std::mem::take(&mut self.lock_state().here)
    }

    pub(super) fn set(&self, expires_at_ms: Option<u64>, count: Option<u32>) {
        let mut s = self.lock_state();
        if let Some(c) = count {
            s.count = c;
        }
        if let Some(e) = expires_at_ms {
            s.expires_at_ms = e;
        }
    }

    pub(super) fn lock_state(&self) -> std::sync::MutexGuard<'_, State> {
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

/// The leases granted through this sidecar and not ended, by token (read
/// through `Deref`), and how many lock leases each (lock, owner, mode) has,
/// so that a re-entry at the `max_held` cap is told from a new lease
/// without looking through them all.
#[derive(Default)]
pub(super) struct Leases {
    by_token: HashMap<Token, Arc<Local>>,
    /// Lock leases by a 4-byte hash of their (lock, owner, mode), seeded per
    /// process: 9 bytes or so a lease. Two that meet only let a claim try
    /// at the cap; the place of what it is granted is checked again.
    holders: HashMap<u32, u32>,
    seed: RandomState,
}

impl Leases {
    fn holder(&self, key: &LockKey, owner: &str, mode: Mode) -> Option<u32> {
        // Truncated on purpose: see `holders`.
        (key.kind == Kind::Lock).then(|| self.seed.hash_one((key, owner, mode)) as u32)
    }

    pub(super) fn insert(&mut self, local: Arc<Local>) {
        // One lease a token: a lease replaced leaves the count too.
        self.remove(&local.token);
        if let Some(h) = self.holder(&local.key, &local.owner, local.mode) {
            *self.holders.entry(h).or_default() += 1;
        }
        self.by_token.insert(local.token.clone(), local);
    }

    pub(super) fn remove(&mut self, token: &Token) -> Option<Arc<Local>> {
        let local = self.by_token.remove(token)?;
        if let Some(h) = self.holder(&local.key, &local.owner, local.mode)
            && let Some(n) = self.holders.get_mut(&h)
        {
            *n -= 1;
            if *n == 0 {
                self.holders.remove(&h);
            }
        }
        Some(local)
    }

    /// Whether `owner` may hold a lock lease on `key` in `mode` here (rarely
    /// true when it does not: see `holders`).
    pub(super) fn may_hold(&self, key: &LockKey, owner: &str, mode: Mode) -> bool {
        self.holder(key, owner, mode)
            .is_some_and(|h| self.holders.contains_key(&h))
    }
}

impl Deref for Leases {
    type Target = HashMap<Token, Arc<Local>>;

    fn deref(&self) -> &Self::Target {
        &self.by_token
    }
}

/// A successful acquire.
#[derive(Clone)]
pub struct Granted {
    pub lease: Arc<Local>,
    pub count: u32,
    pub expires_at_ms: u64,
    /// The ttl this grant ran the lease to: the claim's (a re-entry's may
    /// not be the lease's own), before `max_hold` cuts it.
    pub ttl: Duration,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn local(key: &LockKey, owner: &str, mode: Mode) -> Arc<Local> {
        Arc::new(Local {
            key: key.clone(),
            token: Token::generate(),
            owner: owner.to_owned(),
            mode,
            fence: 1,
            ttl: Duration::from_secs(1),
            since_ms: 0,
            cap_ms: None,
            state: Mutex::new(State::new(0, 1, 1)),
            renewing: AtomicBool::new(false),
            delayed: false,
            end: std::sync::OnceLock::new(),
            ended: CancellationToken::new(),
            filing: Filing::default(),
        })
    }

    /// A lease with its `Arc` counts stays within a 224-byte chunk of
    /// glibc's malloc (216 bytes and its size word), as it was before the
    /// promised end and the stream count joined it: 10,000 hold streams
    /// sit at the 100 MiB line on ZooKeeper.
    #[test]
    fn a_lease_stays_in_its_size_class() {
        assert!(
            size_of::<Local>() <= 200,
            "a lease grew to {} bytes",
            size_of::<Local>()
        );
    }

    /// Two local leases of one (lock, owner, mode) — the old one gone from
    /// the backend unbeknown to this sidecar, the new one granted — keep
    /// the owner found until both end; other owners, modes, locks and
    /// semaphores are never found.
    #[test]
    fn a_holder_is_found_until_its_last_lease_ends() {
        let key = LockKey::lock("a");
        let mut leases = Leases::default();
        let (old, new) = (
            local(&key, "o", Mode::Exclusive),
            local(&key, "o", Mode::Exclusive),
        );
        leases.insert(old.clone());
        leases.insert(new.clone());
        leases.insert(local(&key, "p", Mode::Shared));
        let semaphore = LockKey {
            kind: Kind::Semaphore,
            name: key.name.clone(),
        };
        leases.insert(local(&semaphore, "s", Mode::Exclusive));
        assert!(leases.may_hold(&key, "o", Mode::Exclusive));
        assert!(!leases.may_hold(&key, "o", Mode::Shared));
        assert!(!leases.may_hold(&key, "p", Mode::Exclusive));
        assert!(!leases.may_hold(&LockKey::lock("b"), "o", Mode::Exclusive));
        assert!(!leases.may_hold(&semaphore, "s", Mode::Exclusive));
        assert!(leases.remove(&old.token).is_some());
        assert!(leases.remove(&old.token).is_none());
        assert!(leases.may_hold(&key, "o", Mode::Exclusive));
        assert!(leases.remove(&new.token).is_some());
        assert!(!leases.may_hold(&key, "o", Mode::Exclusive));
        assert!(leases.may_hold(&key, "p", Mode::Shared));
        assert_eq!(leases.len(), 2);
        assert_eq!(leases.holders.len(), 1);
    }
}
