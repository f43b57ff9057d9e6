//! The safety checker: K sidecars × M clients doing random acquire, hold,
//! keepalive and release against one backend while clients crash, hold
//! streams are cut, sidecars are killed (SIGKILL) or stopped (SIGTERM) and
//! restarted, and the backend itself restarts. A protected resource accepts
//! a write only with a fence above the last one it saw. The checker records
//! every grant's interval and reports overlapping exclusive intervals, fence
//! regressions, writes rejected for stale fences, and leases lost without a
//! `lost`/410 signal to their client — all must be 0 — and grants per second.
//!
//! Short by default (CI); the long run is
//! `SIDELOCK_CHECK_SECONDS=120 cargo nextest run --test safety`, whose JSON
//! reports (`target/safety-<backend>.json`) feed RELIABILITY.md.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::postgres::PgCluster;
use common::redis::{RedisNodes, RedisServer};
use common::zookeeper::ZkServer;
use common::{SidecarBuilder, SidecarGuard, unique_name};
use rand::RngExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::sync::{Mutex, RwLock};

const CLIENTS: usize = 32;
const LOCKS: usize = 2;
/// How long an emptied Redlock node stays down: the longest ttl a client asks
/// for (2 s) plus its drift allowance (1% + 2 ms), rounded up.
const REDLOCK_RESTART_DELAY: Duration = Duration::from_millis(2100);
/// Fewer grants than this are too few to judge a run by.
const MIN_GRANTS: usize = 21;
/// How long a run whose faults stalled grants may go on, fault-free, to
/// collect [`MIN_GRANTS`].
const MAX_EXTENSION: Duration = Duration::from_secs(30);

/// The run's length with faults: `SIDELOCK_CHECK_SECONDS`, or 6 s — 12 s on
/// ZooKeeper, where a restarted member (a cold JVM) and the sessions moving
/// off it stall grants for seconds. A run still short of [`MIN_GRANTS`] then
/// goes on without faults (at most [`MAX_EXTENSION`]).
fn seconds(kind: &str) -> u64 {
    std::env::var("SIDELOCK_CHECK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if kind == "zookeeper" { 12 } else { 6 })
}

/// The backend under test and the faults it is put through.
enum Deployment {
    Memory,
    Redis(RedisServer),
    Postgres(PgCluster),
    Redlock(RedisNodes),
    ZooKeeper(ZkServer),
}

impl Deployment {
    async fn start(kind: &str) -> Self {
        match kind {
            "memory" => Deployment::Memory,
            // fsync on every write: a killed Redis comes back with its leases.
            "redis" => Deployment::Redis(
                RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]).await,
            ),
            "postgres" => {
                let cluster = PgCluster::start();
                let admin = cluster.client("postgres").await;
                admin
                    .batch_execute("CREATE DATABASE sidelock")
                    .await
                    .expect("create database");
                Deployment::Postgres(cluster)
            }
            "redlock" => Deployment::Redlock(RedisNodes::start(3).await),
            // A three-node ensemble: one member at a time restarts.
            "zookeeper" => Deployment::ZooKeeper(ZkServer::ensemble().await),
            other => panic!("unknown backend {other}"),
        }
    }

    fn url(&self) -> String {
        match self {
            Deployment::Memory => "memory://".into(),
            Deployment::Redis(s) => s.url(),
            Deployment::Postgres(c) => c.url("sidelock"),
            Deployment::Redlock(n) => n.url(),
            // Short sessions: a killed sidecar's nodes go when its session does.
            Deployment::ZooKeeper(z) => format!("{}?session_timeout=2s", z.url("/safety")),
        }
    }

    /// Memory state lives in one process: restarting it is outside the
    /// backend's guarantee, so only client faults apply there.
    fn sidecars(&self) -> usize {
        if matches!(self, Deployment::Memory) {
            1
        } else {
            3
        }
    }

    fn restarts_sidecars(&self) -> bool {
        !matches!(self, Deployment::Memory)
    }

    /// What the backend holds, for a run that stalled: ZooKeeper's sessions
    /// and their ephemeral nodes (`dump`, answered by the leader) and each
    /// member's mode; nothing for the others.
    fn describe(&self) -> String {
        let Deployment::ZooKeeper(z) = self else {
            return String::new();
        };
        (0..z.len())
            .map(|i| {
                format!(
                    "--- zookeeper member {} ---\n{}{}",
                    i + 1,
                    z.word(i, "srvr"),
                    z.word(i, "dump")
                )
            })
            .collect()
    }

    /// Restarts the backend (Redlock: one node, which comes back empty).
    async fn restart(&mut self) -> Option<&'static str> {
        match self {
            Deployment::Memory => None,
            Deployment::Redis(s) => {
                s.restart().await;
                Some("redis restarted")
            }
            Deployment::Postgres(c) => {
                c.stop_server();
                c.start_server();
                Some("postgres restarted")
            }
            Deployment::Redlock(n) => {
                let i = rand::rng().random_range(0..n.nodes.len());
                // Redlock's delayed restart: a node that comes back empty must
                // stay down for the longest ttl (2 s here, plus the drift),
                // or a lease granted by a bare majority that included it can
                // be granted again (its guarantee; see the README).
                n.nodes[i].kill();
                tokio::time::sleep(REDLOCK_RESTART_DELAY).await;
                n.nodes[i].restart().await;
                Some("redlock node restarted empty")
            }
            Deployment::ZooKeeper(z) => {
                let i = rand::rng().random_range(0..z.len());
                z.restart(i).await;
                Some("zookeeper member restarted")
            }
        }
    }
}

