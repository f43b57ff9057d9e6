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

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{AsyncConnectionConfig, Cmd, ErrorKind, RedisError, RedisFuture, Script, Value};
use serde::Deserialize;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::{
    Attempt, Backend, Busy, Description, Error, Grant, Holder, Loss, Options, Safety, StaleKey,
    State, Status, Summary, Ticket, Turn, Waiter, Watch,
};
use crate::clock::{ms, now_ms};
use crate::lock::{Claim, Held, Kind, LockKey, Mode, Token};
use crate::wakeups::Wakeups;

/// How often this sidecar refreshes its waiters' heartbeats.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);
/// A waiter whose sidecar has not refreshed it for this long is dropped.
const HEARTBEAT_TTL: Duration = Duration::from_secs(15);
/// Connect and response timeout of every Redis call.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

const PRELUDE: &str = include_str!("redis/prelude.lua");

fn script(body: &str) -> Script {
    fast_script("", body)
}

/// A script whose `fast` head runs before the prelude and returns when it
/// can: the prelude's set-up is a good part of a short script's time.
fn fast_script(fast: &str, body: &str) -> Script {
    Script::new(&format!("{fast}\n{PRELUDE}\n{body}"))
}

/// The suffixes of a lock's side keys `{<base>}:<suffix>`, in the order the
/// scripts' `KEYS` hold them (after the base key, before the index).
const SIDE_KEYS: [&str; 9] = [
    "holders",
    "expiry",
    "fence",
    "queue",
    "waiters",
    "heartbeat",
    "delay",
    "limit",
    "seq",
];

/// The compiled scripts.
struct Scripts {
    acquire: Script,
    release: Script,
    renew: Script,
    status: Script,
    inspect: Script,
    force_release: Script,
    dequeue: Script,
    heartbeat: Script,
    reconcile: Script,
    raise_fence: Script,
    stale: Script,
}

impl Scripts {
    fn new() -> Self {
        Self {
            acquire: fast_script(
                include_str!("redis/acquire_fast.lua"),
                include_str!("redis/acquire.lua"),
            ),
            release: fast_script(
                include_str!("redis/release_fast.lua"),
                include_str!("redis/release.lua"),
            ),
            renew: script(include_str!("redis/renew.lua")),
            status: script(include_str!("redis/status.lua")),
            inspect: script(include_str!("redis/inspect.lua")),
            force_release: script(include_str!("redis/force_release.lua")),
            dequeue: script(include_str!("redis/dequeue.lua")),
            heartbeat: script(include_str!("redis/heartbeat.lua")),
            reconcile: script(include_str!("redis/reconcile.lua")),
            raise_fence: script(include_str!("redis/raise_fence.lua")),
            stale: script(include_str!("redis/stale.lua")),
        }
    }
}

/// One script call, `EVALSHA <sha> <keys> <key>… <arg>…`, written straight
/// into one command buffer: redis-rs's `ScriptInvocation` keeps every key
/// and argument in an allocation of its own and copies them into the
/// command at the call, some 40 allocations per uncontended acquire and
/// release.
struct Call<'a> {
    script: &'a Script,
    cmd: Cmd,
}

impl<'a> Call<'a> {
    /// A call whose first `keys` arguments are its keys.
    fn new(script: &'a Script, keys: usize) -> Self {
        let mut cmd = Cmd::with_capacity(32, 512);
        cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys);
        Self { script, cmd }
    }

    /// Appends a key or an argument, in order.
    fn arg<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.cmd.arg(arg);
        self
    }

    /// Runs the call, loading the script first if the server does not know it.
    async fn invoke<T: redis::FromRedisValue>(&self, c: &mut Conn) -> Result<T, RedisError> {
        match self.cmd.query_async(c).await {
            Err(e) if e.kind() == ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.script.load_async(c).await?;
                self.cmd.query_async(c).await
            }
            other => other,
        }
    }
}

/// How to reach the Redis deployment.
enum Target {
    Single(redis::Client),
    Sentinel(tokio::sync::Mutex<SentinelClient>),
    Cluster {
        client: ClusterClient,
        /// The seed nodes, for the pub/sub connection.
        seeds: Vec<redis::Client>,
    },
}

