//! `sidelock run --lock NAME -- CMD…`: hold a lock through a sidecar while a
//! command runs, like `flock`, `consul lock` or `etcdctl lock`.
//!
//! The hold stream keeps the lease alive (the sidecar's watchdog renews it)
//! and releases it the moment this process exits, however it exits.

use std::process::ExitStatus;
use std::time::Duration;

use clap::Args;
use eventsource_stream::{Event, Eventsource};
use futures::{Stream, StreamExt};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::signal::unix::{SignalKind, signal};

use crate::config::Secret;
use crate::duration::{MAX_DURATION, format_duration, parse_duration};

/// What `sidelock run --help` adds below the flags.
const RUN_AFTER_HELP: &str = "\
Exit codes:
  CMD's own     CMD ran under the lock and exited
  128+N         CMD was killed by signal N
  2             a flag or duration is wrong (nothing was sent)
  69            the sidecar cannot be reached or refused the request
  75            the lock was not acquired within --wait
  76            the lease was lost while CMD ran, or its end drew near
                without a renewal from the sidecar (CMD got SIGTERM)
  127           CMD could not be started

Environment read: SIDELOCK_URL (--url), SIDELOCK_API_TOKEN (--api-token).
Environment CMD sees: SIDELOCK_LOCK (the lock name), SIDELOCK_TOKEN (the
lease token), SIDELOCK_FENCE (the fencing token).";

/// `sidelock run`: hold a lock while a command runs.
#[derive(Debug, Args)]
#[command(after_help = RUN_AFTER_HELP)]
pub struct RunArgs {
    /// Lock name.
    #[arg(long)]
    pub lock: String,
    /// Lease ttl, renewed by the sidecar's watchdog while the command runs.
    #[arg(long, value_parser = run_duration)]
    pub ttl: Option<String>,
    /// How long to wait for the lock [default: 0, try once].
    #[arg(long, value_parser = run_duration)]
    pub wait: Option<String>,
    /// Owner identity shown to operators.
    #[arg(long)]
    pub owner: Option<String>,
    /// Take the lock in shared (read) mode.
    #[arg(long)]
    pub shared: bool,
    /// Print nothing while queued (by default a line on stderr says so).
    #[arg(long, short)]
    pub quiet: bool,
    #[command(flatten)]
    pub sidecar: SidecarArgs,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Which sidecar a client subcommand (`run`, `campaign`) talks to, and how.
#[derive(Debug, Args)]
pub struct SidecarArgs {
    /// The sidecar's base URL (http:// or https://).
    #[arg(long, env = "SIDELOCK_URL", default_value = "http://127.0.0.1:7070", value_parser = run_url)]
    pub url: String,
    /// Bearer token for the sidecar's API.
    #[arg(long, env = "SIDELOCK_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<Secret>,
}

/// A duration for `sidelock run`, checked as the sidecar would check it and
/// passed on as written.
pub(crate) fn run_duration(s: &str) -> Result<String, String> {
    let d = parse_duration(s)?;
    if d > MAX_DURATION {
        return Err(format!(
            "{s:?} is longer than the longest duration, {}",
            format_duration(MAX_DURATION)
        ));
    }
    Ok(s.to_owned())
}

/// The sidecar's base URL for `sidelock run`: an absolute http(s) URL.
fn run_url(s: &str) -> Result<String, String> {
    match reqwest::Url::parse(s) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => Ok(s.to_owned()),
        Ok(u) => Err(format!(
            "{s:?} is a {} URL; use http://HOST:PORT or https://HOST:PORT",
            u.scheme()
        )),
        Err(e) => Err(format!(
            "{s:?} is not a URL ({e}); use http://HOST:PORT or https://HOST:PORT"
        )),
    }
}

/// The lock was not acquired within `--wait`.
pub const EXIT_NOT_ACQUIRED: i32 = 75;
/// The lease was lost while the command ran; the command got SIGTERM.
pub const EXIT_LEASE_LOST: i32 = 76;
/// The sidecar could not be reached or refused the request.
pub const EXIT_UNAVAILABLE: i32 = 69;
/// The command could not be started.
pub const EXIT_CANNOT_EXEC: i32 = 127;

