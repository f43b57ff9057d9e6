//! Redlock against five real, independent `redis-server` processes: a
//! minority of nodes down, a majority down, nodes killed or emptied while a
//! lock is held.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::redis::RedisNodes;
use common::{SidecarBuilder, SidecarGuard, assert_problem, problem_type, unique_name};
use nix::sys::signal::Signal;
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

/// A waiter behind a lease a majority holds does not poll when a minority
/// of nodes would grant it (a node that lost its data): that is no split
/// vote, so it waits for the lease's end or its release like any waiter.
/// (It once retried every 5 to 50 ms, for as long as the lease lasted.)
#[tokio::test]
async fn a_waiter_does_not_poll_when_a_minority_would_grant_it() {
    let (mut nodes, a, b) = five().await;
    let name = unique_name("minority-free");
    let held = a
        .api()
        .lock(&name)
        .acquire(&[("owner", "a"), ("ttl", "30s")])
        .await;
    nodes.nodes[1].restart().await;
    let waiter = b.api().lock(&name);
    let waiting =
        tokio::spawn(async move { waiter.acquire(&[("owner", "b"), ("wait", "20s")]).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut before = 0;
    for node in &nodes.nodes {
        before += node.commands_run().await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut after = 0;
    for node in &nodes.nodes {
        after += node.commands_run().await;
    }
    assert!(
        after - before < 100,
        "{} commands on five nodes in 2 s with one waiter",
        after - before
    );
    a.api().lock(&name).release(&held.token).await;
    let next = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter granted after the release")
        .expect("waiter task");
    assert!(next.fence > held.fence);
}

/// A Redlock release wakes each node's queue head without taking it out of
/// the queue and putting it back (each node orders its queue its own way,
/// so no node hands over): with the head's grant, the handoff costs each
/// node at most 12 commands — the release's 5 (its script, the lease, the
/// head, the wake, the delete) and the head's queued acquire's 7. It took
/// the head and pushed it back: 13. (A node the waiter was not granted on,
/// having won the other two first, is checked only for the push-back.)
#[tokio::test]
async fn a_redlock_release_wakes_the_head_in_place_and_a_handoff_costs_each_node_12_commands() {
    let nodes = RedisNodes::start(3).await;
    let a = SidecarBuilder::new(&nodes.url()).start().await;
    let b = SidecarBuilder::new(&nodes.url()).start().await;
    // Every script loaded (a first call of each loads it: 2 commands more).
    let warm = a.api().lock(&unique_name("warm"));
    let g = warm.acquire(&[]).await;
    warm.release(&g.token).await;
    let name = unique_name("wake-in-place");
    let held = a
        .api()
        .lock(&name)
        .acquire(&[("owner", "a"), ("ttl", "30s")])
        .await;
    let waiter = b.api().lock(&name);
    let waiting =
        tokio::spawn(async move { waiter.acquire(&[("owner", "b"), ("wait", "20s")]).await });
    common::eventually("the waiter queued", Duration::from_secs(5), async || {
        (a.api().lock(&name).inspect().await.waiters.len() == 1).then_some(())
    })
    .await;
    // The join's answers read and its first heartbeats sent.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut before = Vec::new();
    for node in &nodes.nodes {
        before.push(node.command_counts().await);
    }
    a.api().lock(&name).release(&held.token).await;
    let next = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter granted after the release")
        .expect("waiter task");
    assert!(next.fence > held.fence);
    let mut handed = 0;
    for (node, before) in nodes.nodes.iter().zip(&before) {
        let after = node.command_counts().await;
        let diff = common::redis::command_diff(before, &after);
        let n =
            |c: &std::collections::BTreeMap<String, u64>, k: &str| c.get(k).copied().unwrap_or(0);
        assert_eq!(
            n(&after, "lpush") - n(before, "lpush"),
            0,
            "the release took the head out of a node's queue and put it back: {diff}"
        );
        if n(&after, "incr") == n(before, "incr") {
            // Not granted here: on a loaded machine the waiter may win the
            // other two nodes first and then leave this one's queue
            // (`dequeue.lua`, whose hand-over finds the queue empty), a
            // path of its own.
            continue;
        }
        handed += 1;
        assert_eq!(
            n(&after, "lpop") - n(before, "lpop"),
            0,
            "the release took the head out of a node's queue: {diff}"
        );
        // A heartbeat (every 5 s; its LLEN tells) may fall in the window.
        let beat = if n(&after, "llen") > n(before, "llen") {
            8
        } else {
            0
        };
        // So may the waiting sidecar's check of its pub/sub connection.
        let pings = n(&after, "ping") - n(before, "ping");
        let ran = after.values().sum::<u64>() - before.values().sum::<u64>();
        assert!(
            ran <= 12 + beat + pings,
            "{ran} commands on a node for one handoff: {diff}"
        );
    }
    assert!(handed >= 2, "the waiter was granted on {handed} of 3 nodes");
}

/// A claim that finds a node's lock free with claims queued (every node's
/// state between a release and the head's grant) looks for the side keys
/// once, naming the lock-delay keys twice in one `EXISTS` (a result of 1 is
/// the queue alone), and is told it is busy behind the queue. With a
/// lock-delay or a shared lease's expiry about as well, that one look must
/// not read as the queue alone: the claim is still not granted, and is
/// answered as the full script answers it.
#[tokio::test]
async fn a_claim_behind_the_queue_of_a_free_redlock_lock_looks_once_and_minds_the_side_keys() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("behind-free");
    let lock = sidecar.api().lock(&name);
    let warm = lock.acquire(&[]).await;
    lock.release(&warm.token).await;

    // Another process's claim queued on every node of the free lock, its
    // process alive (its heartbeat runs for another minute).
    let tag = format!("{{sidelock:{name}}}");
    for node in &nodes.nodes {
        node.queue_foreign_claim(&name).await;
    }
    let exists =
        |c: &std::collections::BTreeMap<String, u64>| c.get("exists").copied().unwrap_or(0);
    let mut before = Vec::new();
    for node in &nodes.nodes {
        before.push(node.command_counts().await);
    }
    let once = lock.acquire_raw(&[("owner", "once")]).await;
    assert_eq!(once.status(), StatusCode::CONFLICT);
    for (node, before) in nodes.nodes.iter().zip(&before) {
        let after = node.command_counts().await;
        assert_eq!(
            exists(&after) - exists(before),
            1,
            "looks for the side keys on a node: {}",
            common::redis::command_diff(before, &after)
        );
    }

    // No queue, and a lock-delay alone, then a shared lease's expiry alone:
    // the one look counts 2 (a key named twice), which is not the queue
    // alone (1), so the full script decides (it looks at each side key's
    // type first). Named once, either would read as the queue alone.
    let types = |c: &std::collections::BTreeMap<String, u64>| c.get("type").copied().unwrap_or(0);
    for node in &nodes.nodes {
        let _: i64 = node.cmd(&["DEL", &format!("{tag}:q")]).await;
    }
    for side in ["delay", "expiry"] {
        let key = format!("{tag}:{side}");
        let mut before = Vec::new();
        for node in &nodes.nodes {
            if side == "delay" {
                let _: String = node.cmd(&["SET", &key, "1", "PX", "60000"]).await;
            } else {
                let _: i64 = node
                    .cmd(&["HSET", &key, "feedfeedfeedfeedfeedfeedfeedfeed", "1"])
                    .await;
            }
            before.push(node.command_counts().await);
        }
        let once = lock.acquire_raw(&[("owner", "once")]).await;
        if side == "delay" {
            assert_eq!(once.status(), StatusCode::CONFLICT, "inside a lock-delay");
        } else if once.status() == StatusCode::OK {
            let grant: serde_json::Value = once.json().await.expect("grant");
            lock.release(grant["token"].as_str().expect("token")).await;
        }
        for (node, before) in nodes.nodes.iter().zip(&before) {
            let after = node.command_counts().await;
            assert!(
                types(&after) > types(before),
                "with a {side} key alone the fast path decided: {}",
                common::redis::command_diff(before, &after)
            );
            let _: i64 = node.cmd(&["DEL", &key]).await;
        }
    }
}

/// A queue entry that is not one (written by hand) at the head of every
/// node's queue is dropped by the release that wakes the head in place,
/// and the claim behind it is woken and granted.
#[tokio::test]
async fn a_redlock_release_drops_a_head_entry_that_is_not_one_and_wakes_the_next() {
    let nodes = RedisNodes::start(3).await;
    let a = SidecarBuilder::new(&nodes.url()).start().await;
    let b = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("junk-head");
    let held = a
        .api()
        .lock(&name)
        .acquire(&[("owner", "a"), ("ttl", "30s")])
        .await;
    let waiter = b.api().lock(&name);
    let waiting =
        tokio::spawn(async move { waiter.acquire(&[("owner", "b"), ("wait", "20s")]).await });
    common::eventually("the waiter queued", Duration::from_secs(5), async || {
        (a.api().lock(&name).inspect().await.waiters.len() == 1).then_some(())
    })
    .await;
    let queue = format!("{{sidelock:{name}}}:q");
    for node in &nodes.nodes {
        let n: i64 = node.cmd(&["LPUSH", &queue, "not an entry"]).await;
        assert_eq!(n, 2);
    }
    a.api().lock(&name).release(&held.token).await;
    let next = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter granted after the release")
        .expect("waiter task");
    assert!(next.fence > held.fence);
    for node in &nodes.nodes {
        let left: Vec<String> = node.cmd(&["LRANGE", &queue, "0", "-1"]).await;
        assert!(left.is_empty(), "left in a node's queue: {left:?}");
    }
}

/// Clients looping on one semaphore through two sidecars, each acquiring
/// (wait 3 s), holding 20 ms and releasing until `run` is over.
const SEMAPHORE_CLIENTS: usize = 12;

/// The most permits held at once and the number of grants. A client counts
/// itself as a holder only between its grant's answer and sending its
/// release, inside its lease: a count above the limit is a real over-grant.
async fn hammer(
    sidecars: &[SidecarGuard],
    name: &str,
    limit: &str,
    run: Duration,
) -> (usize, usize) {
    let held = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let grants = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + run;
    let clients: Vec<_> = (0..SEMAPHORE_CLIENTS)
        .map(|i| {
            let semaphore = sidecars[i % sidecars.len()].api().semaphore(name);
            let (held, most, grants) = (held.clone(), most.clone(), grants.clone());
            let limit = limit.to_owned();
            let owner = format!("client-{i}");
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let params = [("limit", limit.as_str()), ("wait", "3s"), ("owner", &owner)];
                    let response = semaphore.acquire_raw(&params).await;
                    if response.status() != StatusCode::OK {
                        assert_problem(response, StatusCode::CONFLICT, "lock-busy").await;
                        continue;
                    }
                    let grant: common::Grant = response.json().await.expect("grant body");
                    let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    grants.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    held.fetch_sub(1, Ordering::SeqCst);
                    semaphore.release(&grant.token).await;
                }
            })
        })
        .collect();
    for client in clients {
        client.await.expect("client task");
    }
    (most.load(Ordering::SeqCst), grants.load(Ordering::SeqCst))
}

