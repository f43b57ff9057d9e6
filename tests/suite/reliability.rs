//! Worst-day behaviour that does not depend on the backend: every `/v1`
//! route behind the API token, no token leaking anywhere, a shutdown with a
//! thousand holds and waiters, full waiter queues, slow and oversized
//! clients.

use crate::common;

use std::time::Duration;

use common::redis::RedisServer;
use common::{
    ADMIN_TOKEN, API_TOKEN, SidecarBuilder, assert_problem, eventually, unique_name, within,
};
use reqwest::{Method, StatusCode};
use serde_json::Value;
use tokio::io::AsyncWriteExt;

#[tokio::test]
async fn every_v1_route_in_the_openapi_document_needs_the_api_token() {
    let sidecar = SidecarBuilder::new("memory://")
        .api_token(API_TOKEN)
        .admin_token(ADMIN_TOKEN)
        .start()
        .await;
    let doc: Value = sidecar.api().get_json(&["openapi.json"], &[]).await;
    let paths = doc["paths"].as_object().expect("paths");
    // Wrong tokens are throttled per peer address after a burst: every
    // operation is asked from a loopback address of its own.
    let client_from = |n: u8| {
        reqwest::Client::builder()
            .no_proxy()
            .local_address(std::net::IpAddr::from([127, 0, 1, n + 1]))
            .build()
            .expect("HTTP client")
    };
    let mut checked: u8 = 0;
    for (path, operations) in paths {
        if !path.starts_with("/v1") {
            continue;
        }
        let concrete = path.replace("{name}", "route-walk");
        for method in operations.as_object().expect("operations").keys() {
            let method: Method = method.to_uppercase().parse().expect("HTTP method");
            let url = format!("{}{concrete}", sidecar.base_url());
            let http = client_from(checked);
            if path == "/v1/elections/{name}/ready" {
                // The one open /v1 route: a readiness probe, as /readyz.
                let response = http.request(method, &url).send().await.expect("request");
                assert_problem(response, StatusCode::SERVICE_UNAVAILABLE, "not-leader").await;
                continue;
            }
            for bearer in [None, Some("not-the-token")] {
                let mut request = http.request(method.clone(), &url);
                if let Some(token) = bearer {
                    request = request.bearer_auth(token);
                }
                let response = request.send().await.expect("request");
                assert_eq!(
                    response.status(),
                    StatusCode::UNAUTHORIZED,
                    "{method} {path} with bearer {bearer:?} must need the API token"
                );
                assert_problem(response, StatusCode::UNAUTHORIZED, "unauthorized").await;
            }
            checked += 1;
        }
    }
    assert!(
        checked >= 15,
        "only {checked} /v1 operations in the OpenAPI document"
    );
}

#[tokio::test]
async fn tokens_never_appear_in_logs_metrics_events_or_the_dashboard() {
    let sidecar = SidecarBuilder::new("memory://")
        .api_token(API_TOKEN)
        .admin_token(ADMIN_TOKEN)
        .env("SIDELOCK_LOG", "debug")
        .start()
        .await;
    let api = sidecar.api_with_token(API_TOKEN);
    let admin = sidecar.api_with_token(ADMIN_TOKEN);
    let mut events = api.events().await;
    let name = unique_name("secret");
    let lock = api.lock(&name);
    let grant = lock.acquire(&[("owner", "leaky")]).await;
    lock.keepalive(&grant.token, &[]).await;
    let mut hold = api.lock(&unique_name("held")).hold(&[("ttl", "1s")]).await;
    let held = hold.expect_acquired().await;
    lock.release(&grant.token).await;
    let again = lock.acquire(&[]).await;
    admin.lock(&name).force_release().await;
    drop(hold);
    eventually(
        "the force-release event",
        Duration::from_secs(5),
        async || {
            events
                .next_within(Duration::from_millis(100))
                .await
                .ok()
                .flatten()
                .filter(|e| e.event == "force-released")
        },
    )
    .await;

    let metrics = sidecar
        .api()
        .get(&["metrics"], &[])
        .await
        .text()
        .await
        .expect("metrics");
    let page = admin.get(&[], &[]).await.text().await.expect("dashboard");
    let places = [
        ("the log", sidecar.log()),
        ("/metrics", metrics),
        ("/v1/events", events.raw().to_owned()),
        ("the dashboard", page),
    ];
    for secret in [
        &grant.token,
        &held.token,
        &again.token,
        API_TOKEN,
        ADMIN_TOKEN,
    ] {
        for (place, text) in &places {
            assert!(!text.contains(secret), "a token appears in {place}");
        }
    }
}

