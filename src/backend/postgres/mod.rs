//! `postgres://` and `postgresql://`: the classic database lock, done right.
//!
//! Leases, the FIFO queue, fences and the sidecars' heartbeats are rows in
//! tables of one schema (`--pg-schema`, default `sidelock`), created and
//! migrated here at start-up under an advisory lock, so sidecars that start
//! together on an empty database do not race. The SQL is in
//! `postgres/0001_init.sql` and the migrations after it (`0002_*.sql`
//! replaces functions of 0001, `0003_*.sql` admits elections, `0004_*.sql`
//! hands locks over, `0005_*.sql` has a release record expired leases'
//! lock-delay first, `0006_*.sql` counts queues, `0007_*.sql` renews many
//! leases at once, `0008_*.sql` runs a queued look again, `0009_*.sql`
//! notes force-released leases, `0010_*.sql` grants and releases the free
//! exclusive lock nobody waits for, and queues a claim behind a live
//! holder, in a few statements); the README documents every table and
//! index.
//!
//! * Names are data: every row is keyed by (kind, name), kind `lock`,
//!   `semaphore` or `election`, and names reach SQL only
//!   as parameters, so no name can reach a table, a function or the channel.
//! * Every operation is one call of a PL/pgSQL function, i.e. one statement
//!   and one transaction. Acquire takes the key's row lock, frees expired
//!   leases (an expired row counts as free), and grants with `expires_at`
//!   and the next fence from the key's counter, or queues.
//! * Time is the database's clock, so sidecars with skewed clocks agree on
//!   expiry. It is mapped onto this process's clock with an offset measured
//!   on connecting and settled on every answer that reads the database's
//!   clock, chosen so that expiries look slightly early here, never late.
//! * A release hands an exclusive lock to the first waiter in line in its
//!   own transaction (`pass_on()` in `0004_handoff.sql`: the waiter's row
//!   carries the lease it asks for) and tells that waiter's sidecar with
//!   `NOTIFY <schema>_wake_<first 8 of its instance>, 'g <instance> <seq>
//!   <fence> <since> <expires> <kind>/<name>'` on its own channel; waiters of sidecars whose listening connection is gone
//!   (it holds an advisory lock on its instance) are passed by.
//! * Waiting never polls: every other change that may let a waiter in sends
//!   `NOTIFY <schema>_wake, '<kind>/<name>'`; one `LISTEN` connection per
//!   sidecar wakes its local queue heads, and a waiter's own timer covers
//!   holders that die. When that connection comes back after a loss, every
//!   key with local waiters is woken, so releases missed meanwhile are not.
//! * The same connection sends the heartbeat, one statement every
//!   [`HEARTBEAT_EVERY`] whatever the number of waiters, while this sidecar
//!   has tickets (a sidecar with nobody waiting sends none, so idle sidecars
//!   cost the database nothing; its first join after a pause sends one
//!   first, so that its waiter is never taken for a dead sidecar's). It also
//!   removes the waiters of sidecars that stopped heartbeating, this
//!   sidecar's own waiter rows that no request waits for any more, and
//!   expired leases (waking their waiters). TCP keepalives, not statements,
//!   tell an idle LISTEN connection is dead.
//!
//! # Layout
//!
//! * [`errors`]: failures classified by SQLSTATE and driver kind.
//! * [`sql`]: the statements and their replies.
//! * [`calls`]: running statements within deadlines; the clock mapping.
//! * [`schema`]: migrations and the `--legacy-table`.
//! * [`listener`]: the LISTEN connection, heartbeat and reconnects.
//! * [`renewals`]: renewals sent together, one statement at a time.
//! * [`open`]: the URL, the pools and the background tasks.

use calls::Fate;
use schema::LegacyTable;
use sql::{AcquireReply, InspectReply, Sql, ms_i64, parse_kind};

mod calls;
mod errors;
mod listener;
mod open;
mod renewals;
mod schema;
mod sql;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::Pool;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::backend::unanswered::{Failed, release_unanswered};
use crate::backend::{
    Attempt, Backend, Busy, Cause, Description, Error, Grant, Loss, MOST_STALE, Safety, StaleKey,
    State, Status, Summary, Ticket, Turn, Waiter, Watch,
};
use crate::lock::{Claim, Held, Kind, LockKey, Name, Token};
use crate::wakeups::Wakeups;