/// Asserts that the problem refuses a Redlock semaphore, naming why and what
/// to use instead.
fn assert_unsupported_detail(problem: &serde_json::Value) {
    assert_eq!(problem["type"], problem_type("unsupported"), "{problem}");
    assert_eq!(problem["status"], 400, "{problem}");
    let detail = problem["detail"].as_str().unwrap_or_default();
    for needle in ["majority", "redis://", "zk://", "postgres://", "limit=1"] {
        assert!(
            detail.contains(needle),
            "{needle:?} missing from {detail:?}"
        );
    }
}

/// Asserts that an acquire is refused with 400 `unsupported`.
async fn assert_unsupported(response: reqwest::Response) {
    let problem = assert_problem(response, StatusCode::BAD_REQUEST, "unsupported").await;
    assert_unsupported_detail(&problem);
}

/// Asserts that a hold is refused as an acquire is: 400 `unsupported`,
/// no stream (its first attempt answers before the response).
async fn assert_hold_unsupported(response: reqwest::Response) {
    assert_unsupported(response).await;
}

/// Two sidecars, 12 clients looping on one semaphore: with `limit=3` a
/// majority quorum let 4 hold permits at once (no fault injected), so
/// Redlock refuses `limit > 1` on acquire and hold, on either sidecar, and
/// nothing is written; `limit=1` (an exclusive lock) never over-grants.
#[tokio::test]
async fn a_semaphore_never_holds_more_permits_than_its_limit() {
    let nodes = RedisNodes::start(3).await;
    let sidecars = [
        SidecarBuilder::new(&nodes.url()).start().await,
        SidecarBuilder::new(&nodes.url()).start().await,
    ];
    let name = unique_name("counted");
    for sidecar in &sidecars {
        let semaphore = sidecar.api().semaphore(&name);
        for limit in ["2", "3", "4294967295"] {
            for wait in ["0", "1s"] {
                let params = [("limit", limit), ("wait", wait)];
                assert_unsupported(semaphore.acquire_raw(&params).await).await;
                assert_hold_unsupported(semaphore.hold_raw(&params).await).await;
            }
        }
        let state = semaphore.inspect().await;
        assert!(
            state.holders.is_empty() && state.waiters.is_empty(),
            "{state:?}"
        );
        assert_eq!(state.limit, None, "nothing was written");
    }

    let (most, grants) = hammer(&sidecars, &name, "1", Duration::from_secs(3)).await;
    assert!(grants > 0, "no permit was granted");
    assert!(
        most <= 1,
        "{most} permits of a limit=1 semaphore were held at once ({grants} grants)"
    );
}

/// A semaphore in use with 3 permits on every node (as a `redis://`
/// sidecar, or an older version, left it) is refused too when the claim
/// leaves `limit` out, and the refusal writes nothing.
#[tokio::test]
async fn a_semaphore_in_use_with_more_than_one_permit_is_refused_without_limit() {
    let nodes = RedisNodes::start(3).await;
    let name = unique_name("inherited");
    let mut plain = Vec::new();
    for node in &nodes.nodes {
        let sidecar = SidecarBuilder::new(&node.url()).start().await;
        sidecar
            .api()
            .semaphore(&name)
            .acquire(&[("limit", "3"), ("owner", "old"), ("ttl", "30s")])
            .await;
        plain.push(sidecar);
    }
    let redlock = SidecarBuilder::new(&nodes.url()).start().await;
    let semaphore = redlock.api().semaphore(&name);
    assert_unsupported(semaphore.acquire_raw(&[("owner", "new")]).await).await;
    assert_hold_unsupported(semaphore.hold_raw(&[("owner", "new")]).await).await;
    assert_unsupported(semaphore.acquire_raw(&[("limit", "3")]).await).await;
    assert_eq!(semaphore.inspect().await.limit, Some(3));
    for sidecar in &plain {
        let state = sidecar.api().semaphore(&name).inspect().await;
        assert_eq!(state.holder_owners(), ["old"], "{state:?}");
        assert!(state.waiters.is_empty(), "{state:?}");
    }
}

