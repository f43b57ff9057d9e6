//! A node as a backend uses it ([`Member`]): this sidecar's queue tickets on
//! it, kept alive by one heartbeat task, and the keys to reconcile after
//! failed calls.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backend::{Attempt, Busy, Error};
use crate::lock::{Claim, LockKey, Token};
use crate::wakeups::Wakeups;

use super::HEARTBEAT_EVERY;
use super::node::{Node, Step};
use super::pubsub::{Sub, Watchers, pubsub};

/// This sidecar's queued tickets per key, by the node's ticket numbers.
pub(super) type Tickets = HashMap<LockKey, BTreeSet<u64>>;

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One node as a backend uses it: the node, this sidecar's tickets on it
/// (kept alive by a heartbeat task), keys to reconcile after failed calls,
/// and its pub/sub task.
pub struct Member {
    pub node: Arc<Node>,
    pub(super) tickets: Mutex<Tickets>,
    /// Keys where a call failed, so the node may hold tickets of this
    /// sidecar that it no longer waits on; reconciled on the next heartbeat
    /// tick or acquire of the key.
    pub(super) suspect: Mutex<HashSet<LockKey>>,
    pub(super) sidecar: String,
    pub(super) subs: mpsc::UnboundedSender<Sub>,
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
        sidecar: &str,
        watchers: &Watchers,
        wakeups: &Wakeups,
        stop: &CancellationToken,
        numbering: Numbering,
    ) -> Arc<Self> {
        let (subs, rx) = mpsc::unbounded_channel();
        let member = Arc::new(Self {
            node: Arc::new(node),
            tickets: Mutex::new(HashMap::new()),
            suspect: Mutex::new(HashSet::new()),
            sidecar: sidecar.to_owned(),
            subs,
        });
        tokio::spawn(pubsub(
            member.node.clone(),
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

    pub(super) fn track(&self, key: &LockKey, seq: u64, queued: bool) {
        let mut tickets = lock(&self.tickets);
        if queued {
            tickets.entry(key.clone()).or_default().insert(seq);
        } else if let Some(set) = tickets.get_mut(key) {
            set.remove(&seq);
            if set.is_empty() {
                tickets.remove(key);
            }
        }
    }

    /// Reconciles one suspect key; it stays suspect if the node is still away.
    pub(super) async fn reconcile(&self, key: &LockKey) {
        if !lock(&self.suspect).remove(key) {
            return;
        }
        let live: Vec<u64> = lock(&self.tickets)
            .get(key)
            .map(|seqs| seqs.iter().copied().collect())
            .unwrap_or_default();
        if self
            .node
            .reconcile(key, &self.sidecar, &live)
            .await
            .is_err()
        {
            lock(&self.suspect).insert(key.clone());
        }
    }

    /// An acquire attempt that keeps the ticket bookkeeping.
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
        let result = self
            .node
            .try_acquire(claim, step, token, fifo, max_permits)
            .await;
        let attempt = self.check(&claim.key, result)?;
        match (&attempt, step) {
            (
                Attempt::Busy(Busy {
                    ticket: Some(t), ..
                }),
                _,
            ) => self.track(&claim.key, t.seq, true),
            (Attempt::Granted(_), Step::Queued(seq)) => self.track(&claim.key, seq, false),
            _ => {}
        }
        Ok(attempt)
    }

    /// Leaves the queue; a failure is reconciled later.
    pub async fn dequeue(&self, key: &LockKey, seq: u64) -> Result<(), Error> {
        self.track(key, seq, false);
        let result = self.node.dequeue(key, seq).await;
        self.check(key, result)
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
        let keys: Vec<LockKey> = lock(&member.tickets).keys().cloned().collect();
        for key in keys {
            if let Err(e) = member.node.heartbeat(&key, &member.sidecar).await {
                tracing::debug!(lock = %key, error = %e, "heartbeat failed");
            }
        }
    }
}
