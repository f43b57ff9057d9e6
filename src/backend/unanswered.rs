//! Leases whose grant never reached its client: an acquire whose answer
//! was lost (a connection reset or a timeout after the backend ran it) may
//! have made a lease nobody knows of, which would keep the lock until its
//! ttl ends. The backends that can lose an answer give it back here.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::lock::LockKey;

/// First pause before the release, and the longest between its retries.
const FIRST_PAUSE: Duration = Duration::from_millis(250);
const MAX_PAUSE: Duration = Duration::from_secs(5);
/// How often a release that found nothing looks again, until `look_until`.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// How a release of [`release_unanswered`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failed {
    /// It did not run: it never reached the backend (no connection), or
    /// the backend refused it.
    NotRun,
    /// It was sent and no answer came back: it may have run.
    Unanswered,
}

/// Releases the new lease of an attempt on `key` whose answer was lost
/// (`release` releases its token once), again while the backend cannot be
/// reached; while that release finds nothing, again every [`LOOK_EVERY`]
/// until `look_until` (a join's waiter row may be handed the lock until it
/// is removed as nobody's), then once more `late` later (the statement or
/// script may run after its answer timed out). Never past `until`, when
/// such a lease would have ended anyway, nor past `stop`.
///
/// It takes the lost grant's one hold, once: its owner may have asked again
/// meanwhile and re-entered that lease (the same token, one more hold), and
/// a second release would take the owner's own hold. So a release whose
/// own answer is lost is not sent again (it may have run): the lease, if it
/// is still there, is left to its ttl — a lock held too long rather than a
/// lock held twice. Harmless when the attempt granted nothing or re-entered
/// another lease: a release by a token that holds nothing changes nothing.
pub(crate) async fn release_unanswered<F, Fut>(
    key: LockKey,
    release: F,
    late: Duration,
    look_until: Instant,
    until: Instant,
    stop: CancellationToken,
) where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<Option<u32>, Failed>>,
{
    let mut pause = FIRST_PAUSE;
    for round in 0..2 {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep_until(until) => return,
                () = tokio::time::sleep(if round == 0 { pause } else { late }) => {}
            }
            match release().await {
                Ok(Some(_)) => {
                    tracing::info!(lock = %key, "released a lease whose grant never reached its client");
                    return;
                }
                Ok(None) if round == 0 && Instant::now() < look_until => pause = LOOK_EVERY,
                Ok(None) => break,
                Err(Failed::NotRun) => pause = (pause * 2).min(MAX_PAUSE),
                Err(Failed::Unanswered) => {
                    tracing::info!(
                        lock = %key,
                        "the release of a lease whose grant never reached its client went unanswered; \
                         not sent again (a second run could take a re-entered hold): \
                         the lease, if any, ends with its ttl"
                    );
                    return;
                }
            }
        }
    }
}