/// How often a sidecar sends its heartbeat (and cleans expired rows).
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);
/// A waiter whose sidecar has not sent a heartbeat for this long is listed
/// by `/v1/stale` as `orphaned-waiter`.
pub const ORPHAN_AFTER: Duration = Duration::from_secs(5);
/// A waiter whose sidecar has not sent a heartbeat for this long leaves the queue.
pub const LAPSE_AFTER: Duration = Duration::from_secs(10);
/// A waiter row of this sidecar that no request knows of (its join's answer
/// was lost) is removed once it is this old: longer than any join can take.
pub const GHOST_AFTER: Duration = Duration::from_secs(10);
/// A queued attempt whose connection broke runs again after this pause:
/// time for the pool to open a new connection.
const RERUN_AFTER: Duration = Duration::from_millis(50);
/// Longest wait for a pooled connection, or to open one: an outage answers 503 this fast.
const POOL_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait for a pooled connection while the pool's connections are
/// busy but working (statements finish): a burst of requests larger than
/// the pool queues for a connection instead of answering 503.
const BUSY_POOL_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest time one operation may take before it counts as an outage.
const OP_TIMEOUT: Duration = Duration::from_secs(5);

/// The keys whose expired leases one heartbeat removes at most (`LIMIT` in
/// `heartbeat()`, `0006_queue_length.sql`).
const TIDY_BATCH: u64 = 1_000;

/// How long the monitor's housekeeping goes on removing expired leases in
/// full batches, within its round (10 s).
const TIDY_FOR: Duration = Duration::from_secs(3);
/// Connections per sidecar unless the URL says `pool_max_size=N`.
const DEFAULT_POOL_SIZE: usize = 10;
/// Connections per sidecar kept for renewals, releases and status checks.
const UPKEEP_POOL_SIZE: usize = 2;
/// How long an upkeep connection's statement waits for a row lock before it
/// runs again on the main pool (`lock_timeout` of those connections).
const UPKEEP_LOCK_WAIT: Duration = Duration::from_millis(250);
/// How long `watch` waits for the LISTEN connection before relying on the
/// catch-up wake-up that follows every (re)connection.
const LISTEN_WAIT: Duration = Duration::from_secs(2);
/// First and longest pause between reconnection attempts.
const MIN_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// Clock-offset changes up to this are measurement noise (see [`Inner::adopt_offset`]).
const OFFSET_SLACK_MS: i64 = 10;
/// A clock offset lower by this much is a step of the database's clock,
/// taken at once (see [`Inner::adopt_offset`]).
const OFFSET_STEP_MS: i64 = 100;
/// Most stale entries read per source (sidelock's tables, the legacy
/// table), the oldest first: one more than are shown tells that there are
/// more.
const STALE_LIMIT: i64 = MOST_STALE as i64 + 1;

/// One versioned schema migration.
struct Migration {
    version: i32,
    description: &'static str,
    /// `{s}` is replaced by the quoted schema, `{channel}` by the quoted NOTIFY channel.
    sql: &'static str,
}

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "keys, leases, sidecars and waiters with their functions",
        sql: include_str!("0001_init.sql"),
    },
    Migration {
        version: 2,
        description: "acquire and inspect check waiters' sidecars with a join, not live() per row",
        sql: include_str!("0002_liveness_joins.sql"),
    },
    Migration {
        version: 3,
        description: "elections: the key kind 'election' and one leader per name",
        sql: include_str!("0003_elections.sql"),
    },
    Migration {
        version: 4,
        description: "a release hands an exclusive lock to the first waiter in line",
        sql: include_str!("0004_handoff.sql"),
    },
    Migration {
        version: 5,
        description: "a release clears the key's expired leases, recording their lock-delay, first",
        sql: include_str!("0005_release_lapsed.sql"),
    },
    Migration {
        version: 6,
        description: "keys.queued counts a key's waiters (triggers keep it); a join no longer reads the queue",
        sql: include_str!("0006_queue_length.sql"),
    },
    Migration {
        version: 7,
        description: "renew_many renews many leases in one statement",
        sql: include_str!("0007_renew_many.sql"),
    },
    Migration {
        version: 8,
        description: "acquire runs a queued attempt again after its connection broke",
        sql: include_str!("0008_queued_again.sql"),
    },
    Migration {
        version: 9,
        description: "force_release notes the leases it removes in forced, for status",
        sql: include_str!("0009_forced.sql"),
    },
    Migration {
        version: 10,
        description: "acquire and release take short paths for the free exclusive lock nobody waits for and a claim behind a live holder",
        sql: include_str!("0010_short_paths.sql"),
    },
    Migration {
        version: 11,
        description: "a renewal never shortens a lease",
        sql: include_str!("0011_renew_never_shortens.sql"),
    },
    Migration {
        version: 12,
        description: "a release asks whether a waiter's sidecar lives with a shared try of its advisory lock; the heartbeat wakes only keys with waiters (or elections)",
        sql: include_str!("0012_shared_liveness_quiet_tidy.sql"),
    },
];