/// A live connection of either shape.
#[derive(Clone)]
enum Conn {
    Plain(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Plain(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Plain(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Plain(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

fn config() -> AsyncConnectionConfig {
    AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CALL_TIMEOUT))
        .set_response_timeout(Some(CALL_TIMEOUT))
}

/// One logical Redis (a server, a Sentinel-managed master, or a Cluster)
/// with sidelock's key layout and scripts. Redlock runs several of these.
pub struct Node {
    target: Target,
    /// The cached connection; dropped after a connection-level error so the
    /// next call reconnects (and, with Sentinel, asks for the master again).
    /// A plain mutex, held only to clone or replace it: every call takes it,
    /// and an async mutex would park and wake callers that contend for it.
    conn: Mutex<Option<Conn>>,
    /// Held while connecting, so that callers finding no connection make one.
    connecting: tokio::sync::Mutex<()>,
    scripts: Scripts,
    prefix: String,
    /// Server clock minus ours, in ms, as last settled (`i64::MIN`: not yet).
    skew: std::sync::atomic::AtomicI64,
    /// Where this node's URL is shown (without password).
    pub url: String,
    /// The index key, `<prefix>/index`: no lock or semaphore key has a `/`
    /// right after the prefix.
    index: String,
    /// Where earlier versions kept the index: `<prefix>index`, the key
    /// of the lock named `index` now. Its entries are moved to [`Node::index`]
    /// by the next listing (see [`Node::adopt_legacy_index`]).
    legacy_index: String,
}

/// Converts a URL error into the operator's sentence (the URL without its password).
fn bad_url(url: &str, e: impl std::fmt::Display) -> String {
    format!("backend URL {:?}: {e}", super::redact(url))
}

/// `scheme://a:1,b:2/rest` → (["a:1","b:2"], "rest"), keeping user info on every host.
pub fn split_hosts(url: &str) -> Result<(String, Vec<String>, String), String> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| bad_url(url, "missing ://"))?;
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((u, r)) => (format!("{u}@"), r),
        None => (String::new(), rest),
    };
    let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
    let hosts: Vec<String> = hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(|h| format!("{userinfo}{h}"))
        .collect();
    if hosts.is_empty() {
        return Err(bad_url(url, "no host given"));
    }
    Ok((scheme.to_owned(), hosts, path.to_owned()))
}

impl Node {
    /// A node for `url`: `redis://host:port/db`, `rediss://…`,
    /// `redis+sentinel://s1:p,s2:p/<master>[/db]`, `redis+cluster://h1:p,h2:p`.
    ///
    /// # Errors
    /// A sentence naming what is wrong with the URL.
    pub fn open(url: &str, prefix: &str) -> Result<Self, String> {
        let (scheme, hosts, path) = split_hosts(url)?;
        let base = if scheme.starts_with("rediss") {
            "rediss"
        } else {
            "redis"
        };
        let target = match scheme.as_str() {
            "redis" | "rediss" => {
                Target::Single(redis::Client::open(url).map_err(|e| bad_url(url, e))?)
            }
            "redis+sentinel" | "rediss+sentinel" => {
                let mut parts = path.split('/').filter(|p| !p.is_empty());
                let master = parts.next().ok_or_else(|| {
                    bad_url(
                        url,
                        "name the master: redis+sentinel://host:port,host:port/<master>[/db]",
                    )
                })?;
                let db: i64 = match parts.next() {
                    Some(d) => d
                        .parse()
                        .map_err(|_| bad_url(url, "the database must be a number"))?,
                    None => 0,
                };
                let sentinels: Vec<String> =
                    hosts.iter().map(|h| format!("{base}://{h}")).collect();
                let node_info = redis::sentinel::SentinelNodeConnectionInfo::default()
                    .set_redis_connection_info(redis::RedisConnectionInfo::default().set_db(db));
                let client = SentinelClient::build(
                    sentinels,
                    master,
                    Some(node_info),
                    SentinelServerType::Master,
                )
                .map_err(|e| bad_url(url, e))?;
                Target::Sentinel(tokio::sync::Mutex::new(client))
            }
            "redis+cluster" | "rediss+cluster" => {
                let nodes: Vec<String> = hosts.iter().map(|h| format!("{base}://{h}")).collect();
                let client = ClusterClient::builder(nodes.clone())
                    .connection_timeout(CALL_TIMEOUT)
                    .response_timeout(CALL_TIMEOUT)
                    .build()
                    .map_err(|e| bad_url(url, e))?;
                let seeds = nodes
                    .iter()
                    .map(|n| redis::Client::open(n.as_str()).map_err(|e| bad_url(url, e)))
                    .collect::<Result<_, _>>()?;
                Target::Cluster { client, seeds }
            }
            other => return Err(bad_url(url, format!("unknown scheme {other:?}"))),
        };
        if prefix.contains(['{', '}']) {
            return Err(format!(
                "--redis-prefix {prefix:?} must not contain braces (they are Cluster hash tags)"
            ));
        }
        Ok(Self {
            target,
            conn: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            scripts: Scripts::new(),
            prefix: prefix.to_owned(),
            skew: std::sync::atomic::AtomicI64::new(i64::MIN),
            url: super::redact(url),
            index: format!("{prefix}/index"),
            legacy_index: format!("{prefix}index"),
        })
    }

    fn is_cluster(&self) -> bool {
        matches!(self.target, Target::Cluster { .. })
    }

    async fn connect(&self) -> Result<Conn, RedisError> {
        match &self.target {
            Target::Single(c) => Ok(Conn::Plain(
                c.get_multiplexed_async_connection_with_config(&config())
                    .await?,
            )),
            Target::Sentinel(s) => {
                let client = s.lock().await.async_get_client().await?;
                Ok(Conn::Plain(
                    client
                        .get_multiplexed_async_connection_with_config(&config())
                        .await?,
                ))
            }
            Target::Cluster { client, .. } => {
                Ok(Conn::Cluster(client.get_async_connection().await?))
            }
        }
    }

