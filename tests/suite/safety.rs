//! The safety checker: K sidecars × M clients doing random acquire, hold,
//! keepalive and release against one backend, on every lock kind at once —
//! exclusive locks, shared locks on the same names, reentrant owners of
//! exclusive locks, and semaphores with more than one permit — first without
//! faults, then while clients crash, sidecars are killed (SIGKILL) or stopped
//! (SIGTERM) and restarted, and the backend itself restarts (PostgreSQL half
//! the time as a crash, losing what was not flushed). A protected
//! resource per lock accepts a write (exclusive holders) only with a fence
//! above every fence it saw, and a read (shared holders) only with a fence
//! above the last write's. The checker records every grant's interval and
//! reports, per lock kind, overlaps (an exclusive interval overlapping any
//! other interval of its lock; shared may overlap shared), over-grants (more
//! than `limit` permit intervals of a semaphore at once), fence regressions,
//! stale-fence accesses, reentry mismatches and leases lost silently — all
//! must be 0 — and grants per second.
//!
//! # Why a reported violation is real (no false positives)
//!
//! An interval is what the client may assume it held, never more than the
//! backend can have granted: it starts when the grant *answer is received*
//! (the backend granted before it sent the answer) and ends at the earliest
//! of: when the client sends its (last) release or closes its hold stream
//! (the backend releases after that), when it stops acting (a crash), and
//! the lease's expiry as the client was told it (`expires_at_ms` of the
//! grant, a re-entry, a keepalive or a `renewed` event; the sidecars share
//! the test's clock, read a few ms early for rounding). So each interval lies
//! inside the lease's real life, and two intervals that overlap where the
//! contract forbids it are two leases the backend held at once. A plain
//! client told after the fact that its lease may have ended (410, a re-entry
//! answered with another token or 409: SIGTERM releases the plain leases
//! taken through a sidecar, as the contract says) was not promised
//! exclusivity: its interval takes no part in the overlap and over-grant
//! checks. A hold's client acts as the holder until it reads `lost` or the
//! stream's break, however busy it is: its interval ends there, and is
//! checked. A reentrant owner's interval runs from its first grant to the
//! release that brings its count to 0 (or that answers `released`); an
//! intermediate release retried on another sidecar may have counted twice,
//! so the client trusts the count the answer gives.
//!
//! Fences are checked by what the client can order: a grant whose answer was
//! received before another grant was *requested* was made before it, so its
//! fence must be lower (every kind: the README promises strictly increasing
//! fences per name across every grant, a re-entry keeping its fence); no two
//! tokens share a fence — except, reported but not failed, concurrent shared
//! holders on Redlock, where two majorities counting at once can reach the
//! same highest count (no writer is among them, and every later grant is
//! above both). The resource accepts an access only while the client's known
//! expiry has not passed.
//!
//! Redlock refuses semaphores with `limit > 1` (a majority quorum cannot bound
//! a counting semaphore; see the README), so its run uses `limit=1` and
//! checks once that `limit=3` is refused.
//!
//! Short by default (CI); the long run is
//! `SIDELOCK_CHECK_SECONDS=120 cargo nextest run -E 'test(/^safety::/)'`, whose JSON
//! reports (`target/safety-<backend>.json`) feed RELIABILITY.md.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::postgres::PgCluster;
use common::redis::{RedisNodes, RedisServer};
use common::zookeeper::ZkServer;
use common::{SidecarBuilder, SidecarGuard, TestBackend, assert_problem, unique_name};
use eventsource_stream::Eventsource;
use futures::StreamExt;
use rand::RngExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::sync::{Mutex, RwLock};

const CLIENTS: usize = 32;
/// Lock names, each taken exclusively, shared and by reentrant owners.
const LOCKS: usize = 2;
/// Semaphore names.
const SEMAPHORES: usize = 1;
/// A semaphore's permits (Redlock: 1, see [`Deployment::limit`]).
const LIMIT: usize = 3;
/// How long an emptied Redlock node stays down: the longest ttl a client asks
/// for (2 s) plus its drift allowance (1% + 2 ms), rounded up.
const REDLOCK_RESTART_DELAY: Duration = Duration::from_millis(2100);
/// Fewer grants than this are too few to judge a run by.
const MIN_GRANTS: usize = 21;
/// Fewer grants of one kind (or in the fault-free phase) than this are too
/// few to judge that kind by.
const MIN_PER_KIND: usize = 3;
/// How long a run whose faults stalled grants may go on, fault-free, to
/// collect [`MIN_GRANTS`].
const MAX_EXTENSION: Duration = Duration::from_secs(30);
/// How much earlier than the `expires_at_ms` a sidecar reports the checker
/// takes a lease to end: the sidecar and the test read the same clock, each
/// rounded to the millisecond.
const CLOCK_MARGIN_MS: u64 = 5;

