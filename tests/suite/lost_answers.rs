//! Answers lost on their way back from the backend (a cutting proxy in
//! front of it resets the connection after the backend ran the call): the
//! grants they hide are given back in the background, once, and never by
//! a second run of a release whose own answer was lost. The same checks
//! for every backend whose answers can be lost (Redis, PostgreSQL); each
//! backend's tests set up the proxy, a sidecar through it (`through`) and
//! one straight on the backend (`direct`).

use std::time::{Duration, Instant};

use reqwest::StatusCode;

use crate::common::proxy::CuttingProxy;
use crate::common::{SidecarGuard, unique_name, within};

/// An acquire whose answer is lost after the backend granted it answers
/// 503 — and the lease it made, which nobody holds, is released in the
/// background: another owner gets the lock (a writer, after a lost read
/// lease; the one permit of a semaphore) within seconds, not when that
/// lease's ttl ends.
pub async fn a_lost_grant_is_released(
    proxy: &CuttingProxy,
    through_proxy: &SidecarGuard,
    direct: &SidecarGuard,
) {
    for kind in ["exclusive", "shared", "semaphore"] {
        let name = unique_name("grant-lost");
        let owner = unique_name("owner");
        let resource = |s: &SidecarGuard| {
            if kind == "semaphore" {
                s.api().semaphore(&name)
            } else {
                s.api().lock(&name)
            }
        };
        let mut lost_params = vec![("owner", owner.as_str()), ("ttl", "60s")];
        match kind {
            "shared" => lost_params.push(("mode", "shared")),
            "semaphore" => lost_params.push(("limit", "1")),
            _ => {}
        }
        // Loads the scripts or prepares the statement, so that the cut
        // call is the acquire itself.
        let through = resource(through_proxy);
        let warm = through.acquire(&lost_params[2..]).await;
        through.release(&warm.token).await;

        proxy.cut_after(owner.as_bytes());
        let lost = through.acquire_raw(&lost_params).await;
        assert!(!proxy.armed(), "{kind}: the acquire went through the proxy");
        assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE, "{kind}");
        let started = Instant::now();
        let mut params = vec![("owner", "other"), ("wait", "20s")];
        if kind == "semaphore" {
            params.push(("limit", "1"));
        }
        let other = resource(direct).acquire(&params).await;
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{kind}: granted after {:?}: the unanswered lease had to run out",
            started.elapsed()
        );
        resource(direct).release(&other.token).await;
    }
}

/// The background release of a grant whose answer was lost takes that
/// grant's one hold, once: the owner, who asked again at once and
/// re-entered the lost grant (count 2), keeps its own hold. `rounds` is
/// how long the background release's rounds take on this backend.
pub async fn a_re_entered_lost_grant_is_released_once(
    proxy: &CuttingProxy,
    through_proxy: &SidecarGuard,
    direct: &SidecarGuard,
    rounds: Duration,
) {
    let (name, owner) = lose_a_grant(proxy, through_proxy, "re-entered").await;
    // The owner asks again at once (through the other sidecar) and
    // re-enters the grant it was not told of.
    let other_lock = direct.api().lock(&name);
    let again = other_lock
        .acquire(&[("owner", &owner), ("ttl", "60s")])
        .await;
    assert_eq!(again.count, 2, "the owner re-entered the lost grant");
    tokio::time::sleep(rounds).await;
    assert_owner_keeps_its_hold(direct, &name, &again.token).await;
}