    /// A client for the pub/sub connection: the server, the current master,
    /// or a reachable Cluster node (Cluster PUBLISH reaches every node).
    async fn pubsub_client(&self) -> Result<redis::Client, RedisError> {
        match &self.target {
            Target::Single(c) => Ok(c.clone()),
            Target::Sentinel(s) => s.lock().await.async_get_client().await,
            Target::Cluster { seeds, .. } => {
                let mut last = None;
                for seed in seeds {
                    match seed
                        .get_multiplexed_async_connection_with_config(&config())
                        .await
                    {
                        Ok(_) => return Ok(seed.clone()),
                        Err(e) => last = Some(e),
                    }
                }
                Err(last.unwrap_or_else(|| RedisError::from((ErrorKind::Io, "no cluster node"))))
            }
        }
    }

    /// Runs `f` on the cached connection, reconnecting first if needed, and
    /// forgets the connection after a connection-level failure.
    async fn with_conn<T, F>(&self, op: &'static str, f: F) -> Result<T, Error>
    where
        F: AsyncFnOnce(&mut Conn) -> Result<T, RedisError>,
    {
        let mut conn = self.connection(op).await?;
        match f(&mut conn).await {
            Ok(v) => Ok(v),
            Err(e) => {
                if e.is_connection_dropped()
                    || e.is_io_error()
                    || e.is_timeout()
                    || e.is_connection_refusal()
                    || e.kind() == ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
                {
                    *lock(&self.conn) = None;
                }
                Err(unavailable(op, e))
            }
        }
    }

    /// The cached connection, made first if there is none.
    async fn connection(&self, op: &'static str) -> Result<Conn, Error> {
        if let Some(c) = lock(&self.conn).clone() {
            return Ok(c);
        }
        let _connecting = self.connecting.lock().await;
        // Made by the caller that held the lock before.
        if let Some(c) = lock(&self.conn).clone() {
            return Ok(c);
        }
        let c = tokio::time::timeout(CALL_TIMEOUT, self.connect())
            .await
            .map_err(|_| unavailable(op, RedisError::from((ErrorKind::Io, "connect timed out"))))?
            .map_err(|e| unavailable(op, e))?;
        *lock(&self.conn) = Some(c.clone());
        Ok(c)
    }

    /// The main key of `key`; its side keys are `{<base>}:<suffix>`.
    ///
    /// The mapping from (kind, name) to keys is injective, and no name
    /// reaches a key sidelock keeps for itself: a lock is `<prefix><name>`
    /// (the classic `SET NX` key), a semaphore `<prefix>semaphores/<name>`,
    /// and `<prefix>elections/<name>` is kept for elections; names have no
    /// `/`, so none of these can equal another kind's key or the index
    /// `<prefix>/index`, and no `{` or `}` (nor has the prefix), so none can
    /// equal a side key. Channels (`<prefix>wake:<kind>/<name>`) live in
    /// pub/sub's own namespace and carry the kind.
    fn base(&self, key: &LockKey) -> String {
        // Built by hand: this runs for every script call, and `format!` costs
        // several times more than the copies.
        let kind = match key.kind {
            Kind::Lock => "",
            Kind::Semaphore => "semaphores/",
        };
        let name = key.name.as_str();
        let mut base = String::with_capacity(self.prefix.len() + kind.len() + name.len());
        base.push_str(&self.prefix);
        base.push_str(kind);
        base.push_str(name);
        base
    }

    /// The key a lock's exclusive holder is stored under.
    pub fn main_key(&self, key: &LockKey) -> String {
        self.base(key)
    }

    fn channel(&self, key: &LockKey) -> String {
        format!("{}wake:{key}", self.prefix)
    }

    /// Prepares a script call with the lock's keys and the common arguments.
    fn invocation<'a>(&self, script: &'a Script, key: &LockKey) -> Call<'a> {
        let base = self.base(key);
        // A Cluster cannot touch a global index from a lock's slot.
        let index = !self.is_cluster();
        let mut inv = Call::new(script, 1 + SIDE_KEYS.len() + usize::from(index));
        inv.arg(&base);
        // One buffer for every side key `{base}:<suffix>`.
        let mut side = String::with_capacity(base.len() + 12);
        side.push('{');
        side.push_str(&base);
        side.push_str("}:");
        let stem = side.len();
        for suffix in SIDE_KEYS {
            side.truncate(stem);
            side.push_str(suffix);
            inv.arg(side.as_str());
        }
        if index {
            inv.arg(self.index.as_str());
        }
        inv.arg(match key.kind {
            Kind::Lock => "l",
            Kind::Semaphore => "s",
        });
        // The channel is `<prefix>wake:<kind>/<name>`, the index member `<kind>/<name>`.
        let member_at = self.prefix.len() + "wake:".len();
        let mut channel = String::with_capacity(member_at + 11 + key.name.as_str().len());
        channel.push_str(&self.prefix);
        channel.push_str("wake:");
        channel.push_str(key.kind.plural());
        channel.push('/');
        channel.push_str(key.name.as_str());
        inv.arg(channel.as_str());
        inv.arg(&channel[member_at..]);
        inv
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        inv: Call<'_>,
    ) -> Result<T, Error> {
        self.with_conn(op, async |c| inv.invoke(c).await).await
    }

    /// Records a key in use in the Cluster index (single nodes do it in the scripts).
    async fn index(&self, key: &LockKey) {
        if self.is_cluster() {
            let index = &self.index;
            let member = key.to_string();
            let _ = self
                .with_conn("index", async |c| {
                    redis::cmd("ZADD")
                        .arg(index)
                        .arg("NX")
                        .arg(0)
                        .arg(&member)
                        .query_async::<i64>(c)
                        .await
                })
                .await;
        }
    }

    /// One acquire attempt with `token` as the new lease's token; see the
    /// `Backend` contract. With `fifo` off the queue is shown but not enforced.
    /// A semaphore whose limit is above `max_permits` (0: any) is refused
    /// with [`Error::Unsupported`] before anything is written.
    pub async fn try_acquire(
        &self,
        claim: &Claim,
        step: Step,
        token: &Token,
        fifo: bool,
        max_permits: u32,
    ) -> Result<Attempt, Error> {
        let mut inv = self.invocation(&self.scripts.acquire, &claim.key);
        let (turn_arg, seq) = match step {
            Step::Once => ("once", String::new()),
            Step::Join => ("join", String::new()),
            Step::Queued(seq) => ("queued", seq.to_string()),
        };
        inv.arg(turn_arg)
            .arg(seq)
            .arg(token.expose())
            .arg(&claim.owner)
            .arg(&claim.sidecar)
            .arg(mode_arg(claim.mode))
            .arg(ms(claim.ttl))
            .arg(claim.max_hold.map_or(0, ms))
            .arg(ms(claim.lock_delay))
            .arg(claim.limit.unwrap_or(0))
            .arg(ms(HEARTBEAT_TTL))
            .arg(if fifo { "1" } else { "0" })
            .arg(max_permits);
        let reply: Vec<Value> = self.run("try_acquire", inv).await?;
        let clock = self.clock(&reply, 1);
        let attempt = match int(&reply, 0) {
            1 => Attempt::Granted(Grant {
                token: Token::from_client(text(&reply, 2)),
                fence: int(&reply, 3) as u64,
                count: int(&reply, 4) as u32,
                since_ms: clock.local(int(&reply, 5)),
                expires_at_ms: clock.local(int(&reply, 6)),
            }),
            0 => {
                let seq = int(&reply, 6);
                let position = int(&reply, 4);
                let retry = int(&reply, 5);
                Attempt::Busy(Busy {
                    holders: holders(&text(&reply, 2), claim.key.kind, &clock),
                    queue_length: int(&reply, 3) as usize,
                    position: (position > 0).then_some(position as usize),
                    retry_at_ms: (retry > 0).then(|| clock.local(retry)),
                    ticket: (seq > 0).then(|| Ticket {
                        key: claim.key.clone(),
                        seq: seq as u64,
                    }),
                })
            }
            2 => {
                return Err(Error::LimitMismatch {
                    active: int(&reply, 2) as u32,
                });
            }
            5 => {
                return Err(Error::KeyConflict {
                    key: text(&reply, 2),
                    found: text(&reply, 3),
                });
            }
            4 => {
                return Err(Error::Unsupported(format!(
                    "this semaphore is in use with limit {}, above the {max_permits} this backend allows",
                    int(&reply, 2)
                )));
            }
            _ => return Err(Error::LimitRequired),
        };
        let fresh = matches!(&attempt, Attempt::Granted(g) if g.count == 1)
            || matches!(&attempt, Attempt::Busy(b) if b.ticket.is_some());
        if fresh {
            self.index(&claim.key).await;
        }
        Ok(attempt)
    }

    /// Leaves the queue.
    pub async fn dequeue(&self, key: &LockKey, seq: u64) -> Result<(), Error> {
        let mut inv = self.invocation(&self.scripts.dequeue, key);
        inv.arg(seq);
        self.run::<i64>("dequeue", inv).await.map(|_| ())
    }

    /// Renews; `Some(local expiry)` or `None` when the token holds nothing.
    pub async fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, Error> {
        let mut inv = self.invocation(&self.scripts.renew, key);
        inv.arg(token.expose()).arg(ttl.map_or(0, ms));
        let reply: Vec<Value> = self.run("renew", inv).await?;
        let clock = self.clock(&reply, 0);
        let e = int(&reply, 1);
        Ok((e >= 0).then(|| clock.local(e)))
    }

    /// Releases one hold.
    pub async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, Error> {
        let mut inv = self.invocation(&self.scripts.release, key);
        inv.arg(token.expose());
        let reply: Vec<Value> = self.run("release", inv).await?;
        let n = int(&reply, 1);
        Ok((n >= 0).then_some(n as u32))
    }

    /// Whether the lease still holds.
    pub async fn status(&self, key: &LockKey, token: &Token) -> Result<Status, Error> {
        let mut inv = self.invocation(&self.scripts.status, key);
        inv.arg(token.expose());
        let reply: Vec<Value> = self.run("status", inv).await?;
        let clock = self.clock(&reply, 0);
        let e = int(&reply, 1);
        Ok(if e >= 0 {
            Status::Held {
                expires_at_ms: clock.local(e),
            }
        } else {
            Status::Gone(Loss::Expired)
        })
    }

    /// The global state of one key.
    pub async fn inspect(&self, key: &LockKey) -> Result<State, Error> {
        let inv = self.invocation(&self.scripts.inspect, key);
        let reply: Vec<Value> = self.run("inspect", inv).await?;
        if reply.len() > 5 {
            return Err(Error::KeyConflict {
                key: text(&reply, 5),
                found: text(&reply, 6),
            });
        }
        let clock = self.clock(&reply, 0);
        let limit = int(&reply, 2);
        Ok(State {
            fence: int(&reply, 1) as u64,
            limit: (limit > 0).then_some(limit as u32),
            holders: holders(&text(&reply, 3), key.kind, &clock),
            waiters: waiters(&text(&reply, 4), key.kind, &clock),
        })
    }

    /// Removes every lease of a key, returning their tokens.
    pub async fn force_release(&self, key: &LockKey) -> Result<Vec<Token>, Error> {
        let inv = self.invocation(&self.scripts.force_release, key);
        let tokens: Vec<String> = self.run("force_release", inv).await?;
        Ok(tokens.into_iter().map(Token::from_client).collect())
    }

    /// Keeps this sidecar's waiters on one key alive.
    async fn heartbeat(&self, key: &LockKey, sidecar: &str) -> Result<(), Error> {
        let mut inv = self.invocation(&self.scripts.heartbeat, key);
        inv.arg(ms(HEARTBEAT_TTL)).arg(sidecar);
        self.run::<i64>("heartbeat", inv).await.map(|_| ())
    }

    /// Drops `sidecar`'s queued tickets on `key` other than `live`.
    async fn reconcile(&self, key: &LockKey, sidecar: &str, live: &[u64]) -> Result<(), Error> {
        let mut inv = self.invocation(&self.scripts.reconcile, key);
        inv.arg(sidecar);
        for seq in live {
            inv.arg(*seq);
        }
        self.run::<i64>("reconcile", inv).await.map(|_| ())
    }

    /// Raises the key's fence counter to at least `fence`.
    pub async fn raise_fence(&self, key: &LockKey, fence: u64) -> Result<(), Error> {
        let mut inv = self.invocation(&self.scripts.raise_fence, key);
        inv.arg(fence);
        self.run::<i64>("raise_fence", inv).await.map(|_| ())
    }

    /// Answers PING.
    pub async fn ping(&self) -> Result<(), Error> {
        self.with_conn("ping", async |c| {
            redis::cmd("PING").query_async::<String>(c).await
        })
        .await
        .map(|_| ())
    }

    /// Keys in the index after `after`, in order, `chunk` at a time.
    async fn indexed(&self, after: Option<&str>, chunk: usize) -> Result<Vec<String>, Error> {
        let index = &self.index;
        let min = after.map_or_else(|| "-".to_owned(), |a| format!("({a}"));
        self.with_conn("list", async |c| {
            redis::cmd("ZRANGEBYLEX")
                .arg(index)
                .arg(&min)
                .arg("+")
                .arg("LIMIT")
                .arg(0)
                .arg(chunk)
                .query_async::<Vec<String>>(c)
                .await
        })
        .await
    }

    async fn unindex(&self, member: &str) {
        let index = &self.index;
        let _ = self
            .with_conn("list", async |c| {
                redis::cmd("ZREM")
                    .arg(index)
                    .arg(member)
                    .query_async::<i64>(c)
                    .await
            })
            .await;
    }

    /// Moves the entries of the index that earlier versions kept at
    /// `<prefix>index` into the index, so a rolling upgrade loses no
    /// listing: entries older sidecars add there are taken over by the next
    /// listing, and the key goes once they stop (then the lock named `index`
    /// can be used; until then it is a foreign holder). Entries that are no
    /// key are dropped, as the listing drops them from the index.
    async fn adopt_legacy_index(&self) -> Result<(), Error> {
        let (old, new) = (&self.legacy_index, &self.index);
        self.with_conn("list", async |c| {
            let found: String = redis::cmd("TYPE").arg(old).query_async(c).await?;
            if found != "zset" {
                return Ok(());
            }
            let members: Vec<String> = redis::cmd("ZRANGE")
                .arg(old)
                .arg(0)
                .arg(-1)
                .query_async(c)
                .await?;
            let keys: Vec<&String> = members
                .iter()
                .filter(|m| LockKey::parse(m).is_some())
                .collect();
            if !keys.is_empty() {
                let mut add = redis::cmd("ZADD");
                add.arg(new).arg("NX");
                for k in &keys {
                    add.arg(0).arg(k.as_str());
                }
                add.query_async::<i64>(c).await?;
            }
            if !members.is_empty() {
                redis::cmd("ZREM")
                    .arg(old)
                    .arg(&members)
                    .query_async::<i64>(c)
                    .await?;
            }
            Ok(())
        })
        .await
    }

    /// Held or contended keys, from the index.
    pub async fn list(
        &self,
        prefix: &str,
        after: Option<&LockKey>,
        limit: usize,
    ) -> Result<Vec<Summary>, Error> {
        self.adopt_legacy_index().await?;
        let mut rows = Vec::new();
        let mut cursor = after.map(ToString::to_string);
        loop {
            let chunk = self.indexed(cursor.as_deref(), 200).await?;
            let Some(last) = chunk.last() else { break };
            cursor = Some(last.clone());
            for member in &chunk {
                let Some(key) = LockKey::parse(member) else {
                    self.unindex(member).await;
                    continue;
                };
                if !key.name.as_str().starts_with(prefix) {
                    continue;
                }
                let state = match self.inspect(&key).await {
                    // Unreadable until an operator removes the key; `/v1/stale` names it.
                    Err(Error::KeyConflict { .. }) => continue,
                    other => other?,
                };
                if state.holders.is_empty() && state.waiters.is_empty() {
                    self.unindex(member).await;
                    continue;
                }
                rows.push(Summary {
                    key,
                    holders: state.holders.len(),
                    waiters: state.waiters.len(),
                    fence: state.fence,
                });
                if rows.len() >= limit {
                    return Ok(rows);
                }
            }
        }
        Ok(rows)
    }

    /// Stale entries of the keys in use (holders too old, expired but not
    /// cleaned, orphaned waiters), plus keys without expiry among lock keys
    /// and keys matching `legacy`.
    pub async fn stale(
        &self,
        stale_after: Duration,
        legacy: Option<&str>,
    ) -> Result<Vec<StaleKey>, Error> {
        self.adopt_legacy_index().await?;
        let mut out = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let chunk = self.indexed(cursor.as_deref(), 200).await?;
            let Some(last) = chunk.last() else { break };
            cursor = Some(last.clone());
            for member in &chunk {
                let Some(key) = LockKey::parse(member) else {
                    continue;
                };
                let mut inv = self.invocation(&self.scripts.stale, &key);
                inv.arg(ms(stale_after));
                let found: Vec<Vec<Value>> = self.run("stale", inv).await?;
                for entry in found {
                    out.push(StaleKey {
                        key: text(&entry, 0),
                        reason: reason_of(&text(&entry, 1)),
                        age_ms: int(&entry, 2).max(0) as u64,
                        detail: text(&entry, 3),
                    });
                }
            }
        }
        {
            let mut patterns = vec![format!("{}*", glob_escape(&self.prefix))];
            patterns.extend(legacy.map(str::to_owned));
            for pattern in patterns {
                for k in self.scan_without_expiry(&pattern).await? {
                    let legacy_key = !k.starts_with(&self.prefix);
                    out.push(StaleKey {
                        detail: if legacy_key {
                            format!("key {k:?} matches --legacy-pattern and has no expiry: a lock left by hand-written SETNX code blocks forever")
                        } else {
                            format!("lock key {k:?} has no expiry: whoever set it never set PX, so it will never be freed")
                        },
                        key: k,
                        reason: super::StaleReason::NoExpiry,
                        age_ms: 0,
                    });
                }
            }
        }
        Ok(out)
    }

    /// Connections that together see every key: the server, or each Cluster
    /// master (from `CLUSTER NODES`), for SCAN.
    async fn scan_connections(&self) -> Result<Vec<Conn>, Error> {
        let Target::Cluster { seeds, .. } = &self.target else {
            return self.with_conn("stale", async |c| Ok(vec![c.clone()])).await;
        };
        let nodes: String = self
            .with_conn("stale", async |c| {
                redis::cmd("CLUSTER").arg("NODES").query_async(c).await
            })
            .await?;
        let tls = seeds.first().is_some_and(|s| {
            matches!(
                s.get_connection_info().addr(),
                redis::ConnectionAddr::TcpTls { .. }
            )
        });
        let mut conns = Vec::new();
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(addr), Some(flags)) = (fields.get(1), fields.get(2)) else {
                continue;
            };
            if !flags.split(',').any(|f| f == "master") || flags.contains("fail") {
                continue;
            }
            let host_port = addr.split('@').next().unwrap_or(addr);
            let url = format!("{}://{host_port}", if tls { "rediss" } else { "redis" });
            let conn = async {
                redis::Client::open(url.as_str())?
                    .get_multiplexed_async_connection_with_config(&config())
                    .await
            }
            .await
            .map_err(|e| unavailable("stale", e))?;
            conns.push(Conn::Plain(conn));
        }
        Ok(conns)
    }

    async fn scan_without_expiry(&self, pattern: &str) -> Result<Vec<String>, Error> {
        let mut found = Vec::new();
        for mut c in self.scan_connections().await? {
            found.extend(
                scan(&mut c, pattern)
                    .await
                    .map_err(|e| unavailable("stale", e))?,
            );
        }
        Ok(found)
    }
}

