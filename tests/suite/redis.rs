//! Redis-specific behaviour against real `redis-server` processes: interop
//! with hand-written `SET NX PX` clients, the cost of waiting, leases deleted
//! behind sidelock's back, outages, and stale keys. Everything the other
//! backends share is in `conformance.rs`.

use crate::common;
use crate::lost_answers;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::{RedisServer, command_diff};
use common::{SidecarBuilder, SidecarGuard, eventually, unique_name, within};
use nix::sys::signal::Signal;
use reqwest::StatusCode;
use serde_json::Value;
use tokio::sync::Mutex;

async fn sidecar(server: &RedisServer) -> SidecarGuard {
    SidecarBuilder::new(&server.url()).start().await
}

/// Waits for the first stale scan of `sidecar`, the monitor: it runs when
/// the sidecar takes that role, and its commands (`SCAN`, `TYPE`, …) would
/// count in a window measured meanwhile.
async fn first_scan_done(sidecar: &SidecarGuard) {
    let api = sidecar.api();
    eventually(
        "the monitor's first stale scan",
        Duration::from_secs(10),
        async || {
            let scans = api
                .metric_sum("sidelock_backend_operations_total", "op=\"stale\"")
                .await;
            (scans >= 1.0).then_some(())
        },
    )
    .await;
}

#[tokio::test]
async fn waiters_on_two_sidecars_are_granted_in_queue_order() {
    let server = RedisServer::start().await;
    let sidecars = [sidecar(&server).await, sidecar(&server).await];
    let name = unique_name("fifo");
    let holder = sidecars[0]
        .api()
        .lock(&name)
        .acquire(&[("owner", "holder")])
        .await;

    let mut streams = Vec::new();
    for i in 0..8 {
        let lock = sidecars[i % 2].api().lock(&name);
        let owner = format!("waiter-{i}");
        let mut stream = lock.hold(&[("owner", &owner), ("wait", "30s")]).await;
        assert_eq!(stream.expect_queued().await.position, i as u64 + 1);
        streams.push(stream);
    }
    sidecars[1].api().lock(&name).release(&holder.token).await;
    // Each waiter must be granted while every later one still waits: a grant
    // out of order would leave the expected waiter blocked behind a holder
    // that this loop never releases, and time out.
    for (i, mut stream) in streams.into_iter().enumerate() {
        let grant = stream.expect_acquired_within(Duration::from_secs(5)).await;
        assert_eq!(grant.owner, format!("waiter-{i}"));
        assert_eq!(
            grant.fence,
            holder.fence + 1 + i as u64,
            "fences follow the queue"
        );
        drop(stream);
    }
}

#[tokio::test]
async fn a_legacy_set_nx_px_client_and_sidelock_exclude_each_other() {
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let name = unique_name("legacy");
    let key = format!("sidelock:{name}");
    let lock = sidecar.api().lock(&name);
    let scripts = |c: &std::collections::BTreeMap<String, u64>| {
        c.get("evalsha").copied().unwrap_or(0) + c.get("eval").copied().unwrap_or(0)
    };
    // The sidecar's start-up runs scripts of its own (its monitor election
    // and the elected monitor's first looks, a few ms later): counted from
    // when they are done, or they can fall into the count below.
    let mut seen = scripts(&server.command_counts().await);
    let quiet_by = Instant::now() + Duration::from_secs(5);
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = scripts(&server.command_counts().await);
        if now == seen || Instant::now() > quiet_by {
            break;
        }
        seen = now;
    }

    // The hand-written client holds the key: sidelock is refused, and shows it.
    let set: Option<String> = server
        .cmd(&["SET", &key, "legacy-token", "NX", "PX", "600"])
        .await;
    assert_eq!(set.as_deref(), Some("OK"));
    let busy = lock.acquire_busy(&[("owner", "sidelock")]).await;
    assert_eq!(busy["holders"][0]["owner"], "(foreign)");

    // A sidelock waiter is granted when the legacy key expires, by a timer
    // set to its expiry: no legacy client wakes it, and it does not poll.
    // Counted in scripts run rather than timed (a loaded machine delays
    // the grant, never adds attempts): the first try, the join, the retry
    // at the expiry, and one more should that retry come as the key expires;
    // and the sidecar's heartbeat for its waiters (a script call every 5 s),
    // which a loaded machine's slow grant can let in (5 calls in a CI run
    // whose test took 5.9 s). Polling would take dozens.
    let before = scripts(&server.command_counts().await);
    let started = Instant::now();
    let grant = lock
        .acquire(&[("owner", "sidelock"), ("wait", "30s")])
        .await;
    let attempts = scripts(&server.command_counts().await) - before;
    assert!(
        attempts <= 5,
        "granted at the legacy key's expiry, not by polling: {attempts} attempts"
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "granted at the legacy key's expiry, not by a wake-up nobody sends: {:?}",
        started.elapsed()
    );

    // While sidelock holds it, the classic protocol is refused.
    let value: String = server.cmd(&["GET", &key]).await;
    assert_eq!(
        value.split(' ').next(),
        Some(grant.token.as_str()),
        "the main key holds the lease, its token first"
    );
    let set: Option<String> = server
        .cmd(&["SET", &key, "legacy-token", "NX", "PX", "600"])
        .await;
    assert_eq!(set, None, "SET NX must fail while sidelock holds the lock");
    let pttl: i64 = server.cmd(&["PTTL", &key]).await;
    assert!(
        pttl > 0 && pttl <= 30_000,
        "the main key carries the lease's expiry, got {pttl}"
    );

    lock.release(&grant.token).await;
    let set: Option<String> = server
        .cmd(&["SET", &key, "legacy-token", "NX", "PX", "600"])
        .await;
    assert_eq!(
        set.as_deref(),
        Some("OK"),
        "released: the classic protocol gets it"
    );
}

/// Requests sidelock sent (commands run inside its scripts excluded).
fn round_trips(counts: &std::collections::BTreeMap<String, u64>) -> u64 {
    [
        "evalsha",
        "eval",
        "script|load",
        "ping",
        "subscribe",
        "unsubscribe",
        "zrangebylex",
        "scan",
    ]
    .iter()
    .filter_map(|c| counts.get(*c))
    .sum()
}

/// Queues `count` waiters (plain acquires with `wait`) that release as soon
/// as they are granted; returns once all are queued.
async fn queue_waiters(
    sidecars: &[SidecarGuard],
    name: &str,
    count: usize,
) -> tokio::task::JoinSet<u64> {
    let mut waiters = tokio::task::JoinSet::new();
    for i in 0..count {
        let lock = sidecars[i % sidecars.len()].api().lock(name);
        waiters.spawn(async move {
            let grant = lock
                .acquire(&[("owner", &format!("w{i}")), ("wait", "60s"), ("ttl", "60s")])
                .await;
            lock.release(&grant.token).await;
            grant.fence
        });
    }
    let lock = sidecars[0].api().lock(name);
    common::eventually("all waiters queued", Duration::from_secs(60), async || {
        (lock.inspect().await.waiters.len() == count).then_some(())
    })
    .await;
    waiters
}

#[tokio::test]
async fn idle_waiters_cost_redis_almost_nothing_and_handoffs_stay_flat() {
    let server = RedisServer::start().await;
    let sidecars = [sidecar(&server).await, sidecar(&server).await];

    let mut per_handoff = Vec::new();
    let mut breakdown = Vec::new();
    for waiters in [10, 500] {
        let name = unique_name("cost");
        let lock = sidecars[0].api().lock(&name);
        let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
        let mut queued = queue_waiters(&sidecars, &name, waiters).await;

        if waiters == 500 {
            let before = server.command_counts().await;
            tokio::time::sleep(Duration::from_secs(3)).await;
            let after = server.command_counts().await;
            let idle: u64 = after.values().sum::<u64>() - before.values().sum::<u64>();
            assert!(
                idle < 50,
                "500 waiters blocked for 3 s ran {idle} Redis commands: {}",
                command_diff(&before, &after)
            );
        }

        let before = server.command_counts().await;
        lock.release(&holder.token).await;
        let mut fences = Vec::new();
        within("every waiter granted", Duration::from_secs(120), async {
            while let Some(fence) = queued.join_next().await {
                fences.push(fence.expect("waiter task"));
            }
        })
        .await;
        let after = server.command_counts().await;
        let spent = after.values().sum::<u64>() - before.values().sum::<u64>();
        let trips = round_trips(&after) - round_trips(&before);
        breakdown.push(format!(
            "{waiters} waiters: {}",
            command_diff(&before, &after)
        ));
        fences.sort_unstable();
        fences.dedup();
        assert_eq!(fences.len(), waiters, "every grant has its own fence");
        per_handoff.push((spent as f64 / waiters as f64, trips as f64 / waiters as f64));
    }
    let ((small, small_trips), (large, large_trips)) = (per_handoff[0], per_handoff[1]);
    assert!(
        large_trips <= 6.0,
        "{large_trips:.2} round trips to Redis per handoff with 500 waiters"
    );
    assert!(
        large_trips <= small_trips + 0.5,
        "round trips per handoff grew with the queue: {small_trips:.2} with 10 waiters, {large_trips:.2} with 500"
    );
    assert!(
        large <= small * 1.25,
        "commands per handoff (scripts' own included) grew with the queue: {small:.2} with 10 waiters, {large:.2} with 500\n{}",
        breakdown.join("\n")
    );
}

/// Blocked waiters cost Redis the same however many there are and however
/// they are spread over the sidecars, with the holder on either: one
/// heartbeat per sidecar and lock every 5 s, whatever waits behind it (plus
/// the monitor's round every 10 s). 10 s windows, one Redis, two sidecars.
#[tokio::test]
async fn idle_waiters_cost_redis_the_same_however_many_and_wherever_they_wait() {
    const WINDOW: Duration = Duration::from_secs(10);
    let server = RedisServer::start().await;
    let both = [sidecar(&server).await, sidecar(&server).await];
    let mut costs = Vec::new();
    for (label, waiters, on, holder_on) in [
        ("10 waiters on A, holder on A", 10, 0..1, 0),
        ("300 waiters on A, holder on A", 300, 0..1, 0),
        ("300 waiters on B, holder on A", 300, 1..2, 0),
        ("300 waiters on A and B, holder on A", 300, 0..2, 0),
        ("300 waiters on A and B, holder on B", 300, 0..2, 1),
    ] {
        let name = unique_name("spread");
        let holder = both[holder_on]
            .api()
            .lock(&name)
            .acquire(&[("owner", "holder"), ("ttl", "120s")])
            .await;
        let mut queued = queue_waiters(&both[on.clone()], &name, waiters).await;
        let (spent, what) = commands_during(&server, WINDOW).await;
        costs.push((label, on.len(), spent, what));
        both[holder_on]
            .api()
            .lock(&name)
            .release(&holder.token)
            .await;
        within("every waiter granted", Duration::from_secs(60), async {
            while queued.join_next().await.is_some() {}
        })
        .await;
    }
    let report: Vec<String> = costs
        .iter()
        .map(|(label, _, spent, what)| format!("{label}: {spent} ({what})"))
        .collect();
    let report = report.join("\n");
    // Per sidecar with waiters: two heartbeats in the window (one script
    // call each, a handful of commands inside); the monitor: one or two
    // rounds of about 13 commands.
    for (label, sidecars, spent, _) in &costs {
        let bound = 30 + 20 * *sidecars as u64;
        assert!(
            *spent <= bound,
            "{label}: {spent} commands in {WINDOW:?}, more than {bound}:\n{report}"
        );
    }
}

/// The keys of one lock besides its main key, sorted.
async fn side_keys(server: &RedisServer, name: &str) -> Vec<String> {
    let mut keys: Vec<String> = server
        .cmd(&["KEYS", &format!("{{sidelock:{name}}}:*")])
        .await;
    keys.sort();
    keys
}

/// Commands Redis ran between two readings (`INFO` is not counted, nor the
/// `PING`s with which a sidecar with claims queued checks its pub/sub
/// connection every 5 s: they are no lock's work).
fn ran(
    before: &std::collections::BTreeMap<String, u64>,
    after: &std::collections::BTreeMap<String, u64>,
) -> u64 {
    let pings = |c: &std::collections::BTreeMap<String, u64>| c.get("ping").copied().unwrap_or(0);
    after.values().sum::<u64>() - before.values().sum::<u64>() - (pings(after) - pings(before))
}

/// Queues `owner` on `name` through `sidecar` (waiting up to `wait`), once
/// the lock is busy: the acquire's task, returned when the waiter is listed.
async fn queue_waiter(
    sidecar: &SidecarGuard,
    name: &str,
    wait: &'static str,
) -> tokio::task::JoinHandle<common::api::Grant> {
    let lock = sidecar.api().lock(name);
    let waiter =
        tokio::spawn(async move { lock.acquire(&[("owner", "waiter"), ("wait", wait)]).await });
    let lock = sidecar.api().lock(name);
    common::eventually("the waiter queued", Duration::from_secs(5), async || {
        (lock.inspect().await.waiters.len() == 1).then_some(())
    })
    .await;
    waiter
}

/// The commands Redis runs in the next `period`, and what they were.
async fn commands_during(server: &RedisServer, period: Duration) -> (u64, String) {
    let before = server.command_counts().await;
    tokio::time::sleep(period).await;
    let after = server.command_counts().await;
    (ran(&before, &after), command_diff(&before, &after))
}

/// An exclusive lock nobody else holds or waits for lives in its main key
/// alone: Redis runs at most 10 commands per acquire and release, the
/// scripts' own included (the plain recipe runs 4; before the lease moved
/// into the main key, 13, and 17 before that), and at most 4 per keepalive;
/// no side key but the fence counter is ever written.
#[tokio::test]
async fn an_uncontended_lock_costs_redis_few_commands_and_leaves_only_its_fence() {
    const ROUNDS: u64 = 100;
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let name = unique_name("short");
    let lock = sidecar.api().lock(&name);
    // Loads the scripts.
    let grant = lock.acquire(&[]).await;
    lock.keepalive(&grant.token, &[]).await;
    lock.release(&grant.token).await;

    let before = server.command_counts().await;
    for _ in 0..ROUNDS {
        let grant = lock.acquire(&[("ttl", "30s")]).await;
        lock.release(&grant.token).await;
    }
    let after = server.command_counts().await;
    let per_pair = ran(&before, &after) as f64 / ROUNDS as f64;
    assert!(
        per_pair <= 10.5,
        "{per_pair:.2} commands per uncontended acquire and release: {}",
        command_diff(&before, &after)
    );

    let grant = lock.acquire(&[("ttl", "30s"), ("owner", "kept")]).await;
    let before = server.command_counts().await;
    for _ in 0..ROUNDS {
        lock.keepalive(&grant.token, &[]).await;
    }
    let after = server.command_counts().await;
    let per_keepalive = ran(&before, &after) as f64 / ROUNDS as f64;
    assert!(
        per_keepalive <= 4.5,
        "{per_keepalive:.2} commands per keepalive of an uncontended lock: {}",
        command_diff(&before, &after)
    );
    let tag = format!("{{sidelock:{name}}}");
    assert_eq!(
        side_keys(&server, &name).await,
        [format!("{tag}:fence")],
        "kept alive in the main key"
    );
    let pttl: i64 = server.cmd(&["PTTL", &format!("sidelock:{name}")]).await;
    assert!(
        pttl > 25_000,
        "the keepalive moved the main key's expiry: {pttl}"
    );

    lock.release(&grant.token).await;
    assert_eq!(side_keys(&server, &name).await, [format!("{tag}:fence")]);
    let main: i64 = server.cmd(&["EXISTS", &format!("sidelock:{name}")]).await;
    assert_eq!(main, 0);
}

