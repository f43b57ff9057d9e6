//! `zk://h1:port,h2:port/chroot`: leases are ephemeral sequential znodes.
//!
//! Every lock, semaphore or election is a parent node `<root>/locks/<name>`,
//! `<root>/semaphores/<name>` or `<root>/elections/<name>` (a container node,
//! which the server removes when it is empty); an election is an exclusive
//! lock there. A name is
//! one path segment (it has no `/`), and `.` and `..`, which are no valid
//! segments, are written `%2e` and `%2e%2e` (`%` is in no name), so no name
//! reaches another name's node, another kind's directory, or the claim and
//! lock-delay nodes that live one level below a name. Each claim — holder or waiter — is one ephemeral sequential
//! child of this sidecar's session, named as Apache Curator names them:
//!
//! | claim | node | Curator recipe it excludes |
//! |---|---|---|
//! | exclusive lock | `_c_<uuid>-lock-<seq>` | `InterProcessMutex` |
//! | exclusive lock named in `?rw_locks=` | `_c_<uuid>-__WRIT__<seq>` | `InterProcessReadWriteLock` (write side) |
//! | shared lock | `_c_<uuid>-__READ__<seq>` | `InterProcessReadWriteLock` (read side) |
//! | semaphore permit | `_c_<uuid>-lock-<seq>` | none |
//!
//! Curator's recipes sort children by the text after their own lock name, so
//! an `InterProcessMutex` ignores `__WRIT__`/`__READ__` nodes and a read-write
//! lock ignores `lock-` nodes: which name sidelock writes for an exclusive
//! claim has to follow the recipe the Java side uses on that path, hence
//! `?rw_locks=` (names, or prefixes ending in `*`). sidelock itself reads
//! every node that is not `__READ__` as exclusive. The sequence suffix orders
//! the queue:
//!
//! * an exclusive claim is admitted when its node is the first child;
//! * a shared claim when no exclusive node comes before it;
//! * a semaphore claim when fewer than `limit` nodes come before it, all
//!   of its own limit (a node ahead with another keeps it waiting, and its
//!   follower watches that node).
//!
//! # Watches
//!
//! A lock waiter watches only the node that blocks it (its predecessor for an
//! exclusive claim, the nearest earlier exclusive node for a shared one),
//! with a children watch on that node: it fires when the node is deleted and
//! for nothing else (an ephemeral node has no children), so neither the grant
//! nor the renewals that rewrite the blocker's data wake anyone, and a release
//! fires one watch. Nodes ahead of a waiter only ever leave: when its blocker
//! was the last thing ahead that could block it, the deletion admits it.
//! Otherwise, if the waiter is its sidecar's first on the lock, the deletion
//! wakes it, and its attempt lists the lock anyway, grants it or sets up the
//! next watch; any other waiter lists the lock itself and watches its new
//! blocker.
//!
//! A semaphore waiter at index `i` (children sorted by sequence, `L` the
//! limit, `i >= L`) watches:
//!
//! * `i == L` (the head): the parent's children;
//! * `i > L`: its predecessor (index `i - 1`, itself a waiter) for deletion
//!   or a data change — a semaphore waiter's data changes exactly once, when
//!   it is granted (its grant is never written ahead of its listing).
//!
//! A follower waits for its watch only while its node waits here: the
//! ticket holds the sending half of a oneshot channel, so a ticket that goes
//! (granted, dequeued, its session lost) ends the wait.
//!
//! Each registration is checked against a listing taken after it (the
//! children watch returns one; a predecessor watch is followed by a second
//! listing, and the waiter starts over if its index moved), so no change
//! before the registration is missed. Why every waiter is woken when it is
//! admitted: indexes only fall (new nodes come last), by one per deletion of
//! an earlier node. The head is admitted by exactly such a deletion, which
//! fires its children watch. A waiter `w` at `i > L` is admitted only after it
//! became head; it becomes head either by its predecessor `p` being deleted
//! (its watch fires) or by a deletion before `p` while `p` was head, which
//! admits `p`: `p` is then granted (its data changes: `w`'s watch fires) or
//! leaves (deleted: it fires too), and `w` re-evaluates as head. So a release
//! fires two watches: the head's children watch, and the data watch of the
//! head's successor when the head is granted. Joins and departures of waiters
//! fire at most one children watch and one predecessor watch each.
//!
//! # Data
//!
//! The node data (JSON) carries the token, owner, sidecar, mode, hold count,
//! expiry and fence; its times are on the servers' clock, which every
//! sidecar learns from its own writes ([`server_time`]). The fence is the zxid of the write that granted the
//! lease — the create of a try-once claim admitted at once, else the
//! `setData` that marked a waiting node held — and the node's `mzxid` until
//! a later write stores it in the data; strictly increasing across the
//! ensemble's life, also after the parent is removed and created again. The
//! parent's data records the highest fence of the leases that ended on the
//! lock, written by the request that deletes a lease's node when it
//! raises it (release,
//! expiry, force-release, which deletes every holder's node in one
//! request; the fences of leases lost with the session are recorded
//! through the next session): `inspect` shows it for a lock nobody holds,
//! until the emptied lock node is removed. A lock-delay is the data of a
//! persistent child `_sidelock_delay`, written by the request that deletes
//! the expired (or force-released) lease, so that whoever sees the lease
//! gone also sees the delay; it keeps the
//! container parent from being reaped while the delay runs and is deleted
//! once it is over. A lease with a lock-delay also has a persistent mark
//! beside its node from its grant to its end ([`names::Mark`]): a session
//! that ends deletes the node and nothing else, and whoever lists the lock
//! then finds the mark alone and starts the lost lease's lock-delay. The
//! per-lock ttl is enforced here: a node whose expiry
//! passed is deleted by whichever sidecar notices (its status check, a
//! waiter's expiry timer).
//!
//! # Requests
//!
//! A listing of a lock is one multi-read request: its children, then the
//! parent's data and stat, then the delay node (three requests on
//! ZooKeeper before 3.6, which has no multi-read). Concurrent callers in one
//! sidecar share listings. With nobody else on the lock:
//!
//! * try-once acquire: create + listing = 2, in one round trip (the listing
//!   is sent right behind the create, which the server answers first). The
//!   node is created as a granted lease. With nothing ahead, no lock-delay
//!   and no child created or deleted after the create (the parent's `pzxid`
//!   is at most the create's zxid), it held from its creation: every earlier
//!   grant's node was gone before it, so every earlier fence is below its
//!   `czxid`. If a child came or went, or a holder ahead (a reader, a
//!   permit) was granted after the create (a `setData` moves no `pzxid`),
//!   a claim ahead may have been granted after the create: one `setData`
//!   grants it again, with a newer zxid. Not
//!   admitted, the node is deleted (busy: + the holders' data + the delete).
//! * acquire of a lock that may wait, with no other waiter of this sidecar
//!   on it: created as granted, as a try-once claim (2); not admitted, it
//!   is written back as waiting. Otherwise, and on a semaphore: create (a
//!   waiting node) + listing + the `setData` that grants it = 3; busy: +
//!   the holders' data and the watch on the blocker.
//! * release: one multi-request that deletes the node at the version this
//!   sidecar last wrote and records its fence in the parent at the version
//!   the grant's listing saw (unless the parent's record is at that fence
//!   or above: it only rises) = 1. Renewal: one `setData` = 1. A write
//!   through another sidecar (a re-entry, another release) moves a version:
//!   the write fails and the node or the parent is read again. A release
//!   that lost its parent write to another lease's end, which raised the
//!   record, tries again at once without counting the round: only ends of
//!   leases granted before it can raise the record below its fence, so
//!   releases at once all go through.
//! * handoff to a waiter: the release (1); the waiter's watch fires, and its
//!   attempt sends the `setData` that grants it together with its listing
//!   (2, one round trip). The write is the grant when the listing shows the
//!   node admitted, no lock-delay and no child created or deleted after the
//!   write (as for a try-once create); else it is undone (waiting again) or
//!   made again. The client that released and asks again queues: create +
//!   listing + the holder's data (its busy answer, its expiry timer) + the
//!   watch on its blocker (4). About 7 per handoff.
//! * re-entry: create + listing + the holder's data + one multi-request that
//!   raises the holder's count and deletes the new node = 4.
//!
//! # Tentative grants
//!
//! The writes above that go out before the listing that admits them (a
//! create written as granted, a waiter's granting `setData` sent with its
//! listing) are, on a lock, `tentative` in the node's data: only the sidecar that wrote one
//! knows whether its listing made it a grant, and if its answer is lost
//! nobody does. Had it not been admitted, its zxid may be below a grant
//! made since (a claim ahead granted after it), or inside a lock-delay, so
//! another sidecar never re-enters a tentative node for its owner: it waits
//! (at most a second) for the node to change. The writing sidecar confirms
//! a grant it holds after `CONFIRM_AFTER` with a `setData` that stores the
//! fence (any later write by the holder does the same); a lease released
//! before that costs no write more. Everyone else takes a tentative node
//! for a holder, which only ever keeps claims behind it waiting.
//!
//! Only the listing right behind such a write tells whether it is the grant:
//! a later attempt (a waiter whose write's answer was lost reads its node
//! again, `unsure`) grants with a new `setData`.
//!
//! When a claim queues as its sidecar's first waiter on the key, the
//! core's attempt that follows at once gets the queueing attempt's answer
//! again, without a request, while its follower has seen nothing change.
//!
//! # Sessions
//!
//! The session is the backend's own lease: when it expires, every node of
//! this sidecar is gone. The server expires it `T` (the negotiated session
//! timeout) after it last heard from this sidecar, and another sidecar can be
//! granted right after. So this sidecar stops vouching for its leases before
//! that: a lifeline sends a `sync` every `T/6`. A `sync` goes through the
//! leader, which is the server that expires sessions; a read does not: a
//! follower cut off from its leader answers reads by itself until its own
//! timeout (`syncLimit × tickTime`), while the leader, hearing nothing more
//! of the session, expires it. A follower tells its leader of the sessions
//! it heard from in its answer to the leader's next ping (every
//! `tickTime/2`), on the same link, ahead of the `sync`s it forwards after
//! it. So once the round after round `k` is answered, the leader heard from
//! the session no earlier than round `k`'s send time `s`, and cannot expire
//! it before `s + T`, as long as half a tick and the link's delay stay
//! under `T/6` (a session timeout of more than three ticks: ZooKeeper's
//! defaults are 10 s and 2 s). Not covered: an observer that reaches the
//! leader through a follower (`observerMasterPort`), a second hop for the
//! session's touches, and a leader's link to the follower stalling longer
//! than `T/6` without breaking. At `s + 2T/3` without a newer answer (cut off, ensemble
//! without quorum, a process pause), the backend gives the session up: it announces every lease of the session lost on
//! [`Backend::losses`] (the core ends them and tells hold streams), revokes
//! their tokens (renew and release answer lost from then on, even while
//! ZooKeeper is unreachable), drops the session's tickets and opens a new
//! session for later requests. The old session's nodes are deleted as soon
//! as it reconnects, or the server deletes them when it expires it. The
//! margin of `T/3` covers delivering the loss and scheduling delays; the
//! price is that a pause longer than about `T/2` (`2T/3` less a round)
//! ends the leases even if the session would have survived. An expiry the client is told of is handled
//! the same way.

