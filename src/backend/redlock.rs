//! `redlock://h1:p,h2:p,h3:p[/db]`: Redlock over N independent Redis masters.
//!
//! As specified by its author: every attempt runs the single-node acquire
//! script on all N nodes in parallel with a short per-node timeout, with the
//! same token; it succeeds only when a majority granted it and time is left
//! (validity = ttl − elapsed − clock drift); otherwise it is released on every
//! node. Renewals, releases and status checks also need a majority.
//!
//! Each node keeps its own queue, so a global FIFO order cannot be enforced
//! (nodes may see joins in different orders): queues are shown, and grants
//! follow the local FIFO order inside each sidecar; across sidecars,
//! contention is resolved by notification-driven retries with a random
//! delay after a split vote.
//!
//! # Which claims a majority can bound
//!
//! Every grant needs a majority `Q = ⌊N/2⌋ + 1` of the N nodes, and each node
//! checks the claim against what it has granted itself.
//!
//! * **Exclusive and shared locks are safe** (under Redlock's assumptions on
//!   clocks, delays and persistence). Any two majorities share a node, and
//!   that node has granted both leases: an exclusive lease and any other
//!   lease on the key cannot both hold a majority, because the shared node
//!   refused the second. Shared holders never exclude each other, so their
//!   number is unbounded by design.
//! * **Counting semaphores with `limit > 1` are refused.** Each node admits
//!   up to L holders and each grant needs Q of them, so the N·L places of the
//!   nodes fit up to ⌊N·L / Q⌋ grants, no two of them on one node more than L
//!   times: 4 holders for N = 3, L = 3 (two sidecars, 12 clients, no fault
//!   needed — `tests/redlock.rs`). A majority vote cannot tell that a
//!   permit's majority overlaps others' only in places each node still had
//!   free. Unanimity (all N nodes must grant) would bound it at L, but then
//!   one node down stops every semaphore, which throws away the only reason
//!   to run Redlock, so it is not offered. `try_acquire` answers
//!   [`Error::Unsupported`] for `limit > 1` before anything is written, and
//!   the nodes refuse to go on with a semaphore whose active limit is above 1
//!   (one an older version created): use `redis://`, `zk://` or
//!   `postgres://` for semaphores. `limit = 1` stays allowed: ⌊N / Q⌋ = 1, it
//!   is an exclusive lock.
//!
//! Fences: each node counts its own; a grant takes the highest count of its
//! majority and raises the other granting nodes' counters to it, so any later
//! majority (which shares a node with this one) continues above it — as long
//! as no node loses its data. A node restarted without persistence can break
//! that, as it can break Redlock's exclusion itself: use persistence with
//! fsync, or delayed restarts, or prefer ZooKeeper or PostgreSQL where
//! correctness matters (see the README).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use futures::future::join_all;
use futures::stream::FuturesUnordered;
use rand::RngExt;
use tokio_util::sync::CancellationToken;

use super::redact;
use super::redis::{CALL_TIMEOUT, Member, Node, Numbering, Step, Watchers, watch};
use super::unanswered::release_unanswered;
use super::url::Parts;
use super::{
    Attempt, Backend, Busy, Cause, Description, Error, Grant, Holder, Loss, Options, Outage,
    Safety, StaleKey, State, Status, Summary, Ticket, Turn, Watch,
};
use crate::clock::drift_ms as drift;
use crate::clock::{ms, now_ms};
use crate::lock::{Claim, Kind, LockKey, Token};
use crate::wakeups::Wakeups;

/// The Redlock backend.
pub struct Redlock {
    members: Vec<Arc<Member>>,
    /// Nodes that must agree: N/2 + 1.
    quorum: usize,
    watchers: Watchers,
    url: String,
    legacy_pattern: Option<String>,
    /// This sidecar's tickets: local number → each node's ticket number.
    tickets: Mutex<NodeTickets>,
    next_seq: AtomicU64,
    /// Admits [`ATTEMPTS_IN_FLIGHT`] acquire attempts at a time.
    attempts: tokio::sync::Semaphore,
    stop: CancellationToken,
}

/// Acquire attempts sent to the nodes at once. A node answers one script at
/// a time, so a burst of attempts (10,000 waiters arriving together) waits
/// somewhere: in the node connections' queues, where the later attempts
/// outlast the per-node time limit and fail (and the queued requests and
/// the buffers that grow to hold them take memory), or here, before an
/// attempt's clock starts. An attempt ends within its per-node time limit
/// plus the clean-up calls' own timeouts, so an outage cannot hold these
/// places for long.
const ATTEMPTS_IN_FLIGHT: usize = 128;

/// The most permits a Redlock semaphore may have: a majority quorum bounds
/// one holder, not more (see the module doc).
const MAX_PERMITS: u32 = 1;

/// The shortest lease a Redlock attempt can grant: one no longer than its
/// clock-drift allowance (1% + 2 ms) and the nodes' answer never has
/// validity left, and its claim would be granted and undone until its
/// wait ran out.
const MIN_SPAN: Duration = Duration::from_millis(10);

/// The refusal of a semaphore with more than [`MAX_PERMITS`] permits:
/// why, and what to use instead.
fn unsupported_semaphore(nodes: usize, limit: Option<u32>) -> Error {
    let asked = limit.map_or_else(
        || "this semaphore is in use with more than 1 permit".to_owned(),
        |l| format!("limit={l} is refused"),
    );
    Error::Unsupported(format!(
        "{asked}: the redlock backend cannot bound a semaphore with more than 1 permit, because a \
         majority quorum cannot (each of the {nodes} nodes admits `limit` holders and each grant \
         needs only a majority, so more than `limit` clients can hold permits at once); use a \
         redis://, zk:// or postgres:// backend for semaphores, or limit=1 (an exclusive lock)"
    ))
}

/// The nodes whose answers an attempt gave up (timed out, connection
/// lost, garbled: [`Error::sent_may_have_run`]): they may run its script
/// after all, or ran it, and grant its token, a lease
/// nobody would hold until its ttl — a majority of them a whole lock. When
/// dropped, it releases the token on each of them in the background (see
/// [`release_unanswered`]), unless the attempt won with that token: then
/// such a grant is part of the winner's lease.
struct LateGrants {
    members: Vec<Arc<Member>>,
    key: LockKey,
    token: Token,
    /// How long a late grant could last.
    span: Duration,
    stop: CancellationToken,
}

