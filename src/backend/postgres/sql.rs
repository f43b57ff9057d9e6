//! The statements, with the schema filled in, and the rows and JSON replies
//! the functions return.

use std::time::Duration;

use serde::Deserialize;

use crate::clock::ms;
use crate::lock::{Kind, Mode};

/// The statements, with the schema filled in.
pub(super) struct Sql {
    pub(super) acquire: String,
    pub(super) dequeue: String,
    pub(super) renew: String,
    pub(super) renew_many: String,
    pub(super) release: String,
    pub(super) status: String,
    pub(super) inspect: String,
    pub(super) list: String,
    pub(super) stale: String,
    pub(super) force_release: String,
    pub(super) heartbeat: String,
    pub(super) leave: String,
    pub(super) rejoin: String,
    pub(super) announce: String,
}

impl Sql {
    pub(super) fn new(schema: &str) -> Self {
        let s = quote_ident(schema);
        let fill = |template: &str| template.replace("{DB_NOW}", DB_NOW).replace("{s}", &s);
        Self {
            acquire: fill(
                "SELECT {s}.acquire($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)::text, \
                 {DB_NOW}",
            ),
            dequeue: fill("SELECT {s}.dequeue($1, $2, $3)"),
            renew: fill("SELECT {s}.renew($1, $2, $3, $4)::text, {DB_NOW}"),
            renew_many: fill(
                "SELECT i, expires_at_ms, {DB_NOW} FROM {s}.renew_many($1, $2, $3, $4)",
            ),
            // A statement of its own: a release that hands nothing over may
            // commit without its WAL flush (schema version 10).
            release: fill("SELECT {s}.release($1, $2, $3, $4, true)"),
            // A lease's expiry while it holds; else NULL if a force-release
            // removed it (no row: gone).
            status: fill(
                "SELECT {s}.ms(expires_at), {DB_NOW} FROM {s}.leases \
                 WHERE token = $1 AND kind = $2 AND name = $3 AND expires_at > clock_timestamp() \
                 UNION ALL SELECT NULL, {DB_NOW} FROM {s}.forced WHERE token = $1",
            ),
            inspect: fill("SELECT {s}.inspect($1, $2, $3)::text, {DB_NOW}"),
            list: fill(LIST_SQL),
            stale: fill(STALE_SQL),
            force_release: fill("SELECT {s}.force_release($1, $2)::text"),
            heartbeat: fill("SELECT {s}.heartbeat($1, $2, $3, $4, $5, $6)::text, {DB_NOW}"),
            leave: fill("SELECT 1 FROM {s}.leave($1)"),
            rejoin: fill(REJOIN_SQL),
            announce: fill("SELECT {s}.wake($1, $2)"),
        }
    }
}

/// The columns by which a statement reads the database's clock for
/// [`Inner::settle_offset`](super::Inner::settle_offset): when the statement
/// arrived, as close as the database can tell to when it was sent, and
/// when it ended (after the call before it in the select list).
pub(super) const DB_NOW: &str =
    "{s}.ms(statement_timestamp()) AS db_now, {s}.ms(clock_timestamp()) AS db_end";

/// Puts back this sidecar's waiter rows that are gone, each at its own
/// ticket (`seq`), under the keys' row locks (taken in one order, as a
/// release or an acquire takes its key's): not a row whose ticket is
/// there, nor one whose token holds a lease (handed to it meanwhile).
/// `$1` the instance; then one array per column: `$2` seq, `$3` kind, `$4`
/// name, `$5` mode, `$6` owner, `$7` sidecar, `$8` token, `$9` ttl ms,
/// `$10` max_hold ms, `$11` lock-delay ms. Returns the seqs put back.
pub(super) const REJOIN_SQL: &str = "
WITH t AS (
    SELECT * FROM unnest($2::bigint[], $3::text[], $4::text[], $5::text[], $6::text[],
                         $7::text[], $8::text[], $9::bigint[], $10::bigint[], $11::bigint[])
        AS t(seq, kind, name, mode, owner, sidecar, token, ttl_ms, max_hold_ms, lock_delay_ms)
),
locked AS (
    SELECT k.kind, k.name FROM {s}.keys k
     WHERE (k.kind, k.name) IN (SELECT kind, name FROM t)
     ORDER BY k.kind, k.name
       FOR NO KEY UPDATE
)
INSERT INTO {s}.waiters (seq, kind, name, owner, sidecar, instance, mode, queued_at,
                         token, ttl_ms, max_hold_ms, lock_delay_ms)
SELECT t.seq, t.kind, t.name, t.owner, t.sidecar, $1, t.mode, clock_timestamp(),
       t.token, t.ttl_ms, t.max_hold_ms, t.lock_delay_ms
  FROM t JOIN locked l ON l.kind = t.kind AND l.name = t.name
 WHERE NOT EXISTS (SELECT 1 FROM {s}.waiters w WHERE w.seq = t.seq)
   AND NOT EXISTS (SELECT 1 FROM {s}.leases x WHERE x.token = t.token)
 ORDER BY t.seq
