//! The conformance suite: the HTTP contract of `sidelock serve`, checked
//! black-box against the real binary over real HTTP.
//!
//! Every test runs once per backend listed in the `backends` template
//! (`tests/common/backend.rs`). Tests that can use several sidecars ask
//! `BackendGuard::sidecars`, which gives one sidecar for backends whose
//! sidecars do not share state (memory).

use crate::common;

mod elections;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use reqwest::header::{CONTENT_TYPE, WWW_AUTHENTICATE};
use reqwest::{Method, StatusCode};
use rstest::rstest;
use rstest_reuse::apply;
use serde_json::{Value, json};

use common::api::{Body, Params, expect_json};
use common::sse::{HoldEvent, Renewed};
use common::*;

/// Slack added to lease expiry before checking that a lease is gone, and the
/// upper bound on how late a time-based event (expiry, lock-delay end) may
/// arrive. Generous for a loaded 2-core machine.
const TIMING_SLACK: Duration = Duration::from_millis(1500);

/// Starts the backend and one sidecar with default settings.
async fn setup(backend: TestBackend) -> (BackendGuard, SidecarGuard) {
    let backend = backend.start().await;
    let sidecar = backend.start_sidecar().await;
    (backend, sidecar)
}

/// A second sidecar on `backend` when two sidecars share its state (not
/// the memory backend's, whose tests then use one).
async fn second_sidecar(backend: &BackendGuard) -> Option<SidecarGuard> {
    if backend.backend().two_sidecars_share_state() {
        Some(backend.start_sidecar().await)
    } else {
        None
    }
}

/// The most permits a semaphore may have on `backend`: Redlock refuses more
/// than 1 (a majority quorum cannot bound a counting semaphore; see
/// `refuses_more_permits_than_it_can_bound`), the others take any number.
fn max_permits(backend: TestBackend, wanted: u32) -> u32 {
    if backend == TestBackend::Redlock {
        1
    } else {
        wanted
    }
}

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

fn ms_u64(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn owner_names(prefix: &str, count: usize) -> Vec<String> {
    (1..=count).map(|i| format!("{prefix}-{i}")).collect()
}

fn as_strs(strings: &[String]) -> Vec<&str> {
    strings.iter().map(String::as_str).collect()
}

/// Asserts that every member of `expected` is in `actual` with that value
/// (further members are allowed: responses may grow).
fn assert_members(actual: &Value, expected: Value) {
    let expected = expected
        .as_object()
        .expect("expected members form an object");
    for (key, value) in expected {
        assert_eq!(&actual[key], value, "`{key}` in {actual}");
    }
}

fn assert_strictly_increasing(fences: &[u64], what: &str) {
    for pair in fences.windows(2) {
        assert!(
            pair[0] < pair[1],
            "{what}: fences must strictly increase, got {fences:?}"
        );
    }
}

/// Opens a hold stream for `owner` that must queue; returns it once its
/// `queued` event has arrived, checking the reported position.
async fn queue_hold(lock: &Resource, owner: &str, position: u64) -> HoldStream {
    let mut stream = lock.hold(&[("owner", owner), ("wait", "30s")]).await;
    let queued = stream.expect_queued().await;
    assert_eq!(queued.position, position, "{owner} queued at {queued:?}");
    stream
}

mod mutual_exclusion {
    use super::*;

    const CLIENTS: usize = 64;
    const ROUNDS: usize = 4;
    /// How long each client keeps the lock per round.
    const CRITICAL_SECTION: Duration = Duration::from_millis(1);

    /// One grant as seen by its client.
    struct Interval {
        client: usize,
        fence: u64,
        /// After the grant response arrived.
        granted: Instant,
        /// Before the release request was sent.
        releasing: Instant,
    }

    async fn run_client(lock: Resource, client: usize) -> Vec<Interval> {
        let owner = format!("client-{client}");
        let mut intervals = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            let grant = lock
                .acquire(&[("owner", &owner), ("wait", "30s"), ("ttl", "60s")])
                .await;
            let granted = Instant::now();
            tokio::time::sleep(CRITICAL_SECTION).await;
            let releasing = Instant::now();
            let released = lock.release(&grant.token).await;
            assert_eq!(
                released,
                Released {
                    released: true,
                    count: 0
                }
            );
            intervals.push(Interval {
                client,
                fence: grant.fence,
                granted,
                releasing,
            });
        }
        intervals
    }

    #[apply(backends)]
    #[tokio::test]
    async fn concurrent_clients_never_overlap_and_all_finish(backend: TestBackend) {
        let backend = backend.start().await;
        let sidecars = backend.sidecars(2).await;
        let name = unique_name("contended");

        let mut clients = tokio::task::JoinSet::new();
        for client in 0..CLIENTS {
            let lock = sidecars[client % sidecars.len()].api().lock(&name);
            clients.spawn(run_client(lock, client));
        }
        let mut intervals = Vec::new();
        within(
            "every client to finish its rounds",
            Duration::from_secs(120),
            async {
                while let Some(done) = clients.join_next().await {
                    intervals.extend(done.expect("client task panicked"));
                }
            },
        )
        .await;

        let mut rounds = vec![0; CLIENTS];
        for interval in &intervals {
            rounds[interval.client] += 1;
        }
        assert!(
            rounds.iter().all(|&r| r == ROUNDS),
            "rounds per client: {rounds:?}"
        );

        intervals.sort_by_key(|i| i.granted);
        for pair in intervals.windows(2) {
            let (before, after) = (&pair[0], &pair[1]);
            assert!(
                before.releasing <= after.granted,
                "client {} (fence {}) was granted while client {} (fence {}) still held the lock",
                after.client,
                after.fence,
                before.client,
                before.fence
            );
            assert!(
                before.fence < after.fence,
                "fence {} (client {}) granted after fence {} (client {})",
                after.fence,
                after.client,
                before.fence,
                before.client
            );
        }
    }

    #[apply(backends)]
    #[tokio::test]
    async fn waiters_are_granted_in_arrival_order(backend: TestBackend) {
        const WAITERS: usize = 8;
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("fifo"));
        let first = lock.acquire(&[("owner", "first")]).await;

        let owners = owner_names("waiter", WAITERS);
        let mut streams = Vec::new();
        for (i, owner) in owners.iter().enumerate() {
            let mut stream = lock.hold(&[("owner", owner), ("wait", "30s")]).await;
            let queued = stream.expect_queued().await;
            let expected = i as u64 + 1;
            assert_eq!(
                queued,
                Queued {
                    position: expected,
                    queue_length: expected
                }
            );
            streams.push(stream);
        }
        let state = lock.inspect().await;
        assert_eq!(state.waiter_owners(), as_strs(&owners));
        let positions: Vec<u64> = state.waiters.iter().map(|w| w.position).collect();
        assert_eq!(
            positions.iter().copied().collect::<BTreeSet<_>>(),
            (1..=WAITERS as u64).collect::<BTreeSet<_>>()
        );

        lock.release(&first.token).await;
        for (i, mut stream) in streams.into_iter().enumerate() {
            let grant = stream.expect_acquired().await;
            assert_eq!(grant.owner, owners[i], "grant {i} went to the wrong waiter");
            let state = lock.inspect().await;
            assert_eq!(state.holder_owners(), [owners[i].as_str()]);
            assert_eq!(state.waiter_owners(), as_strs(&owners[i + 1..]));
            // Closing the stream releases the lock to the next waiter.
            drop(stream);
        }
    }
}

mod waiting {
    use super::*;

    /// A lock handed to a waiter whose sidecar is stopped (a paused
    /// process, a frozen VM: its connections stay up, so it still counts
    /// as alive) lapses unheard, and another claim is granted after it.
    /// When the sidecar runs again the waiter must not be answered with
    /// that lapsed lease — a 200 for a lock somebody else holds, with a
    /// lower fence — but wait on, and be granted after the other holder.
    /// (The backends that hand locks over: Redis and PostgreSQL. Redlock
    /// and ZooKeeper wake the waiter, which asks for itself, and keep the
    /// lock for it meanwhile: its claim stays first in line.)
    #[rstest]
    #[case::redis(TestBackend::Redis)]
    #[case::postgres(TestBackend::Postgres)]
    #[tokio::test]
    async fn a_lock_handed_to_a_stopped_sidecar_that_lapsed_is_not_answered(
        #[case] backend: TestBackend,
    ) {
        use nix::sys::signal::Signal;
        let backend = backend.start().await;
        let a = backend.start_sidecar().await;
        let b = backend.start_sidecar().await;
        let name = unique_name("handed-while-stopped");
        let holder = b
            .api()
            .lock(&name)
            .acquire(&[("owner", "holder"), ("ttl", "60s")])
            .await;
        let lock = a.api().lock(&name);
        let waiter = tokio::spawn(async move {
            let answer = lock
                .acquire_raw(&[("owner", "waiter"), ("ttl", "1s"), ("wait", "30s")])
                .await;
            (now_ms(), answer)
        });
        eventually("the waiter queued", Duration::from_secs(5), async || {
            (!b.api().lock(&name).inspect().await.waiters.is_empty()).then_some(())
        })
        .await;
        a.signal(Signal::SIGSTOP);
        b.api().lock(&name).release(&holder.token).await;
        // The handed lease's 1 s and the backends' drift allowance.
        let other = eventually(
            "another claim granted",
            Duration::from_secs(10),
            async || {
                let answer = b
                    .api()
                    .lock(&name)
                    .acquire_raw(&[("owner", "other"), ("ttl", "2s")])
                    .await;
                if answer.status() == StatusCode::OK {
                    return Some(answer.json::<Grant>().await.expect("grant"));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                None
            },
        )
        .await;
        a.signal(Signal::SIGCONT);
        let (answered_at, answer) = waiter.await.expect("waiter");
        assert_eq!(answer.status(), StatusCode::OK);
        let grant: Grant = answer.json().await.expect("grant");
        assert!(
            grant.fence > other.fence && grant.expires_at_ms > answered_at,
            "the waiter was answered a lease with fence {} ending at {} ms, at {answered_at} ms; \
             another claim had been granted fence {} meanwhile",
            grant.fence,
            grant.expires_at_ms,
            other.fence
        );
    }

    /// A waiter queued behind another of its sidecar, which is granted and
    /// then lets its lease lapse (never released), is granted when that
    /// lease ends: it follows the new holder's expiry once it heads the
    /// local queue, not only the holder it queued behind.
    #[apply(backends)]
    #[tokio::test]
    async fn the_next_waiter_is_granted_when_the_lease_handed_before_it_lapses(
        backend: TestBackend,
    ) {
        const TTL: Duration = Duration::from_secs(1);
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("lapse-next"));
        let holder = lock.acquire(&[("owner", "holder"), ("ttl", "30s")]).await;
        let mut queued = Vec::new();
        for (owner, ttl) in [("first", "1s"), ("second", "30s")] {
            let waiter = sidecar.api().lock(lock.name());
            queued.push(tokio::spawn(async move {
                waiter
                    .acquire(&[("owner", owner), ("ttl", ttl), ("wait", "20s")])
                    .await
            }));
            let count = queued.len();
            eventually("the waiter queued", Duration::from_secs(5), async || {
                (lock.inspect().await.waiters.len() == count).then_some(())
            })
            .await;
        }
        lock.release(&holder.token).await;
        let mut queued = queued.into_iter();
        let first = queued.next().expect("first").await.expect("first waiter");
        let lapsing = Instant::now();
        let second = tokio::time::timeout(Duration::from_secs(15), queued.next().expect("second"))
            .await
            .expect("the second waiter granted")
            .expect("second waiter");
        assert!(
            lapsing.elapsed() < TTL + TIMING_SLACK,
            "granted {:?} after a {TTL:?} lease began",
            lapsing.elapsed()
        );
        assert!(second.fence > first.fence);
        lock.release(&second.token).await;
    }

    #[apply(backends)]
    #[tokio::test]
    async fn try_once_on_a_busy_lock_reports_holders_and_queue(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();
        let sidecar_id = api.sidecar_id().await;
        let lock = api.lock(&unique_name("busy"));
        let holder = lock.acquire(&[("owner", "holder")]).await;
        let _waiter = queue_hold(&lock, "waiter", 1).await;

        // No `wait`: the default is to try once.
        let busy = lock.acquire_busy(&[("owner", "other")]).await;
        assert_eq!(busy["queue_length"], 1, "{busy}");
        let holders = busy["holders"].as_array().expect("`holders` array");
        assert_eq!(holders.len(), 1, "{busy}");
        assert_eq!(holders[0]["owner"], "holder", "{busy}");
        assert_eq!(holders[0]["sidecar"], sidecar_id.as_str(), "{busy}");
        assert_eq!(holders[0]["mode"], "exclusive", "{busy}");
        assert!(holders[0]["since_ms"].is_u64(), "{busy}");
        assert!(
            !busy.to_string().contains(&holder.token),
            "a busy answer must not reveal the holder's token: {busy}"
        );

        let busy = lock
            .acquire_busy(&[("owner", "other"), ("wait", "0")])
            .await;
        assert_eq!(busy["queue_length"], 1, "{busy}");
    }

    #[apply(backends)]
    #[tokio::test]
    async fn disconnected_waiters_leave_the_queue(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("dropped-waiters"));
        let holder = lock.acquire(&[("owner", "holder")]).await;

        let post_waiter = tokio::spawn({
            let lock = lock.clone();
            async move {
                lock.acquire_raw(&[("owner", "post-waiter"), ("wait", "30s")])
                    .await
            }
        });
        lock.wait_for_waiters(&["post-waiter"]).await;
        let hold_waiter = queue_hold(&lock, "hold-waiter", 2).await;
        let mut survivor = queue_hold(&lock, "survivor", 3).await;

        post_waiter.abort();
        let aborted = post_waiter.await;
        assert!(
            aborted.as_ref().is_err_and(|e| e.is_cancelled()),
            "the waiting POST finished before it was dropped: {aborted:?}"
        );
        drop(hold_waiter);

        let state = lock.wait_for_waiters(&["survivor"]).await;
        assert_eq!(state.waiters[0].position, 1);
        survivor.expect_position(1).await;