/// Clients that take one lock in turn through two sidecars — each asks
/// again, with `wait`, as soon as it released and another client was
/// granted — cost Redis at most 12 commands per handoff, the scripts' own
/// included (the release hands the lock to the next claim in line, and the
/// releaser queues again), however many clients take turns: python-redis-lock
/// needs about 10, sidelock needed 52 before.
#[tokio::test]
async fn a_contended_handoff_costs_redis_at_most_12_commands_whatever_the_queue() {
    let server = RedisServer::start().await;
    let sidecars = Arc::new([sidecar(&server).await, sidecar(&server).await]);
    let mut per_handoff = Vec::new();
    for clients in [8usize, 48] {
        let name = Arc::new(unique_name("turns"));
        let granted = Arc::new(tokio::sync::watch::channel(usize::MAX).0);
        let rounds = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let before = Arc::new(Mutex::new(None));
        let mut tasks = tokio::task::JoinSet::new();
        for id in 0..clients {
            let (sidecars, name, granted, rounds, stop) = (
                sidecars.clone(),
                name.clone(),
                granted.clone(),
                rounds.clone(),
                stop.clone(),
            );
            tasks.spawn(async move {
                let lock = sidecars[id % 2].api().lock(&name);
                let mut seen = granted.subscribe();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let grant = lock
                        .acquire(&[("owner", &format!("c{id}")), ("wait", "60s")])
                        .await;
                    granted.send_replace(id);
                    rounds.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    lock.release(&grant.token).await;
                    let _ = tokio::time::timeout(
                        Duration::from_secs(5),
                        seen.wait_for(|&holder| holder != id),
                    )
                    .await;
                }
            });
        }
        // Counted once every client has had its first turn (scripts loaded,
        // heartbeats written), over the next 300 grants.
        within("warm-up", Duration::from_secs(60), async {
            while rounds.load(std::sync::atomic::Ordering::Relaxed) < 2 * clients as u64 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        let start = rounds.load(std::sync::atomic::Ordering::Relaxed);
        *before.lock().await = Some(server.command_counts().await);
        within("300 handoffs", Duration::from_secs(60), async {
            while rounds.load(std::sync::atomic::Ordering::Relaxed) < start + 300 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        let after = server.command_counts().await;
        let end = rounds.load(std::sync::atomic::Ordering::Relaxed);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let before = before.lock().await.take().expect("counted");
        let per = ran(&before, &after) as f64 / (end - start) as f64;
        per_handoff.push(per);
        assert!(
            per <= 12.0,
            "{per:.2} commands per handoff with {clients} clients: {}",
            command_diff(&before, &after)
        );
        // Every client asks once more after `stop`: let them finish.
        within("clients done", Duration::from_secs(60), async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
    }
    assert!(
        per_handoff[1] <= per_handoff[0] + 1.0,
        "commands per handoff grew with the queue: {per_handoff:?}"
    );
}

/// An exclusive lease in its main key is a lease like any other: a
/// read-only stale scan reports it held too long and leaves it as it is,
/// another sidecar lists it with its owner, sidecar and fence, its owner
/// re-enters it, and it is handed to a waiter on another sidecar with a
/// higher fence.
#[tokio::test]
async fn an_exclusive_lease_is_listed_reported_reentered_and_handed_over() {
    let server = RedisServer::start().await;
    let a = SidecarBuilder::new(&server.url())
        .sidecar_id("short-a")
        .stale_after("200ms")
        .start()
        .await;
    let b = SidecarBuilder::new(&server.url())
        .sidecar_id("short-b")
        .start()
        .await;
    let name = unique_name("short-life");
    let tag = format!("{{sidelock:{name}}}");
    let first = a
        .api()
        .lock(&name)
        .acquire(&[("owner", "first"), ("ttl", "60s")])
        .await;
    assert_eq!(side_keys(&server, &name).await, [format!("{tag}:fence")]);

    tokio::time::sleep(Duration::from_millis(300)).await;
    let stale = a.api().stale().await;
    assert!(
        stale
            .iter()
            .any(|s| s.reason == "held-too-long" && s.key.contains(&name) && s.age_ms >= 200),
        "{stale:#?}"
    );
    assert_eq!(
        side_keys(&server, &name).await,
        [format!("{tag}:fence")],
        "the stale scan wrote nothing"
    );

    let state = b.api().lock(&name).inspect().await;
    assert_eq!(state.holders.len(), 1, "{state:?}");
    let holder = &state.holders[0];
    assert_eq!(
        (
            holder.owner.as_str(),
            holder.sidecar.as_str(),
            holder.fence,
            holder.count
        ),
        ("first", "short-a", first.fence, 1)
    );
    assert!(holder.since_ms > 0 && holder.expires_at_ms > holder.since_ms + 50_000);

    let again = a
        .api()
        .lock(&name)
        .acquire(&[("owner", "first"), ("ttl", "60s")])
        .await;
    assert_eq!(
        (again.token.as_str(), again.count),
        (first.token.as_str(), 2)
    );

    let waiter = {
        let lock = b.api().lock(&name);
        tokio::spawn(async move { lock.acquire(&[("owner", "second"), ("wait", "10s")]).await })
    };
    within("the waiter queued", Duration::from_secs(5), async {
        while b.api().lock(&name).inspect().await.waiters.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let lock = a.api().lock(&name);
    lock.release(&first.token).await;
    assert_eq!(
        b.api().lock(&name).inspect().await.holder_owners(),
        ["first"],
        "one of two holds released"
    );
    lock.release(&first.token).await;
    let second = within("the waiter granted", Duration::from_secs(5), waiter)
        .await
        .expect("waiter task");
    assert!(
        second.fence > first.fence,
        "{} after {}",
        second.fence,
        first.fence
    );
    b.api().lock(&name).release(&second.token).await;
    // The counters, and the heartbeat of the waiter's sidecar until it lapses.
    let beat = format!("{tag}:heartbeat");
    let mut left = side_keys(&server, &name).await;
    if left.contains(&beat) {
        let pttl: i64 = server.cmd(&["PTTL", &beat]).await;
        assert!(pttl > 0 && pttl <= 15_000, "the heartbeat expires: {pttl}");
        left.retain(|k| *k != beat);
    }
    assert_eq!(
        left,
        [format!("{tag}:fence"), format!("{tag}:seq")],
        "only the counters are left"
    );
}

#[tokio::test]
async fn a_lease_deleted_behind_sidelocks_back_is_reported_lost() {
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let name = unique_name("deleted");
    let lock = sidecar.api().lock(&name);

    let mut hold = lock.hold(&[("ttl", "900ms")]).await;
    hold.expect_acquired().await;
    let _: i64 = server.cmd(&["DEL", &format!("sidelock:{name}")]).await;
    assert_eq!(
        hold.expect_lost_within(Duration::from_secs(2)).await,
        "backend"
    );

    let grant = lock.acquire(&[("ttl", "30s")]).await;
    let _: String = server
        .cmd(&[
            "SET",
            &format!("sidelock:{name}"),
            "someone-else",
            "PX",
            "30000",
        ])
        .await;
    lock.keepalive_lost(&grant.token).await;
    lock.release_lost(&grant.token).await;

    let metrics = sidecar
        .api()
        .get(&["metrics"], &[])
        .await
        .text()
        .await
        .unwrap();
    let lost: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("sidelock_lost_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        lost >= 2.0,
        "sidelock_lost_total counts both losses:\n{metrics}"
    );
}

/// One grant as the protected resource saw it.
#[derive(Debug, Clone, Copy)]
struct Interval {
    fence: u64,
    start: Instant,
    end: Instant,
}

#[tokio::test]
async fn redis_restarted_under_load_gives_503s_then_recovers_without_double_grants() {
    // AOF with fsync on every write: a killed Redis comes back with its leases.
    let mut server =
        RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]).await;
    let sidecars = [sidecar(&server).await, sidecar(&server).await];
    let name = unique_name("outage");
    // Clients run until well after the restart: a grant whose reply was lost
    // in the crash has no client to release it and ends only at its ttl.
    let stop = Arc::new(Mutex::new(Instant::now() + Duration::from_secs(60)));
    let intervals = Arc::new(Mutex::new(Vec::<Interval>::new()));
    let unavailable = Arc::new(Mutex::new(0u32));

    let mut clients = tokio::task::JoinSet::new();
    for c in 0..8 {
        let lock = sidecars[c % 2].api().lock(&name);
        let intervals = intervals.clone();
        let unavailable = unavailable.clone();
        let stop = stop.clone();
        clients.spawn(async move {
            while Instant::now() < *stop.lock().await {
                let response = lock.acquire_raw(&[("wait", "1s"), ("ttl", "3s")]).await;
                match response.status() {
                    StatusCode::OK => {}
                    StatusCode::CONFLICT => continue,
                    StatusCode::SERVICE_UNAVAILABLE => {
                        assert!(response.headers().contains_key("retry-after"));
                        *unavailable.lock().await += 1;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    other => panic!(
                        "acquire answered {other}: {}",
                        response.text().await.unwrap_or_default()
                    ),
                }
                let grant: Value = response.json().await.expect("grant body");
                let start = Instant::now();
                tokio::time::sleep(Duration::from_millis(5)).await;
                let token = grant["token"].as_str().expect("token").to_owned();
                let end = Instant::now();
                // Release until Redis answers: a 503 leaves the lease in place,
                // or it may have released it with the answer lost in the crash,
                // and then the retry answers 410 (as the README says).
                let mut retried = false;
                loop {
                    let r = lock.release_raw(&token).await;
                    match r.status() {
                        StatusCode::OK => break,
                        StatusCode::GONE if retried => break,
                        StatusCode::SERVICE_UNAVAILABLE => {
                            retried = true;
                            tokio::time::sleep(Duration::from_millis(50)).await
                        }
                        other => panic!(
                            "release answered {other}: {}",
                            r.text().await.unwrap_or_default()
                        ),
                    }
                }
                intervals.lock().await.push(Interval {
                    fence: grant["fence"].as_u64().expect("fence"),
                    start,
                    end,
                });
            }
        });
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    server.kill();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    server.restart().await;
    let recovered_from = Instant::now();
    *stop.lock().await = recovered_from + Duration::from_secs(5);
    within("clients finish", Duration::from_secs(60), async {
        while let Some(r) = clients.join_next().await {
            r.expect("client task");
        }
    })
    .await;

    assert!(
        *unavailable.lock().await > 0,
        "acquires during the outage must get 503"
    );
    let mut intervals = intervals.lock().await.clone();
    assert!(
        intervals.iter().any(|i| i.start > recovered_from),
        "grants resume after Redis returns"
    );
    intervals.sort_by_key(|i| i.start);
    for pair in intervals.windows(2) {
        assert!(pair[0].end <= pair[1].start, "overlapping grants: {pair:?}");
        assert!(
            pair[0].fence < pair[1].fence,
            "fence went backwards: {pair:?}"
        );
    }
    for s in &sidecars {
        assert!(
            !s.log().contains("panicked"),
            "a sidecar panicked:\n{}",
            s.log()
        );
    }
    let ready = sidecars[0].api().get(&["readyz"], &[]).await;
    assert_eq!(ready.status(), StatusCode::OK);
}

#[tokio::test]
async fn readiness_follows_redis_and_the_sidecar_starts_while_it_is_down() {
    let mut server = RedisServer::start().await;
    server.kill();
    let sidecar = sidecar(&server).await;
    let api = sidecar.api();
    let ready = api.get(&["readyz"], &[]).await;
    common::assert_problem(
        ready,
        StatusCode::SERVICE_UNAVAILABLE,
        "backend-unavailable",
    )
    .await;
    let busy = api.lock("down").acquire_raw(&[]).await;
    assert!(busy.headers().contains_key("retry-after"));
    common::assert_problem(busy, StatusCode::SERVICE_UNAVAILABLE, "backend-unavailable").await;

    server.restart().await;
    common::eventually("ready again", Duration::from_secs(10), async || {
        (api.get(&["readyz"], &[]).await.status() == StatusCode::OK).then_some(())
    })
    .await;
    api.lock("down").acquire(&[]).await;
}

#[tokio::test]
async fn a_waiter_of_a_dead_sidecar_is_passed_by() {
    let server = RedisServer::start().await;
    let alive = sidecar(&server).await;
    let mut doomed = sidecar(&server).await;
    let name = unique_name("orphan");
    let holder = alive.api().lock(&name).acquire(&[("ttl", "60s")]).await;

    let mut dead_waiter = doomed
        .api()
        .lock(&name)
        .hold(&[("owner", "doomed"), ("wait", "60s")])
        .await;
    dead_waiter.expect_queued().await;
    let mut live_waiter = alive
        .api()
        .lock(&name)
        .hold(&[("owner", "alive"), ("wait", "60s")])
        .await;
    assert_eq!(live_waiter.expect_queued().await.position, 2);

    doomed.signal(nix::sys::signal::Signal::SIGKILL);
    doomed.wait_exit(Duration::from_secs(5)).await;
    alive.api().lock(&name).release(&holder.token).await;
    // Nobody listens for the dead sidecar any more: the release passes its
    // ticket by and hands the lock to the live waiter at once.
    let grant = live_waiter
        .expect_acquired_within(Duration::from_secs(2))
        .await;
    assert_eq!(grant.owner, "alive");
}

/// The process (instance) whose queue entries on `name` are the sidecar
/// `sidecar`'s, as the entries name it.
async fn process_of(server: &RedisServer, name: &str, sidecar: &str) -> String {
    let entries: Vec<String> = server
        .cmd(&["LRANGE", &format!("{{sidelock:{name}}}:q"), "0", "-1"])
        .await;
    entries
        .iter()
        .find(|e| e.contains(&format!("\"{sidecar}\"]")))
        .and_then(|e| e.split(' ').nth(4))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no entry of {sidecar} in {entries:?}"))
}

/// Two sidecars named `side-a` and `side-b`.
async fn sides(server: &RedisServer) -> (SidecarGuard, SidecarGuard) {
    let start = |id| SidecarBuilder::new(&server.url()).sidecar_id(id).start();
    (start("side-a").await, start("side-b").await)
}

/// Writes the heartbeat of `sidecar`'s waiters on `name` into the past, as
/// if its process had stopped: the next handoff passes them by.
async fn lapse_heartbeat(server: &RedisServer, name: &str, sidecar: &str) {
    let process = process_of(server, name, sidecar).await;
    let beat = format!("{{sidelock:{name}}}:heartbeat");
    let _: i64 = server.cmd(&["HSET", &beat, &process, "1"]).await;
}

/// Every waiter of a sidecar passed by as dead while it lives queues again
/// and is granted in turn — the local head by its own next look, the others
/// because the release that passed them by said so (`p`), and they queued
/// again at once. (Before, only the local head came back: the others, their
/// timers spent, waited out their whole wait with the lock free.)
#[tokio::test]
async fn every_waiter_of_a_sidecar_passed_by_queues_again() {
    let server = RedisServer::start().await;
    let (a, b) = sides(&server).await;
    let name = unique_name("passed-all");
    let mut holder = a
        .api()
        .lock(&name)
        .hold(&[("owner", "holder"), ("ttl", "600ms")])
        .await;
    holder.expect_acquired().await;
    let mut first = b
        .api()
        .lock(&name)
        .hold(&[("owner", "first"), ("wait", "30s")])
        .await;
    first.expect_queued().await;
    let mut second = b
        .api()
        .lock(&name)
        .hold(&[("owner", "second"), ("wait", "30s")])
        .await;
    second.expect_queued().await;
    // The second's timer fires while the first is ahead of it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    lapse_heartbeat(&server, &name, "side-b").await;
    drop(holder);
    let grant = first.expect_acquired_within(Duration::from_secs(3)).await;
    assert_eq!(grant.owner, "first");
    drop(first);
    let grant = second.expect_acquired_within(Duration::from_secs(3)).await;
    assert_eq!(grant.owner, "second");
}

/// A waiter passed by as dead while its sidecar lives (its heartbeat looked
/// lapsed: here written into the past by hand) is not lost: when its timer
/// fires it queues again at its place, and it is granted.
#[tokio::test]
async fn a_live_waiter_passed_by_as_dead_queues_again_and_is_granted() {
    let server = RedisServer::start().await;
    let (a, b) = sides(&server).await;
    let name = unique_name("passed");
    let holder = a
        .api()
        .lock(&name)
        .acquire(&[("owner", "holder"), ("ttl", "2s")])
        .await;
    let mut first = b
        .api()
        .lock(&name)
        .hold(&[("owner", "first"), ("wait", "30s")])
        .await;
    first.expect_queued().await;
    let mut second = a
        .api()
        .lock(&name)
        .hold(&[("owner", "second"), ("wait", "30s")])
        .await;
    second.expect_queued().await;

    lapse_heartbeat(&server, &name, "side-b").await;
    a.api().lock(&name).release(&holder.token).await;
    let grant = second.expect_acquired_within(Duration::from_secs(2)).await;
    assert_eq!(
        grant.owner, "second",
        "the waiter that looked dead was passed by"
    );
    drop(second);
    let grant = first.expect_acquired_within(Duration::from_secs(6)).await;
    assert_eq!(grant.owner, "first");
}

/// A waiter never polls: behind a lease its holder keeps renewing, it
/// looks again once per renewal at most (when the expiry it was told passes),
/// and behind a lease that expired into its lock-delay, once, when the delay
/// ends. (A short path that did not read the clock once answered a past
/// expiry, and its waiters asked again at once, for as long as it lasted.)
#[tokio::test]
async fn a_waiter_behind_a_renewed_or_delayed_lease_does_not_poll() {
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let name = unique_name("renewed");
    let lock = sidecar.api().lock(&name);
    let mut hold = lock.hold(&[("owner", "holder"), ("ttl", "600ms")]).await;
    hold.expect_acquired().await;
    let waiter = queue_waiter(&sidecar, &name, "20s").await;
    // The watchdog renews every 200 ms (about 10 renewals of 4 commands);
    // the waiter may look once after each.
    let (spent, what) = commands_during(&server, Duration::from_secs(2)).await;
    assert!(
        spent < 100,
        "{spent} commands in 2 s behind a renewed lease: {what}"
    );
    drop(hold);
    let grant = within("the waiter granted", Duration::from_secs(5), waiter)
        .await
        .expect("waiter task");
    lock.release(&grant.token).await;

    let name = unique_name("delayed");
    let lock = sidecar.api().lock(&name);
    lock.acquire(&[
        ("owner", "expiring"),
        ("ttl", "200ms"),
        ("lock_delay", "2s"),
    ])
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let before = server.command_counts().await;
    let started = Instant::now();
    let grant = lock.acquire(&[("owner", "after"), ("wait", "10s")]).await;
    let after = server.command_counts().await;
    assert!(started.elapsed() >= Duration::from_millis(1500));
    // Joining, watching and one look when the delay ends take about 40
    // commands; a look every few ms for 1.6 s would take hundreds.
    let spent = ran(&before, &after);
    assert!(
        spent < 50,
        "{spent} commands to wait out a lock-delay: {}",
        command_diff(&before, &after)
    );
    lock.release(&grant.token).await;
}

/// The lock-delay of a shared lease that expired unnoticed (its sidecar was
/// killed) holds on Redis as anywhere: the main key mirrored the shared
/// holders and is gone, but the short paths look at the holders and delay
/// keys too, so nothing is granted before the delay ends, and a waiter waits
/// for that end without asking again and again. (They once looked at the
/// queue only: a writer was granted inside the delay, and the delay then
/// stretched its key past its lease, which a waiter kept trying.)
#[tokio::test]
async fn an_expired_shared_leases_lock_delay_holds_and_nobody_polls() {
    let server = RedisServer::start().await;
    let live = sidecar(&server).await;
    let mut doomed = sidecar(&server).await;
    let name = unique_name("shared-delay");
    let started = Instant::now();
    doomed
        .api()
        .lock(&name)
        .acquire(&[
            ("owner", "reader"),
            ("mode", "shared"),
            ("ttl", "1s"),
            ("lock_delay", "4s"),
        ])
        .await;
    doomed.signal(nix::sys::signal::Signal::SIGKILL);
    doomed.wait_exit(Duration::from_secs(5)).await;
    tokio::time::sleep_until((started + Duration::from_millis(1300)).into()).await;

    let lock = live.api().lock(&name);
    lock.acquire_busy(&[("owner", "writer"), ("ttl", "2s")])
        .await;
    let waiter = queue_waiter(&live, &name, "15s").await;
    let (spent, what) = commands_during(&server, Duration::from_secs(2)).await;
    assert!(
        spent < 40,
        "{spent} commands in 2 s of a lock-delay: {what}"
    );
    let grant = within("the waiter granted", Duration::from_secs(10), waiter)
        .await
        .expect("waiter task");
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "granted {:?} after a 1 s lease with a 4 s lock-delay",
        started.elapsed()
    );
    lock.release(&grant.token).await;
}

#[tokio::test]
async fn stale_keys_are_listed_for_every_reason() {
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&server.url())
        .stale_after("200ms")
        .flag("legacy-pattern", "lock:*")
        .start()
        .await;
    let api = sidecar.api();
    let held = unique_name("held");
    api.lock(&held).acquire(&[("ttl", "60s")]).await;
    // A lock key set without expiry, and a hand-written SETNX lock.
    let _: String = server.cmd(&["SET", "sidelock:forever", "x"]).await;
    let _: String = server.cmd(&["SET", "lock:orders", "1"]).await;
    // A waiter entry whose sidecar stopped heartbeating, and a holder entry
    // past its expiry that no script has pruned yet.
    let orphan = unique_name("orphan");
    let tag = format!("{{sidelock:{orphan}}}");
    let _: i64 = server
        .cmd(&[
            "RPUSH",
            &format!("{tag}:q"),
            r#"1 x 0123456789abcdef0123456789abcdef 1 dead 30000 0 0 ["ghost","gone"]"#,
        ])
        .await;
    let _: i64 = server
        .cmd(&["HSET", &format!("{tag}:heartbeat"), "dead", "1"])
        .await;
    let _: i64 = server
        .cmd(&[
            "HSET",
            &format!("{tag}:holders"),
            "t",
            r#"{"o":"late","s":"gone","m":"s","f":1,"c":1,"t0":1,"e":2,"ttl":1,"cap":0,"dl":0}"#,
        ])
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    let stale = api.stale().await;
    let has = |reason: &str, key: &str| {
        stale
            .iter()
            .any(|s| s.reason == reason && s.key.contains(key))
    };
    assert!(has("held-too-long", &held), "{stale:#?}");
    assert!(has("no-expiry", "sidelock:forever"), "{stale:#?}");
    assert!(has("no-expiry", "lock:orders"), "{stale:#?}");
    assert!(has("orphaned-waiter", &orphan), "{stale:#?}");
    assert!(has("expired-not-cleaned", &orphan), "{stale:#?}");
}

#[tokio::test]
async fn locks_keep_working_through_a_sentinel_failover() {
    let mut servers = common::redis::RedisSentinel::start().await;
    let sidecar = SidecarBuilder::new(&servers.url()).start().await;
    let api = sidecar.api();
    let before = unique_name("before");
    // The ttl outlasts the failover (about 1 s to notice, 1-3 s to promote);
    // a shorter lease would end with `lost`, as it must.
    let mut hold = api.lock(&before).hold(&[("ttl", "10s")]).await;
    let held = hold.expect_acquired().await;
    // Let the replica catch up, as it usually has in production.
    servers.wait_replicated().await;

    let old_master = servers.master.port();
    servers.master.kill();
    common::eventually(
        "the sentinel promotes the replica",
        Duration::from_secs(30),
        async || (servers.master_port().await == Some(servers.replica.port())).then_some(()),
    )
    .await;
    assert_ne!(servers.replica.port(), old_master);

    // New locks work through the same URL once the sidecar follows the master.
    let after = unique_name("after");
    let grant = common::eventually(
        "acquire after failover",
        Duration::from_secs(20),
        async || {
            let r = api.lock(&after).acquire_raw(&[]).await;
            match r.status() {
                StatusCode::OK => Some(r.json::<Value>().await.expect("grant")),
                StatusCode::SERVICE_UNAVAILABLE => None,
                other => panic!("acquire after failover answered {other}"),
            }
        },
    )
    .await;
    assert_eq!(grant["fence"], 1);

    // The lease held across the failover was replicated: the watchdog keeps
    // renewing it on the new master, and the holder is told nothing is wrong.
    let state = api.lock(&before).inspect().await;
    assert_eq!(state.holders.len(), 1, "{state:?}");
    assert_eq!(state.holders[0].fence, held.fence);
    let renewed = hold.collect_for(Duration::from_secs(4)).await;
    assert!(
        renewed.iter().all(|e| e.name() == "renewed"),
        "only renewals after the failover: {renewed:?}"
    );
    assert!(!renewed.is_empty(), "the watchdog renews on the new master");
}

#[tokio::test]
async fn a_lease_shorter_than_a_sentinel_failover_is_lost_before_anyone_else_holds_it() {
    let mut servers = common::redis::RedisSentinel::start().await;
    let first = SidecarBuilder::new(&servers.url())
        .sidecar_id("first")
        .start()
        .await;
    let second = SidecarBuilder::new(&servers.url())
        .sidecar_id("second")
        .start()
        .await;
    let name = unique_name("failover-lost");
    // The failover takes at least `down-after-milliseconds` (1 s here); the
    // lease, renewed every ttl/3, runs out sooner.
    let mut hold = first.api().lock(&name).hold(&[("ttl", "1s")]).await;
    let held = hold.expect_acquired().await;
    servers.wait_replicated().await;

    servers.master.kill();
    let contender = {
        let api = second.api();
        let name = name.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let r = api.lock(&name).acquire_raw(&[("wait", "1s")]).await;
                match r.status() {
                    StatusCode::OK => {
                        let grant: Value = r.json().await.expect("grant");
                        return (grant, Instant::now());
                    }
                    StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT => {}
                    other => panic!("acquire during the failover answered {other}"),
                }
                assert!(Instant::now() < deadline, "no grant after the failover");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let reason = hold.expect_lost_within(Duration::from_secs(10)).await;
    let lost_at = Instant::now();
    assert_eq!(reason, "unreachable");
    let (grant, granted_at) = within(
        "a grant on the promoted replica",
        Duration::from_secs(40),
        async { contender.await.expect("contender task") },
    )
    .await;
    assert!(lost_at < granted_at, "`lost` came after the new grant");
    assert_eq!(servers.master_port().await, Some(servers.replica.port()));
    assert!(grant["fence"].as_u64().expect("fence") > held.fence);
}

#[tokio::test]
async fn a_locks_keys_share_one_cluster_slot() {
    let cluster = common::redis::RedisCluster::start().await;
    let sidecar = SidecarBuilder::new(&cluster.url()).start().await;
    let name = unique_name("slot");
    let lock = sidecar.api().lock(&name);
    let grant = lock.acquire(&[("ttl", "30s")]).await;
    let node = &cluster.nodes[0];
    let slot = |key: String| async move {
        let slot: i64 = node.cmd(&["CLUSTER", "KEYSLOT", &key]).await;
        slot
    };
    let main = slot(format!("sidelock:{name}")).await;
    for suffix in [
        "fence",
        "seq",
        "q",
        "heartbeat",
        "holders",
        "expiry",
        "delay",
        "limit",
    ] {
        assert_eq!(slot(format!("{{sidelock:{name}}}:{suffix}")).await, main);
    }
    // Whichever node owns the slot, the main key holds the lease.
    let client = redis::cluster::ClusterClient::new(
        cluster.nodes.iter().map(|n| n.url()).collect::<Vec<_>>(),
    )
    .expect("cluster client");
    let mut c = client
        .get_async_connection()
        .await
        .expect("cluster connection");
    let value: String = redis::cmd("GET")
        .arg(format!("sidelock:{name}"))
        .query_async(&mut c)
        .await
        .expect("GET main key");
    assert_eq!(value.split(' ').next(), Some(grant.token.as_str()));
}

/// On a Cluster whose nodes require a password, the listing and the
/// stale scan connect to each master by the address `CLUSTER NODES` gives,
/// and did so without the URL's credentials: every listing and scan
/// answered 503 `authentication failed` while locks worked, and the
/// sidecar logged the backend down and up again at each monitor scan.
#[tokio::test]
async fn a_password_protected_cluster_is_listed_and_scanned_with_its_credentials() {
    let cluster = common::redis::RedisCluster::start_with_password("s3cret-pw").await;
    let sidecar = SidecarBuilder::new(&cluster.url())
        .flag("legacy-pattern", "lock:*")
        .start()
        .await;
    let api = sidecar.api();
    let names: Vec<String> = (0..6).map(|_| unique_name("guarded")).collect();
    for name in &names {
        api.lock(name).acquire(&[]).await;
    }
    let listed = api.get(&["v1", "locks"], &[]).await;
    assert_eq!(listed.status(), StatusCode::OK);
    let listed = listed.text().await.expect("the listing");
    for name in &names {
        assert!(listed.contains(name.as_str()), "{name} in {listed}");
    }
    let stale = api.get(&["v1", "stale"], &[]).await;
    assert_eq!(
        stale.status(),
        StatusCode::OK,
        "{}",
        stale.text().await.unwrap_or_default()
    );
    assert!(
        !sidecar.log().contains("s3cret-pw"),
        "the password stays out of the log"
    );
}

#[tokio::test]
async fn stale_keys_without_expiry_are_found_on_every_cluster_master() {
    let cluster = common::redis::RedisCluster::start().await;
    let sidecar = SidecarBuilder::new(&cluster.url())
        .flag("legacy-pattern", "lock:*")
        .start()
        .await;
    let client = redis::cluster::ClusterClient::new(
        cluster.nodes.iter().map(|n| n.url()).collect::<Vec<_>>(),
    )
    .expect("cluster client");
    let mut c = client
        .get_async_connection()
        .await
        .expect("cluster connection");
    // Enough keys that every master holds some.
    let keys: Vec<String> = (0..12).map(|i| format!("lock:job-{i}")).collect();
    for k in &keys {
        let _: String = redis::cmd("SET")
            .arg(k)
            .arg("1")
            .query_async(&mut c)
            .await
            .expect("SET");
    }
    let stale = sidecar.api().stale().await;
    for k in &keys {
        assert!(
            stale.iter().any(|s| s.reason == "no-expiry" && &s.key == k),
            "{k} missing from {stale:#?}"
        );
    }
}

/// A fence counter carried over from another lock service (set by hand to
/// go on from its numbers) past 10^14: Lua's own number-to-text conversion
/// writes such a number as `1.2345678901235e+14`, which is no fence. Every
/// step of an exclusive lease — the grant, a keepalive, the listing, a
/// release that hands the lock over to a waiter on the other sidecar, and
/// that waiter's release — must keep the exact number. (Before, the lease
/// was written with such a fence: its keepalive and release answered 410.)
#[tokio::test]
async fn an_exclusive_lease_keeps_a_fence_past_ten_to_the_fourteenth() {
    let server = RedisServer::start().await;
    let sidecars = [sidecar(&server).await, sidecar(&server).await];
    let name = unique_name("big-fence");
    let start: u64 = 123_456_789_012_345;
    let _: () = server
        .cmd(&[
            "SET",
            &format!("{{sidelock:{name}}}:fence"),
            &start.to_string(),
        ])
        .await;
    let lock = sidecars[0].api().lock(&name);

    let grant = lock.acquire(&[("ttl", "30s"), ("owner", "first")]).await;
    assert_eq!(grant.fence, start + 1);
    lock.keepalive(&grant.token, &[]).await;
    let state = lock.inspect().await;
    assert_eq!(state.holders.len(), 1, "{state:?}");
    assert_eq!(state.holders[0].fence, start + 1);

    let mut waiter = sidecars[1]
        .api()
        .lock(&name)
        .hold(&[("owner", "second"), ("wait", "30s")])
        .await;
    waiter.expect_queued().await;
    let released = lock.release(&grant.token).await;
    assert!(released.released);
    let second = waiter.expect_acquired_within(Duration::from_secs(5)).await;
    assert_eq!(second.owner, "second");
    assert_eq!(second.fence, start + 2, "handed over with its fence");
    let state = lock.inspect().await;
    assert_eq!(state.holders.len(), 1, "{state:?}");
    assert_eq!(state.holders[0].fence, start + 2);
    drop(waiter);
    lock.wait_until_free().await;

    let third = lock.acquire(&[("owner", "third")]).await;
    assert_eq!(third.fence, start + 3);
    assert!(lock.release(&third.token).await.released);
}

/// The same for shared locks and semaphores, whose holders are kept as JSON
/// (cjson writes numbers with 14 digits): each holder is listed with the
/// exact fence it was granted. (Before, two readers granted 123456789012346
/// and 123456789012347 were both listed with 123456789012350.)
#[tokio::test]
async fn shared_holders_and_permits_keep_fences_past_ten_to_the_fourteenth() {
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let start: u64 = 123_456_789_012_345;
    for (resource, params) in [
        (
            sidecar.api().lock(&unique_name("big-shared")),
            ("mode", "shared"),
        ),
        (
            sidecar.api().semaphore(&unique_name("big-permits")),
            ("limit", "2"),
        ),
    ] {
        let base = match resource.kind() {
            common::Kind::Lock => format!("sidelock:{}", resource.name()),
            common::Kind::Semaphore => format!("sidelock:semaphores/{}", resource.name()),
        };
        let _: () = server
            .cmd(&["SET", &format!("{{{base}}}:fence"), &start.to_string()])
            .await;
        let first = resource.acquire(&[params, ("owner", "first")]).await;
        let second = resource.acquire(&[params, ("owner", "second")]).await;
        assert_eq!((first.fence, second.fence), (start + 1, start + 2));
        let state = resource.inspect().await;
        let mut listed: Vec<(String, u64)> = state
            .holders
            .iter()
            .map(|h| (h.owner.clone(), h.fence))
            .collect();
        listed.sort();
        assert_eq!(
            listed,
            [
                ("first".to_owned(), start + 1),
                ("second".to_owned(), start + 2)
            ],
            "{state:?}"
        );
        assert!(resource.release(&first.token).await.released);
        assert!(resource.release(&second.token).await.released);
    }
}

/// Holder entries written by hand with fences that are no integer sidelock
/// writes — text, a fraction, null, 20 digits — are still reported by
/// `/v1/stale` (held too long), as the fence Lua shows; the report does not
/// fail. (With fences formatted as integers, text made the stale script
/// fail, and `/v1/stale` with it.)
#[tokio::test]
async fn stale_reports_holders_whose_fence_was_written_by_hand() {
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&server.url())
        .stale_after("200ms")
        .start()
        .await;
    let mut names = Vec::new();
    for fence in [r#""x7""#, "5.5", "null", "12345678901234567890"] {
        let name = unique_name("odd-fence");
        let _: i64 = server
            .cmd(&[
                "HSET",
                &format!("{{sidelock:{name}}}:holders"),
                "t",
                &format!(
                    r#"{{"o":"hand","s":"written","m":"s","f":{fence},"c":1,"t0":1,"e":99999999999999,"ttl":1000,"cap":0,"dl":0}}"#
                ),
            ])
            .await;
        names.push(name);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stale = sidecar.api().stale().await;
    for name in &names {
        assert!(
            stale
                .iter()
                .any(|s| s.reason == "held-too-long" && s.key.contains(name.as_str())),
            "{name} is not reported: {stale:#?}"
        );
    }
}

/// A lease value written by hand with leading zeros in its numbers
/// (`00` for no max_hold and no lock-delay, `01` for one hold) is read as
/// the numbers say on every path: a keepalive extends it by its ttl, a
/// release frees it, also when its owner is not JSON (which only the full
/// scripts read). (A fast path comparing them as text once ended such a
/// lease at its keepalive.)
#[tokio::test]
async fn a_hand_written_lease_with_leading_zeros_renews_and_releases() {
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let token = "0123456789abcdef0123456789abcdef";
    let now: i64 = {
        let t: Vec<String> = server.cmd(&["TIME"]).await;
        t[0].parse::<i64>().unwrap() * 1000 + t[1].parse::<i64>().unwrap() / 1000
    };
    let (since, ends) = (now - 1_000, now + 20_000);
    // The second has an owner that is not JSON, which only the full
    // scripts read: the release still frees it. (With one hold and no
    // lock-delay recognised only as the text "1" and "0", it went to the
    // full script, which failed on the owner: 503.)
    for (name, value, renews) in [
        (
            "zeros",
            format!(r#"{token} 5 {since} {ends} 01 30000 00 00 ["hand","written"]"#),
            true,
        ),
        (
            "zeros-odd-owner",
            format!("{token} 5 {since} {ends} 01 30000 0 00 not-json"),
            false,
        ),
    ] {
        let name = unique_name(name);
        let _: () = server
            .cmd(&["SET", &format!("sidelock:{name}"), &value, "PX", "20000"])
            .await;
        let lock = sidecar.api().lock(&name);
        if renews {
            let renewed = lock.keepalive(token, &[]).await;
            assert!(
                renewed.ttl_ms > 29_000 && renewed.expires_at_ms as i64 > now + 25_000,
                "{renewed:?}"
            );
        }
        assert!(lock.release(token).await.released, "{value}");
        assert!(lock.acquire(&[]).await.fence > 0);
    }
}

/// `PUBLISH` calls Redis ran between two readings.
fn publishes(
    before: &std::collections::BTreeMap<String, u64>,
    after: &std::collections::BTreeMap<String, u64>,
) -> u64 {
    after.get("publish").copied().unwrap_or(0) - before.get("publish").copied().unwrap_or(0)
}

/// Hands `name` `rounds` times from a holder on `from` to a waiter on `to`
/// (an exclusive holder, or with `shared` a reader whose release leaves the
/// lock free): each waiter is granted with a higher fence. The `PUBLISH`
/// calls Redis ran on the way, and what it ran.
async fn hand_rounds(
    server: &RedisServer,
    from: &SidecarGuard,
    to: &SidecarGuard,
    name: &str,
    rounds: u64,
    shared: bool,
) -> (u64, String) {
    let mut publishes_seen = 0;
    let mut ran_seen = String::new();
    let holder_mode = if shared { "shared" } else { "exclusive" };
    let mut fence = 0;
    for round in 0..rounds {
        let holder = from
            .api()
            .lock(name)
            .acquire(&[("owner", "holder"), ("ttl", "60s"), ("mode", holder_mode)])
            .await;
        assert!(holder.fence > fence, "round {round}: fences go up");
        let waiter = queue_waiter(to, name, "30s").await;
        let before = server.command_counts().await;
        from.api().lock(name).release(&holder.token).await;
        let grant = within("the waiter's grant", Duration::from_secs(5), waiter)
            .await
            .expect("the waiter's task");
        let after = server.command_counts().await;
        assert_eq!(grant.owner, "waiter");
        assert!(
            grant.fence > holder.fence,
            "round {round}: handed with a higher fence"
        );
        fence = grant.fence;
        publishes_seen += publishes(&before, &after);
        ran_seen = command_diff(&before, &after);
        to.api().lock(name).release(&grant.token).await;
    }
    (publishes_seen, ran_seen)
}

/// A release that hands the lock to a waiter of its own sidecar tells it in
/// the release's answer: Redis publishes nothing (the message would only
/// come back to the sidecar that asked). A waiter on another sidecar is
/// still told on that sidecar's channel. Both for an exclusive holder's
/// release and for the last reader's.
#[tokio::test]
async fn a_handoff_to_a_waiter_of_the_releasing_sidecar_is_told_in_the_answer() {
    const ROUNDS: u64 = 10;
    let server = RedisServer::start().await;
    let (a, b) = sides(&server).await;
    for shared in [false, true] {
        let name = unique_name(if shared {
            "reader-hands"
        } else {
            "holder-hands"
        });
        // Loads the scripts and writes the heartbeats.
        hand_rounds(&server, &a, &b, &name, 1, shared).await;
        hand_rounds(&server, &a, &a, &name, 1, shared).await;

        let (local, ran) = hand_rounds(&server, &a, &a, &name, ROUNDS, shared).await;
        // The monitor's announcement (every 10 s) may fall in one round.
        assert!(
            local <= 1,
            "{local} PUBLISH calls for {ROUNDS} handoffs within one sidecar (shared: {shared}); the last ran {ran}"
        );
        let (across, ran) = hand_rounds(&server, &a, &b, &name, ROUNDS, shared).await;
        assert!(
            across >= ROUNDS,
            "{across} PUBLISH calls for {ROUNDS} handoffs to another sidecar (shared: {shared}); the last ran {ran}"
        );
    }
}

/// Queues a waiter on `name` through `sidecar` behind a 60 s holder, then
/// 8 million junk entries ahead of it: the release that hands it the lock
/// first drops them all, which takes Redis seconds (about 0.6 s a million
/// here), past the call's 2 s limit. The holder's grant and the waiter's task.
async fn hand_over_slowly(
    server: &RedisServer,
    sidecar: &SidecarGuard,
    name: &str,
) -> (
    common::api::Grant,
    tokio::task::JoinHandle<common::api::Grant>,
) {
    const JUNK: usize = 8_000_000;
    // Other calls wait for the long script instead of being told BUSY.
    let _: String = server
        .cmd(&["CONFIG", "SET", "busy-reply-threshold", "120000"])
        .await;
    let lock = sidecar.api().lock(name);
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    let waiter = queue_waiter(sidecar, name, "60s").await;
    let queue = format!("{{sidelock:{name}}}:q");
    let junk = vec!["junk"; 10_000];
    for _ in 0..JUNK / junk.len() {
        let mut args = vec!["LPUSH", queue.as_str()];
        args.extend_from_slice(&junk);
        let _: i64 = server.cmd(&args).await;
    }
    (holder, waiter)
}

/// The waiter of [`hand_over_slowly`] is granted the lease the release
/// handed it, well before the holder's 60 s lease would have ended.
async fn expect_handed_slowly(
    server: &RedisServer,
    sidecar: &SidecarGuard,
    name: &str,
    holder: &common::api::Grant,
    waiter: tokio::task::JoinHandle<common::api::Grant>,
    started: Instant,
) {
    let grant = within("the waiter's grant", Duration::from_secs(60), waiter)
        .await
        .expect("the waiter's task");
    assert_eq!(grant.owner, "waiter");
    assert!(grant.fence > holder.fence);
    let lease: String = server.cmd(&["GET", &format!("sidelock:{name}")]).await;
    assert!(
        lease.starts_with(&grant.token),
        "the lease the release handed over is the waiter's: {lease}"
    );
    // Before the holder's lease ended, with room for a slow machine: the
    // junk's drop alone took Redis 29 s once, beside other builds.
    let left_ms = holder.expires_at_ms.saturating_sub(wall_ms());
    assert!(
        left_ms > 5_000,
        "granted {:?} after the release was sent, {left_ms} ms before the holder's 60 s \
         lease would end: it (nearly) had to end first",
        started.elapsed()
    );
    let queued: i64 = server
        .cmd(&["LLEN", &format!("{{sidelock:{name}}}:q")])
        .await;
    assert_eq!(queued, 0, "the junk went on the way");
    sidecar.api().lock(name).release(&grant.token).await;
}

/// A release whose answer never comes back (its script ran past the call's
/// time limit) still reaches the waiter of the same sidecar it handed the
/// lock to, although no message tells it: the key is reconciled on the next
/// heartbeat tick, and the local head looks again and finds the lease
/// handed to it.
#[tokio::test]
async fn a_handoff_whose_release_answer_is_lost_still_reaches_its_waiter() {
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let name = unique_name("answer-lost");
    let (holder, waiter) = hand_over_slowly(&server, &sidecar, &name).await;
    let started = Instant::now();
    let released = sidecar.api().lock(&name).release_raw(&holder.token).await;
    assert_eq!(
        released.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "the release's answer timed out"
    );
    expect_handed_slowly(&server, &sidecar, &name, &holder, waiter, started).await;
}

/// The same when the client that released hangs up before the answer: the
/// release, dropped with its request, may have run.
#[tokio::test]
async fn a_handoff_whose_releaser_hung_up_still_reaches_its_waiter() {
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let name = unique_name("releaser-gone");
    let (holder, waiter) = hand_over_slowly(&server, &sidecar, &name).await;
    let started = Instant::now();
    let url = sidecar
        .api()
        .url(&["v1", "locks", &name], &[("token", &holder.token)]);
    let hung_up = reqwest::Client::new()
        .delete(url)
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(
        hung_up.as_ref().is_err_and(reqwest::Error::is_timeout),
        "the release answered within 300 ms: {hung_up:?}"
    );
    expect_handed_slowly(&server, &sidecar, &name, &holder, waiter, started).await;
}

/// A release that times out in a Cluster (every master busy with another
/// client's 3 s script, past the call's 2 s limit) answers 503 and runs
/// once at most: of a lock held twice by its owner, one hold or both are
/// left, and nobody else gets it.
#[tokio::test]
async fn a_release_that_times_out_in_a_cluster_runs_once_at_most() {
    let cluster = common::redis::RedisCluster::start().await;
    let sidecar = SidecarBuilder::new(&cluster.url()).start().await;
    let name = unique_name("cluster-once");
    let lock = sidecar.api().lock(&name);
    let first = lock.acquire(&[("owner", "twice"), ("ttl", "60s")]).await;
    let again = lock.acquire(&[("owner", "twice"), ("ttl", "60s")]).await;
    assert_eq!(
        (again.token.as_str(), again.count),
        (first.token.as_str(), 2)
    );

    let busy = "local s = tonumber(redis.call('TIME')[1]) \
                while tonumber(redis.call('TIME')[1]) - s < 3 do end return 1";
    let mut busy_nodes = tokio::task::JoinSet::new();
    for node in &cluster.nodes {
        let url = node.url();
        let busy = busy.to_owned();
        busy_nodes.spawn(async move {
            let client = redis::Client::open(url.as_str()).expect("client");
            let config = redis::AsyncConnectionConfig::new()
                .set_response_timeout(Some(Duration::from_secs(30)));
            let mut c = client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .expect("connection");
            let _: i64 = redis::cmd("EVAL")
                .arg(&busy)
                .arg(0)
                .query_async(&mut c)
                .await
                .expect("busy script");
        });
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = lock.release_raw(&first.token).await;
    // On a loaded machine the release may come before the busy scripts:
    // then it answered, and one hold is left.
    let answered = match released.status() {
        StatusCode::OK => {
            let body: Value = released.json().await.expect("release's answer");
            assert_eq!(body["count"], 1, "{body}");
            true
        }
        status => {
            assert_eq!(
                status,
                StatusCode::SERVICE_UNAVAILABLE,
                "the release's answer timed out"
            );
            false
        }
    };
    while busy_nodes.join_next().await.is_some() {}
    // The release ran (at most) once: the owner holds the lock once more.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let other = lock.acquire_raw(&[("owner", "other")]).await;
    assert_eq!(
        other.status(),
        StatusCode::CONFLICT,
        "another owner got the lock its owner still holds once"
    );
    // Once or not at all: one or two holds are left (one when it answered).
    lock.keepalive(&first.token, &[]).await;
    let mut left = lock.release(&first.token).await.count;
    if left == 1 {
        assert!(!answered, "two holds were left after an answered release");
        left = lock.release(&first.token).await.count;
    }
    assert_eq!(left, 0, "the owner's holds came down one release at a time");
}

/// A Cluster whose first master is announced (to every client that asks
/// which node serves a slot) at a proxy that can lose an answer, and a lock
/// name whose keys that master serves.
async fn cluster_behind_a_proxy() -> (
    common::redis::RedisCluster,
    common::proxy::CuttingProxy,
    String,
) {
    let cluster = common::redis::RedisCluster::start().await;
    let first = &cluster.nodes[0];
    let proxy = common::proxy::CuttingProxy::start(first.port()).await;
    let port = proxy.port().to_string();
    let _: String = first
        .cmd(&["CONFIG", "SET", "cluster-announce-port", &port])
        .await;
    // Every master has heard (gossip) where the first one is now.
    for node in &cluster.nodes {
        common::eventually("the proxy announced", Duration::from_secs(20), async || {
            let nodes: String = node.cmd(&["CLUSTER", "NODES"]).await;
            nodes.contains(&format!(":{port}@")).then_some(())
        })
        .await;
    }
    let slots: Vec<redis::Value> = first.cmd(&["CLUSTER", "SLOTS"]).await;
    let served: Vec<(i64, i64)> = slots
        .iter()
        .filter_map(|range| match range {
            redis::Value::Array(r) => {
                let port_of = match r.get(2) {
                    Some(redis::Value::Array(node)) => node.get(1).cloned(),
                    _ => None,
                };
                match (r.first(), r.get(1), port_of) {
                    (
                        Some(redis::Value::Int(from)),
                        Some(redis::Value::Int(to)),
                        Some(redis::Value::Int(p)),
                    ) if p.to_string() == port => Some((*from, *to)),
                    _ => None,
                }
            }
            _ => None,
        })
        .collect();
    assert!(
        !served.is_empty(),
        "no slot announced at the proxy: {slots:?}"
    );
    let mut name = unique_name("behind-proxy");
    for i in 0.. {
        let candidate = format!("{name}-{i}");
        let slot: i64 = first
            .cmd(&["CLUSTER", "KEYSLOT", &format!("sidelock:{candidate}")])
            .await;
        if served
            .iter()
            .any(|(from, to)| (*from..=*to).contains(&slot))
        {
            name = candidate;
            break;
        }
    }
    (cluster, proxy, name)
}

/// Loads the scripts of a lock's acquire, join and release (handing over)
/// on the node that serves `name`: their first call is refused (`NOSCRIPT`)
/// and sent again with the script, which a cut must not be mistaken for.
async fn load_scripts(sidecar: &SidecarGuard, name: &str) {
    let lock = sidecar.api().lock(name);
    let holder = lock.acquire(&[("ttl", "60s")]).await;
    let waiter = queue_waiter(sidecar, name, "30s").await;
    lock.release(&holder.token).await;
    let grant = waiter.await.expect("the waiter's task");
    lock.release(&grant.token).await;
}

/// In a Cluster, a release whose answer is lost after it ran (the
/// connection reset under it) is not sent again by the Cluster client: a
/// second run of the release of a lock its owner holds twice let the lock
/// go while the owner still held it once, and another owner got it. It
/// answers 503, as on one Redis; the owner's one release took one hold.
#[tokio::test]
async fn a_release_whose_answer_is_lost_in_a_cluster_is_not_sent_again() {
    let (cluster, proxy, name) = cluster_behind_a_proxy().await;
    let sidecar = SidecarBuilder::new(&cluster.url()).start().await;
    load_scripts(&sidecar, &name).await;
    let lock = sidecar.api().lock(&name);
    let first = lock.acquire(&[("owner", "twice"), ("ttl", "60s")]).await;
    let again = lock.acquire(&[("owner", "twice"), ("ttl", "60s")]).await;
    assert_eq!(again.count, 2);
    proxy.cut_after(first.token.as_bytes());
    let released = lock.release_raw(&first.token).await;
    assert!(!proxy.armed(), "the release went through the proxy");
    assert_eq!(
        released.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "its answer was lost"
    );
    let other = lock.acquire_raw(&[("owner", "other")]).await;
    assert_eq!(
        other.status(),
        StatusCode::CONFLICT,
        "another owner got the lock its owner still holds once"
    );
    let last = lock.release(&first.token).await;
    assert_eq!(last.count, 0, "one hold was left: {last:?}");
}

/// In a Cluster, a release that hands the lock to a waiter of its own
/// sidecar and whose answer is lost after it ran still reaches the waiter
/// at once (the Cluster's handoff is published, not carried in the answer).
#[tokio::test]
async fn a_cluster_handoff_whose_release_answer_is_lost_reaches_its_waiter_at_once() {
    let (cluster, proxy, name) = cluster_behind_a_proxy().await;
    let sidecar = SidecarBuilder::new(&cluster.url()).start().await;
    load_scripts(&sidecar, &name).await;
    let lock = sidecar.api().lock(&name);
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    let waiter = queue_waiter(&sidecar, &name, "30s").await;
    proxy.cut_after(holder.token.as_bytes());
    let started = Instant::now();
    let released = lock.release_raw(&holder.token).await;
    assert!(!proxy.armed(), "the release went through the proxy");
    assert!(
        !released.status().is_success(),
        "its answer was lost: {}",
        released.status()
    );
    let grant = within("the waiter's grant", Duration::from_secs(30), waiter)
        .await
        .expect("the waiter's task");
    assert_eq!(grant.owner, "waiter");
    assert!(grant.fence > holder.fence);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "granted {:?} after the release",
        started.elapsed()
    );
    lock.release(&grant.token).await;
}

/// A Redis server, a cutting proxy in front of it, a sidecar through the
/// proxy and one straight on the server.
struct Proxied {
    server: RedisServer,
    proxy: common::proxy::CuttingProxy,
    through_proxy: SidecarGuard,
    direct: SidecarGuard,
}

impl Proxied {
    /// Lets the proxied sidecar's pub/sub connection die without a word.
    fn silence_pubsub(&self) {
        assert_eq!(
            self.proxy.silence(b"SUBSCRIBE"),
            1,
            "one pub/sub connection through the proxy"
        );
    }

    async fn start() -> Self {
        let server = RedisServer::start().await;
        let proxy = common::proxy::CuttingProxy::start(server.port()).await;
        let through_proxy = SidecarBuilder::new(&format!("redis://127.0.0.1:{}", proxy.port()))
            .start()
            .await;
        let direct = sidecar(&server).await;
        Self {
            server,
            proxy,
            through_proxy,
            direct,
        }
    }
}

/// First pages of listings asked at once share the keyspace scans: one
/// under way, and one started after they all came (so each still shows
/// every key in use when it was asked). Each scanned the whole keyspace
/// of its own: the dashboard and `GET /v1/locks` need no token without an
/// API token, so a client asking many at once made Redis walk every key
/// (every fence counter ever written among them) once per request.
#[tokio::test]
async fn first_pages_asked_at_once_share_the_keyspace_scans() {
    const PAGES: usize = 24;
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let name = unique_name("listed");
    let held = sidecar.api().lock(&name).acquire(&[("ttl", "60s")]).await;
    // One scan alone: two SCAN patterns, one call each on a small keyspace.
    let before = server.command_counts().await;
    sidecar.api().list(&[]).await;
    let after = server.command_counts().await;
    let one = after["scan"] - before.get("scan").copied().unwrap_or(0);
    assert!(
        one >= 2,
        "a first page scans: {}",
        command_diff(&before, &after)
    );

    // Redis paused while the pages come, so that they all arrive while
    // the first scan is under way however slowly this machine serves
    // them (unpaused, a loaded machine spread them over three scans);
    // resumed well within a call's time limit (2 s).
    let before = server.command_counts().await;
    server.signal(Signal::SIGSTOP);
    let pages = tokio::spawn(futures::future::join_all((0..PAGES).map(|_| {
        let api = sidecar.api();
        async move { api.list(&[]).await }
    })));
    tokio::time::sleep(Duration::from_millis(700)).await;
    server.signal(Signal::SIGCONT);
    let pages = pages.await.expect("the pages");
    let after = server.command_counts().await;
    for page in &pages {
        assert!(
            page.locks.iter().any(|l| l.name == name),
            "every page shows the lock held when it was asked: {page:?}"
        );
    }
    let scans = after["scan"] - before.get("scan").copied().unwrap_or(0);
    assert!(
        scans <= 2 * one,
        "{PAGES} first pages at once ran {scans} SCAN calls, {one} a scan: {}",
        command_diff(&before, &after)
    );
    sidecar.api().lock(&name).release(&held.token).await;
}

/// First pages asked at once while Redis does not answer share the failed
/// scan too: each answers 503 within about one call's time limit, not one
/// after another (a scan at a time, each failing after its own limit, made
/// the last of them wait for all the others').
#[tokio::test]
async fn first_pages_asked_at_once_while_redis_hangs_all_fail_within_one_scans_time() {
    const PAGES: usize = 4;
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    sidecar.api().list(&[]).await;
    server.signal(Signal::SIGSTOP);
    let pages = async |n: usize| {
        let started = Instant::now();
        let answers = futures::future::join_all((0..n).map(|_| {
            let api = sidecar.api();
            async move { api.get(&["v1", "locks"], &[]).await.status() }
        }))
        .await;
        assert!(
            answers
                .iter()
                .all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
            "{answers:?}"
        );
        started.elapsed()
    };
    // One page alone, to time a failed scan here (the second: the first
    // also finds the connection gone).
    pages(1).await;
    let one = pages(1).await;
    let took = pages(PAGES).await;
    server.signal(Signal::SIGCONT);
    eprintln!("one page {one:?}, {PAGES} at once {took:?}");
    assert!(
        took < one * 2,
        "{PAGES} first pages at once took {took:?} to fail, one alone {one:?}"
    );
}

/// A waiter that leaves the queue (its wait ran out) after Redis handed it
/// the lock unheard (its sidecar's pub/sub connection silent), and whose owner meanwhile re-entered that lease
/// through another sidecar (count 2), gives back its own hold once, also
/// when the answer to that dequeue is lost after it ran: the owner keeps
/// its one hold. Such a dequeue was kept as abandoned and sent again with
/// the ticket's token, and its second run took the owner's hold: the lease
/// was deleted under it, and another owner got the lock (as on
/// PostgreSQL). An earlier version of this test passed all the same: the
/// dequeue script was not loaded yet, so the call it cut was refused
/// (`NOSCRIPT`) and never ran.
#[tokio::test]
async fn a_dequeue_whose_answer_is_lost_does_not_take_a_re_entered_hold() {
    let p = Proxied::start().await;
    let name = unique_name("leave-lost");
    let owner = unique_name("owner");
    let through = p.through_proxy.api().lock(&name);
    let lock = p.direct.api().lock(&name);
    // Loads the dequeue script too (a waiter that leaves), so that the cut
    // call is the dequeue itself: left unloaded, its first call was
    // refused (`NOSCRIPT`) and the cut lost that answer, not a run's.
    let warm = unique_name("warm");
    let held = p.direct.api().lock(&warm).acquire(&[]).await;
    let left = p
        .through_proxy
        .api()
        .lock(&warm)
        .acquire_raw(&[("wait", "100ms")])
        .await;
    assert_eq!(left.status(), StatusCode::CONFLICT);
    p.direct.api().lock(&warm).release(&held.token).await;
    // Loads the other scripts on the proxied connection.
    let (holder, waiter) = lost_answers::queue_behind_a_holder(&through, &lock, &owner, "3s").await;
    // Past the head's first look.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A queue entry is "<seq> <mode> <token> ...".
    let entry: String = p
        .server
        .cmd(&["LINDEX", &format!("{{sidelock:{name}}}:q"), "0"])
        .await;
    let ticket = entry
        .split(' ')
        .nth(2)
        .expect("the entry's token")
        .to_owned();
    p.silence_pubsub();
    lock.release(&holder.token).await;
    let again = lock.acquire(&[("owner", &owner), ("ttl", "60s")]).await;
    assert_eq!(
        (again.token.as_str(), again.count),
        (ticket.as_str(), 2),
        "the owner re-entered the lease handed to its waiter"
    );
    // Its leave, in RESP the dequeue script's entry then its token (which
    // no other call sends side by side), releases the handed hold (2 -> 1),
    // and its answer is lost.
    let dequeue = format!("{entry}\r\n${}\r\n{ticket}\r\n", ticket.len());
    p.proxy.cut_after(dequeue.as_bytes());
    let left = within("the waiter's answer", Duration::from_secs(10), waiter)
        .await
        .expect("the waiter's task");
    assert!(!left.status().is_success(), "{}", left.status());
    assert!(
        !p.proxy.armed(),
        "the waiter's dequeue went through the proxy"
    );
    // Past the retries (the core's pauses of 250 ms, 500 ms, ...; the
    // reconciling once the pub/sub connection is back, about 7 s).
    tokio::time::sleep(Duration::from_secs(12)).await;
    lost_answers::assert_holds_once(&lock, &owner, &again.token).await;
}

/// A lease given back at the `--max-held` cap whose answer is lost is not
/// released again (see
/// [`lost_answers::a_lease_given_back_at_the_cap_whose_answer_is_lost_is_not_released_again`]).
#[tokio::test]
async fn a_lease_given_back_at_the_cap_whose_answer_is_lost_is_not_released_again() {
    let server = RedisServer::start().await;
    let proxy = common::proxy::CuttingProxy::start(server.port()).await;
    let full = SidecarBuilder::new(&format!("redis://127.0.0.1:{}", proxy.port()))
        .flag("max-held", "1")
        .start()
        .await;
    let direct = sidecar(&server).await;
    lost_answers::a_lease_given_back_at_the_cap_whose_answer_is_lost_is_not_released_again(
        &proxy,
        &full,
        &direct,
        // A queue entry is "<seq> <mode> <token> ...".
        async |name: &str| -> String {
            let queue = format!("{{sidelock:{name}}}:q");
            let entry: String = server.cmd(&["LINDEX", &queue, "0"]).await;
            entry
                .split(' ')
                .nth(2)
                .expect("the entry's token")
                .to_owned()
        },
    )
    .await;
}

/// An acquire whose answer is lost after Redis granted it (a proxy resets
/// the connection under it) answers 503 — and the lease it made (an
/// exclusive or read lease, a semaphore permit), which nobody holds, is
/// released in the background: another owner gets the lock within seconds,
/// not when that lease's ttl ends.
#[tokio::test]
async fn a_lease_granted_while_its_answer_was_lost_is_released() {
    let p = Proxied::start().await;
    lost_answers::a_lost_grant_is_released(&p.proxy, &p.through_proxy, &p.direct).await;
}

/// The background release of a grant whose answer was lost takes that
/// grant's one hold, once. It released the token once more after the call
/// limit even when its first release had found the lease: the owner, who
/// had asked again and re-entered the lost grant (200, count 2), lost its
/// own hold — the lease was deleted under it and another owner got the lock.
#[tokio::test]
async fn a_lost_grant_its_owner_re_entered_is_released_once() {
    let p = Proxied::start().await;
    // Past the background release's rounds (the second one after 2 s).
    let rounds = Duration::from_secs(4);
    lost_answers::a_re_entered_lost_grant_is_released_once(
        &p.proxy,
        &p.through_proxy,
        &p.direct,
        rounds,
    )
    .await;
}

/// The background release of a grant whose answer was lost is not sent
/// again when its own answer is lost (it may have run): the owner, who had
/// asked again and re-entered the lost grant (count 2), keeps its one hold.
/// It was sent again after a pause, and its second run took the owner's
/// own hold — the lease was deleted under it and another owner got the
/// lock.
#[tokio::test]
async fn a_lost_grants_release_whose_answer_is_lost_is_not_sent_again() {
    let p = Proxied::start().await;
    lost_answers::a_lost_grants_release_whose_answer_is_lost_is_not_sent_again(
        &p.proxy,
        &p.through_proxy,
        &p.direct,
    )
    .await;
}

/// A join whose answer was lost, handed the lock and re-entered by its
/// owner, keeps the owner's hold: the background release of its token and
/// the give-back of the handoff do not both take the lost grant's hold.
#[tokio::test]
async fn a_lost_join_handed_the_lock_and_re_entered_holds_once() {
    let p = Proxied::start().await;
    lost_answers::a_lost_join_handed_the_lock_and_re_entered_holds_once(
        &p.proxy,
        &p.through_proxy,
        &p.direct,
    )
    .await;
}

/// A second lost join on the lock, handed the lock after the first's
/// release took its hold, is given back within seconds.
#[tokio::test]
async fn a_second_lost_join_handed_the_lock_is_given_back() {
    let p = Proxied::start().await;
    lost_answers::a_second_lost_join_handed_the_lock_is_given_back(
        &p.proxy,
        &p.through_proxy,
        &p.direct,
    )
    .await;
}

/// A join whose answer is lost after Redis queued it leaves a queue entry
/// nobody waits for; the release that hands the lock to that entry must
/// not leave a lease nobody holds until its ttl. (Passes since the handoff
/// to a ticket this sidecar never knew is given back; without that give-back
/// the next waiter is still refused after 20 s.)
#[tokio::test]
async fn a_lock_handed_to_a_join_whose_answer_was_lost_is_given_back() {
    let p = Proxied::start().await;
    lost_answers::a_lock_handed_to_a_join_whose_answer_was_lost_is_given_back(
        &p.proxy,
        &p.through_proxy,
        &p.direct,
        "60s",
        "20s",
    )
    .await;
}

/// A lock handed to a waiter while the waiter's subscription to the lock's
/// channel is still on its way reaches the waiter at once: the handoff comes
/// on its sidecar's own channel, which does not wait for that subscription.
/// It waited — the sidecar's pub/sub connection read nothing until Redis
/// confirmed the subscription, and the acquire looked for its handoff only
/// after — so a Redis round trip more came between a release and its grant
/// when a sidecar's one waiter (one client per pod) had just joined: here
/// the 1.5 s the proxy holds the `SUBSCRIBE` back.
#[tokio::test]
async fn a_handoff_reaches_a_waiter_whose_subscription_is_still_on_its_way() {
    let (status, took) = handed_while_subscribing(Duration::from_millis(1500)).await;
    assert_eq!(status, StatusCode::OK, "the waiter's answer");
    assert!(
        took < Duration::from_secs(1),
        "granted {took:?} after the release, with the subscription held back 1.5 s"
    );
}

/// A waiter handed the lock while its subscription is held back past the
/// call limit (2 s) is granted: it answered 503 — the subscription was not
/// confirmed in time — and gave the lock it had been handed back.
#[tokio::test]
async fn a_waiter_handed_the_lock_is_granted_though_its_subscription_is_late() {
    let (status, took) = handed_while_subscribing(Duration::from_secs(5)).await;
    assert_eq!(status, StatusCode::OK, "the waiter's answer after {took:?}");
}

/// A lock held through a sidecar straight on Redis, a waiter through a
/// sidecar behind a proxy that holds the waiter's `SUBSCRIBE` back by
/// `hold`, and the lock released once that `SUBSCRIBE` was sent: the
/// waiter's status and how long after the release it came.
async fn handed_while_subscribing(hold: Duration) -> (StatusCode, Duration) {
    let p = Proxied::start().await;
    let name = unique_name("sub-late");
    let holder = p.direct.api().lock(&name).acquire(&[("ttl", "60s")]).await;
    p.proxy
        .delay_request(format!("{name}}}:wake").as_bytes(), hold);
    let waiter = {
        let r = p.through_proxy.api().lock(&name);
        tokio::spawn(async move { r.acquire_raw(&[("wait", "30s"), ("ttl", "60s")]).await })
    };
    // A waiter subscribes once it has joined the queue: released at once
    // after (within the 2-s call limit of its subscription).
    eventually(
        "the waiter's subscription sent",
        Duration::from_secs(5),
        async || (!p.proxy.delaying()).then_some(()),
    )
    .await;
    let released = Instant::now();
    p.direct.api().lock(&name).release(&holder.token).await;
    let answer = waiter.await.expect("the waiter's task");
    (answer.status(), released.elapsed())
}

/// A pub/sub connection that dies without a word while a claim is queued
/// (a middlebox drops it, a cable is pulled: no reset, no close) is noticed
/// within seconds, opened again, and the claim granted what the release
/// handed it — an exclusive lock, a shared lease behind a writer, a
/// semaphore's permit with two in use. The handoff's message was lost with
/// the connection, and the waiter heard of its grant only at its retry
/// timer, the holder's expiry (60 s here).
#[tokio::test]
async fn a_pubsub_connection_dead_without_a_word_is_noticed_while_claims_wait() {
    for kind in ["lock", "shared", "semaphore of 2"] {
        let p = Proxied::start().await;
        let name = unique_name("sub-dead");
        let resource = |s: &SidecarGuard| match kind {
            "semaphore of 2" => s.api().semaphore(&name),
            _ => s.api().lock(&name),
        };
        let own: &[(&str, &str)] = match kind {
            "semaphore of 2" => &[("limit", "2")],
            "shared" => &[("mode", "shared")],
            _ => &[],
        };
        let holders = if kind == "semaphore of 2" { 2 } else { 1 };
        let mut held = Vec::new();
        for i in 0..holders {
            let owner = format!("holder-{i}");
            let mut params = vec![("owner", owner.as_str()), ("ttl", "60s")];
            params.extend(own.iter().filter(|(k, _)| *k == "limit"));
            held.push(resource(&p.direct).acquire(&params).await);
        }
        let mut params = vec![("owner", "waiter"), ("wait", "90s"), ("ttl", "60s")];
        params.extend(own);
        let mut waiter = resource(&p.through_proxy).hold(&params).await;
        waiter.expect_queued().await;
        p.silence_pubsub();
        let released = Instant::now();
        resource(&p.direct).release(&held[0].token).await;
        handed_within(&mut waiter, released, &format!("{kind}: ")).await;
    }
}

/// A waiter that leaves while its sidecar puts its passed-by entries back
/// (`rejoin.lua`, after its pub/sub connection came back) must not be put
/// back: its dequeue ran between the sidecar reading its entries and the
/// script, which queued it again — an entry nobody waits for, a release
/// then handed it the lock, and nobody took it or gave it back until its
/// ttl. Here 300 waiters, one per lock, leave together just as the pub/sub
/// connection, killed, has subscribed its channels again (the puts-back
/// follow); afterwards no queue holds an entry, and every lock is free the
/// moment its holder releases it.
#[tokio::test]
async fn a_waiter_leaving_as_its_entries_are_put_back_leaves_no_entry() {
    const LOCKS: usize = 300;
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let api = sidecar.api();
    let name = unique_name("rejoin-ghost");
    let names: Vec<String> = (0..LOCKS).map(|i| format!("{name}-{i}")).collect();
    let mut holders = Vec::new();
    for lock in &names {
        let lock = api.lock(lock);
        holders.push(lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await);
    }
    let subscriptions = async || -> usize {
        let list: String = server.cmd(&["CLIENT", "LIST", "TYPE", "pubsub"]).await;
        list.split([' ', '\n'])
            .filter_map(|field| field.strip_prefix("sub=")?.parse::<usize>().ok())
            .sum()
    };
    for round in 0..3 {
        let mut waiters = Vec::new();
        for lock in &names {
            let mut waiter = api
                .lock(lock)
                .hold(&[("owner", "waiter"), ("wait", "60s"), ("ttl", "60s")])
                .await;
            waiter.expect_queued().await;
            waiters.push(waiter);
        }
        // The own channel and one per lock.
        eventually(
            "every channel subscribed",
            Duration::from_secs(10),
            async || (subscriptions().await > LOCKS).then_some(()),
        )
        .await;
        let killed: i64 = server.cmd(&["CLIENT", "KILL", "TYPE", "pubsub"]).await;
        assert_eq!(killed, 1, "round {round}");
        // The channels are subscribed again one by one; the puts-back follow.
        within(
            "channels subscribed again",
            Duration::from_secs(10),
            async {
                while subscriptions().await + 8 <= LOCKS {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            },
        )
        .await;
        drop(waiters);
        // The puts-back and their clean-up.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    let mut ghosts = Vec::new();
    for lock in &names {
        let state = api.lock(lock).inspect().await;
        if !state.waiters.is_empty() {
            ghosts.push(lock.clone());
        }
    }
    let mut kept = Vec::new();
    for (lock, holder) in names.iter().zip(&holders) {
        let lock = api.lock(lock);
        lock.release(&holder.token).await;
        let taken = lock.acquire_raw(&[("owner", "next")]).await;
        if taken.status() != StatusCode::OK {
            kept.push(format!("{}: {}", lock.name(), taken.status()));
        }
    }
    assert!(
        ghosts.is_empty() && kept.is_empty(),
        "{} queues keep an entry nobody waits for (the first: {:?}); {} locks were not free \
         after their release (the first: {:?})",
        ghosts.len(),
        ghosts.first(),
        kept.len(),
        kept.first()
    );
}

/// Two waiters of a stopped sidecar (still counted alive) are each handed
/// the lock in turn — the first by the release, the second by the other
/// sidecar's heartbeat finding the lock free once the first's lease
/// lapsed — and both leases lapse unheard; a claim of the other sidecar
/// then holds the lock. When the stopped sidecar runs again, both its
/// waiters queue again at their places, ahead of a claim that queues
/// after that, and are granted in turn once that holder releases — the
/// second too, which was not the local head when its lapsed handoff came.
#[tokio::test]
async fn waiters_handed_lapsed_leases_while_stopped_keep_their_places() {
    let server = RedisServer::start().await;
    let (a, b) = (sidecar(&server).await, sidecar(&server).await);
    let name = unique_name("lapsed-handoffs");
    let holder = b
        .api()
        .lock(&name)
        .acquire(&[("owner", "holder"), ("ttl", "60s")])
        .await;
    let mut waiters = Vec::new();
    for (sidecar, owner, ttl) in [
        (&a, "first", "1s"),
        (&a, "second", "1s"),
        (&b, "third", "60s"),
    ] {
        let lock = sidecar.api().lock(&name);
        waiters.push(tokio::spawn(async move {
            lock.acquire(&[("owner", owner), ("ttl", ttl), ("wait", "30s")])
                .await
        }));
        let count = waiters.len();
        eventually("the waiter queued", Duration::from_secs(5), async || {
            (b.api().lock(&name).inspect().await.waiters.len() == count).then_some(())
        })
        .await;
    }
    let third = waiters.pop().expect("third");
    a.signal(Signal::SIGSTOP);
    b.api().lock(&name).release(&holder.token).await;
    // The first's lease lapses; the other sidecar's heartbeat (every 5 s)
    // hands the lock to the second, whose lease lapses too, and the third
    // takes it — all within the stopped sidecar's 15-s heartbeat life.
    let third = within("the third granted", Duration::from_secs(12), third)
        .await
        .expect("third");
    assert_eq!(third.owner, "third");
    a.signal(Signal::SIGCONT);
    // The resumed sidecar hears of its lapsed handoffs; then a claim
    // queues behind its waiters.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lock = b.api().lock(&name);
    waiters.push(tokio::spawn(async move {
        lock.acquire(&[("owner", "fourth"), ("ttl", "1s"), ("wait", "30s")])
            .await
    }));
    eventually("the fourth queued", Duration::from_secs(5), async || {
        let state = b.api().lock(&name).inspect().await;
        state
            .waiters
            .iter()
            .any(|w| w.owner == "fourth")
            .then_some(())
    })
    .await;
    b.api().lock(&name).release(&third.token).await;
    let mut grants = Vec::new();
    for waiter in waiters {
        grants.push(waiter.await.expect("waiter"));
    }
    let order: Vec<(&str, u64)> = grants.iter().map(|g| (g.owner.as_str(), g.fence)).collect();
    assert!(
        third.fence < grants[0].fence
            && grants.windows(2).all(|pair| pair[0].fence < pair[1].fence),
        "granted out of queue order after the third (fence {}): {order:?}",
        third.fence
    );
}

/// Awaits `waiter`'s grant after a release at `released`, within 20 s
/// (two 5-s checks of a pub/sub connection and a reconnect, with room;
/// a missed handoff's retry timer would be the holder's 60-s expiry).
async fn handed_within(waiter: &mut common::HoldStream, released: Instant, what: &str) {
    let grant = waiter.expect_acquired_within(Duration::from_secs(80)).await;
    assert_eq!(grant.owner, "waiter");
    eprintln!(
        "{what}the waiter was handed the lock {:?} after the release",
        released.elapsed()
    );
    assert!(
        released.elapsed() < Duration::from_secs(20),
        "{what}the waiter was handed the lock {:?} after the release",
        released.elapsed()
    );
}

/// A Sentinel failover one sidecar (`stayed`, returned) sees only half of:
/// the sentinel is cut off from the master behind the proxy (its
/// connections reset, new ones refused; clients' connections stay) and
/// promotes the replica; then the sidecar's connections of `kind` (`CLIENT
/// KILL TYPE`: `normal` for commands, `pubsub`) to the old master break,
/// and are made again on the master the sentinel names, while the others
/// stay on the old one. (So no name the test sends says "sentinel".)
async fn sentinel_split(
    kind: &str,
) -> (
    common::redis::RedisSentinel,
    common::proxy::CuttingProxy,
    SidecarGuard,
) {
    let (servers, proxy) = common::redis::RedisSentinel::start_proxied().await;
    let stayed = SidecarBuilder::new(&servers.url())
        .sidecar_id("stayed")
        .start()
        .await;
    proxy.refuse(b"sentinel", 1_000_000);
    proxy.silence(b"sentinel");
    common::eventually(
        "the sentinel promotes the replica",
        Duration::from_secs(30),
        async || (servers.master_port().await == Some(servers.replica.port())).then_some(()),
    )
    .await;
    let killed: i64 = servers.master.cmd(&["CLIENT", "KILL", "TYPE", kind]).await;
    assert!(
        killed > 0,
        "the sidecar's {kind} connections to the old master"
    );
    (servers, proxy, stayed)
}

/// Sentinel, the other way round: a sidecar whose pub/sub connection was
/// made again after a failover, on the new master, while its commands
/// still reach the old one (cut off from the sentinel, still answering).
/// Its probes, published on the old master, go unheard on the new one: the
/// pub/sub connection was made again every 10 s, back to the same new
/// master, while its commands stayed, for as long as the split lasted. An
/// unheard probe now has its commands ask the sentinel again too: they
/// reach the new master, where its waiter is granted (the old master's
/// lease is the split's, as the README's Sentinel section says).
#[tokio::test]
async fn a_sentinel_sidecar_whose_pubsub_moved_first_moves_its_commands_too() {
    let (servers, _proxy, stayed) = sentinel_split("pubsub").await;
    let name = unique_name("drift-back");
    let lock = stayed.api().lock(&name);
    let _holder = lock.acquire(&[("ttl", "60s"), ("owner", "holder")]).await;
    let mut waiter = lock.hold(&[("wait", "80s"), ("owner", "waiter")]).await;
    waiter.expect_queued().await;
    let asked = Instant::now();
    let grant = waiter.expect_acquired_within(Duration::from_secs(80)).await;
    assert!(
        asked.elapsed() < Duration::from_secs(25),
        "the waiter was granted {:?} after it queued: the commands stayed on the old master",
        asked.elapsed()
    );
    let fresh = SidecarBuilder::new(&servers.url())
        .sidecar_id("fresh")
        .start()
        .await;
    let state = fresh.api().lock(&name).inspect().await;
    assert_eq!(state.holders.len(), 1, "{state:?}");
    assert_eq!(state.holders[0].fence, grant.fence, "{state:?}");
}

/// Sentinel: a sidecar whose commands followed a failover to the new
/// master while its pub/sub connection stayed on the old one (cut off from
/// the sentinel, still answering: every `PING` passes) hears none of the
/// releases published on the new master. While it has claims queued it
/// publishes a probe to itself through the master its commands reach, and
/// one never heard moves its pub/sub connection to that master: the
/// waiter is handed the lock seconds after the release, not at the
/// previous holder's expiry (60 s).
#[tokio::test]
async fn a_sentinel_pubsub_connection_left_on_the_old_master_moves_to_the_new_one() {
    // Its commands' connections break (its pub/sub one does not): the
    // sidecar asks the sentinel again, and its commands go to the new master.
    let (servers, _proxy, stayed) = sentinel_split("normal").await;
    let moved = SidecarBuilder::new(&servers.url())
        .sidecar_id("moved")
        .start()
        .await;
    let name = unique_name("drift");
    let probe = unique_name("drift-moved");
    common::eventually(
        "the sidecar's commands reach the new master",
        Duration::from_secs(20),
        async || {
            let r = stayed.api().lock(&probe).acquire_raw(&[]).await;
            if r.status() != StatusCode::OK {
                return None;
            }
            let g: common::Grant = r.json().await.expect("grant");
            let seen = moved.api().lock(&probe).inspect().await.holders.len() == 1;
            stayed.api().lock(&probe).release(&g.token).await;
            seen.then_some(())
        },
    )
    .await;
    let holder = moved
        .api()
        .lock(&name)
        .acquire(&[("ttl", "60s"), ("owner", "holder")])
        .await;
    let mut waiter = stayed
        .api()
        .lock(&name)
        .hold(&[("wait", "80s"), ("owner", "waiter")])
        .await;
    waiter.expect_queued().await;
    moved.api().lock(&name).wait_for_waiters(&["waiter"]).await;
    moved.api().lock(&name).release(&holder.token).await;
    handed_within(&mut waiter, Instant::now(), "").await;
}

/// A pub/sub connection that died without a word while its sidecar had
/// nobody waiting (no `PING` goes then) costs the next first waiter
/// nothing: its `SUBSCRIBE` goes unanswered, the connection is opened again
/// and the subscription asked once more there. It answered 503 while Redis
/// was up.
#[tokio::test]
async fn a_first_waiter_after_an_idle_pubsub_connection_died_is_not_refused() {
    let p = Proxied::start().await;
    let name = unique_name("sub-idle-dead");
    let holder = p
        .direct
        .api()
        .lock(&name)
        .acquire(&[("owner", "holder"), ("ttl", "60s")])
        .await;
    p.silence_pubsub();
    let waiter = {
        let lock = p.through_proxy.api().lock(&name);
        tokio::spawn(async move {
            lock.acquire_raw(&[("owner", "waiter"), ("wait", "30s"), ("ttl", "60s")])
                .await
        })
    };
    // Past the unanswered subscription's limit, and the connection made anew.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let released = Instant::now();
    p.direct.api().lock(&name).release(&holder.token).await;
    let answer = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter answered")
        .expect("the waiter's task");
    assert_eq!(
        answer.status(),
        StatusCode::OK,
        "the waiter's answer, {:?} after the release: {}",
        released.elapsed(),
        answer.text().await.unwrap_or_default()
    );
}

/// A Redis user without rights to the channels (Redis 7's default for a
/// new user) has every subscription refused: the sidecar opens its pub/sub
/// connection again with a growing pause, not in a tight loop (it made
/// connections as fast as Redis took them), and its waiters answer 503
/// naming the refusal.
#[tokio::test]
async fn a_user_refused_the_channels_is_not_reconnected_in_a_tight_loop() {
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&without_channels(&server).await)
        .start()
        .await;
    let connections = async || -> u64 {
        let info: String = server.cmd(&["INFO", "stats"]).await;
        info.lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .and_then(|n| n.trim().parse().ok())
            .expect("total_connections_received in INFO stats")
    };
    let before = connections().await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let made = connections().await - before;
    assert!(
        made <= 8,
        "{made} connections in 4 s from a sidecar whose subscriptions are refused"
    );
    let name = unique_name("no-channels");
    let lock = sidecar.api().lock(&name);
    let holder = lock.acquire(&[("owner", "holder")]).await;
    let waiter = lock
        .acquire_raw(&[("owner", "waiter"), ("wait", "10s")])
        .await;
    assert_refused_the_channels(waiter).await;
    lock.release(&holder.token).await;
}

/// The URL of a new user of `server` without rights to any channel.
async fn without_channels(server: &RedisServer) -> String {
    let _: String = server
        .cmd(&[
            "ACL",
            "SETUSER",
            "nochannels",
            "on",
            ">secret",
            "~*",
            "+@all",
            "resetchannels",
        ])
        .await;
    format!("redis://nochannels:secret@127.0.0.1:{}", server.port())
}

/// Asserts a waiter's 503 naming the channels' refusal, without the password.
async fn assert_refused_the_channels(waiter: reqwest::Response) {
    // The refusal is named (it answered "connection lost", the cause
    // only in the log).
    let problem = common::problem::assert_problem(
        waiter,
        StatusCode::SERVICE_UNAVAILABLE,
        "backend-unavailable",
    )
    .await;
    assert_eq!(problem["cause"], "permission denied", "{problem}");
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("permission denied"), "{problem}");
    assert!(!detail.contains("secret"), "{problem}");
}

/// Every waiter of a lock whose channel Redis refuses is told, not only
/// the first: a second waiter that came while the first's subscription was
/// under way was let in as subscribed and waited out its `wait` (409),
/// never woken by the release it could not hear.
#[tokio::test]
async fn every_waiter_of_a_refused_channel_hears_the_refusal() {
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&without_channels(&server).await)
        .start()
        .await;
    let lock = sidecar.api().lock(&unique_name("no-channels-two"));
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    let params = [("owner", "waiter"), ("wait", "10s")];
    let first = lock.spawn_acquire_raw(&params);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = lock.spawn_acquire_raw(&params);
    assert_refused_the_channels(first.await.expect("the first waiter")).await;
    assert_refused_the_channels(second.await.expect("the second waiter")).await;
    lock.release(&holder.token).await;
}

/// A waiter that came while another's subscription of the same channel
/// was under way waits for it; when that other waiter's subscription is
/// given up unfinished (held up by the proxy, its hold stream closed, and
/// the release handing it the lock, which ends its wait), the waiter left
/// subscribes itself, is woken on the lock's channel and is granted well
/// within its wait. (Waiting forever there instead fails this test.)
#[tokio::test]
async fn a_waiter_whose_subscriber_went_subscribes_itself() {
    let p = Proxied::start().await;
    let name = unique_name("sub-went");
    let holder = p.direct.api().lock(&name).acquire(&[("ttl", "60s")]).await;
    p.proxy.delay_request(
        format!("{name}}}:wake").as_bytes(),
        Duration::from_secs(3600),
    );
    let lock = p.through_proxy.api().lock(&name);
    let params = [("wait", "30s"), ("ttl", "60s")];
    let first = lock.hold(&params).await;
    eventually(
        "the first waiter's subscription sent",
        Duration::from_secs(5),
        async || (!p.proxy.delaying()).then_some(()),
    )
    .await;
    // Shared: woken on the lock's channel, not handed the lock on the
    // sidecar's own.
    let second = lock.spawn_acquire_raw(&[("wait", "30s"), ("ttl", "60s"), ("mode", "shared")]);
    let direct = p.direct.api().lock(&name);
    eventually("both waiters queued", Duration::from_secs(5), async || {
        (direct.inspect().await.waiters.len() == 2).then_some(())
    })
    .await;
    drop(first);
    let released = Instant::now();
    direct.release(&holder.token).await;
    let answer = tokio::time::timeout(Duration::from_secs(20), second)
        .await
        .expect("the second waiter answered")
        .expect("the second waiter's task");
    assert_eq!(
        answer.status(),
        StatusCode::OK,
        "the second waiter's answer, {:?} after the release: {}",
        released.elapsed(),
        answer.text().await.unwrap_or_default()
    );
    assert!(
        released.elapsed() < Duration::from_secs(10),
        "granted {:?} after the release",
        released.elapsed()
    );
}

/// A `SUBSCRIBE` that Redis never answers (its connection silently dead:
/// the proxy holds it and all that follows on that connection for an
/// hour) costs only the waiter it was for. The sidecar's subscriptions
/// went one after another, each waiting for its answer without a limit:
/// every later first waiter of a lock answered 503 after 2 s, for as long
/// as that connection lived. Now a subscription unanswered within the call
/// limit makes the sidecar open its pub/sub connection again, where the
/// subscription is asked once more.
#[tokio::test]
async fn a_subscription_never_answered_does_not_hold_up_the_next_ones() {
    let p = Proxied::start().await;
    let stuck = unique_name("sub-stuck");
    let next = unique_name("sub-next");
    let held = [
        p.direct.api().lock(&stuck).acquire(&[("ttl", "60s")]).await,
        p.direct.api().lock(&next).acquire(&[("ttl", "60s")]).await,
    ];
    p.proxy.delay_request(
        format!("{stuck}}}:wake").as_bytes(),
        Duration::from_secs(3600),
    );
    let first = {
        let r = p.through_proxy.api().lock(&stuck);
        tokio::spawn(async move { r.acquire_raw(&[("wait", "30s"), ("ttl", "60s")]).await })
    };
    eventually(
        "the first waiter's subscription sent",
        Duration::from_secs(5),
        async || (!p.proxy.delaying()).then_some(()),
    )
    .await;
    let waiter = {
        let r = p.through_proxy.api().lock(&next);
        tokio::spawn(async move { r.acquire_raw(&[("wait", "30s"), ("ttl", "60s")]).await })
    };
    // Queued behind the holder, its subscription asked for.
    let lock = p.direct.api().lock(&next);
    eventually(
        "the next waiter queued",
        Duration::from_secs(5),
        async || (lock.inspect().await.waiters.len() == 1).then_some(()),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let released = Instant::now();
    p.direct.api().lock(&next).release(&held[1].token).await;
    let answer = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the next waiter answered")
        .expect("the waiter's task");
    assert_eq!(
        answer.status(),
        StatusCode::OK,
        "the next waiter's answer, {:?} after the release: {}",
        released.elapsed(),
        answer.text().await.unwrap_or_default()
    );
    // The first waiter is granted too once its lock is released: its
    // subscription was asked again on the new connection.
    p.direct.api().lock(&stuck).release(&held[0].token).await;
    let answer = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the first waiter answered")
        .expect("the waiter's task");
    assert_eq!(
        answer.status(),
        StatusCode::OK,
        "the first waiter's answer: {}",
        answer.text().await.unwrap_or_default()
    );
}

/// A lock passed back and forth between two sidecars, one waiter at a time
/// on each (one client per pod), subscribes each sidecar to the lock's
/// channel once, not once per wait: a subscription stays a few seconds
/// after its last waiter leaves, and then goes. Before, each wait sent a
/// `SUBSCRIBE` and each grant an `UNSUBSCRIBE` (16 for 8 handoffs), and the
/// two sidecars were never subscribed at once.
#[tokio::test]
async fn a_lock_passed_between_sidecars_keeps_their_subscriptions_a_while() {
    let server = RedisServer::start().await;
    let sides = [sidecar(&server).await, sidecar(&server).await];
    let name = unique_name("linger");
    let pattern = format!("*{name}*");
    // Sidecars subscribed to the lock's channel.
    let subscribed = async || -> i64 {
        let channels: Vec<String> = server.cmd(&["PUBSUB", "CHANNELS", &pattern]).await;
        let Some(channel) = channels.first() else {
            return 0;
        };
        let counts: (String, i64) = server.cmd(&["PUBSUB", "NUMSUB", channel]).await;
        counts.1
    };
    let mut held = sides[0].api().lock(&name).acquire(&[("ttl", "60s")]).await;
    let mut before = None;
    for round in 0..10 {
        if round == 2 {
            // Both have waited once: from here on, nobody subscribes.
            before = Some(server.command_counts().await);
        }
        let (holder, next) = (&sides[round % 2], &sides[(round + 1) % 2]);
        let waiter = {
            let r = next.api().lock(&name);
            tokio::spawn(async move { r.acquire(&[("wait", "10s"), ("ttl", "60s")]).await })
        };
        // The waiter's subscription in place before the release (a lock
        // handed over before it is confirmed does not keep it).
        let expected = round.min(1) as i64 + 1;
        eventually(
            "the waiter subscribed",
            Duration::from_secs(5),
            async || (subscribed().await == expected).then_some(()),
        )
        .await;
        let view = holder.api().lock(&name);
        eventually("the waiter queued", Duration::from_secs(5), async || {
            (view.inspect().await.waiters.len() == 1).then_some(())
        })
        .await;
        view.release(&held.token).await;
        held = waiter.await.expect("the waiter's task");
    }
    let before = before.expect("counted from the third round");
    let after = server.command_counts().await;
    let ran = |c: &str| after.get(c).unwrap_or(&0) - before.get(c).unwrap_or(&0);
    // Two to spare for the sidecars' own start-up (the monitor election).
    assert!(
        ran("subscribe") + ran("unsubscribe") <= 2,
        "8 handoffs between two sidecars subscribed to the lock: {}",
        command_diff(&before, &after)
    );
    sides[0].api().lock(&name).release(&held.token).await;
    eventually(
        "the lock's channel unsubscribed",
        Duration::from_secs(15),
        async || (subscribed().await == 0).then_some(()),
    )
    .await;
}

/// A lock (`kind` "shared": its waiter a reader) or a semaphore of one
/// permit ("semaphore") or of two ("semaphore of 2": the other permit kept
/// by another owner throughout) held through a sidecar straight on Redis,
/// and a waiter queued through a sidecar behind a proxy.
struct Blocked {
    server: RedisServer,
    proxy: common::proxy::CuttingProxy,
    through_proxy: SidecarGuard,
    direct: SidecarGuard,
    kind: &'static str,
    name: String,
    /// The waiter's owner, in every call its sidecar makes for it.
    owner: String,
    blocker: common::api::Grant,
    /// The waiter's acquire, until a test awaits it.
    waiter: Option<tokio::task::JoinHandle<reqwest::Response>>,
}

impl Blocked {
    async fn start(kind: &'static str) -> Self {
        let Proxied {
            server,
            proxy,
            through_proxy,
            direct,
        } = Proxied::start().await;
        let (name, owner) = (unique_name("blocked"), unique_name("waiter"));
        // The permit, or an exclusive lease before the reader; of two
        // permits, the other one is kept throughout.
        // An exclusive waiter looks only when the lease ends by itself (a
        // release hands it the lock instead).
        let ttl = match kind {
            "exclusive behind a short lease" => "1s",
            _ => "60s",
        };
        let mut params = vec![("owner", "holder"), ("ttl", ttl)];
        params.extend(Self::param_of(kind));
        if kind == "semaphore of 2" {
            let mut keeper = vec![("owner", "keeper"), ("ttl", "60s")];
            keeper.extend(Self::param_of(kind));
            Self::resource_of(kind, &name, &direct)
                .acquire(&keeper)
                .await;
        }
        let blocker = Self::resource_of(kind, &name, &direct)
            .acquire(&params)
            .await;
        let waiter = {
            let r = Self::resource_of(kind, &name, &through_proxy);
            let owner = owner.clone();
            let param = match kind {
                "exclusive behind a short lease" => ("mode", "exclusive"),
                _ => Self::param_of(kind).unwrap_or(("mode", "shared")),
            };
            tokio::spawn(async move {
                r.acquire_raw(&[param, ("owner", &owner), ("wait", "30s"), ("ttl", "60s")])
                    .await
            })
        };
        let view = Self::resource_of(kind, &name, &direct);
        common::eventually("the waiter queued", Duration::from_secs(5), async || {
            (view.inspect().await.waiters.len() == 1).then_some(())
        })
        .await;
        Self {
            server,
            proxy,
            through_proxy,
            direct,
            kind,
            name,
            owner,
            blocker,
            waiter: Some(waiter),
        }
    }

    fn resource_of(kind: &str, name: &str, s: &SidecarGuard) -> common::api::Resource {
        if kind.starts_with("semaphore") {
            s.api().semaphore(name)
        } else {
            s.api().lock(name)
        }
    }

    /// The blocker's and the next claim's own parameter.
    fn param_of(kind: &str) -> Option<(&'static str, &'static str)> {
        match kind {
            "semaphore" => Some(("limit", "1")),
            "semaphore of 2" => Some(("limit", "2")),
            _ => None,
        }
    }

    fn resource(&self, s: &SidecarGuard) -> common::api::Resource {
        Self::resource_of(self.kind, &self.name, s)
    }

    fn param(&self) -> Option<(&'static str, &'static str)> {
        Self::param_of(self.kind)
    }

    /// The waiter's answer, once its attempt went through the armed proxy.
    async fn waiter_answer(&mut self) -> reqwest::Response {
        let answer = within(
            "the waiter's answer",
            Duration::from_secs(20),
            self.waiter.take().expect("the waiter"),
        )
        .await
        .expect("the waiter's task");
        assert!(
            !self.proxy.armed(),
            "{}: the waiter's attempt went through the proxy",
            self.kind
        );
        answer
    }

    /// Another claim (a writer, or the permit left) gets in within `wait`.
    async fn next_gets_in(&self, wait: &str, why: &str) {
        let started = Instant::now();
        let mut params = vec![("owner", "next"), ("wait", wait)];
        params.extend(self.param());
        let next = self.resource(&self.direct).acquire_raw(&params).await;
        assert_eq!(
            next.status(),
            StatusCode::OK,
            "{}: {why} after {:?}: {:?}",
            self.kind,
            started.elapsed(),
            self.resource(&self.direct).inspect().await
        );
    }

    /// The lock's queue, as Redis holds it.
    async fn queue(&self) -> Vec<String> {
        let queue = format!("{{{}}}:q", self.main());
        self.server.cmd(&["LRANGE", &queue, "0", "-1"]).await
    }

    /// The lock's main key.
    fn main(&self) -> String {
        if self.kind.starts_with("semaphore") {
            format!("sidelock:semaphores/{}", self.name)
        } else {
            format!("sidelock:{}", self.name)
        }
    }
}

/// A waiter whose queued attempt was granted while its answer timed out
/// (503: the waiter goes) leaves no shared lease or semaphore permit
/// behind. Leaving the queue gave back only an exclusive lease its token
/// held: the permit or read lease stayed until its ttl, and everyone else
/// waited for it.
#[tokio::test]
async fn a_shared_or_semaphore_grant_whose_answer_was_lost_is_given_back() {
    for kind in ["semaphore", "semaphore of 2", "shared"] {
        let mut b = Blocked::start(kind).await;
        // Its attempt after the release is granted; the answer never comes
        // (the connection is reset only after the call's 2 s limit).
        b.proxy
            .cut_later(b.owner.as_bytes(), Duration::from_secs(3));
        b.resource(&b.direct).release(&b.blocker.token).await;
        let lost = b.waiter_answer().await;
        assert_eq!(
            lost.status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "{kind}: the waiter's answer was lost"
        );
        b.next_gets_in("15s", "the lost grant still blocks").await;
    }
}

/// A waiter whose attempt loses its connection (reset after Redis ran it:
/// the grant's answer lost) keeps waiting: the attempt runs once more on a
/// new connection, and that run answers the grant the first one made — one
/// hold (count 1), one permit — rather than a re-entry or a place in the
/// queue again. The waiter answered 503, although it had seconds of its
/// wait left and Redis was there; in a Cluster, a broken connection of
/// another call's did the same to a waiter woken just then.
#[tokio::test]
async fn a_waiter_whose_attempt_loses_its_connection_keeps_waiting_and_holds_once() {
    for kind in [
        "exclusive behind a short lease",
        "semaphore",
        "semaphore of 2",
        "shared",
    ] {
        let mut b = Blocked::start(kind).await;
        b.proxy.cut_after(b.owner.as_bytes());
        if kind != "exclusive behind a short lease" {
            b.resource(&b.direct).release(&b.blocker.token).await;
        }
        let answer = b.waiter_answer().await;
        assert_eq!(
            answer.status(),
            StatusCode::OK,
            "{kind}: the waiter's answer"
        );
        let grant: common::api::Grant = common::api::expect_json(answer, StatusCode::OK).await;
        assert_eq!(grant.count, 1, "{kind}: the waiter holds once");
        assert!(grant.fence > b.blocker.fence, "{kind}: {grant:?}");
        b.resource(&b.through_proxy).release(&grant.token).await;
        let queue = b.queue().await;
        assert!(queue.is_empty(), "{kind}: left in the queue: {queue:?}");
        // Its one hold released, a writer (or the last permit) gets in.
        b.next_gets_in("5s", "still held after its release").await;
    }
}

/// A waiter's attempt that re-entered its owner's lease (a second reader
/// of the same owner, woken once the first was granted) and lost its
/// connection is not run again into a second re-entry: the re-entry
/// answers under the lease's token, so a run again cannot find it, and it
/// re-entered once more — count 3 for two requests, a hold nobody knew of.
#[tokio::test]
async fn a_re_entry_whose_connection_broke_is_not_made_twice() {
    let Proxied {
        server,
        proxy,
        through_proxy,
        direct,
    } = Proxied::start().await;
    let name = unique_name("re-entry-cut");
    let owner = unique_name("reader");
    let blocker = direct
        .api()
        .lock(&name)
        .acquire(&[("owner", "writer"), ("ttl", "60s")])
        .await;
    let view = direct.api().lock(&name);
    let mut readers = Vec::new();
    for queued in 1..=2 {
        let lock = through_proxy.api().lock(&name);
        let owner = owner.clone();
        readers.push(tokio::spawn(async move {
            lock.acquire_raw(&[
                ("mode", "shared"),
                ("owner", &owner),
                ("wait", "30s"),
                ("ttl", "60s"),
            ])
            .await
        }));
        eventually("the reader queued", Duration::from_secs(5), async || {
            (view.inspect().await.waiters.len() == queued).then_some(())
        })
        .await;
    }
    // The second reader's entry: `<seq> <mode> <token> …`.
    let queue: Vec<String> = server
        .cmd(&["LRANGE", &format!("{{sidelock:{name}}}:q"), "0", "-1"])
        .await;
    let second = queue[1].split(' ').nth(2).expect("a token").to_owned();
    // Past the readers' first looks.
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.cut_after(second.as_bytes());
    view.release(&blocker.token).await;
    let mut answers = Vec::new();
    for reader in readers {
        let answer = within("a reader's answer", Duration::from_secs(20), reader)
            .await
            .expect("the reader's task");
        answers.push(answer.status());
    }
    assert!(
        !proxy.armed(),
        "the second reader's look went through the proxy"
    );
    let holders = view.inspect().await.holders;
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert!(
        holders[0].count <= 2,
        "two requests made {} holds ({answers:?})",
        holders[0].count
    );
}

/// A claim granted while its sidecar queues its claims again (`p` on the
/// lock's channel: a release passed some by) is not put back in the queue.
/// Queueing again skipped only a claim holding the exclusive lease: a
/// semaphore permit or read lease granted whose answer was still on its way
/// went back in the queue as well, where it held a place that nobody would
/// ever take (its sidecar's heartbeats for other waiters kept it alive).
#[tokio::test]
async fn a_claim_granted_while_its_sidecar_queues_again_stays_out_of_the_queue() {
    for kind in ["semaphore", "semaphore of 2", "shared"] {
        let mut b = Blocked::start(kind).await;
        // The waiter's attempt after the release is granted; its answer
        // comes a second late, and meanwhile its sidecar queues again.
        b.proxy
            .hold_answer_after(b.owner.as_bytes(), Duration::from_secs(1));
        b.resource(&b.direct).release(&b.blocker.token).await;
        let view = b.resource(&b.direct);
        common::eventually("the waiter's grant", Duration::from_secs(5), async || {
            let holders = view.inspect().await.holders;
            holders.iter().any(|h| h.owner == b.owner).then_some(())
        })
        .await;
        let main = b.main();
        let _: i64 = b
            .server
            .cmd(&["PUBLISH", &format!("{{{main}}}:wake"), "p"])
            .await;
        let answer = within(
            "the waiter's answer",
            Duration::from_secs(10),
            b.waiter.take().expect("the waiter"),
        )
        .await
        .expect("the waiter's task");
        let grant: common::api::Grant = common::api::expect_json(answer, StatusCode::OK).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let queue = b.queue().await;
        assert!(
            queue.is_empty(),
            "{kind}: the granted claim went back in the queue: {queue:?}"
        );
        b.resource(&b.through_proxy).release(&grant.token).await;
    }
}

/// A waiter that stops waiting while its sidecar cannot reach Redis (its
/// leaving never arrives) leaves no lease behind: a release that hands the
/// lock to its claim, still queued, has the lease given back at once. The
/// sidecar took the ticket for gone: the lock went to nobody's claim, and
/// everyone waited for that lease's ttl.
#[tokio::test]
async fn a_lock_handed_to_a_waiter_whose_leaving_was_lost_is_given_back() {
    let Proxied {
        server: _server,
        proxy,
        through_proxy,
        direct,
    } = Proxied::start().await;
    let name = unique_name("left");
    let owner = unique_name("waiter");
    let lock = direct.api().lock(&name);
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    let waiter = {
        let lock = through_proxy.api().lock(&name);
        let owner = owner.clone();
        tokio::spawn(async move {
            lock.acquire_raw(&[("owner", &owner), ("wait", "2s"), ("ttl", "60s")])
                .await
        })
    };
    common::eventually("the waiter queued", Duration::from_secs(5), async || {
        (lock.inspect().await.waiters.len() == 1).then_some(())
    })
    .await;
    // Its last attempt, as its wait ends, and its leaving are lost on the
    // way (the sidecar's next heartbeat tick would drop the claim).
    proxy.refuse(owner.as_bytes(), 2);
    let gone = within("the waiter's answer", Duration::from_secs(10), waiter)
        .await
        .expect("the waiter's task");
    assert!(!gone.status().is_success(), "{}", gone.status());
    proxy.refuse(b"", 0);
    // The release hands the lock to that claim, unless it is gone.
    lock.release(&holder.token).await;
    let started = Instant::now();
    let next = lock
        .acquire_raw(&[("owner", "next"), ("wait", "15s")])
        .await;
    assert_eq!(
        next.status(),
        StatusCode::OK,
        "the lock went to the claim that left; still blocked after {:?}: {:?}",
        started.elapsed(),
        lock.inspect().await
    );
}

/// A slot moving between Cluster masters while its lock is held and waited
/// for never lets a script run on part of the lock's keys, and once it has
/// moved the lock answers at once. `MIGRATE` moves keys one at a time: with
/// the fence counter already on the new master, the old one (which still
/// had the lease and the queue) ran the release told of the main key only,
/// took the waiter out of the queue and stopped at the fence counter it no
/// longer had (Redis 7 checks each key a script touches; a server that did
/// not would have counted fences from 1 again): the waiter was lost from the
/// queue. Now nothing runs until the slot has moved (503), and the first
/// call after it, answered MOVED, is sent again rather than answered 503.
#[tokio::test]
async fn a_lock_whose_slot_is_moving_keeps_its_fences_increasing() {
    let cluster = common::redis::RedisCluster::start().await;
    let sidecar = SidecarBuilder::new(&cluster.url()).start().await;
    let name = unique_name("moving");
    let lock = sidecar.api().lock(&name);
    for _ in 0..3 {
        let g = lock.acquire(&[]).await;
        lock.release(&g.token).await;
    }
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    let waiter = queue_waiter(&sidecar, &name, "60s").await;

    let main = format!("sidelock:{name}");
    let slot: i64 = cluster.nodes[0].cmd(&["CLUSTER", "KEYSLOT", &main]).await;
    let slot = slot.to_string();
    let mut source = None;
    for (i, node) in cluster.nodes.iter().enumerate() {
        let keys: i64 = node.cmd(&["CLUSTER", "COUNTKEYSINSLOT", &slot]).await;
        if keys > 0 {
            source = Some(i);
        }
    }
    let source = source.expect("the master that has the lock's keys");
    let target = (source + 1) % cluster.nodes.len();
    let (from, to) = (&cluster.nodes[source], &cluster.nodes[target]);
    let from_id: String = from.cmd(&["CLUSTER", "MYID"]).await;
    let to_id: String = to.cmd(&["CLUSTER", "MYID"]).await;
    let to_port = to.port().to_string();
    let _: String = to
        .cmd(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id])
        .await;
    let _: String = from
        .cmd(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id])
        .await;
    // The fence counter goes first, as it may in `redis-cli --cluster reshard`.
    let fence_key = format!("{{{main}}}:fence");
    let moved: String = from
        .cmd(&["MIGRATE", "127.0.0.1", &to_port, &fence_key, "0", "5000"])
        .await;
    assert_eq!(moved, "OK");

    let released = lock.release_raw(&holder.token).await;
    if released.status().is_success() {
        let grant = within("the waiter's grant", Duration::from_secs(10), waiter)
            .await
            .expect("the waiter's task");
        panic!(
            "a release ran on a master that had part of the lock's keys: the waiter got fence {} after the holder's {}",
            grant.fence, holder.fence
        );
    }
    assert_eq!(released.status(), StatusCode::SERVICE_UNAVAILABLE);

    // The rest of the slot moves, and the slot is the new master's.
    let keys: Vec<String> = from.cmd(&["CLUSTER", "GETKEYSINSLOT", &slot, "100"]).await;
    for key in &keys {
        let moved: String = from
            .cmd(&["MIGRATE", "127.0.0.1", &to_port, key, "0", "5000"])
            .await;
        assert_eq!(moved, "OK", "{key}");
    }
    for node in &cluster.nodes {
        let _: String = node
            .cmd(&["CLUSTER", "SETSLOT", &slot, "NODE", &to_id])
            .await;
    }
    let state = lock.inspect().await;
    assert_eq!(
        (state.holders.len(), state.waiters.len()),
        (1, 1),
        "the holder and its waiter after the move: {state:?}"
    );
    let released = lock.release(&holder.token).await;
    assert_eq!(released.count, 0);
    let grant = within("the waiter's grant", Duration::from_secs(10), waiter)
        .await
        .expect("the waiter's task");
    assert!(
        grant.fence > holder.fence,
        "the waiter's fence {} is not above the holder's {}",
        grant.fence,
        holder.fence
    );
    lock.release(&grant.token).await;
}

/// The wall clock in ms, as the sidecar reports times.
fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

/// A lease's `expires_at_ms` is never later than its end in Redis, however
/// slowly answers come back. The sidecar took the server's clock off a
/// reply as the reply arrived: with answers held back 300 ms it told its
/// client that the lease ran 300 ms longer than it did (a client that stops
/// writing at its expiry wrote on after another was granted). An expiry is
/// now read with the server's clock as of the call's sending.
#[tokio::test]
async fn a_leases_expiry_is_never_later_than_its_end_when_answers_are_slow() {
    let server = RedisServer::start().await;
    let proxy = common::proxy::CuttingProxy::start(server.port()).await;
    let sidecar = SidecarBuilder::new(&format!("redis://127.0.0.1:{}", proxy.port()))
        .start()
        .await;
    let name = unique_name("slow");
    let lock = sidecar.api().lock(&name);
    let warm = lock.acquire(&[]).await;
    lock.release(&warm.token).await;
    // The lease's end, read straight from Redis (not through the proxy).
    let end = async || {
        let left: i64 = server.cmd(&["PTTL", &format!("sidelock:{name}")]).await;
        assert!(left > 0, "the lease's key has a ttl: {left}");
        wall_ms() + left as u64
    };

    proxy.slow_answers(Duration::from_millis(300));
    for _ in 0..3 {
        let grant = lock.acquire(&[("ttl", "5s")]).await;
        let ends = end().await;
        assert!(
            grant.expires_at_ms <= ends + 1,
            "the lease ends at {ends} in Redis, its acquire said {} ({} ms late)",
            grant.expires_at_ms,
            grant.expires_at_ms - ends
        );
        let kept = lock.keepalive(&grant.token, &[("ttl", "5s")]).await;
        let ends = end().await;
        assert!(
            kept.expires_at_ms <= ends + 1,
            "the lease ends at {ends} in Redis, its keepalive said {} ({} ms late)",
            kept.expires_at_ms,
            kept.expires_at_ms - ends
        );
        lock.release(&grant.token).await;
    }
}

/// A claim that finds the lock free while others are queued for it (a lease
/// that lapsed with waiters; on every Redlock node, each handoff, between
/// the release and the head's grant) queues behind them on the scripts'
/// short path. It ran the full script, which checks the type of every side
/// key first: about 20 commands where a join behind a holder costs 4 (on
/// Redlock, a quarter of all commands per handoff). The window opens after
/// the monitor's first stale scan, whose commands fell into it once in CI.
#[tokio::test]
async fn a_claim_behind_the_queue_of_a_free_lock_takes_the_short_path() {
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&server.url()).start().await;
    let name = unique_name("behind");
    let lock = sidecar.api().lock(&name);
    let warm = lock.acquire(&[]).await;
    lock.release(&warm.token).await;
    first_scan_done(&sidecar).await;

    // Another sidecar process's claim heads the queue of the free lock,
    // its process alive (its heartbeat runs for another minute).
    server.queue_foreign_claim(&name).await;
    let tag = format!("{{sidelock:{name}}}");
    let _: String = server.cmd(&["SET", &format!("{tag}:seq"), "1"]).await;

    // Trying once: busy behind the queue.
    let types = |c: &std::collections::BTreeMap<String, u64>| c.get("type").copied().unwrap_or(0);
    let before = server.command_counts().await;
    let once = lock.acquire_raw(&[("owner", "once")]).await;
    let after = server.command_counts().await;
    assert_eq!(once.status(), StatusCode::CONFLICT);
    assert!(
        types(&after) == types(&before) && ran(&before, &after) <= 8,
        "a try-once claim behind the queue of a free lock ran the full script:\n{}",
        command_diff(&before, &after)
    );

    // The sidecar's first claim on the lock writes its heartbeat (the full
    // script); its second is a plain join.
    let first = {
        let lock = sidecar.api().lock(&name);
        tokio::spawn(async move {
            lock.acquire_raw(&[("owner", "waiter"), ("wait", "30s")])
                .await
        })
    };
    common::eventually(
        "the first waiter queued",
        Duration::from_secs(5),
        async || {
            let n: i64 = server.cmd(&["LLEN", &format!("{tag}:q")]).await;
            (n == 2).then_some(())
        },
    )
    .await;
    // Its join's answer read: the sidecar knows its heartbeat is kept.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = server.command_counts().await;
    let second = {
        let lock = sidecar.api().lock(&name);
        tokio::spawn(async move {
            lock.acquire_raw(&[("owner", "second"), ("wait", "30s")])
                .await
        })
    };
    common::eventually(
        "the second waiter queued",
        Duration::from_secs(5),
        async || {
            let n: i64 = server.cmd(&["LLEN", &format!("{tag}:q")]).await;
            (n == 3).then_some(())
        },
    )
    .await;
    let after = server.command_counts().await;
    assert!(
        types(&after) == types(&before) && ran(&before, &after) <= 12,
        "a join behind the queue of a free lock ran the full script:\n{}",
        command_diff(&before, &after)
    );
    let state = lock.inspect().await;
    let owners: Vec<&str> = state.waiters.iter().map(|w| w.owner.as_str()).collect();
    assert_eq!(owners, ["other", "waiter", "second"]);
    first.abort();
    second.abort();
}

/// The Cluster node a sidecar's pub/sub connection is on, removed from the
/// cluster (`--cluster del-node`: it is reset, and keeps answering, but
/// hears no cluster PUBLISH any more), is left for a node that hears the
/// cluster: a waiter of that sidecar is handed the lock a release passes
/// to it within seconds. Before, it was told only when the holder's lease
/// would have ended, and a restart of the sidecar did not help (the node
/// is the first seed of its URL).
#[tokio::test]
async fn a_pubsub_node_removed_from_the_cluster_is_left_for_one_that_hears_it() {
    let mut cluster = common::redis::RedisCluster::start().await;
    let members = cluster
        .nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port()))
        .collect::<Vec<_>>()
        .join(",");
    let spare = cluster.add_empty_node().await;
    let spare_port = spare.port();
    let waiting = SidecarBuilder::new(&format!("redis+cluster://127.0.0.1:{spare_port},{members}"))
        .start()
        .await;
    let holding = SidecarBuilder::new(&format!("redis+cluster://{members}"))
        .start()
        .await;
    let spare = cluster.nodes.len() - 1;
    eventually(
        "the waiting sidecar's pub/sub connection on the spare node",
        Duration::from_secs(10),
        async || {
            let channels: Vec<String> = cluster.nodes[spare].cmd(&["PUBSUB", "CHANNELS"]).await;
            (!channels.is_empty()).then_some(())
        },
    )
    .await;
    cluster.remove_node(spare).await;

    let name = unique_name("scaled-in");
    let lock = holding.api().lock(&name);
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    let mut waiter = waiting
        .api()
        .lock(&name)
        .hold(&[("owner", "waiter"), ("wait", "60s"), ("ttl", "60s")])
        .await;
    waiter.expect_queued().await;
    lock.release(&holder.token).await;
    handed_within(&mut waiter, Instant::now(), "").await;
}

/// Probes of a Cluster's pub/sub connection cost nothing while a sidecar
/// has no claim queued: every sidecar watches the monitor election, idle
/// or not, and probing while anything was watched sent a cluster-wide
/// PUBLISH every 5 s from every idle sidecar. With a waiter queued, probes
/// go (which shows the count below sees them).
#[tokio::test]
async fn an_idle_sidecar_sends_no_cluster_probes() {
    let cluster = common::redis::RedisCluster::start().await;
    let sidecar = SidecarBuilder::new(&cluster.url()).start().await;
    let evals = async || {
        let mut n = 0;
        for node in &cluster.nodes {
            n += node
                .command_counts()
                .await
                .get("eval")
                .copied()
                .unwrap_or(0);
        }
        n
    };
    // Past the sidecar's start, then two probe periods.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = evals().await;
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(evals().await - before, 0, "an idle sidecar sent probes");

    let name = unique_name("probed");
    let lock = sidecar.api().lock(&name);
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    let mut waiter = lock
        .hold(&[("owner", "waiter"), ("wait", "60s"), ("ttl", "60s")])
        .await;
    waiter.expect_queued().await;
    let before = evals().await;
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert!(
        evals().await - before >= 1,
        "a sidecar with a queued claim sent no probe"
    );
    drop(waiter);
    lock.release(&holder.token).await;
}

/// A Cluster master that hangs (SIGSTOP: its connections stay open and
/// nothing is answered) and is failed over to its replica: once the
/// cluster is `ok` again, locks in every slot — the hung master's, now its
/// replica's, and the others' — are served within seconds. The hung node
/// is the first seed, the one a cluster client asks first.
#[tokio::test]
async fn a_hung_cluster_master_failed_over_serves_every_slot_again_within_seconds() {
    let cluster = common::redis::RedisCluster::start_replicated(1).await;
    let sidecar = SidecarBuilder::new(&cluster.url()).start().await;
    let hung = &cluster.nodes[0];
    let hung_id: String = hung.cmd(&["CLUSTER", "MYID"]).await;
    // Names over many slots: some on each master.
    let names: Vec<String> = (0..24).map(|_| unique_name("hung")).collect();
    for name in &names {
        let lock = sidecar.api().lock(name);
        let grant = lock.acquire(&[]).await;
        lock.release(&grant.token).await;
    }

    hung.signal(Signal::SIGSTOP);
    // The cluster fails it over: a replica of it is master, every other
    // node sees the cluster ok.
    let watcher = &cluster.nodes[1];
    eventually(
        "the hung master failed over",
        Duration::from_secs(30),
        async || {
            let info: String = watcher.cmd(&["CLUSTER", "INFO"]).await;
            let nodes: String = watcher.cmd(&["CLUSTER", "NODES"]).await;
            let promoted = nodes.lines().any(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                f.get(2).is_some_and(|flags| flags.contains("master"))
                    && f.get(3) == Some(&"-")
                    && !f[2].contains("fail")
                    && nodes.lines().any(|old| {
                        old.starts_with(&hung_id) && old.contains("fail") && !old.contains("fail?")
                    })
            });
            (info.contains("cluster_state:ok") && promoted).then_some(())
        },
    )
    .await;
    let failed_over = Instant::now();
    let mut slow = Vec::new();
    for name in &names {
        let lock = sidecar.api().lock(name);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let answer = lock.acquire_raw(&[("owner", "after")]).await;
            if answer.status() == StatusCode::OK {
                let grant: Value = answer.json().await.expect("grant body");
                lock.release(grant["token"].as_str().expect("token")).await;
                break;
            }
            assert_eq!(
                answer.status(),
                StatusCode::SERVICE_UNAVAILABLE,
                "only an outage may refuse it"
            );
            assert!(Instant::now() < deadline, "{name} still unavailable");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        slow.push(failed_over.elapsed());
    }
    let all = failed_over.elapsed();
    hung.signal(Signal::SIGCONT);
    assert!(
        all < Duration::from_secs(12),
        "every slot served again {all:?} after the failover (times per lock: {slow:?})"
    );
}

