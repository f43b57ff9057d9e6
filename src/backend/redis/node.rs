//! One logical Redis — a server, a Sentinel-managed master or a Cluster —
//! with sidelock's key layout: how to reach it, connections with timeouts,
//! key and channel names, script calls, and the server clock. Redis and
//! Redlock both use it by its public surface.

use std::sync::{Arc, Mutex};

use futures::FutureExt;
use tokio_util::sync::CancellationToken;

use redis::cluster::ClusterClient;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{ErrorKind, RedisError, Script, Value};

use crate::backend::Error;
use crate::backend::url::{Parts, bad_url};
use crate::clock::now_ms;
use crate::lock::{Kind, LockKey};

use super::conn::{Clock, Conn, Connecting, Target, config, not_connected, unavailable};
use super::scripts::{Call, Scripts};
use super::{CALL_TIMEOUT, lock};

/// The longest a Cluster connect may take: it waits for every seed (a hung
/// one for its connect and response time limits), asks them for the slot
/// map one by one, then connects to the nodes of that map.
const CONNECT_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// One logical Redis (a server, a Sentinel-managed master, or a Cluster)
/// with sidelock's key layout and scripts. Redlock runs several of these.
pub struct Node {
    pub(super) target: Target,
    /// The cached connection; dropped after a connection-level error so the
    /// next call reconnects (and, with Sentinel, asks for the master again).
    /// A Cluster's is replaced instead, by a connect in the background.
    /// A plain mutex, held only to clone or replace it: every call takes it,
    /// and an async mutex would park and wake callers that contend for it.
    pub(super) conn: Arc<Mutex<Option<Conn>>>,
    /// Held while connecting to one Redis or a Sentinel master, so that
    /// callers finding no connection make one.
    pub(super) connecting: tokio::sync::Mutex<()>,
    /// A Cluster connect under way, if any (see [`Node::cluster_connect`]).
    pub(super) cluster_connect: Arc<Mutex<Option<Connecting>>>,
    pub(super) scripts: Scripts,
    pub(super) prefix: String,
    /// Server clock minus ours, in ms, as last settled (`i64::MIN`: not yet).
    pub(super) skew: std::sync::atomic::AtomicI64,
    /// The server's clock in the last reply that had it, minus ours when
    /// that call was sent (`i64::MIN`: not yet): at least the true offset,
    /// since the server read its clock after the call left (see
    /// [`Clock::end`]).
    pub(super) ahead: std::sync::atomic::AtomicI64,
    /// Where this node's URL is shown (without password).
    pub url: String,
    /// The keys in use, as the last listing found them (see [`super::listing`]).
    pub(super) listed: Mutex<Option<Listed>>,
    /// Held while a listing scans the keyspace: one scan at a time, which
    /// the listings waiting for it then share (see [`super::listing`]).
    pub(super) scanning: tokio::sync::Mutex<()>,
    /// When the last listing scan that failed ended, and why it failed:
    /// the answer of the listings that waited for it.
    pub(super) scan_failed: Mutex<Option<(std::time::Instant, crate::backend::Cause)>>,
    /// This sidecar process, as its queue entries, heartbeats and own
    /// channel name it: random, so that a sidecar restarted under the same
    /// id is not taken for the process that queued.
    pub(super) instance: String,
    /// The stem of sidecars' own channels, `<prefix>/sidecars/`: a release
    /// that hands a lock over tells the new holder's sidecar there.
    pub(super) stem: String,
    /// Whether a release passes the lock straight to the next claim in line
    /// (one Redis), or wakes it to try (Redlock's nodes, each of which may
    /// order its queue its own way).
    pub(super) handoff: bool,
    /// The backend's shutdown: stops a Cluster connect under way.
    pub(super) stop: CancellationToken,
}

/// The keys in use as one scan found them, sorted as listings page them.
pub(super) struct Listed {
    /// When the scan started: it answers the listings asked before.
    pub(super) started: std::time::Instant,
    /// When it ended.
    pub(super) at: std::time::Instant,
    pub(super) keys: Vec<LockKey>,
}

