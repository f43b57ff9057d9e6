//! Shared harness for the black-box HTTP tests (in the spirit of redis-rs's
//! `tests/support`): every test starts the real `sidelock` binary on an
//! ephemeral port and talks to it over real HTTP.
//!
//! * [`backend`]: the backends the conformance suite runs against, and the
//!   `backends` rstest template (adding a backend is one `#[case]` line), and
//!   `shared_backends`, the networked ones two sidecars share.
//! * [`sidecar`]: [`SidecarBuilder`] / [`SidecarGuard`] for `sidelock serve`.
//! * [`api`]: typed HTTP helpers for locks and semaphores.
//! * [`sse`]: a small Server-Sent-Events reader with deadlines.
//! * [`problem`]: [`assert_problem`] for RFC 9457 error responses.
//! * [`cli`]: a guard for `sidelock run … -- CMD`.
//! * [`browser`]: headless Chromium over WebDriver, for the dashboard.
//! * `redis`, `zookeeper`, `postgres`, `netns`, `process`, [`free_port`],
//!   [`eventually`], [`within`]: the real servers and process guards, from
//!   the `sidelock-test-support` crate (the bench uses them too).
//!
//! Every test binary uses a different subset of these helpers.

pub mod api;
pub mod backend;
pub mod browser;
pub mod cli;
pub mod problem;
pub mod sidecar;
pub mod sse;

pub use sidelock_test_support::{
    POLL_INTERVAL, eventually, free_port, netns, postgres, process, proxy, redis, within, zookeeper,
};

pub use api::{Api, Grant, Keepalive, Kind, Released, Resource};
pub use backend::{BackendGuard, TestBackend};
pub(crate) use backend::{backends, shared_backends};
pub use problem::{assert_problem, problem_type};
pub use sidecar::{SidecarBuilder, SidecarGuard};
pub use sse::{HoldEvent, HoldStream, Queued, SseStream};

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long a sidecar may take to log `listening on …`.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);
/// Upper bound for any single non-streaming HTTP request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Default deadline for the next event on an SSE stream.
pub const EVENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default deadline for a process to exit once it has been told to.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

/// API token used by tests that enable `SIDELOCK_API_TOKEN`.
pub const API_TOKEN: &str = "test-api-token-0123456789abcdef";
/// Admin token used by tests that enable `SIDELOCK_ADMIN_TOKEN`.
pub const ADMIN_TOKEN: &str = "test-admin-token-fedcba9876543210";

/// Milliseconds since the Unix epoch (the unit of every `*_ms` timestamp).
pub fn now_ms() -> u64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970");
    u64::try_from(since_epoch.as_millis()).expect("timestamp fits in u64")
}

/// A lock name no other test (or earlier run against a shared backend) uses:
/// `<prefix>-<pid>-<counter>-<nanos>`, only characters valid in lock names.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{prefix}-{}-{n}-{nanos:08x}", std::process::id())
}