/// A Cluster master that hangs (SIGSTOP) and is not failed over (no
/// replica; the cluster told to serve the slots it still covers) costs
/// its own slots, not the others: locks on the other masters keep being
/// granted and released (at least 98 % of calls; here 99.2-99.9 %, about
/// 660 calls in 12 s). Each call that timed out on the hung master dropped
/// the one cluster connection, and every call then waited for a new one,
/// which waits for every seed, the hung first one too: 3.6 % refused,
/// about 220 calls.
#[tokio::test]
async fn a_hung_cluster_master_costs_only_its_own_slots() {
    let cluster = common::redis::RedisCluster::start().await;
    for node in &cluster.nodes {
        let _: String = node
            .cmd(&["CONFIG", "SET", "cluster-require-full-coverage", "no"])
            .await;
    }
    let sidecar = SidecarBuilder::new(&cluster.url()).start().await;
    let hung = &cluster.nodes[0];
    // Names on the hung master and on the others (where each lock's main
    // key lives while it is held).
    let (mut on_hung, mut elsewhere) = (Vec::new(), Vec::new());
    while on_hung.len() < 4 || elsewhere.len() < 8 {
        let name = unique_name("hang");
        let lock = sidecar.api().lock(&name);
        let grant = lock.acquire(&[]).await;
        // Answered MOVED when the key's slot is another master's.
        let mut c = hung.connection().await.expect("connect to the master");
        let held: Result<i64, _> = redis::cmd("EXISTS")
            .arg(format!("sidelock:{name}"))
            .query_async(&mut c)
            .await;
        lock.release(&grant.token).await;
        if held.is_ok_and(|n| n == 1) {
            on_hung.push(name);
        } else {
            elsewhere.push(name);
        }
    }

    hung.signal(Signal::SIGSTOP);
    // The hung master's own locks time out (each call on it drops or
    // replaces the connection) while the others are used throughout.
    let until = Instant::now() + Duration::from_secs(12);
    let api = sidecar.api();
    let stuck = on_hung.clone();
    let hung_calls = tokio::spawn(async move {
        while Instant::now() < until {
            for name in &stuck {
                let answer = api.lock(name).acquire_raw(&[]).await;
                assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
            }
        }
    });
    let (mut granted, mut refused) = (0, Vec::new());
    while Instant::now() < until {
        for name in &elsewhere {
            let lock = sidecar.api().lock(name);
            let answer = lock.acquire_raw(&[]).await;
            if answer.status() != StatusCode::OK {
                refused.push((answer.status(), name.clone()));
                continue;
            }
            let grant: Value = answer.json().await.expect("grant body");
            let token = grant["token"].as_str().expect("token");
            // A release refused (503) is sent again: it did not run (one
            // hold, and its lease ends with the ttl otherwise).
            let mut released = lock.release_raw(token).await.status();
            while released == StatusCode::SERVICE_UNAVAILABLE {
                refused.push((released, name.clone()));
                released = lock.release_raw(token).await.status();
            }
            assert!(
                released == StatusCode::OK || released == StatusCode::GONE,
                "release: {released}"
            );
            granted += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    hung_calls.await.expect("calls on the hung master");
    hung.signal(Signal::SIGCONT);
    // A few are refused while the cluster client re-reads its slot map
    // (it locks its node table and, inside the lock, connects to every
    // master of the map, the hung one too).
    assert!(
        granted > 0 && refused.len() * 50 <= granted + refused.len(),
        "{} of {} calls on the masters that answer were refused: {:?}",
        refused.len(),
        granted + refused.len(),
        &refused[..refused.len().min(5)]
    );
}

/// A force-release notes the leases it removed in `{<main>}:forced` (for
/// their holders' sidecars), never over a key of another type written
/// there by hand: that key keeps its value and stays without expiry. The
/// note's expiry was set on it, so it vanished a minute later.
#[tokio::test]
async fn a_force_release_leaves_a_foreign_key_in_its_notes_place_as_it_was() {
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&server.url())
        .admin_token(common::ADMIN_TOKEN)
        .start()
        .await;
    let name = unique_name("forced-foreign");
    let forced = format!("{{sidelock:{name}}}:forced");
    let _: String = server.cmd(&["SET", &forced, "mine"]).await;
    let lock = sidecar.api().lock(&name);
    lock.acquire(&[("owner", "victim"), ("ttl", "30s")]).await;
    let admin = sidecar.api_with_token(common::ADMIN_TOKEN);
    assert_eq!(admin.lock(&name).force_release().await, 1);
    let value: String = server.cmd(&["GET", &forced]).await;
    assert_eq!(value, "mine");
    let left: i64 = server.cmd(&["PTTL", &forced]).await;
    assert_eq!(left, -1, "the foreign key was given an expiry");
    // Without such a key, the note is written, with an expiry.
    let noted = unique_name("forced-noted");
    let grant = sidecar
        .api()
        .lock(&noted)
        .acquire(&[("owner", "victim"), ("ttl", "30s")])
        .await;
    assert_eq!(admin.lock(&noted).force_release().await, 1);
    let note = format!("{{sidelock:{noted}}}:forced");
    let marked: i64 = server.cmd(&["HEXISTS", &note, &grant.token]).await;
    assert_eq!(marked, 1);
    let left: i64 = server.cmd(&["PTTL", &note]).await;
    assert!(
        (60_000..=91_000).contains(&left),
        "the note's expiry: {left} ms"
    );
}

/// A lease released or force-released through another sidecar frees its
/// place under `--max-held` on the sidecar that granted it, once that
/// sidecar reaches the cap: it asks the backend about its leases then.
/// Nothing told it, and it answered 429 `sidecar-full` while holding
/// nothing, until the leases' ttl ended — for holds (checked before their
/// stream starts) and acquires alike.
#[tokio::test]
async fn leases_ended_through_another_sidecar_free_their_places_under_max_held() {
    let server = RedisServer::start().await;
    let other = SidecarBuilder::new(&server.url())
        .admin_token(common::ADMIN_TOKEN)
        .start()
        .await;
    let admin = other.api_with_token(common::ADMIN_TOKEN);
    for next in ["hold", "acquire"] {
        let capped = SidecarBuilder::new(&server.url())
            .flag("max-held", "2")
            .start()
            .await;
        let (first, second) = (unique_name("capped"), unique_name("capped"));
        let one = capped.api().lock(&first).acquire(&[("ttl", "1h")]).await;
        capped.api().lock(&second).acquire(&[("ttl", "1h")]).await;
        let full = capped
            .api()
            .lock(&unique_name("capped"))
            .acquire_raw(&[("ttl", "1h")])
            .await;
        common::assert_problem(full, StatusCode::TOO_MANY_REQUESTS, "sidecar-full").await;
        // Ended elsewhere: one released, one force-released.
        other.api().lock(&first).release(&one.token).await;
        assert_eq!(admin.lock(&second).force_release().await, 1);
        // Past the once-a-second limit of the look at the cap.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let lock = capped.api().lock(&unique_name("capped"));
        if next == "hold" {
            let mut hold = lock.hold(&[("ttl", "1h")]).await;
            hold.expect_acquired().await;
        } else {
            let third = lock.acquire_raw(&[("ttl", "1h")]).await;
            assert_eq!(third.status(), StatusCode::OK, "an acquire at the cap");
        }
        // Both places were freed.
        capped
            .api()
            .lock(&unique_name("capped"))
            .acquire(&[("ttl", "1h")])
            .await;
    }
}

/// A release sent again with its `Idempotency-Key` while the first is
/// still under way (Redis paused: both are in the sidecar at once) waits
/// for the first's answer: one hold of two released, both told so. (Run
/// side by side, each released a hold.)
#[tokio::test]
async fn a_retry_under_way_waits_for_the_first_release() {
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let lock = sidecar.api().lock(&unique_name("overlap"));
    let grant = lock.acquire(&[("owner", "o"), ("ttl", "60s")]).await;
    assert_eq!(lock.acquire(&[("owner", "o")]).await.count, 2);
    server.pause_clients(1000).await;
    let first = {
        let (lock, token) = (lock.clone(), grant.token.clone());
        tokio::spawn(async move { lock.release_with_key(&token, "k").await })
    };
    // The first is at Redis, waiting for the pause to end.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = lock.release_with_key(&grant.token, "k").await;
    let first = first.await.expect("the first release's task");
    let one = common::Released {
        released: false,
        count: 1,
    };
    assert_eq!((first, second), (one, one));
    assert_eq!(lock.inspect().await.holders[0].count, 1);
}

/// Clients that send a release with an `Idempotency-Key` and close at once
/// leave the release to finish in the sidecar (Redis paused: each waits
/// there). Such work counts against `--max-connections` (4 here) until it
/// ends: with the cap used by it, a new request is answered 429 at once,
/// not kept waiting; once Redis answers, the sidecar serves again, and each
/// left release released one hold. (Without the count, closing connections
/// left work behind without bound: the fifth request was taken in and
/// waited for Redis.)
#[tokio::test]
async fn releases_left_by_their_clients_count_against_the_connection_cap() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&server.url())
        .env("SIDELOCK_MAX_CONNECTIONS", "4")
        .start()
        .await;
    let name = unique_name("left");
    let lock = sidecar.api().lock(&name);
    let grant = lock.acquire(&[("owner", "o"), ("ttl", "60s")]).await;
    for count in 2..=5 {
        assert_eq!(lock.acquire(&[("owner", "o")]).await.count, count);
    }
    let delete = |key: &str| {
        format!(
            "DELETE /v1/locks/{name}?token={} HTTP/1.1\r\nHost: localhost\r\n\
             Idempotency-Key: {key}\r\nConnection: close\r\n\r\n",
            grant.token
        )
    };
    let connect = || async {
        tokio::net::TcpStream::connect(("127.0.0.1", sidecar.port()))
            .await
            .expect("connect to the sidecar")
    };
    server.pause_clients(1500).await;
    let paused = Instant::now();
    // Four releases, each under its own key (a retry waiting for its
    // turn would give up when its client left): all four go to Redis.
    for i in 0..4 {
        let mut stream = connect().await;
        stream
            .write_all(delete(&format!("k{i}")).as_bytes())
            .await
            .expect("send the release");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Their clients have gone; the sidecar sees the closes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let answer = within(
        "a request beyond the cap",
        Duration::from_millis(800),
        async {
            let mut stream = connect().await;
            stream
                .write_all(delete("k4").as_bytes())
                .await
                .expect("send");
            let mut answer = Vec::new();
            let _ = stream.read_to_end(&mut answer).await;
            String::from_utf8_lossy(&answer).into_owned()
        },
    )
    .await;
    assert!(
        paused.elapsed() < Duration::from_millis(1500),
        "the test took too long to tell anything (Redis resumed): {answer}"
    );
    assert!(
        answer.starts_with("HTTP/1.1 429")
            && answer.contains("urn:sidelock:problem:too-many-connections")
            && answer.to_ascii_lowercase().contains("retry-after: 1"),
        "{answer}"
    );
    // Once the left releases end, keyed releases are served again: the
    // first's answer, kept for its key.
    let replayed = eventually(
        "the sidecar to serve keyed releases again",
        Duration::from_secs(10),
        || async {
            let response = lock.release_with_key_raw(&grant.token, "k0").await;
            (response.status() == StatusCode::OK).then_some(response)
        },
    )
    .await;
    let replayed: common::Released = replayed.json().await.expect("a release's JSON");
    assert!((1..=4).contains(&replayed.count), "{replayed:?}");
    assert_eq!(
        lock.inspect().await.holders[0].count,
        1,
        "each left release released one hold"
    );
}

