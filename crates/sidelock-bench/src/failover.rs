//! The failover workload: leader elections over two sidecars. A leader's
//! campaign stream drops (its process dies), its `sidelock campaign`
//! process is killed, or its whole sidecar is killed (the pod dies); the
//! time until the follower on the other sidecar hears `leader`.

use std::pin::Pin;
use std::time::{Duration, Instant};

use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures::{Stream, StreamExt};
use serde::Serialize;

use crate::procs::Sidecar;
use crate::workloads::{Target, ms};

/// What the failover workload measured, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Failover {
    /// The leader's campaign stream closed → the follower leads.
    pub stream_dropped_ms: Vec<f64>,
    /// The leader's `sidelock campaign` process killed with SIGKILL → the follower leads.
    pub process_killed_ms: Vec<f64>,
    /// The leader's sidecar killed with SIGKILL → the follower on the other
    /// sidecar leads (bounded by the campaign's ttl, `sidecar_killed_ttl_ms`).
    pub sidecar_killed_ms: Vec<f64>,
    pub sidecar_killed_ttl_ms: Option<u64>,
    pub stream_dropped_p50_ms: Option<f64>,
    pub stream_dropped_max_ms: Option<f64>,
    pub process_killed_max_ms: Option<f64>,
    /// A leader cut off from its backend (Redis only, run as root).
    pub partition: Option<Partition>,
    /// Rounds that could not be measured, and why.
    pub errors: Vec<String>,
}

type Events = Pin<Box<dyn Stream<Item = Result<Event, EventStreamError<reqwest::Error>>> + Send>>;

/// An open campaign stream; dropping it closes the connection (resigns).
struct Campaign {
    events: Events,
}

impl Campaign {
    /// Opens a campaign through `base` and returns it with whether it leads
    /// (its first event is `leader`) or follows.
    async fn open(
        base: &str,
        name: &str,
        ttl: &str,
        token: Option<&str>,
    ) -> Result<(Self, bool), String> {
        let client = crate::client::http_client();
        let mut req = client.get(format!("{base}/v1/elections/{name}/campaign?ttl={ttl}"));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("campaign answered {}", resp.status()));
        }
        let mut campaign = Self {
            events: Box::pin(resp.bytes_stream().eventsource()),
        };
        let first = campaign.next(Duration::from_secs(10)).await?;
        Ok((campaign, first == "leader"))
    }

    async fn next(&mut self, within: Duration) -> Result<String, String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.events.next()).await {
                Err(_) => return Err(format!("no campaign event within {within:?}")),
                // The leader's watchdog renewals: news of nothing changing.
                Ok(Some(Ok(e))) if e.event == "renewed" => {}
                Ok(Some(Ok(e))) => return Ok(e.event),
                Ok(Some(Err(e))) => return Err(format!("campaign stream failed: {e}")),
                Ok(None) => return Err("campaign stream ended".into()),
            }
        }
    }

    /// Waits for `leader`, skipping `follower` events.
    async fn until_leader(&mut self, within: Duration) -> Result<Instant, String> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next(left).await?.as_str() {
                "leader" => return Ok(Instant::now()),
                "follower" => {}
                other => return Err(format!("{other} before leading")),
            }
        }
    }
}

/// A campaign that must follow.
async fn follower(
    base: &str,
    name: &str,
    ttl: &str,
    token: Option<&str>,
) -> Result<Campaign, String> {
    match Campaign::open(base, name, ttl, token).await? {
        (c, false) => Ok(c),
        (_, true) => Err("the second campaign led at once".into()),
    }
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s
}

