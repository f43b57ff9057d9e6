//! The PostgreSQL backend beyond the shared conformance suite (which also
//! runs on it): FIFO across sidecars, statement cost of idle waiters, outages
//! and restarts, concurrent start-up, upgrading a version 1 schema, waiters
//! of dead sidecars, missed notifications, and every stale reason.
//!
//! Tests use the machine's server (a schema or database of their own, see
//! `common::postgres`), except those that stop the server or count
//! statements, which start a throwaway cluster.

use crate::common;
use crate::lost_answers;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use reqwest::StatusCode;
use reqwest::header::RETRY_AFTER;

use common::postgres::{PgCluster, TestDatabase, TestSchema};
use common::*;

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

async fn postgres() -> BackendGuard {
    TestBackend::Postgres.start().await
}

fn schema(backend: &BackendGuard) -> &TestSchema {
    backend
        .server::<TestSchema>()
        .expect("a PostgreSQL backend has a schema")
}

fn assert_strictly_increasing(fences: &[u64]) {
    for pair in fences.windows(2) {
        assert!(
            pair[0] < pair[1],
            "fences must strictly increase: {fences:?}"
        );
    }
}

/// Asserts a 503 `backend-unavailable` problem with `Retry-After`.
async fn assert_unavailable(response: reqwest::Response) {
    let retry_after = response
        .headers()
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    assert!(
        retry_after.is_some_and(|s| s >= 1),
        "503 without a usable Retry-After: {:?}",
        response.headers()
    );
    assert_problem(
        response,
        StatusCode::SERVICE_UNAVAILABLE,
        "backend-unavailable",
    )
    .await;
}

/// The schema versions applied to the `sidelock` schema, in order.
async fn migration_versions(client: &tokio_postgres::Client) -> Vec<i32> {
    client
        .query(
            "SELECT version FROM sidelock.schema_migrations ORDER BY version",
            &[],
        )
        .await
        .expect("read schema_migrations")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn readyz_status(sidecar: &SidecarGuard) -> StatusCode {
    sidecar.api().get(&["readyz"], &[]).await.status()
}

/// Two sidecars, 64 clients queued alternately through each: one global
/// queue, served strictly in arrival order, one holder at a time, fences
/// strictly increasing. (The conformance suite's
/// `concurrent_clients_never_overlap_and_all_finish` runs 64 racing clients
/// over two sidecars on this backend too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_clients_on_two_sidecars_are_served_in_global_queue_order() {
    const CLIENTS: usize = 64;
    let backend = postgres().await;
    let sidecars = backend.sidecars(2).await;
    let name = unique_name("fifo");
    let locks: Vec<Resource> = sidecars.iter().map(|s| s.api().lock(&name)).collect();
    let first = locks[0].acquire(&[("owner", "first")]).await;

    let owners: Vec<String> = (0..CLIENTS).map(|i| format!("client-{i}")).collect();
    let mut streams = Vec::new();
    for (i, owner) in owners.iter().enumerate() {
        let mut stream = locks[i % 2]
            .hold(&[("owner", owner), ("wait", "60s"), ("ttl", "30s")])
            .await;
        let queued = stream.expect_queued().await;
        assert_eq!(
            queued.position,
            i as u64 + 1,
            "{owner} through sidecar {}",
            i % 2
        );
        streams.push(stream);
    }
    let expected: Vec<&str> = owners.iter().map(String::as_str).collect();
    for lock in &locks {
        assert_eq!(lock.inspect().await.waiter_owners(), expected);
    }

    // Released through the other sidecar than the one that granted it.
    locks[1].release(&first.token).await;
    let mut fences = vec![first.fence];
    for (i, mut stream) in streams.into_iter().enumerate() {
        let grant = stream.expect_acquired().await;
        assert_eq!(grant.owner, owners[i], "grant {i} went to the wrong client");
        fences.push(grant.fence);
        // Both sidecars see exactly this holder and the rest of the queue.
        for lock in &locks {
            let state = lock.inspect().await;
            assert_eq!(state.holder_owners(), [owners[i].as_str()]);
            assert_eq!(state.waiter_owners(), expected[i + 1..]);
        }
        drop(stream);
    }
    assert_strictly_increasing(&fences);
    locks[0].wait_until_free().await;
}

/// 500 waiters blocked for 3 s cost the database almost nothing: waiting is
/// NOTIFY plus a timer at the holder's expiry, and the heartbeat is one
/// statement per sidecar per interval, whatever the number of waiters.
/// Counted with `pg_stat_statements` in a cluster of its own, for the
/// sidecars' database only.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_hundred_blocked_waiters_run_fewer_than_fifty_statements_in_three_seconds() {
    const WAITERS: usize = 500;
    const LOCKS: usize = 5;
    const WINDOW: Duration = Duration::from_secs(3);
    let cluster = PgCluster::start();
    let admin = cluster.client("postgres").await;
    for sql in [
        "CREATE EXTENSION pg_stat_statements",
        "CREATE DATABASE sidelock",
    ] {
        admin.batch_execute(sql).await.expect(sql);
    }
    let url = cluster.url("sidelock");
    let sidecars = [
        SidecarBuilder::new(&url).start().await,
        SidecarBuilder::new(&url).start().await,
    ];
    let names: Vec<String> = (0..LOCKS).map(|_| unique_name("idle")).collect();
    for name in &names {
        sidecars[0]
            .api()
            .lock(name)
            .acquire(&[("owner", "holder"), ("ttl", "60s")])
            .await;
    }
    let mut joining = tokio::task::JoinSet::new();
    for i in 0..WAITERS {
        let lock = sidecars[i % 2].api().lock(&names[i % LOCKS]);
        joining.spawn(async move {
            let owner = format!("waiter-{i}");
            let mut stream = lock.hold(&[("owner", &owner), ("wait", "60s")]).await;
            stream.expect_queued().await;
            stream
        });
    }
    let mut streams = Vec::with_capacity(WAITERS);
    within("500 waiters to queue", Duration::from_secs(60), async {
        while let Some(stream) = joining.join_next().await {
            streams.push(stream.expect("waiter task"));
        }
    })
    .await;
    let db = cluster.client("sidelock").await;
    let count_waiters = async || -> i64 {
        db.query_one("SELECT count(*) FROM sidelock.waiters", &[])
            .await
            .expect("count waiters")
            .get(0)
    };
    assert_eq!(count_waiters().await, WAITERS as i64);

    admin
        .batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .expect("reset pg_stat_statements");
    tokio::time::sleep(WINDOW).await;
    let (statements, detail) = statements_run(&admin, "sidelock").await;
    eprintln!(
        "{WAITERS} waiters blocked for {WINDOW:?} on two sidecars: {statements} statements\n{}",
        detail.join("\n")
    );
    assert!(
        statements < 50,
        "{statements} statements while {WAITERS} waiters were blocked for {WINDOW:?}:\n{}",
        detail.join("\n")
    );
    // They were blocked all along, and still are.
    assert_eq!(count_waiters().await, WAITERS as i64);
    drop(streams);
}

/// The common lock costs PostgreSQL a few statements: 50 acquires and
/// releases of a free exclusive lock nobody waits for, counted with
/// `pg_stat_statements` tracking the statements inside the functions too.
/// (Version 9's functions ran 24 per pair: the full decision, expired leases
/// and dead sidecars' waiters looked for, on every call.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncontended_acquire_and_release_run_at_most_eight_statements() {
    const PAIRS: i64 = 50;
    let (cluster, admin) = counting_everything().await;
    let sidecar = SidecarBuilder::new(&cluster.url("sidelock")).start().await;
    let lock = sidecar.api().lock(&unique_name("short"));
    // The key's row is written by the first grant, which the count leaves out.
    let first = lock.acquire(&[("ttl", "30s")]).await;
    lock.release(&first.token).await;
    reset_after_start_up(&admin, "sidelock").await;
    let mut fences = vec![first.fence];
    for _ in 0..PAIRS {
        let grant = lock.acquire(&[("ttl", "30s")]).await;
        fences.push(grant.fence);
        lock.release(&grant.token).await;
    }
    let (statements, detail) = statements_run(&admin, "sidelock").await;
    eprintln!(
        "{PAIRS} acquires and releases: {statements} statements\n{}",
        detail.join("\n")
    );
    // The two calls, the row lock, fence and lease of the grant (with the
    // foreign key's check), the row lock and delete of the release; a
    // heartbeat may fall into the window (7 statements with its clean-up
    // of dead sidecars and lapsed leases).
    assert!(
        statements <= PAIRS * 8 + 7,
        "{statements} statements for {PAIRS} acquires and releases (at most {} allowed):\n{}",
        PAIRS * 8 + 7,
        detail.join("\n")
    );
    assert_strictly_increasing(&fences);
    assert_eq!(lock.inspect().await.holders.len(), 0);
}

/// A contended lock costs PostgreSQL a few dozen statements per handoff:
/// 8 clients on two sidecars take one lock 40 times each (every grant
/// queued behind a live holder and handed over by a release), counted with
/// `pg_stat_statements` tracking the statements inside the functions too.
/// (Version 9 ran 38.7 per handoff: each join and each release ran the full
/// decision.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_contended_handoff_runs_at_most_twenty_five_statements() {
    const CLIENTS: usize = 8;
    const ROUNDS: usize = 40;
    let (cluster, admin) = counting_everything().await;
    let url = cluster.url("sidelock");
    let sidecars = [
        SidecarBuilder::new(&url).start().await,
        SidecarBuilder::new(&url).start().await,
    ];
    let name = unique_name("handoffs");
    let first = sidecars[0].api().lock(&name).acquire(&[]).await;
    sidecars[0].api().lock(&name).release(&first.token).await;
    reset_after_start_up(&admin, "sidelock").await;
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..CLIENTS {
        let lock = sidecars[i % 2].api().lock(&name);
        clients.spawn(async move {
            let mut fences = Vec::with_capacity(ROUNDS);
            for _ in 0..ROUNDS {
                let grant = lock.acquire(&[("ttl", "30s"), ("wait", "30s")]).await;
                fences.push(grant.fence);
                lock.release(&grant.token).await;
            }
            fences
        });
    }
    let mut fences = Vec::new();
    while let Some(mine) = clients.join_next().await {
        let mine = mine.expect("client task");
        assert_strictly_increasing(&mine);
        fences.extend(mine);
    }
    let (statements, detail) = statements_run(&admin, "sidelock").await;
    let grants = (CLIENTS * ROUNDS) as i64;
    eprintln!(
        "{grants} grants: {statements} statements\n{}",
        detail.join("\n")
    );
    assert!(
        statements <= grants * 25,
        "{statements} statements for {grants} grants (at most {} allowed):\n{}",
        grants * 25,
        detail.join("\n")
    );
    fences.sort_unstable();
    fences.dedup();
    assert_eq!(fences.len() as i64, grants, "a fence given twice");
}

/// A release commits without waiting for its WAL flush only when it is sent
/// alone (as the sidecar sends it) and hands nothing over: the
/// four-argument `release()` (for callers that may write after it in the
/// same transaction), a release after other writes of its transaction and a
/// release that hands the lock to a waiter leave `synchronous_commit` as
/// the server has it for the rest of the transaction. (Each call is rolled
/// back: the lease stays.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_lone_release_that_hands_nothing_over_skips_the_wal_flush() {
    let backend = postgres().await;
    let sidecar = backend.start_sidecar().await;
    let name = unique_name("flush");
    let lock = sidecar.api().lock(&name);
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    let schema = schema(&backend);
    let mut client = schema.client().await;
    let alone = format!(
        "SELECT \"{}\".release('lock', $1, $2, 10000, true)",
        schema.name
    );
    let plain = format!("SELECT \"{}\".release('lock', $1, $2, 10000)", schema.name);
    let mut setting_after = async |before: &str, call: &str| -> String {
        let tx = client.transaction().await.expect("begin");
        if !before.is_empty() {
            tx.batch_execute(before).await.expect(before);
        }
        let left: Option<i32> = tx
            .query_one(call, &[&name, &holder.token])
            .await
            .expect(call)
            .get(0);
        assert_eq!(left, Some(0), "{call}");
        let setting: String = tx
            .query_one("SELECT current_setting('synchronous_commit')", &[])
            .await
            .expect("read synchronous_commit")
            .get(0);
        tx.rollback().await.expect("rollback");
        setting
    };
    assert_eq!(setting_after("", &alone).await, "off", "sent alone");
    assert_eq!(setting_after("", &plain).await, "on", "four arguments");
    assert_eq!(
        setting_after("SELECT txid_current()", &alone).await,
        "on",
        "after a write of its transaction"
    );
    let mut waiter = lock.hold(&[("owner", "waiter"), ("wait", "60s")]).await;
    waiter.expect_queued().await;
    assert_eq!(setting_after("", &alone).await, "on", "handing over");
    // Through the sidecar, the release hands the lock to the waiter.
    lock.release(&holder.token).await;
    assert_eq!(waiter.expect_acquired().await.owner, "waiter");
}

/// A server crash straight after releases. The release that handed the lock
/// to a waiter waited for its flush: after recovery the waiter still holds
/// the lock with the fence it was told, and nobody else is granted it. The
/// releases that handed nothing over did not wait: the last may come back
/// as its lease (here it usually does), which holds the lock until its 3 s
/// ttl at most; the lock is granted again, with a higher fence than any
/// before the crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_crash_after_releases_keeps_the_handoff_and_the_fences() {
    let (cluster, url) = cluster_with_database().await;
    let sidecar = SidecarBuilder::new(&url).start().await;
    let api = sidecar.api();
    let free = api.lock(&unique_name("crash-free"));
    let handed = api.lock(&unique_name("crash-handed"));
    let holder = handed.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    let mut waiter = handed
        .hold(&[("owner", "waiter"), ("wait", "60s"), ("ttl", "60s")])
        .await;
    waiter.expect_queued().await;
    handed.release(&holder.token).await;
    let handed_over = waiter.expect_acquired().await;
    let mut fences = Vec::new();
    for _ in 0..20 {
        let grant = free.acquire(&[("ttl", "3s")]).await;
        fences.push(grant.fence);
        free.release(&grant.token).await;
    }
    // Straight after the answers: what the server had not written is lost.
    crash_and_restart(&cluster, &sidecar).await;

    let holders = owners_and_fences(&handed).await;
    assert_eq!(holders, [("waiter".to_owned(), handed_over.fence)]);
    handed.acquire_busy(&[("owner", "other")]).await;

    // Each grant's flush wrote the release before it: only the last can be back.
    let back = free.inspect().await.holders.len();
    eprintln!("released leases back after the crash: {back}");
    assert!(back <= 1, "{back} released leases came back");
    let started = Instant::now();
    let again = free.acquire(&[("ttl", "3s"), ("wait", "10s")]).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "granted {:?} after the restart",
        started.elapsed()
    );
    fences.push(again.fence);
    assert_strictly_increasing(&fences);
    drop(waiter);
}

/// A database whose sessions default to `synchronous_commit = off` (a
/// common tuning), with the WAL writer at its slowest: a grant still
/// survives a crash straight after its answer, as the sidecar turns the
/// flush back on for its own sessions. (The old sidecar inherited the
/// setting: after the crash the lease was gone and the next claim was
/// granted the same fence.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_survives_a_crash_on_a_database_without_synchronous_commit() {
    let cluster = Arc::new(PgCluster::start());
    let admin = cluster.client("postgres").await;
    for sql in [
        "CREATE DATABASE sidelock",
        "ALTER DATABASE sidelock SET synchronous_commit = off",
        "ALTER SYSTEM SET wal_writer_delay = '10s'",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.expect(sql);
    }
    drop(admin);
    let sidecar = SidecarBuilder::new(&cluster.url("sidelock")).start().await;
    let lock = sidecar.api().lock(&unique_name("unflushed"));
    // Past the sidecar's start-up writes, so that the grant is the last.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    crash_and_restart(&cluster, &sidecar).await;
    let holders = owners_and_fences(&lock).await;
    assert_eq!(holders, [("holder".to_owned(), holder.fence)]);
    lock.acquire_busy(&[("owner", "other")]).await;
}

/// A database whose transactions default to `repeatable read`: contended
/// claims of two sidecars on one lock are all answered (granted or timed
/// out), none 503. The old sidecar's functions took their snapshot before
/// the key's row lock, so a concurrent grant failed them with a
/// serialization error, 503 after three tries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_on_a_database_defaulting_to_repeatable_read_answers_no_503() {
    contend_on_a_database_where(
        "ALTER DATABASE sidelock SET default_transaction_isolation = 'repeatable read'",
    )
    .await;
}

