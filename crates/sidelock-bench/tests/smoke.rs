//! Smoke test of `sidelock-bench`: every workload runs for a fraction of a
//! second against the memory backend and a real redis-server (PostgreSQL
//! and its plain recipe, ZooKeeper and Redlock too), and the JSON
//! it writes has every workload's fields with sane values. Not a timed test:
//! no latency or throughput threshold is checked here (BENCHMARKS.md has the
//! measured numbers).

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use sidelock_test_support::postgres::TestDatabase;
use sidelock_test_support::redis::{RedisNodes, RedisServer};
use sidelock_test_support::zookeeper::ZkServer;

/// The bench under test.
const BENCH_BIN: &str = env!("CARGO_BIN_EXE_sidelock-bench");

/// The `sidelock` binary beside the bench, where `cargo build --bins`
/// (the test command's step before the tests) puts it.
fn sidelock_bin() -> PathBuf {
    let path = std::path::Path::new(BENCH_BIN).with_file_name("sidelock");
    assert!(
        path.is_file(),
        "{} is missing: build it first (cargo build --bins; scripts/test.sh does)",
        path.display()
    );
    path
}

fn num(v: &Value, path: &str) -> f64 {
    let mut cur = v;
    for part in path.split('.') {
        cur = match part.parse::<usize>() {
            Ok(i) => &cur[i],
            Err(_) => &cur[part],
        };
    }
    cur.as_f64()
        .unwrap_or_else(|| panic!("{path} is not a number in {v:#}"))
}