        lock.release(&holder.token).await;
        assert_eq!(survivor.expect_acquired().await.owner, "survivor");
        assert_eq!(lock.inspect().await.holder_owners(), ["survivor"]);
    }

    #[apply(backends)]
    #[tokio::test]
    async fn closing_a_hold_stream_releases_within_100ms(backend: TestBackend) {
        const BOUND: Duration = Duration::from_millis(100);
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("dropped-hold"));
        // The default 30 s ttl: only the disconnect can free the lock in time.
        let mut hold = lock.hold(&[("owner", "stream-holder")]).await;
        let grant = hold.expect_acquired().await;
        assert_eq!(lock.inspect().await.holder_owners(), ["stream-holder"]);

        let dropped = Instant::now();
        drop(hold);
        let freed_after = loop {
            if lock.inspect().await.holders.is_empty() {
                break dropped.elapsed();
            }
            assert!(
                dropped.elapsed() < Duration::from_secs(5),
                "the lock is still held 5 s after its hold stream was closed"
            );
        };
        assert!(
            freed_after <= BOUND,
            "the lock was freed {freed_after:?} after the stream closed (bound {BOUND:?})"
        );
        lock.release_lost(&grant.token).await;
    }

    #[apply(backends)]
    #[tokio::test]
    async fn an_expired_lease_passes_to_the_waiter(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("expiring"));

        let started = Instant::now();
        let expiring = lock
            .acquire(&[("owner", "expiring"), ("ttl", "300ms")])
            .await;
        let next = lock.acquire(&[("owner", "next"), ("wait", "5s")]).await;
        let elapsed = started.elapsed();
        assert!(
            elapsed >= ms(300),
            "the waiter was granted after {elapsed:?}, before the 300ms lease expired"
        );
        assert!(
            elapsed <= ms(300) + TIMING_SLACK,
            "the waiter was granted only {elapsed:?} after a 300ms lease began"
        );
        assert!(next.fence > expiring.fence);

        // The expired token must not touch the new holder's lease.
        lock.release_lost(&expiring.token).await;
        lock.keepalive_lost(&expiring.token).await;
        assert_eq!(lock.inspect().await.holder_owners(), ["next"]);
    }
}

mod leases {
    use super::*;

    #[apply(backends)]
    #[tokio::test]
    async fn keepalive_extends_the_lease(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("kept-alive"));
        let grant = lock.acquire(&[("ttl", "300ms")]).await;
        assert_eq!(grant.ttl_ms, 300);

        // `ttl_ms` is what the lease has left when reported: allow rounding.
        let renewed = lock.keepalive(&grant.token, &[]).await;
        assert!(
            (250..=300).contains(&renewed.ttl_ms),
            "the default is the lease's own ttl: {renewed:?}"
        );
        // A sidecar reads a server's clock to within 5 ms (Redis settles
        // its offset so), and the renewal may come that soon after the grant.
        assert!(
            renewed.expires_at_ms + 5 >= grant.expires_at_ms,
            "{renewed:?} after {grant:?}"
        );

        let extended = lock.keepalive(&grant.token, &[("ttl", "5s")]).await;
        // Slack for the round trips between computing the expiry and reading it.
        let low = 4950 - backend.drift_ms(5000);
        assert!((low..=5000).contains(&extended.ttl_ms), "{extended:?}");
        assert!(extended.expires_at_ms >= grant.expires_at_ms + 4000);

        // Three times the original ttl later the lease is still there.
        tokio::time::sleep(ms(900)).await;
        lock.acquire_busy(&[]).await;
        let released = lock.release(&grant.token).await;
        assert_eq!(
            released,
            Released {
                released: true,
                count: 0
            }
        );
    }

    /// A keepalive asking for less than an open hold stream's ttl (1 s
    /// against 6 s) does not shorten its lease below the hold's ttl: that
    /// stream's client was told it holds the lease while the stream is
    /// open, and its watchdog renews by its own ttl. Nobody else is granted
    /// the lock, and the stream tells of no loss. Before, the lease lapsed a
    /// second after the keepalive, its watchdog asleep until its next
    /// renewal a third of the hold's ttl away — also when another hold
    /// stream of the same lease had come and gone, whose watchdog was the
    /// one a first fix woke.
    #[apply(backends)]
    #[tokio::test]
    async fn a_hold_keeps_a_lease_a_keepalive_shortened(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("shortened-hold"));
        let mut hold = lock.hold(&[("owner", "holder"), ("ttl", "6s")]).await;
        let grant = hold.expect_acquired().await;
        let mut second = lock.hold(&[("owner", "holder"), ("ttl", "6s")]).await;
        assert_eq!(second.expect_acquired().await.count, 2);
        tokio::time::sleep(ms(50)).await;
        drop(second);
        let deadline = Instant::now() + Duration::from_secs(5);
        while lock.inspect().await.holders.first().map(|h| h.count) != Some(1) {
            assert!(
                Instant::now() < deadline,
                "the second hold was not released"
            );
            tokio::time::sleep(ms(20)).await;
        }
        let kept = lock.keepalive(&grant.token, &[("ttl", "1s")]).await;
        assert!(
            kept.ttl_ms > 4000,
            "an open hold's lease was shortened: {kept:?}"
        );

        let other = lock
            .acquire_raw(&[("owner", "other"), ("wait", "2500ms")])
            .await;
        assert_eq!(
            other.status(),
            StatusCode::CONFLICT,
            "another client was granted the lease of an open hold stream after a keepalive \
             asked for less: {}",
            other.text().await.unwrap_or_default()
        );
        while let Ok(Some(event)) = hold.next_within(ms(100)).await {
            assert!(
                matches!(event, HoldEvent::Renewed(_)),
                "the hold should only have renewed its lease, got {event:?}"
            );
        }
        assert_eq!(lock.inspect().await.holder_owners(), ["holder"]);
        drop(hold);
    }

    /// A hold's watchdog renews a lease a re-entry lengthened (60 s over the
    /// hold's 1.5 s) to no less than the re-entry gave it: the re-entry's
    /// client, which was told its lease runs 60 s, still holds it after the
    /// stream closes and the hold's own ttl has passed. The old watchdog
    /// renewed to the hold's ttl, cutting the lease to 1.5 s, and another
    /// client was granted it while the re-entry's client still held it.
    #[apply(backends)]
    #[tokio::test]
    async fn a_hold_never_shortens_a_lease_a_reentry_lengthened(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("lengthened-hold"));
        let mut hold = lock.hold(&[("owner", "w"), ("ttl", "1500ms")]).await;
        let grant = hold.expect_acquired().await;
        let again = lock.acquire(&[("owner", "w"), ("ttl", "60s")]).await;
        assert_eq!((again.count, &again.token), (2, &grant.token));
        match hold.next_within(ms(2000)).await {
            Ok(Some(HoldEvent::Renewed(r))) => assert!(
                r.expires_at_ms + 2000 >= again.expires_at_ms,
                "the watchdog cut the lease to {r:?} after a re-entry gave it until {}",
                again.expires_at_ms
            ),
            other => panic!("expected the watchdog's renewal, got {other:?}"),
        }
        drop(hold);
        tokio::time::sleep(ms(2500)).await;
        lock.acquire_busy(&[("owner", "other")]).await;
        lock.keepalive(&again.token, &[]).await;
        lock.release(&again.token).await;
    }

    /// As [`a_hold_never_shortens_a_lease_a_reentry_lengthened`], with the
    /// re-entry through another sidecar, which the hold's watchdog does not
    /// know of: a renewal never shortens a lease. The watchdog renewed to
    /// its hold's 1.5 s, cutting the 60 s the re-entry's client was told;
    /// once the stream closed, the lease lapsed and another client was
    /// granted the lock while the re-entry's client still held it.
    #[apply(shared_backends)]
    #[tokio::test]
    async fn a_hold_never_shortens_a_lease_a_reentry_through_another_sidecar_lengthened(
        backend: TestBackend,
    ) {
        let guard = backend.start().await;
        let sidecars = guard.sidecars(2).await;
        let name = unique_name("lengthened-elsewhere");
        let (here, there) = (sidecars[0].api().lock(&name), sidecars[1].api().lock(&name));
        let mut hold = here.hold(&[("owner", "w"), ("ttl", "1500ms")]).await;
        let grant = hold.expect_acquired().await;
        let again = there.acquire(&[("owner", "w"), ("ttl", "60s")]).await;
        assert_eq!((again.count, &again.token), (2, &grant.token));
        match hold.next_within(ms(2000)).await {
            Ok(Some(HoldEvent::Renewed(_))) => {}
            other => panic!("expected the watchdog's renewal, got {other:?}"),
        }
        drop(hold);
        tokio::time::sleep(ms(2500)).await;
        there.acquire_busy(&[("owner", "other")]).await;
        there.keepalive(&again.token, &[]).await;
        there.release(&again.token).await;
    }

    /// As [`a_hold_never_shortens_a_lease_a_reentry_through_another_sidecar_lengthened`],
    /// for a shared lock's reader (lengthened by a re-entry) and a
    /// semaphore's permit (which never re-enters: lengthened by a keepalive
    /// asking 60 s), whose renewals take the shared and counting paths of
    /// every backend: the hold's watchdog through one sidecar must not cut
    /// the 60 s the other sidecar gave the lease, so a writer (or another
    /// permit of a one-permit semaphore) is still refused once the stream
    /// closed (or, for the permit, which one release would free, once the
    /// stream's sidecar died).
    #[apply(shared_backends)]
    #[tokio::test]
    async fn a_shared_hold_never_shortens_a_lease_lengthened_through_another_sidecar(
        backend: TestBackend,
    ) {
        let guard = backend.start().await;
        let sidecars = guard.sidecars(2).await;
        let name = unique_name("shared-lengthened-elsewhere");
        let (here, there) = (sidecars[0].api().lock(&name), sidecars[1].api().lock(&name));
        let reader = [("mode", "shared"), ("owner", "w")];
        let mut hold = here.hold(&[reader[0], reader[1], ("ttl", "1500ms")]).await;
        let grant = hold.expect_acquired().await;
        let again = there.acquire(&[reader[0], reader[1], ("ttl", "60s")]).await;
        assert_eq!((again.count, &again.token), (2, &grant.token));
        let writer = [("owner", "writer")];
        never_shortened_elsewhere(hold, &there, &grant.token, &writer).await;

        let name = unique_name("permit-lengthened-elsewhere");
        let (here, there) = (
            sidecars[0].api().semaphore(&name),
            sidecars[1].api().semaphore(&name),
        );
        let mut hold = here
            .hold(&[("limit", "1"), ("owner", "w"), ("ttl", "1500ms")])
            .await;
        let grant = hold.expect_acquired().await;
        there.keepalive(&grant.token, &[("ttl", "60s")]).await;
        match hold.next_within(ms(2000)).await {
            Ok(Some(HoldEvent::Renewed(_))) => {}
            other => panic!("expected the watchdog's renewal, got {other:?}"),
        }
        // The permit is held once: closing the stream would release it, so
        // the hold's sidecar dies instead, leaving the lease to its end.
        sidecars[0].signal(nix::sys::signal::Signal::SIGKILL);
        tokio::time::sleep(ms(2500)).await;
        there
            .acquire_busy(&[("limit", "1"), ("owner", "other")])
            .await;
        there.keepalive(&grant.token, &[]).await;
        there.release(&grant.token).await;
        drop(hold);
    }

    /// Lets `hold`'s watchdog (1.5 s ttl) renew once and closes the stream;
    /// 2.5 s later the lease `token`, lengthened to 60 s through `there`,
    /// must still be alive and the `rival` refused.
    async fn never_shortened_elsewhere(
        mut hold: HoldStream,
        there: &Resource,
        token: &str,
        rival: Params<'_>,
    ) {
        match hold.next_within(ms(2000)).await {
            Ok(Some(HoldEvent::Renewed(_))) => {}
            other => panic!("expected the watchdog's renewal, got {other:?}"),
        }
        drop(hold);
        tokio::time::sleep(ms(2500)).await;
        there.acquire_busy(rival).await;
        there.keepalive(token, &[]).await;
        there.release(token).await;
    }

    #[apply(backends)]
    #[tokio::test]
    async fn keepalive_and_release_after_expiry_are_lease_lost(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("expired"));
        let grant = lock.acquire(&[("ttl", "200ms")]).await;
        tokio::time::sleep(ms(200) + TIMING_SLACK / 3).await;

        lock.keepalive_lost(&grant.token).await;
        lock.release_lost(&grant.token).await;
        assert!(lock.inspect().await.holders.is_empty());
    }

    /// A release whose answer was lost is sent again: with the same
    /// `Idempotency-Key` it answers what the first answered, and releases
    /// nothing more — also when both are under way at once. (Sent again,
    /// a release of one of two holds let the lock go, and a last hold's
    /// release answered 410 as if the lease had been lost.)
    #[apply(backends)]
    #[tokio::test]
    async fn a_release_sent_again_with_its_idempotency_key_releases_once(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("once"));
        let grant = lock.acquire(&[("owner", "o"), ("ttl", "60s")]).await;
        assert_eq!(lock.acquire(&[("owner", "o")]).await.count, 2);

        let one = Released {
            released: false,
            count: 1,
        };
        assert_eq!(lock.release_with_key(&grant.token, "first").await, one);
        assert_eq!(lock.release_with_key(&grant.token, "first").await, one);
        assert_eq!(lock.inspect().await.holders[0].count, 1);

        let (a, b) = tokio::join!(
            lock.release_with_key(&grant.token, "second"),
            lock.release_with_key(&grant.token, "second"),
        );
        let none = Released {
            released: true,
            count: 0,
        };
        assert_eq!((a, b), (none, none));
        assert_eq!(lock.release_with_key(&grant.token, "second").await, none);
        assert!(lock.inspect().await.holders.is_empty());
        // Another key is another release: the lease is gone.
        assert_problem(
            lock.release_with_key_raw(&grant.token, "third").await,
            StatusCode::GONE,
            "lease-lost",
        )
        .await;
        lock.release_lost(&grant.token).await;
    }

    /// A semaphore permit's release sent again with its `Idempotency-Key`
    /// answers the first release's answer and frees no other permit; the
    /// same token and key under the lock of that name is another request
    /// (410: the answer is kept per kind and name).
    #[apply(backends)]
    #[tokio::test]
    async fn a_permits_release_sent_again_with_its_key_frees_one_permit(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let name = unique_name("permit-once");
        let sem = sidecar.api().semaphore(&name);
        let limit = max_permits(backend, 2).to_string();
        let limit = [("limit", limit.as_str())];
        let take = |owner: &'static str| [&[("owner", owner), ("ttl", "60s")][..], &limit].concat();
        let first = sem.acquire(&take("p1")).await;
        let gone = Released {
            released: true,
            count: 0,
        };
        for _ in 0..3 {
            assert_eq!(sem.release_with_key(&first.token, "k").await, gone);
        }
        let second = sem.acquire(&take("p2")).await;
        if limit[0].1 == "2" {
            let third = sem.acquire(&take("p3")).await;
            sem.acquire_busy(&take("p4")).await;
            assert_eq!(sem.release_with_key(&first.token, "k").await, gone);
            assert_eq!(
                sem.inspect().await.holder_owners().len(),
                2,
                "a replayed release freed another permit"
            );
            sem.release(&third.token).await;
        } else {
            assert_eq!(sem.release_with_key(&first.token, "k").await, gone);
            assert_eq!(sem.inspect().await.holder_owners(), ["p2"]);
        }
        assert_problem(
            sidecar
                .api()
                .lock(&name)
                .release_with_key_raw(&first.token, "k")
                .await,
            StatusCode::GONE,
            "lease-lost",
        )
        .await;
        sem.release(&second.token).await;
    }

    #[apply(backends)]
    #[tokio::test]
    async fn a_wrong_token_is_lease_lost_and_changes_nothing(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();
        let lock = api.lock(&unique_name("guarded"));
        let other = api.lock(&unique_name("other"));
        let grant = lock.acquire(&[("owner", "holder")]).await;
        let other_grant = other.acquire(&[]).await;

        lock.release_lost("not-a-token").await;
        lock.release_lost(&other_grant.token).await;
        lock.keepalive_lost("not-a-token").await;
        lock.keepalive_lost(&other_grant.token).await;

        assert_eq!(lock.inspect().await.holder_owners(), ["holder"]);
        assert!(lock.release(&grant.token).await.released);
    }

    #[apply(backends)]
    #[tokio::test]
    async fn tokens_are_long_and_distinct(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();
        let mut tokens = BTreeSet::new();
        for _ in 0..20 {
            let grant = api.lock(&unique_name("token")).acquire(&[]).await;
            // 128 random bits need at least 22 characters (base64) to write down.
            assert!(grant.token.len() >= 22, "short token {:?}", grant.token);
            assert!(tokens.insert(grant.token), "a token was handed out twice");
        }
    }
}

