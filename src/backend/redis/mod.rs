//! `redis://`, `rediss://`, `redis+sentinel://`, `redis+cluster://`: leases in Redis.
//!
//! Every operation is one Lua script (`redis/*.lua`), atomic on the node that
//! owns the lock's slot, given one key: the lock's main key. Each script runs
//! `lean.lua` and its fast path first, which serve the common cases with a
//! few commands, and only then the prelude's full bookkeeping. An exclusive
//! lease lives in the main key alone, `<prefix><name>`: its token first, then
//! its fence, since, hold count, ttl, max_hold, lock_delay, owner and sidecar,
//! with a PX expiry running to the lease's end plus its lock-delay — so
//! hand-written clients of the classic `SET key token NX PX ttl` protocol
//! and sidelock exclude each other. The fence and ticket counters, the queue
//! (a list of entries in queue order), the waiters' heartbeats and the
//! holders of shared locks and semaphores live in side keys tagged
//! `{<prefix><name>}`, which the scripts derive from the main key and a
//! Cluster keeps in its slot. No name reaches another name's keys (see
//! [`Node::base`]); a main key of another type or content, written by hand,
//! is a foreign holder, and the scripts check every side key's type before
//! the full path's first write, so a key written by hand never leaves half a
//! grant behind.
//!
//! Waiting never polls. A release hands an exclusive lock straight to the
//! next claim in line — the main key takes its lease in the release's own
//! step — and tells that claim's sidecar process on its own channel
//! (`<prefix>/sidecars/<instance>`, the instance random per process), which
//! every sidecar subscribes to at start; claims of processes that stopped
//! heartbeating, or that nobody listens for any more (a killed sidecar), are
//! passed by, and `p` on the lock's channel then has a live sidecar passed
//! by (its pub/sub connection was down) queue its claims again at their
//! places (`rejoin.lua`). A handoff for a claim this sidecar does not know
//! (its request gave up as it came) is given back after a grace, unless the
//! claim turns up (`give_back.lua`, by token and fence). Anything else
//! that may let a waiter in (a shared or semaphore release, an expiry
//! noticed, a force-release, a ticket leaving the head) is `PUBLISH`ed on
//! the lock's channel, `{<prefix><name>}:wake`, which each sidecar subscribes
//! once per contended lock, waking its local queue head (only the named one,
//! when the message names the next ticket: `h<seq>`). Waiters keep a timer
//! at the blocking lease's expiry for holders that die. Queued tickets carry
//! a heartbeat, refreshed for all of a sidecar's tickets on a lock by one
//! script call every [`HEARTBEAT_EVERY`], which also passes on a lock found
//! free while claims wait; tickets of a dead sidecar lapse and are pruned by
//! the next script that touches the lock. Redlock's nodes run the same
//! scripts, but their releases wake the next claim instead of handing it the
//! lock, as each node orders its queue its own way.
//!
//! # Layout
//!
//! Bottom layer first:
//!
//! * [`conn`]: one connection to a deployment, its time limits, the server
//!   clock as read here.
//! * [`scripts`]: the Lua scripts, their calls and reply decoding.
//! * [`tickets`]: this sidecar's queue tickets on a node.
//! * [`node`]: one logical Redis with sidelock's key layout (shared with Redlock).
//! * [`listing`]: the keys in use (by SCAN) and `/v1/stale`.
//! * [`pubsub`]: wake-ups and handoffs over pub/sub.
//! * [`leases`]: a node's lease operations.
//! * [`members`]: a node as a backend uses it, with its heartbeats and
//!   subscriptions.

mod conn;
mod leases;
mod listing;
mod members;
mod node;
mod pubsub;
mod scripts;
mod tickets;

pub use members::{Member, watch};
pub use node::{Node, Step};
pub use pubsub::Watchers;
pub use tickets::Numbering;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use crate::backend::unanswered::{Failed, release_unanswered};
use crate::backend::{
    Attempt, Backend, Cause, Description, Error, Options, Safety, StaleKey, State, Status, Summary,
    Ticket, Turn, Watch,
};
use crate::lock::{Claim, LockKey, Token};
use crate::wakeups::Wakeups;

