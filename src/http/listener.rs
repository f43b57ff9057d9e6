//! Where the sidecar listens: a TCP address, or a Unix-domain socket file
//! (mode 0660, removed at exit, a stale one replaced, a live one or a
//! non-socket refused), and what a handler can tell of a connection that
//! came over the socket.

use std::io;
use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio_util::either::Either;

use crate::config::Listen;

/// One accepted connection, over TCP or a Unix-domain socket.
pub(super) type Conn = Either<TcpStream, UnixStream>;

/// The peer address handlers see for a Unix-socket connection: it is a
/// process on this host, as a loopback peer is (one throttle bucket with
/// loopback TCP clients).
pub const UNIX_PEER: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);

/// Marks a request that came over a Unix socket: only processes that may
/// open the socket file reach it (no browser, no DNS rebinding), so any
/// `Host` is this sidecar's — clients name socket hosts in many ways
/// (`localhost`, the percent-encoded path).
#[derive(Debug, Clone, Copy)]
pub struct OverUnixSocket;

/// A bound listener and what it shows in logs.
pub struct Listener {
    socket: Either<TcpListener, UnixListener>,
    /// The bound address (`127.0.0.1:40123`, `unix:/run/s.sock`).
    pub shown: String,
    /// Removes the socket file when the listener is gone.
    _file: Option<SocketFile>,
}

/// A Unix socket's file, removed on drop (graceful exit).
struct SocketFile(std::path::PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Listener {
    /// Binds `addr`. A Unix socket file left by a process that is gone is
    /// replaced; one where a process still accepts is refused, so a second
    /// sidecar never takes over the first one's clients. The socket is made
    /// mode 0660 (owner and group: the pod's containers sharing it).
    ///
    /// # Errors
    /// A sentence naming `--listen`, the address and the cause.
    pub async fn bind(addr: &Listen) -> Result<Self, String> {
        let cannot = |e: io::Error| format!("--listen {addr}: cannot listen there: {e}");
        match addr {
            Listen::Tcp(a) => {
                let socket = TcpListener::bind(a).await.map_err(cannot)?;
                let shown = socket.local_addr().map_err(cannot)?.to_string();
                Ok(Self {
                    socket: Either::Left(socket),
                    shown,
                    _file: None,
                })
            }
            Listen::Unix(path) => {
                if std::fs::symlink_metadata(path).is_ok() {
                    if UnixStream::connect(path).await.is_ok() {
                        return Err(format!(
                            "--listen {addr}: another process accepts connections on that socket; stop it or choose another path"
                        ));
                    }
                    std::fs::remove_file(path).map_err(cannot)?;
                }
                let socket = UnixListener::bind(path).map_err(cannot)?;
                let file = SocketFile(path.clone());
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
                    .map_err(cannot)?;
                Ok(Self {
                    socket: Either::Right(socket),
                    shown: addr.to_string(),
                    _file: Some(file),
                })
            }
        }
    }

    pub(super) async fn accept(&self) -> io::Result<(Conn, SocketAddr)> {
        match &self.socket {
            Either::Left(tcp) => {
                let (stream, peer) = tcp.accept().await?;
                // Responses are single writes; without this an SSE event or
                // a grant could wait for the peer's delayed ACK.
                let _ = stream.set_nodelay(true);
                Ok((Either::Left(stream), peer))
            }
            Either::Right(unix) => {
                let (stream, _) = unix.accept().await?;
                Ok((Either::Right(stream), UNIX_PEER))
            }
        }
    }
}