/// The run's length: `SIDELOCK_CHECK_SECONDS`, or 8 s — 14 s on ZooKeeper,
/// where a restarted member (a cold JVM) and the sessions moving off it
/// stall grants for seconds. The first quarter is fault-free; a run still
/// short of [`MIN_GRANTS`] then goes on without faults (at most
/// [`MAX_EXTENSION`]).
fn seconds(kind: &str) -> u64 {
    std::env::var("SIDELOCK_CHECK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if kind == "zookeeper" { 14 } else { 8 })
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

    /// A semaphore's permits in the run: Redlock refuses more than one.
    fn limit(&self) -> usize {
        if matches!(self, Deployment::Redlock(_)) {
            1
        } else {
            LIMIT
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
        (0..z.member_count())
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
                // Half the time a crash: releases that did not wait for
                // their WAL flush may come back as leases until their ttl.
                if rand::rng().random_bool(0.5) {
                    c.crash_server();
                    c.start_server();
                    Some("postgres crashed and restarted")
                } else {
                    c.stop_server();
                    c.start_server();
                    Some("postgres restarted")
                }
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
                let i = rand::rng().random_range(0..z.member_count());
                z.restart(i).await;
                Some("zookeeper member restarted")
            }
        }
    }
}

/// What a grant was: the checker's rules and report differ by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grant {
    /// An exclusive lock taken once.
    Exclusive,
    /// A shared (read) lock.
    Shared,
    /// An exclusive lock its owner re-acquired (same token) before releasing.
    Reentrant,
    /// A semaphore permit.
    Permit,
}

impl Grant {
    const ALL: [Grant; 4] = [
        Grant::Exclusive,
        Grant::Shared,
        Grant::Reentrant,
        Grant::Permit,
    ];

    fn index(self) -> usize {
        self as usize
    }

    fn name(self) -> &'static str {
        match self {
            Grant::Exclusive => "exclusive",
            Grant::Shared => "shared",
            Grant::Reentrant => "reentrant",
            Grant::Permit => "semaphore",
        }
    }

    /// Excludes every other holder of its lock.
    fn exclusive(self) -> bool {
        matches!(self, Grant::Exclusive | Grant::Reentrant)
    }
}

/// One grant as its client saw it.
#[derive(Debug, Clone)]
struct Interval {
    /// Index into [`Shared::targets`].
    target: usize,
    kind: Grant,
    token: String,
    fence: u64,
    /// When the request that was granted was sent.
    requested: Instant,
    /// When the grant's answer arrived.
    start: Instant,
    /// When the client stopped acting as the holder, or the lease's expiry as
    /// the client knew it, whichever came first.
    end: Instant,
    /// The client was told its lease may have ended after the fact (410, a
    /// re-entry answered 409 or with another token) — its critical section
    /// may not have been exclusive, and takes no part in the checks.
    signaled: bool,
    /// A hold's client read `lost` (or its stream broke) at its end: it
    /// acted as the holder until then, and the interval is checked.
    told: bool,
    /// Started after the faults began.
    faulted: bool,
}

/// The instant a lease the sidecar says expires at `at_ms` (Unix ms, the
/// machine's clock) ends, read [`CLOCK_MARGIN_MS`] early.
fn expiry(at_ms: Option<u64>) -> Instant {
    let now = Instant::now();
    let wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let left = at_ms
        .unwrap_or(0)
        .saturating_sub(wall)
        .saturating_sub(CLOCK_MARGIN_MS);
    now + Duration::from_millis(left)
}

/// The protected resources: one per lock, written by exclusive holders and
/// read by shared ones.
#[derive(Default)]
struct Resources {
    /// The highest fence each lock's resource saw.
    seen: HashMap<usize, u64>,
    /// The fence of each lock's last write.
    written: HashMap<usize, u64>,
    /// Accesses refused for a stale fence, per [`Grant`] kind.
    rejected: [u64; 4],
}

impl Resources {
    fn access(&mut self, target: usize, kind: Grant, fence: u64) {
        let seen = self.seen.entry(target).or_default();
        let written = self.written.entry(target).or_default();
        let fresh = match kind {
            // A writer must come after every holder before it (or be the
            // last writer, writing again after a re-entry).
            Grant::Exclusive | Grant::Reentrant => {
                fence > *seen || (fence == *seen && fence == *written)
            }
            // A reader must come after the last writer.
            Grant::Shared => fence > *written,
            Grant::Permit => true,
        };
        if !fresh {
            self.rejected[kind.index()] += 1;
            return;
        }
        *seen = (*seen).max(fence);
        if kind.exclusive() {
            *written = fence;
        }
    }
}

