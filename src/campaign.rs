//! `sidelock campaign --name NAME -- CMD…`: run a command only while this
//! process leads an election through a sidecar — the leader-elector
//! sidecar pattern as one command.
//!
//! The campaign stream keeps the leadership (the sidecar's watchdog renews
//! it) and resigns the moment this process exits, however it exits. When the
//! leadership is lost the command gets SIGTERM, then SIGKILL after a grace.

use clap::Args;
use tokio::process::Command;

use crate::run::{
    EXIT_CANNOT_EXEC, EXIT_UNAVAILABLE, SidecarArgs, field, next_event, open_stream, run_duration,
    supervise,
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

With --again, the campaign stands again after CMD exits or the leadership
is lost, until this process is stopped or the sidecar cannot be reached.

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
    loop {
        let code = lead_once(&args).await;
        if !args.again || code == EXIT_UNAVAILABLE || code == EXIT_CANNOT_EXEC {
            return code;
        }
    }
}

/// One campaign: waits for the leadership, runs the command while it lasts.
async fn lead_once(args: &CampaignArgs) -> i32 {
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
        Err(code) => return code,
    };
    let leadership = loop {
        let Some(msg) = next_event(&mut events).await else {
            eprintln!("sidelock campaign: the sidecar closed the stream before this campaign led");
            return EXIT_UNAVAILABLE;
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
                return EXIT_UNAVAILABLE;
            }
        }
    };
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
            return EXIT_CANNOT_EXEC;
        }
    };
    supervise(&mut child, &mut events, "campaign", &leadership).await
}