/// A lease given up because its renewals could not get through (answers
/// held back, so the renewal is still under way at the safety margin) ends
/// as a loss, so its lock-delay runs: the waiter on another sidecar is
/// granted no sooner than `lock_delay` after the holder was told `lost`.
/// (The sidecar released it in Redis once answers came back, before Redis
/// expired it, and a release starts no delay: the waiter was granted at
/// once.)
#[tokio::test]
async fn a_lease_given_up_for_slow_answers_keeps_its_lock_delay() {
    const DELAY: Duration = Duration::from_secs(4);
    let server = RedisServer::start().await;
    let proxy = common::proxy::CuttingProxy::start(server.port()).await;
    let a = SidecarBuilder::new(&format!("redis://127.0.0.1:{}", proxy.port()))
        .start()
        .await;
    let b = sidecar(&server).await;
    let name = unique_name("given-up");
    let mut hold = a
        .api()
        .lock(&name)
        .hold(&[("owner", "holder"), ("ttl", "6s"), ("lock_delay", "4s")])
        .await;
    hold.expect_acquired().await;
    let waiter = {
        let lock = b.api().lock(&name);
        tokio::spawn(async move {
            let grant = lock.acquire(&[("owner", "waiter"), ("wait", "30s")]).await;
            (grant, Instant::now())
        })
    };
    b.api().lock(&name).wait_for_waiters(&["waiter"]).await;

    proxy.slow_answers(Duration::from_secs(5));
    let reason = hold.expect_lost_within(Duration::from_secs(10)).await;
    let lost_at = Instant::now();
    assert_eq!(reason, "unreachable");
    // Answers come back at once again, before Redis expires the lease.
    proxy.slow_answers(Duration::ZERO);
    let (grant, granted_at) = within("the waiter is granted", Duration::from_secs(30), async {
        waiter.await.expect("the waiter's task")
    })
    .await;
    let after = granted_at.saturating_duration_since(lost_at);
    assert!(
        after >= DELAY,
        "the waiter was granted {after:?} after the holder was told lost, inside its lock-delay of {DELAY:?} (fence {})",
        grant.fence
    );
}

