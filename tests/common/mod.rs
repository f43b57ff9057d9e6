//! Shared harness for the black-box HTTP tests (in the spirit of redis-rs's
//! `tests/support`): every test starts the real `sidelock` binary on an
//! ephemeral port and talks to it over real HTTP.
//!
//! * [`backend`]: the backends the conformance suite runs against, and the
//!   `backends` rstest template (adding a backend is one `#[case]` line).
//! * [`sidecar`]: [`SidecarBuilder`] / [`SidecarGuard`] for `sidelock serve`.
//! * [`api`]: typed HTTP helpers for locks and semaphores.
//! * [`sse`]: a small Server-Sent-Events reader with deadlines.
//! * [`problem`]: [`assert_problem`] for RFC 9457 error responses.
//! * [`cli`]: a guard for `sidelock run … -- CMD`.
//! * [`redis`]: real `redis-server` processes on free ports.
//! * [`browser`]: headless Chromium over WebDriver, for the dashboard.
//! * [`postgres`]: a schema per test on the machine's PostgreSQL, and
//!   throwaway clusters for tests that restart the server.
//! * [`zookeeper`]: real ZooKeeper servers (standalone or an ensemble of 3).
//! * [`netns`]: network namespaces with veth links that can be cut, for
//!   partition tests.
//!
//! Every test binary uses a different subset of these helpers.
#![allow(dead_code, unused_imports, unused_macros)]

pub mod api;
pub mod backend;
pub mod browser;
pub mod cli;
pub mod netns;
pub mod postgres;
pub mod problem;
pub mod process;
pub mod redis;
pub mod sidecar;
pub mod sse;
pub mod zookeeper;

pub use api::{Api, Grant, Holder, Keepalive, Kind, LockState, Released, Resource, Waiter};
pub(crate) use backend::backends;
pub use backend::{BackendGuard, TestBackend};
pub use problem::{assert_problem, problem_type};
pub use sidecar::{SidecarBuilder, SidecarGuard};
pub use sse::{HoldEvent, HoldStream, Queued, SseEvent, SseStream};

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long a sidecar may take to log `listening on …`.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);
/// Upper bound for any single non-streaming HTTP request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Default deadline for the next event on an SSE stream.
pub const EVENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default deadline for a process to exit once it has been told to.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between two probes of a condition that has no event to await.
pub const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// API token used by tests that enable `SIDELOCK_API_TOKEN`.
pub const API_TOKEN: &str = "test-api-token-0123456789abcdef";
/// Admin token used by tests that enable `SIDELOCK_ADMIN_TOKEN`.
pub const ADMIN_TOKEN: &str = "test-admin-token-fedcba9876543210";

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

/// A free loopback port (the listener is closed before a server binds it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral loopback port")
}

/// Polls `probe` every [`POLL_INTERVAL`] until it returns `Some`, panicking
/// after `timeout`. Only for state that has no event to await (for example
/// what `GET /v1/locks/{name}` reports).
pub async fn eventually<T>(
    what: &str,
    timeout: Duration,
    mut probe: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Awaits `fut`, panicking with `what` if it takes longer than `timeout`.
pub async fn within<F: Future>(what: &str, timeout: Duration, fut: F) -> F::Output {
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out after {timeout:?}: {what}"))
}
