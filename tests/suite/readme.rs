//! The README's Quick start and Elections are executable: these tests run their `sh` blocks,
//! top to bottom, with bash against a fresh sidecar started as the README's
//! Set up says, and checks every command against what the README shows
//! after it.
//!
//! The README's convention, which this test reads:
//! * every command that prints something is followed by a comment line
//!   `# → ` with what it prints, continued on `#   ` lines;
//! * for a `curl` command that line starts with the HTTP status;
//! * `…` stands for what differs from run to run (tokens, times); every
//!   JSON member shown whole (`"fence":2`, `"mode":"permit"`) must be in the
//!   answer, every SSE `event:` shown must come in that order, and text
//!   shown without JSON (a metric line, a command's output) must appear as
//!   written; a shown text in parentheses is a description, not output.
//!
//! The block runs under `set -euo pipefail` with `curl` wrapped to record
//! each call's status and body, so a command that fails, a status that
//! changed or a value that drifted fails this test.

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

const README: &str = include_str!("../../README.md");

/// The address the README's commands use; replaced by the test sidecar's.
const README_URL: &str = "http://127.0.0.1:7070";

/// One command of the block and what the README shows it prints.
#[derive(Debug)]
struct Step {
    command: String,
    /// The `# → ` text and its continuation lines, joined with newlines.
    shown: Option<String>,
}

/// The first `sh` block under `## <section>`.
fn block(section: &str) -> &'static str {
    let text = README
        .split_once(&format!("\n## {section}\n"))
        .unwrap_or_else(|| panic!("the README has a {section} section"))
        .1;
    let block = text
        .split_once("```sh\n")
        .unwrap_or_else(|| panic!("the {section} has an sh block"))
        .1;
    block.split_once("\n```").expect("the block is closed").0
}

fn quick_start() -> &'static str {
    block("Quick start")
}

fn steps(block: &str) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut in_shown = false;
    for line in block.lines() {
        if let Some(text) = line.strip_prefix("# → ") {
            let step = steps.last_mut().expect("a `# → ` line follows a command");
            assert!(step.shown.is_none(), "two `# → ` lines after {step:?}");
            step.shown = Some(text.to_owned());
            in_shown = true;
        } else if let Some(text) = line.strip_prefix("#   ").filter(|_| in_shown) {
            let shown = steps
                .last_mut()
                .and_then(|s| s.shown.as_mut())
                .expect("a continuation follows a `# → ` line");
            shown.push('\n');
            shown.push_str(text);
        } else {
            in_shown = false;
            let code = line.split(" #").next().unwrap_or("").trim();
            if !code.is_empty() && !line.trim_start().starts_with('#') {
                steps.push(Step {
                    command: code.to_owned(),
                    shown: None,
                });
            }
        }
    }
    steps
}

/// `"key":value` members shown whole: a string without `…`, a number,
/// `true`, `false` or `null`.
fn members(shown: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = shown;
    while let Some(at) = rest.find("\":") {
        let key_start = rest[..at].rfind('"').map_or(0, |i| i);
        let key = &rest[key_start..at + 2];
        let value_text = &rest[at + 2..];
        let value = if let Some(string) = value_text.strip_prefix('"') {
            string
                .find('"')
                .map(|end| format!("\"{}\"", &string[..end]))
        } else {
            let end = value_text
                .find([',', '}', ']', ' ', '\n'])
                .unwrap_or(value_text.len());
            let v = &value_text[..end];
            (!v.is_empty() && (v.parse::<f64>().is_ok() || matches!(v, "true" | "false" | "null")))
                .then(|| v.to_owned())
        };
        if let Some(value) = value.filter(|v| !v.contains('…')) {
            found.push(format!("{key}{value}"));
        }
        rest = &rest[at + 2..];
    }
    found
}

/// The `event: NAME` lines shown, in order.
fn events(shown: &str) -> Vec<&str> {
    shown
        .lines()
        .filter_map(|l| l.trim().strip_prefix("event: "))
        .map(str::trim)
        .collect()
}

/// Checks one output against what the README shows for it.
fn check_output(what: &str, shown: &str, output: &str, failures: &mut Vec<String>) {
    let members = members(shown);
    let events = events(shown);
    for member in &members {
        if !output.contains(member.as_str()) {
            failures.push(format!("{what}: {member} not in {output:?}"));
        }
    }
    let mut from = 0;
    for event in &events {
        match output[from..].find(&format!("event: {event}")) {
            Some(at) => from += at + 1,
            None => failures.push(format!(
                "{what}: event {event} (in order) not in {output:?}"
            )),
        }
    }
    let prose = shown.starts_with('(');
    if members.is_empty() && events.is_empty() && !prose && !shown.is_empty() {
        for part in shown.split('…').map(str::trim).filter(|p| !p.is_empty()) {
            if !output.contains(part) {
                failures.push(format!("{what}: {part:?} not in {output:?}"));
            }
        }
    }
}

/// The script the test runs: strict mode, a recording `curl`, then the block.
fn script(block: &str, base_url: &str, record: &Path) -> String {
    format!(
        r#"set -euo pipefail
REC={rec}
echo 0 > "$REC/n"
curl() {{
  local n
  n=$(( $(cat "$REC/n") + 1 ))
  echo "$n" > "$REC/n"
  local rc=0
  command curl -w '%{{stderr}}%{{http_code}}' "$@" 2> "$REC/$n.status" | tee "$REC/$n.body" || rc=$?
  # A stream cut by its own --max-time is the README's way to end it.
  if [ "$rc" = 28 ] && [[ " $* " == *" --max-time "* ]]; then rc=0; fi
  return "$rc"
}}
{block}
"#,
        rec = record.display(),
        block = block.replace(README_URL, base_url),
    )
}

