//! What operators ask of the core: a key's global state, the listing of
//! held and contended keys, stale keys, and force-release.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::{MOST_STALE, StaleKey, State, Summary};
use crate::error::Error;
use crate::lock::{LockKey, LostReason};

use super::Core;
use super::lease::End;

/// The stale-key scans of a sidecar, one at a time: callers that arrive
/// while one runs wait for it, then share the next, which began after they
/// asked, so it shows everything they saw before asking. A burst of
/// requests costs the backend two scans, not one each (a scan reads the
/// whole keyspace).
#[derive(Default)]
pub(super) struct StaleScans {
    /// Scans begun so far.
    begun: AtomicU64,
    /// The last scan with its number and outcome; held while a scan runs.
    last: tokio::sync::Mutex<Option<(u64, Scanned)>>,
}

/// What a stale-key scan found.
type Scanned = Result<Vec<StaleKey>, Error>;

/// The same outcome again, for a caller that shares a scan: an outage is
/// shared as it was met; any other error is not (the caller scans).
fn again(outcome: &Scanned) -> Option<Scanned> {
    match outcome {
        Ok(keys) => Some(Ok(keys.clone())),
        Err(Error::Unavailable { backend, cause, op }) => Some(Err(Error::Unavailable {
            backend: backend.clone(),
            cause: *cause,
            op,
        })),
        Err(_) => None,
    }
}

impl Core {
    /// The global state of a key.
    ///
    /// # Errors
    /// Backend outages.
    pub async fn inspect(&self, key: &LockKey) -> Result<State, Error> {
        self.op("inspect", self.backend.inspect(key)).await
    }

    /// Held or contended keys.
    ///
    /// # Errors
    /// Backend outages.
    pub async fn list(
        &self,
        prefix: &str,
        after: Option<&LockKey>,
        limit: usize,
    ) -> Result<Vec<Summary>, Error> {
        self.op("list", self.backend.list(prefix, after, limit))
            .await
    }

    /// Keys an operator should look at.
    ///
    /// # Errors
    /// Backend outages.
    pub async fn stale(&self) -> Result<Vec<StaleKey>, Error> {
        let scans = &self.stale_scans;
        let asked = scans.begun.load(Ordering::SeqCst);
        let mut last = scans.last.lock().await;
        if let Some((scan, outcome)) = last.as_ref()
            && *scan > asked
            && let Some(outcome) = again(outcome)
        {
            return outcome;
        }
        let scan = scans.begun.fetch_add(1, Ordering::SeqCst) + 1;
        let outcome = self.scan_stale().await;
        let shared = again(&outcome);
        *last = shared.map(|shared| (scan, shared));
        outcome
    }

    /// One stale-key scan of the backend, not shared: the monitor's, which
    /// must not wait behind requests' scans (its beat renews its lease).
    ///
    /// Keeps the [`MOST_STALE`] oldest entries found, and one more when
    /// there were more (see [`shown_stale`]).
    pub(super) async fn scan_stale(&self) -> Result<Vec<StaleKey>, Error> {
        let mut found = self
            .op("stale", self.backend.stale(self.limits.stale_after))
            .await?;
        found.sort_by_key(|k| std::cmp::Reverse(k.age_ms));
        found.truncate(MOST_STALE + 1);
        Ok(found)
    }

    /// Removes every holder of `key`; `who` describes the caller for the log.
    ///
    /// # Errors
    /// Backend outages.
    pub async fn force_release(&self, key: &LockKey, who: &str) -> Result<usize, Error> {
        let tokens = self
            .op("force_release", self.backend.force_release(key))
            .await?;
        tracing::warn!(lock = %key, holders = tokens.len(), who, "force-released");
        self.metrics.force_releases.inc();
        for token in &tokens {
            if let Some(local) = self.local_on(key, token) {
                self.end(&local, End::Lost(LostReason::ForceReleased));
            }
        }
        Ok(tokens.len())
    }
}

/// The entries of a stale scan to show, at most [`MOST_STALE`], and whether
/// the scan found more.
pub fn shown_stale(mut found: Vec<StaleKey>) -> (Vec<StaleKey>, bool) {
    let more = found.len() > MOST_STALE;
    found.truncate(MOST_STALE);
    (found, more)
}
