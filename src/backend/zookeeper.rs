//! `zk://h1:port,h2:port/chroot`: leases are ephemeral sequential znodes.
//!
//! Every lock or semaphore is a parent node `<root>/locks/<name>` or
//! `<root>/semaphores/<name>` (a container node, which the server removes when
//! it is empty); `<root>/elections/<name>` is kept for elections. A name is
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
//! * a semaphore claim when fewer than `limit` nodes come before it.
//!
//! # Watches
//!
//! A lock waiter watches only the node that blocks it (its predecessor for an
//! exclusive claim, the nearest earlier exclusive node for a shared one), so a
//! release fires one watch.
//!
//! A semaphore waiter at index `i` (children sorted by sequence, `L` the
//! limit, `i >= L`) watches:
//!
//! * `i == L` (the head): the parent's children;
//! * `i > L`: its predecessor (index `i - 1`, itself a waiter) for deletion
//!   or a data change — a waiter's data changes exactly once, when it is
//!   granted.
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
//! expiry and fence. The fence is the zxid of the write that granted the lease,
//! strictly increasing across the ensemble's life, also after the parent is
//! removed and created again. The parent's data keeps the highest fence
//! granted; a lock-delay is the data of a persistent child `_sidelock_delay`,
//! which keeps the container parent from being reaped while the delay runs
//! and is deleted once it is over. The per-lock ttl is enforced here: a node whose
//! expiry passed is deleted by whichever sidecar notices (its status check, a
//! waiter's expiry timer).
//!
//! # Sessions
//!
//! The session is the backend's own lease: when it expires, every node of
//! this sidecar is gone. The server expires it `T` (the negotiated session
//! timeout) after it last heard from this sidecar, and another sidecar can be
//! granted right after. So this sidecar stops vouching for its leases before
//! that: a lifeline sends a request every `T/6`; the server heard from the
//! session no earlier than the send time `s` of the last answered one, so it
//! cannot expire the session before `s + T`. At `s + 2T/3` without a newer
//! answer (cut off, ensemble without quorum, a process pause), the backend
//! gives the session up: it announces every lease of the session lost on
//! [`Backend::losses`] (the core ends them and tells hold streams), revokes
//! their tokens (renew and release answer lost from then on, even while
//! ZooKeeper is unreachable), drops the session's tickets and opens a new
//! session for later requests. The old session's nodes are deleted as soon
//! as it reconnects, or the server deletes them when it expires it. The
//! margin of `T/3` covers delivering the loss and scheduling delays; the
//! price is that a pause longer than `2T/3` ends the leases even if the
//! session would have survived. An expiry the client is told of is handled
//! the same way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rand::RngExt;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use zookeeper_client as zk;

use super::{
    Attempt, Backend, Busy, Description, Error, Grant, Holder, Loss, Options, Safety, StaleKey,
    State, Status, Summary, Ticket, Turn, Waiter, Watch,
};
use crate::clock::{ms, now_ms};
use crate::lock::{Claim, Held, Kind, LockKey, Mode, Name, Token};
use crate::wakeups::Wakeups;

/// How long one ZooKeeper request may take before the backend counts as unavailable.
const OP_TIMEOUT: Duration = Duration::from_secs(5);
/// Default session timeout (`?session_timeout=` in the URL overrides it).
const SESSION_TIMEOUT: Duration = Duration::from_secs(10);
/// Curator's node infix of an exclusive lock (`InterProcessMutex`).
const EXCLUSIVE: &str = "lock-";
/// Curator's node infix of a read lock (`InterProcessReadWriteLock`).
const READ: &str = "__READ__";
/// Curator's node infix of a write lock (`InterProcessReadWriteLock`).
const WRITE: &str = "__WRIT__";
/// The persistent child of a lock node that carries its lock-delay. It keeps
/// the container parent from being reaped while the delay runs. No claim
/// name: no sequence suffix, and neither `lock-` nor Curator's infixes, so
/// Curator sorts it after every claim.
const DELAY_NODE: &str = "_sidelock_delay";
/// Part of the session timeout that may pass without a confirmed round trip
/// before this sidecar stops vouching for its leases (see the module doc).
const SUSPEND_AFTER: (u32, u32) = (2, 3);

/// The ZooKeeper backend.
pub struct ZooKeeper {
    inner: Arc<Inner>,
}

struct Inner {
    hosts: String,
    chroot: String,
    root: String,
    session_timeout: Duration,
    url: String,
    wakeups: Wakeups,
    /// The current session; replaced when it expires.
    client: tokio::sync::Mutex<Option<zk::Client>>,
    /// Waiting nodes of this sidecar by (key, sequence): the tickets.
    tickets: Mutex<HashMap<(LockKey, u64), Queued>>,
    /// Leases granted through this sidecar: token → node path.
    leases: Mutex<HashMap<Token, String>>,
    /// Shared children listings by (session, parent path), while in use. A
    /// listing is O(queue length): a burst of n waiters joining one lock,
    /// each listing on its own, would cost O(n²) bytes on the wire and in
    /// memory, and queue n large responses on the session's one connection
    /// ahead of the lifeline's pings.
    listers: Mutex<HashMap<(i64, String), Arc<Lister>>>,
    /// Whether the parent-create call may use container nodes.
    containers: std::sync::atomic::AtomicBool,
    /// The session whose nodes count as this sidecar's; `None` between sessions.
    /// Locked before `leases`.
    session: Mutex<Option<zk::SessionId>>,
    /// Tokens reported lost, with when: they hold nothing even while their
    /// node may still exist (abandoned session not yet closed or expired).
    revoked: Mutex<HashMap<Token, Instant>>,
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
    /// The node's name under its lock's parent.
    name: String,
    /// Whether a task watches what blocks it ([`Inner::follow`]).
    following: bool,
}

/// What sidelock stores in each claim node.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct NodeData {
    token: String,
    owner: String,
    sidecar: String,
    /// True once granted; a waiting claim is false.
    held: bool,
    since_ms: u64,
    expires_at_ms: u64,
    ttl_ms: u64,
    #[serde(default)]
    cap_ms: Option<u64>,
    lock_delay_ms: u64,
    count: u32,
    fence: u64,
    #[serde(default)]
    limit: Option<u32>,
    queued_ms: u64,
}

/// What sidelock stores in a lock's parent node.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct ParentData {
    #[serde(default)]
    fence: u64,
    #[serde(default)]
    delay_until_ms: u64,
}

/// What a waiting node waits for, by its place among the parent's children.
enum Blocker {
    /// Nothing: it is admitted by place.
    Nothing,
    /// Any deletion before it (a semaphore's queue head watches the children).
    Earlier,
    /// The deletion (or grant) of this node.
    Node(String),
}

/// One child of a lock node.
#[derive(Debug, Clone)]
struct Child {
    name: String,
    seq: u64,
    mode: Mode,
}

/// A child with its data, once read.
#[derive(Debug, Clone)]
struct Node {
    child: Child,
    /// `None` for a node sidelock did not write (Curator, other tools).
    data: Option<NodeData>,
    stat: zk::Stat,
}

impl Node {
    fn holder(&self, kind: Kind) -> Holder {
        match &self.data {
            Some(d) => Holder {
                owner: d.owner.clone(),
                sidecar: d.sidecar.clone(),
                mode: Held::of(kind, self.child.mode),
                since_ms: d.since_ms,
                expires_at_ms: d.expires_at_ms,
                fence: d.fence.max(1),
                count: d.count,
            },
            None => Holder {
                owner: "(foreign)".into(),
                sidecar: String::new(),
                mode: Held::of(kind, self.child.mode),
                since_ms: u64::try_from(self.stat.ctime).unwrap_or(0),
                expires_at_ms: u64::MAX / 2,
                fence: u64::try_from(self.stat.czxid).unwrap_or(0),
                count: 1,
            },
        }
    }

    fn is_held(&self) -> bool {
        self.data.as_ref().is_none_or(|d| d.held)
    }
}

fn parse_child(name: &str) -> Option<Child> {
    child_from(name.to_owned())
}

