//! `GET /metrics` parsed with a Prometheus text-format parser after a
//! scripted set of operations: the counters and histograms must show exactly
//! those operations.

use crate::common;

use std::time::Duration;

use prometheus_parse::{Sample, Scrape, Value};
use reqwest::StatusCode;

use common::*;

/// How long an expiry may take to be noticed on a loaded machine.
const EXPIRY_TIMEOUT: Duration = Duration::from_secs(10);

/// A parsed scrape, and its text for the lines the parser cannot read.
struct Metrics(Scrape, String);

impl Metrics {
    async fn scrape(api: &Api) -> Metrics {
        let response = api.get(&["metrics"], &[]).await;
        assert_eq!(response.status(), StatusCode::OK);
        let text = response.text().await.expect("metrics body");
        let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
            .unwrap_or_else(|e| panic!("not Prometheus text format ({e}):\n{text}"));
        Metrics(scrape, text)
    }

    /// The value of an HTTP series, read from the text: prometheus-parse
    /// 0.2 skips samples whose label values contain `}`, as the route
    /// templates do (`route="/v1/locks/{name}"`, valid exposition format).
    fn http(&self, family: &str, labels: &str) -> u64 {
        let prefix = format!("{family}{{{labels}}} ");
        let line = self
            .1
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no sample {prefix}in\n{}", self.1));
        line[prefix.len()..].parse().expect("an integer count")
    }

    /// The samples of `name` whose labels include every pair of `labels`.
    fn find(&self, name: &str, labels: &[(&str, &str)]) -> Vec<&Sample> {
        self.0
            .samples
            .iter()
            .filter(|s| s.metric == name)
            .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .collect()
    }

    /// The value of the one counter, gauge or untyped sample `name{labels}`.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let found = self.find(name, labels);
        assert_eq!(
            found.len(),
            1,
            "expected one sample {name}{labels:?}, found {found:#?}"
        );
        match &found[0].value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
            other => panic!("{name}{labels:?} is not a single value: {other:?}"),
        }
    }

    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let found = self.find(name, labels);
        assert!(
            found.iter().all(|s| matches!(s.value, Value::Counter(_))),
            "{name} must be a counter: {found:#?}"
        );
        self.value(name, labels) as u64
    }

    fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let found = self.find(name, labels);
        assert!(
            found.iter().all(|s| matches!(s.value, Value::Gauge(_))),
            "{name} must be a gauge: {found:#?}"
        );
        self.value(name, labels)
    }

    /// Cumulative bucket counts `(le, count)` of the histogram `name{labels}`.
    fn buckets(&self, name: &str, labels: &[(&str, &str)]) -> Vec<(f64, u64)> {
        let found = self.find(name, labels);
        assert_eq!(found.len(), 1, "one histogram {name}{labels:?}: {found:#?}");
        match &found[0].value {
            Value::Histogram(buckets) => buckets
                .iter()
                .map(|b| (b.less_than, b.count as u64))
                .collect(),
            other => panic!("{name} is not a histogram: {other:?}"),
        }
    }

    /// The count in the bucket with upper bound `le`.
    fn bucket(&self, name: &str, labels: &[(&str, &str)], le: f64) -> u64 {
        self.buckets(name, labels)
            .into_iter()
            .find(|(bound, _)| {
                (*bound - le).abs() < 1e-12 || (bound.is_infinite() && le.is_infinite())
            })
            .unwrap_or_else(|| panic!("{name} has no bucket le={le}"))
            .1
    }
}

