//! Leases under attack: tokens used under the wrong name or kind, huge
//! durations, spoofable and oversized strings, and per-sidecar caps.

use std::time::Duration;

use reqwest::StatusCode;
use rstest::rstest;

use crate::common::{self, Api, Kind, Resource, TestBackend, assert_problem, now_ms, unique_name};

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
    // Default-ignorable or blank letters and marks, not of category Cf:
    ('\u{34f}', "combining grapheme joiner"),
    ('\u{115f}', "Hangul choseong filler"),
    ('\u{1160}', "Hangul jungseong filler"),
    ('\u{17b4}', "Khmer vowel inherent aq"),
    ('\u{180b}', "Mongolian free variation selector"),
    ('\u{2800}', "Braille pattern blank"),
    ('\u{3164}', "Hangul filler"),
    ('\u{fe0f}', "variation selector 16"),
    ('\u{ffa0}', "halfwidth Hangul filler"),
    ('\u{e0100}', "variation selector 17"),
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
    bad.extend(["x".repeat(1025), "é".repeat(513), "y".repeat(20_000)]);
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
    // The User-Agent logged with a force-release is cut as well.
    let grant = lock.acquire(&[("owner", "holder")]).await;
    let agent = "A".repeat(12_000);
    let r = reqwest::Client::new()
        .delete(format!("{}/v1/admin/locks/{name}", sidecar.base_url()))
        .bearer_auth(common::ADMIN_TOKEN)
        .header("user-agent", &agent)
        .send()
        .await
        .expect("force-release");
    assert_eq!(r.status(), StatusCode::OK);
    lock.release_lost(&grant.token).await;
    let log = sidecar.log();
    assert!(
        log.contains(&"A".repeat(200)),
        "the agent's start is logged"
    );
    assert!(
        !log.contains(&"A".repeat(201)),
        "at most 200 characters of a User-Agent are logged"
    );
}

/// Asserts a 429 `sidecar-full` with `Retry-After`, naming `cap` and `limit`.
async fn assert_full(response: reqwest::Response, cap: &str, limit: u64) {
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .map(|v| v.to_str().unwrap_or_default().to_owned());
    let problem = assert_problem(response, StatusCode::TOO_MANY_REQUESTS, "sidecar-full").await;
    assert!(
        retry_after.is_some_and(|s| s.parse::<u64>().is_ok_and(|n| n >= 1)),
        "429 without Retry-After: {problem}"
    );
    assert_eq!(problem["cap"], cap, "{problem}");
    assert_eq!(problem["limit"], limit, "{problem}");
    let flag = format!("--{}", cap.replace('_', "-"));
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(&flag), "the detail names {flag}: {problem}");
}

/// The `n`-th distinct resource of `kind` for the cap tests.
fn nth(api: &Api, kind: Kind, prefix: &str, n: usize) -> Resource {
    let name = format!("{prefix}-{n}");
    match kind {
        Kind::Lock => api.lock(&name),
        Kind::Semaphore => api.semaphore(&name),
    }
}

/// Acquire parameters of a cap test: semaphores take one permit.
fn cap_params<'a>(kind: Kind, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut params = extra.to_vec();
    if kind == Kind::Semaphore {
        params.push(("limit", "1"));
    }
    params
}

/// Waits for this sidecar's `held_locks` gauges to add up to `n`.
async fn held_becomes(api: &Api, n: f64) {
    common::eventually(
        &format!("{n} leases held"),
        common::EVENT_TIMEOUT,
        async || {
            let held = metric(api, "sidelock_held_locks{kind=\"lock\"}").await
                + metric(api, "sidelock_held_locks{kind=\"semaphore\"}").await;
            (held == n).then_some(())
        },
    )
    .await;
}

