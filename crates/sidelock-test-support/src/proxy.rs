//! A loopback TCP proxy that can lose one answer: the request carrying
//! chosen bytes reaches the server, and its client's connection is reset
//! before the answer comes back (the call ran; its caller cannot know).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The proxy's listener task; dropping the guard stops it (connections
/// already open keep going until either side closes).
pub struct CuttingProxy {
    port: u16,
    /// Bytes whose next client-to-server chunk is forwarded and then cut.
    trigger: Arc<Mutex<Option<Vec<u8>>>>,
    task: JoinHandle<()>,
}

/// How long the server has to run the cut request before the reset.
const CUT_AFTER: Duration = Duration::from_millis(150);

impl CuttingProxy {
    /// Listens on a free loopback port, forwarding to `127.0.0.1:<target>`.
    pub async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy's port");
        let port = listener.local_addr().expect("proxy address").port();
        let trigger: Arc<Mutex<Option<Vec<u8>>>> = Arc::default();
        let armed = trigger.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let armed = armed.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await {
                        relay(client, server, &armed).await;
                    }
                });
            }
        });
        Self {
            port,
            trigger,
            task,
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The next request (client-to-server chunk) containing `needle` is
    /// forwarded, and 150 ms later its client connection is reset.
    pub fn cut_after(&self, needle: &[u8]) {
        *self.trigger.lock().expect("trigger") = Some(needle.to_vec());
    }

    /// Whether the armed cut is still to come.
    pub fn armed(&self) -> bool {
        self.trigger.lock().expect("trigger").is_some()
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies both ways until either side closes, or the trigger fires.
async fn relay(client: TcpStream, server: TcpStream, trigger: &Mutex<Option<Vec<u8>>>) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let upstream = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from_client.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => n,
            };
            let chunk = &buf[..n];
            let cut = {
                let mut t = trigger.lock().expect("trigger");
                let hit = t
                    .as_deref()
                    .is_some_and(|needle| chunk.windows(needle.len()).any(|w| w == needle));
                if hit {
                    *t = None;
                }
                hit
            };
            if to_server.write_all(chunk).await.is_err() {
                return false;
            }
            if cut {
                return true;
            }
        }
    };
    let downstream = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from_server.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if to_client.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let cut = tokio::select! {
        cut = upstream => cut,
        () = downstream => false,
    };
    if cut {
        // Nothing more goes back to the client (the answer stays in the
        // proxy's socket), and then a reset (linger 0) instead of a close.
        tokio::time::sleep(CUT_AFTER).await;
        if let Ok(client) = from_client.reunite(to_client) {
            let _ = client.set_zero_linger();
            drop(client);
        }
    }
}
