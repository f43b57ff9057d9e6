//! Where a sidecar listens and how it says what is wrong with its settings:
//! every `--listen` form DESIGN.md lists (`IP:PORT`, `localhost:PORT`,
//! `:PORT`, `unix:/path`, several at once), the forms it refuses and why,
//! `--backend memory` without `://`, and configuration errors that name the
//! flag a user typed.

use crate::common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;

/// `sidelock <args>` run to its end: exit code and everything it printed.
fn sidelock(args: &[&str]) -> (Option<i32>, String) {
    let mut cmd = Command::new(common::sidecar::SIDELOCK_BIN);
    common::sidecar::remove_inherited_sidelock_env(&mut cmd);
    let out = cmd
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("spawn sidelock");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// `curl --unix-socket socket -s -w '\n%{http_code}' <args> http://localhost<path>`:
/// the body and the status.
fn curl_unix(socket: &Path, args: &[&str], path: &str) -> (String, u16) {
    let out = Command::new("curl")
        .arg("--unix-socket")
        .arg(socket)
        .args(["-s", "--max-time", "10", "-w", "\n%{http_code}"])
        .args(args)
        .arg(format!("http://localhost{path}"))
        .output()
        .expect("curl (scripts/setup.sh installs it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", &text));
    (body.to_owned(), status.trim().parse().unwrap_or(0))
}