/// A database whose sessions default to a short `lock_timeout` (a DBA's
/// guard): contended claims wait for a key's row lock as long as they
/// must, none 503. The sidecar's sessions kept the default, and a claim
/// that waited longer than it for the row lock failed as an outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_on_a_database_with_a_short_lock_timeout_answers_no_503() {
    contend_on_a_database_where("ALTER DATABASE sidelock SET lock_timeout = '1ms'").await;
}

/// 16 clients of two sidecars acquire and release one lock ten times each
/// on database `sidelock`, set up by `setting`; every claim must be granted.
async fn contend_on_a_database_where(setting: &str) {
    let cluster = Arc::new(PgCluster::start());
    let admin = cluster.client("postgres").await;
    for sql in ["CREATE DATABASE sidelock", setting] {
        admin.batch_execute(sql).await.expect(sql);
    }
    drop(admin);
    let url = cluster.url("sidelock");
    let sidecars = [
        SidecarBuilder::new(&url).start().await,
        SidecarBuilder::new(&url).start().await,
    ];
    let name = unique_name("repeatable");
    let mut clients = Vec::new();
    for i in 0..16 {
        let lock = sidecars[i % 2].api().lock(&name);
        clients.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            for _ in 0..10 {
                let response = lock.acquire_raw(&[("wait", "10s"), ("ttl", "10s")]).await;
                let status = response.status();
                if status == StatusCode::OK {
                    let grant: Grant = response.json().await.expect("grant");
                    lock.release(&grant.token).await;
                }
                statuses.push(status);
            }
            statuses
        }));
    }
    let mut statuses = Vec::new();
    for client in clients {
        statuses.extend(client.await.expect("client"));
    }
    let failed: Vec<&StatusCode> = statuses.iter().filter(|s| **s != StatusCode::OK).collect();
    assert!(
        failed.is_empty(),
        "{} of 160 claims failed: {failed:?}",
        failed.len()
    );
}

/// Crashes the server (WAL in its buffers is lost), starts it again and
/// waits until `sidecar` is ready.
async fn crash_and_restart(cluster: &Arc<PgCluster>, sidecar: &SidecarGuard) {
    let crasher = cluster.clone();
    tokio::task::spawn_blocking(move || {
        crasher.crash_server();
        crasher.start_server();
    })
    .await
    .expect("crash and restart the server");
    eventually("/readyz to pass", Duration::from_secs(15), async || {
        (readyz_status(sidecar).await == StatusCode::OK).then_some(())
    })
    .await;
}

/// The owner and fence of each holder of `lock`.
async fn owners_and_fences(lock: &Resource) -> Vec<(String, u64)> {
    lock.inspect()
        .await
        .holders
        .into_iter()
        .map(|h| (h.owner, h.fence))
        .collect()
}

/// A cluster of the test's own whose database `sidelock` has
/// `pg_stat_statements` count the statements inside functions too, and a
/// client of its `postgres` database.
async fn counting_everything() -> (PgCluster, tokio_postgres::Client) {
    let cluster = PgCluster::start();
    let admin = cluster.client("postgres").await;
    for sql in [
        "CREATE EXTENSION pg_stat_statements",
        "CREATE DATABASE sidelock",
        "ALTER DATABASE sidelock SET pg_stat_statements.track = 'all'",
    ] {
        admin.batch_execute(sql).await.expect(sql);
    }
    (cluster, admin)
}

/// Resets `pg_stat_statements` once the sidecars of `database` are past
/// their start-up: the monitor elected and its first stale scan run. (That
/// work comes at once and then every 10 s; counted into a test's window, it
/// added 9 statements to 50 pairs.) The scan is the one statement that
/// names a `reason`: its literal reasons are counted as parameters.
async fn reset_after_start_up(admin: &tokio_postgres::Client, database: &str) {
    eventually(
        "the monitor's first stale scan",
        Duration::from_secs(15),
        async || {
            let scans: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
                 WHERE d.datname = $1 AND s.query LIKE '%AS reason%'",
                &[&database],
            )
            .await
            .expect("look for the stale scan")
            .get(0);
            (scans > 0).then_some(())
        },
    )
    .await;
    admin
        .batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .expect("reset pg_stat_statements");
}

/// The statements `pg_stat_statements` counted in `database` since its last
/// reset: their number, and one line per statement, most called first.
async fn statements_run(admin: &tokio_postgres::Client, database: &str) -> (i64, Vec<String>) {
    let rows = admin
        .query(
            "SELECT s.calls, left(regexp_replace(s.query, '\\s+', ' ', 'g'), 90) \
             FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
             WHERE d.datname = $1 ORDER BY s.calls DESC",
            &[&database],
        )
        .await
        .expect("list statements");
    let statements = rows.iter().map(|r| r.get::<_, i64>(0)).sum();
    let detail = rows
        .iter()
        .map(|r| format!("{:>5} {}", r.get::<_, i64>(0), r.get::<_, String>(1)))
        .collect();
    (statements, detail)
}

/// One client's grant, as it saw it.
struct Interval {
    fence: u64,
    /// Above 1: the client re-entered a lease it was not told of (an
    /// acquire answered 503 after the database granted it).
    count: u64,
    owner: String,
    granted: Instant,
    releasing: Instant,
}

/// A PostgreSQL server of the test's own, with an empty database
/// `sidelock`, and that database's URL.
async fn cluster_with_database() -> (Arc<PgCluster>, String) {
    with_database(PgCluster::start()).await
}

/// `cluster` with the sidecars' database created in it, and that database's URL.
async fn with_database(cluster: PgCluster) -> (Arc<PgCluster>, String) {
    let cluster = Arc::new(cluster);
    let admin = cluster.client("postgres").await;
    admin
        .batch_execute("CREATE DATABASE sidelock")
        .await
        .expect("create database");
    drop(admin);
    let url = cluster.url("sidelock");
    (cluster, url)
}

/// PostgreSQL stopped and started again while clients of two sidecars loop
/// on a lock: 503s (with `Retry-After`) and a failing `/readyz` while it is
/// down, grants again afterwards, never two holders at once, fences strictly
/// increasing (but for a client re-entering a lease whose grant it was told
/// 503 for: it keeps that lease's fence), and a waiter parked across the
/// restart is woken by a release made right after it (its lease would
/// otherwise last another minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restart_under_load_gives_503s_then_recovers_without_double_grants_or_missed_wake_ups() {
    const CLIENTS: usize = 16;
    let (cluster, url) = cluster_with_database().await;
    let a = SidecarBuilder::new(&url).start().await;
    let b = SidecarBuilder::new(&url).start().await;

    // A waiter on `a` behind a one-minute lease taken through `b`.
    let parked = unique_name("parked");
    let holder = b
        .api()
        .lock(&parked)
        .acquire(&[("owner", "holder"), ("ttl", "60s")])
        .await;
    let mut parked_waiter = a
        .api()
        .lock(&parked)
        .hold(&[("owner", "parked-waiter"), ("wait", "60s"), ("ttl", "60s")])
        .await;
    parked_waiter.expect_queued().await;

    // The load: acquire (waiting up to 2 s), hold 2 ms, release; retry on 503.
    let load = unique_name("load");
    let stop = Arc::new(AtomicBool::new(false));
    let outages = Arc::new(AtomicUsize::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..CLIENTS {
        let lock = [&a, &b][client % 2].api().lock(&load);
        let (stop, outages) = (stop.clone(), outages.clone());
        clients.spawn(async move {
            let owner = format!("client-{client}");
            let mut intervals = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let response = lock
                    .acquire_raw(&[("owner", &owner), ("wait", "2s"), ("ttl", "3s")])
                    .await;
                match response.status() {
                    StatusCode::OK => {
                        let grant: Grant = response.json().await.expect("grant body");
                        let granted = Instant::now();
                        tokio::time::sleep(ms(2)).await;
                        let releasing = Instant::now();
                        intervals.push(Interval {
                            fence: grant.fence,
                            count: grant.count,
                            owner: grant.owner.clone(),
                            granted,
                            releasing,
                        });
                        // Until released, or lost with the outage (the lease then expires).
                        let deadline = Instant::now() + Duration::from_secs(10);
                        while Instant::now() < deadline {
                            match lock.release_raw(&grant.token).await.status() {
                                StatusCode::OK | StatusCode::GONE => break,
                                StatusCode::SERVICE_UNAVAILABLE => {
                                    tokio::time::sleep(ms(50)).await;
                                }
                                other => panic!("release answered {other}"),
                            }
                        }
                    }
                    StatusCode::CONFLICT => {}
                    StatusCode::SERVICE_UNAVAILABLE => {
                        outages.fetch_add(1, Ordering::Relaxed);
                        assert_unavailable(response).await;
                        tokio::time::sleep(ms(50)).await;
                    }
                    other => panic!(
                        "acquire answered {other}: {}",
                        response.text().await.unwrap_or_default()
                    ),
                }
            }
            intervals
        });
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let stopper = cluster.clone();
    tokio::task::spawn_blocking(move || stopper.stop_server())
        .await
        .expect("stop the server");
    let stopped = Instant::now();
    for sidecar in [&a, &b] {
        eventually("/readyz to fail", Duration::from_secs(10), async || {
            (readyz_status(sidecar).await == StatusCode::SERVICE_UNAVAILABLE).then_some(())
        })
        .await;
        assert_unavailable(
            sidecar
                .api()
                .lock(&unique_name("down"))
                .acquire_raw(&[])
                .await,
        )
        .await;
    }
    tokio::time::sleep_until((stopped + Duration::from_secs(2)).into()).await;
    let starter = cluster.clone();
    tokio::task::spawn_blocking(move || starter.start_server())
        .await
        .expect("start the server");
    let restarted = Instant::now();

    // Released as soon as `b` can: the waiter on `a` must hear of it, even if
    // the release came before `a` was listening again.
    let released = eventually(
        "the parked lease to be released",
        Duration::from_secs(15),
        async || {
            let response = b.api().lock(&parked).release_raw(&holder.token).await;
            match response.status() {
                StatusCode::OK => Some(Instant::now()),
                StatusCode::SERVICE_UNAVAILABLE => None,
                other => panic!("release of the parked lease answered {other}"),
            }
        },
    )
    .await;
    let grant = parked_waiter
        .expect_acquired_within(Duration::from_secs(10))
        .await;
    let woken_after = released.elapsed();
    assert_eq!(grant.owner, "parked-waiter");
    assert!(
        released.elapsed() < Duration::from_secs(10),
        "the parked waiter was granted only {:?} after the release",
        released.elapsed()
    );
    drop(parked_waiter);

    for sidecar in [&a, &b] {
        eventually("/readyz to pass", Duration::from_secs(15), async || {
            (readyz_status(sidecar).await == StatusCode::OK).then_some(())
        })
        .await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let mut intervals = Vec::new();
    within("the clients to stop", Duration::from_secs(30), async {
        while let Some(done) = clients.join_next().await {
            intervals.extend(done.expect("client task"));
        }
    })
    .await;

    let before = intervals.iter().filter(|i| i.granted < stopped).count();
    let after = intervals.iter().filter(|i| i.granted > restarted).count();
    eprintln!(
        "restart under load: {} grants ({before} before the stop, {after} after the restart), \
         {} answers 503, parked waiter granted {woken_after:?} after the release",
        intervals.len(),
        outages.load(Ordering::Relaxed)
    );
    assert!(
        outages.load(Ordering::Relaxed) > 0,
        "no client saw a 503 while PostgreSQL was down"
    );
    assert!(
        before > 0 && after > 0,
        "grants before the stop: {before}, after the restart: {after}"
    );
    intervals.sort_by_key(|i| i.granted);
    for pair in intervals.windows(2) {
        assert!(
            pair[0].releasing <= pair[1].granted,
            "fence {} was granted while fence {} was still held",
            pair[1].fence,
            pair[0].fence
        );
    }
    // A re-entry keeps its lease's fence; every other grant is a new lease.
    for pair in intervals.windows(2) {
        let re_entry = pair[1].count > 1 && pair[1].owner == pair[0].owner;
        assert!(
            pair[0].fence < pair[1].fence || (re_entry && pair[0].fence == pair[1].fence),
            "fence {} (count {}, {}) after fence {} ({}): fences must strictly increase",
            pair[1].fence,
            pair[1].count,
            pair[1].owner,
            pair[0].fence,
            pair[0].owner
        );
    }
}

/// A sidecar whose database is down at start-up still starts: 503s and a
/// failing `/readyz`, until the database comes and the schema is set up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_started_while_the_database_is_down_serves_once_it_is_up() {
    let cluster = Arc::new(PgCluster::start());
    cluster.stop_server();
    let sidecar = SidecarBuilder::new(&cluster.url("postgres")).start().await;
    assert_eq!(
        readyz_status(&sidecar).await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let lock = sidecar.api().lock(&unique_name("late"));
    assert_unavailable(lock.acquire_raw(&[]).await).await;

    let starter = cluster.clone();
    tokio::task::spawn_blocking(move || starter.start_server())
        .await
        .expect("start the server");
    eventually("/readyz to pass", Duration::from_secs(15), async || {
        (readyz_status(&sidecar).await == StatusCode::OK).then_some(())
    })
    .await;
    let grant = lock.acquire(&[]).await;
    assert_eq!(grant.fence, 1);
}

/// Several sidecars starting at the same moment on an empty database all come
/// up; the schema is created and migrated once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sidecars_starting_at_once_on_an_empty_database_all_come_up() {
    let database = TestDatabase::new().await;
    let url = database.url();
    let (a, b, c, d) = tokio::join!(
        SidecarBuilder::new(&url).start(),
        SidecarBuilder::new(&url).start(),
        SidecarBuilder::new(&url).start(),
        SidecarBuilder::new(&url).start(),
    );
    let sidecars = [a, b, c, d];
    for sidecar in &sidecars {
        assert_eq!(readyz_status(sidecar).await, StatusCode::OK);
    }
    let client = database.client().await;
    assert_eq!(
        migration_versions(&client).await,
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    );
    let registered: i64 = client
        .query_one("SELECT count(*) FROM sidelock.sidecars", &[])
        .await
        .expect("count sidecars")
        .get(0);
    assert_eq!(registered, 4);

    let name = unique_name("shared");
    let grant = sidecars[0].api().lock(&name).acquire(&[]).await;
    for sidecar in &sidecars[1..] {
        sidecar.api().lock(&name).acquire_busy(&[]).await;
    }
    sidecars[3].api().lock(&name).release(&grant.token).await;
}

/// A schema an older sidelock left at version 1 is migrated on start-up:
/// its fences carry on, and the replaced `acquire()` still drops the waiter
/// of a sidecar process that is gone (here one without a `sidecars` row at
/// all), which would otherwise hold the queue and answer busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_schema_is_migrated_and_keeps_its_fences() {
    let database = TestDatabase::new().await;
    let client = database.client().await;
    let version_1 = include_str!("../../src/backend/postgres/0001_init.sql")
        .replace("{s}", "sidelock")
        .replace("{channel}", "'sidelock_wake'");
    let name = unique_name("upgraded");
    client
        .batch_execute(&format!(
            "CREATE SCHEMA sidelock;
             CREATE TABLE sidelock.schema_migrations (
                 version     integer PRIMARY KEY,
                 description text NOT NULL,
                 applied_at  timestamptz NOT NULL DEFAULT now());
             {version_1}
             INSERT INTO sidelock.schema_migrations (version, description) VALUES (1, 'init');
             INSERT INTO sidelock.keys (kind, name, fence) VALUES ('lock', '{name}', 41);
             INSERT INTO sidelock.waiters (kind, name, owner, sidecar, instance, mode, queued_at)
             VALUES ('lock', '{name}', 'ghost', 'gone', 'gone-instance', 'exclusive', now());"
        ))
        .await
        .expect("set up a version 1 schema");

    let sidecar = SidecarBuilder::new(&database.url()).start().await;
    assert_eq!(readyz_status(&sidecar).await, StatusCode::OK);
    assert_eq!(
        migration_versions(&client).await,
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    );

    let lock = sidecar.api().lock(&name);
    let grant = lock.acquire(&[]).await;
    assert_eq!(grant.fence, 42);
    assert!(lock.inspect().await.waiters.is_empty());
    lock.keepalive(&grant.token, &[("ttl", "45s")]).await;
    lock.release(&grant.token).await;
}

