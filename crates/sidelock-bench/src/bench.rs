//! The run: starts what `--spawn-*` and `--backend` ask for, drives every
//! workload against each backend and the Redis baselines, then reports.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::client::Locker;
use crate::counters::Counter;
use crate::procs::{Sidecar, raise_fd_limit, start_redis, use_sidelock};
use crate::report::{
    self, BackendRun, Baselines, Polling, Report, headline, machine, print_tables, read_trim,
};
use crate::urls::redact;
use crate::workloads::{self, Target};
use humantime::parse_duration;

/// Which workloads to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    Uncontended,
    Contended,
    Idle,
    Crash,
    Startup,
    Failover,
    All,
}

/// `sidelock-bench`: which sidecars and backends to measure, with what load.
#[derive(Debug, Parser)]
#[command(
    name = "sidelock-bench",
    version,
    about = "The load generator behind BENCHMARKS.md: measures sidecars over HTTP"
)]
pub struct BenchArgs {
    /// A running sidecar (used when no --backend is given).
    #[arg(long, default_value = "http://127.0.0.1:7070")]
    pub url: String,
    /// A second running sidecar on the same backend (contended, idle and crash use both).
    #[arg(long)]
    pub url2: Option<String>,
    /// PID of the sidecar at --url, for RSS readings.
    #[arg(long)]
    pub sidecar_pid: Option<u32>,
    /// Start sidecars on this backend instead of using --url: memory, redis
    /// (the --redis URL), redlock (--redlock), zookeeper (--zookeeper),
    /// postgres (--postgres) or a backend URL. Repeatable.
    #[arg(long = "backend")]
    pub backends: Vec<String>,
    /// Workload to run.
    #[arg(long, value_enum, default_value = "all")]
    pub workload: Workload,
    /// Client counts of the uncontended and contended workloads
    /// [default: 1,32 and 8,64,512].
    #[arg(long, value_delimiter = ',')]
    pub clients: Option<Vec<usize>>,
    /// Client counts of the contended workload (overrides --clients there).
    #[arg(long, value_delimiter = ',')]
    pub contended_clients: Option<Vec<usize>>,
    /// Waiter counts of the idle workload.
    #[arg(long, value_delimiter = ',', default_value = "10,1000,10000")]
    pub waiters: Vec<usize>,
    /// Length of each uncontended and contended measurement.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Length of each idle-waiters measurement.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub idle_duration: Duration,
    /// Rounds of the crash workload.
    #[arg(long, default_value_t = 10)]
    pub crash_rounds: usize,
    /// Starts measured by the startup workload.
    #[arg(long, default_value_t = 5)]
    pub startup_rounds: usize,
    /// Redis for the baselines and command counts (`redis://host:port`).
    #[arg(long)]
    pub redis: Option<String>,
    /// Start a redis-server on a free port and use it as --redis.
    #[arg(long)]
    pub spawn_redis: bool,
    /// PostgreSQL for statement counts (and `--backend postgres`).
    #[arg(long)]
    pub postgres: Option<String>,
    /// Redlock nodes for `--backend redlock` (`redlock://h1:p1,h2:p2,h3:p3`).
    #[arg(long)]
    pub redlock: Option<String>,
    /// Start three redis-servers on free ports and use them as --redlock.
    #[arg(long)]
    pub spawn_redlock: bool,
    /// ZooKeeper for `--backend zookeeper` (`zk://host:2181[,…]`); request
    /// counts need `mntr` in its `4lw.commands.whitelist`.
    #[arg(long)]
    pub zookeeper: Option<String>,
    /// Sleeps of the polling baseline client.
    #[arg(long, value_delimiter = ',', default_value = "10ms,100ms", value_parser = parse_duration)]
    pub poll: Vec<Duration>,
    /// Skip the direct and polling Redis baselines.
    #[arg(long)]
    pub no_baselines: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// The `sidelock` executable to start sidecars from [default: the one
    /// beside this executable, else `sidelock` on PATH].
    #[arg(long)]
    pub sidelock: Option<PathBuf>,
    /// Bearer token for the sidecars' API.
    #[arg(long, env = "SIDELOCK_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
}

