//! What the lock routes answer: the JSON bodies, as the OpenAPI document
//! lists them.

use std::time::Duration;

use serde::Serialize;
use utoipa::ToSchema;

use crate::backend::{Holder, StaleKey, Waiter};
use crate::clock::{drift_ms, ms, now_ms};
use crate::core::Granted;
use crate::lock::{Held, Kind};

/// A granted lease (acquire's 200 and the hold stream's `acquired` event).
#[derive(Debug, Serialize, ToSchema)]
pub struct Acquired {
    pub name: String,
    pub kind: Kind,
    /// Secret needed to release or renew; keep it private.
    pub token: String,
    /// Strictly increasing per name across all grants; pass it to the protected resource.
    pub fence: u64,
    /// `exclusive` or `shared` for a lock, `permit` for a semaphore.
    pub mode: Held,
    pub owner: String,
    /// Hold count (above 1 after re-entry).
    pub count: u32,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    pub waited_ms: u64,
}

/// Release result.
#[derive(Debug, Serialize, ToSchema)]
pub struct Released {
    /// False while a re-entrant hold count is still above zero.
    pub released: bool,
    /// Remaining hold count.
    pub count: u32,
}

/// Keepalive result (also the hold stream's `renewed` event).
#[derive(Debug, Serialize, ToSchema)]
pub struct Renewed {
    pub expires_at_ms: u64,
    pub ttl_ms: u64,
}

/// The global state of one lock or semaphore.
#[derive(Debug, Serialize, ToSchema)]
pub struct LockView {
    pub name: String,
    pub kind: Kind,
    /// Highest fence granted so far (0 if never).
    pub fence: u64,
    /// Permits of a semaphore in use.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    pub holders: Vec<Holder>,
    pub waiters: Vec<Waiter>,
}

/// One held or contended lock.
#[derive(Debug, Serialize, ToSchema)]
pub struct LockRow {
    pub name: String,
    pub kind: Kind,
    pub holders: usize,
    pub waiters: usize,
    pub fence: u64,
}

/// A page of held or contended locks and semaphores.
#[derive(Debug, Serialize, ToSchema)]
pub struct LockList {
    pub locks: Vec<LockRow>,
    /// Pass as `cursor` for the next page; null on the last page.
    pub next_cursor: Option<String>,
}

/// Stale keys.
#[derive(Debug, Serialize, ToSchema)]
pub struct StaleList {
    pub stale: Vec<StaleKey>,
    /// Present (`true`) when the scan found more than the 1000 entries
    /// listed (the oldest it found).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// Force-release result.
#[derive(Debug, Serialize, ToSchema)]
pub struct ForceReleased {
    /// Number of leases removed.
    pub released: usize,
}

/// How far a backend's clock conversion may move a lease's end (Redis
/// settles a server clock's offset to within 5 ms).
const ROUNDING_MS: u64 = 5;

/// How much sooner than the ttl it asked for a re-entered lease may end
/// and still be answered that ttl: the drift allowance (Redlock's), the
/// rounding of a backend's clock, and the time the re-entry took to come
/// back (Redlock counts the lease from the attempt's start). A lease
/// ending sooner is cut short by a cap the backend keeps: its first
/// grant's `max_hold`.
fn reentry_slack_ms(ttl: Duration) -> u64 {
    (ms(ttl) / 20).max(250) + drift_ms(ttl) + ROUNDING_MS
}

/// The time a grant gave: its claim's ttl, or more where a re-entry found
/// the lease running longer (re-entries never shorten it), and no more than
/// is left before `max_hold` ends the lease — this claim's, or the one its
/// first grant set, which a re-entry through another sidecar does not
/// know but finds in the lease's end (`expires_at_ms`).
fn granted_ttl_ms(g: &Granted) -> u64 {
    let now = now_ms();
    let left = g.expires_at_ms.saturating_sub(now);
    // Longer only where the lease really runs longer: a backend's clock
    // conversion may put a fresh lease's end a millisecond or two past
    // now + ttl (2001 for a 2 s claim on Redis Cluster).
    // A re-entry through another sidecar does not know the cap of the
    // lease's first grant (a fresh grant's own is `cap_ms`, below): the
    // lease's end tells it.
    let capped = g.count > 1 && left.saturating_add(reentry_slack_ms(g.ttl)) < ms(g.ttl);
    let ttl_ms = if left > ms(g.ttl) + ROUNDING_MS || capped {
        left
    } else {
        ms(g.ttl)
    };
    match g.lease.cap_ms.map(std::num::NonZeroU64::get) {
        // Never more than `max_hold` either: the backend's clock and ours
        // may round a millisecond apart.
        Some(cap) => ttl_ms
            .min(cap.saturating_sub(now))
            .min(cap.saturating_sub(g.lease.since_ms)),
        None => ttl_ms,
    }
}

pub(super) fn acquired(g: &Granted) -> Acquired {
    let lease = &g.lease;
    Acquired {
        name: lease.key.name.to_string(),
        kind: lease.key.kind,
        token: lease.token.expose().to_owned(),
        fence: lease.fence,
        mode: Held::of(lease.key.kind, lease.mode),
        owner: lease.owner.clone(),
        count: g.count,
        ttl_ms: granted_ttl_ms(g),
        expires_at_ms: g.expires_at_ms,
        waited_ms: ms(g.waited),
    }
}