/// A waiter whose sidecar dies is listed as orphaned once its heartbeat is
/// overdue, then leaves the queue, and the waiter behind it is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_a_dead_sidecar_are_listed_as_orphaned_then_leave_the_queue() {
    let backend = postgres().await;
    let doomed = backend.start_sidecar().await;
    let survivor = backend.start_sidecar().await;
    let name = unique_name("orphaned");
    let lock = survivor.api().lock(&name);
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    let mut doomed_waiter = doomed
        .api()
        .lock(&name)
        .hold(&[("owner", "doomed"), ("wait", "60s")])
        .await;
    doomed_waiter.expect_queued().await;
    let mut next = lock.hold(&[("owner", "next"), ("wait", "60s")]).await;
    assert_eq!(next.expect_queued().await.position, 2);

    doomed.signal(Signal::SIGKILL);
    let killed = Instant::now();
    drop(doomed_waiter);
    let entry = eventually(
        "the dead sidecar's waiter to be listed as orphaned",
        Duration::from_secs(15),
        async || {
            survivor
                .api()
                .stale()
                .await
                .into_iter()
                .find(|e| e.reason == "orphaned-waiter" && e.key.contains(&name))
        },
    )
    .await;
    assert!(entry.age_ms >= 5_000, "{entry:?}");
    assert_eq!(lock.inspect().await.waiter_owners(), ["doomed", "next"]);

    lock.release(&holder.token).await;
    let grant = next.expect_acquired_within(Duration::from_secs(20)).await;
    assert_eq!(grant.owner, "next");
    assert!(
        killed.elapsed() < Duration::from_secs(20),
        "granted {:?} after the other sidecar died",
        killed.elapsed()
    );
    assert!(lock.inspect().await.waiters.is_empty());
}

/// Backend statements a sidecar sent so far, by its own count (a watch is
/// the LISTEN connection's, no statement).
async fn statements(sidecar: &SidecarGuard) -> u64 {
    let text = sidecar
        .api()
        .get(&["metrics"], &[])
        .await
        .text()
        .await
        .expect("metrics");
    text.lines()
        .filter(|l| l.starts_with("sidelock_backend_operations_total{"))
        .filter(|l| !l.contains("op=\"watch\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Clients that take one lock in turn through two sidecars — each asks
/// again, with `wait`, as soon as it released and another client was
/// granted — cost PostgreSQL about 2 statements (transactions) per handoff:
/// the release, which grants the next waiter in line in the same
/// transaction, and the join of whoever queues next (the session advisory
/// lock recipe needs 2 as well). Before, every sidecar's local head tried
/// after each release: 5 to 7.
#[tokio::test]
async fn a_contended_handoff_costs_postgres_two_statements() {
    let database = TestDatabase::new().await;
    let sidecars = Arc::new([
        SidecarBuilder::new(&database.url()).start().await,
        SidecarBuilder::new(&database.url()).start().await,
    ]);
    let name = Arc::new(unique_name("turns"));
    let granted = Arc::new(tokio::sync::watch::channel(usize::MAX).0);
    let rounds = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for id in 0..8 {
        let (sidecars, name, granted, rounds, stop) = (
            sidecars.clone(),
            name.clone(),
            granted.clone(),
            rounds.clone(),
            stop.clone(),
        );
        tasks.spawn(async move {
            let lock = sidecars[id % 2].api().lock(&name);
            let mut seen = granted.subscribe();
            while !stop.load(Ordering::Relaxed) {
                let grant = lock
                    .acquire(&[("owner", &format!("c{id}")), ("wait", "60s")])
                    .await;
                granted.send_replace(id);
                rounds.fetch_add(1, Ordering::Relaxed);
                lock.release(&grant.token).await;
                let _ = tokio::time::timeout(
                    Duration::from_secs(5),
                    seen.wait_for(|&holder| holder != id),
                )
                .await;
            }
        });
    }
    let count = async || statements(&sidecars[0]).await + statements(&sidecars[1]).await;
    eventually("warm-up", Duration::from_secs(60), async || {
        (rounds.load(Ordering::Relaxed) >= 16).then_some(())
    })
    .await;
    let (start, before) = (rounds.load(Ordering::Relaxed), count().await);
    eventually("200 handoffs", Duration::from_secs(120), async || {
        (rounds.load(Ordering::Relaxed) >= start + 200).then_some(())
    })
    .await;
    let (end, after) = (rounds.load(Ordering::Relaxed), count().await);
    stop.store(true, Ordering::Relaxed);
    let per = (after - before) as f64 / (end - start) as f64;
    assert!(per <= 2.5, "{per:.2} statements per handoff");
    while tasks.join_next().await.is_some() {}
}

/// A lease handed to a waiter whose request went away while the database
/// was down (its sidecar stopped meanwhile, so it could neither hear the
/// handoff nor give it back) is given back once the database is back: the
/// owner's next acquire does not re-enter it unknowingly and hold on after
/// its release. (The give-back's failure was once ignored, and the lock
/// stayed with that owner for as long as it kept acquiring.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_handed_to_a_waiter_that_left_during_an_outage_is_given_back() {
    let (cluster, url) = cluster_with_database().await;
    let a = SidecarBuilder::new(&url).start().await;
    let b = SidecarBuilder::new(&url).start().await;
    let name = unique_name("orphan");
    let holder = b
        .api()
        .lock(&name)
        .acquire(&[("owner", "holder"), ("ttl", "60s")])
        .await;
    let waiter = {
        let lock = a.api().lock(&name);
        tokio::spawn(async move {
            lock.acquire_raw(&[("owner", "x"), ("wait", "60s"), ("ttl", "60s")])
                .await
                .status()
        })
    };
    eventually("the waiter queued", EVENT_TIMEOUT, async || {
        (b.api().lock(&name).inspect().await.waiters.len() == 1).then_some(())
    })
    .await;

    // The release hands the lock to the waiter while its sidecar is stopped;
    // its client goes away and the database goes down before it runs again.
    a.signal(Signal::SIGSTOP);
    b.api().lock(&name).release(&holder.token).await;
    waiter.abort();
    let stopper = cluster.clone();
    tokio::task::spawn_blocking(move || stopper.stop_server())
        .await
        .expect("stop the server");
    a.signal(Signal::SIGCONT);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let starter = cluster.clone();
    tokio::task::spawn_blocking(move || starter.start_server())
        .await
        .expect("start the server");

    // The owner takes the lock again and releases it: then it is free.
    let lock = a.api().lock(&name);
    let grant = eventually(
        "the owner's next acquire",
        Duration::from_secs(20),
        async || {
            let response = lock.acquire_raw(&[("owner", "x"), ("ttl", "60s")]).await;
            match response.status() {
                StatusCode::OK => Some(response.json::<Grant>().await.expect("grant body")),
                _ => None,
            }
        },
    )
    .await;
    eventually("the owner's release", Duration::from_secs(20), async || {
        (lock.release_raw(&grant.token).await.status() == StatusCode::OK).then_some(())
    })
    .await;
    let other = b.api().lock(&name);
    eventually(
        "another owner granted after the owner released",
        Duration::from_secs(15),
        async || {
            let response = other.acquire_raw(&[("owner", "y")]).await;
            (response.status() == StatusCode::OK).then_some(())
        },
    )
    .await;
}

/// A lock held through one sidecar with a waiter queued through another.
struct Queued {
    /// The waiting sidecar's id.
    id: String,
    waiting: SidecarGuard,
    releasing: SidecarGuard,
    name: String,
    holder: common::api::Grant,
    waiter: HoldStream,
}

async fn queue_behind_a_holder(backend: &BackendGuard) -> Queued {
    queue_behind_a_lease_of(backend, "60s").await
}

/// As [`queue_behind_a_holder`], the holder's lease running `ttl`.
async fn queue_behind_a_lease_of(backend: &BackendGuard, ttl: &str) -> Queued {
    let id = unique_name("listener");
    let waiting = backend.sidecar().sidecar_id(&id).start().await;
    let releasing = backend.start_sidecar().await;
    let name = unique_name("queued");
    let holder = releasing
        .api()
        .lock(&name)
        .acquire(&[("owner", "holder"), ("ttl", ttl)])
        .await;
    let mut waiter = waiting
        .api()
        .lock(&name)
        .hold(&[("owner", "waiter"), ("wait", "60s")])
        .await;
    waiter.expect_queued().await;
    Queued {
        id,
        waiting,
        releasing,
        name,
        holder,
        waiter,
    }
}

/// How many LISTEN connections sidecar `id` has open.
async fn listen_connections(client: &tokio_postgres::Client, id: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[&format!("sidelock {id} listen")],
        )
        .await
        .expect("read pg_stat_activity")
        .get(0)
}

/// Ends sidecar `id`'s LISTEN connection's session, waiting until it is gone.
async fn end_listen_connection(client: &tokio_postgres::Client, id: &str) {
    let killed: Vec<bool> = client
        .query(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE application_name = $1",
            &[&format!("sidelock {id} listen")],
        )
        .await
        .expect("terminate the LISTEN connection")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(killed, [true], "exactly one LISTEN connection");
}

/// A release whose NOTIFY is lost because the waiter's sidecar is
/// reconnecting its LISTEN connection still wakes the waiter: every local
/// waiter is woken when the connection is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_missed_while_the_listen_connection_was_down_still_wakes_the_waiter() {
    let backend = postgres().await;
    let Queued {
        id,
        waiting,
        releasing,
        name,
        holder,
        mut waiter,
    } = queue_behind_a_holder(&backend).await;
    let client = schema(&backend).client().await;
    end_listen_connection(&client, &id).await;
    // Before the sidecar has reconnected (it waits 250 ms first).
    releasing.api().lock(&name).release(&holder.token).await;
    let released = Instant::now();

    let grant = waiter.expect_acquired_within(Duration::from_secs(10)).await;
    assert_eq!(grant.owner, "waiter");
    assert!(released.elapsed() < Duration::from_secs(5));
    eventually(
        "the lost LISTEN connection to be logged",
        EVENT_TIMEOUT,
        async || waiting.log().contains("LISTEN connection").then_some(()),
    )
    .await;
}

/// An election's observer hears of a new leader whose announcement came
/// while its sidecar's LISTEN connection was down: on reconnecting, the
/// sidecar woke its local waiters only, and the observer went on naming the
/// leader that had resigned until its own look 30 s later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_hears_of_a_leader_announced_while_the_listen_connection_was_down() {
    let backend = postgres().await;
    let id = unique_name("observing");
    let observing = backend.sidecar().sidecar_id(&id).start().await;
    let campaigning = backend.start_sidecar().await;
    let client = schema(&backend).client().await;
    let leads = |owner: &'static str| {
        move |e: &common::sse::SseEvent| e.event == "leader" && e.json()["owner"] == owner
    };
    // Tried again when the sidecar reconnected before the new leader was
    // announced: the observer then hears the announcement as always.
    for _ in 0..5 {
        let name = unique_name("led");
        let campaign = |owner: &'static str| {
            let api = campaigning.api();
            let name = name.clone();
            async move {
                api.open_stream(
                    &["v1", "elections", &name, "campaign"],
                    &[("owner", owner), ("ttl", "60s")],
                )
                .await
            }
        };
        let mut first = campaign("first").await;
        first
            .wait_for("first leads", EVENT_TIMEOUT, |e| e.event == "leader")
            .await;
        let mut second = campaign("second").await;
        second
            .wait_for("second follows", EVENT_TIMEOUT, |e| e.event == "follower")
            .await;
        let mut observer = observing
            .api()
            .open_stream(&["v1", "elections", &name, "observe"], &[])
            .await;
        observer
            .wait_for("the first leader observed", EVENT_TIMEOUT, leads("first"))
            .await;
        end_listen_connection(&client, &id).await;
        // Before the sidecar has reconnected (it waits 250 ms first).
        drop(first);
        second
            .wait_for("second leads", EVENT_TIMEOUT, |e| e.event == "leader")
            .await;
        if listen_connections(&client, &id).await > 0 {
            continue;
        }
        observer
            .wait_for(
                "the second leader observed",
                Duration::from_secs(5),
                leads("second"),
            )
            .await;
        return;
    }
    panic!("the LISTEN connection was back each time before the new leader was announced");
}

/// Two waiters of one sidecar passed by while its LISTEN connection was
/// down: the release's handoff took the first one's row as a dead
/// sidecar's, and the second one's in the same breath (the instance's
/// advisory lock, taken for the first, is the transaction's own then).
/// Only the local head looks again on reconnecting, so the second waiter's
/// place was gone: it slept until the first one's lease would have
/// expired, while a claim that came later through another sidecar was
/// granted before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_waiter_passed_by_while_the_listen_connection_was_down_keeps_its_turn() {
    let backend = postgres().await;
    let Queued {
        id,
        waiting,
        releasing,
        name,
        holder,
        mut waiter,
    } = queue_behind_a_holder(&backend).await;
    let second = queue_second(&waiting, &name).await;
    let client = schema(&backend).client().await;
    let cut = db_epoch(&client).await;
    end_listen_connection(&client, &id).await;
    // Before the sidecar has reconnected (it waits 250 ms first).
    releasing.api().lock(&name).release(&holder.token).await;
    let first = waiter.expect_acquired_within(Duration::from_secs(10)).await;
    assert_eq!(first.owner, "waiter");
    // The second waiter's row was taken with the first one's and is back,
    // queued again after the cut (before, it did not come back at all).
    let waiters = schema(&backend).table("waiters");
    let requeued = eventually(
        "the second waiter's row back in the queue",
        Duration::from_secs(10),
        async || queued_at(&client, &waiters, &name, "second").await,
    )
    .await;
    assert!(
        requeued > cut,
        "the release passed the second waiter by (its row was queued at {requeued}, the \
         LISTEN connection cut at {cut})"
    );
    let mut later = releasing
        .api()
        .lock(&name)
        .hold(&[("owner", "later"), ("wait", "60s")])
        .await;
    later.expect_queued().await;
    expect_the_second_before_later(waiter, second, later).await;
}

/// The second waiter of the passed-by tests, queued behind the first on
/// the same sidecar.
async fn queue_second(waiting: &SidecarGuard, name: &str) -> HoldStream {
    let mut second = waiting
        .api()
        .lock(name)
        .hold(&[("owner", "second"), ("wait", "60s"), ("ttl", "60s")])
        .await;
    second.expect_queued().await;
    second
}

/// The database's clock, in Unix seconds.
async fn db_epoch(client: &tokio_postgres::Client) -> f64 {
    client
        .query_one("SELECT extract(epoch from clock_timestamp())::float8", &[])
        .await
        .expect("the database clock")
        .get(0)
}

/// When `owner`'s row in the `waiters` table of lock `name` was queued
/// (Unix seconds), if it has one.
async fn queued_at(
    client: &tokio_postgres::Client,
    waiters: &str,
    name: &str,
    owner: &str,
) -> Option<f64> {
    client
        .query(
            &format!(
                "SELECT extract(epoch from queued_at)::float8 FROM {waiters} \
                 WHERE name = $1 AND owner = $2"
            ),
            &[&name, &owner],
        )
        .await
        .expect("a waiter's row")
        .first()
        .map(|r| r.get(0))
}

/// A waiter of `sidecar` on a lock of its own (and that lock's holder):
/// while it waits, its sidecar heartbeats, and so drops the rows of a
/// sidecar that stopped heartbeating.
async fn heartbeating(sidecar: &SidecarGuard) -> (Grant, HoldStream) {
    let other = unique_name("beating");
    let blocking = sidecar.api().lock(&other).acquire(&[("ttl", "60s")]).await;
    let mut beating = sidecar
        .api()
        .lock(&other)
        .hold(&[("owner", "beating"), ("wait", "60s")])
        .await;
    beating.expect_queued().await;
    (blocking, beating)
}

/// Stops `sidecar`'s process (its connections stay up) until `dropped`
/// says another sidecar's heartbeat dropped its rows.
async fn pause_until_dropped(sidecar: &SidecarGuard, dropped: impl AsyncFn() -> bool) {
    sidecar.signal(Signal::SIGSTOP);
    eventually(
        "the paused sidecar's rows dropped",
        Duration::from_secs(30),
        async || dropped().await.then_some(()),
    )
    .await;
}

