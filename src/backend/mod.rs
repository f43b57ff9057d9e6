//! The backend seam: where leases, queues and fences live.
//!
//! Everything above this module — local queues, the watchdog, SSE, metrics,
//! HTTP — is the same for every backend. A backend only has to keep the
//! shared state consistent and say when it changed. [`open`] is the one place
//! that maps a `--backend` URL to an implementation, and [`url`] the one
//! place that takes backend URLs apart and redacts them.
//!
//! One module per backend, a folder split by concern where it is large:
//!
//! * [`memory`]: one process, for tests and single-instance use.
//! * [`redis`]: `redis://`, Sentinel and Cluster — `node` (one logical Redis,
//!   also Redlock's), `scripts`, `leases`, `listing`, `members`, `pubsub`.
//! * [`redlock`]: `redlock://`, a quorum of independent Redis nodes.
//! * [`postgres`]: `postgres://` — `errors`, `sql`, `calls`, `schema`,
//!   `listener`, `open`.
//! * [`zookeeper`]: `zk://` — `names`, `session`, `tree`, `watch`, `acquire`,
//!   `lease`, `admin`, `request` (with the one compare-and-set helper), `data`.
//!
//! `unanswered` gives back the lease of a grant whose answer was lost, for
//! the backends that can lose one (Redis, PostgreSQL).
//!
//! Adding a backend is a module here, one match arm in [`open`] (and its
//! schemes in [`SCHEMES`]) and one `#[case]` line in the conformance suite's
//! backend list (`tests/suite/common/backend.rs`).

pub mod memory;
pub mod postgres;
pub mod redis;
pub mod redlock;
mod unanswered;
pub mod url;
pub mod zookeeper;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use utoipa::ToSchema;

use crate::lock::{Claim, Held, LockKey, Token};
use crate::wakeups::Wakeups;
pub use url::redact;

/// Errors a backend reports.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The backend cannot be reached or failed; the caller may retry later.
    #[error("backend unavailable during {op}")]
    Unavailable {
        op: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A semaphore is in use with a different number of permits.
    #[error("semaphore is in use with limit {active}")]
    LimitMismatch { active: u32 },
    /// A semaphore with no holders or waiters was used without `limit`.
    #[error("semaphore limit is required")]
    LimitRequired,
    /// This backend cannot keep the guarantee the claim asks for; the
    /// sentence says why and what to use instead.
    #[error("{0}")]
    Unsupported(String),
    /// A key, node or row this claim needs holds data sidelock did not
    /// write there (e.g. a Redis key of another type, written by hand);
    /// refused before anything was written.
    #[error(
        "the backend key {key:?} holds a {found}, which sidelock did not write there: remove it (nothing was granted)"
    )]
    KeyConflict { key: String, found: String },
}

impl Error {
    /// Why the backend could not be reached, for an [`Error::Unavailable`].
    pub fn cause(&self) -> Option<Cause> {
        match self {
            Error::Unavailable { source, .. } => Some(Cause::of(source.as_ref())),
            _ => None,
        }
    }

    /// This [`Error::Unavailable`] as that of a call that was sent and not
    /// answered: it may have run (see [`Unanswered`]). Other errors are
    /// answers, and stay as they are.
    #[must_use]
    pub fn unanswered(self) -> Error {
        match self {
            Error::Unavailable { op, source } => Error::Unavailable {
                op,
                source: Box::new(Unanswered(source)),
            },
            answered => answered,
        }
    }

    /// Whether the call may have run although it failed: sent, and its
    /// answer lost ([`Unanswered`]). Such a release or dequeue must not be
    /// sent again as it was: a second run would take a second hold, one
    /// its owner may have re-entered meanwhile.
    pub fn may_have_run(&self) -> bool {
        match self {
            Error::Unavailable { source, .. } => source.is::<Unanswered>(),
            _ => false,
        }
    }

    /// Whether a Redis call that failed once sent may have run: its
    /// connection was lost or its time limit passed, or it failed otherwise
    /// (a TLS alert or garbage mid-reply, a reply of a shape nobody
    /// expected). Only the server's own error reply, which has a code
    /// (`LOADING`, `READONLY`, `BUSY`, `MOVED`), says it did not.
    pub fn sent_may_have_run(&self) -> bool {
        if self.never_sent() {
            return false;
        }
        match self.cause() {
            Some(Cause::ConnectionLost | Cause::TimedOut) => true,
            Some(Cause::Failed) => !self.is_redis_reply(),
            _ => false,
        }
    }