/// The background release of a grant whose answer was lost is not sent
/// again when its own answer is lost (it may have run): the owner, who had
/// asked again and re-entered the lost grant (count 2), keeps its one hold.
/// It was sent again after a pause, and its second run took the owner's
/// own hold — the lease was deleted under it and another owner got the
/// lock.
pub async fn a_lost_grants_release_whose_answer_is_lost_is_not_sent_again(
    proxy: &CuttingProxy,
    through_proxy: &SidecarGuard,
    direct: &SidecarGuard,
) {
    let (name, owner) = lose_a_grant(proxy, through_proxy, "twice-lost").await;
    // The next call on this lock through the proxy is the background
    // release (250 ms after the lost answer): it runs, its answer is lost.
    proxy.cut_after(name.as_bytes());
    let again = direct
        .api()
        .lock(&name)
        .acquire(&[("owner", &owner), ("ttl", "60s")])
        .await;
    assert_eq!(
        again.count, 2,
        "the owner re-entered the lost grant (before its background release)"
    );
    within("the background release", Duration::from_secs(5), async {
        while proxy.armed() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // Past any retry and second round of the background release.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_owner_keeps_its_hold(direct, &name, &again.token).await;
}

/// A waiter's sidecar handed the lock when it is at its `--max-held` cap
/// gives that lease back. Here the owner asked again through another
/// sidecar before the give-back arrived and re-entered the handed lease
/// (count 2); the give-back ran (2 → 1) and its answer was lost. It must
/// not be sent again: it was, in the background, and its second run took
/// the owner's own hold — the lease was deleted under it and another owner
/// got the lock.
/// `full` runs through the proxy with `--max-held 1`; `ticket` reads the
/// token of the one waiter of lock `name` from the backend.
pub async fn a_lease_given_back_at_the_cap_whose_answer_is_lost_is_not_released_again(
    proxy: &CuttingProxy,
    full: &SidecarGuard,
    direct: &SidecarGuard,
    ticket: impl AsyncFn(&str) -> String,
) {
    let name = unique_name("cap-give-back");
    let owner = unique_name("owner");
    let through = full.api().lock(&name);
    let lock = direct.api().lock(&name);
    let (holder, waiter) = queue_behind_a_holder(&through, &lock, &owner, "20s").await;
    let ticket = ticket(&name).await;
    // The waiting sidecar reaches its cap (once the waiter's first try,
    // queued already, has given back the place it took: 429 until then).
    let filler = full.api().lock(&unique_name("filler"));
    crate::common::eventually(
        "a lease filling the cap",
        Duration::from_secs(5),
        async || {
            let r = filler.acquire_raw(&[("ttl", "60s")]).await;
            (r.status() == StatusCode::OK).then_some(())
        },
    )
    .await;
    // The give-back, the next call through the proxy naming the lease,
    // reaches the database a second late and its answer is lost.
    let late = Duration::from_secs(1);
    proxy.delay_request(ticket.as_bytes(), late);
    proxy.cut_later(ticket.as_bytes(), late + Duration::from_millis(300));
    lock.release(&holder.token).await;
    let again = lock.acquire(&[("owner", &owner), ("ttl", "60s")]).await;
    assert_eq!(
        (again.token.as_str(), again.count),
        (ticket.as_str(), 2),
        "the owner re-entered the lease handed to its waiter, before the give-back"
    );
    let refused = within("the waiter's answer", Duration::from_secs(20), waiter)
        .await
        .expect("the waiter's task");
    assert_eq!(
        refused.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "handed the lock at its cap"
    );
    assert!(!proxy.armed(), "the give-back went through the proxy");
    // Past the background retries (250 ms, then 500 ms, ...).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_holds_once(&lock, &owner, &again.token).await;
}

/// Has `lock` (through the direct sidecar) held by "holder" for 120 s and
/// `owner` wait `wait` behind it `through` the proxy, once the scripts are
/// loaded or the statements prepared there (a release's included): the
/// holder's grant, and the waiter's request under way.
pub async fn queue_behind_a_holder(
    through: &crate::common::api::Resource,
    lock: &crate::common::api::Resource,
    owner: &str,
    wait: &str,
) -> (
    crate::common::api::Grant,
    tokio::task::JoinHandle<reqwest::Response>,
) {
    let warm = through.acquire(&[]).await;
    through.release(&warm.token).await;
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "120s")]).await;
    let waiter = {
        let (through, owner, wait) = (through.clone(), owner.to_owned(), wait.to_owned());
        tokio::spawn(async move {
            through
                .acquire_raw(&[("owner", &owner), ("wait", &wait), ("ttl", "60s")])
                .await
        })
    };
    lock.wait_for_waiters(&[owner]).await;
    (holder, waiter)
}

/// Asserts that `owner` alone holds the lock of `lock`, once (by `token`),
/// that another owner is refused it, and releases that one hold.
pub async fn assert_holds_once(lock: &crate::common::api::Resource, owner: &str, token: &str) {
    let state = lock.inspect().await;
    assert_eq!(
        state
            .holders
            .iter()
            .map(|h| (h.owner.as_str(), h.count))
            .collect::<Vec<_>>(),
        [(owner, 1)],
        "the owner keeps its one hold: {state:?}"
    );
    let intruder = lock.acquire_raw(&[("owner", "intruder")]).await;
    assert_eq!(
        intruder.status(),
        StatusCode::CONFLICT,
        "another owner got the lock its owner holds"
    );
    assert_eq!(lock.release(token).await.count, 0);
}