mod acquire;
mod admin;
mod data;
mod lease;
mod names;
mod request;
mod server_time;
mod session;
mod tree;
mod watch;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::broadcast;
use zookeeper_client as zk;

use self::acquire::Own;
use self::data::{Lease, Parent};
use self::request::must;
use self::tree::Lister;
use super::url::Parts;
use super::{
    Attempt, Backend, Busy, Description, Error, Options, Safety, StaleKey, State, Status, Summary,
    Ticket, Turn, Watch,
};
use crate::clock::now_ms;
use crate::lock::{Claim, LockKey, Token};
use crate::wakeups::Wakeups;

/// Default session timeout (`?session_timeout=` in the URL overrides it).
const SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// The ZooKeeper backend.
pub struct ZooKeeper {
    inner: Arc<Inner>,
}

/// The backend's state, shared with its background tasks (the lifeline,
/// watch followers, discards of unaccounted nodes).
struct Inner {
    hosts: String,
    chroot: String,
    root: String,
    session_timeout: Duration,
    url: String,
    wakeups: Wakeups,
    /// The current session; replaced when it expires.
    client: tokio::sync::Mutex<Option<zk::Client>>,
    /// Waiting nodes of this sidecar by (key, sequence): the tickets,
    /// each key's in queue order. Boxed: a map's node has room for eleven
    /// values and nodes filled in order stay half full, so values inline
    /// would cost twice their size.
    tickets: Mutex<BTreeMap<(LockKey, u64), Box<Queued>>>,
    /// Leases granted through this sidecar, as it last wrote or read them.
    /// Boxed: with inline records (216 bytes) the table of 10,000 holds is
    /// one 4 MiB allocation, as resident as it is large.
    leases: Mutex<HashMap<Token, Box<Record>>>,
    /// Shared children listings by (session, parent path), while in use. A
    /// listing is O(queue length): a burst of n waiters joining one lock,
    /// each listing on its own, would cost O(n²) bytes on the wire and in
    /// memory, and queue n large responses on the session's one connection
    /// ahead of the lifeline's pings.
    listers: Mutex<HashMap<(i64, String), Arc<Lister>>>,
    /// Whether the parent-create call may use container nodes.
    containers: std::sync::atomic::AtomicBool,
    /// Whether the server answers multi-reads (ZooKeeper 3.6 and later);
    /// cleared at the first that it refuses.
    multi_read: std::sync::atomic::AtomicBool,
    /// The servers' clock, on which every time in a node is written and
    /// judged.
    clock: server_time::ServerClock,
    /// The session whose nodes count as this sidecar's; `None` between sessions.
    /// Locked before `leases`.
    session: Mutex<Option<zk::SessionId>>,
    /// Tokens reported lost, with when: they hold nothing even while their
    /// node may still exist (abandoned session not yet closed or expired).
    revoked: Mutex<HashMap<Token, Instant>>,
    /// Leases over for their holders whose nodes a check deletes once the
    /// servers' clock is surely past their end (one check each).
    lapsing: Mutex<std::collections::HashSet<Token>>,
    /// Leases re-entered through this sidecar whose nodes another sidecar
    /// granted (and whose session they live in), and whether this sidecar
    /// is ending them: each node is watched, and its deletion by anyone
    /// but this sidecar is reported as the lease's loss
    /// ([`Inner::follow_reentered`]).
    reentered: Mutex<HashMap<Token, bool>>,
    /// Where lost leases are announced ([`Backend::losses`]).
    losses: broadcast::Sender<Token>,
    /// Lock names whose exclusive claims are `__WRIT__` nodes (`?rw_locks=`).
    rw_locks: Vec<String>,
    /// Cancelled by [`Backend::close`]: stops the session's lifeline, which
    /// holds a handle of the client.
    closing: tokio_util::sync::CancellationToken,
}