impl Drop for LateGrants {
    fn drop(&mut self) {
        let now = tokio::time::Instant::now();
        for member in self.members.drain(..) {
            let (key, token, stop) = (self.key.clone(), self.token.clone(), self.stop.clone());
            let until = now + self.span;
            tokio::spawn(async move {
                let release = || member.release_lost(&key, &token);
                release_unanswered(key.clone(), release, CALL_TIMEOUT, now, until, stop).await;
            });
        }
    }
}

/// A local ticket (key, number) → that ticket's number on each node, if it has one.
type NodeTickets = HashMap<(LockKey, u64), Vec<Option<u64>>>;

/// What one node answered, within its time limit.
type Answer<T> = Result<T, Error>;

fn timed_out(op: &'static str) -> Error {
    Error::Unavailable {
        op,
        source: Outage::boxed(Cause::TimedOut, "node did not answer in time"),
    }
}

impl Redlock {
    /// Opens one node per host of `url`.
    ///
    /// # Errors
    /// A sentence naming what is wrong with the URL.
    pub fn open(url: &str, options: &Options, wakeups: Wakeups) -> Result<Self, String> {
        let parts = Parts::parse(url)?;
        let (scheme, hosts, path) = (parts.scheme, parts.hosts_with_userinfo(), parts.path);
        let query = if parts.query.is_empty() {
            String::new()
        } else {
            format!("?{}", parts.query)
        };
        let base = if scheme == "redlocks" {
            "rediss"
        } else {
            "redis"
        };
        let watchers = Watchers::default();
        let stop = CancellationToken::new();
        let members = hosts
            .iter()
            .map(|h| {
                let node = Node::open(
                    &format!("{base}://{h}/{path}{query}"),
                    &options.redis_prefix,
                    false,
                    stop.clone(),
                )?;
                Ok(Member::start(
                    node,
                    &watchers,
                    &wakeups,
                    &stop,
                    Numbering::PerNode,
                ))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Self {
            quorum: members.len() / 2 + 1,
            members,
            watchers,
            url: redact(url),
            legacy_pattern: options.legacy_pattern.clone(),
            tickets: Mutex::new(HashMap::new()),
            next_seq: AtomicU64::new(1),
            attempts: tokio::sync::Semaphore::new(ATTEMPTS_IN_FLIGHT),
            stop,
        })
    }

    /// Runs `f` on every node in parallel, each within `limit`.
    async fn all<'a, T, F, Fut>(&'a self, op: &'static str, limit: Duration, f: F) -> Vec<Answer<T>>
    where
        F: Fn(&'a Arc<Member>, usize) -> Fut,
        Fut: Future<Output = Result<T, Error>> + 'a,
    {
        join_all(self.members.iter().enumerate().map(|(i, m)| {
            let fut = f(m, i);
            async move {
                crate::clock::within(limit, fut)
                    .await
                    .unwrap_or_else(|_| Err(timed_out(op)))
            }
        }))
        .await
    }

    /// As [`all`](Self::all), but answers as soon as `decided` holds of
    /// the answers in so far: a node that hangs then costs nothing while a
    /// majority answers (a renewal waiting for it could run past a short
    /// lease's margin). The calls still running go on behind, each within
    /// `limit`, so that a renewal or release still lands there; here they
    /// read as timed out.
    async fn all_until<T, F, Fut>(
        &self,
        op: &'static str,
        limit: Duration,
        f: F,
        decided: impl Fn(&[Option<Answer<T>>]) -> bool,
    ) -> Vec<Answer<T>>
    where
        F: Fn(Arc<Member>) -> Fut,
        Fut: Future<Output = Result<T, Error>> + Send + 'static,
        T: Send + 'static,
    {
        let mut calls: FuturesUnordered<_> = self
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let call = tokio::spawn(crate::clock::within(limit, f(m.clone())));
                async move { (i, call.await) }
            })
            .collect();
        let mut answers: Vec<Option<Answer<T>>> = self.members.iter().map(|_| None).collect();
        while let Some((i, answer)) = calls.next().await {
            answers[i] = Some(match answer {
                Ok(Ok(answer)) => answer,
                // Out of time, or the call panicked.
                _ => Err(timed_out(op)),
            });
            if decided(&answers) {
                break;
            }
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(timed_out(op))))
            .collect()
    }

    fn node_tickets(&self, ticket: &Ticket) -> Vec<Option<u64>> {
        self.lock_tickets()
            .get(&(ticket.key.clone(), ticket.seq))
            .cloned()
            .unwrap_or_else(|| vec![None; self.members.len()])
    }

    fn lock_tickets(&self) -> std::sync::MutexGuard<'_, NodeTickets> {
        self.tickets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives back a failed attempt's grants (spec: release on every node).
    async fn undo(&self, key: &LockKey, grants: &[(usize, Grant)]) {
        let undo = grants
            .iter()
            .map(|(i, g)| self.members[*i].node.release(key, &g.token));
        join_all(undo).await;
    }

    /// The places `seqs` (per node) of a claim whose attempt failed: a
    /// queued claim's are kept with its ticket, so that its waiter leaves
    /// them when it goes; a joining claim gets no ticket back, and leaves
    /// them now (a place nobody holds would block try-once claims there,
    /// and its heartbeat would keep it for as long as this sidecar runs).
    async fn keep_places(&self, key: &LockKey, turn: Turn<'_>, seqs: &[Option<u64>]) {
        match turn {
            Turn::Queued(t) => {
                self.lock_tickets()
                    .insert((t.key.clone(), t.seq), seqs.to_vec());
            }
            Turn::Join | Turn::Once => {
                let leave = seqs
                    .iter()
                    .enumerate()
                    .filter_map(|(i, s)| s.map(|s| self.members[i].dequeue(key, s)));
                join_all(leave).await;
            }
        }
    }

    /// Unavailable unless a majority of nodes answered.
    fn need_quorum<T>(&self, op: &'static str, answers: &[Answer<T>]) -> Result<(), Error> {
        if answers.iter().filter(|a| a.is_ok()).count() >= self.quorum {
            return Ok(());
        }
        if let Some((key, found)) = answers.iter().find_map(|a| match a {
            Err(Error::KeyConflict { key, found }) => Some((key, found)),
            _ => None,
        }) {
            return Err(Error::KeyConflict {
                key: key.clone(),
                found: found.clone(),
            });
        }
        Err(self.outage(op, answers.iter().filter_map(|a| a.as_ref().err())))
    }

    /// The outage when fewer than a majority answered, from the nodes'
    /// `errors`: a refusal an operator must fix (permissions, credentials)
    /// is named before an outage that passes by itself, whichever node
    /// comes first.
    fn outage<'a>(&self, op: &'static str, errors: impl Iterator<Item = &'a Error>) -> Error {
        self.missed(op, "answered", errors)
    }

    /// As [`outage`](Self::outage), for fewer than a majority that `did`
    /// what it takes ("answered", "counted the grant's fence").
    fn missed<'a>(
        &self,
        op: &'static str,
        did: &str,
        errors: impl Iterator<Item = &'a Error>,
    ) -> Error {
        errors
            .filter_map(|e| match e {
                Error::Unavailable { op, source } => Some((op, source, Cause::of(source.as_ref()))),
                _ => None,
            })
            .min_by_key(|(_, _, cause)| !cause.is_refusal())
            .map_or_else(
                || timed_out(op),
                |(op, source, cause)| Error::Unavailable {
                    op,
                    source: Outage::boxed(
                        cause,
                        format!(
                            "fewer than {} of {} nodes {did}: {source}",
                            self.quorum,
                            self.members.len()
                        ),
                    ),
                },
            )
    }
}

