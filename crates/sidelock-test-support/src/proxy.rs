//! A loopback TCP proxy that can lose one answer: the request carrying
//! chosen bytes reaches the server, and its client's connection is reset
//! before the answer comes back (the call ran; its caller cannot know). It
//! can also hold every answer back for a while (a slow way back), or let a
//! connection die without a word (nothing more gets through it either way,
//! and it is never closed).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The proxy's listener task; dropping the guard stops it (connections
/// already open keep going until either side closes).
pub struct CuttingProxy {
    port: u16,
    /// Bytes whose next client-to-server chunk is forwarded and then cut,
    /// and how long after.
    trigger: Arc<Trigger>,
    /// How answers are held back before they go to the client.
    slow: Arc<Mutex<Slow>>,
    /// The connections open now, for [`silence`](Self::silence).
    open: Arc<Mutex<Vec<std::sync::Weak<Relayed>>>>,
    task: JoinHandle<()>,
}

/// What the proxy knows of one connection it relays.
#[derive(Default)]
struct Relayed {
    /// Everything its client sent, up to [`REMEMBERED`] bytes.
    sent: Mutex<Vec<u8>>,
    /// Set: nothing more goes through, either way; the sockets stay open.
    silent: std::sync::atomic::AtomicBool,
}

/// How much of what a client sends is remembered, to pick connections out.
const REMEMBERED: usize = 64 * 1024;

/// How long the server has to run the cut request before the reset.
const CUT_AFTER: Duration = Duration::from_millis(150);

/// The trigger of a [`CuttingProxy`]: the bytes to look for, and the delay.
type Trigger = Mutex<Option<(Vec<u8>, Duration)>>;

/// Answers held back: every one by `all`; the next one on the connection
/// of the next request containing `once`'s bytes, by its delay.
#[derive(Default)]
struct Slow {
    all: Duration,
    once: Option<(Vec<u8>, Duration)>,
    /// The next requests (how many) containing these bytes are not
    /// forwarded: their client's connection is reset instead (requests
    /// lost on their way).
    refuse: Option<(Vec<u8>, usize)>,
    /// The next request containing these bytes waits this long before it
    /// goes on (it and what its client sends after it; answers and other
    /// connections are not held).
    late: Option<(Vec<u8>, Duration)>,
    /// The answer to the next request containing these bytes comes back
    /// as bytes no protocol reads (the request ran; a TLS alert or garbage
    /// mid-reply does this).
    garble: Option<Vec<u8>>,
}

/// What a garbled answer is replaced by: no RESP type starts with `?`.
const GARBLE: &[u8] = b"?garbled\r\n";