/// The PostgreSQL backend.
pub struct Postgres {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    /// Connections for renewals, releases and status checks only, so lease
    /// upkeep never queues behind a burst of acquires on `pool`.
    upkeep: Pool,
    /// Settings of the LISTEN connection (the pool's, another application name).
    listen_config: tokio_postgres::Config,
    sql: Sql,
    schema: String,
    channel: String,
    /// This process, in `sidecars` and `waiters` (a sidecar id may be reused
    /// by a restarted process; an instance never is).
    instance: String,
    sidecar: String,
    url: String,
    legacy: Option<LegacyTable>,
    wakeups: Wakeups,
    /// The schema is migrated and this sidecar registered.
    ready: watch::Sender<bool>,
    /// Why the last attempt to set the schema up failed, while not `ready`.
    setup_failure: std::sync::Mutex<Cause>,
    /// The LISTEN connection is up.
    listening: watch::Sender<bool>,
    /// A pooled call worked while the LISTEN connection was down: reconnect
    /// it now rather than after the backoff.
    reconnect: Notify,
    /// Local clock minus database clock, in ms (see [`Inner::local`]).
    offset_ms: AtomicI64,
    /// A lower offset measured once, waiting for the next measurement to
    /// confirm it (`i64::MIN`: none; see [`Inner::adopt_offset`]).
    offset_low_ms: AtomicI64,
    /// When a pooled statement last succeeded (local ms): a pool whose
    /// connections all are in use is busy, not down, while this moves.
    progress_ms: AtomicU64,
    /// This sidecar's tickets: the ones requests wait with, and the ones whose
    /// dequeue failed; the heartbeat removes every other row of this instance.
    tickets: Mutex<Tickets>,
    /// Held for writing while [`Inner::rejoin`] puts waiter rows back, and
    /// for reading by a waiter's own queued attempt and dequeue: a row put
    /// back for a ticket that was granted or left between the rejoin's look
    /// at the tickets and its statement would be a ghost that a release
    /// hands the lock to (or, granted, whose removal would take its lease).
    rejoining: tokio::sync::RwLock<()>,
    /// Asks the rejoin task ([`Inner::rejoins`]) to put waiter rows back.
    rejoin_soon: Arc<Notify>,
    /// When the last heartbeat succeeded (local ms; 0: none yet).
    beat_ms: AtomicU64,
    /// The database's time at the last heartbeat (0: none yet): a
    /// heartbeat that finds it a lapse ago knows this sidecar's waiter rows
    /// may have been dropped meanwhile.
    beat_db_ms: AtomicI64,
    /// Renewals waiting for their statement (see [`renewals`]).
    renewals: tokio::sync::mpsc::UnboundedSender<renewals::Renewal>,
    stop: CancellationToken,
}

#[derive(Default)]
struct Tickets {
    /// Queued tickets: each waiter row's token (the lease's, when a release
    /// hands the lock to it) and claim, from which its row is put back when
    /// it may have been dropped ([`Inner::rejoin`]).
    live: HashMap<u64, Live>,
    gone: HashSet<u64>,
    /// Tickets whose waiter left while the database could not be told:
    /// kept in `live` for the caller's retry, never put back.
    leaving: HashSet<u64>,
}

/// One queued ticket of this sidecar: what its waiter row holds.
struct Live {
    token: Token,
    claim: Claim,
}