#[async_trait]
impl Backend for Redlock {
    fn describe(&self) -> Description {
        Description {
            kind: super::BackendKind::Redlock,
            url: self.url.clone(),
            safety: Safety::Efficiency,
        }
    }

    async fn ping(&self) -> Result<(), Error> {
        let answers = self
            .all("ping", Duration::from_secs(1), |m, _| m.node.ping())
            .await;
        self.need_quorum("ping", &answers)
    }

    async fn try_acquire(&self, claim: &Claim, turn: Turn<'_>) -> Result<Attempt, Error> {
        if claim.key.kind == Kind::Semaphore && claim.limit.is_some_and(|l| l > MAX_PERMITS) {
            return Err(unsupported_semaphore(self.members.len(), claim.limit));
        }
        // The nodes' lease runs `max_hold` when that is shorter than the ttl.
        let span = claim.max_hold.map_or(claim.ttl, |m| m.min(claim.ttl));
        if span < MIN_SPAN {
            return Err(Error::Unsupported(format!(
                "a lease of {} ms is too short for the redlock backend: its ttl (and max_hold) \
                 must be at least {} ms, as every grant subtracts a clock-drift allowance of 1% \
                 + 2 ms and the time the nodes take to answer",
                ms(span),
                ms(MIN_SPAN)
            )));
        }
        // A queued semaphore claim without a limit joined a semaphore in
        // use, whose limit is 1 (the only one allowed here): it claims
        // that. A node whose grant to it was undone after a split vote, or
        // that never queued it, would otherwise find the semaphore idle
        // and the claim without a limit, and refuse it (400, or 503 once
        // fewer than a majority answered).
        let adopted;
        let claim = match turn {
            Turn::Queued(_) if claim.key.kind == Kind::Semaphore && claim.limit.is_none() => {
                adopted = Claim {
                    limit: Some(MAX_PERMITS),
                    ..claim.clone()
                };
                &adopted
            }
            _ => claim,
        };
        // Never closed.
        let _admitted = self.attempts.acquire().await;
        let token = Token::generate();
        let started = Instant::now();
        let start_ms = now_ms();
        // From the nodes' lease, which `max_hold` may make shorter than
        // the ttl: a hanging node's wait must leave it validity.
        let limit = (span / 10).clamp(Duration::from_millis(20), Duration::from_millis(500));
        let queued = match turn {
            Turn::Queued(t) => Some(self.node_tickets(t)),
            _ => None,
        };
        let answers = self
            .all("try_acquire", limit, |m, i| {
                let step = match (turn, &queued) {
                    (Turn::Once, _) => Step::Once,
                    (Turn::Join, _) => Step::Join,
                    (Turn::Queued(_), Some(seqs)) => seqs[i].map_or(Step::Join, Step::Queued),
                    (Turn::Queued(_), None) => Step::Join,
                };
                let token = &token;
                async move {
                    m.try_acquire(claim, step, token, false, MAX_PERMITS, false)
                        .await
                }
            })
            .await;

        let mut grants: Vec<(usize, Grant)> = Vec::new();
        let mut busy: Vec<(usize, Busy)> = Vec::new();
        let mut answered = 0;
        // A refusal ends the attempt, but only once every answer is in: a
        // node later in the list may have granted, or queued the claim.
        let mut refused = None;
        // Nodes that found the semaphore idle and the claim without a
        // limit: they did nothing, and refuse the claim only when no node
        // granted or queued it (a node it never queued on sees the
        // semaphore idle once its holder left, while the others queue it).
        let mut unlimited = 0;
        let mut failed = Vec::new();
        let mut late = LateGrants {
            members: Vec::new(),
            key: claim.key.clone(),
            token: token.clone(),
            span,
            stop: self.stop.clone(),
        };
        for (i, a) in answers.into_iter().enumerate() {
            match a {
                Ok(Attempt::Granted(g)) => {
                    answered += 1;
                    grants.push((i, g));
                }
                Ok(Attempt::Busy(b)) => {
                    answered += 1;
                    busy.push((i, b));
                }
                Err(Error::Unsupported(_)) => {
                    refused.get_or_insert(unsupported_semaphore(self.members.len(), None));
                }
                Err(Error::LimitRequired) => unlimited += 1,
                Err(e @ (Error::LimitMismatch { .. } | Error::KeyConflict { .. })) => {
                    refused.get_or_insert(e);
                }
                Err(e) => {
                    if e.sent_may_have_run() {
                        late.members.push(self.members[i].clone());
                    }
                    failed.push(e);
                }
            }
        }
        // The claim's place on each node: where it queued before, and where
        // this attempt queued it.
        let mut seqs = queued
            .clone()
            .unwrap_or_else(|| vec![None; self.members.len()]);
        for (i, b) in &busy {
            if let Some(nt) = &b.ticket {
                seqs[*i] = Some(nt.seq);
            }
        }
        if unlimited > 0 {
            if grants.is_empty() && busy.is_empty() {
                refused.get_or_insert(Error::LimitRequired);
            } else {
                failed.extend((0..unlimited).map(|_| Error::LimitRequired));
            }
        }
        if let Some(refused) = refused {
            self.undo(&claim.key, &grants).await;
            self.keep_places(&claim.key, turn, &seqs).await;
            return Err(refused);
        }

        // The token a majority granted: ours, or a re-entered lease's.
        let mut votes: HashMap<&str, usize> = HashMap::new();
        for (_, g) in &grants {
            *votes.entry(g.token.expose()).or_default() += 1;
        }
        let winner = votes
            .iter()
            .find(|(_, n)| **n >= self.quorum)
            .map(|(t, _)| (*t).to_owned());
        let validity = || ms(span).saturating_sub(ms(started.elapsed()) + drift(span));
        // Left for a grant with no validity left after its fence raises
        // (or a re-entered lease ending before that, at its first grant's
        // `max_hold`): undone, as a split vote is.
        'won: {
            let Some(winner) = winner.filter(|_| validity() > 0) else {
                break 'won;
            };
            let won: Vec<&(usize, Grant)> = grants
                .iter()
                .filter(|(_, g)| g.token.expose() == winner)
                .collect();
            let fence = won.iter().map(|(_, g)| g.fence).max().unwrap_or(0);
            let count = majority_count(won.iter().map(|(_, g)| g.count), self.quorum);
            // Within the lease's validity: a raise that lands later still
            // only raises a counter.
            let left = Duration::from_millis(validity());
            let behind = won.iter().filter(|(_, g)| g.fence < fence).map(|(i, g)| {
                let raise = self.members[*i]
                    .node
                    .raise_fence(&claim.key, fence, &g.token);
                async move {
                    crate::clock::within(left, raise)
                        .await
                        .unwrap_or_else(|_| Err(timed_out("raise_fence")))
                }
            });
            let raises = join_all(behind).await;
            let raised = raises.iter().filter(|r| r.is_ok()).count();
            // Any later majority continues above this fence only if a
            // majority counts it: one that shares no node with them could
            // grant below it.
            let counting = won.iter().filter(|(_, g)| g.fence == fence).count() + raised;
            if counting < self.quorum {
                self.undo(&claim.key, &grants).await;
                self.keep_places(&claim.key, turn, &seqs).await;
                // Named by the raises that failed, before the nodes that
                // did not answer the attempt.
                let raise_failed = raises.iter().filter_map(|r| r.as_ref().err());
                return Err(self.missed(
                    "try_acquire",
                    "counted the grant's fence",
                    raise_failed.chain(&failed),
                ));
            }
            // The lease as the nodes keep it: a re-entered one ends at its
            // first grant's `max_hold`, maybe before this claim's span.
            let node_expiry = won.iter().map(|(_, g)| g.expires_at_ms).min().unwrap_or(0);
            // That end less the drift allowance over the lease's run from
            // this attempt, as a renewal reckons it.
            let node_end = node_expiry.saturating_sub(drift(Duration::from_millis(
                node_expiry.saturating_sub(start_ms),
            )));
            let left = || validity().min(node_end.saturating_sub(now_ms()));
            if left() == 0 {
                break 'won;
            }
            // Nodes that did not grant still show our waiter: take it away.
            // A hanging node may not hold the answer back for longer than
            // an attempt's time limit for a node, nor for more than half the
            // grant's validity: its call goes on after.
            if let Turn::Queued(t) = turn {
                self.lock_tickets().remove(&(t.key.clone(), t.seq));
            }
            let stale: Vec<(Arc<Member>, u64)> = seqs
                .iter()
                .enumerate()
                .filter_map(|(i, s)| {
                    s.filter(|_| !won.iter().any(|(w, _)| *w == i))
                        .map(|s| (self.members[i].clone(), s))
                })
                .collect();
            // Nodes that granted another token — this attempt's, where the
            // winner is a re-entered lease the others kept — give it back,
            // as after a split vote: nobody holds it, and the owner's next
            // re-entries would keep it there.
            let other: Vec<(Arc<Member>, Token)> = grants
                .iter()
                .filter(|(_, g)| g.token.expose() != winner)
                .map(|(i, g)| (self.members[*i].clone(), g.token.clone()))
                .collect();
            if !stale.is_empty() || !other.is_empty() {
                let (key, stop) = (claim.key.clone(), self.stop.clone());
                let leaving = tokio::spawn(async move {
                    let leave = join_all(stale.iter().map(|(m, s)| m.dequeue(&key, *s)));
                    let give_back = join_all(other.iter().map(|(m, t)| m.node.release(&key, t)));
                    tokio::select! {
                        _ = futures::future::join(leave, give_back) => {}
                        () = stop.cancelled() => {}
                    }
                });
                let wait = limit.min(Duration::from_millis(left() / 2));
                let _ = tokio::time::timeout(wait, leaving).await;
            }
            if winner == token.expose() {
                late.members.clear();
            }
            let since_ms = won
                .iter()
                .map(|(_, g)| g.since_ms)
                .min()
                .unwrap_or(start_ms);
            return Ok(Attempt::Granted(Grant {
                token: Token::from_client(winner),
                fence,
                count,
                since_ms,
                expires_at_ms: node_end.min(
                    start_ms
                        .saturating_add(ms(span))
                        .saturating_sub(drift(span)),
                ),
            }));
        }