#[tokio::test]
async fn metrics_count_exactly_the_scripted_operations() {
    let sidecar = SidecarBuilder::new("memory://")
        .admin_token(ADMIN_TOKEN)
        .start()
        .await;
    let api = sidecar.api();
    let admin = sidecar.api_with_token(ADMIN_TOKEN);

    // 1. A grant, a try-once refusal, a wait that times out, a keepalive.
    let a = api.lock("metered-a");
    let held = a.acquire(&[("owner", "a"), ("ttl", "30s")]).await;
    a.acquire_busy(&[("owner", "b")]).await;
    a.acquire_busy(&[("owner", "b"), ("wait", "200ms")]).await;
    a.keepalive(&held.token, &[]).await;

    // 2. A waiter granted after ≥ 400 ms, then released.
    let waiter = {
        let a = a.clone();
        tokio::spawn(async move { a.acquire(&[("owner", "c"), ("wait", "10s")]).await })
    };
    a.wait_for_waiters(&["c"]).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    a.release(&held.token).await;
    let c = waiter.await.expect("waiter task");
    assert!(c.waited_ms >= 400, "{c:?}");
    a.release(&c.token).await;

    // 3. A lease that expires; its keepalive then finds it lost.
    let e = api.lock("metered-e");
    let expiring = e.acquire(&[("owner", "e"), ("ttl", "300ms")]).await;
    eventually("the expiry to be counted", EXPIRY_TIMEOUT, async || {
        let m = Metrics::scrape(&api).await;
        (m.counter("sidelock_lost_total", &[("reason", "expired")]) == 1).then_some(())
    })
    .await;
    e.keepalive_lost(&expiring.token).await;

    // 4. A force-release; the holder's release then gets 410.
    let f = api.lock("metered-f");
    let forced = f.acquire(&[("owner", "f")]).await;
    assert_eq!(admin.lock("metered-f").force_release().await, 1);
    f.release_lost(&forced.token).await;

    // 5. Re-entry: two grants of one lease, two releases.
    let r = api.lock("metered-r");
    let first = r.acquire(&[("owner", "r")]).await;
    let again = r.acquire(&[("owner", "r")]).await;
    assert_eq!(first.token, again.token);
    r.release(&first.token).await;
    r.release(&first.token).await;

    // 6. Two semaphore permits, released.
    let s = api.semaphore("metered-s");
    let p1 = s.acquire(&[("owner", "s1"), ("limit", "2")]).await;
    let p2 = s.acquire(&[("owner", "s2"), ("limit", "2")]).await;
    s.release(&p1.token).await;
    s.release(&p2.token).await;

    let m = Metrics::scrape(&api).await;
    let lock = ("kind", "lock");
    let semaphore = ("kind", "semaphore");

    // Acquires by kind and result: a, c, e, f, r, r; b busy; b timed out; two permits.
    let acquires = |kind, result| m.counter("sidelock_acquires_total", &[kind, ("result", result)]);
    assert_eq!(acquires(lock, "granted"), 6);
    assert_eq!(acquires(lock, "busy"), 1);
    assert_eq!(acquires(lock, "timeout"), 1);
    assert_eq!(acquires(semaphore, "granted"), 2);
    for result in ["cancelled", "rejected", "error"] {
        assert_eq!(acquires(lock, result), 0, "{result}");
        assert_eq!(acquires(semaphore, result), 0, "{result}");
    }
    for result in ["busy", "timeout"] {
        assert_eq!(acquires(semaphore, result), 0, "{result}");
    }

    // Wait time: one observation per grant; only c waited more than 250 ms.
    let wait = "sidelock_wait_seconds";
    assert_eq!(m.value("sidelock_wait_seconds_count", &[lock]) as u64, 6);
    assert_eq!(m.bucket(wait, &[lock], f64::INFINITY), 6);
    assert_eq!(m.bucket(wait, &[lock], 0.25), 5);
    assert!(m.value("sidelock_wait_seconds_sum", &[lock]) >= 0.4);
    assert_eq!(
        m.value("sidelock_wait_seconds_count", &[semaphore]) as u64,
        2
    );
    let bounds: Vec<f64> = m.buckets(wait, &[lock]).iter().map(|b| b.0).collect();
    assert!(bounds[0] <= 0.0001, "sub-millisecond buckets: {bounds:?}");
    assert!(bounds.iter().any(|&b| b >= 300.0), "minutes: {bounds:?}");

    // Hold time: one observation per ended lease (a, c, e, f, r; two permits).
    assert_eq!(m.value("sidelock_hold_seconds_count", &[lock]) as u64, 5);
    assert_eq!(m.bucket("sidelock_hold_seconds", &[lock], f64::INFINITY), 5);
    assert_eq!(
        m.value("sidelock_hold_seconds_count", &[semaphore]) as u64,
        2
    );

    // Nothing is held or waiting any more.
    for kind in [lock, semaphore] {
        assert_eq!(m.gauge("sidelock_held_locks", &[kind]), 0.0);
        assert_eq!(m.gauge("sidelock_waiters", &[kind]), 0.0);
    }

    // Renewals: the keepalive of a (ok) and of e after its expiry (lost).
    assert_eq!(m.counter("sidelock_renewals_total", &[("result", "ok")]), 1);
    assert_eq!(
        m.counter("sidelock_renewals_total", &[("result", "lost")]),
        1
    );
    assert_eq!(
        m.counter("sidelock_renewals_total", &[("result", "error")]),
        0
    );

    // Lost leases and expirations: e expired, f was force-released.
    assert_eq!(
        m.counter("sidelock_lost_total", &[("reason", "expired")]),
        1
    );
    assert_eq!(
        m.counter("sidelock_lost_total", &[("reason", "force_released")]),
        1
    );
    for reason in ["max_hold", "shutdown", "backend"] {
        assert_eq!(
            m.counter("sidelock_lost_total", &[("reason", reason)]),
            0,
            "{reason}"
        );
    }
    assert_eq!(m.counter("sidelock_expirations_total", &[lock]), 1);
    assert_eq!(m.counter("sidelock_expirations_total", &[semaphore]), 0);
    assert_eq!(m.counter("sidelock_force_releases_total", &[]), 1);

    // Backend calls, labelled with the backend.
    let backend = ("backend", "memory");
    let ops = |op| m.counter("sidelock_backend_operations_total", &[backend, ("op", op)]);
    assert_eq!(ops("release"), 7, "a, c, f (410), r twice, two permits");
    assert_eq!(ops("renew"), 2);
    assert_eq!(ops("force_release"), 1);
    assert_eq!(ops("status"), 1, "e's expiry timer asked once");
    assert_eq!(ops("watch"), 2, "the waits of b and c");
    // No periodic ping: a lone sidecar is the monitor, elected with an
    // inspect and an attempt.
    assert!(ops("try_acquire") >= 1);
    assert_eq!(
        m.gauge("sidelock_monitor", &[]),
        1.0,
        "a lone sidecar is the monitor"
    );
    let errors: Vec<&Sample> = m.find("sidelock_backend_errors_total", &[backend]);
    assert!(!errors.is_empty());
    for sample in errors {
        assert_eq!(sample.value, Value::Counter(0.0), "{sample:?}");
    }
    assert_eq!(
        m.value(
            "sidelock_backend_operation_seconds_count",
            &[backend, ("op", "release")]
        ) as u64,
        7
    );
    assert_eq!(m.gauge("sidelock_backend_up", &[backend]), 1.0);

    // HTTP requests by route template and status.
    let http = |method: &str, route: &str, status: &str| {
        m.http(
            "sidelock_http_requests_total",
            &format!("method=\"{method}\",route=\"{route}\",status=\"{status}\""),
        )
    };
    assert_eq!(http("POST", "/v1/locks/{name}", "200"), 6);
    assert_eq!(http("POST", "/v1/locks/{name}", "409"), 2);
    assert_eq!(http("DELETE", "/v1/locks/{name}", "200"), 4);
    assert_eq!(http("DELETE", "/v1/locks/{name}", "410"), 1);
    assert_eq!(http("POST", "/v1/locks/{name}/keepalive", "200"), 1);
    assert_eq!(http("POST", "/v1/locks/{name}/keepalive", "410"), 1);
    assert_eq!(http("POST", "/v1/semaphores/{name}", "200"), 2);
    assert_eq!(http("DELETE", "/v1/semaphores/{name}", "200"), 2);
    assert_eq!(http("DELETE", "/v1/admin/locks/{name}", "200"), 1);
    assert_eq!(
        m.http(
            "sidelock_http_request_duration_seconds_count",
            "method=\"POST\",route=\"/v1/locks/{name}\""
        ),
        8
    );
    // No other family has a `}` inside a label value, so the parser read everything else.
    let braced =
        m.1.lines()
            .filter(|l| !l.starts_with('#') && !l.starts_with("sidelock_http_request"))
            .filter(|l| l.matches('}').count() > 1)
            .count();
    assert_eq!(braced, 0);

    // Every family has help text; lock names are not labels by default.
    for sample in &m.0.samples {
        assert!(sample.metric.starts_with("sidelock_"), "{}", sample.metric);
        assert!(sample.labels.get("lock").is_none(), "{sample:?}");
    }
    for family in [
        "sidelock_acquires_total",
        "sidelock_wait_seconds",
        "sidelock_hold_seconds",
        "sidelock_held_locks",
        "sidelock_waiters",
        "sidelock_renewals_total",
        "sidelock_lost_total",
        "sidelock_expirations_total",
        "sidelock_force_releases_total",
        "sidelock_backend_operations_total",
        "sidelock_backend_errors_total",
        "sidelock_backend_operation_seconds",
        "sidelock_backend_up",
        "sidelock_stale_locks",
        "sidelock_http_requests_total",
        "sidelock_http_request_duration_seconds",
        "sidelock_process_resident_memory_bytes",
    ] {
        assert!(
            m.0.docs.get(family).is_some_and(|help| !help.is_empty()),
            "{family} has no HELP"
        );
    }
}