/// Has a lock named after `prefix` granted through the proxy to a new
/// owner, the answer lost (503): the lock's name and the owner.
async fn lose_a_grant(
    proxy: &CuttingProxy,
    through_proxy: &SidecarGuard,
    prefix: &str,
) -> (String, String) {
    let name = unique_name(prefix);
    let owner = unique_name("owner");
    let lock = through_proxy.api().lock(&name);
    // Loads the scripts or prepares the statement, so that the cut call is
    // the acquire itself.
    let warm = lock.acquire(&[]).await;
    lock.release(&warm.token).await;

    proxy.cut_after(owner.as_bytes());
    let lost = lock.acquire_raw(&[("owner", &owner), ("ttl", "60s")]).await;
    assert!(!proxy.armed(), "the acquire went through the proxy");
    assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE);
    (name, owner)
}

/// The owner of `token`, which re-entered a lost grant, still holds lock
/// `name` once: its keepalive works, another owner is refused, and its one
/// release leaves nothing.
async fn assert_owner_keeps_its_hold(direct: &SidecarGuard, name: &str, token: &str) {
    let lock = direct.api().lock(name);
    let kept = lock.keepalive_raw(token, &[]).await;
    assert_eq!(
        kept.status(),
        StatusCode::OK,
        "the owner's hold was released under it"
    );
    let intruder = lock.acquire_raw(&[("owner", "intruder")]).await;
    assert_eq!(
        intruder.status(),
        StatusCode::CONFLICT,
        "another owner got the lock its owner holds"
    );
    let released = lock.release(token).await;
    assert_eq!(released.count, 0, "the owner's one hold was left");
}

/// A join through the proxy whose answer was lost after the backend queued
/// it, behind a holder through the direct sidecar.
struct LostJoin {
    /// The lost join's owner.
    owner: String,
    /// The lock through the proxied sidecar.
    through: crate::common::api::Resource,
    /// The lock through the direct sidecar.
    lock: crate::common::api::Resource,
    /// The holder the join queued behind.
    holder: crate::common::api::Grant,
}

/// Makes a [`LostJoin`] on a new lock named from `prefix`, the join asking
/// for `ttl`; returns once its 503 is back.
async fn lose_a_join(
    prefix: &str,
    proxy: &CuttingProxy,
    through_proxy: &SidecarGuard,
    direct: &SidecarGuard,
    ttl: &str,
) -> LostJoin {
    let name = unique_name(prefix);
    let owner = unique_name("owner");
    let through = through_proxy.api().lock(&name);
    let warm = through.acquire(&[]).await;
    through.release(&warm.token).await;
    let lock = direct.api().lock(&name);
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "120s")]).await;

    proxy.cut_after(owner.as_bytes());
    let lost = through
        .acquire_raw(&[("owner", &owner), ("wait", "30s"), ("ttl", ttl)])
        .await;
    assert!(!proxy.armed(), "the join went through the proxy");
    assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE);
    LostJoin {
        owner,
        through,
        lock,
        holder,
    }
}

/// Past the background release's first look at a [`LostJoin`] (which
/// finds it queued, holding nothing; `answered` is when its 503 came
/// back), releases the holder, so that the lock is handed to the lost join,
/// and asks again for its owner, which re-enters that lease.
async fn hand_over_and_re_enter(join: &LostJoin, answered: Instant) -> crate::common::api::Grant {
    tokio::time::sleep(Duration::from_millis(900).saturating_sub(answered.elapsed())).await;
    join.lock.release(&join.holder.token).await;
    let again = join
        .through
        .acquire(&[("owner", &join.owner), ("ttl", "60s")])
        .await;
    assert_eq!(
        again.count, 2,
        "the retry re-enters the lease handed to the lost join"
    );
    again
}

