//! A node as a backend uses it ([`Member`]): this sidecar's queue tickets on
//! it, kept alive by one heartbeat task, and the keys to reconcile after
//! failed calls.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backend::{Attempt, Busy, Error};
use crate::lock::{Claim, Kind, LockKey, Token};
use crate::wakeups::Wakeups;

use super::HEARTBEAT_EVERY;
use super::leases::{NodeTurn, entry};
use super::node::{Node, Step};
use super::pubsub::{Sub, Watchers, deliver, pubsub};

/// One of this sidecar's queue entries on a node: the token it queued with
/// (the lease's, when the lock is handed to it) and the entry as its join
/// wrote it, by which the scripts find it.
#[derive(Clone)]
pub(super) struct Queued {
    pub(super) token: Token,
    pub(super) entry: String,
}

/// How long a ticket that left the queue is remembered ([`Tickets::finished`]).
const FINISHED_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// This sidecar's tickets on one node, shared by its member and its pub/sub task.
#[derive(Default)]
pub(super) struct Tickets {
    /// Queued tickets per key, by the node's ticket numbers.
    pub(super) queued: HashMap<LockKey, BTreeMap<u64, Queued>>,
    /// Tickets that left the queue lately (granted, handed over, dequeued):
    /// a handoff message for one of them is no lease nobody knows.
    pub(super) finished: Finished,
    /// Tickets whose waiter left while the node could not be told: their
    /// leaving is sent again (the key's reconciling, the caller's retries),
    /// and a lock handed to one meanwhile is given back.
    pub(super) abandoned: HashMap<(LockKey, u64), Queued>,
}

/// Tickets that left the queue in the last [`FINISHED_FOR`]. Each is
/// forgotten once, oldest first, when a later one is added: a sidecar that
/// hands over a thousand locks a second remembers sixty thousand, and
/// adding one must not look at all of them.
#[derive(Default)]
pub(super) struct Finished {
    /// When each ticket last left.
    at: HashMap<(LockKey, u64), std::time::Instant>,
    /// The same tickets (a ticket that left twice: twice), oldest first.
    order: std::collections::VecDeque<(std::time::Instant, LockKey, u64)>,
}

impl Finished {
    /// Remembers that ticket `seq` on `key` left at `now`, and forgets the
    /// tickets that left [`FINISHED_FOR`] before it. Returns how many it
    /// forgot.
    pub(super) fn add(&mut self, key: &LockKey, seq: u64, now: std::time::Instant) -> usize {
        let mut forgot = 0;
        while let Some((left, ..)) = self.order.front() {
            if now.saturating_duration_since(*left) < FINISHED_FOR {
                break;
            }
            let Some((left, old_key, old_seq)) = self.order.pop_front() else {
                break;
            };
            let id = (old_key, old_seq);
            // Not when it left again later: that entry is further back.
            if self.at.get(&id) == Some(&left) {
                self.at.remove(&id);
                forgot += 1;
            }
        }
        self.at.insert((key.clone(), seq), now);
        self.order.push_back((now, key.clone(), seq));
        forgot
    }

    /// Whether ticket `seq` on `key` left lately.
    pub(super) fn has(&self, key: &LockKey, seq: u64) -> bool {
        self.at.contains_key(&(key.clone(), seq))
    }

    /// How many tickets are remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.at.len()
    }
}

impl Tickets {
    /// Whether ticket `seq` on `key` is queued or left lately.
    pub(super) fn knows(&self, key: &LockKey, seq: u64) -> bool {
        self.queued.get(key).is_some_and(|s| s.contains_key(&seq)) || self.finished.has(key, seq)
    }