/// The claim named `name` (its sequence and mode), or `None` for other nodes.
fn child_from(name: String) -> Option<Child> {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    if digits < 10 {
        return None;
    }
    let seq = name[name.len() - digits..].parse().ok()?;
    let mode = if name.contains(READ) {
        Mode::Shared
    } else {
        Mode::Exclusive
    };
    Some(Child { name, seq, mode })
}

fn sorted(names: Vec<String>) -> Vec<Child> {
    let mut children: Vec<Child> = names.into_iter().filter_map(child_from).collect();
    children.sort_by_key(|c| c.seq);
    children
}

/// A parent's children sorted by sequence, shared by the callers that
/// asked for them at about the same time.
type Listing = Arc<Vec<Child>>;

/// A caller of [`Inner::children`]; the last one to leave (also when its
/// future is dropped) removes the parent's [`Lister`] and its listing.
struct ListerUse<'a> {
    listers: &'a Mutex<HashMap<(i64, String), Arc<Lister>>>,
    id: (i64, String),
    lister: Arc<Lister>,
}

impl Drop for ListerUse<'_> {
    fn drop(&mut self) {
        let mut listers = lock(self.listers);
        // Only the map and this caller hold it: nobody waits for a listing.
        if Arc::strong_count(&self.lister) == 2 {
            listers.remove(&self.id);
        }
    }
}

/// One parent's listings. Callers that arrive while a listing is under way
/// wait for it to end, then share one new listing: one request per batch of
/// callers instead of one each, and every caller's listing is issued after
/// it asked, so it shows every change the caller saw before asking (a
/// session's requests are answered in order; watch events come before
/// later answers).
#[derive(Default)]
struct Lister {
    /// Listings issued so far.
    issued: std::sync::atomic::AtomicU64,
    /// The newest completed listing with its issue number. Whoever holds the
    /// lock and finds it stale issues the next listing.
    last: tokio::sync::Mutex<Option<(u64, Listing)>>,
}

/// Whether the child at `index` is admitted by its place alone.
fn admitted(children: &[Child], index: usize, kind: Kind, limit: u32) -> bool {
    match (kind, children[index].mode) {
        (Kind::Semaphore, _) => index < limit as usize,
        (Kind::Lock, Mode::Exclusive) => index == 0,
        (Kind::Lock, Mode::Shared) => children[..index].iter().all(|c| c.mode == Mode::Shared),
    }
}

fn unavailable(op: &'static str, e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::Unavailable {
        op,
        source: Box::new(e),
    }
}

#[derive(Debug, thiserror::Error)]
#[error("ZooKeeper did not answer within {0:?}")]
struct TimedOut(Duration);

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Message(String);

/// Runs one ZooKeeper request: `Err` when ZooKeeper is unreachable, else the
/// request's own result (NoNode, BadVersion… are answers, not outages).
async fn call<T>(
    op: &'static str,
    fut: impl Future<Output = Result<T, zk::Error>>,
) -> Result<Result<T, zk::Error>, Error> {
    match tokio::time::timeout(OP_TIMEOUT, fut).await {
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

/// Like [`call`], treating every error as an outage.
async fn must<T>(
    op: &'static str,
    fut: impl Future<Output = Result<T, zk::Error>>,
) -> Result<T, Error> {
    call(op, fut).await?.map_err(|e| unavailable(op, e))
}

fn encode_name(name: &Name) -> String {
    // `.` and `..` are not valid ZooKeeper path segments; `%` is not a valid lock name character.
    match name.as_str() {
        "." => "%2e".into(),
        ".." => "%2e%2e".into(),
        other => other.into(),
    }
}

fn decode_name(segment: &str) -> Option<Name> {
    let s = match segment {
        "%2e" => ".",
        "%2e%2e" => "..",
        other => other,
    };
    Name::parse(s).ok()
}

/// Whether `name` matches one of the `?rw_locks=` patterns (exact, or a prefix ending in `*`).
fn matches_any(patterns: &[String], name: &str) -> bool {
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == p,
    })
}

fn node_prefix(infix: &str) -> String {
    let b: [u8; 16] = rand::rng().random();
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    let uuid = format!(
        "{}-{}-4{}-a{}-{}",
        &h[0..8],
        &h[8..12],
        &h[13..16],
        &h[17..20],
        &h[20..32]
    );
    format!("_c_{uuid}-{infix}")
}