/// A re-entry that fails for want of a quorum (one node down, another's
/// answer lost after it counted the hold) leaves that node one hold ahead;
/// the owner's next release must not then report the highest count left on
/// any node: it said "one hold left" while a majority had let the lock go,
/// and another owner got it. A release reports the holds a majority keeps.
#[tokio::test]
async fn a_release_reports_the_holds_a_majority_keeps_not_the_most_any_node_keeps() {
    let mut nodes = RedisNodes::start(3).await;
    let (proxy, through_proxy) = second_node_through_a_proxy(&nodes).await;
    let a = SidecarBuilder::new(&through_proxy).start().await;
    let b = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("majority-count");
    let owner = unique_name("owner");
    let lock = a.api().lock(&name);
    nodes.nodes[2].kill();
    let first = lock.acquire(&[("owner", &owner), ("ttl", "60s")]).await;
    assert_eq!(first.count, 1);

    proxy.cut_after(owner.as_bytes());
    let again = lock.acquire_raw(&[("owner", &owner), ("ttl", "60s")]).await;
    assert!(!proxy.armed(), "the re-entry went through the proxy");
    assert!(
        !again.status().is_success(),
        "one node answered: no quorum ({})",
        again.status()
    );
    nodes.nodes[2].restart().await;
    // The nodes the sidecar reaches again.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let released = lock.release_raw(&first.token).await;
    let status = released.status();
    let body: serde_json::Value = released.json().await.expect("release's answer");
    let other = b
        .api()
        .lock(&name)
        .acquire_raw(&[("owner", "other"), ("ttl", "60s")])
        .await;
    let told_it_holds = status.is_success() && body["count"].as_u64().unwrap_or(0) > 0;
    assert!(
        !(told_it_holds && other.status().is_success()),
        "the owner was told it still holds ({body}) and another owner got the lock"
    );
}

/// A release that returned at a quorum leaves the node it did not reach
/// a hold ahead (its call died with the sidecar on SIGTERM, or was lost):
/// the listing shows the holds a majority keeps, not the first node's.
/// Node 0, the one the listing read first, is set a hold ahead by hand.
#[tokio::test]
async fn the_listing_shows_the_holds_a_majority_keeps_not_the_first_nodes() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("listed-count");
    let (main, _) = keys_of(&name);
    let lock = sidecar.api().lock(&name);
    let first = lock.acquire(&[("owner", "o"), ("ttl", "60s")]).await;
    let again = lock.acquire(&[("owner", "o"), ("ttl", "60s")]).await;
    assert_eq!(again.count, 2);
    let released = lock.release(&first.token).await;
    assert_eq!(released.count, 1);

    let value: String = nodes.nodes[0].cmd(&["GET", &main]).await;
    let mut fields: Vec<String> = value.split(' ').map(str::to_owned).collect();
    assert_eq!(fields[4], "1", "the hold count's place in {value:?}");
    fields[4] = "2".to_owned();
    let _: () = nodes.nodes[0]
        .cmd(&["SET", &main, &fields.join(" "), "KEEPTTL"])
        .await;

    let state = lock.inspect().await;
    assert_eq!(state.holder_owners(), ["o"], "{state:?}");
    assert_eq!(state.holders[0].count, 1, "{state:?}");
}

/// An owner of three holds releases one while one node was emptied (it
/// restarted without the lease) and another hangs (SIGSTOP): the node that
/// answers keeps two holds, and whether a majority does depends on the
/// hung one. The owner must not be told the lock was let go (200, no holds
/// left: a majority may still keep two of them until their ttl), nor be
/// asked to send the release again (503: the answering node ran it): its
/// lease is reported lost.
#[tokio::test]
async fn a_release_whose_count_a_silent_node_decides_reports_the_lease_lost() {
    // (A semaphore's permit is not re-entered: one hold each.)
    for kind in ["exclusive", "shared"] {
        release_a_hold_with_one_node_emptied_and_one_hung(kind).await;
    }
}

/// An owner of three holds of `kind` (an exclusive or a read lease)
/// releases one with node 2 emptied and node 1 hung: its lease is reported
/// lost.
async fn release_a_hold_with_one_node_emptied_and_one_hung(kind: &str) {
    let mut nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("silent-decides");
    let owner = unique_name("owner");
    let lock = sidecar.api().lock(&name);
    let mut params = vec![("owner", owner.as_str()), ("ttl", "60s")];
    if kind == "shared" {
        params.push(("mode", "shared"));
    }
    let first = lock.acquire(&params).await;
    for count in 2..=3 {
        let again = lock.acquire(&params).await;
        assert_eq!(
            (again.token.as_str(), again.count),
            (first.token.as_str(), count),
            "{kind}: re-entered"
        );
    }
    nodes.nodes[2].restart().await;
    // The sidecar's connection to the restarted node is made again (its
    // first call after the restart fails), by another lock's calls.
    let other = sidecar.api().lock(&unique_name("reconnect"));
    for _ in 0..2 {
        if let Ok(grant) = other
            .acquire_raw(&[])
            .await
            .json::<serde_json::Value>()
            .await
            && let Some(token) = grant["token"].as_str()
        {
            other.release_raw(token).await;
        }
    }
    nodes.nodes[1].signal(Signal::SIGSTOP);

    let released = lock.release_raw(&first.token).await;
    let status = released.status();
    let body = released.text().await.unwrap_or_default();
    nodes.nodes[1].signal(Signal::SIGCONT);
    assert_eq!(
        status,
        StatusCode::GONE,
        "{kind}: one node keeps two holds, one lost the lease, one is silent: {body}"
    );
}

/// A proxy in front of the second of three nodes, and the Redlock URL that
/// reaches that node through it.
async fn second_node_through_a_proxy(nodes: &RedisNodes) -> (common::proxy::CuttingProxy, String) {
    let proxy = common::proxy::CuttingProxy::start(nodes.nodes[1].port()).await;
    let url = format!(
        "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
        nodes.nodes[0].port(),
        proxy.port(),
        nodes.nodes[2].port()
    );
    (proxy, url)
}

/// The main key and the queue of lock `name` on a node (the default prefix).
fn keys_of(name: &str) -> (String, String) {
    let main = format!("sidelock:{name}");
    let queue = format!("{{{main}}}:q");
    (main, queue)
}

/// A claim that may wait is granted by two nodes while the third, where a
/// foreign client holds the key, queues it. Its place there was never
/// taken away (only a claim that had queued before cleaned up after
/// itself), and the sidecar's heartbeat kept it for as long as it ran: the
/// node refused every try-once claim behind that phantom waiter, so with
/// one other node down a free lock answered 409 forever.
#[tokio::test]
async fn a_claim_granted_by_a_majority_leaves_no_place_in_a_minority_queue() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("phantom");
    let (main, queue) = keys_of(&name);
    let _: () = nodes.nodes[2]
        .cmd(&["SET", &main, "foreign", "PX", "2000"])
        .await;
    let lock = sidecar.api().lock(&name);
    let grant = lock.acquire(&[("owner", "z"), ("wait", "10s")]).await;
    let places: i64 = nodes.nodes[2].cmd(&["LLEN", &queue]).await;
    assert_eq!(places, 0, "the claim's place on the node that refused it");
    lock.release(&grant.token).await;
    common::eventually(
        "the foreign key to expire",
        Duration::from_secs(10),
        async || (nodes.nodes[2].cmd::<i64>(&["EXISTS", &main]).await == 0).then_some(()),
    )
    .await;
    assert!(lock.inspect().await.waiters.is_empty());
    nodes.nodes[1].signal(Signal::SIGSTOP);
    let next = lock.acquire_raw(&[("owner", "next")]).await;
    nodes.nodes[1].signal(Signal::SIGCONT);
    assert_eq!(
        next.status(),
        StatusCode::OK,
        "a free lock, two nodes of three: {}",
        next.text().await.unwrap_or_default()
    );
}