/// A waiting node of this sidecar.
struct Queued {
    /// The node as this sidecar wrote it (nobody else writes a waiting node).
    own: Own,
    /// Set while a task ([`watch::Follower`]) watches what blocks it, for
    /// that task: dropped with the ticket (granted, dequeued, its session
    /// lost), which ends the task's wait for its watch.
    follower: Option<tokio::sync::oneshot::Sender<()>>,
    /// The answer of the attempt that queued it as this sidecar's first
    /// waiter on the key, for its next attempt (the core's, at once):
    /// dropped as soon as what blocks it changes, which its follower sees.
    answer: Option<Box<Busy>>,
    /// Set when its follower saw what blocked it go: its next attempt
    /// probably grants it, and sends the granting write with its listing.
    hint: bool,
    /// Set when an attempt failed while ZooKeeper was unreachable: a write
    /// of that attempt may have run without an answer, so `own` may be out
    /// of date, and the next attempt reads the node first.
    unsure: bool,
    /// A semaphore claim's node ahead with another limit, which keeps it
    /// waiting although its place admits it: its follower watches that
    /// node.
    mixed: Option<String>,
}

/// A lease granted through this sidecar: its node, which a release or
/// renewal writes at the version it knows without reading it first (a
/// write through another sidecar, a re-entry, makes it read again), and
/// the lock node as the grant listed it, whose record the release updates
/// in the same request.
#[derive(Clone)]
struct Record {
    /// The lease's node.
    lease: Lease,
    /// The lock node.
    parent: Parent,
}

