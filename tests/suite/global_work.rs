//! Work that reads or writes for the whole backend is done once, by the
//! monitor the sidecars elect among themselves, not once per sidecar: an
//! idle backend is as loaded with twenty sidecars as with one, a monitor
//! that leaves is replaced, and nobody else can take its election.

use crate::common;

use std::time::Duration;

use common::postgres::PgCluster;
use common::redis::{RedisNodes, RedisServer, command_diff};
use common::zookeeper::ZkServer;
use common::{SidecarBuilder, SidecarGuard, eventually};
use futures::future::join_all;
use reqwest::StatusCode;
use serde_json::Value;

const MONITOR: &str = "sidelock.monitor";

async fn sidecars(url: &str, count: usize) -> Vec<SidecarGuard> {
    join_all((0..count).map(|i| {
        SidecarBuilder::new(url)
            .sidecar_id(&format!("sidecar-{i}"))
            .start()
    }))
    .await
}

/// The sidecar the monitor election names, if any (none while the backend
/// cannot be read).
async fn monitor(sidecar: &SidecarGuard) -> Option<String> {
    let response = sidecar.api().get(&["v1", "elections", MONITOR], &[]).await;
    if response.status() != StatusCode::OK {
        return None;
    }
    let election: Value = response.json().await.expect("election JSON");
    election["leader"]["sidecar"].as_str().map(str::to_owned)
}

#[tokio::test]
async fn an_idle_redis_is_as_loaded_by_twenty_sidecars_as_by_one() {
    let (one, many) = tokio::join!(RedisServer::start(), RedisServer::start());
    let (one_url, many_url) = (one.url(), many.url());
    let (_one_sidecar, _many_sidecars) =
        tokio::join!(sidecars(&one_url, 1), sidecars(&many_url, 20));
    // Start-up (each sidecar looks for a monitor once) is over.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let (one_before, many_before) = tokio::join!(one.command_counts(), many.command_counts());
    tokio::time::sleep(Duration::from_secs(25)).await;
    let (one_after, many_after) = tokio::join!(one.command_counts(), many.command_counts());
    let spent = |before: &std::collections::BTreeMap<String, u64>,
                 after: &std::collections::BTreeMap<String, u64>| {
        after.values().sum::<u64>() - before.values().sum::<u64>()
    };
    let (by_one, by_many) = (
        spent(&one_before, &one_after),
        spent(&many_before, &many_after),
    );
    eprintln!("idle 25 s: 1 sidecar {by_one} Redis commands, 20 sidecars {by_many}");
    // The same work, give or take one of the monitor's 10 s rounds that
    // falls inside one window and not the other.
    assert!(
        by_many as f64 <= by_one as f64 * 1.5 + 10.0,
        "idle for 25 s, 20 sidecars ran {by_many} Redis commands and 1 sidecar ran {by_one}\n\
         20 sidecars: {}\n1 sidecar: {}",
        command_diff(&many_before, &many_after),
        command_diff(&one_before, &one_after),
    );
}

/// The same on Redlock, counted over its three nodes: the monitor's lease
/// and announcement reach every node, and nothing else runs.
#[tokio::test]
async fn an_idle_redlock_is_as_loaded_by_twenty_sidecars_as_by_one() {
    let (one, many) = tokio::join!(RedisNodes::start(3), RedisNodes::start(3));
    let (one_url, many_url) = (one.url(), many.url());
    let (_one_sidecar, _many_sidecars) =
        tokio::join!(sidecars(&one_url, 1), sidecars(&many_url, 20));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let total = async |nodes: &RedisNodes| -> u64 {
        let mut sum = 0;
        for node in &nodes.nodes {
            sum += node.commands_run().await;
        }
        sum
    };
    let (one_before, many_before) = (total(&one).await, total(&many).await);
    tokio::time::sleep(Duration::from_secs(25)).await;
    let (by_one, by_many) = (
        total(&one).await - one_before,
        total(&many).await - many_before,
    );
    eprintln!("idle 25 s over 3 nodes: 1 sidecar {by_one} commands, 20 sidecars {by_many}");
    assert!(
        by_many as f64 <= by_one as f64 * 1.5 + 30.0,
        "idle for 25 s, 20 sidecars ran {by_many} commands on the Redlock nodes and 1 sidecar ran {by_one}"
    );
}