/// A lease granted by two nodes of three (a foreign client held the key on
/// the third) is re-entered once the third is free: the two re-enter it,
/// the third grants the attempt's new token. The lease won, and the new
/// token's grant on the third node was never given back: it outlived both
/// releases, every later re-entry of the owner renewed it there, and with
/// one other node down nobody was granted the free lock.
#[tokio::test]
async fn a_reentry_gives_back_the_new_tokens_grant_on_the_nodes_that_did_not_reenter() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("reentry-leak");
    let (main, _) = keys_of(&name);
    let _: () = nodes.nodes[2]
        .cmd(&["SET", &main, "foreign", "PX", "1000"])
        .await;
    let lock = sidecar.api().lock(&name);
    let first = lock.acquire(&[("owner", "o"), ("ttl", "60s")]).await;
    common::eventually(
        "the foreign key to expire",
        Duration::from_secs(10),
        async || (nodes.nodes[2].cmd::<i64>(&["EXISTS", &main]).await == 0).then_some(()),
    )
    .await;
    let again = lock.acquire(&[("owner", "o"), ("ttl", "60s")]).await;
    assert_eq!(again.token, first.token, "a re-entry");
    lock.release(&first.token).await;
    lock.release(&first.token).await;
    common::eventually(
        "the third node to hold nothing",
        Duration::from_secs(5),
        async || (nodes.nodes[2].cmd::<i64>(&["EXISTS", &main]).await == 0).then_some(()),
    )
    .await;
    nodes.nodes[0].signal(Signal::SIGSTOP);
    let next = lock.acquire_raw(&[("owner", "next")]).await;
    nodes.nodes[0].signal(Signal::SIGCONT);
    assert_eq!(
        next.status(),
        StatusCode::OK,
        "a free lock, two nodes of three: {}",
        next.text().await.unwrap_or_default()
    );
}

/// One node refuses a claim (a side key written by hand: 409
/// `key-conflict`, "nothing was granted") while the nodes after it in the
/// list grant it or queue it. The answers were read in node order and the
/// first refusal returned at once: the later nodes' grants were never
/// undone, and a majority kept a lease nobody had been given; a place in a
/// queue stayed for as long as the sidecar ran.
#[tokio::test]
async fn a_claim_one_node_refuses_leaves_no_grant_and_no_place_on_the_others() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("refused");
    let (main, queue) = keys_of(&name);
    let fence_key = format!("{{{main}}}:fence");
    let _: () = nodes.nodes[0]
        .cmd(&["SET", &fence_key, "not-a-number"])
        .await;
    let lock = sidecar.api().lock(&name);
    let refused = lock.acquire_raw(&[("owner", "x"), ("ttl", "60s")]).await;
    assert_problem(refused, StatusCode::CONFLICT, "key-conflict").await;
    let state = lock.inspect().await;
    assert!(state.holders.is_empty(), "{state:?}");

    // A claim that may wait, queued by the node a foreign client holds.
    let _: () = nodes.nodes[2]
        .cmd(&["SET", &main, "foreign", "PX", "60000"])
        .await;
    let refused = lock
        .acquire_raw(&[("owner", "x"), ("ttl", "60s"), ("wait", "5s")])
        .await;
    assert_problem(refused, StatusCode::CONFLICT, "key-conflict").await;
    let places: i64 = nodes.nodes[2].cmd(&["LLEN", &queue]).await;
    assert_eq!(places, 0, "the claim's place on the node that queued it");

    let _: () = nodes.nodes[0].cmd(&["DEL", &fence_key]).await;
    lock.acquire(&[("owner", "y")]).await;
}

/// A grant takes the highest fence count of its majority and raises the
/// other granting nodes to it, so that any later majority continues above
/// it. When a raise failed, the grant was still answered with that fence:
/// a later majority without the one node that counted it could grant a
/// lower fence (here 2 after 987654321). Such a grant is undone instead,
/// and the attempt answers 503 naming why the raise failed.
#[tokio::test]
async fn a_grant_whose_fence_a_majority_does_not_count_is_undone() {
    const HIGH: u64 = 987_654_320;
    let mut nodes = RedisNodes::start(3).await;
    let (proxy, url) = second_node_through_a_proxy(&nodes).await;
    let sidecar = SidecarBuilder::new(&url).start().await;
    let name = unique_name("raise");
    // Node 0 counted fences no other node did (grants by a minority).
    let fence_key = format!("{{sidelock:{name}}}:fence");
    let _: () = nodes.nodes[0]
        .cmd(&["SET", &fence_key, &HIGH.to_string()])
        .await;
    nodes.nodes[2].kill();
    let lock = sidecar.api().lock(&name);
    // The raise of node 1 to the grant's fence never reaches it.
    proxy.refuse((HIGH + 1).to_string().as_bytes(), 1);
    let first = lock
        .acquire_raw(&[("owner", "first"), ("ttl", "60s")])
        .await;
    assert!(!proxy.refusing(), "the raise went through the proxy");
    let mut fences = Vec::new();
    let mut tokens = Vec::new();
    if first.status() == StatusCode::OK {
        let first: serde_json::Value = first.json().await.expect("a grant");
        fences.push(first["fence"].as_u64().expect("a fence"));
        tokens.push(first["token"].as_str().expect("a token").to_owned());
    } else {
        let problem = assert_problem(
            first,
            StatusCode::SERVICE_UNAVAILABLE,
            "backend-unavailable",
        )
        .await;
        // Why: the raise's connection broke (it said "timed out").
        assert_eq!(problem["cause"], "connection lost", "{problem}");
        let again = lock.acquire(&[("owner", "first"), ("ttl", "60s")]).await;
        fences.push(again.fence);
        tokens.push(again.token);
    }
    for token in &tokens {
        lock.release(token).await;
    }
    // A majority without node 0: node 1, and node 2 back empty.
    nodes.nodes[2].restart().await;
    nodes.nodes[0].kill();
    let later = common::eventually(
        "a grant by nodes 1 and 2",
        Duration::from_secs(15),
        async || {
            let r = lock
                .acquire_raw(&[("owner", "later"), ("ttl", "60s")])
                .await;
            if r.status() == StatusCode::OK {
                r.json::<serde_json::Value>().await.ok()
            } else {
                None
            }
        },
    )
    .await;
    let later = later["fence"].as_u64().expect("a fence");
    assert!(
        fences.iter().all(|f| later > *f),
        "a later grant's fence {later} after {fences:?}"
    );
}

/// A node whose answer to a join comes after the attempt's time limit for
/// it (a tenth of the ttl) has queued the claim all the same. The attempt
/// forgot that node, so nothing took the place away when the waiter left:
/// it stayed in the node's queue, shown as a waiter and keeping try-once
/// claims out of that node, until its heartbeat lapsed and some later
/// script pruned it. The key is now reconciled as after a lost answer —
/// and a reconciling cut short by the next attempt's time limit leaves the
/// key to reconcile (it forgot it).
#[tokio::test]
async fn a_place_made_after_the_attempts_time_limit_is_taken_away() {
    let nodes = RedisNodes::start(3).await;
    let (proxy, url) = second_node_through_a_proxy(&nodes).await;
    let sidecar = SidecarBuilder::new(&url).start().await;
    let name = unique_name("late");
    let (_, queue) = keys_of(&name);
    let lock = sidecar.api().lock(&name);
    lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    // A ttl of 1 s gives each node 100 ms to answer.
    proxy.hold_answer_after(b"late-waiter", Duration::from_millis(400));
    let waiter = lock
        .acquire_raw(&[("owner", "late-waiter"), ("ttl", "1s"), ("wait", "1s")])
        .await;
    assert_eq!(waiter.status(), StatusCode::CONFLICT);
    common::eventually(
        "the late place taken away",
        Duration::from_secs(12),
        async || (nodes.nodes[1].cmd::<i64>(&["LLEN", &queue]).await == 0).then_some(()),
    )
    .await;
}

