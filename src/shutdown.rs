//! Shutdown: one [`CancellationToken`] cancelled on SIGTERM or SIGINT drives
//! everything — the HTTP server's graceful stop, every SSE stream, every
//! waiter and every background task.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Cancels `token` on the first SIGTERM or SIGINT.
pub fn on_signal(token: CancellationToken) {
    tokio::spawn(async move {
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!(
                "cannot install signal handlers; SIGTERM will not shut down gracefully"
            );
            return;
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
            () = token.cancelled() => return,
        }
        token.cancel();
    });
}
