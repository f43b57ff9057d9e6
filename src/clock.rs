//! Wall-clock milliseconds that never go backwards.
//!
//! The API reports times as Unix milliseconds (`expires_at_ms`, `since_ms`).
//! Reading `SystemTime` for every lease would let an NTP step make leases
//! expire early or late, so the clock is anchored to the wall clock once at
//! start-up and advanced by the monotonic clock from then on.

use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

struct Anchor {
    instant: Instant,
    epoch_ms: u64,
}

fn anchor() -> &'static Anchor {
    static ANCHOR: OnceLock<Anchor> = OnceLock::new();
    ANCHOR.get_or_init(|| Anchor {
        instant: Instant::now(),
        epoch_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
    })
}

/// Unix time in milliseconds, monotonic within this process.
pub fn now_ms() -> u64 {
    let a = anchor();
    a.epoch_ms + a.instant.elapsed().as_millis() as u64
}

/// The tokio instant at which [`now_ms`] reaches `at_ms` (now if it has
/// passed; [`after`]'s far future if it lies beyond that).
pub fn instant_at(at_ms: u64) -> tokio::time::Instant {
    let now = now_ms();
    after(Duration::from_millis(at_ms.saturating_sub(now)))
}

/// The tokio instant `d` from now, saturating at about 30 years ahead (an
/// `Instant` sum can overflow where a `u64` of milliseconds does not).
pub fn after(d: Duration) -> tokio::time::Instant {
    const FAR: Duration = Duration::from_secs(30 * 365 * 24 * 3600);
    let now = tokio::time::Instant::now();
    now.checked_add(d.min(FAR)).unwrap_or(now)
}

/// Milliseconds in a duration, saturating at `u64::MAX`.
pub fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The clock-drift allowance of a lease with `ttl`: 1% plus 2 ms, as
/// Redlock subtracts it from a lease's validity. A lease whose expiry came
/// within this of its `max_hold` cap has reached the cap.
pub fn drift_ms(ttl: Duration) -> u64 {
    ms(ttl) / 100 + 2
}
