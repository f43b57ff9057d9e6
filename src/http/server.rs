//! The accept loop: one task per HTTP/1.1 connection, per-connection
//! timeouts, a cap on open connections, graceful shutdown on the sidecar's
//! token.
//!
//! `axum::serve` would do, but its connections sniff for HTTP/2 first, and
//! the task of every connection carries that auto-detecting state as well
//! as the HTTP/1 one. A sidecar on loopback speaks HTTP/1.1 only, and every
//! waiting request and hold is an open connection, so the per-connection
//! size is the memory cost of waiting (see BENCHMARKS.md).
//!
//! Timeouts ([`ConnectionLimits`]): a connection with no request in flight
//! must send a whole request head within the header-read timeout of its
//! first byte (or of connecting), and, after a response, start the next
//! request within the idle timeout; a request's body must arrive within the
//! body-read timeout of its head. A request in flight — a `wait`, a hold
//! stream — is not timed here: it lives as long as its handler. A response
//! whose bytes make no progress for the write timeout (a client that does
//! not read, pipelining or not) closes its connection with a reset, so its
//! kernel send queue is freed at once; for a hold stream that is a
//! disconnect, which releases the lease. A request may shorten its
//! response's write timeout ([`Stall`]): a hold's watchdog runs only while
//! its stream is written, so a hold whose client stops reading must lose
//! its connection, and release its lease, before the lease can lapse
//! unrenewed.
//!
//! Head size: a request head (request line and headers) of more than
//! [`MAX_HEAD`] bytes is answered 431 by hyper and the connection closed.
//! hyper's own answers to heads it refuses (400, 414, 431: a status line
//! and no body) are written as problem documents instead
//! ([`problem_for_hyper_answer`]).
//! hyper reads the next pipelined request only after the response before it
//! is written, so a pipelining client holds at most one response and
//! [`MAX_HEAD`] bytes of requests in the sidecar, plus the socket's buffers
//! for at most the write timeout.
//!
//! Cap: at `max_connections` open connections, a new one makes room by
//! closing the oldest connection without a request in flight (idle, or still
//! sending its head); when every connection has a request in flight, the
//! new one is answered 429 at once and closed. At most
//! [`REFUSALS_AT_ONCE`] refusals are in flight; a connection beyond them is
//! closed without an answer, so a flood cannot fill the file table.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use futures::FutureExt as _;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use crate::config::ConnectionLimits;
use crate::error::Error;

use super::listener::{Conn, Listener, OverUnixSocket};

/// How long to pause accepting after an accept error such as `EMFILE`, so a
/// full file table is not a busy loop.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// hyper's read buffer, which bounds the request head: far above any
/// request a client of this API sends, small enough that 30,000 unfinished
/// heads fit in the chart's memory limit. hyper checks it after each read,
/// which may take in 16 KiB more: heads up to 48 KiB are read.
pub const MAX_HEAD: usize = 32 * 1024;

/// Open files kept free of connections (backend connections, config, logs,
/// refusals in flight).
const FILES_IN_RESERVE: u64 = 64;

/// Connections being answered 429 at once at most, each for up to
/// [`REFUSE_WITHIN`]; they come out of [`FILES_IN_RESERVE`].
const REFUSALS_AT_ONCE: usize = 16;

impl ConnectionLimits {
    /// The cap on open connections within `files` open files (the process's
    /// limit; 0 when unknown): `max_connections`, lowered to leave
    /// [`FILES_IN_RESERVE`] files for everything else.
    pub fn cap_within(&self, files: u64) -> usize {
        if files == 0 {
            return self.max_connections;
        }
        let room =
            usize::try_from(files.saturating_sub(FILES_IN_RESERVE).max(1)).unwrap_or(usize::MAX);
        self.max_connections.min(room)
    }
}