/// A keyed release whose client leaves while it waits for the turn of the
/// same key's release under way gives up at once (it has not run; the
/// client's retry waits for the first's answer): it holds no place among
/// the requests still running after their clients left, so a new request
/// is served beside the one under way, with `--max-connections 2`.
#[tokio::test]
async fn a_keyed_release_that_leaves_while_waiting_its_turn_gives_up() {
    use tokio::io::AsyncWriteExt as _;
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&server.url())
        .env("SIDELOCK_MAX_CONNECTIONS", "2")
        .start()
        .await;
    let lock = sidecar.api().lock(&unique_name("gives-up"));
    let grant = lock.acquire(&[("owner", "o"), ("ttl", "60s")]).await;
    for count in 2..=3 {
        assert_eq!(lock.acquire(&[("owner", "o")]).await.count, count);
    }
    server.pause_clients(1500).await;
    // The first, under way at Redis.
    let first = {
        let (lock, token) = (lock.clone(), grant.token.clone());
        tokio::spawn(async move { lock.release_with_key(&token, "k").await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Its retry waits for its turn, and its client leaves.
    let mut retry = tokio::net::TcpStream::connect(("127.0.0.1", sidecar.port()))
        .await
        .expect("connect to the sidecar");
    retry
        .write_all(
            format!(
                "DELETE /v1/locks/{}?token={} HTTP/1.1\r\nHost: localhost\r\nIdempotency-Key: k\r\n\r\n",
                lock.name(),
                grant.token
            )
            .as_bytes(),
        )
        .await
        .expect("send the retry");
    tokio::time::sleep(Duration::from_millis(150)).await;
    drop(retry);
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Another release (its own key) is taken in: it waits for Redis too.
    let other = lock.release_with_key(&grant.token, "other").await;
    let first = first.await.expect("the first release's task");
    // Both waited for the pause; Redis serves its paused clients in no
    // promised order, so either may have taken the third hold.
    let mut counts = [first.count, other.count];
    counts.sort_unstable();
    assert_eq!(counts, [1, 2], "each release took one hold");
    assert_eq!(
        lock.inspect().await.holders[0].count,
        1,
        "two releases, two holds"
    );
}

/// The warning a sidecar logs for a Redis that may evict its keys.
const EVICTS: &str = "set maxmemory-policy noeviction";

// A Redis with a maxmemory and an allkeys policy may evict a lease while
// it is held, or a fence counter: the sidecar said nothing of it. It warns
// now, once it connects, and not for a Redis that never evicts.
#[tokio::test]
async fn a_redis_that_may_evict_keys_is_named_in_a_warning() {
    let evicting =
        RedisServer::start_with(&["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"])
            .await;
    let keeping = RedisServer::start_with(&["--maxmemory", "100mb"]).await;
    let warned = sidecar(&evicting).await;
    let quiet = sidecar(&keeping).await;
    for s in [&warned, &quiet] {
        let lock = s.api().lock(&unique_name("evict"));
        let grant = lock.acquire(&[]).await;
        lock.release(&grant.token).await;
    }
    eventually("the warning", Duration::from_secs(10), async || {
        warned.log().contains(EVICTS).then_some(())
    })
    .await;
    let line = warned
        .log()
        .lines()
        .find(|l| l.contains(EVICTS))
        .map(str::to_owned)
        .unwrap_or_default();
    assert!(
        line.contains("WARN") && line.contains("allkeys-lru"),
        "{line}"
    );
    // The other's check ran as it connected, as this one's did.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!quiet.log().contains(EVICTS), "{}", quiet.log());
}

/// Fences stay exact at the top of the counter: Lua numbers hold integers
/// exactly only up to 2^53 - 1, and a fence counter set near it by hand
/// (the old scripts handed out 9007199254740996 twice) grants up to that
/// fence and then refuses with 409 `key-conflict` naming the counter, on
/// the free lock's short path and on a handoff to a queued claim alike,
/// leaving the counter where it was; the lock can still be inspected and
/// scanned.
#[tokio::test]
async fn fences_past_the_last_exact_integer_are_refused_not_repeated() {
    const LAST_EXACT: u64 = 9_007_199_254_740_991;
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let name = unique_name("top-fence");
    let fence_key = format!("{{sidelock:{name}}}:fence");
    let lock = sidecar.api().lock(&name);
    let _: () = server
        .cmd(&["SET", &fence_key, &(LAST_EXACT - 3).to_string()])
        .await;
    let grant = lock.acquire(&[]).await;
    assert_eq!(grant.fence, LAST_EXACT - 2);
    assert!(lock.release(&grant.token).await.released);

    // Two claims queue behind a holder; the lock is handed to the first
    // with the last exact fence, and the second is refused when it would
    // be handed the next.
    let holder = lock.acquire(&[("owner", "holder")]).await;
    assert_eq!(holder.fence, LAST_EXACT - 1);
    let queue = format!("{{sidelock:{name}}}:q");
    let mut waiters = Vec::new();
    for (i, owner) in ["first", "second"].into_iter().enumerate() {
        waiters.push(lock.spawn_acquire_raw(&[("owner", owner), ("wait", "20s")]));
        eventually("the claim is queued", Duration::from_secs(10), async || {
            let queued: usize = server.cmd(&["LLEN", &queue]).await;
            (queued == i + 1).then_some(())
        })
        .await;
    }
    let [first, second] = <[_; 2]>::try_from(waiters).expect("two waiters");
    assert!(lock.release(&holder.token).await.released);
    let first = within("the first claim's answer", Duration::from_secs(20), first)
        .await
        .expect("the first claim's task");
    assert_eq!(first.status(), StatusCode::OK);
    let first: common::Grant = first.json().await.expect("grant");
    assert_eq!(first.fence, LAST_EXACT);
    // A spent counter leaves the lock readable.
    let state = lock.inspect().await;
    assert_eq!(state.holders.len(), 1, "{state:?}");
    assert_eq!(state.holders[0].fence, LAST_EXACT);
    assert!(lock.release(&first.token).await.released);
    let refused = within("the second claim's answer", Duration::from_secs(20), second)
        .await
        .expect("the second claim's task");
    let problem = common::assert_problem(refused, StatusCode::CONFLICT, "key-conflict").await;
    assert!(
        problem["detail"]
            .as_str()
            .unwrap_or_default()
            .contains(&fence_key),
        "{problem}"
    );
    // And so is a claim on the free lock, while the lock can still be
    // inspected and scanned.
    let refused = lock.acquire_raw(&[]).await;
    common::assert_problem(refused, StatusCode::CONFLICT, "key-conflict").await;
    assert!(lock.inspect().await.holders.is_empty());
    let stale = sidecar.api().get(&["v1", "stale"], &[]).await;
    assert_eq!(stale.status(), StatusCode::OK);
    let counter: String = server.cmd(&["GET", &fence_key]).await;
    assert_eq!(counter, LAST_EXACT.to_string());
    // A counter past it, set by hand, shows no rounded fence: inspecting
    // is refused (the fence 2^53 + 1 read as 2^53, a 20-digit one as 2^63).
    for past in ["9007199254740993", "99999999999999999999"] {
        let _: () = server.cmd(&["SET", &fence_key, past]).await;
        let inspected = sidecar.api().get(&["v1", "locks", &name], &[]).await;
        common::assert_problem(inspected, StatusCode::CONFLICT, "key-conflict").await;
    }
}

/// A hold whose lease reaches it late is renewed in time: the lock is
/// handed to a queued hold while its sidecar is stopped, and the lease's
/// ttl runs from the handoff, so when the sidecar resumes 1.7 s later only
/// 1.1 s of the 2.8 s ttl is left, 0.79 s before its safety margin. The old
/// watchdog waited a third of the ttl (0.93 s) from its own start, past the
/// margin, and reported `lost`, although a renewal would have kept the
/// lease; now it renews at once. (The stop is shorter than the sidecar's
/// backend call timeout, so no call it had in flight times out on resuming.
/// With a 1.5 s ttl and a 1.1 s stop the resumed sidecar had 233 ms to renew
/// inside its margin, and with 2.4 s 434 ms: loaded CI runs missed both.)
#[tokio::test]
async fn a_hold_handed_a_lease_while_its_sidecar_was_stopped_renews_it_in_time() {
    let server = RedisServer::start().await;
    let releaser = sidecar(&server).await;
    let waiting = sidecar(&server).await;
    let name = unique_name("late-lease");
    let holder = releaser.api().lock(&name).acquire(&[("ttl", "60s")]).await;
    let mut hold = waiting
        .api()
        .lock(&name)
        .hold(&[("ttl", "2800ms"), ("wait", "30s")])
        .await;
    hold.expect_queued().await;
    waiting.signal(Signal::SIGSTOP);
    let released = releaser.api().lock(&name).release(&holder.token).await;
    tokio::time::sleep(Duration::from_millis(1700)).await;
    waiting.signal(Signal::SIGCONT);
    assert!(released.released);
    hold.expect_acquired().await;
    match hold.next_within(Duration::from_secs(2)).await {
        Ok(Some(common::HoldEvent::Renewed(_))) => {}
        other => panic!("the late lease should be renewed before its expiry, got {other:?}"),
    }
}

/// While a waiter's sidecar subscribes to the lock's wake-ups (here a
/// SUBSCRIBE held back 1.5 s on its way to Redis), the waiter's `wait` still
/// runs and its client may still leave: a `wait=200ms` claim answers 409
/// well before the subscription is confirmed, and a client that gives up
/// leaves the queue at once. The old sidecar heeded neither until the
/// subscription was confirmed (a 200 ms wait answered after 1.5 s; a gone
/// client stayed queued as long).
#[tokio::test]
async fn a_waiter_whose_subscription_is_slow_keeps_its_wait_and_its_client() {
    let p = Proxied::start().await;
    for leaves in [true, false] {
        let name = unique_name("slow-subscribe");
        let holder = p.direct.api().lock(&name).acquire(&[("ttl", "60s")]).await;
        p.proxy.delay_request(
            format!("{{sidelock:{name}}}:wake").as_bytes(),
            Duration::from_millis(1500),
        );
        let lock = p.through_proxy.api().lock(&name);
        let started = Instant::now();
        if leaves {
            let waiter = lock.spawn_acquire_raw(&[("wait", "30s"), ("owner", "leaver")]);
            p.direct
                .api()
                .lock(&name)
                .wait_for_waiters(&["leaver"])
                .await;
            waiter.abort();
            tokio::time::sleep(Duration::from_millis(400)).await;
            let state = p.direct.api().lock(&name).inspect().await;
            assert!(
                state.waiters.is_empty(),
                "a client gone {:?} after it came is still queued: {:?}",
                started.elapsed(),
                state.waiters
            );
        } else {
            let answer = lock.acquire_raw(&[("wait", "200ms")]).await;
            assert_eq!(answer.status(), StatusCode::CONFLICT);
            assert!(
                started.elapsed() < Duration::from_millis(1000),
                "a 200 ms wait answered after {:?}",
                started.elapsed()
            );
        }
        p.direct.api().lock(&name).release(&holder.token).await;
    }
}

/// A keyspace full of abandoned locks makes a bounded stale report: with
/// 1,500 hand-written keys without expiry matching `--legacy-pattern`,
/// `/v1/stale` lists 1,000 and says it is `truncated` (the old answer
/// listed every one, however many). With fewer, nothing is cut and the answer has no `truncated`.
#[tokio::test]
async fn a_stale_report_is_bounded() {
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&server.url())
        .flag("legacy-pattern", "legacy:*")
        .start()
        .await;
    let stale = async || -> Value {
        sidecar
            .api()
            .get(&["v1", "stale"], &[])
            .await
            .json()
            .await
            .expect("the stale report")
    };
    let _: () = server.cmd(&["SET", "legacy:one", "x"]).await;
    let report = stale().await;
    assert_eq!(
        report["stale"].as_array().map(Vec::len),
        Some(1),
        "{report}"
    );
    assert!(report.get("truncated").is_none(), "{report}");

    let keys: Vec<String> = (0..1500).map(|i| format!("legacy:{i}")).collect();
    let mut mset = vec!["MSET"];
    for key in &keys {
        mset.extend([key.as_str(), "x"]);
    }
    let _: () = server.cmd(&mset).await;
    // Past the one-scan-at-a-time sharing of the first report.
    let report = stale().await;
    assert_eq!(
        report["stale"].as_array().map(Vec::len),
        Some(1000),
        "{}",
        report["truncated"]
    );
    assert_eq!(report["truncated"], true);
}

/// Keys are bytes: a legacy client (or anyone) may write one that is not
/// UTF-8. One such key under `--legacy-pattern` or the sidecar's prefix made
/// every stale scan or listing fail to read the scan's reply, which was
/// reported as the backend being unreachable (503, `sidelock_backend_up`
/// 0, the dashboard's listing gone). Such a key is listed as stale with
/// its bytes escaped, and as is its name with a bidi override, so that it
/// cannot pass for another; it is not a lock, so listings skip it.
#[tokio::test]
async fn keys_that_are_not_utf8_or_hide_their_name_are_shown_escaped_not_an_outage() {
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&server.url())
        .flag("legacy-pattern", "lock:*")
        .start()
        .await;
    let api = sidecar.api();
    let grant = api.lock(&unique_name("listed")).acquire(&[]).await;
    let mut c = server.connection().await.expect("connect to test redis");
    for key in [
        &b"lock:\xff\xfe"[..],
        "lock:\u{202e}gnp.exe".as_bytes(),
        b"sidelock:\xffx",
        b"lock:good",
    ] {
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg("1")
            .query_async(&mut c)
            .await
            .expect("SET");
    }
    let stale = api.get(&["v1", "stale"], &[]).await;
    assert_eq!(stale.status(), StatusCode::OK);
    let stale: Value = stale.json().await.expect("the stale report");
    let keys: Vec<&str> = stale["stale"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|s| s["key"].as_str())
        .collect();
    for shown in [
        "lock:good",
        "lock:\\xff\\xfe",
        "lock:\\xe2\\x80\\xaegnp.exe",
        "sidelock:\\xffx",
    ] {
        assert!(keys.contains(&shown), "{shown} in {keys:?}");
    }
    let listed = api.get(&["v1", "locks"], &[]).await;
    assert_eq!(listed.status(), StatusCode::OK);
    let listed: Value = listed.json().await.expect("the listing");
    assert!(listed.to_string().contains(&grant.name), "{listed}");
    let metrics = api
        .get(&["metrics"], &[])
        .await
        .text()
        .await
        .expect("metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("sidelock_backend_up{") && l.ends_with(" 1")),
        "the backend stays up: {metrics}"
    );
}

/// A semaphore's limit as some Redis 7.2 releases wrote it (a Lua number
/// of eight or more trailing zeros as `1e+8`) is read as the number it is,
/// not refused as a key of the wrong type.
#[tokio::test]
async fn a_limit_written_in_exponent_form_is_still_the_semaphores_limit() {
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let name = unique_name("exponent");
    let semaphore = sidecar.api().semaphore(&name);
    let first = semaphore.acquire(&[("limit", "100000000")]).await;
    let limit_key = format!("{{sidelock:semaphores/{name}}}:limit");
    let written: String = server.cmd(&["GET", &limit_key]).await;
    assert_eq!(written, "100000000");
    let _: () = server.cmd(&["SET", &limit_key, "1e+8"]).await;
    let second = semaphore.acquire(&[("limit", "100000000")]).await;
    semaphore.release(&second.token).await;
    semaphore.release(&first.token).await;
}

/// A lease its owner holds once through each sidecar of a [`Proxied`].
struct ReEntered {
    owner: String,
    /// The lock through the proxied sidecar, and through the direct one.
    through: common::api::Resource,
    lock: common::api::Resource,
    /// The grant through the proxy, and the re-entry (count 2) directly.
    first: common::api::Grant,
    again: common::api::Grant,
}

/// Has a new owner acquire a lock named from `prefix` through the proxy
/// (once the scripts are loaded there) and re-enter it directly.
async fn re_entered_through_both(p: &Proxied, prefix: &str) -> ReEntered {
    let name = unique_name(prefix);
    let owner = unique_name("owner");
    let through = p.through_proxy.api().lock(&name);
    let lock = p.direct.api().lock(&name);
    let warm = through.acquire(&[]).await;
    through.release(&warm.token).await;
    let first = through.acquire(&[("owner", &owner), ("ttl", "60s")]).await;
    let again = lock.acquire(&[("owner", &owner), ("ttl", "60s")]).await;
    assert_eq!(
        again.count, 2,
        "the owner re-entered through the other sidecar"
    );
    ReEntered {
        owner,
        through,
        lock,
        first,
        again,
    }
}

/// A client's release whose answer is lost after Redis ran it (503) is
/// not sent again by the sidecar when it stops: SIGTERM releases the holds
/// taken through it, and it still counted that one as its own, so the
/// release ran twice and took the hold the owner had re-entered through
/// another sidecar (count 2 → 0): another owner got the lock.
#[tokio::test]
async fn a_release_whose_answer_is_lost_is_not_sent_again_at_shutdown() {
    let mut p = Proxied::start().await;
    let ReEntered {
        owner,
        through,
        lock,
        first,
        again,
    } = re_entered_through_both(&p, "lost-then-stop").await;

    p.proxy.cut_after(first.token.as_bytes());
    let lost = through.release_raw(&first.token).await;
    assert!(!p.proxy.armed(), "the release went through the proxy");
    assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE);
    p.through_proxy.terminate();
    p.through_proxy.wait_exit(Duration::from_secs(20)).await;
    lost_answers::assert_holds_once(&lock, &owner, &again.token).await;
}

