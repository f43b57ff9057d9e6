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

/// The sign-in form's body has the same limit as every other request
/// body (64 KiB, 413 `body-too-large`): it needs no token, and it was read
/// whole up to 2 MiB (the web framework's default) before anything was
/// checked, then answered 400 as a form with a wrong parameter.
#[tokio::test]
async fn a_sign_in_form_past_the_body_limit_is_refused_as_too_large() {
    let sidecar = sidecar_with_tokens().start().await;
    let body = format!("token={}", "a".repeat(64 * 1024));
    let response = client()
        .post(format!("{}/dashboard/sign-in", sidecar.base_url()))
        .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .expect("sign in");
    assert_problem(response, StatusCode::PAYLOAD_TOO_LARGE, "body-too-large").await;
    // A form within the limit still signs in.
    signed_in(&sidecar).await;
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
    let problem = assert_problem(last, StatusCode::TOO_MANY_REQUESTS, THROTTLED).await;
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("wrong tokens")),
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
        .filter(|l| l.contains("WARN") && l.contains("wrong token"))
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

// ---------------------------------------------------------------------------
// One throttle of failed token checks, per peer address, shared by the
// dashboard sign-in, the `/v1` bearer token and the admin bearer token.

/// A second loopback address a hostile client sends from; the sidecar
/// listens on 127.0.0.1 and sees it as another peer.
const OTHER_PEER: [u8; 4] = [127, 0, 0, 2];

/// The slug of a peer whose failed token checks used up its burst.
const THROTTLED: &str = "too-many-failed-tokens";

/// Like [`client`], with `from` as the source address of its connections.
fn client_from(from: [u8; 4]) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(REQUEST_TIMEOUT)
        .local_address(std::net::IpAddr::from(from))
        .build()
        .expect("HTTP client")
}

/// Where a token is checked: every `/v1` lock kind, the listing, the
/// admin routes and the dashboard itself, each as a request with `token`.
fn token_check(
    http: &reqwest::Client,
    sidecar: &SidecarGuard,
    i: usize,
    token: &str,
) -> reqwest::RequestBuilder {
    let base = sidecar.base_url();
    let request = match i % 7 {
        0 => http.get(format!("{base}/v1/info")),
        1 => http.post(format!("{base}/v1/locks/{}?ttl=30s", unique_name("excl"))),
        2 => http.post(format!(
            "{base}/v1/locks/{}?ttl=30s&mode=shared",
            unique_name("shared")
        )),
        3 => http.post(format!(
            "{base}/v1/semaphores/{}?ttl=30s&limit=3",
            unique_name("sem")
        )),
        4 => http.get(format!("{base}/v1/locks")),
        5 => http.delete(format!("{base}/v1/admin/semaphores/permits")),
        _ => http.get(format!("{base}/")),
    };
    request.bearer_auth(token)
}

/// Sends wrong tokens from `http` until one is refused with 429 (at most
/// [`ATTEMPTS`]) and returns that answer and how many were checked (401).
async fn exhaust(
    http: &reqwest::Client,
    mut send: impl AsyncFnMut(&reqwest::Client, usize) -> reqwest::Response,
) -> (reqwest::Response, usize) {
    let mut unauthorized = 0;
    for i in 0..ATTEMPTS {
        let response = send(http, i).await;
        match response.status() {
            StatusCode::UNAUTHORIZED => unauthorized += 1,
            StatusCode::TOO_MANY_REQUESTS => return (response, unauthorized),
            other => panic!(
                "wrong token {i} got {other}: {}",
                response.text().await.unwrap_or_default()
            ),
        }
    }
    panic!("{ATTEMPTS} wrong tokens were all checked (401): no throttle");
}