/// The end both passed-by tests share: once the granted `waiter` leaves,
/// the second waiter is granted at once, and `later` after it.
async fn expect_the_second_before_later(
    waiter: HoldStream,
    mut second: HoldStream,
    mut later: HoldStream,
) {
    drop(waiter);
    let released = Instant::now();
    let grant = second.expect_acquired_within(Duration::from_secs(40)).await;
    assert_eq!(grant.owner, "second", "a claim queued later went first");
    assert!(
        released.elapsed() < Duration::from_secs(5),
        "the second waiter was granted {:?} after the first left",
        released.elapsed()
    );
    drop(second);
    let grant = later.expect_acquired_within(Duration::from_secs(10)).await;
    assert_eq!(grant.owner, "later");
}

/// A sidecar paused past the heartbeat lapse (a stopped process, a frozen
/// VM) keeps its LISTEN connection, so nothing tells it that another
/// sidecar's heartbeat dropped its waiters' rows meanwhile. Once it runs
/// again, every one of its waiters must take its place back at its ticket.
/// Before, only the local head did (woken by the drop's notification, read
/// when the process ran again): the second waiter's row never came back,
/// and a claim queued later through another sidecar went first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_a_sidecar_paused_past_the_heartbeat_lapse_keep_their_turn() {
    let backend = postgres().await;
    let Queued {
        waiting,
        releasing,
        name,
        holder,
        mut waiter,
        ..
    } = queue_behind_a_holder(&backend).await;
    let second = queue_second(&waiting, &name).await;
    let _beating = heartbeating(&releasing).await;

    let client = schema(&backend).client().await;
    let waiters = schema(&backend).table("waiters");
    let row = async |owner: &str| queued_at(&client, &waiters, &name, owner).await;
    pause_until_dropped(&waiting, async || {
        row("waiter").await.is_none() && row("second").await.is_none()
    })
    .await;
    let mut later = releasing
        .api()
        .lock(&name)
        .hold(&[("owner", "later"), ("wait", "60s")])
        .await;
    later.expect_queued().await;
    let resumed = db_epoch(&client).await;
    waiting.signal(Signal::SIGCONT);
    // A release before the sidecar ran again would find no row of it: the
    // head's comes back first (the drop's notification woke it already).
    let back = eventually(
        "the first waiter's row back in the queue",
        Duration::from_secs(10),
        async || row("waiter").await,
    )
    .await;
    assert!(
        back > resumed,
        "queued again at {back}, resumed at {resumed}"
    );

    releasing.api().lock(&name).release(&holder.token).await;
    let first = waiter.expect_acquired_within(Duration::from_secs(10)).await;
    assert_eq!(first.owner, "waiter");
    let requeued = eventually(
        "the second waiter's row back in the queue",
        Duration::from_secs(10),
        async || row("second").await,
    )
    .await;
    assert!(
        requeued > resumed,
        "queued again at {requeued}, resumed at {resumed}"
    );
    expect_the_second_before_later(waiter, second, later).await;
}

/// As above, for a semaphore, where a release hands nothing over but
/// wakes, and a waiter takes a free permit when no row is ahead of its
/// own: every row of the paused sidecar must be back before permits free.
/// Before, only its local head's came back at once (each other one when it
/// headed the sidecar's queue), so two permits freed together went to the
/// head and to a claim queued later through another sidecar, past the
/// second waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_waiters_of_a_paused_sidecar_all_take_their_places_back() {
    let backend = postgres().await;
    let waiting = backend.start_sidecar().await;
    let releasing = backend.start_sidecar().await;
    let name = unique_name("permits");
    let permit = [("limit", "2"), ("ttl", "60s")];
    let holders = [
        releasing.api().semaphore(&name).acquire(&permit).await,
        releasing.api().semaphore(&name).acquire(&permit).await,
    ];
    let mut queued = Vec::new();
    for owner in ["first", "second"] {
        let mut stream = waiting
            .api()
            .semaphore(&name)
            .hold(&[("owner", owner), ("limit", "2"), ("wait", "60s")])
            .await;
        stream.expect_queued().await;
        queued.push(stream);
    }
    let _beating = heartbeating(&releasing).await;

    let client = schema(&backend).client().await;
    let waiters = schema(&backend).table("waiters");
    let row = async |owner: &str| queued_at(&client, &waiters, &name, owner).await;
    pause_until_dropped(&waiting, async || {
        row("first").await.is_none() && row("second").await.is_none()
    })
    .await;
    let mut later = releasing
        .api()
        .semaphore(&name)
        .hold(&[("owner", "later"), ("limit", "2"), ("wait", "60s")])
        .await;
    later.expect_queued().await;
    let resumed = db_epoch(&client).await;
    waiting.signal(Signal::SIGCONT);
    for owner in ["first", "second"] {
        let back = eventually(
            &format!("{owner}'s row back in the queue"),
            Duration::from_secs(10),
            async || row(owner).await,
        )
        .await;
        assert!(
            back > resumed,
            "{owner} queued again at {back}, resumed at {resumed}"
        );
    }
    for holder in &holders {
        releasing
            .api()
            .semaphore(&name)
            .release(&holder.token)
            .await;
    }
    // Held (not dropped) while `later` is watched.
    for stream in &mut queued {
        stream.expect_acquired_within(Duration::from_secs(10)).await;
    }
    let events = later.collect_for(Duration::from_secs(1)).await;
    assert!(
        !events.iter().any(|e| matches!(e, HoldEvent::Acquired(_))),
        "a claim queued later took a permit: {events:?}"
    );
}

/// A LISTEN connection that died on this side while the server still has
/// its session (a dropped network, a hung backend) keeps holding the
/// instance's advisory lock: the sidecar's next LISTEN connection ends that
/// session instead of waiting behind it forever, and hears its handoffs.
/// (Here another session takes the lock as the old connection goes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listen_connection_behind_its_own_zombie_session_takes_over() {
    let backend = postgres().await;
    let Queued {
        id,
        waiting: _waiting,
        releasing,
        name,
        holder,
        mut waiter,
    } = queue_behind_a_holder(&backend).await;
    let client = schema(&backend).client().await;
    let instance = instance_of(&backend, &client, &id).await;
    let zombie = schema(&backend).client().await;
    end_listen_connection(&client, &id).await;
    // Before the sidecar reconnects (it waits 250 ms first).
    zombie
        .execute(
            "SELECT pg_advisory_lock(hashtextextended('sidelock instance ' || $1, 0))",
            &[&instance],
        )
        .await
        .expect("take the instance's advisory lock");
    releasing.api().lock(&name).release(&holder.token).await;
    let released = Instant::now();

    let grant = waiter.expect_acquired_within(Duration::from_secs(15)).await;
    assert_eq!(grant.owner, "waiter");
    assert!(
        released.elapsed() < Duration::from_secs(8),
        "the waiter heard of its handoff {:?} after the release",
        released.elapsed()
    );
    assert!(
        zombie.simple_query("SELECT 1").await.is_err(),
        "the session holding the instance's lock was left running"
    );
}

/// Another sidecar's release that holds the instance's advisory lock for
/// its transaction (`pass_on()` takes it to tell whether the waiter's
/// sidecar is gone) while this sidecar's LISTEN connection comes back is
/// not ended: only an idle session, which a transaction is not, can be an
/// earlier connection of the sidecar's own. The new connection ended it
/// (the release failed), as if it were a zombie.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listen_connection_coming_back_does_not_end_a_release_checking_its_sidecar() {
    let backend = postgres().await;
    let Queued {
        id,
        waiting: _waiting,
        releasing,
        name,
        holder,
        mut waiter,
    } = queue_behind_a_holder(&backend).await;
    let client = schema(&backend).client().await;
    let instance = instance_of(&backend, &client, &id).await;
    let release = schema(&backend).client().await;
    end_listen_connection(&client, &id).await;
    // Before the sidecar reconnects (it waits 250 ms first): a release's
    // transaction, looking whether the waiter's sidecar is alive.
    release.batch_execute("BEGIN").await.expect("begin");
    release
        .execute(
            "SELECT pg_advisory_xact_lock(hashtextextended('sidelock instance ' || $1, 0))",
            &[&instance],
        )
        .await
        .expect("take the instance's advisory lock for the transaction");
    eventually(
        "the sidecar's LISTEN connection to come back",
        EVENT_TIMEOUT,
        async || (listen_connections(&client, &id).await == 1).then_some(()),
    )
    .await;
    // Past its try for the lock (and, before, its ending of the holder).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        release.simple_query("SELECT 1").await.is_ok(),
        "the LISTEN connection ended another session's transaction"
    );
    release.batch_execute("COMMIT").await.expect("commit");
    // The connection takes the lock once the transaction ends, and hears
    // its handoffs.
    releasing.api().lock(&name).release(&holder.token).await;
    let grant = waiter.expect_acquired_within(Duration::from_secs(15)).await;
    assert_eq!(grant.owner, "waiter");
}

/// The instance of sidecar `id`, once its heartbeat wrote it.
async fn instance_of(backend: &BackendGuard, client: &tokio_postgres::Client, id: &str) -> String {
    eventually(
        "the waiting sidecar's heartbeat",
        EVENT_TIMEOUT,
        async || {
            client
                .query_opt(
                    &format!(
                        "SELECT instance FROM {} WHERE sidecar = $1",
                        schema(backend).table("sidecars")
                    ),
                    &[&id],
                )
                .await
                .expect("read sidecars")
                .map(|r| r.get::<_, String>(0))
        },
    )
    .await
}

/// `/v1/stale` on PostgreSQL: holders older than `--stale-after`, expired rows
/// not cleaned yet, waiters whose sidecar stopped heartbeating, and rows of a
/// hand-written lock table (`--legacy-table`) that never expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_lists_every_reason() {
    let backend = postgres().await;
    let schema = schema(&backend);
    let table = schema.table("method_lock");
    let sidecar = backend
        .sidecar()
        .stale_after("300ms")
        .flag("legacy-table", &format!("{}.method_lock", schema.name))
        .start()
        .await;
    let explicit = backend
        .sidecar()
        .flag(
            "legacy-table",
            &format!("{}.method_lock(method_name, update_time)", schema.name),
        )
        .start()
        .await;
    let api = sidecar.api();
    let client = schema.client().await;

    // The textbook lock table: a unique name, no expiry.
    client
        .batch_execute(&format!(
            "CREATE TABLE {table} (
                 id serial PRIMARY KEY,
                 method_name varchar(64) NOT NULL UNIQUE,
                 description varchar(1024),
                 update_time timestamp NOT NULL DEFAULT now());
             INSERT INTO {table} (method_name, update_time)
                 VALUES ('nightly_report', now() - interval '2 hours'),
                        ('forever', 'infinity'), ('since_ever', '-infinity')"
        ))
        .await
        .expect("create the legacy table");

    let held = unique_name("held");
    api.lock(&held).acquire(&[("ttl", "60s")]).await;

    // An expired lease whose key is locked, so no sidecar can clean it yet.
    let expired = unique_name("expired");
    let grant = api.lock(&expired).acquire(&[("ttl", "200ms")]).await;
    let mut locker = schema.client().await;
    let tx = locker.transaction().await.expect("begin");
    tx.execute(
        &format!(
            "SELECT 1 FROM {} WHERE kind = 'lock' AND name = $1 FOR UPDATE",
            schema.table("keys")
        ),
        &[&expired],
    )
    .await
    .expect("lock the key");

    // A waiter of a sidecar that does not exist (or no longer does).
    let orphan = unique_name("orphan");
    client
        .batch_execute(&format!(
            "INSERT INTO {} (kind, name) VALUES ('lock', '{orphan}');
             INSERT INTO {} (kind, name, owner, sidecar, instance, mode, queued_at)
                 VALUES ('lock', '{orphan}', 'ghost', 'gone-sidecar', 'gone-instance',
                         'exclusive', now() - interval '1 minute')",
            schema.table("keys"),
            schema.table("waiters")
        ))
        .await
        .expect("insert an orphaned waiter");

    tokio::time::sleep(ms(400)).await;
    let stale = api.stale().await;
    let find = |reason: &str, needle: &str| {
        stale
            .iter()
            .find(|e| e.reason == reason && e.key.contains(needle))
            .unwrap_or_else(|| panic!("no {reason} entry for {needle}: {stale:#?}"))
    };
    let too_long = find("held-too-long", &held);
    assert!(too_long.age_ms >= 300, "{too_long:?}");
    let not_cleaned = find("expired-not-cleaned", &expired);
    assert!(not_cleaned.age_ms >= 100, "{not_cleaned:?}");
    let orphaned = find("orphaned-waiter", &orphan);
    assert!(orphaned.age_ms >= 60_000, "{orphaned:?}");
    let legacy = find("no-expiry", "nightly_report");
    assert!(legacy.key.contains("method_lock"), "{legacy:?}");
    assert!(
        legacy.age_ms >= 2 * 3_600_000 - 60_000,
        "age from update_time: {legacy:?}"
    );
    // Rows whose time says "always" or "never" are listed without an age
    // (the old scan failed on them, 503).
    for endless in ["forever", "since_ever"] {
        let row = find("no-expiry", endless);
        assert_eq!(row.age_ms, 0, "{row:?}");
    }
    let explicit_stale = explicit.api().stale().await;
    assert!(
        explicit_stale
            .iter()
            .any(|e| e.reason == "no-expiry" && e.key.ends_with("/nightly_report")),
        "{explicit_stale:#?}"
    );

    // Once the key is free, the monitor's housekeeping (every 10 s) cleans
    // the expired row.
    tx.rollback().await.expect("rollback");
    eventually(
        "the expired row to be cleaned",
        Duration::from_secs(25),
        async || {
            let rows: i64 = client
                .query_one(
                    &format!(
                        "SELECT count(*) FROM {} WHERE token = $1",
                        schema.table("leases")
                    ),
                    &[&grant.token],
                )
                .await
                .expect("count leases")
                .get(0);
            (rows == 0).then_some(())
        },
    )
    .await;
    assert!(
        !api.stale()
            .await
            .iter()
            .any(|e| e.reason == "expired-not-cleaned" && e.key.contains(&expired))
    );
    // The orphan is not in anyone's way: it is not listed as a waiter, and
    // the lock is granted at once.
    let orphaned_lock = api.lock(&orphan);
    assert!(orphaned_lock.inspect().await.waiters.is_empty());
    orphaned_lock.acquire(&[]).await;
}

/// One acquire call made directly, as a sidecar makes it, in a transaction
/// of its own: its answer, and how many `waiters` rows (table or index
/// entries) it read.
async fn acquire_counting_reads(
    db: &mut tokio_postgres::Client,
    schema: &TestSchema,
    name: &str,
    mode: &str,
    owner: &str,
) -> (serde_json::Value, i64) {
    let waiters = schema.table("waiters");
    // Rows are counted on the relation that returned them: the table for a
    // sequential scan, the index for an index scan.
    let reads = format!(
        "SELECT sum(pg_stat_get_xact_tuples_returned(c.oid) \
                    + pg_stat_get_xact_tuples_fetched(c.oid))::bigint \
           FROM pg_class c \
          WHERE c.oid = '{waiters}'::regclass \
             OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = '{waiters}'::regclass)"
    );
    let acquire = format!(
        "SELECT \"{}\".acquire('lock', $1, $2, $3, 'test', 'test-instance', $4, 60000, NULL, 0, \
                NULL, 'join', NULL, 10000, true)::text",
        schema.name
    );
    let tx = db.transaction().await.expect("begin");
    let before: i64 = tx.query_one(&reads, &[]).await.expect("reads").get(0);
    let token = format!("{owner}-token");
    let reply: String = tx
        .query_one(&acquire, &[&name, &mode, &owner, &token])
        .await
        .expect("acquire")
        .get(0);
    let after: i64 = tx.query_one(&reads, &[]).await.expect("reads").get(0);
    tx.commit().await.expect("commit");
    (
        serde_json::from_str(&reply).expect("acquire answers JSON"),
        after - before,
    )
}

/// Inserts `n` waiter rows of `instance` on lock `name` in one statement.
async fn insert_waiters(
    db: &tokio_postgres::Client,
    schema: &TestSchema,
    name: &str,
    mode: &str,
    instance: &str,
    n: i64,
) {
    db.execute(
        &format!(
            "INSERT INTO {} (kind, name, owner, sidecar, instance, mode, queued_at) \
             SELECT 'lock', $1, 'w' || i, 'test', $2, $3, now() \
               FROM generate_series(1, $4::bigint) AS i",
            schema.table("waiters")
        ),
        &[&name, &instance, &mode, &n],
    )
    .await
    .expect("insert waiters");
}