mod hold {
    use super::*;

    #[apply(backends)]
    #[tokio::test]
    async fn a_waiting_hold_is_queued_then_acquired(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("hold"));
        let holder = lock.acquire(&[("owner", "holder")]).await;

        let mut stream = lock
            .hold(&[("owner", "streamer"), ("wait", "30s"), ("ttl", "5s")])
            .await;
        assert_eq!(
            stream.expect_queued().await,
            Queued {
                position: 1,
                queue_length: 1
            }
        );
        lock.release(&holder.token).await;

        let grant = stream.expect_acquired().await;
        assert_eq!(grant.name, lock.name());
        assert_eq!(grant.kind, "lock");
        assert_eq!(grant.owner, "streamer");
        assert_eq!(grant.mode.as_deref(), Some("exclusive"));
        assert_eq!(grant.count, 1);
        assert_eq!(grant.ttl_ms, 5000);
        assert!(grant.fence > holder.fence);
        assert!(!grant.token.is_empty());
        assert_eq!(lock.inspect().await.holder_owners(), ["streamer"]);
    }

    #[apply(backends)]
    #[tokio::test]
    async fn the_watchdog_renews_while_the_stream_is_open(backend: TestBackend) {
        const WINDOW: Duration = Duration::from_millis(1200);
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("watched"));
        let mut stream = lock.hold(&[("owner", "watched"), ("ttl", "300ms")]).await;
        let grant = stream.expect_acquired().await;
        assert_eq!(grant.ttl_ms, 300);

        let renewals: Vec<Renewed> = stream
            .collect_for(WINDOW)
            .await
            .into_iter()
            .map(|event| match event {
                HoldEvent::Renewed(renewed) => renewed,
                other => panic!("unexpected {other:?} while holding"),
            })
            .collect();
        // Every ttl/3 = 100 ms: about 12 in the window; at most every ttl/3.
        assert!(
            (3..=14).contains(&renewals.len()),
            "{} renewals in {WINDOW:?} with a 300ms ttl: {renewals:?}",
            renewals.len()
        );
        for pair in renewals.windows(2) {
            assert!(
                pair[0].expires_at_ms <= pair[1].expires_at_ms,
                "{renewals:?}"
            );
        }
        // `ttl_ms` is what is left of the lease when reported (may round
        // down): never more than the ttl, and at least a third of it left
        // (a loaded CI run reported one 114 ms after its renewal: 186).
        assert!(
            renewals
                .iter()
                .all(|r| r.ttl_ms.is_some_and(|ttl| (100..=300).contains(&ttl))),
            "{renewals:?}"
        );
        assert!(renewals[renewals.len() - 1].expires_at_ms > grant.expires_at_ms);

        // Four ttls after the grant the lease is still the same one.
        let state = lock.inspect().await;
        assert_eq!(state.holder_owners(), ["watched"]);
        assert_eq!(state.holders[0].fence, grant.fence);
        lock.acquire_busy(&[]).await;
    }

    /// A hold that re-enters a plain lease renews it at its ttl's pace, and
    /// the plain lease's ttl may be far below the 100 ms a hold may ask for:
    /// a 60 ms lease was renewed every 20 ms for as long as the stream
    /// stayed open (a 1 ms one, every millisecond). It is renewed at a
    /// 100 ms lease's pace (every 33 ms) at most.
    #[apply(backends)]
    #[tokio::test]
    async fn a_hold_reentering_a_short_plain_lease_renews_no_faster_than_a_100ms_hold(
        backend: TestBackend,
    ) {
        const WINDOW: Duration = Duration::from_secs(2);
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();
        let lock = api.lock(&unique_name("short-reentered"));
        let mut tries = 0;
        // The hold must re-enter within the plain lease's 60 ms. One that
        // comes as the lease ends may find it neither surely alive (to
        // re-enter) nor surely gone (to take anew): busy, tried again.
        let hold = loop {
            tries += 1;
            let grant = lock.acquire(&[("owner", "o"), ("ttl", "60ms")]).await;
            let mut hold = lock.hold(&[("owner", "o"), ("ttl", "10s")]).await;
            match hold.next_within(Duration::from_secs(10)).await {
                Ok(Some(HoldEvent::Acquired(g))) if g.token == grant.token => break hold,
                Ok(Some(HoldEvent::Acquired(_) | HoldEvent::Timeout(_))) => {}
                other => panic!("the hold's first event: {other:?}"),
            }
            assert!(tries < 5, "the hold never came within the lease's 60 ms");
        };
        let before = api.metric_sum("sidelock_renewals_total", "").await;
        tokio::time::sleep(WINDOW).await;
        let renewed = api.metric_sum("sidelock_renewals_total", "").await - before;
        // 60 at a 100 ms lease's pace; 100 at the 60 ms lease's own.
        assert!(
            renewed <= 80.0,
            "{renewed} renewals in {WINDOW:?} of one hold"
        );
        drop(hold);
    }

    /// `--default-ttl` may be below the 100 ms a hold or campaign may ask
    /// for (a plain lease may be that short). A hold or campaign that asks
    /// for no ttl was refused for the ttl it never sent; it gets 100 ms.
    #[apply(backends)]
    #[tokio::test]
    async fn a_hold_or_campaign_without_a_ttl_gets_100ms_under_a_shorter_default(
        backend: TestBackend,
    ) {
        let limit = max_permits(backend, 2).to_string();
        let backend = backend.start().await;
        let sidecar = backend.sidecar().default_ttl("20ms").start().await;
        let api = sidecar.api();
        // Every kind of hold: exclusive, shared, a semaphore's permit.
        let held: [(common::api::Resource, Params<'_>); 3] = [
            (
                api.lock(&unique_name("short-default")),
                &[("owner", "exclusive")],
            ),
            (
                api.lock(&unique_name("short-default")),
                &[("owner", "shared"), ("mode", "shared")],
            ),
            (
                api.semaphore(&unique_name("short-default")),
                &[("owner", "permit"), ("limit", &limit)],
            ),
        ];
        for (resource, params) in &held {
            let mut hold = resource.hold(params).await;
            let grant = hold.expect_acquired().await;
            assert_eq!(grant.ttl_ms, 100, "{params:?}");
            // Five ttls later the watchdog still holds the same lease.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let state = resource.inspect().await;
            assert_eq!(state.holder_owners(), [params[0].1], "{params:?}");
            assert_eq!(state.holders[0].fence, grant.fence, "{params:?}");
            drop(hold);
        }

        let election = unique_name("short-default");
        let mut campaign = api
            .open_stream(
                &["v1", "elections", &election, "campaign"],
                &[("owner", "c")],
            )
            .await;
        let leader = campaign
            .wait_for("a leader event", EVENT_TIMEOUT, |e| e.event == "leader")
            .await
            .json();
        let ttl = leader["ttl_ms"].as_u64().unwrap_or(0);
        assert!((21..=100).contains(&ttl), "{leader}");
        drop(campaign);
    }

    #[apply(backends)]
    #[tokio::test]
    async fn a_hold_times_out_when_its_wait_runs_out(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("timeout"));
        let _holder = lock.acquire(&[("owner", "holder")]).await;

        let mut patient = lock.hold(&[("owner", "patient"), ("wait", "300ms")]).await;
        assert_eq!(patient.expect_queued().await.position, 1);
        let data = patient.expect_timeout().await;
        let waited = data["waited_ms"].as_u64();
        assert!(
            waited.is_some_and(|w| w >= 270),
            "timeout after a 300ms wait reports {data}"
        );
        patient.expect_end().await;
        lock.wait_for_waiters(&[]).await;

        // wait=0 (the default) on a busy lock: `timeout` at once.
        let mut impatient = lock.hold(&[("owner", "impatient")]).await;
        impatient.expect_timeout().await;
        impatient.expect_end().await;
        assert_eq!(lock.inspect().await.holder_owners(), ["holder"]);
    }

    #[apply(backends)]
    #[tokio::test]
    async fn force_release_ends_the_hold_with_lost(backend: TestBackend) {
        let backend = backend.start().await;
        let sidecar = backend.sidecar().admin_token(ADMIN_TOKEN).start().await;
        let lock = sidecar.api().lock(&unique_name("forced"));
        let mut stream = lock.hold(&[("owner", "victim")]).await;
        let grant = stream.expect_acquired().await;

        let admin = sidecar.api_with_token(ADMIN_TOKEN);
        assert_eq!(admin.lock(lock.name()).force_release().await, 1);
        assert_eq!(stream.expect_lost().await, "force_released");
        stream.expect_end().await;
        assert!(lock.inspect().await.holders.is_empty());
        lock.keepalive_lost(&grant.token).await;
    }

    /// A force-release through another sidecar (an operator's, on any
    /// pod) ends a hold with `lost` `force_released` — an exclusive lock's,
    /// a reader's and a semaphore permit's — and a keepalive of its token
    /// with 410. The holder's sidecar only found the lease gone and said
    /// `backend`. ZooKeeper keeps no record of a
    /// force-release: `backend` there, as the README says.
    #[apply(backends)]
    #[tokio::test]
    async fn a_force_release_through_another_sidecar_ends_the_hold_as_force_released(
        backend: TestBackend,
    ) {
        let backend = backend.start().await;
        let holding = backend.sidecar().admin_token(ADMIN_TOKEN).start().await;
        let other = match backend.backend().two_sidecars_share_state() {
            true => Some(backend.sidecar().admin_token(ADMIN_TOKEN).start().await),
            false => None,
        };
        let admin_side = other.as_ref().unwrap_or(&holding);
        let expected = match backend.backend() {
            TestBackend::ZooKeeper => "backend",
            _ => "force_released",
        };
        for kind in ["exclusive", "shared", "semaphore"] {
            let name = unique_name("forced-elsewhere");
            let (resource, admin) = if kind == "semaphore" {
                (
                    holding.api().semaphore(&name),
                    admin_side.api_with_token(ADMIN_TOKEN).semaphore(&name),
                )
            } else {
                (
                    holding.api().lock(&name),
                    admin_side.api_with_token(ADMIN_TOKEN).lock(&name),
                )
            };
            // Renewed every second: the next renewal finds the lease gone.
            let mut params = vec![("owner", "victim"), ("ttl", "3s")];
            match kind {
                "shared" => params.push(("mode", "shared")),
                "semaphore" => params.push(("limit", "1")),
                _ => {}
            }
            let mut stream = resource.hold(&params).await;
            let grant = stream.expect_acquired().await;

            assert_eq!(admin.force_release().await, 1, "{kind}");
            assert_eq!(stream.expect_lost().await, expected, "{kind}");
            stream.expect_end().await;
            resource.keepalive_lost(&grant.token).await;
        }
    }

    #[apply(backends)]
    #[tokio::test]
    async fn max_hold_ends_the_lease(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();

        // Hold stream: the watchdog stops renewing at max_hold.
        let lock = api.lock(&unique_name("max-hold"));
        let started = Instant::now();
        let mut stream = lock.hold(&[("ttl", "300ms"), ("max_hold", "800ms")]).await;
        stream.expect_acquired().await;
        let reason = stream.expect_lost_within(ms(800) + TIMING_SLACK).await;
        let elapsed = started.elapsed();
        assert_eq!(reason, "max_hold");
        assert!(
            elapsed >= ms(800),
            "lost after {elapsed:?}, before max_hold"
        );
        stream.expect_end().await;
        // `lost` comes at the earliest moment the backend's clock may reach
        // the cap; ZooKeeper's node stays until every sidecar is sure it
        // has (the width of its bounds on the servers' clock, a write's
        // round trip with its fsync: README, Clocks), then goes.
        eventually("the capped lease gone", ms(1000), async || {
            lock.inspect().await.holders.is_empty().then_some(())
        })
        .await;
        lock.acquire(&[]).await;

        // Keepalive: the expiry is capped at acquisition + max_hold.
        let capped = api.lock(&unique_name("max-hold-keepalive"));
        let grant = capped
            .acquire(&[("ttl", "300ms"), ("max_hold", "500ms")])
            .await;
        // An estimate: a backend that counts the acquire's round trip
        // against the grant (Redlock) reports an expiry a little earlier
        // than acquisition + ttl, so allow that much against the 10 s asked.
        let acquired_at = grant.expires_at_ms - grant.ttl_ms;
        let renewed = capped.keepalive(&grant.token, &[("ttl", "10s")]).await;
        assert!(
            renewed.expires_at_ms <= acquired_at + 500 + 100,
            "keepalive extended past max_hold: {renewed:?}, acquired at {acquired_at}"
        );
        assert!(renewed.ttl_ms <= 500, "{renewed:?}");
    }

    #[apply(backends)]
    #[tokio::test]
    async fn lock_delay_follows_expiry_but_not_release(backend: TestBackend) {
        const TTL: Duration = Duration::from_millis(300);
        const DELAY: Duration = Duration::from_millis(1500);
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();

        let lock = api.lock(&unique_name("delayed"));
        let started = Instant::now();
        lock.acquire(&[("ttl", "300ms"), ("lock_delay", "1500ms")])
            .await;
        // The lease has expired, the delay still runs (until >= 1800 ms).
        tokio::time::sleep_until((started + TTL + ms(400)).into()).await;
        let busy = lock.acquire_busy(&[]).await;
        // Nobody holds it: the refusal says so, and why (it said "the
        // lock is held", naming no holder).
        assert_eq!(busy["holders"], json!([]), "{busy}");
        let detail = busy["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("nobody holds") && detail.contains("lock-delay"),
            "{detail}"
        );
        lock.acquire(&[("wait", "10s")]).await;
        let elapsed = started.elapsed();
        assert!(
            elapsed >= TTL + DELAY,
            "granted {elapsed:?} after an expiring lease with a {DELAY:?} lock delay"
        );

        // A released lock is free at once, whatever its lock_delay.
        let released = api.lock(&unique_name("released"));
        let grant = released.acquire(&[("lock_delay", "5s")]).await;
        released.release(&grant.token).await;
        released.acquire(&[]).await;
    }
}

