//! `sidelock serve` as a child process on an ephemeral loopback port.

use std::ffi::OsString;
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tempfile::TempDir;

use super::api::Api;
use super::process::ChildGuard;
use super::{POLL_INTERVAL, START_TIMEOUT};

/// The path of the binary under test, built by Cargo for integration tests.
pub const SIDELOCK_BIN: &str = env!("CARGO_BIN_EXE_sidelock");

/// What the sidecar logs once it has bound its listener, before `<ip>:<port>`.
const LISTENING_MARKER: &str = "listening on ";

/// Extra flags, environment and config file for one sidecar.
///
/// Always passes `serve --listen 127.0.0.1:0 --backend <url>`; every
/// inherited `SIDELOCK_*` variable is removed so the developer's shell cannot
/// leak into a test.
#[must_use]
pub struct SidecarBuilder {
    backend_url: String,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    config_toml: Option<String>,
    /// Address to listen on (an IPv4 address of the host or of `netns`).
    listen_ip: String,
    /// Network namespace to run in (`ip netns exec`).
    netns: Option<String>,
    /// Soft and hard limit of open files of the sidecar, if lowered.
    open_files: Option<u64>,
}

impl SidecarBuilder {
    pub fn new(backend_url: &str) -> Self {
        Self {
            backend_url: backend_url.to_owned(),
            args: Vec::new(),
            env: vec![
                ("NO_COLOR".into(), "1".into()),
                ("SIDELOCK_LOG".into(), "info,sidelock=debug".into()),
            ],
            config_toml: None,
            listen_ip: "127.0.0.1".into(),
            netns: None,
            open_files: None,
        }
    }

    /// Runs the sidecar inside `ns`, listening on `listen_ip` (the namespace
    /// end of one of its links, which the test reaches from the host).
    ///
    /// Clients call it by that address, so it is an allowed `Host`.
    pub fn netns(mut self, ns: &super::netns::Netns, listen_ip: &str) -> Self {
        self.netns = Some(ns.name().to_owned());
        self.listen_ip = listen_ip.to_owned();
        self.env("SIDELOCK_ALLOWED_HOSTS", listen_ip)
    }

    /// Starts the sidecar with at most `limit` open files (soft and hard
    /// `RLIMIT_NOFILE`), so tests can reach the limit.
    pub fn open_files(mut self, limit: u64) -> Self {
        self.open_files = Some(limit);
        self
    }

    /// Appends one raw command-line argument.
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Appends `--<name> <value>`.
    pub fn flag(self, name: &str, value: &str) -> Self {
        self.arg(format!("--{name}")).arg(value)
    }

    /// Sets an environment variable for the sidecar.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Runs the sidecar with its wall clock `seconds` ahead (negative:
    /// behind) of the host's, under libfaketime (`scripts/setup.sh`
    /// installs it); its monotonic clock is left as it is.
    pub fn clock_ahead(self, seconds: i32) -> Self {
        let library = super::postgres::faketime_library();
        self.env("LD_PRELOAD", &library.to_string_lossy())
            .env("FAKETIME", &format!("{seconds:+}"))
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
    }

    /// `SIDELOCK_API_TOKEN`: every `/v1` call then needs the bearer token.
    pub fn api_token(self, token: &str) -> Self {
        self.env("SIDELOCK_API_TOKEN", token)
    }

    /// `SIDELOCK_ADMIN_TOKEN`: enables the admin API.
    pub fn admin_token(self, token: &str) -> Self {
        self.env("SIDELOCK_ADMIN_TOKEN", token)
    }

    pub fn sidecar_id(self, id: &str) -> Self {
        self.flag("sidecar-id", id)
    }

    pub fn default_ttl(self, duration: &str) -> Self {
        self.flag("default-ttl", duration)
    }

    pub fn max_ttl(self, duration: &str) -> Self {
        self.flag("max-ttl", duration)
    }

    pub fn max_wait(self, duration: &str) -> Self {
        self.flag("max-wait", duration)
    }

    pub fn max_waiters(self, count: u32) -> Self {
        self.flag("max-waiters", &count.to_string())
    }

    pub fn lock_delay(self, duration: &str) -> Self {
        self.flag("lock-delay", duration)
    }

    pub fn stale_after(self, duration: &str) -> Self {
        self.flag("stale-after", duration)
    }

    pub fn shutdown_grace(self, duration: &str) -> Self {
        self.flag("shutdown-grace", duration)
    }

    /// Writes `contents` to `sidelock.toml` in the sidecar's directory and
    /// passes `--config <that file>`.
    pub fn config_toml(mut self, contents: &str) -> Self {
        self.config_toml = Some(contents.to_owned());
        self
    }