/// A join whose answer is lost after the backend queued it leaves a queue
/// entry nobody waits for; a release that hands the lock to that entry
/// before it is removed as nobody's makes a lease nobody holds, which kept
/// the lock for its ttl (PostgreSQL: the background release had looked for
/// a lease only at about 0.25 s and 5.25 s). That lease is given back
/// within seconds: the next waiter is granted within `within`. The lost
/// join asks for `ttl`.
pub async fn a_lock_handed_to_a_join_whose_answer_was_lost_is_given_back(
    proxy: &CuttingProxy,
    through_proxy: &SidecarGuard,
    direct: &SidecarGuard,
    ttl: &str,
    within: &str,
) {
    let LostJoin { lock, holder, .. } =
        lose_a_join("ghost-join", proxy, through_proxy, direct, ttl).await;
    // Past the background release's first look and its second round.
    tokio::time::sleep(Duration::from_millis(6500)).await;
    lock.release(&holder.token).await;
    let started = Instant::now();
    let next = lock
        .acquire_raw(&[("owner", "next"), ("wait", within)])
        .await;
    assert_eq!(
        next.status(),
        StatusCode::OK,
        "the lock handed to the lost join's row (ttl {ttl}) still blocks after {:?}: {:?}",
        started.elapsed(),
        lock.inspect().await
    );
}

/// A join whose answer was lost, handed the lock and then re-entered by
/// its owner's retry, leaves the owner its one hold: of the two clean-ups
/// of the lost grant — the background release of its token, and the
/// give-back of a lock handed to a ticket this sidecar never knew — only
/// one takes the lost grant's hold. (Both did: the background release took
/// it, then the give-back found one hold left and passed the lock to the
/// next waiter while the owner still held it.)
pub async fn a_lost_join_handed_the_lock_and_re_entered_holds_once(
    proxy: &CuttingProxy,
    through_proxy: &SidecarGuard,
    direct: &SidecarGuard,
) {
    let join = lose_a_join("ghost-reentered", proxy, through_proxy, direct, "60s").await;
    let LostJoin {
        owner,
        through,
        lock,
        ..
    } = &join;
    let answered = Instant::now();
    // The next waiter, queued behind the lost join.
    let next = {
        let lock = lock.clone();
        tokio::spawn(async move {
            lock.acquire_raw(&[("owner", "next"), ("wait", "30s")])
                .await
        })
    };
    lock.wait_for_waiters(&[owner.as_str(), "next"]).await;
    let again = hand_over_and_re_enter(&join, answered).await;
    // Past the background release's second round (2.25 s) and the
    // give-back of the handoff (2 s after it).
    tokio::time::sleep(Duration::from_millis(3500).saturating_sub(answered.elapsed())).await;
    let state = lock.inspect().await;
    assert_eq!(
        state
            .holders
            .iter()
            .map(|h| (h.owner.as_str(), h.count))
            .collect::<Vec<_>>(),
        [(owner.as_str(), 1)],
        "the owner keeps its one hold, and nobody else holds: {state:?}"
    );
    assert!(
        !next.is_finished(),
        "the next waiter was granted while the owner held the lock"
    );
    assert_eq!(through.release(&again.token).await.count, 0);
    let next = next.await.expect("the next waiter's task");
    assert_eq!(next.status(), StatusCode::OK);
}

/// Two lost joins on one lock: the first handed the lock and re-entered
/// by its owner (its release took the lost grant's hold), the second
/// handed the lock when that owner releases, after its own release found
/// nothing. The second's lease is given back within seconds: leaving a
/// lease to a lost join's release is decided by its token, not by the lock.
pub async fn a_second_lost_join_handed_the_lock_is_given_back(
    proxy: &CuttingProxy,
    through_proxy: &SidecarGuard,
    direct: &SidecarGuard,
) {
    let join = lose_a_join("ghost-pair", proxy, through_proxy, direct, "60s").await;
    let LostJoin { through, lock, .. } = &join;
    let answered = Instant::now();
    let again = hand_over_and_re_enter(&join, answered).await;
    // The second lost join, queued behind that lease, and a waiter behind it.
    let second = unique_name("second");
    proxy.cut_after(second.as_bytes());
    let lost = through
        .acquire_raw(&[("owner", &second), ("wait", "30s"), ("ttl", "60s")])
        .await;
    assert!(!proxy.armed(), "the second join went through the proxy");
    assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE);
    let next = {
        let lock = lock.clone();
        tokio::spawn(async move {
            lock.acquire_raw(&[("owner", "next"), ("wait", "30s")])
                .await
        })
    };
    lock.wait_for_waiters(&[second.as_str(), "next"]).await;
    // Past both background releases' second rounds (the first took its
    // hold, the second found its join still queued).
    tokio::time::sleep(Duration::from_millis(4500).saturating_sub(answered.elapsed())).await;
    assert_eq!(through.release(&again.token).await.count, 0);
    let released = Instant::now();
    let next = within(
        "the next waiter is granted",
        Duration::from_secs(20),
        async { next.await.expect("the next waiter's task") },
    )
    .await;
    assert_eq!(next.status(), StatusCode::OK);
    assert!(
        released.elapsed() < Duration::from_secs(8),
        "the lock handed to the second lost join was held {:?}",
        released.elapsed()
    );
}