/// Runs `sidelock-bench <args> --json <tmp>` (`args` split on whitespace);
/// asserts it succeeded and returns its printed tables and the JSON it wrote.
async fn run_bench(args: &str) -> (String, Value) {
    let args: Vec<String> = args.split_whitespace().map(str::to_owned).collect();
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("bench.json");
    let out = tokio::task::spawn_blocking({
        let json = json.clone();
        move || {
            Command::new(BENCH_BIN)
                .args(&args)
                .arg("--sidelock")
                .arg(sidelock_bin())
                .arg("--json")
                .arg(&json)
                .env_remove("SIDELOCK_API_TOKEN")
                .output()
                .expect("run sidelock-bench")
        }
    })
    .await
    .expect("join");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "sidelock-bench failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    let report =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("read JSON")).expect("JSON");
    (stdout, report)
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_runs_every_workload_and_writes_well_formed_json() {
    let redis = RedisServer::start().await;
    let args = format!(
        "--workload all --backend memory --backend redis --redis {} \
         --duration 300ms --idle-duration 300ms --clients 1,2 --contended-clients 2,4 \
         --waiters 3 --crash-rounds 1 --startup-rounds 1 --poll 10ms",
        redis.url()
    );
    let (stdout, report) = run_bench(&args).await;
    for table in [
        "Uncontended",
        "Contended",
        "Idle waiters",
        "Idle holds",
        "Crash",
        "Startup",
    ] {
        assert!(stdout.contains(table), "no {table} table in:\n{stdout}");
    }
    assert!(num(&report, "machine.cpus") >= 1.0);
    let runs = report["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2, "{report:#}");
    assert_eq!(runs[0]["backend"], "memory://");
    assert!(runs[1]["backend"].as_str().unwrap().starts_with("redis://"));
    for run in runs {
        assert_eq!(run["errors"].as_array().map(Vec::len), Some(0), "{run:#}");
        // The same clients over the sidecar's Unix socket.
        let unix = run["uncontended_unix"]
            .as_array()
            .expect("uncontended_unix");
        assert_eq!(unix.len(), 2, "{run:#}");
        for u in unix {
            assert!(num(u, "pairs") > 0.0, "{u:#}");
            assert_eq!(num(u, "errors"), 0.0, "{u:#}");
        }
        let unc = run["uncontended"].as_array().expect("uncontended");
        assert_eq!(unc.len(), 2);
        for u in unc {
            assert!(num(u, "pairs") > 0.0, "{u:#}");
            assert!(num(u, "pairs_per_s") > 0.0);
            assert!(num(u, "acquire.p50_us") > 0.0);
            assert!(num(u, "acquire.p50_us") <= num(u, "acquire.p99_us"));
            assert!(num(u, "acquire.p99_us") <= num(u, "acquire.p999_us"));
            assert!(num(u, "release.p50_us") > 0.0);
            assert_eq!(num(u, "errors"), 0.0);
            // CPU per pair: the bench and its sidecar always, Redis on the
            // Redis run (its server is local). One share may round to 0
            // clock ticks in 300 ms; both together cannot.
            let cpu = num(u, "cpu_us_per_pair.bench") + num(u, "cpu_us_per_pair.sidecar");
            assert!(cpu > 0.0, "{u:#}");
        }
        let con = run["contended"].as_array().expect("contended");
        assert_eq!(con.len(), 2);
        for c in con {
            assert!(num(c, "grants") > 0.0, "{c:#}");
            assert!(num(c, "handoffs") > 0.0, "{c:#}");
            assert!(num(c, "handoff.p50_us") > 0.0);
            assert!(num(c, "max_wait_ms") > 0.0);
            assert_eq!(num(c, "errors"), 0.0);
        }
        let idle = &run["idle"][0];
        assert_eq!(num(idle, "waiters"), 3.0);
        assert_eq!(num(idle, "queued"), 3.0, "{idle:#}");
        assert!(num(idle, "rss_kib") > 1000.0);
        let holds = &run["holds"][0];
        assert_eq!(num(holds, "waiters"), 3.0);
        assert_eq!(num(holds, "queued"), 3.0, "{holds:#}");
        assert!(num(holds, "rss_kib") > 1000.0);
        let crash = &run["crash"];
        assert!(num(crash, "hold_cut_ms.0") > 0.0, "{crash:#}");
        assert!(num(crash, "client_killed_ms.0") > 0.0);
        let failover = &run["failover"];
        assert!(num(failover, "stream_dropped_ms.0") > 0.0, "{failover:#}");
        assert!(num(failover, "process_killed_ms.0") > 0.0, "{failover:#}");
        let startup = &run["startup"];
        assert!(num(startup, "ready_p50_ms") > 0.0);
        assert!(num(startup, "idle_rss_max_kib") > 1000.0);
    }
    // Redis: commands counted, and the sidecar on Redis waits without polling.
    let redis_run = &runs[1];
    assert!(num(redis_run, "uncontended.0.cpu_us_per_pair.redis") >= 0.0);
    assert!(runs[0]["uncontended"][0]["cpu_us_per_pair"]["redis"].is_null());
    assert!(num(redis_run, "contended.0.commands_per_grant") > 0.0);
    assert!(num(redis_run, "contended.0.round_trips_per_grant") > 0.0);
    assert!(num(redis_run, "idle.0.round_trips_per_s") >= 0.0);
    assert!(
        !redis_run["crash"]["sidecar_killed_ms"]
            .as_array()
            .expect("sidecar_killed_ms")
            .is_empty()
    );
    let failover = &redis_run["failover"];
    assert!(
        !failover["sidecar_killed_ms"]
            .as_array()
            .expect("sidecar_killed_ms")
            .is_empty()
    );
    // Root (as the test command runs): a leader partitioned from Redis.
    // SAFETY: geteuid only reads the process credentials.
    if unsafe { libc::geteuid() } == 0 {
        let partition = &failover["partition"];
        assert_eq!(num(partition, "overlaps"), 0.0, "{partition:#}");
        assert!(
            num(partition, "lost_ms.0") < num(partition, "led_ms.0"),
            "{partition:#}"
        );
    }
    // Baselines.
    let base = &report["baselines"];
    assert!(num(base, "direct_redis.0.pairs_per_s") > 0.0, "{base:#}");
    assert_eq!(num(base, "direct_redis.0.round_trips_per_pair"), 2.0);
    assert!(num(base, "direct_redis.0.cpu_us_per_pair.redis") >= 0.0);
    assert!(base["direct_redis"][0]["cpu_us_per_pair"]["sidecar"].is_null());
    let polling = &base["polling"][0];
    assert_eq!(num(polling, "poll_ms"), 10.0);
    assert!(num(polling, "contended.0.grants") > 0.0);
    assert!(num(polling, "idle.0.round_trips_per_s") > 0.0);
    assert!(report["headline"]["uncontended_1_ratio_pairs_per_s"].is_number());
}

/// ZooKeeper and Redlock: the bench runs on them and reads their request
/// counters (`mntr`, `INFO commandstats` summed over the nodes).
#[tokio::test(flavor = "multi_thread")]
async fn bench_counts_zookeeper_and_redlock_operations() {
    let zk = ZkServer::start().await;
    let redlock = RedisNodes::start(3).await;
    let args = format!(
        "--workload contended --no-baselines --backend zookeeper --zookeeper {} \
         --backend redlock --redlock {} --duration 300ms --contended-clients 4",
        zk.url(""),
        redlock.url()
    );
    let (_, report) = run_bench(&args).await;
    let runs = report["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2, "{report:#}");
    assert!(runs[0]["backend"].as_str().unwrap().starts_with("zk://"));
    assert!(
        runs[1]["backend"]
            .as_str()
            .unwrap()
            .starts_with("redlock://")
    );
    for run in runs {
        assert_eq!(run["errors"].as_array().map(Vec::len), Some(0), "{run:#}");
        assert!(num(run, "contended.0.handoffs") > 0.0, "{run:#}");
        // Every handoff needs at least a request to the backend.
        assert!(
            num(run, "contended.0.round_trips_per_grant") >= 1.0,
            "{run:#}"
        );
    }
    // Redlock asks every node: more commands per grant than one node sees.
    assert!(num(&runs[1], "contended.0.commands_per_grant") >= 3.0);
}

/// PostgreSQL beside its plain recipe (session advisory locks, waiting in
/// the server), both counted by the database's transactions in one run.
#[tokio::test(flavor = "multi_thread")]
async fn bench_runs_the_postgres_plain_recipe_beside_sidelock() {
    let db = TestDatabase::new().await;
    let args = format!(
        "--workload uncontended --backend postgres --postgres {} --duration 300ms \
         --clients 1,2",
        db.url()
    );
    let (stdout, report) = run_bench(&args).await;
    assert!(
        stdout.contains("direct postgres (advisory lock)"),
        "{stdout}"
    );
    let base = &report["baselines"];
    assert_eq!(base["errors"].as_array().map(Vec::len), Some(0), "{base:#}");
    for i in 0..2 {
        let run = &base["direct_postgres"][i];
        assert!(num(run, "pairs") > 0.0, "{run:#}");
        assert_eq!(num(run, "errors"), 0.0, "{run:#}");
        // Two statements per pair: the lock and the unlock.
        assert!(
            (num(run, "round_trips_per_pair") - 2.0).abs() < 0.01,
            "{run:#}"
        );
    }
    // (The database's own counters flush about once a second: too coarse
    // to check in 300 ms.)
    let sidelock = &report["runs"][0];
    assert!(num(sidelock, "uncontended.0.pairs") > 0.0, "{sidelock:#}");

    let args = format!(
        "--workload contended --backend postgres --postgres {} --duration 300ms \
         --contended-clients 4",
        db.url()
    );
    let (_, report) = run_bench(&args).await;
    let run = &report["baselines"]["direct_postgres_contended"][0];
    assert!(num(run, "handoffs") > 0.0, "{run:#}");
    assert_eq!(num(run, "errors"), 0.0, "{run:#}");
}