/// How long the command gets between SIGTERM and SIGKILL after a lost lease.
pub(crate) const KILL_GRACE: Duration = Duration::from_secs(10);

/// The next event of a hold stream; `None` when the stream ends or fails.
/// Comments (the keep-alives) are not events.
pub(crate) async fn next_event<S, E>(events: &mut S) -> Option<Event>
where
    S: Stream<Item = Result<Event, E>> + Unpin,
{
    events.next().await?.ok()
}

pub(crate) fn field(data: &str, name: &str) -> Option<serde_json::Value> {
    serde_json::from_str::<serde_json::Value>(data)
        .ok()?
        .get(name)
        .cloned()
}

/// The events of an SSE stream from the sidecar.
pub(crate) type Events = std::pin::Pin<
    Box<
        dyn Stream<Item = Result<Event, eventsource_stream::EventStreamError<reqwest::Error>>>
            + Send,
    >,
>;

/// Opens `GET <base>/v1/<segments…>?<pairs>` as an SSE stream; `who` names
/// the subcommand in messages. On failure, the message is printed and the
/// exit code returned.
pub(crate) async fn open_stream(
    sidecar: &SidecarArgs,
    segments: &[&str],
    pairs: &[(&str, &str)],
    who: &str,
) -> Result<Events, i32> {
    let base = sidecar.url.trim_end_matches('/');
    let mut url = match reqwest::Url::parse(&format!("{base}/v1/")) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("sidelock {who}: bad --url {base:?}: {e}");
            return Err(EXIT_UNAVAILABLE);
        }
    };
    if let Ok(mut path) = url.path_segments_mut() {
        path.pop_if_empty().extend(segments);
    }
    // Only when there is a query: an empty one would leave a stray `?`.
    if !pairs.is_empty() {
        url.query_pairs_mut().extend_pairs(pairs);
    }
    let client = reqwest::Client::new();
    let mut request = client.get(url).header("accept", "text/event-stream");
    if let Some(token) = &sidecar.api_token {
        request = request.bearer_auth(token.expose());
    }
    let response = match request.send().await {
        Ok(r) => r,
        Err(e) => {
            eprintln!(
                "sidelock {who}: cannot reach the sidecar at {base}: {}",
                send_failure(&e)
            );
            return Err(EXIT_UNAVAILABLE);
        }
    };
    if !response.status().is_success() {
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        let detail = field(&body, "detail")
            .and_then(|d| d.as_str().map(str::to_owned))
            .unwrap_or(body);
        eprintln!("sidelock {who}: the sidecar answered {status}: {detail}");
        return Err(EXIT_UNAVAILABLE);
    }
    Ok(Box::pin(response.bytes_stream().eventsource()))
}

