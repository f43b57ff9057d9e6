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
//! One renewal must not cost the others: the statement never waits for a
//! row lock (a lease another transaction holds locked is renewed alone,
//! with `renew()`, which waits as before, in a task of its own); a lease
//! asked for twice with the same ttl is renewed once for both; and a
//! statement the database refuses is sent again one renewal at a time, so
//! only the renewal it refuses fails.
//!
//! # Cancellation safety
//! A queued renewal whose caller gave up is left out of its statement; one
//! already sent renews its lease as before (the answer is dropped).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::Inner;
use super::calls::Fate;
use super::errors::Failure;
use super::sql::RenewReply;
use crate::backend::{Cause, Error, Outage, chain};
use crate::lock::Token;

/// Most leases in one statement; the rest go in the next.
const MOST: usize = 1000;

/// The lease's new expiry in the database's clock, `None` when the token
/// holds nothing.
type Answer = Result<Option<i64>, Error>;

/// One lease to renew, and where its answer goes.
pub(super) struct Renewal {
    pub(super) kind: &'static str,
    pub(super) name: String,
    /// The lease's token: a secret, redacted in `Debug`.
    pub(super) token: Token,
    pub(super) ttl_ms: Option<i64>,
    pub(super) answer: oneshot::Sender<Answer>,
}

/// One element of a statement: a lease, and everyone who asked for it with
/// the same ttl.
struct Element {
    kind: &'static str,
    name: String,
    token: Token,
    ttl_ms: Option<i64>,
    answers: Vec<oneshot::Sender<Answer>>,
}

impl Element {
    fn tell(self, answer: &Answer) {
        for a in self.answers {
            let _ = a.send(copy(answer));
        }
    }
}

/// Sends the renewals asked for on `asked`, one statement at a time, until
/// `stop` or until the backend is gone.
pub(super) async fn run(
    inner: Weak<Inner>,
    mut asked: mpsc::UnboundedReceiver<Renewal>,
    stop: CancellationToken,
) {
    // Renewals not sent yet, in the order they were asked for.
    let mut waiting: VecDeque<Renewal> = VecDeque::new();
    loop {
        if waiting.is_empty() {
            tokio::select! {
                () = stop.cancelled() => return,
                first = asked.recv() => match first {
                    Some(r) => waiting.push_back(r),
                    None => return,
                },
            }
        }
        while let Ok(r) = asked.try_recv() {
            waiting.push_back(r);
        }
        let batch = take_batch(&mut waiting);
        if batch.is_empty() {
            continue;
        }
        let Some(inner) = inner.upgrade() else {
            return;
        };
        send(&inner, batch).await;
    }
}

/// The next statement's elements, in order: a lease once, with every
/// renewal of it that asks for the same ttl; a renewal of a lease already
/// in it with another ttl stays in `waiting` for the next one.
fn take_batch(waiting: &mut VecDeque<Renewal>) -> Vec<Element> {
    let mut batch: Vec<Element> = Vec::new();
    let mut at: HashMap<Token, usize> = HashMap::new();
    let mut rest = VecDeque::new();
    while let Some(r) = waiting.pop_front() {
        if r.answer.is_closed() {
            continue;
        }
        match at.get(&r.token) {
            Some(&i) => {
                let e = &mut batch[i];
                if e.kind == r.kind && e.name == r.name && e.ttl_ms == r.ttl_ms {
                    e.answers.push(r.answer);
                } else {
                    rest.push_back(r);
                }
            }
            None if batch.len() < MOST => {
                at.insert(r.token.clone(), batch.len());
                batch.push(Element {
                    kind: r.kind,
                    name: r.name,
                    token: r.token,
                    ttl_ms: r.ttl_ms,
                    answers: vec![r.answer],
                });
            }
            None => rest.push_back(r),
        }
    }
    *waiting = rest;
    batch
}