/// The same on PostgreSQL, counted with `pg_stat_statements` per database
/// of one cluster of its own: a sidecar with nobody waiting sends no
/// heartbeat (it keeps waiters alive), so twenty idle sidecars cost what one
/// does: the monitor's renewal and announcement.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_postgres_is_as_loaded_by_twenty_sidecars_as_by_one() {
    let cluster = PgCluster::start();
    let admin = cluster.client("postgres").await;
    for sql in [
        "CREATE EXTENSION pg_stat_statements",
        "CREATE DATABASE one",
        "CREATE DATABASE many",
    ] {
        admin.batch_execute(sql).await.expect(sql);
    }
    let (one_url, many_url) = (cluster.url("one"), cluster.url("many"));
    let (_one, _many) = tokio::join!(sidecars(&one_url, 1), sidecars(&many_url, 20));
    tokio::time::sleep(Duration::from_secs(3)).await;
    admin
        .batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .expect("reset pg_stat_statements");
    tokio::time::sleep(Duration::from_secs(25)).await;
    let calls = async |db: &str| -> (i64, String) {
        let rows = admin
            .query(
                "SELECT s.calls, left(regexp_replace(s.query, '\\s+', ' ', 'g'), 60) \
                 FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
                 WHERE d.datname = $1 ORDER BY s.calls DESC",
                &[&db],
            )
            .await
            .expect("list statements");
        let total = rows.iter().map(|r| r.get::<_, i64>(0)).sum();
        let detail = rows
            .iter()
            .map(|r| format!("{:>4} {}", r.get::<_, i64>(0), r.get::<_, String>(1)))
            .collect::<Vec<_>>()
            .join("\n");
        (total, detail)
    };
    let ((by_one, one_detail), (by_many, many_detail)) = (calls("one").await, calls("many").await);
    eprintln!("idle 25 s: 1 sidecar {by_one} statements, 20 sidecars {by_many}");
    assert!(
        by_many as f64 <= by_one as f64 * 1.5 + 6.0,
        "idle for 25 s, 20 sidecars ran {by_many} statements and 1 sidecar ran {by_one}\n\
         20 sidecars:\n{many_detail}\n1 sidecar:\n{one_detail}"
    );
}

/// An uncontended acquire and release through one sidecar costs PostgreSQL
/// the same with ten sidecars listening as with one: a release with nobody
/// waiting notifies nobody. (It used to NOTIFY the shared channel, and
/// reading a notification costs every listening sidecar's connection a
/// transaction: ten per release with ten sidecars.) Counted with
/// `pg_stat_database`, which counts those reads too, once every sidecar has
/// gone (a backend reports its counts when it ends): the pairs' cost is a
/// database with pairs less one without, with the same sidecars.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_costs_postgres_the_same_whatever_the_number_of_sidecars() {
    const PAIRS: usize = 50;
    let cluster = PgCluster::start();
    let admin = cluster.client("postgres").await;
    let mut cost = Vec::new();
    for count in [1, 10] {
        let mut totals = Vec::new();
        for pairs in [0, PAIRS] {
            let db = format!("s{count}p{pairs}");
            admin
                .batch_execute(&format!("CREATE DATABASE {db}"))
                .await
                .expect("create database");
            let running = sidecars(&cluster.url(&db), count).await;
            let lock = running[0].api().lock("pairs");
            // The monitor's first rounds, then the pairs.
            tokio::time::sleep(Duration::from_secs(2)).await;
            for _ in 0..pairs {
                let grant = lock.acquire(&[]).await;
                lock.release(&grant.token).await;
            }
            drop(running);
            let total = common::eventually(
                "the sidecars' connections closed",
                Duration::from_secs(30),
                async || {
                    let row = admin
                        .query_one(
                            "SELECT (SELECT count(*) FROM pg_stat_activity WHERE datname = $1), \
                                (SELECT xact_commit + xact_rollback FROM pg_stat_database \
                                  WHERE datname = $1)",
                            &[&db],
                        )
                        .await
                        .expect("read pg_stat_database");
                    (row.get::<_, i64>(0) == 0).then(|| row.get::<_, i64>(1))
                },
            )
            .await;
            totals.push(total);
        }
        cost.push(totals[1] - totals[0]);
    }
    eprintln!(
        "{PAIRS} pairs: 1 sidecar {} transactions, 10 sidecars {}",
        cost[0], cost[1]
    );
    assert!(
        cost[1] as f64 <= cost[0] as f64 * 1.2 + 20.0,
        "{PAIRS} uncontended pairs cost {} transactions with 10 sidecars, {} with 1",
        cost[1],
        cost[0]
    );
}

/// The pings a sidecar sent its backend, by its own count.
async fn pings(sidecar: &SidecarGuard) -> u64 {
    backend_ops(sidecar, "ping").await
}