/// Runs `args.command` under the lock; returns the process exit code.
pub async fn run(args: RunArgs) -> i32 {
    let mut pairs: Vec<(&str, &str)> = [
        ("ttl", &args.ttl),
        ("wait", &args.wait),
        ("owner", &args.owner),
    ]
    .into_iter()
    .filter_map(|(k, v)| Some((k, v.as_deref()?)))
    .collect();
    if args.shared {
        pairs.push(("mode", "shared"));
    }
    let segments = ["locks", args.lock.as_str(), "hold"];
    let mut events = match open_stream(&args.sidecar, &segments, &pairs, "run").await {
        Ok(events) => events,
        Err(code) => return code,
    };
    // When this run joined the queue; later `queued` events move it forward.
    let mut queued_since = None;
    let acquired = loop {
        let Some(msg) = next_event(&mut events).await else {
            eprintln!("sidelock run: the sidecar closed the stream before the lock was granted");
            return EXIT_UNAVAILABLE;
        };
        match msg.event.as_str() {
            "acquired" => break msg.data,
            "queued" => {
                if !args.quiet {
                    let since = *queued_since.get_or_insert_with(std::time::SystemTime::now);
                    let at =
                        |name| field(&msg.data, name).map_or("?".to_owned(), |v| v.to_string());
                    eprintln!(
                        "sidelock run: lock {:?} is held elsewhere; queued at position {} of {} since {}",
                        args.lock,
                        at("position"),
                        at("queue_length"),
                        humantime::format_rfc3339_seconds(since)
                    );
                }
            }
            "timeout" => {
                eprintln!(
                    "sidelock run: lock {:?} is busy; not acquired within the wait",
                    args.lock
                );
                return EXIT_NOT_ACQUIRED;
            }
            other => {
                eprintln!("sidelock run: {other} before the grant: {}", msg.data);
                return EXIT_UNAVAILABLE;
            }
        }
    };
    let token = field(&acquired, "token").and_then(|t| t.as_str().map(str::to_owned));
    let fence = field(&acquired, "fence").map(|f| f.to_string());
    let mut command = Command::new(&args.command[0]);
    command
        .args(&args.command[1..])
        .env("SIDELOCK_LOCK", &args.lock)
        .env("SIDELOCK_TOKEN", token.unwrap_or_default())
        .env("SIDELOCK_FENCE", fence.unwrap_or_default());
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("sidelock run: cannot start {:?}: {e}", args.command[0]);
            return EXIT_CANNOT_EXEC;
        }
    };
    supervise(&mut child, &mut events, "run", &acquired, None).await
}

/// When to stop the command unless a newer renewal comes, for the lease
/// that `data` (an `acquired`, `leader` or `renewed` event) tells of: a sixth
/// of its ttl before its end, counted from now by `ttl_ms` (not by
/// `expires_at_ms`: the sidecar's clock may be another machine's, or stand
/// behind this one's after a suspend). A sidecar that stops renewing without
/// a word (frozen, starved) must not leave the command running while
/// another client is granted the lock; the sixth covers the event's way here
/// and the command's stop. `None` without the field.
fn give_up_at(data: &str) -> Option<tokio::time::Instant> {
    let ttl = field(data, "ttl_ms")?.as_u64()?;
    let margin = ttl / 6;
    Some(tokio::time::Instant::now() + Duration::from_millis(ttl - margin))
}

/// The stop signals (SIGTERM, SIGINT) a process heard, from the moment it
/// listens ([`Stop::listen`]) for the rest of its life: one listener, so
/// that a signal heard at any moment (before a command starts, as it
/// starts, while it runs) is never missed, and whoever asks later knows.
pub(crate) struct Stop {
    /// How many were heard, and the last one's number.
    heard: tokio::sync::watch::Receiver<(u32, i32)>,
    /// The first one's number (0: none yet).
    first: std::sync::Arc<std::sync::atomic::AtomicI32>,
}