/// String keys matching `pattern` that have no expiry, on one server.
async fn scan(c: &mut Conn, pattern: &str) -> Result<Vec<String>, RedisError> {
    let mut found = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .arg("TYPE")
            .arg("string")
            .query_async(c)
            .await?;
        for k in keys {
            let pttl: i64 = redis::cmd("PTTL").arg(&k).query_async(c).await?;
            if pttl == -1 {
                found.push(k);
            }
        }
        if next == 0 {
            return Ok(found);
        }
        cursor = next;
    }
}

/// How one node takes part in the queue for one attempt (a [`Turn`] with
/// the node's own ticket number).
#[derive(Debug, Clone, Copy)]
pub enum Step {
    Once,
    Join,
    Queued(u64),
}

/// Translates server timestamps into this sidecar's clock.
struct Clock {
    /// Server milliseconds minus local milliseconds.
    skew: i64,
}

impl Clock {
    fn local(&self, server_ms: i64) -> u64 {
        (server_ms - self.skew).max(0) as u64
    }
}

/// Offsets closer than this to the settled one are measurement noise.
const SKEW_NOISE_MS: i64 = 5;

impl Node {
    /// The clock of a reply whose element `at` is the server time. The
    /// offset is settled per node and moves only when it changes by more
    /// than [`SKEW_NOISE_MS`], so one expiry reads the same in every reply.
    fn clock(&self, reply: &[Value], at: usize) -> Clock {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(Value::Int(server)) = reply.get(at) else {
            return Clock { skew: 0 };
        };
        let measured = server.saturating_sub(i64::try_from(now_ms()).unwrap_or(i64::MAX));
        let settled = self.skew.load(Relaxed);
        if settled == i64::MIN || (measured - settled).abs() > SKEW_NOISE_MS {
            self.skew.store(measured, Relaxed);
            return Clock { skew: measured };
        }
        Clock { skew: settled }
    }
}

