//! Configuration: flags, `SIDELOCK_*` environment variables and an optional
//! TOML file, with that precedence (flag > env > file > default).
//!
//! The file uses the flags' names in snake_case (`max_ttl = "1h"`) and
//! rejects unknown keys.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Deserializer};

use crate::core::Limits;
use crate::duration::{MAX_DURATION, format_duration, parse_duration};

/// A setting that must never be printed: a token, or a backend URL that may
/// carry a password. `Debug` shows `[redacted]`, so a `?settings` in a log
/// line or a panic message cannot leak it; the value is read through `Deref`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// The value itself.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

impl std::ops::Deref for Secret {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Secret(s.to_owned())
    }
}

/// An address the sidecar listens on (`--listen`): TCP, or a Unix-domain
/// socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Tcp(SocketAddr),
    /// An absolute path; the socket is created with mode 0660 and removed at exit.
    Unix(PathBuf),
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Tcp(addr) => write!(f, "{addr}"),
            Listen::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// The `--listen` forms, for messages.
const LISTEN_FORMS: &str =
    "IP:PORT (127.0.0.1:7070, [::1]:7070), localhost:PORT, :PORT (loopback) or unix:/path/to.sock";

/// Parses one `--listen` value: `IP:PORT`, `localhost:PORT`, `:PORT`
/// (both loopback, 127.0.0.1) or `unix:/absolute/path`.
///
/// # Errors
/// A sentence quoting the value, listing the forms, and guessing what was meant.
pub fn parse_listen(s: &str) -> Result<Listen, String> {
    let s = s.trim();
    let refuse = |hint: &str| Err(format!("{s:?}: expected {LISTEN_FORMS}{hint}"));
    if let Some(path) = s.strip_prefix("unix:") {
        let path = Path::new(path);
        if !path.is_absolute() {
            return refuse(
                "; a socket path must be absolute, e.g. unix:/run/sidelock/sidelock.sock",
            );
        }
        return Ok(Listen::Unix(path.to_owned()));
    }
    let port = |p: &str| p.parse::<u16>().ok();
    if let Some(p) = s.strip_prefix(':').and_then(port) {
        return Ok(Listen::Tcp(SocketAddr::from(([127, 0, 0, 1], p))));
    }
    if let Some(p) = s
        .split_once(':')
        .filter(|(host, _)| host.eq_ignore_ascii_case("localhost"))
        .and_then(|(_, p)| port(p))
    {
        return Ok(Listen::Tcp(SocketAddr::from(([127, 0, 0, 1], p))));
    }
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(Listen::Tcp(addr));
    }
    match s {
        _ if port(s).is_some() => refuse(&format!("; did you mean :{s}?")),
        _ if s.parse::<std::net::IpAddr>().is_ok() || s.eq_ignore_ascii_case("localhost") => {
            refuse(&format!("; give a port too, e.g. {s}:7070"))
        }
        _ => refuse(""),
    }
}

/// One value or a list: `listen = ":7070"` or `listen = [":7070", "unix:/s.sock"]`.
fn de_listen<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<Listen>>, D::Error> {
    // Strings first, parsed after: an untagged enum would replace the
    // parser's message with its own.
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    let texts = match Option::<OneOrMany>::deserialize(d)? {
        None => return Ok(None),
        Some(OneOrMany::One(t)) => vec![t],
        Some(OneOrMany::Many(ts)) => ts,
    };
    texts
        .iter()
        .map(|t| parse_listen(t).map_err(|e| serde::de::Error::custom(format!("listen {e}"))))
        .collect::<Result<_, _>>()
        .map(Some)
}

/// The longest `--dashboard-session-ttl`.
const MAX_DASHBOARD_SESSION_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// The most worker threads `--threads` may ask for.
const MAX_THREADS: usize = 1024;

fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Ms(u64),
        Text(String),
    }
    match Option::<Raw>::deserialize(d)? {
        None => Ok(None),
        Some(Raw::Ms(n)) => Ok(Some(Duration::from_millis(n))),
        Some(Raw::Text(s)) => parse_duration(&s)
            .map(Some)
            .map_err(serde::de::Error::custom),
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Settings of `sidelock serve`; every one optional so the sources can be layered.
#[derive(Debug, Default, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeArgs {
    /// TOML file with the settings below (snake_case keys).
    #[arg(long, env = "SIDELOCK_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Where to listen [default: 127.0.0.1:7070]: IP:PORT, localhost:PORT,
    /// :PORT (loopback) or unix:/path/to.sock (mode 0660, removed at exit);
    /// repeat the flag (or separate with commas) for several; port 0 picks a
    /// free port.
    #[arg(long, env = "SIDELOCK_LISTEN", value_delimiter = ',', value_parser = parse_listen)]
    #[serde(default, deserialize_with = "de_listen")]
    pub listen: Option<Vec<Listen>>,
    /// Backend URL [default: memory://]: memory://, redis://, rediss://,
    /// redis+sentinel://, rediss+sentinel://, redis+cluster://,
    /// rediss+cluster://, redlock://, redlocks://, zk://, postgres://,
    /// postgresql:// (README: "Backends and their guarantees").
    #[arg(long, env = "SIDELOCK_BACKEND", hide_env_values = true)]
    pub backend: Option<Secret>,
    /// This sidecar's id in holder listings [default: hostname-<random>].
    #[arg(long, env = "SIDELOCK_SIDECAR_ID")]
    pub sidecar_id: Option<String>,
    /// Lease ttl when a request gives none [default: 30s].
    #[arg(long, env = "SIDELOCK_DEFAULT_TTL", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "de_duration")]
    pub default_ttl: Option<Duration>,
    /// Longest ttl a request may ask for [default: 1h].
    #[arg(long, env = "SIDELOCK_MAX_TTL", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "de_duration")]
    pub max_ttl: Option<Duration>,
    /// Longest wait a request may ask for [default: 1h].
    #[arg(long, env = "SIDELOCK_MAX_WAIT", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "de_duration")]
    pub max_wait: Option<Duration>,
    /// Default lock-delay after a lease ends by expiry or loss [default: 0s].
    #[arg(long, env = "SIDELOCK_LOCK_DELAY", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "de_duration")]
    pub lock_delay: Option<Duration>,
    /// Holders older than this are listed by /v1/stale [default: 1h].
    #[arg(long, env = "SIDELOCK_STALE_AFTER", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "de_duration")]
    pub stale_after: Option<Duration>,
    /// Waiters per lock in this sidecar before acquires get 429 [default: 10000].
    #[arg(long, env = "SIDELOCK_MAX_WAITERS")]
    pub max_waiters: Option<usize>,
    /// Requests waiting in this sidecar, over all locks, before further waits get 429 [default: 20000].
    #[arg(long, env = "SIDELOCK_MAX_TOTAL_WAITERS")]
    pub max_total_waiters: Option<usize>,
    /// Leases held through this sidecar before further acquires get 429 [default: 100000].
    #[arg(long, env = "SIDELOCK_MAX_HELD")]
    pub max_held: Option<usize>,
    /// Label metrics with lock names (bounded to 500 names) [default: false].
    #[arg(long, env = "SIDELOCK_METRICS_LOCK_LABELS", num_args = 0..=1, default_missing_value = "true")]
    pub metrics_lock_labels: Option<bool>,
    /// Time allowed for releasing everything on SIGTERM [default: 10s].
    #[arg(long, env = "SIDELOCK_SHUTDOWN_GRACE", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "de_duration")]
    pub shutdown_grace: Option<Duration>,
    /// Time a client has to send a whole request head [default: 10s].
    #[arg(long, env = "SIDELOCK_HEADER_READ_TIMEOUT", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "de_duration")]
    pub header_read_timeout: Option<Duration>,
    /// Time a connection may stay idle between requests [default: 60s].
    #[arg(long, env = "SIDELOCK_IDLE_TIMEOUT", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "de_duration")]
    pub idle_timeout: Option<Duration>,
    /// Time a client has to send a request's body after its head [default: 30s].
    #[arg(long, env = "SIDELOCK_BODY_READ_TIMEOUT", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "de_duration")]
    pub body_read_timeout: Option<Duration>,
    /// Time a response may make no progress while the client does not read
    /// it before the connection is closed [default: 30s].
    #[arg(long, env = "SIDELOCK_WRITE_TIMEOUT", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "de_duration")]
    pub write_timeout: Option<Duration>,
    /// Open connections at most (lowered to fit the open-file limit) [default: 30000].
    #[arg(long, env = "SIDELOCK_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Worker threads of the sidecar's runtime [default: the CPUs this
    /// process may use, as its cgroup's CPU limit rounds them].
    #[arg(long, env = "SIDELOCK_THREADS")]
    pub threads: Option<usize>,
    /// Host names (`name` or `name:port`) besides loopback that requests may
    /// carry in `Host`; others get 421 except on the probe routes.
    #[arg(long, env = "SIDELOCK_ALLOWED_HOSTS", value_delimiter = ',')]
    pub allowed_hosts: Option<Vec<String>>,
    /// Log format [default: text].
    #[arg(long, env = "SIDELOCK_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Prefix of every Redis key sidelock writes [default: sidelock:].
    #[arg(long, env = "SIDELOCK_REDIS_PREFIX")]
    pub redis_prefix: Option<String>,
    /// Redis key pattern of hand-written locks (e.g. `lock:*`) listed by /v1/stale when they have no expiry.
    #[arg(long, env = "SIDELOCK_LEGACY_PATTERN")]
    pub legacy_pattern: Option<String>,
    /// PostgreSQL schema of sidelock's tables, created and migrated at start-up [default: sidelock].
    #[arg(long, env = "SIDELOCK_PG_SCHEMA")]
    pub pg_schema: Option<String>,
    /// PostgreSQL hand-written lock table, `[schema.]table[(name_column[, time_column])]`,
    /// whose rows /v1/stale lists as `no-expiry`.
    #[arg(long, env = "SIDELOCK_LEGACY_TABLE")]
    pub legacy_table: Option<String>,
    /// ZooKeeper path (under the URL's chroot) of sidelock's lock tree [default: /sidelock].
    #[arg(long, env = "SIDELOCK_ZK_LOCK_ROOT")]
    pub zk_lock_root: Option<String>,
    /// Bearer token every /v1 request must carry.
    #[arg(long, env = "SIDELOCK_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<Secret>,
    /// Bearer token of the admin API (force-release); without it the admin API answers 403.
    #[arg(long, env = "SIDELOCK_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<Secret>,
    /// How long a dashboard sign-in lasts, at most 30 days [default: 12h].
    #[arg(long, env = "SIDELOCK_DASHBOARD_SESSION_TTL", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "de_duration")]
    pub dashboard_session_ttl: Option<Duration>,
}