/// Waits until `cond` holds, for at most 10 s.
fn eventually_sync(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn a_unix_socket_serves_every_route_beside_tcp_and_is_removed_at_exit() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("sidelock.sock");
    let mut sidecar = SidecarBuilder::new("memory://")
        .flag("listen", &format!("unix:{}", socket.display()))
        .start()
        .await;
    let log = sidecar.log();
    assert!(
        log.contains(&format!("listening on unix:{}", socket.display())),
        "{log}"
    );
    let meta = std::fs::metadata(&socket).expect("the socket exists");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o660, "socket mode");

    // An acquire over the socket is seen over TCP: one sidecar, two doors.
    let (body, status) = curl_unix(&socket, &["-X", "POST"], "/v1/locks/door?owner=unix");
    assert_eq!(status, 200, "{body}");
    let grant: serde_json::Value = serde_json::from_str(&body).expect("json");
    let lock = sidecar.api().lock("door");
    assert_eq!(lock.inspect().await.holder_owners(), ["unix"]);
    let token = grant["token"].as_str().expect("token");
    let (body, status) = curl_unix(
        &socket,
        &["-X", "DELETE"],
        &format!("/v1/locks/door?token={token}"),
    );
    assert_eq!(
        (status, body.contains("\"released\":true")),
        (200, true),
        "{body}"
    );

    // A hold stream over the socket: held while open, released when closed.
    let mut hold = Command::new("curl")
        .arg("--unix-socket")
        .arg(&socket)
        .args([
            "-sN",
            "http://localhost/v1/locks/door/hold?owner=streamer&ttl=30s",
        ])
        .stdout(Stdio::null())
        .spawn()
        .expect("curl");
    let deadline = Instant::now() + Duration::from_secs(10);
    while lock.inspect().await.holder_owners() != ["streamer"] {
        assert!(
            Instant::now() < deadline,
            "the hold over the socket was not granted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    hold.kill().expect("kill curl");
    let _ = hold.wait();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !lock.inspect().await.holders.is_empty() {
        assert!(
            Instant::now() < deadline,
            "closing the stream did not release"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The operator routes, and the dashboard, with curl's Host: localhost.
    for (path, want) in [
        ("/healthz", 200),
        ("/readyz", 200),
        ("/metrics", 200),
        ("/v1/info", 200),
        ("/openapi.json", 200),
        ("/", 200),
    ] {
        let (body, status) = curl_unix(&socket, &[], path);
        assert_eq!(status, want, "{path}: {body}");
    }

    // Socket clients name the host in many ways (requests-unixsocket sends
    // the percent-encoded path); only processes that can open the file get
    // here, so the Host rule against DNS rebinding does not apply.
    for host in [
        "Host: %2Frun%2Fsidelock.sock",
        "Host: sidelock",
        "Host: evil.example",
    ] {
        let (body, status) = curl_unix(&socket, &["-H", host], "/v1/info");
        assert_eq!(status, 200, "{host}: {body}");
    }
    // Over TCP the same Host is refused.
    let r = reqwest::Client::new()
        .get(format!("{}/v1/info", sidecar.base_url()))
        .header("Host", "evil.example")
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 421);

    sidecar.signal(Signal::SIGTERM);
    let status = sidecar.wait_exit(Duration::from_secs(15)).await;
    assert!(status.success(), "{status}");
    assert!(!socket.exists(), "the socket file is removed at exit");
}

#[tokio::test]
async fn a_stale_socket_is_replaced_and_a_live_one_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("s.sock");
    let listen = format!("unix:{}", socket.display());
    let first = SidecarBuilder::new("memory://")
        .flag("listen", &listen)
        .start()
        .await;

    // A second sidecar on the same path would steal the first one's clients.
    let (code, text) = sidelock(&["--listen", &listen]);
    assert_ne!(code, Some(0), "{text}");
    assert!(text.contains("--listen"), "{text}");
    assert!(text.contains(&socket.display().to_string()), "{text}");
    assert!(text.contains("another process"), "{text}");
    assert!(socket.exists(), "the live socket is left alone");

    // A sidecar killed without cleaning up leaves its file behind: reused.
    first.signal(Signal::SIGKILL);
    eventually_sync("the first sidecar to die", || {
        std::os::unix::net::UnixStream::connect(&socket).is_err()
    });
    assert!(socket.exists(), "SIGKILL leaves the file");
    let second = SidecarBuilder::new("memory://")
        .flag("listen", &listen)
        .start()
        .await;
    let (_, status) = curl_unix(&socket, &[], "/healthz");
    assert_eq!(status, 200, "{}", second.log());

    // A path that is not a socket is never deleted.
    let file = dir.path().join("data.txt");
    std::fs::write(&file, "keep me").expect("write");
    let (code, text) = sidelock(&["--listen", &format!("unix:{}", file.display())]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("not a socket"), "{text}");
    assert_eq!(std::fs::read_to_string(&file).expect("kept"), "keep me");
}

#[tokio::test]
async fn loopback_shorthands_listen_on_127_0_0_1() {
    for form in [":0", "localhost:0"] {
        // The builder's own --listen 127.0.0.1:0 comes first; the log's
        // second listening line is this form's.
        let sidecar = SidecarBuilder::new("memory://")
            .flag("listen", form)
            .start()
            .await;
        let log = sidecar.log();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("listening on "))
            .collect();
        assert_eq!(lines.len(), 2, "{log}");
        let addr = lines[1]
            .split("listening on ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .expect("an address");
        assert!(addr.starts_with("127.0.0.1:"), "{form} -> {addr}");
        let url = format!("http://{addr}/healthz");
        let status = reqwest::get(&url).await.expect("reach").status();
        assert_eq!(status, 200, "{form}: {url}");
    }
}

#[test]
fn other_listen_forms_are_refused_naming_the_flag_and_the_forms() {
    for (value, hint) in [
        ("7071", Some("did you mean :7071")),
        ("localhost", None),
        ("http://127.0.0.1:7070", None),
        ("unix:", None),
        ("unix:relative.sock", Some("absolute")),
        ("127.0.0.1", None),
        ("127.0.0.1:99999", None),
    ] {
        let (code, text) = sidelock(&["--listen", value]);
        assert_eq!(code, Some(2), "--listen {value}: {text}");
        assert!(text.contains("--listen"), "{value}: {text}");
        assert!(text.contains(&format!("{value:?}")), "{value}: {text}");
        for form in ["IP:PORT", "localhost:PORT", ":PORT", "unix:/path"] {
            assert!(text.contains(form), "{value}: {form} missing in {text}");
        }
        if let Some(hint) = hint {
            assert!(text.contains(hint), "{value}: {text}");
        }
        assert!(!text.contains("invalid socket address syntax"), "{text}");
    }
    // The environment and the file take the same forms and say so too.
    let mut cmd = Command::new(common::sidecar::SIDELOCK_BIN);
    common::sidecar::remove_inherited_sidelock_env(&mut cmd);
    let out = cmd.env("SIDELOCK_LISTEN", "7071").output().expect("spawn");
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("did you mean :7071"), "{text}");

    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("sidelock.toml");
    std::fs::write(&file, "listen = \"7071\"\n").expect("write");
    let (code, text) = sidelock(&["--config", file.to_str().expect("utf-8")]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("did you mean :7071"), "{text}");
}