mod reentrancy {
    use super::*;

    #[apply(backends)]
    #[tokio::test]
    async fn the_same_owner_reenters_and_releases_by_count(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("reentrant"));
        let first = lock.acquire(&[("owner", "worker")]).await;
        assert_eq!(first.count, 1);
        let second = lock.acquire(&[("owner", "worker")]).await;
        assert_eq!(second.token, first.token);
        assert_eq!(second.fence, first.fence);
        assert_eq!(second.count, 2);
        assert_eq!(lock.inspect().await.holders[0].count, 2);
        lock.acquire_busy(&[("owner", "stranger")]).await;

        let released = lock.release(&first.token).await;
        assert_eq!(
            released,
            Released {
                released: false,
                count: 1
            }
        );
        lock.acquire_busy(&[("owner", "stranger")]).await;
        let released = lock.release(&first.token).await;
        assert_eq!(
            released,
            Released {
                released: true,
                count: 0
            }
        );

        let stranger = lock.acquire(&[("owner", "stranger")]).await;
        assert!(stranger.fence > first.fence);
    }

    /// The same owner re-entering through another sidecar right after its
    /// grant — a try-once acquire's, a waiter's — gets that lease. (On
    /// ZooKeeper both grants are written before the listing that admits
    /// them: another sidecar re-enters such a node only once the sidecar
    /// that wrote it confirmed it, and waits for that.)
    #[apply(backends)]
    #[tokio::test]
    async fn the_same_owner_reenters_through_another_sidecar_at_once(backend: TestBackend) {
        let (backend, a) = setup(backend).await;
        let b = second_sidecar(&backend).await;
        let name = unique_name("reentrant-elsewhere");
        let la = a.api().lock(&name);
        let lb = b.as_ref().unwrap_or(&a).api().lock(&name);

        let first = la.acquire(&[("owner", "worker")]).await;
        let second = lb.acquire(&[("owner", "worker")]).await;
        assert_eq!(
            (second.token.as_str(), second.fence, second.count),
            (first.token.as_str(), first.fence, 2)
        );
        assert_eq!(lb.release(&first.token).await.count, 1);
        assert_eq!(la.release(&first.token).await.count, 0);

        let holder = la.acquire(&[("owner", "holder")]).await;
        let waiter = {
            let la = a.api().lock(&name);
            tokio::spawn(async move { la.acquire(&[("owner", "worker"), ("wait", "30s")]).await })
        };
        common::eventually("the waiter queued", Duration::from_secs(10), async || {
            (la.inspect().await.waiters.len() == 1).then_some(())
        })
        .await;
        la.release(&holder.token).await;
        let granted = waiter.await.expect("the waiter's task");
        let again = lb.acquire(&[("owner", "worker"), ("wait", "5s")]).await;
        assert_eq!(
            (again.token.as_str(), again.fence, again.count),
            (granted.token.as_str(), granted.fence, 2)
        );
        assert!(granted.fence > holder.fence);
        assert_eq!(la.release(&granted.token).await.count, 1);
        assert_eq!(lb.release(&granted.token).await.count, 0);
    }

    /// A re-entry through another sidecar of a lease its first grant capped
    /// (`max_hold`) was answered `ttl_ms` 10000 for a lease ending 1.5 s
    /// later (its `expires_at_ms` was right): a client trusting `ttl_ms`
    /// would hold on 8 s past the lease, beside the next holder. The
    /// answer's `ttl_ms` is the time the lease runs.
    #[apply(backends)]
    #[tokio::test]
    async fn a_re_entry_of_a_capped_lease_is_answered_the_time_it_runs(backend: TestBackend) {
        let (backend, a) = setup(backend).await;
        let b = second_sidecar(&backend).await;
        // A shared lease too: its re-entry is answered by the same code.
        for mode in ["exclusive", "shared"] {
            let name = unique_name("capped-reentry");
            let la = a.api().lock(&name);
            let lb = b.as_ref().unwrap_or(&a).api().lock(&name);
            let first = la
                .acquire(&[
                    ("owner", "o"),
                    ("mode", mode),
                    ("ttl", "2s"),
                    ("max_hold", "3s"),
                ])
                .await;
            let asked = Instant::now();
            let again = lb
                .acquire(&[("owner", "o"), ("mode", mode), ("ttl", "30s")])
                .await;
            let answered = asked.elapsed();
            assert_eq!(
                (again.token.as_str(), again.count),
                (first.token.as_str(), 2),
                "{mode}"
            );
            assert!(
                again.ttl_ms <= 3_000 && again.ttl_ms + ms_u64(answered) + 1_500 >= 3_000,
                "{mode}: a lease capped at 3 s answered ttl_ms {} (expires_at_ms {})",
                again.ttl_ms,
                again.expires_at_ms
            );
        }
    }

    /// A queued waiter must not make one release end a re-entered lease: the
    /// owner still holds it until its count reaches 0.
    #[apply(backends)]
    #[tokio::test]
    async fn a_reentered_lock_stays_held_after_one_release_while_others_wait(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("reentrant-queued"));
        let first = lock.acquire(&[("owner", "worker")]).await;
        let second = lock.acquire(&[("owner", "worker")]).await;
        assert_eq!(
            (second.token.as_str(), second.count),
            (first.token.as_str(), 2)
        );
        let mut waiter = queue_hold(&lock, "waiter", 1).await;

        let released = lock.release(&first.token).await;
        assert_eq!(
            released,
            Released {
                released: false,
                count: 1
            }
        );
        let state = lock.inspect().await;
        assert_eq!(state.holder_owners(), ["worker"], "{state:?}");
        assert_eq!(state.holders[0].count, 1, "{state:?}");
        assert_eq!(state.waiter_owners(), ["waiter"], "{state:?}");

        let released = lock.release(&first.token).await;
        assert_eq!(
            released,
            Released {
                released: true,
                count: 0
            }
        );
        let granted = waiter.expect_acquired().await;
        assert!(granted.fence > first.fence);
    }

    /// Owners may hold any character a name allows in an owner, `/` and
    /// non-ASCII ones included. On Redis a reader's owner, read back and
    /// encoded again by the script, came out as `svc\/worker` and never
    /// matched: the same owner got a second lease instead of re-entering,
    /// and with a writer queued it waited behind the writer that waited
    /// for it.
    #[apply(backends)]
    #[tokio::test]
    async fn owners_with_slashes_and_accents_reenter_in_both_modes(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        for (mode, owner) in [
            ("shared", "svc/worker"),
            ("shared", "équipe\\nuit"),
            ("exclusive", "svc/worker"),
        ] {
            let lock = sidecar.api().lock(&unique_name("owner-chars"));
            let first = lock.acquire(&[("mode", mode), ("owner", owner)]).await;
            let mut writer = lock.hold(&[("owner", "writer"), ("wait", "30s")]).await;
            writer.expect_queued().await;
            let again = lock.acquire(&[("mode", mode), ("owner", owner)]).await;
            assert_eq!(again.token, first.token, "{mode} {owner:?} re-enters");
            assert_eq!(again.count, 2, "{mode} {owner:?}");
            lock.release(&first.token).await;
            lock.release(&first.token).await;
            writer.expect_acquired().await;
        }
    }

    #[apply(backends)]
    #[tokio::test]
    async fn clients_without_an_owner_are_not_reentrant(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("anonymous"));
        let grant = lock.acquire(&[]).await;
        assert!(!grant.owner.is_empty(), "a generated owner is reported");
        lock.acquire_busy(&[]).await;
    }
}

mod modes {
    use super::*;

    #[apply(backends)]
    #[tokio::test]
    async fn shared_holders_coexist_and_exclude_writers(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("rw"));
        let reader_1 = lock
            .acquire(&[("mode", "shared"), ("owner", "reader-1")])
            .await;
        let reader_2 = lock
            .acquire(&[("mode", "shared"), ("owner", "reader-2")])
            .await;
        assert_eq!(reader_1.mode.as_deref(), Some("shared"));
        assert_ne!(reader_1.token, reader_2.token);
        let state = lock.inspect().await;
        assert_eq!(state.holder_owners(), ["reader-1", "reader-2"]);
        assert!(
            state
                .holders
                .iter()
                .all(|h| h.mode.as_deref() == Some("shared"))
        );
        lock.acquire_busy(&[("mode", "exclusive"), ("owner", "writer")])
            .await;

        lock.release(&reader_1.token).await;
        lock.release(&reader_2.token).await;
        let writer = lock.acquire(&[("owner", "writer")]).await;
        assert_eq!(writer.mode.as_deref(), Some("exclusive"));
        lock.acquire_busy(&[("mode", "shared"), ("owner", "reader-3")])
            .await;
    }

    /// A re-entered exclusive holder's last release, with readers of two
    /// sidecars (one where the backend keeps no shared state) in line: the
    /// release passes the lock on from the queue's head whatever its mode
    /// (on Redis, the fast path takes the head and hands over after it), so
    /// both readers are granted together; a writer then queued gets in only
    /// after both have gone.
    #[apply(backends)]
    #[tokio::test]
    async fn readers_queued_behind_a_re_entered_writer_are_granted_together(backend: TestBackend) {
        let (backend, a) = setup(backend).await;
        let b = second_sidecar(&backend).await;
        let name = unique_name("rw-handoff");
        let la = a.api().lock(&name);
        let lb = b.as_ref().unwrap_or(&a).api().lock(&name);
        let holder = la.acquire(&[("owner", "w0")]).await;
        assert_eq!(la.acquire(&[("owner", "w0")]).await.count, 2);
        let mut r1 = la
            .hold(&[("owner", "r1"), ("mode", "shared"), ("wait", "30s")])
            .await;
        assert_eq!(r1.expect_queued().await.position, 1);
        // (Redlock's nodes order queued claims each their own way: no
        // position is checked for the second.)
        let mut r2 = lb
            .hold(&[("owner", "r2"), ("mode", "shared"), ("wait", "30s")])
            .await;
        r2.expect_queued().await;

        assert_eq!(la.release(&holder.token).await.count, 1);
        assert_eq!(la.inspect().await.holder_owners(), ["w0"]);
        assert_eq!(la.release(&holder.token).await.count, 0);
        // At once: a head the release dropped would be queued again only
        // when its sidecar next looks (about 5 s on Redis).
        let (g1, g2) = (
            r1.expect_acquired_within(Duration::from_secs(3)).await,
            r2.expect_acquired_within(Duration::from_secs(3)).await,
        );
        assert_eq!(
            (g1.mode.as_deref(), g2.mode.as_deref()),
            (Some("shared"), Some("shared"))
        );
        assert!(g1.fence > holder.fence && g2.fence > holder.fence);
        assert_eq!(la.inspect().await.holder_owners(), ["r1", "r2"]);

        let mut w1 = queue_hold(&lb, "w1", 1).await;
        la.release(&g1.token).await;
        assert_eq!(
            la.inspect().await.holder_owners(),
            ["r2"],
            "the writer is not let in while a reader holds"
        );
        lb.release(&g2.token).await;
        let writer = w1.expect_acquired().await;
        assert_eq!(writer.owner, "w1");
        assert!(writer.fence > g1.fence.max(g2.fence));
    }

    #[apply(backends)]
    #[tokio::test]
    async fn a_queued_writer_is_not_overtaken_by_readers(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let lock = sidecar.api().lock(&unique_name("fair-rw"));
        let reader = lock
            .acquire(&[("mode", "shared"), ("owner", "reader-1")])
            .await;
        let mut writer = queue_hold(&lock, "writer", 1).await;

        // Compatible with the current holder, but the writer is first in line.
        lock.acquire_busy(&[("mode", "shared"), ("owner", "reader-2")])
            .await;

        lock.release(&reader.token).await;
        assert_eq!(writer.expect_acquired().await.owner, "writer");
    }

    /// A reader's lease that expired keeps the lock for its lock-delay,
    /// even when the last live reader releases with a writer waiting and
    /// nobody looked at the lock since the lease expired (the writer's
    /// sidecar is stopped meanwhile; the release once handed the lock to the
    /// writer at once on PostgreSQL).
    #[apply(backends)]
    #[tokio::test]
    async fn an_expired_readers_lock_delay_outlasts_the_last_readers_release(backend: TestBackend) {
        // Long enough that the writer's sidecar is stopped well before the
        // lease ends, not in the middle of the writer's first look (a
        // Redlock attempt stopped past its time limit answers 503).
        const TTL: Duration = Duration::from_millis(800);
        const DELAY: Duration = Duration::from_millis(2000);
        let backend = backend.start().await;
        let sidecars = backend.sidecars(2).await;
        let (readers, writers) = (&sidecars[0], &sidecars[sidecars.len() - 1]);
        let lock = readers.api().lock(&unique_name("reader-delay"));
        let started = Instant::now();
        lock.acquire(&[
            ("mode", "shared"),
            ("owner", "lapsing"),
            ("ttl", "800ms"),
            ("lock_delay", "2s"),
        ])
        .await;
        let live = lock
            .acquire(&[("mode", "shared"), ("owner", "live"), ("ttl", "30s")])
            .await;
        let writer = {
            let lock = writers.api().lock(lock.name());
            tokio::spawn(async move { lock.acquire(&[("owner", "writer"), ("wait", "15s")]).await })
        };
        eventually("the writer queued", Duration::from_secs(5), async || {
            (lock.inspect().await.waiters.len() == 1).then_some(())
        })
        .await;
        // The writer's sidecar cannot look when the lease expires.
        let stopped = sidecars.len() > 1;
        if stopped {
            writers.signal(nix::sys::signal::Signal::SIGSTOP);
        }
        tokio::time::sleep_until((started + TTL + ms(300)).into()).await;
        lock.release(&live.token).await;
        tokio::time::sleep(ms(300)).await;
        if stopped {
            writers.signal(nix::sys::signal::Signal::SIGCONT);
        }
        let grant = tokio::time::timeout(Duration::from_secs(10), writer)
            .await
            .expect("the writer granted after the lock-delay")
            .expect("writer task");
        let waited = started.elapsed();
        assert!(
            waited >= TTL + DELAY,
            "the writer got the lock {waited:?} after a reader's {TTL:?} lease with a {DELAY:?} lock-delay"
        );
        lock.release(&grant.token).await;
    }
}

