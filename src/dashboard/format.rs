//! Numbers and times as the page writes them (the page's script writes
//! live updates the same way).

use std::time::Duration;

/// `850 ms`, `12 s`, `2m 03s`, `1h 02m`, `3d 04h` (the same as the page's script).
pub fn fmt_duration_ms(ms: u64) -> String {
    let s = ms / 1000;
    if ms < 1000 {
        format!("{ms} ms")
    } else if s < 60 {
        format!("{s} s")
    } else if s < 3600 {
        format!("{}m {:02}s", s / 60, s % 60)
    } else if s < 86_400 {
        format!("{}h {:02}m", s / 3600, s % 3600 / 60)
    } else {
        format!("{}d {:02}h", s / 86_400, s % 86_400 / 3600)
    }
}

/// A latency: `0.25 ms`, `3.2 ms`, `45 ms`, `1.3 s`, `2m 05s`.
pub fn fmt_latency_ms(ms: f64) -> String {
    if ms < 0.1 {
        // Below the lowest histogram bucket: more digits would be invented.
        "< 0.1 ms".into()
    } else if ms < 1.0 {
        format!("{} ms", trim_float(ms, 2))
    } else if ms < 10.0 {
        format!("{} ms", trim_float(ms, 1))
    } else if ms < 1000.0 {
        format!("{:.0} ms", ms)
    } else if ms < 60_000.0 {
        format!("{} s", trim_float(ms / 1000.0, 1))
    } else {
        fmt_duration_ms(ms as u64)
    }
}

/// A rate: `0`, `0.4`, `12`, `1.2k`.
pub fn fmt_rate(v: f64) -> String {
    if v <= 0.0 {
        "0".into()
    } else if v < 10.0 {
        trim_float(v, 1)
    } else if v < 1000.0 {
        format!("{v:.0}")
    } else {
        format!("{}k", trim_float(v / 1000.0, 1))
    }
}

pub(super) fn trim_float(v: f64, decimals: usize) -> String {
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

/// The last second RFC 3339 writes (9999-12-31 23:59:59), in ms.
const LAST_SHOWN_MS: u64 = 253_402_300_799_000;

/// `2026-11-21 07:45:52 UTC`; a time past year 9999 (only a backend key
/// written by hand holds one) as that year's last second, which the
/// formatter refuses to go past.
pub fn fmt_utc(ms: u64) -> String {
    let at = std::time::UNIX_EPOCH + Duration::from_millis(ms.min(LAST_SHOWN_MS));
    humantime::format_rfc3339_seconds(at)
        .to_string()
        .replacen('T', " ", 1)
        .replace('Z', " UTC")
}