#[tokio::test]
async fn the_file_and_the_environment_take_several_listeners() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("env.sock");
    let sidecar = SidecarBuilder::new("memory://")
        .env("SIDELOCK_LISTEN", &format!(":0,unix:{}", socket.display()))
        .start()
        .await;
    // Flags win over env: only the builder's --listen is used.
    assert!(!socket.exists(), "{}", sidecar.log());
    drop(sidecar);

    let file_socket = dir.path().join("file.sock");
    let sidecar = SidecarBuilder::new("memory://")
        .config_toml(&format!("listen = [\"unix:{}\"]\n", file_socket.display()))
        .start()
        .await;
    assert!(
        !file_socket.exists(),
        "flags win over the file: {}",
        sidecar.log()
    );
    drop(sidecar);

    // Without the builder's flag: the env's two listeners are both served.
    let mut cmd = Command::new(common::sidecar::SIDELOCK_BIN);
    common::sidecar::remove_inherited_sidelock_env(&mut cmd);
    let log = dir.path().join("env.log");
    let mut child = cmd
        .env(
            "SIDELOCK_LISTEN",
            format!("127.0.0.1:0, unix:{}", socket.display()),
        )
        .env("NO_COLOR", "1")
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("spawn");
    eventually_sync("both listeners", || {
        std::fs::read_to_string(&log)
            .map(|l| l.matches("listening on ").count() == 2)
            .unwrap_or(false)
    });
    let (_, status) = curl_unix(&socket, &[], "/healthz");
    assert_eq!(status, 200);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid")),
        Signal::SIGTERM,
    )
    .expect("signal");
    assert!(child.wait().expect("wait").success());
    assert!(!socket.exists(), "removed at exit");
}

/// The runtime's worker threads of process `pid`.
fn workers(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("the sidecar's threads")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim() == "tokio-rt-worker")
        .count()
}

/// `--threads` (from the environment or the file) sizes the runtime, which
/// serves as before; unset, it has one worker per CPU.
#[tokio::test]
async fn threads_sets_the_runtimes_workers() {
    let one = SidecarBuilder::new("memory://")
        .env("SIDELOCK_THREADS", "1")
        .start()
        .await;
    let three = SidecarBuilder::new("memory://")
        .config_toml("threads = 3\n")
        .start()
        .await;
    let unset = SidecarBuilder::new("memory://").start().await;
    for (sidecar, expected) in [
        (&one, 1),
        (&three, 3),
        (
            &unset,
            std::thread::available_parallelism().map_or(1, usize::from),
        ),
    ] {
        let lock = sidecar.api().lock(&unique_name("threads"));
        let grant = lock.acquire(&[]).await;
        lock.release(&grant.token).await;
        assert_eq!(workers(sidecar.pid()), expected, "{}", sidecar.log());
    }
}

#[tokio::test]
async fn backend_memory_without_scheme_means_memory() {
    let sidecar = SidecarBuilder::new("memory").start().await;
    let info = sidecar.api().info().await;
    assert_eq!(info["backend"]["url"], "memory://", "{info}");
    let log = sidecar.log();
    assert!(log.contains("backend=memory://"), "{log}");

    for value in ["redis", "localhost:6379", "postgres"] {
        let (code, text) = sidelock(&["--backend", value]);
        assert_eq!(code, Some(2), "--backend {value}: {text}");
        assert!(text.contains("--backend"), "{text}");
        assert!(text.contains(&format!("{value:?}")), "{text}");
        assert!(text.contains("redis://"), "{text}");
    }
}

#[test]
fn configuration_errors_name_the_flag() {
    for (args, flags) in [
        (
            &["--default-ttl", "2h", "--max-ttl", "1h"][..],
            &["--default-ttl", "--max-ttl"][..],
        ),
        (&["--max-ttl", "0"][..], &["--max-ttl"][..]),
        (&["--max-waiters", "0"][..], &["--max-waiters"][..]),
        (&["--max-held", "0"][..], &["--max-held"][..]),
        (&["--idle-timeout", "0"][..], &["--idle-timeout"][..]),
        (&["--max-connections", "0"][..], &["--max-connections"][..]),
        (&["--threads", "0"][..], &["--threads"][..]),
        (&["--threads", "5000"][..], &["--threads"][..]),
        (&["--stale-after", "9000h"][..], &["--stale-after"][..]),
        (
            &["--dashboard-session-ttl", "31d0h"][..],
            &["--dashboard-session-ttl"][..],
        ),
        (
            &["--dashboard-session-ttl", "800h"][..],
            &["--dashboard-session-ttl"][..],
        ),
        (&["--sidecar-id", "pod\u{202e}1"][..], &["--sidecar-id"][..]),
        (&["--allowed-hosts", "a/b"][..], &["--allowed-hosts"][..]),
    ] {
        let (code, text) = sidelock(args);
        assert_eq!(code, Some(2), "{args:?}: {text}");
        for flag in flags {
            assert!(text.contains(flag), "{args:?}: {flag} missing in {text}");
        }
        for internal in [
            "default_ttl",
            "max_ttl",
            "max_waiters",
            "max_held",
            "idle_timeout",
            "max_connections",
            "stale_after",
            "dashboard_session_ttl",
            "sidecar_id",
            "allowed_hosts",
        ] {
            assert!(
                !text.contains(internal),
                "{args:?} names the internal key {internal}: {text}"
            );
        }
    }
}