impl ZooKeeper {
    /// Parses `zk://h1:port,h2:port/chroot[?session_timeout=10s&rw_locks=a,b*]`; connects lazily.
    ///
    /// # Errors
    /// A sentence for the operator when the URL is malformed.
    pub fn open(url: &str, options: &Options, wakeups: Wakeups) -> Result<Self, String> {
        let rest = url.strip_prefix("zk://").ok_or_else(|| {
            format!(
                "ZooKeeper URL {:?} must start with zk://",
                super::redact(url)
            )
        })?;
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (hosts, chroot) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/').to_owned()),
            None => (rest, String::new()),
        };
        if hosts.is_empty() {
            return Err(format!(
                "ZooKeeper URL {:?} names no server; use zk://host:2181[,host:2181…][/chroot]",
                super::redact(url)
            ));
        }
        let mut session_timeout = SESSION_TIMEOUT;
        let mut rw_locks = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("session_timeout", v)) => {
                    session_timeout = crate::duration::parse_duration(v)
                        .map_err(|e| format!("ZooKeeper URL: session_timeout: {e}"))?;
                }
                Some(("rw_locks", v)) => {
                    rw_locks.extend(v.split(',').filter(|p| !p.is_empty()).map(str::to_owned));
                }
                _ => {
                    return Err(format!(
                        "ZooKeeper URL: unknown parameter {:?}; only session_timeout and rw_locks are accepted",
                        pair.split('=').next().unwrap_or_default()
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
                hosts: hosts.to_owned(),
                chroot,
                root,
                session_timeout,
                url: super::redact(url),
                wakeups,
                client: tokio::sync::Mutex::new(None),
                tickets: Mutex::new(HashMap::new()),
                leases: Mutex::new(HashMap::new()),
                listers: Mutex::new(HashMap::new()),
                containers: std::sync::atomic::AtomicBool::new(true),
                session: Mutex::new(None),
                revoked: Mutex::new(HashMap::new()),
                losses: broadcast::channel(4096).0,
                rw_locks,
                closing: tokio_util::sync::CancellationToken::new(),
            }),
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    fn key_path(&self, key: &LockKey) -> String {
        format!(
            "{}/{}/{}",
            self.root,
            key.kind.plural(),
            encode_name(&key.name)
        )
    }

    /// The current session, connecting (again) when there is none or it expired.
    async fn client(self: &Arc<Self>) -> Result<zk::Client, Error> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.state().is_terminated() {
                return Ok(c.clone());
            }
            tracing::warn!(backend = "zookeeper", "session ended; opening a new one");
            self.session_lost(c.session_id());
            *slot = None;
        }
        // The server heard from this session no earlier than now.
        let started = Instant::now();
        let connect = zk::Client::connector()
            .with_session_timeout(self.session_timeout)
            .with_connection_timeout(Duration::from_secs(2))
            .with_fail_eagerly()
            .connect(&self.hosts);
        let client = must("connect", connect).await?;
        let client = if self.chroot.is_empty() {
            client
        } else {
            // Create the chroot itself before entering it.
            let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
            must("connect", client.mkdir(&self.chroot, &opts)).await?;
            client
                .chroot(self.chroot.clone())
                .map_err(|_| unavailable("connect", Message("bad chroot".into())))?
        };
        let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        for dir in ["locks", "semaphores"] {
            must(
                "connect",
                client.mkdir(&format!("{}/{dir}", self.root), &opts),
            )
            .await?;
        }
        tracing::info!(
            backend = "zookeeper",
            session = ?client.session_id(),
            "ZooKeeper session established"
        );
        let sid = client.session_id();
        *lock(&self.session) = Some(sid);
        let lifeline = Self::lifeline(Arc::downgrade(self), client.clone(), started);
        let closing = self.closing.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = closing.cancelled() => {}
                () = lifeline => {}
            }
        });
        // Follow the session: when it ends, forget its nodes and wake every local
        // waiter (their attempts then report the loss).
        let me = Arc::downgrade(self);
        let mut states = client.state_watcher();
        tokio::spawn(async move {
            loop {
                let state = states.changed().await;
                let Some(me) = me.upgrade() else { return };
                if state.is_terminated() {
                    me.session_lost(sid);
                    return;
                }
                if state == zk::SessionState::SyncConnected {
                    // Watches are re-armed by the client; wake anyway in case one fired unseen.
                    for key in me.wakeups.keys() {
                        me.wakeups.wake(&key);
                    }
                }
            }
        });
        *slot = Some(client.clone());
        Ok(client)
    }

    /// Session `sid` ended or was given up: its leases are announced lost and
    /// revoked, its tickets forgotten, every local waiter woken (their
    /// attempts then report the loss). Nothing happens if `sid` is no longer
    /// the current session (it was handled already).
    fn session_lost(&self, sid: zk::SessionId) {
        let lost: Vec<Token> = {
            let mut session = lock(&self.session);
            if *session != Some(sid) {
                return;
            }
            *session = None;
            lock(&self.leases).drain().map(|(token, _)| token).collect()
        };
        if !lost.is_empty() {
            tracing::warn!(
                backend = "zookeeper",
                session = ?sid,
                leases = lost.len(),
                "leases of the ZooKeeper session are lost"
            );
            let now = Instant::now();
            // Long enough for the abandoned session to be closed or expired.
            let keep = self.session_timeout * 3 + OP_TIMEOUT;
            let mut revoked = lock(&self.revoked);
            revoked.retain(|_, at| now.duration_since(*at) < keep);
            revoked.extend(lost.iter().map(|t| (t.clone(), now)));
        }
        for token in lost {
            // No receiver (the core not following) only means nobody listens.
            let _ = self.losses.send(token);
        }
        lock(&self.tickets).clear();
        for key in self.wakeups.keys() {
            self.wakeups.wake(&key);
        }
    }

    fn is_revoked(&self, token: &Token) -> bool {
        lock(&self.revoked).contains_key(token)
    }

    /// Confirms session `sid` is alive by round trips and gives it up when none
    /// succeeded for [`SUSPEND_AFTER`] of its timeout: the server may expire it
    /// soon after, and another sidecar be granted its locks (module doc).
    async fn lifeline(me: std::sync::Weak<Self>, zk: zk::Client, established: Instant) {
        let timeout = zk.session_timeout();
        let (num, den) = SUSPEND_AFTER;
        let budget = timeout * num / den;
        let every = (timeout / 6).max(Duration::from_millis(50));
        let root = match me.upgrade() {
            Some(me) => me.root.clone(),
            None => return,
        };
        let sid = zk.session_id();
        // The server last heard from the session no earlier than this.
        let mut heard = established;
        loop {
            if zk.state().is_terminated() {
                return;
            }
            let Some(inner) = me.upgrade() else { return };
            if *lock(&inner.session) != Some(sid) {
                return;
            }
            drop(inner);
            let deadline = tokio::time::Instant::from_std(heard + budget);
            let sent = Instant::now();
            match tokio::time::timeout_at(deadline, zk.check_stat(&root)).await {
                Ok(Ok(_) | Err(zk::Error::NoNode)) => {
                    heard = sent;
                    tokio::time::sleep(every).await;
                }
                Ok(Err(_)) => {
                    let retry = tokio::time::Instant::now() + every.min(Duration::from_millis(100));
                    tokio::time::sleep_until(retry.min(deadline)).await;
                }
                Err(_) => {}
            }
            if Instant::now() >= heard + budget {
                let Some(inner) = me.upgrade() else { return };
                tracing::warn!(
                    backend = "zookeeper",
                    session = ?sid,
                    silent_ms = ms(heard.elapsed()),
                    session_timeout_ms = ms(timeout),
                    "no answer from ZooKeeper for too long; giving up the session and its leases"
                );
                inner.session_lost(sid);
                {
                    let mut slot = inner.client.lock().await;
                    if slot.as_ref().is_some_and(|c| c.session_id() == sid) {
                        *slot = None;
                    }
                }
                drop(inner);
                Self::bury(zk, root, timeout).await;
                return;
            }
        }
    }

    /// Deletes the nodes of an abandoned session as soon as it is reachable
    /// again, so no token reported lost can hold anything there. If it never
    /// reconnects the server expires it, which deletes them too.
    async fn bury(zk: zk::Client, root: String, timeout: Duration) {
        let mut states = zk.state_watcher();
        let give_up = tokio::time::Instant::now() + timeout * 2 + OP_TIMEOUT;
        loop {
            let state = zk.state();
            if state.is_terminated() {
                return;
            }
            if state == zk::SessionState::SyncConnected {
                if let Ok(Ok(paths)) = call("bury", zk.list_ephemerals(&root)).await {
                    for path in paths {
                        let _ = call("bury", zk.delete(&path, None)).await;
                    }
                    tracing::info!(backend = "zookeeper", session = ?zk.session_id(), "nodes of the abandoned session deleted");
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            } else if tokio::time::timeout_at(give_up, states.changed())
                .await
                .is_err()
            {
                return;
            }
            if tokio::time::Instant::now() >= give_up {
                return;
            }
        }
    }

    /// Creates the parent of `key` (a container node where the server has them).
    async fn ensure_parent(&self, zk: &zk::Client, path: &str) -> Result<(), Error> {
        let data = serde_json::to_vec(&ParentData::default()).unwrap_or_default();
        let containers = self.containers.load(std::sync::atomic::Ordering::Relaxed);
        let mode = if containers {
            zk::CreateMode::Container
        } else {
            zk::CreateMode::Persistent
        };
        let opts = mode.with_acls(zk::Acls::anyone_all());
        match call("try_acquire", zk.create(path, &data, &opts)).await? {
            Ok(_) | Err(zk::Error::NodeExists) => Ok(()),
            Err(zk::Error::Unimplemented) if containers => {
                self.containers
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                Box::pin(self.ensure_parent(zk, path)).await
            }
            Err(e) => Err(unavailable("try_acquire", e)),
        }
    }

    /// The children of `path`, listed after this call began (shared with
    /// concurrent callers, see [`Lister`]).
    async fn children(
        &self,
        zk: &zk::Client,
        op: &'static str,
        path: &str,
    ) -> Result<Listing, Error> {
        use std::sync::atomic::Ordering::SeqCst;
        let id = (zk.session_id().0, path.to_owned());
        let lister = lock(&self.listers).entry(id.clone()).or_default().clone();
        let user = ListerUse {
            listers: &self.listers,
            id,
            lister,
        };
        let lister = &user.lister;
        let seen = lister.issued.load(SeqCst);
        let mut last = lister.last.lock().await;
        if let Some((n, listing)) = &*last
            && *n > seen
        {
            return Ok(listing.clone());
        }
        let n = lister.issued.fetch_add(1, SeqCst) + 1;
        let listed = match call(op, zk.list_children(path)).await {
            Ok(Ok(names)) => Ok(Arc::new(sorted(names))),
            Ok(Err(zk::Error::NoNode)) => Ok(Arc::new(Vec::new())),
            Ok(Err(e)) => Err(unavailable(op, e)),
            Err(e) => Err(e),
        };
        if let Ok(listing) = &listed {
            *last = Some((n, listing.clone()));
        }
        listed
    }

    async fn read(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        child: &Child,
    ) -> Result<Option<Node>, Error> {
        match call(op, zk.get_data(&format!("{parent}/{}", child.name))).await? {
            Ok((bytes, stat)) => Ok(Some(Node {
                child: child.clone(),
                data: serde_json::from_slice(&bytes).ok(),
                stat,
            })),
            Err(zk::Error::NoNode) => Ok(None),
            Err(e) => Err(unavailable(op, e)),
        }
    }

    async fn parent_data(
        &self,
        zk: &zk::Client,
        op: &'static str,
        path: &str,
    ) -> Result<(ParentData, Option<i32>), Error> {
        match call(op, zk.get_data(path)).await? {
            Ok((bytes, stat)) => Ok((
                serde_json::from_slice(&bytes).unwrap_or_default(),
                Some(stat.version),
            )),
            Err(zk::Error::NoNode) => Ok((ParentData::default(), None)),
            Err(e) => Err(unavailable(op, e)),
        }
    }

    /// Read-modify-write of the parent's data (compare-and-set on its version).
    async fn update_parent(
        &self,
        zk: &zk::Client,
        op: &'static str,
        path: &str,
        f: impl Fn(&mut ParentData),
    ) -> Result<(), Error> {
        for _ in 0..20 {
            let (mut data, version) = self.parent_data(zk, op, path).await?;
            let Some(version) = version else {
                return Ok(());
            };
            f(&mut data);
            let bytes = serde_json::to_vec(&data).unwrap_or_default();
            match call(op, zk.set_data(path, &bytes, Some(version))).await? {
                Ok(_) | Err(zk::Error::NoNode) => return Ok(()),
                Err(zk::Error::BadVersion) => continue,
                Err(e) => return Err(unavailable(op, e)),
            }
        }
        Ok(())
    }

    /// The end of `parent`'s lock-delay (0: none) and the version of its delay node.
    async fn delay(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
    ) -> Result<(u64, Option<i32>), Error> {
        let path = format!("{parent}/{DELAY_NODE}");
        match call(op, zk.get_data(&path)).await? {
            Ok((bytes, stat)) => {
                let until =
                    serde_json::from_slice::<ParentData>(&bytes).map_or(0, |d| d.delay_until_ms);
                Ok((until, Some(stat.version)))
            }
            Err(zk::Error::NoNode) => Ok((0, None)),
            Err(e) => Err(unavailable(op, e)),
        }
    }

    /// Extends `parent`'s lock-delay to `until` in its delay node, which a
    /// container parent cannot be reaped with (the parent's own data would be lost with it).
    async fn record_delay(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        until: u64,
    ) -> Result<(), Error> {
        let path = format!("{parent}/{DELAY_NODE}");
        let data = ParentData {
            fence: 0,
            delay_until_ms: until,
        };
        let bytes = serde_json::to_vec(&data).unwrap_or_default();
        for _ in 0..20 {
            let result = match self.delay(zk, op, parent).await? {
                (current, Some(_)) if current >= until => return Ok(()),
                (_, Some(version)) => call(op, zk.set_data(&path, &bytes, Some(version)))
                    .await?
                    .map(|_| ()),
                (_, None) => {
                    let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                    call(op, zk.create(&path, &bytes, &opts)).await?.map(|_| ())
                }
            };
            match result {
                Ok(()) => return Ok(()),
                Err(zk::Error::BadVersion | zk::Error::NodeExists) => {}
                // The parent went (reaped when its last claim left): the delay still applies.
                Err(zk::Error::NoNode) => self.ensure_parent(zk, parent).await?,
                Err(e) => return Err(unavailable(op, e)),
            }
        }
        Err(unavailable(op, Message("lock-delay kept changing".into())))
    }

    /// Deletes a delay node that is over, unless it changed since it was read.
    async fn clear_delay(&self, zk: &zk::Client, op: &'static str, parent: &str, version: i32) {
        let path = format!("{parent}/{DELAY_NODE}");
        // Losing the race to a new delay (BadVersion) or to another cleaner is fine.
        let _ = call(op, zk.delete(&path, Some(version))).await;
    }

    /// Deletes a node whose lease expired (if it still is that lease), starting its lock-delay.
    async fn expire(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        node: &Node,
    ) -> Result<bool, Error> {
        let Some(d) = &node.data else {
            return Ok(false);
        };
        let path = format!("{parent}/{}", node.child.name);
        match call(op, zk.delete(&path, Some(node.stat.version))).await? {
            Ok(()) => {
                let until = d.expires_at_ms.saturating_add(d.lock_delay_ms);
                if d.lock_delay_ms > 0 && until > now_ms() {
                    self.record_delay(zk, op, parent, until).await?;
                }
                Ok(true)
            }
            Err(zk::Error::NoNode) => Ok(true),
            Err(zk::Error::BadVersion) => Ok(false),
            Err(e) => Err(unavailable(op, e)),
        }
    }

    /// Children with the data of those admitted by place; expired leases among
    /// them are deleted first. Returns the children and the admitted nodes.
    async fn snapshot(
        &self,
        zk: &zk::Client,
        op: &'static str,
        key: &LockKey,
        parent: &str,
    ) -> Result<(Listing, Vec<Node>, u32), Error> {
        for _ in 0..10 {
            let children = self.children(zk, op, parent).await?;
            let mut limit = 0;
            if key.kind == Kind::Semaphore && !children.is_empty() {
                limit = self.active_limit(zk, op, parent, &children).await?;
            }
            let mut nodes = Vec::new();
            let mut changed = false;
            let now = now_ms();
            for (i, c) in children.iter().enumerate() {
                if !admitted(&children, i, key.kind, limit) {
                    if key.kind == Kind::Lock && c.mode == Mode::Exclusive {
                        break;
                    }
                    continue;
                }
                let Some(node) = self.read(zk, op, parent, c).await? else {
                    changed = true;
                    continue;
                };
                if let Some(d) = &node.data
                    && d.held
                    && d.expires_at_ms <= now
                    && self.expire(zk, op, parent, &node).await?
                {
                    changed = true;
                    continue;
                }
                nodes.push(node);
            }
            if changed {
                self.wakeups.wake(key);
                continue;
            }
            return Ok((children, nodes, limit));
        }
        Err(unavailable(
            op,
            Message("the lock's children kept changing".into()),
        ))
    }

    /// A semaphore's limit: the one recorded by its first sidelock node.
    async fn active_limit(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        children: &[Child],
    ) -> Result<u32, Error> {
        for c in children {
            if let Some(node) = self.read(zk, op, parent, c).await?
                && let Some(limit) = node.data.and_then(|d| d.limit)
            {
                return Ok(limit);
            }
        }
        Ok(1)
    }

    /// Finds the node of `token` under `parent`: this sidecar's record first, else a scan.
    async fn find(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        token: &Token,
    ) -> Result<Option<Node>, Error> {
        let known = lock(&self.leases).get(token).cloned();
        if let Some(path) = known
            && let Some(name) = path.strip_prefix(&format!("{parent}/"))
            && let Some(child) = parse_child(name)
        {
            if let Some(node) = self.read(zk, op, parent, &child).await?
                && node
                    .data
                    .as_ref()
                    .is_some_and(|d| d.token == token.expose())
            {
                return Ok(Some(node));
            }
            lock(&self.leases).remove(token);
            return Ok(None);
        }
        for c in self.children(zk, op, parent).await?.iter() {
            if let Some(node) = self.read(zk, op, parent, c).await?
                && node
                    .data
                    .as_ref()
                    .is_some_and(|d| d.held && d.token == token.expose())
            {
                return Ok(Some(node));
            }
        }
        Ok(None)
    }

    /// Watches what blocks the waiting node `name` and wakes local waiters on
    /// `key` when it changes, until the node is granted or leaves. `listing`
    /// is the parent's children as the attempt that queued the node saw them
    /// (taken after the node was created), which saves the first listing.
    async fn follow(
        self: Arc<Self>,
        zk: zk::Client,
        key: LockKey,
        parent: String,
        name: String,
        listing: Listing,
    ) {
        let Some(seq) = parse_child(&name).map(|c| c.seq) else {
            return;
        };
        match lock(&self.tickets).get_mut(&(key.clone(), seq)) {
            Some(queued) if !queued.following => queued.following = true,
            // Followed already, or no longer waiting.
            _ => return,
        }
        let _ = self.follow_loop(&zk, &key, &parent, &name, listing).await;
        if let Some(queued) = lock(&self.tickets).get_mut(&(key.clone(), seq)) {
            queued.following = false;
        }
    }

    // Listings are dropped before every wait for a watch: a waiter parked
    // with the listing it joined on would keep O(queue length) bytes alive
    // for as long as it waits, O(n²) for a queue of n. The calls and the
    // wait are boxed: inline, the largest call's state would be part of
    // every waiter's task for as long as it waits for its watch.
    async fn follow_loop(
        &self,
        zk: &zk::Client,
        key: &LockKey,
        parent: &str,
        name: &str,
        listing: Listing,
    ) -> Result<(), Error> {
        let Some(seq) = parse_child(name).map(|c| c.seq) else {
            return Ok(());
        };
        let mut listing = Some(listing);
        loop {
            if !lock(&self.tickets).contains_key(&(key.clone(), seq)) {
                return Ok(());
            }
            let children = match listing.take() {
                Some(children) => children,
                None => Box::pin(self.children(zk, "watch", parent)).await?,
            };
            let Some(at) = children.iter().position(|c| c.name == name) else {
                return Ok(());
            };
            let (blocker, limit) = match (key.kind, children[at].mode) {
                (Kind::Semaphore, _) => {
                    let limit =
                        Box::pin(self.active_limit(zk, "watch", parent, &children)).await? as usize;
                    match at.cmp(&limit) {
                        std::cmp::Ordering::Less => (Blocker::Nothing, limit),
                        // The head of the queue: any deletion before it admits it.
                        std::cmp::Ordering::Equal => (Blocker::Earlier, limit),
                        // Further back: its predecessor, which is deleted or
                        // granted (a data change) before this node can be head.
                        std::cmp::Ordering::Greater => {
                            (Blocker::Node(children[at - 1].name.clone()), limit)
                        }
                    }
                }
                (Kind::Lock, Mode::Exclusive) => (
                    at.checked_sub(1).map_or(Blocker::Nothing, |b| {
                        Blocker::Node(children[b].name.clone())
                    }),
                    0,
                ),
                (Kind::Lock, Mode::Shared) => (
                    children[..at]
                        .iter()
                        .rev()
                        .find(|c| c.mode == Mode::Exclusive)
                        .map_or(Blocker::Nothing, |c| Blocker::Node(c.name.clone())),
                    0,
                ),
            };
            drop(children);
            let blocker = match blocker {
                Blocker::Node(blocker) => blocker,
                Blocker::Nothing => {
                    // Nothing blocks it by place: its attempt decides (lock-delay, expiry).
                    self.wakeups.wake(key);
                    return Ok(());
                }
                Blocker::Earlier => {
                    let (now, w) =
                        Box::pin(must("watch", zk.list_and_watch_children(parent))).await?;
                    let position = sorted(now).iter().position(|c| c.name == name);
                    match position {
                        None => return Ok(()),
                        Some(i) if i < limit => {
                            self.wakeups.wake(key);
                            return Ok(());
                        }
                        Some(_) => {
                            Box::pin(self.await_watch(key, w)).await;
                            continue;
                        }
                    }
                }
            };
            let target = format!("{parent}/{blocker}");
            let watcher = match Box::pin(must("watch", zk.check_and_watch_stat(&target))).await? {
                (None, _) => {
                    self.wakeups.wake(key);
                    continue;
                }
                (Some(_), w) => w,
            };
            drop(target);
            if key.kind == Kind::Semaphore {
                // A deletion between the listing and the watch may have made
                // the predecessor head, or admitted it: look again.
                let again = Box::pin(self.children(zk, "watch", parent)).await?;
                let moved = again.iter().position(|c| c.name == name) != Some(at);
                drop(again);
                if moved {
                    continue;
                }
            }
            Box::pin(self.await_watch(key, watcher)).await;
        }
    }

    /// Waits for one watch event; wakes local waiters unless it was a data change.
    async fn await_watch(&self, key: &LockKey, watcher: zk::OneshotWatcher) {
        let event = watcher.changed().await;
        tracing::debug!(
            backend = "zookeeper",
            lock = %key,
            path = %event.path,
            event = ?event.event_type,
            "watch fired"
        );
        if !event.session_state.is_terminated()
            && event.event_type != zk::EventType::NodeDataChanged
        {
            self.wakeups.wake(key);
        }
    }

    fn forget_ticket(&self, key: &LockKey, seq: u64) {
        lock(&self.tickets).remove(&(key.clone(), seq));
    }

    /// Grants the waiting node `node` (ours): marks it held and takes its fence.
    async fn grant(
        &self,
        zk: &zk::Client,
        parent: &str,
        path: &str,
        mut data: NodeData,
        version: i32,
    ) -> Result<Option<Grant>, Error> {
        let now = now_ms();
        data.held = true;
        data.since_ms = now;
        data.cap_ms = data.cap_ms.map(|hold| now.saturating_add(hold));
        data.expires_at_ms = now.saturating_add(data.ttl_ms);
        if let Some(cap) = data.cap_ms {
            data.expires_at_ms = data.expires_at_ms.min(cap);
        }
        let bytes = serde_json::to_vec(&data).unwrap_or_default();
        let stat = match call("try_acquire", zk.set_data(path, &bytes, Some(version))).await? {
            Ok(stat) => stat,
            Err(zk::Error::NoNode | zk::Error::BadVersion) => return Ok(None),
            Err(e) => return Err(unavailable("try_acquire", e)),
        };
        // The zxid of the granting write: above every earlier grant, ever.
        data.fence = u64::try_from(stat.mzxid).unwrap_or(0);
        let bytes = serde_json::to_vec(&data).unwrap_or_default();
        must("try_acquire", zk.set_data(path, &bytes, Some(stat.version))).await?;
        let fence = data.fence;
        self.update_parent(zk, "try_acquire", parent, |p| p.fence = p.fence.max(fence))
            .await?;
        let token = Token::from_client(data.token.clone());
        let current = {
            let session = lock(&self.session);
            let current = *session == Some(zk.session_id());
            if current {
                lock(&self.leases).insert(token.clone(), path.to_owned());
            }
            current
        };
        if !current {
            // The session was given up while granting: this lease was never vouched for.
            let _ = call("try_acquire", zk.delete(path, None)).await;
            return Err(unavailable(
                "try_acquire",
                Message("the ZooKeeper session was given up while granting".into()),
            ));
        }
        Ok(Some(Grant {
            token,
            fence: data.fence,
            count: 1,
            since_ms: data.since_ms,
            expires_at_ms: data.expires_at_ms,
        }))
    }
}

