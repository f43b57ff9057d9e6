//! The two charts, acquisitions per bucket and wait-time quantiles, laid
//! out in chart units from the recent statistics (the template draws them as
//! SVG).

use super::format::{fmt_duration_ms, fmt_latency_ms, fmt_rate};
use super::stats::{BUCKET_MS, Recent, StatsView};

/// Buckets the charts show: the last 5 minutes (the history keeps 15).
pub const CHART_BUCKETS: usize = 60;

/// An axis label of a chart.
#[derive(Debug, Clone)]
pub struct Tick {
    pub label: String,
    /// Position in chart units (0 at the bottom).
    pub y: f64,
}

/// One bar of the acquisitions chart, in chart units.
#[derive(Debug, Clone)]
pub struct Bar {
    pub x: f64,
    pub width: f64,
    pub granted_y: f64,
    pub granted_h: f64,
    pub refused_y: f64,
    pub refused_h: f64,
    pub title: String,
}

/// One line of the wait chart: SVG paths in chart units.
#[derive(Debug, Clone)]
pub struct Line {
    pub class: &'static str,
    pub label: &'static str,
    /// The line through consecutive buckets.
    pub d: String,
    /// A marker at every point (zero-length segments drawn with round caps).
    pub dots: String,
    /// The percentile over the whole window, for the legend.
    pub summary: String,
}

/// The two charts: plot areas are `CHART_BUCKETS` wide and 100 high; labels are HTML.
#[derive(Debug, Clone, Default)]
pub struct Charts {
    pub width: usize,
    pub bars: Vec<Bar>,
    pub rate_ticks: Vec<Tick>,
    pub lines: Vec<Line>,
    pub wait_ticks: Vec<Tick>,
    pub x_labels: Vec<&'static str>,
    pub empty: bool,
}

/// Rounds `v` up to 1, 2 or 5 times a power of ten.
pub(super) fn nice_ceiling(v: f64) -> f64 {
    if v <= 1.0 {
        return 1.0;
    }
    let magnitude = 10f64.powf(v.log10().floor());
    for step in [1.0, 2.0, 5.0, 10.0] {
        if v <= step * magnitude {
            return step * magnitude;
        }
    }
    10.0 * magnitude
}

/// The lowest and highest decade on the wait chart, in milliseconds (as log10).
pub(super) const WAIT_MIN_DECADE: i32 = -1; // 0.1 ms
pub(super) const WAIT_MIN_TOP_DECADE: i32 = 2; // at least up to 100 ms

pub(super) fn charts(stats: &StatsView, window: &Recent) -> Charts {
    let window_start =
        bucket_floor(stats.now_ms).saturating_sub(BUCKET_MS * (CHART_BUCKETS as u64 - 1));
    let slot = |start_ms: u64| (start_ms.saturating_sub(window_start) / BUCKET_MS) as f64;
    let visible: Vec<_> = stats
        .buckets
        .iter()
        .filter(|b| b.start_ms >= window_start)
        .collect();

    let per_second = |n: u64, b: &super::stats::Bucket| {
        let elapsed = if b.partial {
            stats.now_ms.saturating_sub(b.start_ms).max(1000)
        } else {
            BUCKET_MS
        };
        n as f64 * 1000.0 / elapsed as f64
    };
    let top = visible
        .iter()
        .map(|b| per_second(b.granted + b.busy + b.timeout, b))
        .fold(0.0, f64::max);
    let rate_max = nice_ceiling(top);
    let scale = |v: f64| (v / rate_max * 100.0).min(100.0);
    let bars = visible
        .iter()
        .filter(|b| b.granted + b.busy + b.timeout > 0)
        .map(|b| {
            let g = scale(per_second(b.granted, b));
            let r = scale(per_second(b.busy + b.timeout, b));
            let ago = stats.now_ms.saturating_sub(b.start_ms);
            Bar {
                x: slot(b.start_ms) + 0.1,
                width: 0.8,
                granted_y: round2(100.0 - g),
                granted_h: round2(g),
                refused_y: round2(100.0 - g - r),
                refused_h: round2(r),
                title: format!(
                    "{} ago: {} granted ({}/s), {} busy, {} timed out",
                    fmt_duration_ms(ago - ago % 1000),
                    b.granted,
                    fmt_rate(per_second(b.granted, b)),
                    b.busy,
                    b.timeout
                ),
            }
        })
        .collect();
    let rate_ticks = [1.0, 0.5, 0.0]
        .iter()
        .map(|f| Tick {
            label: format!("{}/s", fmt_rate(rate_max * f)),
            y: round2(f * 100.0),
        })
        .collect();

    let highest = visible
        .iter()
        .filter_map(|b| b.wait_p99_ms)
        .fold(0.0, f64::max);
    let top_decade = if highest > 0.0 {
        (highest.log10().ceil() as i32).max(WAIT_MIN_TOP_DECADE)
    } else {
        WAIT_MIN_TOP_DECADE
    };
    let decades = f64::from(top_decade - WAIT_MIN_DECADE);
    let y_of = |ms: f64| {
        let v = ms.max(10f64.powi(WAIT_MIN_DECADE)).log10();
        ((v - f64::from(WAIT_MIN_DECADE)) / decades * 100.0).clamp(0.0, 100.0)
    };
    let line =
        |class, label, summary: Option<f64>, pick: fn(&super::stats::Bucket) -> Option<f64>| {
            let mut d = String::new();
            let mut dots = String::new();
            let mut previous: Option<f64> = None;
            for b in &visible {
                let x = slot(b.start_ms) + 0.5;
                match pick(b) {
                    Some(ms) => {
                        let y = 100.0 - y_of(ms);
                        let joined = previous.is_some_and(|px| x - px <= 1.5);
                        d.push_str(&format!("{}{x:.1} {y:.2} ", if joined { "L" } else { "M" }));
                        dots.push_str(&format!("M{x:.1} {y:.2} L{x:.1} {y:.2} "));
                        previous = Some(x);
                    }
                    None => previous = None,
                }
            }
            Line {
                class,
                label,
                d: d.trim_end().to_owned(),
                dots: dots.trim_end().to_owned(),
                summary: summary.map_or_else(|| "–".into(), fmt_latency_ms),
            }
        };
    let lines = vec![
        line("p50", "p50", window.wait_p50_ms, |b| b.wait_p50_ms),
        line("p90", "p90", window.wait_p90_ms, |b| b.wait_p90_ms),
        line("p99", "p99", window.wait_p99_ms, |b| b.wait_p99_ms),
    ];
    let wait_ticks = (WAIT_MIN_DECADE..=top_decade)
        .rev()
        .map(|decade| Tick {
            label: fmt_latency_ms(10f64.powi(decade)),
            y: round2(y_of(10f64.powi(decade))),
        })
        .collect();
    Charts {
        width: CHART_BUCKETS,
        empty: visible.iter().all(|b| b.granted + b.busy + b.timeout == 0),
        bars,
        rate_ticks,
        lines,
        wait_ticks,
        x_labels: vec!["5 min ago", "4 min", "3 min", "2 min", "1 min", "now"],
    }
}

pub(super) fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

pub(super) fn bucket_floor(ms: u64) -> u64 {
    ms - ms % BUCKET_MS
}