/// A majority missed because one node is down and another refuses the
/// user its scripts (`NOPERM`): the 503 names the refusal, which an
/// operator must fix, not the node that is down, which comes back by
/// itself. It named whichever node came first in the URL.
#[tokio::test]
async fn a_majority_missed_through_a_refusal_names_the_refusal() {
    let mut nodes = RedisNodes::start(3).await;
    for (i, node) in nodes.nodes.iter().enumerate() {
        let mut acl = vec![
            "ACL", "SETUSER", "locker", "on", ">secret", "~*", "&*", "+@all",
        ];
        if i == 1 {
            acl.extend(["-evalsha", "-eval"]);
        }
        let _: String = node.cmd(&acl).await;
    }
    let ports: Vec<u16> = nodes.nodes.iter().map(|n| n.port()).collect();
    let sidecar = SidecarBuilder::new(&format!(
        "redlock://locker:secret@127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
        ports[0], ports[1], ports[2]
    ))
    .start()
    .await;
    nodes.nodes[0].kill();
    let refused = sidecar
        .api()
        .lock(&unique_name("refused-scripts"))
        .acquire_raw(&[])
        .await;
    let problem = assert_problem(
        refused,
        StatusCode::SERVICE_UNAVAILABLE,
        "backend-unavailable",
    )
    .await;
    assert_eq!(problem["cause"], "permission denied", "{problem}");
    assert!(!problem.to_string().contains("secret"), "{problem}");
}

/// A waiter's subscription needs a majority of nodes, not all: with one of
/// three nodes stopped (it neither answers nor closes), a waiter with a
/// short wait answers at its wait's end. It waited for the stopped node's
/// subscription to time out twice, about 4 s.
#[tokio::test]
async fn a_waiter_does_not_wait_for_a_stopped_node_to_subscribe() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let lock = sidecar.api().lock(&unique_name("stopped-sub"));
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "30s")]).await;
    nodes.nodes[2].signal(Signal::SIGSTOP);
    let asked = Instant::now();
    let answer = lock
        .acquire_raw(&[("owner", "waiter"), ("wait", "1s")])
        .await;
    let took = asked.elapsed();
    nodes.nodes[2].signal(Signal::SIGCONT);
    assert_eq!(
        answer.status(),
        StatusCode::CONFLICT,
        "busy at the wait's end"
    );
    assert!(
        took < Duration::from_millis(2500),
        "answered after {took:?}"
    );
    lock.release(&holder.token).await;
}

// A leader's `since_ms` is the earliest among the nodes that answered: a
// slow node moves it without any change of leader. Observers compared
// leaders without it, but a campaign's `follower` events compared whole
// readings, and told a waiting campaign of the same leader again.
#[tokio::test]
async fn a_waiting_campaign_hears_of_its_leader_once_while_a_node_is_slow() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let api = sidecar.api();
    let name = unique_name("once");
    let segments = ["v1", "elections", name.as_str(), "campaign"];
    // The leader's grant lands on each node at another moment: its
    // `since` differs from node to node.
    nodes.nodes[0].pause_clients(150).await;
    nodes.nodes[1].pause_clients(350).await;
    let mut leader = api
        .open_stream(&segments, &[("owner", "leader"), ("ttl", "30s")])
        .await;
    leader
        .wait_for("the leader event", Duration::from_secs(10), |e| {
            e.event == "leader"
        })
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut waiting = api.open_stream(&segments, &[("owner", "waiting")]).await;
    let told = waiting
        .wait_for("the follower event", Duration::from_secs(10), |e| {
            e.event == "follower"
        })
        .await;
    assert_eq!(
        told.json()["leader"]["owner"],
        "leader",
        "{}",
        waiting.raw()
    );
    // The node where the grant came first hangs; another campaign joins,
    // and the election is read again without it.
    nodes.nodes[2].pause_clients(4_000).await;
    let joining = {
        let api = api.clone();
        let segments = segments.map(str::to_owned);
        tokio::spawn(async move {
            let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
            api.open_stream(&segments, &[("owner", "joining")]).await
        })
    };
    match waiting.next_within(Duration::from_secs(3)).await {
        Err(()) => {}
        Ok(event) => panic!(
            "told of the same leader again: {event:?}\n{}",
            waiting.raw()
        ),
    }
    drop(joining);
}

// Each node stored a lease with the fence it counted, and the grant raised
// only the nodes' counters to the highest: with the node that counted it
// gone, the owner's re-entry through another sidecar answered the same
// lease with the fence of the others (1 after 101), and `inspect` showed it.
#[tokio::test]
async fn a_lease_keeps_its_fence_when_the_node_that_counted_it_is_gone() {
    let mut nodes = RedisNodes::start(3).await;
    let a = SidecarBuilder::new(&nodes.url()).start().await;
    let b = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("kept-fence");
    let (main, _) = keys_of(&name);
    let _: () = nodes.nodes[0]
        .cmd(&["SET", &format!("{{{main}}}:fence"), "100"])
        .await;
    let grant = a
        .api()
        .lock(&name)
        .acquire(&[("owner", "o"), ("ttl", "60s")])
        .await;
    assert_eq!(grant.fence, 101);
    nodes.nodes[0].kill();
    let again = b
        .api()
        .lock(&name)
        .acquire(&[("owner", "o"), ("ttl", "60s")])
        .await;
    assert_eq!(again.token, grant.token);
    assert_eq!(again.count, 2);
    assert_eq!(again.fence, 101, "the re-entered lease's fence");
    assert_eq!(b.api().lock(&name).inspect().await.holders[0].fence, 101);
}

// A semaphore waiter sent without a limit, which one node did not queue
// (it was slow): once the holder left, that node found the semaphore idle
// and answered "limit required", and that one answer refused the claim
// with 400 although the other two queued and granted it.
#[tokio::test]
async fn a_waiter_without_a_limit_is_granted_when_one_node_never_queued_it() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let semaphore = sidecar.api().semaphore(&unique_name("unlimited"));
    let first = semaphore
        .acquire(&[("owner", "first"), ("limit", "1"), ("ttl", "60s")])
        .await;
    nodes.nodes[2].pause_clients(1_000).await;
    let waiter = semaphore.spawn_acquire_raw(&[("owner", "waiter"), ("wait", "30s")]);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    semaphore.release(&first.token).await;
    let answer = waiter.await.expect("the waiter's task");
    assert_eq!(
        answer.status(),
        StatusCode::OK,
        "{}",
        answer.text().await.unwrap_or_default()
    );
}

/// Asserts that `answer` is a grant whose lease had not ended when the
/// answer came.
async fn assert_granted_in_time(answer: reqwest::Response) {
    let received = common::now_ms();
    let status = answer.status();
    let body = answer.text().await.unwrap_or_default();
    assert_eq!(status, StatusCode::OK, "{body}");
    let grant: serde_json::Value = serde_json::from_str(&body).expect("a grant's JSON");
    let expires_at_ms = grant["expires_at_ms"].as_u64().expect("expires_at_ms");
    assert!(
        expires_at_ms > received,
        "a grant answered {} ms after its lease ended",
        received - expires_at_ms
    );
}