impl Inner {
    /// Releases one hold of `token`'s lease on `key`: the holds left, or
    /// `None` when the token holds nothing there; with an error, what
    /// became of the statement.
    async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, (Error, Fate)> {
        let remaining: Option<i32> = self
            .value_or_fate(
                "release",
                &self.sql.release,
                &[
                    &key.kind.as_str(),
                    &key.name.as_str(),
                    &token.expose(),
                    &ms_i64(LAPSE_AFTER),
                ],
            )
            .await?;
        Ok(remaining.map(|n| u32::try_from(n).unwrap_or(0)))
    }
}

/// The error of a statement whose [`Fate`] the caller has no use for but
/// the core has: one that may have run says so ([`Error::may_have_run`]).
fn said((error, fate): (Error, Fate)) -> Error {
    match fate {
        Fate::Unknown => error.unanswered(),
        Fate::NotRun | Fate::Refused => error,
    }
}

/// Gives back, in the background, the lease an attempt of `claim` with
/// `token` may have been granted although its answer was lost (see
/// [`release_unanswered`]). A join's waiter row, which nobody waits for,
/// may be handed the lock until it is removed — by this sidecar's heartbeat
/// after [`GHOST_AFTER`], or as a silent sidecar's after [`LAPSE_AFTER`] —
/// so after a join the release looks for that long.
fn give_back_unanswered(inner: &Arc<Inner>, claim: &Claim, token: Token, join: bool) {
    let (me, key) = (inner.clone(), claim.key.clone());
    let release = move || {
        let (me, key, token) = (me.clone(), key.clone(), token.clone());
        async move {
            me.release(&key, &token)
                .await
                .map_err(|(_, fate)| match fate {
                    Fate::Unknown => Failed::Unanswered,
                    Fate::NotRun | Fate::Refused => Failed::NotRun,
                })
        }
    };
    let now = tokio::time::Instant::now();
    let look_until = if join {
        now + GHOST_AFTER + LAPSE_AFTER + HEARTBEAT_EVERY
    } else {
        now
    };
    // A lease handed to the row as late as `look_until` runs its ttl from
    // then: ending at `now + ttl` left it holding the lock for its whole
    // ttl whenever that was shorter than the row's life.
    tokio::spawn(release_unanswered(
        claim.key.clone(),
        release,
        OP_TIMEOUT,
        look_until,
        look_until + claim.ttl,
        inner.stop.clone(),
    ));
}

impl Postgres {
    /// Calls `acquire` for `claim` at its turn (`once`, `join`, `queued`
    /// or `again`) under `token`; the error tells what became of the call.
    async fn acquire(
        &self,
        claim: &Claim,
        turn: &str,
        seq: Option<i64>,
        token: &Token,
    ) -> Result<Option<AcquireReply>, (Error, Fate)> {
        let inner = &self.inner;
        // Above i32::MAX refused by `try_acquire`.
        let limit = claim.limit.map(|l| i32::try_from(l).unwrap_or(i32::MAX));
        inner
            .json_or_fate(
                "try_acquire",
                &inner.sql.acquire,
                &[
                    &claim.key.kind.as_str(),
                    &claim.key.name.as_str(),
                    &claim.mode.as_str(),
                    &claim.owner,
                    &claim.sidecar,
                    &inner.instance,
                    &token.expose(),
                    &ms_i64(claim.ttl),
                    &limit,
                    &ms_i64(claim.lock_delay),
                    &claim.max_hold.map(ms_i64),
                    &turn,
                    &seq,
                    &ms_i64(LAPSE_AFTER),
                    &true,
                ],
            )
            .await
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.inner.stop.cancel();
    }
}

#[async_trait]
impl Backend for Postgres {
    fn describe(&self) -> Description {
        Description {
            kind: crate::backend::BackendKind::Postgres,
            url: self.inner.url.clone(),
            safety: Safety::Correctness,
        }
    }

    async fn ping(&self) -> Result<(), Error> {
        self.inner.rows("ping", "SELECT 1", &[]).await.map(|_| ())
    }