impl Stop {
    /// Listens from now on (the signals' default action, ending the
    /// process, is gone with that).
    pub(crate) fn listen() -> Self {
        let (tell, heard) = tokio::sync::watch::channel((0, 0));
        let first = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
        let first_heard = first.clone();
        if let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            tokio::spawn(async move {
                loop {
                    let n = tokio::select! {
                        _ = term.recv() => Signal::SIGTERM,
                        _ = int.recv() => Signal::SIGINT,
                    } as i32;
                    let _ = first_heard.compare_exchange(
                        0,
                        n,
                        std::sync::atomic::Ordering::Relaxed,
                        std::sync::atomic::Ordering::Relaxed,
                    );
                    tell.send_modify(|(count, last)| (*count, *last) = (*count + 1, n));
                }
            });
        }
        Self { heard, first }
    }

    /// A stop that never hears anything (nobody listens for it).
    pub(crate) fn deaf() -> Self {
        let (_, heard) = tokio::sync::watch::channel((0, 0));
        Self {
            heard,
            first: std::sync::Arc::default(),
        }
    }

    /// The first signal heard, if any.
    pub(crate) fn signal(&self) -> Option<i32> {
        let (count, _) = *self.heard.borrow();
        (count > 0).then(|| self.first.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Once a signal has been heard (at once if one was): the first.
    pub(crate) async fn heard(&self) -> i32 {
        let mut heard = self.heard.clone();
        if heard.wait_for(|(count, _)| *count > 0).await.is_err() {
            // Nobody listens: nothing will be heard.
            std::future::pending::<()>().await;
        }
        self.first.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Waits for the command while watching the hold stream (`granted`: the
/// data of the event that granted the lease) and forwarding SIGTERM/SIGINT
/// to the command: those `stop` hears, or, without one, those heard from
/// now on.
pub(crate) async fn supervise<S, E>(
    child: &mut Child,
    events: &mut S,
    who: &str,
    granted: &str,
    stop: Option<&Stop>,
) -> i32
where
    S: Stream<Item = Result<Event, E>> + Unpin,
{
    let listened;
    let stop = match stop {
        Some(stop) => stop,
        None => {
            listened = Stop::listen();
            &listened
        }
    };
    // Every signal heard is passed on, those heard before CMD started too.
    let mut heard = stop.heard.clone();
    heard.mark_changed();
    let pid = child
        .id()
        .and_then(|p| i32::try_from(p).ok())
        .map(Pid::from_raw);
    let send = |sig: Signal| {
        if let Some(pid) = pid {
            let _ = kill(pid, sig);
        }
    };
    let mut deadline = give_up_at(granted);
    let why = loop {
        let expired = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            status = child.wait() => return exit_code(status),
            Ok(()) = heard.changed() => {
                let (count, n) = *heard.borrow_and_update();
                if count > 0 {
                    send(Signal::try_from(n).unwrap_or(Signal::SIGTERM));
                }
            }
            () = expired => {
                break "no renewal from the sidecar as the lease's end drew near".to_owned();
            }
            msg = next_event(events) => match msg {
                Some(m) if m.event == "renewed" => {
                    deadline = give_up_at(&m.data).or(deadline);
                }
                other => {
                    break other.map_or_else(
                        || "the hold stream ended".to_owned(),
                        |m| format!("{}: {}", m.event, m.data),
                    );
                }
            }
        }
    };
    eprintln!("sidelock {who}: lease lost ({why}); stopping the command");
    send(Signal::SIGTERM);
    if tokio::time::timeout(KILL_GRACE, child.wait())
        .await
        .is_err()
    {
        send(Signal::SIGKILL);
        let _ = child.wait().await;
    }
    EXIT_LEASE_LOST
}

/// Why a request did not get an answer, in words: the socket error's kind
/// when there is one (`connection refused`), else reqwest's own class.
fn send_failure(e: &reqwest::Error) -> String {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            // An OS error's kind reads well ("connection refused"); anything
            // else (a resolver's error) says more in its own words.
            return if io.raw_os_error().is_some() {
                io.kind().to_string()
            } else {
                io.to_string()
            };
        }
        source = cause.source();
    }
    if e.is_timeout() {
        "timed out".to_owned()
    } else if e.is_connect() {
        "cannot connect".to_owned()
    } else {
        "the request failed".to_owned()
    }
}

pub(crate) fn exit_code(status: std::io::Result<ExitStatus>) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(s) => s
            .code()
            .or_else(|| s.signal().map(|sig| 128 + sig))
            .unwrap_or(1),
        Err(_) => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review finding: the deadline took the earlier of `ttl_ms` from now
    /// and `expires_at_ms` on this machine's clock. A sidecar whose clock
    /// stands behind (another machine's; or this one's, anchored before a
    /// suspend) made every command stop at once, exit 76.
    #[tokio::test]
    async fn a_sidecar_clock_behind_this_one_leaves_the_deadline_to_the_ttl() {
        let behind = crate::clock::now_ms() - 60_000;
        let data = format!(r#"{{"ttl_ms":30000,"expires_at_ms":{behind}}}"#);
        let at = give_up_at(&data).expect("a deadline");
        let left = at.saturating_duration_since(tokio::time::Instant::now());
        assert!(
            left > Duration::from_secs(24),
            "the command would be stopped {left:?} from now"
        );
    }
}