        self.undo(&claim.key, &grants).await;
        if answered < self.quorum {
            self.keep_places(&claim.key, turn, &seqs).await;
            return Err(self.outage("try_acquire", failed.iter()));
        }
        // A split vote: some nodes granted and no majority is busy. (When a
        // majority is, a node that granted lost the holder's key, and waiting
        // for the holder is right.)
        let split = !grants.is_empty() && busy.len() < self.quorum;
        let mut ticket = None;
        if matches!(turn, Turn::Join) {
            let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            self.lock_tickets().insert((claim.key.clone(), seq), seqs);
            ticket = Some(Ticket {
                key: claim.key.clone(),
                seq,
            });
        } else if let Turn::Queued(t) = turn {
            self.lock_tickets().insert((t.key.clone(), t.seq), seqs);
        }
        let shown = busy
            .iter()
            .max_by_key(|(_, b)| b.queue_length)
            .map(|(_, b)| b.clone())
            .unwrap_or_default();
        // After a split vote every contender retries after a random delay;
        // otherwise at the earliest moment a blocking lease can lapse.
        let retry_at_ms = if split {
            Some(now_ms() + rand::rng().random_range(5..50))
        } else {
            busy.iter().filter_map(|(_, b)| b.retry_at_ms).min()
        };
        Ok(Attempt::Busy(Busy {
            holders: shown.holders,
            omitted: 0,
            queue_length: shown.queue_length,
            position: None,
            retry_at_ms,
            ticket,
        }))
    }

    async fn dequeue(&self, ticket: &Ticket) -> Result<(), Error> {
        let Some(seqs) = self
            .lock_tickets()
            .remove(&(ticket.key.clone(), ticket.seq))
        else {
            return Ok(());
        };
        let leave = seqs
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.map(|s| self.members[i].dequeue(&ticket.key, s)));
        join_all(leave).await;
        Ok(())
    }

    async fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, Error> {
        let started = now_ms();
        let (n, quorum) = (self.members.len(), self.quorum);
        let answers = self
            .all_until(
                "renew",
                Duration::from_millis(500),
                |m| {
                    let (key, token) = (key.clone(), token.clone());
                    async move { m.node.renew(&key, &token, ttl).await }
                },
                // A majority holds it, or no majority can.
                |answers| {
                    let held = answers
                        .iter()
                        .filter(|a| matches!(a, Some(Ok(Some(_)))))
                        .count();
                    let gone = answers
                        .iter()
                        .filter(|a| matches!(a, Some(Ok(None))))
                        .count();
                    held >= quorum || gone > n - quorum
                },
            )
            .await;
        let mut held: Vec<u64> = answers
            .iter()
            .filter_map(|a| a.as_ref().ok().copied().flatten())
            .collect();
        let gone = answers.iter().filter(|a| matches!(a, Ok(None))).count();
        if held.len() >= self.quorum {
            // The time until which a majority holds it, less the drift.
            held.sort_unstable_by(|a, b| b.cmp(a));
            let until = held[self.quorum - 1];
            let lease_ttl = Duration::from_millis(until.saturating_sub(started));
            return Ok(Some(until.saturating_sub(drift(lease_ttl))));
        }
        if gone > self.members.len() - self.quorum {
            // A majority no longer has it: the lease is lost; clean up the rest.
            join_all(self.members.iter().map(|m| m.node.release(key, token))).await;
            return Ok(None);
        }
        Err(self.outage("renew", answers.iter().filter_map(|a| a.as_ref().err())))
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, Error> {
        let quorum = self.quorum;
        let answers = self
            .all_until(
                "release",
                Duration::from_millis(500),
                |m| {
                    let (key, token) = (key.clone(), token.clone());
                    async move { m.node.release(&key, &token).await }
                },
                |answers| release_decided(answers, quorum),
            )
            .await;
        if answers.iter().filter(|a| a.is_ok()).count() < self.quorum {
            let outage = self.outage("release", answers.iter().filter_map(|a| a.as_ref().err()));
            return Err(if ran_anywhere(&answers) {
                outage.unanswered()
            } else {
                outage
            });
        }
        Ok(majority_holds(&answers, self.quorum))
    }

    async fn status(&self, key: &LockKey, token: &Token) -> Result<Status, Error> {
        let (n, quorum) = (self.members.len(), self.quorum);
        let answers = self
            .all_until(
                "status",
                Duration::from_millis(500),
                |m| {
                    let (key, token) = (key.clone(), token.clone());
                    async move { m.node.status(&key, &token).await }
                },
                // A majority holds it, or a majority says it is gone and
                // the nodes left cannot change whether a majority says it
                // was force-released.
                |answers| {
                    let (mut held, mut gone, mut forced) = (0, 0, 0);
                    for a in answers.iter().flatten() {
                        match a {
                            Ok(Status::Held { .. }) => held += 1,
                            Ok(Status::Gone(loss)) => {
                                gone += 1;
                                forced += usize::from(*loss == Loss::ForceReleased);
                            }
                            Err(_) => {}
                        }
                    }
                    held >= quorum
                        || (gone >= quorum && (forced >= quorum || gone - forced > n - quorum))
                },
            )
            .await;
        let mut held: Vec<u64> = answers
            .iter()
            .filter_map(|a| match a {
                Ok(Status::Held { expires_at_ms }) => Some(*expires_at_ms),
                _ => None,
            })
            .collect();
        if held.len() >= self.quorum {
            held.sort_unstable_by(|a, b| b.cmp(a));
            return Ok(Status::Held {
                expires_at_ms: held[self.quorum - 1],
            });
        }
        // Gone on a quorum, not merely too few holding: with one node
        // silent and another restarted empty, a lease held on a quorum
        // would read as gone (and the sidecar, asking about its leases at
        // its `--max-held` cap, would end a valid one). A force-release
        // says why only when a quorum noted it (one that reached a
        // minority did not end the lease).
        let losses: Vec<Loss> = answers
            .iter()
            .filter_map(|a| match a {
                Ok(Status::Gone(loss)) => Some(*loss),
                _ => None,
            })
            .collect();
        if losses.len() < self.quorum {
            return Err(self.outage("status", answers.iter().filter_map(|a| a.as_ref().err())));
        }
        let forced = losses.iter().filter(|&&l| l == Loss::ForceReleased).count();
        Ok(Status::Gone(if forced >= self.quorum {
            Loss::ForceReleased
        } else {
            match losses[0] {
                Loss::ForceReleased => Loss::Expired,
                loss => loss,
            }
        }))
    }

    async fn inspect(&self, key: &LockKey) -> Result<State, Error> {
        let quorum = self.quorum;
        // Every node's answer within 1 s (the waiters shown are the most
        // any node has); past that, answered once those in decide every
        // holder, within a call's time limit: a node still to answer could
        // make one seen on a minority a majority's (a slow node of its
        // majority showed a lock held as free).
        let mut calls: FuturesUnordered<_> = self
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| async move {
                let answer = crate::clock::within(CALL_TIMEOUT, m.node.inspect(key)).await;
                (i, answer.unwrap_or_else(|_| Err(timed_out("inspect"))))
            })
            .collect();
        let mut answers: Vec<Option<Answer<State>>> = self.members.iter().map(|_| None).collect();
        let everyone = tokio::time::sleep(Duration::from_secs(1));
        tokio::pin!(everyone);
        let mut waited = false;
        loop {
            tokio::select! {
                next = calls.next() => match next {
                    Some((i, answer)) => answers[i] = Some(answer),
                    None => break,
                },
                () = &mut everyone, if !waited => waited = true,
            }
            if waited && inspect_decided(&answers, quorum) {
                break;
            }
        }
        let answers: Vec<Answer<State>> = answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(timed_out("inspect"))))
            .collect();
        self.need_quorum("inspect", &answers)?;
        let states: Vec<State> = answers.into_iter().filter_map(Result::ok).collect();
        // A holder is real when a majority of nodes has it.
        // Its hold count is the one a majority has (a release that reached
        // a quorum and not the rest leaves a minority a hold ahead).
        let mut seen: HashMap<HolderId, (Vec<u32>, Holder)> = HashMap::new();
        for h in states.iter().flat_map(|s| &s.holders) {
            let entry = seen
                .entry(holder_id(h))
                .or_insert_with(|| (Vec::new(), h.clone()));
            entry.0.push(h.count);
            entry.1.fence = entry.1.fence.max(h.fence);
            entry.1.since_ms = entry.1.since_ms.min(h.since_ms);
        }
        let mut holders: Vec<Holder> = seen
            .into_values()
            .filter(|(counts, _)| counts.len() >= quorum)
            .map(|(counts, mut h)| {
                h.count = kept_by_a_majority(counts.into_iter(), quorum);
                h
            })
            .collect();
        holders.sort_by_key(|h| h.since_ms);
        let waiters = states
            .iter()
            .max_by_key(|s| s.waiters.len())
            .map(|s| s.waiters.clone())
            .unwrap_or_default();
        Ok(State {
            fence: states.iter().map(|s| s.fence).max().unwrap_or(0),
            limit: states.iter().find_map(|s| s.limit),
            holders,
            waiters,
        })
    }

    async fn list(
        &self,
        prefix: &str,
        after: Option<&LockKey>,
        limit: usize,
    ) -> Result<Vec<Summary>, Error> {
        let answers = self
            .all("list", Duration::from_secs(5), |m, _| {
                m.node.list(prefix, after, limit)
            })
            .await;
        self.need_quorum("list", &answers)?;
        // In the nodes' order, that of the keys' names, which the cursor
        // (the last name shown) follows: by kind, a page would skip back
        // and forth between elections and locks.
        let mut merged: std::collections::BTreeMap<String, Summary> = Default::default();
        for row in answers.into_iter().filter_map(Result::ok).flatten() {
            let entry = merged
                .entry(row.key.to_string())
                .or_insert_with(|| row.clone());
            entry.holders = entry.holders.max(row.holders);
            entry.waiters = entry.waiters.max(row.waiters);
            entry.fence = entry.fence.max(row.fence);
        }
        Ok(merged.into_values().take(limit).collect())
    }

    async fn stale(&self, stale_after: Duration) -> Result<Vec<StaleKey>, Error> {
        let legacy = self.legacy_pattern.as_deref();
        let answers = self
            .all("stale", Duration::from_secs(10), |m, _| {
                m.node.stale(stale_after, legacy)
            })
            .await;
        self.need_quorum("stale", &answers)?;
        Ok(answers
            .into_iter()
            .enumerate()
            .filter_map(|(i, a)| a.ok().map(|found| (i, found)))
            .flat_map(|(i, found)| {
                let url = self.members[i].node.url.clone();
                found.into_iter().map(move |mut s| {
                    s.detail = format!("on {url}: {}", s.detail);
                    s
                })
            })
            .collect())
    }

    async fn force_release(&self, key: &LockKey) -> Result<Vec<Token>, Error> {
        let answers = self
            .all("force_release", Duration::from_secs(1), |m, _| {
                m.node.force_release(key)
            })
            .await;
        self.need_quorum("force_release", &answers)?;
        let mut tokens: Vec<Token> = answers
            .into_iter()
            .filter_map(Result::ok)
            .flatten()
            .collect();
        tokens.sort_by(|a, b| a.expose().cmp(b.expose()));
        tokens.dedup();
        Ok(tokens)
    }

    /// Published on every node; one that answers is enough, as every
    /// sidecar subscribes on every node.
    async fn announce(&self, key: &LockKey) -> Result<(), Error> {
        let results = join_all(self.members.iter().map(|m| m.node.announce(key))).await;
        let failed = results.iter().filter(|r| r.is_err()).count();
        match results.into_iter().find(Result::is_err) {
            Some(Err(e)) if failed == self.members.len() => Err(e),
            _ => Ok(()),
        }
    }

    async fn watch(&self, key: &LockKey) -> Result<Watch, Error> {
        watch(&self.members, &self.watchers, key, self.quorum).await
    }

    /// Up while a majority of the nodes' pub/sub connections are.
    fn connected(&self) -> Option<bool> {
        let up = self
            .members
            .iter()
            .filter(|m| m.connected.load(std::sync::atomic::Ordering::Relaxed))
            .count();
        Some(up >= self.quorum)
    }

    async fn close(&self) {
        self.stop.cancel();
    }
}