    async fn try_acquire(&self, claim: &Claim, turn: Turn<'_>) -> Result<Attempt, Error> {
        if let Some(limit) = claim.limit.filter(|&l| i32::try_from(l).is_err()) {
            return Err(Error::Unsupported(format!(
                "limit={limit} is refused: the postgres backend stores a semaphore's permits \
                 as an integer column, at most {} permits",
                i32::MAX
            )));
        }
        let inner = &self.inner;
        let _rejoin = match turn {
            Turn::Queued(_) => Some(inner.rejoining.read().await),
            Turn::Once | Turn::Join => None,
        };
        let (turn_name, seq) = match turn {
            Turn::Once => ("once", None),
            Turn::Join => ("join", None),
            Turn::Queued(ticket) => ("queued", i64::try_from(ticket.seq).ok()),
        };
        // A queued claim asks for the lease its row carries. A ticket this
        // sidecar no longer holds was handed a lease just now: it waits in the
        // waiter's place, which its wake-up makes it look at next.
        let token = match turn {
            Turn::Queued(ticket) => match inner.tickets().live.get(&ticket.seq) {
                Some(live) => live.token.clone(),
                None => return Ok(Attempt::Busy(Busy::default())),
            },
            _ => Token::generate(),
        };
        if matches!(turn, Turn::Join) && inner.heartbeat_is_old() {
            inner.heartbeat_now("try_acquire").await?;
        }
        let mut answer = self.acquire(claim, turn_name, seq, &token).await;
        if matches!(turn, Turn::Queued(_))
            && matches!(&answer, Err((e, _)) if e.cause() == Some(Cause::ConnectionLost))
            && !inner.stop.is_cancelled()
        {
            // Run again, a queued look answers the grant its first run may
            // have made (found by its token); a waiter that may have long to
            // wait still is not failed by one broken connection. When the
            // run again cannot tell what the first did (its ticket has gone:
            // the first may have re-entered its owner's lease), the first
            // failure stands.
            tokio::time::sleep(RERUN_AFTER).await;
            let again = self.acquire(claim, "again", seq, &token).await;
            if matches!(&again, Ok(Some(reply)) if !matches!(reply, AcquireReply::Unsure)) {
                answer = again;
            }
        }
        let reply = match answer {
            Ok(reply) => reply,
            Err((e, fate)) => {
                if fate == Fate::Unknown && matches!(turn, Turn::Once | Turn::Join) {
                    // The database may have granted the new token all the
                    // same: nobody would hold that lease until its ttl.
                    give_back_unanswered(&self.inner, claim, token, matches!(turn, Turn::Join));
                }
                return Err(e);
            }
        };
        let reply = reply.ok_or_else(|| Error::Unavailable {
            op: "try_acquire",
            source: "acquire returned NULL".into(),
        })?;
        match (&reply, turn) {
            (AcquireReply::Busy(b), _) => {
                if let Some(seq) = b.seq {
                    let live = Live {
                        token: token.clone(),
                        claim: claim.clone(),
                    };
                    inner.tickets().live.insert(seq, live);
                }
            }
            // The grant removed the ticket.
            (AcquireReply::Granted(_), Turn::Queued(ticket)) => {
                inner.tickets().live.remove(&ticket.seq);
            }
            _ => {}
        }
        match reply {
            AcquireReply::Granted(g) => Ok(Attempt::Granted(Grant {
                token: Token::from_client(g.token),
                fence: g.fence,
                count: g.count,
                since_ms: inner.local(g.since_ms),
                expires_at_ms: inner.local(g.expires_at_ms),
            })),
            AcquireReply::Busy(b) => Ok(Attempt::Busy(Busy {
                holders: b
                    .holders
                    .into_iter()
                    .map(|h| inner.holder(claim.key.kind, h))
                    .collect(),
                omitted: 0,
                queue_length: b.queue_length,
                position: b.position,
                retry_at_ms: b.retry_at_ms.map(|at| inner.local_deadline(at, b.now_ms)),
                ticket: b.seq.map(|seq| Ticket {
                    key: claim.key.clone(),
                    seq,
                }),
            })),
            AcquireReply::LimitMismatch { active } => Err(Error::LimitMismatch { active }),
            AcquireReply::LimitRequired => Err(Error::LimitRequired),
            AcquireReply::Unsure => Err(Error::Unavailable {
                op: "try_acquire",
                source: "a queued attempt run again could not tell what its first run did".into(),
            }),
        }
    }

