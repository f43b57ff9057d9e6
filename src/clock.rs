//! Wall-clock milliseconds that never go backwards.
//!
//! The API reports times as Unix milliseconds (`expires_at_ms`, `since_ms`).
//! Reading `SystemTime` for every lease would let an NTP step make leases
//! expire early or late, so the clock is anchored to the wall clock once at
//! start-up and advanced by the monotonic clock from then on.
//!
//! Also here: [`within`], the time limit of a backend call, which a pause
//! of the whole process does not trip.

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

/// How late a time limit's timer must fire for this process to count as
/// paused through its deadline (timers fire within a few milliseconds of
/// theirs on a process that runs, tens on a loaded one).
const LATE: Duration = Duration::from_millis(50);

/// How long a call whose deadline passed while this process was paused
/// still has to show an answer that came meanwhile: its connection's reader
/// has to run once.
const AFTER_PAUSE: Duration = Duration::from_millis(200);

/// A call that did not end within its time limit.
#[derive(Debug)]
pub struct Elapsed;

/// Runs `call` within `limit` from now, as `tokio::time::timeout` does,
/// except when this process was paused through the deadline (SIGSTOP, a
/// VM's or a CPU quota's pause: its timer then fires late). An answer that
/// came during the pause waits unread in a socket, and the timer, firing at
/// resume, came before the connection's reader (another task) had run: a
/// call answered in time failed. So a call whose deadline fired late gets
/// [`AFTER_PAUSE`] more, or `limit` more when that is shorter (Redlock's
/// per-node limits are a tenth of a short lease, which the whole attempt
/// must leave time of); any other, until the timer's next tick.
///
/// # Errors
/// [`Elapsed`] when `call` did not end in time.
pub fn within<F: Future>(
    limit: Duration,
    call: F,
) -> impl Future<Output = Result<F::Output, Elapsed>> {
    // From the call, as `tokio::time::timeout`, not from its first poll.
    let deadline = after(limit);
    async move {
        let mut call = std::pin::pin!(call);
        if let Ok(out) = tokio::time::timeout_at(deadline, call.as_mut()).await {
            return Ok(out);
        }
        let late = tokio::time::Instant::now().saturating_duration_since(deadline);
        let grace = if late >= LATE {
            AFTER_PAUSE.min(limit)
        } else {
            Duration::ZERO
        };
        tokio::time::timeout(grace, call).await.map_err(|_| Elapsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process paused through a call's deadline (the runtime's only
    /// thread blocked), whose answer came meanwhile but is passed on by
    /// another task (as a connection's reader does) that runs only after
    /// the timer fired: the call is answered. `tokio::time::timeout` gave
    /// up on it.
    #[test]
    fn a_call_answered_during_a_pause_through_its_deadline_is_answered() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        rt.block_on(async {
            let (tx, rx) = tokio::sync::oneshot::channel();
            // The reader: it has read the answer when the pause starts,
            // and takes a few turns of the runtime after it to pass it on.
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                std::thread::sleep(Duration::from_millis(500));
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                let _ = tx.send(7);
            });
            let call = tokio::spawn(within(Duration::from_millis(100), rx));
            let answer = call.await.expect("the call");
            assert_eq!(answer.ok().and_then(Result::ok), Some(7));
        });
    }

    /// A short limit paused through gets no more than itself again: a
    /// Redlock attempt with a short lease must still leave the lease its
    /// time (10 ms, paused 100 ms: about 110 ms; with the whole 200 ms of
    /// grace, about 300).
    #[test]
    fn a_short_limit_paused_through_gets_no_more_than_itself_again() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        rt.block_on(async {
            let started = std::time::Instant::now();
            let call = tokio::spawn(within(
                Duration::from_millis(10),
                std::future::pending::<()>(),
            ));
            std::thread::sleep(Duration::from_millis(100));
            assert!(call.await.expect("the call").is_err());
            let took = started.elapsed();
            assert!(took < Duration::from_millis(220), "{took:?}");
        });
    }

    /// A call that is not answered fails, not before its deadline.
    #[tokio::test]
    async fn a_call_unanswered_fails_once_its_deadline_passed() {
        let started = tokio::time::Instant::now();
        let answer = within(Duration::from_millis(100), std::future::pending::<()>()).await;
        assert!(answer.is_err());
        assert!(started.elapsed() >= Duration::from_millis(100));
    }
}
