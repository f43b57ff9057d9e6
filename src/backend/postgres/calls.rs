//! Running statements: a pooled connection within a deadline, one
//! function call per operation, failures as 503s while the schema is not
//! ready, and database times mapped onto this process's clock.

use std::sync::atomic::{AtomicBool, Ordering};

use deadpool_postgres::{Object, Pool, PoolError, TimeoutType};
use serde::Deserialize;
use tokio_postgres::NoTls;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use crate::backend::{Cause, Error, Holder, Outage};
use crate::clock::{ms, now_ms};
use crate::lock::{Held, Kind};

use super::errors::{Class, Failure};
use super::sql::HolderRow;
use super::{
    BUSY_POOL_TIMEOUT, Inner, OFFSET_SLACK_MS, OFFSET_STEP_MS, OP_TIMEOUT, POOL_TIMEOUT, Tickets,
};

impl Inner {
    /// A database time as this process's Unix milliseconds. The offset is
    /// measured so that converted times are never later than the moment the
    /// database reads its clock, as seen here.
    pub(super) fn local(&self, db_ms: i64) -> u64 {
        let offset = self.offset_ms.load(Ordering::Relaxed);
        u64::try_from(db_ms.saturating_add(offset)).unwrap_or(0)
    }

    /// Takes a re-measured clock offset:
    /// - higher by more than [`OFFSET_SLACK_MS`] (the database's clock moved
    ///   back, or another server took over): at once;
    /// - lower by [`OFFSET_STEP_MS`] or more (the database's clock stepped
    ///   forward; times would read late): at once;
    /// - lower by less, but more than the slack: when the next measurement
    ///   is that low too (the higher of the two). One slow answer measures
    ///   low by its delay, and moving the offset with each would move the
    ///   times of one lease between its grant and its renewals (a hold
    ///   stream's `max_hold` check compares them).
    ///
    /// Smaller differences are measurement noise, and keeping the offset
    /// keeps the times reported for one lease consistent.
    pub(super) fn adopt_offset(&self, measured: i64) {
        let current = self.offset_ms.load(Ordering::Relaxed);
        let pending = self.offset_low_ms.swap(i64::MIN, Ordering::Relaxed);
        let take = if measured > current + OFFSET_SLACK_MS || measured <= current - OFFSET_STEP_MS {
            measured
        } else if measured < current - OFFSET_SLACK_MS {
            if pending == i64::MIN {
                self.offset_low_ms.store(measured, Ordering::Relaxed);
                return;
            }
            pending.max(measured)
        } else {
            return;
        };
        if (take - current).abs() >= 1000 {
            tracing::info!(
                from_ms = current,
                to_ms = take,
                "the database clock moved against ours; adopting the new offset"
            );
        } else {
            tracing::debug!(from_ms = current, to_ms = take, "clock offset settled");
        }
        self.offset_ms.store(take, Ordering::Relaxed);
    }

    /// Lowers the clock offset to `bound` when it is above it: `bound` is
    /// the local time a notification arrived less the database time it
    /// carries, so the true offset is below it. A step of the database's
    /// clock forward since the last statement then makes a lease handed
    /// over late only by the notification's delay, not by the step, until
    /// the next statement settles the offset.
    pub(super) fn cap_offset(&self, bound: i64) {
        if self.offset_ms.load(Ordering::Relaxed) > bound {
            self.adopt_offset(bound);
        }
    }

    /// Settles the clock offset on the answer, received at `received`, to a
    /// statement sent at `sent` (local ms) that read the database's clock
    /// as it arrived and as it ended (its [`DB_NOW`](super::sql::DB_NOW)
    /// columns). Both readings came after `sent`, so `sent` less either is
    /// never above the true offset, and each answer may be taken (as
    /// [`Inner::adopt_offset`] does, past its slack): times are then never
    /// late however the database's clock stepped since the LISTEN
    /// connection measured it. The arrival's reading is the closer one,
    /// unless the database's clock ran further during the statement than
    /// ours did: it stepped forward meanwhile (say while the statement
    /// waited for a row lock), and the times it wrote are on the new clock,
    /// which only the end's reading knows.
    pub(super) fn settle_offset(&self, (sent, received): (u64, u64), rows: &[Row]) {
        let Some(row) = rows.first() else {
            return;
        };
        let (Ok(arrived), Ok(ended)) = (
            row.try_get::<_, i64>("db_now"),
            row.try_get::<_, i64>("db_end"),
        ) else {
            return;
        };
        let local = |t: u64| i64::try_from(t).unwrap_or(i64::MAX);
        let (sent, took) = (local(sent), local(received.saturating_sub(sent)));
        // Plus 1 ms: the database's times are floored to the millisecond.
        let db = if ended.saturating_sub(arrived) > took + 1 {
            ended
        } else {
            arrived
        };
        self.adopt_offset(sent.saturating_sub(db) - 1);
    }