    /// Whether the call failed before it was sent ([`Unsent`]).
    fn never_sent(&self) -> bool {
        match self {
            Error::Unavailable { source, .. } => source.is::<Unsent>(),
            _ => false,
        }
    }

    /// Whether this is a Redis server's error reply (it has a code).
    fn is_redis_reply(&self) -> bool {
        let Error::Unavailable { source, .. } = self else {
            return false;
        };
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
        while let Some(e) = next {
            if let Some(r) = e.downcast_ref::<::redis::RedisError>() {
                return r.code().is_some();
            }
            next = e.source();
        }
        false
    }
}

/// The source of an [`Error::Unavailable`] whose call reached the backend
/// and whose answer never came back (a connection lost or a time limit
/// passed after it was sent): it may have run. Its own source is the
/// failure, which [`Cause::of`] reads.
#[derive(Debug, thiserror::Error)]
#[error("sent, no answer (it may have run)")]
pub struct Unanswered(#[source] Box<dyn std::error::Error + Send + Sync>);

/// The source of an [`Error::Unavailable`] whose call was never sent: no
/// connection could be made for it (a TLS handshake refused, Sentinel
/// naming no master, a connect timed out), so it surely did not run. Its
/// own source is the failure, which [`Cause::of`] reads.
#[derive(Debug, thiserror::Error)]
#[error("not sent, no connection")]
pub struct Unsent(#[source] pub Box<dyn std::error::Error + Send + Sync>);

/// Why a backend could not be reached, in words an operator reads (logs,
/// 503s, the dashboard). Found from the error chain's own types and kinds
/// (I/O error kinds, the drivers' predicates and codes), never its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Cause {
    /// Nothing listens at the address (or a firewall rejects).
    ConnectionRefused,
    /// No answer in time: a partition, an overloaded or stopped server.
    TimedOut,
    /// An open connection broke (reset, closed by the server).
    ConnectionLost,
    /// The server refused the credentials.
    AuthenticationFailed,
    /// The ZooKeeper session expired.
    SessionExpired,
    /// The server refused the user a command or channel (Redis `NOPERM`).
    PermissionDenied,
    /// Anything else; the log at debug level has the chain.
    Failed,
}

impl Cause {
    /// The cause as logs and problem documents write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::ConnectionRefused => "connection refused",
            Cause::TimedOut => "timed out",
            Cause::ConnectionLost => "connection lost",
            Cause::AuthenticationFailed => "authentication failed",
            Cause::SessionExpired => "session expired",
            Cause::PermissionDenied => "permission denied",
            Cause::Failed => "failed",
        }
    }

    /// Whether the server refused (credentials, rights): an operator must
    /// fix it, where an outage passes by itself.
    pub fn is_refusal(self) -> bool {
        matches!(self, Cause::PermissionDenied | Cause::AuthenticationFailed)
    }

    /// The first cause any error of `e`'s chain names.
    pub fn of(e: &(dyn std::error::Error + 'static)) -> Self {
        let mut next = Some(e);
        while let Some(e) = next {
            if let Some(cause) = Self::of_one(e) {
                return cause;
            }
            next = e.source();
        }
        Cause::Failed
    }

    fn of_one(e: &(dyn std::error::Error + 'static)) -> Option<Self> {
        use std::io::ErrorKind as K;
        if let Some(c) = e.downcast_ref::<Outage>() {
            return Some(c.cause);
        }
        if e.is::<tokio::time::error::Elapsed>() {
            return Some(Cause::TimedOut);
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return match io.kind() {
                K::ConnectionRefused => Some(Cause::ConnectionRefused),
                K::TimedOut | K::WouldBlock => Some(Cause::TimedOut),
                K::ConnectionReset
                | K::ConnectionAborted
                | K::BrokenPipe
                | K::UnexpectedEof
                | K::NotConnected => Some(Cause::ConnectionLost),
                K::HostUnreachable | K::NetworkUnreachable | K::AddrNotAvailable => {
                    Some(Cause::ConnectionRefused)
                }
                _ => None,
            };
        }
        if let Some(r) = e.downcast_ref::<::redis::RedisError>() {
            return if r.is_connection_refusal() {
                Some(Cause::ConnectionRefused)
            } else if r.is_timeout() {
                Some(Cause::TimedOut)
            } else if r.kind() == ::redis::ErrorKind::AuthenticationFailed
                || matches!(r.code(), Some("NOAUTH" | "WRONGPASS"))
            {
                Some(Cause::AuthenticationFailed)
            } else if r.code() == Some("NOPERM") {
                Some(Cause::PermissionDenied)
            } else if r.is_connection_dropped() {
                Some(Cause::ConnectionLost)
            } else {
                None
            };
        }
        if let Some(pg) = e.downcast_ref::<tokio_postgres::Error>() {
            use tokio_postgres::error::SqlState;
            return match pg.code() {
                Some(c)
                    if *c == SqlState::INVALID_PASSWORD
                        || *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION =>
                {
                    Some(Cause::AuthenticationFailed)
                }
                _ if pg.is_closed() => Some(Cause::ConnectionLost),
                // The server ending the session itself says so on the
                // statement (admin or crash shutdown, a connection
                // exception): the connection is lost all the same.
                Some(c)
                    if *c == SqlState::ADMIN_SHUTDOWN
                        || *c == SqlState::CRASH_SHUTDOWN
                        || c.code().starts_with("08") =>
                {
                    Some(Cause::ConnectionLost)
                }
                _ => None,
            };
        }
        if let Some(zk) = e.downcast_ref::<zookeeper_client::Error>() {
            use zookeeper_client::Error as Z;
            return match zk {
                Z::Timeout => Some(Cause::TimedOut),
                // No server of the ensemble accepted a connection.
                Z::NoHosts => Some(Cause::ConnectionRefused),
                Z::ConnectionLoss | Z::ClientClosed => Some(Cause::ConnectionLost),
                Z::SessionExpired => Some(Cause::SessionExpired),
                Z::AuthFailed | Z::NoAuth => Some(Cause::AuthenticationFailed),
                _ => None,
            };
        }
        None
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A backend's own reason for an outage (its timeout ran out, no quorum
/// answered), with the cause it stands for; `detail` is for the debug log.
#[derive(Debug, thiserror::Error)]
#[error("{detail}")]
pub struct Outage {
    pub cause: Cause,
    pub detail: String,
}

impl Outage {
    /// An outage of `cause`, boxed as an [`Error::Unavailable`] source.
    pub fn boxed(
        cause: Cause,
        detail: impl Into<String>,
    ) -> Box<dyn std::error::Error + Send + Sync> {
        Box::new(Outage {
            cause,
            detail: detail.into(),
        })
    }
}

/// An error and its sources, for log lines and start-up messages.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(source) = next {
        text.push_str(": ");
        text.push_str(&source.to_string());
        next = source.source();
    }
    text
}

/// How much a backend's locks can be trusted; shown by `/v1/info` and the dashboard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Safety {
    /// Locks exist in one process only.
    SingleProcess,
    /// Good for avoiding duplicate work; a failover or clock jump can break exclusion.
    Efficiency,
    /// Exclusion holds through failures; fences make writes safe.
    Correctness,
}

