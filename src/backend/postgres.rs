//! `postgres://` and `postgresql://`: the classic database lock, done right.
//!
//! Leases, the FIFO queue, fences and the sidecars' heartbeats are rows in
//! tables of one schema (`--pg-schema`, default `sidelock`), created and
//! migrated here at start-up under an advisory lock, so sidecars that start
//! together on an empty database do not race. The SQL is in
//! `postgres/0001_init.sql` and the migrations after it (`0002_*.sql`
//! replaces functions of 0001); the README documents every table and index.
//!
//! * Names are data: every row is keyed by (kind, name), kind `lock` or
//!   `semaphore` (`election` is kept for elections), and names reach SQL only
//!   as parameters, so no name can reach a table, a function or the channel.
//! * Every operation is one call of a PL/pgSQL function, i.e. one statement
//!   and one transaction. Acquire takes the key's row lock, frees expired
//!   leases (an expired row counts as free), and grants with `expires_at`
//!   and the next fence from the key's counter, or queues.
//! * Time is the database's clock, so sidecars with skewed clocks agree on
//!   expiry. It is mapped onto this process's clock with an offset measured
//!   on connecting, chosen so that expiries look slightly early here, never
//!   late.
//! * Waiting never polls: every change that may let a waiter in sends
//!   `NOTIFY <schema>_wake, '<kind>/<name>'`; one `LISTEN` connection per
//!   sidecar wakes its local queue heads, and a waiter's own timer covers
//!   holders that die. When that connection comes back after a loss, every
//!   key with local waiters is woken, so releases missed meanwhile are not.
//! * The same connection sends the heartbeat, one statement every
//!   [`HEARTBEAT_EVERY`] whatever the number of waiters. It also removes the
//!   waiters of sidecars that stopped heartbeating, this sidecar's own
//!   waiter rows that no request waits for any more, and expired leases.

use std::collections::HashSet;
use std::error::Error as StdError;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{
    Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod, Runtime, TimeoutType,
};
use futures::StreamExt;
use serde::Deserialize;
use tokio::sync::{Notify, mpsc, watch};
use tokio_postgres::types::ToSql;
use tokio_postgres::{AsyncMessage, NoTls, Row};
use tokio_util::sync::CancellationToken;

use super::{
    Attempt, Backend, Busy, Cause, Description, Error, Grant, Holder, Loss, Options, Outage,
    Safety, StaleKey, State, Status, Summary, Ticket, Turn, Waiter, Watch, chain,
};
use crate::clock::{ms, now_ms};
use crate::lock::{Claim, Held, Kind, LockKey, Mode, Name, Token};
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
/// Longest wait for a pooled connection, or to open one: an outage answers 503 this fast.
const POOL_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait for a pooled connection while the pool's connections are
/// busy but working (statements finish): a burst of requests larger than
/// the pool queues for a connection instead of answering 503.
const BUSY_POOL_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest time one operation may take before it counts as an outage.
const OP_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections per sidecar unless the URL says `pool_max_size=N`.
const DEFAULT_POOL_SIZE: usize = 10;
/// Connections per sidecar kept for renewals, releases and status checks.
const UPKEEP_POOL_SIZE: usize = 2;
/// How long `watch` waits for the LISTEN connection before relying on the
/// catch-up wake-up that follows every (re)connection.
const LISTEN_WAIT: Duration = Duration::from_secs(2);
/// First and longest pause between reconnection attempts.
const MIN_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// Clock-offset changes up to this are measurement noise (see [`Inner::adopt_offset`]).
const OFFSET_SLACK_MS: i64 = 10;
/// Most stale entries reported per reason source.
const STALE_LIMIT: i64 = 1000;

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
        sql: include_str!("postgres/0001_init.sql"),
    },
    Migration {
        version: 2,
        description: "acquire and inspect check waiters' sidecars with a join, not live() per row",
        sql: include_str!("postgres/0002_liveness_joins.sql"),
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
    /// When a pooled statement last succeeded (local ms): a pool whose
    /// connections all are in use is busy, not down, while this moves.
    progress_ms: AtomicU64,
    /// This sidecar's tickets: the ones requests wait with, and the ones whose
    /// dequeue failed; the heartbeat removes every other row of this instance.
    tickets: Mutex<Tickets>,
    stop: CancellationToken,
}

#[derive(Default)]
struct Tickets {
    live: HashSet<u64>,
    gone: HashSet<u64>,
}

/// The statements, with the schema filled in.
struct Sql {
    acquire: String,
    dequeue: String,
    renew: String,
    release: String,
    status: String,
    inspect: String,
    list: String,
    stale: String,
    force_release: String,
    heartbeat: String,
    leave: String,
}

impl Sql {
    fn new(schema: &str) -> Self {
        let s = quote_ident(schema);
        let fill = |template: &str| template.replace("{s}", &s);
        Self {
            acquire: fill(
                "SELECT {s}.acquire($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)::text",
            ),
            dequeue: fill("SELECT {s}.dequeue($1)"),
            renew: fill("SELECT {s}.renew($1, $2, $3, $4)::text"),
            release: fill("SELECT {s}.release($1, $2, $3)"),
            status: fill(
                "SELECT {s}.ms(expires_at), {s}.ms(clock_timestamp()) FROM {s}.leases \
                 WHERE token = $1 AND kind = $2 AND name = $3 AND expires_at > clock_timestamp()",
            ),
            inspect: fill("SELECT {s}.inspect($1, $2, $3)::text"),
            list: fill(LIST_SQL),
            stale: fill(STALE_SQL),
            force_release: fill("SELECT {s}.force_release($1, $2)::text"),
            heartbeat: fill("SELECT {s}.heartbeat($1, $2, $3, $4, $5, $6)::text"),
            leave: fill("SELECT 1 FROM {s}.leave($1)"),
        }
    }
}

