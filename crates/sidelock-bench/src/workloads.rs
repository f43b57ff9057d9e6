//! The workloads: uncontended pairs, contended handoffs, idle waiters,
//! crash recovery and start-up.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde::Serialize;
use tokio::sync::Barrier;

use crate::client::{Latency, Locker, Refused, histogram, latency, record};
use crate::counters::{Counter, Ops};
use crate::procs::{CpuMeter, Sidecar, rss_kib};

/// Workload 1 for one client count.
#[derive(Debug, Serialize)]
pub struct Uncontended {
    pub clients: usize,
    pub pairs: u64,
    pub pairs_per_s: f64,
    pub acquire: Latency,
    pub release: Latency,
    pub errors: u64,
    pub backend_ops: Option<Ops>,
    pub round_trips_per_pair: Option<f64>,
    pub commands_per_pair: Option<f64>,
    /// CPU time per pair (µs) of the bench, the sidecars and the backend's
    /// servers (when they run on this machine), warm-up included: with the
    /// cores saturated, pairs/s is the inverse of their sum.
    pub cpu_us_per_pair: BTreeMap<&'static str, f64>,
}

/// Workload 2 for one client count.
#[derive(Debug, Serialize)]
pub struct Contended {
    pub clients: usize,
    pub sidecars: usize,
    /// Acquisitions within the measured time.
    pub grants: u64,
    pub grants_per_s: f64,
    /// Acquisitions by a client other than the previous holder.
    pub handoffs: u64,
    pub handoffs_per_s: f64,
    /// From the holder sending its release to the next (other) holder receiving its grant.
    pub handoff: Latency,
    /// From asking to being granted.
    pub wait: Latency,
    pub max_wait_ms: f64,
    pub backend_ops: Option<Ops>,
    /// Backend operations per acquisition (every grant, including the tail
    /// after the measured time, is one acquire + one release).
    pub round_trips_per_grant: Option<f64>,
    pub commands_per_grant: Option<f64>,
    /// CPU time per acquisition (µs) of the bench, the sidecars and the
    /// backend's servers (when they run on this machine).
    pub cpu_us_per_grant: BTreeMap<&'static str, f64>,
    pub errors: u64,
}

/// Workload 3 for one waiter count.
#[derive(Debug, Serialize)]
pub struct Idle {
    pub waiters: usize,
    /// Waiters the sidecar reported queued (sidecar runs only).
    pub queued: Option<u64>,
    /// Waiter requests that ended before the measurement (refused or failed).
    pub waiter_errors: u64,
    /// The first few distinct reasons those requests gave, so a refusal is
    /// explained in the report rather than only counted.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub waiter_error_samples: Vec<String>,
    /// Seconds from the first request until all were queued (or ended):
    /// how long the backend took to take the burst of joins.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queued_in_s: Option<f64>,
    pub seconds: f64,
    pub backend_ops: Option<Ops>,
    pub round_trips_per_s: Option<f64>,
    pub commands_per_s: Option<f64>,
    pub rss_before_kib: Option<u64>,
    pub rss_kib: Option<u64>,
    pub rss_per_waiter_kib: Option<f64>,
}

/// Workload 4.
#[derive(Debug, Serialize)]
pub struct Crash {
    /// Hold stream's connection closed → next waiter granted, milliseconds.
    pub hold_cut_ms: Vec<f64>,
    /// Holder process (`sidelock run`) killed with SIGKILL → next grant.
    pub client_killed_ms: Vec<f64>,
    /// Rounds that could not be measured, and why.
    pub errors: Vec<String>,
    /// Holding sidecar killed with SIGKILL → next grant on the other sidecar
    /// (bounded by the lease ttl, `sidecar_killed_ttl_ms`).
    pub sidecar_killed_ms: Vec<f64>,
    pub sidecar_killed_ttl_ms: Option<u64>,
    pub hold_cut_p50_ms: Option<f64>,
    pub hold_cut_max_ms: Option<f64>,
    pub client_killed_max_ms: Option<f64>,
}

/// Workload 5.
#[derive(Debug, Serialize)]
pub struct Startup {
    /// Exec → first `/readyz` 200, per start.
    pub ready_ms: Vec<f64>,
    pub ready_p50_ms: f64,
    pub idle_rss_kib: Vec<u64>,
    pub idle_rss_max_kib: u64,
}