/// A waiter granted by two nodes while the third, where it was queued too,
/// hangs (SIGSTOP): taking its place out of that node's queue waited for
/// the node's call to time out (2 s), and the grant of a 1 s lease was
/// answered a second after the lease had ended on the nodes that granted
/// it — free for anyone else to take. A grant is answered within its
/// validity or not at all.
#[tokio::test]
async fn a_grant_is_never_answered_after_its_lease_ran_out() {
    let nodes = RedisNodes::start(3).await;
    let a = SidecarBuilder::new(&nodes.url()).start().await;
    let b = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("validity");
    let (_, queue) = keys_of(&name);
    let holder = a
        .api()
        .lock(&name)
        .acquire(&[("owner", "holder"), ("ttl", "30s")])
        .await;
    let waiter =
        b.api()
            .lock(&name)
            .spawn_acquire_raw(&[("owner", "w"), ("ttl", "1s"), ("wait", "20s")]);
    common::eventually(
        "the waiter queued on every node",
        Duration::from_secs(5),
        async || {
            for n in &nodes.nodes {
                if n.cmd::<i64>(&["LLEN", &queue]).await != 1 {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    nodes.nodes[2].signal(Signal::SIGSTOP);
    a.api().lock(&name).release(&holder.token).await;
    let answer = waiter.await.expect("the waiter's task");
    nodes.nodes[2].signal(Signal::SIGCONT);
    assert_granted_in_time(answer).await;
}

/// A claim whose `max_hold` (50 ms) is shorter than its ttl (10 s) gets a
/// lease of 50 ms on each node, but its validity was reckoned from the
/// ttl: with a node slow to answer (150 ms), the grant was answered after
/// the lease had ended on the other two.
#[tokio::test]
async fn a_grant_capped_by_max_hold_is_never_answered_after_its_end() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let lock = sidecar.api().lock(&unique_name("capped-validity"));
    // Connections made before the pause.
    let warm = lock.acquire(&[("owner", "warm")]).await;
    lock.release(&warm.token).await;
    nodes.nodes[2].pause_clients(150).await;
    let answer = lock
        .acquire_raw(&[("owner", "w"), ("ttl", "10s"), ("max_hold", "50ms")])
        .await;
    match answer.status() {
        // Refused for want of time is right too.
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT => {}
        _ => {
            assert_granted_in_time(answer).await;
        }
    }
}

/// Two nodes of three stall past an attempt's time limit for a node (a
/// 2 s ttl gives each node 200 ms): only the third answers, and the claim
/// is refused with 503. The stalled nodes ran the attempt's script when
/// they woke and granted its token — a majority lease nobody had been
/// given, kept until its ttl: the free lock answered 409 to everyone, and
/// the refused owner's next claim re-entered it (`count` 2). A grant a
/// node may have made after its answer was given up is released there.
#[tokio::test]
async fn a_grant_made_after_a_nodes_time_limit_is_given_back() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let lock = sidecar.api().lock(&unique_name("late-grant"));
    // Connections made before the pauses.
    let warm = lock.acquire(&[("owner", "warm")]).await;
    lock.release(&warm.token).await;
    nodes.nodes[0].pause_clients(400).await;
    nodes.nodes[1].pause_clients(400).await;
    let refused = lock.acquire_raw(&[("owner", "o"), ("ttl", "2s")]).await;
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let state = lock.inspect().await;
    assert!(
        state.holders.is_empty(),
        "a lease nobody was given: {state:?}"
    );
    let again = lock.acquire(&[("owner", "o"), ("ttl", "2s")]).await;
    assert_eq!(again.count, 1, "{again:?}");
}

/// A lease no longer than Redlock's clock-drift allowance (1% + 2 ms) can
/// never be granted: every attempt was granted by the nodes and undone for
/// want of validity, taken for a split vote, and tried again 5–50 ms later
/// until the claim's wait ran out — a free lock answered 409, after a
/// wait's worth of grants and undos on every node. Such a ttl, or
/// `max_hold`, is refused up front, saying what Redlock needs.
#[tokio::test]
async fn a_lease_too_short_for_redlocks_drift_allowance_is_refused() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let lock = sidecar.api().lock(&unique_name("too-short"));
    for params in [
        [("ttl", "2ms"), ("wait", "1s")],
        [("ttl", "10s"), ("max_hold", "2ms")],
    ] {
        let problem = assert_problem(
            lock.acquire_raw(&params).await,
            StatusCode::BAD_REQUEST,
            "unsupported",
        )
        .await;
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("at least"), "{problem}");
    }
    lock.acquire(&[("ttl", "100ms")]).await;
}

/// A hold's watchdog renews a lease a re-entry lengthened (10 s over the
/// hold's 300 ms) to the end the re-entry was told of. It renewed to the
/// lease's expiry as Redlock reports it — the nodes' less a drift
/// allowance — which took the allowance off again at every renewal: the
/// lease fell back to the hold's ttl seconds early, and once the stream
/// closed another client was granted what the re-entry's client still
/// held.
#[tokio::test]
async fn a_lengthened_lease_keeps_its_end_through_a_holds_renewals() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let lock = sidecar.api().lock(&unique_name("drifting"));
    let mut hold = lock.hold(&[("owner", "w"), ("ttl", "300ms")]).await;
    hold.expect_acquired().await;
    let again = lock.acquire(&[("owner", "w"), ("ttl", "10s")]).await;
    assert_eq!(again.count, 2);
    tokio::time::sleep(Duration::from_secs(6)).await;
    drop(hold);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    lock.acquire_busy(&[("owner", "other")]).await;
    lock.release(&again.token).await;
}

/// A claim whose `max_hold` (400 ms) is far shorter than its ttl (30 s),
/// with one node of three stopped: the attempt waited the ttl's time limit
/// for the stopped node (500 ms), longer than the nodes' lease, so no
/// grant ever had validity left and a free lock answered 409 at the end of
/// the wait. The time limit comes from the lease the nodes keep.
#[tokio::test]
async fn a_claim_capped_by_max_hold_is_granted_with_a_node_stopped() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let lock = sidecar.api().lock(&unique_name("capped-stopped"));
    let warm = lock.acquire(&[("owner", "warm")]).await;
    lock.release(&warm.token).await;
    nodes.nodes[2].signal(Signal::SIGSTOP);
    let answer = lock
        .acquire_raw(&[("ttl", "30s"), ("max_hold", "400ms"), ("wait", "2s")])
        .await;
    nodes.nodes[2].signal(Signal::SIGCONT);
    assert_granted_in_time(answer).await;
}

/// A re-entry of a lease capped by its first grant's `max_hold` (2 s),
/// sent just before that cap with one node slow: the nodes keep the lease
/// only to the cap, but the re-entry's validity was reckoned from its own
/// ttl, and it was answered after the lease had ended.
#[tokio::test]
async fn a_reentry_is_never_answered_after_its_leases_cap() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let lock = sidecar.api().lock(&unique_name("capped-reentry"));
    let first = lock
        .acquire(&[("owner", "o"), ("ttl", "10s"), ("max_hold", "2s")])
        .await;
    let cap = first.expires_at_ms;
    let until_cap = cap.saturating_sub(common::now_ms()).saturating_sub(100);
    tokio::time::sleep(Duration::from_millis(until_cap)).await;
    nodes.nodes[2].pause_clients(600).await;
    let answer = lock.acquire_raw(&[("owner", "o"), ("ttl", "10s")]).await;
    if answer.status() == StatusCode::OK {
        assert_granted_in_time(answer).await;
    }
}

/// The end a re-entry answers on Redlock is its nodes' end less a drift
/// allowance, Redlock's margin for clocks that run fast. A hold's watchdog
/// renewing up to that end set the nodes' lease to it exactly: the margin
/// was gone, and a node whose clock ran fast could free the lock before
/// the end its client was told of. The nodes keep the margin.
#[tokio::test]
async fn a_holds_renewals_keep_redlocks_margin_past_the_end_it_answered() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("margin");
    let (main, _) = keys_of(&name);
    let lock = sidecar.api().lock(&name);
    let mut hold = lock.hold(&[("owner", "w"), ("ttl", "300ms")]).await;
    hold.expect_acquired().await;
    let again = lock.acquire(&[("owner", "w"), ("ttl", "10s")]).await;
    assert_eq!(again.count, 2);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // drift(10 s) = 102 ms; what the renewals' own timing may take off.
    let margin = 102 - 30;
    for node in &nodes.nodes {
        let pttl: i64 = node.cmd(&["PTTL", &main]).await;
        let node_end = common::now_ms() + u64::try_from(pttl).expect("the lease on every node");
        assert!(
            node_end >= again.expires_at_ms + margin,
            "a node keeps the lease to {node_end}, {} ms short of the end answered plus the \
             margin",
            (again.expires_at_ms + margin).saturating_sub(node_end)
        );
    }
    drop(hold);
}

