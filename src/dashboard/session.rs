//! Dashboard sign-in: one random session per sign-in, kept on the server
//! with an expiry.
//!
//! A session value is 128 bits from the OS generator (the same as a lease
//! token), handed to the browser in an HttpOnly cookie and known to the
//! server until sign-out, expiry or restart. At most [`MAX_SESSIONS`] live
//! at once: a new sign-in past that ends the one closest to its expiry, so
//! sign-ins cannot grow the set without bound.
//!
//! Wrong tokens go through the sidecar's one throttle of failed token
//! checks ([`crate::http::throttle`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::lock::Token;

/// Live sessions at most; a sign-in past that ends the oldest.
pub const MAX_SESSIONS: usize = 1024;

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
}