/// A join costs the same behind 5,000 waiters as behind none: the acquire
/// that queues one more reads a bounded number of `waiters` rows — behind an
/// exclusive holder, behind readers with a writer waiting (a reader may not
/// overtake it), and while another name's queue belongs to a sidecar that
/// stopped heartbeating. It once counted the whole queue and scanned all of
/// it for waiters of dead sidecars — twice its length per join — so a
/// burst of 10,000 joins on one name kept the database busy long enough
/// that some answered 503. The queue length it answers stays exact.
#[tokio::test]
async fn a_join_reads_a_bounded_part_of_the_queue_however_long_it_is() {
    const AHEAD: i64 = 5_000;
    let backend = postgres().await;
    let sidecar = backend.start_sidecar().await;
    let schema = schema(&backend);
    let mut db = schema.client().await;
    // Live sidecar processes of the test's own, and one that stopped.
    db.execute(
        &format!(
            "INSERT INTO {} VALUES ('test-instance', 'test', now(), now() + interval '1 hour'), \
                                   ('writer-instance', 'test', now(), now() + interval '1 hour'), \
                                   ('lapsed-instance', 'test', now(), now() - interval '1 hour')",
            schema.table("sidecars")
        ),
        &[],
    )
    .await
    .expect("insert sidecars");

    // Behind an exclusive holder.
    let held = unique_name("long-queue");
    let lock = sidecar.api().lock(&held);
    let _holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    insert_waiters(&db, schema, &held, "exclusive", "test-instance", AHEAD).await;
    // Behind readers, a writer first in line.
    let read = unique_name("read-queue");
    let _reader = sidecar
        .api()
        .lock(&read)
        .acquire(&[("owner", "reader"), ("mode", "shared"), ("ttl", "60s")])
        .await;
    insert_waiters(&db, schema, &read, "exclusive", "writer-instance", 1).await;
    insert_waiters(&db, schema, &read, "shared", "test-instance", AHEAD).await;
    // A queue of a sidecar that stopped, on a name nobody touches meanwhile
    // (its key's row lock held, so no heartbeat removes it first).
    let other = unique_name("lapsed-queue");
    let _other_holder = sidecar
        .api()
        .lock(&other)
        .acquire(&[("owner", "holder"), ("ttl", "60s")])
        .await;
    insert_waiters(&db, schema, &other, "exclusive", "lapsed-instance", AHEAD).await;
    let mut locker = schema.client().await;
    let busy_key = locker.transaction().await.expect("begin");
    busy_key
        .execute(
            &format!(
                "SELECT 1 FROM {} WHERE kind = 'lock' AND name = $1 FOR UPDATE",
                schema.table("keys")
            ),
            &[&other],
        )
        .await
        .expect("lock the key");

    // Statistics that show the queues, and eight joins of each kind in one
    // session: after five calls PostgreSQL may switch a function's
    // statements to a generic plan, which must not read the queues either.
    db.batch_execute(&format!("ANALYZE {}", schema.table("waiters")))
        .await
        .expect("analyze");
    let mut joins = Vec::new();
    for (name, mode, ahead) in [(&held, "exclusive", AHEAD), (&read, "shared", AHEAD + 1)] {
        for i in 0..8 {
            let owner = format!("probe-{i}");
            let (reply, reads) = acquire_counting_reads(&mut db, schema, name, mode, &owner).await;
            joins.push((mode, ahead + i, reply, reads));
        }
    }
    // Before any assertion: a failing test must not leave the key locked
    // (dropping the schema would wait for it).
    busy_key.rollback().await.expect("rollback");
    for (mode, ahead, reply, reads) in joins {
        assert_eq!(reply["outcome"], "busy", "{reply}");
        assert_eq!(reply["queue_length"].as_i64(), Some(ahead + 1), "{reply}");
        assert_eq!(reply["position"].as_i64(), Some(ahead + 1), "{reply}");
        assert!(
            reads <= 50,
            "a {mode} join behind {ahead} waiters, with {AHEAD} waiters of a stopped \
             sidecar on another name, read {reads} waiters rows"
        );
    }
    // The sidecar's own view agrees: the next waiter through it is behind all of them.
    let mut next = lock.hold(&[("owner", "next"), ("wait", "60s")]).await;
    assert_eq!(next.expect_queued().await.position, AHEAD as u64 + 9);
}

/// `keys.queued` beside the key's waiter rows counted.
async fn queue_counts(
    db: &tokio_postgres::Client,
    schema: &TestSchema,
    kind: &str,
    name: &str,
) -> (i64, i64) {
    let row = db
        .query_one(
            &format!(
                "SELECT k.queued, (SELECT count(*) FROM {} w WHERE w.kind = k.kind AND w.name = k.name) \
                   FROM {} k WHERE k.kind = $1 AND k.name = $2",
                schema.table("waiters"),
                schema.table("keys")
            ),
            &[&kind, &name],
        )
        .await
        .expect("queue counts");
    (row.get(0), row.get(1))
}

/// The queue length a key keeps (`keys.queued`) stays the number of its
/// waiter rows through every way a waiter comes and goes, with several at
/// once on two sidecars: joins, waiters giving up, releases handing the
/// lock on, a sidecar killed (its waiters removed once it stops
/// heartbeating) and one shut down (its waiters leave with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kept_queue_length_matches_the_queue_through_every_change() {
    let backend = postgres().await;
    let schema = schema(&backend);
    let db = schema.client().await;
    let doomed = backend.start_sidecar().await;
    let mut leaving = backend.start_sidecar().await;
    let survivor = backend.start_sidecar().await;
    let name = unique_name("counted");
    let lock = survivor.api().lock(&name);
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    let assert_counted = async |when: &str| {
        let (kept, counted) = queue_counts(&db, schema, "lock", &name).await;
        assert_eq!(kept, counted, "kept queue length vs waiter rows {when}");
        counted
    };

    // 30 waiters join at once through the three sidecars, 10 each.
    let mut joining = tokio::task::JoinSet::new();
    for i in 0..30 {
        let lock = [&doomed, &leaving, &survivor][i % 3].api().lock(&name);
        joining.spawn(async move {
            let owner = format!("w{i}");
            let mut stream = lock.hold(&[("owner", &owner), ("wait", "60s")]).await;
            stream.expect_queued().await;
            (i, stream)
        });
    }
    let mut streams: Vec<(usize, HoldStream)> = joining.join_all().await;
    assert_eq!(assert_counted("after 30 joins").await, 30);

    // Five of one sidecar's waiters give up at once (it dequeues them).
    streams.retain(|(i, _)| i % 3 != 1 || *i >= 15);
    let expected = 30 - 5;
    eventually("5 waiters to leave", Duration::from_secs(10), async || {
        (queue_counts(&db, schema, "lock", &name).await.1 == expected).then_some(())
    })
    .await;
    assert_counted("after 5 gave up").await;

    // Three handoffs: the release, then each granted waiter's stream
    // closing, hands the lock to the head of the queue.
    lock.release(&holder.token).await;
    let mut previous = "holder".to_owned();
    for round in 0..3 {
        let owner = eventually(
            "the head to be granted",
            Duration::from_secs(10),
            async || {
                let owner = lock.inspect().await.holders.first()?.owner.clone();
                (owner != previous).then_some(owner)
            },
        )
        .await;
        let at = streams
            .iter()
            .position(|(i, _)| format!("w{i}") == owner)
            .expect("the lock went to a waiter of the test");
        let (_, mut stream) = streams.remove(at);
        stream.expect_acquired().await;
        assert_counted(&format!("after handoff {round}")).await;
        drop(stream);
        previous = owner;
    }

    // The last stream's closing hands the lock to the next head: seen
    // first, so that it counts neither among the queue nor among the
    // killed sidecar's waiters (a CI run read the queue after that handoff
    // and counted its waiter as still to go, when it was the killed one's).
    let next_holder = eventually(
        "the next head to be granted",
        Duration::from_secs(10),
        async || {
            let owner = lock.inspect().await.holders.first()?.owner.clone();
            (owner != previous).then_some(owner)
        },
    )
    .await;

    // The killed sidecar's waiters go once it stops heartbeating.
    let doomed_left = streams
        .iter()
        .filter(|(i, _)| i % 3 == 0 && format!("w{i}") != next_holder)
        .count() as i64;
    let before = assert_counted("before the kill").await;
    doomed.signal(Signal::SIGKILL);
    streams.retain(|(i, _)| i % 3 != 0);
    eventually(
        "the killed sidecar's waiters to be removed",
        Duration::from_secs(30),
        async || {
            (queue_counts(&db, schema, "lock", &name).await.1 <= before - doomed_left).then_some(())
        },
    )
    .await;
    assert_counted("after the killed sidecar's waiters went").await;

    // The sidecar shut down takes its waiters with it.
    leaving.signal(Signal::SIGTERM);
    leaving.wait_exit(Duration::from_secs(20)).await;
    streams.retain(|(i, _)| i % 3 != 1);
    let left = assert_counted("after a sidecar shut down").await;
    // The last handoff's stream was closed: one of the rest may hold the lock.
    let holding = lock
        .inspect()
        .await
        .holders
        .first()
        .map(|h| h.owner.clone());
    let waiting = streams
        .iter()
        .filter(|(i, _)| holding.as_deref() != Some(format!("w{i}").as_str()))
        .count();
    assert_eq!(left, waiting as i64, "only the survivor's waiters are left");
    drop(streams);
    eventually("the queue to empty", Duration::from_secs(10), async || {
        (queue_counts(&db, schema, "lock", &name).await.1 == 0).then_some(())
    })
    .await;
    assert_counted("with the queue empty").await;
}

/// The kept queue length stays exact where several waiters are admitted at
/// once, each removing its own row, through two sidecars: a semaphore of 3
/// permits with 12 waiters whose permits are released together, and 10
/// readers queued behind a writer, all let in when the writer leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kept_queue_length_stays_exact_when_many_are_admitted_at_once() {
    let backend = postgres().await;
    let schema = schema(&backend);
    let db = schema.client().await;
    let sidecars = Arc::new([backend.start_sidecar().await, backend.start_sidecar().await]);
    let rows = async |kind: &str, name: &str, when: &str| {
        let (kept, counted) = queue_counts(&db, schema, kind, name).await;
        assert_eq!(kept, counted, "kept queue length vs waiter rows {when}");
        counted
    };
    let queue = async |kind: &'static str,
                       name: &str,
                       waiters: usize,
                       params: Vec<(&'static str, &'static str)>| {
        let mut joining = tokio::task::JoinSet::new();
        for i in 0..waiters {
            let api = sidecars[i % 2].api();
            let resource = if kind == "semaphore" {
                api.semaphore(name)
            } else {
                api.lock(name)
            };
            let params = params.clone();
            joining.spawn(async move {
                let owner = format!("w{i}");
                let mut all = params.clone();
                all.extend([("owner", owner.as_str()), ("wait", "60s")]);
                let mut stream = resource.hold(&all).await;
                stream.expect_queued().await;
                stream
            });
        }
        joining.join_all().await
    };

    // A semaphore: 3 permits held, 12 waiting; the 3 released at once.
    let permits = unique_name("permits");
    let semaphore = sidecars[0].api().semaphore(&permits);
    let mut held = Vec::new();
    for i in 0..3 {
        let owner = format!("p{i}");
        held.push(
            semaphore
                .acquire(&[("limit", "3"), ("owner", &owner)])
                .await,
        );
    }
    let streams = queue("semaphore", &permits, 12, vec![("limit", "3")]).await;
    assert_eq!(rows("semaphore", &permits, "with 12 waiting").await, 12);
    futures::future::join_all(held.iter().map(|g| semaphore.release(&g.token))).await;
    eventually(
        "3 waiters to be admitted",
        Duration::from_secs(10),
        async || (queue_counts(&db, schema, "semaphore", &permits).await.1 == 9).then_some(()),
    )
    .await;
    rows("semaphore", &permits, "after 3 were admitted").await;
    let busy = semaphore
        .acquire_busy(&[("limit", "3"), ("owner", "probe")])
        .await;
    assert_eq!(busy["queue_length"], 9, "{busy}");
    drop(streams);

    // Readers behind a writer, all admitted when it leaves.
    let name = unique_name("readers");
    let lock = sidecars[1].api().lock(&name);
    let reader = lock.acquire(&[("owner", "r0"), ("mode", "shared")]).await;
    let mut writer = lock.hold(&[("owner", "writer"), ("wait", "60s")]).await;
    writer.expect_queued().await;
    let readers = queue("lock", &name, 10, vec![("mode", "shared")]).await;
    assert_eq!(
        rows("lock", &name, "with a writer and 10 readers waiting").await,
        11
    );
    lock.release(&reader.token).await;
    writer.expect_acquired().await;
    assert_eq!(rows("lock", &name, "with the writer in").await, 10);
    drop(writer);
    eventually(
        "the readers to be admitted",
        Duration::from_secs(10),
        async || (queue_counts(&db, schema, "lock", &name).await.1 == 0).then_some(()),
    )
    .await;
    rows("lock", &name, "with every reader in").await;
    assert_eq!(lock.inspect().await.holders.len(), 10);
    drop(readers);
}

/// A database where every statement that renews takes 20 ms (a statement
/// trigger's sleep, as a slow disk or a loaded server would): 200 hold
/// streams (exclusive locks, readers of a shared lock, permits of a
/// semaphore) with a 1.5 s ttl need 400 renewals a second, and one commit per
/// renewal on the two upkeep connections gives 100. Sent one by one, the
/// renewals fell behind and leases lapsed (`lost`); sent together — each
/// statement carries what queued while the last one committed — they keep
/// up with a commit for every several renewals.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renewals_of_many_holds_keep_up_with_a_slow_database() {
    const HOLDS: usize = 200;
    const WINDOW: Duration = Duration::from_secs(6);
    let (cluster, url) = cluster_with_database().await;
    let sidecar = SidecarBuilder::new(&url).start().await;
    let db = cluster.client("sidelock").await;
    db.batch_execute(
        "CREATE FUNCTION public.slowly() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(0.02); RETURN NULL; END $$; \
         CREATE TRIGGER slowly AFTER UPDATE ON sidelock.leases \
         FOR EACH STATEMENT EXECUTE FUNCTION public.slowly();",
    )
    .await
    .expect("slow down renewals");

    // Every kind of lease: exclusive locks, readers of one shared lock,
    // permits of one semaphore of 100.
    let (readers, permits) = (unique_name("readers"), unique_name("permits"));
    let mut opening = tokio::task::JoinSet::new();
    for i in 0..HOLDS {
        let api = sidecar.api();
        let (resource, extra) = match i % 3 {
            0 => (api.lock(&unique_name("renewed")), None),
            1 => (api.lock(&readers), Some(("mode", "shared"))),
            _ => (api.semaphore(&permits), Some(("limit", "100"))),
        };
        opening.spawn(async move {
            let owner = format!("holder-{i}");
            let mut params = vec![("ttl", "1500ms"), ("owner", owner.as_str())];
            params.extend(extra);
            let mut stream = resource.hold(&params).await;
            stream.expect_acquired().await;
            stream
        });
    }
    let mut streams = Vec::with_capacity(HOLDS);
    within("200 holds to be granted", Duration::from_secs(60), async {
        while let Some(stream) = opening.join_next().await {
            streams.push(stream.expect("hold task"));
        }
    })
    .await;

    const COMMITS: &str = "SELECT xact_commit FROM pg_stat_database WHERE datname = 'sidelock'";
    let renewed = async || {
        sidecar
            .api()
            .metric_sum("sidelock_renewals_total", "result=\"ok\"")
            .await
    };
    let (commits_before, renewed_before): (i64, f64) = (
        db.query_one(COMMITS, &[]).await.expect("commits").get(0),
        renewed().await,
    );
    tokio::time::sleep(WINDOW).await;
    let (commits, renewals) = (
        db.query_one(COMMITS, &[])
            .await
            .expect("commits")
            .get::<_, i64>(0)
            - commits_before,
        renewed().await - renewed_before,
    );
    let lost = sidecar.api().metric_sum("sidelock_lost_total", "").await;
    eprintln!("{HOLDS} holds for {WINDOW:?}: {renewals} renewals, {commits} commits, {lost} lost");
    assert_eq!(lost, 0.0, "leases lapsed while their holds were open");
    // Each hold renews every 500 ms: 12 times in the window, at least 10.
    assert!(
        renewals >= (HOLDS * 10) as f64,
        "{renewals} renewals of {HOLDS} holds in {WINDOW:?}"
    );
    assert!(
        (commits as f64) < renewals / 3.0,
        "{commits} commits for {renewals} renewals"
    );
    for stream in &mut streams {
        for event in stream.collect_for(Duration::ZERO).await {
            assert!(
                !matches!(event, HoldEvent::Lost(_)),
                "a hold was told {event:?}"
            );
        }
    }
    drop(streams);
}