fn int(reply: &[Value], i: usize) -> i64 {
    match reply.get(i) {
        Some(Value::Int(n)) => *n,
        Some(Value::BulkString(b)) => String::from_utf8_lossy(b).parse().unwrap_or(0),
        _ => 0,
    }
}

fn text(reply: &[Value], i: usize) -> String {
    match reply.get(i) {
        Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(Value::SimpleString(s)) => s.clone(),
        Some(Value::Int(n)) => n.to_string(),
        _ => String::new(),
    }
}

fn mode_arg(mode: Mode) -> &'static str {
    match mode {
        Mode::Exclusive => "x",
        Mode::Shared => "s",
    }
}

/// Holder metadata as the scripts return it.
#[derive(Deserialize)]
struct RawHolder {
    o: String,
    s: String,
    m: String,
    f: u64,
    c: u32,
    t0: i64,
    e: i64,
}

/// Waiter metadata as the scripts return it.
#[derive(Deserialize)]
struct RawWaiter {
    o: String,
    s: String,
    m: String,
    t0: i64,
}

fn mode_of(m: &str) -> Mode {
    if m == "s" {
        Mode::Shared
    } else {
        Mode::Exclusive
    }
}

fn holders(json: &str, kind: Kind, clock: &Clock) -> Vec<Holder> {
    // cjson encodes an empty table as {}; both mean no holders.
    serde_json::from_str::<Vec<RawHolder>>(json)
        .unwrap_or_default()
        .into_iter()
        .map(|h| Holder {
            owner: h.o,
            sidecar: h.s,
            mode: Held::of(kind, mode_of(&h.m)),
            since_ms: if h.t0 > 0 { clock.local(h.t0) } else { 0 },
            expires_at_ms: if h.e > 0 { clock.local(h.e) } else { 0 },
            fence: h.f,
            count: h.c,
        })
        .collect()
}

