//! A node as a backend uses it ([`Member`]): this sidecar's queue tickets on
//! it, kept alive by one heartbeat task, the keys to reconcile after failed
//! calls, and the lock channels watched on every member ([`watch`]).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use futures::StreamExt as _;
use redis::{ErrorKind, RedisError};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::backend::unanswered::Failed;
use crate::backend::{Attempt, Busy, Cause, Error, Watch};
use crate::lock::{Claim, Kind, LockKey, Token};
use crate::wakeups::Wakeups;

use super::conn::unavailable;
use super::leases::{NodeTurn, entry};
use super::node::{Node, Step};
use super::pubsub::{
    Channel, LINGER, MAX_LINGERING, Sub, Subscribing, UNKNOWN_GRACE, Watched, Watchers, deliver,
    pubsub,
};
use super::tickets::{Abandoned, Numbering, Queued, Tickets, track};
use super::{CALL_TIMEOUT, HEARTBEAT_EVERY, lock};

/// The most keys kept suspect that this sidecar has no waiter or ticket
/// on: past it, such a key is not reconciled, and a ticket a failed call
/// may have left there lapses with this sidecar's heartbeat on the key
/// (`HEARTBEAT_TTL`), as a dead sidecar's does. Keys with a local waiter or
/// ticket are always kept (a lost release may have handed one the lock;
/// their heartbeat would keep an orphan ticket alive).
const MOST_SUSPECT_IDLE: usize = 1024;

/// The most keys kept suspect after joins given up unanswered (a join may
/// have queued a claim no ticket names yet: its place, left there, would be
/// kept alive by this sidecar's heartbeat once another of its waiters
/// queues on the key, ahead of everyone); past it, as any idle key.
const MOST_SUSPECT_JOINS: usize = 16 * MOST_SUSPECT_IDLE;

/// One node as a backend uses it: the node, this sidecar's tickets on it
/// (kept alive by a heartbeat task), keys to reconcile after failed calls,
/// and its pub/sub task.
pub struct Member {
    pub node: Arc<Node>,
    pub(super) tickets: Arc<Mutex<Tickets>>,
    /// Keys where a call failed, so the node may hold tickets of this
    /// sidecar that it no longer waits on; reconciled on the next heartbeat
    /// tick or acquire of the key.
    pub(super) suspect: Mutex<HashSet<LockKey>>,
    pub(super) subs: mpsc::UnboundedSender<Sub>,
    /// Whether the pub/sub connection is up (connected and subscribed).
    pub connected: Arc<std::sync::atomic::AtomicBool>,
    /// This sidecar's waiters, told of what the node's replies hand them.
    wakeups: Wakeups,
}

impl Member {
    /// Starts the member's heartbeat and pub/sub tasks.
    pub fn start(
        node: Node,
        watchers: &Watchers,
        wakeups: &Wakeups,
        stop: &CancellationToken,
        numbering: Numbering,
    ) -> Arc<Self> {
        let (subs, rx) = mpsc::unbounded_channel();
        let connected = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let member = Arc::new(Self {
            node: Arc::new(node),
            tickets: Arc::new(Mutex::new(Tickets::default())),
            suspect: Mutex::new(HashSet::new()),
            subs,
            connected: connected.clone(),
            wakeups: wakeups.clone(),
        });
        tokio::spawn(pubsub(
            member.node.clone(),
            member.tickets.clone(),
            connected,
            rx,
            watchers.clone(),
            wakeups.clone(),
            stop.clone(),
            numbering,
        ));
        tokio::spawn(heartbeats(Arc::downgrade(&member), stop.clone()));
        member
    }

    /// Notes a failed call on `key` and passes the result on.
    pub(super) fn check<T>(&self, key: &LockKey, result: Result<T, Error>) -> Result<T, Error> {
        self.check_joining(key, result, false)
    }

    /// [`check`](Self::check), for a join when `joining` (which may have
    /// queued a claim that none of this sidecar's tickets names yet).
    fn check_joining<T>(
        &self,
        key: &LockKey,
        result: Result<T, Error>,
        joining: bool,
    ) -> Result<T, Error> {
        if let Err(e @ Error::Unavailable { .. }) = &result {
            // Refused before it was sent, it changed nothing there.
            let unsent = e
                .cause()
                .is_some_and(|c| c == Cause::ConnectionRefused || c.is_refusal());
            if !unsent {
                self.suspect(key, joining);
            }
        }
        result
    }

