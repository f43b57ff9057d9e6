//! Dashboard sign-in: one random session per sign-in, kept on the server
//! with an expiry, and a throttle on wrong tokens.
//!
//! A session value is 128 bits from the OS generator (the same as a lease
//! token), handed to the browser in an HttpOnly cookie and known to the
//! server until sign-out, expiry or restart. At most [`MAX_SESSIONS`] live
//! at once: a new sign-in past that ends the one closest to its expiry, so
//! sign-ins cannot grow the set without bound.
//!
//! Failed sign-ins draw from one token bucket for the whole sidecar
//! ([`BURST`] attempts, refilled at one per [`REFILL`]): when it is empty,
//! sign-ins answer 429 without looking at the token, so guessing runs at
//! one try per second at most. Wrong and refused sign-ins are logged in at
//! most one WARN line per [`REPORT_EVERY`], with their count.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::lock::Token;

/// Live sessions at most; a sign-in past that ends the oldest.
pub const MAX_SESSIONS: usize = 1024;
/// Failed sign-ins allowed in a burst before the throttle answers 429.
pub const BURST: u32 = 10;
/// The throttle gives back one attempt per this long.
pub const REFILL: Duration = Duration::from_secs(1);
/// At most one WARN line about failed sign-ins per this long.
pub const REPORT_EVERY: Duration = Duration::from_secs(10);

/// The sessions of signed-in browsers.
pub struct Sessions {
    /// How long a session lasts from its sign-in (`--dashboard-session-ttl`).
    ttl: Duration,
    /// Session value → when it ends. At most [`MAX_SESSIONS`] entries.
    live: Mutex<HashMap<String, Instant>>,
}

impl Sessions {
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            live: Mutex::new(HashMap::new()),
        }
    }

    /// How long a session lasts (the cookie's `Max-Age`).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Starts a session and returns its value.
    pub fn start(&self) -> String {
        let value = Token::generate().expose().to_owned();
        let now = Instant::now();
        // The configuration bounds the ttl; the fallback only avoids a panic.
        let ends = now.checked_add(self.ttl).unwrap_or(now);
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|_, end| *end > now);
        if live.len() >= MAX_SESSIONS
            && let Some(oldest) = live
                .iter()
                .min_by_key(|(_, end)| **end)
                .map(|(v, _)| v.clone())
        {
            live.remove(&oldest);
        }
        live.insert(value.clone(), ends);
        value
    }

    /// Whether `value` is a session that has not ended.
    pub fn valid(&self, value: &str) -> bool {
        let now = Instant::now();
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        match live.get(value) {
            Some(end) if *end > now => true,
            Some(_) => {
                live.remove(value);
                false
            }
            None => false,
        }
    }

    /// Ends the session `value` (sign-out); unknown values are ignored.
    pub fn end(&self, value: &str) {
        self.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(value);
    }
}

/// The token bucket of sign-in attempts and the WARN lines' aggregation.
pub struct Throttle {
    state: Mutex<Bucket>,
}

/// The throttle's state.
struct Bucket {
    /// Attempts available now (up to [`BURST`]), as of `at`.
    attempts: f64,
    /// When `attempts` was last brought up to date.
    at: Instant,
    /// Failed sign-ins not yet reported in a WARN line.
    unreported: u64,
    /// When the last WARN line was written.
    reported_at: Option<Instant>,
}

impl Default for Throttle {
    fn default() -> Self {
        Self {
            state: Mutex::new(Bucket {
                attempts: f64::from(BURST),
                at: Instant::now(),
                unreported: 0,
                reported_at: None,
            }),
        }
    }
}

impl Throttle {
    /// Takes one attempt from the bucket before a token is checked: `false`
    /// (throttled, counted as a failure) when none is left. Taken before
    /// the check, so concurrent guesses cannot pass together.
    pub fn attempt(&self, peer: SocketAddr) -> bool {
        let mut b = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let refilled = now.duration_since(b.at).as_secs_f64() / REFILL.as_secs_f64();
        b.attempts = (b.attempts + refilled).min(f64::from(BURST));
        b.at = now;
        if b.attempts >= 1.0 {
            b.attempts -= 1.0;
            true
        } else {
            report(&mut b, peer, now);
            false
        }
    }

    /// The attempt's token was right: it gives its attempt back.
    pub fn succeeded(&self) {
        let mut b = self.state.lock().unwrap_or_else(|e| e.into_inner());
        b.attempts = (b.attempts + 1.0).min(f64::from(BURST));
    }

    /// The attempt's token was wrong.
    pub fn failed(&self, peer: SocketAddr) {
        let mut b = self.state.lock().unwrap_or_else(|e| e.into_inner());
        report(&mut b, peer, Instant::now());
    }
}

/// Counts one failed sign-in and writes the WARN line when the last one is
/// [`REPORT_EVERY`] old, so a flood cannot fill the log.
fn report(b: &mut Bucket, peer: SocketAddr, now: Instant) {
    b.unreported += 1;
    if b.reported_at
        .is_none_or(|at| now.duration_since(at) >= REPORT_EVERY)
    {
        tracing::warn!(
            %peer,
            failed = b.unreported,
            "dashboard sign-in with a wrong token (failed sign-ins since the last such line; at most one line per 10 s)"
        );
        b.unreported = 0;
        b.reported_at = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_are_distinct_end_and_stay_bounded() {
        let sessions = Sessions::new(Duration::from_secs(60));
        let a = sessions.start();
        let b = sessions.start();
        assert_ne!(a, b);
        assert!(sessions.valid(&a) && sessions.valid(&b));
        sessions.end(&a);
        assert!(!sessions.valid(&a) && sessions.valid(&b));
        for _ in 0..MAX_SESSIONS + 10 {
            sessions.start();
        }
        assert_eq!(sessions.live.lock().unwrap().len(), MAX_SESSIONS);
        assert!(!sessions.valid(&b), "the oldest session made room");
    }

    #[test]
    fn a_session_of_no_duration_is_never_valid() {
        let sessions = Sessions::new(Duration::ZERO);
        assert!(!sessions.valid(&sessions.start()));
    }

    #[test]
    fn the_throttle_admits_a_burst_then_refuses() {
        let throttle = Throttle::default();
        let peer = SocketAddr::from(([127, 0, 0, 1], 1));
        for _ in 0..BURST {
            assert!(throttle.attempt(peer));
            throttle.failed(peer);
        }
        assert!(!throttle.attempt(peer));
    }
}
