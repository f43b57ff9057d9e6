//! Redlock against five real, independent `redis-server` processes: a
//! minority of nodes down, a majority down, nodes killed or emptied while a
//! lock is held.

mod common;

use common::redis::RedisNodes;
use common::{SidecarBuilder, SidecarGuard, assert_problem, unique_name};
use reqwest::StatusCode;

async fn five() -> (RedisNodes, SidecarGuard, SidecarGuard) {
    let nodes = RedisNodes::start(5).await;
    let a = SidecarBuilder::new(&nodes.url()).start().await;
    let b = SidecarBuilder::new(&nodes.url()).start().await;
    (nodes, a, b)
}

#[tokio::test]
async fn locks_work_with_two_of_five_nodes_down() {
    let (mut nodes, a, b) = five().await;
    nodes.nodes[0].kill();
    nodes.nodes[3].kill();
    let name = unique_name("minority-down");
    let grant = a.api().lock(&name).acquire(&[("owner", "a")]).await;
    b.api().lock(&name).acquire_busy(&[("owner", "b")]).await;
    let state = b.api().lock(&name).inspect().await;
    assert_eq!(state.holder_owners(), ["a"]);
    b.api().lock(&name).keepalive(&grant.token, &[]).await;
    a.api().lock(&name).release(&grant.token).await;
    let next = b.api().lock(&name).acquire(&[("owner", "b")]).await;
    assert!(next.fence > grant.fence);
    let ready = a.api().get(&["readyz"], &[]).await;
    assert_eq!(ready.status(), StatusCode::OK, "a majority answers: ready");
}

#[tokio::test]
async fn locks_are_refused_cleanly_with_three_of_five_nodes_down() {
    let (mut nodes, a, _b) = five().await;
    let name = unique_name("majority-down");
    let held = a.api().lock(&name).acquire(&[("ttl", "30s")]).await;
    for i in [1, 2, 4] {
        nodes.nodes[i].kill();
    }
    let lock = a.api().lock(&name);
    let refused = lock.acquire_raw(&[]).await;
    assert!(refused.headers().contains_key("retry-after"));
    assert_problem(
        refused,
        StatusCode::SERVICE_UNAVAILABLE,
        "backend-unavailable",
    )
    .await;
    let other = a.api().lock(&unique_name("other")).acquire_raw(&[]).await;
    assert_problem(
        other,
        StatusCode::SERVICE_UNAVAILABLE,
        "backend-unavailable",
    )
    .await;
    // Without a majority the holder cannot be told its lease is fine either.
    let renewal = lock.keepalive_raw(&held.token, &[]).await;
    assert_problem(
        renewal,
        StatusCode::SERVICE_UNAVAILABLE,
        "backend-unavailable",
    )
    .await;
    let ready = a.api().get(&["readyz"], &[]).await;
    assert_problem(
        ready,
        StatusCode::SERVICE_UNAVAILABLE,
        "backend-unavailable",
    )
    .await;
    assert!(!a.log().contains("panicked"));
}

#[tokio::test]
async fn a_node_killed_or_emptied_while_a_lock_is_held_does_not_let_a_second_client_in() {
    let (mut nodes, a, b) = five().await;
    let name = unique_name("held-through-faults");
    let mut hold = a
        .api()
        .lock(&name)
        .hold(&[("owner", "a"), ("ttl", "2s")])
        .await;
    let grant = hold.expect_acquired().await;

    // One node dies, another comes back with an empty dataset: three of the
    // five still hold the lease, so nobody else can reach a majority.
    nodes.nodes[0].kill();
    nodes.nodes[1].restart().await;
    for _ in 0..5 {
        b.api().lock(&name).acquire_busy(&[("owner", "b")]).await;
    }
    // The watchdog keeps renewing on the majority, and the holder is not told
    // anything is wrong.
    let events = hold
        .collect_for(std::time::Duration::from_millis(1500))
        .await;
    assert!(
        !events.is_empty() && events.iter().all(|e| e.name() == "renewed"),
        "{events:?}"
    );

    // The waiter gets it once the holder lets go, with a higher fence.
    let waiter = b.api().lock(&name);
    let waiting =
        tokio::spawn(async move { waiter.acquire(&[("owner", "b"), ("wait", "10s")]).await });
    drop(hold);
    let next = waiting.await.expect("waiter task");
    assert!(
        next.fence > grant.fence,
        "fence {} after {}",
        next.fence,
        grant.fence
    );
}
