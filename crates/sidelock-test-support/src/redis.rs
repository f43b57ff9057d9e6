//! Real `redis-server` processes for tests: each on a free loopback port in
//! its own temp dir, killed and reaped on drop, its log printed when the
//! test fails. Servers can be killed and restarted on the same port for
//! fault tests.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::free_port;
use crate::process::ChildGuard;

/// How long a server may take to answer PING.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Starts of a new server on fresh ports before its test fails.
const START_ATTEMPTS: u32 = 3;
/// An argument of [`RedisServer::start_with`] that stands for a free port.
pub const FREE_PORT: &str = "<free port>";

fn require(binary: &str) {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {binary}"))
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "{binary} is not installed: run scripts/setup.sh (it installs Debian's redis-server, redis-sentinel and redis-tools)"
    );
}

/// One `redis-server`.
pub struct RedisServer {
    /// Dropped first, so it can still print its log from `dir`.
    child: Option<ChildGuard>,
    dir: TempDir,
    port: u16,
    extra: Vec<String>,
    /// `requirepass` of the server, which [`Self::url`] then carries.
    password: Option<String>,
}

impl RedisServer {
    /// Starts a server with no persistence on a free port.
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// Starts a server with extra `redis-server` arguments; each
    /// [`FREE_PORT`] among them becomes another free port.
    ///
    /// A port found free can be taken by another process before the server
    /// binds it: a server that exits before it is ready is started again on
    /// new ports, up to [`START_ATTEMPTS`] times.
    pub async fn start_with(extra: &[&str]) -> Self {
        Self::start_configured(extra, None).await
    }

    /// Starts a server that requires `password` (`requirepass`); its
    /// [`url`](Self::url) carries the password.
    pub async fn start_with_password(password: &str) -> Self {
        Self::start_configured(&[], Some(password)).await
    }

