//! The operator dashboard (`GET /`), black-box: a real sidecar process, real
//! HTTP, and for the live behaviour a real headless Chromium.

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{
    ACCEPT_ENCODING, CACHE_CONTROL, CONTENT_ENCODING, CONTENT_SECURITY_POLICY, CONTENT_TYPE, ETAG,
    IF_NONE_MATCH, LOCATION, SET_COOKIE,
};
use serde_json::{Value, json};

use common::browser::Browser;
use common::sidecar::SIDELOCK_BIN;
use common::*;

/// An owner string that would run script if the page ever inserted it as HTML.
const HOSTILE_OWNER: &str =
    r#"<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>"#;

/// Cargo's target directory (where test artifacts go).
fn target_dir() -> PathBuf {
    PathBuf::from(SIDELOCK_BIN)
        .parent()
        .and_then(|p| p.parent())
        .expect("the sidelock binary lives in target/<profile>/")
        .to_owned()
}

async fn get_text(
    url: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, reqwest::header::HeaderMap, String) {
    let http = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("HTTP client");
    let mut request = http.get(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.text().await.expect("body");
    (status, headers, body)
}

/// The HTML of the `<section id="…">` of a page.
fn section<'a>(page: &'a str, id: &str) -> &'a str {
    let start = page
        .find(&format!("<section class=\"card\" id=\"{id}\""))
        .unwrap_or_else(|| panic!("no section {id}"));
    let end = page[start..].find("</section>").expect("section end");
    &page[start..start + end]
}

/// The asset URLs the page links to.
fn asset_urls(page: &str) -> Vec<String> {
    page.match_indices("/static/")
        .map(|(i, _)| {
            let rest = &page[i..];
            rest[..rest.find('"').expect("quoted URL")].to_owned()
        })
        .collect()
}