    /// This process's queued entries on `key`, in ticket order.
    pub(super) fn entries(&self, key: &LockKey) -> Vec<String> {
        self.queued
            .get(key)
            .map(|s| s.values().map(|q| q.entry.clone()).collect())
            .unwrap_or_default()
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

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

/// Whose numbering a node's queue tickets follow, which decides how a
/// release message that names the next ticket (`h<seq>`) wakes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Numbering {
    /// The node's tickets are the local queues' own (one Redis): only the
    /// named ticket is woken.
    Shared,
    /// Each node numbers its tickets its own way (Redlock): every named
    /// ticket wakes the local queue head, as a plain release does.
    PerNode,
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
        if let Err(Error::Unavailable { .. }) = &result {
            lock(&self.suspect).insert(key.clone());
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
        if self.node.reconcile(key, &live).await.is_err() {
            lock(&self.suspect).insert(key.clone());
        } else if !live.is_empty() {
            self.wakeups.wake(key);
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
            suspect: &self.suspect,
            key: Some(key),
        };
        let result = self.node.release_handing(key, token).await;
        unanswered.key = None;
        let (holds, handed) = self.check(key, result)?;
        if let Some(h) = handed {
            deliver(&self.node, &self.tickets, &self.wakeups, key, h);
        } else if holds.is_none() && self.wakeups.len(key) > 0 {
            // Nothing to release: perhaps a run of this release whose answer
            // was lost handed the lock to one of our waiters already.
            lock(&self.suspect).insert(key.clone());
        }
        Ok(holds)
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
            (Step::Queued(_), Some(q)) if self.node.handoff => {
                (NodeTurn::Queued { entry: &q.entry }, &q.token)
            }
            (Step::Queued(_), Some(q)) => (NodeTurn::Queued { entry: &q.entry }, token),
            // Handed over just now: the lease waits in the waiter's place,
            // which its wake-up makes it look at next.
            (Step::Queued(_), None) => return Ok(Attempt::Busy(Busy::default())),
        };
        let result = self
            .node
            .try_acquire(claim, turn, token, fifo, max_permits)
            .await;
        let attempt = self.check(&claim.key, result)?;
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
    pub async fn dequeue(&self, key: &LockKey, seq: u64) -> Result<(), Error> {
        let q = match self.queued(key, seq) {
            Some(q) => {
                self.track(key, seq, None);
                q
            }
            None => match lock(&self.tickets).abandoned.remove(&(key.clone(), seq)) {
                Some(q) => q,
                None => return Ok(()),
            },
        };
        let result = match self.node.dequeue(key, &q.entry, &q.token).await {
            // Neither queued nor holding the lock exclusively: a shared or
            // semaphore claim may have been granted by an attempt whose
            // answer was lost (its waiter then left): that hold goes too.
            Ok(0) if key.kind == Kind::Semaphore || !exclusive(&q.entry) => {
                self.release(key, &q.token).await.map(|_| ())
            }
            other => other.map(|_| ()),
        };
        if result.is_err() {
            lock(&self.tickets).abandoned.insert((key.clone(), seq), q);
        }
        self.check(key, result)
    }
}

/// Whether a queue entry (`<seq> <mode> …`, lean.lua) is an exclusive claim.
fn exclusive(entry: &str) -> bool {
    entry.split(' ').nth(1) == Some("x")
}

/// A call in flight whose answer may hand this process a lock: dropped
/// with `key` still set, it marks the key suspect (reconciled on the next
/// heartbeat tick, and its local head looks again).
struct Unanswered<'a> {
    suspect: &'a Mutex<HashSet<LockKey>>,
    key: Option<&'a LockKey>,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key {
            lock(self.suspect).insert(key.clone());
        }
    }
}

/// Adds (`Some`) or removes this sidecar's ticket `seq` on `key`; a removed
/// one is remembered as finished for a while.
pub(super) fn track(tickets: &Mutex<Tickets>, key: &LockKey, seq: u64, queued: Option<Queued>) {
    let mut tickets = lock(tickets);
    match queued {
        Some(q) => {
            tickets
                .queued
                .entry(key.clone())
                .or_default()
                .insert(seq, q);
        }
        None => {
            if let Some(seqs) = tickets.queued.get_mut(key) {
                seqs.remove(&seq);
                if seqs.is_empty() {
                    tickets.queued.remove(key);
                }
            }
            tickets.finished.add(key, seq, std::time::Instant::now());
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
    use std::time::{Duration, Instant};

    use super::{FINISHED_FOR, Finished};
    use crate::lock::LockKey;

    fn key(name: &str) -> LockKey {
        LockKey::lock(name)
    }

    /// A ticket is known for [`FINISHED_FOR`] after it last left, and then
    /// forgotten; adding one forgets only the tickets whose time is up, so
    /// a busy sidecar's handoffs do not each look at every ticket of the
    /// last minute (they did: sixty thousand at a thousand handoffs a second).
    #[test]
    fn finished_tickets_are_forgotten_oldest_first_one_by_one() {
        let (a, b) = (key("a"), key("b"));
        let t0 = Instant::now();
        let mut finished = Finished::default();
        let step = Duration::from_millis(1);
        let n = 3 * FINISHED_FOR.as_millis() as u64;
        let mut forgot = 0;
        for i in 0..n {
            forgot += finished.add(&a, i, t0 + step * i as u32);
            // No more than a minute's worth is ever remembered.
            assert!(finished.len() <= FINISHED_FOR.as_millis() as usize + 1);
        }
        assert_eq!(
            forgot + finished.len(),
            n as usize,
            "each ticket forgotten once"
        );
        assert!(finished.has(&a, n - 1));
        assert!(!finished.has(&a, 0));
        assert!(!finished.has(&b, n - 1));

        // A ticket that leaves again is kept from its last time.
        let mut finished = Finished::default();
        finished.add(&b, 7, t0);
        finished.add(&b, 7, t0 + FINISHED_FOR / 2);
        assert_eq!(finished.add(&a, 1, t0 + FINISHED_FOR), 0);
        assert!(finished.has(&b, 7));
        assert_eq!(finished.add(&a, 2, t0 + FINISHED_FOR * 2), 2);
        assert!(!finished.has(&b, 7));
        assert!(!finished.has(&a, 1));
    }
}