mod semaphores {
    use super::*;

    #[apply(backends)]
    #[tokio::test]
    async fn a_semaphore_admits_up_to_its_limit(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let semaphore = sidecar.api().semaphore(&unique_name("pool"));
        let limit = max_permits(backend, 3);
        let n = limit as usize;
        let limit = limit.to_string();
        let owners = owner_names("worker", n + 1);

        let mut permits = Vec::new();
        for owner in &owners[..n] {
            let permit = semaphore
                .acquire(&[("limit", &limit), ("owner", owner)])
                .await;
            assert_eq!(permit.kind, "semaphore");
            assert_eq!(permit.count, 1);
            permits.push(permit);
        }
        let fences: Vec<u64> = permits.iter().map(|p| p.fence).collect();
        assert_strictly_increasing(&fences, "semaphore permits");
        let state = semaphore.inspect().await;
        assert_eq!(state.kind, "semaphore");
        assert_eq!(state.limit, Some(n as u64));
        assert_eq!(state.holder_owners(), as_strs(&owners[..n]));

        let busy = semaphore
            .acquire_busy(&[("limit", &limit), ("owner", &owners[n])])
            .await;
        assert_eq!(busy["holders"].as_array().map(Vec::len), Some(n), "{busy}");

        let mut next = semaphore
            .hold(&[("limit", &limit), ("owner", &owners[n]), ("wait", "30s")])
            .await;
        assert_eq!(next.expect_queued().await.position, 1);
        assert!(semaphore.release(&permits[0].token).await.released);
        let grant = next.expect_acquired().await;
        assert_eq!(grant.owner, owners[n]);
        assert!(grant.fence > fences[n - 1]);
        assert_eq!(semaphore.inspect().await.holders.len(), n);
    }

    /// A semaphore lease is a `permit` wherever the API names how it is held:
    /// the acquire answer, the hold stream's `acquired`, the listing's holders
    /// and waiters, a busy answer's holders, a `timeout` event's holders and
    /// the event stream — as on the dashboard. Locks keep `exclusive`/`shared`.
    #[apply(backends)]
    #[tokio::test]
    async fn a_semaphore_lease_is_called_a_permit_everywhere(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();
        let mut events = api.events().await;
        let semaphore = api.semaphore(&unique_name("permits"));
        let limit = [("limit", "1")];

        let permit = semaphore.acquire(&[limit[0], ("owner", "first")]).await;
        assert_eq!(permit.mode.as_deref(), Some("permit"), "{permit:?}");
        let mut queued = semaphore
            .hold(&[limit[0], ("owner", "second"), ("wait", "30s")])
            .await;
        queued.expect_queued().await;

        let state = semaphore.raw_inspect().await;
        assert_eq!(state["holders"][0]["mode"], "permit", "{state}");
        assert_eq!(state["waiters"][0]["mode"], "permit", "{state}");
        let busy = semaphore
            .acquire_busy(&[limit[0], ("owner", "third")])
            .await;
        assert_eq!(busy["holders"][0]["mode"], "permit", "{busy}");
        let timeout = semaphore
            .hold(&[limit[0], ("owner", "fourth")])
            .await
            .expect_timeout()
            .await;
        assert_eq!(timeout["holders"][0]["mode"], "permit", "{timeout}");

        semaphore.release(&permit.token).await;
        let next = queued.expect_acquired().await;
        assert_eq!(next.mode.as_deref(), Some("permit"), "{next:?}");
        let event = events
            .wait_for("`acquired` of the semaphore", EVENT_TIMEOUT, |e| {
                e.event == "acquired" && e.json()["name"] == semaphore.name()
            })
            .await;
        assert_eq!(event.json()["mode"], "permit", "{}", event.data);
        let text = format!("{state}{busy}{timeout}{}", event.data);
        assert!(!text.contains("exclusive"), "{text}");
    }

    /// Redlock refuses semaphores with more than one permit (400
    /// `unsupported`, before anything is written); the other backends grant them.
    #[apply(backends)]
    #[tokio::test]
    async fn refuses_more_permits_than_it_can_bound(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let semaphore = sidecar.api().semaphore(&unique_name("bounded"));
        for limit in ["2", "3", "1000"] {
            let response = semaphore.acquire_raw(&[("limit", limit)]).await;
            if backend == TestBackend::Redlock {
                let problem =
                    assert_problem(response, StatusCode::BAD_REQUEST, "unsupported").await;
                let detail = problem["detail"].as_str().unwrap_or_default();
                assert!(detail.contains("majority"), "{detail}");
                assert!(detail.contains("limit=1"), "{detail}");
                let state = semaphore.inspect().await;
                assert!(
                    state.holders.is_empty() && state.limit.is_none(),
                    "{state:?}"
                );
            } else {
                let permit: Grant = expect_json(response, StatusCode::OK).await;
                semaphore.release(&permit.token).await;
            }
        }
        let permit = semaphore.acquire(&[("limit", "1")]).await;
        assert_eq!(semaphore.inspect().await.limit, Some(1));
        semaphore.release(&permit.token).await;
    }

    #[apply(backends)]
    #[tokio::test]
    async fn semaphore_parameters_are_checked(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let semaphore = sidecar.api().semaphore(&unique_name("checked"));
        let bad = StatusCode::BAD_REQUEST;

        assert_problem(semaphore.acquire_raw(&[]).await, bad, "invalid-parameter").await;
        assert_problem(
            semaphore.acquire_raw(&[("limit", "0")]).await,
            bad,
            "out-of-range",
        )
        .await;

        // On Redlock the active limit is 1 and 2 is refused before it is compared.
        let active = max_permits(backend, 2);
        let other = if active == 1 { "2" } else { "3" };
        let permit = semaphore.acquire(&[("limit", &active.to_string())]).await;
        // A hold is refused as the acquire is, before any stream opens.
        for refused in [
            semaphore.acquire_raw(&[("limit", other)]).await,
            semaphore.hold_raw(&[("limit", other)]).await,
        ] {
            if backend == TestBackend::Redlock {
                assert_problem(refused, bad, "unsupported").await;
            } else {
                let mismatch = assert_problem(refused, bad, "limit-mismatch").await;
                assert_eq!(mismatch["limit"], active, "{mismatch}");
            }
        }
        for mode in ["shared", "exclusive"] {
            assert_problem(
                semaphore
                    .acquire_raw(&[("limit", &active.to_string()), ("mode", mode)])
                    .await,
                bad,
                "invalid-parameter",
            )
            .await;
        }

        // Once idle, the limit may change.
        semaphore.release(&permit.token).await;
        let changed = max_permits(backend, 5);
        semaphore.acquire(&[("limit", &changed.to_string())]).await;
        assert_eq!(semaphore.inspect().await.limit, Some(u64::from(changed)));
    }

    // A claim without a limit takes the one in use. On ZooKeeper it wrote
    // none: granted after the holder with limit 1 left, it left the
    // semaphore without a limit, and a claim with limit 2 through another
    // sidecar was granted beside it.
    #[apply(shared_backends)]
    #[tokio::test]
    async fn a_semaphore_keeps_its_limit_while_a_claim_without_one_holds_it(backend: TestBackend) {
        let guard = backend.start().await;
        let sidecars = guard.sidecars(2).await;
        let name = unique_name("kept-limit");
        let (one, two) = (
            sidecars[0].api().semaphore(&name),
            sidecars[1].api().semaphore(&name),
        );
        let first = one.acquire(&[("owner", "first"), ("limit", "1")]).await;
        let waiter = {
            let two = two.clone();
            tokio::spawn(
                async move { two.acquire(&[("owner", "no-limit"), ("wait", "30s")]).await },
            )
        };
        eventually(
            "the claim without a limit waits",
            Duration::from_secs(10),
            async || (!one.inspect().await.waiters.is_empty()).then_some(()),
        )
        .await;
        one.release(&first.token).await;
        let second = waiter.await.expect("the waiter's task");
        assert_eq!(second.owner, "no-limit");
        let refused = one.acquire_raw(&[("owner", "two"), ("limit", "2")]).await;
        if backend == TestBackend::Redlock {
            assert_problem(refused, StatusCode::BAD_REQUEST, "unsupported").await;
        } else {
            let mismatch = assert_problem(refused, StatusCode::BAD_REQUEST, "limit-mismatch").await;
            assert_eq!(mismatch["limit"], 1, "{mismatch}");
        }
        let state = one.inspect().await;
        assert_eq!(state.holder_owners(), ["no-limit"]);
        assert_eq!(state.limit, Some(1));
    }
}

mod fencing {
    use super::*;

    #[apply(backends)]
    #[tokio::test]
    async fn fences_strictly_increase_across_all_grants(backend: TestBackend) {
        let backend = backend.start().await;
        let sidecars = backend.sidecars(2).await;
        let name = unique_name("fenced");
        let locks: Vec<Resource> = sidecars.iter().map(|s| s.api().lock(&name)).collect();

        let fresh = locks[0].inspect().await;
        assert_eq!(
            (fresh.fence, fresh.holders.len(), fresh.waiters.len()),
            (0, 0, 0)
        );

        let mut fences = Vec::new();
        for round in 0..6 {
            let lock = &locks[round % locks.len()];
            let grant = lock.acquire(&[]).await;
            fences.push(grant.fence);
            lock.release(&grant.token).await;

            let mut stream = lock.hold(&[]).await;
            fences.push(stream.expect_acquired().await.fence);
            drop(stream);
            lock.wait_until_free().await;

            let reader_1 = lock.acquire(&[("mode", "shared")]).await;
            let reader_2 = lock.acquire(&[("mode", "shared")]).await;
            fences.extend([reader_1.fence, reader_2.fence]);
            lock.release(&reader_1.token).await;
            lock.release(&reader_2.token).await;
        }
        assert_strictly_increasing(&fences, "grants of one lock");
        for lock in &locks {
            assert_eq!(lock.inspect().await.fence, fences[fences.len() - 1]);
        }
    }
}

mod observability {
    use super::*;