/// Opens the dashboard in Chromium and walks through what an operator does
/// during an incident: find the holder, watch changes arrive live, see the
/// queue, force-release the stuck lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_in_a_real_browser() {
    let sidecar = SidecarBuilder::new("memory://")
        .sidecar_id("checkout-7f9c4d-2xk8p")
        .admin_token(ADMIN_TOKEN)
        .stale_after("8s")
        .start()
        .await;
    let api = sidecar.api();

    // A holder that exists before the page opens; it will also turn stale.
    let cron = api.lock("legacy:cron-cleanup");
    cron.acquire(&[("owner", "cron@batch-host-3"), ("ttl", "10m")])
        .await;

    let browser = Browser::start(1440, 1200).await;
    let page = &browser;
    page.client
        .goto(sidecar.base_url())
        .await
        .expect("open the dashboard");
    page.wait_for_text("#holders", "cron@batch-host-3").await;
    page.wait_for(
        "the event stream to connect",
        Duration::from_secs(15),
        "return document.getElementById('live-status').dataset.state === 'live';",
        vec![],
    )
    .await;
    // Marks this document: a reload would lose the mark.
    page.js(
        "window.__sidelockMark = 'same-document'; return true;",
        vec![],
    )
    .await;

    // Traffic for the charts: three workers contending for one lock (so
    // they wait), and some try-once refusals.
    let workers: Vec<_> = (0..3u64)
        .map(|w| {
            let orders = api.lock("orders:sync");
            tokio::spawn(async move {
                let owner = format!("sync-worker-{w}");
                for round in 0..14u64 {
                    let grant = orders
                        .acquire(&[("owner", owner.as_str()), ("ttl", "10s"), ("wait", "5s")])
                        .await;
                    tokio::time::sleep(Duration::from_millis(15 + (round + w) % 4 * 15)).await;
                    orders.release(&grant.token).await;
                }
            })
        })
        .collect();
    let orders = api.lock("orders:sync");
    for _ in 0..8 {
        let refused = orders.acquire_raw(&[("owner", "impatient")]).await;
        assert!(matches!(
            refused.status(),
            StatusCode::CONFLICT | StatusCode::OK
        ));
        if refused.status() == StatusCode::OK {
            let grant: Value = refused.json().await.expect("grant");
            orders
                .release(grant["token"].as_str().expect("token"))
                .await;
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    for worker in workers {
        worker.await.expect("traffic worker");
    }
    // The first holder turns stale (--stale-after 8s); everything below is
    // younger, so the screenshot shows one stale key.
    page.wait_for_text("#stale", "legacy:cron-cleanup").await;
    page.wait_for_text("#stale", "held-too-long").await;

    // A new holder appears without a reload.
    let billing = api.lock("billing:invoice-run");
    let stuck = billing
        .acquire(&[("owner", "invoice-worker-1"), ("ttl", "45s")])
        .await;
    page.wait_for_text("#holders", "invoice-worker-1").await;

    // Waiters show in the queue, in order.
    let mut first_waiter = billing
        .hold(&[("owner", "invoice-worker-2"), ("wait", "60s")])
        .await;
    first_waiter.expect_queued().await;
    let mut second_waiter = billing
        .hold(&[("owner", "invoice-worker-3"), ("wait", "60s")])
        .await;
    second_waiter.expect_queued().await;
    page.wait_for_text("#queues", "invoice-worker-3").await;
    let order = page
        .js(
            "return Array.from(document.querySelectorAll('#queues .queue[data-lock=\"locks/billing:invoice-run\"] li .owner')).map(e => e.textContent);",
            vec![],
        )
        .await;
    assert_eq!(order, json!(["invoice-worker-2", "invoice-worker-3"]));

    // Shared readers and a semaphore, for a realistic picture.
    let reports = api.lock("reports.nightly");
    for owner in ["report-reader-a", "report-reader-b"] {
        reports
            .acquire(&[("owner", owner), ("mode", "shared"), ("ttl", "2m")])
            .await;
    }
    let gpus = api.semaphore("gpu-pool");
    for owner in ["trainer-0", "trainer-1", "trainer-2"] {
        gpus.acquire(&[("owner", owner), ("limit", "4"), ("ttl", "5m")])
            .await;
    }
    page.wait_for_text("#holders", "trainer-2").await;
    page.wait_for(
        "the charts to show acquisitions",
        Duration::from_secs(15),
        "return document.querySelectorAll('.chart rect.granted').length > 0;",
        vec![],
    )
    .await;
    page.full_page_screenshot(&target_dir().join("dashboard.png"))
        .await;

    // Force-release the stuck lock with the admin token.
    page.click("button[data-action='force-release'][data-name='billing:invoice-run']")
        .await;
    page.wait_for(
        "the force-release dialog",
        Duration::from_secs(5),
        "return document.getElementById('force-dialog').open;",
        vec![],
    )
    .await;
    page.type_into("#force-token", ADMIN_TOKEN).await;
    page.type_into("#force-reason", "stuck during incident 4711")
        .await;
    page.click("#force-confirm").await;
    page.wait_for_text(
        "#flash",
        "Force-released billing:invoice-run: 1 lease removed",
    )
    .await;
    page.wait_for_no_text("#holders", "invoice-worker-1").await;
    // The queue hands over in order: the first waiter holds it now.
    first_waiter.expect_acquired().await;
    page.wait_for_text("#holders", "invoice-worker-2").await;
    billing.release_lost(&stuck.token).await;
    assert!(
        sidecar.log().contains("force-released"),
        "force-release is logged"
    );

    // A hostile owner string is shown as text, never run.
    let tenant = api.lock("tenant-42:export");
    tenant
        .acquire(&[("owner", HOSTILE_OWNER), ("ttl", "1m")])
        .await;
    page.wait_for_text("#holders", "window.__pwned=2").await;
    let injected = page
        .js(
            "return [typeof window.__pwned, document.querySelectorAll('#live img, #live script').length];",
            vec![],
        )
        .await;
    assert_eq!(injected, json!(["undefined", 0]));

    // Everything above happened in one document: no reloads.
    assert_eq!(
        page.js("return window.__sidelockMark;", vec![]).await,
        json!("same-document")
    );

    // Phone-sized: no horizontal scrolling.
    page.client
        .set_window_size(390, 1600)
        .await
        .expect("resize the window");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let overflow = page
        .js(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth;",
            vec![],
        )
        .await;
    assert_eq!(overflow, json!(0), "the page scrolls sideways on a phone");
    page.full_page_screenshot(&target_dir().join("dashboard-mobile.png"))
        .await;

    drop(second_waiter);
    browser.close().await;
}

/// `/v1/stale` stops at 1,000 entries and says `"truncated":true`; the
/// page showed the 1,000 as "every entry" and the tile counted 1,000, so an
/// operator could not tell that more keys were stale than shown.
#[tokio::test]
async fn a_stale_list_cut_at_its_limit_says_so_on_the_page() {
    let sidecar = SidecarBuilder::new("memory://")
        .stale_after("1s")
        .start()
        .await;
    let api = sidecar.api();
    for i in 0..1_001 {
        api.lock(&format!("cut:{i:04}"))
            .acquire(&[("ttl", "1m")])
            .await;
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let base = sidecar.base_url();
    let (_, _, stale) = get_text(&format!("{base}/v1/stale"), &[]).await;
    assert!(stale.contains("\"truncated\":true"), "the API says more");
    let (status, _, page) = get_text(&format!("{base}/"), &[]).await;
    assert_eq!(status, StatusCode::OK);
    let shown = section(&page, "stale");
    assert!(
        shown.contains("first 1000") && !shown.contains("every entry"),
        "the stale panel says the list is cut: {shown:.600}"
    );
    let tile = page
        .split("Stale keys</span>")
        .nth(1)
        .and_then(|rest| rest.split("</div>").next())
        .unwrap_or_default();
    assert!(
        tile.contains("1000+"),
        "the tile says more than 1000: {tile}"
    );
}

/// Without JavaScript the page is a complete snapshot: holders, waiters and
/// stale keys, with this sidecar's identity and the backend's health.
#[tokio::test]
async fn page_is_a_complete_snapshot_without_javascript() {
    let sidecar = SidecarBuilder::new("memory://")
        .sidecar_id("snapshot-sidecar")
        .stale_after("1s")
        .start()
        .await;
    let api = sidecar.api();
    let lock = api.lock("jobs:rebuild");
    lock.acquire(&[("owner", "builder-7"), ("ttl", "1m")]).await;
    let mut waiter = lock.hold(&[("owner", "builder-8"), ("wait", "30s")]).await;
    waiter.expect_queued().await;
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let base = sidecar.base_url();
    let (status, headers, page) = get_text(&format!("{base}/"), &[]).await;
    assert_eq!(status, StatusCode::OK);
    let header = |name| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    };
    assert!(header(CONTENT_TYPE).starts_with("text/html"));
    assert_eq!(header(CACHE_CONTROL), "no-store");
    let csp = header(CONTENT_SECURITY_POLICY);
    assert!(
        csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"),
        "{csp}"
    );
    for text in [
        "snapshot-sidecar",
        "memory://",
        "single-process",
        "healthy",
        env!("CARGO_PKG_VERSION"),
        "jobs:rebuild",
        "builder-7",
        "builder-8",
        "held-too-long",
        "locks/jobs:rebuild",
    ] {
        assert!(page.contains(text), "{text} missing from the page");
    }
    // The live part, as the script fetches it.
    let (status, _, live) = get_text(&format!("{base}/dashboard/live"), &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert!(live.contains("builder-8") && !live.contains("<html"));

    // Filtering by prefix, and a prefix that is not a name.
    let (_, _, filtered) = get_text(&format!("{base}/?prefix=nothing-here"), &[]).await;
    let holders = section(&filtered, "holders");
    assert!(!holders.contains("builder-7") && holders.contains("No lock is held"));
    // Stale keys are listed whatever the filter: every entry of /v1/stale.
    assert!(section(&filtered, "stale").contains("locks/jobs:rebuild"));
    let (status, _, bad) = get_text(&format!("{base}/?prefix=no%20spaces"), &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert!(bad.contains("Filter not applied"), "{bad}");
    // A query string it cannot read says so too (it was the unfiltered
    // page, without a word).
    for unread in ["prefix=a&prefix=b", "bogus=1", "page=abc"] {
        let (status, _, page) = get_text(&format!("{base}/?{unread}"), &[]).await;
        assert_eq!(status, StatusCode::OK);
        assert!(page.contains("Filter not applied"), "{unread}: {page}");
    }
}

#[tokio::test]
async fn assets_are_embedded_cached_and_compressed_but_streams_and_metrics_are_not() {
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let base = sidecar.base_url();
    let (_, _, page) = get_text(&format!("{base}/"), &[]).await;
    let urls = asset_urls(&page);
    for file in ["app.css", "app.js", "favicon.svg"] {
        assert!(
            urls.iter().any(|u| u.ends_with(file)),
            "{file} not linked: {urls:?}"
        );
    }
    for url in &urls {
        let (status, headers, body) = get_text(&format!("{base}{url}"), &[]).await;
        assert_eq!(status, StatusCode::OK, "{url}");
        assert!(!body.is_empty());
        assert_eq!(
            headers[CACHE_CONTROL].to_str().unwrap_or(""),
            "public, max-age=31536000, immutable"
        );
        let etag = headers[ETAG].to_str().expect("etag").to_owned();
        let (status, headers, body) =
            get_text(&format!("{base}{url}"), &[(IF_NONE_MATCH.as_str(), &etag)]).await;
        assert_eq!(status, StatusCode::NOT_MODIFIED, "{url}");
        assert!(body.is_empty());
        assert_eq!(headers[ETAG].to_str().unwrap_or(""), etag);
    }

    // Compressed when asked: the script (decoded, the same bytes) and the page.
    let js = urls.iter().find(|u| u.ends_with("app.js")).expect("app.js");
    let (_, _, plain) = get_text(&format!("{base}{js}"), &[]).await;
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let response = http
        .get(format!("{base}{js}"))
        .header(ACCEPT_ENCODING, "gzip")
        .send()
        .await
        .expect("GET app.js");
    assert_eq!(response.headers()[CONTENT_ENCODING], "gzip");
    let gz = response.bytes().await.expect("body");
    let mut decoded = String::new();
    std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&gz[..]), &mut decoded)
        .expect("valid gzip");
    assert_eq!(decoded, plain);
    assert!(gz.len() < plain.len());
    let (_, headers, _) = get_text(&format!("{base}/"), &[("accept-encoding", "gzip")]).await;
    assert_eq!(headers[CONTENT_ENCODING], "gzip");

    // Never on /metrics or on event streams (a compressor would buffer them).
    let (_, headers, _) =
        get_text(&format!("{base}/metrics"), &[("accept-encoding", "gzip")]).await;
    assert!(headers.get(CONTENT_ENCODING).is_none());
    let events = http
        .get(format!("{base}/v1/events"))
        .header(ACCEPT_ENCODING, "gzip")
        .send()
        .await
        .expect("GET /v1/events");
    assert!(
        events.headers()[CONTENT_TYPE]
            .to_str()
            .unwrap_or("")
            .starts_with("text/event-stream")
    );
    assert!(events.headers().get(CONTENT_ENCODING).is_none());
    drop(events);

    let (status, _, _) = get_text(&format!("{base}/static/0/missing.css"), &[]).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn with_an_api_token_the_dashboard_needs_a_sign_in() {
    let sidecar = SidecarBuilder::new("memory://")
        .api_token(API_TOKEN)
        .admin_token(ADMIN_TOKEN)
        .start()
        .await;
    let base = sidecar.base_url();
    sidecar
        .api_with_token(API_TOKEN)
        .lock("secret:thing")
        .acquire(&[("owner", "owner-x")])
        .await;

    // Nothing about locks without the token.
    let (status, _, page) = get_text(&format!("{base}/"), &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(page.contains("Sign in") && page.contains("SIDELOCK_API_TOKEN"));
    assert!(!page.contains("secret:thing") && !page.contains("owner-x"));
    let (status, _, _) = get_text(&format!("{base}/dashboard/live"), &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    let http = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let sign_in = |token: &'static str| {
        let body = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("token", token)
            .finish();
        http.post(format!("{base}/dashboard/sign-in"))
            .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(body)
            .send()
    };
    let wrong = sign_in("not-the-token").await.expect("sign in");
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    assert!(wrong.headers().get(SET_COOKIE).is_none());
    assert!(
        wrong
            .text()
            .await
            .unwrap_or_default()
            .contains("not this sidecar")
    );

    let ok = sign_in(API_TOKEN).await.expect("sign in");
    assert_eq!(ok.status(), StatusCode::SEE_OTHER);
    assert_eq!(ok.headers()[LOCATION], "/");
    let set_cookie = ok.headers()[SET_COOKIE]
        .to_str()
        .expect("cookie")
        .to_owned();
    assert!(set_cookie.contains("HttpOnly") && set_cookie.contains("SameSite=Strict"));
    assert!(
        !set_cookie.contains(API_TOKEN),
        "the cookie is not the token"
    );
    let cookie = set_cookie.split(';').next().expect("name=value").to_owned();

    let (status, _, page) = get_text(&format!("{base}/"), &[("cookie", &cookie)]).await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("secret:thing") && page.contains("Sign out"));
    let bearer = format!("Bearer {API_TOKEN}");
    let (status, _, live) = get_text(
        &format!("{base}/dashboard/live"),
        &[("authorization", &bearer)],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(live.contains("owner-x"));

    // The cookie opens the page only, never the API.
    let (status, _, _) = get_text(&format!("{base}/v1/locks"), &[("cookie", &cookie)]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = get_text(&format!("{base}/v1/stats"), &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = get_text(&format!("{base}/v1/stats"), &[("authorization", &bearer)]).await;
    assert_eq!(status, StatusCode::OK);

    let out = http
        .post(format!("{base}/dashboard/sign-out"))
        .header("cookie", &cookie)
        .send()
        .await
        .expect("sign out");
    assert_eq!(out.status(), StatusCode::SEE_OTHER);
    assert!(
        out.headers()[SET_COOKIE]
            .to_str()
            .unwrap_or("")
            .contains("Max-Age=0")
    );
}

#[tokio::test]
async fn force_release_needs_an_admin_token_on_the_sidecar() {
    for (admin, disabled) in [(false, true), (true, false)] {
        let mut builder = SidecarBuilder::new("memory://");
        if admin {
            builder = builder.admin_token(ADMIN_TOKEN);
        }
        let sidecar = builder.start().await;
        sidecar.api().lock("held").acquire(&[]).await;
        let (_, _, page) = get_text(&format!("{}/", sidecar.base_url()), &[]).await;
        let button = &page[page
            .find("data-action=\"force-release\"")
            .expect("a button")..];
        let button = &button[..button.find('>').expect("tag end")];
        assert_eq!(button.contains(" disabled"), disabled, "{button}");
        assert_eq!(page.contains("Force-release is disabled"), disabled);
    }
}

#[tokio::test]
async fn thousands_of_locks_are_paginated() {
    use futures::StreamExt;

    const LOCKS: usize = 2000;
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let api = sidecar.api();
    futures::stream::iter(0..LOCKS)
        .for_each_concurrent(32, |i| {
            let lock = api.lock(&format!("bulk-{i:04}"));
            async move {
                lock.acquire(&[("owner", "loader"), ("ttl", "5m")]).await;
            }
        })
        .await;

    let base = sidecar.base_url();
    let mut url = format!("{base}/?limit=500");
    let mut pages = Vec::new();
    loop {
        let (status, _, page) = get_text(&url, &[]).await;
        assert_eq!(status, StatusCode::OK);
        pages.push(page.matches("<tbody class=\"lock\"").count());
        let Some(at) = page.find("rel=\"next\"") else {
            break;
        };
        let href_at = page[..at].rfind("href=\"").expect("next link") + 6;
        let href = &page[href_at..href_at + page[href_at..].find('"').expect("quote")];
        url = format!("{base}{}", href.replace("&#38;", "&").replace("&amp;", "&"));
        assert!(pages.len() <= 5, "pagination does not end");
    }
    // 2000 locks: four full pages, then an empty last page (a full page
    // cannot know whether more follow).
    assert_eq!(pages, vec![500, 500, 500, 500, 0]);

    // A prefix narrows the listing: bulk-1000 … bulk-1099.
    let (_, _, page) = get_text(&format!("{base}/?prefix=bulk-10"), &[]).await;
    assert_eq!(page.matches("<tbody class=\"lock\"").count(), 50);
    assert!(page.contains("Next page"));
    assert!(page.contains("bulk-1049") && !page.contains("bulk-1050"));
}

#[tokio::test]
async fn stats_report_recent_acquisitions_for_the_charts() {
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let api = sidecar.api();
    let lock = api.lock("charted");
    for _ in 0..5 {
        let grant = lock.acquire(&[]).await;
        lock.release(&grant.token).await;
    }
    let grant = lock.acquire(&[]).await;
    lock.acquire_busy(&[]).await;
    lock.release(&grant.token).await;

    let stats: Value = api.get_json(&["v1", "stats"], &[]).await;
    assert_eq!(stats["bucket_ms"], 5000);
    assert_eq!(stats["window_ms"], 900_000);
    let buckets = stats["buckets"].as_array().expect("buckets");
    assert!(buckets.last().is_some_and(|b| b["partial"] == true));
    let sum = |field: &str| {
        buckets
            .iter()
            .map(|b| b[field].as_u64().unwrap_or(0))
            .sum::<u64>()
    };
    assert_eq!(sum("granted"), 6);
    assert_eq!(sum("busy"), 1);
    assert!(
        buckets.iter().any(|b| b["wait_p99_ms"].is_number()),
        "percentiles where there were grants: {stats}"
    );
    for bucket in buckets {
        for (field, value) in bucket.as_object().expect("a bucket object") {
            let text = value.to_string();
            let decimals = text.split_once('.').map_or(0, |(_, frac)| frac.len());
            assert!(decimals <= 3, "{field} is not rounded: {text}");
        }
    }
    let doc: Value = api.get_json(&["openapi.json"], &[]).await;
    assert!(
        doc["paths"]["/v1/stats"]["get"].is_object(),
        "/v1/stats is in the OpenAPI document"
    );
}

/// When the event stream drops (here: the sidecar restarts on the same
/// port), the page says so, keeps refreshing on a timer, reconnects, and
/// shows what happened meanwhile, all without a reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_updates_fall_back_and_reconnect_when_the_stream_drops() {
    use common::process::ChildGuard;
    use std::process::Command;

    let dir = tempfile::tempdir().expect("temp dir");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let base = format!("http://127.0.0.1:{port}");
    let start = |log: &str| {
        let mut cmd = Command::new(SIDELOCK_BIN);
        common::sidecar::remove_inherited_sidelock_env(&mut cmd);
        cmd.args(["serve", "--shutdown-grace", "1s", "--listen"])
            .arg(format!("127.0.0.1:{port}"));
        ChildGuard::spawn(cmd, "sidecar", &dir.path().join(log), false)
    };
    let api = Api::new(&base);
    let up = async || {
        eventually("the sidecar to listen", START_TIMEOUT, async || {
            let http = reqwest::Client::builder().no_proxy().build().ok()?;
            let r = http.get(format!("{base}/healthz")).send().await.ok()?;
            r.status().is_success().then_some(())
        })
        .await
    };

    let mut first = start("first.log");
    up().await;
    api.lock("before-restart")
        .acquire(&[("owner", "old-holder")])
        .await;
    let browser = Browser::start(1280, 900).await;
    browser
        .client
        .goto(&base)
        .await
        .expect("open the dashboard");
    browser
        .wait_for(
            "the stream to connect",
            Duration::from_secs(15),
            "return document.getElementById('live-status').dataset.state === 'live';",
            vec![],
        )
        .await;
    browser
        .js(
            "window.__sidelockMark = 'same-document'; return true;",
            vec![],
        )
        .await;

    first.signal(nix::sys::signal::Signal::SIGTERM);
    first.wait_exit(Duration::from_secs(10)).await;
    browser
        .wait_for(
            "the page to notice the dropped stream",
            Duration::from_secs(15),
            "return ['polling', 'error'].includes(document.getElementById('live-status').dataset.state);",
            vec![],
        )
        .await;

    let _second = start("second.log");
    up().await;
    api.lock("after-restart")
        .acquire(&[("owner", "new-holder")])
        .await;
    browser.wait_for_text("#holders", "new-holder").await;
    browser
        .wait_for(
            "the stream to reconnect",
            Duration::from_secs(30),
            "return document.getElementById('live-status').dataset.state === 'live';",
            vec![],
        )
        .await;
    assert_eq!(
        browser.js("return window.__sidelockMark;", vec![]).await,
        json!("same-document")
    );
    browser.close().await;
}

/// Whether every element matching `selector` lies inside the viewport (seen
/// without scrolling); `null` when none matches.
const IN_VIEWPORT: &str = "const found = Array.from(document.querySelectorAll(arguments[0])); \
    if (found.length === 0) return null; \
    return found.every(e => { const r = e.getBoundingClientRect(); \
    return r.width > 0 && r.top >= 0 && r.left >= 0 && r.bottom <= window.innerHeight && r.right <= window.innerWidth; });";

#[tokio::test]
async fn queued_locks_show_without_scrolling_at_1280_by_1000() {
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let api = sidecar.api();
    // One held lock of every kind with one waiter each, and one without.
    let exclusive = api.lock("queued:exclusive");
    exclusive
        .acquire(&[("owner", "writer"), ("ttl", "5m")])
        .await;
    let shared = api.lock("queued:shared");
    shared
        .acquire(&[("owner", "reader"), ("mode", "shared"), ("ttl", "5m")])
        .await;
    let permits = api.semaphore("queued:permits");
    permits
        .acquire(&[("owner", "trainer"), ("limit", "1"), ("ttl", "5m")])
        .await;
    let calm = api.lock("calm:lock");
    calm.acquire(&[("owner", "alone"), ("ttl", "5m")]).await;
    let mut waiters = Vec::new();
    for (resource, params) in [
        (&exclusive, vec![("owner", "next-writer"), ("wait", "5m")]),
        (&shared, vec![("owner", "next-writer"), ("wait", "5m")]),
        (
            &permits,
            vec![("owner", "next-trainer"), ("limit", "1"), ("wait", "5m")],
        ),
    ] {
        let mut waiter = resource.hold(&params).await;
        waiter.expect_queued().await;
        waiters.push(waiter);
    }

    let browser = Browser::start(1280, 1000).await;
    browser
        .client
        .goto(sidecar.base_url())
        .await
        .expect("open the dashboard");
    browser.wait_for_text("#holders", "trainer").await;
    browser
        .screenshot(&target_dir().join("dashboard-queued-1280x1000.png"))
        .await;
    for lock in [
        "locks/queued:exclusive",
        "locks/queued:shared",
        "semaphores/queued:permits",
    ] {
        let selector = format!("#holders tbody.lock[data-lock=\"{lock}\"] .queue-count");
        assert_eq!(
            browser.js(IN_VIEWPORT, vec![json!(selector)]).await,
            json!(true),
            "the queue of {lock} is not seen without scrolling"
        );
        let text = browser
            .js(
                "return document.querySelector(arguments[0]).textContent.trim();",
                vec![json!(selector)],
            )
            .await;
        assert_eq!(text, json!("1 waiting"), "{lock}");
    }
    let calm_count = browser
        .js(
            "return document.querySelectorAll('#holders tbody.lock[data-lock=\"locks/calm:lock\"] .queue-count').length;",
            vec![],
        )
        .await;
    assert_eq!(
        calm_count,
        json!(0),
        "a lock nobody waits for shows no queue"
    );
    drop(waiters);
    browser.close().await;
}

/// Elections have a section of their own — leader, value, sidecar, fence,
/// candidates — escaped like every other string, and do not appear among
/// the held locks (where a force-release button would point nowhere).
#[tokio::test]
async fn elections_show_their_leader_value_and_candidates() {
    let sidecar = SidecarBuilder::new("memory://")
        .sidecar_id("elections-sidecar")
        .start()
        .await;
    let api = sidecar.api();
    let name = "scheduler";
    let mut leader = api
        .open_stream(
            &["v1", "elections", name, "campaign"],
            &[("owner", "pod-a"), ("value", HOSTILE_OWNER)],
        )
        .await;
    leader
        .wait_for("leader", EVENT_TIMEOUT, |e| e.event == "leader")
        .await;
    let mut follower = api
        .open_stream(
            &["v1", "elections", name, "campaign"],
            &[("owner", "pod-b")],
        )
        .await;
    follower
        .wait_for("follower", EVENT_TIMEOUT, |e| e.event == "follower")
        .await;

    let (status, _, page) = get_text(&format!("{}/", sidecar.base_url()), &[]).await;
    assert_eq!(status, StatusCode::OK);
    let elections = section(&page, "elections");
    for text in [
        "scheduler",
        "pod-a",
        "elections-sidecar",
        "this one",
        "since ",
    ] {
        assert!(elections.contains(text), "{text} missing: {elections}");
    }
    assert!(
        elections.contains("img src=x onerror=") && !elections.contains("<img src=x"),
        "the value must be escaped: {elections}"
    );
    assert!(
        elections.contains(r#"<td data-label="Candidates"><div class="cell">2</div></td>"#),
        "{elections}"
    );
    assert!(!section(&page, "holders").contains("scheduler"));
    assert!(!section(&page, "queues").contains("scheduler"));
}
