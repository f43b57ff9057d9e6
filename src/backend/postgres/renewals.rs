//! Renewals that go together: while one statement of renewals is on its
//! way, the renewals asked for meanwhile queue, and the next statement
//! carries all of them (`renew_many`: one transaction, one commit).
//!
//! Every renewal is a write that commits. Sent one by one, a sidecar with
//! thousands of holds needed as many commits a second as it renewed
//! leases, on its two upkeep connections, and on a slow or loaded database
//! the renewals fell behind until leases lapsed. Together, each statement
//! takes whatever queued while the last one committed: the slower the
//! database, the more each carries, so renewals keep up, and a lone
//! renewal still goes at once.
//!
//! # Cancellation safety
//! A queued renewal whose caller gave up is left out of its statement; one
//! already sent renews its lease as before (the answer is dropped).

use std::collections::HashSet;
use std::sync::Weak;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::Inner;
use super::errors::Failure;
use crate::backend::{Cause, Error, Outage};

/// Most renewals in one statement; the rest go in the next.
const MOST: usize = 1000;

/// One lease to renew, and where its answer goes: the lease's new expiry
/// in the database's clock, `None` when the token holds nothing.
pub(super) struct Renewal {
    pub(super) kind: &'static str,
    pub(super) name: String,
    /// The lease's token: a secret, never logged.
    pub(super) token: String,
    pub(super) ttl_ms: Option<i64>,
    pub(super) answer: oneshot::Sender<Result<Option<i64>, Error>>,
}

/// Sends the renewals asked for on `asked`, one statement at a time, until
/// `stop` or until the backend is gone.
pub(super) async fn run(
    inner: Weak<Inner>,
    mut asked: mpsc::UnboundedReceiver<Renewal>,
    stop: CancellationToken,
) {
    // Second renewals of a lease already in the statement being built.
    let mut later: Vec<Renewal> = Vec::new();
    loop {
        let mut batch = std::mem::take(&mut later);
        if batch.is_empty() {
            tokio::select! {
                () = stop.cancelled() => return,
                first = asked.recv() => match first {
                    Some(r) => batch.push(r),
                    None => return,
                },
            }
        }
        while batch.len() < MOST {
            match asked.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        batch.retain(|r| !r.answer.is_closed());
        // One statement renews a lease once: a second renewal of it (a
        // keepalive beside the watchdog's) goes in the next.
        let mut tokens = HashSet::with_capacity(batch.len());
        let (now, again): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .partition(|r| tokens.insert(r.token.clone()));
        later = again;
        if now.is_empty() {
            continue;
        }
        let Some(inner) = inner.upgrade() else {
            return;
        };
        send(&inner, now).await;
    }
}

/// Renews `batch` in one statement and gives each renewal its answer.
async fn send(inner: &Inner, batch: Vec<Renewal>) {
    let kinds: Vec<&str> = batch.iter().map(|r| r.kind).collect();
    let names: Vec<&str> = batch.iter().map(|r| r.name.as_str()).collect();
    let tokens: Vec<&str> = batch.iter().map(|r| r.token.as_str()).collect();
    let ttls: Vec<Option<i64>> = batch.iter().map(|r| r.ttl_ms).collect();
    let rows = inner
        .rows(
            "renew",
            &inner.sql.renew_many,
            &[&kinds, &names, &tokens, &ttls],
        )
        .await;
    let renewed = rows.and_then(|rows| {
        let mut expires = vec![None; batch.len()];
        for row in rows {
            let read = |e| Failure::from(e).into_error("renew");
            let (i, at): (i32, i64) =
                (row.try_get(0).map_err(read)?, row.try_get(1).map_err(read)?);
            if let Some(slot) = usize::try_from(i)
                .ok()
                .and_then(|i| i.checked_sub(1))
                .and_then(|i| expires.get_mut(i))
            {
                *slot = Some(at);
            }
        }
        Ok::<_, Error>(expires)
    });
    match renewed {
        Ok(expires) => {
            for (r, at) in batch.into_iter().zip(expires) {
                let _ = r.answer.send(Ok(at));
            }
        }
        Err(e) => {
            // Each renewal gets the failure, with its cause.
            let cause = e.cause();
            let detail = format!("{e:#}");
            let mut first = Some(e);
            for r in batch {
                let e = first.take().unwrap_or_else(|| Error::Unavailable {
                    op: "renew",
                    source: Outage::boxed(cause.unwrap_or(Cause::Failed), detail.clone()),
                });
                let _ = r.answer.send(Err(e));
            }
        }
    }
}