impl ZooKeeper {
    /// Parses `zk://h1:port,h2:port/chroot[?session_timeout=10s&rw_locks=a,b*]`; connects lazily.
    ///
    /// # Errors
    /// A sentence for the operator when the URL is malformed.
    pub fn open(url: &str, options: &Options, wakeups: Wakeups) -> Result<Self, String> {
        let parts = Parts::parse(url)
            .ok()
            .filter(|p| p.scheme == "zk")
            .ok_or_else(|| {
                format!(
                    "ZooKeeper URL {:?} names no server; use zk://host:2181[,host:2181…][/chroot]",
                    super::redact(url)
                )
            })?;
        if parts.userinfo.is_some() {
            return Err(format!(
                "ZooKeeper URL {:?} has user info; ZooKeeper URLs carry none: zk://host:2181[,host:2181…][/chroot]",
                super::redact(url)
            ));
        }
        let hosts = parts.hosts.join(",");
        let chroot = if parts.path.is_empty() {
            String::new()
        } else {
            format!("/{}", parts.path).trim_end_matches('/').to_owned()
        };
        let mut session_timeout = SESSION_TIMEOUT;
        let mut rw_locks = Vec::new();
        for (name, value) in parts.query_pairs() {
            match name {
                "session_timeout" => {
                    session_timeout = crate::duration::parse_duration(value)
                        .map_err(|e| format!("ZooKeeper URL: session_timeout: {e}"))?;
                }
                "rw_locks" => {
                    rw_locks.extend(
                        value
                            .split(',')
                            .filter(|p| !p.is_empty())
                            .map(str::to_owned),
                    );
                }
                _ => {
                    return Err(format!(
                        "ZooKeeper URL: unknown parameter {name:?}; only session_timeout and rw_locks are accepted"
                    ));
                }
            }
        }
        let root = options.zk_lock_root.trim_end_matches('/').to_owned();
        if !root.starts_with('/') || root.len() < 2 {
            return Err(format!(
                "--zk-lock-root {:?} must be an absolute ZooKeeper path such as /sidelock",
                options.zk_lock_root
            ));
        }
        Ok(Self {
            inner: Arc::new(Inner {
                hosts,
                chroot,
                root,
                session_timeout,
                url: super::redact(url),
                wakeups,
                client: tokio::sync::Mutex::new(None),
                tickets: Mutex::new(BTreeMap::new()),
                leases: Mutex::new(HashMap::new()),
                listers: Mutex::new(HashMap::new()),
                containers: std::sync::atomic::AtomicBool::new(true),
                multi_read: std::sync::atomic::AtomicBool::new(true),
                clock: server_time::ServerClock::default(),
                session: Mutex::new(None),
                revoked: Mutex::new(HashMap::new()),
                lapsing: Mutex::new(std::collections::HashSet::new()),
                reentered: Mutex::new(HashMap::new()),
                losses: broadcast::channel(4096).0,
                rw_locks,
                closing: tokio_util::sync::CancellationToken::new(),
            }),
        })
    }
}

