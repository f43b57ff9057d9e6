//! Prometheus metrics: every family is registered here, with its help text.
//!
//! Lock names become labels only with `--metrics-lock-labels`, and then only
//! for the first [`MAX_LOCK_LABELS`] names seen; later names share the label
//! `_other`, so a million lock names cannot explode the series count.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use prometheus::{
    Encoder, Gauge, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::lock::{Kind, LockKey};

/// How many distinct lock names get their own label value.
pub const MAX_LOCK_LABELS: usize = 500;

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
                "Duration of backend operations, by operation.",
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
                "1 when the backend answered its last health check, else 0.",
            )
            .const_label("backend", backend),
        )
        .expect("valid metric");
        r.register(Box::new(backend_up.clone()))
            .expect("unique metric");
        Self {
            lock_labels: lock_labels.then(|| Mutex::new(HashSet::new())),
            acquires: counter(
                r,
                "acquires_total",
                "Acquire requests by result: granted, busy, timeout, cancelled, rejected, error.",
                lock_result,
            ),
            wait: histogram(
                r,
                "wait_seconds",
                "Time from an acquire request to its grant.",
                lock,
                LATENCY_BUCKETS,
            ),
            hold: histogram(
                r,
                "hold_seconds",
                "Time leases granted by this sidecar were held, from grant to end.",
                lock,
                HOLD_BUCKETS,
            ),
            held: gauge_vec(
                r,
                "held_locks",
                "Leases currently held through this sidecar.",
                &["kind"],
            ),
            waiters: gauge_vec(
                r,
                "waiters",
                "Requests of this sidecar waiting in a queue.",
                &["kind"],
            ),
            renewals: counter(
                r,
                "renewals_total",
                "Lease renewals (watchdog and keepalive) by result: ok, lost, error.",
                &["result"],
            ),
            lost: counter(
                r,
                "lost_total",
                "Leases that ended without their holder releasing them, by reason.",
                &["reason"],
            ),
            expirations: counter(
                r,
                "expirations_total",
                "Leases of this sidecar that reached their expiry.",
                &["kind"],
            ),
            backend_ops: backend_label(
                "backend_operations_total",
                "Backend operations by operation.",
                &["op"],
            ),
            backend_errors: backend_label(
                "backend_errors_total",
                "Backend operations that failed, by operation.",
                &["op"],
            ),
            backend_seconds,
            backend_up,
            stale: gauge(r, "stale_locks", "Entries of /v1/stale at the last scan."),
            http_requests: counter(
                r,
                "http_requests_total",
                "HTTP requests by method, route and status.",
                &["method", "route", "status"],
            ),
            http_seconds: histogram(
                r,
                "http_request_duration_seconds",
                "HTTP request durations by method and route (to the response head).",
                &["method", "route"],
                LATENCY_BUCKETS,
            ),
            force_releases: {
                let c = IntCounter::new("force_releases_total", "Admin force-releases.")
                    .expect("valid metric");
                r.register(Box::new(c.clone())).expect("unique metric");
                c
            },
            registry,
        }
    }

    /// The label values identifying `key`: its kind, plus the bounded lock
    /// label when lock labels are on.
    pub fn key_labels(&self, key: &LockKey) -> Vec<String> {
        let kind = kind_label(key.kind).to_owned();
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
        let mut labels = self.key_labels(key);
        labels.push(result.to_owned());
        let refs: Vec<&str> = labels.iter().map(String::as_str).collect();
        self.acquires.with_label_values(&refs).inc();
    }

    /// Records a wait or hold duration.
    pub fn observe(&self, family: &HistogramVec, key: &LockKey, d: Duration) {
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

/// The `kind` label value.
pub fn kind_label(kind: Kind) -> &'static str {
    match kind {
        Kind::Lock => "lock",
        Kind::Semaphore => "semaphore",
    }
}
