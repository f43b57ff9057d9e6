//! `sidelock-bench`: the load generator behind BENCHMARKS.md, in the spirit
//! of `redis-benchmark` — a separate program that talks to sidecars only
//! over HTTP and links no server code.
//!
//! Against running sidecars (`--url`, `--url2`), or against sidecars it
//! starts itself on free ports (`--backend memory|redis|postgres|URL`,
//! repeatable; the `sidelock` binary beside this one, or `--sidelock PATH`),
//! optionally with its own `redis-server` (`--spawn-redis`). With a Redis URL
//! it also measures the baselines: direct Redis from Rust (`SET NX PX` + Lua
//! release, no sidecar) and the common polling loop (`SET NX PX`, sleep,
//! retry).
//!
//! # Layout
//!
//! * [`urls`]: backend URLs — their hosts, and printed without passwords.
//! * [`procs`]: child sidecars and redis-servers, RSS and CPU readings.
//! * [`client`]: the lock clients (sidelock over HTTP, Redis direct/polling) and latency histograms.
//! * [`counters`]: backend operation counters (Redis `INFO commandstats`, ZooKeeper `mntr`, PostgreSQL `pg_stat_database`).
//! * [`workloads`]: the five workloads.
//! * [`failover`]: leader elections failing over between two sidecars.
//! * [`report`]: the JSON report, its headline and the printed tables.
//! * [`bench`]: the run, from the command line to the report.

mod bench;
mod client;
mod counters;
mod failover;
mod procs;
mod report;
mod urls;
mod workloads;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = bench::BenchArgs::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sidelock-bench: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(bench::bench(args));
    std::process::ExitCode::from(u8::try_from(code).unwrap_or(1))
}
