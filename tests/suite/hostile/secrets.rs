//! No secret — lease token, API token, admin token, backend password — in
//! the sidecar's log (at `SIDELOCK_LOG=trace`), `/v1/info`, `/metrics`,
//! `/v1/events`, the listings or the dashboard; nor in start-up errors.
//! See the crate doc of the hostile suite (`main.rs`).

use reqwest::{Method, StatusCode};
use rstest::rstest;

use crate::common::api::Body;
use crate::common::postgres::PgCluster;
use crate::common::process::ChildGuard;
use crate::common::redis::{RedisNodes, RedisServer};
use crate::common::sidecar::SIDELOCK_BIN;
use crate::common::zookeeper::ZkServer;
use crate::common::*;

/// The backends' password: long and unusual, so any occurrence is a leak.
const PASSWORD: &str = "Backend-Passw0rd-7f3a9c1e5d";
/// A password the backends do not accept.
const WRONG_PASSWORD: &str = "Wrong-Backend-Passw0rd-2e6b8d4f";
/// A wrong API token a client tried: it may be someone's real secret.
const WRONG_TOKEN: &str = "wrong-token-4b8e2f6a0c1d3e5f";

/// Which backend a case runs on.
#[derive(Debug, Clone, Copy)]
enum On {
    Memory,
    Redis,
    Redlock,
    Postgres,
    ZooKeeper,
}

/// A started backend server (kept alive by the test) and the URL that
/// carries its password where the backend takes one.
async fn start(on: On) -> (Box<dyn std::any::Any>, String) {
    match on {
        On::Memory => (Box::new(()), "memory://".into()),
        On::Redis => {
            let server = RedisServer::start_with_password(PASSWORD).await;
            // Credential-like parameters in every spelling; Redis ignores them.
            let url = format!(
                "{}/0?pass%77ord={PASSWORD}&%50ASSWORD={PASSWORD}&auth_token={PASSWORD}",
                server.url()
            );
            (Box::new(server), url)
        }
        On::Redlock => {
            let nodes = RedisNodes::start_with_password(3, PASSWORD).await;
            let url = nodes.url();
            (Box::new(nodes), url)
        }
        On::Postgres => {
            let cluster = PgCluster::start_with_password(PASSWORD);
            // The driver decodes parameter names: this is its password.
            let url = format!(
                "postgres://postgres@127.0.0.1:{}/postgres?pass%77ord={PASSWORD}",
                cluster.port()
            );
            (Box::new(cluster), url)
        }
        On::ZooKeeper => {
            let server = ZkServer::start().await;
            let url = server.url("/secrets");
            (Box::new(server), url)
        }
    }
}