/// Held or contended keys after a cursor: `$1` prefix, `$2`/`$3` the cursor's
/// kind and name (NULL for the first page), `$4` limit, `$5` lapse in ms.
const LIST_SQL: &str = "
WITH t AS (SELECT clock_timestamp() AS now),
active AS (
    SELECT l.kind, l.name FROM {s}.leases l, t
     WHERE l.expires_at > t.now AND starts_with(l.name, $1)
    UNION
    SELECT w.kind, w.name FROM {s}.waiters w, t
     WHERE starts_with(w.name, $1)
       AND EXISTS (SELECT 1 FROM {s}.sidecars c
                    WHERE c.instance = w.instance AND c.heartbeat_at > t.now - {s}.millis($5))
)
SELECT a.kind, a.name, k.fence,
       (SELECT count(*) FROM {s}.leases l
         WHERE l.kind = a.kind AND l.name = a.name AND l.expires_at > t.now) AS holders,
       (SELECT count(*) FROM {s}.waiters w
         WHERE w.kind = a.kind AND w.name = a.name
           AND EXISTS (SELECT 1 FROM {s}.sidecars c
                        WHERE c.instance = w.instance
                          AND c.heartbeat_at > t.now - {s}.millis($5))) AS waiters
  FROM active a JOIN {s}.keys k ON k.kind = a.kind AND k.name = a.name, t
 WHERE $2::text IS NULL OR (a.kind, a.name) > ($2::text, $3::text)
 ORDER BY a.kind, a.name
 LIMIT $4";

/// Stale rows of sidelock's own tables: `$1` stale-after in ms, `$2` orphan
/// threshold in ms, `$3` limit.
const STALE_SQL: &str = "
WITH t AS (SELECT clock_timestamp() AS now)
SELECT * FROM (
    SELECT 'held-too-long' AS reason, l.kind, l.name, l.owner, l.sidecar, l.fence,
           {s}.ms(t.now) - {s}.ms(l.acquired_at) AS age_ms
      FROM {s}.leases l, t
     WHERE l.expires_at > t.now AND l.acquired_at < t.now - {s}.millis($1)
    UNION ALL
    SELECT 'expired-not-cleaned', l.kind, l.name, l.owner, l.sidecar, l.fence,
           {s}.ms(t.now) - {s}.ms(l.expires_at)
      FROM {s}.leases l, t
     WHERE l.expires_at <= t.now
    UNION ALL
    SELECT 'orphaned-waiter', w.kind, w.name, w.owner, w.sidecar, NULL::bigint,
           {s}.ms(t.now) - {s}.ms(coalesce(s.heartbeat_at, w.queued_at))
      FROM {s}.waiters w LEFT JOIN {s}.sidecars s ON s.instance = w.instance, t
     WHERE s.heartbeat_at IS NULL OR s.heartbeat_at <= t.now - {s}.millis($2)
) x
ORDER BY kind, name, reason
LIMIT $3";

/// The database clock in ms (works before the schema exists).
const NOW_SQL: &str = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// How a failure should be handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// The database cannot be reached or is going away: 503, retry later.
    Outage,
    /// A serialization failure or deadlock: run the statement again.
    Retry,
    /// The database refused the statement (permissions, wrong schema, a bug):
    /// retrying will not help.
    Fatal,
}

/// A failed database call, classified by the driver's error kinds and SQLSTATE codes.
struct Failure {
    class: Class,
    source: Box<dyn StdError + Send + Sync>,
}

impl Failure {
    fn timeout(what: &str) -> Self {
        Self {
            class: Class::Outage,
            source: Outage::boxed(
                Cause::TimedOut,
                format!("PostgreSQL did not answer within {OP_TIMEOUT:?} ({what})"),
            ),
        }
    }

    fn into_error(self, op: &'static str) -> Error {
        if self.class == Class::Fatal {
            tracing::error!(op, error = %chain(self.source.as_ref()), "PostgreSQL refused a sidelock statement");
        }
        Error::Unavailable {
            op,
            source: self.source,
        }
    }

    fn describe(&self) -> String {
        chain(self.source.as_ref())
    }
}

impl From<tokio_postgres::Error> for Failure {
    fn from(e: tokio_postgres::Error) -> Self {
        Self {
            class: classify(&e),
            source: without_row_data(e),
        }
    }
}

/// The driver's error, less what the server quoted from the statement: a
/// server error's `DETAIL` and `HINT` can hold a row's values (`Failing row
/// contains (<lease token>, …)`), and the error reaches the log. What stays
/// is the SQLSTATE, the severity and the message, which names constraints
/// and relations but no values.
fn without_row_data(e: tokio_postgres::Error) -> Box<dyn StdError + Send + Sync> {
    match e.as_db_error() {
        Some(db) => Outage::boxed(
            Cause::of(&e),
            format!(
                "{}: {} (SQLSTATE {})",
                db.severity(),
                db.message(),
                db.code().code()
            ),
        ),
        None => Box::new(e),
    }
}

