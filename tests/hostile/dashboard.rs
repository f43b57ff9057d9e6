//! Dashboard sessions: one random session per sign-in, ended by sign-out
//! and by its expiry, and wrong tokens throttled with bounded logging.
//! See the crate doc of the hostile suite (`main.rs`).

use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{CONTENT_TYPE, COOKIE, RETRY_AFTER, SET_COOKIE};

use crate::common::*;

/// Wrong sign-ins a hostile client sends as fast as it can.
const ATTEMPTS: usize = 200;

/// A client that does not follow redirects or keep cookies: the test
/// presents each session cookie itself.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(REQUEST_TIMEOUT)
        .build()
        .expect("HTTP client")
}

/// `POST /dashboard/sign-in` with `token=`.
async fn sign_in(sidecar: &SidecarGuard, token: &str) -> reqwest::Response {
    let body = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("token", token)
        .finish();
    client()
        .post(format!("{}/dashboard/sign-in", sidecar.base_url()))
        .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .expect("sign in")
}

/// Signs in with the right token and returns the whole `Set-Cookie` value.
async fn signed_in(sidecar: &SidecarGuard) -> String {
    let response = sign_in(sidecar, API_TOKEN).await;
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    response.headers()[SET_COOKIE]
        .to_str()
        .expect("ASCII cookie")
        .to_owned()
}

/// `name=value` of a `Set-Cookie` value.
fn pair(set_cookie: &str) -> &str {
    set_cookie.split(';').next().expect("name=value").trim()
}

/// The status of `path` presenting `cookie` (`name=value`).
async fn status_with(sidecar: &SidecarGuard, path: &str, cookie: &str) -> StatusCode {
    client()
        .get(format!("{}{path}", sidecar.base_url()))
        .header(COOKIE, cookie)
        .send()
        .await
        .expect("GET with a cookie")
        .status()
}

fn sidecar_with_tokens() -> SidecarBuilder {
    SidecarBuilder::new("memory://")
        .api_token(API_TOKEN)
        .admin_token(ADMIN_TOKEN)
}

#[tokio::test]
async fn every_sign_in_gets_its_own_session_and_sign_out_ends_only_that_one() {
    let sidecar = sidecar_with_tokens().start().await;
    let first = signed_in(&sidecar).await;
    let second = signed_in(&sidecar).await;
    let admin = sign_in(&sidecar, ADMIN_TOKEN).await;
    assert_eq!(admin.status(), StatusCode::SEE_OTHER);
    let third = admin.headers()[SET_COOKIE]
        .to_str()
        .expect("cookie")
        .to_owned();
    for cookie in [&first, &second, &third] {
        for flag in ["HttpOnly", "SameSite=Strict", "Path=/"] {
            assert!(cookie.contains(flag), "{flag} missing: {cookie}");
        }
        let value = pair(cookie).split_once('=').expect("name=value").1;
        assert!(
            value.len() >= 32 && value.chars().all(|c| c.is_ascii_hexdigit()),
            "a session is at least 128 random bits: {cookie}"
        );
        assert!(!cookie.contains(API_TOKEN) && !cookie.contains(ADMIN_TOKEN));
    }
    assert_ne!(pair(&first), pair(&second), "two sign-ins share a session");
    assert_ne!(pair(&first), pair(&third), "two sign-ins share a session");
    for cookie in [&first, &second, &third] {
        assert_eq!(
            status_with(&sidecar, "/", pair(cookie)).await,
            StatusCode::OK
        );
    }
    // A value nobody was given is no session.
    let (name, _) = pair(&first).split_once('=').expect("name=value");
    let forged = format!("{name}={}", "0".repeat(32));
    assert_eq!(
        status_with(&sidecar, "/", &forged).await,
        StatusCode::UNAUTHORIZED
    );

    // Sign-out ends the first session on the server, whatever the browser keeps.
    let out = client()
        .post(format!("{}/dashboard/sign-out", sidecar.base_url()))
        .header(COOKIE, pair(&first))
        .send()
        .await
        .expect("sign out");
    assert_eq!(out.status(), StatusCode::SEE_OTHER);
    let cleared = out.headers()[SET_COOKIE].to_str().expect("cookie");
    assert!(cleared.contains("Max-Age=0"), "{cleared}");
    for path in ["/", "/dashboard/live"] {
        assert_eq!(
            status_with(&sidecar, path, pair(&first)).await,
            StatusCode::UNAUTHORIZED,
            "{path} still open to a signed-out session"
        );
    }
    // The others stay signed in.
    for cookie in [&second, &third] {
        assert_eq!(
            status_with(&sidecar, "/", pair(cookie)).await,
            StatusCode::OK
        );
        assert_eq!(
            status_with(&sidecar, "/dashboard/live", pair(cookie)).await,
            StatusCode::OK
        );
    }
}