/// Serves `router` on every listener until `stop` is cancelled, then asks
/// every connection to finish its request in flight and close, and returns
/// when all have (streams end on the same token).
///
/// Handlers see the peer address as `ConnectInfo<SocketAddr>` ([`UNIX_PEER`]
/// over a Unix socket). At most `cap` connections are open over all
/// listeners together (see the module doc).
pub async fn serve(
    listeners: Vec<Listener>,
    router: Router,
    limits: ConnectionLimits,
    cap: usize,
    stop: CancellationToken,
) {
    let connections = TaskTracker::new();
    let limits = Arc::new(limits);
    let open = Arc::new(Registry::default());
    let next_id = Arc::new(AtomicU64::new(0));
    let refusals = Arc::new(Semaphore::new(REFUSALS_AT_ONCE));
    futures::future::join_all(listeners.into_iter().map(|listener| {
        accept(
            listener,
            router.clone(),
            limits.clone(),
            cap,
            refusals.clone(),
            stop.clone(),
            connections.clone(),
            open.clone(),
            next_id.clone(),
        )
    }))
    .await;
    connections.close();
    connections.wait().await;
}

/// Accepts connections on one listener until `stop` is cancelled.
#[allow(clippy::too_many_arguments)]
async fn accept(
    listener: Listener,
    router: Router,
    limits: Arc<ConnectionLimits>,
    cap: usize,
    refusals: Arc<Semaphore>,
    stop: CancellationToken,
    connections: TaskTracker,
    open: Arc<Registry>,
    next_id: Arc<AtomicU64>,
) {
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
        if open.len() >= cap && !open.shed_oldest_idle() {
            // Beyond the refusals in flight the connection is dropped: closed
            // at once, without an answer.
            if let Ok(refusal) = refusals.clone().try_acquire_owned() {
                refuse(stream, cap, refusal);
            }
            continue;
        }
        let id = next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let state = open.insert(id);
        connections.spawn(connection(
            stream,
            peer,
            router.clone(),
            limits.clone(),
            Member {
                id,
                state,
                registry: open.clone(),
            },
            stop.clone(),
        ));
    }
    drop(listener);
}

/// How long a refused connection may take to receive its 429.
const REFUSE_WITHIN: Duration = Duration::from_secs(1);

/// Answers a connection over the cap with a 429 problem and closes it,
/// giving the peer at most [`REFUSE_WITHIN`]. The request is read and
/// discarded first, so the close is not a reset that would lose the answer.
/// `refusal` is held until the connection is closed.
fn refuse(mut stream: Conn, cap: usize, refusal: OwnedSemaphorePermit) {
    let answer = closing_problem(&Error::TooManyConnections { limit: cap });
    tracing::debug!(
        cap,
        "connection refused: every open connection has a request in flight"
    );
    tokio::spawn(async move {
        let _ = tokio::time::timeout(REFUSE_WITHIN, async {
            stream.write_all(&answer).await?;
            stream.shutdown().await?;
            let mut sink = [0_u8; 1024];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<_, io::Error>(())
        })
        .await;
        drop((stream, refusal));
    });
}

/// The open connections, oldest first.
#[derive(Default)]
struct Registry {
    connections: Mutex<BTreeMap<u64, Arc<ConnState>>>,
}

impl Registry {
    fn insert(&self, id: u64) -> Arc<ConnState> {
        let state = Arc::new(ConnState::default());
        self.lock().insert(id, state.clone());
        state
    }

    fn len(&self) -> usize {
        self.lock().len()
    }

