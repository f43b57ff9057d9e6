//! What a run measured: the report `--json` writes, the headline figures
//! BENCHMARKS.md quotes, and the Markdown tables printed at the end.

use serde::Serialize;

use crate::workloads::{Contended, Crash, Idle, Startup, Uncontended};

/// The machine the bench ran on.
#[derive(Debug, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: Option<String>,
    pub kernel: Option<String>,
    pub loadavg_before: Option<String>,
    pub loadavg_after: Option<String>,
    pub fd_limit: u64,
}

/// Results of one backend.
#[derive(Debug, Default, Serialize)]
pub struct BackendRun {
    pub backend: String,
    /// Sidecars started by the bench (false: --url).
    pub spawned: bool,
    pub uncontended: Vec<Uncontended>,
    /// The uncontended workload again over each sidecar's Unix socket.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub uncontended_unix: Vec<Uncontended>,
    pub contended: Vec<Contended>,
    pub idle: Vec<Idle>,
    /// Workload 3 with hold streams (one lock each) instead of waiters.
    pub holds: Vec<Idle>,
    pub crash: Option<Crash>,
    pub failover: Option<crate::failover::Failover>,
    pub startup: Option<Startup>,
    pub errors: Vec<String>,
}

/// The polling baseline with one sleep.
#[derive(Debug, Serialize)]
pub struct Polling {
    pub poll_ms: f64,
    pub contended: Vec<Contended>,
    pub idle: Vec<Idle>,
}

/// The plain recipes on the same backends: Redis (direct and polling) and
/// PostgreSQL (session advisory locks).
#[derive(Debug, Default, Serialize)]
pub struct Baselines {
    pub direct_redis: Vec<Uncontended>,
    pub polling: Vec<Polling>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub direct_postgres: Vec<Uncontended>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub direct_postgres_contended: Vec<Contended>,
    pub errors: Vec<String>,
}

/// Everything `--json` writes.
#[derive(Debug, Serialize)]
pub struct Report {
    pub version: &'static str,
    pub started_at_ms: u64,
    pub machine: Machine,
    pub settings: serde_json::Value,
    pub runs: Vec<BackendRun>,
    pub baselines: Option<Baselines>,
    pub headline: serde_json::Value,
}

/// Milliseconds since the Unix epoch, for the report's start time and run ids.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub(crate) fn read_trim(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

pub(crate) fn machine(fd_limit: u64) -> Machine {
    Machine {
        cpus: std::thread::available_parallelism().map_or(0, usize::from),
        cpu_model: std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        }),
        kernel: read_trim("/proc/sys/kernel/osrelease"),
        loadavg_before: read_trim("/proc/loadavg"),
        loadavg_after: None,
        fd_limit,
    }
}

fn is_redis(run: &BackendRun) -> bool {
    run.backend.starts_with("redis://") || run.backend.starts_with("rediss://")
}

/// The figures the README quotes, all from this run.
pub(crate) fn headline(r: &Report) -> serde_json::Value {
    let mut h = serde_json::Map::new();
    let sidelock = r.runs.iter().find(|r| is_redis(r));
    if let (Some(s), Some(b)) = (sidelock, &r.baselines) {
        for u in &s.uncontended {
            if let Some(d) = b.direct_redis.iter().find(|d| d.clients == u.clients)
                && d.pairs_per_s > 0.0
            {
                h.insert(
                    format!("uncontended_{}_ratio_pairs_per_s", u.clients),
                    serde_json::json!((u.pairs_per_s / d.pairs_per_s * 100.0).round() / 100.0),
                );
                h.insert(
                    format!("uncontended_{}_acquire_p50_extra_us", u.clients),
                    serde_json::json!(u.acquire.p50_us as i64 - d.acquire.p50_us as i64),
                );
            }
        }
        for c in &s.contended {
            h.insert(
                format!("contended_{}_handoff_p50_us", c.clients),
                serde_json::json!(c.handoff.p50_us),
            );
            for p in &b.polling {
                if let Some(pc) = p.contended.iter().find(|pc| pc.clients == c.clients) {
                    h.insert(
                        format!(
                            "contended_{}_polling_{}ms_handoff_p50_us",
                            c.clients, p.poll_ms
                        ),
                        serde_json::json!(pc.handoff.p50_us),
                    );
                }
            }
        }
    }
    serde_json::Value::Object(h)
}