    pub(super) fn track(&self, key: &LockKey, seq: u64, queued: Option<Queued>) {
        track(&self.tickets, key, seq, queued);
    }

    fn queued(&self, key: &LockKey, seq: u64) -> Option<Queued> {
        lock(&self.tickets).queued.get(key)?.get(&seq).cloned()
    }

    /// Reconciles one suspect key; it stays suspect if the node is still away.
    /// The local head then looks again: a release whose answer was lost may
    /// have handed it the lock.
    pub(super) async fn reconcile(&self, key: &LockKey) {
        if !lock(&self.suspect).remove(key) {
            return;
        }
        // Until it is done — also when its caller drops it (an attempt past
        // Redlock's time limit for the node) — the key stays suspect.
        let mut unfinished = Unanswered {
            member: self,
            key: Some(key),
            joining: false,
        };
        let abandoned: Vec<u64> = lock(&self.tickets)
            .abandoned
            .keys()
            .filter(|(k, _)| k == key)
            .map(|(_, seq)| *seq)
            .collect();
        for seq in abandoned {
            // Kept (and the key suspect) when the node is still away.
            if self.dequeue(key, seq).await.is_err() {
                return;
            }
        }
        let live: Vec<u64> = lock(&self.tickets)
            .queued
            .get(key)
            .map(|seqs| seqs.keys().copied().collect())
            .unwrap_or_default();
        if self.node.reconcile(key, &live).await.is_ok() {
            unfinished.key = None;
            if !live.is_empty() {
                self.wakeups.wake(key);
            }
        }
    }

    /// Releases one hold (the holds left; `None`: the token holds nothing).
    /// A lock the release handed to a claim of this process is delivered
    /// from its answer: no message on the node's channel tells it. When the
    /// answer is lost, the key's reconciling on the next heartbeat tick has
    /// the local head look again, once the node answers: a release whose
    /// answer timed out may still be running, and a look before it ends
    /// would fail the waiter.
    pub async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, Error> {
        // Dropped before its answer (its caller went away), the release may
        // still run: the key is reconciled as after a lost answer.
        let mut unanswered = Unanswered {
            member: self,
            key: Some(key),
            joining: false,
        };
        // A connection lost or a time limit passed once the script was
        // sent: it may have run. (Not sent without a connection; a reply
        // that is an error — READONLY, BUSY, LOADING — says it did not.)
        let result = match self.node.connection("release").await {
            Ok(_) => self
                .node
                .release_handing(key, token)
                .await
                .map_err(sent_unanswered),
            Err(e) => Err(e),
        };
        unanswered.key = None;
        let (holds, handed) = self.check(key, result)?;
        if let Some(h) = handed {
            deliver(&self.node, &self.tickets, &self.wakeups, key, h);
            // The waiter's grant goes out before this release's answer: the
            // next holder is waiting, the releaser is not.
            tokio::task::yield_now().await;
        } else if holds.is_none() && self.wakeups.len(key) > 0 {
            // Nothing to release: perhaps a run of this release whose answer
            // was lost handed the lock to one of our waiters already.
            lock(&self.suspect).insert(key.clone());
        }
        Ok(holds)
    }

    /// Releases `token`'s lease of an attempt whose answer was given up,
    /// for [`release_unanswered`](crate::backend::unanswered::release_unanswered):
    /// not run when no connection can be had; after connecting, a failure
    /// may come after the release ran.
    pub(crate) async fn release_lost(
        &self,
        key: &LockKey,
        token: &Token,
    ) -> Result<Option<u32>, Failed> {
        self.release(key, token).await.map_err(|e| {
            if e.cause().is_some() && !e.may_have_run() {
                Failed::NotRun
            } else {
                Failed::Unanswered
            }
        })
    }