impl CuttingProxy {
    /// Listens on a free loopback port, forwarding to `127.0.0.1:<target>`.
    pub async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy's port");
        let port = listener.local_addr().expect("proxy address").port();
        let trigger: Arc<Trigger> = Arc::default();
        let slow: Arc<Mutex<Slow>> = Arc::default();
        let open: Arc<Mutex<Vec<std::sync::Weak<Relayed>>>> = Arc::default();
        let (armed, slowed, listed) = (trigger.clone(), slow.clone(), open.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (armed, slowed) = (armed.clone(), slowed.clone());
                let relayed = Arc::new(Relayed::default());
                {
                    let mut listed = listed.lock().expect("open");
                    listed.retain(|c| c.strong_count() > 0);
                    listed.push(Arc::downgrade(&relayed));
                }
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await {
                        relay(client, server, &armed, &slowed, &relayed).await;
                    }
                });
            }
        });
        Self {
            port,
            trigger,
            slow,
            open,
            task,
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The next request (client-to-server chunk) containing `needle` is
    /// forwarded, and 150 ms later its client connection is reset.
    pub fn cut_after(&self, needle: &[u8]) {
        self.cut_later(needle, CUT_AFTER);
    }

    /// As [`cut_after`](Self::cut_after), the reset `delay` after the request.
    pub fn cut_later(&self, needle: &[u8], delay: Duration) {
        *self.trigger.lock().expect("trigger") = Some((needle.to_vec(), delay));
    }

    /// Holds every answer (server-to-client chunk) back for `delay` from
    /// now on; requests go at once.
    pub fn slow_answers(&self, delay: Duration) {
        self.slow.lock().expect("slow").all = delay;
    }

    /// Holds back, by `delay`, the next answer on the connection of the
    /// next request containing `needle` (the request goes at once; other
    /// connections, such as a pub/sub one, are not held).
    pub fn hold_answer_after(&self, needle: &[u8], delay: Duration) {
        self.slow.lock().expect("slow").once = Some((needle.to_vec(), delay));
    }

    /// The next `times` requests containing `needle` never reach the
    /// server: each one's client connection is reset instead.
    pub fn refuse(&self, needle: &[u8], times: usize) {
        self.slow.lock().expect("slow").refuse = (times > 0).then(|| (needle.to_vec(), times));
    }

    /// The answer to the next request containing `needle` comes back
    /// garbled (the request reaches the server and runs).
    pub fn garble_answer_after(&self, needle: &[u8]) {
        self.slow.lock().expect("slow").garble = Some(needle.to_vec());
    }

    /// Holds the next request containing `needle` back by `delay` before
    /// it reaches the server (a slow way there for that one request).
    pub fn delay_request(&self, needle: &[u8], delay: Duration) {
        self.slow.lock().expect("slow").late = Some((needle.to_vec(), delay));
    }

    /// Every open connection whose client has sent `needle` (in its first
    /// 64 KiB) dies without a word from now on: nothing more it carries
    /// reaches either side, and neither side is told (a peer gone behind a
    /// middlebox, a cable pulled). Returns how many it silenced.
    pub fn silence(&self, needle: &[u8]) -> usize {
        let mut silenced = 0;
        for relayed in self.open.lock().expect("open").iter() {
            let Some(relayed) = relayed.upgrade() else {
                continue;
            };
            let sent = relayed.sent.lock().expect("sent");
            if sent.windows(needle.len()).any(|w| w == needle) {
                relayed
                    .silent
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                silenced += 1;
            }
        }
        silenced
    }

    /// Every open connection dies without a word, as with
    /// [`silence`](Self::silence). Returns how many it silenced.
    pub fn silence_all(&self) -> usize {
        let open = self.open.lock().expect("open");
        let live = open.iter().filter_map(std::sync::Weak::upgrade);
        live.map(|relayed| {
            relayed
                .silent
                .store(true, std::sync::atomic::Ordering::SeqCst)
        })
        .count()
    }

    /// Whether the request armed with [`delay_request`](Self::delay_request)
    /// is still to come.
    pub fn delaying(&self) -> bool {
        self.slow.lock().expect("slow").late.is_some()
    }

    /// Whether requests armed with [`refuse`](Self::refuse) are still to
    /// come.
    pub fn refusing(&self) -> bool {
        self.slow.lock().expect("slow").refuse.is_some()
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

/// Copies both ways until either side closes, or the trigger fires: then
/// nothing more goes back to the client (what the client still sends goes
/// on, so that a request split over several writes arrives whole), and
/// after the trigger's delay the client's connection is reset.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    trigger: &Trigger,
    slow: &Mutex<Slow>,
    relayed: &Relayed,
) {
    let silent = || relayed.silent.load(std::sync::atomic::Ordering::SeqCst);
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let cut: tokio::sync::watch::Sender<Option<Duration>> = tokio::sync::watch::Sender::new(None);
    // This connection's next answer is held back this long.
    let held: Mutex<Option<Duration>> = Mutex::new(None);
    // This connection's next answer comes back garbled.
    let garbled = std::sync::atomic::AtomicBool::new(false);
    let upstream = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from_client.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let chunk = &buf[..n];
            if silent() {
                continue;
            }
            {
                let mut sent = relayed.sent.lock().expect("sent");
                let room = REMEMBERED.saturating_sub(sent.len());
                sent.extend_from_slice(&chunk[..room.min(n)]);
            }
            let hit = {
                let mut t = trigger.lock().expect("trigger");
                let hit = t.as_ref().is_some_and(|(needle, _)| {
                    chunk.windows(needle.len()).any(|w| w == needle.as_slice())
                });
                if hit {
                    t.take().map(|(_, delay)| delay)
                } else {
                    None
                }
            };
            // Before the request goes: its answer must not get back.
            if hit.is_some() {
                cut.send_replace(hit);
            }
            let (refused, late) = {
                let mut slowed = slow.lock().expect("slow");
                let contains =
                    |needle: &Vec<u8>| chunk.windows(needle.len()).any(|w| w == needle.as_slice());
                if slowed
                    .once
                    .as_ref()
                    .is_some_and(|(needle, _)| contains(needle))
                {
                    *held.lock().expect("held") = slowed.once.take().map(|(_, d)| d);
                }
                if slowed.garble.as_ref().is_some_and(contains) {
                    slowed.garble = None;
                    garbled.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                let refused = slowed
                    .refuse
                    .as_mut()
                    .filter(|(needle, _)| contains(needle))
                    .map(|(_, left)| {
                        *left -= 1;
                        *left
                    });
                if refused == Some(0) {
                    slowed.refuse = None;
                }
                let late = if slowed
                    .late
                    .as_ref()
                    .is_some_and(|(needle, _)| contains(needle))
                {
                    slowed.late.take().map(|(_, d)| d)
                } else {
                    None
                };
                (refused.is_some(), late)
            };
            if refused {
                cut.send_replace(Some(Duration::ZERO));
                // The reset comes next.
                return std::future::pending().await;
            }
            if let Some(delay) = late {
                tokio::time::sleep(delay).await;
            }
            if to_server.write_all(chunk).await.is_err() {
                return;
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
            if cut.borrow().is_some() || silent() {
                continue;
            }
            let once = held.lock().expect("held").take().unwrap_or_default();
            let delay = slow.lock().expect("slow").all + once;
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let answer = if garbled.swap(false, std::sync::atomic::Ordering::SeqCst) {
                GARBLE
            } else {
                &buf[..n]
            };
            if to_client.write_all(answer).await.is_err() {
                return;
            }
        }
    };
    let mut fired = cut.subscribe();
    let reset = async {
        let Ok(delay) = fired
            .wait_for(Option::is_some)
            .await
            .map(|d| d.unwrap_or_default())
        else {
            return std::future::pending().await;
        };
        tokio::time::sleep(delay).await;
    };
    let reset_now = tokio::select! {
        () = upstream => false,
        () = downstream => false,
        () = reset => true,
    };
    if reset_now && let Ok(client) = from_client.reunite(to_client) {
        // A reset (linger 0) instead of a close.
        let _ = client.set_zero_linger();
        drop(client);
    }
}