fn waiters(json: &str, kind: Kind, clock: &Clock) -> Vec<Waiter> {
    serde_json::from_str::<Vec<RawWaiter>>(json)
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, w)| Waiter {
            owner: w.o,
            sidecar: w.s,
            mode: Held::of(kind, mode_of(&w.m)),
            position: i + 1,
            since_ms: clock.local(w.t0),
        })
        .collect()
}

/// The reason a stale-key script wrote (`no-expiry` for any word it does not know).
fn reason_of(s: &str) -> super::StaleReason {
    super::StaleReason::parse(s).unwrap_or(super::StaleReason::NoExpiry)
}

fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn unavailable(op: &'static str, e: RedisError) -> Error {
    Error::Unavailable {
        op,
        source: Box::new(e),
    }
}

/// This sidecar's queued tickets per key, by the node's ticket numbers.
type Tickets = HashMap<LockKey, BTreeSet<u64>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One node as a backend uses it: the node, this sidecar's tickets on it
/// (kept alive by a heartbeat task), keys to reconcile after failed calls,
/// and its pub/sub task.
pub struct Member {
    pub node: Arc<Node>,
    tickets: Mutex<Tickets>,
    /// Keys where a call failed, so the node may hold tickets of this
    /// sidecar that it no longer waits on; reconciled on the next heartbeat
    /// tick or acquire of the key.
    suspect: Mutex<HashSet<LockKey>>,
    sidecar: String,
    subs: mpsc::UnboundedSender<Sub>,
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
    fn check<T>(&self, key: &LockKey, result: Result<T, Error>) -> Result<T, Error> {
        if let Err(Error::Unavailable { .. }) = &result {
            lock(&self.suspect).insert(key.clone());
        }
        result
    }