impl Node {
    /// A node for `url`: `redis://host:port/db`, `rediss://…`,
    /// `redis+sentinel://s1:p,s2:p/<master>[/db]`, `redis+cluster://h1:p,h2:p`;
    /// see [`Node::handoff`].
    ///
    /// # Errors
    /// A sentence naming what is wrong with the URL.
    pub fn open(
        url: &str,
        prefix: &str,
        handoff: bool,
        stop: CancellationToken,
    ) -> Result<Self, String> {
        let parts = Parts::parse(url)?;
        let (scheme, hosts, path) = (parts.scheme, parts.hosts_with_userinfo(), parts.path);
        let base = if scheme.starts_with("rediss") {
            "rediss"
        } else {
            "redis"
        };
        let target = match scheme {
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
                    // Calls are timed by `Conn`, which a pause of this
                    // process does not trip; the crate's own commands (slot
                    // refreshes, checks) by this longer limit per node,
                    // which a pause of more than 2 s past a call's limit
                    // still trips.
                    .response_timeout(2 * CALL_TIMEOUT)
                    .overall_response_timeout(None)
                    // Never sent twice: a script whose answer was lost may
                    // have run, and a second run of a release takes a second
                    // hold (or finds a lease it already handed over). A
                    // call answered MOVED, which ran nowhere, is sent
                    // again by `run`.
                    .retries(0)
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
            conn: Arc::new(Mutex::new(None)),
            connecting: tokio::sync::Mutex::new(()),
            cluster_connect: Arc::new(Mutex::new(None)),
            scripts: Scripts::new(),
            prefix: prefix.to_owned(),
            skew: std::sync::atomic::AtomicI64::new(i64::MIN),
            ahead: std::sync::atomic::AtomicI64::new(i64::MIN),
            url: crate::backend::redact(url),
            listed: Mutex::new(None),
            scanning: tokio::sync::Mutex::new(()),
            scan_failed: Mutex::new(None),
            instance: crate::lock::Token::generate().expose()[..16].to_owned(),
            stem: format!("{prefix}/sidecars/"),
            handoff,
            stop,
        })
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

    /// The Cluster connect under way, started if there is none: a task of
    /// its own that puts its connection in place of the cached one. It
    /// goes on when the caller that started it gives up: it waits for every
    /// seed, and with one seed hung it takes longer than a call may wait
    /// (cut off at every call, it never finished, and the backend stayed
    /// unavailable after the cluster had failed over). Until it is done,
    /// the old connection serves the slots that still answer.
    fn cluster_connect(&self, client: &ClusterClient) -> Connecting {
        let mut under_way = lock(&self.cluster_connect);
        if let Some(connecting) = under_way.as_ref() {
            return connecting.clone();
        }
        let (client, cached, slot) = (
            client.clone(),
            self.conn.clone(),
            self.cluster_connect.clone(),
        );
        // The slot is held until this connect is in it, so the task's
        // clearing of it comes after.
        let stop = self.stop.clone();
        let task = tokio::spawn(async move {
            let connect = tokio::time::timeout(CONNECT_LIMIT, client.get_async_connection());
            let result = match stop.run_until_cancelled(connect).await {
                Some(Ok(Ok(c))) => Ok(Conn::Cluster(c)),
                Some(Ok(Err(e))) => Err(e),
                Some(Err(_)) => Err(RedisError::from((ErrorKind::Io, "connect timed out"))),
                None => Err(RedisError::from((ErrorKind::Io, "the backend is closing"))),
            };
            if let Ok(c) = &result {
                *lock(&cached) = Some(c.clone());
            }
            *lock(&slot) = None;
            result
        });
        let connecting = async move {
            task.await.unwrap_or_else(|e| {
                Err(RedisError::from((
                    ErrorKind::Io,
                    "connect failed",
                    e.to_string(),
                )))
            })
        }
        .boxed()
        .shared();
        *under_way = Some(connecting.clone());
        connecting
    }

    /// A client for the pub/sub connection: the server, the current master,
    /// or a reachable Cluster node (Cluster PUBLISH reaches every node),
    /// with the node's place among the seeds. Seeds are tried from place
    /// `from` on (round the list), so that one that failed is tried last.
    pub(super) async fn pubsub_client(
        &self,
        from: usize,
    ) -> Result<(redis::Client, usize), RedisError> {
        match &self.target {
            Target::Single(c) => Ok((c.clone(), 0)),
            Target::Sentinel(s) => Ok((s.lock().await.async_get_client().await?, 0)),
            Target::Cluster { seeds, .. } => {
                // The first seed that sees its cluster `ok`: a node removed
                // from the cluster (reset, still answering) hears no
                // cluster PUBLISH. Failing that, the first that answers.
                let mut answering = None;
                let mut last = None;
                let order = (0..seeds.len()).map(|i| (from + i) % seeds.len());
                for place in order {
                    let seed = &seeds[place];
                    match seed
                        .get_multiplexed_async_connection_with_config(&config())
                        .await
                    {
                        Ok(mut c) => {
                            let info = redis::cmd("CLUSTER")
                                .arg("INFO")
                                .query_async::<String>(&mut c)
                                .await;
                            if info.is_ok_and(|i| i.contains("cluster_state:ok")) {
                                return Ok((seed.clone(), place));
                            }
                            answering.get_or_insert_with(|| (seed.clone(), place));
                        }
                        Err(e) => last = Some(e),
                    }
                }
                answering.ok_or_else(|| {
                    last.unwrap_or_else(|| RedisError::from((ErrorKind::Io, "no cluster node")))
                })
            }
        }
    }