    /// An acquire attempt that keeps the ticket bookkeeping. A queued
    /// attempt on a node that hands locks over asks for the lease its entry
    /// was queued with (`token` is the new lease's otherwise).
    pub async fn try_acquire(
        &self,
        claim: &Claim,
        step: Step,
        token: &Token,
        fifo: bool,
        max_permits: u32,
        again: bool,
    ) -> Result<Attempt, Error> {
        if lock(&self.suspect).contains(&claim.key) {
            self.reconcile(&claim.key).await;
        }
        let since = self.node.server_now();
        let queued = match step {
            // A node that wakes the next claim instead of handing it the lock
            // (Redlock's) may have granted this ticket in an attempt that did
            // not win: queued again at its place, as a new entry.
            Step::Queued(seq) if !self.node.handoff => {
                Some(self.queued(&claim.key, seq).unwrap_or_else(|| Queued {
                    token: token.clone(),
                    entry: entry(seq, claim, token, since, &self.node.instance),
                }))
            }
            Step::Queued(seq) => self.queued(&claim.key, seq),
            _ => None,
        };
        let (turn, token) = match (step, &queued) {
            (Step::Once, _) => (NodeTurn::Once, token),
            (Step::Join, _) => {
                let beat = !lock(&self.tickets).queued.contains_key(&claim.key);
                (NodeTurn::Join { since, beat }, token)
            }
            (Step::Queued(_), Some(q)) if self.node.handoff => (
                NodeTurn::Queued {
                    entry: &q.entry,
                    again,
                },
                &q.token,
            ),
            (Step::Queued(_), Some(q)) => (
                NodeTurn::Queued {
                    entry: &q.entry,
                    again,
                },
                token,
            ),
            // Handed over just now: the lease waits in the waiter's place,
            // which its wake-up makes it look at next.
            (Step::Queued(_), None) => return Ok(Attempt::Busy(Busy::default())),
        };
        // Dropped before its answer (Redlock gives each node a time limit),
        // the attempt may still run and queue the claim: the key is
        // reconciled as after a lost answer.
        let joining = matches!(step, Step::Join);
        let mut unanswered = Unanswered {
            member: self,
            key: Some(&claim.key),
            joining,
        };
        let result = self
            .node
            .try_acquire(claim, turn, token, fifo, max_permits)
            .await;
        unanswered.key = None;
        let attempt = self.check_joining(&claim.key, result, joining)?;
        match (&attempt, step) {
            (
                Attempt::Busy(Busy {
                    ticket: Some(t), ..
                }),
                _,
            ) => self.track(
                &claim.key,
                t.seq,
                Some(Queued {
                    token: token.clone(),
                    entry: entry(t.seq, claim, token, since, &self.node.instance),
                }),
            ),
            (Attempt::Granted(_), Step::Queued(seq)) => self.track(&claim.key, seq, None),
            // A node that hands the lock over may have handed it to this
            // ticket as the answer came back: its delivery ended the ticket.
            (Attempt::Busy(_), Step::Queued(seq)) if !self.node.handoff => {
                self.track(&claim.key, seq, queued);
            }
            _ => {}
        }
        Ok(attempt)
    }

    /// Leaves the queue (releasing the lease the lock was handed to meanwhile,
    /// if it was). A ticket whose leaving failed is kept as abandoned and
    /// sent again by the next call for it or the key's reconciling:
    /// forgotten, a lock handed to its claim later went to nobody until the
    /// lease's ttl.
    ///
    /// A leaving sent with the ticket's token that may have run (its answer
    /// lost) is sent again without it: the second run of the first, which
    /// had given back the lease handed to the ticket, took the hold its
    /// owner had re-entered meanwhile through another sidecar.
    pub async fn dequeue(&self, key: &LockKey, seq: u64) -> Result<(), Error> {
        let (q, token_spent) = match self.queued(key, seq) {
            Some(q) => {
                self.track(key, seq, None);
                (q, false)
            }
            None => {
                let mut tickets = lock(&self.tickets);
                let at = (key.clone(), seq);
                match tickets.abandoned.remove(&at) {
                    // Left already; kept for a handoff's message until then.
                    Some(a) if a.kept_until.is_some() => {
                        if a.kept_until.is_some_and(|t| t > std::time::Instant::now()) {
                            tickets.abandoned.insert(at, a);
                        }
                        return Ok(());
                    }
                    Some(a) => (a.queued, a.token_spent),
                    None => return Ok(()),
                }
            }
        };
        let result = if token_spent {
            match self.node.drop_entry(key, &q.entry).await {
                Ok(0) => {
                    let now = std::time::Instant::now();
                    let mut tickets = lock(&self.tickets);
                    tickets
                        .abandoned
                        .retain(|_, a| a.kept_until.is_none_or(|t| t > now));
                    tickets.abandoned.insert(
                        (key.clone(), seq),
                        Abandoned {
                            queued: q,
                            token_spent,
                            kept_until: Some(now + UNKNOWN_GRACE * 2),
                        },
                    );
                    return Ok(());
                }
                other => other.map(|_| ()),
            }
        } else {
            match self.leave(key, &q).await {
                // Neither queued nor holding the lock exclusively: a shared
                // or semaphore claim may have been granted by an attempt
                // whose answer was lost (its waiter then left): that hold
                // goes too.
                Ok(0) if key.kind == Kind::Semaphore || !exclusive(&q.entry) => {
                    self.release(key, &q.token).await.map(|_| ())
                }
                other => other.map(|_| ()),
            }
        };
        if let Err(e) = &result {
            let token_spent = token_spent || e.may_have_run();
            lock(&self.tickets).abandoned.insert(
                (key.clone(), seq),
                Abandoned {
                    queued: q,
                    token_spent,
                    kept_until: None,
                },
            );
        }
        self.check(key, result)
    }