/// As [`a_release_whose_answer_is_lost_is_not_sent_again_at_shutdown`],
/// with a release whose client hung up while it was on its way to Redis
/// (the sidecar drops the request; the call, sent, still runs).
#[tokio::test]
async fn a_release_whose_client_hung_up_is_not_sent_again_at_shutdown() {
    let mut p = Proxied::start().await;
    let ReEntered {
        owner,
        through,
        lock,
        first,
        again,
    } = re_entered_through_both(&p, "left-then-stop").await;

    p.proxy
        .delay_request(first.token.as_bytes(), Duration::from_millis(1000));
    let gone = tokio::time::timeout(
        Duration::from_millis(300),
        through.release_raw(&first.token),
    )
    .await;
    assert!(gone.is_err(), "the client hung up before the answer");
    // The release reaches Redis and runs (2 -> 1).
    common::eventually("the release to run", Duration::from_secs(5), async || {
        (lock.inspect().await.holders.first().map(|h| h.count) == Some(1)).then_some(())
    })
    .await;
    p.through_proxy.terminate();
    p.through_proxy.wait_exit(Duration::from_secs(20)).await;
    lost_answers::assert_holds_once(&lock, &owner, &again.token).await;
}

/// A hold stream whose client leaves while Redis refuses its release (an
/// error reply, here `NOREPLICAS`, as `LOADING` during a restart: the
/// release surely did not run) releases the lease once Redis takes writes
/// again. The release was tried once: the lease then held the lock, and the
/// waiter behind it on the other sidecar, until its 60 s ttl (with
/// elections: a campaign that resigned kept leading).
#[tokio::test]
async fn a_hold_whose_release_was_refused_releases_once_redis_takes_it() {
    let server = RedisServer::start().await;
    let sidecars = [sidecar(&server).await, sidecar(&server).await];
    let name = unique_name("refused-release");
    let mut holder = sidecars[0]
        .api()
        .lock(&name)
        .hold(&[("owner", "holder"), ("ttl", "60s")])
        .await;
    holder.expect_acquired().await;
    let waiter_lock = sidecars[1].api().lock(&name);
    let mut waiter = waiter_lock
        .hold(&[("owner", "waiter"), ("wait", "60s")])
        .await;
    waiter.expect_queued().await;
    let writes = async |n: &str| {
        let _: () = server
            .cmd(&["CONFIG", "SET", "min-replicas-to-write", n])
            .await;
    };
    writes("1").await;
    drop(holder);
    // The release is refused meanwhile.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        waiter_lock.inspect().await.holder_owners(),
        ["holder"],
        "the refused release must not have run"
    );
    writes("0").await;
    let grant = waiter.expect_acquired_within(Duration::from_secs(8)).await;
    assert_eq!(grant.owner, "waiter");
}

