//! Failures, classified: a driver error is a SQLSTATE the server sent or
//! one of the driver's own kinds (closed connection, I/O) — never message
//! text — and decides between a 503, a retry and a bug; no row data reaches
//! an error message.

use std::error::Error as StdError;

use deadpool_postgres::{HookError, PoolError};

use crate::backend::{Cause, Error, Outage, chain};

use super::OP_TIMEOUT;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    /// The database cannot be reached or is going away: 503, retry later.
    Outage,
    /// A serialization failure or deadlock: run the statement again.
    Retry,
    /// A row lock was not free within the connection's `lock_timeout` (the
    /// upkeep connections' is short): run it again where it may wait.
    Locked,
    /// The database refused the statement (permissions, wrong schema, a bug):
    /// retrying will not help.
    Fatal,
}

/// A failed database call, classified by the driver's error kinds and SQLSTATE codes.
pub(super) struct Failure {
    pub(super) class: Class,
    pub(super) source: Box<dyn StdError + Send + Sync>,
}

impl Failure {
    pub(super) fn timeout(what: &str) -> Self {
        Self {
            class: Class::Outage,
            source: Outage::boxed(
                Cause::TimedOut,
                format!("PostgreSQL did not answer within {OP_TIMEOUT:?} ({what})"),
            ),
        }
    }

    pub(super) fn into_error(self, op: &'static str) -> Error {
        if self.class == Class::Fatal {
            tracing::error!(op, error = %chain(self.source.as_ref()), "PostgreSQL refused a sidelock statement");
        }
        Error::Unavailable {
            op,
            source: self.source,
        }
    }

    pub(super) fn describe(&self) -> String {
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
pub(super) fn without_row_data(e: tokio_postgres::Error) -> Box<dyn StdError + Send + Sync> {
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
            PoolError::Backend(e) | PoolError::PostCreateHook(HookError::Backend(e)) => classify(e),
            PoolError::Timeout(_) | PoolError::Closed => Class::Outage,
            _ => Class::Fatal,
        };
        let source = match e {
            PoolError::Backend(e) | PoolError::PostCreateHook(HookError::Backend(e)) => {
                without_row_data(e)
            }
            PoolError::Timeout(_) => Outage::boxed(Cause::TimedOut, e.to_string()),
            e => Box::new(e),
        };
        Self { class, source }
    }
}

/// Classifies a driver error by SQLSTATE (for errors the server sent) or by
/// the driver's own kinds (closed connection, I/O), never by message text.
pub(super) fn classify(e: &tokio_postgres::Error) -> Class {
    if let Some(code) = e.code() {
        let code = code.code();
        return match code {
            // serialization_failure, deadlock_detected
            "40001" | "40P01" => Class::Retry,
            // lock_not_available
            "55P03" => Class::Locked,
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