    /// Runs the dequeue script for `q`: an error once it was sent on a
    /// connection that was then lost or timed out says it may have run.
    async fn leave(&self, key: &LockKey, q: &Queued) -> Result<i64, Error> {
        self.node.connection("dequeue").await?;
        self.node
            .dequeue(key, &q.entry, &q.token)
            .await
            .map_err(sent_unanswered)
    }
}

/// The error of a script sent on a connection, marked unanswered when it
/// may have run ([`Error::sent_may_have_run`]).
fn sent_unanswered(e: Error) -> Error {
    if e.sent_may_have_run() {
        e.unanswered()
    } else {
        e
    }
}

/// Subscribes `key`'s channel on every member (once per channel however many
/// local waiters watch it) and resolves when `quorum` members confirmed. A
/// watcher that comes while the channel's subscription is under way waits
/// for its outcome and shares it.
///
/// # Errors
/// [`Error::Unavailable`] when fewer than `quorum` members could subscribe.
///
/// # Cancellation safety
/// Dropped while it subscribes, the watchers waiting for it find it gone
/// and one of them subscribes instead.
pub async fn watch(
    members: &[Arc<Member>],
    watchers: &Watchers,
    key: &LockKey,
    quorum: usize,
) -> Result<Watch, Error> {
    let channel = members[0].node.channel(key);
    {
        let mut w = lock(watchers);
        let lingered = match w.channels.get_mut(&channel) {
            Some(ch) => {
                ch.watchers += 1;
                ch.watchers == 1
            }
            None => {
                let ch = Channel {
                    key: key.clone(),
                    watchers: 1,
                    confirmed: false,
                    linger: 0,
                    pending: None,
                };
                w.channels.insert(channel.clone(), ch);
                false
            }
        };
        if lingered {
            w.lingering -= 1;
        }
    }
    // Counted above, so the channel stays while this watches.
    let guard = WatchGuard {
        channel: channel.clone(),
        watchers: watchers.clone(),
        subs: members.iter().map(|m| m.subs.clone()).collect(),
    };
    loop {
        let role = {
            let mut w = lock(watchers);
            let Some(ch) = w.channels.get_mut(&channel) else {
                return Err(unavailable("subscribe", not_confirmed()));
            };
            if ch.confirmed {
                return Ok(Box::new(guard));
            }
            match &ch.pending {
                Some(under_way) => Role::Follow(under_way.clone()),
                None => {
                    let (tell, under_way) = tokio::sync::watch::channel(None);
                    ch.pending = Some(under_way);
                    Role::Lead(tell)
                }
            }
        };
        let outcome = match role {
            Role::Lead(tell) => {
                let outcome = subscribe(members, &channel, quorum).await;
                if let Some(ch) = lock(watchers).channels.get_mut(&channel) {
                    ch.pending = None;
                    ch.confirmed = outcome.is_ok();
                }
                let _ = tell.send(Some(outcome.clone()));
                outcome
            }
            Role::Follow(mut under_way) => {
                let told = under_way
                    .wait_for(Option::is_some)
                    .await
                    .map(|outcome| outcome.clone().unwrap_or_else(|| Err(not_confirmed())));
                match told {
                    Ok(outcome) => outcome,
                    Err(_) => {
                        // Its subscriber went without an outcome: subscribe
                        // anew.
                        if let Some(ch) = lock(watchers).channels.get_mut(&channel)
                            && ch
                                .pending
                                .as_ref()
                                .is_some_and(|p| p.same_channel(&under_way))
                        {
                            ch.pending = None;
                        }
                        continue;
                    }
                }
            }
        };
        return match outcome {
            Ok(()) => Ok(Box::new(guard)),
            Err(why) => Err(unavailable("subscribe", why)),
        };
    }
}