impl Safety {
    /// The class as the API writes it (`single-process`).
    pub fn as_str(self) -> &'static str {
        match self {
            Safety::SingleProcess => "single-process",
            Safety::Efficiency => "efficiency",
            Safety::Correctness => "correctness",
        }
    }
}

impl std::fmt::Display for Safety {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which backend a URL opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Memory,
    Redis,
    Redlock,
    ZooKeeper,
    Postgres,
}

impl BackendKind {
    /// The word the API, the metrics and the logs use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Redis => "redis",
            Self::Redlock => "redlock",
            Self::ZooKeeper => "zookeeper",
            Self::Postgres => "postgres",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Static facts about a backend.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Description {
    pub kind: BackendKind,
    /// The URL with any password removed.
    pub url: String,
    pub safety: Safety,
}

/// Where a queued claim stands in a backend's global FIFO queue.
#[derive(Debug, Clone)]
pub struct Ticket {
    pub key: LockKey,
    /// Global queue order: lower is earlier. Local queues sort by it.
    pub seq: u64,
}

/// How a claim takes part in the queue for one attempt.
#[derive(Debug, Clone, Copy)]
pub enum Turn<'a> {
    /// Try once; never queue. Busy while anyone waits (fairness), unless re-entering.
    Once,
    /// Try once; if busy, join the queue in the same atomic step and return a ticket.
    Join,
    /// Try as the holder of this ticket: granted only when the ticket's turn has come.
    Queued(&'a Ticket),
}

/// A granted lease.
#[derive(Debug, Clone)]
pub struct Grant {
    pub token: Token,
    pub fence: u64,
    /// Hold count: above 1 after re-entry by the same owner.
    pub count: u32,
    pub since_ms: u64,
    pub expires_at_ms: u64,
}

/// The most holders a busy answer keeps and shows. A lock may have any
/// number of shared holders (a semaphore, `limit` of them), and every waiter
/// keeps its last busy answer: all of them, kept by each waiter, would take
/// memory in their product. A backend may name only these (counting the
/// others in [`Busy::omitted`]).
pub const SHOWN_HOLDERS: usize = 100;

/// Why a claim was not granted.
#[derive(Debug, Clone, Default)]
pub struct Busy {
    pub holders: Vec<Holder>,
    /// Holders left out of `holders`: the backends name every holder, and
    /// the sidecar keeps and shows at most a few (a waiter keeps its last
    /// busy answer for as long as it waits).
    pub omitted: usize,
    pub queue_length: usize,
    /// 1-based place in the queue of the attempt's ticket, when it has one.
    pub position: Option<usize>,
    /// The earliest moment the blocking state can lapse by itself (lease
    /// expiry, end of a lock-delay): the waiter's timer, so that dead holders
    /// are covered without polling.
    pub retry_at_ms: Option<u64>,
    /// The ticket issued by [`Turn::Join`].
    pub ticket: Option<Ticket>,
}

/// Result of an acquire attempt.
#[derive(Debug, Clone)]
pub enum Attempt {
    Granted(Grant),
    Busy(Busy),
}

/// A current holder, as every sidecar sees it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Holder {
    pub owner: String,
    pub sidecar: String,
    pub mode: Held,
    pub since_ms: u64,
    pub expires_at_ms: u64,
    pub fence: u64,
    pub count: u32,
}

