//! What operators ask of the core: a key's global state, the listing of
//! held and contended keys, stale keys, and force-release.

use crate::backend::{self, State, Summary};
use crate::error::Error;
use crate::lock::{LockKey, LostReason};

use super::Core;
use super::lease::End;

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
    pub async fn stale(&self) -> Result<Vec<backend::StaleKey>, Error> {
        self.op("stale", self.backend.stale(self.limits.stale_after))
            .await
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
