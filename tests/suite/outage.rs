//! A bad day, as the on-call engineer sees it: a backend that cannot be
//! reached is obvious everywhere they look — one WARN in the log at start and
//! on every change of health (redacted URL, a readable cause), 503s that say
//! which backend and why, `/readyz`, the metrics gauge and the dashboard —
//! and never with the backend's password.

use crate::common;

use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::*;
use reqwest::StatusCode;

const PASSWORD: &str = "s3cr3t-outage-pw";

/// Lines of `log` that contain `needle`.
fn lines_with<'a>(log: &'a str, needle: &str) -> Vec<&'a str> {
    log.lines().filter(|l| l.contains(needle)).collect()
}

/// Waits until the sidecar's log has `n` lines containing `needle`.
async fn log_lines(sidecar: &SidecarGuard, needle: &str, n: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = sidecar.log();
        if lines_with(&log, needle).len() >= n {
            return log;
        }
        assert!(
            Instant::now() < deadline,
            "no {n} lines with {needle:?} in the log:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `sidelock_backend_up`'s value.
async fn backend_up(api: &Api) -> f64 {
    let text = api
        .get(&["metrics"], &[])
        .await
        .text()
        .await
        .expect("metrics");
    text.lines()
        .find(|l| l.starts_with("sidelock_backend_up"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sidelock_backend_up in\n{text}"))
}

/// Checks a 503 `backend-unavailable` names the backend and the cause.
async fn assert_names_the_outage(response: reqwest::Response, kind: &str, shown: &str) -> String {
    names_the_outage(response, kind, shown, &["connection refused"]).await
}

/// As [`assert_names_the_outage`], with the cause expected.
async fn names_the_outage(
    response: reqwest::Response,
    kind: &str,
    shown: &str,
    causes: &[&str],
) -> String {
    let retry_after = response.headers().get("retry-after").cloned();
    let problem = assert_problem(
        response,
        StatusCode::SERVICE_UNAVAILABLE,
        "backend-unavailable",
    )
    .await;
    assert!(retry_after.is_some(), "Retry-After: {problem}");
    assert_eq!(problem["backend"], kind, "{problem}");
    assert_eq!(problem["address"], shown, "{problem}");
    let cause = problem["cause"].as_str().unwrap_or_default();
    assert!(causes.contains(&cause), "{problem}");
    let detail = problem["detail"].as_str().unwrap_or_default();
    for word in [kind, shown, cause] {
        assert!(detail.contains(word), "{word} missing: {problem}");
    }
    problem.to_string()
}

#[tokio::test]
async fn an_unreachable_redis_is_named_in_the_log_the_503s_readyz_and_the_dashboard() {
    // Port 1: nothing listens, every connection is refused.
    let url = format!("redis://:{PASSWORD}@127.0.0.1:1/0");
    let shown = "redis://127.0.0.1:1/0";
    let sidecar = SidecarBuilder::new(&url).start().await;
    let api = sidecar.api();

    let log = log_lines(&sidecar, "backend unreachable", 1).await;
    let warn = lines_with(&log, "backend unreachable")[0];
    assert!(warn.contains("WARN"), "{warn}");
    assert!(warn.contains(shown), "{warn}");
    assert!(warn.contains("connection refused"), "{warn}");
    assert!(
        !warn.contains("os error") && !warn.contains("Some("),
        "{warn}"
    );

    let mut seen = String::new();
    for _ in 0..5 {
        let r = api.lock("ledger").acquire_raw(&[]).await;
        seen.push_str(&assert_names_the_outage(r, "redis", shown).await);
    }
    let r = api.get(&["readyz"], &[]).await;
    seen.push_str(&assert_names_the_outage(r, "redis", shown).await);
    assert_eq!(backend_up(&api).await, 0.0);

    let page = api.get(&[], &[]).await;
    assert_eq!(page.status(), StatusCode::OK);
    let html = page.text().await.expect("dashboard");
    assert!(html.contains("Backend unreachable"), "{html}");
    assert!(html.contains("connection refused"), "{html}");
    assert!(html.contains(shown), "{html}");
    for claim in ["No lock is held.", "Nobody is waiting.", "No stale keys."] {
        assert!(!html.contains(claim), "{claim} while the backend is down");
    }
    assert!(html.contains("figure unknown"), "{html}");
    seen.push_str(&html);

    // Five failed acquires and a probe: still one WARN, no ERROR flood.
    let log = sidecar.log();
    assert_eq!(lines_with(&log, "backend unreachable").len(), 1, "{log}");
    assert!(lines_with(&log, " ERROR ").is_empty(), "{log}");
    seen.push_str(&log);
    assert!(!seen.contains(PASSWORD), "the password leaked:\n{seen}");
}

#[tokio::test]
async fn a_redis_that_goes_away_and_comes_back_is_logged_once_each_way() {
    let mut redis = RedisServer::start_with_password(PASSWORD).await;
    let url = redis.url();
    assert!(
        url.contains(PASSWORD),
        "the guard's URL carries the password"
    );
    let shown = url.replace(&format!(":{PASSWORD}@"), "");
    let sidecar = SidecarBuilder::new(&url).start().await;
    let api = sidecar.api();
    let lock = api.lock(&unique_name("health"));
    let grant = lock.acquire(&[]).await;
    lock.release(&grant.token).await;
    assert_eq!(backend_up(&api).await, 1.0);

    redis.kill();
    // A request notices at once (its connection broke); the periodic check
    // would within 10 s.
    let r = lock.acquire_raw(&[]).await;
    // The open connection broke, or a reconnect was already refused.
    names_the_outage(
        r,
        "redis",
        &shown,
        &["connection lost", "connection refused"],
    )
    .await;
    let log = log_lines(&sidecar, "backend unreachable", 1).await;
    assert!(
        lines_with(&log, "backend unreachable")[0].contains(&shown),
        "{log}"
    );
    assert_eq!(backend_up(&api).await, 0.0);
    for _ in 0..3 {
        let r = lock.acquire_raw(&[]).await;
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    }

    redis.restart().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = lock.acquire_raw(&[]).await;
        if r.status() == StatusCode::OK {
            let grant: Grant = r.json().await.expect("grant");
            lock.release(&grant.token).await;
            break;
        }
        assert!(Instant::now() < deadline, "Redis did not come back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = log_lines(&sidecar, "backend reachable again", 1).await;
    assert_eq!(backend_up(&api).await, 1.0);
    assert_eq!(lines_with(&log, "backend unreachable").len(), 1, "{log}");
    assert_eq!(
        lines_with(&log, "backend reachable again").len(),
        1,
        "{log}"
    );
    assert!(!log.contains(PASSWORD), "{log}");
}

#[tokio::test]
async fn unreachable_postgres_and_zookeeper_say_connection_refused() {
    for (url, kind, shown) in [
        (
            format!("postgres://postgres:{PASSWORD}@127.0.0.1:1/sidelock"),
            "postgres",
            "postgres://postgres@127.0.0.1:1/sidelock",
        ),
        (
            "zk://127.0.0.1:1".to_owned(),
            "zookeeper",
            "zk://127.0.0.1:1",
        ),
    ] {
        let sidecar = SidecarBuilder::new(&url).start().await;
        let log = log_lines(&sidecar, "backend unreachable", 1).await;
        let warn = lines_with(&log, "backend unreachable")[0];
        assert!(warn.contains(shown), "{warn}");
        let r = sidecar.api().get(&["readyz"], &[]).await;
        let problem =
            assert_problem(r, StatusCode::SERVICE_UNAVAILABLE, "backend-unavailable").await;
        assert_eq!(problem["backend"], kind, "{problem}");
        assert_eq!(problem["address"], shown, "{problem}");
        assert!(
            ["connection refused", "timed out"].contains(&problem["cause"].as_str().unwrap_or("")),
            "{problem}"
        );
        assert!(!format!("{log}{problem}").contains(PASSWORD), "{log}");
    }
}