/// A waiter woken by a release, whose look loses its connection after the
/// backend granted it (a read lease; the permit of a semaphore of 1, or
/// the one left of a semaphore of 2), keeps waiting: it is answered the
/// grant its look made — one hold — not 503 with most of its wait left
/// while the backend was there, and not a second hold.
pub async fn a_waiter_whose_look_loses_its_connection_holds_once(
    proxy: &CuttingProxy,
    through_proxy: &SidecarGuard,
    direct: &SidecarGuard,
) {
    for kind in ["shared", "semaphore", "semaphore of 2"] {
        let name = unique_name("look-cut");
        let owner = unique_name("waiter");
        let resource = |s: &SidecarGuard| {
            if kind == "shared" {
                s.api().lock(&name)
            } else {
                s.api().semaphore(&name)
            }
        };
        let own: &[(&str, &str)] = match kind {
            "shared" => &[],
            "semaphore" => &[("limit", "1")],
            _ => &[("limit", "2")],
        };
        let with = |params: &[(&'static str, &'static str)]| {
            let mut all = params.to_vec();
            all.extend_from_slice(own);
            all
        };
        if kind == "semaphore of 2" {
            resource(direct)
                .acquire(&with(&[("owner", "keeper"), ("ttl", "60s")]))
                .await;
        }
        let blocker = resource(direct)
            .acquire(&with(&[("owner", "holder"), ("ttl", "60s")]))
            .await;
        let waiter = {
            let r = resource(through_proxy);
            let mut params = vec![
                ("owner", owner.clone()),
                ("wait", "30s".to_owned()),
                ("ttl", "60s".to_owned()),
            ];
            params.extend(own.iter().map(|&(k, v)| (k, v.to_owned())));
            if kind == "shared" {
                params.push(("mode", "shared".to_owned()));
            }
            tokio::spawn(async move {
                let params: Vec<(&str, &str)> =
                    params.iter().map(|(k, v)| (*k, v.as_str())).collect();
                r.acquire_raw(&params).await
            })
        };
        let view = resource(direct);
        crate::common::eventually("the waiter queued", Duration::from_secs(5), async || {
            (view.inspect().await.waiters.len() == 1).then_some(())
        })
        .await;
        // Past the waiter's first look: the next one is the release's.
        tokio::time::sleep(Duration::from_millis(300)).await;
        proxy.cut_after(owner.as_bytes());
        view.release(&blocker.token).await;
        let answer = within("the waiter's answer", Duration::from_secs(20), waiter)
            .await
            .expect("the waiter's task");
        assert!(
            !proxy.armed(),
            "{kind}: the waiter's look went through the proxy"
        );
        let grant: crate::common::api::Grant =
            crate::common::api::expect_json(answer, StatusCode::OK).await;
        assert_eq!(grant.count, 1, "{kind}: the waiter holds once");
        assert!(grant.fence > blocker.fence, "{kind}: {grant:?}");
        resource(through_proxy).release(&grant.token).await;
        let left = view.inspect().await;
        assert!(
            left.waiters.is_empty(),
            "{kind}: left in the queue: {left:?}"
        );
        // Its one hold released, a writer (or the last permit) gets in.
        let next = resource(direct)
            .acquire_raw(&with(&[("owner", "next"), ("wait", "5s")]))
            .await;
        assert_eq!(
            next.status(),
            StatusCode::OK,
            "{kind}: still held after the waiter's release: {:?}",
            view.inspect().await
        );
    }
}