fn has(w: Workload, which: Workload) -> bool {
    w == which || w == Workload::All
}

/// Runs the bench; returns the process exit code.
pub async fn bench(args: BenchArgs) -> i32 {
    match bench_inner(args).await {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("sidelock-bench: {e}");
            1
        }
    }
}

async fn bench_inner(mut args: BenchArgs) -> Result<(), String> {
    use_sidelock(args.sidelock.clone());
    let fd_limit = raise_fd_limit();
    let max_waiters = args.waiters.iter().copied().max().unwrap_or(0) as u64;
    if fd_limit < max_waiters + 256 {
        eprintln!(
            "sidelock-bench: warning: open-file limit {fd_limit} is below {} waiters; raise it (ulimit -n)",
            max_waiters
        );
    }
    let mut report = Report {
        version: env!("CARGO_PKG_VERSION"),
        started_at_ms: report::now_ms(),
        machine: machine(fd_limit),
        settings: serde_json::json!({
            "workload": format!("{:?}", args.workload).to_lowercase(),
            "duration_ms": args.duration.as_millis() as u64,
            "idle_duration_ms": args.idle_duration.as_millis() as u64,
            "waiters": args.waiters,
            "crash_rounds": args.crash_rounds,
            "startup_rounds": args.startup_rounds,
            "poll_ms": args.poll.iter().map(|d| d.as_secs_f64() * 1e3).collect::<Vec<_>>(),
        }),
        runs: Vec::new(),
        baselines: None,
        headline: serde_json::Value::Null,
    };
    let _redis_child = if args.spawn_redis {
        let r = start_redis().await;
        args.redis = Some(r.url());
        Some(r)
    } else {
        None
    };
    let mut _redlock_children = Vec::new();
    if args.spawn_redlock {
        for _ in 0..3 {
            _redlock_children.push(start_redis().await);
        }
        let hosts: Vec<String> = _redlock_children
            .iter()
            .map(|r| format!("127.0.0.1:{}", r.port()))
            .collect();
        args.redlock = Some(format!("redlock://{}", hosts.join(",")));
    }
    let uncontended_clients = args.clients.clone().unwrap_or_else(|| vec![1, 32]);
    let contended_clients = args
        .contended_clients
        .clone()
        .or_else(|| args.clients.clone())
        .unwrap_or_else(|| vec![8, 64, 512]);
    let run_id = format!("{}-{:x}", std::process::id(), report::now_ms() & 0xff_ffff);
    if args.backends.is_empty() {
        let mut urls = vec![args.url.clone()];
        urls.extend(args.url2.clone());
        let target = Target {
            pids: vec![args.sidecar_pid, None],
            urls,
            api_token: args.api_token.clone(),
        };
        let mut run = BackendRun {
            backend: args.url.clone(),
            ..BackendRun::default()
        };
        let counter_url = args
            .redis
            .clone()
            .or(args.redlock.clone())
            .or(args.zookeeper.clone())
            .or(args.postgres.clone());
        run_backend(
            &args,
            &mut run,
            None,
            Some(&target),
            counter_url.as_deref(),
            &uncontended_clients,
            &contended_clients,
            &run_id,
        )
        .await;
        report.runs.push(run);
    } else {
        for b in &args.backends {
            let url = match b.as_str() {
                "memory" => "memory://".to_owned(),
                "redis" => args
                    .redis
                    .clone()
                    .ok_or("--backend redis needs --redis URL or --spawn-redis")?,
                "postgres" => args
                    .postgres
                    .clone()
                    .ok_or("--backend postgres needs --postgres URL")?,
                "redlock" => args
                    .redlock
                    .clone()
                    .ok_or("--backend redlock needs --redlock URL or --spawn-redlock")?,
                "zookeeper" => args
                    .zookeeper
                    .clone()
                    .ok_or("--backend zookeeper needs --zookeeper URL")?,
                other => other.to_owned(),
            };
            let counter_url = Some(url.clone());
            let mut run = BackendRun {
                backend: redact(&url),
                spawned: true,
                ..BackendRun::default()
            };
            run_backend(
                &args,
                &mut run,
                Some(&url),
                None,
                counter_url.as_deref(),
                &uncontended_clients,
                &contended_clients,
                &run_id,
            )
            .await;
            report.runs.push(run);
        }
    }
    if let (Some(redis), false) = (&args.redis, args.no_baselines) {
        report.baselines = Some(
            baselines(
                &args,
                redis,
                &uncontended_clients,
                &contended_clients,
                &run_id,
            )
            .await,
        );
    }
    if let (Some(postgres), false) = (&args.postgres, args.no_baselines) {
        let out = report.baselines.get_or_insert_with(Baselines::default);
        postgres_baselines(
            &args,
            postgres,
            &uncontended_clients,
            &contended_clients,
            &run_id,
            out,
        )
        .await;
    }
    report.machine.loadavg_after = read_trim("/proc/loadavg");
    report.headline = headline(&report);
    print_tables(&report);
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n")
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!("\nJSON written to {}", path.display());
    }
    let failed: Vec<&String> = report
        .runs
        .iter()
        .flat_map(|r| &r.errors)
        .chain(report.baselines.iter().flat_map(|b| &b.errors))
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("{} measurement(s) failed", failed.len()))
    }
}