#[tokio::test]
async fn lock_labels_only_with_the_flag_and_bounded() {
    let sidecar = SidecarBuilder::new("memory://")
        .arg("--metrics-lock-labels")
        .start()
        .await;
    let api = sidecar.api();
    let lock = api.lock("labelled-lock");
    let grant = lock.acquire(&[]).await;
    lock.release(&grant.token).await;
    let m = Metrics::scrape(&api).await;
    assert_eq!(
        m.counter(
            "sidelock_acquires_total",
            &[
                ("kind", "lock"),
                ("lock", "labelled-lock"),
                ("result", "granted")
            ]
        ),
        1
    );
    assert_eq!(
        m.value(
            "sidelock_wait_seconds_count",
            &[("kind", "lock"), ("lock", "labelled-lock")]
        ) as u64,
        1
    );
    // Gauges and the other families never carry lock names.
    assert!(
        m.find("sidelock_held_locks", &[("lock", "labelled-lock")])
            .is_empty()
    );
}

/// The example alert rules (and the families the Helm chart alerts on) only
/// use metrics the sidecar exports, so a rename cannot silently break them.
#[tokio::test]
async fn alert_rules_use_exported_metrics() {
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let m = Metrics::scrape(&sidecar.api()).await;
    let rules = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/alerts.yml"))
        .expect("read docs/alerts.yml");
    let mut used: Vec<String> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("sidelock_"))
        .map(|w| {
            ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| w.strip_suffix(s))
                .unwrap_or(w)
                .to_owned()
        })
        .collect();
    assert!(used.len() >= 7, "{used:?}");
    used.extend(
        [
            "sidelock_lost_total",
            "sidelock_waiters",
            "sidelock_wait_seconds",
            "sidelock_backend_up",
            "sidelock_held_locks",
            "sidelock_stale_locks",
        ]
        .map(str::to_owned),
    );
    for family in &used {
        assert!(
            m.0.docs.contains_key(family),
            "{family} is used by alerts but not exported"
        );
    }
}