    /// Runs `f` on the cached connection, reconnecting first if needed, and
    /// forgets the connection after a connection-level failure, a garbled
    /// reply among them (its framing is unknown after it: the call after
    /// it, sent there, failed as a lost connection, which may have run, so
    /// a release was not sent again).
    pub(super) async fn with_conn<T, F>(&self, op: &'static str, f: F) -> Result<T, Error>
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
                    || e.kind() == ErrorKind::Parse
                    || e.kind() == ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
                {
                    match &self.target {
                        // Replaced in the background (a fresh slot map):
                        // meanwhile the old one serves the other masters.
                        Target::Cluster { client, .. } => drop(self.cluster_connect(client)),
                        _ => *lock(&self.conn) = None,
                    }
                }
                Err(unavailable(op, e))
            }
        }
    }

    /// The cached connection, made first if there is none.
    pub(super) async fn connection(&self, op: &'static str) -> Result<Conn, Error> {
        if let Some(c) = lock(&self.conn).clone() {
            return Ok(c);
        }
        if let Target::Cluster { client, .. } = &self.target {
            return self.cluster_connection(op, client).await;
        }
        let _connecting = self.connecting.lock().await;
        // Made by the caller that held the lock before.
        if let Some(c) = lock(&self.conn).clone() {
            return Ok(c);
        }
        let c = crate::clock::within(CALL_TIMEOUT, self.connect())
            .await
            .map_err(|_| not_connected(op, RedisError::from((ErrorKind::Io, "connect timed out"))))?
            .map_err(|e| not_connected(op, e))?;
        *lock(&self.conn) = Some(c.clone());
        let (url, stop) = (self.url.clone(), self.stop.clone());
        let check = crate::clock::within(CALL_TIMEOUT, warn_of_eviction(c.clone(), url));
        tokio::spawn(async move { stop.run_until_cancelled(check).await });
        Ok(c)
    }

    /// A Cluster connection when none is cached: the caller waits for the
    /// connect under way at most a call's time limit.
    async fn cluster_connection(
        &self,
        op: &'static str,
        client: &ClusterClient,
    ) -> Result<Conn, Error> {
        crate::clock::within(CALL_TIMEOUT, self.cluster_connect(client))
            .await
            .map_err(|_| not_connected(op, RedisError::from((ErrorKind::Io, "connect timed out"))))?
            .map_err(|e| not_connected(op, e))
    }

    /// The main key of `key`; its side keys are `{<base>}:<suffix>`.
    ///
    /// The mapping from (kind, name) to keys is injective: a lock is
    /// `<prefix><name>` (the classic `SET NX` key), a semaphore
    /// `<prefix>semaphores/<name>`, an election `<prefix>elections/<name>`
    /// (an exclusive lock to the scripts); names have no `/`, so none of
    /// these can equal another kind's key, and no `{` or `}` (nor has the
    /// prefix), so none can equal a side key. The wake channel,
    /// `{<base>}:wake`, lives in pub/sub's own namespace.
    pub(super) fn base(&self, key: &LockKey) -> String {
        // Built by hand: this runs for every script call, and `format!` costs
        // several times more than the copies.
        let kind = match key.kind {
            Kind::Lock => "",
            Kind::Semaphore => "semaphores/",
            Kind::Election => "elections/",
        };
        let name = key.name.as_str();
        let mut base = String::with_capacity(self.prefix.len() + kind.len() + name.len());
        base.push_str(&self.prefix);
        base.push_str(kind);
        base.push_str(name);
        base
    }

    /// This sidecar process's own channel, where it hears of locks handed
    /// to it.
    pub(super) fn own_channel(&self) -> String {
        format!("{}{}", self.stem, self.instance)
    }

    /// Whether this is a Redis Cluster.
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self.target, Target::Cluster { .. })
    }

    /// Whether the pub/sub connection may listen on another server than the
    /// one commands reach, and so is checked by a probe published where
    /// commands go rather than by a `PING`: any node of a Cluster, and with
    /// Sentinel the master of when it connected (commands that failed ask
    /// the sentinels again and follow a failover; an old master cut off
    /// from the sentinels still answers its pub/sub connection, which hears
    /// none of the new master's messages).
    pub(super) fn probes_pubsub(&self) -> bool {
        matches!(self.target, Target::Cluster { .. } | Target::Sentinel(_))
    }

    /// After a probe went unheard: with Sentinel, drops the commands'
    /// connection, so that the next call asks the sentinels for the master
    /// as the pub/sub connection made again does. Otherwise a pub/sub
    /// connection on the new master, with commands still on an old one cut
    /// off from the sentinels, heard no probe and was made again every two
    /// probes, on the same new master, for as long as the split lasted.
    pub(super) fn ask_for_the_master_again(&self) {
        if matches!(self.target, Target::Sentinel(_)) {
            *lock(&self.conn) = None;
        }
    }

    /// Publishes `payload` on this sidecar's own channel from a script on
    /// the master of that channel's slot, as the scripts' own messages go:
    /// in a Cluster, to every node the cluster bus reaches.
    pub(super) async fn publish_own(&self, payload: &str) -> Result<(), Error> {
        let channel = self.own_channel();
        self.with_conn("probe", async |c| {
            redis::cmd("EVAL")
                .arg("return redis.call('PUBLISH', KEYS[1], ARGV[1])")
                .arg(1)
                .arg(&channel)
                .arg(payload)
                .query_async::<i64>(c)
                .await
        })
        .await
        .map(|_| ())
    }

    /// The wake channel of `key`, on which the scripts publish.
    pub(super) fn channel(&self, key: &LockKey) -> String {
        format!("{{{}}}:wake", self.base(key))
    }

    /// Prepares a script call on the lock's main key (the scripts derive its
    /// side keys) with its kind as the first argument.
    pub(super) fn invocation<'a>(&self, script: &'a Script, key: &LockKey) -> Call<'a> {
        let mut inv = Call::new(script, &self.base(key), self.is_cluster());
        inv.arg(match key.kind {
            // An election is an exclusive lock to the scripts.
            Kind::Lock | Kind::Election => "l",
            Kind::Semaphore => "s",
        });
        inv
    }

    pub(super) async fn run<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        inv: Call<'_>,
    ) -> Result<T, Error> {
        let mut redirects = 0;
        loop {
            let mut moved = false;
            let answer = self
                .with_conn(op, async |c| {
                    let answer = inv.invoke(c).await;
                    moved = answer.as_ref().is_err_and(|e| {
                        e.kind() == ErrorKind::Server(redis::ServerErrorKind::Moved)
                    });
                    answer
                })
                .await;
            // A Cluster master that no longer serves the slot answers MOVED
            // having run nothing, so the call is sent again once the client
            // has read the new slot map (which that answer starts): a slot
            // that moved is not an outage. (Lost answers are never sent
            // again: see `retries(0)` in [`Node::open`].)
            if !moved || redirects == MAX_REDIRECTS {
                return answer;
            }
            redirects += 1;
            tokio::time::sleep(REDIRECT_PAUSE * redirects).await;
        }
    }
}