    /// Starts the sidecar and waits until it logs its listening address.
    pub async fn start(self) -> SidecarGuard {
        let dir = tempfile::Builder::new()
            .prefix("sidelock-test-")
            .tempdir()
            .expect("create temp dir");
        let mut cmd = match &self.netns {
            None => Command::new(SIDELOCK_BIN),
            Some(ns) => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", ns, SIDELOCK_BIN]);
                cmd
            }
        };
        cmd.current_dir(dir.path());
        remove_inherited_sidelock_env(&mut cmd);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.arg("serve")
            .arg("--listen")
            .arg(format!("{}:0", self.listen_ip))
            .arg("--backend")
            .arg(&self.backend_url);
        if let Some(contents) = &self.config_toml {
            let path = dir.path().join("sidelock.toml");
            std::fs::write(&path, contents).expect("write sidelock.toml");
            cmd.arg("--config").arg(path);
        }
        cmd.args(&self.args);
        if let Some(limit) = self.open_files {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe and touches no memory of the parent.
            unsafe {
                cmd.pre_exec(move || {
                    nix::sys::resource::setrlimit(
                        nix::sys::resource::Resource::RLIMIT_NOFILE,
                        limit,
                        limit,
                    )
                    .map_err(std::io::Error::from)
                });
            }
        }

        let log_path = dir.path().join("sidelock.log");
        let mut child = ChildGuard::spawn(cmd, "sidecar", &log_path, false);
        let port = wait_for_listening(&mut child, &self.listen_ip).await;
        if self.netns.is_some() {
            wait_for_route(&self.listen_ip, port).await;
        }
        SidecarGuard {
            child,
            port,
            base_url: format!("http://{}:{port}", self.listen_ip),
            _dir: dir,
        }
    }
}

/// Waits until the host reaches `ip:port` (a sidecar in a namespace: its
/// link may take a moment to carry traffic after it came up).
async fn wait_for_route(ip: &str, port: u16) {
    let addr: std::net::SocketAddr = format!("{ip}:{port}").parse().expect("listen address");
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let connect = tokio::net::TcpStream::connect(addr);
        match tokio::time::timeout(Duration::from_millis(500), connect).await {
            Ok(Ok(_)) => return,
            other => assert!(
                Instant::now() < deadline,
                "the host cannot reach the sidecar at {addr} in its namespace: {other:?}"
            ),
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Removes every `SIDELOCK_*` variable the test process inherited.
pub fn remove_inherited_sidelock_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("SIDELOCK_") {
            cmd.env_remove(key);
        }
    }
}

async fn wait_for_listening(child: &mut ChildGuard, ip: &str) -> u16 {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Some(port) = parse_listening_port(&child.log(), ip) {
            return port;
        }
        if let Some(status) = child.try_status() {
            panic!("sidecar exited ({status}) before it was listening");
        }
        assert!(
            Instant::now() < deadline,
            "sidecar did not log `{LISTENING_MARKER}{ip}:PORT` within {START_TIMEOUT:?}"
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// The port from the first `listening on IP:PORT` in `log`.
fn parse_listening_port(log: &str, ip: &str) -> Option<u16> {
    let log = strip_ansi(log);
    let marker = format!("{LISTENING_MARKER}{ip}:");
    let start = log.find(&marker)? + marker.len();
    let digits: String = log[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok().filter(|&port| port != 0)
}

/// Removes ANSI escape sequences (`ESC [ … letter`), in case the log is coloured.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A running sidecar; SIGKILLed and reaped on drop (its log is printed if the
/// test is panicking).
pub struct SidecarGuard {
    // Dropped before `_dir`, so the log still exists when it is printed.
    child: ChildGuard,
    port: u16,
    base_url: String,
    _dir: TempDir,
}

impl SidecarGuard {
    /// `http://127.0.0.1:PORT`, without a trailing slash.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Everything the sidecar has logged so far.
    pub fn log(&self) -> String {
        self.child.log()
    }

    /// A client without credentials.
    pub fn api(&self) -> Api {
        Api::new(&self.base_url)
    }

    /// A client sending `Authorization: Bearer <token>`.
    pub fn api_with_token(&self, token: &str) -> Api {
        self.api().with_bearer(token)
    }

    pub fn signal(&self, signal: Signal) {
        self.child.signal(signal);
    }

    /// The sidecar's process id.
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Sends SIGTERM (graceful shutdown).
    pub fn terminate(&self) {
        self.signal(Signal::SIGTERM);
    }

    /// Waits for the sidecar to exit, panicking after `timeout`.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        self.child.wait_exit(timeout).await
    }
}

#[cfg(test)]
mod tests {
    use super::parse_listening_port;

    #[test]
    fn parses_port_from_plain_and_coloured_logs() {
        let plain =
            "2026-01-01T00:00:00Z  INFO sidelock: listening on 127.0.0.1:40123 backend=memory://\n";
        let ip = "127.0.0.1";
        assert_eq!(parse_listening_port(plain, ip), Some(40123));
        let coloured = "\u{1b}[32m INFO\u{1b}[0m listening on 127.0.0.1:7070\n";
        assert_eq!(parse_listening_port(coloured, ip), Some(7070));
        assert_eq!(parse_listening_port("starting\n", ip), None);
        assert_eq!(parse_listening_port("listening on 127.0.0.1:0\n", ip), None);
        let ns = "listening on 10.100.3.2:7071\n";
        assert_eq!(parse_listening_port(ns, "10.100.3.2"), Some(7071));
    }
}