/// An election key written by hand with no expiry (a foreign leader that
/// never lapses) is watched at the refresh's pace: its expiry read as 0 made
/// the observer's next look due at once, and each observed election cost
/// its sidecar an `inspect` every 5 ms for as long as the key stayed. A
/// campaign waiting behind it must not poll either.
#[tokio::test]
async fn an_election_key_without_expiry_is_not_read_in_a_loop() {
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let name = unique_name("foreign-leader");
    let _: () = server
        .cmd(&["SET", &format!("sidelock:elections/{name}"), "x"])
        .await;
    let api = sidecar.api();
    let inspects = async || {
        api.metric_sum("sidelock_backend_operations_total", "op=\"inspect\"")
            .await
    };
    let before = inspects().await;
    let observer = api
        .open_stream(&["v1", "elections", &name, "observe"], &[])
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let read = inspects().await - before;
    assert!(
        read <= 5.0,
        "{read} inspects in 2 s of observing a leader that never lapses"
    );
    drop(observer);
    // A campaign waiting behind it tries at the same pace.
    let attempts = async || {
        api.metric_sum("sidelock_backend_operations_total", "op=\"try_acquire\"")
            .await
    };
    let before = attempts().await;
    let campaign = api
        .open_stream(&["v1", "elections", &name, "campaign"], &[])
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let tried = attempts().await - before;
    assert!(
        tried <= 5.0,
        "{tried} attempts in 2 s of waiting behind a leader that never lapses"
    );
    drop(campaign);
}