/// Who a holder on one node is, to count the nodes that have it: its
/// owner, sidecar and mode.
type HolderId = (String, String, crate::lock::Held);

fn holder_id(h: &Holder) -> HolderId {
    (h.owner.clone(), h.sidecar.clone(), h.mode)
}

/// Whether the inspect answers in so far (`None`: still to come) decide
/// every holder: each one seen is on a majority, or could not be with the
/// nodes still to answer; and a majority answered, or can no longer.
fn inspect_decided(answers: &[Option<Answer<State>>], quorum: usize) -> bool {
    let waiting = answers.iter().filter(|a| a.is_none()).count();
    let states: Vec<&State> = answers
        .iter()
        .filter_map(|a| a.as_ref().and_then(|a| a.as_ref().ok()))
        .collect();
    if states.len() < quorum {
        return states.len() + waiting < quorum;
    }
    let mut seen: HashMap<HolderId, usize> = HashMap::new();
    for h in states.iter().flat_map(|s| &s.holders) {
        *seen.entry(holder_id(h)).or_default() += 1;
    }
    seen.values().all(|&n| n >= quorum || n + waiting < quorum)
}

/// The holds a majority of the granting nodes keeps: a re-entry answers
/// that, not the most any node keeps (a node one hold ahead, after a
/// re-entry whose answer was lost, told the owner of a hold the majority
/// does not have, which its releases then could not match).
fn majority_count(counts: impl Iterator<Item = u32>, quorum: usize) -> u32 {
    kept_by_a_majority(counts, quorum).max(1)
}