/// A watcher's part in its channel's subscription: to make it, telling
/// the others its outcome, or to wait for the one under way.
enum Role {
    Lead(tokio::sync::watch::Sender<Option<Result<(), RedisError>>>),
    Follow(Subscribing),
}

/// Subscribes `channel` on every member: `Ok` when `quorum` members
/// confirmed, or why not (a refusal is told, so that the 503 names it).
async fn subscribe(
    members: &[Arc<Member>],
    channel: &str,
    quorum: usize,
) -> Result<(), RedisError> {
    // Asked twice at most: a connection that died without a word while
    // nobody waited (no check goes then) leaves the first unanswered, and
    // is made again with this channel among its subscriptions.
    let acks = members.iter().map(|m| async {
        let mut why = not_confirmed();
        for _ in 0..2 {
            let (ack, done) = oneshot::channel();
            if m.subs
                .send(Sub::Subscribe(channel.to_owned(), ack))
                .is_err()
            {
                break;
            }
            match crate::clock::within(CALL_TIMEOUT, done).await {
                Ok(Ok(Ok(()))) => return Ok(()),
                Ok(Ok(Err(e))) => why = e,
                _ => {}
            }
        }
        Err(why)
    });
    // Done once `quorum` members confirmed, or once too few are left to:
    // a member down costs no watcher its time limit.
    let mut acks: futures::stream::FuturesUnordered<_> = acks.collect();
    let (mut confirmed, mut failed) = (0, Vec::new());
    while let Some(answer) = acks.next().await {
        match answer {
            Ok(()) => confirmed += 1,
            Err(e) => failed.push(e),
        }
        if confirmed >= quorum {
            return Ok(());
        }
        if members.len() - failed.len() < quorum {
            break;
        }
    }
    // A refusal before an outage, as Redlock names its nodes' errors.
    let told = failed
        .iter()
        .position(|e| Cause::of(e).is_refusal())
        .unwrap_or(0);
    Err(if failed.is_empty() {
        not_confirmed()
    } else {
        failed.swap_remove(told)
    })
}

/// Why a member's subscription failed when it gave no reason (no answer).
fn not_confirmed() -> RedisError {
    RedisError::from((ErrorKind::Io, "subscription not confirmed"))
}

/// Unsubscribes [`LINGER`] after the last local watcher of a channel goes
/// (at once when too many linger, or no watch saw it confirmed).
pub(super) struct WatchGuard {
    pub(super) channel: String,
    pub(super) watchers: Watchers,
    pub(super) subs: Vec<mpsc::UnboundedSender<Sub>>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        let mut watchers = lock(&self.watchers);
        let Watched {
            channels,
            lingering,
            lingers,
        } = &mut *watchers;
        let Some(ch) = channels.get_mut(&self.channel) else {
            return;
        };
        ch.watchers -= 1;
        if ch.watchers > 0 {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if ch.confirmed && *lingering < MAX_LINGERING => {
                *lingers += 1;
                *lingering += 1;
                ch.linger = *lingers;
                let linger = *lingers;
                let (channel, watchers, subs) = (
                    self.channel.clone(),
                    self.watchers.clone(),
                    self.subs.clone(),
                );
                runtime.spawn(async move {
                    tokio::time::sleep(LINGER).await;
                    let mut w = lock(&watchers);
                    // Still without a watcher since this linger began.
                    if w.channels
                        .get(&channel)
                        .is_some_and(|ch| ch.watchers == 0 && ch.linger == linger)
                    {
                        w.channels.remove(&channel);
                        w.lingering -= 1;
                        unsubscribe(&subs, &channel);
                    }
                });
            }
            _ => {
                channels.remove(&self.channel);
                unsubscribe(&self.subs, &self.channel);
            }
        }
    }
}