    async fn dequeue(&self, ticket: &Ticket) -> Result<(), Error> {
        let inner = &self.inner;
        let _rejoin = inner.rejoining.read().await;
        // Without its token (handed a lease the waiter took), nothing matches.
        let taken = {
            let mut tickets = inner.tickets();
            tickets.leaving.remove(&ticket.seq);
            tickets.live.remove(&ticket.seq)
        };
        let token = taken
            .as_ref()
            .map(|t| t.token.expose().to_owned())
            .unwrap_or_default();
        let seq = i64::try_from(ticket.seq).unwrap_or(i64::MAX);
        let result: Result<bool, (Error, Fate)> = inner
            .value_or_fate(
                "dequeue",
                &inner.sql.dequeue,
                &[&seq, &token, &ms_i64(LAPSE_AFTER)],
            )
            .await;
        if let Err((_, fate)) = &result {
            // The row must not stay at the head of the queue: the heartbeat
            // removes it once the database is back.
            let mut tickets = inner.tickets();
            tickets.gone.insert(ticket.seq);
            // Kept for the caller's retry, which must give back a lease the
            // database may have handed the ticket meanwhile — unless this
            // run may have given it back already: run again with the
            // token, it would take a hold the owner re-entered since
            // (the retry then takes the row alone; a lease this run did
            // not reach is left to its ttl, held too long, never twice).
            if let Some(live) = taken.filter(|_| *fate != Fate::Unknown) {
                tickets.live.insert(ticket.seq, live);
                tickets.leaving.insert(ticket.seq);
            }
        }
        result.map(|_| ()).map_err(said)
    }

