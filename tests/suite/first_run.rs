//! What a new user and an on-call engineer read first: the sidecar's log
//! lines and `--help`.

use crate::common;

use common::*;

/// The escape that starts every ANSI colour sequence.
const ESC: char = '\u{1b}';

/// `sidelock` with `args`; its exit code and everything it printed.
fn sidelock(args: &[&str]) -> (Option<i32>, String) {
    let mut cmd = std::process::Command::new(common::sidecar::SIDELOCK_BIN);
    common::sidecar::remove_inherited_sidelock_env(&mut cmd);
    let out = cmd.args(args).output().expect("spawn sidelock");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[tokio::test]
async fn a_log_that_is_not_a_terminal_has_no_colour_codes_in_either_format() {
    for format in ["text", "json"] {
        // NO_COLOR empty: colour is not refused by the environment, only by
        // the log being a file.
        let sidecar = SidecarBuilder::new("memory://")
            .env("NO_COLOR", "")
            .flag("log-format", format)
            .start()
            .await;
        let lock = sidecar.api().lock(&unique_name("colour"));
        let grant = lock.acquire(&[]).await;
        lock.release(&grant.token).await;
        let log = sidecar.log();
        assert!(log.contains("listening on"), "{log}");
        assert!(
            !log.contains(ESC),
            "--log-format {format} wrote colour codes:\n{log:?}"
        );
    }
}

#[tokio::test]
async fn the_listening_line_writes_the_safety_class_as_the_api_does() {
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let info = sidecar.api().info().await;
    let safety = info["backend"]["safety"].as_str().expect("backend.safety");
    assert_eq!(safety, "single-process");
    let log = sidecar.log();
    let line = log
        .lines()
        .find(|l| l.contains("listening on"))
        .expect("a listening line");
    assert!(line.contains(&format!("safety={safety}")), "{line}");
    assert!(!log.contains("SingleProcess"), "{log}");
}

/// `--help` in a pod whose backend URL, with its password, comes from the
/// environment (the chart's Secret) does not print the URL, nor the
/// tokens. (Clap printed `[env: SIDELOCK_BACKEND=<the URL>]`.)
#[test]
fn help_does_not_print_secrets_from_the_environment() {
    let mut cmd = std::process::Command::new(common::sidecar::SIDELOCK_BIN);
    common::sidecar::remove_inherited_sidelock_env(&mut cmd);
    let out = cmd
        .args(["serve", "--help"])
        .env(
            "SIDELOCK_BACKEND",
            "postgres://app:Backend-Pw-9d2e@db/locks",
        )
        .env("SIDELOCK_API_TOKEN", "Api-Token-5c1b")
        .env("SIDELOCK_ADMIN_TOKEN", "Admin-Token-7e4f")
        .output()
        .expect("spawn sidelock");
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("SIDELOCK_BACKEND"), "{help}");
    for secret in ["Backend-Pw-9d2e", "Api-Token-5c1b", "Admin-Token-7e4f"] {
        assert!(!help.contains(secret), "--help shows {secret}:\n{help}");
    }
}

#[test]
fn help_for_backend_lists_every_scheme() {
    let (code, help) = sidelock(&["serve", "--help"]);
    assert_eq!(code, Some(0), "{help}");
    for scheme in [
        "memory",
        "redis",
        "rediss",
        "redis+sentinel",
        "rediss+sentinel",
        "redis+cluster",
        "rediss+cluster",
        "redlock",
        "redlocks",
        "zk",
        "postgres",
        "postgresql",
    ] {
        assert!(
            help.contains(&format!("{scheme}://")),
            "--help does not list {scheme}://:\n{help}"
        );
    }
}