    /// A database deadline as a local moment that is never early: the time
    /// left, counted from now (after the answer arrived), plus 1 ms.
    pub(super) fn local_deadline(&self, at_db: i64, now_db: i64) -> u64 {
        now_ms() + u64::try_from(at_db.saturating_sub(now_db)).unwrap_or(0) + 1
    }

    pub(super) fn holder(&self, kind: Kind, h: HolderRow) -> Holder {
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

    pub(super) fn tickets(&self) -> std::sync::MutexGuard<'_, Tickets> {
        self.tickets.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Inner {
    pub(super) fn not_ready(&self, op: &'static str) -> Option<Error> {
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
    pub(super) fn setup_failed(&self, f: &Failure) {
        *self
            .setup_failure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Cause::of(f.source.as_ref());
    }

    /// Runs one statement on a pooled connection, within [`OP_TIMEOUT`],
    /// again after a serialization failure or deadlock.
    pub(super) async fn rows(
        &self,
        op: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, Error> {
        self.rows_or_fate(op, sql, params).await.map_err(|(e, _)| e)
    }

    /// As [`Inner::rows`], telling with the error what became of the
    /// statement.
    pub(super) async fn rows_or_fate(
        &self,
        op: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, (Error, Fate)> {
        let rows = self.rows_as_of_sending(op, sql, || Some(params)).await?;
        Ok(rows.unwrap_or_default())
    }

    /// As [`Inner::rows_or_fate`], with parameters that `build` reads once
    /// a connection is had (each try), not before a wait for one: what they
    /// say holds as of the statement. `None` from `build`: nothing to run
    /// (answered `None`).
    pub(super) async fn rows_as_of_sending<P: Params>(
        &self,
        op: &'static str,
        sql: &str,
        build: impl Fn() -> Option<P>,
    ) -> Result<Option<Vec<Row>>, (Error, Fate)> {
        if let Some(e) = self.not_ready(op) {
            return Err((e, Fate::NotRun));
        }
        let mut tries = 0;
        // Lease upkeep has connections of its own, whose statements wait for
        // no row lock long (their `lock_timeout`): one that would is run
        // again on the main pool (as a lease renewed alone is), so that a
        // row another transaction keeps locked does not take them.
        let mut pool = match op {
            "renew" | "release" | "status" => &self.upkeep,
            _ => &self.pool,
        };
        loop {
            tries += 1;
            // Set once the statement is on its way: from then on a failure
            // may come after the database ran it.
            let sent = AtomicBool::new(false);
            let run = async {
                // Abandoned unless answered: past its time limit, or when
                // its caller goes (a client that leaves drops its request).
                let mut pending = Pending(Some(self.connection(pool).await?));
                let query = async {
                    let client = pending.client();
                    let statement = client.prepare_cached(sql).await?;
                    let Some(built) = build() else {
                        return Ok(None);
                    };
                    sent.store(true, Ordering::Relaxed);
                    let at = now_ms();
                    let rows = client.query(&statement, &built.refs()).await?;
                    Ok::<_, Failure>(Some((rows, at)))
                };
                let answer = crate::clock::within(OP_TIMEOUT, query).await;
                if answer.is_ok() {
                    pending.answered();
                }
                answer.unwrap_or_else(|_| Err(Failure::timeout(op)))
            };
            match run.await {
                Ok(None) => return Ok(None),
                Ok(Some((rows, sent_at))) => {
                    self.settle_offset((sent_at, now_ms()), &rows);
                    self.progress_ms.store(now_ms(), Ordering::Relaxed);
                    if !*self.listening.borrow() {
                        self.reconnect.notify_one();
                    }
                    return Ok(Some(rows));
                }
                Err(f) if f.class == Class::Retry && tries < 3 => continue,
                Err(f) if f.class == Class::Locked && !std::ptr::eq(pool, &self.pool) => {
                    pool = &self.pool;
                }
                Err(f) => {
                    let fate = match f.class {
                        Class::Fatal => Fate::Refused,
                        // Its transaction was rolled back.
                        Class::Locked => Fate::NotRun,
                        _ if sent.load(Ordering::Relaxed) => Fate::Unknown,
                        _ => Fate::NotRun,
                    };
                    return Err((f.into_error(op), fate));
                }
            }
        }
    }

    /// A pooled connection. Waiting for one fails after [`POOL_TIMEOUT`] in
    /// an outage, but goes on (up to [`BUSY_POOL_TIMEOUT`]) while statements
    /// on the pool's other connections keep succeeding.
    pub(super) async fn connection(&self, pool: &Pool) -> Result<Object, Failure> {
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
    pub(super) async fn value<T>(
        &self,
        op: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<T, Error>
    where
        T: for<'a> tokio_postgres::types::FromSql<'a>,
    {
        self.value_or_fate(op, sql, params)
            .await
            .map_err(|(e, _)| e)
    }

    /// As [`Inner::value`], telling with the error what became of the
    /// statement (an answer that cannot be read came after it ran).
    pub(super) async fn value_or_fate<T>(
        &self,
        op: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<T, (Error, Fate)>
    where
        T: for<'a> tokio_postgres::types::FromSql<'a>,
    {
        let rows = self.rows_or_fate(op, sql, params).await?;
        let row = rows.first().ok_or_else(|| {
            let e = Error::Unavailable {
                op,
                source: "the function returned no row".into(),
            };
            (e, Fate::Unknown)
        })?;
        row.try_get(0)
            .map_err(|e| (Failure::from(e).into_error(op), Fate::Unknown))
    }

    /// A function's JSON answer (`NULL` as `None`).
    pub(super) async fn json<T: for<'de> Deserialize<'de>>(
        &self,
        op: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<T>, Error> {
        self.json_or_fate(op, sql, params).await.map_err(|(e, _)| e)
    }

    /// As [`Inner::json`], telling with the error what became of the statement.
    pub(super) async fn json_or_fate<T: for<'de> Deserialize<'de>>(
        &self,
        op: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<T>, (Error, Fate)> {
        let text: Option<String> = self.value_or_fate(op, sql, params).await?;
        text.map(|t| {
            serde_json::from_str(&t).map_err(|e| {
                let e = Error::Unavailable {
                    op,
                    source: format!("unexpected answer {t:?}: {e}").into(),
                };
                (e, Fate::Unknown)
            })
        })
        .transpose()
    }
}

/// What became of a statement that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fate {
    /// It never reached the database (no connection, schema not ready).
    NotRun,
    /// The database refused it (not an outage: it will be refused again).
    Refused,
    /// It was sent and no answer came back (or one that cannot be read):
    /// the database may have run and committed it.
    Unknown,
}

/// A statement's parameters, as [`Inner::rows_as_of_sending`] lends them.
pub(super) trait Params {
    fn refs(&self) -> Vec<&(dyn ToSql + Sync)>;
}

impl Params for &[&(dyn ToSql + Sync)] {
    fn refs(&self) -> Vec<&(dyn ToSql + Sync)> {
        self.to_vec()
    }
}

/// A pooled connection with a statement on its way. Dropped before
/// [`Pending::answered`] (the statement ran past its time limit, or its
/// caller went), the connection is taken out of its pool and closed, and the
/// server asked to cancel the statement: it may still run, or wait for a row
/// lock, and every statement sent on that connection later would queue
/// behind it.
struct Pending(Option<Object>);

impl Pending {
    fn client(&self) -> &Object {
        self.0.as_ref().expect("a connection until answered")
    }

    /// The statement was answered: the connection goes back to its pool.
    fn answered(&mut self) {
        self.0 = None;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(client) = self.0.take() else {
            return;
        };
        let cancel = client.cancel_token();
        drop(Object::take(client));
        // Bounded, and needs no answer: the connection is gone either way.
        tokio::spawn(async move {
            let _ = tokio::time::timeout(POOL_TIMEOUT, cancel.cancel_query(NoTls)).await;
        });
    }
}
