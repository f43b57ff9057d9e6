//! Recent history for the dashboard's charts: acquisitions and wait-time
//! percentiles per 5-second bucket over the last 15 minutes.
//!
//! The history is sampled from the metric families themselves
//! (`sidelock_acquires_total`, `sidelock_wait_seconds`) at every bucket
//! boundary, so it costs nothing on the request path, never misses an
//! acquisition, and agrees with what Prometheus scrapes. Percentiles are
//! estimated from the histogram buckets the way `histogram_quantile` does
//! (linear interpolation inside the bucket), so they are as precise as the
//! buckets: sub-millisecond to minutes.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::{Extension, Json};
use prometheus::core::Collector;
use serde::Serialize;
use utoipa::ToSchema;

use crate::clock::{instant_at, now_ms};
use crate::core::Core;
use crate::http::App;
use crate::http::params::{NoParams, Params};
use crate::http::problem::Problem;
use crate::metrics::Metrics;

/// Width of one bucket.
pub const BUCKET_MS: u64 = 5_000;
/// Buckets kept: 15 minutes.
pub const BUCKETS: usize = 180;

/// Acquire counts and the wait histogram: cumulative at one moment (as
/// [`Counts::read`] takes them from the metric families), or over an interval
/// (as [`Counts::since`] takes the difference of two).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Counts {
    granted: u64,
    busy: u64,
    timeout: u64,
    /// Cancelled, rejected and failed acquires.
    other: u64,
    /// `(upper bound in seconds, cumulative count)` of the wait histogram,
    /// summed over every series (kinds, and lock labels when on).
    wait: Vec<(f64, u64)>,
    wait_count: u64,
    wait_sum: f64,
}

impl Counts {
    /// Reads the current totals.
    pub(crate) fn read(metrics: &Metrics) -> Self {
        let mut t = Self::default();
        for family in metrics.acquires.collect() {
            for metric in family.get_metric() {
                let result = metric
                    .get_label()
                    .iter()
                    .find(|l| l.name() == "result")
                    .map(|l| l.value());
                // Counters are integers stored as f64.
                let n = metric.get_counter().value() as u64;
                match result {
                    Some("granted") => t.granted += n,
                    Some("busy") => t.busy += n,
                    Some("timeout") => t.timeout += n,
                    _ => t.other += n,
                }
            }
        }
        for family in metrics.wait.collect() {
            for metric in family.get_metric() {
                let h = metric.get_histogram();
                t.wait_count += h.get_sample_count();
                t.wait_sum += h.get_sample_sum();
                let buckets = h.get_bucket();
                if t.wait.is_empty() {
                    t.wait = buckets.iter().map(|b| (b.upper_bound(), 0)).collect();
                }
                for (slot, b) in t.wait.iter_mut().zip(buckets) {
                    slot.1 += b.cumulative_count();
                }
            }
        }
        t
    }

    /// What happened between `earlier` and `self`.
    fn since(&self, earlier: &Counts) -> Counts {
        let wait = self
            .wait
            .iter()
            .enumerate()
            .map(|(i, &(le, n))| {
                let before = earlier.wait.get(i).map_or(0, |b| b.1);
                (le, n.saturating_sub(before))
            })
            .collect();
        Counts {
            granted: self.granted.saturating_sub(earlier.granted),
            busy: self.busy.saturating_sub(earlier.busy),
            timeout: self.timeout.saturating_sub(earlier.timeout),
            other: self.other.saturating_sub(earlier.other),
            wait,
            wait_count: self.wait_count.saturating_sub(earlier.wait_count),
            wait_sum: (self.wait_sum - earlier.wait_sum).max(0.0),
        }
    }
}

