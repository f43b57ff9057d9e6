//! The accept loop: one task per HTTP/1.1 connection, graceful shutdown on
//! the sidecar's token.
//!
//! `axum::serve` would do, but its connections sniff for HTTP/2 first, and
//! the task of every connection carries that auto-detecting state as well
//! as the HTTP/1 one. A sidecar on loopback speaks HTTP/1.1 only, and every
//! waiting request and hold is an open connection, so the per-connection
//! size is the memory cost of waiting (see BENCHMARKS.md).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

/// How long to pause accepting after an accept error such as `EMFILE`, so a
/// full file table is not a busy loop.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// Serves `router` on `listener` until `stop` is cancelled, then asks every
/// connection to finish its request in flight and close, and returns when
/// all have (streams end on the same token).
///
/// Handlers see the peer address as `ConnectInfo<SocketAddr>`.
pub async fn serve(listener: TcpListener, router: Router, stop: CancellationToken) {
    let connections = TaskTracker::new();
    loop {
        let (stream, peer) = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("accept failed: {e}; pausing {ACCEPT_PAUSE:?}");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                    continue;
                }
            },
        };
        // Responses are single writes; without this an SSE event or a grant
        // could wait for the peer's delayed ACK.
        let _ = stream.set_nodelay(true);
        connections.spawn(connection(stream, peer, router.clone(), stop.clone()));
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

async fn connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    router: Router,
    stop: CancellationToken,
) {
    let _open = Open::count();
    let service = router.map_request(move |mut req: hyper::Request<Incoming>| {
        req.extensions_mut().insert(ConnectInfo(peer));
        req.map(axum::body::Body::new)
    });
    let service = TowerToHyperService::new(service);
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => log_end(r),
        () = stop.cancelled() => {
            conn.as_mut().graceful_shutdown();
            log_end(conn.await);
        }
    }
}

/// One open connection in [`crate::alloc::CONNECTIONS`], for as long as it lives.
struct Open;

impl Open {
    fn count() -> Self {
        crate::alloc::CONNECTIONS.fetch_add(1, Ordering::Relaxed);
        Open
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        crate::alloc::CONNECTIONS.fetch_sub(1, Ordering::Relaxed);
    }
}

fn log_end(r: Result<(), hyper::Error>) {
    if let Err(e) = r {
        tracing::trace!("connection ended: {e}");
    }
}