/// Where a workload sends its requests.
#[derive(Clone)]
pub struct Target {
    pub urls: Vec<String>,
    pub pids: Vec<Option<u32>>,
    pub api_token: Option<String>,
}

impl Target {
    pub(crate) fn url(&self, i: usize) -> &str {
        &self.urls[i % self.urls.len()]
    }
    fn locker(&self, i: usize) -> Locker {
        Locker::sidecar(self.url(i), self.api_token.as_deref())
    }
}

pub(crate) fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn per_op(n: u64, d: u64) -> f64 {
    (n as f64 / d.max(1) as f64 * 100.0).round() / 100.0
}

fn per(n: u64, d: f64) -> f64 {
    if d > 0.0 {
        (n as f64 / d * 10.0).round() / 10.0
    } else {
        0.0
    }
}

/// Workload 1: each client acquires and releases its own lock in a loop.
///
/// # Errors
/// When a client cannot make its first pair.
pub async fn uncontended(
    lockers: Vec<Locker>,
    duration: Duration,
    run: &str,
    counter: &mut Option<Counter>,
    client_round_trips: Option<&AtomicU64>,
    processes: &[(&'static str, u32)],
) -> Result<Uncontended, String> {
    let clients = lockers.len();
    let barrier = Arc::new(Barrier::new(clients));
    let spawn_all = async {
        let mut tasks = Vec::new();
        for (i, mut locker) in lockers.into_iter().enumerate() {
            let barrier = barrier.clone();
            let name = format!("bench-u-{run}-{clients}-{i}");
            tasks.push(tokio::spawn(async move {
                // Warm-up: opens the connection.
                let warm = async {
                    let t = locker.acquire(&name, Duration::ZERO).await?;
                    locker.release(&name, &t).await.map_err(Refused::Failed)
                };
                let warmed = warm.await;
                barrier.wait().await;
                if let Err(e) = warmed {
                    return Err(format!("{e:?}"));
                }
                let (mut acq, mut rel) = (histogram(), histogram());
                let (mut pairs, mut errors) = (0u64, 0u64);
                let start = Instant::now();
                let deadline = start + duration;
                while Instant::now() < deadline {
                    let t0 = Instant::now();
                    let token = match locker.acquire(&name, Duration::ZERO).await {
                        Ok(t) => t,
                        Err(_) => {
                            errors += 1;
                            continue;
                        }
                    };
                    let t1 = Instant::now();
                    if locker.release(&name, &token).await.is_err() {
                        errors += 1;
                        continue;
                    }
                    let t2 = Instant::now();
                    record(&mut acq, t1 - t0);
                    record(&mut rel, t2 - t1);
                    pairs += 1;
                }
                // The client lives until the CPU is read: a direct
                // PostgreSQL client's server process ends with it.
                Ok((acq, rel, pairs, errors, start.elapsed(), locker))
            }));
        }
        futures::future::join_all(tasks).await
    };
    let cpu = CpuMeter::start(processes);
    let (results, ops) = Counter::around(counter, client_round_trips, spawn_all).await;
    let (mut acq, mut rel) = (histogram(), histogram());
    let (mut pairs, mut errors, mut elapsed) = (0, 0, Duration::ZERO);
    let mut clients_alive = Vec::with_capacity(clients);
    for t in results {
        let (a, r, p, e, d, locker) = t.map_err(|e| e.to_string())??;
        clients_alive.push(locker);
        acq.add(&a).map_err(|e| e.to_string())?;
        rel.add(&r).map_err(|e| e.to_string())?;
        pairs += p;
        errors += e;
        elapsed = elapsed.max(d);
    }
    Ok(Uncontended {
        clients,
        pairs,
        pairs_per_s: per(pairs, elapsed.as_secs_f64()),
        acquire: latency(&acq),
        release: latency(&rel),
        errors,
        backend_ops: ops,
        // Warm-up pairs run inside the counted window too.
        round_trips_per_pair: ops.map(|o| per_op(o.round_trips, pairs + clients as u64)),
        commands_per_pair: ops.map(|o| per_op(o.commands, pairs + clients as u64)),
        cpu_us_per_pair: {
            let cpu = cpu.per_op(pairs + clients as u64);
            drop(clients_alive);
            cpu
        },
    })
}

/// Workload 2: every client takes the same lock in a loop and releases it at
/// once; measures handoffs.
///
/// # Errors
/// Task failures.
pub async fn contended(
    lockers: Vec<Locker>,
    sidecars: usize,
    duration: Duration,
    name: &str,
    counter: &mut Option<Counter>,
    client_round_trips: Option<&AtomicU64>,
    processes: &[(&'static str, u32)],
) -> Result<Contended, String> {
    let clients = lockers.len();
    let epoch = Instant::now();
    // Nanoseconds since `epoch` at which the last holder sent its release (0:
    // none yet), and which client that was.
    let last_release = Arc::new(AtomicU64::new(0));
    let last_holder = Arc::new(AtomicU64::new(u64::MAX));
    // The client granted last: a client that has just released waits for
    // another client's grant before it asks again, so every grant is a
    // handoff. Without this a polling client re-takes the lock it just
    // released while the others sleep, and only the max wait shows it.
    let (granted_tx, granted_rx) = tokio::sync::watch::channel(u64::MAX);
    let granted_tx = Arc::new(granted_tx);
    let barrier = Arc::new(Barrier::new(clients));
    let deadline = Arc::new(std::sync::OnceLock::<Instant>::new());
    let work = async {
        let mut tasks = Vec::new();
        for (id, mut locker) in lockers.into_iter().enumerate() {
            let id = id as u64;
            let (barrier, last_release, last_holder, deadline) = (
                barrier.clone(),
                last_release.clone(),
                last_holder.clone(),
                deadline.clone(),
            );
            let (granted_tx, mut granted_rx) = (granted_tx.clone(), granted_rx.clone());
            let name = name.to_owned();
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let end = *deadline.get_or_init(|| Instant::now() + duration);
                // Independent polling clients are out of phase: start each at
                // a random point of its interval, or they try in lockstep.
                if let Some(poll) = locker.poll_interval() {
                    tokio::time::sleep(poll.mul_f64(rand::random::<f64>())).await;
                }
                let (mut hand, mut wait) = (histogram(), histogram());
                let (mut grants, mut handoffs, mut late, mut errors) = (0u64, 0u64, 0u64, 0u64);
                while Instant::now() < end {
                    let t0 = Instant::now();
                    let token = match locker.acquire(&name, Duration::from_secs(600)).await {
                        Ok(t) => t,
                        Err(_) => {
                            errors += 1;
                            tokio::time::sleep(Duration::from_millis(1)).await;
                            continue;
                        }
                    };
                    let granted = Instant::now();
                    let released_at = last_release.load(Ordering::Acquire);
                    let previous = last_holder.swap(id, Ordering::AcqRel);
                    granted_tx.send_replace(id);
                    if granted < end {
                        grants += 1;
                        record(&mut wait, granted - t0);
                        if released_at > 0 && previous != id {
                            handoffs += 1;
                            let at = epoch + Duration::from_nanos(released_at);
                            record(&mut hand, granted.saturating_duration_since(at));
                        }
                    } else {
                        late += 1;
                    }
                    let now = u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    last_release.store(now.max(1), Ordering::Release);
                    if locker.release(&name, &token).await.is_err() {
                        errors += 1;
                    }
                    if clients > 1 {
                        let _ = tokio::time::timeout_at(
                            end.into(),
                            granted_rx.wait_for(|&holder| holder != id),
                        )
                        .await;
                    }
                    // A polling client that has had its turn goes back to
                    // sleeping, like one whose try failed (sidelock's client
                    // queues again at the tail of the FIFO).
                    if let Some(poll) = locker.poll_interval() {
                        tokio::time::sleep(poll).await;
                    }
                }
                (hand, wait, grants, handoffs, late, errors)
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await);
        }
        out
    };
    let cpu = CpuMeter::start(processes);
    let (results, ops) = Counter::around(counter, client_round_trips, work).await;
    let (mut hand, mut wait) = (histogram(), histogram());
    let (mut grants, mut handoffs, mut all, mut errors) = (0, 0, 0, 0);
    for r in results {
        let (h, w, g, hs, l, e) = r.map_err(|e| e.to_string())?;
        hand.add(&h).map_err(|e| e.to_string())?;
        wait.add(&w).map_err(|e| e.to_string())?;
        grants += g;
        handoffs += hs;
        all += g + l;
        errors += e;
    }
    let per_grant = |n: u64| (all > 0).then(|| (n as f64 / all as f64 * 100.0).round() / 100.0);
    let w = latency(&wait);
    Ok(Contended {
        clients,
        sidecars,
        grants,
        grants_per_s: per(grants, duration.as_secs_f64()),
        handoffs,
        handoffs_per_s: per(handoffs, duration.as_secs_f64()),
        handoff: latency(&hand),
        max_wait_ms: w.max_us as f64 / 1e3,
        wait: w,
        backend_ops: ops,
        round_trips_per_grant: ops.and_then(|o| per_grant(o.round_trips)),
        commands_per_grant: ops.and_then(|o| per_grant(o.commands)),
        cpu_us_per_grant: cpu.per_op(all),
        errors,
    })
}

/// Local waiters a sidecar reports in `/metrics` (`sidelock_waiters`).
async fn waiters_queued(base: &str, api_token: Option<&str>) -> Option<u64> {
    let mut req = reqwest::Client::new().get(format!("{base}/metrics"));
    if let Some(t) = api_token {
        req = req.bearer_auth(t);
    }
    let text = req.send().await.ok()?.text().await.ok()?;
    let sum: f64 = text
        .lines()
        .filter(|l| l.starts_with("sidelock_waiters{") || l.starts_with("sidelock_waiters "))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    Some(sum as u64)
}

/// An open hold stream that has been granted; dropping it closes the connection.
pub struct Hold {
    _events: Box<dyn std::any::Any + Send>,
}

/// Opens `GET …/hold` and waits for `acquired`.
///
/// # Errors
/// When the stream ends or fails before the grant.
pub async fn hold(
    base: &str,
    name: &str,
    ttl: &str,
    api_token: Option<&str>,
) -> Result<Hold, String> {
    let client = crate::client::http_client();
    let mut req = client.get(format!("{base}/v1/locks/{name}/hold?ttl={ttl}&wait=60s"));
    if let Some(t) = api_token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("hold answered {}", resp.status()));
    }
    let mut events = resp.bytes_stream().eventsource();
    loop {
        match events.next().await {
            Some(Ok(m)) if m.event == "acquired" => {
                return Ok(Hold {
                    _events: Box::new(events),
                });
            }
            Some(Ok(m)) if m.event == "queued" => {}
            Some(Ok(m)) => return Err(format!("hold stream sent {} before the grant", m.event)),
            Some(Err(e)) => return Err(format!("hold stream failed before the grant: {e}")),
            None => return Err("hold stream ended before the grant".into()),
        }
    }
}

/// Waits until `base` reports at least `n` local waiters (less those that
/// `ended`), up to `timeout`.
async fn until_queued_or_ended(
    base: &str,
    api_token: Option<&str>,
    n: u64,
    ended: &AtomicU64,
    timeout: Duration,
) -> Option<u64> {
    let deadline = Instant::now() + timeout;
    loop {
        let q = waiters_queued(base, api_token).await;
        let gone = ended.load(Ordering::Relaxed);
        if q.is_some_and(|q| q + gone >= n) || Instant::now() > deadline {
            return q;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `base` reports at least `n` local waiters, up to `timeout`.
async fn until_queued(
    base: &str,
    api_token: Option<&str>,
    n: u64,
    timeout: Duration,
) -> Option<u64> {
    let deadline = Instant::now() + timeout;
    loop {
        let q = waiters_queued(base, api_token).await;
        if q.is_some_and(|q| q >= n) || Instant::now() > deadline {
            return q;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Workload 3 through sidelock: `waiters` requests blocked on a held lock.
///
/// # Errors
/// When the holder cannot take the lock.
pub async fn idle_sidecar(
    t: &Target,
    waiters: usize,
    duration: Duration,
    name: &str,
    counter: &mut Option<Counter>,
) -> Result<Idle, String> {
    let token = t.api_token.as_deref();
    // The holder is on the other sidecar when there are two, so waiting
    // depends on the backend's notifications.
    let holder = hold(t.url(1), name, "30s", token).await?;
    let base = t.url(0).to_owned();
    let pid = t.pids.first().copied().flatten();
    let rss_before = pid.and_then(rss_kib);
    let mut tasks = tokio::task::JoinSet::new();
    let wait = duration + Duration::from_secs(300);
    let ended = Arc::new(AtomicU64::new(0));
    let samples = Arc::new(std::sync::Mutex::new(Vec::new()));
    let joining = Instant::now();
    for _ in 0..waiters {
        let (ended, samples) = (ended.clone(), samples.clone());
        let mut locker = Locker::sidecar(&base, t.api_token.as_deref());
        let name = name.to_owned();
        tasks.spawn(async move {
            let why = match locker.acquire(&name, wait).await {
                Ok(_) => "granted while the holder held the lock".to_owned(),
                Err(Refused::Busy) => "409: the wait ended".to_owned(),
                Err(Refused::Failed(why)) => why,
            };
            ended.fetch_add(1, Ordering::Relaxed);
            keep_sample(&samples, why);
        });
    }
    let queued = until_queued_or_ended(
        &base,
        token,
        waiters as u64,
        &ended,
        Duration::from_secs(60) + Duration::from_millis(10 * waiters as u64),
    )
    .await;
    let queued_in_s = (joining.elapsed().as_secs_f64() * 100.0).round() / 100.0;
    // Let the last connections settle before measuring.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let ((), ops) = Counter::around(counter, None, tokio::time::sleep(duration)).await;
    let seconds = started.elapsed().as_secs_f64();
    let rss = pid.and_then(rss_kib);
    let waiter_errors = ended.load(Ordering::Relaxed);
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    drop(holder);
    // Give the sidecar a moment to drop the waiters before the next run.
    let _ = until_queued_zero(&base, token).await;
    let mut r = idle_result(waiters, queued, seconds, ops, rss_before, rss);
    r.waiter_errors = waiter_errors;
    r.waiter_error_samples = std::mem::take(&mut *lock_samples(&samples));
    r.queued_in_s = Some(queued_in_s);
    Ok(r)
}

/// Most distinct error reasons an idle run keeps.
const SAMPLES: usize = 3;

/// Keeps `why` if it is new and fewer than [`SAMPLES`] are kept.
fn keep_sample(samples: &std::sync::Mutex<Vec<String>>, why: String) {
    let mut kept = lock_samples(samples);
    if kept.len() < SAMPLES && !kept.contains(&why) {
        kept.push(why);
    }
}

fn lock_samples(samples: &std::sync::Mutex<Vec<String>>) -> std::sync::MutexGuard<'_, Vec<String>> {
    samples
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Workload 3, holds: `holds` hold streams on as many lock names, each
/// granted, kept open for `duration` (the watchdog renews them), on sidecar 1.
/// Reported in the same shape as waiters: `waiters` is the number of holds
/// asked, `queued` the number granted, `waiter_errors` those refused.
///
/// # Errors
/// Never for a refused hold (counted); only when nothing can be measured.
pub async fn idle_holds(
    t: &Target,
    holds: usize,
    duration: Duration,
    name: &str,
    counter: &mut Option<Counter>,
) -> Result<Idle, String> {
    use futures::StreamExt as _;
    let token = t.api_token.as_deref();
    let base = t.url(0).to_owned();
    let pid = t.pids.first().copied().flatten();
    let rss_before = pid.and_then(rss_kib);
    // At most 64 grants in flight, so a slow backend refuses none for time.
    let opened: Vec<Result<Hold, String>> = futures::stream::iter(0..holds)
        .map(|i| {
            let (base, name) = (&base, format!("{name}-{i}"));
            async move { hold(base, &name, "30s", token).await }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let granted = opened.iter().filter(|h| h.is_ok()).count() as u64;
    if granted == 0 && holds > 0 {
        let why = opened.into_iter().find_map(Result::err).unwrap_or_default();
        return Err(format!("no hold was granted: {why}"));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let ((), ops) = Counter::around(counter, None, tokio::time::sleep(duration)).await;
    let seconds = started.elapsed().as_secs_f64();
    let rss = pid.and_then(rss_kib);
    let samples = std::sync::Mutex::new(Vec::new());
    for why in opened.iter().filter_map(|h| h.as_ref().err()) {
        keep_sample(&samples, why.clone());
    }
    drop(opened);
    let mut r = idle_result(holds, Some(granted), seconds, ops, rss_before, rss);
    r.waiter_errors = holds as u64 - granted;
    r.waiter_error_samples = samples
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    Ok(r)
}

async fn until_queued_zero(base: &str, token: Option<&str>) -> Option<u64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let q = waiters_queued(base, token).await;
        if q == Some(0) || q.is_none() || Instant::now() > deadline {
            return q;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn idle_result(
    waiters: usize,
    queued: Option<u64>,
    seconds: f64,
    ops: Option<Ops>,
    rss_before: Option<u64>,
    rss: Option<u64>,
) -> Idle {
    let rate = |n: u64| (n as f64 / seconds * 10.0).round() / 10.0;
    Idle {
        waiters,
        queued,
        waiter_errors: 0,
        waiter_error_samples: Vec::new(),
        queued_in_s: None,
        seconds: (seconds * 100.0).round() / 100.0,
        backend_ops: ops,
        round_trips_per_s: ops.map(|o| rate(o.round_trips)),
        commands_per_s: ops.map(|o| rate(o.commands)),
        rss_before_kib: rss_before,
        rss_kib: rss,
        rss_per_waiter_kib: rss_before.zip(rss).map(|(b, a)| {
            ((a.saturating_sub(b)) as f64 / waiters.max(1) as f64 * 100.0).round() / 100.0
        }),
    }
}

/// Workload 3 for the polling client: `waiters` loops of `SET NX PX` + sleep
/// on a key that someone else holds.
///
/// # Errors
/// When Redis cannot be reached.
pub async fn idle_polling(
    redis_url: &str,
    poll: Duration,
    waiters: usize,
    duration: Duration,
    name: &str,
    counter: &mut Option<Counter>,
) -> Result<Idle, String> {
    let rt = Arc::new(AtomicU64::new(0));
    let mut holder = Locker::redis(redis_url, None, rt.clone()).await?;
    let held = holder
        .acquire(name, Duration::ZERO)
        .await
        .map_err(|e| format!("{e:?}"))?;
    // Clients share up to 64 multiplexed connections (Redis's own connection
    // limit would be hit long before 10,000); each still sends its own commands.
    let mut conns = Vec::new();
    for _ in 0..waiters.clamp(1, 64) {
        conns.push(Locker::redis(redis_url, Some(poll), rt.clone()).await?);
    }
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..waiters {
        let mut locker = conns[i % conns.len()].clone();
        let name = name.to_owned();
        tasks.spawn(async move {
            // Spread the first tries over one interval, as independent clients would be.
            tokio::time::sleep(poll.mul_f64(i as f64 / waiters as f64)).await;
            let _ = locker.acquire(&name, Duration::from_secs(3600)).await;
        });
    }
    tokio::time::sleep(poll + Duration::from_millis(500)).await;
    let started = Instant::now();
    let ((), ops) = Counter::around(counter, Some(&rt), tokio::time::sleep(duration)).await;
    let seconds = started.elapsed().as_secs_f64();
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    let _ = holder.release(name, &held).await;
    Ok(idle_result(waiters, None, seconds, ops, None, None))
}

/// A waiter that reports how long after `t0` it was granted.
fn waiter(mut locker: Locker, name: String) -> tokio::task::JoinHandle<Result<Instant, String>> {
    tokio::spawn(async move {
        let token = locker
            .acquire(&name, Duration::from_secs(60))
            .await
            .map_err(|e| format!("{e:?}"))?;
        let at = Instant::now();
        let _ = locker.release(&name, &token).await;
        Ok(at)
    })
}

/// Workload 4: how long the next waiter waits after the holder dies.
///
/// `sidecars`: when the bench started them, the holder's sidecar is killed
/// too (needs two sidecars on a shared backend).
///
/// # Errors
/// When a round fails.
pub async fn crash(
    t: &Target,
    rounds: usize,
    run: &str,
    mut respawn: Option<(&mut Vec<Sidecar>, &str)>,
) -> Result<Crash, String> {
    let token = t.api_token.as_deref();
    let mut cut = Vec::new();
    for r in 0..rounds {
        let name = format!("bench-x-{run}-cut-{r}");
        let holder = hold(t.url(1), &name, "30s", token).await?;
        let w = waiter(t.locker(0), name.clone());
        until_queued(t.url(0), token, 1, Duration::from_secs(10)).await;
        let t0 = Instant::now();
        drop(holder);
        let at = w.await.map_err(|e| e.to_string())??;
        cut.push(ms(at - t0));
    }
    let mut killed = Vec::new();
    let mut errors = Vec::new();
    for r in 0..rounds.min(5) {
        let name = format!("bench-x-{run}-kill-{r}");
        let mut child = crate::procs::spawn_client(
            &[
                "run",
                "--lock",
                &name,
                "--ttl",
                "30s",
                "--wait",
                "30s",
                "--url",
                t.url(1),
                "--",
                "sleep",
                "600",
            ],
            token,
        )?;
        // Held once a try-once acquire is refused.
        let mut probe = t.locker(0);
        let deadline = Instant::now() + Duration::from_secs(20);
        let held = loop {
            match probe.acquire(&name, Duration::ZERO).await {
                Err(Refused::Busy) => break Ok(()),
                Ok(tok) => {
                    let _ = probe.release(&name, &tok).await;
                }
                Err(Refused::Failed(e)) => break Err(e),
            }
            if let Ok(Some(status)) = child.try_wait() {
                break Err(format!(
                    "sidelock run exited with {status} before taking the lock"
                ));
            }
            if Instant::now() > deadline {
                break Err("sidelock run did not take the lock within 20 s".into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        if let Err(e) = held {
            errors.push(format!("holder process killed, round {r}: {e}"));
            continue;
        }
        let w = waiter(t.locker(0), name.clone());
        until_queued(t.url(0), token, 1, Duration::from_secs(10)).await;
        let t0 = Instant::now();
        crate::procs::kill_group(&child);
        let at = w.await.map_err(|e| e.to_string())??;
        killed.push(ms(at - t0));
        let _ = child.wait().await;
    }
    let mut sidecar_killed = Vec::new();
    let mut ttl_ms = None;
    if let Some((sidecars, backend)) = respawn.as_mut()
        && sidecars.len() >= 2
    {
        let ttl = 2000;
        ttl_ms = Some(ttl);
        for r in 0..rounds.min(3) {
            let name = format!("bench-x-{run}-sidecar-{r}");
            let victim_url = sidecars[1].url.clone();
            let holder = hold(&victim_url, &name, &format!("{ttl}ms"), token).await?;
            let w = waiter(Locker::sidecar(&sidecars[0].url, token), name.clone());
            until_queued(&sidecars[0].url, token, 1, Duration::from_secs(10)).await;
            let t0 = Instant::now();
            let victim = sidecars.remove(1);
            victim.kill().await;
            let at = w.await.map_err(|e| e.to_string())??;
            sidecar_killed.push(ms(at - t0));
            drop(holder);
            sidecars.push(Sidecar::start(backend, &format!("bench-2-{r}")).await?);
        }
    }
    let mut sorted = cut.clone();
    sorted.sort_by(f64::total_cmp);
    Ok(Crash {
        hold_cut_p50_ms: sorted.get(sorted.len() / 2).copied(),
        hold_cut_max_ms: sorted.last().copied(),
        client_killed_max_ms: killed.iter().copied().max_by(f64::total_cmp),
        hold_cut_ms: cut,
        client_killed_ms: killed,
        errors,
        sidecar_killed_ms: sidecar_killed,
        sidecar_killed_ttl_ms: ttl_ms,
    })
}

/// Workload 5: start a sidecar `rounds` times; time to `/readyz` 200 and RSS
/// after a second of idling.
///
/// # Errors
/// When a sidecar does not start.
pub async fn startup(backend: &str, rounds: usize) -> Result<Startup, String> {
    let mut ready = Vec::new();
    let mut rss = Vec::new();
    for r in 0..rounds.max(1) {
        let s = Sidecar::start(backend, &format!("bench-start-{r}")).await?;
        ready.push(ms(s.ready_after));
        tokio::time::sleep(Duration::from_secs(1)).await;
        rss.push(rss_kib(s.pid).unwrap_or(0));
        s.kill().await;
    }
    let mut sorted = ready.clone();
    sorted.sort_by(f64::total_cmp);
    Ok(Startup {
        ready_p50_ms: sorted[sorted.len() / 2],
        ready_ms: ready,
        idle_rss_max_kib: rss.iter().copied().max().unwrap_or(0),
        idle_rss_kib: rss,
    })
}
