//! Processes the bench starts itself: sidecars (`sidelock serve`, from the
//! `sidelock` binary beside this one or `--sidelock`) on free loopback ports,
//! killed when dropped; `redis-server`s (the test-support crate's, shared
//! with the tests); plus RSS and CPU time of processes on this machine.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sidelock_test_support::free_port;
use sidelock_test_support::redis::RedisServer;
use tokio::process::{Child, Command};

/// How long a started process may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The `sidelock` executable the bench starts sidecars and `sidelock run` from.
static SIDELOCK: OnceLock<PathBuf> = OnceLock::new();

/// Sets the `sidelock` executable: `path`, else `sidelock` beside this
/// executable (where cargo builds both), else `sidelock` on `PATH`.
pub fn use_sidelock(path: Option<PathBuf>) {
    let beside = || {
        let exe = std::env::current_exe().ok()?;
        let candidate = exe.parent()?.join("sidelock");
        candidate.is_file().then_some(candidate)
    };
    let chosen = path
        .or_else(beside)
        .unwrap_or_else(|| PathBuf::from("sidelock"));
    let _ = SIDELOCK.set(chosen);
}

/// The `sidelock` executable chosen by [`use_sidelock`].
pub fn sidelock() -> &'static Path {
    SIDELOCK.get_or_init(|| PathBuf::from("sidelock"))
}

/// Raises this process's soft limit of open files to its hard limit and
/// returns the new soft limit (10,000 waiters are 10,000 connections).
pub fn raise_fd_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
                hard
            } else {
                soft
            }
        }
        Ok((soft, _)) => soft,
        Err(_) => 0,
    }
}

/// A `redis-server` with no persistence on a free port, for `--spawn-redis`
/// and `--spawn-redlock`, taking as many clients as the idle workload opens.
pub async fn start_redis() -> RedisServer {
    RedisServer::start_with(&["--maxclients", "20000"]).await
}