#[tokio::test]
async fn the_quick_start_runs_as_written() {
    let block = quick_start();
    assert!(block.contains("ADMIN="), "the block sets the admin token");
    assert!(block.contains("TOKEN="), "the block sets the lease token");
    run_as_written("Quick start", block, 15).await;
}

#[tokio::test]
async fn the_elections_walk_through_runs_as_written() {
    let block = block("Elections");
    assert!(block.contains("/campaign") && block.contains("/observe") && block.contains("/ready"));
    assert!(block.contains("sidelock campaign"));
    run_as_written("Elections", block, 7).await;
}

/// Runs `block` (of the README's `section`) against a sidecar started as
/// the Set up says and checks every command against what the README shows.
async fn run_as_written(section: &str, block: &str, min_curls: usize) {
    let steps = steps(block);
    let curls: Vec<&Step> = steps
        .iter()
        .filter(|s| s.command.contains("curl "))
        .collect();
    assert!(
        curls.len() >= min_curls,
        "the {section} lost commands: {steps:#?}"
    );
    for step in &curls {
        assert_eq!(
            step.command.matches("curl ").count(),
            1,
            "one curl per line, so each has its own shown answer: {}",
            step.command
        );
        assert!(step.shown.is_some(), "no `# → ` after {}", step.command);
    }

    // The sidecar as the README's Set up starts it.
    let set_up = README
        .split_once("\n## Set up\n")
        .expect("a Set up section")
        .1;
    let admin = set_up
        .split("SIDELOCK_ADMIN_TOKEN=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("Set up starts the sidecar with SIDELOCK_ADMIN_TOKEN");
    if block.contains("ADMIN=") {
        assert!(
            block.contains(&format!("ADMIN={admin}")),
            "the block's ADMIN is the Set up's token"
        );
    }
    let sidecar = SidecarBuilder::new("memory://")
        .admin_token(admin)
        .start()
        .await;
    let record = tempfile::tempdir().expect("temp dir");
    let bin_dir = Path::new(common::sidecar::SIDELOCK_BIN)
        .parent()
        .expect("the binary's directory");
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let script = script(block, sidecar.base_url(), record.path());
    let mut cmd = Command::new("bash");
    common::sidecar::remove_inherited_sidelock_env(&mut cmd);
    cmd.arg("-c")
        .arg(&script)
        .env("PATH", path)
        .env("SIDELOCK_URL", sidecar.base_url());
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::task::spawn_blocking(move || cmd.output().expect("bash")),
    )
    .await
    .unwrap_or_else(|_| panic!("the {section} finishes within 60 s"))
    .expect("join");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the {section} failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}\nsidecar log:\n{}",
        out.status,
        sidecar.log()
    );

    let calls: usize = std::fs::read_to_string(record.path().join("n"))
        .expect("the call count")
        .trim()
        .parse()
        .expect("a number");
    assert_eq!(calls, curls.len(), "every curl of the block ran once");
    let mut failures = Vec::new();
    for (i, step) in curls.iter().enumerate() {
        let n = i + 1;
        let status =
            std::fs::read_to_string(record.path().join(format!("{n}.status"))).expect("status");
        let status = status.trim();
        let status = &status[status.len().saturating_sub(3)..];
        let body = std::fs::read_to_string(record.path().join(format!("{n}.body"))).expect("body");
        let shown = step.shown.as_deref().unwrap_or_default();
        let (want, rest) = shown.split_once(' ').unwrap_or((shown, ""));
        if status != want {
            failures.push(format!(
                "{}: status {status}, the README says {want}: {body}",
                step.command
            ));
        }
        // A pipeline's shown output is what the pipeline prints, not curl's body.
        let output = if step.command.contains(" | ") {
            &stdout
        } else {
            &body
        };
        check_output(&step.command, rest, output, &mut failures);
    }
    for step in steps.iter().filter(|s| !s.command.contains("curl ")) {
        if let Some(shown) = &step.shown {
            check_output(&step.command, shown, &stdout, &mut failures);
        }
    }
    assert!(
        failures.is_empty(),
        "the README's {section} drifted from the product:\n{}\n\nstdout:\n{stdout}",
        failures.join("\n")
    );
}

#[test]
fn the_readers_of_the_convention_read_it() {
    assert_eq!(
        members(r#"{"a":"x","b":1,"t":"9f…","c":true,"d":{"e":null},"f":…}"#),
        [r#""a":"x""#, r#""b":1"#, r#""c":true"#, r#""e":null"#]
    );
    assert_eq!(
        events("event: acquired\ndata: {}\nevent: renewed"),
        ["acquired", "renewed"]
    );
    let mut failures = Vec::new();
    check_output("x", r#"{"fence":2}"#, r#"{"fence":3}"#, &mut failures);
    check_output(
        "x",
        "event: a\nevent: b",
        "event: b\nevent: a",
        &mut failures,
    );
    check_output("x", "fence 1", "fence 2", &mut failures);
    assert_eq!(failures.len(), 3, "{failures:?}");
    check_output("x", "(prose)", "", &mut failures);
    assert_eq!(failures.len(), 3, "{failures:?}");
}