impl From<PoolError> for Failure {
    fn from(e: PoolError) -> Self {
        let class = match &e {
            PoolError::Backend(e) => classify(e),
            PoolError::Timeout(_) | PoolError::Closed => Class::Outage,
            _ => Class::Fatal,
        };
        let source = match e {
            PoolError::Backend(e) => without_row_data(e),
            PoolError::Timeout(_) => Outage::boxed(Cause::TimedOut, e.to_string()),
            e => Box::new(e),
        };
        Self { class, source }
    }
}

/// Classifies a driver error by SQLSTATE (for errors the server sent) or by
/// the driver's own kinds (closed connection, I/O), never by message text.
fn classify(e: &tokio_postgres::Error) -> Class {
    if let Some(code) = e.code() {
        let code = code.code();
        return match code {
            // serialization_failure, deadlock_detected
            "40001" | "40P01" => Class::Retry,
            // query_canceled (statement_timeout, pg_cancel_backend)
            "57014" => Class::Outage,
            // connection_exception, insufficient_resources (too many
            // connections), operator_intervention (admin/crash shutdown,
            // cannot_connect_now, database_dropped), system_error
            _ if ["08", "53", "57", "58"]
                .iter()
                .any(|class| code.starts_with(class)) =>
            {
                Class::Outage
            }
            _ => Class::Fatal,
        };
    }
    let io = e
        .source()
        .is_some_and(|s| s.downcast_ref::<std::io::Error>().is_some());
    // No source at all: the driver's own timeout or an unexpected message.
    if e.is_closed() || io || e.source().is_none() {
        Class::Outage
    } else {
        // Authentication, TLS, configuration, (de)serialisation.
        Class::Fatal
    }
}

fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

fn parse_kind(kind: &str) -> Option<Kind> {
    match kind {
        "lock" => Some(Kind::Lock),
        "semaphore" => Some(Kind::Semaphore),
        _ => None,
    }
}

/// Milliseconds as the database's `bigint`.
fn ms_i64(d: Duration) -> i64 {
    i64::try_from(ms(d)).unwrap_or(i64::MAX)
}

/// Checks `--pg-schema`: lower-case letters, digits and `_`, so it needs no
/// quoting anywhere and `<schema>_wake` fits PostgreSQL's 63-byte names.
fn validate_schema(schema: &str) -> Result<(), String> {
    let ok = !schema.is_empty()
        && schema.len() <= 48
        && schema
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && schema
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "--pg-schema {schema:?}: use 1 to 48 characters of a-z 0-9 _, not starting with a digit"
        ))
    }
}

/// Removes the raw `key=value` pairs of `keys` from a URL's query, keeping
/// every other byte as it was. Returns the URL and the removed values.
fn strip_query(url: &str, keys: &[&str]) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), Vec::new());
    };
    let mut kept = Vec::new();
    let mut removed = Vec::new();
    for pair in query.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if keys.contains(&key) {
            removed.push((key.to_owned(), value.to_owned()));
        } else {
            kept.push(pair);
        }
    }
    if kept.is_empty() {
        (base.to_owned(), removed)
    } else {
        (format!("{base}?{}", kept.join("&")), removed)
    }
}

/// A hand-written lock table (`--legacy-table`): `[schema.]table[(name_column[, time_column])]`.
#[derive(Debug, Clone)]
struct LegacyTable {
    table: String,
    name_column: Option<String>,
    time_column: Option<String>,
}

impl LegacyTable {
    fn parse(spec: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "--legacy-table {spec:?}: use [schema.]table or [schema.]table(name_column[, time_column]) with plain identifiers"
            )
        };
        let ident = |s: &str| {
            let s = s.trim();
            let ok = s
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$');
            ok.then(|| s.to_owned())
        };
        let (table, columns) = match spec.trim().split_once('(') {
            Some((table, rest)) => (table, Some(rest.strip_suffix(')').ok_or_else(bad)?)),
            None => (spec.trim(), None),
        };
        let parts: Vec<&str> = table.trim().split('.').collect();
        if parts.is_empty() || parts.len() > 2 || parts.iter().any(|p| ident(p).is_none()) {
            return Err(bad());
        }
        let (name_column, time_column) = match columns {
            None => (None, None),
            Some(columns) => {
                let columns: Vec<&str> = columns.split(',').collect();
                if columns.len() > 2 {
                    return Err(bad());
                }
                let name = ident(columns[0]).ok_or_else(bad)?;
                let time = match columns.get(1) {
                    Some(c) => Some(ident(c).ok_or_else(bad)?),
                    None => None,
                };
                (Some(name), time)
            }
        };
        Ok(Self {
            table: table.trim().to_owned(),
            name_column,
            time_column,
        })
    }
}

/// One column of the legacy table, from the catalog.
struct Column {
    name: String,
    ty: String,
    unique: bool,
}

fn is_text_type(ty: &str) -> bool {
    ty == "text" || ty == "name" || ty == "citext" || ty.starts_with("character")
}

fn is_time_type(ty: &str) -> bool {
    ty.starts_with("timestamp") || ty == "date"
}

