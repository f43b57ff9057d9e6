//! The sidecar process: open the backend, serve HTTP, shut down cleanly.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::backend;
use crate::clock::now_ms;
use crate::config::Settings;
use crate::core::Core;
use crate::dashboard::{self, Dashboard};
use crate::http::{self, App};
use crate::metrics::Metrics;
use crate::shutdown;
use crate::wakeups::Wakeups;

/// Runs a sidecar until SIGTERM/SIGINT, then releases everything it holds.
///
/// # Errors
/// A sentence for the operator when the backend URL is bad or the listen
/// address cannot be bound.
pub async fn serve(settings: Settings) -> Result<(), String> {
    // Every hold and waiter is an open connection: allow as many as the hard limit.
    let files = raise_fd_limit();
    tracing::debug!(files, "open-file limit");
    let token = CancellationToken::new();
    shutdown::on_signal(token.clone());
    let wakeups = Wakeups::default();
    let backend = backend::open(
        &settings.backend,
        &settings.backend_options,
        wakeups.clone(),
    )
    .await?;
    let description = backend.describe();
    let metrics = Arc::new(Metrics::new(
        description.kind.as_str(),
        settings.metrics_lock_labels,
    ));
    let core = Core::new(
        backend,
        wakeups,
        settings.sidecar_id.clone(),
        settings.limits.clone(),
        metrics,
        token.clone(),
    );
    core.follow_losses();
    let dashboard = Arc::new(Dashboard::new(
        &core.metrics,
        &settings.sidecar_id,
        settings.dashboard_session_ttl,
    ));
    let mut listeners = Vec::with_capacity(settings.listen.len());
    for addr in &settings.listen {
        listeners.push(http::listener::Listener::bind(addr).await?);
    }
    for listener in &listeners {
        tracing::info!(
            sidecar = %settings.sidecar_id,
            backend = %description.url,
            safety = %description.safety,
            "listening on {}",
            listener.shown
        );
    }
    core.monitor();
    core.tasks.spawn(dashboard::stats::sample(
        core.clone(),
        dashboard.stats.clone(),
    ));

    let grace = settings.shutdown_grace;
    let limits = settings.connections.clone();
    let cap = limits.cap_within(files);
    if cap < limits.max_connections {
        tracing::warn!(
            cap,
            files,
            "max_connections lowered to fit the open-file limit"
        );
    }
    let app = Arc::new(App {
        core: core.clone(),
        settings: settings.clone(),
        started_at_ms: now_ms(),
        event_streams: Arc::new(tokio::sync::Semaphore::new(
            crate::http::locks::MAX_EVENT_STREAMS,
        )),
        observe_streams: Arc::new(tokio::sync::Semaphore::new(
            crate::http::elections::MAX_OBSERVE_STREAMS,
        )),
        finishers: Arc::new(http::locks::Finishers::new(core.tasks.clone(), cap)),
        throttle: Default::default(),
    });
    let drained = async {
        let router = http::router(
            app,
            dashboard::api(dashboard.clone()),
            dashboard::router(dashboard),
        );
        http::server::serve(listeners, router, limits, cap, token.clone()).await;
        Ok(())
    };
    // The server stops when every connection is done; holds and event streams
    // end on the token, but a client that never reads must not keep us past the grace.
    let served = tokio::select! {
        r = drained => r,
        () = async { token.cancelled().await; tokio::time::sleep(grace).await } => {
            tracing::warn!(
                "connections still open after the grace period; they close at exit, and the \
                 leases of holds whose clients have not let go are left to lapse"
            );
            Ok(())
        }
    };
    let released = core.release_everything().await;
    core.tasks.close();
    if tokio::time::timeout(grace, core.tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!("background tasks still running after the grace period");
    }
    core.backend().close().await;
    tracing::info!(released, "stopped");
    served
}

/// Raises this process's soft limit of open files to its hard limit and
/// returns the new soft limit.
pub fn raise_fd_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
                hard
            } else {
                soft
            }
        }
        Ok((soft, _)) => soft,
        Err(_) => 0,
    }
}
