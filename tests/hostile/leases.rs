//! Leases under attack: tokens used under the wrong name or kind, huge
//! durations, spoofable and oversized strings, and per-sidecar caps.

use reqwest::StatusCode;
use rstest::rstest;

use crate::common::{self, Api, Kind, Resource, TestBackend, unique_name};

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