/// `acquire`'s answer.
#[derive(Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
enum AcquireReply {
    Granted(GrantedReply),
    Busy(BusyReply),
    LimitMismatch { active: u32 },
    LimitRequired,
}

#[derive(Deserialize)]
struct GrantedReply {
    token: String,
    fence: u64,
    count: u32,
    since_ms: i64,
    expires_at_ms: i64,
}

#[derive(Deserialize)]
struct BusyReply {
    holders: Vec<HolderRow>,
    queue_length: usize,
    position: Option<usize>,
    seq: Option<u64>,
    retry_at_ms: Option<i64>,
    now_ms: i64,
}

#[derive(Deserialize)]
struct HolderRow {
    owner: String,
    sidecar: String,
    mode: Mode,
    since_ms: i64,
    expires_at_ms: i64,
    fence: u64,
    count: u32,
}

#[derive(Deserialize)]
struct WaiterRow {
    owner: String,
    sidecar: String,
    mode: Mode,
    since_ms: i64,
}

#[derive(Deserialize)]
struct RenewReply {
    expires_at_ms: i64,
}

#[derive(Deserialize)]
struct InspectReply {
    fence: u64,
    permits: Option<u32>,
    holders: Vec<HolderRow>,
    waiters: Vec<WaiterRow>,
}

impl Inner {
    /// A database time as this process's Unix milliseconds. The offset is
    /// measured so that converted times are never later than the moment the
    /// database reads its clock, as seen here.
    fn local(&self, db_ms: i64) -> u64 {
        let offset = self.offset_ms.load(Ordering::Relaxed);
        u64::try_from(db_ms.saturating_add(offset)).unwrap_or(0)
    }

    /// Takes a re-measured clock offset when it differs by more than
    /// [`OFFSET_SLACK_MS`] (the database's clock moved, or another server took
    /// over); smaller differences are measurement noise, and keeping the
    /// offset keeps the times reported for one lease consistent.
    fn adopt_offset(&self, measured: i64) {
        let current = self.offset_ms.load(Ordering::Relaxed);
        if (measured - current).abs() > OFFSET_SLACK_MS {
            tracing::info!(
                from_ms = current,
                to_ms = measured,
                "the database clock moved against ours; adopting the new offset"
            );
            self.offset_ms.store(measured, Ordering::Relaxed);
        }
    }

    /// A database deadline as a local moment that is never early: the time
    /// left, counted from now (after the answer arrived), plus 1 ms.
    fn local_deadline(&self, at_db: i64, now_db: i64) -> u64 {
        now_ms() + u64::try_from(at_db.saturating_sub(now_db)).unwrap_or(0) + 1
    }

    fn holder(&self, kind: Kind, h: HolderRow) -> Holder {
        Holder {
            owner: h.owner,
            sidecar: h.sidecar,
            mode: Held::of(kind, h.mode),
            since_ms: self.local(h.since_ms),
            expires_at_ms: self.local(h.expires_at_ms),
            fence: h.fence,
            count: h.count,
        }
    }

    fn tickets(&self) -> std::sync::MutexGuard<'_, Tickets> {
        self.tickets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends one heartbeat on `client` (see `heartbeat` in the SQL).
    async fn heartbeat(
        &self,
        client: &tokio_postgres::Client,
        statement: &tokio_postgres::Statement,
    ) -> Result<(), tokio_postgres::Error> {
        let as_i64 = |set: &HashSet<u64>| -> Vec<i64> {
            set.iter().filter_map(|&s| i64::try_from(s).ok()).collect()
        };
        let (live, gone) = {
            let t = self.tickets();
            (as_i64(&t.live), as_i64(&t.gone))
        };
        let params: [&(dyn ToSql + Sync); 6] = [
            &self.instance,
            &self.sidecar,
            &ms_i64(LAPSE_AFTER),
            &live,
            &gone,
            &ms_i64(GHOST_AFTER),
        ];
        client.query_one(statement, &params).await?;
        let mut t = self.tickets();
        for seq in gone {
            t.gone.remove(&u64::try_from(seq).unwrap_or(0));
        }
        Ok(())
    }

    fn not_ready(&self, op: &'static str) -> Option<Error> {
        (!*self.ready.borrow()).then(|| Error::Unavailable {
            op,
            source: Outage::boxed(
                *self
                    .setup_failure
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
                format!(
                    "PostgreSQL has not been reachable since start-up, so schema {:?} is not set up yet",
                    self.schema
                ),
            ),
        })
    }

    /// Remembers why setting the schema up failed, for [`Inner::not_ready`].
    fn setup_failed(&self, f: &Failure) {
        *self
            .setup_failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Cause::of(f.source.as_ref());
    }