#[tokio::test]
async fn a_session_ends_at_its_expiry() {
    let sidecar = sidecar_with_tokens()
        .env("SIDELOCK_DASHBOARD_SESSION_TTL", "3s")
        .start()
        .await;
    let cookie = signed_in(&sidecar).await;
    assert!(
        cookie.contains("Max-Age=3"),
        "the browser is told: {cookie}"
    );
    let session = pair(&cookie).to_owned();
    // The server refuses it by itself, even from a client that keeps it.
    eventually("the session expires", Duration::from_secs(15), async || {
        (status_with(&sidecar, "/", &session).await == StatusCode::UNAUTHORIZED).then_some(())
    })
    .await;
    assert_eq!(
        status_with(&sidecar, "/dashboard/live", &session).await,
        StatusCode::UNAUTHORIZED
    );
    // A new sign-in works.
    let fresh = signed_in(&sidecar).await;
    assert_eq!(
        status_with(&sidecar, "/", pair(&fresh)).await,
        StatusCode::OK
    );
}

#[tokio::test]
async fn wrong_tokens_are_throttled_and_logged_in_bounded_lines() {
    let sidecar = sidecar_with_tokens().start().await;
    let mut unauthorized = 0;
    let mut throttled = Vec::new();
    for i in 0..ATTEMPTS {
        let response = sign_in(&sidecar, &format!("wrong-token-{i}")).await;
        match response.status() {
            StatusCode::UNAUTHORIZED => unauthorized += 1,
            StatusCode::TOO_MANY_REQUESTS => throttled.push(response),
            other => panic!("a wrong token got {other}"),
        }
    }
    assert!(
        unauthorized <= 20,
        "{unauthorized} of {ATTEMPTS} wrong tokens were checked: no throttle"
    );
    let last = throttled.pop().expect("throttled");
    let retry_after: u64 = last.headers()[RETRY_AFTER]
        .to_str()
        .expect("Retry-After")
        .parse()
        .expect("Retry-After in seconds");
    assert!(
        (1..=60).contains(&retry_after),
        "Retry-After: {retry_after}"
    );
    let problem = assert_problem(last, StatusCode::TOO_MANY_REQUESTS, "too-many-sign-ins").await;
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("sign-in")),
        "{problem}"
    );
    // While throttled even the right token is not looked at.
    assert_eq!(
        sign_in(&sidecar, API_TOKEN).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let warnings = sidecar
        .log()
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("sign-in"))
        .count();
    assert!(
        (1..=3).contains(&warnings),
        "{warnings} WARN lines for {ATTEMPTS} wrong sign-ins:\n{}",
        sidecar.log()
    );
    // After the throttle's window the right token works again.
    tokio::time::sleep(Duration::from_secs(retry_after)).await;
    let cookie = signed_in(&sidecar).await;
    assert_eq!(
        status_with(&sidecar, "/", pair(&cookie)).await,
        StatusCode::OK
    );
}