/// Fills every unset setting of `$hi` from `$lo`.
macro_rules! layer {
    ($hi:expr, $lo:expr; $($field:ident),* $(,)?) => {
        ServeArgs { $($field: $hi.$field.or($lo.$field),)* }
    };
}

impl ServeArgs {
    fn under(self, lower: ServeArgs) -> ServeArgs {
        layer!(self, lower; config, listen, backend, sidecar_id, default_ttl, max_ttl, max_wait,
            lock_delay, stale_after, max_waiters, max_total_waiters, max_held, metrics_lock_labels, shutdown_grace,
            header_read_timeout, idle_timeout, body_read_timeout, write_timeout, max_connections, threads, allowed_hosts,
            log_format, redis_prefix, legacy_pattern, pg_schema, legacy_table, zk_lock_root,
            api_token, admin_token, dashboard_session_ttl)
    }
}

/// Per-connection timeouts and the cap on open connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Time to send a whole request head, from its first byte (or from
    /// connecting, for a connection's first request).
    pub header_read: Duration,
    /// Time between a response and the first byte of the next request.
    pub idle: Duration,
    /// Time to send a request's body, from the end of its head.
    pub body_read: Duration,
    /// Time a response may make no progress because the client does not
    /// read it; then the connection is reset.
    pub write: Duration,
    /// Open connections at most.
    pub max_connections: usize,
}

/// The resolved settings of a sidecar.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where the sidecar listens (at least one).
    pub listen: Vec<Listen>,
    pub backend: Secret,
    pub sidecar_id: String,
    pub limits: Limits,
    pub metrics_lock_labels: bool,
    pub shutdown_grace: Duration,
    /// Per-connection timeouts and the cap on open connections.
    pub connections: ConnectionLimits,
    /// Worker threads of the runtime (`None`: as many as CPUs).
    pub threads: Option<usize>,
    /// Host names besides loopback that requests may name (lowercase).
    pub allowed_hosts: Vec<String>,
    pub log_format: LogFormat,
    pub api_token: Option<Secret>,
    pub admin_token: Option<Secret>,
    /// How long a dashboard sign-in lasts (`--dashboard-session-ttl`).
    pub dashboard_session_ttl: Duration,
    pub backend_options: crate::backend::Options,
}