/// How a release was answered.
enum Release {
    /// 200 with this hold count left (`released: false`).
    Held(u64),
    /// 200 `released: true`.
    Released,
    /// 410, or no sidecar answered: the lease had ended (or will at its ttl).
    Gone,
}

struct Shared {
    /// `locks/<name>` for the first [`LOCKS`], then `semaphores/<name>`.
    targets: Vec<String>,
    /// A semaphore's permits.
    limit: usize,
    urls: RwLock<Vec<String>>,
    resources: Mutex<Resources>,
    intervals: Mutex<Vec<Interval>>,
    /// Re-entries that answered another fence or hold count than expected.
    reentry_mismatches: AtomicU64,
    /// Re-entries performed (answered with the owner's own token).
    reentries: AtomicU64,
    /// Owners, unique per acquisition.
    owners: AtomicU64,
    http: reqwest::Client,
    /// The end of the fault-free phase.
    faults_from: Instant,
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

    fn target_url(&self, base: &str, target: usize, rest: &str) -> String {
        format!("{base}/v1/{}{rest}", self.targets[target])
    }

    /// The URL that asks for `kind` on `target` (`rest`: "" to acquire,
    /// `/hold` for a hold stream).
    fn claim_url(
        &self,
        base: &str,
        target: usize,
        rest: &str,
        kind: Grant,
        (wait, ttl): (u64, u64),
        owner: Option<&str>,
    ) -> String {
        let mut url = format!(
            "{}?wait={wait}&ttl={ttl}",
            self.target_url(base, target, rest)
        );
        match kind {
            Grant::Shared => url.push_str("&mode=shared"),
            Grant::Permit => url.push_str(&format!("&limit={}", self.limit)),
            Grant::Exclusive | Grant::Reentrant => {}
        }
        if let Some(owner) = owner {
            url.push_str(&format!("&owner={owner}"));
        }
        url
    }

    /// Hands the resource an access by a holder whose lease, as far as it
    /// knows, has not expired.
    async fn access(&self, target: usize, kind: Grant, fence: u64, expires: Instant) {
        if Instant::now() < expires {
            self.resources.lock().await.access(target, kind, fence);
        }
    }