#[tokio::test]
async fn sigterm_with_a_thousand_holds_and_waiters_releases_everything_and_tells_everyone() {
    const HOLDS: usize = 500;
    let server = RedisServer::start().await;
    let mut sidecar = SidecarBuilder::new(&server.url())
        .shutdown_grace("10s")
        .start()
        .await;
    let api = sidecar.api();
    let names: Vec<String> = (0..HOLDS)
        .map(|i| format!("{}-{i}", unique_name("drain")))
        .collect();
    let mut streams = Vec::new();
    for name in &names {
        let mut hold = api.lock(name).hold(&[("ttl", "30s")]).await;
        hold.expect_acquired().await;
        streams.push(hold);
    }
    for name in &names {
        let mut waiter = api.lock(name).hold(&[("wait", "60s")]).await;
        waiter.expect_queued().await;
        streams.push(waiter);
    }
    let main_keys: i64 = server
        .cmd(&["EXISTS", &format!("sidelock:{}", names[0])])
        .await;
    assert_eq!(main_keys, 1);

    sidecar.terminate();
    let mut told = 0;
    within("every stream told", Duration::from_secs(30), async {
        // Each client lets go once told: its lease is released then.
        for mut stream in streams {
            assert_eq!(stream.expect_lost().await, "shutdown");
            told += 1;
        }
    })
    .await;
    assert_eq!(told, 2 * HOLDS);
    let status = sidecar.wait_exit(Duration::from_secs(15)).await;
    assert!(status.success(), "exit status {status}");
    for name in &names {
        let held: i64 = server.cmd(&["EXISTS", &format!("sidelock:{name}")]).await;
        assert_eq!(held, 0, "{name} still held after shutdown");
        let waiting: i64 = server
            .cmd(&["LLEN", &format!("{{sidelock:{name}}}:q")])
            .await;
        assert_eq!(waiting, 0, "{name} still has waiters after shutdown");
    }
}

#[tokio::test]
async fn a_full_waiter_queue_answers_429_and_other_locks_stay_responsive() {
    let sidecar = SidecarBuilder::new("memory://")
        .max_waiters(5)
        .start()
        .await;
    let api = sidecar.api();
    let busy = api.lock("crowded");
    busy.acquire(&[("ttl", "60s")]).await;
    let mut waiters = Vec::new();
    for i in 0..5 {
        let mut w = busy
            .hold(&[("wait", "60s"), ("owner", &format!("w{i}"))])
            .await;
        w.expect_queued().await;
        waiters.push(w);
    }
    let refused = busy.acquire_raw(&[("wait", "5s")]).await;
    assert!(refused.headers().contains_key("retry-after"));
    assert_problem(refused, StatusCode::TOO_MANY_REQUESTS, "too-many-waiters").await;
    // Try-once requests are not queued, so they are answered as usual.
    busy.acquire_busy(&[]).await;
    let other = api.lock("quiet");
    let grant = within("another lock", Duration::from_secs(2), other.acquire(&[])).await;
    other.release(&grant.token).await;
}

#[tokio::test]
async fn ten_thousand_slow_and_oversized_clients_do_not_stall_the_sidecar() {
    const CONNECTIONS: usize = 10_000;
    let limit = sidelock::sidecar::raise_fd_limit();
    assert!(
        limit > CONNECTIONS as u64 + 500,
        "open-file limit {limit} is too low for {CONNECTIONS} connections; raise the hard limit (ulimit -Hn)"
    );
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let addr = format!("127.0.0.1:{}", sidecar.port());
    // 10,000 concurrent connections: half slowloris (half a request, then
    // nothing), half idle after connecting.
    let mut stalled = Vec::with_capacity(CONNECTIONS);
    for i in 0..CONNECTIONS {
        let mut s = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        if i % 2 == 0 {
            s.write_all(b"POST /v1/locks/slow HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n")
                .await
                .expect("write");
        }
        stalled.push(s);
    }
    // A body far over the limit is refused without reading it all.
    let huge = vec![b'a'; 8 * 1024 * 1024];
    let response = reqwest::Client::new()
        .post(format!("{}/v1/locks/huge", sidecar.base_url()))
        .header("content-type", "application/json")
        .body(huge)
        .send()
        .await;
    // The sidecar answers 413 as soon as the limit is passed; a client still
    // uploading may see that answer or the connection closed under it.
    match response {
        Ok(response) => {
            assert_problem(response, StatusCode::PAYLOAD_TOO_LARGE, "body-too-large").await;
        }
        Err(e) => assert!(
            !e.is_connect() && (e.is_request() || e.is_body()),
            "the oversized upload failed otherwise: {e}"
        ),
    }
    // Everyone else is served promptly all along.
    let lock = sidecar.api().lock(&unique_name("responsive"));
    for _ in 0..20 {
        let grant = within(
            "acquire while clients stall",
            Duration::from_secs(2),
            lock.acquire(&[]),
        )
        .await;
        lock.release(&grant.token).await;
    }
    drop(stalled);
}