impl Settings {
    /// Layers `args` (flags and env, as clap parsed them) over the config file
    /// they name, then defaults, and checks the result.
    ///
    /// # Errors
    /// A sentence for the operator naming the bad setting.
    pub fn resolve(args: ServeArgs) -> Result<Self, String> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => ServeArgs::default(),
        };
        let a = args.under(file);
        let d = Limits::default();
        let max_ttl = a.max_ttl.unwrap_or(d.max_ttl);
        let limits = Limits {
            // An unset default follows a lowered max_ttl instead of contradicting it.
            default_ttl: a.default_ttl.unwrap_or(d.default_ttl.min(max_ttl)),
            max_ttl,
            max_wait: a.max_wait.unwrap_or(d.max_wait),
            lock_delay: a.lock_delay.unwrap_or(d.lock_delay),
            stale_after: a.stale_after.unwrap_or(d.stale_after),
            max_waiters: a.max_waiters.unwrap_or(d.max_waiters),
            max_total_waiters: a.max_total_waiters.unwrap_or(d.max_total_waiters),
            max_held: a.max_held.unwrap_or(d.max_held),
        };
        for (setting, value) in [
            ("--default-ttl", a.default_ttl),
            ("--max-ttl", a.max_ttl),
            ("--max-wait", a.max_wait),
            ("--lock-delay", a.lock_delay),
            ("--stale-after", a.stale_after),
            ("--shutdown-grace", a.shutdown_grace),
            ("--header-read-timeout", a.header_read_timeout),
            ("--idle-timeout", a.idle_timeout),
            ("--body-read-timeout", a.body_read_timeout),
            ("--write-timeout", a.write_timeout),
        ] {
            if let Some(value) = value.filter(|v| *v > MAX_DURATION) {
                return Err(format!(
                    "{setting} ({} ms) is above the longest allowed duration, {} ({} ms)",
                    value.as_millis(),
                    format_duration(MAX_DURATION),
                    MAX_DURATION.as_millis()
                ));
            }
        }
        if limits.max_ttl < crate::lock::MIN_RENEWED_TTL {
            // Below it no hold stream or campaign could be opened at all.
            return Err(format!(
                "--max-ttl ({}) must be at least {} ms, the shortest ttl a hold stream or \
                 campaign may have",
                humantime::format_duration(limits.max_ttl),
                crate::lock::MIN_RENEWED_TTL.as_millis()
            ));
        }
        if limits.default_ttl.is_zero() || limits.default_ttl > limits.max_ttl {
            return Err(format!(
                "--default-ttl ({}) must be above 0 and at most --max-ttl ({})",
                humantime::format_duration(limits.default_ttl),
                humantime::format_duration(limits.max_ttl)
            ));
        }
        for (setting, value) in [
            ("--max-waiters", limits.max_waiters),
            ("--max-total-waiters", limits.max_total_waiters),
            ("--max-held", limits.max_held),
        ] {
            if value == 0 {
                return Err(format!("{setting} must be at least 1"));
            }
        }
        let connections = ConnectionLimits {
            header_read: a.header_read_timeout.unwrap_or(Duration::from_secs(10)),
            idle: a.idle_timeout.unwrap_or(Duration::from_secs(60)),
            body_read: a.body_read_timeout.unwrap_or(Duration::from_secs(30)),
            write: a.write_timeout.unwrap_or(Duration::from_secs(30)),
            max_connections: a.max_connections.unwrap_or(30_000),
        };
        for (name, value) in [
            ("--header-read-timeout", connections.header_read),
            ("--idle-timeout", connections.idle),
            ("--body-read-timeout", connections.body_read),
            ("--write-timeout", connections.write),
        ] {
            if value.is_zero() {
                return Err(format!("{name} must be above 0"));
            }
        }
        if connections.max_connections == 0 {
            return Err("--max-connections must be at least 1".into());
        }
        if let Some(n) = a.threads.filter(|n| !(1..=MAX_THREADS).contains(n)) {
            return Err(format!(
                "--threads ({n}) must be 1 to {MAX_THREADS}; leave it unset for one per CPU"
            ));
        }
        let dashboard_session_ttl = a
            .dashboard_session_ttl
            .unwrap_or(Duration::from_secs(12 * 3600));
        if dashboard_session_ttl < Duration::from_secs(1)
            || dashboard_session_ttl > MAX_DASHBOARD_SESSION_TTL
        {
            return Err(format!(
                "--dashboard-session-ttl ({}) must be at least 1s and at most 30 days",
                format_duration(dashboard_session_ttl)
            ));
        }
        let allowed_hosts: Vec<String> = a
            .allowed_hosts
            .unwrap_or_default()
            .iter()
            .map(|h| h.trim().to_ascii_lowercase())
            .filter(|h| !h.is_empty())
            .collect();
        if let Some(bad) = allowed_hosts
            .iter()
            .find(|h| h.contains(['/', '@', ' ', '*']) || h.len() > 253)
        {
            return Err(format!(
                "--allowed-hosts: {bad:?} is not a host name; give names like sidelock.internal or sidelock.internal:7070"
            ));
        }
        let sidecar_id = match a.sidecar_id.filter(|s| !s.is_empty()) {
            // Shown next to every holder, like an owner: the same rule.
            Some(id) => {
                crate::lock::check_plain_text("--sidecar-id", &id, 200)?;
                id
            }
            None => default_sidecar_id(),
        };
        let listen = a
            .listen
            .filter(|l| !l.is_empty())
            .unwrap_or_else(|| vec![Listen::Tcp(SocketAddr::from(([127, 0, 0, 1], 7070)))]);
        for l in &listen {
            if let Listen::Unix(path) = l {
                check_socket_path(path)?;
            }
        }
        Ok(Self {
            listen,
            backend: backend_url(a.backend)?,
            sidecar_id: sidecar_id.clone(),
            limits,
            metrics_lock_labels: a.metrics_lock_labels.unwrap_or(false),
            shutdown_grace: a.shutdown_grace.unwrap_or(Duration::from_secs(10)),
            connections,
            threads: a.threads,
            allowed_hosts,
            log_format: a.log_format.unwrap_or(LogFormat::Text),
            api_token: a.api_token.filter(|t| !t.is_empty()),
            admin_token: a.admin_token.filter(|t| !t.is_empty()),
            dashboard_session_ttl,
            backend_options: crate::backend::Options {
                redis_prefix: a.redis_prefix.unwrap_or_else(|| "sidelock:".into()),
                legacy_pattern: a.legacy_pattern.filter(|p| !p.is_empty()),
                pg_schema: a
                    .pg_schema
                    .filter(|s| !s.is_empty())
                    .unwrap_or_else(|| "sidelock".into()),
                legacy_table: a.legacy_table.filter(|t| !t.is_empty()),
                zk_lock_root: a
                    .zk_lock_root
                    .filter(|s| !s.is_empty())
                    .unwrap_or_else(|| "/sidelock".into()),
                sidecar: sidecar_id.clone(),
            },
        })
    }
}