/// Finding 12, held leases: with `--max-held 4`, a fifth lease on a fifth
/// name — lock or semaphore, acquire or hold stream — gets 429 with
/// `Retry-After` naming the cap; re-entries do not count; capacity comes
/// back after every way a lease ends (release, hold closed, expiry,
/// force-release, lost at keepalive) and is never leaked.
#[rstest]
#[case::memory(TestBackend::Memory)]
#[case::redis(TestBackend::Redis)]
#[tokio::test]
async fn a_sidecar_holds_at_most_max_held_leases(#[case] backend: TestBackend) {
    const CAP: u64 = 4;
    let backend = backend.start().await;
    let sidecar = backend
        .sidecar()
        .flag("max-held", &CAP.to_string())
        .admin_token(common::ADMIN_TOKEN)
        .start()
        .await;
    let api = sidecar.api();
    let admin = api.with_bearer(common::ADMIN_TOKEN);
    let prefix = unique_name("held");
    let kinds = [Kind::Lock, Kind::Semaphore];
    // Each way out, with how it frees one of the CAP leases.
    for round in 0..5 {
        let mut tokens = Vec::new();
        let mut streams = Vec::new();
        for n in 0..CAP as usize {
            let kind = kinds[n % 2];
            let r = nth(&api, kind, &format!("{prefix}-{round}"), n);
            if n == 0 {
                let mut s = r.hold(&cap_params(kind, &[("ttl", "30s")])).await;
                tokens.push((r, s.expect_acquired().await.token));
                streams.push(s);
            } else {
                let ttl = if round == 2 && n == 1 { "500ms" } else { "30s" };
                let token = r
                    .acquire(&cap_params(kind, &[("ttl", ttl), ("owner", "o")]))
                    .await
                    .token;
                tokens.push((r, token));
            }
        }
        // Full: acquires and holds of new names, of either kind, are refused.
        for kind in kinds {
            let r = nth(&api, kind, &format!("{prefix}-{round}"), 99);
            assert_full(r.acquire_raw(&cap_params(kind, &[])).await, "max_held", CAP).await;
            assert_full(
                r.acquire_raw(&cap_params(kind, &[("wait", "2s")])).await,
                "max_held",
                CAP,
            )
            .await;
            assert_full(r.hold_raw(&cap_params(kind, &[])).await, "max_held", CAP).await;
        }
        // Full, the owner of a held lock re-enters it (it takes no new
        // place): trying once, waiting, and with a hold stream. Only that:
        // the same owner in the other mode, or of a semaphore (which nobody
        // re-enters), asks for a new lease.
        let (r2, t2) = &tokens[2];
        assert_full(
            r2.acquire_raw(&[("owner", "o"), ("mode", "shared")]).await,
            "max_held",
            CAP,
        )
        .await;
        let (r3, _) = &tokens[3];
        assert_eq!(r3.kind(), Kind::Semaphore);
        assert_full(
            r3.acquire_raw(&cap_params(r3.kind(), &[("owner", "o")]))
                .await,
            "max_held",
            CAP,
        )
        .await;
        for wait in [None, Some(("wait", "2s"))] {
            let params: Vec<_> = [("owner", "o")].into_iter().chain(wait).collect();
            let again = r2.acquire(&params).await;
            assert_eq!((&again.token, again.count), (t2, 2));
            assert_eq!(r2.release(t2).await.count, 1);
        }
        let mut again = r2.hold(&[("owner", "o")]).await;
        let g = again.expect_acquired().await;
        assert_eq!((&g.token, g.count), (t2, 2));
        drop(again);
        common::eventually(
            "the hold stream's re-entry given back",
            common::EVENT_TIMEOUT,
            async || {
                let g = r2.acquire(&[("owner", "o")]).await;
                r2.release(&g.token).await;
                (g.count == 2).then_some(())
            },
        )
        .await;
        // One lease ends, in a different way each round.
        let (r1, t1) = &tokens[1];
        match round {
            0 => {
                r1.release(t1).await;
            }
            1 => drop(streams.pop()),
            2 => {
                // Its expiry is noticed by the sidecar's own timer.
            }
            3 => {
                let forced = match r1.kind() {
                    Kind::Lock => admin.lock(r1.name()),
                    Kind::Semaphore => admin.semaphore(r1.name()),
                };
                assert_eq!(forced.force_release().await, 1);
            }
            _ => {
                // A lease the backend no longer has, learnt at a keepalive.
                let forced = match r1.kind() {
                    Kind::Lock => admin.lock(r1.name()),
                    Kind::Semaphore => admin.semaphore(r1.name()),
                };
                forced.force_release().await;
                r1.keepalive_lost(t1).await;
            }
        }
        held_becomes(&api, (CAP - 1) as f64).await;
        // A waiter takes no lease's place while it waits (its `queued`
        // event comes after its first attempt has given the place back).
        let busy = &tokens[2].0;
        let mut waiter = busy
            .hold(&cap_params(busy.kind(), &[("wait", "30s"), ("owner", "w")]))
            .await;
        waiter.expect_queued().await;
        let kind = kinds[round % 2];
        let extra = nth(&api, kind, &format!("{prefix}-{round}"), 100);
        // The waiter's own attempts (whenever it is woken) take a place for
        // their moment, so a new acquire may meet a passing 429; a leaked
        // place would refuse it for good.
        let token = common::eventually(
            "room for one more lease",
            common::EVENT_TIMEOUT,
            async || {
                let r = extra.acquire_raw(&cap_params(kind, &[])).await;
                match r.status() {
                    StatusCode::TOO_MANY_REQUESTS => None,
                    _ => Some(
                        common::api::expect_json::<common::Grant>(r, StatusCode::OK)
                            .await
                            .token,
                    ),
                }
            },
        )
        .await;
        assert_full(
            nth(&api, kind, &format!("{prefix}-{round}"), 101)
                .acquire_raw(&cap_params(kind, &[]))
                .await,
            "max_held",
            CAP,
        )
        .await;
        // Everything ends: the count goes back to zero, not below or above.
        drop(waiter);
        tokens[2].0.wait_for_waiters(&[]).await;
        extra.release(&token).await;
        // (The hold's lease ends with its stream; ended ones answer 410.)
        drop(streams);
        for (r, t) in &tokens[1..] {
            let _ = r.release_raw(t).await;
        }
        held_becomes(&api, 0.0).await;
    }
    // After every round, exactly CAP new leases fit again.
    let mut last = Vec::new();
    for n in 0..CAP as usize {
        let r = nth(&api, Kind::Lock, &prefix, 200 + n);
        last.push(r.acquire(&[]).await);
    }
    assert_full(
        nth(&api, Kind::Lock, &prefix, 300).acquire_raw(&[]).await,
        "max_held",
        CAP,
    )
    .await;
}

/// Re-entry at the cap, shared mode: the owner of a shared lease re-enters
/// it (its count goes up, no new place); another owner's shared lease, the
/// same owner asking exclusive, an owner-less claim, and an owner named
/// like a made-up one are new leases and get 429, while an owner so named
/// re-enters its own lease. A second sidecar, not at its cap, re-enters the
/// same lease for the same owner as usual.
#[rstest]
#[case::memory(TestBackend::Memory)]
#[case::redis(TestBackend::Redis)]
#[tokio::test]
async fn at_the_cap_only_the_same_owner_and_mode_re_enter(#[case] backend: TestBackend) {
    const CAP: u64 = 2;
    let backend = backend.start().await;
    let full = backend
        .sidecar()
        .flag("max-held", &CAP.to_string())
        .start()
        .await;
    let name = unique_name("reentry-shared");
    let lock = full.api().lock(&name);
    let shared = [("mode", "shared"), ("owner", "o"), ("ttl", "30s")];
    let first = lock.acquire(&shared).await;
    // The other place: an owner whose chosen name starts as the made-up
    // owners of owner-less claims do, who re-enters like any other (such
    // owners were never looked for at the cap, and got 429).
    let named = full.api().lock(&format!("{name}-named"));
    let mine = [("owner", "anonymous-me"), ("ttl", "30s")];
    let filler = named.acquire(&mine).await;
    let again = named.acquire(&mine).await;
    assert_eq!((&again.token, again.count), (&filler.token, 2));
    let held = named.hold(&mine).await.expect_acquired().await;
    assert_eq!((&held.token, held.count), (&filler.token, 3));
    let again = lock.acquire(&shared).await;
    assert_eq!((&again.token, again.count), (&first.token, 2));
    for refused in [
        &[("mode", "shared"), ("owner", "p")][..],
        &[("mode", "shared")][..],
        &[("mode", "shared"), ("owner", "anonymous-o")][..],
        &[("owner", "o"), ("wait", "1s")][..],
    ] {
        assert_full(lock.acquire_raw(refused).await, "max_held", CAP).await;
    }
    assert_eq!(lock.release(&first.token).await.count, 1);
    if !backend.backend().two_sidecars_share_state() {
        return;
    }
    let other = backend.sidecar().start().await;
    let through_other = other.api().lock(&name).acquire(&shared).await;
    assert_eq!(
        (&through_other.token, through_other.count),
        (&first.token, 2)
    );
}