    async fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, Error> {
        let inner = &self.inner;
        let stopped = || Error::Unavailable {
            op: "renew",
            source: "the backend is closing".into(),
        };
        let (answer, answered) = tokio::sync::oneshot::channel();
        inner
            .renewals
            .send(renewals::Renewal {
                kind: key.kind.as_str(),
                name: key.name.as_str().to_owned(),
                token: token.clone(),
                ttl_ms: ttl.map(ms_i64),
                answer,
            })
            .map_err(|_| stopped())?;
        let expires = answered.await.map_err(|_| stopped())??;
        Ok(expires.map(|at| inner.local(at)))
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, Error> {
        self.inner.release(key, token).await.map_err(said)
    }

    async fn status(&self, key: &LockKey, token: &Token) -> Result<Status, Error> {
        let rows = self
            .inner
            .rows(
                "status",
                &self.inner.sql.status,
                &[&token.expose(), &key.kind.as_str(), &key.name.as_str()],
            )
            .await?;
        Ok(match rows.first().map(|row| row.get::<_, Option<i64>>(0)) {
            Some(Some(expires_at_ms)) => Status::Held {
                expires_at_ms: self.inner.local(expires_at_ms),
            },
            Some(None) => Status::Gone(Loss::ForceReleased),
            None => Status::Gone(Loss::Expired),
        })
    }

    async fn inspect(&self, key: &LockKey) -> Result<State, Error> {
        let inner = &self.inner;
        let reply: Option<InspectReply> = inner
            .json(
                "inspect",
                &inner.sql.inspect,
                &[&key.kind.as_str(), &key.name.as_str(), &ms_i64(LAPSE_AFTER)],
            )
            .await?;
        let Some(reply) = reply else {
            return Ok(State::default());
        };
        let in_use = !reply.holders.is_empty() || !reply.waiters.is_empty();
        Ok(State {
            fence: reply.fence,
            limit: reply
                .permits
                .filter(|_| in_use && key.kind == Kind::Semaphore),
            holders: reply
                .holders
                .into_iter()
                .map(|h| inner.holder(key.kind, h))
                .collect(),
            waiters: reply
                .waiters
                .into_iter()
                .enumerate()
                .map(|(i, w)| Waiter {
                    owner: w.owner,
                    sidecar: w.sidecar,
                    mode: Held::of(key.kind, w.mode),
                    position: i + 1,
                    since_ms: inner.local(w.since_ms),
                })
                .collect(),
        })
    }

    async fn list(
        &self,
        prefix: &str,
        after: Option<&LockKey>,
        limit: usize,
    ) -> Result<Vec<Summary>, Error> {
        let after_kind = after.map(|k| k.kind.as_str());
        let after_name = after.map(|k| k.name.as_str());
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self
            .inner
            .rows(
                "list",
                &self.inner.sql.list,
                &[
                    &prefix,
                    &after_kind,
                    &after_name,
                    &limit,
                    &ms_i64(LAPSE_AFTER),
                ],
            )
            .await?;
        Ok(rows
            .iter()
            .filter_map(|row| {
                let kind = parse_kind(row.get(0))?;
                let name = Name::parse(row.get(1)).ok()?;
                let fence: i64 = row.get(2);
                let holders: i64 = row.get(3);
                let waiters: i64 = row.get(4);
                Some(Summary {
                    key: LockKey { kind, name },
                    holders: usize::try_from(holders).unwrap_or(0),
                    waiters: usize::try_from(waiters).unwrap_or(0),
                    fence: u64::try_from(fence).unwrap_or(0),
                })
            })
            .collect())
    }

    async fn stale(&self, stale_after: Duration) -> Result<Vec<StaleKey>, Error> {
        let inner = &self.inner;
        let rows = inner
            .rows(
                "stale",
                &inner.sql.stale,
                &[&ms_i64(stale_after), &ms_i64(ORPHAN_AFTER), &STALE_LIMIT],
            )
            .await?;
        let table = |t: &str| format!("{}.{t}", inner.schema);
        let mut stale: Vec<StaleKey> = rows
            .iter()
            .filter_map(|row| {
                let reason: &str = row.get(0);
                let kind = parse_kind(row.get(1))?;
                let name: &str = row.get(2);
                let owner: &str = row.get(3);
                let sidecar: &str = row.get(4);
                let fence: Option<i64> = row.get(5);
                let age_ms = u64::try_from(row.get::<_, i64>(6)).unwrap_or(0);
                let key = format!("{}/{name}", kind.plural());
                let age = humantime::format_duration(Duration::from_millis(age_ms));
                let (reason, detail) = match reason {
                    "held-too-long" => (
                        crate::backend::StaleReason::HeldTooLong,
                        format!(
                            "held by owner {owner:?} on sidecar {sidecar:?} with fence {} for longer than {} (row in {})",
                            fence.unwrap_or(0),
                            humantime::format_duration(stale_after),
                            table("leases")
                        ),
                    ),
                    "expired-not-cleaned" => (
                        crate::backend::StaleReason::ExpiredNotCleaned,
                        format!(
                            "the lease of owner {owner:?} (sidecar {sidecar:?}, fence {}) expired {age} ago and its row is still in {}; it counts as free",
                            fence.unwrap_or(0),
                            table("leases")
                        ),
                    ),
                    "orphaned-waiter" => (
                        crate::backend::StaleReason::OrphanedWaiter,
                        format!(
                            "waiter of owner {owner:?} queued through sidecar {sidecar:?}, which has sent no heartbeat for {age} (row in {}); it leaves the queue after {}",
                            table("waiters"),
                            humantime::format_duration(LAPSE_AFTER)
                        ),
                    ),
                    _ => return None,
                };
                Some(StaleKey {
                    key,
                    reason,
                    age_ms,
                    detail,
                })
            })
            .collect();
        if let Some(legacy) = &inner.legacy {
            stale.extend(inner.legacy_stale(legacy).await?);
        }
        Ok(stale)
    }

    async fn force_release(&self, key: &LockKey) -> Result<Vec<Token>, Error> {
        let tokens: Option<Vec<String>> = self
            .inner
            .json(
                "force_release",
                &self.inner.sql.force_release,
                &[&key.kind.as_str(), &key.name.as_str()],
            )
            .await?;
        Ok(tokens
            .unwrap_or_default()
            .into_iter()
            .map(Token::from_client)
            .collect())
    }

    async fn announce(&self, key: &LockKey) -> Result<(), Error> {
        let inner = &self.inner;
        inner
            .rows(
                "announce",
                &inner.sql.announce,
                &[&key.kind.as_str(), &key.name.as_str()],
            )
            .await
            .map(|_| ())
    }

    /// The heartbeat statement, whose cleanup is everyone's: while no
    /// sidecar has waiters, nobody else sends it.
    /// Heartbeats, each removing the expired leases of up to
    /// [`TIDY_BATCH`] keys, while they come back full and for at most
    /// [`TIDY_FOR`]: one a round let leases that expire faster than a
    /// batch a round pile up.
    async fn tidy(&self) -> Result<(), Error> {
        let started = tokio::time::Instant::now();
        while self.inner.heartbeat_clearing("tidy").await? >= TIDY_BATCH
            && started.elapsed() < TIDY_FOR
        {}
        Ok(())
    }

    async fn watch(&self, _key: &LockKey) -> Result<Watch, Error> {
        // One LISTEN covers every key. Once it is up, a release cannot be
        // missed; if it is down, its reconnection wakes every local waiter.
        let mut listening = self.inner.listening.subscribe();
        let _ = tokio::time::timeout(LISTEN_WAIT, listening.wait_for(|up| *up)).await;
        Ok(Box::new(()))
    }

    /// The `LISTEN` connection.
    fn connected(&self) -> Option<bool> {
        Some(*self.inner.listening.borrow() && *self.inner.ready.borrow())
    }

    async fn close(&self) {
        let inner = &self.inner;
        inner.stop.cancel();
        if *inner.ready.borrow()
            && let Err(e) = inner
                .rows("close", &inner.sql.leave, &[&inner.instance])
                .await
        {
            tracing::warn!(error = %e, "could not remove this sidecar's rows from PostgreSQL");
        }
        inner.pool.close();
        inner.upkeep.close();
    }
}

#[cfg(test)]
mod tests {
    use super::errors::{Class, Failure};
    use super::open::validate_schema;
    use super::*;
    use crate::backend::url::strip_query;

