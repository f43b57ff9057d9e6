//! `sidelock run --lock NAME -- CMD`: holds a lock through a sidecar while
//! CMD runs. Exit codes: CMD's own; 128+signal if CMD was killed; 75 when the
//! lock was not acquired within --wait; 76 when the lease was lost (CMD gets
//! SIGTERM); 69 when the sidecar cannot be reached or answers an error.

use crate::common;

use std::time::Duration;

use common::cli::RunBuilder;
use common::*;

/// How long one `sidelock run` may take in these tests.
const RUN_TIMEOUT: Duration = Duration::from_secs(20);

/// CMD for tests that need it to keep running: creates `started`, then waits
/// (at most 20 s) until the test creates `go`. `sleep 0.05` keeps a TERM trap
/// responsive.
const WAIT_FOR_GO: &str = r#"touch started; i=0; while [ ! -e go ] && [ "$i" -lt 400 ]; do sleep 0.05; i=$((i + 1)); done"#;

/// A sidecar on the memory backend (`sidelock run` does not depend on the backend).
async fn sidecar(configure: impl FnOnce(SidecarBuilder) -> SidecarBuilder) -> SidecarGuard {
    configure(SidecarBuilder::new("memory://")).start().await
}

async fn default_sidecar() -> SidecarGuard {
    sidecar(|builder| builder).await
}

#[tokio::test]
async fn returns_the_exit_code_of_the_command() {
    let sidecar = default_sidecar().await;
    let mut run = RunBuilder::new(sidecar.base_url(), &unique_name("run-exit"))
        .sh("exit 7")
        .spawn();
    assert_eq!(run.exit_code(RUN_TIMEOUT).await, 7);
}

#[tokio::test]
async fn a_command_killed_by_a_signal_exits_128_plus_the_signal() {
    let sidecar = default_sidecar().await;
    let mut run = RunBuilder::new(sidecar.base_url(), &unique_name("run-killed"))
        .sh("kill -KILL $$")
        .spawn();
    assert_eq!(run.exit_code(RUN_TIMEOUT).await, 128 + 9);
}

