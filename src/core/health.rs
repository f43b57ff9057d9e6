//! Whether the backend answers, as this sidecar last saw it — from every
//! backend operation, requests' and the periodic check's alike — so that an
//! outage is one WARN line when it starts (with the backend's redacted
//! address and a readable cause), a reminder every few minutes while it
//! lasts, and one line when it ends; and the `sidelock_backend_up` gauge,
//! `/readyz` and the dashboard agree with the log.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus::Gauge;

use crate::backend::{BackendKind, Cause, Description};
use crate::clock::now_ms;

/// How often an outage that goes on is logged again.
const REMIND_EVERY: Duration = Duration::from_secs(300);

/// The backend's health as last seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// Nothing has been asked of the backend yet.
    Unknown,
    Up,
    /// The last operation could not reach it, for this cause, since then
    /// (Unix ms).
    Down {
        cause: Cause,
        since_ms: u64,
    },
}

/// The tracker; see the module doc.
pub struct Health {
    kind: BackendKind,
    /// The redacted URL.
    url: String,
    gauge: Gauge,
    state: Mutex<State>,
}

struct State {
    seen: Seen,
    /// When the outage was last logged.
    logged: Instant,
    /// When an operation last reached the backend.
    reached: Option<Instant>,
}

impl Health {
    pub fn new(description: &Description, gauge: Gauge) -> Self {
        Self {
            kind: description.kind,
            url: description.url.clone(),
            gauge,
            state: Mutex::new(State {
                seen: Seen::Unknown,
                logged: Instant::now(),
                reached: None,
            }),
        }
    }

    /// An operation reached the backend.
    pub fn reached(&self) {
        let mut state = self.lock();
        if let Seen::Down { since_ms, .. } = state.seen {
            let down = Duration::from_millis(now_ms().saturating_sub(since_ms));
            tracing::info!(
                "backend reachable again: {} {} (unreachable for {})",
                self.kind,
                self.url,
                humantime::format_duration(Duration::from_secs(down.as_secs()))
            );
        }
        state.seen = Seen::Up;
        state.reached = Some(Instant::now());
        self.gauge.set(1.0);
    }

    /// Whether the last operation reached the backend, within `within`.
    pub fn reached_within(&self, within: Duration) -> bool {
        let state = self.lock();
        state.seen == Seen::Up && state.reached.is_some_and(|at| at.elapsed() < within)
    }

    /// Whether the last operation could not reach the backend.
    pub fn is_down(&self) -> bool {
        matches!(self.lock().seen, Seen::Down { .. })
    }

    /// An operation could not reach the backend.
    pub fn unreachable(&self, cause: Cause) {
        let mut state = self.lock();
        match state.seen {
            Seen::Down { since_ms, .. } => {
                if state.logged.elapsed() >= REMIND_EVERY {
                    let down = Duration::from_millis(now_ms().saturating_sub(since_ms));
                    tracing::warn!(
                        "backend still unreachable: {} {}: {cause} (for {})",
                        self.kind,
                        self.url,
                        humantime::format_duration(Duration::from_secs(down.as_secs()))
                    );
                    state.logged = Instant::now();
                }
                state.seen = Seen::Down { cause, since_ms };
            }
            Seen::Up | Seen::Unknown => {
                tracing::warn!("backend unreachable: {} {}: {cause}", self.kind, self.url);
                state.logged = Instant::now();
                state.seen = Seen::Down {
                    cause,
                    since_ms: now_ms(),
                };
            }
        }
        self.gauge.set(0.0);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