/// Runs `rounds` of each failover over the sidecars of `t` (the leader on the
/// last, the follower on the first). With `respawn`, the leader's sidecar is
/// killed too (and started again) for up to three rounds.
///
/// # Errors
/// When a campaign cannot be opened.
pub async fn failover(
    t: &Target,
    rounds: usize,
    run: &str,
    mut respawn: Option<(&mut Vec<Sidecar>, &str)>,
) -> Result<Failover, String> {
    let token = t.api_token.as_deref();
    let (leader_url, follower_url) = (t.url(1).to_owned(), t.url(0).to_owned());
    let mut dropped = Vec::new();
    let mut errors = Vec::new();
    for r in 0..rounds {
        let name = format!("bench-e-{run}-drop-{r}");
        let (leader, leads) = Campaign::open(&leader_url, &name, "30s", token).await?;
        if !leads {
            errors.push(format!(
                "stream dropped, round {r}: the first campaign did not lead"
            ));
            continue;
        }
        let mut next = follower(&follower_url, &name, "30s", token).await?;
        let t0 = Instant::now();
        drop(leader);
        match next.until_leader(Duration::from_secs(40)).await {
            Ok(at) => dropped.push(ms(at - t0)),
            Err(e) => errors.push(format!("stream dropped, round {r}: {e}")),
        }
    }
    let mut killed = Vec::new();
    for r in 0..rounds.min(5) {
        let name = format!("bench-e-{run}-kill-{r}");
        let mut child = crate::procs::spawn_client(
            &[
                "campaign",
                "--name",
                &name,
                "--ttl",
                "30s",
                "--quiet",
                "--url",
                &leader_url,
                "--",
                "sleep",
                "600",
            ],
            token,
        )?;
        // Led once a campaign through the follower's sidecar follows.
        let deadline = Instant::now() + Duration::from_secs(20);
        let next = loop {
            match Campaign::open(&follower_url, &name, "30s", token).await {
                Ok((c, false)) => break Ok(c),
                Ok((_, true)) => {}
                Err(e) => break Err(e),
            }
            if Instant::now() > deadline {
                break Err("sidelock campaign did not lead within 20 s".into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let mut next = match next {
            Ok(c) => c,
            Err(e) => {
                errors.push(format!("process killed, round {r}: {e}"));
                continue;
            }
        };
        let t0 = Instant::now();
        crate::procs::kill_group(&child);
        match next.until_leader(Duration::from_secs(40)).await {
            Ok(at) => killed.push(ms(at - t0)),
            Err(e) => errors.push(format!("process killed, round {r}: {e}")),
        }
        let _ = child.wait().await;
    }
    let mut sidecar_killed = Vec::new();
    let mut ttl_ms = None;
    if let Some((sidecars, backend)) = respawn.as_mut()
        && sidecars.len() >= 2
    {
        let ttl = 2000;
        ttl_ms = Some(ttl);
        for r in 0..rounds.min(3) {
            let name = format!("bench-e-{run}-sidecar-{r}");
            let victim_url = sidecars[1].url.clone();
            let (leader, leads) =
                Campaign::open(&victim_url, &name, &format!("{ttl}ms"), token).await?;
            if !leads {
                errors.push(format!(
                    "sidecar killed, round {r}: the first campaign did not lead"
                ));
                continue;
            }
            let mut next = follower(&sidecars[0].url, &name, &format!("{ttl}ms"), token).await?;
            let t0 = Instant::now();
            let victim = sidecars.remove(1);
            victim.kill().await;
            match next.until_leader(Duration::from_secs(40)).await {
                Ok(at) => sidecar_killed.push(ms(at - t0)),
                Err(e) => errors.push(format!("sidecar killed, round {r}: {e}")),
            }
            drop(leader);
            sidecars.push(Sidecar::start(backend, &format!("bench-2-e{r}")).await?);
        }
    }
    let d = sorted(&dropped);
    Ok(Failover {
        stream_dropped_p50_ms: d.get(d.len() / 2).copied(),
        stream_dropped_max_ms: d.last().copied(),
        process_killed_max_ms: sorted(&killed).last().copied(),
        stream_dropped_ms: dropped,
        process_killed_ms: killed,
        sidecar_killed_ms: sidecar_killed,
        sidecar_killed_ttl_ms: ttl_ms,
        partition: None,
        errors,
    })
}

/// A leader cut off from its backend: when it hears `lost` and when the
/// campaign on the other side of the cut leads, from the cut.
#[derive(Debug, Clone, Serialize)]
pub struct Partition {
    /// The campaigns' ttl.
    pub ttl_ms: u64,
    /// Cut → the cut-off leader hears `lost`.
    pub lost_ms: Vec<f64>,
    /// Cut → the candidate on the other side leads.
    pub led_ms: Vec<f64>,
    /// Rounds where the new leader led first: a broken guarantee.
    pub overlaps: usize,
}

/// `rounds` partitions of a leader (Redis, in a network namespace of the
/// bench's own: root and `ip` needed): sidecar A runs in the namespace and
/// reaches a Redis of the bench's over one veth link, sidecar B on the host;
/// A's link to Redis is cut while A's campaign leads and B's follows.
///
/// # Errors
/// When the servers or sidecars cannot be started.
pub async fn partition(rounds: usize, run: &str) -> Result<Partition, String> {
    use sidelock_test_support::netns::Netns;
    use sidelock_test_support::redis::RedisServer;
    let ttl_ms = 3000;
    let ns = Netns::create();
    let clients = ns.link();
    let link = ns.link();
    let redis = RedisServer::start_with(&[
        "--bind",
        "127.0.0.1",
        &link.host_ip,
        "--protected-mode",
        "no",
    ])
    .await;
    let cut_side = Sidecar::start_in(
        &format!("redis://{}:{}", link.host_ip, redis.port()),
        "bench-cut",
        Some((ns.name(), &clients.peer_ip)),
    )
    .await?;
    let other = Sidecar::start(
        &format!("redis://127.0.0.1:{}", redis.port()),
        "bench-other",
    )
    .await?;
    let ttl = format!("{ttl_ms}ms");
    let (mut lost_ms, mut led_ms, mut overlaps) = (Vec::new(), Vec::new(), 0);
    for r in 0..rounds {
        let name = format!("bench-e-{run}-partition-{r}");
        let (mut leader, leads) = Campaign::open(&cut_side.url, &name, &ttl, None).await?;
        if !leads {
            return Err("the cut-side campaign did not lead".into());
        }
        let mut heir = follower(&other.url, &name, &ttl, None).await?;
        // Past a renewal, so the lease runs from one.
        tokio::time::sleep(Duration::from_millis(ttl_ms / 3 + 100)).await;
        let t0 = Instant::now();
        ns.cut(&link);
        let told = tokio::spawn(async move {
            let lost = leader.next(Duration::from_secs(20)).await;
            (lost, Instant::now())
        });
        let led = heir.until_leader(Duration::from_secs(30)).await?;
        let (lost, lost_at) = told.await.map_err(|e| e.to_string())?;
        match lost.as_deref() {
            Ok("lost") => {}
            other => return Err(format!("the cut-off leader heard {other:?}, not lost")),
        }
        if led < lost_at {
            overlaps += 1;
        }
        lost_ms.push(ms(lost_at - t0));
        led_ms.push(ms(led - t0));
        drop(heir);
        ns.heal(&link);
        // Serving again before the next round.
        let client = crate::client::http_client();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = client
                .get(format!("{}/readyz", cut_side.url))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                break;
            }
            if Instant::now() > deadline {
                return Err("the cut side did not recover within 30 s".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    cut_side.kill().await;
    other.kill().await;
    drop(redis);
    Ok(Partition {
        ttl_ms,
        lost_ms,
        led_ms,
        overlaps,
    })
}