#[tokio::test]
async fn every_help_text_names_every_label_value_its_family_exports() {
    let sidecar = SidecarBuilder::new("memory://").start().await;
    let metrics = Metrics::scrape(&sidecar.api()).await;
    let family = "sidelock_lost_total";
    let help = metrics
        .1
        .lines()
        .find_map(|l| l.strip_prefix(&format!("# HELP {family} ")))
        .unwrap_or_else(|| panic!("no HELP for {family}:\n{}", metrics.1));
    let reasons: Vec<&str> = metrics
        .find(family, &[])
        .iter()
        .filter_map(|s| s.labels.get("reason"))
        .collect();
    assert!(reasons.contains(&"unreachable"), "{reasons:?}");
    for reason in reasons {
        assert!(
            help.split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                .any(|word| word == reason),
            "the HELP of {family} does not name the reason {reason}: {help}"
        );
    }
}

/// Each leadership won through a sidecar counts once there; the gauge
/// follows the campaigns that lead; election names become labels only with
/// `--metrics-lock-labels`.
#[tokio::test]
async fn leader_changes_and_leading_campaigns_are_counted() {
    for labelled in [false, true] {
        let mut builder = SidecarBuilder::new("memory://");
        if labelled {
            builder = builder.arg("--metrics-lock-labels");
        }
        let sidecar = builder.start().await;
        let api = sidecar.api();
        let labels: &[(&str, &str)] = if labelled {
            &[("election", "counted")]
        } else {
            &[]
        };
        let m = Metrics::scrape(&api).await;
        assert_eq!(m.value("sidelock_elections_leading", &[]) as u64, 0);
        let segments = ["v1", "elections", "counted", "campaign"];
        let mut first = api.open_stream(&segments, &[]).await;
        first
            .wait_for("leader", EVENT_TIMEOUT, |e| e.event == "leader")
            .await;
        let mut second = api.open_stream(&segments, &[]).await;
        second
            .wait_for("follower", EVENT_TIMEOUT, |e| e.event == "follower")
            .await;
        let m = Metrics::scrape(&api).await;
        assert_eq!(m.counter("sidelock_leader_changes_total", labels), 1);
        assert_eq!(m.value("sidelock_elections_leading", &[]) as u64, 1);
        drop(first);
        second
            .wait_for("leader", EVENT_TIMEOUT, |e| e.event == "leader")
            .await;
        let m = Metrics::scrape(&api).await;
        assert_eq!(m.counter("sidelock_leader_changes_total", labels), 2);
        assert_eq!(m.value("sidelock_elections_leading", &[]) as u64, 1);
        drop(second);
        eventually("no campaign leads", EVENT_TIMEOUT, async || {
            let m = Metrics::scrape(&api).await;
            (m.value("sidelock_elections_leading", &[]) as u64 == 0).then_some(())
        })
        .await;
    }
}