/// At the cap, acquires that are refused (new leases) must not cost a real
/// re-entry its answer. The cap's look for a re-entry went through every
/// local lease within a budget of looks a second, so a stream of refused
/// acquires at a cap of 10,000 leases spent the budget and the owner's
/// re-entries got 429.
#[tokio::test]
async fn refused_acquires_at_the_cap_do_not_crowd_out_a_re_entry() {
    use futures::StreamExt as _;
    const CAP: u64 = 10_000;
    let backend = TestBackend::Memory.start().await;
    let full = backend
        .sidecar()
        .flag("max-held", &CAP.to_string())
        .start()
        .await;
    let api = full.api();
    let name = unique_name("reentry-crowded");
    let lock = api.lock(&name);
    let mine = [("owner", "o"), ("ttl", "120s")];
    let first = lock.acquire(&mine).await;
    futures::stream::iter(1..CAP)
        .for_each_concurrent(32, |n| {
            let filler = api.lock(&format!("{name}-{n}"));
            async move {
                filler.acquire(&[("ttl", "120s")]).await;
            }
        })
        .await;
    let stop = tokio_util::sync::CancellationToken::new();
    let flood = {
        let (api, name, stop) = (api.clone(), name.clone(), stop.clone());
        tokio::spawn(async move {
            let refused = std::sync::atomic::AtomicU64::new(0);
            futures::stream::iter(0..)
                .take_until(stop.cancelled())
                .for_each_concurrent(16, |n: u64| {
                    let (api, refused) = (api.clone(), &refused);
                    let r = api.lock(&format!("{name}-new-{n}"));
                    async move {
                        let params = [("owner", "flood")];
                        if r.acquire_raw(&params).await.status() == StatusCode::TOO_MANY_REQUESTS {
                            refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                })
                .await;
            refused.into_inner()
        })
    };
    // The flood under way.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for n in 0..20 {
        let again = lock.acquire_raw(&mine).await;
        assert_eq!(again.status(), StatusCode::OK, "re-entry {n} at the cap");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    let refused = flood.await.expect("the flood");
    assert!(refused > 100, "the flood was refused {refused} times");
    assert_eq!(lock.release(&first.token).await.count, 20);
}

/// A Redis, a sidecar on it with `--max-held cap`, and another without.
async fn capped_and_other(
    cap: u64,
) -> (
    common::BackendGuard,
    common::SidecarGuard,
    common::SidecarGuard,
) {
    let backend = TestBackend::Redis.start().await;
    let full = backend
        .sidecar()
        .flag("max-held", &cap.to_string())
        .start()
        .await;
    let other = backend.sidecar().start().await;
    (backend, full, other)
}

/// At the cap, a re-entry is let in on the strength of a local lease of the
/// same owner; when that lease is gone from the backend (released through
/// another sidecar, which does not tell this one), the backend grants a
/// new lease instead. That new lease must not take a place past the cap:
/// the gone lease ends (its holder told) and gives its place. Each round
/// added one lease past the cap before (within the second in which the
/// sidecar does not look for gone leases).
#[tokio::test]
async fn a_reentry_at_the_cap_onto_a_lease_gone_elsewhere_stays_under_max_held() {
    const CAP: u64 = 2;
    let (_backend, full, other) = capped_and_other(CAP).await;
    let name = unique_name("reentry-gone");
    let held = |api: Api| async move {
        metric(&api, "sidelock_held_locks{kind=\"lock\"}").await
            + metric(&api, "sidelock_held_locks{kind=\"semaphore\"}").await
    };
    let _filler = full
        .api()
        .lock(&format!("{name}-filler"))
        .acquire(&[("ttl", "60s")])
        .await;
    let mut token = full
        .api()
        .lock(&name)
        .acquire(&[("ttl", "60s"), ("owner", "o")])
        .await
        .token;
    for round in 0..6 {
        // Released where this sidecar does not hear of it.
        other.api().lock(&name).release(&token).await;
        let again = full
            .api()
            .lock(&name)
            .acquire_raw(&[("ttl", "60s"), ("owner", "o")])
            .await;
        let n = held(full.api()).await;
        assert!(n <= CAP as f64, "round {round}: {n} leases held, cap {CAP}");
        match again.status() {
            StatusCode::OK => {
                let g: common::Grant = again.json().await.expect("grant");
                assert_eq!(g.count, 1, "round {round}: a new lease, not a re-entry");
                // The gone lease was let go here: it is not there to release.
                full.api().lock(&name).release_lost(&token).await;
                token = g.token;
            }
            StatusCode::TOO_MANY_REQUESTS => {
                let g = other
                    .api()
                    .lock(&name)
                    .acquire(&[("ttl", "60s"), ("owner", "o")])
                    .await;
                token = g.token;
            }
            s => panic!("round {round}: {s}"),
        }
    }
}

/// Fills `full`, a sidecar of `--max-held 2`, with a lease on another name
/// and `mine` on `name` (its token returned); then, with an acquire refused
/// at the cap, has it look for gone leases (none yet), so that it does not
/// again for a second.
async fn fill_to_the_cap(
    full: &common::SidecarGuard,
    name: &str,
    mine: &[(&str, &str)],
    cap: u64,
) -> String {
    let _filler = full
        .api()
        .lock(&format!("{name}-filler"))
        .acquire(&[("ttl", "60s")])
        .await;
    let old = full.api().lock(name).acquire(mine).await.token;
    let stranger = full.api().lock(&format!("{name}-stranger"));
    assert_full(stranger.acquire_raw(&[]).await, "max_held", cap).await;
    old
}

/// The same, for a claim that waits: let in at the cap as a re-entry, it
/// queues behind another owner and is granted a new lease when that owner
/// releases — handed the lock by the release (exclusive) or granted by its
/// own attempt once woken (shared). That lease must not take a place past
/// the cap either: the gone lease ends, `lost`, and gives its place. The
/// wait starts within the second after the sidecar last looked for gone
/// leases, so that only the grant's own check can keep the cap.
#[rstest]
#[case::handed(&[("owner", "o"), ("ttl", "60s")][..])]
#[case::woken(&[("owner", "o"), ("ttl", "60s"), ("mode", "shared")][..])]
#[tokio::test]
async fn a_waiting_reentry_at_the_cap_onto_a_lease_gone_elsewhere_stays_under_max_held(
    #[case] mine: &[(&str, &str)],
) {
    const CAP: u64 = 2;
    let (_backend, full, other) = capped_and_other(CAP).await;
    let name = unique_name("reentry-gone-waiting");
    let (lock, elsewhere) = (full.api().lock(&name), other.api().lock(&name));
    let old = fill_to_the_cap(&full, &name, mine, CAP).await;
    elsewhere.release(&old).await;
    let blocker = elsewhere.acquire(&[("owner", "b"), ("ttl", "60s")]).await;
    let waiting = lock.spawn_acquire_raw(&[mine, &[("wait", "20s")]].concat());
    elsewhere.wait_for_waiters(&["o"]).await;
    elsewhere.release(&blocker.token).await;
    let granted: common::Grant =
        common::api::expect_json(waiting.await.expect("the waiting acquire"), StatusCode::OK).await;
    assert_eq!(granted.count, 1, "a new lease, not a re-entry");
    assert_ne!(granted.token, old);
    let held = metric(&full.api(), "sidelock_held_locks{kind=\"lock\"}").await;
    assert!(held <= CAP as f64, "{held} leases held, cap {CAP}");
    // The gone lease was let go here: it is not there to release.
    lock.release_lost(&old).await;
    lock.release(&granted.token).await;
}

/// The same when the backend cannot say whether the gone lease is gone
/// (its status call is cut off): nothing frees a place, so the new lease
/// is given back and the claim answered 429; the lock is left free on the
/// backend, not held by a lease nobody has (it was, until its ttl, with
/// the give-back taken out). The owner's next acquire, whose look goes
/// through, ends the gone lease and is granted.
#[tokio::test]
async fn a_reentry_at_the_cap_whose_gone_lease_cannot_be_confirmed_gives_its_grant_back() {
    const CAP: u64 = 2;
    let server = common::redis::RedisServer::start().await;
    let proxy = common::proxy::CuttingProxy::start(server.port()).await;
    let full = common::SidecarBuilder::new(&format!("redis://127.0.0.1:{}", proxy.port()))
        .flag("max-held", &CAP.to_string())
        .start()
        .await;
    let other = common::SidecarBuilder::new(&format!("redis://127.0.0.1:{}", server.port()))
        .start()
        .await;
    let name = unique_name("reentry-unconfirmed");
    let (lock, elsewhere) = (full.api().lock(&name), other.api().lock(&name));
    let mine = [("owner", "o"), ("ttl", "60s")];
    let old = fill_to_the_cap(&full, &name, &mine, CAP).await;
    elsewhere.release(&old).await;
    proxy.refuse(old.as_bytes(), 1);
    assert_full(lock.acquire_raw(&mine).await, "max_held", CAP).await;
    assert!(!proxy.refusing(), "the gone lease's status was asked");
    let held = metric(&full.api(), "sidelock_held_locks{kind=\"lock\"}").await;
    assert!(held <= CAP as f64, "{held} leases held, cap {CAP}");
    elsewhere.wait_until_free().await;
    let granted = common::eventually(
        "the owner's next acquire at the cap",
        Duration::from_secs(10),
        async || {
            let r = lock.acquire_raw(&mine).await;
            (r.status() == StatusCode::OK).then_some(r)
        },
    )
    .await;
    let granted: common::Grant = granted.json().await.expect("grant");
    assert_eq!(granted.count, 1);
    lock.release(&granted.token).await;
}

/// An acquire's `ttl_ms` says the time the grant gave: cut by `max_hold`
/// (acquire and the hold's `acquired`), and, for a re-entry, the ttl that
/// re-entry asked for, which is where the lease now expires, exclusive or
/// shared, or more where the lease already ran longer (the old answer gave
/// the lease's first ttl: 30000 for a lease ending in 2 s, 10000 for one
/// ending in 60 s; a shared re-entry on Redis ran the lease to its first
/// ttl only).
#[rstest]
#[case::memory(TestBackend::Memory)]
#[case::redis(TestBackend::Redis)]
#[tokio::test]
async fn an_acquires_ttl_ms_is_the_time_it_granted(#[case] backend: TestBackend) {
    let backend = backend.start().await;
    let sidecar = backend.sidecar().start().await;
    let api = sidecar.api();
    let capped = api.lock(&unique_name("capped"));
    let grant = capped.acquire(&[("ttl", "30s"), ("max_hold", "2s")]).await;
    assert!(grant.ttl_ms <= 2000, "{grant:?}");
    capped.release(&grant.token).await;
    let mut hold = capped.hold(&[("ttl", "30s"), ("max_hold", "2s")]).await;
    let held = hold.expect_acquired().await;
    assert!(held.ttl_ms <= 2000, "{held:?}");
    drop(hold);

    for mode in ["exclusive", "shared"] {
        let lock = api.lock(&unique_name("reentered"));
        let first = lock
            .acquire(&[("owner", "me"), ("ttl", "10s"), ("mode", mode)])
            .await;
        assert_eq!(first.ttl_ms, 10_000);
        let again = lock
            .acquire(&[("owner", "me"), ("ttl", "60s"), ("mode", mode)])
            .await;
        assert_eq!(again.count, 2);
        assert_eq!(again.ttl_ms, 60_000, "{mode}: {again:?}");
        let later = again.expires_at_ms.saturating_sub(first.expires_at_ms);
        assert!(
            later >= 45_000,
            "{mode}: the re-entry runs the lease to 60 s: {again:?}"
        );
        // A shorter re-entry does not shorten it, and says so.
        let shorter = lock
            .acquire(&[("owner", "me"), ("ttl", "5s"), ("mode", mode)])
            .await;
        assert!(shorter.ttl_ms >= 45_000, "{mode}: {shorter:?}");
        for _ in 0..3 {
            lock.release(&again.token).await;
        }
    }
}

/// A holder's re-entry is no waiter: at either waiter cap (`--max-waiters`
/// per lock, `--max-total-waiters` per sidecar) full, the owner holding a
/// lock, exclusive or shared, re-enters it with the `wait` it always sends,
/// by acquire or by hold stream, while another owner's wait still gets 429
/// (the old sidecar refused the re-entry with 429 before trying it).
/// Semaphore permits never re-enter.
#[rstest]
#[case::memory(TestBackend::Memory)]
#[case::redis(TestBackend::Redis)]
#[tokio::test]
async fn a_holder_reenters_with_a_wait_at_the_waiter_caps(#[case] backend: TestBackend) {
    let backend = backend.start().await;
    for flag in ["max-waiters", "max-total-waiters"] {
        let sidecar = backend.sidecar().flag(flag, "1").start().await;
        let api = sidecar.api();
        for mode in ["exclusive", "shared"] {
            let r = api.lock(&unique_name("reenter-at-cap"));
            let holder = [("owner", "holder"), ("mode", mode)];
            let with = |extra: (&'static str, &'static str)| {
                let mut params = holder.to_vec();
                params.push(extra);
                params
            };
            let held = r.acquire(&with(("ttl", "60s"))).await;
            let waiter = {
                let r = r.clone();
                tokio::spawn(async move {
                    r.acquire_raw(&[("wait", "30s"), ("owner", "w")])
                        .await
                        .status()
                })
            };
            r.wait_for_waiters(&["w"]).await;
            let again = r.acquire(&with(("wait", "5s"))).await;
            assert_eq!(again.count, 2, "{flag}, {mode}");
            let hold = r.hold_raw(&with(("wait", "5s"))).await;
            assert_eq!(hold.status(), StatusCode::OK, "{flag}, {mode}");
            let refused = r
                .acquire_raw(&[("wait", "5s"), ("owner", "other"), ("mode", mode)])
                .await;
            assert_eq!(
                refused.status(),
                StatusCode::TOO_MANY_REQUESTS,
                "{flag}, {mode}"
            );
            drop(hold);
            r.release(&again.token).await;
            r.release(&held.token).await;
            assert_eq!(waiter.await.unwrap(), StatusCode::OK, "{flag}, {mode}");
        }
    }
}

/// The statuses of `n` acquires of `lock` with `params` sent at once, in
/// order (by their numeric value).
async fn sent_together(lock: &Resource, n: usize, params: &[(&str, &str)]) -> Vec<StatusCode> {
    let claims: Vec<_> = (0..n).map(|_| lock.spawn_acquire_raw(params)).collect();
    let mut statuses = Vec::new();
    for claim in claims {
        statuses.push(claim.await.expect("claim").status());
    }
    statuses.sort_by_key(StatusCode::as_u16);
    statuses
}

/// The waiter caps still hold for claims that only look like re-entries:
/// an owner whose lease this sidecar still counts, but which another
/// sidecar force-released and granted to someone else, sends five waiting
/// claims at a sidecar whose caps allow one waiter; one waits, the others
/// get 429 (before, each skipped the caps as a re-entry and all five
/// queued).
#[tokio::test]
async fn claims_that_only_look_like_reentries_stay_under_the_waiter_caps() {
    let backend = TestBackend::Redis.start().await;
    let capped = backend
        .sidecar()
        .flag("max-waiters", "1")
        .flag("max-total-waiters", "1")
        .start()
        .await;
    let other = backend.sidecar().admin_token("admin").start().await;
    let name = unique_name("lookalike");
    let lock = capped.api().lock(&name);
    lock.acquire(&[("owner", "a"), ("ttl", "60s")]).await;
    let admin = other.api_with_token("admin").lock(&name);
    assert_eq!(admin.force_release().await, 1);
    let taken = other
        .api()
        .lock(&name)
        .acquire(&[("owner", "b"), ("ttl", "60s")])
        .await;
    let statuses = sent_together(&lock, 5, &[("owner", "a"), ("wait", "3s")]).await;
    assert_eq!(
        statuses,
        [StatusCode::CONFLICT]
            .into_iter()
            .chain([StatusCode::TOO_MANY_REQUESTS; 4])
            .collect::<Vec<_>>(),
        "one waits its 3 s, the others are refused"
    );
    other.api().lock(&name).release(&taken.token).await;
}

/// `--max-waiters` holds for claims that arrive together: ten waiting
/// claims sent at once at a held lock, with one waiter allowed per lock,
/// leave one waiting and nine refused with 429 `too-many-waiters` (the cap
/// counted the lock's waiters only once they had joined, after their first
/// attempt's round trip, so claims arriving together all passed it); and
/// twenty claims granted at once, which never wait, are not refused by it.
#[tokio::test]
async fn claims_arriving_together_stay_under_the_per_lock_waiter_cap() {
    let backend = TestBackend::Redis.start().await;
    let sidecar = backend.sidecar().flag("max-waiters", "1").start().await;
    let lock = sidecar.api().lock(&unique_name("together"));
    let holder = lock.acquire(&[("owner", "h"), ("ttl", "60s")]).await;
    let statuses = sent_together(&lock, 10, &[("wait", "2s")]).await;
    assert_eq!(
        statuses,
        [StatusCode::CONFLICT]
            .into_iter()
            .chain([StatusCode::TOO_MANY_REQUESTS; 9])
            .collect::<Vec<_>>(),
        "one waits its 2 s, the others are refused"
    );
    lock.release(&holder.token).await;

    // Claims that are granted at once never wait: twenty shared claims
    // sent together at a free lock are all granted, whatever the cap.
    let shared = sidecar.api().lock(&unique_name("together-shared"));
    let statuses = sent_together(&shared, 20, &[("wait", "2s"), ("mode", "shared")]).await;
    assert_eq!(statuses, [StatusCode::OK; 20]);
}

/// Finding 12, waiters: with `--max-total-waiters 3`, three waiters on
/// three different busy names (lock, semaphore, hold stream) fit and a
/// fourth on a fourth name gets 429 with `Retry-After`; try-once acquires
/// are not waiters and still answer 409; a waiter's place comes back when
/// it is granted, times out or disconnects, and is never leaked.
#[rstest]
#[case::memory(TestBackend::Memory)]
#[case::redis(TestBackend::Redis)]
#[tokio::test]
async fn a_sidecar_queues_at_most_max_total_waiters(#[case] backend: TestBackend) {
    const CAP: u64 = 3;
    let backend = backend.start().await;
    let sidecar = backend
        .sidecar()
        .flag("max-total-waiters", &CAP.to_string())
        .start()
        .await;
    let api = sidecar.api();
    let prefix = unique_name("waiting");
    let kinds = [Kind::Lock, Kind::Semaphore];
    // Ten busy names.
    let mut held = Vec::new();
    for n in 0..10 {
        let kind = kinds[n % 2];
        let r = nth(&api, kind, &prefix, n);
        let token = r
            .acquire(&cap_params(kind, &[("ttl", "60s"), ("owner", "holder")]))
            .await
            .token;
        held.push((r, token));
    }
    let waiting = |n: usize, wait: &'static str| {
        let (r, _) = held[n].clone();
        tokio::spawn(async move {
            r.acquire_raw(&cap_params(
                r.kind(),
                &[("wait", wait), ("owner", "waiter")],
            ))
            .await
            .status()
        })
    };
    // Three waiters: a lock, a semaphore, a hold stream.
    let w0 = waiting(0, "30s");
    let w1 = waiting(1, "30s");
    held[0].0.wait_for_waiters(&["waiter"]).await;
    held[1].0.wait_for_waiters(&["waiter"]).await;
    let (r2, _) = &held[2];
    let mut hold = r2.hold(&cap_params(r2.kind(), &[("wait", "30s")])).await;
    hold.expect_queued().await;
    // A fourth waiter, on a fourth name, of either kind or a hold: 429.
    for n in [3, 4] {
        let (r, _) = &held[n];
        assert_full(
            r.acquire_raw(&cap_params(r.kind(), &[("wait", "5s")]))
                .await,
            "max_total_waiters",
            CAP,
        )
        .await;
        assert_full(
            r.hold_raw(&cap_params(r.kind(), &[("wait", "5s")])).await,
            "max_total_waiters",
            CAP,
        )
        .await;
        // Trying once is not waiting.
        r.acquire_busy(&cap_params(r.kind(), &[])).await;
    }
    // Granted: the lock's holder releases, its waiter gets it.
    held[0].0.release(&held[0].1).await;
    assert_eq!(w0.await.unwrap(), StatusCode::OK);
    let w3 = waiting(3, "300ms");
    // Timed out: the 300 ms waiter leaves by itself.
    assert_eq!(w3.await.unwrap(), StatusCode::CONFLICT);
    // Disconnected: the hold stream's client goes away.
    drop(hold);
    held[2].0.wait_for_waiters(&[]).await;
    // And the aborted request of a plain acquire.
    w1.abort();
    held[1].0.wait_for_waiters(&[]).await;
    // No place leaked: exactly CAP waiters fit again, on new names.
    let again: Vec<_> = (4..4 + CAP as usize).map(|n| waiting(n, "30s")).collect();
    for (r, _) in held.iter().skip(4).take(CAP as usize) {
        r.wait_for_waiters(&["waiter"]).await;
    }
    let (r, _) = &held[9];
    assert_full(
        r.acquire_raw(&cap_params(r.kind(), &[("wait", "5s")]))
            .await,
        "max_total_waiters",
        CAP,
    )
    .await;
    for w in again {
        w.abort();
    }
}

/// Finding 12: the two caps are settings like the others — flag, env and
/// TOML — and `/v1/info` shows them.
#[tokio::test]
async fn the_caps_come_from_flags_env_and_file() {
    let backend = TestBackend::Memory.start().await;
    for (builder, held, waiters) in [
        (
            backend
                .sidecar()
                .flag("max-held", "7")
                .flag("max-total-waiters", "8"),
            7,
            8,
        ),
        (
            backend
                .sidecar()
                .env("SIDELOCK_MAX_HELD", "9")
                .env("SIDELOCK_MAX_TOTAL_WAITERS", "10"),
            9,
            10,
        ),
        (
            backend
                .sidecar()
                .config_toml("max_held = 11\nmax_total_waiters = 12\n"),
            11,
            12,
        ),
    ] {
        let sidecar = builder.start().await;
        let info = sidecar.api().info().await;
        assert_eq!(info["limits"]["max_held"], held, "{info}");
        assert_eq!(info["limits"]["max_total_waiters"], waiters, "{info}");
    }
}

/// Review finding: a duration finer than a millisecond (`1ns`, `999us`)
/// passed the "above 0" check and truncated to a 0 ms lease: Redis, Redlock
/// and PostgreSQL answered 503, memory granted a second owner at once. Every
/// duration parameter, in the query, JSON and a form, on acquire, hold and
/// keepalive, takes only the documented forms; anything else is a 400 that
/// echoes what was sent, and the lock stays free.
#[rstest]
#[case::memory(TestBackend::Memory)]
#[case::redis(TestBackend::Redis)]
#[case::postgres(TestBackend::Postgres)]
#[tokio::test]
async fn durations_outside_the_documented_forms_are_refused(#[case] backend: TestBackend) {
    use crate::common::api::Body;
    use reqwest::Method;
    let backend = backend.start().await;
    let sidecar = duration_sidecar(&backend).await;
    let api = sidecar.api();
    let bad = [
        "1ns", "999us", "0.5ms", "30sec", "5min", "1hr", "30s30s", " 30s", "1d",
    ];
    for kind in [Kind::Lock, Kind::Semaphore] {
        let name = unique_name("grammar");
        let resource = match kind {
            Kind::Lock => api.lock(&name),
            Kind::Semaphore => api.semaphore(&name),
        };
        let limit: &[(&str, &str)] = match kind {
            Kind::Lock => &[],
            Kind::Semaphore => &[("limit", "1")],
        };
        for parameter in ["ttl", "wait", "lock_delay", "max_hold"] {
            for value in bad {
                for body in [
                    Body::Empty,
                    Body::Json(serde_json::json!({ parameter: value })),
                    Body::Form(vec![(parameter.to_owned(), value.to_owned())]),
                ] {
                    let mut query = limit.to_vec();
                    if matches!(body, Body::Empty) {
                        query.push((parameter, value));
                    }
                    for (method, hold) in [(Method::POST, false), (Method::GET, true)] {
                        if hold && !matches!(body, Body::Empty) {
                            continue;
                        }
                        let mut segments = vec!["v1", kind.segment(), name.as_str()];
                        if hold {
                            segments.push("hold");
                        }
                        let body = match &body {
                            Body::Empty => Body::Empty,
                            Body::Json(v) => Body::Json(v.clone()),
                            Body::Form(f) => Body::Form(f.clone()),
                            Body::Raw { .. } => unreachable!(),
                        };
                        let r = api.send(method.clone(), &segments, &query, body).await;
                        let problem =
                            assert_problem(r, StatusCode::BAD_REQUEST, "invalid-parameter").await;
                        let detail = problem["detail"].as_str().unwrap_or_default();
                        assert!(
                            detail.contains(&format!("{value:?}")),
                            "the detail echoes {value:?} as sent: {problem}"
                        );
                    }
                }
            }
        }
        let state = resource.inspect().await;
        assert!(state.holders.is_empty(), "nothing was granted: {state:?}");
        // Keepalive's ttl: the same grammar, and the lease keeps its ttl.
        let mut params = vec![("ttl", "30s")];
        params.extend_from_slice(limit);
        let grant = resource.acquire(&params).await;
        for value in bad {
            let r = api
                .send(
                    Method::POST,
                    &["v1", kind.segment(), &name, "keepalive"],
                    &[("token", grant.token.as_str()), ("ttl", value)],
                    Body::Empty,
                )
                .await;
            assert_problem(r, StatusCode::BAD_REQUEST, "invalid-parameter").await;
        }
        let state = resource.inspect().await;
        assert_eq!(state.holders.len(), 1, "{state:?}");
        assert!(
            state.holders[0].expires_at_ms > now_ms() + 20_000,
            "the lease kept its 30 s ttl: {state:?}"
        );
    }
}

/// A token no acquire ever answered — a NUL, a control character, a space,
/// a character outside ASCII — is refused with 400 before any backend sees
/// it, on the lease's own name and elsewhere, and the sidecar's holds renew
/// on meanwhile. (PostgreSQL refused such a token's statement: a 5xx for a
/// request that holds nothing, and once renewals went together, a failure
/// of every hold's renewal beside it.)
#[rstest]
#[case::memory(TestBackend::Memory)]
#[case::redis(TestBackend::Redis)]
#[case::postgres(TestBackend::Postgres)]
#[tokio::test]
async fn a_token_that_cannot_be_one_is_refused_and_touches_no_lease(#[case] backend: TestBackend) {
    let backend = backend.start().await;
    let sidecar = backend.start_sidecar().await;
    let api = sidecar.api();
    let held = api.lock(&unique_name("kept"));
    // A ttl long enough that a renewal slowed by a loaded machine (a
    // PostgreSQL write waits for its WAL flush) stays inside its margin:
    // at 1.5 s the margin was 167 ms, and a CI run lost the hold to a slow
    // renewal, not to the refused requests.
    let mut stream = held.hold(&[("ttl", "3s"), ("owner", "holder")]).await;
    let grant = stream.expect_acquired().await;
    let elsewhere = api.lock(&unique_name("elsewhere"));
    let bad = [
        "\0",
        "a\0b",
        "tab\there",
        "line\nbreak",
        "x y",
        "\u{7f}",
        "caf\u{e9}",
    ];
    // Three seconds: three renewals of the hold, among the refused requests.
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < until {
        for token in bad {
            for lock in [&held, &elsewhere] {
                assert_problem(
                    lock.keepalive_raw(token, &[]).await,
                    StatusCode::BAD_REQUEST,
                    "invalid-parameter",
                )
                .await;
                assert_problem(
                    lock.release_raw(token).await,
                    StatusCode::BAD_REQUEST,
                    "invalid-parameter",
                )
                .await;
            }
        }
    }
    for event in stream.collect_for(Duration::ZERO).await {
        assert!(
            !matches!(event, common::HoldEvent::Lost(_)),
            "the hold was told {event:?}"
        );
    }
    held.keepalive(&grant.token, &[]).await;
    assert!(held.release(&grant.token).await.released);
}

/// `HEAD` on a route whose `GET` acts — a lock's or a semaphore's hold, an
/// election's campaign — answers 405 and does nothing: axum answered it
/// with the `GET` handler, so a `curl -I` acquired and released the lock
/// (its fence went up) and stood for election.
#[tokio::test]
async fn head_on_a_hold_or_a_campaign_changes_nothing() {
    let sidecar = common::SidecarBuilder::new("memory://").start().await;
    let api = sidecar.api();
    let name = unique_name("head");
    for (segments, query) in [
        (
            vec!["v1", "locks", name.as_str(), "hold"],
            vec![("ttl", "30s")],
        ),
        (
            vec!["v1", "semaphores", name.as_str(), "hold"],
            vec![("limit", "1")],
        ),
        (vec!["v1", "elections", name.as_str(), "campaign"], vec![]),
    ] {
        let answer = api
            .request(reqwest::Method::HEAD, &segments, &query)
            .send()
            .await
            .expect("send HEAD");
        assert_eq!(
            answer.status(),
            StatusCode::METHOD_NOT_ALLOWED,
            "HEAD /{}",
            segments.join("/")
        );
    }
    assert_eq!(
        api.lock(&name).inspect().await.fence,
        0,
        "the lock was held"
    );
    assert_eq!(
        api.semaphore(&name).inspect().await.fence,
        0,
        "the semaphore was held"
    );
    let election: serde_json::Value = api.get_json(&["v1", "elections", &name], &[]).await;
    assert_eq!(election["leader"], serde_json::Value::Null, "{election}");
    assert_eq!(election["candidates"], 0, "{election}");
}

/// A lock with more holders than a busy answer shows (130 readers here; a
/// semaphore's permits alike): a try-once claim, a waiter whose wait ran
/// out and a hold stream's `timeout` name the first 100, and
/// `holders_total` counts them all. (Every waiter kept every holder for as
/// long as it waited, so that memory grew with holders times waiters, and
/// each 409 wrote them all.)
#[rstest]
#[case::memory(TestBackend::Memory)]
#[case::redis(TestBackend::Redis)]
#[case::postgres(TestBackend::Postgres)]
#[case::zookeeper(TestBackend::ZooKeeper)]
#[tokio::test]
async fn a_busy_answer_names_at_most_100_holders(#[case] backend: TestBackend) {
    const READERS: usize = 130;
    let backend = backend.start().await;
    let sidecar = backend.start_sidecar().await;
    let lock = sidecar.api().lock(&unique_name("crowded"));
    for i in 0..READERS {
        let owner = format!("reader-{i}");
        lock.acquire(&[("owner", &owner), ("mode", "shared"), ("ttl", "2m")])
            .await;
    }
    let check = |what: &str, answer: &serde_json::Value| {
        let holders = answer["holders"].as_array().map_or(0, Vec::len);
        assert_eq!(
            (holders, answer["holders_total"].as_u64()),
            (100, Some(READERS as u64)),
            "{what}: {answer}"
        );
    };
    check("try once", &lock.acquire_busy(&[("owner", "writer")]).await);
    check(
        "a waiter",
        &lock
            .acquire_busy(&[("owner", "writer"), ("wait", "300ms")])
            .await,
    );
    let mut hold = lock.hold(&[("owner", "writer"), ("wait", "300ms")]).await;
    check("a hold stream", &hold.expect_timeout().await);
}

// The owner made up for a claim sent without one is shown in busy answers
// and listings; given back by another client, it re-entered that claim's
// lease and answered its token (the README says such claims never
// re-enter).
#[rstest]
#[case::memory(TestBackend::Memory)]
#[case::redis(TestBackend::Redis)]
#[case::zookeeper(TestBackend::ZooKeeper)]
#[tokio::test]
async fn a_made_up_owner_given_back_is_refused_and_never_reenters(#[case] backend: TestBackend) {
    let backend = backend.start().await;
    let sidecar = backend.start_sidecar().await;
    let lock = sidecar.api().lock(&unique_name("made-up"));
    let grant = lock.acquire(&[("ttl", "30s")]).await;
    let busy = lock.acquire_busy(&[]).await;
    let owner = busy["holders"][0]["owner"]
        .as_str()
        .unwrap_or_else(|| panic!("a holder's owner: {busy}"))
        .to_owned();
    assert!(owner.starts_with("anonymous-"), "{owner}");
    let problem = assert_problem(
        lock.acquire_raw(&[("owner", owner.as_str())]).await,
        StatusCode::BAD_REQUEST,
        "invalid-parameter",
    )
    .await;
    assert!(
        problem["detail"].as_str().unwrap_or("").contains("made up"),
        "{problem}"
    );
    let state = lock.inspect().await;
    assert_eq!(state.holders.len(), 1);
    assert_eq!(state.holders[0].count, 1, "the lease was not re-entered");
    assert!(lock.release(&grant.token).await.released);
}

// The same through a hold, in shared mode, and on a semaphore: a made-up
// owner is refused wherever an owner is taken.
#[tokio::test]
async fn a_made_up_owner_is_refused_by_holds_shared_locks_and_semaphores() {
    let backend = TestBackend::Memory.start().await;
    let sidecar = backend.start_sidecar().await;
    let api = sidecar.api();
    let made_up = "anonymous-0123456789ab";
    let lock = api.lock(&unique_name("made-up-kinds"));
    let semaphore = api.semaphore(&unique_name("made-up-kinds"));
    for refused in [
        lock.hold_raw(&[("owner", made_up)]).await,
        lock.acquire_raw(&[("owner", made_up), ("mode", "shared")])
            .await,
        semaphore
            .acquire_raw(&[("owner", made_up), ("limit", "3")])
            .await,
    ] {
        assert_problem(refused, StatusCode::BAD_REQUEST, "invalid-parameter").await;
    }
    // Names that only look alike are owners like any other.
    for owner in [
        "anonymous-0123456789AB",
        "anonymous-0123456789abc",
        "anonymous-me",
    ] {
        let grant = lock.acquire(&[("owner", owner)]).await;
        assert!(lock.release(&grant.token).await.released, "{owner}");
    }
}

/// A try-once claim is refused while anyone waits, holders or not: a
/// shared claim beside a shared holder, with an exclusive claim queued, was
/// told "the lock is held" — which a shared holder does not make it for
/// another shared claim. The detail names the queue too.
#[tokio::test]
async fn a_try_once_refused_for_the_queue_is_told_so() {
    let sidecar = common::SidecarBuilder::new("memory://").start().await;
    let lock = sidecar.api().lock(&unique_name("queued-first"));
    lock.acquire(&[("owner", "reader"), ("mode", "shared")])
        .await;
    let writer = {
        let lock = sidecar.api().lock(lock.name());
        tokio::spawn(async move {
            lock.acquire_raw(&[("owner", "writer"), ("wait", "30s")])
                .await
                .status()
        })
    };
    lock.wait_for_waiters(&["writer"]).await;
    let busy = lock
        .acquire_busy(&[("owner", "second-reader"), ("mode", "shared")])
        .await;
    let detail = busy["detail"].as_str().unwrap_or_default();
    assert_eq!(
        detail,
        "the lock is held, or 1 queued claim(s) go first (FIFO), and wait=0 (try once); \
         give wait=<duration> to queue for it"
    );
    writer.abort();
}