/// How often a call a Cluster master answered MOVED is sent again.
const MAX_REDIRECTS: u32 = 5;

/// The pause before the first resend after a MOVED (longer before each
/// next): the client reads the new slot map meanwhile.
const REDIRECT_PAUSE: std::time::Duration = std::time::Duration::from_millis(20);

/// How one node takes part in the queue for one attempt (a [`Turn`] with
/// the node's own ticket number).
#[derive(Debug, Clone, Copy)]
pub enum Step {
    Once,
    Join,
    Queued(u64),
}

impl Node {
    /// The server's clock now, as this sidecar reads it (its own clock until
    /// a reply settled the offset).
    pub(super) fn server_now(&self) -> i64 {
        let skew = self.skew.load(std::sync::atomic::Ordering::Relaxed);
        let now = i64::try_from(now_ms()).unwrap_or(i64::MAX);
        if skew == i64::MIN { now } else { now + skew }
    }

    /// The clock as settled, for server times that came without one.
    pub(super) fn settled_clock(&self) -> Clock {
        self.clock(&[], 0, 0)
    }
}

/// Offsets closer than this to the settled one are measurement noise.
pub(super) const SKEW_NOISE_MS: i64 = 5;

impl Node {
    /// The clock of a reply, sent at `sent` (local ms), whose element `at`
    /// is the server time. The offset is settled per node and moves only
    /// when it changes by more than [`SKEW_NOISE_MS`], so one time reads
    /// the same in every reply.
    pub(super) fn clock(&self, reply: &[Value], at: usize, sent: u64) -> Clock {
        use std::sync::atomic::Ordering::Relaxed;
        let settled = self.skew.load(Relaxed);
        let server = match reply.get(at) {
            Some(Value::Int(server)) if *server > 0 => *server,
            // A reply that did not need the server's clock (a queued join):
            // the offsets as settled.
            _ => {
                let ahead = self.ahead.load(Relaxed);
                return Clock {
                    skew: if settled == i64::MIN { 0 } else { settled },
                    ahead: (ahead != i64::MIN).then_some(ahead),
                };
            }
        };
        let local = |t: u64| i64::try_from(t).unwrap_or(i64::MAX);
        // Settled like the skew, so one lease's end reads the same in every
        // reply: every such measurement is at least the true offset.
        let measured_ahead = server.saturating_sub(local(sent));
        let was = self.ahead.load(Relaxed);
        let ahead = if was == i64::MIN || (measured_ahead - was).abs() > SKEW_NOISE_MS {
            self.ahead.store(measured_ahead, Relaxed);
            measured_ahead
        } else {
            was
        };
        let measured = server.saturating_sub(local(now_ms()));
        let skew = if settled == i64::MIN || (measured - settled).abs() > SKEW_NOISE_MS {
            self.skew.store(measured, Relaxed);
            measured
        } else {
            settled
        };
        Clock {
            skew,
            ahead: Some(ahead),
        }
    }
}