/// The `q` quantile (0..1) of a histogram given as cumulative bucket counts,
/// in seconds, interpolated linearly inside the bucket like Prometheus's
/// `histogram_quantile`. `None` without observations. Observations above the
/// highest finite bound report that bound.
pub fn quantile(buckets: &[(f64, u64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut lower = 0.0;
    let mut below = 0u64;
    for &(le, cumulative) in buckets {
        if cumulative as f64 >= rank && cumulative > below {
            if le.is_infinite() {
                return Some(lower);
            }
            let inside = (cumulative - below) as f64;
            return Some(lower + (le - lower) * ((rank - below as f64) / inside).clamp(0.0, 1.0));
        }
        if le.is_finite() {
            lower = le;
        }
        below = cumulative;
    }
    Some(lower)
}

/// One bucket of the history.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Bucket {
    /// Unix milliseconds; buckets are aligned to multiples of `bucket_ms`.
    pub start_ms: u64,
    /// The bucket still running: its counts cover `start_ms` to `now_ms` only.
    pub partial: bool,
    /// Acquires granted.
    pub granted: u64,
    /// Try-once acquires refused because the lock was held.
    pub busy: u64,
    /// Waits that ran out before a grant.
    pub timeout: u64,
    /// Acquires cancelled (client gone, shutdown), rejected (429, bad semaphore
    /// limit) or failed (backend outage).
    pub other: u64,
    /// Grants per second over the bucket (over the elapsed part if partial).
    #[serde(serialize_with = "three_decimals")]
    pub granted_per_second: f64,
    /// Wait-time percentiles of the grants in this bucket, in milliseconds
    /// (estimated from the `sidelock_wait_seconds` buckets); absent without grants.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "three_decimals_opt"
    )]
    pub wait_p50_ms: Option<f64>,
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "three_decimals_opt"
    )]
    pub wait_p90_ms: Option<f64>,
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "three_decimals_opt"
    )]
    pub wait_p99_ms: Option<f64>,
    /// Mean wait of the grants in this bucket, in milliseconds.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "three_decimals_opt"
    )]
    pub wait_mean_ms: Option<f64>,
}

/// `x` to three decimals (a microsecond of a millisecond figure): the
/// estimates carry no more, and binary fractions (`0.09000000000000001`)
/// would show through.
fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn three_decimals<S: serde::Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(round3(*x))
}

fn three_decimals_opt<S: serde::Serializer>(x: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match x {
        Some(x) => s.serialize_some(&round3(*x)),
        None => s.serialize_none(),
    }
}

impl Bucket {
    fn new(start_ms: u64, elapsed_ms: u64, partial: bool, d: &Counts) -> Self {
        let pct = |q| quantile(&d.wait, q).map(|s| s * 1000.0);
        Bucket {
            start_ms,
            partial,
            granted: d.granted,
            busy: d.busy,
            timeout: d.timeout,
            other: d.other,
            granted_per_second: d.granted as f64 * 1000.0 / elapsed_ms.max(1) as f64,
            wait_p50_ms: pct(0.5),
            wait_p90_ms: pct(0.9),
            wait_p99_ms: pct(0.99),
            wait_mean_ms: (d.wait_count > 0).then(|| d.wait_sum * 1000.0 / d.wait_count as f64),
        }
    }
}

/// The answer of `GET /v1/stats`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct StatsView {
    pub bucket_ms: u64,
    /// How far back the history reaches at most.
    pub window_ms: u64,
    pub now_ms: u64,
    /// Oldest first; the last one is the running (partial) bucket. History
    /// starts when the sidecar started.
    pub buckets: Vec<Bucket>,
}

/// A summary over the last `n` buckets, for the dashboard's tiles.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recent {
    pub granted: u64,
    pub refused: u64,
    pub granted_per_second: f64,
    pub wait_p50_ms: Option<f64>,
    pub wait_p90_ms: Option<f64>,
    pub wait_p99_ms: Option<f64>,
}

struct Ring {
    /// Start of the running bucket.
    start_ms: u64,
    /// Counts at `start_ms`.
    base: Counts,
    /// Finished buckets with their raw deltas (for percentiles over windows).
    done: VecDeque<(Bucket, Counts)>,
}

/// The chart history of one sidecar.
pub struct Stats {
    ring: Mutex<Ring>,
}