/// A re-entry capped by its lease's `max_hold` answers the nodes' end less
/// the drift allowance over what is left of it, as every other Redlock
/// answer does: it answered the nodes' own end. The first grant's end is
/// the nodes' less 202 ms (1% of 20 s and 2 ms), the re-entry's a second
/// later less 192 ms, and whatever the first grant's way to the nodes took
/// (a few ms, more on a loaded machine): it answered 200 ms and more past
/// the first. (With a 2 s cap the two differed by 20 ms against 10, and the
/// way there on a loaded machine blurred them.)
#[tokio::test]
async fn a_capped_reentry_answers_no_later_than_its_first_grant() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let lock = sidecar.api().lock(&unique_name("capped-answer"));
    let first = lock
        .acquire(&[("owner", "o"), ("ttl", "60s"), ("max_hold", "20s")])
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let again = lock.acquire(&[("owner", "o"), ("ttl", "60s")]).await;
    assert_eq!(again.count, 2);
    assert!(
        again.expires_at_ms <= first.expires_at_ms + 100,
        "the re-entry answered {} ms past its first grant's end",
        again.expires_at_ms - first.expires_at_ms
    );
}

/// One node of three hangs (stopped: its connections stay open and say
/// nothing). Renewals, a lease's status and releases waited the full
/// 500 ms for it although two nodes answered at once, so a hold of under
/// about 1.8 s was lost at its first renewal (`unreachable`, the renewal
/// still running at the lease's margin). They answer once a majority
/// decides; the hung node's call goes on behind.
#[tokio::test]
async fn a_hung_node_does_not_hold_back_a_short_leases_renewals() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let lock = sidecar.api().lock(&unique_name("hung-node"));
    // Every node's connection open before one hangs.
    let warm = lock.acquire(&[("owner", "warm")]).await;
    lock.release(&warm.token).await;
    nodes.nodes[2].signal(Signal::SIGSTOP);
    let mut hold = lock.hold(&[("owner", "h"), ("ttl", "900ms")]).await;
    hold.expect_acquired().await;
    let events = hold.collect_for(Duration::from_secs(3)).await;
    let renewed = events
        .iter()
        .filter(|e| matches!(e, common::sse::HoldEvent::Renewed(_)))
        .count();
    let other = sidecar.api().lock(&unique_name("hung-release"));
    let grant = other.acquire(&[("owner", "k"), ("ttl", "900ms")]).await;
    let started = Instant::now();
    other.release(&grant.token).await;
    let released_in = started.elapsed();
    nodes.nodes[2].signal(Signal::SIGCONT);
    assert!(
        renewed >= 6,
        "{renewed} renewals in 3 s of a 900 ms lease: {events:?}"
    );
    assert!(
        released_in < Duration::from_millis(300),
        "a release took {released_in:?} with two nodes answering"
    );
}

/// Each node lists keys in the order of their names (`elections/…` before
/// `locks/…`), and a cursor is the last name shown; the merged page was
/// ordered by kind (locks first), so its cursor skipped back and forth: a
/// page of two after an election repeated a lock on the next page, and an
/// election missing on one node was never shown. Pages follow the nodes'
/// order: every entry once.
#[tokio::test]
async fn redlock_pages_list_every_lock_semaphore_and_election_once() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let api = sidecar.api();
    let prefix = unique_name("pages");
    let mut expected = Vec::new();
    for suffix in ["a", "b"] {
        let name = format!("{prefix}-{suffix}");
        api.lock(&name).acquire(&[]).await;
        expected.push(format!("lock {name}"));
    }
    let name = format!("{prefix}-s");
    api.semaphore(&name).acquire(&[("limit", "1")]).await;
    expected.push(format!("semaphore {name}"));
    let name = format!("{prefix}-e");
    let mut leader = api
        .open_stream(&["v1", "elections", &name, "campaign"], &[("owner", "c")])
        .await;
    leader
        .wait_for("leader", Duration::from_secs(10), |e| e.event == "leader")
        .await;
    expected.push(format!("election {name}"));
    expected.sort();
    for limit in ["1", "2", "3"] {
        let mut listed = Vec::new();
        let mut cursor: Option<String> = None;
        for page_number in 0.. {
            assert!(page_number < 10, "limit {limit}: no end: {listed:?}");
            let mut query = vec![("prefix", prefix.as_str()), ("limit", limit)];
            if let Some(cursor) = &cursor {
                query.push(("cursor", cursor));
            }
            let page = api.list(&query).await;
            listed.extend(page.locks.iter().map(|l| format!("{} {}", l.kind, l.name)));
            cursor = page.next_cursor;
            if cursor.is_none() {
                break;
            }
        }
        listed.sort();
        assert_eq!(listed, expected, "limit {limit}");
    }
}

/// A lease this sidecar gave up (its renewal could not reach a majority
/// near its expiry) is released in the background; when that release ran
/// on a majority but their answers came too late, it must not be sent
/// again. It was, and its second run took the hold its owner had taken
/// through another sidecar meanwhile (count 2 → 0): the lease was deleted
/// under an owner told it held it, and another owner got the lock.
#[tokio::test]
async fn a_revoked_lease_whose_release_answers_come_too_late_is_not_released_again() {
    let nodes = RedisNodes::start(3).await;
    let proxies = [
        common::proxy::CuttingProxy::start(nodes.nodes[1].port()).await,
        common::proxy::CuttingProxy::start(nodes.nodes[2].port()).await,
    ];
    let url = format!(
        "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
        nodes.nodes[0].port(),
        proxies[0].port(),
        proxies[1].port()
    );
    let a = SidecarBuilder::new(&url).start().await;
    let b = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("revoked-late");
    let owner = unique_name("owner");
    let through_a = a.api().lock(&name);
    let lock = b.api().lock(&name);
    // Loads the scripts on the proxied connections.
    let warm = through_a.acquire(&[]).await;
    through_a.release(&warm.token).await;

    let first = through_a.acquire(&[("owner", &owner), ("ttl", "2s")]).await;
    let again = lock.acquire(&[("owner", &owner), ("ttl", "60s")]).await;
    assert_eq!(
        (again.token.as_str(), again.count),
        (first.token.as_str(), 2),
        "the owner re-entered its lease through the other sidecar"
    );
    // From here on, the two proxied nodes run what this sidecar sends and
    // answer it after its per-node limit (500 ms): a majority that is
    // there, and late.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    for proxy in &proxies {
        proxy.slow_answers(Duration::from_millis(900));
    }
    // A renewal near the lease's expiry (asking for the other sidecar's
    // ttl, so that, run, it does not shorten that hold) fails, and is
    // under way at the lease's last check: the lease is given up, and
    // released in the background.
    let kept = through_a
        .keepalive_raw(&first.token, &[("ttl", "60s")])
        .await;
    assert!(
        [StatusCode::SERVICE_UNAVAILABLE, StatusCode::GONE].contains(&kept.status()),
        "the renewal reached no majority in time: {}",
        kept.status()
    );
    common::eventually("the lease given up", Duration::from_secs(3), async || {
        let kept = through_a
            .keepalive_raw(&first.token, &[("ttl", "60s")])
            .await;
        (kept.status() == StatusCode::GONE).then_some(())
    })
    .await;
    // Past the background release's retries (100 ms, 200 ms, ... while
    // answers come late), then answers on time again.
    tokio::time::sleep(Duration::from_secs(4)).await;
    for proxy in &proxies {
        proxy.slow_answers(Duration::ZERO);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    crate::lost_answers::assert_holds_once(&lock, &owner, &again.token).await;
}