/// Renews `batch` in one statement and answers each element.
async fn send(inner: &Arc<Inner>, batch: Vec<Element>) {
    let kinds: Vec<&str> = batch.iter().map(|e| e.kind).collect();
    let names: Vec<&str> = batch.iter().map(|e| e.name.as_str()).collect();
    let tokens: Vec<&str> = batch.iter().map(|e| e.token.expose()).collect();
    let ttls: Vec<Option<i64>> = batch.iter().map(|e| e.ttl_ms).collect();
    let rows = inner
        .rows_or_fate(
            "renew",
            &inner.sql.renew_many,
            &[&kinds, &names, &tokens, &ttls],
        )
        .await;
    let read = |e| Failure::from(e).into_error("renew");
    // Per element: renewed to (Some), or renewed alone (None); absent: the
    // token holds nothing.
    let outcome = rows.and_then(|rows| {
        let mut found: Vec<Option<Option<i64>>> = vec![None; batch.len()];
        for row in rows {
            let i: i32 = row.try_get(0).map_err(|e| (read(e), Fate::Unknown))?;
            let at: Option<i64> = row.try_get(1).map_err(|e| (read(e), Fate::Unknown))?;
            if let Some(slot) = usize::try_from(i)
                .ok()
                .and_then(|i| i.checked_sub(1))
                .and_then(|i| found.get_mut(i))
            {
                *slot = Some(at);
            }
        }
        Ok(found)
    });
    match outcome {
        Ok(found) => {
            for (e, found) in batch.into_iter().zip(found) {
                match found {
                    Some(Some(at)) => e.tell(&Ok(Some(at))),
                    // Locked by another transaction: alone, waiting for it.
                    Some(None) => alone(inner, e),
                    None => e.tell(&Ok(None)),
                }
            }
        }
        // The database refused the statement: one renewal at a time, so
        // that only the one it refuses fails.
        Err((_, Fate::Refused)) if batch.len() > 1 => {
            for e in batch {
                alone(inner, e);
            }
        }
        Err((e, _)) => {
            let failed: Answer = Err(e);
            for e in batch {
                e.tell(&failed);
            }
        }
    }
}

/// Renews one lease with `renew()` in a task of its own, which waits for a
/// row lock as renewals always did, without holding up the statements: on
/// the main pool, so that leases locked for long do not take the upkeep
/// connections the statements need.
fn alone(inner: &Arc<Inner>, e: Element) {
    let inner = Arc::clone(inner);
    tokio::spawn(async move {
        let reply: Result<Option<RenewReply>, Error> = inner
            .json(
                "renew alone",
                &inner.sql.renew,
                &[&e.kind, &e.name.as_str(), &e.token.expose(), &e.ttl_ms],
            )
            .await;
        e.tell(&reply.map(|r| r.map(|r| r.expires_at_ms)));
    });
}

/// An answer for one more caller: errors are not `Clone`, so a failure is
/// told again as an outage of the same cause, with the first one's words.
fn copy(answer: &Answer) -> Answer {
    match answer {
        Ok(at) => Ok(*at),
        Err(e) => Err(Error::Unavailable {
            op: "renew",
            source: Outage::boxed(e.cause().unwrap_or(Cause::Failed), chain(e)),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use tokio::sync::oneshot;

    use super::{Answer, MOST, Renewal, take_batch};
    use crate::lock::Token;

    fn renewal(token: &str, ttl_ms: Option<i64>) -> (Renewal, oneshot::Receiver<Answer>) {
        let (answer, rx) = oneshot::channel();
        let r = Renewal {
            kind: "lock",
            name: format!("n-{token}"),
            token: Token::from_client(token.to_owned()),
            ttl_ms,
            answer,
        };
        (r, rx)
    }

    /// A lease is in a statement once: asked for again with the same ttl,
    /// both askers get the one answer; with another ttl, the second waits
    /// for the next statement; a renewal whose caller left is dropped; and
    /// a statement holds at most [`MOST`] leases.
    #[test]
    fn a_statement_names_each_lease_once_and_leaves_nobody_behind() {
        let mut waiting = VecDeque::new();
        let mut kept = Vec::new();
        for (token, ttl) in [
            ("a", None),
            ("b", Some(5)),
            ("a", None),
            ("a", Some(9)),
            ("c", None),
        ] {
            let (r, rx) = renewal(token, ttl);
            waiting.push_back(r);
            kept.push(rx);
        }
        let (gone, rx) = renewal("d", None);
        waiting.push_back(gone);
        drop(rx);

        let batch = take_batch(&mut waiting);
        let named: Vec<(&str, usize)> = batch
            .iter()
            .map(|e| (e.token.expose(), e.answers.len()))
            .collect();
        assert_eq!(named, [("a", 2), ("b", 1), ("c", 1)]);
        assert_eq!(waiting.len(), 1, "a's other ttl waits");
        let next = take_batch(&mut waiting);
        assert_eq!(next.len(), 1);
        assert_eq!((next[0].token.expose(), next[0].ttl_ms), ("a", Some(9)));
        assert!(waiting.is_empty());

        for i in 0..MOST + 5 {
            let (r, rx) = renewal(&format!("t{i}"), None);
            waiting.push_back(r);
            kept.push(rx);
        }
        assert_eq!(take_batch(&mut waiting).len(), MOST);
        assert_eq!(take_batch(&mut waiting).len(), 5);
    }
}