/// Locks `m`, also after a panic poisoned it.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[async_trait]
impl Backend for ZooKeeper {
    fn describe(&self) -> Description {
        Description {
            kind: super::BackendKind::ZooKeeper,
            url: self.inner.url.clone(),
            safety: Safety::Correctness,
        }
    }

    async fn ping(&self) -> Result<(), Error> {
        let zk = self.inner.client().await?;
        must("ping", zk.check_stat(&self.inner.root)).await?;
        Ok(())
    }

    async fn try_acquire(&self, claim: &Claim, turn: Turn<'_>) -> Result<Attempt, Error> {
        let result = self.attempt(claim, turn).await;
        // A waiter keeps its place through a connection loss (e.g. a leader
        // election) as long as its session, and so its node, lives: retry soon.
        if let (Err(Error::Unavailable { .. }), Turn::Queued(t)) = (&result, turn)
            && let Some(queued) = lock(&self.inner.tickets).get_mut(&(t.key.clone(), t.seq))
        {
            queued.unsure = true;
            return Ok(Attempt::Busy(Busy {
                retry_at_ms: Some(now_ms() + 500),
                ..Busy::default()
            }));
        }
        result
    }

    async fn dequeue(&self, ticket: &Ticket) -> Result<(), Error> {
        self.dequeue_node(ticket).await
    }