    async fn start_configured(extra: &[&str], password: Option<&str>) -> Self {
        require("redis-server");
        let dir = tempfile::tempdir().expect("temp dir for redis-server");
        let mut server = Self {
            dir,
            port: 0,
            extra: Vec::new(),
            child: None,
            password: password.map(str::to_owned),
        };
        for attempt in 1..=START_ATTEMPTS {
            server.port = free_port();
            server.extra = extra
                .iter()
                .map(|s| {
                    if *s == FREE_PORT {
                        free_port().to_string()
                    } else {
                        (*s).to_owned()
                    }
                })
                .collect();
            if let Some(password) = password {
                server
                    .extra
                    .extend(["--requirepass".to_owned(), password.to_owned()]);
            }
            match server.try_launch().await {
                Ok(()) => return server,
                Err(e) if attempt < START_ATTEMPTS => eprintln!("{e}\nstarting again on new ports"),
                Err(e) => panic!("{e}"),
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// Starts the server on its port, panicking if it does not become ready.
    async fn launch(&mut self) {
        if let Err(e) = self.try_launch().await {
            panic!("{e}");
        }
    }

    async fn try_launch(&mut self) -> Result<(), String> {
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra);
        let log = self.dir.path().join(format!("redis-{}.log", self.port));
        let label = format!("redis-server :{}", self.port);
        self.child = Some(ChildGuard::spawn(cmd, &label, &log, false));
        self.wait_ready().await
    }

    /// Waits for PING; an error (with the server's log) if it exited first.
    async fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(mut c) = self.connection().await
                && redis::cmd("PING")
                    .query_async::<String>(&mut c)
                    .await
                    .is_ok()
            {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_status()
            {
                let error = format!(
                    "{} exited with {status} before it was ready:\n{}",
                    child.label(),
                    child.log()
                );
                self.child = None;
                return Err(error);
            }
            assert!(
                Instant::now() < deadline,
                "redis-server :{} not ready after {READY_TIMEOUT:?}",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>`, or `redis://:<password>@127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://{}127.0.0.1:{}", self.userinfo(), self.port)
    }

    /// `:<password>@` for a server that requires one, else nothing.
    fn userinfo(&self) -> String {
        self.password
            .as_ref()
            .map_or(String::new(), |p| format!(":{p}@"))
    }

    /// A fresh connection for test commands.
    pub async fn connection(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        redis::Client::open(self.url())?
            .get_multiplexed_async_connection()
            .await
    }

    /// Runs one command and returns its reply.
    pub async fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut c = self.connection().await.expect("connect to test redis");
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query_async(&mut c)
            .await
            .unwrap_or_else(|e| panic!("redis {args:?}: {e}"))
    }

    /// Pauses every client of the server for `ms` milliseconds
    /// (`CLIENT PAUSE`): commands sent meanwhile wait, and are then served
    /// in no promised order.
    pub async fn pause_clients(&self, ms: u64) {
        let _: () = self.cmd(&["CLIENT", "PAUSE", &ms.to_string()]).await;
    }

    /// Queues, by hand, another sidecar process's exclusive claim at the tail
    /// of `name`'s queue (default prefix), its process alive: its heartbeat
    /// runs for another minute of this server's clock.
    pub async fn queue_foreign_claim(&self, name: &str) {
        let time: Vec<String> = self.cmd(&["TIME"]).await;
        let now: u64 = time[0].parse::<u64>().expect("seconds") * 1000;
        let tag = format!("{{sidelock:{name}}}");
        let entry = format!(
            "1 x {} {now} beef 60000 0 0 [\"other\",\"elsewhere\"]",
            "ab".repeat(16)
        );
        let _: i64 = self.cmd(&["RPUSH", &format!("{tag}:q"), &entry]).await;
        let beat = (now + 60_000).to_string();
        let _: i64 = self
            .cmd(&["HSET", &format!("{tag}:heartbeat"), "beef", &beat])
            .await;
    }

    /// Calls per command so far (`INFO commandstats`; commands run inside
    /// scripts count too), without the `INFO` calls themselves.
    pub async fn command_counts(&self) -> BTreeMap<String, u64> {
        let info: String = self.cmd(&["INFO", "commandstats"]).await;
        parse_commandstats(&info)
    }

    /// Total calls so far, as [`Self::command_counts`] counts them.
    pub async fn commands_run(&self) -> u64 {
        self.command_counts().await.values().sum()
    }

    /// Sends `signal` to the server (SIGSTOP hangs it: connections stay
    /// open and nothing is answered, as with a frozen machine).
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        if let Some(child) = &self.child {
            child.signal(signal);
        }
    }

    /// Kills the server (SIGKILL), keeping its port and directory.
    pub fn kill(&mut self) {
        drop(self.child.take());
    }

    /// Starts the server again on the same port (empty dataset).
    pub async fn restart(&mut self) {
        self.kill();
        self.launch().await;
    }
}

/// The calls made between two [`RedisServer::command_counts`] readings,
/// largest first: what an assertion on command counts prints.
pub fn command_diff(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> String {
    let mut diff: Vec<(u64, &str)> = after
        .iter()
        .map(|(name, n)| (n - before.get(name).copied().unwrap_or(0), name.as_str()))
        .filter(|(n, _)| *n > 0)
        .collect();
    diff.sort_unstable_by(|a, b| b.cmp(a));
    diff.iter()
        .map(|(n, name)| format!("{name}={n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A master, one replica and one `redis-sentinel` watching them as `mymaster`.
pub struct RedisSentinel {
    pub master: RedisServer,
    pub replica: RedisServer,
    /// Dropped first, so it can still print its log from `dir`.
    sentinel: ChildGuard,
    _dir: TempDir,
    port: u16,
}

/// The master name the sentinel monitors.
pub const SENTINEL_MASTER: &str = "mymaster";

impl RedisSentinel {
    /// Starts master, replica and sentinel, and waits until the sentinel
    /// knows the master.
    pub async fn start() -> Self {
        require("redis-sentinel");
        let master = RedisServer::start().await;
        let port = master.port();
        Self::watch(master, port).await
    }

    /// As [`start`](Self::start), with the sentinel reaching the master
    /// through the returned proxy, whose address it names as the master's to
    /// clients (the replica replicates directly): refusing the sentinel's
    /// connections there cuts the master off from the sentinel alone, and
    /// the sentinel fails over while clients keep their connections to the
    /// old master.
    pub async fn start_proxied() -> (Self, crate::proxy::CuttingProxy) {
        require("redis-sentinel");
        let master = RedisServer::start().await;
        let proxy = crate::proxy::CuttingProxy::start(master.port()).await;
        (Self::watch(master, proxy.port()).await, proxy)
    }

    /// Starts a replica of `master` and a sentinel watching `master` at
    /// `master_port`.
    async fn watch(master: RedisServer, master_port: u16) -> Self {
        let replica =
            RedisServer::start_with(&["--replicaof", "127.0.0.1", &master.port().to_string()])
                .await;
        let dir = tempfile::tempdir().expect("temp dir for redis-sentinel");
        let port = free_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\n\
                 sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {} 1\n\
                 sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n\
                 sentinel failover-timeout {SENTINEL_MASTER} 5000\n",
                dir.path().display(),
                master_port
            ),
        )
        .expect("write sentinel.conf");
        let mut cmd = Command::new("redis-sentinel");
        cmd.arg(&conf);
        let sentinel = ChildGuard::spawn(
            cmd,
            &format!("redis-sentinel :{port}"),
            &dir.path().join("sentinel.log"),
            false,
        );
        let me = Self {
            master,
            replica,
            sentinel,
            _dir: dir,
            port,
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        while me.master_port().await != Some(master_port) {
            assert!(
                Instant::now() < deadline,
                "redis-sentinel did not report the master:\n{}",
                me.sentinel.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        me
    }

    /// `redis+sentinel://127.0.0.1:<sentinel port>/mymaster`.
    pub fn url(&self) -> String {
        format!("redis+sentinel://127.0.0.1:{}/{SENTINEL_MASTER}", self.port)
    }

    /// Waits until the replica has acknowledged every write so far.
    pub async fn wait_replicated(&self) {
        crate::eventually(
            "the replica acknowledges",
            Duration::from_secs(10),
            async || {
                let acked: i64 = self.master.cmd(&["WAIT", "1", "200"]).await;
                (acked == 1).then_some(())
            },
        )
        .await;
    }

    /// The port the sentinel currently names as master.
    pub async fn master_port(&self) -> Option<u16> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", self.port)).ok()?;
        let mut c = client.get_multiplexed_async_connection().await.ok()?;
        let addr: Vec<String> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(SENTINEL_MASTER)
            .query_async(&mut c)
            .await
            .ok()?;
        addr.get(1)?.parse().ok()
    }
}

/// A Redis Cluster of three masters built with `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Three masters, no replicas.
    pub async fn start() -> Self {
        Self::start_replicated(0).await
    }

    /// Three masters, no replicas, each requiring `password`; the
    /// [`url`](Self::url) carries it.
    pub async fn start_with_password(password: &str) -> Self {
        Self::start_configured(0, Some(password)).await
    }

    /// Three masters (`nodes[0..3]`), each with `replicas` replicas after
    /// them in `nodes`; the cluster `ok` on every node and every replica
    /// in sync with its master.
    pub async fn start_replicated(replicas: usize) -> Self {
        Self::start_configured(replicas, None).await
    }

    async fn start_configured(replicas: usize, password: Option<&str>) -> Self {
        require("redis-cli");
        let mut nodes = Vec::new();
        for _ in 0..3 * (1 + replicas) {
            nodes.push(Self::start_node_with(password).await);
        }
        let mut create = Command::new("redis-cli");
        if let Some(password) = password {
            create.args(["-a", password, "--no-auth-warning"]);
        }
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port()));
        }
        create.args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"]);
        let out = create.output().expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + READY_TIMEOUT;
        for (i, n) in nodes.iter().enumerate() {
            loop {
                let info: String = n.cmd(&["CLUSTER", "INFO"]).await;
                // A replica (after the three masters) also in sync.
                let replication: String = if i < 3 {
                    String::new()
                } else {
                    n.cmd(&["INFO", "replication"]).await
                };
                if info.contains("cluster_state:ok")
                    && (i < 3 || replication.contains("master_link_status:up"))
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster not ok: {info}\n{replication}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Self { nodes }
    }

    /// `redis+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,127.0.0.1:<p3>`, with
    /// `:<password>@` before the hosts when the nodes require one.
    pub fn url(&self) -> String {
        let auth = self.nodes[0]
            .password
            .as_ref()
            .map(|p| format!(":{p}@"))
            .unwrap_or_default();
        format!("redis+cluster://{auth}{}", host_list(&self.nodes))
    }

    /// A server with cluster mode on, in no cluster yet.
    async fn start_node() -> RedisServer {
        Self::start_node_with(None).await
    }

    /// As [`start_node`](Self::start_node), requiring `password` if given.
    async fn start_node_with(password: Option<&str>) -> RedisServer {
        // The bus port defaults to port + 10000, which does not exist for
        // ephemeral ports above 55535: Redis then refuses to start.
        RedisServer::start_configured(
            &[
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "2000",
                "--cluster-port",
                FREE_PORT,
            ],
            password,
        )
        .await
    }

    /// Adds a master without slots (`redis-cli --cluster add-node`), once
    /// every node knows it and it sees the cluster `ok`.
    pub async fn add_empty_node(&mut self) -> &RedisServer {
        let node = Self::start_node().await;
        run_cli(&[
            "add-node",
            &format!("127.0.0.1:{}", node.port()),
            &format!("127.0.0.1:{}", self.nodes[0].port()),
        ]);
        self.nodes.push(node);
        let count = self.nodes.len();
        let deadline = Instant::now() + READY_TIMEOUT;
        for n in &self.nodes {
            loop {
                let info: String = n.cmd(&["CLUSTER", "INFO"]).await;
                if info.contains("cluster_state:ok")
                    && info.contains(&format!("cluster_known_nodes:{count}\r"))
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the new node is not known to all: {info}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        &self.nodes[count - 1]
    }

    /// Removes the slot-less node `index` from the cluster (`redis-cli
    /// --cluster del-node`: the others forget it, and it is reset). The
    /// server keeps running and answering, alone.
    pub async fn remove_node(&self, index: usize) {
        let id: String = self.nodes[index].cmd(&["CLUSTER", "MYID"]).await;
        let other = usize::from(index == 0);
        run_cli(&[
            "del-node",
            &format!("127.0.0.1:{}", self.nodes[other].port()),
            &id,
        ]);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let info: String = self.nodes[index].cmd(&["CLUSTER", "INFO"]).await;
            if info.contains("cluster_known_nodes:1\r") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the removed node still knows the cluster: {info}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Runs `redis-cli --cluster <args> --cluster-yes`, failing on an error.
fn run_cli(args: &[&str]) {
    let out = Command::new("redis-cli")
        .arg("--cluster")
        .args(args)
        .arg("--cluster-yes")
        .output()
        .expect("run redis-cli --cluster");
    assert!(
        out.status.success(),
        "redis-cli --cluster {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Independent Redis masters for Redlock.
pub struct RedisNodes {
    pub nodes: Vec<RedisServer>,
}

impl RedisNodes {
    pub async fn start(count: usize) -> Self {
        let mut nodes = Vec::with_capacity(count);
        for _ in 0..count {
            nodes.push(RedisServer::start().await);
        }
        Self { nodes }
    }

    /// Independent masters that all require `password`.
    pub async fn start_with_password(count: usize, password: &str) -> Self {
        let mut nodes = Vec::with_capacity(count);
        for _ in 0..count {
            nodes.push(RedisServer::start_with_password(password).await);
        }
        Self { nodes }
    }

    /// `redlock://127.0.0.1:<p1>,127.0.0.1:<p2>,…` (with the nodes'
    /// password as `:<password>@` when they require one).
    pub fn url(&self) -> String {
        let userinfo = self
            .nodes
            .first()
            .map_or(String::new(), RedisServer::userinfo);
        format!("redlock://{userinfo}{}", host_list(&self.nodes))
    }
}

/// `127.0.0.1:<p1>,127.0.0.1:<p2>,…`: the host part of a multi-node URL.
fn host_list(nodes: &[RedisServer]) -> String {
    nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port()))
        .collect::<Vec<_>>()
        .join(",")
}

/// Parses `INFO commandstats` into calls per command.
#[must_use]
pub fn parse_commandstats(info: &str) -> BTreeMap<String, u64> {
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            (name != "info").then(|| (name.to_owned(), calls))
        })
        .collect()
}
