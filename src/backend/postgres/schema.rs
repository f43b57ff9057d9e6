//! The schema: migrations under an advisory lock, and the hand-written lock
//! table (`--legacy-table`) whose rows `/v1/stale` lists.

use std::sync::atomic::Ordering;
use std::time::Duration;

use deadpool_postgres::Object;

use crate::backend::{Error, StaleKey};

use super::errors::{Class, Failure};
use super::listener::measure_offset;
use super::sql::{quote_ident, quote_literal};
use super::{Inner, MIGRATIONS, STALE_LIMIT};

/// A hand-written lock table (`--legacy-table`): `[schema.]table[(name_column[, time_column])]`.
#[derive(Debug, Clone)]
pub(super) struct LegacyTable {
    pub(super) table: String,
    pub(super) name_column: Option<String>,
    pub(super) time_column: Option<String>,
}

impl LegacyTable {
    pub(super) fn parse(spec: &str) -> Result<Self, String> {
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
pub(super) struct Column {
    pub(super) name: String,
    pub(super) ty: String,
    pub(super) unique: bool,
}

pub(super) fn is_text_type(ty: &str) -> bool {
    ty == "text" || ty == "name" || ty == "citext" || ty.starts_with("character")
}

pub(super) fn is_time_type(ty: &str) -> bool {
    ty.starts_with("timestamp") || ty == "date"
}

impl Inner {
    /// Creates or migrates the schema, measures the clock offset and registers
    /// this sidecar. Safe when several sidecars do it at once.
    pub(super) async fn setup(&self) -> Result<(), Failure> {
        let mut client = self.connection(&self.pool).await?;
        // Owners and values are any Unicode text: a database of another
        // encoding cannot store some of them (each such request would fail
        // as if the database were down), nor the schema's own text.
        let encoding: String = client.query_one("SHOW server_encoding", &[]).await?.get(0);
        if encoding != "UTF8" {
            return Err(Failure {
                class: Class::Fatal,
                source: format!(
                    "the database's encoding is {encoding}; sidelock stores owners and values \
                     as Unicode text: use a database created with ENCODING 'UTF8'"
                )
                .into(),
            });
        }
        self.migrate(&mut client).await?;
        let offset = measure_offset(&client).await?;
        self.offset_ms.store(offset, Ordering::Relaxed);
        let statement = client.prepare_cached(&self.sql.heartbeat).await?;
        self.heartbeat(&client, &statement).await?;
        self.ready.send_replace(true);
        Ok(())
    }

    pub(super) async fn migrate(&self, client: &mut Object) -> Result<(), Failure> {
        let s = quote_ident(&self.schema);
        let tx = client.transaction().await?;
        // Serialises sidecars migrating the same schema; released at commit.
        tx.execute(
            "SELECT 1 FROM pg_advisory_xact_lock(hashtext('sidelock'), hashtext($1))",
            &[&self.schema],
        )
        .await?;
        // Only what is missing: PostgreSQL checks `CREATE` on the database
        // before it reads `IF NOT EXISTS`, and a role without it may run on
        // a schema an administrator made for it.
        let found = tx
            .query_one(
                "SELECT to_regnamespace($1) IS NOT NULL, to_regclass($2) IS NOT NULL",
                &[&s, &format!("{s}.schema_migrations")],
            )
            .await?;
        let (has_schema, has_table): (bool, bool) = (found.get(0), found.get(1));
        // The DDL waits for table locks as the database or role says, not
        // as long as a claim waits for a row lock (SESSION_SETUP): an
        // `ALTER TABLE` queued behind a long transaction would hold up
        // every claim queued behind it.
        let mut create = String::from(
            "SET LOCAL client_min_messages = warning; SET LOCAL lock_timeout TO DEFAULT;",
        );
        if !has_schema {
            create.push_str(&format!("CREATE SCHEMA IF NOT EXISTS {s};"));
        }
        if !has_table {
            create.push_str(&format!(
                "CREATE TABLE IF NOT EXISTS {s}.schema_migrations (
                     version     integer PRIMARY KEY,
                     description text NOT NULL,
                     applied_at  timestamptz NOT NULL DEFAULT now());"
            ));
        }
        tx.batch_execute(&create).await?;
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
}

impl Inner {
    /// Rows of the `--legacy-table`, all without expiry.
    pub(super) async fn legacy_stale(&self, legacy: &LegacyTable) -> Result<Vec<StaleKey>, Error> {
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
        // A time of `infinity` or `-infinity` (hand-written tables use them
        // for "never" and "always") has no age: subtracting it fails.
        let age = match time_column {
            Some(c) => format!(
                "CASE WHEN isfinite({col}::timestamptz) THEN floor(extract(epoch FROM \
                 (clock_timestamp() - {col}::timestamptz)) * 1000)::bigint END",
                col = quote_ident(&c.name)
            ),
            None => "NULL::bigint".to_owned(),
        };
        let sql = format!(
            "SELECT {}::text, {age} FROM {table} ORDER BY 2 DESC NULLS LAST LIMIT {STALE_LIMIT}",
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
                    reason: crate::backend::StaleReason::NoExpiry,
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
