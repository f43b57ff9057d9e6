//! Durations as people write them: one strict grammar for requests, flags,
//! environment variables and the config file, and the longest any may name.

use std::time::Duration;

/// The longest duration any setting may name, and the bound of a request's
/// `max_hold`: 365 days. Every time sum stays far from overflowing with it.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// `d` for a person: whole days as `N days` (humantime writes 365 days as
/// months), anything else as humantime does.
pub fn format_duration(d: Duration) -> String {
    const DAY: u64 = 24 * 3600;
    if d.subsec_nanos() == 0 && d.as_secs() >= DAY && d.as_secs().is_multiple_of(DAY) {
        format!("{} days", d.as_secs() / DAY)
    } else {
        humantime::format_duration(d).to_string()
    }
}

/// Parses `250ms`, `30s`, `5m`, `1h`, `1m30s`; a bare integer is milliseconds.
///
/// # Errors
/// A sentence naming the accepted forms.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    strict_duration(s).ok_or_else(|| {
        format!(
            "{s:?} is not a duration; use a whole number of milliseconds (250) or of ms, s, m, h \
             (250ms, 30s, 5m, 1h), largest unit first when combined (1m30s)"
        )
    })
}

/// The one duration grammar: `^[0-9]+$` (milliseconds) or `^([0-9]+(h|m|s|ms))+$`
/// with each unit at most once, largest first. Nothing finer than a
/// millisecond can be written, so no duration truncates to 0. Too large a
/// number saturates, for the caller's range check to name the maximum.
fn strict_duration(s: &str) -> Option<Duration> {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::from_millis(s.parse().unwrap_or(u64::MAX)));
    }
    const UNITS: [(&str, u64); 4] = [("h", 3_600_000), ("m", 60_000), ("s", 1_000), ("ms", 1)];
    let mut rest = s;
    let mut total: u64 = 0;
    let mut next_unit = 0;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let n: u64 = rest[..digits].parse().unwrap_or(u64::MAX);
        rest = &rest[digits..];
        let letters = rest.bytes().take_while(u8::is_ascii_lowercase).count();
        let unit = &rest[..letters];
        rest = &rest[letters..];
        let at = UNITS[next_unit..].iter().position(|(u, _)| *u == unit)? + next_unit;
        next_unit = at + 1;
        total = total.saturating_add(n.saturating_mul(UNITS[at].1));
    }
    (next_unit > 0).then(|| Duration::from_millis(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_only_the_documented_forms() {
        for (text, ms) in [
            ("0", 0),
            ("250", 250),
            ("250ms", 250),
            ("30s", 30_000),
            ("5m", 300_000),
            ("1h", 3_600_000),
            ("1m30s", 90_000),
            ("1h0m0s5ms", 3_600_005),
            ("99999999999999999999999", u64::MAX),
            ("99999999999999h", u64::MAX),
        ] {
            assert_eq!(
                parse_duration(text),
                Ok(Duration::from_millis(ms)),
                "{text}"
            );
        }
        for text in [
            "", " 30s", "30s ", "30sec", "5min", "1hr", "30s30s", "30s1m", "1d", "1ns", "500us",
            "0.5s", "-1s", "+1s", "1e3", "s", "1S", "1 s", "ms",
        ] {
            let err = parse_duration(text).unwrap_err();
            assert!(
                err.starts_with(&format!("{text:?} is not a duration")),
                "{err}"
            );
        }
    }

    #[test]
    fn durations_accept_units_and_bare_milliseconds() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1500"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("soon").unwrap_err().contains("250ms"));
        assert!(parse_duration("-5s").is_err());
    }
}
