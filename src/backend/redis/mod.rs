//! `redis://`, `rediss://`, `redis+sentinel://`, `redis+cluster://`: leases in Redis.
//!
//! Every operation is one Lua script (`redis/*.lua`, sharing `prelude.lua`;
//! the uncontended acquire and release return before it, from `*_fast.lua`),
//! atomic on the node that owns the lock's slot. An exclusive lock is the
//! plain string key `<prefix><name>` holding the token with a PX expiry —
//! the classic `SET key token NX PX ttl` protocol — so hand-written clients
//! using that protocol and sidelock exclude each other. Holder metadata,
//! expiries, the fence counter and the queue live in side keys tagged
//! `{<prefix><name>}` so a Cluster keeps them in the main key's slot. No
//! name reaches a key sidelock keeps for itself (see [`Node::base`]); a main
//! key of another type than a string, written by hand, is a foreign holder,
//! and the acquire script checks every other key's type before its first
//! write, so a key written by hand never leaves half a grant behind.
//!
//! Waiting never polls: scripts `PUBLISH` on the lock's channel whenever a
//! waiter may get in, each sidecar subscribes once per contended lock on one
//! pub/sub connection and wakes its local queue head (only the named one,
//! when a release names the next ticket: `h<seq>`), and waiters keep a
//! timer at the blocking lease's expiry for holders that die. Queued tickets
//! carry a heartbeat, refreshed for all of a sidecar's tickets on a lock by
//! one script call every [`HEARTBEAT_EVERY`]; tickets of a dead sidecar lapse
//! and are pruned by the next script that touches the lock.
//!
//! # Layout
//!
//! * [`node`]: one logical Redis with sidelock's key layout (shared with Redlock).
//! * [`scripts`]: the Lua scripts, their calls and reply decoding.
//! * [`leases`]: a node's lease operations.
//! * [`listing`]: the key index and `/v1/stale`.
//! * [`members`]: a node as a backend uses it, with its heartbeats.
//! * [`pubsub`]: wake-ups over pub/sub.

mod leases;
mod listing;
mod members;
mod node;
mod pubsub;
mod scripts;

pub use members::{Member, Numbering};
pub use node::{Node, Step};
pub use pubsub::{Watchers, watch};

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use crate::backend::{
    Attempt, Backend, Description, Error, Options, Safety, StaleKey, State, Status, Summary,
    Ticket, Turn, Watch,
};
use crate::lock::{Claim, LockKey, Token};
use crate::wakeups::Wakeups;

/// How often this sidecar refreshes its waiters' heartbeats.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);
/// A waiter whose sidecar has not refreshed it for this long is dropped.
const HEARTBEAT_TTL: Duration = Duration::from_secs(15);
/// Connect and response timeout of every Redis call.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

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
        let node = Node::open(url, &options.redis_prefix)?;
        let watchers = Watchers::default();
        let stop = CancellationToken::new();
        let member = Member::start(
            node,
            &options.sidecar,
            &watchers,
            &wakeups,
            &stop,
            Numbering::Shared,
        );
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
        self.member
            .try_acquire(claim, step, &Token::generate(), true, 0)
            .await
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
        self.node().release(key, token).await
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
    fn no_name_reaches_another_names_key_or_an_internal_key() {
        for prefix in ["sidelock:", "", "lock:"] {
            let node = Node::open("redis://127.0.0.1:1", prefix).expect("node");
            let internal = [node.index.clone()];
            let mut owner: HashMap<String, LockKey> = HashMap::new();
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
                        assert!(!internal.contains(&k), "{key} uses {k}");
                        if let Some(other) = owner.insert(k.clone(), key.clone()) {
                            panic!("{key} and {other} share {k}");
                        }
                    }
                    assert_ne!(node.channel(&key), node.index);
                }
            }
        }
    }
}