/// The largest number that at least `quorum` of `counts` reach (0 when
/// there are fewer).
fn kept_by_a_majority(counts: impl Iterator<Item = u32>, quorum: usize) -> u32 {
    let mut counts: Vec<u32> = counts.collect();
    counts.sort_unstable_by(|x, y| y.cmp(x));
    counts.get(quorum.saturating_sub(1)).copied().unwrap_or(0)
}

/// What a release answered by at least a quorum of nodes leaves the
/// owner: `None` when a quorum held nothing of the token (the lease was
/// gone before it), else the holds a majority of the nodes still keeps (a
/// node that holds nothing counts as keeping none: never tell an owner it
/// holds what a majority let go). Nodes differ when an attempt's answer
/// was lost after a node counted it (a failed re-entry leaves that node
/// one hold ahead) or a node lost its data. When that number depends on a
/// node that did not answer, the lease is lost (`None`): counted as keeping
/// none, that node made an owner of three holds, releasing one, hear that
/// the lock was let go while the nodes that answered still kept two (a
/// node restarted empty, another down); and a 503 would have the owner
/// send the release again, on nodes that ran it already.
fn majority_holds(answers: &[Answer<Option<u32>>], quorum: usize) -> Option<u32> {
    if answers.iter().filter(|a| matches!(a, Ok(None))).count() >= quorum {
        return None;
    }
    // The holds a majority keeps with every silent node keeping none, and
    // with every silent node keeping as many as any: equal unless a silent
    // node decides it.
    let kept = |silent: u32| {
        let holds = answers.iter().map(|a| match a {
            Ok(held) => held.unwrap_or(0),
            Err(_) => silent,
        });
        kept_by_a_majority(holds, quorum)
    };
    let least = kept(0);
    (kept(u32::MAX) == least).then_some(least)
}