async fn counter(url: Option<&str>) -> Option<Counter> {
    Counter::open(url?)
        .await
        .map_err(|e| eprintln!("sidelock-bench: no backend counters: {e}"))
        .ok()
        .flatten()
}

/// Sidecars the bench started for one workload.
struct Spawned {
    sidecars: Vec<Sidecar>,
}

impl Spawned {
    async fn start(backend: &str, n: usize) -> Result<Self, String> {
        let mut sidecars = Vec::new();
        for i in 0..n {
            sidecars.push(Sidecar::start(backend, &format!("bench-{}", i + 1)).await?);
        }
        Ok(Self { sidecars })
    }
    fn target(&self, api_token: Option<&String>) -> Target {
        Target {
            urls: self.sidecars.iter().map(|s| s.url.clone()).collect(),
            pids: self.sidecars.iter().map(|s| Some(s.pid)).collect(),
            api_token: api_token.cloned(),
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_backend(
    args: &BenchArgs,
    run: &mut BackendRun,
    spawn: Option<&str>,
    external: Option<&Target>,
    counter_url: Option<&str>,
    uncontended_clients: &[usize],
    contended_clients: &[usize],
    run_id: &str,
) {
    let shared = spawn.is_some_and(|b| !b.starts_with("memory"));
    let pair = if shared { 2 } else { 1 };
    let label = run.backend.clone();
    let mut counter = counter(counter_url).await;
    // Fresh sidecars per workload, so RSS readings start from a clean process.
    macro_rules! target {
        ($n:expr, $spawned:ident, $target:ident) => {
            let $spawned = match spawn {
                Some(b) => match Spawned::start(b, $n).await {
                    Ok(s) => Some(s),
                    Err(e) => {
                        run.errors.push(e);
                        return;
                    }
                },
                None => None,
            };
            let $target = match (&$spawned, external) {
                (Some(s), _) => s.target(args.api_token.as_ref()),
                (None, Some(t)) => t.clone(),
                (None, None) => return,
            };
        };
    }
    if has(args.workload, Workload::Uncontended) {
        target!(1, spawned, target);
        let mut processes: Vec<(&'static str, u32)> = target
            .pids
            .iter()
            .flatten()
            .map(|&pid| ("sidecar", pid))
            .collect();
        if let Some(c) = counter.as_mut().filter(|c| !c.is_postgres()) {
            processes.extend(c.local_pids().await);
        }
        for &c in uncontended_clients {
            eprintln!("[{label}] uncontended, {c} clients");
            let mut processes = processes.clone();
            if counter.as_ref().is_some_and(Counter::is_postgres) {
                // The sidecar opens its connections, and with them the
                // server's processes, as the load asks: open them first.
                let lockers = (0..c).map(|i| target.locker_for(0, i)).collect();
                let warm = Duration::from_millis(500);
                let _ = workloads::uncontended(lockers, warm, run_id, &mut None, None, &[]).await;
                if let Some(counter) = counter.as_mut() {
                    processes.extend(counter.local_pids().await);
                }
            }
            let lockers = (0..c).map(|i| target.locker_for(0, i)).collect();
            match workloads::uncontended(
                lockers,
                args.duration,
                run_id,
                &mut counter,
                None,
                &processes,
            )
            .await
            {
                Ok(r) => run.uncontended.push(r),
                Err(e) => run.errors.push(format!("uncontended {c}: {e}")),
            }
            // The same over the sidecar's Unix socket, when it has one.
            if let Some(socket) = spawned
                .as_ref()
                .and_then(|s| s.sidecars.first())
                .and_then(|s| s.socket_url.clone())
            {
                eprintln!("[{label}] uncontended over a Unix socket, {c} clients");
                let lockers = (0..c)
                    .map(|_| Locker::sidecar(&socket, args.api_token.as_deref()))
                    .collect();
                match workloads::uncontended(
                    lockers,
                    args.duration,
                    &format!("{run_id}-unix"),
                    &mut counter,
                    None,
                    &processes,
                )
                .await
                {
                    Ok(r) => run.uncontended_unix.push(r),
                    Err(e) => run.errors.push(format!("uncontended unix {c}: {e}")),
                }
            }
        }
        drop(spawned);
    }
    if has(args.workload, Workload::Contended) {
        target!(pair, spawned, target);
        let sidecars: Vec<(&'static str, u32)> = target
            .pids
            .iter()
            .flatten()
            .map(|&pid| ("sidecar", pid))
            .collect();
        for &c in contended_clients {
            eprintln!("[{label}] contended, {c} clients");
            let name = format!("bench-c-{run_id}-{c}");
            let mut processes = sidecars.clone();
            if let Some(counter) = counter.as_mut() {
                if counter.is_postgres() {
                    // The sidecars open their connections, and with them
                    // the server's processes, as the load asks: open them first.
                    let lockers = (0..c).map(|i| target.locker_for(i, i)).collect();
                    let warm = Duration::from_millis(500);
                    let _ =
                        workloads::contended(lockers, 0, warm, &name, &mut None, None, &[]).await;
                }
                processes.extend(counter.local_pids().await);
            }
            let lockers = (0..c).map(|i| target.locker_for(i, i)).collect();
            match workloads::contended(
                lockers,
                target.urls.len(),
                args.duration,
                &name,
                &mut counter,
                None,
                &processes,
            )
            .await
            {
                Ok(r) => run.contended.push(r),
                Err(e) => run.errors.push(format!("contended {c}: {e}")),
            }
        }
        drop(spawned);
    }
    if has(args.workload, Workload::Idle) {
        for &w in &args.waiters {
            target!(pair, spawned, target);
            eprintln!("[{label}] idle, {w} waiters");
            let name = format!("bench-i-{run_id}-{w}");
            match workloads::idle_sidecar(&target, w, args.idle_duration, &name, &mut counter).await
            {
                Ok(r) => run.idle.push(r),
                Err(e) => run.errors.push(format!("idle {w}: {e}")),
            }
            drop(spawned);
            target!(pair, spawned, target);
            eprintln!("[{label}] idle, {w} holds");
            let name = format!("bench-h-{run_id}-{w}");
            match workloads::idle_holds(&target, w, args.idle_duration, &name, &mut counter).await {
                Ok(r) => run.holds.push(r),
                Err(e) => run.errors.push(format!("holds {w}: {e}")),
            }
            drop(spawned);
        }
    }
    if has(args.workload, Workload::Crash) {
        target!(pair, spawned, target);
        eprintln!("[{label}] crash");
        let mut spawned = spawned;
        let respawn = match (&mut spawned, spawn) {
            (Some(s), Some(b)) if shared => Some((&mut s.sidecars, b)),
            _ => None,
        };
        match workloads::crash(&target, args.crash_rounds, run_id, respawn).await {
            Ok(r) => run.crash = Some(r),
            Err(e) => run.errors.push(format!("crash: {e}")),
        }
        drop(spawned);
    }
    if has(args.workload, Workload::Failover) {
        target!(pair, spawned, target);
        eprintln!("[{label}] failover");
        let mut spawned = spawned;
        let respawn = match (&mut spawned, spawn) {
            (Some(s), Some(b)) if shared => Some((&mut s.sidecars, b)),
            _ => None,
        };
        match crate::failover::failover(&target, args.crash_rounds, run_id, respawn).await {
            Ok(r) => run.failover = Some(r),
            Err(e) => run.errors.push(format!("failover: {e}")),
        }
        drop(spawned);
        // The partition needs a Redis of its own behind a link it can cut.
        let redis = spawn.is_some_and(|b| b.starts_with("redis://"));
        // SAFETY: geteuid only reads the process credentials.
        if redis && unsafe { libc::geteuid() } == 0 {
            eprintln!("[{label}] partition");
            match crate::failover::partition(args.crash_rounds.clamp(1, 3), run_id).await {
                Ok(p) => {
                    if p.overlaps > 0 {
                        run.errors.push(format!(
                            "partition: a new leader led before the cut-off one heard lost in {} round(s)",
                            p.overlaps
                        ));
                    }
                    if let Some(f) = run.failover.as_mut() {
                        f.partition = Some(p);
                    }
                }
                Err(e) => run.errors.push(format!("partition: {e}")),
            }
        }
    }
    if has(args.workload, Workload::Startup)
        && let Some(b) = spawn
    {
        eprintln!("[{label}] startup");
        match workloads::startup(b, args.startup_rounds).await {
            Ok(r) => run.startup = Some(r),
            Err(e) => run.errors.push(format!("startup: {e}")),
        }
    }
}

impl Target {
    /// Client `i` on sidecar `sidecar` (modulo the sidecars there are).
    fn locker_for(&self, sidecar: usize, _i: usize) -> Locker {
        Locker::sidecar(
            &self.urls[sidecar % self.urls.len()],
            self.api_token.as_deref(),
        )
    }
}

async fn baselines(
    args: &BenchArgs,
    redis: &str,
    uncontended_clients: &[usize],
    contended_clients: &[usize],
    run_id: &str,
) -> Baselines {
    let mut out = Baselines::default();
    let mut counter = counter(Some(redis)).await;
    let rt = Arc::new(AtomicU64::new(0));
    if has(args.workload, Workload::Uncontended) {
        let processes = match counter.as_mut() {
            Some(c) => c.local_pids().await,
            None => Vec::new(),
        };
        for &c in uncontended_clients {
            eprintln!("[direct redis] uncontended, {c} clients");
            let mut lockers = Vec::new();
            for _ in 0..c {
                match Locker::redis(redis, None, rt.clone()).await {
                    Ok(l) => lockers.push(l),
                    Err(e) => {
                        out.errors.push(e);
                        return out;
                    }
                }
            }
            match workloads::uncontended(
                lockers,
                args.duration,
                &format!("d-{run_id}"),
                &mut counter,
                Some(&rt),
                &processes,
            )
            .await
            {
                Ok(r) => out.direct_redis.push(r),
                Err(e) => out.errors.push(format!("direct {c}: {e}")),
            }
        }
    }
    for &poll in &args.poll {
        let mut p = Polling {
            poll_ms: poll.as_secs_f64() * 1e3,
            contended: Vec::new(),
            idle: Vec::new(),
        };
        if has(args.workload, Workload::Contended) {
            for &c in contended_clients {
                eprintln!("[polling {poll:?}] contended, {c} clients");
                let mut lockers = Vec::new();
                for _ in 0..c {
                    match Locker::redis(redis, Some(poll), rt.clone()).await {
                        Ok(l) => lockers.push(l),
                        Err(e) => out.errors.push(e),
                    }
                }
                let name = format!("bench-pc-{run_id}-{}-{c}", poll.as_millis());
                let processes = match counter.as_mut() {
                    Some(c) => c.local_pids().await,
                    None => Vec::new(),
                };
                match workloads::contended(
                    lockers,
                    0,
                    args.duration,
                    &name,
                    &mut counter,
                    Some(&rt),
                    &processes,
                )
                .await
                {
                    Ok(r) => p.contended.push(r),
                    Err(e) => out.errors.push(format!("polling contended {c}: {e}")),
                }
            }
        }
        if has(args.workload, Workload::Idle) {
            for &w in &args.waiters {
                eprintln!("[polling {poll:?}] idle, {w} waiters");
                let name = format!("bench-pi-{run_id}-{}-{w}", poll.as_millis());
                match workloads::idle_polling(
                    redis,
                    poll,
                    w,
                    args.idle_duration,
                    &name,
                    &mut counter,
                )
                .await
                {
                    Ok(r) => p.idle.push(r),
                    Err(e) => out.errors.push(format!("polling idle {w}: {e}")),
                }
            }
        }
        out.polling.push(p);
    }
    out
}

/// The PostgreSQL plain recipe: a session advisory lock per client
/// connection, waiting in the server (`pg_advisory_lock`).
async fn postgres_baselines(
    args: &BenchArgs,
    url: &str,
    uncontended_clients: &[usize],
    contended_clients: &[usize],
    run_id: &str,
    out: &mut Baselines,
) {
    let mut counter = counter(Some(url)).await;
    let rt = Arc::new(AtomicU64::new(0));
    let lockers = async |c: usize, errors: &mut Vec<String>| {
        let mut lockers = Vec::new();
        for _ in 0..c {
            match Locker::postgres(url, rt.clone()).await {
                Ok(l) => lockers.push(l),
                Err(e) => {
                    errors.push(e);
                    return None;
                }
            }
        }
        Some(lockers)
    };
    if has(args.workload, Workload::Uncontended) {
        for &c in uncontended_clients {
            eprintln!("[direct postgres] uncontended, {c} clients");
            let Some(lockers) = lockers(c, &mut out.errors).await else {
                return;
            };
            let processes = match counter.as_mut() {
                Some(c) => c.local_pids().await,
                None => Vec::new(),
            };
            match workloads::uncontended(
                lockers,
                args.duration,
                &format!("pg-{run_id}"),
                &mut counter,
                Some(&rt),
                &processes,
            )
            .await
            {
                Ok(r) => out.direct_postgres.push(r),
                Err(e) => out.errors.push(format!("direct postgres {c}: {e}")),
            }
        }
    }
    if has(args.workload, Workload::Contended) {
        let room = connection_room(url).await;
        for &c in contended_clients {
            // The recipe needs a session per client: more than the server
            // takes is no measurement (sidelock's pool stays small).
            if room.is_some_and(|room| c > room) {
                eprintln!(
                    "[direct postgres] contended, {c} clients: skipped, the server takes {} more connections",
                    room.unwrap_or(0)
                );
                continue;
            }
            eprintln!("[direct postgres] contended, {c} clients");
            let Some(lockers) = lockers(c, &mut out.errors).await else {
                return;
            };
            let name = format!("bench-pgc-{run_id}-{c}");
            // The recipe's sessions are open: their server processes run.
            let processes = match counter.as_mut() {
                Some(counter) => counter.local_pids().await,
                None => Vec::new(),
            };
            match workloads::contended(
                lockers,
                0,
                args.duration,
                &name,
                &mut counter,
                Some(&rt),
                &processes,
            )
            .await
            {
                Ok(r) => out.direct_postgres_contended.push(r),
                Err(e) => out
                    .errors
                    .push(format!("direct postgres contended {c}: {e}")),
            }
        }
    }
}

/// How many more connections the PostgreSQL server at `url` takes
/// (`max_connections` less those open and its superuser reserve), if it says.
async fn connection_room(url: &str) -> Option<usize> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .ok()?;
    tokio::spawn(conn);
    let row = client
        .query_one(
            "SELECT current_setting('max_connections')::int
                    - current_setting('superuser_reserved_connections')::int
                    - (SELECT count(*) FROM pg_stat_activity)::int",
            &[],
        )
        .await
        .ok()?;
    usize::try_from(row.get::<_, i32>(0)).ok()
}