    /// Closes the oldest connection without a request in flight, else the
    /// oldest whose requests in flight all still wait for their body (a
    /// client that sends a head and no body holds no work yet, and must not
    /// keep a place from everyone else: some routes read a body before any
    /// credential); false when every connection has work in flight.
    fn shed_oldest_idle(&self) -> bool {
        let mut connections = self.lock();
        let idle = |c: &ConnState| c.in_flight.load(Ordering::Acquire) == 0;
        let unsent = |c: &ConnState| {
            c.in_flight.load(Ordering::Acquire) <= c.awaiting_body.load(Ordering::Acquire)
        };
        let oldest = connections
            .iter()
            .find(|(_, c)| idle(c))
            .or_else(|| connections.iter().find(|(_, c)| unsent(c)))
            .map(|(id, _)| *id);
        match oldest.and_then(|id| connections.remove(&id)) {
            Some(c) => {
                c.shed.store(true, Ordering::Release);
                c.wake_reader();
                true
            }
            None => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<ConnState>>> {
        // A panic elsewhere while holding the lock leaves a map that is still whole.
        self.connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A connection's place in the [`Registry`], left when the connection ends.
struct Member {
    id: u64,
    state: Arc<ConnState>,
    registry: Arc<Registry>,
}

impl Drop for Member {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
    }
}

/// A request extension: shortens the write timeout of the request's
/// connection while its response is in flight.
#[derive(Clone)]
pub struct Stall(Arc<ConnState>);

impl Stall {
    /// Resets the connection when its writes make no progress for `limit`,
    /// or for a shorter limit set before, until this response ends.
    pub(in crate::http) fn limit(&self, limit: Duration) {
        let limit = crate::clock::ms(limit).max(1);
        let _ = self
            .0
            .stall_limit_ms
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
                Some(if old == 0 { limit } else { old.min(limit) })
            });
    }
}

/// What the accept loop, the reader and the requests of one connection share.
#[derive(Default)]
struct ConnState {
    /// Requests whose response has not been written to the end.
    in_flight: AtomicUsize,
    /// Requests in flight whose body has not arrived to its end (nor been
    /// dropped unread).
    awaiting_body: AtomicUsize,
    /// Requests whose response has been written to the end (or dropped).
    finished: AtomicU64,
    /// The reader's waker, woken when a request in flight ends (so the idle
    /// timeout starts) and when the connection is shed.
    reader: Mutex<Option<Waker>>,
    /// Set to close the connection at once to make room for a new one: its
    /// next read fails. (A flag and the reader's waker, not a cancellation
    /// token: that is an allocation and a future more in every connection.)
    shed: AtomicBool,
    /// The [`Stall`] limit of the response in flight, in milliseconds; 0
    /// for none (the write timeout).
    stall_limit_ms: AtomicU64,
    /// Whether the server is waiting to read the socket while a request is
    /// in flight (its last read there found nothing), so that it sees the
    /// client close it. It does not while it holds bytes the client sent
    /// after the request (a pipelined one, a stray line end).
    reading: AtomicBool,
    /// The socket's descriptor, for [`ConnState::poll_departed`].
    fd: std::sync::atomic::AtomicI32,
    /// The timer of the next look at whether the client left, armed while
    /// a request is in flight and the server is not reading.
    departure: Mutex<Option<Pin<Box<Sleep>>>>,
}

impl ConnState {
    fn set_reader(&self, waker: &Waker) {
        let mut reader = self
            .reader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &mut *reader {
            Some(w) if w.will_wake(waker) => {}
            slot => *slot = Some(waker.clone()),
        }
    }

    /// Ready once the client is seen gone (it closed its side, or the
    /// connection broke) while a request is in flight and the server does
    /// not read the socket: looked at every [`DEPARTURE_LOOK`]. A
    /// connection whose server reads sees the close itself.
    fn poll_departed(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut timer = self
            .departure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.in_flight.load(Ordering::Acquire) == 0 || self.reading.load(Ordering::Acquire) {
            *timer = None;
            return Poll::Pending;
        }
        loop {
            let sleep = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(DEPARTURE_LOOK)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            if peer_gone(self.fd.load(Ordering::Relaxed)) {
                return Poll::Ready(());
            }
            sleep.as_mut().reset(Instant::now() + DEPARTURE_LOOK);
        }
    }