/// Opens a transaction on `db` that keeps the row of lease `token` locked
/// (an operator's `SELECT … FOR UPDATE`), until `db` commits.
async fn lock_lease_row(db: &tokio_postgres::Client, token: &str) {
    db.batch_execute(&format!(
        "BEGIN; SELECT 1 FROM sidelock.leases WHERE token = '{token}' FOR UPDATE"
    ))
    .await
    .expect("lock a lease row");
}

/// Lease rows that other transactions keep locked (an operator's open
/// `SELECT … FOR UPDATE`, a long statement) hold up only their own
/// renewals: the statement of renewals never waits for a row lock, and a
/// locked lease is renewed alone, waiting for the lock as renewals always
/// did, on a connection that is not the upkeep's. (With the first version
/// of renewals sent together, the statement waited for the row with every
/// other lease locked behind it, and all 20 holds lapsed; renewed alone on
/// the two upkeep connections, three locked rows took both, and the other
/// holds' renewals waited behind them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_locked_lease_row_holds_up_only_its_own_renewal() {
    const HOLDS: usize = 20;
    const LOCKED: usize = 3;
    let (cluster, url) = cluster_with_database().await;
    let sidecar = SidecarBuilder::new(&url).start().await;
    let mut streams = Vec::with_capacity(HOLDS);
    let mut tokens = Vec::with_capacity(HOLDS);
    for i in 0..HOLDS {
        let lock = sidecar.api().lock(&unique_name("locked-row"));
        let owner = format!("holder-{i}");
        let mut stream = lock.hold(&[("ttl", "3s"), ("owner", &owner)]).await;
        tokens.push(stream.expect_acquired().await.token);
        streams.push(stream);
    }
    // Three rows, in three transactions: more than the upkeep connections.
    let mut lockers = Vec::new();
    for token in &tokens[..LOCKED] {
        let db = cluster.client("sidelock").await;
        lock_lease_row(&db, token).await;
        lockers.push(db);
    }
    // Four seconds: past the locked leases' ttl, four renewals of the rest.
    tokio::time::sleep(Duration::from_secs(4)).await;
    for db in &lockers {
        db.batch_execute("COMMIT").await.expect("unlock");
    }
    for (i, stream) in streams.iter_mut().enumerate().skip(LOCKED) {
        for event in stream.collect_for(Duration::ZERO).await {
            assert!(
                !matches!(event, HoldEvent::Lost(_)),
                "hold {i}, whose row nobody locked, was told {event:?}"
            );
        }
    }
    drop(streams);
}

/// Releases of a lease whose row another transaction keeps locked wait
/// for that row; they took both upkeep connections, and after their time
/// limit (503) the connections went back to the pool with the releases
/// still waiting in the server: every statement of renewals queued behind
/// them, and every hold lapsed while the row stayed locked (10 of 10). A
/// release that finds a row lock taken now waits for it on the main pool
/// (and is answered once the row is free), and a statement past its time
/// limit is cancelled and its connection closed (the releases cut off
/// never run later).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn releases_waiting_for_a_locked_lease_row_cost_no_renewal() {
    const HOLDS: usize = 10;
    let (cluster, url) = cluster_with_database().await;
    let sidecar = SidecarBuilder::new(&url).start().await;
    let mut streams = Vec::with_capacity(HOLDS);
    for i in 0..HOLDS {
        let lock = sidecar.api().lock(&unique_name("renewed"));
        let owner = format!("holder-{i}");
        let mut stream = lock.hold(&[("ttl", "3s"), ("owner", &owner)]).await;
        stream.expect_acquired().await;
        streams.push(stream);
    }
    let locked = sidecar.api().lock(&unique_name("locked-row"));
    let lease = locked.acquire(&[("ttl", "60s")]).await;
    let db = cluster.client("sidelock").await;
    lock_lease_row(&db, &lease.token).await;
    let releases: Vec<_> = (0..3)
        .map(|_| {
            let (locked, token) = (locked.clone(), lease.token.clone());
            tokio::spawn(async move { locked.release_raw(&token).await.status() })
        })
        .collect();
    // Past the releases' time limit, and then past the holds' ttl.
    tokio::time::sleep(Duration::from_secs(9)).await;
    for release in releases {
        let status = release.await.expect("the release's task");
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }
    for (i, stream) in streams.iter_mut().enumerate() {
        for event in stream.collect_for(Duration::ZERO).await {
            assert!(
                !matches!(event, HoldEvent::Lost(_)),
                "hold {i}, whose row nobody locked, was told {event:?}"
            );
        }
    }
    db.batch_execute("COMMIT").await.expect("unlock");

    // A release that waits a moment for the row waits as it always did,
    // on the main pool, and is answered once the row is free.
    lock_lease_row(&db, &lease.token).await;
    let release = {
        let (locked, token) = (locked.clone(), lease.token.clone());
        tokio::spawn(async move { locked.release(&token).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    db.batch_execute("COMMIT").await.expect("unlock");
    let released = release.await.expect("the release's task");
    assert_eq!(released.count, 0);
    drop(streams);
}

/// A release whose client leaves while it waits for a locked lease row (on
/// the main pool, past the upkeep connections' lock wait): its connection
/// went back to the pool with the release still waiting in the server, and
/// the next statement on it queued behind that release — with a pool of
/// one, an acquire of another lock waited for the row too. The statement of
/// a request that goes is cancelled and its connection closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_whose_client_left_holds_up_no_other_statement() {
    let (cluster, url) = cluster_with_database().await;
    let sidecar = SidecarBuilder::new(&format!("{url}?pool_max_size=1"))
        .start()
        .await;
    let locked = sidecar.api().lock(&unique_name("locked-row"));
    let lease = locked.acquire(&[("ttl", "60s")]).await;
    let db = cluster.client("sidelock").await;
    lock_lease_row(&db, &lease.token).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .expect("a client");
    let left = impatient
        .delete(
            locked
                .api()
                .url(&["v1", "locks", locked.name()], &[("token", &lease.token)]),
        )
        .send()
        .await;
    assert!(left.is_err(), "the release waited for the row: {left:?}");
    let started = Instant::now();
    let other = sidecar
        .api()
        .lock(&unique_name("other"))
        .acquire_raw(&[("ttl", "60s")])
        .await;
    assert_eq!(other.status(), StatusCode::OK);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "an acquire of another lock took {:?}",
        started.elapsed()
    );
    db.batch_execute("COMMIT").await.expect("unlock");
}

/// A database of the test's own on the machine's server, a cutting proxy in
/// front of the server, a sidecar through the proxy and one straight on
/// the server.
struct Proxied {
    database: TestDatabase,
    proxy: common::proxy::CuttingProxy,
    through_proxy: SidecarGuard,
    direct: SidecarGuard,
}

impl Proxied {
    async fn start() -> Self {
        let database = TestDatabase::new().await;
        let proxy = common::proxy::CuttingProxy::start(common::postgres::PORT).await;
        let through_proxy =
            SidecarBuilder::new(&common::postgres::url(proxy.port(), &database.name))
                .start()
                .await;
        let direct = SidecarBuilder::new(&database.url()).start().await;
        Self {
            database,
            proxy,
            through_proxy,
            direct,
        }
    }
}

/// A waiter that leaves the queue (its wait ran out) after PostgreSQL
/// handed it the lock unheard, and whose owner meanwhile asked again
/// through another sidecar and re-entered that lease (count 2), gives back
/// its own hold once, also when the answer to that dequeue is lost after
/// the database ran it: the owner keeps its one hold and nobody else gets
/// the lock. Before the fix, the dequeue was sent again in the background
/// (`tell_later`) with the same token. Its second run released the owner's
/// hold too. The lease was deleted under the owner, and another owner got
/// the lock while the first one still held it.
#[tokio::test]
async fn a_dequeue_whose_answer_is_lost_does_not_take_a_re_entered_hold() {
    let p = Proxied::start().await;
    let name = unique_name("leave-lost");
    let owner = unique_name("owner");
    let through = p.through_proxy.api().lock(&name);
    let lock = p.direct.api().lock(&name);
    let (holder, waiter) = lost_answers::queue_behind_a_holder(&through, &lock, &owner, "3s").await;
    let db = p.database.client().await;
    let ticket: String = db
        .query_one(
            "SELECT token FROM sidelock.waiters WHERE name = $1",
            &[&name],
        )
        .await
        .expect("the waiter's row")
        .get(0);
    // Past the waiter's first look.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The proxied sidecar's LISTEN connection goes silent. Its server side
    // still holds the instance's advisory lock, so the release below hands
    // the lock to the waiter's row. The sidecar never hears of it.
    assert_eq!(
        p.proxy.silence(b"pg_try_advisory_lock("),
        1,
        "the LISTEN connection"
    );
    lock.release(&holder.token).await;
    // The owner asks again, straight on the database, and re-enters the
    // lease handed to its waiter.
    let again = lock.acquire(&[("owner", &owner), ("ttl", "60s")]).await;
    assert_eq!(
        (again.token.as_str(), again.count),
        (ticket.as_str(), 2),
        "the owner re-entered the lease handed to its waiter"
    );

    // The waiter's leave is `dequeue(seq, token)`. It releases the handed
    // hold (2 -> 1) and commits. Then its answer is lost.
    p.proxy.cut_after(ticket.as_bytes());
    let left = within("the waiter's answer", Duration::from_secs(10), waiter)
        .await
        .expect("the waiter's task");
    assert_eq!(left.status(), StatusCode::CONFLICT, "the wait ran out");
    assert!(
        !p.proxy.armed(),
        "the waiter's dequeue went through the proxy"
    );
    // Past the background retries (250 ms, then 500 ms, ...).
    tokio::time::sleep(Duration::from_secs(2)).await;
    lost_answers::assert_holds_once(&lock, &owner, &again.token).await;
}

/// A lease given back at the `--max-held` cap whose answer is lost is not
/// released again (see
/// [`lost_answers::a_lease_given_back_at_the_cap_whose_answer_is_lost_is_not_released_again`]).
#[tokio::test]
async fn a_lease_given_back_at_the_cap_whose_answer_is_lost_is_not_released_again() {
    let database = TestDatabase::new().await;
    let proxy = common::proxy::CuttingProxy::start(common::postgres::PORT).await;
    let full = SidecarBuilder::new(&common::postgres::url(proxy.port(), &database.name))
        .flag("max-held", "1")
        .start()
        .await;
    let direct = SidecarBuilder::new(&database.url()).start().await;
    let db = database.client().await;
    lost_answers::a_lease_given_back_at_the_cap_whose_answer_is_lost_is_not_released_again(
        &proxy,
        &full,
        &direct,
        async |name: &str| -> String {
            db.query_one(
                "SELECT token FROM sidelock.waiters WHERE name = $1",
                &[&name],
            )
            .await
            .expect("the waiter's row")
            .get(0)
        },
    )
    .await;
}

/// An acquire whose answer is lost after PostgreSQL committed the grant (a
/// proxy resets the connection under it, as a server stopped between the
/// commit and the answer does) answers 503 — and the lease it made, which
/// nobody holds, is released in the background: another owner gets the
/// lock (a writer, after a lost read lease; the one permit of a semaphore)
/// within seconds, not when that lease's ttl ends. A clean-clone CI run saw
/// the effect under a restart: the unanswered client asked again,
/// re-entered the lease (count 2) and released once per round, holding the
/// lock until the ttl ended.
#[tokio::test]
async fn a_lease_granted_while_its_answer_was_lost_is_released() {
    let p = Proxied::start().await;
    lost_answers::a_lost_grant_is_released(&p.proxy, &p.through_proxy, &p.direct).await;
}

/// The background release of a grant whose answer was lost takes that
/// grant's one hold, once: the owner, who asked again at once and
/// re-entered the lost grant (count 2), keeps its own hold.
#[tokio::test]
async fn a_lost_grant_its_owner_re_entered_is_released_once() {
    let p = Proxied::start().await;
    // Past the background release's rounds (the second one a statement's
    // time limit after the first).
    let rounds = Duration::from_secs(8);
    lost_answers::a_re_entered_lost_grant_is_released_once(
        &p.proxy,
        &p.through_proxy,
        &p.direct,
        rounds,
    )
    .await;
}

/// The background release of a grant whose answer was lost is not sent
/// again when its own answer is lost (it may have run): the owner, who had
/// asked again and re-entered the lost grant (count 2), keeps its one hold.
/// It was sent again after a pause, and its second run took the owner's
/// own hold — the lease was deleted under it and another owner got the
/// lock.
#[tokio::test]
async fn a_lost_grants_release_whose_answer_is_lost_is_not_sent_again() {
    let p = Proxied::start().await;
    lost_answers::a_lost_grants_release_whose_answer_is_lost_is_not_sent_again(
        &p.proxy,
        &p.through_proxy,
        &p.direct,
    )
    .await;
}

/// A join whose answer is lost after PostgreSQL queued it leaves a waiter
/// row nobody waits for; a release that handed the lock to that row before
/// it was removed as nobody's made a lease nobody held, which kept the lock
/// for its ttl (found by review: the background release had looked for a
/// lease only at about 0.25 s and 5.25 s).
///
/// With a ttl shorter than the row can be handed the lock (here 5 s, the
/// lock handed at 6.5 s), the background release had stopped looking at
/// the ttl, and the lease nobody held kept the lock for its whole ttl.
#[rstest::rstest]
#[case::long_ttl("60s", "20s")]
#[case::ttl_shorter_than_the_row_lives("5s", "3s")]
#[tokio::test]
async fn a_lock_handed_to_a_join_whose_answer_was_lost_is_given_back(
    #[case] ttl: &str,
    #[case] within: &str,
) {
    let p = Proxied::start().await;
    lost_answers::a_lock_handed_to_a_join_whose_answer_was_lost_is_given_back(
        &p.proxy,
        &p.through_proxy,
        &p.direct,
        ttl,
        within,
    )
    .await;
}

/// A reader or semaphore waiter woken by a release, whose look loses its
/// connection after PostgreSQL granted it, keeps waiting and is answered
/// that grant, held once. It answered 503 with most of its wait left.
#[tokio::test]
async fn a_waiter_whose_look_loses_its_connection_keeps_waiting_and_holds_once() {
    let p = Proxied::start().await;
    lost_answers::a_waiter_whose_look_loses_its_connection_holds_once(
        &p.proxy,
        &p.through_proxy,
        &p.direct,
    )
    .await;
}

/// A waiter's look that re-entered its owner's lease (a second reader of
/// the same owner, woken once the first was granted) and lost its
/// connection is not run again into a second re-entry: the re-entry
/// removes the waiter's row, a run again put it back and re-entered once
/// more — count 3 for two requests, a hold nobody knew of.
#[tokio::test]
async fn a_re_entry_whose_connection_broke_is_not_made_twice() {
    let mut r = SameOwnerReaders::queue().await;
    r.p.proxy.cut_after(r.second.as_bytes());
    let (answers, state) = r.answers().await;
    assert!(state.waiters.is_empty(), "left in the queue: {state:?}");
    let holders = state.holders;
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert!(
        holders[0].count <= 2,
        "two requests made {} holds ({answers:?})",
        holders[0].count
    );
}

/// A look that never reached the database (its connection reset on the
/// way) is run again and re-enters its owner's lease: its ticket is still
/// queued, so its first run did nothing. The reader answered 503.
#[tokio::test]
async fn a_re_entry_whose_look_was_lost_on_its_way_is_made_by_the_run_again() {
    let mut r = SameOwnerReaders::queue().await;
    r.p.proxy.refuse(r.second.as_bytes(), 1);
    let (answers, state) = r.answers().await;
    assert!(
        !r.p.proxy.refusing(),
        "the second reader's look was refused"
    );
    assert_eq!(answers, [StatusCode::OK, StatusCode::OK], "{state:?}");
    assert!(state.waiters.is_empty(), "left in the queue: {state:?}");
    assert_eq!(state.holders.len(), 1, "{state:?}");
    assert_eq!(state.holders[0].count, 2, "{state:?}");
}

