//! Leases under attack: tokens used under the wrong name or kind, huge
//! durations, spoofable and oversized strings, and per-sidecar caps.

use reqwest::StatusCode;
use rstest::rstest;

use crate::common::{self, Api, Kind, Resource, TestBackend, assert_problem, unique_name};

/// Unix milliseconds.
fn now_ms() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The value of the one sample `series` (`name{labels}` exactly as exposed),
/// 0 if absent.
async fn metric(api: &Api, series: &str) -> f64 {
    let response = api.get(&["metrics"], &[]).await;
    assert_eq!(response.status(), StatusCode::OK);
    let text = response.text().await.expect("metrics body");
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0.0, |v| v.trim().parse().expect("a number"))
}

/// The sum of every sample of the family `name` (all label values).
async fn family_sum(api: &Api, name: &str) -> f64 {
    let response = api.get(&["metrics"], &[]).await;
    let text = response.text().await.expect("metrics body");
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .map(|l| {
            l.rsplit_once(' ')
                .and_then(|(_, v)| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        })
        .sum()
}

/// The local state a wrong-name request must leave alone.
#[derive(Debug, PartialEq)]
struct LocalState {
    held_locks: f64,
    held_semaphores: f64,
    lost: f64,
    expirations: f64,
}

async fn local_state(api: &Api) -> LocalState {
    LocalState {
        held_locks: metric(api, "sidelock_held_locks{kind=\"lock\"}").await,
        held_semaphores: metric(api, "sidelock_held_locks{kind=\"semaphore\"}").await,
        lost: family_sum(api, "sidelock_lost_total").await,
        expirations: family_sum(api, "sidelock_expirations_total").await,
    }
}

/// Acquires on `r` with a long ttl (semaphores with one permit).
async fn take(r: &Resource, owner: &str) -> String {
    let mut params = vec![("ttl", "60s"), ("owner", owner)];
    if r.kind() == Kind::Semaphore {
        params.push(("limit", "1"));
    }
    r.acquire(&params).await.token
}

/// Every way to name a lease other than its own: another name of the same
/// kind, the same name of the other kind, another name of the other kind.
fn wrong_places(api: &Api, kind: Kind, name: &str) -> Vec<Resource> {
    let other = unique_name("other");
    let same_name_other_kind = match kind {
        Kind::Lock => api.semaphore(name),
        Kind::Semaphore => api.lock(name),
    };
    vec![
        match kind {
            Kind::Lock => api.lock(&other),
            Kind::Semaphore => api.semaphore(&other),
        },
        same_name_other_kind,
        match kind {
            Kind::Lock => api.semaphore(&other),
            Kind::Semaphore => api.lock(&other),
        },
    ]
}

/// Finding 3: a token presented under the wrong name or kind answers 410
/// and changes nothing about the lease it belongs to — not the held-locks
/// gauge, not the lost and expired counters, not the lease itself (it still
/// renews and releases), not a hold stream on it, and on SIGTERM the sidecar
/// still releases it, so a second sidecar gets it at once.
#[rstest]
#[case::memory(TestBackend::Memory)]
#[case::redis(TestBackend::Redis)]
#[case::postgres(TestBackend::Postgres)]
#[tokio::test]
async fn a_token_under_the_wrong_name_leaves_its_lease_alone(#[case] backend: TestBackend) {
    let backend = backend.start().await;
    let mut sidecar = backend.start_sidecar().await;
    let api = sidecar.api();
    let mut kept = Vec::new();
    for kind in [Kind::Lock, Kind::Semaphore] {
        let name = unique_name("victim");
        let lease = match kind {
            Kind::Lock => api.lock(&name),
            Kind::Semaphore => api.semaphore(&name),
        };
        let token = take(&lease, "victim").await;
        // A hold stream's lease, whose token the client also received.
        let held = match kind {
            Kind::Lock => api.lock(&unique_name("held")),
            Kind::Semaphore => api.semaphore(&unique_name("held")),
        };
        let mut hold_params = vec![("ttl", "60s"), ("owner", "holder")];
        if kind == Kind::Semaphore {
            hold_params.push(("limit", "1"));
        }
        let mut stream = held.hold(&hold_params).await;
        let hold_token = stream.expect_acquired().await.token;

        let before = local_state(&api).await;
        for t in [&token, &hold_token] {
            for wrong in wrong_places(&api, kind, &name)
                .into_iter()
                .chain(wrong_places(&api, kind, held.name()))
            {
                wrong.release_lost(t).await;
                wrong.keepalive_lost(t).await;
                assert_eq!(
                    local_state(&api).await,
                    before,
                    "a {kind:?} token used on {:?} {} changed this sidecar's leases",
                    wrong.kind(),
                    wrong.name()
                );
            }
        }
        // Both leases are intact where they live.
        lease.keepalive(&token, &[]).await;
        held.keepalive(&hold_token, &[]).await;
        // The hold's first word since `acquired` is about its own release.
        held.release(&hold_token).await;
        assert_eq!(
            stream.expect_lost().await,
            "released",
            "the hold stream heard of its lease's end before its own release"
        );
        kept.push(lease);
    }
    assert_eq!(
        metric(&api, "sidelock_held_locks{kind=\"lock\"}").await
            + metric(&api, "sidelock_held_locks{kind=\"semaphore\"}").await,
        2.0,
        "the victim lock and semaphore are no longer counted as held"
    );

    sidecar.terminate();
    assert!(
        sidecar.wait_exit(common::EXIT_TIMEOUT).await.success(),
        "sidecar did not exit cleanly on SIGTERM"
    );
    if backend.backend().two_sidecars_share_state() {
        let second = backend.start_sidecar().await;
        for lease in &kept {
            let here = match lease.kind() {
                Kind::Lock => second.api().lock(lease.name()),
                Kind::Semaphore => second.api().semaphore(lease.name()),
            };
            // Try once: granted only if the first sidecar released it on SIGTERM.
            take(&here, "successor").await;
        }
    }
}

/// The longest `max_hold` a request may ask for: 365 days.
const MAX_HOLD_MS: u64 = 365 * 24 * 3600 * 1000;
/// `--max-ttl` of the duration tests' sidecars (also the bound of `lock_delay`).
const MAX_TTL_MS: u64 = 600_000;
/// `--max-wait` of the duration tests' sidecars.
const MAX_WAIT_MS: u64 = 5_000;

/// Where a parameter goes.
#[derive(Debug, Clone, Copy)]
enum Source {
    Query,
    /// A JSON body, the value as a number.
    JsonNumber,
    /// A JSON body, the value as a string.
    JsonText,
    Form,
}

impl Source {
    const ALL: [Source; 4] = [
        Source::Query,
        Source::JsonNumber,
        Source::JsonText,
        Source::Form,
    ];
}

/// Sends `method segments` with `fixed` in the query and `(name, value)`
/// through `source`.
async fn send_with(
    api: &Api,
    method: reqwest::Method,
    segments: &[&str],
    fixed: &[(&str, &str)],
    (name, value): (&str, u64),
    source: Source,
) -> reqwest::Response {
    use crate::common::api::Body;
    let text = value.to_string();
    let mut query: Vec<(&str, &str)> = fixed.to_vec();
    let body = match source {
        Source::Query => {
            query.push((name, &text));
            Body::Empty
        }
        Source::JsonNumber => Body::Json(serde_json::json!({ name: value })),
        Source::JsonText => Body::Json(serde_json::json!({ name: text })),
        Source::Form => Body::Form(vec![(name.to_owned(), text.clone())]),
    };
    api.send(method, segments, &query, body).await
}

/// The values past `max` every duration parameter is tried with.
fn too_large(max: u64) -> [u64; 4] {
    [u64::MAX, i64::MAX as u64, 1 << 53, max + 1]
}

/// Asserts a 400 `out-of-range` naming `parameter` and `max_ms`.
async fn assert_out_of_range(response: reqwest::Response, parameter: &str, max_ms: u64) {
    let problem = assert_problem(response, StatusCode::BAD_REQUEST, "out-of-range").await;
    assert_eq!(problem["parameter"], parameter, "{problem}");
    assert_eq!(problem["max_ms"], max_ms, "{problem}");
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains(parameter),
        "the detail names {parameter}: {problem}"
    );
}