/// A table of idle waiters or holds; `columns`: the count, the granted or
/// queued count, the per-item RSS heading.
fn print_idle(title: &str, columns: [&str; 3], rows: &[(String, &Idle)]) {
    if rows.is_empty() {
        return;
    }
    let [count, granted, per] = columns;
    println!("\n## {title}\n");
    println!(
        "| system | {count} | {granted} | round trips/s | commands/s | sidecar RSS MiB | {per} |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (label, i) in rows {
        println!(
            "| {label} | {} | {} | {} | {} | {} | {} |",
            i.waiters,
            match (i.queued, i.waiter_errors) {
                (None, _) => "-".into(),
                (Some(q), 0) => q.to_string(),
                (Some(q), e) => format!("{q} ({e} refused)"),
            },
            opt(i.round_trips_per_s),
            opt(i.commands_per_s),
            opt(i.rss_kib.map(|k| (k as f64 / 1024.0 * 10.0).round() / 10.0)),
            opt(i.rss_per_waiter_kib)
        );
    }
    for (label, i) in rows {
        if let Some(s) = i.queued_in_s {
            println!("\n{label}: {} {count} queued in {s} s", i.waiters);
        }
        for why in &i.waiter_error_samples {
            println!("\n{label}: refused: {why}");
        }
    }
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v}"))
}

/// `bench 48 + redis 83 + sidecar 93 = 224`, or `-` when nothing was read.
fn cpu_shares(shares: &std::collections::BTreeMap<&'static str, f64>) -> String {
    if shares.is_empty() {
        return "-".into();
    }
    let parts: Vec<String> = shares
        .iter()
        .map(|(role, us)| format!("{role} {us:.0}"))
        .collect();
    format!(
        "{} = {:.0}",
        parts.join(" + "),
        shares.values().sum::<f64>()
    )
}

