//! See the crate doc of the hostile suite (`main.rs`).
//!
//! Transport: metric labels drawn from a fixed set whatever the request's
//! method and path.

use std::collections::BTreeSet;
use std::time::Duration;

use rand::RngExt;
use reqwest::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::*;

/// Deadline of one raw exchange with a sidecar.
const RAW_TIMEOUT: Duration = Duration::from_secs(20);

/// Sends `request` byte for byte on a new connection and returns everything
/// the sidecar answers until it closes the connection.
async fn raw_exchange(port: u16, request: &[u8]) -> String {
    within("a raw HTTP exchange", RAW_TIMEOUT, async {
        let mut stream = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect to the sidecar");
        stream.write_all(request).await.expect("send the request");
        let mut answer = Vec::new();
        // A reset after the answer is as good as a close here.
        let _ = stream.read_to_end(&mut answer).await;
        String::from_utf8_lossy(&answer).into_owned()
    })
    .await
}

/// A random string of a length in `len` (at least 12) a method token and a path segment
/// both accept, starting with a marker that no metric name contains.
fn junk(rng: &mut impl RngExt, len: std::ops::Range<usize>) -> String {
    let len = rng.random_range(len);
    const CHARS: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut s = String::from("QZJ");
    s.extend((3..len.max(12)).map(|_| char::from(CHARS[rng.random_range(0..CHARS.len())])));
    s
}

/// `/metrics` as text.
async fn scrape(api: &Api) -> String {
    let response = api.get(&["metrics"], &[]).await;
    assert_eq!(response.status(), StatusCode::OK);
    response.text().await.expect("metrics body")
}

/// The series of a scrape: every sample line without its value.
fn series(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' ').map(|(s, _)| s.to_owned()))
        .collect()
}

/// One round of hostile requests: random (long) methods on routes and on
/// random paths, standard methods on random paths. Returns every random
/// string sent.
async fn hostile_round(port: u16, rng: &mut impl RngExt) -> Vec<String> {
    let mut sent = Vec::new();
    for i in 0..60 {
        let method = junk(rng, 4..8192);
        let path = match i % 3 {
            0 => format!("/{}", junk(rng, 4..4096)),
            1 => format!("/v1/locks/{}", junk(rng, 40..41)),
            _ => "/healthz".to_owned(),
        };
        let answer = raw_exchange(
            port,
            format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await;
        assert!(
            answer.starts_with("HTTP/1.1 4"),
            "{method:.40} {path:.60}: {answer:.300}"
        );
        sent.push(method);
        if path.contains("QZJ") {
            sent.push(path);
        }
    }
    for method in ["GET", "POST", "DELETE", "PUT", "PATCH", "OPTIONS", "HEAD"] {
        let path = format!("/{}/{}", junk(rng, 30..31), junk(rng, 2000..2001));
        let answer = raw_exchange(
            port,
            format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await;
        assert!(
            answer.starts_with("HTTP/1.1 4"),
            "{method} {path:.60}: {answer:.300}"
        );
        sent.push(path);
    }
    sent
}

/// Finding 7: the HTTP method and path of a request were label values
/// verbatim (100 requests with 8 KB methods made `/metrics` 19 MB). Random
/// methods and paths, many and long, must add no series after the first
/// round of each kind and leave no request-derived string in `/metrics`.
#[tokio::test]
async fn metric_labels_come_from_a_fixed_set() {
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let api = sidecar.api();
    let mut rng = rand::rng();

    // Counted once, so the scrape itself adds no series between the two below.
    scrape(&api).await;
    let mut sent = hostile_round(sidecar.port(), &mut rng).await;
    let first = scrape(&api).await;
    sent.extend(hostile_round(sidecar.port(), &mut rng).await);
    let second = scrape(&api).await;

    for s in &sent {
        // The marker and 9 random characters are enough to be recognised.
        let at = s.find("QZJ").expect("every string sent has a marker");
        let probe = &s[at..at + 12];
        assert!(
            !second.contains(probe),
            "/metrics contains the request-derived string {probe:?}"
        );
    }
    let (a, b) = (series(&first), series(&second));
    let added: Vec<_> = b.difference(&a).collect();
    assert!(
        added.is_empty(),
        "the second round of random methods and paths added series: {added:?}"
    );
    assert!(
        second.len() < 256 * 1024,
        "/metrics is {} bytes after {} random requests",
        second.len(),
        sent.len()
    );
}