async fn duration_sidecar(backend: &common::BackendGuard) -> common::SidecarGuard {
    backend
        .sidecar()
        .max_ttl(&format!("{MAX_TTL_MS}ms"))
        .max_wait(&format!("{MAX_WAIT_MS}ms"))
        .start()
        .await
}

/// Finding 4: every duration parameter of acquire, hold and keepalive, for
/// locks and semaphores, given as u64::MAX, i64::MAX, 2^53 or its maximum
/// + 1 ms, in the query, a JSON body (number or text) or a form body, is a
/// 400 `out-of-range` naming the parameter and its maximum; exactly at the
/// maximum it is accepted, the expiry lies ahead, and nobody else is granted.
#[rstest]
#[case::memory(TestBackend::Memory)]
#[case::redis(TestBackend::Redis)]
#[case::postgres(TestBackend::Postgres)]
#[tokio::test]
async fn huge_durations_are_refused_and_the_maximum_holds(#[case] backend: TestBackend) {
    use reqwest::Method;
    let backend = backend.start().await;
    let sidecar = duration_sidecar(&backend).await;
    let api = sidecar.api();
    let bounds = [
        ("ttl", MAX_TTL_MS),
        ("wait", MAX_WAIT_MS),
        ("lock_delay", MAX_TTL_MS),
        ("max_hold", MAX_HOLD_MS),
    ];
    for kind in [Kind::Lock, Kind::Semaphore] {
        let name = unique_name("huge");
        let fixed: &[(&str, &str)] = match kind {
            Kind::Lock => &[],
            Kind::Semaphore => &[("limit", "1")],
        };
        for (parameter, max) in bounds {
            for value in too_large(max) {
                for source in Source::ALL {
                    let r = send_with(
                        &api,
                        Method::POST,
                        &["v1", kind.segment(), &name],
                        fixed,
                        (parameter, value),
                        source,
                    )
                    .await;
                    assert_out_of_range(r, parameter, max).await;
                }
                let r = send_with(
                    &api,
                    Method::GET,
                    &["v1", kind.segment(), &name, "hold"],
                    fixed,
                    (parameter, value),
                    Source::Query,
                )
                .await;
                assert_out_of_range(r, parameter, max).await;
            }
        }
        // Exactly at each maximum: granted, expiring ahead, exclusive.
        let resource = match kind {
            Kind::Lock => api.lock(&name),
            Kind::Semaphore => api.semaphore(&name),
        };
        for (parameter, max) in bounds {
            let before = now_ms();
            let text = max.to_string();
            let mut params: Vec<(&str, &str)> = fixed.to_vec();
            params.extend([(parameter, text.as_str()), ("owner", "first")]);
            let grant = resource.acquire(&params).await;
            assert!(
                grant.expires_at_ms > before,
                "{parameter}={max}: the lease expires in the past ({} <= {before})",
                grant.expires_at_ms
            );
            let mut second: Vec<(&str, &str)> = fixed.to_vec();
            second.push(("owner", "second"));
            resource.acquire_busy(&second).await;
            // The keepalive's ttl at its maximum, from every source.
            for source in Source::ALL {
                let r = send_with(
                    &api,
                    Method::POST,
                    &["v1", kind.segment(), &name, "keepalive"],
                    &[("token", &grant.token)],
                    ("ttl", MAX_TTL_MS),
                    source,
                )
                .await;
                let renewed: common::Keepalive = common::api::expect_json(r, StatusCode::OK).await;
                assert!(renewed.expires_at_ms > before + MAX_TTL_MS / 2);
            }
            resource.acquire_busy(&second).await;
            for value in too_large(MAX_TTL_MS) {
                for source in Source::ALL {
                    let r = send_with(
                        &api,
                        Method::POST,
                        &["v1", kind.segment(), &name, "keepalive"],
                        &[("token", &grant.token)],
                        ("ttl", value),
                        source,
                    )
                    .await;
                    assert_out_of_range(r, "ttl", MAX_TTL_MS).await;
                }
            }
            resource.release(&grant.token).await;
        }
        // A hold at the maximum max_hold stays open and exclusive.
        let hold_max = MAX_HOLD_MS.to_string();
        let mut params: Vec<(&str, &str)> = fixed.to_vec();
        params.extend([("max_hold", hold_max.as_str()), ("ttl", "3s")]);
        let mut stream = resource.hold(&params).await;
        let grant = stream.expect_acquired().await;
        let mut second: Vec<(&str, &str)> = fixed.to_vec();
        second.push(("owner", "second"));
        resource.acquire_busy(&second).await;
        // The watchdog renews it (a wrapped cap would end it at once).
        match stream.next_within(common::EVENT_TIMEOUT).await {
            Ok(Some(common::HoldEvent::Renewed(r))) => {
                assert!(r.expires_at_ms > grant.expires_at_ms - 3000)
            }
            other => {
                panic!("expected `renewed` on a hold with max_hold at its maximum, got {other:?}")
            }
        }
        resource.acquire_busy(&second).await;
    }
}