#[tokio::test]
async fn the_command_sees_lock_token_and_fence() {
    let sidecar = default_sidecar().await;
    let name = unique_name("run-env");
    let mut run = RunBuilder::new(sidecar.base_url(), &name)
        .sh(r#"printf '%s\n%s\n%s\n' "$SIDELOCK_LOCK" "$SIDELOCK_TOKEN" "$SIDELOCK_FENCE" > env.txt"#)
        .spawn();
    assert_eq!(run.exit_code(RUN_TIMEOUT).await, 0, "{}", run.log());

    let env = std::fs::read_to_string(run.file("env.txt")).expect("CMD wrote env.txt");
    let [lock, token, fence] = env.lines().collect::<Vec<_>>()[..] else {
        panic!("unexpected env.txt: {env:?}");
    };
    assert_eq!(lock, name);
    assert!(token.len() >= 22, "SIDELOCK_TOKEN={token:?}");
    let fence: u64 = fence
        .parse()
        .unwrap_or_else(|e| panic!("SIDELOCK_FENCE={fence:?}: {e}"));
    assert!(fence >= 1);

    // The lease ended with CMD, and it was a real grant.
    let lock = sidecar.api().lock(&name);
    lock.wait_until_free().await;
    assert!(lock.acquire(&[]).await.fence > fence);
}

#[tokio::test]
async fn the_lock_is_held_while_the_command_runs() {
    let sidecar = default_sidecar().await;
    let lock = sidecar.api().lock(&unique_name("run-held"));
    let mut run = RunBuilder::new(sidecar.base_url(), lock.name())
        .sh(WAIT_FOR_GO)
        .spawn();
    run.wait_for_file("started").await;

    assert_eq!(lock.inspect().await.holders.len(), 1);
    lock.acquire_busy(&[]).await;

    std::fs::write(run.file("go"), "").expect("create go");
    assert_eq!(run.exit_code(RUN_TIMEOUT).await, 0);
    lock.wait_until_free().await;
}

#[tokio::test]
async fn a_busy_lock_exits_75_without_running_the_command() {
    let sidecar = default_sidecar().await;
    let lock = sidecar.api().lock(&unique_name("run-busy"));
    lock.acquire(&[("owner", "elsewhere")]).await;

    let mut run = RunBuilder::new(sidecar.base_url(), lock.name())
        .wait("200ms")
        .sh("touch ran")
        .spawn();
    assert_eq!(run.exit_code(RUN_TIMEOUT).await, 75);
    assert!(!run.file("ran").exists(), "CMD ran without the lock");
    assert_eq!(lock.inspect().await.holder_owners(), ["elsewhere"]);
}

#[tokio::test]
async fn a_lost_lease_terminates_the_command_and_exits_76() {
    let sidecar = sidecar(|builder| builder.admin_token(ADMIN_TOKEN)).await;
    let name = unique_name("run-lost");
    let mut run = RunBuilder::new(sidecar.base_url(), &name)
        .sh(&format!(
            "trap 'echo term > terminated; exit 143' TERM; {WAIT_FOR_GO}"
        ))
        .spawn();
    run.wait_for_file("started").await;

    let admin = sidecar.api_with_token(ADMIN_TOKEN);
    assert_eq!(admin.lock(&name).force_release().await, 1);
    assert_eq!(run.exit_code(RUN_TIMEOUT).await, 76);
    let marker = std::fs::read_to_string(run.file("terminated")).unwrap_or_default();
    assert_eq!(marker.trim(), "term", "CMD did not receive SIGTERM");
}

#[tokio::test]
async fn an_unreachable_sidecar_exits_69() {
    // A port that was free a moment ago: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("bind an ephemeral port")
        .port();
    let mut run = RunBuilder::new(
        &format!("http://127.0.0.1:{port}"),
        &unique_name("run-unreachable"),
    )
    .sh("touch ran")
    .spawn();
    assert_eq!(run.exit_code(RUN_TIMEOUT).await, 69);
    assert!(!run.file("ran").exists());
}

#[tokio::test]
async fn the_api_token_is_sent_when_configured() {
    let sidecar = sidecar(|builder| builder.api_token(API_TOKEN)).await;
    let name = unique_name("run-token");

    let mut refused = RunBuilder::new(sidecar.base_url(), &name)
        .sh("touch ran")
        .spawn();
    assert_eq!(refused.exit_code(RUN_TIMEOUT).await, 69, "no token: 401");
    assert!(!refused.file("ran").exists());

    let mut run = RunBuilder::new(sidecar.base_url(), &name)
        .env("SIDELOCK_API_TOKEN", API_TOKEN)
        .sh("exit 0")
        .spawn();
    assert_eq!(run.exit_code(RUN_TIMEOUT).await, 0, "{}", run.log());
}

/// `sidelock run` with `args` and no command of interest; returns its exit
/// code and everything it printed. For usage errors and `--help`.
fn run_cli(args: &[&str]) -> (Option<i32>, String) {
    let mut cmd = std::process::Command::new(common::sidecar::SIDELOCK_BIN);
    common::sidecar::remove_inherited_sidelock_env(&mut cmd);
    let out = cmd
        .env("NO_COLOR", "1")
        .args(args)
        .output()
        .expect("spawn sidelock");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// A loopback URL where nothing listens (the port was free a moment ago).
fn nothing_listens() -> String {
    format!("http://127.0.0.1:{}", free_port())
}

#[tokio::test]
async fn while_queued_it_says_so_on_stderr_in_every_mode() {
    let sidecar = default_sidecar().await;
    for shared in [false, true] {
        let lock = sidecar.api().lock(&unique_name("run-queued"));
        let held = lock.acquire(&[("owner", "elsewhere")]).await;
        let mut builder = RunBuilder::new(sidecar.base_url(), lock.name())
            .wait("20s")
            .flag("owner", "runner");
        if shared {
            builder = builder.arg("--shared");
        }
        let mut run = builder.sh("touch ran").spawn();
        lock.wait_for_waiters(&["runner"]).await;
        let line = eventually("the queued line on stderr", EVENT_TIMEOUT, async || {
            run.log()
                .lines()
                .find(|l| l.contains("queued"))
                .map(str::to_owned)
        })
        .await;
        assert!(line.contains(lock.name()), "names the lock: {line}");
        assert!(line.contains("position 1"), "gives the position: {line}");
        assert!(line.contains("since "), "says since when: {line}");
        assert!(!run.file("ran").exists(), "CMD ran while queued");

        lock.release(&held.token).await;
        assert_eq!(run.exit_code(RUN_TIMEOUT).await, 0, "{}", run.log());
        assert!(run.file("ran").exists());
    }
}

#[tokio::test]
async fn quiet_keeps_the_queue_to_itself() {
    let sidecar = default_sidecar().await;
    let lock = sidecar.api().lock(&unique_name("run-quiet"));
    let held = lock.acquire(&[("owner", "elsewhere")]).await;
    let mut run = RunBuilder::new(sidecar.base_url(), lock.name())
        .wait("20s")
        .flag("owner", "runner")
        .arg("--quiet")
        .sh("touch ran")
        .spawn();
    lock.wait_for_waiters(&["runner"]).await;
    lock.release(&held.token).await;
    // The queued event comes before the grant, so its line would be out by now.
    assert_eq!(run.exit_code(RUN_TIMEOUT).await, 0, "{}", run.log());
    assert!(run.file("ran").exists());
    assert_eq!(run.log().trim(), "", "--quiet printed something");
}

#[tokio::test]
async fn bad_durations_and_flags_are_usage_errors_before_any_request() {
    // Nothing listens at the URL: any request would end in exit 69, not 2.
    let url = nothing_listens();
    for (flag, value, named) in [
        ("--ttl", "30x", "--ttl"),
        ("--ttl", "", "--ttl"),
        ("--wait", "soon", "--wait"),
        ("--wait", "-1s", "--wait"),
        ("--ttl", "9000h", "--ttl"),
        ("--wait", "30sec", "--wait"),
        ("--url", "not a url", "--url"),
        ("--url", "ftp://127.0.0.1:7070", "--url"),
    ] {
        let mut args = vec!["run", "--lock", "x"];
        if flag != "--url" {
            args.extend(["--url", &url]);
        }
        let flag_value = format!("{flag}={value}");
        args.extend([flag_value.as_str(), "--", "sh", "-c", "touch ran"]);
        let (code, out) = run_cli(&args);
        assert_eq!(code, Some(2), "{flag} {value:?}: {out}");
        assert!(
            out.contains(named),
            "{flag} {value:?} names the flag: {out}"
        );
    }
}

#[tokio::test]
async fn an_unreachable_sidecar_says_connection_refused_at_its_url() {
    let url = nothing_listens();
    let mut run = RunBuilder::new(&url, &unique_name("run-refused"))
        .sh("touch ran")
        .spawn();
    assert_eq!(run.exit_code(RUN_TIMEOUT).await, 69);
    let log = run.log();
    assert_eq!(
        log.trim(),
        format!("sidelock run: cannot reach the sidecar at {url}: connection refused")
    );
    assert!(!run.file("ran").exists());
}

#[tokio::test]
async fn run_help_lists_exit_codes_and_environment() {
    let (code, help) = run_cli(&["run", "--help"]);
    assert_eq!(code, Some(0), "{help}");
    for code in ["69", "75", "76", "127", "128+"] {
        assert!(help.contains(code), "exit code {code} missing:\n{help}");
    }
    for var in [
        "SIDELOCK_URL",
        "SIDELOCK_API_TOKEN",
        "SIDELOCK_LOCK",
        "SIDELOCK_TOKEN",
        "SIDELOCK_FENCE",
    ] {
        assert!(help.contains(var), "{var} missing:\n{help}");
    }
}

/// Two sidecars on one Redis: the CLI's (`a`) and another client's (`b`).
async fn two_sidecars_on_redis() -> (common::redis::RedisServer, SidecarGuard, SidecarGuard) {
    let redis = common::redis::RedisServer::start().await;
    let a = SidecarBuilder::new(&redis.url()).start().await;
    let b = SidecarBuilder::new(&redis.url()).start().await;
    (redis, a, b)
}

/// CMD that records when it got SIGTERM, then waits for `go`.
fn recording_term() -> String {
    format!("trap 'touch terminated; exit 143' TERM; {WAIT_FOR_GO}")
}

/// Review finding: a sidecar frozen (SIGSTOP, a starved node) renews
/// nothing and tells its CLI nothing, and the CLI's stream stays open: the
/// lease ran out in Redis and another sidecar's client was granted the lock
/// while CMD ran on. The CLI now stops CMD when the lease's end draws near
/// without a renewal, before anyone else can be granted it.
#[tokio::test]
async fn a_frozen_sidecar_stops_the_command_before_another_is_granted() {
    let (_redis, a, b) = two_sidecars_on_redis().await;
    let name = unique_name("run-frozen");
    let mut run = RunBuilder::new(a.base_url(), &name)
        .flag("ttl", "2s")
        .sh(&recording_term())
        .spawn();
    run.wait_for_file("started").await;
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    let granted = b
        .api()
        .lock(&name)
        .acquire(&[("owner", "b"), ("wait", "30s")])
        .await;
    let stopped_first = run.file("terminated").exists();
    a.signal(nix::sys::signal::Signal::SIGCONT);
    assert!(
        stopped_first,
        "CMD still ran when another client was granted the lock (fence {})",
        granted.fence
    );
    assert_eq!(run.exit_code(RUN_TIMEOUT).await, 76);
}

/// The same for `sidelock campaign`: its command stops before a campaign
/// through another sidecar leads.
#[tokio::test]
async fn a_frozen_sidecar_stops_the_leaders_command_before_another_leads() {
    let (_redis, a, b) = two_sidecars_on_redis().await;
    let name = unique_name("campaign-frozen");
    let mut run = RunBuilder::campaign(a.base_url(), &name)
        .flag("ttl", "2s")
        .sh(&recording_term())
        .spawn();
    run.wait_for_file("started").await;
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    let mut heir = b
        .api()
        .open_stream(&["v1", "elections", &name, "campaign"], &[])
        .await;
    heir.wait_for("a leader event", Duration::from_secs(30), |e| {
        e.event == "leader"
    })
    .await;
    let stopped_first = run.file("terminated").exists();
    a.signal(nix::sys::signal::Signal::SIGCONT);
    assert!(
        stopped_first,
        "the old leader's command still ran when another campaign led"
    );
    assert_eq!(run.exit_code(RUN_TIMEOUT).await, 76);
}