#[async_trait]
impl Backend for ZooKeeper {
    fn describe(&self) -> Description {
        Description {
            kind: "zookeeper",
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
            && lock(&self.inner.tickets).contains_key(&(t.key.clone(), t.seq))
        {
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
        let me = &self.inner;
        if me.is_revoked(token) {
            return Ok(None);
        }
        let zk = me.client().await?;
        let parent = me.key_path(key);
        for _ in 0..10 {
            let Some(node) = me.find(&zk, "renew", &parent, token).await? else {
                return Ok(None);
            };
            let Some(mut d) = node.data.clone() else {
                return Ok(None);
            };
            let now = now_ms();
            if d.expires_at_ms <= now {
                me.expire(&zk, "renew", &parent, &node).await?;
                return Ok(None);
            }
            let mut until = now.saturating_add(ttl.map_or(d.ttl_ms, ms));
            if let Some(cap) = d.cap_ms {
                until = until.min(cap);
            }
            d.expires_at_ms = until;
            let bytes = serde_json::to_vec(&d).unwrap_or_default();
            let path = format!("{parent}/{}", node.child.name);
            match call("renew", zk.set_data(&path, &bytes, Some(node.stat.version))).await? {
                Ok(_) => return Ok(Some(until)),
                Err(zk::Error::NoNode) => return Ok(None),
                Err(zk::Error::BadVersion) => continue,
                Err(e) => return Err(unavailable("renew", e)),
            }
        }
        Err(unavailable("renew", Message("lease kept changing".into())))
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, Error> {
        let me = &self.inner;
        if me.is_revoked(token) {
            return Ok(None);
        }
        let zk = me.client().await?;
        let parent = me.key_path(key);
        for _ in 0..10 {
            let Some(node) = me.find(&zk, "release", &parent, token).await? else {
                return Ok(None);
            };
            let Some(mut d) = node.data.clone() else {
                return Ok(None);
            };
            if d.expires_at_ms <= now_ms() {
                me.expire(&zk, "release", &parent, &node).await?;
                me.wakeups.wake(key);
                return Ok(None);
            }
            let path = format!("{parent}/{}", node.child.name);
            let version = Some(node.stat.version);
            let result = if d.count > 1 {
                d.count -= 1;
                let bytes = serde_json::to_vec(&d).unwrap_or_default();
                call("release", zk.set_data(&path, &bytes, version))
                    .await?
                    .map(|_| ())
            } else {
                d.count = 0;
                call("release", zk.delete(&path, version)).await?
            };
            match result {
                Ok(()) => {
                    if d.count == 0 {
                        lock(&me.leases).remove(token);
                        me.wakeups.wake(key);
                    }
                    return Ok(Some(d.count));
                }
                Err(zk::Error::NoNode) => return Ok(None),
                Err(zk::Error::BadVersion) => continue,
                Err(e) => return Err(unavailable("release", e)),
            }
        }
        Err(unavailable(
            "release",
            Message("lease kept changing".into()),
        ))
    }

    async fn status(&self, key: &LockKey, token: &Token) -> Result<Status, Error> {
        let me = &self.inner;
        if me.is_revoked(token) {
            return Ok(Status::Gone(Loss::Backend));
        }
        let ours = lock(&me.leases).contains_key(token);
        let zk = me.client().await?;
        let parent = me.key_path(key);
        let Some(node) = me.find(&zk, "status", &parent, token).await? else {
            // Our own lease gone without our knowledge: the session took it.
            return Ok(Status::Gone(if ours {
                Loss::Expired
            } else {
                Loss::Backend
            }));
        };
        let Some(d) = &node.data else {
            return Ok(Status::Gone(Loss::Backend));
        };
        if d.expires_at_ms <= now_ms() {
            me.expire(&zk, "status", &parent, &node).await?;
            lock(&me.leases).remove(token);
            me.wakeups.wake(key);
            return Ok(Status::Gone(Loss::Expired));
        }
        Ok(Status::Held {
            expires_at_ms: d.expires_at_ms,
        })
    }

    async fn inspect(&self, key: &LockKey) -> Result<State, Error> {
        let me = &self.inner;
        let zk = me.client().await?;
        let parent = me.key_path(key);
        let (children, nodes, limit) = me.snapshot(&zk, "inspect", key, &parent).await?;
        let (pdata, _) = me.parent_data(&zk, "inspect", &parent).await?;
        let holders: Vec<Holder> = nodes
            .iter()
            .filter(|n| n.is_held())
            .map(|n| n.holder(key.kind))
            .collect();
        let mut waiters = Vec::new();
        for c in children.iter() {
            if nodes.iter().any(|n| n.child.name == c.name && n.is_held()) {
                continue;
            }
            let Some(node) = me.read(&zk, "inspect", &parent, c).await? else {
                continue;
            };
            let (owner, sidecar, since_ms) = match &node.data {
                Some(d) => (d.owner.clone(), d.sidecar.clone(), d.queued_ms),
                None => (
                    "(foreign)".into(),
                    String::new(),
                    u64::try_from(node.stat.ctime).unwrap_or(0),
                ),
            };
            waiters.push(Waiter {
                owner,
                sidecar,
                mode: Held::of(key.kind, c.mode),
                position: waiters.len() + 1,
                since_ms,
            });
        }
        let fence = holders
            .iter()
            .map(|h| h.fence)
            .max()
            .unwrap_or(0)
            .max(pdata.fence);
        Ok(State {
            fence,
            limit: (key.kind == Kind::Semaphore && !children.is_empty()).then_some(limit),
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
        let me = &self.inner;
        let zk = me.client().await?;
        let mut keys = Vec::new();
        for kind in [Kind::Lock, Kind::Semaphore] {
            let dir = format!("{}/{}", me.root, kind.plural());
            let names = match call("list", zk.list_children(&dir)).await? {
                Ok(n) => n,
                Err(zk::Error::NoNode) => Vec::new(),
                Err(e) => return Err(unavailable("list", e)),
            };
            keys.extend(
                names
                    .iter()
                    .filter_map(|n| decode_name(n))
                    .map(|name| LockKey { kind, name }),
            );
        }
        keys.sort();
        let mut rows = Vec::new();
        for key in keys {
            if rows.len() >= limit {
                break;
            }
            if !key.name.as_str().starts_with(prefix) || after.is_some_and(|a| &key <= a) {
                continue;
            }
            let parent = me.key_path(&key);
            let (children, nodes, _) = me.snapshot(&zk, "list", &key, &parent).await?;
            if children.is_empty() {
                continue;
            }
            let held = nodes.iter().filter(|n| n.is_held()).count();
            let (pdata, _) = me.parent_data(&zk, "list", &parent).await?;
            let fence = nodes
                .iter()
                .filter(|n| n.is_held())
                .map(|n| n.holder(key.kind).fence)
                .max()
                .unwrap_or(0)
                .max(pdata.fence);
            rows.push(Summary {
                key,
                holders: held,
                waiters: children.len() - held,
                fence,
            });
        }
        Ok(rows)
    }

    async fn stale(&self, stale_after: Duration) -> Result<Vec<StaleKey>, Error> {
        let me = &self.inner;
        let zk = me.client().await?;
        let now = now_ms();
        let mut out = Vec::new();
        for kind in [Kind::Lock, Kind::Semaphore] {
            let dir = format!("{}/{}", me.root, kind.plural());
            let names = match call("stale", zk.list_children(&dir)).await? {
                Ok(n) => n,
                Err(zk::Error::NoNode) => Vec::new(),
                Err(e) => return Err(unavailable("stale", e)),
            };
            for segment in names {
                let parent = format!("{dir}/{segment}");
                let shown = format!("{}/{segment}", kind.plural());
                let (mut raw, pstat) = match call("stale", zk.get_children(&parent)).await? {
                    Ok(r) => r,
                    Err(zk::Error::NoNode) => continue,
                    Err(e) => return Err(unavailable("stale", e)),
                };
                raw.retain(|n| n != DELAY_NODE);
                if raw.is_empty() {
                    let age = now.saturating_sub(u64::try_from(pstat.mtime).unwrap_or(0));
                    let (pdata, _) = me.parent_data(&zk, "stale", &parent).await?;
                    let (marked, marker) = me.delay(&zk, "stale", &parent).await?;
                    let over = pdata.delay_until_ms.max(marked) <= now;
                    if over && let Some(version) = marker {
                        me.clear_delay(&zk, "stale", &parent, version).await;
                    }
                    // An empty parent whose lock-delay is over is removed; a
                    // container node would be removed by the server anyway.
                    let cleaned = over
                        && matches!(
                            call("stale", zk.delete(&parent, Some(pstat.version))).await?,
                            Ok(())
                        );
                    out.push(StaleKey {
                        key: parent.clone(),
                        reason: "empty-parent",
                        age_ms: age,
                        detail: if cleaned {
                            "lock node without claims; removed".into()
                        } else {
                            "lock node without claims".into()
                        },
                    });
                    continue;
                }
                for name in raw {
                    let path = format!("{parent}/{name}");
                    let (bytes, stat) = match call("stale", zk.get_data(&path)).await? {
                        Ok(r) => r,
                        Err(zk::Error::NoNode) => continue,
                        Err(e) => return Err(unavailable("stale", e)),
                    };
                    let age = now.saturating_sub(u64::try_from(stat.ctime).unwrap_or(0));
                    if stat.ephemeral_owner == 0 {
                        out.push(StaleKey {
                            key: path,
                            reason: "no-expiry",
                            age_ms: age,
                            detail: format!(
                                "non-ephemeral node under {shown}: it outlives every session and blocks the lock until deleted"
                            ),
                        });
                        continue;
                    }
                    let Ok(d) = serde_json::from_slice::<NodeData>(&bytes) else {
                        continue;
                    };
                    if !d.held {
                        continue;
                    }
                    if d.expires_at_ms <= now {
                        out.push(StaleKey {
                            key: path,
                            reason: "expired-not-cleaned",
                            age_ms: now - d.since_ms.min(now),
                            detail: format!(
                                "lease of owner {:?} on sidecar {:?} expired {} ms ago",
                                d.owner,
                                d.sidecar,
                                now - d.expires_at_ms
                            ),
                        });
                    } else if now.saturating_sub(d.since_ms) > ms(stale_after) {
                        out.push(StaleKey {
                            key: shown.clone(),
                            reason: "held-too-long",
                            age_ms: now - d.since_ms,
                            detail: format!(
                                "held by owner {:?} on sidecar {:?} with fence {} for longer than {}",
                                d.owner,
                                d.sidecar,
                                d.fence,
                                humantime::format_duration(stale_after)
                            ),
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    async fn force_release(&self, key: &LockKey) -> Result<Vec<Token>, Error> {
        let me = &self.inner;
        let zk = me.client().await?;
        let parent = me.key_path(key);
        let (_, nodes, _) = me.snapshot(&zk, "force_release", key, &parent).await?;
        let mut tokens = Vec::new();
        let mut delay = 0;
        for node in &nodes {
            let Some(d) = node.data.as_ref().filter(|d| d.held) else {
                continue;
            };
            let path = format!("{parent}/{}", node.child.name);
            match call("force_release", zk.delete(&path, None)).await? {
                Ok(()) => {
                    let token = Token::from_client(d.token.clone());
                    lock(&me.leases).remove(&token);
                    tokens.push(token);
                    delay = delay.max(d.lock_delay_ms);
                }
                Err(zk::Error::NoNode) => {}
                Err(e) => return Err(unavailable("force_release", e)),
            }
        }
        if delay > 0 {
            me.record_delay(
                &zk,
                "force_release",
                &parent,
                now_ms().saturating_add(delay),
            )
            .await?;
        }
        if !tokens.is_empty() {
            me.wakeups.wake(key);
        }
        Ok(tokens)
    }

    async fn watch(&self, _key: &LockKey) -> Result<Watch, Error> {
        // Every waiting node watches its blocker from the attempt that left it
        // waiting (before that attempt answered), so delivery is already in place.
        Ok(Box::new(()))
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

/// A claim node this sidecar is creating, or created, that nothing tracks
/// yet: not a lease, not a ticket. If the create's answer is lost
/// (`ConnectionLoss`: the node may exist all the same), or the request fails
/// or is cancelled before the node becomes a lease or a ticket, dropping
/// this deletes the node in the background. Otherwise the node would stay
/// while this sidecar's session lives, and block the queue for everyone.
/// The node is found by its name prefix, as Curator's protected mode does.
struct Unclaimed {
    me: Arc<Inner>,
    zk: zk::Client,
    parent: String,
    /// The node's name without its sequence: `_c_<uuid>-<infix>`.
    prefix: String,
    armed: bool,
}

impl Unclaimed {
    /// The node in `slot`, if any, is accounted for (a lease, a ticket, or
    /// deleted).
    fn settle(slot: &mut Option<Self>) {
        if let Some(mut node) = slot.take() {
            node.armed = false;
        }
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Outside a runtime (the process is ending) the session closes
        // with it, which deletes the node.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let discard = self.me.clone().discard(
                self.zk.clone(),
                std::mem::take(&mut self.parent),
                std::mem::take(&mut self.prefix),
            );
            runtime.spawn(discard);
        }
    }
}

impl Inner {
    /// Deletes the children of `parent` whose names start with `prefix`,
    /// retrying while ZooKeeper is unreachable, until they are gone, the
    /// session that owns them ends (which deletes them) or the backend
    /// closes.
    async fn discard(self: Arc<Self>, zk: zk::Client, parent: String, prefix: String) {
        let mut pause = Duration::from_millis(100);
        loop {
            let attempt = async {
                for name in zk.list_children(&parent).await? {
                    if name.starts_with(&prefix) {
                        match zk.delete(&format!("{parent}/{name}"), None).await {
                            Ok(()) | Err(zk::Error::NoNode) => {
                                tracing::info!(backend = "zookeeper", node = %name, %parent,
                                    "deleted a claim node its request could not account for");
                            }
                            Err(e) => return Err(e),
                        }
                    }
                }
                Ok(())
            };
            let done = tokio::select! {
                () = self.closing.cancelled() => return,
                r = tokio::time::timeout(OP_TIMEOUT, attempt) => r,
            };
            match done {
                Ok(
                    Ok(())
                    | Err(zk::Error::NoNode | zk::Error::SessionExpired | zk::Error::ClientClosed),
                ) => return,
                Ok(Err(e)) => tracing::debug!(backend = "zookeeper", error = %e, %parent,
                    "retrying the deletion of an unaccounted claim node"),
                Err(_) => {}
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }
}

impl ZooKeeper {
    async fn attempt(&self, claim: &Claim, turn: Turn<'_>) -> Result<Attempt, Error> {
        let me = &self.inner;
        let zk = me.client().await?;
        let key = &claim.key;
        let parent = me.key_path(key);
        let op = "try_acquire";

        // Re-entry: the same owner holding the lock in the same mode.
        if key.kind == Kind::Lock {
            let (_, nodes, _) = me.snapshot(&zk, op, key, &parent).await?;
            for node in &nodes {
                let Some(d) = &node.data else { continue };
                if !(d.held && d.owner == claim.owner && node.child.mode == claim.mode) {
                    continue;
                }
                let mut d = d.clone();
                let now = now_ms();
                d.count += 1;
                d.expires_at_ms = d.expires_at_ms.max(now.saturating_add(ms(claim.ttl)));
                if let Some(cap) = d.cap_ms {
                    d.expires_at_ms = d.expires_at_ms.min(cap);
                }
                let path = format!("{parent}/{}", node.child.name);
                let bytes = serde_json::to_vec(&d).unwrap_or_default();
                match call(op, zk.set_data(&path, &bytes, Some(node.stat.version))).await? {
                    Ok(_) => {}
                    Err(zk::Error::NoNode | zk::Error::BadVersion) => {
                        return Box::pin(self.try_acquire(claim, turn)).await;
                    }
                    Err(e) => return Err(unavailable(op, e)),
                }
                if let Turn::Queued(t) = turn {
                    self.dequeue(t).await?;
                }
                return Ok(Attempt::Granted(Grant {
                    token: Token::from_client(d.token.clone()),
                    fence: d.fence,
                    count: d.count,
                    since_ms: d.since_ms,
                    expires_at_ms: d.expires_at_ms,
                }));
            }
        }

        // Our node: the ticket's, or a new one (then untracked until it is
        // a lease or a ticket).
        let (name, mut unclaimed) = match turn {
            Turn::Queued(t) => {
                let known = lock(&me.tickets)
                    .get(&(key.clone(), t.seq))
                    .map(|q| q.name.clone());
                let Some(name) = known else {
                    return Err(unavailable(
                        op,
                        Message(
                            "the ZooKeeper session ended and this waiter's place went with it"
                                .into(),
                        ),
                    ));
                };
                (name, None)
            }
            Turn::Once | Turn::Join => {
                if key.kind == Kind::Semaphore && claim.limit.is_none() {
                    let children = me.children(&zk, op, &parent).await?;
                    if children.is_empty() {
                        return Err(Error::LimitRequired);
                    }
                }
                let data = NodeData {
                    token: Token::generate().expose().to_owned(),
                    owner: claim.owner.clone(),
                    sidecar: claim.sidecar.clone(),
                    held: false,
                    since_ms: 0,
                    expires_at_ms: 0,
                    ttl_ms: ms(claim.ttl),
                    cap_ms: claim.max_hold.map(ms),
                    lock_delay_ms: ms(claim.lock_delay),
                    count: 1,
                    fence: 0,
                    limit: claim.limit,
                    queued_ms: now_ms(),
                };
                let bytes = serde_json::to_vec(&data).unwrap_or_default();
                let infix = match (key.kind, claim.mode) {
                    (Kind::Semaphore, _) => EXCLUSIVE,
                    (Kind::Lock, Mode::Shared) => READ,
                    (Kind::Lock, Mode::Exclusive)
                        if matches_any(&me.rw_locks, key.name.as_str()) =>
                    {
                        WRITE
                    }
                    (Kind::Lock, Mode::Exclusive) => EXCLUSIVE,
                };
                // Armed before the create: its answer may be lost.
                let unclaimed = Unclaimed {
                    me: me.clone(),
                    zk: zk.clone(),
                    parent: parent.clone(),
                    prefix: node_prefix(infix),
                    armed: true,
                };
                let prefix = format!("{parent}/{}", unclaimed.prefix);
                let opts = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
                let mut tries = 0;
                let seq = loop {
                    match call(op, zk.create(&prefix, &bytes, &opts)).await? {
                        Ok((_, seq)) => break seq,
                        Err(zk::Error::NoNode) if tries < 5 => {
                            tries += 1;
                            me.ensure_parent(&zk, &parent).await?;
                        }
                        Err(e) => return Err(unavailable(op, e)),
                    }
                };
                (format!("{}{seq}", unclaimed.prefix), Some(unclaimed))
            }
        };
        let path = format!("{parent}/{name}");

        let (children, nodes, limit) = me.snapshot(&zk, op, key, &parent).await?;
        let Some(at) = children.iter().position(|c| c.name == name) else {
            if let Turn::Queued(t) = turn {
                me.forget_ticket(key, t.seq);
            }
            return Err(unavailable(
                op,
                Message("this waiter's node is gone (ZooKeeper session ended)".into()),
            ));
        };
        let seq = children[at].seq;
        // Semaphore limit: the first node's limit is the active one.
        if key.kind == Kind::Semaphore
            && let Some(asked) = claim.limit
            && asked != limit
        {
            if unclaimed.is_some()
                && let Ok(()) | Err(zk::Error::NoNode) = call(op, zk.delete(&path, None)).await?
            {
                Unclaimed::settle(&mut unclaimed);
            }
            return Err(Error::LimitMismatch { active: limit });
        }
        let own = me.read(&zk, op, &parent, &children[at]).await?;
        let Some(own) = own else {
            return Err(unavailable(
                op,
                Message("this claim's node vanished".into()),
            ));
        };
        let now = now_ms();
        let (pdata, _) = me.parent_data(&zk, op, &parent).await?;
        let ahead: Vec<&Node> = nodes.iter().filter(|n| n.child.seq < seq).collect();
        let queue_ahead = ahead.iter().filter(|n| !n.is_held()).count();
        let by_place = admitted(&children, at, key.kind, limit);
        // Once/Join: busy while anyone waits ahead (fairness).
        let fair = !matches!(turn, Turn::Once | Turn::Join)
            || (queue_ahead == 0
                && children[..at]
                    .iter()
                    .all(|c| nodes.iter().any(|n| n.child.name == c.name)));
        // Parents written before delay nodes existed may carry a delay too.
        let (marked, marker) = me.delay(&zk, op, &parent).await?;
        let delay_until = marked.max(pdata.delay_until_ms);
        let delayed = delay_until > now;
        if !delayed && let Some(version) = marker {
            me.clear_delay(&zk, op, &parent, version).await;
        }
        if by_place
            && fair
            && !delayed
            && let Some(d) = own.data.clone()
            && let Some(grant) = me.grant(&zk, &parent, &path, d, own.stat.version).await?
        {
            if let Turn::Queued(t) = turn {
                me.forget_ticket(key, t.seq);
            }
            Unclaimed::settle(&mut unclaimed);
            return Ok(Attempt::Granted(grant));
        }

        // Busy.
        let holders: Vec<Holder> = nodes
            .iter()
            .filter(|n| n.is_held())
            .map(|n| n.holder(claim.key.kind))
            .collect();
        let blocking = nodes
            .iter()
            .filter(|n| n.child.seq < seq && n.is_held())
            .filter(|n| claim.mode == Mode::Exclusive || n.child.mode == Mode::Exclusive)
            .map(|n| n.holder(claim.key.kind).expires_at_ms)
            .min();
        let retry_at_ms = if delayed { Some(delay_until) } else { blocking };
        let waiting_total = children.len() - holders.len().min(children.len());
        let mut busy = Busy {
            holders,
            queue_length: waiting_total,
            position: None,
            retry_at_ms,
            ticket: None,
        };
        let position = children[..at]
            .iter()
            .filter(|c| !nodes.iter().any(|n| n.child.name == c.name && n.is_held()))
            .count()
            + 1;
        match turn {
            Turn::Once => {
                if let Ok(()) | Err(zk::Error::NoNode) = call(op, zk.delete(&path, None)).await? {
                    Unclaimed::settle(&mut unclaimed);
                }
                busy.queue_length = waiting_total.saturating_sub(1);
                return Ok(Attempt::Busy(busy));
            }
            Turn::Join => {
                lock(&me.tickets).insert(
                    (key.clone(), seq),
                    Queued {
                        name: name.clone(),
                        following: false,
                    },
                );
                Unclaimed::settle(&mut unclaimed);
                busy.ticket = Some(Ticket {
                    key: key.clone(),
                    seq,
                });
                busy.position = Some(position);
            }
            Turn::Queued(_) => busy.position = Some(position),
        }
        // Watch what blocks this node before answering, so no release is missed.
        let follower = me.clone();
        let (zk2, key2, parent2) = (zk.clone(), key.clone(), parent.clone());
        let following = lock(&me.tickets)
            .get(&(key.clone(), seq))
            .is_some_and(|q| q.following);
        if !following {
            tokio::spawn(follower.follow(zk2, key2, parent2, name, children));
        }
        Ok(Attempt::Busy(busy))
    }

    async fn dequeue_node(&self, ticket: &Ticket) -> Result<(), Error> {
        let me = &self.inner;
        let name = lock(&me.tickets)
            .remove(&(ticket.key.clone(), ticket.seq))
            .map(|q| q.name);
        let Some(name) = name else { return Ok(()) };
        let zk = me.client().await?;
        let parent = me.key_path(&ticket.key);
        let path = format!("{parent}/{name}");
        match call("dequeue", zk.delete(&path, None)).await {
            Ok(Ok(()) | Err(zk::Error::NoNode)) => Ok(()),
            Ok(Err(e)) => Err(unavailable("dequeue", e)),
            // The ticket is forgotten already: its node must not outlive it.
            Err(e) => {
                tokio::spawn(me.clone().discard(zk, parent, name));
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{DELAY_NODE, Mode, matches_any, parse_child, sorted};

    #[test]
    fn rw_lock_patterns_match_names_and_prefixes() {
        let patterns = vec!["orders".to_owned(), "billing-*".to_owned()];
        assert!(matches_any(&patterns, "orders"));
        assert!(!matches_any(&patterns, "orders-2"));
        assert!(matches_any(&patterns, "billing-eu"));
        assert!(matches_any(&patterns, "billing-"));
        assert!(!matches_any(&patterns, "billing"));
        assert!(!matches_any(&[], "orders"));
    }

    #[test]
    fn curator_names_parse_to_modes_and_the_delay_node_is_no_claim() {
        let write = parse_child("_c_0a-__WRIT__0000000007").expect("a claim");
        assert_eq!((write.seq, write.mode), (7, Mode::Exclusive));
        let read = parse_child("_c_0a-__READ__0000000005").expect("a claim");
        assert_eq!((read.seq, read.mode), (5, Mode::Shared));
        let mutex = parse_child("_c_0a-lock-0000000006").expect("a claim");
        assert_eq!(mutex.mode, Mode::Exclusive);
        assert!(parse_child(DELAY_NODE).is_none());
        let order: Vec<u64> = sorted(vec![
            "_c_0a-__WRIT__0000000007".into(),
            DELAY_NODE.into(),
            "_c_0b-lock-0000000006".into(),
            "_c_0c-__READ__0000000005".into(),
        ])
        .iter()
        .map(|c| c.seq)
        .collect();
        assert_eq!(order, [5, 6, 7]);
    }
}