    fn track(&self, key: &LockKey, seq: u64, queued: bool) {
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
    async fn reconcile(&self, key: &LockKey) {
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
async fn heartbeats(member: std::sync::Weak<Member>, stop: CancellationToken) {
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

/// Requests to a pub/sub task.
enum Sub {
    Subscribe(String, oneshot::Sender<Result<(), RedisError>>),
    Unsubscribe(String),
}

/// Local watchers per wake channel; subscriptions live while above zero.
pub type Watchers = Arc<Mutex<HashMap<String, (LockKey, usize)>>>;

/// Subscribes `key`'s channel on every member (once per channel however many
/// local waiters watch it) and resolves when `quorum` members confirmed.
///
/// # Errors
/// [`Error::Unavailable`] when fewer than `quorum` members could subscribe.
pub async fn watch(
    members: &[Arc<Member>],
    watchers: &Watchers,
    key: &LockKey,
    quorum: usize,
) -> Result<Watch, Error> {
    let channel = members[0].node.channel(key);
    let first = {
        let mut w = lock(watchers);
        let entry = w.entry(channel.clone()).or_insert_with(|| (key.clone(), 0));
        entry.1 += 1;
        entry.1 == 1
    };
    let guard = WatchGuard {
        channel: channel.clone(),
        watchers: watchers.clone(),
        subs: members.iter().map(|m| m.subs.clone()).collect(),
    };
    if first {
        let acks = members.iter().map(|m| {
            let (ack, done) = oneshot::channel();
            let _ = m.subs.send(Sub::Subscribe(channel.clone(), ack));
            async move {
                matches!(
                    tokio::time::timeout(CALL_TIMEOUT, done).await,
                    Ok(Ok(Ok(())))
                )
            }
        });
        let confirmed = futures::future::join_all(acks)
            .await
            .into_iter()
            .filter(|ok| *ok)
            .count();
        if confirmed < quorum {
            return Err(unavailable(
                "subscribe",
                RedisError::from((ErrorKind::Io, "subscription not confirmed")),
            ));
        }
    }
    Ok(Box::new(guard))
}

/// Keeps one subscription per watched channel on one pub/sub connection;
/// a message wakes the local queue head of its lock. After a reconnect it
/// resubscribes and wakes every watched lock, catching up releases missed
/// while disconnected.
async fn pubsub(
    node: Arc<Node>,
    mut rx: mpsc::UnboundedReceiver<Sub>,
    watchers: Watchers,
    wakeups: Wakeups,
    stop: CancellationToken,
    numbering: Numbering,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let connected = async {
            let client = node.pubsub_client().await?;
            client.get_async_pubsub().await
        };
        let ps = tokio::select! {
            () = stop.cancelled() => return,
            r = tokio::time::timeout(CALL_TIMEOUT, connected) => r,
        };
        let Ok(Ok(ps)) = ps else {
            // Fail waiting subscribers now rather than at their timeout.
            while let Ok(sub) = rx.try_recv() {
                if let Sub::Subscribe(_, ack) = sub {
                    let down = RedisError::from((ErrorKind::Io, "pub/sub connection down"));
                    let _ = ack.send(Err(down));
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
            continue;
        };
        backoff = Duration::from_millis(50);
        let (mut sink, mut stream) = ps.split();
        let current: Vec<(String, LockKey)> = lock(&watchers)
            .iter()
            .map(|(c, (k, _))| (c.clone(), k.clone()))
            .collect();
        let mut healthy = true;
        for (channel, _) in &current {
            if sink.subscribe(channel).await.is_err() {
                healthy = false;
            }
        }
        if !healthy {
            continue;
        }
        for (_, key) in &current {
            wakeups.wake(key);
        }
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                sub = rx.recv() => match sub {
                    None => return,
                    Some(Sub::Subscribe(channel, ack)) => {
                        let r = sink.subscribe(&channel).await;
                        let failed = r.is_err();
                        let _ = ack.send(r);
                        if failed { break; }
                    }
                    Some(Sub::Unsubscribe(channel)) => {
                        if sink.unsubscribe(&channel).await.is_err() { break; }
                    }
                },
                msg = stream.next() => {
                    let Some(msg) = msg else { break };
                    let key = lock(&watchers)
                        .get(msg.get_channel_name())
                        .map(|(k, _)| k.clone());
                    if let Some(key) = key {
                        match next_ticket(&msg).filter(|_| numbering == Numbering::Shared) {
                            Some(seq) => wakeups.wake_ticket(&key, seq),
                            None => wakeups.wake(&key),
                        }
                    }
                }
            }
        }
        tracing::warn!(url = %node.url, "pub/sub connection lost; reconnecting");
    }
}

/// The ticket a release message names (`h<seq>`: only its holder can be
/// admitted), if it names one.
fn next_ticket(msg: &redis::Msg) -> Option<u64> {
    std::str::from_utf8(msg.get_payload_bytes().strip_prefix(b"h")?)
        .ok()?
        .parse()
        .ok()
}

/// Unsubscribes when the last local watcher of a channel goes.
struct WatchGuard {
    channel: String,
    watchers: Watchers,
    subs: Vec<mpsc::UnboundedSender<Sub>>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        let mut watchers = lock(&self.watchers);
        if let Some(entry) = watchers.get_mut(&self.channel) {
            entry.1 -= 1;
            if entry.1 == 0 {
                watchers.remove(&self.channel);
                for subs in &self.subs {
                    let _ = subs.send(Sub::Unsubscribe(self.channel.clone()));
                }
            }
        }
    }
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
            kind: super::BackendKind::Redis,
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

    use super::{Node, SIDE_KEYS};
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
            let internal = [node.index.clone(), format!("{prefix}elections/x")];
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
            for kind in [Kind::Lock, Kind::Semaphore] {
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