pub(crate) fn print_tables(r: &Report) {
    let m = &r.machine;
    println!(
        "machine: {} cpus, {}, kernel {}, load before {}",
        m.cpus,
        m.cpu_model.as_deref().unwrap_or("?"),
        m.kernel.as_deref().unwrap_or("?"),
        m.loadavg_before.as_deref().unwrap_or("?")
    );
    let mut unc: Vec<(String, &Uncontended)> = Vec::new();
    let mut con: Vec<(String, &Contended)> = Vec::new();
    let mut idle: Vec<(String, &Idle)> = Vec::new();
    for run in &r.runs {
        unc.extend(run.uncontended.iter().map(|u| (run.backend.clone(), u)));
        unc.extend(
            run.uncontended_unix
                .iter()
                .map(|u| (format!("{} over a Unix socket", run.backend), u)),
        );
        con.extend(run.contended.iter().map(|c| (run.backend.clone(), c)));
        idle.extend(run.idle.iter().map(|i| (run.backend.clone(), i)));
    }
    if let Some(b) = &r.baselines {
        unc.extend(b.direct_redis.iter().map(|u| ("direct redis".into(), u)));
        unc.extend(
            b.direct_postgres
                .iter()
                .map(|u| ("direct postgres (advisory lock)".into(), u)),
        );
        con.extend(
            b.direct_postgres_contended
                .iter()
                .map(|c| ("direct postgres (advisory lock)".into(), c)),
        );
        for p in &b.polling {
            let label = format!("polling {}ms", p.poll_ms);
            con.extend(p.contended.iter().map(|c| (label.clone(), c)));
            idle.extend(p.idle.iter().map(|i| (label.clone(), i)));
        }
    }
    if !unc.is_empty() {
        println!("\n## Uncontended (acquire + release, own lock per client)\n");
        println!(
            "| system | clients | pairs/s | acquire p50/p99/p999 µs | release p50/p99/p999 µs | round trips/pair | commands/pair | CPU µs/pair | errors |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---|---:|");
        for (label, u) in unc {
            println!(
                "| {label} | {} | {:.0} | {}/{}/{} | {}/{}/{} | {} | {} | {} | {} |",
                u.clients,
                u.pairs_per_s,
                u.acquire.p50_us,
                u.acquire.p99_us,
                u.acquire.p999_us,
                u.release.p50_us,
                u.release.p99_us,
                u.release.p999_us,
                opt(u.round_trips_per_pair),
                opt(u.commands_per_pair),
                cpu_shares(&u.cpu_us_per_pair),
                u.errors
            );
        }
    }
    if !con.is_empty() {
        println!("\n## Contended (one lock, hold ~0)\n");
        println!(
            "| system | clients | sidecars | grants/s | handoffs/s | handoff p50/p99 µs | max wait ms | round trips/grant | commands/grant | CPU µs/grant | errors |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|");
        for (label, c) in con {
            println!(
                "| {label} | {} | {} | {:.0} | {:.0} | {}/{} | {:.1} | {} | {} | {} | {} |",
                c.clients,
                c.sidecars,
                c.grants_per_s,
                c.handoffs_per_s,
                c.handoff.p50_us,
                c.handoff.p99_us,
                c.max_wait_ms,
                opt(c.round_trips_per_grant),
                opt(c.commands_per_grant),
                cpu_shares(&c.cpu_us_per_grant),
                c.errors
            );
        }
    }
    print_idle(
        "Idle waiters (lock held, waiters blocked)",
        ["waiters", "queued", "KiB/waiter"],
        &idle,
    );
    let holds: Vec<(String, &Idle)> = r
        .runs
        .iter()
        .flat_map(|run| run.holds.iter().map(move |h| (run.backend.clone(), h)))
        .collect();
    print_idle(
        "Idle holds (hold streams, one lock each, renewed by the watchdog)",
        ["holds", "granted", "KiB/hold"],
        &holds,
    );
    let crash: Vec<_> = r
        .runs
        .iter()
        .filter_map(|run| run.crash.as_ref().map(|c| (&run.backend, c)))
        .collect();
    if !crash.is_empty() {
        println!("\n## Crash (holder gone → next waiter granted)\n");
        println!(
            "| backend | hold stream cut p50/max ms | holder process killed max ms | holding sidecar killed ms (ttl) |"
        );
        println!("|---|---:|---:|---:|");
        for (b, c) in crash {
            println!(
                "| {b} | {}/{} | {} | {} |",
                opt(c.hold_cut_p50_ms),
                opt(c.hold_cut_max_ms),
                opt(c.client_killed_max_ms),
                if c.sidecar_killed_ms.is_empty() {
                    "-".into()
                } else {
                    format!(
                        "{:?} ({} ms)",
                        c.sidecar_killed_ms,
                        c.sidecar_killed_ttl_ms.unwrap_or(0)
                    )
                }
            );
        }
    }
    let failover: Vec<_> = r
        .runs
        .iter()
        .filter_map(|run| run.failover.as_ref().map(|f| (&run.backend, f)))
        .collect();
    if !failover.is_empty() {
        println!("\n## Failover (leader gone → the follower on the other sidecar leads)\n");
        println!(
            "| backend | campaign stream dropped p50/max ms | campaign process killed max ms | leader's sidecar killed ms (ttl) |"
        );
        println!("|---|---:|---:|---:|");
        for (b, f) in failover {
            println!(
                "| {b} | {}/{} | {} | {} |",
                opt(f.stream_dropped_p50_ms),
                opt(f.stream_dropped_max_ms),
                opt(f.process_killed_max_ms),
                if f.sidecar_killed_ms.is_empty() {
                    "-".into()
                } else {
                    format!(
                        "{:?} ({} ms)",
                        f.sidecar_killed_ms,
                        f.sidecar_killed_ttl_ms.unwrap_or(0)
                    )
                }
            );
        }
        for (b, f) in r
            .runs
            .iter()
            .filter_map(|run| Some((&run.backend, run.failover.as_ref()?.partition.as_ref()?)))
        {
            println!(
                "\nPartitioned leader ({b}, ttl {} ms): cut → lost {:?} ms; cut → the other side leads {:?} ms; new leader before lost: {} round(s)",
                f.ttl_ms, f.lost_ms, f.led_ms, f.overlaps
            );
        }
    }
    let start: Vec<_> = r
        .runs
        .iter()
        .filter_map(|run| run.startup.as_ref().map(|s| (&run.backend, s)))
        .collect();
    if !start.is_empty() {
        println!("\n## Startup\n");
        println!("| backend | exec → /readyz 200 p50 ms | idle RSS max MiB |");
        println!("|---|---:|---:|");
        for (b, s) in start {
            println!(
                "| {b} | {} | {:.1} |",
                s.ready_p50_ms,
                s.idle_rss_max_kib as f64 / 1024.0
            );
        }
    }
    if let serde_json::Value::Object(h) = &r.headline
        && !h.is_empty()
    {
        println!("\n## Headline\n");
        for (k, v) in h {
            println!("- {k}: {v}");
        }
    }
    for run in &r.runs {
        for e in run
            .errors
            .iter()
            .chain(run.crash.iter().flat_map(|c| &c.errors))
            .chain(run.failover.iter().flat_map(|f| &f.errors))
        {
            println!("error [{}]: {e}", run.backend);
        }
    }
    if let Some(b) = &r.baselines {
        for e in &b.errors {
            println!("error [baseline]: {e}");
        }
    }
}
