//! A lease's hold count is bounded: a re-entry past the most holds one
//! lease may have (2,147,483,646) is refused with 409 `too-many-holds` and
//! its hold given back. The count had no bound: past 2³¹ holds PostgreSQL's
//! `integer` overflowed into a 503, and the memory and ZooKeeper backends'
//! counts would wrap to no hold at all. Two billion re-entries take days,
//! so each backend's test sets the count by hand, one below the bound.

use crate::common;

use common::api::Resource;
use common::redis::RedisServer;
use common::zookeeper::ZkServer;
use common::{SidecarBuilder, assert_problem, unique_name};
use reqwest::StatusCode;

/// The most holds one lease may have.
const MOST: u64 = i32::MAX as u64 - 1;

/// Has `owner` hold `lock` with its count set to [`MOST`] by `set_count`
/// (given the lock's name and the lease's token), then checks that one
/// more re-entry is refused and given back, and that the holds are still
/// there to release one by one.
async fn refuses_a_re_entry_past_the_most_holds(
    lock: &Resource,
    name: &str,
    set_count: impl AsyncFn(&str, &str),
) {
    let owner = unique_name("owner");
    let held = lock.acquire(&[("owner", &owner), ("ttl", "60s")]).await;
    set_count(name, &held.token).await;
    let counted = |state: &common::api::LockState| {
        state
            .holders
            .iter()
            .map(|h| (h.owner.clone(), h.count))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        counted(&lock.inspect().await),
        [(owner.clone(), MOST)],
        "the count set by hand"
    );

    let again = lock.acquire_raw(&[("owner", &owner), ("ttl", "60s")]).await;
    let problem = assert_problem(again, StatusCode::CONFLICT, "too-many-holds").await;
    assert_eq!(problem["limit"], MOST, "{problem}");
    assert_eq!(
        counted(&lock.inspect().await),
        [(owner.clone(), MOST)],
        "the refused re-entry's hold was given back"
    );
    let intruder = lock.acquire_raw(&[("owner", "intruder")]).await;
    assert_eq!(intruder.status(), StatusCode::CONFLICT, "still held");
    assert_eq!(lock.release(&held.token).await.count, MOST - 1);
}

#[tokio::test]
async fn redis_refuses_a_re_entry_past_the_most_holds() {
    let server = RedisServer::start().await;
    let sidecar = SidecarBuilder::new(&server.url()).start().await;
    let name = unique_name("most-holds");
    refuses_a_re_entry_past_the_most_holds(
        &sidecar.api().lock(&name),
        &name,
        async |name: &str, _token: &str| {
            // The lease is "<token> <fence> <since> <expiry> <count> ...".
            let main = format!("sidelock:{name}");
            let lease: String = server.cmd(&["GET", &main]).await;
            let mut fields: Vec<&str> = lease.split(' ').collect();
            let most = MOST.to_string();
            fields[4] = &most;
            let _: () = server
                .cmd(&["SET", &main, &fields.join(" "), "KEEPTTL"])
                .await;
        },
    )
    .await;
}

#[tokio::test]
async fn postgres_refuses_a_re_entry_past_the_most_holds() {
    let database = common::postgres::TestDatabase::new().await;
    let sidecar = SidecarBuilder::new(&database.url()).start().await;
    let client = database.client().await;
    let name = unique_name("most-holds");
    refuses_a_re_entry_past_the_most_holds(
        &sidecar.api().lock(&name),
        &name,
        async |name: &str, _token: &str| {
            let set = client
                .execute(
                    "UPDATE sidelock.leases SET hold_count = $1 WHERE kind = 'lock' AND name = $2",
                    &[&(MOST as i32), &name],
                )
                .await
                .expect("set the hold count");
            assert_eq!(set, 1, "one lease");
        },
    )
    .await;
}

#[tokio::test]
async fn zookeeper_refuses_a_re_entry_past_the_most_holds() {
    use zookeeper_client as zk;
    let server = ZkServer::start().await;
    let sidecar = SidecarBuilder::new(&server.url("/holds")).start().await;
    let client = zk::Client::connector()
        .connect(&format!("127.0.0.1:{}/holds", server.client_port(0)))
        .await
        .expect("connect to the test server");
    let name = unique_name("most-holds");
    refuses_a_re_entry_past_the_most_holds(
        &sidecar.api().lock(&name),
        &name,
        async |name: &str, _token: &str| {
            let parent = format!("/sidelock/locks/{name}");
            let (children, _) = client
                .get_children(&parent)
                .await
                .expect("the lock's claims");
            let claims: Vec<&String> = children.iter().filter(|c| c.starts_with("_c_")).collect();
            assert_eq!(claims.len(), 1, "{children:?}");
            let path = format!("{parent}/{}", claims[0]);
            let (data, stat) = client.get_data(&path).await.expect("the lease");
            let mut lease: serde_json::Value =
                serde_json::from_slice(&data).expect("the lease's JSON");
            lease["count"] = MOST.into();
            client
                .set_data(
                    &path,
                    &serde_json::to_vec(&lease).expect("JSON"),
                    Some(stat.version),
                )
                .await
                .expect("set the hold count");
        },
    )
    .await;
}