/// Logs a warning when the Redis behind `conn` (at `url`, shown without
/// credentials) may evict keys: under a `maxmemory` with any policy but
/// `noeviction`, a lease could vanish while its holder holds it, or a
/// fence counter start again (README, *Eviction*). Quiet where `CONFIG` is
/// not allowed (managed services rename or refuse it).
async fn warn_of_eviction(mut conn: Conn, url: String) {
    async fn setting(conn: &mut Conn, name: &str) -> Option<String> {
        let reply: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg(name)
            .query_async(conn)
            .await
            .map_err(
                |e| tracing::debug!(backend = "redis", error = %e, "CONFIG GET {name} refused"),
            )
            .ok()?;
        reply.into_iter().nth(1)
    }
    let Some(policy) = setting(&mut conn, "maxmemory-policy").await else {
        return;
    };
    if policy == "noeviction" {
        return;
    }
    let Some(maxmemory) = setting(&mut conn, "maxmemory").await else {
        return;
    };
    if maxmemory == "0" {
        return;
    }
    tracing::warn!(
        backend = "redis",
        %url,
        %policy,
        %maxmemory,
        "this Redis evicts keys when it reaches maxmemory: a lease could vanish while held, \
         or a fence counter start again; set maxmemory-policy noeviction"
    );
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tokio_util::sync::CancellationToken;

    use super::{Node, Target};

    /// A Cluster connect under way ends with the backend's shutdown: with
    /// a seed that accepts and never answers, it would otherwise go on for
    /// the client's own timeouts, past the sidecar's shutdown.
    #[tokio::test]
    async fn a_cluster_connect_under_way_ends_when_the_backend_closes() {
        let (port, _hung) = super::super::conn::never_answering().await;
        let stop = CancellationToken::new();
        let url = format!("redis+cluster://127.0.0.1:{port}");
        let node = Node::open(&url, "sidelock:", true, stop.clone()).expect("node");
        let Target::Cluster { client, .. } = &node.target else {
            panic!("a Cluster target");
        };
        let connecting = node.cluster_connect(client);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let closed = Instant::now();
        stop.cancel();
        let ended = tokio::time::timeout(Duration::from_millis(500), connecting).await;
        assert!(
            matches!(ended, Ok(Err(_))),
            "the connect went on {:?} after the backend closed",
            closed.elapsed()
        );
    }
}