    /// Runs one statement on a pooled connection, within [`OP_TIMEOUT`],
    /// again after a serialization failure or deadlock.
    async fn rows(
        &self,
        op: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, Error> {
        if let Some(e) = self.not_ready(op) {
            return Err(e);
        }
        let mut tries = 0;
        loop {
            tries += 1;
            // Lease upkeep has connections of its own.
            let pool = match op {
                "renew" | "release" | "status" => &self.upkeep,
                _ => &self.pool,
            };
            let run = async {
                let client = self.connection(pool).await?;
                let query = async {
                    let statement = client.prepare_cached(sql).await?;
                    Ok::<_, Failure>(client.query(&statement, params).await?)
                };
                tokio::time::timeout(OP_TIMEOUT, query)
                    .await
                    .unwrap_or_else(|_| Err(Failure::timeout(op)))
            };
            match run.await {
                Ok(rows) => {
                    self.progress_ms.store(now_ms(), Ordering::Relaxed);
                    if !*self.listening.borrow() {
                        self.reconnect.notify_one();
                    }
                    return Ok(rows);
                }
                Err(f) if f.class == Class::Retry && tries < 3 => continue,
                Err(f) => return Err(f.into_error(op)),
            }
        }
    }

    /// A pooled connection. Waiting for one fails after [`POOL_TIMEOUT`] in
    /// an outage, but goes on (up to [`BUSY_POOL_TIMEOUT`]) while statements
    /// on the pool's other connections keep succeeding.
    async fn connection(&self, pool: &Pool) -> Result<Object, Failure> {
        let started = tokio::time::Instant::now();
        // Kept across the checks below, so the request keeps its place in
        // the pool's FIFO queue.
        let get = pool.get();
        tokio::pin!(get);
        loop {
            tokio::select! {
                got = &mut get => return Ok(got?),
                () = tokio::time::sleep(POOL_TIMEOUT) => {}
            }
            let idle_ms = now_ms().saturating_sub(self.progress_ms.load(Ordering::Relaxed));
            if idle_ms >= ms(POOL_TIMEOUT) || started.elapsed() >= BUSY_POOL_TIMEOUT {
                return Err(PoolError::Timeout(TimeoutType::Wait).into());
            }
        }
    }

    /// The first column of the one row a function call returns.
    async fn value<T>(
        &self,
        op: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<T, Error>
    where
        T: for<'a> tokio_postgres::types::FromSql<'a>,
    {
        let rows = self.rows(op, sql, params).await?;
        let row = rows.first().ok_or_else(|| Error::Unavailable {
            op,
            source: "the function returned no row".into(),
        })?;
        row.try_get(0).map_err(|e| Failure::from(e).into_error(op))
    }

    /// A function's JSON answer (`NULL` as `None`).
    async fn json<T: for<'de> Deserialize<'de>>(
        &self,
        op: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<T>, Error> {
        let text: Option<String> = self.value(op, sql, params).await?;
        text.map(|t| {
            serde_json::from_str(&t).map_err(|e| Error::Unavailable {
                op,
                source: format!("unexpected answer {t:?}: {e}").into(),
            })
        })
        .transpose()
    }

    /// Creates or migrates the schema, measures the clock offset and registers
    /// this sidecar. Safe when several sidecars do it at once.
    async fn setup(&self) -> Result<(), Failure> {
        let mut client = self.connection(&self.pool).await?;
        self.migrate(&mut client).await?;
        let offset = measure_offset(&client).await?;
        self.offset_ms.store(offset, Ordering::Relaxed);
        let statement = client.prepare_cached(&self.sql.heartbeat).await?;
        self.heartbeat(&client, &statement).await?;
        self.ready.send_replace(true);
        Ok(())
    }

    async fn migrate(&self, client: &mut Object) -> Result<(), Failure> {
        let s = quote_ident(&self.schema);
        let tx = client.transaction().await?;
        // Serialises sidecars migrating the same schema; released at commit.
        tx.execute(
            "SELECT 1 FROM pg_advisory_xact_lock(hashtext('sidelock'), hashtext($1))",
            &[&self.schema],
        )
        .await?;
        tx.batch_execute(&format!(
            "SET LOCAL client_min_messages = warning;
             CREATE SCHEMA IF NOT EXISTS {s};
             CREATE TABLE IF NOT EXISTS {s}.schema_migrations (
                 version     integer PRIMARY KEY,
                 description text NOT NULL,
                 applied_at  timestamptz NOT NULL DEFAULT now())"
        ))
        .await?;
        let current: i32 = tx
            .query_one(
                &format!("SELECT coalesce(max(version), 0) FROM {s}.schema_migrations"),
                &[],
            )
            .await?
            .get(0);
        let channel = quote_literal(&self.channel);
        for m in MIGRATIONS.iter().filter(|m| m.version > current) {
            let sql = m.sql.replace("{s}", &s).replace("{channel}", &channel);
            tx.batch_execute(&sql).await?;
            tx.execute(
                &format!(
                    "INSERT INTO {s}.schema_migrations (version, description) VALUES ($1, $2)"
                ),
                &[&m.version, &m.description],
            )
            .await?;
            tracing::info!(schema = %self.schema, version = m.version, "applied PostgreSQL migration");
        }
        let latest = MIGRATIONS.last().map_or(0, |m| m.version);
        if current > latest {
            tracing::warn!(
                schema = %self.schema,
                version = current,
                known = latest,
                "the PostgreSQL schema is newer than this sidelock; running on it unchanged"
            );
        }
        tx.commit().await?;
        Ok(())
    }

    /// Background task: sets the schema up if start-up could not, then keeps
    /// the LISTEN connection (and with it the heartbeat) alive.
    async fn run(self: Arc<Self>) {
        let mut backoff = MIN_BACKOFF;
        while !self.stop.is_cancelled() {
            if !*self.ready.borrow() {
                match self.setup().await {
                    Ok(()) => {
                        tracing::info!(schema = %self.schema, "PostgreSQL is reachable; schema ready")
                    }
                    Err(f) => {
                        // The sidecar's health check warns once per outage.
                        self.setup_failed(&f);
                        tracing::debug!(error = %f.describe(), "PostgreSQL is not reachable; retrying");
                        self.pause(&mut backoff).await;
                        continue;
                    }
                }
            }
            match tokio::time::timeout(OP_TIMEOUT, self.connect_listener()).await {
                Ok(Ok((client, notifications))) => {
                    backoff = MIN_BACKOFF;
                    self.listen(client, notifications).await;
                }
                Ok(Err(f)) => {
                    tracing::warn!(error = %f.describe(), "cannot LISTEN on PostgreSQL; retrying");
                }
                Err(_) => tracing::warn!("connecting the LISTEN connection timed out; retrying"),
            }
            self.pause(&mut backoff).await;
        }
    }

    /// Waits before the next connection attempt: `backoff` (doubling up to
    /// [`MAX_BACKOFF`]), or [`MIN_BACKOFF`] once a pooled call shows the
    /// database is back.
    async fn pause(&self, backoff: &mut Duration) {
        let started = tokio::time::Instant::now();
        tokio::select! {
            () = tokio::time::sleep(*backoff) => {}
            () = self.reconnect.notified() => {
                tokio::time::sleep_until(started + MIN_BACKOFF).await;
            }
            () = self.stop.cancelled() => {}
        }
        *backoff = (*backoff * 2).min(MAX_BACKOFF);
    }

    /// Opens the dedicated LISTEN connection; its notifications arrive on the channel,
    /// which closes when the connection ends.
    async fn connect_listener(
        &self,
    ) -> Result<(tokio_postgres::Client, mpsc::UnboundedReceiver<String>), Failure> {
        let (client, mut connection) = self.listen_config.connect(NoTls).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(n)) => {
                        if tx.send(n.payload().to_owned()).is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %chain(&e), "the LISTEN connection ended");
                        return;
                    }
                }
            }
        });
        client
            .batch_execute(&format!("LISTEN {}", quote_ident(&self.channel)))
            .await?;
        Ok((client, rx))
    }

    /// Delivers notifications and sends heartbeats until the connection fails.
    async fn listen(
        &self,
        client: tokio_postgres::Client,
        mut notifications: mpsc::UnboundedReceiver<String>,
    ) {
        let beat = match client.prepare(&self.sql.heartbeat).await {
            Ok(statement) => statement,
            Err(e) => {
                tracing::warn!(error = %chain(&e), "cannot prepare the heartbeat");
                return;
            }
        };
        match measure_offset(&client).await {
            Ok(offset) => self.adopt_offset(offset),
            Err(e) => {
                tracing::warn!(error = %chain(&e), "cannot read the database clock");
                return;
            }
        }
        self.listening.send_replace(true);
        tracing::debug!(channel = %self.channel, "listening for wake-ups");
        // Releases made while this connection was down were not heard: let
        // every local queue head look again.
        for key in self.wakeups.keys() {
            self.wakeups.wake(&key);
        }
        let mut ticker = tokio::time::interval(HEARTBEAT_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = self.stop.cancelled() => break,
                payload = notifications.recv() => match payload {
                    Some(payload) => match LockKey::parse(&payload) {
                        Some(key) => self.wakeups.wake(&key),
                        None => tracing::debug!(payload, "ignoring a foreign notification"),
                    },
                    None => {
                        tracing::warn!("lost the LISTEN connection to PostgreSQL; reconnecting");
                        break;
                    }
                },
                _ = ticker.tick() => {
                    match tokio::time::timeout(OP_TIMEOUT, self.heartbeat(&client, &beat)).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => {
                            tracing::warn!(error = %chain(&e), "heartbeat failed; reconnecting");
                            break;
                        }
                        Err(_) => {
                            tracing::warn!("heartbeat timed out; reconnecting");
                            break;
                        }
                    }
                }
            }
        }
        self.listening.send_replace(false);
    }

    /// Rows of the `--legacy-table`, all without expiry.
    async fn legacy_stale(&self, legacy: &LegacyTable) -> Result<Vec<StaleKey>, Error> {
        const COLUMNS: &str = "
            SELECT c.oid::regclass::text, a.attname::text, format_type(a.atttypid, a.atttypmod),
                   EXISTS (SELECT 1 FROM pg_index i
                            WHERE i.indrelid = c.oid AND i.indisunique AND i.indnatts = 1
                              AND i.indkey[0] = a.attnum)
              FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
             WHERE c.oid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
             ORDER BY a.attnum";
        let rows = self.rows("stale", COLUMNS, &[&legacy.table]).await?;
        let Some(table) = rows.first().map(|r| r.get::<_, String>(0)) else {
            tracing::warn!(table = %legacy.table, "--legacy-table names no table; skipping it");
            return Ok(Vec::new());
        };
        let columns: Vec<Column> = rows
            .iter()
            .map(|r| Column {
                name: r.get(1),
                ty: r.get(2),
                unique: r.get(3),
            })
            .collect();
        let find = |wanted: &Option<String>| {
            wanted
                .as_ref()
                .and_then(|w| columns.iter().find(|c| &c.name == w))
        };
        let name_column = match &legacy.name_column {
            Some(_) => find(&legacy.name_column),
            None => columns
                .iter()
                .find(|c| c.unique && is_text_type(&c.ty))
                .or_else(|| columns.iter().find(|c| is_text_type(&c.ty))),
        };
        let Some(name_column) = name_column else {
            tracing::warn!(%table, "--legacy-table: no lock-name column found; name it as table(column)");
            return Ok(Vec::new());
        };
        let time_column = match &legacy.time_column {
            Some(_) => find(&legacy.time_column),
            None => columns.iter().find(|c| is_time_type(&c.ty)),
        };
        let age = match time_column {
            Some(c) => format!(
                "floor(extract(epoch FROM (clock_timestamp() - {}::timestamptz)) * 1000)::bigint",
                quote_ident(&c.name)
            ),
            None => "NULL::bigint".to_owned(),
        };
        let sql = format!(
            "SELECT {}::text, {age} FROM {table} LIMIT {STALE_LIMIT}",
            quote_ident(&name_column.name)
        );
        let rows = self.rows("stale", &sql, &[]).await?;
        Ok(rows
            .iter()
            .map(|r| {
                let name: Option<String> = r.get(0);
                let name = name.unwrap_or_default();
                let age: Option<i64> = r.get(1);
                let since = match (time_column, age) {
                    (Some(c), Some(age)) => format!(
                        "; column {} says it was taken {} ago",
                        c.name,
                        humantime::format_duration(Duration::from_millis(age.max(0) as u64))
                    ),
                    _ => String::new(),
                };
                StaleKey {
                    key: format!("{table}/{name}"),
                    reason: super::StaleReason::NoExpiry,
                    age_ms: age.map_or(0, |a| a.max(0) as u64),
                    detail: format!(
                        "row {name:?} of the hand-written lock table {table} has no expiry: \
                         nothing frees it but a DELETE{since}"
                    ),
                }
            })
            .collect())
    }
}