/// The backend URL: `memory://` when unset, and `memory` written without
/// `://` means it too; any other value needs a known scheme.
fn backend_url(given: Option<Secret>) -> Result<Secret, String> {
    let Some(url) = given.filter(|u| !u.trim().is_empty()) else {
        return Ok("memory://".into());
    };
    if url.trim() == "memory" {
        return Ok("memory://".into());
    }
    match url.split_once("://") {
        Some((scheme, _)) if crate::backend::SCHEMES.contains(&scheme) => Ok(url),
        _ => Err(format!(
            "--backend {:?} is not a backend URL; use one of {} (e.g. redis://127.0.0.1:6379/0)",
            crate::backend::redact(&url),
            crate::backend::SCHEMES
                .iter()
                .map(|s| format!("{s}://"))
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// A Unix socket path must be in an existing directory and must not be
/// another kind of file (a socket file left by a dead sidecar is replaced
/// when it binds; see `sidecar`).
fn check_socket_path(path: &Path) -> Result<(), String> {
    let shown = path.display();
    match path.parent() {
        Some(dir) if dir.is_dir() => {}
        _ => {
            return Err(format!(
                "--listen unix:{shown}: the directory of the socket does not exist; create it first"
            ));
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()) => Err(format!(
            "--listen unix:{shown}: that path exists and is not a socket; choose another path (it is never deleted)"
        )),
        _ => Ok(()),
    }
}

fn read_file(path: &Path) -> Result<ServeArgs, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read config file {}: {e}", path.display()))?;
    toml::from_str(&text)
        .map_err(|e| format!("config file {}: {}", path.display(), shown(&e, &text)))
}

/// A config file's error without its text: the parser's own message quotes
/// the line, and its type errors the value, either of which may be a token
/// or a backend password. Says where (line, key) and what was expected.
fn shown(e: &toml::de::Error, text: &str) -> String {
    let message = e.message().trim();
    let message = match (message.split_once(": "), message.split_once(", expected ")) {
        (
            Some((kind @ ("invalid type" | "invalid value" | "invalid length"), _)),
            Some((_, expected)),
        ) => {
            format!("{kind}, expected {expected}")
        }
        (Some((kind @ ("invalid type" | "invalid value" | "invalid length"), _)), None) => {
            kind.to_owned()
        }
        _ => message.to_owned(),
    };
    let Some(span) = e.span() else {
        return message;
    };
    let before = text.get(..span.start).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let key = text
        .lines()
        .nth(line - 1)
        .and_then(|l| l.split_once('='))
        .map(|(k, _)| k.trim())
        .filter(|k| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-.\"' ".contains(c))
        });
    match key {
        Some(key) => format!("line {line} ({key}): {message}"),
        None => format!("line {line}: {message}"),
    }
}

fn default_sidecar_id() -> String {
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let suffix: u32 = rand::random();
    format!("{host}-{:06x}", suffix & 0xff_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bad line of a config file is named by its number and key, never
    /// quoted: it may hold a token or a backend password (the parser's
    /// message quoted the whole line, and its type errors the value).
    #[test]
    fn a_bad_config_file_is_refused_without_its_values() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sidelock.toml");
        for (text, says) in [
            (
                "max_ttl = \"2m\"\napi-token = \"s3cr3t-t0ken\"\n",
                "line 2 (api-token): unknown field",
            ),
            (
                "admin_token = 12345678\n",
                "line 1 (admin_token): invalid type, expected a string",
            ),
            ("backend = \"postgres://u:s3cr3t-pw@db/x\n", "line 1"),
        ] {
            std::fs::write(&path, text).unwrap();
            let e = read_file(&path).unwrap_err();
            assert!(e.contains(says), "{text:?}: {e}");
            for secret in ["s3cr3t", "12345678"] {
                assert!(!e.contains(secret), "{text:?}: {e}");
            }
        }
    }

    #[test]
    fn file_rejects_unknown_keys_and_reads_durations() {
        let ok: ServeArgs = toml::from_str("max_ttl = \"2m\"\nmax_wait = 1500").unwrap();
        assert_eq!(ok.max_ttl, Some(Duration::from_secs(120)));
        assert_eq!(ok.max_wait, Some(Duration::from_millis(1500)));
        let err = toml::from_str::<ServeArgs>("max_tll = \"2m\"").unwrap_err();
        assert!(err.to_string().contains("max_tll"));
    }

    #[test]
    fn durations_above_the_maximum_are_refused_from_every_source() {
        let huge = Duration::from_millis(u64::MAX);
        let just_over = MAX_DURATION + Duration::from_millis(1);
        for value in [huge, just_over] {
            for setting in [
                "default_ttl",
                "max_ttl",
                "max_wait",
                "lock_delay",
                "stale_after",
                "shutdown_grace",
                "header_read_timeout",
                "idle_timeout",
                "body_read_timeout",
                "write_timeout",
            ] {
                let text = format!(
                    "{setting} = {}",
                    value.as_millis().min(u128::from(u64::MAX))
                );
                let args: ServeArgs = match toml::from_str(&text) {
                    Ok(args) => args,
                    // TOML integers stop at i64::MAX: give the value as text.
                    Err(_) => {
                        toml::from_str(&format!("{setting} = \"{}\"", value.as_millis())).unwrap()
                    }
                };
                let err = Settings::resolve(args).unwrap_err();
                let flag = format!("--{}", setting.replace('_', "-"));
                assert!(err.contains(&flag), "{err}");
                assert!(err.contains("365 days (31536000000 ms)"), "{err}");
            }
        }
        let at_max = ServeArgs {
            max_ttl: Some(MAX_DURATION),
            max_wait: Some(MAX_DURATION),
            lock_delay: Some(MAX_DURATION),
            ..ServeArgs::default()
        };
        assert!(Settings::resolve(at_max).is_ok());
    }

    #[test]
    fn a_max_ttl_no_hold_could_have_is_refused() {
        for max_ttl in [Duration::ZERO, Duration::from_millis(99)] {
            let args = ServeArgs {
                max_ttl: Some(max_ttl),
                default_ttl: Some(Duration::from_millis(1).min(max_ttl)),
                ..ServeArgs::default()
            };
            let err = Settings::resolve(args).unwrap_err();
            assert!(
                err.contains("--max-ttl") && err.contains("at least 100 ms"),
                "{err}"
            );
        }
        let at_min = ServeArgs {
            max_ttl: Some(crate::lock::MIN_RENEWED_TTL),
            default_ttl: Some(Duration::from_millis(1)),
            ..ServeArgs::default()
        };
        assert!(Settings::resolve(at_min).is_ok());
    }

    #[test]
    fn a_sidecar_id_that_could_spoof_another_is_refused() {
        for id in ["pod-1\u{202e}", "pod\u{200b}1", "pod-1\n", &"p".repeat(201)] {
            let args = ServeArgs {
                sidecar_id: Some(id.into()),
                ..ServeArgs::default()
            };
            let err = Settings::resolve(args).unwrap_err();
            assert!(
                err.contains("--sidecar-id") && err.contains("allowed"),
                "{err}"
            );
        }
    }

    #[test]
    fn file_sets_connection_timeouts_and_cap() {
        let file: ServeArgs = toml::from_str(
            "header_read_timeout = \"2s\"\nidle_timeout = \"5s\"\nbody_read_timeout = 700\nwrite_timeout = \"3s\"\nmax_connections = 99",
        )
        .unwrap();
        let s = Settings::resolve(file).unwrap();
        assert_eq!(
            s.connections,
            ConnectionLimits {
                header_read: Duration::from_secs(2),
                idle: Duration::from_secs(5),
                body_read: Duration::from_millis(700),
                write: Duration::from_secs(3),
                max_connections: 99,
            }
        );
        let hosts: ServeArgs =
            toml::from_str("allowed_hosts = [\"Pod.Internal\", \"app:8080\"]").unwrap();
        assert_eq!(
            Settings::resolve(hosts).unwrap().allowed_hosts,
            ["pod.internal", "app:8080"]
        );
        let zero: ServeArgs = toml::from_str("idle_timeout = \"0s\"").unwrap();
        assert!(
            Settings::resolve(zero)
                .unwrap_err()
                .contains("--idle-timeout")
        );
    }

    #[test]
    fn flags_win_over_file() {
        let flags = ServeArgs {
            max_ttl: Some(Duration::from_secs(3)),
            ..ServeArgs::default()
        };
        let file = ServeArgs {
            max_ttl: Some(Duration::from_secs(1)),
            max_wait: Some(Duration::from_secs(9)),
            ..ServeArgs::default()
        };
        let merged = flags.under(file);
        assert_eq!(merged.max_ttl, Some(Duration::from_secs(3)));
        assert_eq!(merged.max_wait, Some(Duration::from_secs(9)));
    }
}

#[cfg(test)]
mod dashboard_session_ttl {
    use super::*;

    #[test]
    fn is_read_from_the_file_defaulted_and_bounded() {
        let file: ServeArgs = toml::from_str("dashboard_session_ttl = \"15m\"").unwrap();
        assert_eq!(file.dashboard_session_ttl, Some(Duration::from_secs(900)));
        let resolved = Settings::resolve(file).unwrap();
        assert_eq!(resolved.dashboard_session_ttl, Duration::from_secs(900));
        let default = Settings::resolve(ServeArgs::default()).unwrap();
        assert_eq!(
            default.dashboard_session_ttl,
            Duration::from_secs(12 * 3600)
        );
        for bad in [Duration::ZERO, Duration::from_secs(31 * 24 * 3600)] {
            let args = ServeArgs {
                dashboard_session_ttl: Some(bad),
                ..ServeArgs::default()
            };
            let err = Settings::resolve(args).unwrap_err();
            assert!(err.contains("at most 30 days"), "{err}");
        }
    }
}