/// How often this sidecar refreshes its waiters' heartbeats.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);
/// A waiter whose sidecar has not refreshed it for this long is dropped.
const HEARTBEAT_TTL: Duration = Duration::from_secs(15);
/// Connect and response timeout of every Redis call.
pub(super) const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a queued attempt whose connection broke waits before it runs
/// again: time for the connection to be made anew.
const RERUN_AFTER: Duration = Duration::from_millis(50);

/// Locks `m`, also after a thread panicked holding it (the state it guards
/// stays usable: every update is one step).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `redis://` family backend: one [`Member`].
pub struct Redis {
    member: Arc<Member>,
    legacy_pattern: Option<String>,
    watchers: Watchers,
    stop: CancellationToken,
}

impl Redis {
    /// Opens `url` (no network traffic yet: calls connect on first use, so
    /// the sidecar starts while Redis is down and reports not-ready).
    ///
    /// # Errors
    /// A sentence naming what is wrong with the URL or options.
    pub fn open(url: &str, options: &Options, wakeups: Wakeups) -> Result<Self, String> {
        let stop = CancellationToken::new();
        let node = Node::open(url, &options.redis_prefix, true, stop.clone())?;
        let watchers = Watchers::default();
        let member = Member::start(node, &watchers, &wakeups, &stop, Numbering::Shared);
        Ok(Self {
            member,
            legacy_pattern: options.legacy_pattern.clone(),
            watchers,
            stop,
        })
    }

    fn node(&self) -> &Node {
        &self.member.node
    }
}

#[async_trait]
impl Backend for Redis {
    fn describe(&self) -> Description {
        Description {
            kind: crate::backend::BackendKind::Redis,
            url: self.node().url.clone(),
            safety: Safety::Efficiency,
        }
    }

    async fn ping(&self) -> Result<(), Error> {
        self.node().ping().await
    }

    async fn try_acquire(&self, claim: &Claim, turn: Turn<'_>) -> Result<Attempt, Error> {
        let step = match turn {
            Turn::Once => Step::Once,
            Turn::Join => Step::Join,
            Turn::Queued(t) => Step::Queued(t.seq),
        };
        let token = Token::generate();
        let mut result = self
            .member
            .try_acquire(claim, step, &token, true, 0, false)
            .await;
        if matches!(step, Step::Queued(_))
            && result.as_ref().err().and_then(Error::cause) == Some(Cause::ConnectionLost)
            && !self.stop.is_cancelled()
        {
            // Run again, a queued attempt answers the grant its first run
            // may have made (acquire.lua); a waiter that may have long to
            // wait still is not failed by one broken connection (in a
            // Cluster, often another call's, which broke just before). When
            // the run again cannot tell what the first did (its claim would
            // re-enter its owner's lease, or is no longer queued: the first
            // may have re-entered it), the first failure stands.
            tokio::time::sleep(RERUN_AFTER).await;
            let again = self
                .member
                .try_acquire(claim, step, &token, true, 0, true)
                .await;
            if again.is_ok() {
                result = again;
            }
        }
        if matches!(step, Step::Once | Step::Join)
            && result.as_ref().is_err_and(Error::sent_may_have_run)
        {
            // The script may have granted the new token all the same (its
            // answer lost, late or garbled): nobody would hold that lease
            // until its ttl.
            let (member, key) = (self.member.clone(), claim.key.clone());
            let until = tokio::time::Instant::now() + claim.ttl;
            let lost = (key.clone(), token.clone());
            lock(&member.tickets).lost.insert(lost.clone(), false);
            let release = {
                let (member, lost) = (member.clone(), lost.clone());
                move || {
                    let (member, lost) = (member.clone(), lost.clone());
                    async move {
                        // Connected first: a failure after that may come
                        // after the release ran.
                        if member.node.connection("release").await.is_err() {
                            return Err(Failed::NotRun);
                        }
                        let released = member.release(&lost.0, &lost.1).await;
                        if !matches!(released, Ok(None)) {
                            // The lost grant's hold is taken (or may be).
                            lock(&member.tickets).lost.insert(lost, true);
                        }
                        released.map_err(|_| Failed::Unanswered)
                    }
                }
            };
            let stop = self.stop.clone();
            tokio::spawn(async move {
                release_unanswered(
                    lost.0.clone(),
                    release,
                    CALL_TIMEOUT,
                    tokio::time::Instant::now(),
                    until,
                    stop.clone(),
                )
                .await;
                // A hold taken: a give-back of a handoff to the lost join,
                // still to come, must not take another until the lease
                // would have ended anyway.
                if lock(&member.tickets).lost.get(&lost) == Some(&true) {
                    tokio::select! {
                        () = tokio::time::sleep_until(until) => {}
                        () = stop.cancelled() => {}
                    }
                }
                lock(&member.tickets).lost.remove(&lost);
            });
        }
        result
    }