/// Two readers of one owner queued through the proxy behind a writer, on a
/// lock whose writer the test then releases.
struct SameOwnerReaders {
    p: Proxied,
    name: String,
    blocker: common::api::Grant,
    readers: Vec<tokio::task::JoinHandle<reqwest::Response>>,
    /// The token the second reader's looks send (its row's).
    second: String,
}

impl SameOwnerReaders {
    async fn queue() -> Self {
        let p = Proxied::start().await;
        let name = unique_name("re-entry-cut");
        let owner = unique_name("reader");
        let view = p.direct.api().lock(&name);
        let blocker = view.acquire(&[("owner", "writer"), ("ttl", "60s")]).await;
        let mut readers = Vec::new();
        for queued in 1..=2 {
            let lock = p.through_proxy.api().lock(&name);
            let owner = owner.clone();
            readers.push(tokio::spawn(async move {
                lock.acquire_raw(&[
                    ("mode", "shared"),
                    ("owner", &owner),
                    ("wait", "30s"),
                    ("ttl", "60s"),
                ])
                .await
            }));
            eventually("the reader queued", Duration::from_secs(5), async || {
                (view.inspect().await.waiters.len() == queued).then_some(())
            })
            .await;
        }
        let db = p.database.client().await;
        let second: String = db
            .query_one(
                "SELECT token FROM sidelock.waiters WHERE name = $1 ORDER BY seq OFFSET 1",
                &[&name],
            )
            .await
            .expect("the second reader's row")
            .get(0);
        // Past the readers' first looks.
        tokio::time::sleep(Duration::from_millis(300)).await;
        Self {
            p,
            name,
            blocker,
            readers,
            second,
        }
    }

    /// Releases the writer: the readers' answers, and the lock's state.
    async fn answers(&mut self) -> (Vec<StatusCode>, common::api::LockState) {
        let view = self.p.direct.api().lock(&self.name);
        view.release(&self.blocker.token).await;
        let mut answers = Vec::new();
        for reader in std::mem::take(&mut self.readers) {
            let answer = within("a reader's answer", Duration::from_secs(20), reader)
                .await
                .expect("the reader's task");
            answers.push(answer.status());
        }
        assert!(
            !self.p.proxy.armed(),
            "the second reader's look went through the proxy"
        );
        (answers, view.inspect().await)
    }
}

/// The database's clock steps while a sidecar runs (an NTP step on its
/// host): the expiries the sidecar reports must follow at once, and never
/// read later than the moment the database ends the lease. The clock offset
/// was measured only when the LISTEN connection connected: after a step of
/// 5 s forward, a grant and a keepalive reported 5 s more than the database
/// gave, so a client that trusted `expires_at_ms` went on working past its
/// lease into the next holder's (and after a step back, 5 s less).
#[rstest::rstest]
#[case::forward("+5")]
#[case::back("-5")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reported_expiries_follow_a_step_of_the_database_clock(#[case] step: &str) {
    let (cluster, url) = with_database(PgCluster::start_with_steppable_clock()).await;
    let sidecar = SidecarBuilder::new(&url).start().await;
    let waiting = SidecarBuilder::new(&url).start().await;
    let contended = unique_name("handed");
    let holder = sidecar
        .api()
        .lock(&contended)
        .acquire(&[("ttl", "30s")])
        .await;
    let mut waiter = waiting
        .api()
        .lock(&contended)
        .hold(&[("wait", "60s"), ("ttl", "30s")])
        .await;
    waiter.expect_queued().await;
    let early = unique_name("early");
    let kept = sidecar.api().lock(&early).acquire(&[("ttl", "30s")]).await;
    let db = cluster.client("sidelock").await;
    let clock = "SELECT sidelock.ms(clock_timestamp())";
    let before: i64 = db.query_one(clock, &[]).await.expect("clock").get(0);
    cluster.step_clock(step);
    let after: i64 = db.query_one(clock, &[]).await.expect("clock").get(0);
    let stepped: i64 = step.parse::<i64>().expect("a step in seconds") * 1000;
    assert!(
        (after - before - stepped).abs() < 1000,
        "the database clock did not step by {step} s: {before} → {after}"
    );

    // Handed over most likely before the waiting sidecar's next statement
    // (a heartbeat every 2 s): late by the notification's delay at most,
    // and early by a step back (the safe side) until a statement settles it.
    sidecar.api().lock(&contended).release(&holder.token).await;
    let handed = waiter.expect_acquired_within(Duration::from_secs(10)).await;
    let step_back = (-stepped).max(0);
    expect_on_time(
        &db,
        "a handoff",
        &handed.token,
        handed.expires_at_ms,
        (250, 500 + step_back),
    )
    .await;
    let name = unique_name("late");
    let grant = sidecar.api().lock(&name).acquire(&[("ttl", "30s")]).await;
    expect_on_time(&db, "a grant", &grant.token, grant.expires_at_ms, (2, 500)).await;
    let renewed = sidecar.api().lock(&early).keepalive(&kept.token, &[]).await;
    expect_on_time(
        &db,
        "a keepalive",
        &kept.token,
        renewed.expires_at_ms,
        (2, 500),
    )
    .await;
}

/// The database's clock steps forward while a statement waits for a row
/// lock: the statement arrived before the step (its `statement_timestamp()`
/// is on the old clock) and granted after it (the lease's expiry is on the
/// new one). The grant must still not read late: a reading taken on
/// arrival alone settled the offset on the old clock, and the grant
/// reported the step as extra time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_waited_across_a_step_of_the_database_clock_is_on_time() {
    let (cluster, url) = with_database(PgCluster::start_with_steppable_clock()).await;
    let sidecar = SidecarBuilder::new(&url).start().await;
    let name = unique_name("stepped");
    // The key's row exists once the lock was used.
    let first = sidecar.api().lock(&name).acquire(&[("ttl", "30s")]).await;
    sidecar.api().lock(&name).release(&first.token).await;
    let mut blocker = cluster.client("sidelock").await;
    let row_lock = blocker.transaction().await.expect("a transaction");
    row_lock
        .execute(
            "SELECT 1 FROM sidelock.keys WHERE kind = 'lock' AND name = $1 FOR UPDATE",
            &[&name],
        )
        .await
        .expect("lock the key's row");
    let lock = sidecar.api().lock(&name);
    let acquiring = tokio::spawn(async move { lock.acquire(&[("ttl", "30s")]).await });
    // The acquire waits for the row lock (its statement has arrived).
    let db = cluster.client("sidelock").await;
    eventually(
        "the acquire waiting for the row lock",
        Duration::from_secs(10),
        async || {
            let waiting: i64 = db
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND query LIKE '%acquire%'",
                    &[],
                )
                .await
                .expect("pg_stat_activity")
                .get(0);
            (waiting > 0).then_some(())
        },
    )
    .await;
    cluster.step_clock("+5");
    row_lock.rollback().await.expect("release the row lock");
    let grant = acquiring.await.expect("the acquire");
    expect_on_time(&db, "a grant", &grant.token, grant.expires_at_ms, (2, 1000)).await;
}

/// Asserts that `reported`, a lease's expiry as the sidecar told it, is
/// the moment the database ends the lease: no more than `late_ms` later,
/// and no more than `early_ms` earlier (the time the answers took).
async fn expect_on_time(
    db: &tokio_postgres::Client,
    what: &str,
    token: &str,
    reported: u64,
    (late_ms, early_ms): (i64, i64),
) {
    let db_left: i64 = db
        .query_one(
            "SELECT sidelock.ms(expires_at) - sidelock.ms(clock_timestamp()) \
             FROM sidelock.leases WHERE token = $1",
            &[&token],
        )
        .await
        .expect("the lease's row")
        .get(0);
    let now = i64::try_from(now_ms()).expect("now");
    let reported_left = i64::try_from(reported).expect("an expiry") - now;
    assert!(
        reported_left <= db_left + late_ms,
        "{what} reported {reported_left} ms left, the database gives the lease {db_left} ms"
    );
    assert!(
        reported_left >= db_left - early_ms,
        "{what} reported {reported_left} ms left, the database gives the lease {db_left} ms"
    );
}

// Owners and values are any Unicode text. On a database of another
// encoding, one it cannot store (SQLSTATE 22P05) would be taken for an
// outage: 503, the backend marked down, an ERROR logged per request. On
// LATIN1 even the schema's own text cannot be stored. A sidecar refuses such
// a database when it starts, naming the encoding it needs.
#[tokio::test]
async fn a_database_that_is_not_utf8_is_refused_at_start_naming_the_encoding() {
    let cluster = PgCluster::start();
    let admin = cluster.client("postgres").await;
    admin
        .batch_execute(
            "CREATE DATABASE win ENCODING 'WIN1252' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
        )
        .await
        .expect("create a WIN1252 database");
    drop(admin);
    let mut cmd = tokio::process::Command::new(common::sidecar::SIDELOCK_BIN);
    let out = cmd
        .env_remove("SIDELOCK_BACKEND")
        .env("NO_COLOR", "1")
        .args(["serve", "--listen", "127.0.0.1:0", "--backend"])
        .arg(cluster.url("win"))
        .kill_on_drop(true)
        .output();
    let out = common::within("the sidecar to exit", Duration::from_secs(30), out)
        .await
        .expect("run sidelock serve");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("WIN1252") && text.contains("ENCODING 'UTF8'"),
        "{text}"
    );
}

/// A semaphore limit PostgreSQL cannot store (its `permits` column is an
/// `integer`) is refused with 400 `unsupported` naming the largest it can,
/// by acquire and by hold alike, and nothing is taken; the largest is
/// granted and kept exactly. (The old sidecar stored 4294967295 as
/// 2147483647: both limits were then accepted on one semaphore, and
/// inspecting it showed a limit nobody had asked for.)
#[tokio::test]
async fn a_semaphore_limit_above_what_postgres_stores_is_refused() {
    let backend = postgres().await;
    let sidecar = backend.sidecar().start().await;
    let semaphore = sidecar.api().semaphore(&unique_name("wide"));
    for limit in ["2147483648", "4294967295"] {
        let refused = semaphore.acquire_raw(&[("limit", limit)]).await;
        let problem = assert_problem(refused, StatusCode::BAD_REQUEST, "unsupported").await;
        assert!(
            problem["detail"]
                .as_str()
                .unwrap_or_default()
                .contains("2147483647"),
            "{problem}"
        );
        let refused = semaphore.hold_raw(&[("limit", limit)]).await;
        assert_problem(refused, StatusCode::BAD_REQUEST, "unsupported").await;
    }
    assert!(semaphore.inspect().await.holders.is_empty());
    let grant = semaphore.acquire(&[("limit", "2147483647")]).await;
    let state: serde_json::Value = sidecar
        .api()
        .get(&["v1", "semaphores", &grant.name], &[])
        .await
        .json()
        .await
        .expect("inspect");
    assert_eq!(state["limit"], 2_147_483_647_u64, "{state}");
    semaphore.release(&grant.token).await;
}

/// A stale report with more entries than it lists says so, and lists the
/// oldest: 1,001 locks held past `--stale-after` make 1,000 entries and
/// `truncated`, and the one left out is the newest. (The old query cut its
/// rows at 1,000 in name order, so the answer never said it was cut, and
/// kept the first names, not the oldest leases.)
#[tokio::test]
async fn a_cut_stale_report_says_so_and_keeps_the_oldest() {
    let backend = postgres().await;
    let sidecar = backend.sidecar().flag("stale-after", "1s").start().await;
    let api = sidecar.api();
    let prefix = unique_name("many-stale");
    for i in (1..1001).rev() {
        api.lock(&format!("{prefix}-{i:04}"))
            .acquire(&[("ttl", "60s")])
            .await;
    }
    // The newest lease, clearly newer, has the first name.
    tokio::time::sleep(Duration::from_millis(50)).await;
    api.lock(&format!("{prefix}-0000"))
        .acquire(&[("ttl", "60s")])
        .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let report: serde_json::Value = api
        .get(&["v1", "stale"], &[])
        .await
        .json()
        .await
        .expect("the stale report");
    let entries = report["stale"].as_array().expect("stale entries");
    assert_eq!(entries.len(), 1000, "{}", report["truncated"]);
    assert_eq!(report["truncated"], true);
    let newest = format!("{prefix}-0000");
    assert!(
        entries
            .iter()
            .all(|e| !e["key"].as_str().unwrap_or_default().ends_with(&newest)),
        "the newest lease is the one left out"
    );
}

/// A waiter's look whose connection the server ends mid-statement (an
/// administrator's `pg_terminate_backend`, a fast shutdown, a pooler or HA
/// proxy): the server says so with SQLSTATE 57P01 on the statement, which
/// was read as a failed statement, not a lost connection. The waiter got
/// 503 and left the queue; it looks again and keeps waiting, as it does
/// when the connection breaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiters_look_ended_by_the_server_looks_again() {
    let backend = postgres().await;
    // Both sidecars kept to the end: the holder's lease lapses, the
    // waiter's look follows it.
    let Queued {
        id,
        waiting: _waiting,
        releasing: _holding,
        name,
        holder: _,
        mut waiter,
    } = queue_behind_a_lease_of(&backend, "2s").await;
    // The key's row held, so the look at the lease's end waits for it.
    let mut blocker = schema(&backend).client().await;
    let tx = blocker.transaction().await.expect("begin");
    tx.execute(
        &format!(
            "SELECT 1 FROM {} WHERE kind = 'lock' AND name = $1 FOR UPDATE",
            schema(&backend).table("keys")
        ),
        &[&name],
    )
    .await
    .expect("lock the key's row");
    let client = schema(&backend).client().await;
    let app = format!("sidelock {id}");
    eventually(
        "the waiter's look to wait for the row",
        Duration::from_secs(10),
        async || {
            let n: i64 = client
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE application_name = $1 AND wait_event_type = 'Lock'",
                    &[&app],
                )
                .await
                .expect("pg_stat_activity")
                .get(0);
            (n > 0).then_some(())
        },
    )
    .await;
    let _ = client
        .execute(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity \
             WHERE application_name = $1 AND wait_event_type = 'Lock'",
            &[&app],
        )
        .await
        .expect("terminate the look");
    tx.rollback().await.expect("let the row go");
    let grant = waiter.expect_acquired_within(Duration::from_secs(10)).await;
    assert_eq!(grant.owner, "waiter");
}

/// A role without `CREATE` on the database, whose schema an administrator
/// made for it (least privilege): PostgreSQL checks that privilege before
/// it looks at `IF NOT EXISTS`, so the unconditional `CREATE SCHEMA` at
/// start-up refused every start, even on a schema migrated to the latest
/// version. The schema that exists is used as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_create_on_the_database_runs_on_a_schema_made_for_it() {
    let database = TestDatabase::new().await;
    let client = database.client().await;
    let role = format!("{}_app", database.name);
    client
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; CREATE SCHEMA sidelock AUTHORIZATION {role};"
        ))
        .await
        .expect("a role and its schema");
    let url = database.url().replacen("postgres@", &format!("{role}@"), 1);
    assert_ne!(url, database.url(), "the URL names the role");
    for start in ["an empty schema", "a migrated schema"] {
        let sidecar = SidecarBuilder::new(&url).start().await;
        assert_eq!(readyz_status(&sidecar).await, StatusCode::OK, "{start}");
        let lock = sidecar.api().lock(&unique_name("least-privilege"));
        let grant = lock.acquire(&[]).await;
        lock.release(&grant.token).await;
    }
    assert_eq!(
        migration_versions(&client).await,
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    );
    drop(client);
    drop(database);
    common::postgres::psql_machine("postgres", &format!("DROP ROLE IF EXISTS {role}"));
}