ON CONFLICT (seq) DO NOTHING
RETURNING seq";

/// Held or contended keys after a cursor: `$1` prefix, `$2`/`$3` the cursor's
/// kind and name (NULL for the first page), `$4` limit, `$5` lapse in ms.
pub(super) const LIST_SQL: &str = "
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

/// Stale rows of sidelock's own tables, the oldest first: `$1` stale-after
/// in ms, `$2` orphan threshold in ms, `$3` limit.
pub(super) const STALE_SQL: &str = "
WITH t AS (SELECT clock_timestamp() AS now)
SELECT * FROM (
    SELECT 'held-too-long' AS reason, l.kind, l.name, l.owner, l.sidecar, l.fence,
           {s}.ms(t.now) - {s}.ms(l.acquired_at) AS age_ms
      FROM {s}.leases l, t
     WHERE l.expires_at > t.now AND l.acquired_at < t.now - {s}.millis($1)
       AND l.kind <> 'election'
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
ORDER BY age_ms DESC, kind, name, reason
LIMIT $3";

/// Run first on every connection the sidecar opens, whatever the database,
/// role or server set as defaults (set per session, not as a startup
/// option, which poolers refuse):
/// - `read committed`: every function takes the key's row lock first and
///   must then see what the transaction before it committed; under
///   `repeatable read` or `serializable` its snapshot predates the lock and
///   a concurrent grant fails it with a serialization error;
/// - a commit waits for its WAL flush (`synchronous_commit` back `on` where
///   it is `off`; stronger settings stay): a grant answered is a grant a
///   crash keeps. The releases that may skip it say so themselves;
/// - no `lock_timeout`: a claim waits for a busy key's row lock as long as
///   it takes (a default a DBA set failed it as an outage, 503); the
///   upkeep connections set their own short one after this.
pub(super) const SESSION_SETUP: &str = "SELECT set_config('default_transaction_isolation', \
     'read committed', false), set_config('synchronous_commit', \
     CASE current_setting('synchronous_commit') WHEN 'off' THEN 'on' \
     ELSE current_setting('synchronous_commit') END, false), \
     set_config('lock_timeout', '0', false)";

/// The database clock in ms (works before the schema exists).
pub(super) const NOW_SQL: &str =
    "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

pub(super) fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

pub(super) fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

pub(super) fn parse_kind(kind: &str) -> Option<Kind> {
    match kind {
        "lock" => Some(Kind::Lock),
        "semaphore" => Some(Kind::Semaphore),
        "election" => Some(Kind::Election),
        _ => None,
    }
}

/// Milliseconds as the database's `bigint`.
pub(super) fn ms_i64(d: Duration) -> i64 {
    i64::try_from(ms(d)).unwrap_or(i64::MAX)
}

/// `acquire`'s answer.
#[derive(Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub(super) enum AcquireReply {
    Granted(GrantedReply),
    Busy(BusyReply),
    LimitMismatch {
        active: u32,
    },
    LimitRequired,
    /// A queued attempt run again could not tell what its first run did.
    Unsure,
}

#[derive(Deserialize)]
pub(super) struct GrantedReply {
    pub(super) token: String,
    pub(super) fence: u64,
    pub(super) count: u32,
    pub(super) since_ms: i64,
    pub(super) expires_at_ms: i64,
}

#[derive(Deserialize)]
pub(super) struct BusyReply {
    pub(super) holders: Vec<HolderRow>,
    pub(super) queue_length: usize,
    pub(super) position: Option<usize>,
    pub(super) seq: Option<u64>,
    pub(super) retry_at_ms: Option<i64>,
    pub(super) now_ms: i64,
}

#[derive(Deserialize)]
pub(super) struct HolderRow {
    pub(super) owner: String,
    pub(super) sidecar: String,
    pub(super) mode: Mode,
    pub(super) since_ms: i64,
    pub(super) expires_at_ms: i64,
    pub(super) fence: u64,
    pub(super) count: u32,
}

#[derive(Deserialize)]
pub(super) struct WaiterRow {
    pub(super) owner: String,
    pub(super) sidecar: String,
    pub(super) mode: Mode,
    pub(super) since_ms: i64,
}

#[derive(Deserialize)]
pub(super) struct RenewReply {
    pub(super) expires_at_ms: i64,
}

#[derive(Deserialize)]
pub(super) struct InspectReply {
    pub(super) fence: u64,
    pub(super) permits: Option<u32>,
    pub(super) holders: Vec<HolderRow>,
    pub(super) waiters: Vec<WaiterRow>,
}