/// Resident set size of `pid` in KiB (`VmRSS` in `/proc/<pid>/status`).
#[must_use]
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// CPU time `pid` has used, all its threads, in clock ticks (`utime +
/// stime` of `/proc/<pid>/stat`).
#[must_use]
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces: count after it.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The CPU time processes use during a measurement, by role (`bench`,
/// `sidecar`, `redis`); the processes of one role are summed.
pub struct CpuMeter {
    /// Role, PID and its CPU ticks at the start.
    start: Vec<(&'static str, u32, u64)>,
}

impl CpuMeter {
    /// Starts measuring this process (`bench`) and `others`; a process
    /// that cannot be read (gone, or not on this machine) is left out.
    #[must_use]
    pub fn start(others: &[(&'static str, u32)]) -> Self {
        let start = std::iter::once(("bench", std::process::id()))
            .chain(others.iter().copied())
            .filter_map(|(role, pid)| Some((role, pid, cpu_ticks(pid)?)))
            .collect();
        Self { start }
    }

    /// Microseconds of CPU per operation for each role since the start.
    #[must_use]
    pub fn per_op(&self, ops: u64) -> std::collections::BTreeMap<&'static str, f64> {
        // SAFETY: sysconf only reads a configuration value.
        let ticks_per_s = match unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
            t if t > 0 => t as f64,
            _ => 100.0,
        };
        let mut out = std::collections::BTreeMap::new();
        for &(role, pid, before) in &self.start {
            if let Some(now) = cpu_ticks(pid) {
                let us = now.saturating_sub(before) as f64 / ticks_per_s * 1e6;
                *out.entry(role).or_insert(0.0) += us / ops.max(1) as f64;
            }
        }
        for v in out.values_mut() {
            *v = (*v * 10.0).round() / 10.0;
        }
        out
    }
}

/// Where a started sidecar's log goes: `$TMPDIR/sidelock-bench-<id>.log`
/// (the bench prints its path when a measurement fails).
fn log_file(id: &str) -> Stdio {
    let path = std::env::temp_dir().join(format!("sidelock-bench-{id}.log"));
    std::fs::File::create(path).map_or_else(|_| Stdio::null(), Stdio::from)
}

/// A `sidelock serve` child on a free port.
pub struct Sidecar {
    pub child: Child,
    pub url: String,
    /// `unix:<path>` of the socket it also listens on (not in a netns).
    pub socket_url: Option<String>,
    pub pid: u32,
    /// Time from spawn to the first `GET /readyz` 200.
    pub ready_after: Duration,
}

impl Sidecar {
    /// Starts `sidelock serve --backend <backend>` and waits until `/readyz` answers 200.
    ///
    /// # Errors
    /// When the process cannot start or is not ready in time.
    pub async fn start(backend: &str, id: &str) -> Result<Self, String> {
        Self::start_in(backend, id, None).await
    }

    /// [`Sidecar::start`], inside the network namespace `netns` (its name,
    /// and the address of the namespace to listen on) when given.
    ///
    /// # Errors
    /// When the process cannot start or is not ready in time.
    pub async fn start_in(
        backend: &str,
        id: &str,
        netns: Option<(&str, &str)>,
    ) -> Result<Self, String> {
        let port = free_port();
        let host = netns.map_or("127.0.0.1", |(_, ip)| ip);
        let url = format!("http://{host}:{port}");
        let mut cmd = match netns {
            Some((ns, _)) => {
                // `ip netns exec` execs the program: the child is the sidecar.
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", ns]).arg(sidelock());
                cmd
            }
            None => Command::new(sidelock()),
        };
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("SIDELOCK_") {
                cmd.env_remove(key);
            }
        }
        // Outside a namespace it also listens on a Unix socket (removed by
        // the sidecar at exit), for the transport comparison.
        let socket = netns.is_none().then(|| {
            std::env::temp_dir().join(format!("sidelock-bench-{}-{port}.sock", std::process::id()))
        });
        let mut listen = format!("{host}:{port}");
        if let Some(path) = &socket {
            let _ = std::fs::remove_file(path);
            listen.push_str(&format!(",unix:{}", path.display()));
        }
        cmd.args(["serve", "--listen", &listen])
            .args(["--backend", backend, "--sidecar-id", id])
            .args(["--max-waiters", "100000"])
            .env("SIDELOCK_LOG", "warn")
            // Called by its namespace address, which is then an allowed Host.
            .env("SIDELOCK_ALLOWED_HOSTS", host)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file(id))
            .kill_on_drop(true);
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {} serve: {e}", sidelock().display()))?;
        let pid = child.id().unwrap_or(0);
        let probe = reqwest::Client::builder()
            .no_proxy()
            .build()
            .map_err(|e| e.to_string())?;
        let ready = format!("{url}/readyz");
        loop {
            if let Ok(r) = probe.get(&ready).send().await
                && r.status().is_success()
            {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "sidelock serve --backend {backend} exited with {status} before it was ready"
                ));
            }
            if started.elapsed() > READY_TIMEOUT {
                return Err(format!(
                    "sidelock serve --backend {backend} not ready after {READY_TIMEOUT:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(Self {
            child,
            url,
            socket_url: socket.map(|p| format!("unix:{}", p.display())),
            pid,
            ready_after: started.elapsed(),
        })
    }

    /// SIGKILL, and reap.
    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }
}

/// Starts a `sidelock` client subcommand (`run`, `campaign`) in a process
/// group of its own, so that [`kill_group`] kills it and its command.
///
/// # Errors
/// When the process cannot start.
pub fn spawn_client(args: &[&str], api_token: Option<&str>) -> Result<Child, String> {
    let mut cmd = Command::new(sidelock());
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .kill_on_drop(true);
    if let Some(tok) = api_token {
        cmd.env("SIDELOCK_API_TOKEN", tok);
    }
    cmd.spawn()
        .map_err(|e| format!("cannot start {} {}: {e}", sidelock().display(), args[0]))
}

/// SIGKILL to the process group of `child` (started by [`spawn_client`]).
pub fn kill_group(child: &Child) {
    if let Some(pgid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pgid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}