/// Asks every member's pub/sub task to unsubscribe `channel`.
fn unsubscribe(subs: &[mpsc::UnboundedSender<Sub>], channel: &str) {
    for s in subs {
        let _ = s.send(Sub::Unsubscribe(channel.to_owned()));
    }
}

/// Whether a queue entry (`<seq> <mode> …`, lean.lua) is an exclusive claim.
fn exclusive(entry: &str) -> bool {
    entry.split(' ').nth(1) == Some("x")
}

/// A call in flight whose answer may hand this process a lock or queue one
/// of its claims, or a reconciling under way: dropped with `key` still set,
/// it marks the key suspect (reconciled on the next heartbeat tick, and its
/// local head looks again).
struct Unanswered<'a> {
    member: &'a Member,
    key: Option<&'a LockKey>,
    /// A join's: it may have queued a claim no ticket names yet.
    joining: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key {
            self.member.suspect(key, self.joining);
        }
    }
}

impl Member {
    /// Marks `key` suspect: always when a local waiter or ticket is on it;
    /// after a join (`joining`) while fewer than [`MOST_SUSPECT_JOINS`]
    /// keys are; else while fewer than [`MOST_SUSPECT_IDLE`] are.
    fn suspect(&self, key: &LockKey, joining: bool) {
        let waited_on = self.wakeups.len(key) > 0 || lock(&self.tickets).on(key);
        let most = if joining {
            MOST_SUSPECT_JOINS
        } else {
            MOST_SUSPECT_IDLE
        };
        let mut suspect = lock(&self.suspect);
        if waited_on || suspect.len() < most {
            suspect.insert(key.clone());
        }
    }
}

