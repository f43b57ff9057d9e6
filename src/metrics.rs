//! Prometheus metrics: every family is registered here, with its help text.
//!
//! Lock names become labels only with `--metrics-lock-labels`, and then only
//! for the first [`MAX_LOCK_LABELS`] names seen; later names share the label
//! `_other`, so a million lock names cannot explode the series count.
//!
//! Every label combination known in advance (kinds, results, reasons,
//! backend operations) is created at start with value 0, so that `rate()` and
//! `increase()` see the first event as a step from 0 instead of a series that
//! appears already at 1 — an alert on the first lost lease must fire.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use prometheus::{
    Encoder, Gauge, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

use crate::lock::LostReason;
use crate::lock::{Kind, LockKey};

/// How many distinct lock names get their own label value.
pub const MAX_LOCK_LABELS: usize = 500;

/// Values of `result` on `sidelock_acquires_total`.
pub const ACQUIRE_RESULTS: &[&str] = &[
    "granted",
    "busy",
    "timeout",
    "cancelled",
    "rejected",
    "error",
];

/// Values of `result` on `sidelock_renewals_total`.
pub const RENEWAL_RESULTS: &[&str] = &["ok", "lost", "error"];

/// Values of `reason` on `sidelock_lost_total`.
pub const LOST_REASONS: &[LostReason] = &[
    LostReason::Expired,
    LostReason::ForceReleased,
    LostReason::MaxHold,
    LostReason::Shutdown,
    LostReason::Backend,
    LostReason::Unreachable,
];

/// Values of `op` on the backend families: the operations the core performs.
pub const BACKEND_OPS: &[&str] = &[
    "ping",
    "try_acquire",
    "watch",
    "dequeue",
    "renew",
    "release",
    "status",
    "inspect",
    "list",
    "stale",
    "force_release",
    "announce",
    "observe",
    "tidy",
];

const KINDS: &[Kind] = &Kind::ALL;

/// Buckets for lock waits and backend calls: sub-millisecond to minutes.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Buckets for how long locks are held: milliseconds to hours.
const HOLD_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0,
    14400.0,
];

/// All of the sidecar's metric families.
pub struct Metrics {
    registry: Registry,
    /// Lock names given their own label (bounded); `None` when labels are off.
    lock_labels: Option<Mutex<HashSet<String>>>,
    pub acquires: IntCounterVec,
    pub wait: HistogramVec,
    pub hold: HistogramVec,
    pub held: IntGaugeVec,
    pub waiters: IntGaugeVec,
    pub renewals: IntCounterVec,
    pub lost: IntCounterVec,
    pub expirations: IntCounterVec,
    pub backend_ops: IntCounterVec,
    pub backend_errors: IntCounterVec,
    pub backend_seconds: HistogramVec,
    pub backend_up: Gauge,
    pub stale: Gauge,
    pub http_requests: IntCounterVec,
    pub http_seconds: HistogramVec,
    pub force_releases: IntCounter,
    /// Leaderships won through this sidecar (each leader change is counted
    /// once, by the new leader's sidecar), by election with lock labels.
    pub leader_changes: IntCounterVec,
    pub elections_leading: IntGauge,
    /// 1 while this sidecar is the monitor (does the backend-wide work).
    pub monitor: IntGauge,
}

fn counter(reg: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    reg.register(Box::new(c.clone())).expect("unique metric");
    c
}

