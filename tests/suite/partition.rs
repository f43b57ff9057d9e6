//! A network partition between a sidecar and its backend, made with a network
//! namespace of the test's own: sidecar A runs in the namespace and reaches
//! the backend (Redis, PostgreSQL) over one veth link and its clients over
//! another; sidecar B runs on the host. Cutting A's backend link leaves A's clients connected to A, so
//! they can be told — and the test checks they are told `lost` strictly
//! before B's waiter is granted the lock on the other side of the cut.

use crate::common;

use std::time::{Duration, Instant};

use common::netns::Netns;
use common::postgres::PgCluster;
use common::redis::RedisServer;
use common::{SidecarBuilder, assert_problem, eventually, unique_name, within};
use reqwest::StatusCode;
use rstest::rstest;

/// A backend server on the host, reachable on loopback and on `host_ip`.
enum Server {
    Redis(RedisServer),
    Postgres(PgCluster),
}

impl Server {
    async fn start(kind: &str, host_ip: &str) -> Self {
        match kind {
            "redis" => Self::Redis(
                RedisServer::start_with(&[
                    "--bind",
                    "127.0.0.1",
                    host_ip,
                    "--protected-mode",
                    "no",
                ])
                .await,
            ),
            "postgres" => Self::Postgres(PgCluster::start_listening_on(&[host_ip])),
            other => panic!("no partition setup for {other}"),
        }
    }

    /// The backend URL, with `host` as the server's address.
    fn url(&self, host: &str) -> String {
        match self {
            Self::Redis(r) => format!("redis://{host}:{}", r.port()),
            Self::Postgres(p) => p.url("postgres").replace("127.0.0.1", host),
        }
    }
}

#[rstest]
#[case::redis("redis")]
#[case::postgres("postgres")]
#[tokio::test]
async fn a_holder_cut_off_from_its_backend_is_told_lost_before_the_other_side_is_granted(
    #[case] kind: &str,
) {
    let ns = Netns::create();
    let clients = ns.link();
    let backend = ns.link();
    let server = Server::start(kind, &backend.host_ip).await;
    let cut_side = SidecarBuilder::new(&server.url(&backend.host_ip))
        .netns(&ns, &clients.peer_ip)
        .sidecar_id("cut-side")
        .start()
        .await;
    let other_side = SidecarBuilder::new(&server.url("127.0.0.1"))
        .sidecar_id("other-side")
        .start()
        .await;
    let name = unique_name("partition");
    let plain_name = unique_name("partition-plain");
    let a = cut_side.api();
    let b = other_side.api();

    // A holds one lock through a hold stream (the watchdog renews it) and
    // another with a plain lease its client renews; B waits for the first.
    let mut hold = a
        .lock(&name)
        .hold(&[("ttl", "3s"), ("owner", "cut-side-holder")])
        .await;
    let held = hold.expect_acquired().await;
    let plain = a.lock(&plain_name).acquire(&[("ttl", "3s")]).await;
    let waiter = {
        let b = b.clone();
        let name = name.clone();
        tokio::spawn(async move {
            let grant = b
                .lock(&name)
                .acquire(&[("wait", "30s"), ("owner", "other-side-waiter")])
                .await;
            (grant, Instant::now())
        })
    };
    b.lock(&name).wait_for_waiters(&["other-side-waiter"]).await;
    // Let the watchdog renew at least once, so the lease runs from a renewal.
    let renewed = hold.next_within(Duration::from_secs(3)).await;
    assert!(
        matches!(renewed, Ok(Some(ref e)) if e.name() == "renewed"),
        "the watchdog renews before the cut: {:?}",
        renewed.map(|e| e.map(|e| e.name()))
    );

    let cut_at = Instant::now();
    ns.cut(&backend);
    // Read on its own, so the time of `lost` is when it arrives.
    let told = tokio::spawn(async move {
        let reason = hold.expect_lost_within(Duration::from_secs(10)).await;
        let lost_at = Instant::now();
        hold.expect_end().await;
        (reason, lost_at)
    });

    // A renewal that cannot reach the backend is an outage (503) while the
    // lease has time; one still hanging when the safety margin is reached
    // answers 410 then, with the lease given up.
    let refused = a.lock(&plain_name).keepalive_raw(&plain.token, &[]).await;
    let status = refused.status();
    assert!(
        status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::GONE,
        "keepalive during the cut answered {status}"
    );
    if status == StatusCode::SERVICE_UNAVAILABLE {
        assert!(refused.headers().contains_key("retry-after"));
    }

    let (reason, lost_at) = within(
        "the cut-off holder is told",
        Duration::from_secs(15),
        async { told.await.expect("hold stream task") },
    )
    .await;
    assert_eq!(reason, "unreachable");

    let (grant, granted_at) = within(
        "the other side is granted",
        Duration::from_secs(20),
        async { waiter.await.expect("waiter task") },
    )
    .await;
    assert!(
        lost_at < granted_at,
        "the holder learned `lost` {:?} after the cut, the other side was granted {:?} after it",
        lost_at - cut_at,
        granted_at - cut_at
    );
    assert!(grant.fence > held.fence, "{} > {}", grant.fence, held.fence);
    eprintln!(
        "cut → lost {:?}, cut → grant on the other side {:?}",
        lost_at - cut_at,
        granted_at - cut_at
    );

    // The plain lease, whose renewal failed near its expiry, is gone too.
    assert_problem(
        a.lock(&plain_name).keepalive_raw(&plain.token, &[]).await,
        StatusCode::GONE,
        "lease-lost",
    )
    .await;

    // Healed, A serves again, and the tokens it gave up stay dead.
    ns.heal(&backend);
    eventually(
        "the cut side is ready again",
        Duration::from_secs(20),
        async || {
            let ready = a.get(&["readyz"], &[]).await;
            ready.status().is_success().then_some(())
        },
    )
    .await;
    assert_problem(
        a.lock(&name).release_raw(&held.token).await,
        StatusCode::GONE,
        "lease-lost",
    )
    .await;
    assert_problem(
        a.lock(&plain_name).release_raw(&plain.token).await,
        StatusCode::GONE,
        "lease-lost",
    )
    .await;
    let again = a.lock(&plain_name).acquire(&[("wait", "10s")]).await;
    assert!(again.fence > plain.fence);
    b.lock(&name).release(&grant.token).await;
}