/// One grant as its client saw it.
#[derive(Debug, Clone)]
struct Interval {
    lock: usize,
    fence: u64,
    start: Instant,
    /// When the client stopped acting as the holder.
    end: Instant,
    /// The client was told its lease may have ended (`lost`, 410, or its
    /// hold stream broke) — its critical section may not have been exclusive.
    signaled: bool,
}

/// The protected resources: one per lock, accepting only increasing fences.
#[derive(Default)]
struct Resources {
    last: HashMap<usize, u64>,
    accepted: u64,
    rejected: u64,
}

impl Resources {
    fn write(&mut self, lock: usize, fence: u64) {
        let last = self.last.entry(lock).or_default();
        if fence > *last {
            *last = fence;
            self.accepted += 1;
        } else {
            self.rejected += 1;
        }
    }
}

struct Shared {
    names: Vec<String>,
    urls: RwLock<Vec<String>>,
    resources: Mutex<Resources>,
    intervals: Mutex<Vec<Interval>>,
    http: reqwest::Client,
    /// The end of the faults, and of the run unless it is extended.
    stop: Instant,
    /// The end of the clients' run.
    until: std::sync::Mutex<Instant>,
}

impl Shared {
    fn until(&self) -> Instant {
        *self.until.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn url(&self) -> String {
        let urls = self.urls.read().await;
        urls[rand::rng().random_range(0..urls.len())].clone()
    }

    fn lock_url(&self, base: &str, lock: usize, rest: &str) -> String {
        format!("{base}/v1/locks/{}{rest}", self.names[lock])
    }

    /// Asks `base` for `lock` (acquire with POST, a hold stream with GET on
    /// `/hold`); the response if it is a 200, else nothing.
    async fn claim(
        &self,
        method: reqwest::Method,
        base: &str,
        lock: usize,
        rest: &str,
        (wait, ttl): (u64, u64),
    ) -> Option<reqwest::Response> {
        let url = format!("{}?wait={wait}&ttl={ttl}", self.lock_url(base, lock, rest));
        let response = self.http.request(method, url).send().await.ok()?;
        (response.status() == StatusCode::OK).then_some(response)
    }

    /// Releases `token`, trying other sidecars when one is gone; true if the
    /// answer was 410 (the lease had ended).
    async fn release(&self, lock: usize, token: &str) -> bool {
        for _ in 0..20 {
            let base = self.url().await;
            let url = self.lock_url(&base, lock, "");
            match self
                .http
                .delete(format!("{url}?token={token}"))
                .send()
                .await
            {
                Ok(r) if r.status() == StatusCode::OK => return false,
                Ok(r) if r.status() == StatusCode::GONE => return true,
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        // Unreachable for two seconds: the lease ends at its ttl; the client
        // stopped acting before asking, so its interval is already closed.
        true
    }
}

/// acquire → write → maybe keepalive → release (or crash without releasing).
async fn plain(shared: &Shared, lock: usize, crash: bool) {
    let (wait, ttl) = {
        let mut r = rand::rng();
        // A crashed client's lease blocks the lock until its ttl: keep those short.
        let ttl = if crash {
            r.random_range(200..600)
        } else {
            r.random_range(400..2000)
        };
        (r.random_range(0..800), ttl)
    };
    let base = shared.url().await;
    let Some(response) = shared
        .claim(reqwest::Method::POST, &base, lock, "", (wait, ttl))
        .await
    else {
        return;
    };
    let Ok(grant) = response.json::<Value>().await else {
        return;
    };
    let start = Instant::now();
    let fence = grant["fence"].as_u64().expect("fence");
    let token = grant["token"].as_str().expect("token").to_owned();
    shared.resources.lock().await.write(lock, fence);
    let work = rand::rng().random_range(0..15);
    tokio::time::sleep(Duration::from_millis(work)).await;
    let mut signaled = false;
    if rand::rng().random_bool(0.3) {
        let url = shared.lock_url(&base, lock, "/keepalive");
        if let Ok(r) = shared
            .http
            .post(format!("{url}?token={token}"))
            .send()
            .await
        {
            signaled |= r.status() == StatusCode::GONE;
        }
    }
    let end = Instant::now();
    if !crash {
        signaled |= shared.release(lock, &token).await;
    }
    shared.intervals.lock().await.push(Interval {
        lock,
        fence,
        start,
        end,
        signaled,
    });
}

/// A hold stream: write on `acquired`, work while watching for `lost`, then
/// close (or cut) the connection.
async fn hold(shared: &Shared, lock: usize) {
    let (wait, ttl, work) = {
        let mut r = rand::rng();
        (
            r.random_range(0..800),
            r.random_range(300..1500),
            r.random_range(0..40),
        )
    };
    let base = shared.url().await;
    let Some(response) = shared
        .claim(reqwest::Method::GET, &base, lock, "/hold", (wait, ttl))
        .await
    else {
        return;
    };
    let mut events = sidelock::run::SseReader::new(response.bytes_stream());
    let grant = loop {
        match events.next().await {
            Some(e) if e.event == "acquired" => break e.data,
            Some(e) if e.event == "queued" => {}
            _ => return,
        }
    };
    let start = Instant::now();
    let grant: Value = serde_json::from_str(&grant).expect("acquired data");
    let fence = grant["fence"].as_u64().expect("fence");
    shared.resources.lock().await.write(lock, fence);
    let deadline = tokio::time::Instant::now() + Duration::from_millis(work);
    let mut signaled = false;
    loop {
        match tokio::time::timeout_at(deadline, events.next()).await {
            Err(_) => break,
            Ok(Some(e)) if e.event == "renewed" => {}
            // `lost`, or the stream broke (sidecar killed): no longer exclusive.
            Ok(_) => {
                signaled = true;
                break;
            }
        }
    }
    let end = Instant::now();
    drop(events);
    shared.intervals.lock().await.push(Interval {
        lock,
        fence,
        start,
        end,
        signaled,
    });
}

async fn client(shared: Arc<Shared>) {
    while Instant::now() < shared.until() {
        let (lock, dice) = {
            let mut r = rand::rng();
            (r.random_range(0..LOCKS), r.random_range(0..100))
        };
        match dice {
            0..57 => plain(&shared, lock, false).await,
            57..95 => hold(&shared, lock).await,
            _ => plain(&shared, lock, true).await,
        }
    }
}

/// Kills or stops a random sidecar (or the backend) every so often.
async fn faults(
    shared: Arc<Shared>,
    deployment: &mut Deployment,
    sidecars: &mut [SidecarGuard],
) -> Vec<String> {
    let mut log = Vec::new();
    while Instant::now() + Duration::from_secs(2) < shared.stop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let dice = rand::rng().random_range(0..3);
        if dice == 2 {
            if let Some(what) = deployment.restart().await {
                log.push(what.to_owned());
            }
            continue;
        }
        let i = rand::rng().random_range(0..sidecars.len());
        let old = sidecars[i].base_url().to_owned();
        shared.urls.write().await.retain(|u| *u != old);
        if dice == 0 {
            sidecars[i].signal(nix::sys::signal::Signal::SIGKILL);
            log.push("sidecar SIGKILL".into());
        } else {
            sidecars[i].terminate();
            log.push("sidecar SIGTERM".into());
        }
        let status = sidecars[i].wait_exit(Duration::from_secs(20)).await;
        if dice == 1 {
            assert!(status.success(), "SIGTERM exit status {status}");
        }
        sidecars[i] = SidecarBuilder::new(&deployment.url()).start().await;
        shared
            .urls
            .write()
            .await
            .push(sidecars[i].base_url().to_owned());
    }
    log
}

async fn check(kind: &str) {
    let mut deployment = Deployment::start(kind).await;
    let mut sidecars = Vec::new();
    for _ in 0..deployment.sidecars() {
        sidecars.push(SidecarBuilder::new(&deployment.url()).start().await);
    }
    let nominal = Duration::from_secs(seconds(kind));
    let prefix = unique_name("checked");
    let shared = Arc::new(Shared {
        names: (0..LOCKS).map(|i| format!("{prefix}-{i}")).collect(),
        urls: RwLock::new(sidecars.iter().map(|s| s.base_url().to_owned()).collect()),
        resources: Mutex::default(),
        intervals: Mutex::default(),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .expect("HTTP client"),
        stop: Instant::now() + nominal,
        until: std::sync::Mutex::new(Instant::now() + nominal),
    });
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| tokio::spawn(client(shared.clone())))
        .collect();
    let faults_seen = if deployment.restarts_sidecars() {
        faults(shared.clone(), &mut deployment, &mut sidecars).await
    } else {
        Vec::new()
    };
    // Faults (a restarted ZooKeeper member, a cold JVM) can stall grants for
    // seconds: such a run goes on without faults until it has enough grants
    // to judge, for at most MAX_EXTENSION.
    let cap = shared.stop + MAX_EXTENSION;
    loop {
        let until = shared.until();
        tokio::time::sleep_until((until - Duration::from_millis(500)).into()).await;
        if shared.intervals.lock().await.len() >= MIN_GRANTS || Instant::now() >= cap {
            break;
        }
        *shared.until.lock().unwrap_or_else(|e| e.into_inner()) =
            (until + Duration::from_secs(1)).min(cap);
    }
    for c in clients {
        c.await.expect("client task");
    }
    let seconds = started.elapsed().as_secs_f64();

    let mut intervals = shared.intervals.lock().await.clone();
    intervals.sort_by_key(|i| i.start);
    let mut overlaps = 0;
    let mut silent = 0;
    let mut regressions = 0;
    for lock in 0..LOCKS {
        let mine: Vec<&Interval> = intervals.iter().filter(|i| i.lock == lock).collect();
        let mut latest: Option<&Interval> = None;
        for current in &mine {
            if let Some(prev) = latest {
                if current.start < prev.end && !(prev.signaled || current.signaled) {
                    overlaps += 1;
                    silent += 1;
                }
                if current.fence <= prev.fence {
                    regressions += 1;
                }
            }
            if latest.is_none_or(|l| current.end > l.end) {
                latest = Some(current);
            }
        }
    }
    let resources = shared.resources.lock().await;
    let report = json!({
        "backend": kind,
        "sidecars": deployment.sidecars(),
        "clients": CLIENTS,
        "seconds": seconds,
        "grants": intervals.len(),
        "grants_per_second": intervals.len() as f64 / seconds,
        "signaled_losses": intervals.iter().filter(|i| i.signaled).count(),
        "overlapping_exclusive_intervals": overlaps,
        "fence_regressions": regressions,
        "stale_fence_writes_rejected": resources.rejected,
        "leases_lost_silently": silent,
        "faults": faults_seen,
    });
    let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let _ = std::fs::write(
        target.join(format!("safety-{kind}.json")),
        format!("{report:#}"),
    );
    eprintln!("{report}");
    if intervals.len() < MIN_GRANTS {
        eprintln!("{}", deployment.describe());
    }
    assert!(
        intervals.len() >= MIN_GRANTS,
        "too few grants to judge: {report}"
    );
    assert_eq!(overlaps, 0, "{report}");
    assert_eq!(regressions, 0, "{report}");
    assert_eq!(resources.rejected, 0, "{report}");
    assert_eq!(silent, 0, "{report}");
    for s in &sidecars {
        assert!(
            !s.log().contains("panicked"),
            "a sidecar panicked:\n{}",
            s.log()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_is_safe_under_client_faults() {
    check("memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_is_safe_under_sidecar_and_server_restarts() {
    check("redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_is_safe_under_sidecar_and_server_restarts() {
    check("postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_is_safe_under_sidecar_restarts_and_an_emptied_node() {
    check("redlock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_is_safe_under_sidecar_and_ensemble_member_restarts() {
    check("zookeeper").await;
}