fn histogram(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> HistogramVec {
    let h = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .expect("valid metric");
    reg.register(Box::new(h.clone())).expect("unique metric");
    h
}

fn gauge_vec(reg: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    reg.register(Box::new(g.clone())).expect("unique metric");
    g
}

fn gauge(reg: &Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::with_opts(Opts::new(name, help)).expect("valid metric");
    reg.register(Box::new(g.clone())).expect("unique metric");
    g
}

impl Metrics {
    /// Registers every family. `backend` becomes a constant label on backend
    /// metrics; `lock_labels` turns on per-lock labels.
    pub fn new(backend: &str, lock_labels: bool) -> Self {
        let registry = Registry::new_custom(Some("sidelock".into()), None).expect("valid prefix");
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("process collector");
        let r = &registry;
        let lock: &[&str] = if lock_labels {
            &["kind", "lock"]
        } else {
            &["kind"]
        };
        let lock_result: &[&str] = if lock_labels {
            &["kind", "lock", "result"]
        } else {
            &["kind", "result"]
        };
        let backend_label = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(
                Opts::new(name, help).const_label("backend", backend),
                labels,
            )
            .expect("valid metric");
            r.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let backend_seconds = HistogramVec::new(
            HistogramOpts::new(
                "backend_operation_seconds",
                "Seconds per backend call, by operation.",
            )
            .const_label("backend", backend)
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["op"],
        )
        .expect("valid metric");
        r.register(Box::new(backend_seconds.clone()))
            .expect("unique metric");
        let backend_up = Gauge::with_opts(
            Opts::new(
                "backend_up",
                "1 when the backend answered the last operation (a request's, or the health \
                 check every 10 s), else 0.",
            )
            .const_label("backend", backend),
        )
        .expect("valid metric");
        r.register(Box::new(backend_up.clone()))
            .expect("unique metric");
        let metrics = Self {
            lock_labels: lock_labels.then(|| Mutex::new(HashSet::new())),
            acquires: counter(
                r,
                "acquires_total",
                "Acquire requests (hold streams included) by kind and result: granted; busy (try-once \
                 refused); timeout (the wait ran out); cancelled (client left, shutdown); rejected \
                 (429, semaphore limit); error (backend outage).",
                lock_result,
            ),
            wait: histogram(
                r,
                "wait_seconds",
                "Seconds from an acquire request to its grant, for granted acquires, by kind.",
                lock,
                LATENCY_BUCKETS,
            ),
            hold: histogram(
                r,
                "hold_seconds",
                "Seconds leases granted through this sidecar were held, from grant to release, \
                 expiry or loss, by kind.",
                lock,
                HOLD_BUCKETS,
            ),
            held: gauge_vec(
                r,
                "held_locks",
                "Leases currently held through this sidecar, by kind.",
                &["kind"],
            ),
            waiters: gauge_vec(
                r,
                "waiters",
                "Requests of this sidecar currently waiting in a queue, by kind.",
                &["kind"],
            ),
            renewals: counter(
                r,
                "renewals_total",
                "Lease renewals (watchdog and keepalive) by result: ok; lost (the lease was gone); \
                 error (backend outage).",
                &["result"],
            ),
            lost: counter(
                r,
                "lost_total",
                &format!(
                    "Leases of this sidecar that ended without their holder releasing them, by \
                     reason: {}.",
                    LOST_REASONS
                        .iter()
                        .map(|reason| reason.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                &["reason"],
            ),
            expirations: counter(
                r,
                "expirations_total",
                "Leases of this sidecar that ran out of time (expired or max_hold), by kind.",
                &["kind"],
            ),
            backend_ops: backend_label(
                "backend_operations_total",
                "Backend calls by operation.",
                &["op"],
            ),
            backend_errors: backend_label(
                "backend_errors_total",
                "Backend calls that failed because the backend was unavailable, by operation.",
                &["op"],
            ),
            backend_seconds,
            backend_up,
            stale: gauge(
                r,
                "stale_locks",
                "Entries of /v1/stale at the monitor's last scan (every 60 s), on the monitor; \
                 0 on every other sidecar, so max over sidecars is the count.",
            ),
            http_requests: counter(
                r,
                "http_requests_total",
                "HTTP requests by method, route template and status.",
                &["method", "route", "status"],
            ),
            http_seconds: histogram(
                r,
                "http_request_duration_seconds",
                "Seconds from an HTTP request to its response head, by method and route template.",
                &["method", "route"],
                LATENCY_BUCKETS,
            ),
            force_releases: {
                let c = IntCounter::new(
                    "force_releases_total",
                    "Admin force-releases performed (each may remove several holders).",
                )
                .expect("valid metric");
                r.register(Box::new(c.clone())).expect("unique metric");
                c
            },
            leader_changes: counter(
                r,
                "leader_changes_total",
                "Leaderships won by campaigns through this sidecar: each leader change of an \
                 election is counted once, by the sidecar of the new leader (summed over \
                 sidecars, the election's leader changes); by election with \
                 --metrics-lock-labels.",
                if lock_labels { &["election"] } else { &[] },
            ),
            elections_leading: {
                let g = IntGauge::new(
                    "elections_leading",
                    "Campaigns through this sidecar that currently lead their election.",
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            monitor: {
                let g = IntGauge::new(
                    "monitor",
                    "1 while this sidecar is the monitor: the one sidecar of the backend that \
                     scans for stale keys and announces itself to the others.",
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            registry,
        };
        metrics.initialise_known_series();
        metrics
    }

    /// Creates every series whose labels are known in advance, at 0.
    fn initialise_known_series(&self) {
        for &kind in KINDS {
            let kind = kind.as_str();
            if self.lock_labels.is_none() {
                for result in ACQUIRE_RESULTS {
                    self.acquires.with_label_values(&[kind, result]);
                }
                self.wait.with_label_values(&[kind]);
                self.hold.with_label_values(&[kind]);
            }
            self.held.with_label_values(&[kind]);
            self.waiters.with_label_values(&[kind]);
            self.expirations.with_label_values(&[kind]);
        }
        if self.lock_labels.is_none() {
            self.leader_changes.with_label_values::<&str>(&[]);
        }
        for result in RENEWAL_RESULTS {
            self.renewals.with_label_values(&[result]);
        }
        for reason in LOST_REASONS {
            self.lost.with_label_values(&[reason.as_str()]);
        }
        for op in BACKEND_OPS {
            self.backend_ops.with_label_values(&[op]);
            self.backend_errors.with_label_values(&[op]);
            self.backend_seconds.with_label_values(&[op]);
        }
    }

    /// The label values identifying `key`: its kind, plus the bounded lock
    /// label when lock labels are on.
    pub fn key_labels(&self, key: &LockKey) -> Vec<String> {
        let kind = key.kind.as_str().to_owned();
        match &self.lock_labels {
            None => vec![kind],
            Some(seen) => {
                let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                let name = key.name.as_str();
                let label = if seen.contains(name) {
                    name.to_owned()
                } else if seen.len() < MAX_LOCK_LABELS {
                    seen.insert(name.to_owned());
                    name.to_owned()
                } else {
                    "_other".to_owned()
                };
                vec![kind, label]
            }
        }
    }

    /// Counts an acquire outcome.
    pub fn acquired(&self, key: &LockKey, result: &str) {
        if self.lock_labels.is_none() {
            // The usual case, without building label vectors on every acquire.
            self.acquires
                .with_label_values(&[key.kind.as_str(), result])
                .inc();
            return;
        }
        let mut labels = self.key_labels(key);
        labels.push(result.to_owned());
        let refs: Vec<&str> = labels.iter().map(String::as_str).collect();
        self.acquires.with_label_values(&refs).inc();
    }

    /// Counts a leadership won through this sidecar.
    pub fn leader_changed(&self, election: &crate::lock::Name) {
        if self.lock_labels.is_none() {
            self.leader_changes.with_label_values::<&str>(&[]).inc();
            return;
        }
        let key = LockKey {
            kind: Kind::Election,
            name: election.clone(),
        };
        let label = self.key_labels(&key).pop().unwrap_or_default();
        self.leader_changes
            .with_label_values(&[label.as_str()])
            .inc();
    }

    /// Records a wait or hold duration.
    pub fn observe(&self, family: &HistogramVec, key: &LockKey, d: Duration) {
        if self.lock_labels.is_none() {
            family
                .with_label_values(&[key.kind.as_str()])
                .observe(d.as_secs_f64());
            return;
        }
        let labels = self.key_labels(key);
        let refs: Vec<&str> = labels.iter().map(String::as_str).collect();
        family.with_label_values(&refs).observe(d.as_secs_f64());
    }

    /// The text exposition of every family.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let encoder = TextEncoder::new();
        // Encoding into a Vec cannot fail for families we registered ourselves.
        let _ = encoder.encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> LockKey {
        LockKey::lock(name)
    }

    /// `(name, type)` of every `# TYPE` line, and the names with `# HELP`.
    fn families(text: &str) -> (Vec<(String, String)>, HashSet<String>) {
        let mut types = Vec::new();
        let mut helps = HashSet::new();
        for line in text.lines() {
            let mut words = line.splitn(4, ' ');
            match (words.next(), words.next(), words.next(), words.next()) {
                (Some("#"), Some("TYPE"), Some(name), Some(kind)) => {
                    types.push((name.to_owned(), kind.to_owned()));
                }
                (Some("#"), Some("HELP"), Some(name), Some(help)) if !help.trim().is_empty() => {
                    helps.insert(name.to_owned());
                }
                _ => {}
            }
        }
        (types, helps)
    }

    #[test]
    fn every_family_has_help_and_the_right_type_before_any_traffic() {
        let text = Metrics::new("memory", false).render();
        let (types, helps) = families(&text);
        for (name, kind) in [
            ("sidelock_acquires_total", "counter"),
            ("sidelock_wait_seconds", "histogram"),
            ("sidelock_hold_seconds", "histogram"),
            ("sidelock_held_locks", "gauge"),
            ("sidelock_waiters", "gauge"),
            ("sidelock_renewals_total", "counter"),
            ("sidelock_lost_total", "counter"),
            ("sidelock_expirations_total", "counter"),
            ("sidelock_force_releases_total", "counter"),
            ("sidelock_backend_operations_total", "counter"),
            ("sidelock_backend_errors_total", "counter"),
            ("sidelock_backend_operation_seconds", "histogram"),
            ("sidelock_backend_up", "gauge"),
            ("sidelock_stale_locks", "gauge"),
        ] {
            assert!(
                types.contains(&(name.to_owned(), kind.to_owned())),
                "{name} is not a {kind}:\n{text}"
            );
        }
        for (name, _) in &types {
            assert!(name.starts_with("sidelock_"), "{name}");
            assert!(helps.contains(name), "{name} has no help text");
        }
        // Known series exist at 0 before anything happened.
        for series in [
            "sidelock_lost_total{reason=\"expired\"} 0",
            "sidelock_lost_total{reason=\"force_released\"} 0",
            "sidelock_acquires_total{kind=\"lock\",result=\"timeout\"} 0",
            "sidelock_renewals_total{result=\"lost\"} 0",
            "sidelock_waiters{kind=\"lock\"} 0",
            "sidelock_backend_errors_total{backend=\"memory\",op=\"try_acquire\"} 0",
            "sidelock_wait_seconds_count{kind=\"semaphore\"} 0",
        ] {
            assert!(text.contains(series), "missing {series}:\n{text}");
        }
    }

    #[test]
    fn latency_buckets_span_sub_millisecond_to_minutes() {
        assert!(LATENCY_BUCKETS.first().is_some_and(|&b| b < 0.001));
        assert!(LATENCY_BUCKETS.last().is_some_and(|&b| b >= 60.0));
        assert!(HOLD_BUCKETS.last().is_some_and(|&b| b >= 3600.0));
        for buckets in [LATENCY_BUCKETS, HOLD_BUCKETS] {
            assert!(buckets.windows(2).all(|w| w[0] < w[1]));
        }
    }

    #[test]
    fn lock_labels_are_off_by_default() {
        let m = Metrics::new("memory", false);
        m.acquired(&key("orders"), "granted");
        assert!(!m.render().contains("orders"));
    }

    #[test]
    fn lock_labels_are_bounded() {
        let m = Metrics::new("memory", true);
        for i in 0..MAX_LOCK_LABELS + 100 {
            let k = key(&format!("lock-{i}"));
            m.acquired(&k, "granted");
            m.observe(&m.wait, &k, Duration::from_millis(1));
        }
        let text = m.render();
        let labelled: HashSet<&str> = text
            .lines()
            .filter(|l| l.starts_with("sidelock_acquires_total{"))
            .filter_map(|l| l.split("lock=\"").nth(1)?.split('"').next())
            .collect();
        assert_eq!(labelled.len(), MAX_LOCK_LABELS + 1, "500 names and _other");
        assert!(labelled.contains("_other"));
        assert!(labelled.contains("lock-0"));
        assert!(!labelled.contains(format!("lock-{}", MAX_LOCK_LABELS).as_str()));
        let other = text
            .lines()
            .find(|l| l.starts_with("sidelock_acquires_total{") && l.contains("lock=\"_other\""))
            .expect("an _other series");
        assert!(other.ends_with(" 100"), "{other}");
    }
}