/// A queued claim, as every sidecar sees it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Waiter {
    pub owner: String,
    pub sidecar: String,
    pub mode: Held,
    /// 1 is next in line.
    pub position: usize,
    pub since_ms: u64,
}

/// The global state of one lock or semaphore.
#[derive(Debug, Clone, Default)]
pub struct State {
    /// The highest fence ever granted on this key (0 if never).
    pub fence: u64,
    /// The active permit count of a semaphore in use.
    pub limit: Option<u32>,
    pub holders: Vec<Holder>,
    pub waiters: Vec<Waiter>,
}

/// One row of the listing of held or contended keys.
#[derive(Debug, Clone)]
pub struct Summary {
    pub key: LockKey,
    pub holders: usize,
    pub waiters: usize,
    pub fence: u64,
}

/// The most entries a stale-key scan keeps and `GET /v1/stale` answers,
/// so that a keyspace full of abandoned keys makes no unbounded answer.
pub const MOST_STALE: usize = 1000;

/// A key an operator should look at.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct StaleKey {
    /// The backend's own key or path.
    pub key: String,
    pub reason: StaleReason,
    pub age_ms: u64,
    pub detail: String,
}

/// Why `/v1/stale` lists a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum StaleReason {
    /// A lease older than `--stale-after`.
    HeldTooLong,
    /// A key with no expiry: a hand-written lock (`--legacy-pattern`,
    /// `--legacy-table`) or one whose TTL was removed.
    NoExpiry,
    /// A lease past its expiry that the backend has not removed yet.
    ExpiredNotCleaned,
    /// A waiter whose sidecar stopped sending heartbeats.
    OrphanedWaiter,
    /// A ZooKeeper lock node with no children left.
    EmptyParent,
    /// A key holding data sidelock did not write there.
    WrongType,
}

impl StaleReason {
    /// The word the API and the dashboard use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HeldTooLong => "held-too-long",
            Self::NoExpiry => "no-expiry",
            Self::ExpiredNotCleaned => "expired-not-cleaned",
            Self::OrphanedWaiter => "orphaned-waiter",
            Self::EmptyParent => "empty-parent",
            Self::WrongType => "wrong-type",
        }
    }

    /// The reason `word` names (as a backend's script or query writes it).
    pub fn parse(word: &str) -> Option<Self> {
        [
            Self::HeldTooLong,
            Self::NoExpiry,
            Self::ExpiredNotCleaned,
            Self::OrphanedWaiter,
            Self::EmptyParent,
            Self::WrongType,
        ]
        .into_iter()
        .find(|r| r.as_str() == word)
    }
}