    #[apply(backends)]
    #[tokio::test]
    async fn inspect_shows_holders_and_waiters(backend: TestBackend) {
        let backend = backend.start().await;
        let sidecar_id = unique_name("sidecar");
        let sidecar = backend.sidecar().sidecar_id(&sidecar_id).start().await;
        let lock = sidecar.api().lock(&unique_name("inspected"));

        let idle = lock.inspect().await;
        assert_eq!(idle.name, lock.name());
        assert_eq!(idle.kind, "lock");
        assert_eq!(idle.fence, 0);
        assert!(idle.holders.is_empty() && idle.waiters.is_empty());

        let before = now_ms();
        let grant = lock.acquire(&[("owner", "holder"), ("ttl", "20s")]).await;
        let _waiter_1 = queue_hold(&lock, "waiter-1", 1).await;
        let _waiter_2 = queue_hold(&lock, "waiter-2", 2).await;

        let state = lock.inspect().await;
        assert_eq!(state.fence, grant.fence);
        let [holder] = state.holders.as_slice() else {
            panic!("expected one holder: {state:?}");
        };
        assert_eq!(holder.owner, "holder");
        assert_eq!(holder.sidecar, sidecar_id);
        assert_eq!(holder.mode.as_deref(), Some("exclusive"));
        assert_eq!(holder.fence, grant.fence);
        assert_eq!(holder.count, 1);
        // The same end, as each answer counts it: a sidecar that reads a
        // server's clock off its replies counts a lease's end with the
        // offset it settled on, which a call slowed on its way out raises
        // at once (ends read earlier, never later than they are) and a
        // quicker one lowers again; on a loaded machine two answers were
        // seen 6–7 ms apart (Redis Sentinel, Redis Cluster).
        const READING_NOISE_MS: u64 = 250;
        assert!(
            holder.expires_at_ms.abs_diff(grant.expires_at_ms)
                <= backend.backend().drift_ms(grant.ttl_ms) + READING_NOISE_MS,
            "inspect {} vs grant {}",
            holder.expires_at_ms,
            grant.expires_at_ms
        );
        assert!(
            holder.since_ms.abs_diff(before) < 5_000,
            "since_ms {} vs now {before}",
            holder.since_ms
        );
        assert!(
            (19_900..=20_100).contains(&(holder.expires_at_ms - holder.since_ms)),
            "{holder:?}"
        );

        assert_eq!(state.waiter_owners(), ["waiter-1", "waiter-2"]);
        for waiter in &state.waiters {
            assert_eq!(waiter.sidecar, sidecar_id);
            assert_eq!(waiter.mode.as_deref(), Some("exclusive"));
            // Redis stamps a holder with its own clock and a waiter with the
            // sidecar's reading of it, which lags by up to a reply's way
            // back (tens of ms on a loaded machine).
            assert!(
                waiter.since_ms + 250 >= holder.since_ms,
                "{waiter:?} joined before {holder:?}"
            );
        }
    }

    #[apply(backends)]
    #[tokio::test]
    async fn list_filters_by_prefix_and_paginates(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();
        let prefix = unique_name("listed");

        let mut expected = Vec::new();
        for suffix in ["a", "b", "c"] {
            let name = format!("{prefix}-{suffix}");
            let grant = api.lock(&name).acquire(&[]).await;
            expected.push(("lock".to_owned(), name, grant.fence));
        }
        let name = format!("{prefix}-s");
        let limit = max_permits(backend, 2).to_string();
        let permit = api.semaphore(&name).acquire(&[("limit", &limit)]).await;
        expected.push(("semaphore".to_owned(), name, permit.fence));
        // Neither an idle lock nor another prefix is listed.
        let idle = api.lock(&format!("{prefix}-idle"));
        let grant = idle.acquire(&[]).await;
        idle.release(&grant.token).await;
        api.lock(&unique_name("unlisted")).acquire(&[]).await;

        let mut listed = Vec::new();
        let mut cursor: Option<String> = None;
        for page_number in 0.. {
            assert!(page_number < 10, "pagination does not end: {listed:?}");
            let mut query = vec![("prefix", prefix.as_str()), ("limit", "2")];
            if let Some(cursor) = &cursor {
                query.push(("cursor", cursor));
            }
            let page = api.list(&query).await;
            assert!(page.locks.len() <= 2, "limit=2 gave {page:?}");
            if page_number == 0 {
                assert_eq!(page.locks.len(), 2, "{page:?}");
                assert!(page.next_cursor.is_some(), "{page:?}");
            }
            for entry in &page.locks {
                assert_eq!((entry.holders, entry.waiters), (1, 0), "{entry:?}");
            }
            listed.extend(
                page.locks
                    .into_iter()
                    .map(|entry| (entry.kind, entry.name, entry.fence)),
            );
            cursor = page.next_cursor;
            if cursor.is_none() {
                break;
            }
        }
        assert_eq!(listed, expected, "sorted by kind, then name");
    }

    #[apply(backends)]
    #[tokio::test]
    async fn stale_lists_locks_held_too_long(backend: TestBackend) {
        const STALE_AFTER: Duration = Duration::from_millis(200);
        let backend = backend.start().await;
        let sidecar = backend.sidecar().stale_after("200ms").start().await;
        let api = sidecar.api();
        let lock = api.lock(&unique_name("stale"));

        let started = Instant::now();
        lock.acquire(&[("ttl", "30s")]).await;
        let fresh = api.stale().await;
        if started.elapsed() < STALE_AFTER {
            assert!(
                fresh.iter().all(|e| !e.key.contains(lock.name())),
                "listed as stale right after the acquire: {fresh:?}"
            );
        }

        let entry = eventually(
            "the lock to be listed as stale",
            5 * TIMING_SLACK,
            async || {
                let stale = api.stale().await;
                stale.into_iter().find(|e| e.key.contains(lock.name()))
            },
        )
        .await;
        assert_eq!(entry.reason, "held-too-long", "{entry:?}");
        assert!(entry.age_ms >= 200, "{entry:?}");
    }

    #[apply(backends)]
    #[tokio::test]
    async fn the_event_stream_reports_lock_events_without_tokens(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();
        let sidecar_id = api.sidecar_id().await;
        let mut events = api.events().await;
        let lock = api.lock(&unique_name("observed"));

        let grant = lock.acquire(&[("owner", "observed")]).await;
        lock.release(&grant.token).await;

        for kind in ["acquired", "released"] {
            let event = events
                .wait_for(&format!("`{kind}` of the lock"), EVENT_TIMEOUT, |e| {
                    e.event == kind && e.json()["name"] == lock.name()
                })
                .await;
            let data = event.json();
            assert_eq!(data["type"], kind, "{data}");
            assert_eq!(data["kind"], "lock", "{data}");
            assert_eq!(data["owner"], "observed", "{data}");
            assert_eq!(data["sidecar"], sidecar_id.as_str(), "{data}");
            assert_eq!(data["mode"], "exclusive", "{data}");
            assert_eq!(data["fence"], grant.fence, "{data}");
            assert!(data["at_ms"].is_u64(), "{data}");
        }
        assert!(
            !events.raw().contains(&grant.token),
            "the event stream leaked a token:\n{}",
            events.raw()
        );
    }

    #[apply(backends)]
    #[tokio::test]
    async fn info_reports_identity_backend_and_limits(backend: TestBackend) {
        let backend_guard = backend.start().await;
        let sidecar_id = unique_name("info");
        let sidecar = backend_guard
            .sidecar()
            .sidecar_id(&sidecar_id)
            .default_ttl("20s")
            .max_ttl("2m")
            .max_wait("90s")
            .max_waiters(50)
            .lock_delay("250ms")
            .stale_after("10m")
            .start()
            .await;
        let api = sidecar.api();
        let info = api.info().await;

        assert_eq!(info["sidecar"], sidecar_id.as_str(), "{info}");
        assert_eq!(info["version"], env!("CARGO_PKG_VERSION"), "{info}");
        assert_members(
            &info["backend"],
            json!({
                "kind": backend.info_kind(),
                "url": backend_guard.url(),
                "safety": backend.safety(),
            }),
        );
        assert!(
            info["started_at_ms"].as_u64().is_some_and(|t| t > 0),
            "{info}"
        );
        assert!(info["uptime_ms"].is_u64(), "{info}");
        assert_members(
            &info["limits"],
            json!({
                "default_ttl_ms": 20_000,
                "max_ttl_ms": 120_000,
                "max_wait_ms": 90_000,
                "max_waiters": 50,
                "lock_delay_ms": 250,
                "stale_after_ms": 600_000,
            }),
        );
        assert_members(
            &info["auth"],
            json!({"api_token": false, "admin_token": false}),
        );

        // The default ttl applies to acquires that do not give one.
        let grant = api.lock(&unique_name("default-ttl")).acquire(&[]).await;
        assert_eq!(grant.ttl_ms, 20_000);
    }

    #[apply(backends)]
    #[tokio::test]
    async fn health_readiness_and_openapi(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();

        let health: Value = api.get_json(&["healthz"], &[]).await;
        assert_eq!(health["status"], "ok", "{health}");
        let ready: Value = api.get_json(&["readyz"], &[]).await;
        assert_eq!(ready["status"], "ready", "{ready}");

        let openapi: Value = api.get_json(&["openapi.json"], &[]).await;
        assert!(
            openapi["openapi"]
                .as_str()
                .is_some_and(|v| v.starts_with('3')),
            "not an OpenAPI 3 document: {}",
            openapi["openapi"]
        );
        let paths = openapi["paths"].as_object().expect("`paths` object");
        for path in [
            "/v1/locks/{name}",
            "/v1/locks/{name}/keepalive",
            "/v1/locks/{name}/hold",
            "/v1/locks",
            "/v1/semaphores/{name}",
            "/v1/info",
        ] {
            assert!(
                paths.contains_key(path),
                "{path} missing from {:?}",
                paths.keys()
            );
        }
    }

    #[apply(backends)]
    #[tokio::test]
    async fn metrics_are_prometheus_text_with_the_sidelock_prefix(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();
        let lock = api.lock(&unique_name("metered"));
        let grant = lock.acquire(&[]).await;
        lock.release(&grant.token).await;

        let response = api.get(&["metrics"], &[]).await;
        assert_eq!(response.status(), StatusCode::OK);
        let content_type = response.headers()[CONTENT_TYPE].to_str().unwrap_or("");
        assert!(content_type.starts_with("text/plain"), "{content_type}");
        let text = response.text().await.expect("metrics body");

        assert!(
            text.contains("# TYPE sidelock_acquires_total counter"),
            "{text}"
        );
        let samples: Vec<&str> = text
            .lines()
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .collect();
        assert!(
            samples
                .iter()
                .any(|line| line.starts_with("sidelock_acquires_total")),
            "{text}"
        );
        assert!(
            samples.iter().any(|line| line.contains("_seconds_bucket")),
            "no duration histogram: {text}"
        );
        for line in &samples {
            assert!(line.starts_with("sidelock_"), "unprefixed metric: {line}");
        }
        assert!(
            !text.contains(lock.name()),
            "lock names are labels only with --metrics-lock-labels"
        );
    }
}

mod validation {
    use super::*;

