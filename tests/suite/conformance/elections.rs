//! Leader election, once per backend: campaigns on two sidecars, the
//! leader's death, observers, the readiness probe that follows the leader,
//! and the attacks on it — a second campaign of the same owner, a lock of
//! the same name, hostile values.

use crate::common;

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use rstest::rstest;
use rstest_reuse::apply;
use serde_json::Value;

use common::api::{Api, expect_json};
use common::*;

/// A campaign's stream, opened through `api`.
async fn campaign(api: &Api, election: &str, params: &[(&str, &str)]) -> SseStream {
    api.open_stream(&["v1", "elections", election, "campaign"], params)
        .await
}

async fn observe(api: &Api, election: &str) -> SseStream {
    api.open_stream(&["v1", "elections", election, "observe"], &[])
        .await
}

async fn election(api: &Api, election: &str) -> Value {
    api.get_json(&["v1", "elections", election], &[]).await
}

async fn ready(api: &Api, election: &str) -> StatusCode {
    api.get(&["v1", "elections", election, "ready"], &[])
        .await
        .status()
}

/// The next event, which must be `name`; its data.
async fn expect_event(stream: &mut SseStream, name: &str) -> Value {
    let event = stream
        .next()
        .await
        .unwrap_or_else(|| panic!("stream ended before `{name}`:\n{}", stream.raw()));
    assert_eq!(event.event, name, "{}", stream.raw());
    event.json()
}

/// Waits for the `leader` event of a campaign (skipping `follower` events).
async fn expect_leadership(stream: &mut SseStream, within: Duration) -> Value {
    stream
        .wait_for("a leader event", within, |e| e.event == "leader")
        .await
        .json()
}

/// Polls `…/ready` until it answers `status`.
async fn until_ready_is(api: &Api, name: &str, status: StatusCode) {
    eventually(
        &format!("{name}/ready answers {status}"),
        EVENT_TIMEOUT,
        async || (ready(api, name).await == status).then_some(()),
    )
    .await;
}