/// Why a lease ended without its holder releasing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Loss {
    /// The lease ran past its expiry.
    Expired,
    /// The backend no longer has it and cannot say why (key deleted, session lost).
    Backend,
    /// A force-release removed it (through any sidecar), as the backend
    /// recorded.
    ForceReleased,
}

/// The state of one lease, for the sidecar's expiry timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Still held; expires then unless renewed.
    Held { expires_at_ms: u64 },
    /// Gone, and why.
    Gone(Loss),
}

/// The storage of leases, queues and fences behind the sidecar.
///
/// # Contract
///
/// * **Atomicity.** [`try_acquire`](Backend::try_acquire), [`renew`](Backend::renew)
///   and [`release`](Backend::release) are each one atomic step in the backend
///   (a Lua script, a transaction, a znode operation): a grant is written with
///   its expiry in the same step that checks for conflicts, and renew and
///   release compare the token in the step that changes the lease. A lease
///   whose expiry has passed counts as free in every check.
/// * **Conflicts.** An exclusive lease excludes every other lease on the key;
///   shared leases exclude only exclusive ones; a semaphore admits up to its
///   `limit` leases. The same owner asking again for a lock in the mode it
///   holds re-enters: same token, same fence, count + 1, regardless of queue.
///   Semaphore permits never re-enter.
/// * **Fairness.** Waiters form one FIFO queue per key across all sidecars. A
///   [`Turn::Once`] or [`Turn::Join`] claim is busy while the queue is not
///   empty; a [`Turn::Queued`] claim is granted only when every earlier ticket
///   is compatible with it (for exclusive: it is first; for shared: only shared
///   tickets are ahead; for semaphores: fewer tickets ahead than free permits).
///   The grant removes the ticket in the same step.
/// * **Fencing.** Every grant that is not a re-entry takes a fence strictly
///   greater than every fence granted before on that key, by any sidecar,
///   for the backend's whole life.
/// * **Lock delay.** When a lease ends by expiry or loss (not release), the key
///   grants nothing until the lease's expiry plus its claim's `lock_delay`.
/// * **Wake-ups.** Whenever a change may let a waiter in — a release, an
///   expiry noticed, a force-release, a ticket leaving the head of the queue —
///   the backend calls [`Wakeups::wake`] for that key on every sidecar that
///   [`watch`](Backend::watch)es it (pub/sub, watches, `NOTIFY`). Waiting never
///   polls: between wake-ups a waiter sleeps until [`Busy::retry_at_ms`].
///   A grant wakes nobody; [`announce`](Backend::announce) tells observers of
///   an election of its new leader where the backend can.
/// * **Handoffs.** A backend may grant a queued claim by itself when the
///   lock frees — Redis's release passes an exclusive lock to the next
///   ticket in line in the same step — and deliver the lease to its waiter
///   with [`Wakeups::granted`] instead of waking it. The claim's token is
///   then the one its ticket was queued with; a [`Turn::Queued`] attempt of a
///   ticket that was handed the lock answers that grant, and
///   [`dequeue`](Backend::dequeue) of such a ticket releases it (its waiter
///   left before it heard).
///
/// # Errors
///
/// [`Error::Unavailable`] when the backend cannot be reached; callers answer
/// 503 and retry later. A `release` or `dequeue` that was sent and not
/// answered says so ([`Error::may_have_run`]): sent again by its token, a
/// second run could take a hold its owner re-entered meanwhile.
/// [`Error::LimitMismatch`] and [`Error::LimitRequired`] are the client's
/// mistakes with semaphores. [`Error::Unsupported`]: a claim
/// this backend refuses (Redlock: semaphores with more than one permit),
/// before anything is written. [`Error::KeyConflict`]: a key the claim needs
/// holds foreign data; nothing is written either.
///
/// # Cancellation safety
///
/// A future dropped before completion may or may not have taken effect, as
/// with any remote call. The core never drops `try_acquire` on the floor: it
/// runs acquisitions in tasks of their own and releases grants nobody
/// received. `release`, `dequeue` and `renew` may be retried, except a
/// `release` that [may have run](Error::may_have_run). A `dequeue` is
/// retried always, so a backend whose dequeue can release a lease handed to
/// the ticket must not send the ticket's token again after a lost answer
/// (PostgreSQL then removes the waiter row alone, Redis and Redlock the
/// queue entry alone; ZooKeeper's dequeue forgets the ticket before it
/// releases anything, so a retry finds nothing to do).
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// What this backend is.
    fn describe(&self) -> Description;

    /// Checks the backend is reachable (for `/readyz`).
    async fn ping(&self) -> Result<(), Error>;

    /// Attempts to grant `claim` now; see the contract for `turn`.
    async fn try_acquire(&self, claim: &Claim, turn: Turn<'_>) -> Result<Attempt, Error>;

    /// Leaves the queue (timeout, disconnect). Idempotent.
    async fn dequeue(&self, ticket: &Ticket) -> Result<(), Error>;

    /// Extends the lease to `ttl` (default: the lease's own ttl) from now,
    /// never past its claim's `max_hold` from acquisition.
    /// `Some(expires_at_ms)`; `None`: the token holds nothing.
    async fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, Error>;

    /// Drops one hold of the lease. `Some(remaining)` hold count, `None`: the token holds nothing.
    async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, Error>;

    /// Whether the lease still holds, for the holder's expiry timer.
    async fn status(&self, key: &LockKey, token: &Token) -> Result<Status, Error>;

    /// The global state of `key`.
    async fn inspect(&self, key: &LockKey) -> Result<State, Error>;

    /// Held or contended keys whose name starts with `prefix`, ordered by
    /// key, strictly after `after`, at most `limit`.
    async fn list(
        &self,
        prefix: &str,
        after: Option<&LockKey>,
        limit: usize,
    ) -> Result<Vec<Summary>, Error>;

    /// Keys an operator should look at. A backend may stop looking once it
    /// has found more than [`MOST_STALE`] (the caller shows that many).
    async fn stale(&self, stale_after: Duration) -> Result<Vec<StaleKey>, Error>;

    /// Removes every lease of `key` (admin), returning their tokens.
    async fn force_release(&self, key: &LockKey) -> Result<Vec<Token>, Error>;

    /// One more local waiter on `key`: deliver wake-ups for it until the
    /// returned guard is dropped. Resolves once delivery is in place (e.g. the
    /// subscription is confirmed), so an attempt made afterwards cannot miss
    /// a release. Backends count watchers and subscribe once per key.
    async fn watch(&self, key: &LockKey) -> Result<Watch, Error>;

    /// Tells every sidecar [`watch`](Backend::watch)ing `key` that it has
    /// a new holder (an election's new leader), so that their observers
    /// ([`Wakeups::changed`]) read it at once. A change that lets no waiter
    /// in: no waiter needs to wake for it. The default does nothing;
    /// observers then see the new holder at their next look.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the backend cannot be reached.
    async fn announce(&self, _key: &LockKey) -> Result<(), Error> {
        Ok(())
    }

    /// Delivers [`Wakeups::changed`] (or [`Wakeups::wake`]) for every change
    /// of `key` this backend can report — releases, expiries, queue changes
    /// and announced grants — until the returned guard is dropped: what an
    /// election's observer follows. The default is [`watch`](Backend::watch).
    async fn observe(&self, key: &LockKey) -> Result<Watch, Error> {
        self.watch(key).await
    }

    /// Backend-wide housekeeping, done by one sidecar at a time (the
    /// monitor) every few seconds: what no request of a key would otherwise
    /// do soon (PostgreSQL: remove expired leases, waking their waiters, and
    /// the rows of dead sidecars). The default does nothing.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the backend cannot be reached.
    async fn tidy(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Whether [`observe`](Backend::observe) reports by itself the end of a
    /// lease whose holder's process dies, not only releases (ZooKeeper: the
    /// session's ephemeral node is deleted). Where it does not (the
    /// default), such a lease is noticed only by the next look at the key
    /// after it runs out, and whoever needs to know sooner must hear its
    /// holder announce that it is alive.
    fn reports_lease_ends(&self) -> bool {
        false
    }

    /// Whether the connection on which the backend sends this sidecar
    /// messages is up now (Redis's pub/sub, PostgreSQL's `LISTEN`), for
    /// `/readyz`: with it up and a message or a reply heard lately, the
    /// sidecar is ready without asking. `None` (the default): no such
    /// connection; readiness asks the backend ([`ping`](Backend::ping)).
    fn connected(&self) -> Option<bool> {
        None
    }

    /// Releases backend resources at shutdown.
    async fn close(&self) {}

    /// A feed of leases this backend lost on its own — its session expired or
    /// it was cut off from its servers for too long to vouch for them — so
    /// the sidecar can tell their holders at once instead of at the next
    /// renewal. Every token sent holds nothing any more: its renew and release
    /// answer `None` from then on. `None` (the default): the backend never
    /// pushes losses; holders learn of them by renewing or from the expiry timer.
    ///
    /// # Errors
    ///
    /// A receiver that lagged behind missed some tokens (`RecvError::Lagged`);
    /// the caller must then ask [`status`](Backend::status) for each lease it
    /// keeps.
    ///
    /// # Cancellation safety
    ///
    /// Receiving is cancellation safe: a token not yet received stays queued.
    fn losses(&self) -> Option<tokio::sync::broadcast::Receiver<Token>> {
        None
    }
}

/// Keeps a backend's wake-up delivery for one waiter alive; dropping it unwatches.
pub type Watch = Box<dyn Send + Sync>;

/// Backend settings from the configuration.
#[derive(Debug, Clone)]
pub struct Options {
    /// Prefix of every Redis key sidelock writes (`--redis-prefix`).
    pub redis_prefix: String,
    /// Keys of hand-written locks to report when they have no expiry (`--legacy-pattern`).
    pub legacy_pattern: Option<String>,
    /// PostgreSQL: schema of sidelock's tables (`--pg-schema`).
    pub pg_schema: String,
    /// PostgreSQL: hand-written lock table whose rows `/v1/stale` lists as
    /// `no-expiry` (`--legacy-table`).
    pub legacy_table: Option<String>,
    /// ZooKeeper: path of sidelock's lock tree under the URL's chroot (`--zk-lock-root`).
    pub zk_lock_root: String,
    /// This sidecar's id, as its waiters carry it.
    pub sidecar: String,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            redis_prefix: "sidelock:".into(),
            legacy_pattern: None,
            pg_schema: "sidelock".into(),
            legacy_table: None,
            zk_lock_root: "/sidelock".into(),
            sidecar: String::new(),
        }
    }
}