    fn wake_reader(&self) {
        let waker = self
            .reader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// How often a connection whose request is in flight, and whose socket the
/// server does not read, is looked at for its client's leaving.
const DEPARTURE_LOOK: Duration = Duration::from_secs(1);

/// Whether the peer of socket `fd` closed its side or the connection broke
/// (`POLLRDHUP`, `POLLHUP`, `POLLERR`), whatever it sent before that is still
/// unread.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn peer_gone(fd: std::os::fd::RawFd) -> bool {
    let mut look = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid `pollfd` for the call's duration, and no wait; the
    // descriptor is the connection's own, open while its task (the caller)
    // runs — a stale one would only answer POLLNVAL.
    let found = unsafe { libc::poll(&raw mut look, 1, 0) };
    found == 1 && look.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Where `poll` cannot tell a peer's closed side (no `POLLRDHUP`): never
/// seen, as before (README).
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn peer_gone(_fd: std::os::fd::RawFd) -> bool {
    false
}

/// One request in flight on its connection, from its head to the end of its
/// response.
struct InFlight(Arc<ConnState>);

impl InFlight {
    fn start(state: &Arc<ConnState>) -> Self {
        // What the server read before may hold bytes past this request.
        state.reading.store(false, Ordering::Release);
        state.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(state.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // HTTP/1.1: the next response is written only after this one.
        self.0.stall_limit_ms.store(0, Ordering::Release);
        self.0.finished.fetch_add(1, Ordering::AcqRel);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.wake_reader();
    }
}

/// One connection's task. A plain `fn`: it builds hyper's connection
/// first and returns a block that owns only that, the connection's entry
/// and the stop token. An `async fn` would keep its arguments (the stream,
/// the peer, …) beside the connection built from them, and a copy of
/// each it moves: the task of every open connection, waiting or holding
/// requests included, would be 128 bytes larger (tokio aligns it to 128).
#[allow(clippy::manual_async_fn)]
fn connection(
    stream: Conn,
    peer: SocketAddr,
    router: Router,
    limits: Arc<ConnectionLimits>,
    member: Member,
    stop: CancellationToken,
) -> impl Future<Output = ()> + Send + 'static {
    let open = Open::count();
    let unix = matches!(stream, Either::Right(_));
    let fd = match &stream {
        Either::Left(tcp) => tcp.as_raw_fd(),
        Either::Right(socket) => socket.as_raw_fd(),
    };
    member.state.fd.store(fd, Ordering::Relaxed);
    let state = member.state.clone();
    let body_read = limits.body_read;
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let in_flight = InFlight::start(&state);
        let deadline = Instant::now() + body_read;
        let mut req = req.map(|body| {
            let awaited = (!body.is_end_stream()).then(|| Awaited::start(&state));
            axum::body::Body::new(TimedBody {
                inner: body,
                deadline,
                timeout: body_read,
                sleep: None,
                awaited,
            })
        });
        req.extensions_mut().insert(ConnectInfo(peer));
        req.extensions_mut().insert(Stall(state.clone()));
        if unix {
            req.extensions_mut().insert(OverUnixSocket);
        }
        // A combinator, not an async block, which would keep the request
        // twice (captured, and inside the future it awaits) in a box
        // hyper keeps for the connection's life.
        router.clone().oneshot(req).map(move |response| {
            let Ok(response) = response;
            Ok::<_, std::convert::Infallible>(response.map(|inner| Tracked {
                inner,
                _in_flight: in_flight,
            }))
        })
    });
    let io = Watched {
        inner: stream,
        state: member.state.clone(),
        limits,
        seen_finished: 0,
        head_started: None,
        waiting_since: None,
        sleep: None,
        sleep_until: None,
        write_stalled_since: None,
        write_sleep: None,
        own_answer: None,
    };
    // Boxed here, not pinned in the task: the block would hold it twice
    // (captured, and moved into its pinned place).
    let mut conn = Box::pin(
        hyper::server::conn::http1::Builder::new()
            .max_buf_size(MAX_HEAD)
            .serve_connection(TokioIo::new(io), service),
    );
    async move {
        let _open = open;
        tokio::select! {
            // The connection first: a request it starts, and whether it then
            // reads the socket, are what the next branch looks at.
            biased;
            r = conn.as_mut() => log_end(r),
            // Shedding wakes this task through the reader's waker, which this
            // branch keeps set too: a connection whose reader is not polled (a
            // stalled write with a pipelined request buffered) ends here, as
            // does one whose client left with a request in flight and bytes
            // after it unread (the reader would never see the close).
            shed = std::future::poll_fn(|cx| {
                member.state.set_reader(cx.waker());
                if member.state.shed.load(Ordering::Acquire) {
                    return Poll::Ready(true);
                }
                member.state.poll_departed(cx).map(|()| false)
            }) => if shed {
                tracing::trace!("connection closed to make room");
            } else {
                tracing::debug!("the client left with a request in flight");
            },
            () = stop.cancelled() => {
                conn.as_mut().graceful_shutdown();
                log_end(conn.await);
            }
        }
    }
}

/// A request body that fails with [`BodyTimedOut`] when it has not arrived
/// by its deadline.
struct TimedBody {
    inner: Incoming,
    deadline: Instant,
    /// The body-read timeout the deadline was set from.
    timeout: Duration,
    /// Created on the first wait, so a body that is already there (or empty)
    /// costs no timer.
    sleep: Option<Pin<Box<Sleep>>>,
    /// Counts the request among its connection's awaiting their body, until
    /// the body ends (or fails, or is dropped).
    awaited: Option<Awaited>,
}

/// A request counted in [`ConnState::awaiting_body`] while it lives.
struct Awaited(Arc<ConnState>);

impl Awaited {
    fn start(state: &Arc<ConnState>) -> Self {
        state.awaiting_body.fetch_add(1, Ordering::AcqRel);
        Awaited(state.clone())
    }
}

impl Drop for Awaited {
    fn drop(&mut self) {
        self.0.awaiting_body.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The error of a request body that did not arrive within the body-read timeout.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within the body-read timeout ({timeout:?})")]
pub struct BodyTimedOut {
    /// The body-read timeout that passed.
    pub timeout: Duration,
}

impl HttpBody for TimedBody {
    type Data = axum::body::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            if !matches!(frame, Some(Ok(_))) || this.inner.is_end_stream() {
                this.awaited = None;
            }
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                this.awaited = None;
                Poll::Ready(Some(Err(BodyTimedOut {
                    timeout: this.timeout,
                }
                .into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request in flight until it is written
    /// to the end or dropped.
    struct Tracked {
        #[pin]
        inner: axum::body::Body,
        _in_flight: InFlight,
    }
}

impl HttpBody for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The socket of a connection, failing a read with `TimedOut` when the
/// header-read or idle timeout of a connection without a request in flight
/// has passed, and a write when the peer has read nothing for the write
/// timeout.
struct Watched {
    inner: Conn,
    state: Arc<ConnState>,
    limits: Arc<ConnectionLimits>,
    /// [`ConnState::finished`] when last read: a change means a response ended.
    seen_finished: u64,
    /// When the first byte of the request head being read arrived.
    head_started: Option<Instant>,
    /// Since when the connection has had no request in flight and no byte of a new one.
    waiting_since: Option<Instant>,
    /// The header-read or idle timer, while the connection has no request
    /// in flight: a request that waits or holds a lock needs none.
    sleep: Option<Pin<Box<Sleep>>>,
    /// The deadline `sleep` is set to, if it is armed.
    sleep_until: Option<Instant>,
    /// Since when writes have been refused by a full send buffer; `None`
    /// after a write that made progress.
    write_stalled_since: Option<Instant>,
    /// The write deadline's timer, created at the first stalled write so a
    /// connection whose client reads costs no timer.
    write_sleep: Option<Pin<Box<Sleep>>>,
    /// The problem document written in place of hyper's own answer to a
    /// head it refused, and how much of it is written.
    own_answer: Option<Box<(Vec<u8>, usize)>>,
}

impl Watched {
    /// Runs one write on the socket and times it: progress clears the
    /// stall, a stall longer than the write timeout resets the connection.
    fn timed_write(
        &mut self,
        cx: &mut Context<'_>,
        write: impl FnOnce(Pin<&mut Conn>, &mut Context<'_>) -> Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match write(Pin::new(&mut self.inner), cx) {
            Poll::Pending => {}
            ready => {
                self.write_stalled_since = None;
                return ready;
            }
        }
        let limit = match self.state.stall_limit_ms.load(Ordering::Acquire) {
            0 => self.limits.write,
            ms => self.limits.write.min(Duration::from_millis(ms)),
        };
        let deadline = *self.write_stalled_since.get_or_insert_with(Instant::now) + limit;
        let sleep = self
            .write_sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.deadline() != deadline {
            sleep.as_mut().reset(deadline);
        }
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                // A reset frees the unread responses in the send queue at
                // once; a close would keep them until the peer reads or
                // the kernel gives up.
                // A Unix socket's buffers go with the close itself.
                if let Either::Left(tcp) = &self.inner {
                    let _ = tcp.set_zero_linger();
                }
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client read nothing of its response within the write timeout",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.state.shed.load(Ordering::Acquire) {
            return Poll::Ready(Err(shed()));
        }
        let finished = this.state.finished.load(Ordering::Acquire);
        if finished != this.seen_finished {
            this.seen_finished = finished;
            this.head_started = None;
            this.waiting_since = None;
        }
        if this.state.in_flight.load(Ordering::Acquire) > 0 {
            this.head_started = None;
            this.waiting_since = None;
            this.sleep = None;
            this.sleep_until = None;
            this.state.set_reader(cx.waker());
            // The request may have ended between the check and the waker being stored.
            if this.state.in_flight.load(Ordering::Acquire) > 0 {
                let before = buf.filled().len();
                let read = Pin::new(&mut this.inner).poll_read(cx, buf);
                // Waiting on the socket, it hears a close; bytes read may
                // be more than it needs, and keep it from reading again.
                let waiting = read.is_pending() || buf.filled().len() == before;
                this.state.reading.store(waiting, Ordering::Release);
                return read;
            }
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before && this.head_started.is_none() {
                    this.head_started = Some(Instant::now());
                }
                return Poll::Ready(Ok(()));
            }
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => {}
        }
        // Shedding wakes the reader of an idle connection through this waker.
        this.state.set_reader(cx.waker());
        if this.state.shed.load(Ordering::Acquire) {
            return Poll::Ready(Err(shed()));
        }
        let deadline = match this.head_started {
            Some(started) => started + this.limits.header_read,
            None => {
                let since = *this.waiting_since.get_or_insert_with(Instant::now);
                // The first request of a connection is timed as a head from the connect.
                if this.seen_finished == 0 {
                    since + this.limits.header_read
                } else {
                    since + this.limits.idle
                }
            }
        };
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if this.sleep_until != Some(deadline) {
            sleep.as_mut().reset(deadline);
            this.sleep_until = Some(deadline);
        }
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                if this.head_started.is_some() {
                    "the request head did not arrive within the header-read timeout"
                } else {
                    "the connection was idle for longer than its timeout"
                },
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Watched {
    /// Writes the problem document for hyper's own answer starting `buf`,
    /// if it is one, in its place: `Some` with hyper's bytes counted as
    /// written once the document is, `None` for any other write.
    fn poll_own_answer(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Option<Poll<io::Result<usize>>> {
        let mut own = match self.own_answer.take() {
            Some(own) => own,
            None => Box::new((problem_for_hyper_answer(buf)?, 0)),
        };
        let replaced = buf.len().min(hyper_answer_len(buf));
        while own.1 < own.0.len() {
            let rest = &own.0[own.1..];
            match self.timed_write(cx, |inner, cx| inner.poll_write(cx, rest)) {
                Poll::Ready(Ok(0)) => return Some(Poll::Ready(Ok(0))),
                Poll::Ready(Ok(n)) => own.1 += n,
                Poll::Ready(Err(e)) => return Some(Poll::Ready(Err(e))),
                Poll::Pending => {
                    self.own_answer = Some(own);
                    return Some(Poll::Pending);
                }
            }
        }
        Some(Poll::Ready(Ok(replaced)))
    }
}

/// The length of hyper's own answer at the start of `buf`: its head (it
/// has no body), or all of `buf` if the head goes on past it.
fn hyper_answer_len(buf: &[u8]) -> usize {
    buf.windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(buf.len(), |end| end + 4)
}

/// The problem document to write instead of hyper's own answer to a
/// request head it refused, if `buf` starts with one: a 400, 414 or 431
/// status line (hyper's `on_error`) in a head without `content-type`, which
/// every response of the sidecar's own has. Any other write is `None`.
fn problem_for_hyper_answer(buf: &[u8]) -> Option<Vec<u8>> {
    // After an HTTP/1.0 request on a kept-alive connection hyper answers
    // in HTTP/1.0; the document goes out as HTTP/1.1, which such a client
    // reads as well (RFC 9110 §6.2), and the connection closes after it.
    let fault = match (buf.get(..9)?, buf.get(9..13)?) {
        (b"HTTP/1.1 " | b"HTTP/1.0 ", b"400 ") => crate::error::HeadFault::Malformed,
        (b"HTTP/1.1 " | b"HTTP/1.0 ", b"414 ") => crate::error::HeadFault::UriTooLong,
        // Heads up to MAX_HEAD are always read; more may be, as reads fall.
        (b"HTTP/1.1 " | b"HTTP/1.0 ", b"431 ") => {
            crate::error::HeadFault::TooLarge { limit: MAX_HEAD }
        }
        _ => return None,
    };
    let head = &buf[..hyper_answer_len(buf)];
    let typed = head
        .split(|&b| b == b'\n')
        .any(|line| line.len() >= 13 && line[..13].eq_ignore_ascii_case(b"content-type:"));
    if typed || !head.ends_with(b"\r\n\r\n") {
        return None;
    }
    Some(closing_problem(&Error::MalformedHead(fault)))
}

/// A whole HTTP/1.1 response carrying `error`'s problem document, written
/// to the socket by hand where no handler answers (a refused connection,
/// a head hyper refused); the connection closes after it. 429 and 503 say
/// when to retry, as [`Error`]'s own responses do.
fn closing_problem(error: &Error) -> Vec<u8> {
    let (status, _) = error.status_slug();
    let body = serde_json::to_vec(&error.problem()).unwrap_or_default();
    let retry = matches!(status.as_u16(), 429 | 503)
        .then(|| format!("retry-after: {}\r\n", super::problem::RETRY_AFTER_SECS))
        .unwrap_or_default();
    let mut answer = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/problem+json\r\n{retry}\
         connection: close\r\ncontent-length: {}\r\n\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or_default(),
        body.len()
    )
    .into_bytes();
    answer.extend_from_slice(&body);
    answer
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(answered) = self.poll_own_answer(cx, buf) {
            return answered;
        }
        self.timed_write(cx, |inner, cx| inner.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let first = bufs
            .iter()
            .find(|b| !b.is_empty())
            .map_or(&[][..], |b| &**b);
        if let Some(answered) = self.poll_own_answer(cx, first) {
            return answered;
        }
        self.timed_write(cx, |inner, cx| inner.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
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

/// The read error of a connection closed to make room for a new one.
fn shed() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "the connection was closed to make room for a new one",
    )
}

fn log_end(r: Result<(), hyper::Error>) {
    if let Err(e) = r {
        tracing::trace!("connection ended: {e}");
    }
}

#[cfg(test)]
mod size_tests {
    /// The size of what `f` returns, without calling it.
    fn returned_size<A, B, C, D, E, G, F>(_: impl FnOnce(A, B, C, D, E, G) -> F) -> usize {
        size_of::<F>()
    }

    /// Every open connection, waiting and holding ones included, is a task
    /// for its whole life: hyper's connection (816 bytes) is boxed once,
    /// not held inline beside the arguments it was built from (1,120 bytes
    /// as an `async fn`, 1,800 when a block captured it and pinned a copy).
    #[test]
    fn a_connection_task_holds_no_copy_of_the_connection() {
        let size = returned_size(super::connection);
        assert!(size <= 256, "a connection's task future is {size} bytes");
    }
}