/// Whether `right` (a request with a right token) is refused with 429 while
/// `http`'s peer is throttled: wrong tokens from `guess` empty the bucket
/// first. A refill may land between the two, so it tries a few times.
async fn refused_while_throttled(
    http: &reqwest::Client,
    mut guess: impl AsyncFnMut(&reqwest::Client, usize) -> reqwest::Response,
    mut right: impl AsyncFnMut(&reqwest::Client) -> reqwest::Response,
) {
    for _ in 0..5 {
        exhaust(http, &mut guess).await;
        let response = right(http).await;
        if response.status() == StatusCode::TOO_MANY_REQUESTS {
            retry_after(&response);
            assert_problem(response, StatusCode::TOO_MANY_REQUESTS, THROTTLED).await;
            return;
        }
        assert!(
            response.status().is_success() || response.status().is_redirection(),
            "the right token got {}",
            response.status()
        );
    }
    panic!("a throttled peer's right token was compared and accepted 5 times");
}

/// The 429's `Retry-After` in seconds, checked to be sane.
fn retry_after(response: &reqwest::Response) -> u64 {
    let seconds: u64 = response.headers()[RETRY_AFTER]
        .to_str()
        .expect("Retry-After")
        .parse()
        .expect("Retry-After in seconds");
    assert!((1..=60).contains(&seconds), "Retry-After: {seconds}");
    seconds
}

/// WARN lines about wrong tokens in the sidecar's log.
fn token_warnings(sidecar: &SidecarGuard) -> usize {
    sidecar
        .log()
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("wrong token"))
        .count()
}

#[tokio::test]
async fn wrong_bearer_tokens_on_v1_are_throttled_after_the_burst_with_bounded_logging() {
    let sidecar = sidecar_with_tokens().start().await;
    // One client, one kept-alive connection, guessing as fast as it can on
    // every kind of /v1 route.
    let http = client();
    let (refused, unauthorized) = exhaust(&http, async |http: &reqwest::Client, i: usize| {
        token_check(http, &sidecar, i % 5, &format!("guess-{i}"))
            .send()
            .await
            .expect("guess")
    })
    .await;
    assert!(
        unauthorized <= 20,
        "{unauthorized} wrong tokens were checked before the first 429"
    );
    retry_after(&refused);
    let problem = assert_problem(refused, StatusCode::TOO_MANY_REQUESTS, THROTTLED).await;
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("wrong tokens") && d.contains("one per second")),
        "{problem}"
    );
    // The flood goes on: it is refused without a comparison on every route
    // that checks a token; only the refill (one per second) is checked.
    let started = std::time::Instant::now();
    let mut checked = 0;
    for i in 0..ATTEMPTS {
        let response = token_check(&http, &sidecar, i, &format!("guess-more-{i}"))
            .send()
            .await
            .expect("guess");
        match response.status() {
            StatusCode::TOO_MANY_REQUESTS => {}
            StatusCode::UNAUTHORIZED => checked += 1,
            other => panic!("guess {i} got {other}"),
        }
    }
    let refills = 2 + started.elapsed().as_secs();
    assert!(
        checked <= refills,
        "{checked} of {ATTEMPTS} throttled guesses were checked in {:?}",
        started.elapsed()
    );
    // The right token is not compared either, on any route or the sign-in.
    for route in 0..7 {
        refused_while_throttled(
            &http,
            async |http: &reqwest::Client, i: usize| {
                token_check(http, &sidecar, route, &format!("again-{i}"))
                    .send()
                    .await
                    .expect("guess")
            },
            async |http: &reqwest::Client| {
                let token = if route == 5 { ADMIN_TOKEN } else { API_TOKEN };
                token_check(http, &sidecar, route, token)
                    .send()
                    .await
                    .expect("right token")
            },
        )
        .await;
    }
    refused_while_throttled(
        &http,
        async |http: &reqwest::Client, i: usize| {
            token_check(http, &sidecar, 0, &format!("again-{i}"))
                .send()
                .await
                .expect("guess")
        },
        async |_: &reqwest::Client| sign_in(&sidecar, API_TOKEN).await,
    )
    .await;
    let warnings = token_warnings(&sidecar);
    assert!(
        (1..=3).contains(&warnings),
        "{warnings} WARN lines for {} wrong tokens:\n{}",
        2 * ATTEMPTS,
        sidecar.log()
    );
    assert!(
        !sidecar.log().contains("guess-"),
        "a presented token was logged"
    );
}