/// Every `--backend` URL scheme [`open`] knows.
pub const SCHEMES: &[&str] = &[
    "memory",
    "redis",
    "rediss",
    "redis+sentinel",
    "rediss+sentinel",
    "redis+cluster",
    "rediss+cluster",
    "redlock",
    "redlocks",
    "zk",
    "postgres",
    "postgresql",
];

/// Opens the backend a `--backend` URL names.
///
/// # Errors
/// A sentence for the operator when the URL's scheme is unknown or it is malformed.
pub async fn open(
    url: &str,
    options: &Options,
    wakeups: Wakeups,
) -> Result<Arc<dyn Backend>, String> {
    match url::scheme(url) {
        "memory" => Ok(Arc::new(memory::Memory::new(wakeups))),
        "redis" | "rediss" | "redis+sentinel" | "rediss+sentinel" | "redis+cluster"
        | "rediss+cluster" => Ok(Arc::new(redis::Redis::open(url, options, wakeups)?)),
        "redlock" | "redlocks" => Ok(Arc::new(redlock::Redlock::open(url, options, wakeups)?)),
        "postgres" | "postgresql" => Ok(Arc::new(
            postgres::Postgres::open(url, options, wakeups).await?,
        )),
        "zk" => Ok(Arc::new(zookeeper::ZooKeeper::open(url, options, wakeups)?)),
        _ => {
            let shown = redact(url);
            let other = url::scheme(&shown);
            Err(format!(
                "backend URL scheme {other:?} is not supported; use memory://, redis://, rediss://, redis+sentinel://, redis+cluster://, redlock://, postgres:// or zk://"
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Safety;

    #[test]
    fn the_safety_class_is_written_as_the_api_writes_it() {
        for safety in [
            Safety::SingleProcess,
            Safety::Efficiency,
            Safety::Correctness,
        ] {
            assert_eq!(
                serde_json::to_value(safety).unwrap(),
                serde_json::json!(safety.to_string())
            );
        }
    }
}
