//! Opening the backend: the URL's own parameters, the schema name, the
//! pools and the background task.

use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::{Notify, watch};
use tokio_postgres::NoTls;
use tokio_util::sync::CancellationToken;

use crate::backend::url::strip_query;
use crate::backend::{Cause, Options, chain};
use crate::lock::Token;
use crate::wakeups::Wakeups;

use super::errors::Class;
use super::schema::LegacyTable;
use super::sql::{SESSION_SETUP, Sql};
use super::{DEFAULT_POOL_SIZE, Inner, POOL_TIMEOUT, Postgres, UPKEEP_LOCK_WAIT, UPKEEP_POOL_SIZE};

/// Checks `--pg-schema`: lower-case letters, digits and `_`, so it needs no
/// quoting anywhere and `<schema>_wake` fits PostgreSQL's 63-byte names.
pub(super) fn validate_schema(schema: &str) -> Result<(), String> {
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
        let mut config: tokio_postgres::Config = driver_url.parse().map_err(|e| {
            format!(
                "backend URL {:?}: {}",
                crate::backend::redact(url),
                chain(&e)
            )
        })?;
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

        let build = |size: usize, setup: Option<Hook>| {
            let manager = Manager::from_config(
                config.clone(),
                NoTls,
                ManagerConfig {
                    recycling_method: RecyclingMethod::Fast,
                },
            );
            let builder = Pool::builder(manager);
            let builder = match setup {
                Some(hook) => builder.post_create(hook),
                None => builder,
            };
            builder
                .max_size(size)
                // `connection()` bounds the wait, telling a busy pool from a dead one.
                .wait_timeout(None)
                .create_timeout(Some(POOL_TIMEOUT))
                .recycle_timeout(Some(POOL_TIMEOUT))
                .runtime(Runtime::Tokio1)
                .build()
                .map_err(|e| format!("PostgreSQL connection pool: {e}"))
        };
        let pool = build(
            pool_size,
            Some(Hook::async_fn(|client, _| {
                Box::pin(async move {
                    client
                        .batch_execute(SESSION_SETUP)
                        .await
                        .map_err(HookError::Backend)
                })
            })),
        )?;
        // The upkeep connections wait for a row lock only briefly: a
        // statement that would wait longer runs again on the main pool
        // (`Inner::rows_or_fate`), so that a row another transaction keeps
        // locked never holds up renewals. (Set per session, not as a
        // startup option, which poolers refuse.)
        let upkeep = build(
            UPKEEP_POOL_SIZE,
            Some(Hook::async_fn(|client, _| {
                Box::pin(async move {
                    let wait = UPKEEP_LOCK_WAIT.as_millis();
                    client
                        .batch_execute(&format!("{SESSION_SETUP}; SET lock_timeout = {wait}"))
                        .await
                        .map_err(HookError::Backend)
                })
            })),
        )?;
        let instance = Token::generate().expose()[..16].to_owned();
        let (renewals, asked) = tokio::sync::mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let inner = Arc::new(Inner {
            pool,
            upkeep,
            listen_config,
            sql: Sql::new(&schema),
            channel: format!("{schema}_wake"),
            schema: schema.clone(),
            instance,
            sidecar: options.sidecar.clone(),
            url: crate::backend::redact(url),
            legacy,
            wakeups,
            ready: watch::channel(false).0,
            setup_failure: std::sync::Mutex::new(Cause::TimedOut),
            listening: watch::channel(false).0,
            reconnect: Notify::new(),
            offset_ms: AtomicI64::new(0),
            offset_low_ms: AtomicI64::new(i64::MIN),
            progress_ms: AtomicU64::new(0),
            tickets: Mutex::default(),
            rejoining: tokio::sync::RwLock::new(()),
            rejoin_soon: Arc::new(Notify::new()),
            beat_ms: AtomicU64::new(0),
            beat_db_ms: AtomicI64::new(0),
            renewals,
            stop: stop.clone(),
        });
        tokio::spawn(super::renewals::run(
            Arc::downgrade(&inner),
            asked,
            stop.clone(),
        ));
        tokio::spawn(Inner::rejoins(
            Arc::downgrade(&inner),
            inner.rejoin_soon.clone(),
            stop,
        ));
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