/// Reads an SSE response's body until it has sent `count` times `marker`:
/// what the stream sent.
async fn read_until(mut response: reqwest::Response, marker: &str, count: usize) -> String {
    let mut text = String::new();
    while text.matches(marker).count() < count {
        let chunk = within("the next events", EVENT_TIMEOUT, response.chunk())
            .await
            .expect("read the events stream")
            .unwrap_or_else(|| panic!("the events stream ended: {text}"));
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    text
}

/// Acquire, keepalive, release, hold, force-release and failed
/// authentication on every lock kind, with an API token, an admin token and
/// a backend password, at `SIDELOCK_LOG=trace`: none of those secrets, and
/// no lease token, appears in anything the sidecar shows or logs.
#[rstest]
#[case::memory(On::Memory, "text")]
#[case::redis(On::Redis, "text")]
#[case::redlock(On::Redlock, "text")]
#[case::postgres(On::Postgres, "text")]
#[case::postgres_json_log(On::Postgres, "json")]
#[case::zookeeper(On::ZooKeeper, "text")]
#[tokio::test]
async fn no_secret_reaches_the_log_info_metrics_events_or_dashboard(
    #[case] on: On,
    #[case] log_format: &str,
) {
    let (_server, url) = start(on).await;
    let schema = postgres::unique_ident("secrets");
    let mut sidecar = SidecarBuilder::new(&url)
        .env("SIDELOCK_LOG", "trace")
        .env("SIDELOCK_LOG_FORMAT", log_format)
        .env("SIDELOCK_PG_SCHEMA", &schema)
        .api_token(API_TOKEN)
        .admin_token(ADMIN_TOKEN)
        .start()
        .await;
    let api = sidecar.api_with_token(API_TOKEN);
    let admin = sidecar.api_with_token(ADMIN_TOKEN);
    let events = api.open_stream_raw(&["v1", "events"], &[]).await;
    assert_eq!(events.status(), StatusCode::OK);

    let mut tokens = Vec::new();
    // Redlock refuses semaphores of more than one permit.
    let permits = if matches!(on, On::Redlock) { "1" } else { "2" };
    let cases: [(Kind, &[(&str, &str)]); 3] = [
        (Kind::Lock, &[]),
        (Kind::Lock, &[("mode", "shared")]),
        (Kind::Semaphore, &[("limit", permits)]),
    ];
    for (kind, extra) in cases {
        let name = unique_name("secret");
        let resource = match kind {
            Kind::Lock => api.lock(&name),
            Kind::Semaphore => api.semaphore(&name),
        };
        let params: Vec<(&str, &str)> = extra.iter().copied().chain([("ttl", "10s")]).collect();
        // Acquire, keepalive, release.
        let grant = resource.acquire(&params).await;
        resource.keepalive(&grant.token, &[("ttl", "20s")]).await;
        // Inspect and list while it is held: they show holders, never tokens.
        let inspect = api
            .get(&["v1", kind.segment(), &name], &[])
            .await
            .text()
            .await
            .expect("inspect body");
        assert!(
            !inspect.contains(&grant.token),
            "inspect shows the token: {inspect}"
        );
        resource.release(&grant.token).await;
        tokens.push(grant.token);
        // A release with a token that holds nothing.
        let lost = resource.release_raw(WRONG_TOKEN).await;
        assert_eq!(lost.status(), StatusCode::GONE);
        // Hold, then close the stream.
        let mut hold = resource.hold(&params).await;
        tokens.push(hold.expect_acquired().await.token);
        drop(hold);
        resource.wait_until_free().await;
        // Force-release by the admin.
        let grant = resource.acquire(&params).await;
        tokens.push(grant.token);
        let forced = match kind {
            Kind::Lock => admin.lock(&name),
            Kind::Semaphore => admin.semaphore(&name),
        };
        assert_eq!(forced.force_release().await, 1);
    }
    // Failed authentication: /v1, the admin API, the dashboard's sign-in.
    let wrong = sidecar.api_with_token(WRONG_TOKEN);
    let refused = wrong.get(&["v1", "info"], &[]).await;
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    let refused = wrong.lock("x").force_release_raw().await;
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    let refused = api.lock("x").force_release_raw().await;
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    let sign_in = sidecar
        .api()
        .send(
            Method::POST,
            &["dashboard", "sign-in"],
            &[],
            Body::Form(vec![("token".into(), WRONG_TOKEN.into())]),
        )
        .await;
    assert_eq!(sign_in.status(), StatusCode::UNAUTHORIZED);

    // Everything the sidecar shows.
    let mut shown = vec![
        ("/v1/info", api.info().await.to_string()),
        (
            "/metrics",
            api.get(&["metrics"], &[])
                .await
                .text()
                .await
                .expect("metrics"),
        ),
        (
            "/v1/locks",
            api.get(&["v1", "locks"], &[])
                .await
                .text()
                .await
                .expect("list"),
        ),
        (
            "/v1/stale",
            api.get(&["v1", "stale"], &[])
                .await
                .text()
                .await
                .expect("stale"),
        ),
        (
            "/",
            api.get(&[""], &[]).await.text().await.expect("dashboard"),
        ),
        (
            "/dashboard/live",
            api.get(&["dashboard", "live"], &[])
                .await
                .text()
                .await
                .expect("live"),
        ),
        (
            "/v1/events",
            read_until(events, "force-released", cases.len()).await,
        ),
    ];
    assert!(
        shown[0].1.contains("\"url\""),
        "/v1/info names the backend URL: {}",
        shown[0].1
    );
    // The log, complete once the sidecar has released everything and exited.
    sidecar.terminate();
    sidecar.wait_exit(EXIT_TIMEOUT).await;
    let log = sidecar.log();
    assert!(log.contains("TRACE"), "the log is at trace level:\n{log}");
    shown.push(("the log", log));

    let mut secrets = vec![API_TOKEN, ADMIN_TOKEN, WRONG_TOKEN];
    if !matches!(on, On::Memory | On::ZooKeeper) {
        secrets.push(PASSWORD);
    }
    secrets.extend(tokens.iter().map(String::as_str));
    for (where_, text) in &shown {
        for secret in &secrets {
            if let Some(at) = text.find(secret) {
                let from = text[..at]
                    .char_indices()
                    .rev()
                    .nth(300)
                    .map_or(0, |(i, _)| i);
                panic!(
                    "{on:?}: {where_} shows the secret {secret:?}: …{}…",
                    &text[from..(at + secret.len()).min(text.len())]
                );
            }
        }
    }
}

/// A bad Redis or Redlock URL stops the start-up with an error that names
/// what is wrong, without the password (in the authority or a parameter).
#[rstest]
#[case::bad_port("redis://:{pw}@127.0.0.1:notaport/0")]
#[case::bad_database("redis://:{pw}@127.0.0.1:6379/notadb")]
#[case::password_with_a_slash("redis://:{pw}/x@127.0.0.1:6379/0")]
#[case::password_with_a_question_mark("redis://:x?{pw}@127.0.0.1:6379/0")]
#[case::password_before_a_question_mark("redis://:{pw}?x@127.0.0.1:6379/0")]
#[case::sentinel_without_master("redis+sentinel://user:{pw}@127.0.0.1:26379")]
#[case::redlock_bad_port("redlock://:{pw}@127.0.0.1:1,127.0.0.1:x")]
#[case::encoded_parameter("redis://127.0.0.1:6379/notadb?pass%77ord={pw}")]
#[case::unknown_scheme("rediz://:{pw}@127.0.0.1:6379")]
#[case::no_scheme("admin:{pw}@127.0.0.1:6379")]
#[case::zookeeper_parameter("zk://127.0.0.1:2181/x?pass%77ord={pw}")]
#[tokio::test]
async fn a_bad_backend_url_is_refused_without_its_password(#[case] url: &str) {
    let url = url.replace("{pw}", PASSWORD);
    let mut cmd = std::process::Command::new(SIDELOCK_BIN);
    crate::common::sidecar::remove_inherited_sidelock_env(&mut cmd);
    let out = cmd
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", &url])
        .env("SIDELOCK_LOG", "trace")
        .env("NO_COLOR", "1")
        .output()
        .expect("run sidelock");
    let output = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{url}: started:\n{output}");
    assert!(
        output.contains("URL") || output.contains("scheme"),
        "{url}: the error does not say what is wrong:\n{output}"
    );
    assert!(
        !output.contains(PASSWORD) && !output.contains("Passw0rd"),
        "{url}: the error shows the password:\n{output}"
    );
}

/// A wrong backend password: whether the sidecar stops at start-up or
/// serves and answers 503, neither its log (at trace), its start-up error
/// nor `/readyz` shows the password.
#[rstest]
#[case::redis(On::Redis)]
#[case::redlock(On::Redlock)]
#[case::postgres(On::Postgres)]
#[tokio::test]
async fn a_wrong_backend_password_is_not_shown(#[case] on: On) {
    let (_server, url) = start(on).await;
    let url = url.replace(PASSWORD, WRONG_PASSWORD);
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port();
    let mut cmd = std::process::Command::new(SIDELOCK_BIN);
    crate::common::sidecar::remove_inherited_sidelock_env(&mut cmd);
    cmd.args([
        "serve",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--backend",
        &url,
    ])
    .env("SIDELOCK_LOG", "trace")
    .env("SIDELOCK_PG_SCHEMA", postgres::unique_ident("secrets"))
    .env("NO_COLOR", "1");
    let log_path = dir.path().join("sidelock.log");
    let mut child = ChildGuard::spawn(cmd, "sidecar", &log_path, false);
    let api = Api::new(&format!("http://127.0.0.1:{port}"));
    // It refuses to start, or it serves and is not ready.
    let outcome = eventually(
        "the sidecar exits or answers /readyz",
        START_TIMEOUT,
        async || {
            if let Some(status) = child.try_status() {
                return Some(format!("exited ({status})"));
            }
            let response = reqwest::get(api.url(&["readyz"], &[])).await.ok()?;
            let status = response.status();
            Some(format!(
                "/readyz {status}: {}",
                response.text().await.unwrap_or_default()
            ))
        },
    )
    .await;
    if outcome.starts_with("/readyz") {
        assert!(outcome.starts_with("/readyz 503"), "{outcome}");
        // A request that needs the backend, so its error is logged too.
        let refused = api.lock("x").acquire_raw(&[]).await;
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        child.signal(nix::sys::signal::Signal::SIGTERM);
        child.wait_exit(EXIT_TIMEOUT).await;
    }
    let log = child.log();
    for shown in [&outcome, &log] {
        assert!(
            !shown.contains(WRONG_PASSWORD) && !shown.contains(PASSWORD),
            "{on:?}: the password is shown:\n{shown}"
        );
    }
}