/// Local clock minus database clock, in ms, measured so it errs towards
/// making database times look early here (never late): the best of three
/// probes, each taking the local time before the query was sent.
async fn measure_offset(client: &tokio_postgres::Client) -> Result<i64, tokio_postgres::Error> {
    let mut best = i64::MIN;
    for _ in 0..3 {
        let before = i64::try_from(now_ms()).unwrap_or(i64::MAX);
        let db: i64 = client.query_one(NOW_SQL, &[]).await?.get(0);
        best = best.max(before - db);
    }
    Ok(best - 1)
}

impl Postgres {
    /// Connects, creates or migrates the schema, and starts the LISTEN
    /// connection. When PostgreSQL cannot be reached yet, the sidecar starts
    /// anyway and answers 503 (and `/readyz` fails) until it can.
    ///
    /// # Errors
    /// A sentence for the operator when the URL or a setting is malformed, or
    /// PostgreSQL refuses the schema (authentication, permissions).
    pub async fn open(url: &str, options: &Options, wakeups: Wakeups) -> Result<Self, String> {
        let schema = options.pg_schema.clone();
        validate_schema(&schema)?;
        let legacy = options
            .legacy_table
            .as_deref()
            .map(LegacyTable::parse)
            .transpose()?;
        let (driver_url, ours) = strip_query(url, &["pool_max_size"]);
        let pool_size = match ours.last() {
            Some((_, n)) => n.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
                format!("backend URL: pool_max_size={n:?} is not a positive number")
            })?,
            None => DEFAULT_POOL_SIZE,
        };
        let mut config: tokio_postgres::Config = driver_url
            .parse()
            .map_err(|e| format!("backend URL {:?}: {}", super::redact(url), chain(&e)))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(POOL_TIMEOUT);
        }
        if config.get_tcp_user_timeout().is_none() {
            // Unacknowledged writes to a vanished server fail within this.
            config.tcp_user_timeout(Duration::from_secs(10));
        }
        if config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
            // The idle LISTEN connection notices a vanished server within ~15 s.
            config.keepalives_idle(Duration::from_secs(5));
            config.keepalives_interval(Duration::from_secs(2));
            config.keepalives_retries(5);
        }
        let app = config
            .get_application_name()
            .map_or_else(|| format!("sidelock {}", options.sidecar), str::to_owned);
        config.application_name(&app);
        let mut listen_config = config.clone();
        listen_config.application_name(format!("{app} listen"));

        let build = |size: usize| {
            let manager = Manager::from_config(
                config.clone(),
                NoTls,
                ManagerConfig {
                    recycling_method: RecyclingMethod::Fast,
                },
            );
            Pool::builder(manager)
                .max_size(size)
                // `connection()` bounds the wait, telling a busy pool from a dead one.
                .wait_timeout(None)
                .create_timeout(Some(POOL_TIMEOUT))
                .recycle_timeout(Some(POOL_TIMEOUT))
                .runtime(Runtime::Tokio1)
                .build()
                .map_err(|e| format!("PostgreSQL connection pool: {e}"))
        };
        let pool = build(pool_size)?;
        let upkeep = build(UPKEEP_POOL_SIZE)?;
        let instance = Token::generate().expose()[..16].to_owned();
        let inner = Arc::new(Inner {
            pool,
            upkeep,
            listen_config,
            sql: Sql::new(&schema),
            channel: format!("{schema}_wake"),
            schema: schema.clone(),
            instance,
            sidecar: options.sidecar.clone(),
            url: super::redact(url),
            legacy,
            wakeups,
            ready: watch::channel(false).0,
            setup_failure: std::sync::Mutex::new(Cause::TimedOut),
            listening: watch::channel(false).0,
            reconnect: Notify::new(),
            offset_ms: AtomicI64::new(0),
            progress_ms: AtomicU64::new(0),
            tickets: Mutex::default(),
            stop: CancellationToken::new(),
        });
        match tokio::time::timeout(Duration::from_secs(15), inner.setup()).await {
            Ok(Ok(())) => {}
            Ok(Err(f)) if f.class == Class::Fatal => {
                return Err(format!(
                    "PostgreSQL backend {}: cannot set up schema {schema:?}: {}",
                    inner.url,
                    f.describe()
                ));
            }
            Ok(Err(f)) => {
                inner.setup_failed(&f);
                tracing::debug!(
                    error = %f.describe(),
                    "PostgreSQL is not reachable; answering 503 until it is"
                );
            }
            Err(_) => {
                tracing::warn!("setting up PostgreSQL timed out; answering 503 until it works")
            }
        }
        tokio::spawn(inner.clone().run());
        Ok(Self { inner })
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
            kind: super::BackendKind::Postgres,
            url: self.inner.url.clone(),
            safety: Safety::Correctness,
        }
    }

    async fn ping(&self) -> Result<(), Error> {
        self.inner.rows("ping", "SELECT 1", &[]).await.map(|_| ())
    }

    async fn try_acquire(&self, claim: &Claim, turn: Turn<'_>) -> Result<Attempt, Error> {
        let inner = &self.inner;
        let token = Token::generate();
        let (turn_name, seq) = match turn {
            Turn::Once => ("once", None),
            Turn::Join => ("join", None),
            Turn::Queued(ticket) => ("queued", i64::try_from(ticket.seq).ok()),
        };
        let limit = claim.limit.map(|l| i32::try_from(l).unwrap_or(i32::MAX));
        let reply: Option<AcquireReply> = inner
            .json(
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
                    &turn_name,
                    &seq,
                    &ms_i64(LAPSE_AFTER),
                ],
            )
            .await?;
        let reply = reply.ok_or_else(|| Error::Unavailable {
            op: "try_acquire",
            source: "acquire returned NULL".into(),
        })?;
        match (&reply, turn) {
            (AcquireReply::Busy(b), _) => {
                if let Some(seq) = b.seq {
                    inner.tickets().live.insert(seq);
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
        }
    }

    async fn dequeue(&self, ticket: &Ticket) -> Result<(), Error> {
        let inner = &self.inner;
        inner.tickets().live.remove(&ticket.seq);
        let seq = i64::try_from(ticket.seq).unwrap_or(i64::MAX);
        let result: Result<bool, Error> = inner.value("dequeue", &inner.sql.dequeue, &[&seq]).await;
        if result.is_err() {
            // The row must not stay at the head of the queue: the heartbeat
            // removes it once the database is back.
            inner.tickets().gone.insert(ticket.seq);
        }
        result.map(|_| ())
    }

    async fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, Error> {
        let inner = &self.inner;
        let reply: Option<RenewReply> = inner
            .json(
                "renew",
                &inner.sql.renew,
                &[
                    &key.kind.as_str(),
                    &key.name.as_str(),
                    &token.expose(),
                    &ttl.map(ms_i64),
                ],
            )
            .await?;
        Ok(reply.map(|r| inner.local(r.expires_at_ms)))
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, Error> {
        let remaining: Option<i32> = self
            .inner
            .value(
                "release",
                &self.inner.sql.release,
                &[&key.kind.as_str(), &key.name.as_str(), &token.expose()],
            )
            .await?;
        Ok(remaining.map(|n| u32::try_from(n).unwrap_or(0)))
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
        Ok(match rows.first() {
            Some(row) => Status::Held {
                expires_at_ms: self.inner.local(row.get(0)),
            },
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
                        super::StaleReason::HeldTooLong,
                        format!(
                            "held by owner {owner:?} on sidecar {sidecar:?} with fence {} for longer than {} (row in {})",
                            fence.unwrap_or(0),
                            humantime::format_duration(stale_after),
                            table("leases")
                        ),
                    ),
                    "expired-not-cleaned" => (
                        super::StaleReason::ExpiredNotCleaned,
                        format!(
                            "the lease of owner {owner:?} (sidecar {sidecar:?}, fence {}) expired {age} ago and its row is still in {}; it counts as free",
                            fence.unwrap_or(0),
                            table("leases")
                        ),
                    ),
                    "orphaned-waiter" => (
                        super::StaleReason::OrphanedWaiter,
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

    async fn watch(&self, _key: &LockKey) -> Result<Watch, Error> {
        // One LISTEN covers every key. Once it is up, a release cannot be
        // missed; if it is down, its reconnection wakes every local waiter.
        let mut listening = self.inner.listening.subscribe();
        let _ = tokio::time::timeout(LISTEN_WAIT, listening.wait_for(|up| *up)).await;
        Ok(Box::new(()))
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
    use super::*;

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