    async fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, Error> {
        self.inner.renew(key, token, ttl).await
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, Error> {
        self.inner.release(key, token).await
    }

    async fn status(&self, key: &LockKey, token: &Token) -> Result<Status, Error> {
        self.inner.status(key, token).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<State, Error> {
        self.inner.inspect(key).await
    }

    async fn list(
        &self,
        prefix: &str,
        after: Option<&LockKey>,
        limit: usize,
    ) -> Result<Vec<Summary>, Error> {
        self.inner.list(prefix, after, limit).await
    }

    async fn stale(&self, stale_after: Duration) -> Result<Vec<StaleKey>, Error> {
        self.inner.stale(stale_after).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<Vec<Token>, Error> {
        self.inner.force_release(key).await
    }

    /// A persistent watch on the key's parent node: every child created or
    /// deleted (a candidate joining, a leader leaving, the next one granted)
    /// tells the observer, with no announcement needed.
    async fn observe(&self, key: &LockKey) -> Result<Watch, Error> {
        let stop = tokio_util::sync::CancellationToken::new();
        let inner = self.inner.clone();
        let key = key.clone();
        let stopped = stop.clone();
        tokio::spawn(async move { inner.observe(key, stopped).await });
        Ok(Box::new(stop.drop_guard()))
    }

    /// A lease is an ephemeral node: it goes when it is released or its
    /// session dies, and the observer's persistent watch fires.
    fn reports_lease_ends(&self) -> bool {
        true
    }

    async fn watch(&self, _key: &LockKey) -> Result<Watch, Error> {
        // Every waiting node watches its blocker from the attempt that left it
        // waiting (before that attempt answered), so delivery is already in place.
        Ok(Box::new(()))
    }

    /// The session, which the lifeline keeps confirming.
    fn connected(&self) -> Option<bool> {
        Some(lock(&self.inner.session).is_some())
    }

    fn losses(&self) -> Option<broadcast::Receiver<Token>> {
        Some(self.inner.losses.subscribe())
    }

    async fn close(&self) {
        self.inner.closing.cancel();
        // Dropping the last handle closes the session, which deletes its
        // ephemeral nodes at once (watchers hold handles only while waiting).
        drop(self.inner.client.lock().await.take());
    }
}