/// Characters that let a string look like another one (or like several
/// lines) on the dashboard and in logs, one of each class refused.
const SPOOFING: &[(char, &str)] = &[
    ('\u{0}', "NUL"),
    ('\u{7}', "BEL"),
    ('\u{1b}', "ESC"),
    ('\n', "line feed"),
    ('\r', "carriage return"),
    ('\u{7f}', "DEL"),
    ('\u{85}', "next line"),
    ('\u{ad}', "soft hyphen"),
    ('\u{61c}', "Arabic letter mark"),
    ('\u{200b}', "zero-width space"),
    ('\u{200c}', "zero-width non-joiner"),
    ('\u{200d}', "zero-width joiner"),
    ('\u{200e}', "left-to-right mark"),
    ('\u{200f}', "right-to-left mark"),
    ('\u{202a}', "left-to-right embedding"),
    ('\u{202e}', "right-to-left override"),
    ('\u{2060}', "word joiner"),
    ('\u{2066}', "left-to-right isolate"),
    ('\u{2069}', "pop directional isolate"),
    ('\u{feff}', "byte order mark"),
    ('\u{2028}', "line separator"),
    ('\u{2029}', "paragraph separator"),
    ('\u{e000}', "private use"),
    ('\u{378}', "unassigned"),
    ('\u{a0}', "no-break space"),
    ('\u{3000}', "ideographic space"),
    ('\u{e0041}', "tag latin capital A"),
];