    /// Releases one hold of `token`, trying other sidecars when one is gone;
    /// also whether it had to retry (an earlier try may have counted).
    async fn release(&self, target: usize, token: &str) -> (Release, bool) {
        for attempt in 0..20 {
            let base = self.url().await;
            let url = self.target_url(&base, target, "");
            let retried = attempt > 0;
            match self
                .http
                .delete(format!("{url}?token={token}"))
                .send()
                .await
            {
                Ok(r) if r.status() == StatusCode::OK => {
                    let body = r.json::<Value>().await.unwrap_or_default();
                    return match body["count"].as_u64() {
                        Some(n) if body["released"] == false && n > 0 => {
                            (Release::Held(n), retried)
                        }
                        _ => (Release::Released, retried),
                    };
                }
                Ok(r) if r.status() == StatusCode::GONE => return (Release::Gone, retried),
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        // Unreachable for two seconds: the lease ends at its ttl; the client
        // stopped acting before asking, so its interval is already closed.
        (Release::Gone, true)
    }

    async fn record(&self, mut interval: Interval, expires: Instant) {
        interval.end = interval.end.min(expires);
        interval.faulted = interval.start >= self.faults_from;
        self.intervals.lock().await.push(interval);
    }
}

/// acquire → access the resource → (reentrant: re-acquire 1–2 times) → maybe
/// keepalive → release as many times as held (or crash without releasing).
async fn plain(shared: &Shared, target: usize, kind: Grant, crash: bool) {
    let (wait, ttl, reentries) = {
        let mut r = rand::rng();
        // A crashed client's lease blocks the lock until its ttl: keep those short.
        let ttl = if crash {
            r.random_range(200..600)
        } else {
            r.random_range(400..2000)
        };
        let reentries = if kind == Grant::Reentrant {
            r.random_range(1..=2)
        } else {
            0
        };
        (r.random_range(0..800), ttl, reentries)
    };
    let owner = format!("checker-{}", shared.owners.fetch_add(1, Ordering::Relaxed));
    let base = shared.url().await;
    let url = shared.claim_url(&base, target, "", kind, (wait, ttl), Some(&owner));
    let requested = Instant::now();
    let Ok(response) = shared.http.post(&url).send().await else {
        return;
    };
    if response.status() != StatusCode::OK {
        return;
    }
    let Ok(grant) = response.json::<Value>().await else {
        return;
    };
    let start = Instant::now();
    let mut expires = expiry(grant["expires_at_ms"].as_u64());
    let fence = grant["fence"].as_u64().expect("fence");
    let token = grant["token"].as_str().expect("token").to_owned();
    let mut interval = Interval {
        target,
        kind,
        token: token.clone(),
        fence,
        requested,
        start,
        end: start,
        signaled: false,
        told: false,
        faulted: false,
    };
    shared.access(target, kind, fence, expires).await;
    let work = rand::rng().random_range(0..15);
    tokio::time::sleep(Duration::from_millis(work)).await;

    // Re-entry on the same sidecar, as a client talks to its own.
    let mut count = 1;
    // A re-entry whose answer was lost may have counted.
    let mut uncertain = false;
    for _ in 0..reentries {
        let Ok(r) = shared.http.post(&url).send().await else {
            uncertain = true;
            break;
        };
        if r.status() == StatusCode::CONFLICT {
            // Someone else holds the lock: ours is gone.
            interval.signaled = true;
            break;
        }
        if r.status() != StatusCode::OK {
            uncertain = true;
            break;
        }
        let Ok(again) = r.json::<Value>().await else {
            uncertain = true;
            break;
        };
        if again["token"].as_str() != Some(token.as_str()) {
            // A new lease: the one re-entered had ended. Release the new one
            // at once (it is a grant of its own, checked like any other).
            interval.signaled = true;
            reentered_elsewhere(shared, target, requested, &again).await;
            break;
        }
        count += 1;
        shared.reentries.fetch_add(1, Ordering::Relaxed);
        if again["fence"].as_u64() != Some(fence)
            || (!uncertain && again["count"].as_u64() != Some(count))
        {
            shared.reentry_mismatches.fetch_add(1, Ordering::Relaxed);
        }
        count = again["count"].as_u64().unwrap_or(count);
        expires = expires.max(expiry(again["expires_at_ms"].as_u64()));
        shared.access(target, kind, fence, expires).await;
    }

    if rand::rng().random_bool(0.3) {
        let url = shared.target_url(&base, target, "/keepalive");
        if let Ok(r) = shared
            .http
            .post(format!("{url}?token={token}"))
            .send()
            .await
        {
            if r.status() == StatusCode::GONE {
                interval.signaled = true;
            } else if r.status() == StatusCode::OK {
                let body = r.json::<Value>().await.unwrap_or_default();
                expires = expires.max(expiry(body["expires_at_ms"].as_u64()));
            }
        }
    }
    interval.end = Instant::now();
    if crash {
        shared.record(interval, expires).await;
        return;
    }
    for _ in 0..5 {
        // The lease may end with this release: the client stops acting now.
        interval.end = Instant::now();
        match shared.release(target, &token).await {
            (Release::Gone, _) => {
                interval.signaled = true;
                break;
            }
            (Release::Released, retried) => {
                if count != 1 && !retried && !uncertain {
                    shared.reentry_mismatches.fetch_add(1, Ordering::Relaxed);
                }
                break;
            }
            (Release::Held(left), retried) => {
                if left != count - 1 && !retried && !uncertain {
                    shared.reentry_mismatches.fetch_add(1, Ordering::Relaxed);
                }
                count = left;
            }
        }
    }
    shared.record(interval, expires).await;
}

/// A re-entry answered with a token other than the owner's: recorded as an
/// exclusive grant of its own and released at once.
async fn reentered_elsewhere(shared: &Shared, target: usize, requested: Instant, grant: &Value) {
    let start = Instant::now();
    let expires = expiry(grant["expires_at_ms"].as_u64());
    let (Some(fence), Some(token)) = (grant["fence"].as_u64(), grant["token"].as_str()) else {
        return;
    };
    let mut interval = Interval {
        target,
        kind: Grant::Exclusive,
        token: token.to_owned(),
        fence,
        requested,
        start,
        end: start,
        signaled: false,
        told: false,
        faulted: false,
    };
    interval.signaled = matches!(shared.release(target, token).await.0, Release::Gone);
    shared.record(interval, expires).await;
}

/// A hold stream: access the resource on `acquired`, work while watching for
/// `lost`, then close (or cut) the connection. A busy client (a third) works
/// in one step without reading, and reads what came meanwhile only after
/// it. Either way the client acts as the holder until it reads `lost` (or
/// the stream's break): its interval ends there, and is checked like any
/// other — a `lost` that came after another was granted is no excuse.
async fn hold(shared: &Shared, target: usize, kind: Grant) {
    let (wait, ttl, busy) = {
        let mut r = rand::rng();
        (
            r.random_range(0..800),
            r.random_range(300..1500),
            r.random_bool(0.3),
        )
    };
    let work = rand::rng().random_range(0..if busy { 200 } else { 40 });
    let base = shared.url().await;
    let url = shared.claim_url(&base, target, "/hold", kind, (wait, ttl), None);
    let requested = Instant::now();
    let Ok(response) = shared.http.get(&url).send().await else {
        return;
    };
    if response.status() != StatusCode::OK {
        return;
    }
    let mut events = response.bytes_stream().eventsource();
    let grant = loop {
        match events.next().await {
            Some(Ok(e)) if e.event == "acquired" => break e.data,
            Some(Ok(e)) if e.event == "queued" => {}
            _ => return,
        }
    };
    let start = Instant::now();
    let grant: Value = serde_json::from_str(&grant).expect("acquired data");
    let mut expires = expiry(grant["expires_at_ms"].as_u64());
    let fence = grant["fence"].as_u64().expect("fence");
    let token = grant["token"].as_str().expect("token").to_owned();
    shared.access(target, kind, fence, expires).await;
    let mut deadline = tokio::time::Instant::now() + Duration::from_millis(work);
    if busy {
        tokio::time::sleep_until(deadline).await;
        shared.access(target, kind, fence, expires).await;
        deadline = tokio::time::Instant::now();
    }
    let mut told = false;
    loop {
        let next = if busy {
            // What arrived during the step, without waiting for more.
            match futures::FutureExt::now_or_never(events.next()) {
                Some(e) => Ok(e),
                None => break,
            }
        } else {
            tokio::time::timeout_at(deadline, events.next()).await
        };
        match next {
            Err(_) => break,
            Ok(Some(Ok(e))) if e.event == "renewed" => {
                let renewed: Value = serde_json::from_str(&e.data).unwrap_or_default();
                expires = expires.max(expiry(renewed["expires_at_ms"].as_u64()));
            }
            // `lost`, or the stream broke (sidecar killed): no longer exclusive.
            Ok(_) => {
                told = true;
                break;
            }
        }
    }
    let end = Instant::now();
    drop(events);
    let interval = Interval {
        target,
        kind,
        token,
        fence,
        requested,
        start,
        end,
        signaled: false,
        told,
        faulted: false,
    };
    shared.record(interval, expires).await;
}

async fn client(shared: Arc<Shared>) {
    while Instant::now() < shared.until() {
        let (target, mode, dice) = {
            let mut r = rand::rng();
            (
                r.random_range(0..shared.targets.len()),
                r.random_range(0..100),
                r.random_range(0..100),
            )
        };
        let kind = match (target < LOCKS, mode) {
            (false, _) => Grant::Permit,
            (true, 0..50) => Grant::Exclusive,
            (true, 50..80) => Grant::Shared,
            (true, _) => Grant::Reentrant,
        };
        // Clients crash only once the faults have begun.
        let faulty = Instant::now() >= shared.faults_from && Instant::now() < shared.stop;
        match dice {
            // A hold stream has one lease: no re-entry.
            57..95 if kind != Grant::Reentrant => hold(&shared, target, kind).await,
            95.. if faulty && kind != Grant::Reentrant => plain(&shared, target, kind, true).await,
            _ => plain(&shared, target, kind, false).await,
        }
    }
}

/// After the fault-free phase, kills or stops a random sidecar (or restarts
/// the backend) every so often.
async fn faults(
    shared: Arc<Shared>,
    deployment: &mut Deployment,
    sidecars: &mut [SidecarGuard],
) -> Vec<String> {
    let mut log = Vec::new();
    tokio::time::sleep_until(shared.faults_from.into()).await;
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

/// What the intervals show, per [`Grant`] kind.
#[derive(Default)]
struct Verdict {
    /// Pairs of intervals of one lock that overlap where one is exclusive
    /// (counted under the later one's kind).
    overlaps: [u64; 4],
    /// Permit grants that made more than `limit` intervals at once.
    over_grants: u64,
    /// The most permit intervals of one semaphore at once.
    max_permits: usize,
    /// Grants whose fence is not above that of a grant answered before they
    /// were requested.
    fence_regressions: [u64; 4],
    /// Grants whose fence another token also got (only concurrent grants can:
    /// any other pair is ordered, and counted above).
    fence_duplicates: [u64; 4],
    /// Intervals (nobody told of a loss) that were part of an overlap or an
    /// over-grant: leases lost silently.
    silent: [u64; 4],
}

/// Judges `intervals` by the rules in the module doc; `locks` of the targets
/// are locks, the rest semaphores of `limit` permits.
fn judge(intervals: &[Interval], targets: usize, locks: usize, limit: usize) -> Verdict {
    let mut verdict = Verdict::default();
    let mut conflicted = HashSet::new();
    for target in 0..targets {
        let mut mine: Vec<(usize, &Interval)> = intervals
            .iter()
            .enumerate()
            .filter(|(_, i)| i.target == target)
            .collect();

        // Fences: ordered by what the clients can order, and never shared.
        let mut by_start = mine.clone();
        by_start.sort_by_key(|(_, i)| i.start);
        let mut by_request = mine.clone();
        by_request.sort_by_key(|(_, i)| i.requested);
        let mut before = by_start.iter().peekable();
        let mut highest = None;
        for (_, b) in &by_request {
            while let Some((_, a)) = before.next_if(|(_, a)| a.start < b.requested) {
                highest = highest.max(Some(a.fence));
            }
            if highest.is_some_and(|h| b.fence <= h) {
                verdict.fence_regressions[b.kind.index()] += 1;
            }
        }
        let mut tokens: HashMap<u64, &str> = HashMap::new();
        for (_, i) in &mine {
            if tokens
                .insert(i.fence, &i.token)
                .is_some_and(|t| t != i.token)
            {
                verdict.fence_duplicates[i.kind.index()] += 1;
            }
        }

        // Overlaps: among intervals nobody was told may have ended.
        mine.retain(|(_, i)| !i.signaled && i.end > i.start);
        mine.sort_by_key(|(_, i)| i.start);
        let mut active: Vec<(usize, &Interval)> = Vec::new();
        for (ix, x) in mine {
            active.retain(|(_, a)| a.end > x.start);
            if target < locks {
                for (ia, a) in &active {
                    if a.kind.exclusive() || x.kind.exclusive() {
                        verdict.overlaps[x.kind.index()] += 1;
                        conflicted.insert(*ia);
                        conflicted.insert(ix);
                    }
                }
                active.push((ix, x));
            } else {
                active.push((ix, x));
                verdict.max_permits = verdict.max_permits.max(active.len());
                if active.len() > limit {
                    verdict.over_grants += 1;
                    conflicted.extend(active.iter().map(|(i, _)| *i));
                }
            }
        }
    }
    for i in conflicted {
        verdict.silent[intervals[i].kind.index()] += 1;
    }
    verdict
}

/// Whether the run has enough grants of every kind, and in each phase, to be
/// judged.
fn enough(intervals: &[Interval]) -> bool {
    intervals.len() >= MIN_GRANTS
        && intervals.iter().filter(|i| !i.faulted).count() >= MIN_PER_KIND
        && Grant::ALL
            .iter()
            .all(|k| intervals.iter().filter(|i| i.kind == *k).count() >= MIN_PER_KIND)
}

async fn check(kind: &str) {
    let mut deployment = Deployment::start(kind).await;
    let mut sidecars = Vec::new();
    for _ in 0..deployment.sidecars() {
        sidecars.push(SidecarBuilder::new(&deployment.url()).start().await);
    }
    let nominal = Duration::from_secs(seconds(kind));
    let prefix = unique_name("checked");
    let started = Instant::now();
    let shared = Arc::new(Shared {
        targets: (0..LOCKS)
            .map(|i| format!("locks/{prefix}-{i}"))
            .chain((0..SEMAPHORES).map(|i| format!("semaphores/{prefix}-{i}")))
            .collect(),
        limit: deployment.limit(),
        urls: RwLock::new(sidecars.iter().map(|s| s.base_url().to_owned()).collect()),
        resources: Mutex::default(),
        intervals: Mutex::default(),
        reentry_mismatches: AtomicU64::new(0),
        reentries: AtomicU64::new(0),
        owners: AtomicU64::new(0),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .expect("HTTP client"),
        faults_from: started + nominal / 4,
        stop: started + nominal,
        until: std::sync::Mutex::new(started + nominal),
    });
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
        if enough(&shared.intervals.lock().await) || Instant::now() >= cap {
            break;
        }
        *shared.until.lock().unwrap_or_else(|e| e.into_inner()) =
            (until + Duration::from_secs(1)).min(cap);
    }
    for c in clients {
        c.await.expect("client task");
    }
    let seconds = started.elapsed().as_secs_f64();

    let intervals = shared.intervals.lock().await.clone();
    let verdict = judge(&intervals, shared.targets.len(), LOCKS, shared.limit);
    let resources = shared.resources.lock().await;
    let mismatches = shared.reentry_mismatches.load(Ordering::Relaxed);
    let per_kind: serde_json::Map<String, Value> = Grant::ALL
        .iter()
        .map(|k| {
            let of_kind = || intervals.iter().filter(|i| i.kind == *k);
            let mut report = json!({
                "grants": of_kind().count(),
                "grants_without_faults": of_kind().filter(|i| !i.faulted).count(),
                "signaled_losses": of_kind().filter(|i| i.signaled || i.told).count(),
                "fence_regressions": verdict.fence_regressions[k.index()],
                "fence_duplicates": verdict.fence_duplicates[k.index()],
                "stale_fence_accesses_rejected": resources.rejected[k.index()],
                "leases_lost_silently": verdict.silent[k.index()],
            });
            if *k == Grant::Permit {
                report["limit"] = json!(shared.limit);
                report["max_concurrent_permits"] = json!(verdict.max_permits);
                report["over_grants"] = json!(verdict.over_grants);
            } else {
                report["overlaps"] = json!(verdict.overlaps[k.index()]);
            }
            if *k == Grant::Reentrant {
                report["reentries"] = json!(shared.reentries.load(Ordering::Relaxed));
                report["reentry_mismatches"] = json!(mismatches);
            }
            (k.name().to_owned(), report)
        })
        .collect();
    let overlaps: u64 = verdict.overlaps.iter().sum();
    let regressions: u64 = verdict.fence_regressions.iter().sum();
    // Redlock's concurrent shared holders can share a fence: each takes the
    // highest count of its own majority, and two majorities counting at once
    // can reach the same highest count. Reported, not failed: no writer is
    // among them, and any later grant is above both (fence_regressions).
    let duplicates: u64 = Grant::ALL
        .iter()
        .filter(|k| !(**k == Grant::Shared && matches!(deployment, Deployment::Redlock(_))))
        .map(|k| verdict.fence_duplicates[k.index()])
        .sum();
    let rejected: u64 = resources.rejected.iter().sum();
    let silent: u64 = verdict.silent.iter().sum();
    let report = json!({
        "backend": kind,
        "sidecars": deployment.sidecars(),
        "clients": CLIENTS,
        "seconds": seconds,
        "fault_free_seconds": (nominal / 4).as_secs_f64(),
        "grants": intervals.len(),
        "grants_per_second": intervals.len() as f64 / seconds,
        "signaled_losses": intervals.iter().filter(|i| i.signaled || i.told).count(),
        "overlapping_exclusive_intervals": overlaps,
        "semaphore_over_grants": verdict.over_grants,
        "fence_regressions": regressions,
        "fence_duplicates": verdict.fence_duplicates.iter().sum::<u64>(),
        "stale_fence_writes_rejected": rejected,
        "leases_lost_silently": silent,
        "reentry_mismatches": mismatches,
        "kinds": per_kind,
        "faults": faults_seen,
    });
    let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let _ = std::fs::write(
        target.join(format!("safety-{kind}.json")),
        format!("{report:#}"),
    );
    eprintln!("{report}");
    if !enough(&intervals) {
        eprintln!("{}", deployment.describe());
    }
    assert!(enough(&intervals), "too few grants to judge: {report}");
    assert_eq!(overlaps, 0, "{report}");
    assert_eq!(verdict.over_grants, 0, "{report}");
    assert_eq!(regressions, 0, "{report}");
    assert_eq!(duplicates, 0, "{report}");
    assert_eq!(rejected, 0, "{report}");
    assert_eq!(silent, 0, "{report}");
    assert_eq!(mismatches, 0, "{report}");
    for s in &sidecars {
        assert!(
            !s.log().contains("panicked"),
            "a sidecar panicked:\n{}",
            s.log()
        );
    }
    if let Deployment::Redlock(_) = deployment {
        let base = sidecars[0].base_url();
        let name = unique_name("more-permits");
        refuses_more_than_one_permit(base, &name).await;
    }
}

/// Redlock: a semaphore of 3 permits is refused with 400 `unsupported`; one
/// of 1 permit is granted.
async fn refuses_more_than_one_permit(base: &str, name: &str) {
    let http = reqwest::Client::new();
    let url = format!("{base}/v1/semaphores/{name}");
    let refused = http
        .post(format!("{url}?limit=3&ttl=5s"))
        .send()
        .await
        .expect("acquire");
    let problem = assert_problem(refused, StatusCode::BAD_REQUEST, "unsupported").await;
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("limit")),
        "the refusal says which parameter: {problem}"
    );
    let granted = http
        .post(format!("{url}?limit=1&ttl=5s"))
        .send()
        .await
        .expect("acquire");
    assert_eq!(granted.status(), StatusCode::OK, "limit=1 stays allowed");
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

/// Finding 1's workload, fault-free: 12 clients spread over two sidecars
/// (one on memory) loop on one semaphore of 3 permits (wait 3 s, hold 20 ms,
/// release) for `SIDELOCK_CHECK_SECONDS` (default 3 s). Never more than 3
/// permit intervals at once, judged as in [`check`]; the report goes to
/// `target/safety-semaphore-<backend>.json`.
async fn semaphore_admits_at_most_its_limit(backend: TestBackend) {
    const HOLDERS: usize = 12;
    let guard = backend.start().await;
    let sidecars = guard.sidecars(2).await;
    let urls: Vec<String> = sidecars.iter().map(|s| s.base_url().to_owned()).collect();
    let name = unique_name("permits");
    let seconds = std::env::var("SIDELOCK_CHECK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let until = Instant::now() + Duration::from_secs(seconds);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("HTTP client");
    let intervals = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..HOLDERS)
        .map(|c| {
            let url = format!("{}/v1/semaphores/{name}", urls[c % urls.len()]);
            let (http, intervals) = (http.clone(), intervals.clone());
            tokio::spawn(async move {
                while Instant::now() < until {
                    let requested = Instant::now();
                    let response = http
                        .post(format!("{url}?limit={LIMIT}&wait=3s&ttl=2s"))
                        .send()
                        .await
                        .expect("acquire");
                    if response.status() != StatusCode::OK {
                        continue;
                    }
                    let grant: Value = response.json().await.expect("grant");
                    let start = Instant::now();
                    let expires = expiry(grant["expires_at_ms"].as_u64());
                    let token = grant["token"].as_str().expect("token").to_owned();
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let end = Instant::now().min(expires);
                    let released = http
                        .delete(format!("{url}?token={token}"))
                        .send()
                        .await
                        .expect("release");
                    intervals.lock().await.push(Interval {
                        target: 0,
                        kind: Grant::Permit,
                        token,
                        fence: grant["fence"].as_u64().expect("fence"),
                        requested,
                        start,
                        end,
                        signaled: released.status() != StatusCode::OK,
                        told: false,
                        faulted: false,
                    });
                }
            })
        })
        .collect();
    for c in clients {
        c.await.expect("client task");
    }
    let intervals = intervals.lock().await;
    let verdict = judge(&intervals, 1, 0, LIMIT);
    let report = json!({
        "backend": backend.info_kind(),
        "sidecars": sidecars.len(),
        "grants": intervals.len(),
        "told_of_a_loss": intervals.iter().filter(|i| i.signaled).count(),
        "max_concurrent_permits": verdict.max_permits,
        "over_grants": verdict.over_grants,
        "fence_regressions": verdict.fence_regressions[Grant::Permit.index()],
        "fence_duplicates": verdict.fence_duplicates[Grant::Permit.index()],
    });
    let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let _ = std::fs::write(
        target.join(format!("safety-semaphore-{}.json", backend.info_kind())),
        format!("{report:#}"),
    );
    eprintln!("{report}");
    assert!(intervals.len() >= MIN_GRANTS, "too few grants: {report}");
    assert_eq!(
        verdict.over_grants, 0,
        "more than {LIMIT} holders: {report}"
    );
    assert!(verdict.max_permits <= LIMIT, "{report}");
    assert_eq!(
        verdict.fence_regressions[Grant::Permit.index()],
        0,
        "{report}"
    );
    assert_eq!(
        verdict.fence_duplicates[Grant::Permit.index()],
        0,
        "{report}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_semaphore_of_3_never_has_4_holders() {
    semaphore_admits_at_most_its_limit(TestBackend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_semaphore_of_3_never_has_4_holders_across_two_sidecars() {
    semaphore_admits_at_most_its_limit(TestBackend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_semaphore_of_3_never_has_4_holders_across_two_sidecars() {
    semaphore_admits_at_most_its_limit(TestBackend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zookeeper_semaphore_of_3_never_has_4_holders_across_two_sidecars() {
    semaphore_admits_at_most_its_limit(TestBackend::ZooKeeper).await;
}

/// Finding 1: a majority quorum cannot bound a counting semaphore, so
/// Redlock refuses `limit > 1` instead of over-granting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_refuses_a_semaphore_of_more_than_one_permit() {
    let guard = TestBackend::Redlock.start().await;
    let sidecar = guard.start_sidecar().await;
    refuses_more_than_one_permit(sidecar.base_url(), &unique_name("permits")).await;
}