/// A background release that one node ran while the others refused it
/// (an error reply: here `NOREPLICAS`, as `LOADING` during a rolling
/// restart) is not sent again: each resend that ran on a minority was
/// harmless alone, but a second node running the next one left two of
/// three nodes a hold short — the owner's hold, re-entered through another
/// sidecar, gone on a majority, and another owner let in.
#[tokio::test]
async fn a_background_release_that_ran_on_a_minority_is_not_sent_again() {
    let nodes = RedisNodes::start(3).await;
    let a = SidecarBuilder::new(&nodes.url()).start().await;
    let b = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("minority-runs");
    let owner = unique_name("owner");
    let through_a = a.api().lock(&name);
    let lock = b.api().lock(&name);
    let first = through_a
        .acquire(&[("owner", &owner), ("ttl", "10s")])
        .await;
    let again = lock.acquire(&[("owner", &owner), ("ttl", "60s")]).await;
    assert_eq!(
        again.count, 2,
        "the owner re-entered through the other sidecar"
    );
    let (main, _) = keys_of(&name);
    let writes = async |node: usize, on: bool| {
        let n = if on { "0" } else { "1" };
        let _: () = nodes.nodes[node]
            .cmd(&["CONFIG", "SET", "min-replicas-to-write", n])
            .await;
    };
    let count_on = async |node: usize| -> String {
        let lease: Option<String> = nodes.nodes[node].cmd(&["GET", &main]).await;
        lease.map_or_else(
            || "gone".to_owned(),
            |l| l.split(' ').nth(4).unwrap_or("?").to_owned(),
        )
    };
    for node in 0..3 {
        writes(node, false).await;
    }
    // A renewal within the last tenth of the lease's ttl fails: the lease
    // is given up, and its release sent in the background, refused.
    tokio::time::sleep(Duration::from_millis(9300)).await;
    let kept = through_a
        .keepalive_raw(&first.token, &[("ttl", "60s")])
        .await;
    assert!(
        [StatusCode::SERVICE_UNAVAILABLE, StatusCode::GONE].contains(&kept.status()),
        "{}",
        kept.status()
    );
    // Node 0 takes the next release (2 -> 1); nodes 1 and 2 refuse it.
    writes(0, true).await;
    common::eventually(
        "node 0 runs the release",
        Duration::from_secs(5),
        async || (count_on(0).await == "1").then_some(()),
    )
    .await;
    writes(0, false).await;
    // Node 1 alone takes any release sent again.
    writes(1, true).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    writes(0, true).await;
    writes(2, true).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let counts = [count_on(0).await, count_on(1).await, count_on(2).await];
    let intruder = lock.acquire_raw(&[("owner", "intruder")]).await;
    assert_eq!(
        intruder.status(),
        StatusCode::CONFLICT,
        "another owner got the lock its owner holds (holds per node {counts:?})"
    );
    let kept = lock.keepalive_raw(&again.token, &[]).await;
    assert_eq!(kept.status(), StatusCode::OK, "holds per node {counts:?}");
}

/// An attempt answered while its sidecar was paused (SIGSTOP here; a VM's
/// or a CPU quota's pause in production) past the nodes' time limit
/// (ttl/10, at most 500 ms) is answered, not timed out: at resume the
/// timers fired before the connections' readers ran, and an acquire the
/// nodes had granted answered 503. The grant's validity counts the pause
/// (ttl − the attempt's time, from its start). Here the nodes hang until
/// the sidecar is paused.
#[tokio::test]
async fn an_attempt_answered_while_its_sidecar_was_paused_is_answered() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let api = sidecar.api();
    api.lock(&unique_name("warm-up")).acquire(&[]).await;
    let name = unique_name("paused-attempt");
    for node in &nodes.nodes {
        node.signal(Signal::SIGSTOP);
    }
    let sent_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64;
    let acquire = api.lock(&name).spawn_acquire_raw(&[("ttl", "60s")]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    sidecar.signal(Signal::SIGSTOP);
    tokio::time::sleep(Duration::from_millis(100)).await;
    for node in &nodes.nodes {
        node.signal(Signal::SIGCONT);
    }
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    sidecar.signal(Signal::SIGCONT);
    let answer = acquire.await.expect("the acquire");
    let status = answer.status();
    let body: serde_json::Value = answer.json().await.expect("a JSON body");
    assert_eq!(status, StatusCode::OK, "{body}");
    // Counted from the answer, the end would be 1.3 s later than this.
    let expires_at_ms = body["expires_at_ms"].as_u64().expect("expires_at_ms");
    assert!(
        expires_at_ms <= sent_ms + 60_000,
        "the pause counted: sent at {sent_ms}, {body}"
    );
}

/// A holder a majority keeps is shown while one of its nodes is slow: the
/// lease is on nodes 0 and 1 (node 2 lost it), and node 1 answers after
/// 1.5 s. Inspect counted only the nodes that answered within 1 s (0 and 2:
/// one of them has it) and showed the lock free while it was held; an
/// election's observers showed no leader, then the leader again. It now
/// waits for a node that could decide, within a call's time limit (2 s).
#[tokio::test]
async fn a_holder_is_shown_while_one_of_its_majority_is_slow() {
    let nodes = RedisNodes::start(3).await;
    let sidecar = SidecarBuilder::new(&nodes.url()).start().await;
    let name = unique_name("slow-majority");
    let (main, _) = keys_of(&name);
    let lock = sidecar.api().lock(&name);
    let held = lock.acquire(&[("owner", "o"), ("ttl", "60s")]).await;
    let _: i64 = nodes.nodes[2].cmd(&["DEL", &main]).await;
    assert_eq!(
        lock.inspect().await.holders.len(),
        1,
        "held by nodes 0 and 1"
    );
    nodes.nodes[1].signal(Signal::SIGSTOP);
    let inspect = {
        let lock = lock.clone();
        tokio::spawn(async move { lock.inspect().await })
    };
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    nodes.nodes[1].signal(Signal::SIGCONT);
    let state = inspect.await.expect("the inspect");
    assert_eq!(
        state
            .holders
            .iter()
            .map(|h| h.owner.as_str())
            .collect::<Vec<_>>(),
        ["o"],
        "{state:?}"
    );
    lock.release(&held.token).await;
}

/// An attempt that failed (node 1 hung, node 2's grant undone) whose
/// answer from node 0 came back garbled (a TLS alert or garbage mid-reply:
/// the script ran and granted) releases node 0's grant in the background,
/// as it does a timed-out node's. Only a lost connection or a time limit
/// counted: node 0 kept a lease nobody held until its ttl (60 s here), and
/// the lock's next grants had one node fewer to lose.
#[tokio::test]
async fn a_failed_attempts_garbled_grant_is_released_on_its_node() {
    let nodes = RedisNodes::start(3).await;
    let proxy = common::proxy::CuttingProxy::start(nodes.nodes[0].port()).await;
    let url = format!(
        "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
        proxy.port(),
        nodes.nodes[1].port(),
        nodes.nodes[2].port()
    );
    let sidecar = SidecarBuilder::new(&url).start().await;
    let name = unique_name("garbled-grant");
    let (main, _) = keys_of(&name);
    let lock = sidecar.api().lock(&name);
    let warm = lock.acquire(&[]).await;
    lock.release(&warm.token).await;
    proxy.garble_answer_after(name.as_bytes());
    nodes.nodes[1].signal(Signal::SIGSTOP);
    let first = lock.acquire_raw(&[("ttl", "60s")]).await;
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    nodes.nodes[1].signal(Signal::SIGCONT);
    common::eventually(
        "node 0's garbled grant released",
        Duration::from_secs(5),
        async || {
            let lease: Option<String> = nodes.nodes[0].cmd(&["GET", &main]).await;
            lease.is_none().then_some(())
        },
    )
    .await;
}