/// Whether a release that fewer than a quorum answered may have run
/// anywhere: on the nodes that answered it, and on those whose answers
/// came late or were lost. Sent again, it would run a second time there —
/// harmless on a minority once, but every failed resend is sent again, so
/// minorities add up (one node runs one, another the next: two of three a
/// hold short), and with an even number of nodes half of them running it
/// twice is already too many. The nodes that refused it (an error answer,
/// no connection) did not run it: a release only they refused is sent
/// again.
fn ran_anywhere<T>(answers: &[Answer<T>]) -> bool {
    answers.iter().any(|a| match a {
        Ok(_) => true,
        Err(e) => e.may_have_run() || e.sent_may_have_run(),
    })
}

/// Whether the release answers in so far decide [`majority_holds`]
/// whatever the nodes still silent say.
fn release_decided(answers: &[Option<Answer<Option<u32>>>], quorum: usize) -> bool {
    let answered = answers.iter().filter(|a| matches!(a, Some(Ok(_)))).count();
    if answered < quorum {
        return false;
    }
    let gone = answers
        .iter()
        .filter(|a| matches!(a, Some(Ok(None))))
        .count();
    if gone >= quorum {
        return true;
    }
    // The nodes still silent could make a majority that holds nothing of
    // the token: the lease was gone before the release (410).
    if gone + answers.iter().filter(|a| a.is_none()).count() >= quorum {
        return false;
    }
    let kept = |silent: u32| {
        let holds = answers.iter().map(|a| match a {
            Some(Ok(held)) => held.unwrap_or(0),
            _ => silent,
        });
        kept_by_a_majority(holds, quorum)
    };
    kept(0) == kept(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::{
        Answer, inspect_decided, majority_count, majority_holds, ran_anywhere, release_decided,
        timed_out,
    };
    use crate::backend::{Cause, Error, Holder, Outage, State};

    #[test]
    fn a_failed_release_may_have_run_wherever_a_node_ran_it_or_went_silent() {
        let refused = || {
            Err::<Option<u32>, _>(Error::Unavailable {
                op: "release",
                source: Outage::boxed(Cause::ConnectionRefused, "down"),
            })
        };
        let late = || Err::<Option<u32>, _>(timed_out("release"));
        // Ran on one node, refused by two: sent again, it may run there
        // again, and the next resend on another node (two of three a hold
        // short).
        assert!(ran_anywhere(&[Ok(Some(1)), refused(), refused()]));
        assert!(ran_anywhere(&[late(), refused(), refused()]));
        assert!(ran_anywhere(&[
            Ok(None),
            refused(),
            refused(),
            refused(),
            refused()
        ]));
        // Refused everywhere: it ran nowhere, and is still owed.
        assert!(!ran_anywhere(&[refused(), refused(), refused()]));
        // Failed once sent, otherwise than by a lost connection or a time
        // limit (a TLS alert mid-reply): it may have run there. It read as
        // refused, and was sent again.
        let garbled = || {
            let tls = std::io::Error::new(std::io::ErrorKind::InvalidData, "tls alert");
            Err::<Option<u32>, _>(Error::Unavailable {
                op: "release",
                source: Box::new(redis::RedisError::from(tls)),
            })
        };
        assert!(ran_anywhere(&[garbled(), refused(), refused()]));
        // The server's own error reply says it did not run.
        let loading = || {
            Err::<Option<u32>, _>(Error::Unavailable {
                op: "release",
                source: Box::new(redis::RedisError::from((
                    redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading),
                    "loading",
                ))),
            })
        };
        assert!(!ran_anywhere(&[loading(), refused(), refused()]));
    }

    #[test]
    fn a_release_answers_before_a_silent_node_only_when_it_cannot_change_the_count() {
        let held = |n| Some(Ok(Some(n)));
        assert!(release_decided(&[held(1), held(1), None], 2));
        assert!(release_decided(&[Some(Ok(None)), None, Some(Ok(None))], 2));
        // One node a hold ahead: the silent one decides between 1 and 2.
        assert!(!release_decided(&[held(2), held(1), None], 2));
        assert!(!release_decided(&[held(1), None, None], 2));
        // Gone on one node, the lease left on another: the silent third may
        // say gone too, and the release is then of a lease already lost.
        assert!(!release_decided(&[held(0), Some(Ok(None)), None], 2));
        assert!(!release_decided(
            &[Some(Ok(None)), held(0), held(0), None, None],
            3
        ));
        assert!(!release_decided(
            &[held(1), Some(Err(timed_out("release"))), None],
            2
        ));
    }

    /// Inspect waits for a node still out only while it could make a
    /// holder seen on a minority a majority's: for each holder of a shared
    /// lock apart, with three nodes and with five, a failed node counting
    /// as answered.
    #[test]
    fn inspect_waits_only_for_a_node_that_could_decide_a_holder() {
        let holder = |owner: &str| Holder {
            owner: owner.to_owned(),
            sidecar: "s".to_owned(),
            mode: crate::lock::Held::Shared,
            fence: 1,
            count: 1,
            since_ms: 0,
            expires_at_ms: 0,
        };
        let state = |owners: &[&str]| -> Option<Answer<State>> {
            Some(Ok(State {
                fence: 1,
                limit: None,
                holders: owners.iter().map(|o| holder(o)).collect(),
                waiters: Vec::new(),
            }))
        };
        let failed = || -> Option<Answer<State>> { Some(Err(timed_out("inspect"))) };
        // Three nodes: a and b on both that answered, c on one.
        assert!(inspect_decided(
            &[state(&["a", "b"]), state(&["a", "b"]), None],
            2
        ));
        assert!(!inspect_decided(
            &[state(&["a", "c"]), state(&["a"]), None],
            2
        ));
        assert!(inspect_decided(
            &[state(&["a", "c"]), state(&["a"]), failed()],
            2
        ));
        // Too few answers to decide yet, or ever.
        assert!(!inspect_decided(&[state(&["a"]), None, None], 2));
        assert!(inspect_decided(&[state(&["a"]), failed(), failed()], 2));
        // Five nodes, quorum 3: one on one of three answers, two still out.
        let five = [state(&["a", "x"]), state(&["a"]), state(&["a"]), None, None];
        assert!(!inspect_decided(&five, 3));
        let five = [
            state(&["a", "x"]),
            state(&["a"]),
            state(&["a"]),
            failed(),
            None,
        ];
        assert!(inspect_decided(&five, 3));
    }

    #[test]
    fn a_re_entry_reports_the_holds_a_majority_keeps() {
        assert_eq!(majority_count([2, 2, 2].into_iter(), 2), 2);
        // One node a hold ahead (a re-entry's lost answer).
        assert_eq!(majority_count([3, 2, 2].into_iter(), 2), 2);
        assert_eq!(majority_count([2, 3].into_iter(), 2), 2);
        assert_eq!(majority_count([4, 4, 3, 3, 3].into_iter(), 3), 3);
        assert_eq!(majority_count([1, 1].into_iter(), 2), 1);
    }

    #[test]
    fn a_release_reports_what_a_majority_keeps() {
        let gone = || Ok(None);
        let down = || Err(timed_out("release"));
        // Every node released one of two holds.
        assert_eq!(
            majority_holds(&[Ok(Some(1)), Ok(Some(1)), Ok(Some(1))], 2),
            Some(1)
        );
        assert_eq!(
            majority_holds(&[Ok(Some(1)), Ok(Some(1)), down()], 2),
            Some(1)
        );
        assert_eq!(majority_holds(&[Ok(Some(0)), gone(), down()], 2), Some(0));
        // One node a hold ahead (a failed re-entry's lost answer): the
        // majority let go.
        assert_eq!(
            majority_holds(&[Ok(Some(0)), Ok(Some(1)), gone()], 2),
            Some(0)
        );
        assert_eq!(
            majority_holds(&[Ok(Some(2)), Ok(Some(1)), Ok(Some(1))], 2),
            Some(1)
        );
        // Whether a majority let go depends on the node that did not
        // answer: lost. (An owner of three holds releasing one was told
        // the lock was let go.)
        assert_eq!(majority_holds(&[Ok(Some(2)), gone(), down()], 2), None);
        assert_eq!(majority_holds(&[Ok(Some(0)), Ok(Some(1)), down()], 2), None);
        assert_eq!(
            majority_holds(&[gone(), gone(), down(), Ok(Some(3)), Ok(Some(3))], 3),
            None
        );
        // Gone on a quorum before this release: lost.
        assert_eq!(majority_holds(&[gone(), gone(), Ok(Some(0))], 2), None);
        assert_eq!(
            majority_holds(&[gone(), gone(), gone(), Ok(Some(3)), Ok(Some(3))], 3),
            None
        );
    }
}