    #[test]
    fn schema_names_need_no_quoting() {
        assert!(validate_schema("sidelock").is_ok());
        assert!(validate_schema("_t_1").is_ok());
        assert!(validate_schema("").is_err());
        assert!(validate_schema("1abc").is_err());
        assert!(validate_schema("Upper").is_err());
        assert!(validate_schema("a-b").is_err());
        assert!(validate_schema(&"a".repeat(49)).is_err());
    }

    #[test]
    fn sidelock_parameters_are_taken_out_of_the_url() {
        let (url, ours) = strip_query(
            "postgres://db/x?options=-c%20a%3Db&pool_max_size=4",
            &["pool_max_size"],
        );
        assert_eq!(url, "postgres://db/x?options=-c%20a%3Db");
        assert_eq!(ours, [("pool_max_size".to_owned(), "4".to_owned())]);
        let (url, ours) = strip_query("postgres://db/x", &["pool_max_size"]);
        assert_eq!((url.as_str(), ours.len()), ("postgres://db/x", 0));
    }

    #[test]
    fn payloads_are_keys() {
        let key = LockKey::parse("locks/a.b:c").unwrap();
        assert_eq!((key.kind, key.name.as_str()), (Kind::Lock, "a.b:c"));
        let key = LockKey::parse("semaphores/gpu").unwrap();
        assert_eq!(key.kind, Kind::Semaphore);
        assert!(LockKey::parse("other/x").is_none());
        assert!(LockKey::parse("locks/a b").is_none());
    }

    #[test]
    fn legacy_table_specs() {
        let t = LegacyTable::parse("method_lock").unwrap();
        assert_eq!(
            (t.table.as_str(), t.name_column, t.time_column),
            ("method_lock", None, None)
        );
        let t = LegacyTable::parse("public.method_lock(method_name, update_time)").unwrap();
        assert_eq!(t.table, "public.method_lock");
        assert_eq!(t.name_column.as_deref(), Some("method_name"));
        assert_eq!(t.time_column.as_deref(), Some("update_time"));
        assert!(LegacyTable::parse("a;drop table x").is_err());
        assert!(LegacyTable::parse("t(a,b,c)").is_err());
        assert!(LegacyTable::parse("a.b.c").is_err());
    }

    #[test]
    fn errors_without_sqlstate_from_io_are_outages() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let failure = Failure {
            class: Class::Outage,
            source: Box::new(io),
        };
        assert!(matches!(
            failure.into_error("ping"),
            Error::Unavailable { op: "ping", .. }
        ));
    }
}