    async fn dequeue(&self, ticket: &Ticket) -> Result<(), Error> {
        self.member.dequeue(&ticket.key, ticket.seq).await
    }

    async fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, Error> {
        self.node().renew(key, token, ttl).await
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, Error> {
        self.member.release(key, token).await
    }

    async fn status(&self, key: &LockKey, token: &Token) -> Result<Status, Error> {
        self.node().status(key, token).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<State, Error> {
        self.node().inspect(key).await
    }

    async fn list(
        &self,
        prefix: &str,
        after: Option<&LockKey>,
        limit: usize,
    ) -> Result<Vec<Summary>, Error> {
        self.node().list(prefix, after, limit).await
    }

    async fn stale(&self, stale_after: Duration) -> Result<Vec<StaleKey>, Error> {
        self.node()
            .stale(stale_after, self.legacy_pattern.as_deref())
            .await
    }

    async fn force_release(&self, key: &LockKey) -> Result<Vec<Token>, Error> {
        self.node().force_release(key).await
    }

    async fn announce(&self, key: &LockKey) -> Result<(), Error> {
        self.node().announce(key).await
    }

    async fn watch(&self, key: &LockKey) -> Result<Watch, Error> {
        watch(std::slice::from_ref(&self.member), &self.watchers, key, 1).await
    }

    fn connected(&self) -> Option<bool> {
        Some(
            self.member
                .connected
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    async fn close(&self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::Node;
    use super::scripts::SIDE_KEYS;
    use crate::lock::{Kind, LockKey, Name};

    /// Every key one lock or semaphore uses: its main key and side keys.
    fn keys_of(node: &Node, key: &LockKey) -> Vec<String> {
        let base = node.base(key);
        let mut keys = vec![base.clone()];
        keys.extend(SIDE_KEYS.iter().map(|s| format!("{{{base}}}:{s}")));
        keys
    }

    #[test]
    fn no_name_reaches_another_names_key_or_channel() {
        for prefix in ["sidelock:", "", "lock:"] {
            let node = Node::open(
                "redis://127.0.0.1:1",
                prefix,
                true,
                tokio_util::sync::CancellationToken::new(),
            )
            .expect("node");
            let mut owner: HashMap<String, LockKey> = HashMap::new();
            let mut channels: HashMap<String, LockKey> = HashMap::new();
            let names = [
                "index",
                "INDEX",
                "index:x",
                "semaphores",
                "semaphores:x",
                "elections",
                "wake",
                "wake:locks",
                "holders",
                "fence",
                "seq",
                "shared",
                "sidelock:index",
                ".",
                "..",
                "x",
            ];
            for kind in Kind::ALL {
                for name in names {
                    let key = LockKey {
                        kind,
                        name: Name::parse(name).expect("valid name"),
                    };
                    for k in keys_of(&node, &key) {
                        if let Some(other) = owner.insert(k.clone(), key.clone()) {
                            panic!("{key} and {other} share {k}");
                        }
                    }
                    let channel = node.channel(&key);
                    if let Some(other) = channels.insert(channel.clone(), key.clone()) {
                        panic!("{key} and {other} share the channel {channel}");
                    }
                }
            }
        }
    }

    /// The scripts judge a waiter's process alive by the same window the
    /// sidecar refreshes its heartbeat within.
    #[test]
    fn the_scripts_heartbeat_window_is_the_sidecars() {
        let line = super::scripts::LEAN
            .lines()
            .find_map(|l| l.strip_prefix("local HEARTBEAT_TTL = "))
            .expect("lean.lua defines HEARTBEAT_TTL");
        let lua: u128 = line.trim().parse().expect("a number of ms");
        assert_eq!(lua, super::HEARTBEAT_TTL.as_millis());
    }
}