/// Two candidates on two sidecars: the first leads and publishes its value;
/// the second follows, seeing that leader; the leader's process dies (its
/// stream drops) and the second leads with a higher fence; an observer on
/// a third connection sees both leaders in order; `ready` follows the
/// leadership from one sidecar to the other.
#[apply(backends)]
#[tokio::test]
async fn the_leader_dies_and_the_follower_takes_over(backend: TestBackend) {
    let backend = backend.start().await;
    let sidecars = backend.sidecars(2).await;
    let (one, two) = (sidecars[0].api(), sidecars[sidecars.len() - 1].api());
    let name = unique_name("election");

    assert_eq!(ready(&one, &name).await, StatusCode::SERVICE_UNAVAILABLE);
    let mut observer = observe(&two, &name).await;
    assert_eq!(expect_event(&mut observer, "leader").await, Value::Null);

    let mut first = campaign(
        &one,
        &name,
        &[("owner", "pod-a"), ("value", "10.0.0.1:8080")],
    )
    .await;
    let won = expect_event(&mut first, "leader").await;
    assert_eq!(won["value"], "10.0.0.1:8080");
    let first_fence = won["fence"].as_u64().expect("fence");
    assert!(first_fence >= 1);
    assert_eq!(ready(&one, &name).await, StatusCode::OK);
    if sidecars.len() > 1 {
        assert_eq!(ready(&two, &name).await, StatusCode::SERVICE_UNAVAILABLE);
    }

    let mut second = campaign(
        &two,
        &name,
        &[("owner", "pod-b"), ("value", "10.0.0.2:8080")],
    )
    .await;
    let follower = expect_event(&mut second, "follower").await;
    assert_eq!(follower["leader"]["owner"], "pod-a");
    assert_eq!(follower["leader"]["value"], "10.0.0.1:8080");
    assert_eq!(follower["leader"]["fence"], first_fence);

    let seen = election(&two, &name).await;
    assert_eq!(seen["name"], name.as_str());
    assert_eq!(seen["leader"]["value"], "10.0.0.1:8080");
    assert_eq!(
        seen["leader"]["sidecar"],
        sidecars[0].api().sidecar_id().await
    );
    assert_eq!(seen["candidates"], 2);

    // The leader's process dies: its stream drops.
    let killed = Instant::now();
    drop(first);
    let took_over = expect_leadership(&mut second, EVENT_TIMEOUT).await;
    let failover = killed.elapsed();
    assert_eq!(took_over["value"], "10.0.0.2:8080");
    assert!(
        took_over["fence"].as_u64().expect("fence") > first_fence,
        "the new leader's fence {took_over} must exceed {first_fence}"
    );
    // A dropped stream resigns at once, not at the lease's expiry (30 s).
    assert!(
        failover < Duration::from_secs(5),
        "failover took {failover:?}"
    );

    until_ready_is(&two, &name, StatusCode::OK).await;
    if sidecars.len() > 1 {
        assert_eq!(ready(&one, &name).await, StatusCode::SERVICE_UNAVAILABLE);
    }

    // The observer saw pod-a, then (perhaps nobody between) pod-b.
    let mut leaders = Vec::new();
    while leaders
        .last()
        .map(|l: &Value| l["owner"] != "pod-b")
        .unwrap_or(true)
    {
        let event = observer
            .wait_for("a leader event", EVENT_TIMEOUT, |e| e.event == "leader")
            .await;
        let leader = event.json();
        if !leader.is_null() {
            leaders.push(leader);
        }
    }
    let owners: Vec<&str> = leaders
        .iter()
        .map(|l| l["owner"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(owners, ["pod-a", "pod-b"], "observed leaders: {leaders:?}");
    assert!(leaders[0]["fence"].as_u64() < leaders[1]["fence"].as_u64());

    drop(second);
    until_ready_is(&two, &name, StatusCode::SERVICE_UNAVAILABLE).await;
    let after = observer
        .wait_for("nobody leads", EVENT_TIMEOUT, |e| e.event == "leader")
        .await;
    assert_eq!(after.json(), Value::Null);
}

/// Re-entry is by owner for locks; two campaigns of one owner through one
/// sidecar must still not both lead.
#[apply(backends)]
#[tokio::test]
async fn two_campaigns_of_one_owner_do_not_both_lead(backend: TestBackend) {
    let backend = backend.start().await;
    let sidecar = backend.start_sidecar().await;
    let api = sidecar.api();
    let name = unique_name("same-owner");
    let mut first = campaign(&api, &name, &[("owner", "twin"), ("value", "one")]).await;
    expect_event(&mut first, "leader").await;
    let mut second = campaign(&api, &name, &[("owner", "twin"), ("value", "two")]).await;
    let follower = expect_event(&mut second, "follower").await;
    assert_eq!(follower["leader"]["value"], "one");
    assert!(
        second
            .next_within(Duration::from_millis(500))
            .await
            .is_err(),
        "the second campaign must keep waiting: {}",
        second.raw()
    );
    assert_eq!(election(&api, &name).await["candidates"], 2);
}

/// Election names never meet lock names: a held lock and a led election of
/// the same name are independent, and neither shows up as the other.
#[apply(backends)]
#[tokio::test]
async fn an_election_and_a_lock_of_one_name_are_independent(backend: TestBackend) {
    let backend = backend.start().await;
    let sidecar = backend.start_sidecar().await;
    let api = sidecar.api();
    let name = unique_name("shared-name");
    let lock = api.lock(&name);
    let held = lock.acquire(&[("owner", "locker")]).await;
    let mut leader = campaign(&api, &name, &[("owner", "leader")]).await;
    expect_event(&mut leader, "leader").await;
    assert_eq!(lock.inspect().await.holder_owners(), ["locker"]);
    assert_eq!(election(&api, &name).await["leader"]["owner"], "leader");
    lock.release(&held.token).await;
    assert_eq!(election(&api, &name).await["leader"]["owner"], "leader");
}

/// A leader leads for as long as its campaign lives: past `stale_after` it
/// is not a stuck lock, and `/v1/stale` does not list it (nor the monitor's
/// own election), while a lock held as long is listed.
#[apply(backends)]
#[tokio::test]
async fn a_long_leadership_is_not_stale(backend: TestBackend) {
    let backend = backend.start().await;
    let sidecar = backend.sidecar().stale_after("200ms").start().await;
    let api = sidecar.api();
    let name = unique_name("long-term");
    let mut leader = campaign(&api, &name, &[("owner", "lasting")]).await;
    expect_event(&mut leader, "leader").await;
    let lock = api.lock(&name);
    lock.acquire(&[("ttl", "30s")]).await;
    let stale = eventually(
        "the lock to be stale",
        Duration::from_secs(10),
        async || {
            let stale = api.stale().await;
            stale
                .iter()
                .any(|e| e.key.contains(&name) && !e.key.contains("elections"))
                .then_some(stale)
        },
    )
    .await;
    assert!(
        stale.iter().all(|e| !e.key.contains("elections")),
        "an election's leader listed as stale: {stale:?}"
    );
}

/// A leader whose sidecar stops gracefully hears `lost` `shutdown`, and
/// the election is free as soon as it lets go (closes its campaign).
#[apply(backends)]
#[tokio::test]
async fn a_leader_hears_shutdown_and_the_election_is_free(backend: TestBackend) {
    let backend = backend.start().await;
    let sidecars = backend.sidecars(2).await;
    let name = unique_name("shutdown");
    let mut leader = campaign(&sidecars[0].api(), &name, &[("owner", "stopping")]).await;
    expect_event(&mut leader, "leader").await;
    sidecars[0].terminate();
    let lost = expect_event(&mut leader, "lost").await;
    assert_eq!(lost["reason"], "shutdown");
    drop(leader);
    if sidecars.len() > 1 {
        let next = sidecars[1].api();
        let mut successor = campaign(&next, &name, &[("owner", "next")]).await;
        expect_leadership(&mut successor, EVENT_TIMEOUT).await;
    }
}

/// A leader whose whole pod dies (sidecar killed, nothing released) is
/// replaced once its lease runs out: the follower leads after about the
/// campaign's ttl, never before it.
#[apply(shared_backends)]
#[tokio::test]
async fn a_killed_leaders_lease_runs_out_before_the_follower_leads(backend: TestBackend) {
    let backend = backend.start().await;
    let mut sidecars = backend.sidecars(2).await;
    let name = unique_name("killed");
    let ttl = Duration::from_secs(2);
    let mut first = campaign(
        &sidecars[0].api(),
        &name,
        &[("owner", "doomed"), ("ttl", "2s")],
    )
    .await;
    expect_event(&mut first, "leader").await;
    let mut second = campaign(
        &sidecars[1].api(),
        &name,
        &[("owner", "heir"), ("ttl", "2s")],
    )
    .await;
    expect_event(&mut second, "follower").await;

    let killed = Instant::now();
    sidecars[0].signal(nix::sys::signal::Signal::SIGKILL);
    sidecars[0].wait_exit(EXIT_TIMEOUT).await;
    expect_leadership(&mut second, ttl + Duration::from_secs(10)).await;
    let took = killed.elapsed();
    // ZooKeeper ends the session (and its nodes) at its own timeout, which
    // may come first; the lease's ttl bounds the rest. The last renewal came
    // at most ttl/3 before the kill.
    let earliest = if backend.backend() == TestBackend::ZooKeeper {
        Duration::ZERO
    } else {
        ttl * 2 / 3 - Duration::from_millis(100)
    };
    assert!(
        took >= earliest,
        "the heir led {took:?} after the kill, before the lease ran out"
    );
    let _ = sidecars.remove(0);
}

/// A campaign's `lock_delay` holds after its leader's whole pod dies: the
/// heir leads no sooner than the lock-delay after the lease ended — after
/// its ttl ran out, or, on ZooKeeper, after the session ended (the delay
/// then runs from when the loss is seen).
#[apply(shared_backends)]
#[tokio::test]
async fn a_killed_leaders_lock_delay_holds_before_the_follower_leads(backend: TestBackend) {
    const DELAY: Duration = Duration::from_secs(3);
    let backend = backend.start().await;
    let mut sidecars = backend.sidecars(2).await;
    let name = unique_name("killed-delayed");
    let ttl = Duration::from_secs(2);
    let mut first = campaign(
        &sidecars[0].api(),
        &name,
        &[("owner", "doomed"), ("ttl", "2s"), ("lock_delay", "3s")],
    )
    .await;
    expect_event(&mut first, "leader").await;
    let mut second = campaign(
        &sidecars[1].api(),
        &name,
        &[("owner", "heir"), ("ttl", "2s"), ("lock_delay", "3s")],
    )
    .await;
    expect_event(&mut second, "follower").await;

    let killed = Instant::now();
    sidecars[0].signal(nix::sys::signal::Signal::SIGKILL);
    sidecars[0].wait_exit(EXIT_TIMEOUT).await;
    expect_leadership(&mut second, ttl + DELAY + Duration::from_secs(15)).await;
    let took = killed.elapsed();
    let lease_left = if backend.backend() == TestBackend::ZooKeeper {
        Duration::ZERO
    } else {
        ttl * 2 / 3 - Duration::from_millis(100)
    };
    assert!(
        took >= lease_left + DELAY,
        "the heir led {took:?} after the kill, inside the lost lease's lock-delay of {DELAY:?}"
    );
    let _ = sidecars.remove(0);
}

/// Bad parameters are refused before anything is written, with a sentence
/// saying what is allowed.
#[apply(backends)]
#[tokio::test]
async fn bad_campaign_parameters_are_refused(backend: TestBackend) {
    let backend = backend.start().await;
    let sidecar = backend.start_sidecar().await;
    let api = sidecar.api();
    let name = unique_name("refused");
    let long = "v".repeat(1025);
    for (params, says) in [
        (vec![("value", long.as_str())], "at most 1024 bytes"),
        (vec![("value", "line\nbreak")], "value contains"),
        (vec![("value", "\u{202e}evil")], "value contains"),
        (vec![("owner", "")], "owner is 0 characters"),
        (vec![("ttl", "0s")], "ttl must be above 0"),
        (vec![("ttl", "1000h")], "above the maximum"),
        (vec![("wait", "1s")], "wait"),
        (vec![("mode", "shared")], "mode"),
    ] {
        let response = api
            .open_stream_raw(&["v1", "elections", &name, "campaign"], &params)
            .await;
        let problem: Value = expect_json(response, StatusCode::BAD_REQUEST).await;
        let detail = problem["detail"].as_str().unwrap_or("");
        assert!(detail.contains(says), "{params:?}: {problem}");
    }
    for bad in ["a/b", "with space", ""] {
        let status = api
            .get(&["v1", "elections", bad, "ready"], &[])
            .await
            .status();
        assert!(
            status == StatusCode::BAD_REQUEST || status == StatusCode::NOT_FOUND,
            "ready of {bad:?}: {status}"
        );
    }
    assert_eq!(election(&api, &name).await["candidates"], 0);
    assert_eq!(ready(&api, &name).await, StatusCode::SERVICE_UNAVAILABLE);
}

/// With an API token, the election API needs it but `…/ready` does not
/// (kubelets call it by pod IP, without credentials), and answers the
/// same from a non-loopback Host.
#[tokio::test]
async fn ready_is_open_like_readyz_and_the_rest_needs_the_token() {
    let backend = TestBackend::Memory.start().await;
    let sidecar = backend.sidecar().api_token(API_TOKEN).start().await;
    let open = sidecar.api();
    let name = unique_name("probe");
    let refused = open.get(&["v1", "elections", &name], &[]).await.status();
    assert_eq!(refused, StatusCode::UNAUTHORIZED);
    let refused = open
        .open_stream_raw(&["v1", "elections", &name, "campaign"], &[])
        .await
        .status();
    assert_eq!(refused, StatusCode::UNAUTHORIZED);

    let mut leader = campaign(&sidecar.api_with_token(API_TOKEN), &name, &[]).await;
    expect_event(&mut leader, "leader").await;
    assert_eq!(ready(&open, &name).await, StatusCode::OK);
    let by_pod_ip = reqwest::Client::new()
        .get(open.url(&["v1", "elections", &name, "ready"], &[]))
        .header(reqwest::header::HOST, "10.1.2.3:7070")
        .send()
        .await
        .expect("ready by pod IP");
    assert_eq!(by_pod_ip.status(), StatusCode::OK);
    let other = reqwest::Client::new()
        .get(open.url(&["v1", "elections", &name], &[]))
        .header(reqwest::header::HOST, "10.1.2.3:7070")
        .bearer_auth(API_TOKEN)
        .send()
        .await
        .expect("election by pod IP");
    assert_eq!(other.status(), StatusCode::MISDIRECTED_REQUEST);
}

/// `sidelock campaign -- CMD`: the command runs only while leading.
mod campaign_command {
    use super::*;
    use common::cli::RunBuilder;

    const RUN_TIMEOUT: Duration = Duration::from_secs(20);
    /// Creates `started`, then waits (at most 20 s) for the test's `go`.
    const WAIT_FOR_GO: &str = r#"echo "$SIDELOCK_ELECTION $SIDELOCK_FENCE" > started; i=0; while [ ! -e go ] && [ "$i" -lt 400 ]; do sleep 0.05; i=$((i + 1)); done"#;

    /// Two `sidelock campaign`s on two sidecars: the second's command starts
    /// only after the first's has exited, with a higher fence.
    #[tokio::test]
    async fn the_command_runs_only_while_leading() {
        let backend = TestBackend::Redis.start().await;
        let sidecars = backend.sidecars(2).await;
        let name = unique_name("cli-election");
        let mut first = RunBuilder::campaign(sidecars[0].base_url(), &name)
            .flag("value", "first")
            .sh(WAIT_FOR_GO)
            .spawn();
        first.wait_for_file("started").await;
        let mut second = RunBuilder::campaign(sidecars[1].base_url(), &name)
            .flag("value", "second")
            .sh(WAIT_FOR_GO)
            .spawn();
        let api = sidecars[1].api();
        eventually("two candidates", EVENT_TIMEOUT, async || {
            (election(&api, &name).await["candidates"] == 2).then_some(())
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !second.file("started").exists(),
            "the follower's command ran"
        );
        assert_eq!(election(&api, &name).await["leader"]["value"], "first");

        std::fs::write(first.file("go"), "").expect("write go");
        assert_eq!(first.exit_code(RUN_TIMEOUT).await, 0, "{}", first.log());
        second.wait_for_file("started").await;
        let fence = |run: &common::cli::RunGuard| -> u64 {
            let text = std::fs::read_to_string(run.file("started")).expect("started");
            let (election, fence) = text.trim().split_once(' ').expect("name and fence");
            assert_eq!(election, name);
            fence.parse().expect("a fence")
        };
        assert!(fence(&second) > fence(&first));
        std::fs::write(second.file("go"), "").expect("write go");
        assert_eq!(second.exit_code(RUN_TIMEOUT).await, 0, "{}", second.log());
        assert!(second.log().contains("standing by"), "{}", second.log());
    }

    /// The leadership lost while the command runs (the sidecar stops): the
    /// command gets SIGTERM and the exit code is 76.
    #[tokio::test]
    async fn a_lost_leadership_stops_the_command() {
        let backend = TestBackend::Memory.start().await;
        let sidecar = backend.start_sidecar().await;
        let mut run = RunBuilder::campaign(sidecar.base_url(), &unique_name("cli-lost"))
            .sh(r#"trap 'touch terminated; exit 0' TERM; touch started; i=0; while [ "$i" -lt 400 ]; do sleep 0.05; i=$((i + 1)); done"#)
            .spawn();
        run.wait_for_file("started").await;
        sidecar.terminate();
        assert_eq!(run.exit_code(RUN_TIMEOUT).await, 76, "{}", run.log());
        assert!(run.file("terminated").exists(), "CMD got no SIGTERM");
        assert!(run.log().contains("lost"), "{}", run.log());
    }

    /// With `--again`, each term runs the command anew, each with a higher fence.
    #[tokio::test]
    async fn again_campaigns_after_each_term_with_a_higher_fence() {
        let backend = TestBackend::Memory.start().await;
        let sidecar = backend.start_sidecar().await;
        let run = RunBuilder::campaign(sidecar.base_url(), &unique_name("cli-again"))
            .arg("--again")
            .sh(r#"echo "$SIDELOCK_FENCE" >> terms"#)
            .spawn();
        let terms = run.file("terms");
        let fences: Vec<u64> = eventually("three terms", EVENT_TIMEOUT, async || {
            let text = std::fs::read_to_string(&terms).unwrap_or_default();
            let fences: Vec<u64> = text.lines().filter_map(|l| l.parse().ok()).collect();
            (fences.len() >= 3).then_some(fences)
        })
        .await;
        for pair in fences.windows(2) {
            assert!(pair[0] < pair[1], "fences {fences:?}");
        }
        drop(run);
    }

    /// `--again` stops when its process is told to (SIGTERM, as Kubernetes
    /// stops a pod): its CMD gets the signal and no term follows. The first
    /// term's signal handlers stayed for the process's life, so SIGTERM
    /// only reached CMD, and the campaign stood again (and while following,
    /// it was not heard at all) until SIGKILL.
    #[tokio::test]
    async fn again_stops_when_told_to_and_stands_no_more() {
        let backend = TestBackend::Memory.start().await;
        let sidecar = backend.start_sidecar().await;
        let mut run = RunBuilder::campaign(sidecar.base_url(), &unique_name("cli-stopped"))
            .arg("--again")
            .sh("echo term >> terms; exec sleep 30")
            .spawn();
        run.wait_for_file("terms").await;
        run.signal(nix::sys::signal::Signal::SIGTERM);
        let status = run.wait_exit(Duration::from_secs(10)).await;
        let terms = std::fs::read_to_string(run.file("terms")).unwrap_or_default();
        assert_eq!(terms.lines().count(), 1, "a term after SIGTERM: {status}");
        assert_eq!(status.code(), Some(128 + 15), "{}", run.log());
    }

    /// The same while following: the leader is another campaign, and this
    /// one, between terms, stops at once.
    #[tokio::test]
    async fn again_stops_while_following_when_told_to() {
        let backend = TestBackend::Memory.start().await;
        let sidecar = backend.start_sidecar().await;
        let name = unique_name("cli-following");
        let mut run = RunBuilder::campaign(sidecar.base_url(), &name)
            .arg("--again")
            .sh("echo term >> terms")
            .spawn();
        run.wait_for_file("terms").await;
        // Another campaign leads now: this one follows.
        let api = sidecar.api();
        let mut other = campaign(&api, &name, &[("owner", "other")]).await;
        other
            .wait_for("leading", EVENT_TIMEOUT, |e| e.event == "leader")
            .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        run.signal(nix::sys::signal::Signal::SIGTERM);
        let status = run.wait_exit(Duration::from_secs(10)).await;
        assert_eq!(status.code(), Some(128 + 15), "{}", run.log());
    }

    /// With `--again`, a CMD that fails at once (a missing binary, a bad
    /// config) does not lead and resign as fast as the sidecar answers:
    /// quick terms are spaced out, more and more (hundreds of terms in 3 s
    /// before).
    #[tokio::test]
    async fn again_spaces_out_terms_that_end_at_once() {
        let backend = TestBackend::Memory.start().await;
        let sidecar = backend.start_sidecar().await;
        let run = RunBuilder::campaign(sidecar.base_url(), &unique_name("cli-quick"))
            .arg("--again")
            .sh("echo term >> terms; exit 3")
            .spawn();
        tokio::time::sleep(Duration::from_secs(3)).await;
        let terms = std::fs::read_to_string(run.file("terms")).unwrap_or_default();
        let terms = terms.lines().count();
        assert!((2..=8).contains(&terms), "{terms} terms in 3 s");
        drop(run);
    }

    /// With `--again`, CMD's own exit code ends no loop, whatever it is: 69
    /// and 127, sidelock's own codes for an unreachable sidecar and a CMD
    /// that cannot start, ended it for good when CMD exited with them (a
    /// worker's `EX_UNAVAILABLE`, a shell's missing command).
    #[tokio::test]
    async fn again_stands_again_whatever_cmd_exits_with() {
        let backend = TestBackend::Memory.start().await;
        let sidecar = backend.start_sidecar().await;
        let run = RunBuilder::campaign(sidecar.base_url(), &unique_name("cli-sixty-nine"))
            .arg("--again")
            .sh("echo term >> terms; exit 69")
            .spawn();
        let terms = run.file("terms");
        eventually("three terms", EVENT_TIMEOUT, async || {
            let text = std::fs::read_to_string(&terms).unwrap_or_default();
            (text.lines().count() >= 3).then_some(())
        })
        .await;
        drop(run);
    }
}

/// The sidecar's event stream (`/v1/events`, the dashboard's) named a
/// campaign's owner as the lease stores it: a JSON document with the
/// published value and the campaign's own id, which is never shown to
/// clients. Events carry the campaign's `owner`, as every other answer does.
#[apply(backends)]
#[tokio::test]
async fn election_events_name_the_campaigns_owner_not_its_stored_form(backend: TestBackend) {
    let backend = backend.start().await;
    let sidecar = backend.start_sidecar().await;
    let api = sidecar.api();
    let mut events = api.events().await;
    let name = unique_name("evented");
    let mut leader = campaign(
        &api,
        &name,
        &[("owner", "pod-a"), ("value", "10.0.0.1:8080")],
    )
    .await;
    expect_event(&mut leader, "leader").await;
    let acquired = events
        .wait_for(
            "the election's acquired event",
            Duration::from_secs(10),
            |e| e.event == "acquired" && e.json()["name"] == name.as_str(),
        )
        .await;
    let data = acquired.json();
    assert_eq!(data["owner"], "pod-a", "{data}");
    assert_eq!(data["kind"], "election", "{data}");
    assert!(!acquired.data.contains("campaign"), "{}", acquired.data);
}
