//! Real servers for sidelock's tests and its bench, in the spirit of
//! redis-rs's `tests/support`: every server runs as a child process on a
//! free loopback port, in a temporary directory with a log file, and is
//! killed and reaped when its guard drops; readiness is awaited with a
//! deadline and the log is printed when a test fails.
//!
//! # Layout
//!
//! * [`process`]: [`ChildGuard`](process::ChildGuard), the child that is always reaped.
//! * [`redis`]: `redis-server` (single, with a password, Sentinel, Cluster, independent nodes).
//! * [`zookeeper`]: ZooKeeper, standalone or an ensemble of 3.
//! * [`postgres`]: a schema per test on the machine's PostgreSQL, and
//!   throwaway clusters for tests that restart the server.
//! * [`netns`]: network namespaces with veth links to cut, for partition tests.
//! * [`proxy`]: a TCP proxy that loses the answer to a chosen request.

pub mod netns;
pub mod postgres;
pub mod process;
pub mod proxy;
pub mod redis;
pub mod zookeeper;

use std::time::{Duration, Instant};

/// Pause between two probes of a condition that has no event to await.
pub const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// A free loopback port (the listener is closed before a server binds it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral loopback port")
}

/// Polls `probe` every [`POLL_INTERVAL`] until it returns `Some`, panicking
/// after `timeout`. Only for state that has no event to await.
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