/// Sends `(name, value)` to `method segments` through every source that
/// route takes; each answer must be 400 `invalid-parameter` naming `name`.
async fn assert_refused_everywhere(
    api: &Api,
    method: reqwest::Method,
    segments: &[&str],
    fixed: &[(&str, &str)],
    (name, value): (&str, &str),
) {
    use crate::common::api::Body;
    let mut query: Vec<(&str, &str)> = fixed.to_vec();
    query.push((name, value));
    let mut answers = vec![
        api.send(method.clone(), segments, &query, Body::Empty)
            .await,
    ];
    if method != reqwest::Method::GET {
        let mut json = serde_json::Map::new();
        json.insert(name.to_owned(), value.into());
        answers.push(
            api.send(method.clone(), segments, fixed, Body::Json(json.into()))
                .await,
        );
        answers.push(
            api.send(
                method.clone(),
                segments,
                fixed,
                Body::Form(vec![(name.to_owned(), value.to_owned())]),
            )
            .await,
        );
    }
    for answer in answers {
        let problem = assert_problem(answer, StatusCode::BAD_REQUEST, "invalid-parameter").await;
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(name), "the detail names {name}: {problem}");
        assert!(
            detail.contains("allowed"),
            "the detail says what is allowed: {problem}"
        );
    }
}