/// Refreshes the heartbeat of this sidecar's waiters on one node — one
/// script call per contended lock every [`HEARTBEAT_EVERY`], however many
/// wait on it — and reconciles keys where calls failed.
pub(super) async fn heartbeats(member: std::sync::Weak<Member>, stop: CancellationToken) {
    let mut every = tokio::time::interval(HEARTBEAT_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = every.tick() => {}
        }
        let Some(member) = member.upgrade() else {
            return;
        };
        let suspects: Vec<LockKey> = lock(&member.suspect).iter().cloned().collect();
        for key in suspects {
            member.reconcile(&key).await;
        }
        let keys: Vec<LockKey> = lock(&member.tickets).queued.keys().cloned().collect();
        for key in keys {
            if let Err(e) = member.node.heartbeat(&key).await {
                tracing::debug!(lock = %key, error = %e, "heartbeat failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use super::{MOST_SUSPECT_IDLE, Member, Step, lock, sent_unanswered};
    use crate::backend::Error;
    use crate::backend::redis::conn::never_answering;
    use crate::backend::redis::node::Node;
    use crate::backend::redis::tickets::Numbering;
    use crate::lock::{Claim, Kind, LockKey, Mode, Name, Token};
    use crate::wakeups::Wakeups;

    fn claim(i: usize) -> Claim {
        Claim {
            key: LockKey {
                kind: Kind::Lock,
                name: Name::parse(&format!("job-{i}")).expect("valid name"),
            },
            mode: Mode::Exclusive,
            owner: "o".into(),
            sidecar: "s".into(),
            ttl: Duration::from_secs(10),
            limit: None,
            lock_delay: Duration::ZERO,
            max_hold: None,
        }
    }

    /// A member whose node is at `url`, its tasks stopped by `stop`.
    fn member(url: &str, stop: &CancellationToken) -> Arc<Member> {
        let node = Node::open(url, "sidelock:", true, stop.clone()).expect("node");
        Member::start(
            node,
            &Default::default(),
            &Wakeups::default(),
            stop,
            Numbering::Shared,
        )
    }

    /// Acquires and releases `names` locks once each, all at once, through a
    /// member whose node is at `url`, each call given up after `limit` (as
    /// Redlock gives each node a time limit); returns how many keys it keeps
    /// suspect.
    async fn suspects_after(url: &str, names: usize, limit: Duration) -> usize {
        let stop = CancellationToken::new();
        let member = member(url, &stop);
        let calls = (0..names).map(|i| {
            let member = member.clone();
            async move {
                let (claim, token) = (claim(i), Token::generate());
                let acquire = member.try_acquire(&claim, Step::Once, &token, true, 0, false);
                let _ = tokio::time::timeout(limit, acquire).await;
                let _ = tokio::time::timeout(limit, member.release(&claim.key, &token)).await;
            }
        });
        futures::future::join_all(calls).await;
        let kept = lock(&member.suspect).len();
        stop.cancel();
        kept
    }

    /// A join given up unanswered (it may have queued the claim, in none
    /// of this sidecar's tickets yet) keeps its key suspect past the
    /// bound: left out, its orphan place was never taken away, and a
    /// waiter of this sidecar on that key kept it alive with its heartbeat,
    /// ahead of everyone.
    #[tokio::test]
    async fn a_join_given_up_keeps_its_key_suspect_past_the_bound() {
        let (port, _hung) = never_answering().await;
        let stop = CancellationToken::new();
        let member = member(&format!("redis://127.0.0.1:{port}"), &stop);
        // Past the bound, also while the heartbeat task reconciles one.
        for i in 0..MOST_SUSPECT_IDLE + 10 {
            lock(&member.suspect).insert(claim(i).key);
        }
        let joining = claim(MOST_SUSPECT_IDLE + 10);
        let token = Token::generate();
        let join = member.try_acquire(&joining, Step::Join, &token, true, 0, false);
        let _ = tokio::time::timeout(Duration::from_millis(300), join).await;
        assert!(lock(&member.suspect).contains(&joining.key));
        stop.cancel();
    }

    /// A node away keeps no suspect key per name a call failed on: one
    /// refusing connections keeps none (nothing ran there), one whose calls
    /// are given up unanswered (they may have run) at most
    /// [`MOST_SUSPECT_IDLE`] that no local waiter or ticket needs. Each was
    /// kept for as long as the node was away (Redlock grants with a node
    /// down): a name per job grew the set without bound, and the node's
    /// return reconciled them all, one call each, before the next waiter's
    /// heartbeat.
    #[tokio::test]
    async fn a_node_away_keeps_a_bounded_set_of_suspect_keys() {
        let names = MOST_SUSPECT_IDLE + 200;
        let limit = Duration::from_millis(300);
        assert_eq!(suspects_after("redis://127.0.0.1:1", names, limit).await, 0);
        let (port, _hung) = never_answering().await;
        let kept = suspects_after(&format!("redis://127.0.0.1:{port}"), names, limit).await;
        assert!(
            kept <= MOST_SUSPECT_IDLE,
            "{kept} suspect keys kept of {names} names"
        );
    }

    /// A release whose reply failed to arrive whole for another reason than
    /// a lost connection or a time limit (a TLS alert mid-reply, an I/O
    /// error of another kind, a reply of an unexpected shape) may have run,
    /// and is not sent again: it read as refused, and a shutdown or a
    /// revocation released the hold a second time. The server's own error
    /// reply still says it did not run.
    #[test]
    fn a_call_that_failed_after_it_was_sent_may_have_run_unless_the_server_refused_it() {
        let failed = |e: redis::RedisError| {
            sent_unanswered(Error::Unavailable {
                op: "release",
                source: Box::new(e),
            })
            .may_have_run()
        };
        let tls = std::io::Error::new(std::io::ErrorKind::InvalidData, "tls alert");
        assert!(failed(tls.into()));
        assert!(failed(redis::RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "an unexpected reply"
        ))));
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert!(failed(reset.into()));
        for kind in [
            redis::ServerErrorKind::BusyLoading,
            redis::ServerErrorKind::ReadOnly,
            redis::ServerErrorKind::ResponseError,
        ] {
            assert!(
                !failed(redis::RedisError::from((
                    redis::ErrorKind::Server(kind),
                    "refused"
                ))),
                "{kind:?}"
            );
        }
        // No connection made for it (a TLS handshake refused): never sent.
        let handshake = std::io::Error::new(std::io::ErrorKind::InvalidData, "tls alert");
        let unsent = super::super::conn::not_connected("release", handshake.into());
        assert!(!unsent.sent_may_have_run());
        assert!(!sent_unanswered(unsent).may_have_run());
    }
}