/// A leadership Redis handed to a campaign whose sidecar then gives it back
/// (its `--max-held` cap reached meanwhile) is announced: the give-back
/// deleted the key and published nothing, so observers on other sidecars
/// showed that campaign leading until their 30 s refresh while nobody led.
#[tokio::test]
async fn a_handed_leadership_given_back_is_announced_to_observers() {
    given_back_leadership_is_announced(false).await;
}

/// A leadership given back as above, but whose give-back Redis refused at
/// first (it refuses writes: `NOREPLICAS`) and the sidecar sent again in
/// the background, is announced once Redis takes it: the resend published
/// nothing, and observers elsewhere showed pod-b leading until their 30 s
/// refresh while nobody led.
#[tokio::test]
async fn a_leadership_given_back_in_the_background_is_announced_to_observers() {
    given_back_leadership_is_announced(true).await;
}

/// pod-a leads, pod-b follows through a sidecar whose one place a plain
/// lock takes; pod-a leaves while pod-b's sidecar is stopped, Redis hands
/// pod-b the lease, and pod-b's sidecar gives it back when it resumes
/// (Redis refusing that give-back at first when `refused_first`): an
/// observer on a third sidecar must see nobody leading.
async fn given_back_leadership_is_announced(refused_first: bool) {
    let server = RedisServer::start().await;
    let leading = sidecar(&server).await;
    let capped = SidecarBuilder::new(&server.url())
        .flag("max-held", "1")
        .start()
        .await;
    let watching = sidecar(&server).await;
    let name = unique_name("given-back");
    let stream = |api: common::api::Api, what: &'static str, owner: &'static str| {
        let name = name.clone();
        async move {
            let params: &[(&str, &str)] = if owner.is_empty() {
                &[]
            } else {
                &[("owner", owner)]
            };
            api.open_stream(&["v1", "elections", &name, what], params)
                .await
        }
    };
    let leader_is = |owner: &'static str| {
        move |e: &common::sse::SseEvent| {
            e.event == "leader" && e.json()["owner"].as_str().unwrap_or("(none)") == owner
        }
    };
    let mut observer = stream(watching.api(), "observe", "").await;
    let mut first = stream(leading.api(), "campaign", "pod-a").await;
    first
        .wait_for("pod-a leads", Duration::from_secs(5), |e| {
            e.event == "leader"
        })
        .await;
    let mut second = stream(capped.api(), "campaign", "pod-b").await;
    second
        .wait_for("pod-b follows", Duration::from_secs(5), |e| {
            e.event == "follower"
        })
        .await;
    // The capped sidecar's one place is taken by a plain lock.
    let plain = capped.api().lock(&unique_name("slot")).acquire(&[]).await;
    observer
        .wait_for("pod-a observed", Duration::from_secs(5), leader_is("pod-a"))
        .await;
    capped.signal(Signal::SIGSTOP);
    drop(first);
    observer
        .wait_for("pod-b observed", Duration::from_secs(5), leader_is("pod-b"))
        .await;
    if refused_first {
        let _: () = server
            .cmd(&["CONFIG", "SET", "min-replicas-to-write", "1"])
            .await;
    }
    capped.signal(Signal::SIGCONT);
    if refused_first {
        // The give-back refused, and sent again 250 ms later, then at 500 ms.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let _: () = server
            .cmd(&["CONFIG", "SET", "min-replicas-to-write", "0"])
            .await;
    }
    eventually(
        "pod-b's lease given back",
        Duration::from_secs(8),
        async || {
            let now: Value = watching
                .api()
                .get_json(&["v1", "elections", &name], &[])
                .await;
            now["leader"].is_null().then_some(())
        },
    )
    .await;
    observer
        .wait_for(
            "nobody observed leading once pod-b's lease was given back",
            Duration::from_secs(3),
            leader_is("(none)"),
        )
        .await;
    drop((second, plain));
}

/// A semaphore waiter sent without `limit` (allowed while the semaphore is
/// in use: it takes the limit in force) whose sidecar was paused past its
/// heartbeat, and whose semaphore went idle meanwhile (the release dropped
/// the lapsed place, and with nothing held or queued, the limit), takes a
/// permit when its sidecar resumes: its attempt found no limit and none
/// given, and answered 400 `invalid-parameter` ("limit is required") to a
/// request that was valid, and the waiter left the queue.
#[tokio::test]
async fn a_semaphore_waiter_without_limit_whose_sidecar_paused_takes_a_permit() {
    let server = RedisServer::start().await;
    let releasing = sidecar(&server).await;
    let waiting = sidecar(&server).await;
    let name = unique_name("unlimited-waiter");
    let holder = releasing
        .api()
        .semaphore(&name)
        .acquire(&[("limit", "1"), ("ttl", "60s")])
        .await;
    let mut waiter = waiting
        .api()
        .semaphore(&name)
        .hold(&[("owner", "waiter"), ("wait", "60s")])
        .await;
    waiter.expect_queued().await;
    // Nothing of the waiting sidecar's in flight when it stops: this test
    // is about the pause past the heartbeat, not a call's answer waiting
    // (`a_call_answered_while_its_sidecar_was_paused_is_answered`).
    tokio::time::sleep(Duration::from_millis(500)).await;
    waiting.signal(Signal::SIGSTOP);
    // Past the 15 s heartbeat window: the release drops the waiter's place.
    tokio::time::sleep(Duration::from_millis(16_500)).await;
    releasing
        .api()
        .semaphore(&name)
        .release(&holder.token)
        .await;
    waiting.signal(Signal::SIGCONT);
    let grant = waiter.expect_acquired_within(Duration::from_secs(10)).await;
    assert_eq!(grant.owner, "waiter");
    // One permit: a claim with `limit=1` is refused while it holds.
    let other = releasing
        .api()
        .semaphore(&name)
        .acquire_raw(&[("limit", "1")])
        .await;
    assert_eq!(other.status(), StatusCode::CONFLICT);
}

/// While a hold whose client left sends its refused release again, the
/// lease's expiry is still watched: a re-entry of it through the same
/// sidecar by a plain acquire (whose lease the hold watched) is
/// reported when it ends (Redis still answers reads here: `expired`), with
/// no keepalive asking. The first resending of the release left nobody
/// watching: the lease's end was noticed only by the next resend, its
/// pauses doubling to 5 s (about 8.8 s after the client left, for this
/// 4 s lease), while its client, between keepalives, counted on it.
#[tokio::test]
async fn a_refused_release_sent_again_leaves_the_lease_watched() {
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let name = unique_name("watched-while-resent");
    let api = sidecar.api();
    let lock = api.lock(&name);
    let mut first = lock.hold(&[("owner", "o"), ("ttl", "4s")]).await;
    first.expect_acquired().await;
    let again = lock.acquire(&[("owner", "o"), ("ttl", "4s")]).await;
    assert_eq!(again.count, 2);
    let mut events = api.events().await;
    let _: () = server
        .cmd(&["CONFIG", "SET", "min-replicas-to-write", "1"])
        .await;
    drop(first);
    eventually(
        "the re-entry's lease reported when it ends (4 s)",
        Duration::from_millis(5500),
        async || {
            events
                .next_within(Duration::from_millis(100))
                .await
                .ok()
                .flatten()
                .filter(|e| {
                    ["lost", "expired"].contains(&e.event.as_str())
                        && e.json()["name"] == name.as_str()
                })
        },
    )
    .await;
    let _: () = server
        .cmd(&["CONFIG", "SET", "min-replicas-to-write", "0"])
        .await;
}

/// A call whose answer came while its sidecar was paused (SIGSTOP here; a
/// VM's or a CPU quota's pause in production) past the call's time limit
/// (2 s) is answered, not timed out: the answer waits in the socket when
/// the sidecar resumes. The timer fired first at resume, before the
/// connection's reader ran, and a try-once acquire Redis had granted
/// answered 503 (its grant then given back), a waiter's join lost its
/// place.
#[tokio::test]
async fn a_call_answered_while_its_sidecar_was_paused_is_answered() {
    let server = RedisServer::start().await;
    let sidecar = sidecar(&server).await;
    let name = unique_name("paused-call");
    let api = sidecar.api();
    api.lock(&unique_name("warm-up")).acquire(&[]).await;
    for round in 0..3 {
        let name = format!("{name}-{round}");
        // Redis holds the call unanswered until the sidecar is paused,
        // then answers it at once.
        server.signal(Signal::SIGSTOP);
        let acquire = api.lock(&name).spawn_acquire_raw(&[("ttl", "60s")]);
        tokio::time::sleep(Duration::from_millis(300)).await;
        sidecar.signal(Signal::SIGSTOP);
        tokio::time::sleep(Duration::from_millis(200)).await;
        server.signal(Signal::SIGCONT);
        tokio::time::sleep(Duration::from_millis(2_800)).await;
        sidecar.signal(Signal::SIGCONT);
        let answer = acquire.await.expect("the acquire");
        let status = answer.status();
        let body = answer.text().await.unwrap_or_default();
        assert_eq!(status, StatusCode::OK, "round {round}: {body}");
    }
}

/// A try-once acquire whose answer came back garbled (a TLS alert or
/// garbage mid-reply: the script ran and granted) answers 503 and its
/// grant is released in the background, as one whose answer was lost or
/// late is. Only a lost connection or a time limit counted as "may have
/// run" there: the lease stayed, held by nobody, until its ttl (60 s here),
/// and everyone else got 409.
#[tokio::test]
async fn a_grant_whose_answer_came_back_garbled_is_released() {
    let server = RedisServer::start().await;
    let (proxy, sidecar, name) = behind_a_proxy(&server, "garbled").await;
    let lock = sidecar.api().lock(&name);
    proxy.garble_answer_after(name.as_bytes());
    let first = lock
        .acquire_raw(&[("owner", "first"), ("ttl", "60s")])
        .await;
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    granted_to_the_next("the garbled grant released", &lock).await;
}

/// Waits until `lock`, given back (`what`), is granted to another owner.
async fn granted_to_the_next(what: &str, lock: &common::api::Resource) {
    eventually(what, Duration::from_secs(5), async || {
        let next = lock
            .acquire_raw(&[("owner", "second"), ("ttl", "60s")])
            .await;
        (next.status() == StatusCode::OK).then_some(())
    })
    .await;
    let state = lock.inspect().await;
    assert_eq!(state.holder_owners(), ["second"], "{state:?}");
}

/// A sidecar whose Redis connections go through a [`common::proxy::CuttingProxy`],
/// and a lock it has granted and released once (its scripts loaded).
async fn behind_a_proxy(
    server: &RedisServer,
    prefix: &str,
) -> (common::proxy::CuttingProxy, SidecarGuard, String) {
    let proxy = common::proxy::CuttingProxy::start(server.port()).await;
    let sidecar = SidecarBuilder::new(&format!("redis://127.0.0.1:{}", proxy.port()))
        .start()
        .await;
    let name = unique_name(prefix);
    let lock = sidecar.api().lock(&name);
    let warm = lock.acquire(&[]).await;
    lock.release(&warm.token).await;
    (proxy, sidecar, name)
}

/// A grant that races its client's disconnect is released, and a release
/// the backend refused (it surely did not run: `NOREPLICAS` here, as in a
/// failover) is sent again until it is heard, as a hold stream's is. It
/// was sent once: refused, the lease stayed, held by nobody, until its ttl
/// (60 s here), and everyone else got 409.
#[tokio::test]
async fn a_grant_whose_client_left_is_released_after_a_refusal() {
    let server = RedisServer::start().await;
    let (proxy, sidecar, name) = behind_a_proxy(&server, "left-refused").await;
    let lock = sidecar.api().lock(&name);
    let owner = unique_name("gone");
    // The grant's answer comes 1.5 s late; its client is gone by then.
    proxy.hold_answer_after(owner.as_bytes(), Duration::from_millis(1_500));
    let leaving = lock.spawn_acquire_raw(&[("owner", &owner), ("ttl", "60s")]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    leaving.abort();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The release that follows the grant is refused, and so is the first
    // time it is sent again (250 ms later).
    let _: () = server
        .cmd(&["CONFIG", "SET", "min-replicas-to-write", "1"])
        .await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let _: () = server
        .cmd(&["CONFIG", "SET", "min-replicas-to-write", "0"])
        .await;
    granted_to_the_next("the grant of the client that left released", &lock).await;
}

/// A queue that a release took its only entry from and put back (a shared
/// claim heads it: only woken, not handed the lock) keeps an expiry, and a
/// try-once claim on the free lock whose queued claims' process stopped
/// beating is granted, as the full script would grant it. The queue was
/// put back without its expiry, and the try-once fast path answered 409
/// behind the dead entry (its heartbeat gone, or lapsed) for as long as
/// nobody ran a script that prunes: for good on a lock used only with
/// try-once claims.
#[tokio::test]
async fn a_try_once_claim_is_not_held_back_by_a_dead_shared_waiter() {
    let server = RedisServer::start().await;
    let alive = sidecar(&server).await;
    let mut doomed = SidecarBuilder::new(&server.url())
        .sidecar_id("doomed")
        .start()
        .await;
    let name = unique_name("dead-shared-head");
    let lock = alive.api().lock(&name);
    let holder = lock.acquire(&[("ttl", "60s")]).await;
    let mut dead_waiter = doomed
        .api()
        .lock(&name)
        .hold(&[("owner", "doomed"), ("mode", "shared"), ("wait", "60s")])
        .await;
    dead_waiter.expect_queued().await;
    doomed.signal(nix::sys::signal::Signal::SIGKILL);
    doomed.wait_exit(Duration::from_secs(5)).await;
    lock.release(&holder.token).await;
    let queue = format!("{{sidelock:{name}}}:q");
    let pttl: i64 = server.cmd(&["PTTL", &queue]).await;
    assert!(pttl > 0, "the queue's expiry after the release: {pttl}");
    lapse_heartbeat(&server, &name, "doomed").await;
    let next = lock.acquire_raw(&[("owner", "next")]).await;
    let status = next.status();
    let body = next.text().await.unwrap_or_default();
    assert_eq!(status, StatusCode::OK, "{body}");
}

/// A queued claim that finds its entry gone (pruned while its sidecar could
/// not beat) is put back at its place with the queue's expiry: a queue it
/// starts again had none, and kept the entry for good once its process
/// died.
#[tokio::test]
async fn a_claim_queued_again_at_its_place_keeps_the_queue_expiring() {
    let server = RedisServer::start().await;
    let (a, b) = sides(&server).await;
    let name = unique_name("requeued");
    let holder = a.api().lock(&name).acquire(&[("ttl", "60s")]).await;
    let mut waiter = b
        .api()
        .lock(&name)
        .hold(&[("owner", "waiter"), ("wait", "60s")])
        .await;
    waiter.expect_queued().await;
    let queue = format!("{{sidelock:{name}}}:q");
    let _: i64 = server.cmd(&["DEL", &queue]).await;
    // The waiter looks again, finds its entry gone and queues it again.
    let _: i64 = server
        .cmd(&["PUBLISH", &format!("{{sidelock:{name}}}:wake"), "r"])
        .await;
    eventually(
        "the claim queued again",
        Duration::from_secs(5),
        async || {
            let n: i64 = server.cmd(&["LLEN", &queue]).await;
            (n == 1).then_some(())
        },
    )
    .await;
    let pttl: i64 = server.cmd(&["PTTL", &queue]).await;
    assert!(pttl > 0, "the queue's expiry: {pttl}");
    a.api().lock(&name).release(&holder.token).await;
    waiter.expect_acquired().await;
}
