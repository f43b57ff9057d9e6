//! Requests: one ZooKeeper request under a timeout, what counts as an
//! outage, and the retry of compare-and-set rounds that lose to a
//! concurrent write.

use std::time::Duration;

use zookeeper_client as zk;

use crate::backend::Error;

/// How long one ZooKeeper request may take before the backend counts as unavailable.
pub(super) const OP_TIMEOUT: Duration = Duration::from_secs(5);

/// The outage of `op`, caused by `e`.
pub(super) fn unavailable(
    op: &'static str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> Error {
    Error::Unavailable {
        op,
        source: Box::new(e),
    }
}

/// A request that got no answer in time.
#[derive(Debug, thiserror::Error)]
#[error("ZooKeeper did not answer within {0:?}")]
struct TimedOut(Duration);

/// `error`, the outage of a write, as that of one that may have been
/// applied ([`Error::unanswered`]): unless the client had no connection to
/// send it on or was closed, it failed after it was sent (the connection
/// lost or silent, the time limit passed), and ZooKeeper may have applied
/// it.
pub(super) fn unanswered_write(error: Error) -> Error {
    let unsent = matches!(
        &error,
        Error::Unavailable { source, .. } if matches!(
            source.downcast_ref::<zk::Error>(),
            Some(zk::Error::NoHosts | zk::Error::ClientClosed)
        )
    );
    // (Other errors are answers, which `unanswered` leaves as they are.)
    if unsent { error } else { error.unanswered() }
}

/// Why a request failed, when ZooKeeper's answer does not say it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(super) struct Message(pub(super) String);

/// Runs one ZooKeeper request: `Err` when ZooKeeper is unreachable, else the
/// request's own result (NoNode, BadVersion… are answers, not outages).
pub(super) async fn call<T>(
    op: &'static str,
    fut: impl Future<Output = Result<T, zk::Error>>,
) -> Result<Result<T, zk::Error>, Error> {
    match crate::clock::within(OP_TIMEOUT, fut).await {
        Err(_) => Err(unavailable(op, TimedOut(OP_TIMEOUT))),
        Ok(Err(
            e @ (zk::Error::ConnectionLoss
            | zk::Error::SessionExpired
            | zk::Error::SessionMoved
            | zk::Error::Timeout
            | zk::Error::NoHosts
            | zk::Error::ClientClosed
            | zk::Error::Throttled
            | zk::Error::NotReadOnly
            | zk::Error::AuthFailed
            | zk::Error::NoAuth),
        )) => Err(unavailable(op, e)),
        Ok(r) => Ok(r),
    }
}

/// The operation of a multi-request that failed, which undid the others.
#[derive(Debug)]
pub(super) struct Failed {
    /// Its index among the request's operations.
    pub(super) index: usize,
    /// ZooKeeper's answer to it (NoNode, BadVersion, NodeExists…).
    pub(super) error: zk::Error,
}

/// Commits one multi-request: `Err` when ZooKeeper is unreachable, else
/// the results, or the operation that failed.
pub(super) async fn commit(
    op: &'static str,
    fut: impl Future<Output = Result<Vec<zk::MultiWriteResult>, zk::MultiWriteError>>,
) -> Result<Result<Vec<zk::MultiWriteResult>, Failed>, Error> {
    let answer = call(op, async {
        match fut.await {
            Ok(results) => Ok(Ok(results)),
            Err(zk::MultiWriteError::OperationFailed { index, source }) => Ok(Err(Failed {
                index,
                error: source,
            })),
            Err(zk::MultiWriteError::RequestFailed { source }) => Err(source),
        }
    })
    .await?;
    answer.map_err(|e| unavailable(op, e))
}

/// Like [`call`], treating every error as an outage.
pub(super) async fn must<T>(
    op: &'static str,
    fut: impl Future<Output = Result<T, zk::Error>>,
) -> Result<T, Error> {
    call(op, fut).await?.map_err(|e| unavailable(op, e))
}

/// Rounds a compare-and-set on a lock's own records gets: the lock node's
/// fence record and its delay node. Every lease that ends on the lock
/// writes the record when its fence raises it (in the request that deletes
/// its node), and every expiry or force-release with a lock-delay the
/// delay node, so all sidecars ending leases on the lock compete for the
/// same version. A lost round means another writer's write went through,
/// so 20 rounds carry a writer through a burst of up to 20 concurrent
/// writers and still end a request that keeps losing. (A release does not
/// count the rounds it lost to a write that raised the record: a
/// semaphore's permits released at once are more writers than that.)
pub(super) const PARENT_ROUNDS: u32 = 20;

/// Rounds a compare-and-set on one claim node gets (renew), an attempt
/// that starts over when a claim ahead of it left or a re-entry lost its
/// race, and a snapshot of a lock's claims that starts over when it found
/// one gone or expired one. A claim node has few writers (its holder's
/// requests, a sidecar finding it expired), and the others start over only
/// after a claim left: 10 rounds are plenty, and still end a request that
/// keeps losing.
pub(super) const CLAIM_ROUNDS: u32 = 10;

/// How one compare-and-set round ended.
pub(super) enum Round<T> {
    /// It wrote, or found there was nothing to write: the answer.
    Done(T),
    /// What it read changed before it wrote: read again.
    Conflict,
}

/// Runs `round` until it is [`Round::Done`], at most `rounds` times.
/// `None` when every round ended in a conflict: the caller says what that
/// means (a failure, or an update it can do without).
pub(super) async fn retry_on_conflict<T, R>(
    rounds: u32,
    mut round: impl FnMut() -> R,
) -> Result<Option<T>, Error>
where
    R: Future<Output = Result<Round<T>, Error>>,
{
    for _ in 0..rounds {
        if let Round::Done(answer) = round().await? {
            return Ok(Some(answer));
        }
    }
    Ok(None)
}