/// A leader cut off from its backend hears `lost` before the campaign on
/// the other side of the cut leads, and the new leader's fence is higher:
/// the partition rules of holds apply to campaigns.
#[rstest]
#[case::redis("redis")]
#[case::postgres("postgres")]
#[tokio::test]
async fn a_leader_cut_off_from_its_backend_hears_lost_before_another_leads(#[case] kind: &str) {
    let ns = Netns::create();
    let clients = ns.link();
    let backend = ns.link();
    let server = Server::start(kind, &backend.host_ip).await;
    let cut_side = SidecarBuilder::new(&server.url(&backend.host_ip))
        .netns(&ns, &clients.peer_ip)
        .sidecar_id("cut-leader")
        .start()
        .await;
    let other_side = SidecarBuilder::new(&server.url("127.0.0.1"))
        .sidecar_id("other-candidate")
        .start()
        .await;
    let name = unique_name("partitioned-election");
    let (a, b) = (cut_side.api(), other_side.api());
    let campaign = |api: &common::Api, owner: &str| {
        let api = api.clone();
        let name = name.clone();
        let owner = owner.to_owned();
        async move {
            api.open_stream(
                &["v1", "elections", &name, "campaign"],
                &[("owner", &owner), ("ttl", "3s")],
            )
            .await
        }
    };
    let mut leader = campaign(&a, "cut-leader").await;
    let won = leader
        .wait_for("leader", Duration::from_secs(10), |e| e.event == "leader")
        .await
        .json();
    let mut heir = campaign(&b, "heir").await;
    heir.wait_for("follower", Duration::from_secs(10), |e| {
        e.event == "follower"
    })
    .await;
    // A renewal at least once, so the lease runs from a renewal (a third
    // of the ttl).
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let cut_at = Instant::now();
    ns.cut(&backend);
    let told = tokio::spawn(async move {
        let lost = leader
            .wait_for("lost", Duration::from_secs(10), |e| e.event == "lost")
            .await
            .json();
        (lost, Instant::now())
    });
    let led = tokio::spawn(async move {
        let led = heir
            .wait_for("leader", Duration::from_secs(20), |e| e.event == "leader")
            .await
            .json();
        (led, Instant::now())
    });
    let (lost, lost_at) = within(
        "the cut-off leader is told",
        Duration::from_secs(15),
        async { told.await.expect("leader task") },
    )
    .await;
    assert_eq!(lost["reason"], "unreachable");
    let (led, led_at) = within("the heir leads", Duration::from_secs(25), async {
        led.await.expect("heir task")
    })
    .await;
    assert!(
        lost_at < led_at,
        "the leader heard `lost` {:?} after the cut, the heir led {:?} after it",
        lost_at - cut_at,
        led_at - cut_at
    );
    assert!(
        led["fence"].as_u64() > won["fence"].as_u64(),
        "{led} after {won}"
    );
    eprintln!(
        "election {kind}: cut → lost {:?}, cut → new leader {:?}, margin {:?}",
        lost_at - cut_at,
        led_at - cut_at,
        led_at - lost_at
    );
    ns.heal(&backend);
}