/// A waiter that leaves while the database is down is told to the database
/// in the background until it hears, however long the outage: the core
/// gave up after `--max-ttl` (2 s here), and the ticket stayed in the
/// backend's tickets for good — kept alive by a heartbeat every 2 s for
/// the rest of the sidecar's life, one more leak per such outage. Here the
/// outage lasts 5 s; a while after it, the idle sidecar sends no more
/// heartbeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_leaving_during_an_outage_longer_than_max_ttl_is_forgotten() {
    let cluster = Arc::new(PgCluster::start());
    let admin = cluster.client("postgres").await;
    admin
        .batch_execute("CREATE DATABASE sidelock")
        .await
        .expect("create the database");
    drop(admin);
    let sidecar = SidecarBuilder::new(&cluster.url("sidelock"))
        .default_ttl("2s")
        .max_ttl("2s")
        .start()
        .await;
    let lock = sidecar.api().lock(&unique_name("left-in-outage"));
    let _holder = lock.acquire(&[("owner", "holder")]).await;
    let mut waiter = lock.hold(&[("owner", "waiter"), ("wait", "60s")]).await;
    waiter.expect_queued().await;

    let stopper = cluster.clone();
    tokio::task::spawn_blocking(move || stopper.stop_server())
        .await
        .expect("stop the server");
    drop(waiter);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let starter = cluster.clone();
    tokio::task::spawn_blocking(move || starter.start_server())
        .await
        .expect("start the server");
    eventually(
        "the sidecar ready again",
        Duration::from_secs(20),
        async || (readyz_status(&sidecar).await == StatusCode::OK).then_some(()),
    )
    .await;
    // The retry's next turn (every 5 s at most) and the heartbeat after it.
    tokio::time::sleep(Duration::from_secs(8)).await;

    let db = cluster.client("sidelock").await;
    let mut beats = std::collections::BTreeSet::new();
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(7) {
        let at: i64 = db
            .query_one(
                "SELECT (extract(epoch FROM max(heartbeat_at)) * 1000)::bigint \
                 FROM sidelock.sidecars",
                &[],
            )
            .await
            .expect("read the heartbeat")
            .get(0);
        beats.insert(at);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // One heartbeat may be housekeeping's; a ticket kept alive beats every 2 s.
    assert!(
        beats.len() <= 2,
        "{} heartbeats in 7 s from a sidecar nobody waits through",
        beats.len()
    );
}

/// A statement answered while its sidecar was paused (SIGSTOP here; a VM's
/// or a CPU quota's pause in production) past the statement's time limit
/// (5 s) is answered, not timed out: at resume the timer fired before the
/// connection's reader ran, and an acquire the database had granted
/// answered 503. Here an operator's open `SELECT … FOR UPDATE` of the
/// lock's key row holds the acquire until the sidecar is paused.
#[tokio::test]
async fn a_statement_answered_while_its_sidecar_was_paused_is_answered() {
    let backend = postgres().await;
    let schema = schema(&backend);
    let sidecar = backend.start_sidecar().await;
    let name = unique_name("paused-statement");
    let lock = sidecar.api().lock(&name);
    let first = lock.acquire(&[]).await;
    lock.release(&first.token).await;
    let locker = schema.client().await;
    locker
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM {} WHERE kind = 'lock' AND name = '{name}' FOR UPDATE",
            schema.table("keys")
        ))
        .await
        .expect("lock the key row");
    let acquire = lock.spawn_acquire_raw(&[("ttl", "60s")]);
    tokio::time::sleep(ms(500)).await;
    assert!(!acquire.is_finished(), "the acquire waits for the key row");
    sidecar.signal(Signal::SIGSTOP);
    tokio::time::sleep(ms(200)).await;
    locker.batch_execute("COMMIT").await.expect("commit");
    tokio::time::sleep(ms(5_300)).await;
    sidecar.signal(Signal::SIGCONT);
    let answer = acquire.await.expect("the acquire");
    let status = answer.status();
    let body = answer.text().await.unwrap_or_default();
    assert_eq!(status, StatusCode::OK, "{body}");
}

/// Two releases that pass a killed sidecar's waiters by at once both find
/// that sidecar dead. A release asked whether a waiter's sidecar lives by
/// taking its instance's advisory lock for its transaction, exclusively:
/// while one release held it (it passed that sidecar's waiter on another
/// lock by, and had not committed), the other's try failed, read as the
/// sidecar's live session, and it handed its lock to the dead waiter, held
/// by nobody until its ttl (a minute here), the live waiter behind it kept
/// waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_passing_a_killed_sidecars_waiters_by_at_once_both_find_it_dead() {
    let (cluster, url) = cluster_with_database().await;
    let doomed = SidecarBuilder::new(&url).start().await;
    let survivor = SidecarBuilder::new(&url).start().await;
    let (first, second) = (unique_name("dead-first"), unique_name("dead-second"));
    let held = |name: &str| {
        let lock = survivor.api().lock(name);
        async move { lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await }
    };
    let (first_holder, second_holder) = (held(&first).await, held(&second).await);
    let mut dead_waiters = Vec::new();
    for name in [&first, &second] {
        let mut waiter = doomed
            .api()
            .lock(name)
            .hold(&[("owner", "doomed"), ("ttl", "60s"), ("wait", "60s")])
            .await;
        waiter.expect_queued().await;
        dead_waiters.push(waiter);
    }
    let mut next = survivor
        .api()
        .lock(&second)
        .hold(&[("owner", "next"), ("wait", "60s")])
        .await;
    assert_eq!(next.expect_queued().await.position, 2);
    doomed.signal(Signal::SIGKILL);
    drop(dead_waiters);
    let db = cluster.client("sidelock").await;
    eventually(
        "the killed sidecar's session gone",
        Duration::from_secs(10),
        async || {
            let row = db
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted",
                    &[],
                )
                .await
                .expect("advisory locks");
            // The survivor's LISTEN connection's alone.
            (row.get::<_, i64>(0) == 1).then_some(())
        },
    )
    .await;
    // A release of the first lock, in a transaction left open: it passed
    // the dead waiter there by, and keeps what it took to learn that.
    db.batch_execute(&format!(
        "BEGIN; SELECT sidelock.release('lock', '{first}', '{}', 10000)",
        first_holder.token
    ))
    .await
    .expect("the first lock's release");
    survivor
        .api()
        .lock(&second)
        .release(&second_holder.token)
        .await;
    let grant = next.expect_acquired_within(Duration::from_secs(3)).await;
    assert_eq!(grant.owner, "next");
    db.batch_execute("COMMIT").await.expect("commit");
}

/// `n` locks, used once through `sidecar` so that their key rows exist,
/// each with its key row locked by an open transaction of the test's:
/// an acquire on one holds its connection until that transaction ends.
async fn key_rows_locked(
    cluster: &PgCluster,
    sidecar: &SidecarGuard,
    n: usize,
) -> Vec<(String, tokio_postgres::Client)> {
    let mut blockers = Vec::new();
    for _ in 0..n {
        let blocker = unique_name("blocker");
        let grant = sidecar.api().lock(&blocker).acquire(&[]).await;
        sidecar.api().lock(&blocker).release(&grant.token).await;
        let db = cluster.client("sidelock").await;
        db.batch_execute(&format!(
            "BEGIN; SELECT 1 FROM sidelock.keys WHERE kind = 'lock' AND name = '{blocker}' FOR UPDATE"
        ))
        .await
        .expect("lock a key row");
        blockers.push((blocker, db));
    }
    blockers
}

/// A ticket delivered while its sidecar's rejoin (after its LISTEN
/// connection came back) waited for a pooled connection is not put back:
/// the rejoin reads its tickets once it has the connection. It read them
/// before: the row went back with the token its client had been handed,
/// after that lease had expired and another client had held the lock, and
/// the next release handed the same token again — so the first client's
/// keepalive renewed a lease someone else had held in between (200, not
/// 410). Here the sidecar has one pooled connection, and statements on
/// locks whose key rows the test keeps locked hold it in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_ticket_delivered_while_a_rejoin_waited_is_not_put_back() {
    let (cluster, url) = cluster_with_database().await;
    let id = unique_name("rejoining");
    let waiting = SidecarBuilder::new(&format!("{url}?pool_max_size=1"))
        .sidecar_id(&id)
        .start()
        .await;
    let releasing = SidecarBuilder::new(&url).start().await;
    let name = unique_name("handed-twice");
    let lock = releasing.api().lock(&name);
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    let first = waiting.api().lock(&name).spawn_acquire_raw(&[
        ("owner", "first"),
        ("ttl", "1s"),
        ("wait", "60s"),
    ]);
    eventually(
        "the first waiter queued",
        Duration::from_secs(5),
        async || (lock.inspect().await.waiter_owners() == ["first"]).then_some(()),
    )
    .await;
    // Renewed every few hundred ms on the sidecar's upkeep connections:
    // statements that succeed keep its waits for a pooled connection going.
    let mut keeper = waiting
        .api()
        .lock(&unique_name("keeper"))
        .hold(&[("ttl", "1s")])
        .await;
    keeper.expect_acquired().await;
    let blockers = key_rows_locked(&cluster, &releasing, 3).await;
    // Each acquire on a blocked lock holds the one connection until its row
    // is let go; the rejoin's statements queue for it in between.
    let block = |i: usize| waiting.api().lock(&blockers[i].0).spawn_acquire_raw(&[]);
    let _first_blocked = block(0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let admin = cluster.client("sidelock").await;
    end_listen_connection(&admin, &id).await;
    // Reconnected after 250 ms: the rejoin's heartbeat queues.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let _second_blocked = block(1);
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The heartbeat runs, then the second blocker holds the connection and
    // the rejoin's statement queues behind it; a third queues behind that.
    blockers[0]
        .1
        .batch_execute("ROLLBACK")
        .await
        .expect("let go");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _third_blocked = block(2);
    tokio::time::sleep(Duration::from_millis(200)).await;
    lock.release(&holder.token).await;
    let handed = first.await.expect("the first waiter");
    assert_eq!(handed.status(), StatusCode::OK);
    let handed: serde_json::Value = handed.json().await.expect("a grant");
    let token = handed["token"].as_str().expect("a token").to_owned();
    // Its client says nothing more: the lease expires, and another client
    // is granted the lock.
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let second = lock.acquire(&[("owner", "second"), ("ttl", "60s")]).await;
    // The rejoin's statement runs; the third blocker holds the connection.
    blockers[1]
        .1
        .batch_execute("ROLLBACK")
        .await
        .expect("let go");
    tokio::time::sleep(Duration::from_millis(300)).await;
    lock.release(&second.token).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let kept = waiting.api().lock(&name).keepalive_raw(&token, &[]).await;
    assert_eq!(
        kept.status(),
        StatusCode::GONE,
        "the first client's lease, expired while another held the lock, renewed: {:?}",
        lock.inspect().await
    );
    blockers[2]
        .1
        .batch_execute("ROLLBACK")
        .await
        .expect("let go");
    drop(keeper);
}

/// A heartbeat sent through the pool reads the tickets it keeps alive once
/// it has a connection, not before its wait for one. Read before, a waiter
/// that queued while it waited was not among them, and the heartbeat,
/// running more than a ghost's age (10 s) after that waiter's row went in,
/// dropped the row as one whose join's answer was lost (its waiter, woken
/// by the drop, queued again at its ticket: for a moment any release
/// passed it by, and its wait showed as just begun). Here the sidecar has
/// one pooled connection, held in turn by acquires on locks whose key rows
/// the test keeps locked; a join queues behind the first, and the heartbeat
/// a later join sends first (its last heartbeat is old: it had no tickets
/// meanwhile) behind the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_that_queued_while_a_heartbeat_waited_keeps_its_place() {
    let (cluster, url) = cluster_with_database().await;
    let waiting = SidecarBuilder::new(&format!("{url}?pool_max_size=1"))
        .start()
        .await;
    let holding = SidecarBuilder::new(&url).start().await;
    // Renewed every few hundred ms on the sidecar's upkeep connections:
    // statements that succeed keep its waits for a pooled connection going.
    let mut keeper = waiting
        .api()
        .lock(&unique_name("keeper"))
        .hold(&[("ttl", "1s")])
        .await;
    keeper.expect_acquired().await;
    let name = unique_name("queued-meanwhile");
    let lock = holding.api().lock(&name);
    let _held = lock.acquire(&[("owner", "holder"), ("ttl", "60s")]).await;
    // A waiter whose heartbeats keep the sidecar's last one fresh, until
    // it is handed its lock.
    let fresh = unique_name("fresh");
    let fresh_held = holding.api().lock(&fresh).acquire(&[("ttl", "60s")]).await;
    let beating = waiting
        .api()
        .lock(&fresh)
        .spawn_acquire_raw(&[("wait", "60s")]);
    eventually(
        "the beating waiter queued",
        Duration::from_secs(5),
        async || (holding.api().lock(&fresh).inspect().await.waiters.len() == 1).then_some(()),
    )
    .await;
    let blockers = key_rows_locked(&cluster, &holding, 4).await;
    let block = |i: usize| waiting.api().lock(&blockers[i].0).spawn_acquire_raw(&[]);
    let step = Duration::from_millis(150);
    let _blocked = block(0);
    tokio::time::sleep(step).await;
    // Its last heartbeat is fresh: it joins without one, behind the first
    // blocker.
    let first = waiting
        .api()
        .lock(&name)
        .spawn_acquire_raw(&[("owner", "first"), ("wait", "60s")]);
    tokio::time::sleep(step).await;
    let _more_blocked: Vec<_> = (1..4)
        .map(|i| {
            let b = block(i);
            std::thread::sleep(Duration::from_millis(50));
            b
        })
        .collect();
    // The beating waiter is handed its lock: no tickets are left to
    // heartbeat for, and the last heartbeat grows old.
    holding.api().lock(&fresh).release(&fresh_held.token).await;
    let handed = beating.await.expect("the beating waiter");
    assert_eq!(handed.status(), StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(2_600)).await;
    // A second join sends a heartbeat first; it queues behind the blockers.
    let _second = waiting
        .api()
        .lock(&name)
        .spawn_acquire_raw(&[("owner", "second"), ("wait", "60s")]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The first join goes in; then each blocker holds the connection for
    // 4 s (under a statement's 5 s limit), 12 s before the heartbeat runs.
    for (_, db) in &blockers {
        db.batch_execute("ROLLBACK").await.expect("let go");
        tokio::time::sleep(Duration::from_millis(4_000)).await;
    }
    eventually("both waiters queued", Duration::from_secs(5), async || {
        (lock.inspect().await.waiter_owners().len() == 2).then_some(())
    })
    .await;
    let state = lock.inspect().await;
    assert_eq!(state.waiter_owners(), ["first", "second"]);
    // Dropped, its row came back when its waiter looked again (woken by the
    // drop), at its ticket but as a new row: for that moment a release
    // would pass it by, and its wait shows as begun just now.
    let since = |owner: &str| {
        state
            .waiters
            .iter()
            .find(|w| w.owner == owner)
            .map(|w| w.since_ms)
            .expect("queued")
    };
    assert!(
        since("first") + 10_000 < since("second"),
        "the first waiter's row, queued while the heartbeat waited, was dropped and made anew: {state:?}"
    );
    assert!(!first.is_finished(), "the first waiter still waits");
    drop(keeper);
}

/// Expired leases on keys nobody touches again are all removed by the
/// monitor's housekeeping, however many: it goes on while its batches come
/// back full. One batch of 1,000 keys every 10 s (no sidecar heartbeating
/// with waiters) let leases that expire faster, such as per-job locks left
/// to expire, pile up without bound. And no key without waiters is woken
/// on the channel every sidecar listens on: each removal sent a
/// notification, thousands a second once batches follow each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_leases_are_all_tidied_however_many() {
    const LEASES: usize = 2_500;
    let (cluster, url) = cluster_with_database().await;
    let sidecar = SidecarBuilder::new(&url).start().await;
    let (listener, mut connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("a listening connection");
    let prefix = unique_name("left-to-expire");
    // Wake-ups of the test's keys (the monitor announces its own).
    let heard = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (counting, ours) = (heard.clone(), prefix.clone());
    let _listening = tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = futures::StreamExt::next(&mut messages).await {
            if let tokio_postgres::AsyncMessage::Notification(n) = message
                && n.payload().contains(&ours)
            {
                counting.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    listener
        .batch_execute("LISTEN sidelock_wake")
        .await
        .expect("listen");
    let names: Vec<String> = (0..LEASES).map(|i| format!("{prefix}-{i}")).collect();
    for chunk in names.chunks(64) {
        futures::future::join_all(chunk.iter().map(|name| {
            let lock = sidecar.api().lock(name);
            async move { lock.acquire(&[("ttl", "100ms")]).await }
        }))
        .await;
    }
    let db = cluster.client("sidelock").await;
    let expired = async || -> i64 {
        db.query_one(
            "SELECT count(*) FROM sidelock.leases WHERE expires_at <= clock_timestamp()",
            &[],
        )
        .await
        .expect("count expired leases")
        .get(0)
    };
    // The monitor tidies every 10 s: at most two of its batches before.
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(expired().await, 0, "expired leases left");
    let heard = heard.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(heard, 0, "wake-ups of keys nobody waits for");
}