/// Finding 11: an owner with a control, format (bidi, zero-width), line or
/// paragraph separator, private-use, unassigned or non-ASCII space
/// character, a leading or trailing space, or more than 200 characters is a
/// 400 on acquire and hold of locks and semaphores, from every source;
/// 200 characters of plain text (letters of any script) are accepted and
/// shown as given.
#[tokio::test]
async fn owners_that_could_spoof_another_are_refused() {
    use reqwest::Method;
    let backend = TestBackend::Memory.start().await;
    let sidecar = backend.start_sidecar().await;
    let api = sidecar.api();
    for kind in [Kind::Lock, Kind::Semaphore] {
        let name = unique_name("owner");
        let fixed: &[(&str, &str)] = match kind {
            Kind::Lock => &[],
            Kind::Semaphore => &[("limit", "1")],
        };
        let mut bad: Vec<String> = SPOOFING
            .iter()
            .flat_map(|(c, _)| {
                [
                    format!("alice{c}"),
                    format!("{c}alice"),
                    format!("ali{c}ce"),
                ]
            })
            .collect();
        bad.extend([
            " alice".to_owned(),
            "alice ".to_owned(),
            "é".repeat(201),
            "a".repeat(201),
            String::new(),
        ]);
        for owner in &bad {
            for segments in [
                vec!["v1", kind.segment(), name.as_str()],
                vec!["v1", kind.segment(), name.as_str(), "hold"],
            ] {
                let method = if segments.len() == 4 {
                    Method::GET
                } else {
                    Method::POST
                };
                assert_refused_everywhere(&api, method, &segments, fixed, ("owner", owner)).await;
            }
        }
        let resource = match kind {
            Kind::Lock => api.lock(&name),
            Kind::Semaphore => api.semaphore(&name),
        };
        for owner in ["é".repeat(200), "worker 7 (Zürich, 東京)".to_owned()] {
            let mut params: Vec<(&str, &str)> = fixed.to_vec();
            params.push(("owner", &owner));
            let grant = resource.acquire(&params).await;
            assert_eq!(grant.owner, owner);
            assert_eq!(resource.inspect().await.holders[0].owner, owner);
            resource.release(&grant.token).await;
        }
    }
}

/// Finding 11: an admin force-release `reason` is at most 1 KiB of text
/// without control, format, separator, private-use or unassigned
/// characters; past that, or with one, it is a 400 and nothing is logged
/// or released. Exactly 1 KiB is accepted.
#[tokio::test]
async fn force_release_reasons_are_bounded_and_plain() {
    use reqwest::Method;
    let backend = TestBackend::Memory.start().await;
    let sidecar = backend
        .sidecar()
        .admin_token(common::ADMIN_TOKEN)
        .start()
        .await;
    let api = sidecar.api();
    let admin = api.with_bearer(common::ADMIN_TOKEN);
    let name = unique_name("reason");
    let lock = api.lock(&name);
    let grant = lock.acquire(&[("owner", "holder")]).await;
    let segments = ["v1", "admin", "locks", name.as_str()];
    let mut bad: Vec<String> = SPOOFING
        .iter()
        .map(|(c, _)| format!("maintenance{c}window"))
        .collect();
    bad.extend(["x".repeat(1025), "é".repeat(513), "y".repeat(60_000)]);
    for reason in &bad {
        assert_refused_everywhere(&admin, Method::DELETE, &segments, &[], ("reason", reason)).await;
    }
    // Nothing was released by the refused requests, nor logged.
    lock.keepalive(&grant.token, &[]).await;
    let log = sidecar.log();
    assert!(
        !log.contains(&"x".repeat(1025)),
        "a refused reason was logged"
    );
    assert!(
        !log.contains("force-released"),
        "a refused request force-released"
    );
    let reason = "z".repeat(1024);
    let r = admin
        .send(
            Method::DELETE,
            &segments,
            &[("reason", &reason)],
            crate::common::api::Body::Empty,
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    lock.release_lost(&grant.token).await;
    assert!(
        sidecar.log().contains(&reason),
        "the accepted reason is logged"
    );
}