/// The backend operations `op` a sidecar ran, by its own count.
async fn backend_ops(sidecar: &SidecarGuard, op: &str) -> u64 {
    let op = format!("op=\"{op}\"");
    let text = sidecar
        .api()
        .get(&["metrics"], &[])
        .await
        .text()
        .await
        .expect("metrics");
    text.lines()
        .filter(|l| l.starts_with("sidelock_backend_operations_total{"))
        .filter(|l| l.contains(&op))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A kubelet probing `/readyz` every few seconds on every pod costs an idle
/// backend nothing: with the connection the backend sends the sidecar
/// messages on up (ZooKeeper: the session), and a message (the monitor's
/// announcement every 10 s) or a reply (the session's own keep-alive) heard
/// lately, the sidecar answers without asking. It asked (a `PING`, a
/// `SELECT 1`, a stat) at every probe before.
#[rstest::rstest]
#[case::redis("redis")]
#[case::postgres("postgres")]
#[case::zookeeper("zookeeper")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_probes_cost_an_idle_backend_nothing(#[case] backend: &str) {
    let (_server, url): (Box<dyn std::any::Any>, String) = match backend {
        "redis" => {
            let server = RedisServer::start().await;
            let url = server.url();
            (Box::new(server), url)
        }
        "postgres" => {
            let cluster = PgCluster::start();
            let url = cluster.url("postgres");
            (Box::new(cluster), url)
        }
        _ => {
            let server = ZkServer::start().await;
            let url = server.url("/readiness");
            (Box::new(server), url)
        }
    };
    let running = sidecars(&url, 2).await;
    // Both sidecars have heard the monitor, or elected it, by now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = pings(&running[0]).await + pings(&running[1]).await;
    // Longer than what they did at start-up counts as evidence (15 s).
    for _ in 0..24 {
        for sidecar in &running {
            let ready = sidecar.api().get(&["readyz"], &[]).await;
            assert_eq!(ready.status(), StatusCode::OK);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let after = pings(&running[0]).await + pings(&running[1]).await;
    assert_eq!(
        after - before,
        0,
        "48 probes of idle sidecars pinged {backend}"
    );
}

/// Two sidecars elect one monitor; when it shuts down the other takes over
/// — at once on ZooKeeper, whose watch reports the end of the lease, and
/// after the announcements stop on Redis.
#[tokio::test]
async fn a_monitor_that_shuts_down_is_replaced_on_redis() {
    let server = RedisServer::start().await;
    replaced(&server.url(), Duration::from_secs(45)).await;
}

#[tokio::test]
async fn a_monitor_that_shuts_down_is_replaced_on_zookeeper() {
    let server = ZkServer::start().await;
    replaced(&server.url("/monitor"), Duration::from_secs(15)).await;
}

async fn replaced(url: &str, within: Duration) {
    let mut pair = sidecars(url, 2).await;
    let first = eventually("a monitor", Duration::from_secs(15), async || {
        monitor(&pair[0]).await
    })
    .await;
    assert_eq!(monitor(&pair[1]).await.as_deref(), Some(first.as_str()));
    let gauge = |text: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix("sidelock_monitor "))
            .map(|v| v.trim().to_owned())
    };
    let mut elected = Vec::new();
    for sidecar in &pair {
        elected.push(gauge(
            &sidecar
                .api()
                .get(&["metrics"], &[])
                .await
                .text()
                .await
                .expect("metrics"),
        ));
    }
    elected.sort();
    assert_eq!(
        elected,
        [Some("0".to_owned()), Some("1".to_owned())],
        "exactly one sidecar_monitor gauge is 1"
    );

    let at = if first == "sidecar-0" { 0 } else { 1 };
    let mut gone = pair.remove(at);
    gone.terminate();
    gone.wait_exit(Duration::from_secs(10)).await;
    let survivor = &pair[0];
    let next = eventually("another monitor", within, async || {
        monitor(survivor).await.filter(|s| *s != first)
    })
    .await;
    assert_ne!(next, first);
}

#[tokio::test]
async fn clients_cannot_campaign_for_or_observe_the_monitor_election() {
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&server.url()).start().await;
    let api = sidecar.api();
    for route in ["campaign", "observe"] {
        let r = api.get(&["v1", "elections", MONITOR, route], &[]).await;
        let problem = common::assert_problem(r, StatusCode::BAD_REQUEST, "invalid-name").await;
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("reserved"), "{detail}");
    }
    // Reading it is allowed: it names the monitor.
    let elected = eventually(
        "the monitor is named",
        Duration::from_secs(15),
        async || monitor(&sidecar).await,
    )
    .await;
    // Only the election is reserved: a lock, a shared lock and a semaphore
    // of the same name are ordinary, and do not disturb the monitor.
    let lock = api.lock(MONITOR);
    let held = lock.acquire(&[("owner", "a")]).await;
    lock.release(&held.token).await;
    lock.acquire(&[("mode", "shared"), ("owner", "r1")]).await;
    lock.acquire(&[("mode", "shared"), ("owner", "r2")]).await;
    let permits = api.semaphore(MONITOR);
    permits.acquire(&[("limit", "2")]).await;
    permits.acquire(&[("limit", "2")]).await;
    permits.acquire_busy(&[("limit", "2")]).await;
    assert_eq!(monitor(&sidecar).await, Some(elected));
}

