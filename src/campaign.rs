//! `sidelock campaign --name NAME -- CMD…`: run a command only while this
//! process leads an election through a sidecar — the leader-elector
//! sidecar pattern as one command.
//!
//! The campaign stream keeps the leadership (the sidecar's watchdog renews
//! it) and resigns the moment this process exits, however it exits. When the
//! leadership is lost the command gets SIGTERM, then SIGKILL after a grace.

use std::time::Duration;

use clap::Args;
use tokio::process::Command;

use crate::run::{
    EXIT_CANNOT_EXEC, EXIT_UNAVAILABLE, SidecarArgs, Stop, field, next_event, open_stream,
    run_duration, supervise,
};

/// What `sidelock campaign --help` adds below the flags.
const CAMPAIGN_AFTER_HELP: &str = "\
Exit codes (as sidelock run):
  CMD's own     CMD ran as leader and exited (without --again)
  128+N         CMD was killed by signal N
  2             a flag or duration is wrong (nothing was sent)
  69            the sidecar cannot be reached or refused the request
  76            the leadership was lost while CMD ran (CMD got SIGTERM)
  127           CMD could not be started

With --again, the campaign stands again after CMD exits (whatever its code)
or the leadership is lost, until the sidecar cannot be reached or this
process is stopped: SIGTERM or SIGINT goes to CMD while it runs (the exit is
then CMD's), and ends the campaign at once while following (128+N).
Terms that end within 1 s are spaced out (200 ms doubling to 5 s).

Environment read: SIDELOCK_URL (--url), SIDELOCK_API_TOKEN (--api-token).
Environment CMD sees: SIDELOCK_ELECTION (the election's name),
SIDELOCK_FENCE (the leadership's fencing token: pass it to what you write).";

/// `sidelock campaign`: run a command only while leading an election.
#[derive(Debug, Args)]
#[command(after_help = CAMPAIGN_AFTER_HELP)]
pub struct CampaignArgs {
    /// Election name.
    #[arg(long)]
    pub name: String,
    /// What observers see while this campaign leads (e.g. this pod's address).
    #[arg(long)]
    pub value: Option<String>,
    /// Owner identity shown with the leader.
    #[arg(long)]
    pub owner: Option<String>,
    /// Leadership lease, renewed by the sidecar's watchdog while CMD runs:
    /// how long a leader whose sidecar dies keeps the election.
    #[arg(long, value_parser = run_duration)]
    pub ttl: Option<String>,
    /// Campaign again after CMD exits or the leadership is lost.
    #[arg(long)]
    pub again: bool,
    /// Print nothing while following (by default a line on stderr names the leader).
    #[arg(long, short)]
    pub quiet: bool,
    #[command(flatten)]
    pub sidecar: SidecarArgs,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Campaigns, runs `args.command` while leading; returns the exit code.
pub async fn campaign(args: CampaignArgs) -> i32 {
    if !args.again {
        // Stopped while following by the signal's default action, as
        // nothing listens for it before the term.
        return match lead_once(&args, None).await {
            Term::Ran(code) | Term::Failed(code) => code,
            Term::Stopped(signal) => 128 + signal,
        };
    }
    // A term's listeners for SIGTERM and SIGINT (which pass them to CMD)
    // would stay for the process's life, and the signals' default action
    // (to end it) with them: one listener for the whole loop ends it.
    let stop = Stop::listen();
    let mut pause = Duration::ZERO;
    loop {
        let began = tokio::time::Instant::now();
        let term = lead_once(&args, Some(&stop)).await;
        if let Some(signal) = stop.signal() {
            return match term {
                // CMD got the signal too: its exit is the process's.
                Term::Ran(code) | Term::Failed(code) => code,
                Term::Stopped(_) => 128 + signal,
            };
        }
        match term {
            Term::Ran(_) => {}
            Term::Failed(code) => return code,
            Term::Stopped(signal) => return 128 + signal,
        }
        // A CMD that fails at once (a missing binary, a bad config) would
        // lead and resign as fast as the sidecar answers: terms that end
        // quickly are spaced out, more and more.
        pause = if began.elapsed() < QUICK_TERM {
            (pause * 2).clamp(MIN_PAUSE, MAX_PAUSE)
        } else {
            Duration::ZERO
        };
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            signal = stop.heard() => return 128 + signal,
        }
    }
}

/// A term shorter than this (from campaigning to CMD's exit) is followed
/// by a pause before the next, from [`MIN_PAUSE`] doubling to [`MAX_PAUSE`].
const QUICK_TERM: Duration = Duration::from_secs(1);
const MIN_PAUSE: Duration = Duration::from_millis(200);
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// How one campaign ended.
enum Term {
    /// CMD ran as leader and ended with this code (its own, 128+N when
    /// killed by signal N, or 76 when the leadership was lost).
    Ran(i32),
    /// sidelock's own failure before CMD ran: the sidecar cannot be reached
    /// or refused (69), CMD cannot start (127).
    Failed(i32),
    /// Stopped by signal N before CMD started.
    Stopped(i32),
}

/// One campaign: waits for the leadership, runs the command while it
/// lasts. `stop`: the signals the loop listens for (none without
/// `--again`: the command's supervision listens while it runs).
async fn lead_once(args: &CampaignArgs, stop: Option<&Stop>) -> Term {
    let deaf = Stop::deaf();
    let listening = stop.unwrap_or(&deaf);
    let (mut events, leadership) = tokio::select! {
        biased;
        signal = listening.heard() => return Term::Stopped(signal),
        led = lead(args) => match led {
            Ok(led) => led,
            Err(code) => return Term::Failed(code),
        },
    };
    // Heard as the leadership came: CMD does not start (the stream,
    // dropped, resigns).
    if let Some(signal) = listening.signal() {
        return Term::Stopped(signal);
    }
    let fence = field(&leadership, "fence").map(|f| f.to_string());
    let mut command = Command::new(&args.command[0]);
    command
        .args(&args.command[1..])
        .env("SIDELOCK_ELECTION", &args.name)
        .env("SIDELOCK_FENCE", fence.unwrap_or_default());
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("sidelock campaign: cannot start {:?}: {e}", args.command[0]);
            return Term::Failed(EXIT_CANNOT_EXEC);
        }
    };
    Term::Ran(supervise(&mut child, &mut events, "campaign", &leadership, stop).await)
}

/// Opens the campaign and waits for its leadership: the stream and the
/// `leader` event's data, or the exit code of a failure.
async fn lead(args: &CampaignArgs) -> Result<(crate::run::Events, String), i32> {
    let pairs: Vec<(&str, &str)> = [
        ("ttl", &args.ttl),
        ("value", &args.value),
        ("owner", &args.owner),
    ]
    .into_iter()
    .filter_map(|(k, v)| Some((k, v.as_deref()?)))
    .collect();
    let segments = ["elections", args.name.as_str(), "campaign"];
    let mut events = match open_stream(&args.sidecar, &segments, &pairs, "campaign").await {
        Ok(events) => events,
        Err(code) => return Err(code),
    };
    let leadership = loop {
        let Some(msg) = next_event(&mut events).await else {
            eprintln!("sidelock campaign: the sidecar closed the stream before this campaign led");
            return Err(EXIT_UNAVAILABLE);
        };
        match msg.event.as_str() {
            "leader" => break msg.data,
            "follower" => {
                if !args.quiet {
                    let leader = field(&msg.data, "leader").unwrap_or_default();
                    let who = |name| {
                        leader
                            .get(name)
                            .map_or("?".to_owned(), serde_json::Value::to_string)
                    };
                    if leader.is_null() {
                        eprintln!("sidelock campaign: {:?} has no leader yet", args.name);
                    } else {
                        eprintln!(
                            "sidelock campaign: {:?} is led by {} (value {}, sidecar {}); standing by",
                            args.name,
                            who("owner"),
                            who("value"),
                            who("sidecar")
                        );
                    }
                }
            }
            other => {
                eprintln!("sidelock campaign: {other} before leading: {}", msg.data);
                return Err(EXIT_UNAVAILABLE);
            }
        }
    };
    Ok((events, leadership))
}