#[tokio::test]
async fn wrong_tokens_from_one_peer_do_not_throttle_another() {
    let sidecar = sidecar_with_tokens().start().await;
    let hostile = client_from(OTHER_PEER);
    // Another address (another pod, to the sidecar) uses up its sign-ins.
    let (refused, _) = exhaust(&hostile, async |http: &reqwest::Client, i: usize| {
        http.post(format!("{}/dashboard/sign-in", sidecar.base_url()))
            .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(format!("token=guess-{i}"))
            .send()
            .await
            .expect("sign in")
    })
    .await;
    assert_problem(refused, StatusCode::TOO_MANY_REQUESTS, THROTTLED).await;
    // The operator's browser (port-forwarded: loopback) still signs in.
    let response = sign_in(&sidecar, API_TOKEN).await;
    assert_eq!(
        response.status(),
        StatusCode::SEE_OTHER,
        "another address's failures locked the operator out: {}",
        response.text().await.unwrap_or_default()
    );
    // The hostile peer's failures count at every place a token is checked.
    for route in 0..7 {
        refused_while_throttled(
            &hostile,
            async |http: &reqwest::Client, i: usize| {
                token_check(http, &sidecar, route, &format!("guess-{i}"))
                    .send()
                    .await
                    .expect("guess")
            },
            async |http: &reqwest::Client| {
                token_check(http, &sidecar, route, ADMIN_TOKEN)
                    .send()
                    .await
                    .expect("right token")
            },
        )
        .await;
    }

    // The application and the operator on 127.0.0.1 are not affected:
    // right tokens work everywhere, and a wrong one is checked (401).
    let local = client();
    for i in 0..7 {
        let response = token_check(&local, &sidecar, i, API_TOKEN)
            .send()
            .await
            .expect("right token");
        let status = response.status();
        let expected = if i == 5 {
            // The API token may not use the admin API.
            StatusCode::FORBIDDEN
        } else {
            StatusCode::OK
        };
        assert_eq!(status, expected, "route {i} with the API token");
    }
    let admin = token_check(&local, &sidecar, 5, ADMIN_TOKEN)
        .send()
        .await
        .expect("admin");
    assert_eq!(admin.status(), StatusCode::OK);
    let cookie = signed_in(&sidecar).await;
    assert_eq!(
        status_with(&sidecar, "/", pair(&cookie)).await,
        StatusCode::OK
    );
    let wrong = token_check(&local, &sidecar, 0, "a-typo")
        .send()
        .await
        .expect("typo");
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn after_the_refill_the_right_token_works_again() {
    let sidecar = sidecar_with_tokens().start().await;
    let http = client();
    let (refused, _) = exhaust(&http, async |http: &reqwest::Client, i: usize| {
        token_check(http, &sidecar, 0, &format!("guess-{i}"))
            .send()
            .await
            .expect("guess")
    })
    .await;
    let wait = retry_after(&refused);
    // Asking with the right token while throttled costs nothing: it is
    // let through once the bucket has an attempt again.
    eventually(
        "the right token is accepted again",
        Duration::from_secs(wait + 10),
        async || {
            let response = token_check(&http, &sidecar, 0, API_TOKEN)
                .send()
                .await
                .expect("right token");
            (response.status() == StatusCode::OK).then_some(())
        },
    )
    .await;
    // A success takes nothing from the bucket: every route answers.
    for i in 0..7 {
        let token = if i == 5 { ADMIN_TOKEN } else { API_TOKEN };
        let response = token_check(&http, &sidecar, i, token)
            .send()
            .await
            .expect("right token");
        assert_eq!(response.status(), StatusCode::OK, "route {i}");
    }
    let cookie = signed_in(&sidecar).await;
    assert_eq!(
        status_with(&sidecar, "/", pair(&cookie)).await,
        StatusCode::OK
    );
}

#[tokio::test]
async fn wrong_admin_tokens_count_too() {
    // With an API token, a wrong admin token on the admin routes; without
    // one, the admin check is the only token check there is.
    for api_token in [true, false] {
        let mut builder = SidecarBuilder::new("memory://").admin_token(ADMIN_TOKEN);
        if api_token {
            builder = builder.api_token(API_TOKEN);
        }
        let sidecar = builder.start().await;
        let hostile = client_from(OTHER_PEER);
        let (refused, unauthorized) =
            exhaust(&hostile, async |http: &reqwest::Client, i: usize| {
                let kind = if i.is_multiple_of(2) {
                    "locks"
                } else {
                    "semaphores"
                };
                http.delete(format!("{}/v1/admin/{kind}/guarded", sidecar.base_url()))
                    .bearer_auth(format!("guess-{i}"))
                    .send()
                    .await
                    .expect("guess")
            })
            .await;
        assert!(unauthorized <= 20, "{unauthorized} admin guesses checked");
        retry_after(&refused);
        assert_problem(refused, StatusCode::TOO_MANY_REQUESTS, THROTTLED).await;
        // The right admin token is not compared while the peer is throttled.
        refused_while_throttled(
            &hostile,
            async |http: &reqwest::Client, i: usize| {
                http.delete(format!("{}/v1/admin/locks/guarded", sidecar.base_url()))
                    .bearer_auth(format!("again-{i}"))
                    .send()
                    .await
                    .expect("guess")
            },
            async |http: &reqwest::Client| {
                http.delete(format!("{}/v1/admin/locks/guarded", sidecar.base_url()))
                    .bearer_auth(ADMIN_TOKEN)
                    .send()
                    .await
                    .expect("admin")
            },
        )
        .await;
        let warnings = token_warnings(&sidecar);
        assert!(
            (1..=3).contains(&warnings),
            "{warnings} WARN lines:\n{}",
            sidecar.log()
        );
        // Another peer's admin token works.
        let local = client()
            .delete(format!("{}/v1/admin/locks/guarded", sidecar.base_url()))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .expect("admin");
        assert_eq!(local.status(), StatusCode::OK, "api token: {api_token}");
    }
}

/// A sign-in form that is not one `token=` (sent twice, as JSON, or with
/// no body) and an asset path that is no text answer problem documents,
/// as every error does; they were axum's plain text. The answer never
/// quotes what was sent (a token).
#[tokio::test]
async fn a_malformed_sign_in_or_asset_path_answers_a_problem_document() {
    let sidecar = SidecarBuilder::new("memory://")
        .api_token(API_TOKEN)
        .start()
        .await;
    let post = |content_type: &'static str, body: String| {
        client()
            .post(format!("{}/dashboard/sign-in", sidecar.base_url()))
            .header(CONTENT_TYPE, content_type)
            .body(body)
            .send()
    };
    let twice = format!("token={API_TOKEN}&token=other");
    let answer = post("application/x-www-form-urlencoded", twice)
        .await
        .expect("sign in");
    let problem = assert_problem(answer, StatusCode::BAD_REQUEST, "invalid-parameter").await;
    assert!(!problem.to_string().contains(API_TOKEN), "{problem}");
    let json = format!("{{\"token\":\"{API_TOKEN}\"}}");
    let answer = post("application/json", json).await.expect("sign in");
    let problem = assert_problem(
        answer,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported-media-type",
    )
    .await;
    assert!(!problem.to_string().contains(API_TOKEN), "{problem}");
    let answer = client()
        .get(format!("{}/static/%ff/app.js", sidecar.base_url()))
        .send()
        .await
        .expect("asset");
    assert_problem(answer, StatusCode::NOT_FOUND, "not-found").await;
}

/// The dashboard's `page` at its largest, on a page that has a next one:
/// the page answers, its next link counts on at most to the largest page.
/// (The link's `page + 1` overflowed: a debug build panicked and the
/// connection closed without an answer.)
#[tokio::test]
async fn the_largest_page_number_answers() {
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let api = sidecar.api();
    for name in ["pages-b", "pages-c"] {
        api.lock(name).acquire(&[("ttl", "1m")]).await;
    }
    for path in ["/", "/dashboard/live"] {
        let url = format!(
            "http://127.0.0.1:{}{path}?cursor=locks/pages-a&limit=1&page={}",
            sidecar.port(),
            u32::MAX
        );
        let response = client()
            .get(&url)
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        assert_eq!(response.status(), StatusCode::OK, "{url}");
    }
}