/// Redis restarted empty takes the monitor's lease with it: the monitor
/// hears its renewal fail, and one of the sidecars is elected again.
#[tokio::test]
async fn a_monitor_whose_lease_the_backend_lost_is_elected_again() {
    let mut server = RedisServer::start().await;
    let pair = sidecars(&server.url(), 2).await;
    eventually("a monitor", Duration::from_secs(15), async || {
        monitor(&pair[0]).await
    })
    .await;
    server.restart().await;
    eventually("a monitor again", Duration::from_secs(60), async || {
        monitor(&pair[1]).await
    })
    .await;
    // The old monitor has stepped down (its renewal found nothing) or is
    // the one elected again: one gauge is 1 once its 10 s round has run.
    eventually(
        "exactly one monitor gauge",
        Duration::from_secs(15),
        async || {
            let gauges = join_all(pair.iter().map(async |s| {
                let text = s
                    .api()
                    .get(&["metrics"], &[])
                    .await
                    .text()
                    .await
                    .expect("metrics");
                text.lines().any(|l| l == "sidelock_monitor 1")
            }))
            .await;
            (gauges.iter().filter(|g| **g).count() == 1).then_some(())
        },
    )
    .await;
}

/// The monitor's stale scan reads every key in use, one call each: with
/// many locks in use it runs for many seconds (38 s for 1.3 million). It ran
/// inside the monitor's round, which renews the monitor's lease, so the
/// lease went unrenewed for as long, and a scan longer than the lease (30 s)
/// handed the role to another sidecar mid-scan. The scan now runs beside
/// the renewals.
#[tokio::test]
async fn a_long_stale_scan_does_not_hold_back_the_monitors_renewals() {
    const LOCKS: u32 = 600_000;
    /// The monitor renews every 10 s.
    const BEAT: Duration = Duration::from_secs(10);
    let server = RedisServer::start().await;
    let mut first = SidecarBuilder::new(&server.url()).start().await;
    let model = "sidelock:model";
    first.api().lock("model").acquire(&[("ttl", "1h")]).await;
    // Many leases in use, each a copy of a real one under another name, in
    // batches that each answer well within the client's time limit.
    const BATCH: u32 = 10_000;
    for start in (0..LOCKS).step_by(BATCH as usize) {
        let copied: i64 = server
            .cmd(&[
                "EVAL",
                "local v = redis.call('GET', KEYS[1]) \
                 for i = tonumber(ARGV[1]), tonumber(ARGV[1]) + tonumber(ARGV[2]) - 1 do \
                   redis.call('SET', 'sidelock:busy-' .. i, v, 'PX', 3600000) \
                 end \
                 return tonumber(ARGV[2])",
                "1",
                model,
                &start.to_string(),
                &BATCH.to_string(),
            ])
            .await;
        assert_eq!(copied, i64::from(BATCH));
    }
    // A monitor elected now scans at once.
    first.terminate();
    first.wait_exit(Duration::from_secs(10)).await;
    let monitor = SidecarBuilder::new(&server.url()).start().await;
    let started = std::time::Instant::now();
    loop {
        let (renewed, scanned) = (
            backend_ops(&monitor, "renew").await,
            backend_ops(&monitor, "stale").await,
        );
        if renewed > 0 && scanned == 0 {
            break;
        }
        if scanned > 0 {
            let took = started.elapsed();
            assert!(
                took > BEAT + Duration::from_secs(1),
                "the scan of {LOCKS} locks took {took:?}, under the monitor's beat: \
                 too short to judge by; use more locks"
            );
            panic!("the monitor did not renew its lease during its {took:?} stale scan");
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no renewal nor scan in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// `GET /v1/stale` scans the whole keyspace (every key in use, a `SCAN` of
// the legacy pattern): each request ran its own scan, so a burst of them
// cost the shared backend one full scan each. Requests that arrive while a
// scan runs now share the next.
#[tokio::test]
async fn a_burst_of_stale_key_requests_shares_scans() {
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&server.url()).start().await;
    let before = backend_ops(&sidecar, "stale").await;
    let api = sidecar.api();
    // Redis holds the first scan while the others arrive.
    server.pause_clients(1500).await;
    let answers = join_all((0..20).map(|_| api.stale())).await;
    assert_eq!(answers.len(), 20);
    let scans = backend_ops(&sidecar, "stale").await - before;
    // Two when every request arrived during the first; a loaded machine
    // may deliver a straggler after the second began.
    assert!(
        (1..=4).contains(&scans),
        "20 requests at once ran {scans} scans"
    );
}