    /// One request that must be answered with a problem.
    struct Case {
        what: &'static str,
        method: Method,
        segments: Vec<String>,
        query: Vec<(&'static str, String)>,
        body: Body,
        status: StatusCode,
        slug: &'static str,
        /// Extension members the problem must carry.
        members: Vec<(&'static str, Value)>,
    }

    impl Case {
        fn new(what: &'static str, method: Method, segments: &[&str]) -> Self {
            Self {
                what,
                method,
                segments: segments.iter().map(|s| (*s).to_owned()).collect(),
                query: Vec::new(),
                body: Body::Empty,
                status: StatusCode::BAD_REQUEST,
                slug: "invalid-parameter",
                members: Vec::new(),
            }
        }

        /// `POST /v1/locks/{name}`.
        fn acquire(what: &'static str, name: &str) -> Self {
            Self::new(what, Method::POST, &["v1", "locks", name])
        }

        fn query(mut self, key: &'static str, value: &str) -> Self {
            self.query.push((key, value.to_owned()));
            self
        }

        fn json(self, value: Value) -> Self {
            self.body(Body::Json(value))
        }

        fn raw(self, content_type: &str, bytes: impl Into<Vec<u8>>) -> Self {
            self.body(Body::Raw {
                content_type: content_type.to_owned(),
                bytes: bytes.into(),
            })
        }

        fn body(mut self, body: Body) -> Self {
            self.body = body;
            self
        }

        fn expect(mut self, status: u16, slug: &'static str) -> Self {
            self.status = StatusCode::from_u16(status).expect("valid status");
            self.slug = slug;
            self
        }

        fn member(mut self, name: &'static str, value: Value) -> Self {
            self.members.push((name, value));
            self
        }

        /// Sends the request and checks the problem (panics on mismatch).
        async fn check(self, api: Api) {
            let segments: Vec<&str> = self.segments.iter().map(String::as_str).collect();
            let query: Vec<(&str, &str)> =
                self.query.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let response = api.send(self.method, &segments, &query, self.body).await;
            let problem = assert_problem(response, self.status, self.slug).await;
            for (name, value) in &self.members {
                assert_eq!(&problem[*name], value, "{}: {problem}", self.what);
            }
        }
    }

    fn out_of_range(case: Case, parameter: &str, max_ms: Option<u64>) -> Case {
        let case = case
            .expect(400, "out-of-range")
            .member("parameter", json!(parameter));
        match max_ms {
            Some(max) => case.member("max_ms", json!(max)),
            None => case,
        }
    }

    #[apply(backends)]
    #[tokio::test]
    async fn bad_input_is_a_problem_and_never_a_server_error(backend: TestBackend) {
        let backend = backend.start().await;
        // The default ttl must fit under --max-ttl.
        let sidecar = backend
            .sidecar()
            .default_ttl("5s")
            .max_ttl("10s")
            .max_wait("5s")
            .start()
            .await;
        let api = sidecar.api();
        let held = api.lock(&unique_name("held"));
        let grant = held.acquire(&[]).await;
        let keepalive = ["v1", "locks", held.name(), "keepalive"];
        let name = unique_name("bad-input");
        let lock = ["v1", "locks", name.as_str()];
        let hold = ["v1", "locks", name.as_str(), "hold"];
        let too_long = "a".repeat(201);

        let cases = vec![
            // Names.
            Case::acquire("name of 201 characters", &too_long).expect(400, "invalid-name"),
            Case::acquire("name with a space", "a b").expect(400, "invalid-name"),
            Case::acquire("name with an encoded slash", "a/b").expect(400, "invalid-name"),
            Case::acquire("name with non-ASCII letters", "verrou-ü").expect(400, "invalid-name"),
            Case::acquire("name with punctuation", "a*b").expect(400, "invalid-name"),
            Case::new(
                "inspect with a bad name",
                Method::GET,
                &["v1", "locks", "a b"],
            )
            .expect(400, "invalid-name"),
            Case::new(
                "hold with a bad name",
                Method::GET,
                &["v1", "locks", "a b", "hold"],
            )
            .expect(400, "invalid-name"),
            Case::new("empty name", Method::POST, &["v1", "locks", ""]).expect(404, "not-found"),
            // Values.
            Case::new("unknown mode", Method::POST, &lock).query("mode", "banana"),
            Case::new("unparsable ttl", Method::POST, &lock).query("ttl", "soon"),
            Case::new("negative wait", Method::POST, &lock).query("wait", "-1"),
            Case::new("unparsable max_hold", Method::POST, &lock).query("max_hold", "forever"),
            Case::new("ttl of the wrong JSON type", Method::POST, &lock).json(json!({"ttl": true})),
            out_of_range(
                Case::new("ttl above --max-ttl", Method::POST, &lock).query("ttl", "11s"),
                "ttl",
                Some(10_000),
            ),
            out_of_range(
                Case::new("ttl of zero", Method::POST, &lock).query("ttl", "0"),
                "ttl",
                None,
            ),
            out_of_range(
                Case::new("wait above --max-wait", Method::POST, &lock).query("wait", "6s"),
                "wait",
                Some(5_000),
            ),
            out_of_range(
                Case::new("keepalive ttl above --max-ttl", Method::POST, &keepalive)
                    .query("token", &grant.token)
                    .query("ttl", "1m"),
                "ttl",
                Some(10_000),
            ),
            // Parameters.
            Case::new("unknown query parameter", Method::POST, &lock).query("bogus", "1"),
            Case::new("unknown JSON field", Method::POST, &lock).json(json!({"bogus": 1})),
            Case::new("info with a query parameter", Method::GET, &["v1", "info"])
                .query("bogus", "1"),
            Case::new("parameter repeated in the query", Method::POST, &lock)
                .query("ttl", "1s")
                .query("ttl", "2s"),
            Case::new("parameter in both query and body", Method::POST, &lock)
                .query("ttl", "1s")
                .json(json!({"ttl": "2s"})),
            Case::new("parameter repeated in the JSON body", Method::POST, &lock)
                .raw("application/json", r#"{"ttl": "1s", "ttl": "2s"}"#),
            Case::new("release without a token", Method::DELETE, &lock),
            Case::new("keepalive without a token", Method::POST, &keepalive),
            Case::new("hold with an unknown mode", Method::GET, &hold).query("mode", "banana"),
            // Found by the backend's first attempt, which answers before
            // the stream opens (it was a 200 stream opening with `error`).
            Case::new(
                "semaphore hold without a limit",
                Method::GET,
                &["v1", "semaphores", &unique_name("no-limit"), "hold"],
            ),
            out_of_range(
                Case::new("hold with ttl above --max-ttl", Method::GET, &hold).query("ttl", "1h"),
                "ttl",
                Some(10_000),
            ),
            // A watchdog renews every third of the ttl: 1 ms asked the
            // backend for a renewal every millisecond, for as long as the
            // stream stayed open.
            out_of_range(
                Case::new("hold with ttl below 100 ms", Method::GET, &hold).query("ttl", "1ms"),
                "ttl",
                Some(10_000),
            )
            .member("min_ms", json!(100)),
            out_of_range(
                Case::new(
                    "campaign with ttl below 100 ms",
                    Method::GET,
                    &["v1", "elections", name.as_str(), "campaign"],
                )
                .query("ttl", "99ms"),
                "ttl",
                Some(10_000),
            )
            .member("min_ms", json!(100)),
            Case::new(
                "unparsable semaphore limit",
                Method::POST,
                &["v1", "semaphores", name.as_str()],
            )
            .query("limit", "many"),
            Case::new("unparsable list limit", Method::GET, &["v1", "locks"]).query("limit", "x"),
            Case::new("list limit above 1000", Method::GET, &["v1", "locks"])
                .query("limit", "1001")
                .expect(400, "out-of-range"),
            // Bodies.
            Case::new("malformed JSON", Method::POST, &lock).raw("application/json", r#"{"ttl": "#),
            Case::new("JSON that is not an object", Method::POST, &lock)
                .raw("application/json", r#"["ttl"]"#),
            Case::new("body over 64 KiB", Method::POST, &lock)
                .json(json!({"owner": "x".repeat(70 * 1024)}))
                .expect(413, "body-too-large"),
            Case::new("text/plain body", Method::POST, &lock)
                .raw("text/plain", "ttl=1s")
                .expect(415, "unsupported-media-type"),
            // Routes.
            Case::new("unknown /v1 route", Method::GET, &["v1", "nope"]).expect(404, "not-found"),
            Case::new("unknown route", Method::GET, &["nope"]).expect(404, "not-found"),
            Case::new("wrong method", Method::PUT, &lock).expect(405, "method-not-allowed"),
        ];
        // Each case runs as its own task, so one run reports every failing
        // case (their panic messages are on stderr).
        let mut failed = Vec::new();
        for case in cases {
            let what = case.what;
            if tokio::spawn(case.check(api.clone())).await.is_err() {
                failed.push(what);
            }
        }
        assert!(failed.is_empty(), "failed cases: {failed:#?}");

        // None of that disturbed the lock that was held meanwhile.
        assert!(held.release(&grant.token).await.released);
    }

    #[apply(backends)]
    #[tokio::test]
    async fn valid_names_use_the_whole_alphabet_up_to_200_characters(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();
        let base = format!("AZaz09._:-{}", unique_name("n"));
        for name in [format!("{base:x<200}"), "x".to_owned()] {
            let grant = api.lock(&name).acquire(&[]).await;
            assert_eq!(grant.name, name);
        }
    }

    #[apply(backends)]
    #[tokio::test]
    async fn durations_take_units_or_plain_milliseconds(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();
        for (ttl, expected_ms) in [
            ("250ms", 250),
            ("30s", 30_000),
            ("5m", 300_000),
            ("1h", 3_600_000),
            ("1m30s", 90_000),
            ("1500", 1_500),
        ] {
            let grant = api
                .lock(&unique_name("duration"))
                .acquire(&[("ttl", ttl)])
                .await;
            assert_eq!(grant.ttl_ms, expected_ms, "ttl={ttl}");
        }
        let lock = api.lock(&unique_name("duration"));
        let response = api
            .send(
                Method::POST,
                &["v1", "locks", lock.name()],
                &[],
                Body::Json(json!({"ttl": 1500})),
            )
            .await;
        let grant: Grant = expect_json(response, StatusCode::OK).await;
        assert_eq!(grant.ttl_ms, 1_500, "a JSON number is milliseconds");
    }

    #[apply(backends)]
    #[tokio::test]
    async fn parameters_come_from_query_json_or_form(backend: TestBackend) {
        let (_backend, sidecar) = setup(backend).await;
        let api = sidecar.api();
        let form = vec![
            ("owner".to_owned(), "form".to_owned()),
            ("ttl".to_owned(), "2s".to_owned()),
        ];
        let ways = [
            ("query", Body::Empty),
            ("json", Body::Json(json!({"owner": "json", "ttl": "2s"}))),
            ("form", Body::Form(form)),
        ];
        for (way, body) in ways {
            let name = unique_name(way);
            let query: &[(&str, &str)] = if way == "query" {
                &[("owner", "query"), ("ttl", "2s")]
            } else {
                &[]
            };
            let response = api
                .send(Method::POST, &["v1", "locks", &name], query, body)
                .await;
            let grant: Grant = expect_json(response, StatusCode::OK).await;
            assert_eq!((grant.owner.as_str(), grant.ttl_ms), (way, 2_000), "{way}");
        }
        // The same value in the query and the body is no conflict (`2000` and "2000" too).
        let response = api
            .send(
                Method::POST,
                &["v1", "locks", &unique_name("both")],
                &[("ttl", "2000")],
                Body::Json(json!({"ttl": 2000})),
            )
            .await;
        let grant: Grant = expect_json(response, StatusCode::OK).await;
        assert_eq!(grant.ttl_ms, 2_000);
    }
}

mod auth {
    use super::*;

    async fn assert_unauthorized(response: reqwest::Response) {
        let challenge = response
            .headers()
            .get(WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        assert!(
            challenge
                .as_deref()
                .is_some_and(|c| c.starts_with("Bearer")),
            "401 without `WWW-Authenticate: Bearer`: {challenge:?}"
        );
        assert_problem(response, StatusCode::UNAUTHORIZED, "unauthorized").await;
    }

    #[apply(backends)]
    #[tokio::test]
    async fn the_api_token_guards_v1_only(backend: TestBackend) {
        let backend = backend.start().await;
        let sidecar = backend
            .sidecar()
            .api_token(API_TOKEN)
            .admin_token(ADMIN_TOKEN)
            .start()
            .await;
        let name = unique_name("guarded");
        let info = ["v1", "info"];

        let anonymous = sidecar.api();
        assert_unauthorized(anonymous.get(&info, &[]).await).await;
        assert_unauthorized(anonymous.lock(&name).acquire_raw(&[]).await).await;
        let intruder = sidecar.api_with_token("wrong-token");
        assert_unauthorized(intruder.get(&info, &[]).await).await;
        assert_unauthorized(intruder.lock(&name).acquire_raw(&[]).await).await;

        let user = sidecar.api_with_token(API_TOKEN);
        let reported = user.info().await;
        assert_members(
            &reported["auth"],
            json!({"api_token": true, "admin_token": true}),
        );
        assert!(
            user.lock(&name).inspect().await.holders.is_empty(),
            "a refused acquire took the lock"
        );
        user.lock(&name).acquire(&[]).await;
        // The admin token is accepted on /v1 too.
        sidecar.api_with_token(ADMIN_TOKEN).info().await;

        for open in ["healthz", "readyz", "metrics", "openapi.json"] {
            let response = anonymous.get(&[open], &[]).await;
            assert_eq!(response.status(), StatusCode::OK, "/{open} needs no token");
        }
    }

    #[apply(backends)]
    #[tokio::test]
    async fn the_admin_api_is_forbidden_without_an_admin_token(backend: TestBackend) {
        let backend = backend.start().await;
        let plain = backend.start_sidecar().await;
        let guarded = backend.sidecar().api_token(API_TOKEN).start().await;
        let forbidden = StatusCode::FORBIDDEN;

        for api in [
            plain.api(),
            plain.api_with_token("anything"),
            guarded.api_with_token(API_TOKEN),
        ] {
            let lock = api.lock(&unique_name("unadministered"));
            let grant = lock.acquire(&[]).await;
            assert_problem(lock.force_release_raw().await, forbidden, "forbidden").await;
            lock.keepalive(&grant.token, &[]).await;
        }
    }

    #[apply(backends)]
    #[tokio::test]
    async fn force_release_needs_the_admin_token(backend: TestBackend) {
        let backend = backend.start().await;
        let sidecar = backend
            .sidecar()
            .api_token(API_TOKEN)
            .admin_token(ADMIN_TOKEN)
            .start()
            .await;
        let user = sidecar.api_with_token(API_TOKEN);
        let admin = sidecar.api_with_token(ADMIN_TOKEN);
        let lock = user.lock(&unique_name("administered"));
        let grant = lock.acquire(&[("owner", "holder")]).await;

        assert_unauthorized(sidecar.api().lock(lock.name()).force_release_raw().await).await;
        assert_unauthorized(
            sidecar
                .api_with_token("wrong-token")
                .lock(lock.name())
                .force_release_raw()
                .await,
        )
        .await;
        assert_problem(
            lock.force_release_raw().await,
            StatusCode::FORBIDDEN,
            "forbidden",
        )
        .await;
        lock.keepalive(&grant.token, &[]).await;

        assert_eq!(admin.lock(lock.name()).force_release().await, 1);
        lock.keepalive_lost(&grant.token).await;
        lock.release_lost(&grant.token).await;
        assert!(lock.inspect().await.holders.is_empty());
        // "Every force-release is logged with who and what."
        eventually(
            "the force-release to be logged",
            EVENT_TIMEOUT,
            async || {
                let log = sidecar.log();
                log.lines()
                    .any(|line| line.contains(lock.name()) && line.to_lowercase().contains("force"))
                    .then_some(())
            },
        )
        .await;

        let semaphore = user.semaphore(&unique_name("administered"));
        let permits = max_permits(backend.backend(), 2);
        for _ in 0..permits {
            semaphore.acquire(&[("limit", &permits.to_string())]).await;
        }
        assert_eq!(
            admin.semaphore(semaphore.name()).force_release().await,
            u64::from(permits)
        );
        assert!(semaphore.inspect().await.holders.is_empty());
    }
}

mod lifecycle {
    use super::*;

    /// A sidecar shutting down releases the holds granted through it, and
    /// only those: a lease its owner re-entered through another sidecar
    /// keeps that hold (no stranger is granted), and its client there
    /// releases it last. (It
    /// released every hold of the token: the hold taken through the other
    /// sidecar was let go behind its client's back, and a stranger was
    /// granted while that client still counted on the lock.)
    #[apply(shared_backends)]
    #[tokio::test]
    async fn a_sidecar_shutting_down_releases_only_the_holds_it_granted(backend: TestBackend) {
        let zookeeper = backend == TestBackend::ZooKeeper;
        let backend = backend.start().await;
        let mut a = backend.sidecar().shutdown_grace("5s").start().await;
        let b = backend.start_sidecar().await;
        let name = unique_name("shutdown-reentered");
        let (la, lb) = (a.api().lock(&name), b.api().lock(&name));
        let first = la.acquire(&[("owner", "worker"), ("ttl", "60s")]).await;
        let second = lb.acquire(&[("owner", "worker"), ("ttl", "60s")]).await;
        assert_eq!(
            (second.token.as_str(), second.count),
            (first.token.as_str(), 2)
        );
        // On ZooKeeper the lease ends when the stopping sidecar closes its
        // session, after its background tasks (up to the grace): the
        // stranger waits for that.
        let wait = if zookeeper { "30s" } else { "4s" };
        let stranger = {
            let lb = lb.clone();
            tokio::spawn(async move {
                lb.acquire_raw(&[("owner", "stranger"), ("wait", wait)])
                    .await
            })
        };
        a.terminate();
        let status = a.wait_exit(Duration::from_secs(5) + TIMING_SLACK).await;
        assert_eq!(status.code(), Some(0), "exit status {status}");
        let stranger = stranger.await.expect("the stranger's task");
        if zookeeper {
            // A lease is a node of the session of the sidecar that created
            // it: it ends with that sidecar, and its holder through another
            // sidecar is told so (README, ZooKeeper).
            assert_eq!(
                stranger.status(),
                StatusCode::OK,
                "{:?}",
                stranger.text().await
            );
            lb.keepalive_lost(&first.token).await;
            return;
        }
        assert_eq!(
            stranger.status(),
            StatusCode::CONFLICT,
            "a stranger was granted while the lease was held through the other sidecar: {:?}",
            stranger.text().await
        );
        let state = lb.inspect().await;
        let holder = state
            .holders
            .iter()
            .find(|h| h.owner == "worker")
            .unwrap_or_else(|| panic!("the re-entered lease was released: {state:?}"));
        assert_eq!(holder.count, 1, "{state:?}");
        assert_eq!(
            lb.release(&first.token).await,
            Released {
                released: true,
                count: 0
            }
        );
    }

    #[apply(backends)]
    #[tokio::test]
    async fn sigterm_ends_holds_releases_and_exits_zero(backend: TestBackend) {
        const GRACE: Duration = Duration::from_secs(5);
        let backend = backend.start().await;
        let mut sidecar = backend.sidecar().shutdown_grace("5s").start().await;
        // A second sidecar on a shared backend checks that the locks are released.
        let observer = second_sidecar(&backend).await;
        let lock = sidecar.api().lock(&unique_name("shutdown"));
        let mut holder = lock.hold(&[("owner", "holder")]).await;
        holder.expect_acquired().await;
        let mut waiter = queue_hold(&lock, "waiter", 1).await;

        let terminated = Instant::now();
        sidecar.terminate();
        assert_eq!(holder.expect_lost().await, "shutdown");
        // The holder lets go: its lease is released then.
        drop(holder);
        let rest = waiter.until_end().await;
        assert!(
            rest.iter().all(|event| match event {
                HoldEvent::Queued(_) => true,
                HoldEvent::Lost(reason) => reason == "shutdown",
                _ => false,
            }),
            "the waiter must not be granted during shutdown: {rest:?}"
        );

        let status = sidecar.wait_exit(GRACE + TIMING_SLACK).await;
        assert_eq!(status.code(), Some(0), "exit status {status}");
        let took = terminated.elapsed();
        assert!(took <= GRACE + TIMING_SLACK, "shutdown took {took:?}");

        if let Some(observer) = observer {
            let state = observer.api().lock(lock.name()).inspect().await;
            assert!(
                state.holders.is_empty() && state.waiters.is_empty(),
                "{state:?}"
            );
        }
    }

    /// Hold streams through sidecar `a` (stopping with `grace`), each
    /// acquired, and owner `next` queued behind them through sidecar `b`.
    struct HeldWhileStopping {
        a: SidecarGuard,
        _b: SidecarGuard,
        holders: Vec<HoldStream>,
        grants: Vec<Grant>,
        /// When (Unix ms) and how `next` was answered.
        waiter: tokio::task::JoinHandle<(u64, reqwest::Response)>,
    }

    /// [`HeldWhileStopping`] on a fresh lock (a semaphore of `limit`
    /// permits, with one), one hold per entry of `holds`.
    async fn held_while_stopping(
        backend: &BackendGuard,
        grace: &str,
        limit: Option<u32>,
        holds: &[Params<'_>],
    ) -> HeldWhileStopping {
        let a = backend.sidecar().shutdown_grace(grace).start().await;
        let b = backend.start_sidecar().await;
        let name = unique_name("held-while-stopping");
        let limit = limit.map(|l| l.to_string());
        let on = |api: Api| match limit {
            Some(_) => api.semaphore(&name),
            None => api.lock(&name),
        };
        let (mut holders, mut grants) = (Vec::new(), Vec::new());
        for (i, params) in holds.iter().enumerate() {
            let owner = format!("holder-{i}");
            let mut asked = vec![("owner", owner.as_str())];
            asked.extend_from_slice(params);
            asked.extend(limit.as_deref().map(|l| ("limit", l)));
            let mut holder = on(a.api()).hold(&asked).await;
            grants.push(holder.expect_acquired().await);
            holders.push(holder);
        }
        let (lock, observer) = (on(b.api()), on(b.api()));
        let waiter = tokio::spawn(async move {
            let mut asked = vec![("owner", "next"), ("wait", "30s")];
            asked.extend(limit.as_deref().map(|l| ("limit", l)));
            let answer = lock.acquire_raw(&asked).await;
            (now_ms(), answer)
        });
        eventually("the waiter queued", Duration::from_secs(10), async || {
            (observer.inspect().await.waiters.len() == 1).then_some(())
        })
        .await;
        HeldWhileStopping {
            a,
            _b: b,
            holders,
            grants,
            waiter,
        }
    }

    /// The safety checker's failure: a holder told `lost` on SIGTERM may act
    /// as the holder until it reads it, so the lease goes to another only
    /// once its client lets go (closes the stream), however long it takes to
    /// read — never while the event sits unread. A client that reads it
    /// frees the lock at once. For every kind: an exclusive hold, shared
    /// holds an exclusive claim waits behind, and every permit of a
    /// semaphore of 2 (Redlock: of 1, the most it bounds).
    #[apply(shared_backends)]
    #[tokio::test]
    async fn sigterm_gives_a_hold_away_only_once_its_client_lets_go(backend: TestBackend) {
        const HOLD: Params = &[("ttl", "30s")];
        const SHARED: Params = &[("ttl", "30s"), ("mode", "shared")];
        let permits = max_permits(backend, 2);
        let backend = backend.start().await;
        let every_permit = vec![HOLD; permits as usize];
        let shapes: [(&str, Option<u32>, &[Params]); 3] = [
            ("an exclusive hold", None, &[HOLD]),
            ("two shared holds", None, &[SHARED, SHARED]),
            ("every permit of a semaphore", Some(permits), &every_permit),
        ];
        for (what, limit, holds) in shapes {
            let mut held = held_while_stopping(&backend, "20s", limit, holds).await;
            held.a.terminate();
            // The holders' clients are busy (a GC pause, a long step) and
            // read nothing for a while: the leases are still theirs.
            tokio::time::sleep(Duration::from_secs(2)).await;
            assert!(
                !held.waiter.is_finished(),
                "{what}: granted to another before the holders read `lost`: {:?}",
                held.waiter.await
            );
            for holder in &mut held.holders {
                assert_eq!(holder.expect_lost().await, "shutdown", "{what}");
            }
            let let_go = now_ms();
            held.holders.clear();
            let (granted_at, answer) = within("the waiter's grant", EVENT_TIMEOUT, held.waiter)
                .await
                .expect("the waiter's task");
            assert_eq!(
                answer.status(),
                StatusCode::OK,
                "{what}: {:?}",
                answer.text().await
            );
            assert!(granted_at >= let_go, "{what}");
            let status = held.a.wait_exit(EVENT_TIMEOUT).await;
            assert_eq!(status.code(), Some(0), "{what}: exit status {status}");
        }
    }

    /// A holder that never lets go after `lost` does not keep the sidecar
    /// past its grace, and its lease is not released under it: it lapses
    /// at its expiry (on ZooKeeper it ends with the stopped sidecar's
    /// session, at the end of the grace).
    #[apply(shared_backends)]
    #[tokio::test]
    async fn sigterm_leaves_a_hold_whose_client_never_lets_go_to_lapse(backend: TestBackend) {
        const GRACE: Duration = Duration::from_secs(2);
        let zookeeper = backend == TestBackend::ZooKeeper;
        let backend = backend.start().await;
        let mut held = held_while_stopping(&backend, "2s", None, &[&[("ttl", "6s")]]).await;
        let grant = &held.grants[0];

        let (terminated, terminated_ms) = (Instant::now(), now_ms());
        held.a.terminate();
        let status = held.a.wait_exit(GRACE + TIMING_SLACK).await;
        assert_eq!(status.code(), Some(0), "exit status {status}");
        let took = terminated.elapsed();
        assert!(took <= GRACE + TIMING_SLACK, "shutdown took {took:?}");
        let (granted_ms, answer) =
            within("the waiter's grant", Duration::from_secs(20), held.waiter)
                .await
                .expect("the waiter's task");
        assert_eq!(answer.status(), StatusCode::OK, "{:?}", answer.text().await);
        let not_before = if zookeeper {
            (terminated_ms + GRACE.as_millis() as u64).min(grant.expires_at_ms)
        } else {
            grant.expires_at_ms
        };
        assert!(
            granted_ms + 5 >= not_before,
            "granted to another at {granted_ms}, before {not_before} (the lease's expiry {}, \
             SIGTERM at {terminated_ms})",
            grant.expires_at_ms
        );
    }

    /// A hold left to lapse at shutdown (its client never let go) ends as a
    /// loss, not a release: its lock-delay runs from its expiry, as for any
    /// holder that may still act.
    #[apply(shared_backends)]
    #[tokio::test]
    async fn sigterm_keeps_the_lock_delay_of_a_hold_left_to_lapse(backend: TestBackend) {
        let backend = backend.start().await;
        let delayed: Params = &[("ttl", "2s"), ("lock_delay", "3s")];
        let mut held = held_while_stopping(&backend, "5s", None, &[delayed]).await;
        let expires_at_ms = held.grants[0].expires_at_ms;
        held.a.terminate();
        let (granted_ms, answer) =
            within("the waiter's grant", Duration::from_secs(25), held.waiter)
                .await
                .expect("the waiter's task");
        assert_eq!(answer.status(), StatusCode::OK, "{:?}", answer.text().await);
        let not_before = expires_at_ms + 3000;
        assert!(
            granted_ms + 5 >= not_before,
            "granted to another at {granted_ms}, before the lease's expiry {expires_at_ms} \
             plus its lock-delay"
        );
        let status = held.a.wait_exit(EVENT_TIMEOUT).await;
        assert_eq!(status.code(), Some(0), "exit status {status}");
    }

    /// Clients that close their hold streams as SIGTERM arrives (their pods
    /// stop too) leave nothing held: each lease's other holds through the
    /// sidecar (a plain re-entry of the same owner) go with its stream, as
    /// SIGTERM releases everything.
    #[apply(shared_backends)]
    #[tokio::test]
    async fn holds_closed_as_sigterm_arrives_leave_nothing_held(backend: TestBackend) {
        use nix::sys::signal::Signal;
        const LOCKS: usize = 8;
        let backend = backend.start().await;
        let mut a = backend.sidecar().shutdown_grace("5s").start().await;
        let b = backend.start_sidecar().await;
        let names: Vec<String> = (0..LOCKS)
            .map(|i| format!("{}-{i}", unique_name("closed-at-sigterm")))
            .collect();
        let mut streams = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let owner = format!("owner-{i}");
            let lock = a.api().lock(name);
            let mut hold = lock.hold(&[("owner", &owner), ("ttl", "60s")]).await;
            let held = hold.expect_acquired().await;
            let again = lock.acquire(&[("owner", &owner), ("ttl", "60s")]).await;
            assert_eq!(
                (again.token.as_str(), again.count),
                (held.token.as_str(), 2)
            );
            streams.push(hold);
        }
        // Stopped, the sidecar finds the closed streams and the signal
        // together when it resumes.
        a.signal(Signal::SIGSTOP);
        drop(streams);
        tokio::time::sleep(Duration::from_millis(200)).await;
        a.terminate();
        a.signal(Signal::SIGCONT);
        let status = a.wait_exit(Duration::from_secs(5) + TIMING_SLACK).await;
        assert_eq!(status.code(), Some(0), "exit status {status}");
        for name in &names {
            let state = b.api().lock(name).inspect().await;
            assert!(state.holders.is_empty(), "{name} still held: {state:?}");
        }
    }

    #[apply(backends)]
    #[tokio::test]
    async fn flags_override_env_which_overrides_the_config_file(backend: TestBackend) {
        // The default ttl must fit under every max_ttl used here.
        const FILE: &str = "default_ttl = \"500ms\"\nmax_ttl = \"1s\"\n";
        async fn max_ttl_ms(sidecar: SidecarBuilder) -> u64 {
            let sidecar = sidecar.start().await;
            let info = sidecar.api().info().await;
            info["limits"]["max_ttl_ms"]
                .as_u64()
                .unwrap_or_else(|| panic!("no limits.max_ttl_ms: {info}"))
        }
        let backend = backend.start().await;
        let file = || backend.sidecar().config_toml(FILE);

        assert_eq!(max_ttl_ms(file()).await, 1_000, "file");
        assert_eq!(
            max_ttl_ms(file().env("SIDELOCK_MAX_TTL", "2s")).await,
            2_000,
            "env over file"
        );
        assert_eq!(
            max_ttl_ms(file().env("SIDELOCK_MAX_TTL", "2s").max_ttl("3s")).await,
            3_000,
            "flag over env"
        );

        // The file's value is enforced, not just reported.
        let sidecar = file().start().await;
        let response = sidecar
            .api()
            .lock(&unique_name("config"))
            .acquire_raw(&[("ttl", "1500ms")])
            .await;
        assert_problem(response, StatusCode::BAD_REQUEST, "out-of-range").await;
    }
}

/// `/openapi.json` is a valid OpenAPI 3.1 document by a real validator, so
/// code generators and schemathesis can rely on it (every response has its
/// required `description`, every `$ref` resolves).
#[tokio::test]
async fn the_openapi_document_passes_openapi_spec_validator() {
    let validator =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/openapi-spec-validator");
    assert!(
        validator.exists(),
        "{} is missing: run scripts/setup.sh, which builds .venv from tests/fuzz/requirements.txt",
        validator.display()
    );
    let sidecar = SidecarBuilder::new("memory://")
        .api_token(API_TOKEN)
        .admin_token(ADMIN_TOKEN)
        .start()
        .await;
    let response = reqwest::get(format!("{}/openapi.json", sidecar.base_url()))
        .await
        .expect("GET /openapi.json");
    assert_eq!(response.status(), StatusCode::OK);
    let document = response.bytes().await.expect("the document's body");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("openapi.json");
    std::fs::write(&path, &document).expect("write the document");
    let out = std::process::Command::new(&validator)
        .arg(&path)
        .output()
        .expect("run openapi-spec-validator");
    assert!(
        out.status.success(),
        "openapi-spec-validator rejects /openapi.json:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