fn bucket_start(at_ms: u64) -> u64 {
    at_ms - at_ms % BUCKET_MS
}

impl Stats {
    /// Starts the history now, from the current totals.
    pub fn new(metrics: &Metrics) -> Self {
        Stats {
            ring: Mutex::new(Ring {
                start_ms: now_ms(),
                base: Counts::read(metrics),
                done: VecDeque::with_capacity(BUCKETS),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes the running bucket at `at_ms` with `totals`, starting the next.
    fn close(&self, at_ms: u64, totals: Counts) {
        let mut ring = self.lock();
        if at_ms <= ring.start_ms {
            return;
        }
        let delta = totals.since(&ring.base);
        let start = bucket_start(ring.start_ms);
        let bucket = Bucket::new(start, at_ms - ring.start_ms, false, &delta);
        if ring.done.len() == BUCKETS {
            ring.done.pop_front();
        }
        ring.done.push_back((bucket, delta));
        ring.start_ms = at_ms;
        ring.base = totals;
    }

    /// The history, ending with the running bucket as of now.
    pub fn view(&self, metrics: &Metrics) -> StatsView {
        let now = now_ms();
        let totals = Counts::read(metrics);
        let ring = self.lock();
        let mut buckets: Vec<Bucket> = ring.done.iter().map(|(b, _)| b.clone()).collect();
        let running = totals.since(&ring.base);
        buckets.push(Bucket::new(
            bucket_start(ring.start_ms),
            now.saturating_sub(ring.start_ms),
            true,
            &running,
        ));
        StatsView {
            bucket_ms: BUCKET_MS,
            window_ms: BUCKET_MS * BUCKETS as u64,
            now_ms: now,
            buckets,
        }
    }

    /// Counts over the finished buckets of the last `window_ms` plus the running one.
    pub fn recent(&self, metrics: &Metrics, window_ms: u64) -> Recent {
        let now = now_ms();
        let totals = Counts::read(metrics);
        let ring = self.lock();
        let from = now.saturating_sub(window_ms);
        let mut sum = totals.since(&ring.base);
        let mut covered_ms = now.saturating_sub(ring.start_ms);
        for (bucket, delta) in ring.done.iter().rev() {
            if bucket.start_ms < from {
                break;
            }
            sum.granted += delta.granted;
            sum.busy += delta.busy;
            sum.timeout += delta.timeout;
            for (slot, add) in sum.wait.iter_mut().zip(&delta.wait) {
                slot.1 += add.1;
            }
            covered_ms += BUCKET_MS;
        }
        Recent {
            granted: sum.granted,
            refused: sum.busy + sum.timeout,
            granted_per_second: sum.granted as f64 * 1000.0 / covered_ms.max(1000) as f64,
            wait_p50_ms: quantile(&sum.wait, 0.5).map(|s| s * 1000.0),
            wait_p90_ms: quantile(&sum.wait, 0.9).map(|s| s * 1000.0),
            wait_p99_ms: quantile(&sum.wait, 0.99).map(|s| s * 1000.0),
        }
    }
}

/// Closes a bucket at every 5-second boundary until shutdown.
pub async fn sample(core: Arc<Core>, stats: Arc<Stats>) {
    loop {
        let next = bucket_start(now_ms()) + BUCKET_MS;
        tokio::select! {
            () = core.shutdown.cancelled() => return,
            () = tokio::time::sleep_until(instant_at(next)) => {}
        }
        stats.close(now_ms(), Counts::read(&core.metrics));
    }
}

#[utoipa::path(get, path = "/v1/stats", tag = "operations",
    responses(
        (status = 200, body = StatsView, description = "Per-bucket acquisitions and wait-time percentiles"),
        (status = 401, body = Problem, content_type = "application/problem+json", description = "Missing or wrong API token"),
        (status = 429, body = Problem, content_type = "application/problem+json", description = "too-many-failed-tokens: more than 10 wrong tokens from this address; the token was not compared (Retry-After)"),
    ))]
/// Acquisitions and wait-time percentiles per 5-second bucket over the last
/// 15 minutes (the dashboard's charts).
pub async fn stats(
    State(app): State<Arc<App>>,
    Extension(dashboard): Extension<Arc<super::Dashboard>>,
    Params(_none): Params<NoParams>,
) -> Json<StatsView> {
    Json(dashboard.stats.view(&app.core.metrics))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock::LockKey;
    use std::time::Duration;

    fn key(name: &str) -> LockKey {
        LockKey::lock(name)
    }

    #[test]
    fn quantile_interpolates_inside_the_bucket_like_prometheus() {
        let buckets = [(0.1, 0), (0.2, 10), (0.4, 20), (f64::INFINITY, 20)];
        assert_eq!(quantile(&buckets, 0.5), Some(0.2));
        let p75 = quantile(&buckets, 0.75).unwrap();
        assert!((p75 - 0.3).abs() < 1e-9, "{p75}");
        let p25 = quantile(&buckets, 0.25).unwrap();
        assert!((p25 - 0.15).abs() < 1e-9, "{p25}");
        assert_eq!(quantile(&[(0.1, 0), (f64::INFINITY, 0)], 0.5), None);
        assert_eq!(quantile(&[], 0.5), None);
        // Everything above the highest bound reports that bound.
        assert_eq!(quantile(&[(0.1, 0), (f64::INFINITY, 3)], 0.99), Some(0.1));
    }

    #[test]
    fn figures_are_written_with_at_most_three_decimals() {
        let d = Counts {
            granted: 1,
            wait: vec![(0.1, 0), (0.25, 3), (f64::INFINITY, 3)],
            wait_count: 1,
            wait_sum: 0.00009,
            ..Counts::default()
        };
        let json = serde_json::to_value(Bucket::new(0, 3000, true, &d)).unwrap();
        assert_eq!(
            json["granted_per_second"],
            serde_json::json!(0.333),
            "{json}"
        );
        assert_eq!(json["wait_mean_ms"], serde_json::json!(0.09), "{json}");
        assert_eq!(json["wait_p50_ms"], serde_json::json!(175.0), "{json}");
        assert_eq!(json["wait_p90_ms"], serde_json::json!(235.0), "{json}");
    }

    #[test]
    fn buckets_count_what_happened_in_them() {
        let m = Metrics::new("memory", false);
        let stats = Stats::new(&m);
        let k = key("a");
        for _ in 0..3 {
            m.acquired(&k, "granted");
            m.observe(&m.wait, &k, Duration::from_millis(2));
        }
        m.acquired(&k, "busy");
        let start = stats.lock().start_ms;
        stats.close(start + BUCKET_MS, Counts::read(&m));
        m.acquired(&k, "timeout");
        m.acquired(&k, "granted");
        m.observe(&m.wait, &k, Duration::from_secs(3));

        let view = stats.view(&m);
        assert_eq!(view.buckets.len(), 2);
        let first = &view.buckets[0];
        assert!(!first.partial);
        assert_eq!((first.granted, first.busy, first.timeout), (3, 1, 0));
        assert!((first.granted_per_second - 0.6).abs() < 1e-9);
        let p50 = first.wait_p50_ms.unwrap();
        assert!((1.0..=2.5).contains(&p50), "{p50}");
        let running = &view.buckets[1];
        assert!(running.partial);
        assert_eq!((running.granted, running.timeout), (1, 1));
        let p99 = running.wait_p99_ms.unwrap();
        assert!((2500.0..=5000.0).contains(&p99), "{p99}");

        let recent = stats.recent(&m, 60_000);
        assert_eq!((recent.granted, recent.refused), (4, 2));
    }

    #[test]
    fn history_is_bounded() {
        let m = Metrics::new("memory", false);
        let stats = Stats::new(&m);
        let mut at = stats.lock().start_ms;
        for _ in 0..BUCKETS + 20 {
            at += BUCKET_MS;
            stats.close(at, Counts::read(&m));
        }
        assert_eq!(stats.view(&m).buckets.len(), BUCKETS + 1);
    }
}
