//! Ending and extending leases: release, keepalive, and giving up a lease
//! whose renewals cannot reach the backend (revoked: 410 from then on,
//! released in the backend once it answers).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::clock::{ms, now_ms};
use crate::error::Error;
use crate::lock::{LockKey, LostReason, Token};

use super::event::EventType;
use super::expiry::margin_ms;
use super::lease::{End, Local, Underway};
use super::{Core, answered};

impl Core {
    /// Ends a local lease once: removes it, counts it, publishes the event.
    /// Returns false if it had ended already.
    pub(super) fn end(&self, local: &Local, end: End) -> bool {
        if local.end.set(end).is_err() {
            return false;
        }
        local.ended.cancel();
        self.expiries.remove(local);
        if local.key.kind == crate::lock::Kind::Election {
            // Its observers everywhere: a release with nobody waiting wakes nobody.
            self.announce_key(&local.key);
        }
        if self.lock_leases().remove(&local.token).is_some() {
            self.held_slots.fetch_sub(1, Ordering::AcqRel);
        }
        let m = &self.metrics;
        m.held.with_label_values(&[local.key.kind.as_str()]).dec();
        let held = Duration::from_millis(now_ms().saturating_sub(local.since_ms));
        m.observe(&m.hold, &local.key, held);
        let mut event = match end {
            End::Released => local.event(EventType::Released, &self.sidecar),
            End::Lost(reason) => {
                m.lost.with_label_values(&[reason.as_str()]).inc();
                let kind = match reason {
                    LostReason::Expired | LostReason::MaxHold => {
                        m.expirations
                            .with_label_values(&[local.key.kind.as_str()])
                            .inc();
                        EventType::Expired
                    }
                    LostReason::ForceReleased => EventType::ForceReleased,
                    _ => EventType::Lost,
                };
                let mut e = local.event(kind, &self.sidecar);
                e.reason = Some(reason);
                e
            }
        };
        event.held_ms = Some(ms(held));
        self.publish(event);
        true
    }

    /// Releases one hold of a lease by its token.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] when the token holds nothing; backend outages.
    pub async fn release(&self, key: &LockKey, token: &Token) -> Result<u32, Error> {
        self.release_told(key, token).await.0
    }

    /// Releases the hold of a plain acquire whose client left before its
    /// grant arrived, as [`release_left`](Self::release_left) releases a
    /// hold stream's: a release the backend surely did not run is sent
    /// again until it is heard (kept, the lease would hold the lock, held
    /// by nobody, until its ttl).
    pub async fn release_unclaimed(&self, key: &LockKey, token: &Token) {
        match self.local_on(key, token) {
            Some(lease) => self.release_left(&lease).await,
            None => drop(self.release(key, token).await),
        }
    }

    /// Releases the hold of a hold stream whose client left. A release the
    /// backend surely did not run (an outage, a refusal) is sent again,
    /// pauses doubling to 5 s, until it is answered, the lease ends or the
    /// sidecar shuts down (whose release of the lease's holds takes this
    /// one): kept, the lease would hold the lock, and the queue behind it,
    /// until its ttl — a campaign that resigned, its election. One that may
    /// have run is not sent again.
    pub(super) async fn release_left(&self, lease: &Local) {
        let mut pause = Duration::from_millis(250);
        while let (Err(Error::Unavailable { .. }), false) =
            self.release_told(&lease.key, &lease.token).await
        {
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                () = lease.ended.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
            // Both may be due at once: shutdown releases the lease's holds
            // here itself, this one among them.
            if self.shutdown.is_cancelled() || lease.end.get().is_some() {
                return;
            }
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    }

    /// [`Core::release`], and whether a release that failed may have run.
    async fn release_told(&self, key: &LockKey, token: &Token) -> (Result<u32, Error>, bool) {
        if self.is_revoked(token) {
            return (Err(Error::LeaseLost), false);
        }
        // The hold taken here that this releases, taken before the call: a
        // release that may have run (its answer lost, or its client gone
        // and the call dropped) leaves it taken, as the sidecar must not
        // give it back again (at shutdown, or when the lease is revoked):
        // released twice, it would take one its owner re-entered through
        // another sidecar. Not run after all, it ends with the lease.
        let mine = self.local_on(key, token).filter(|l| l.take_here());
        let result = match self.release_own(key, token).await {
            (Ok(result), _) => result,
            (Err(e), may_have_run) => {
                if let Some(mine) = mine.filter(|_| !may_have_run) {
                    mine.count_here(true);
                }
                return (Err(e), may_have_run);
            }
        };
        let local = self.local_on(key, token);
        let released = match (result, local) {
            (Some(0), Some(local)) => {
                self.end(&local, End::Released);
                Ok(0)
            }
            (Some(n), Some(local)) => {
                local.set(None, Some(n));
                Ok(n)
            }
            (Some(n), None) => Ok(n),
            (None, local) => {
                if let Some(local) = local {
                    // Expired, force-released, or gone while still valid
                    // (data lost, or a backend that cannot tell what its
                    // release left).
                    let reason = self.gone_reason(&local).await;
                    self.end(&local, End::Lost(reason));
                }
                Err(Error::LeaseLost)
            }
        };
        (released, false)
    }

    /// Releases one hold of a lease once per `idempotency` key its client
    /// sends: the same key again (for the same lease) answers what the
    /// first release answered, and waits for it while it is under way —
    /// for five minutes (`answered::KEPT_FOR`). Only an answer is kept: after
    /// an error the release runs again. A request whose client `left`
    /// before its release started gives up (one under way runs to its end,
    /// so that its answer is kept).
    ///
    /// # Errors
    /// As [`Core::release`]; [`Error::ShuttingDown`] when the client left.
    pub async fn release_once(
        &self,
        key: &LockKey,
        token: &Token,
        idempotency: &str,
        left: &tokio_util::sync::CancellationToken,
    ) -> Result<u32, Error> {
        let answered = || self.answered.lock().unwrap_or_else(|e| e.into_inner());
        let (release, turn) = {
            let mut a = answered();
            let release = a.release(key, token, idempotency);
            if let Some(holds) = a.answer(release, std::time::Instant::now()) {
                return Ok(holds);
            }
            (release, a.join(release))
        };
        // Leaves the turn however this ends (a request given up included).
        let _leaving = answered::Leaving {
            answered: &self.answered,
            release,
        };
        let _mine = tokio::select! {
            mine = turn.lock() => mine,
            () = left.cancelled() => return Err(Error::ShuttingDown),
        };
        // The request before it may have been answered meanwhile.
        if let Some(holds) = answered().answer(release, std::time::Instant::now()) {
            return Ok(holds);
        }
        if left.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        let holds = self.release(key, token).await?;
        answered().keep(release, holds, std::time::Instant::now());
        Ok(holds)
    }

    /// The ttl of a lease on `key` granted through this sidecar.
    pub fn lease_ttl(&self, key: &LockKey, token: &Token) -> Option<Duration> {
        self.local_on(key, token).map(|l| l.ttl)
    }

    /// The `max_hold` of a lease this sidecar granted, if it has one.
    pub fn lease_max_hold(&self, key: &LockKey, token: &Token) -> Option<Duration> {
        self.local_on(key, token)
            .and_then(|l| l.cap_ms.map(|cap| cap.get().saturating_sub(l.since_ms)))
            .map(Duration::from_millis)
    }

    /// A client's keepalive: extends a lease to `ttl` (default: its own)
    /// from now, but not below the ttl an open hold stream of the lease
    /// renews it by (that stream's client was told it holds the lease while
    /// the stream is open, and its watchdog renews by that ttl). What it
    /// answers is the end the lease's clients were told of from then on.
    /// Returns the expiry and the ttl it asked for (`None`: the lease's own).
    ///
    /// # Errors
    /// As [`keepalive`](Self::keepalive).
    pub async fn keepalive_asked(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<(u64, Option<Duration>), Error> {
        let ttl = match self.local_on(key, token) {
            Some(local) if local.streamed() => Some(ttl.map_or(local.ttl, |t| t.max(local.ttl))),
            _ => ttl,
        };
        let expires_at_ms = self.keepalive(key, token, ttl).await?;
        if let Some(local) = self.local_on(key, token) {
            local.promise(expires_at_ms, false);
        }
        Ok((expires_at_ms, ttl))
    }

    /// Extends a lease to `ttl` (default: its own) from now.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] when the token holds nothing; backend outages.
    pub(super) async fn keepalive(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<u64, Error> {
        if self.is_revoked(token) {
            self.metrics.renewals.with_label_values(&["lost"]).inc();
            return Err(Error::LeaseLost);
        }
        let renewal = self.op("renew", self.backend.renew(key, token, ttl));
        let renewed = match self.local_on(key, token) {
            Some(local) => {
                local.renewing.store(true, Ordering::Relaxed);
                let mut underway = Underway(Some(&local.renewing));
                let renewed = tokio::select! {
                    renewed = renewal => renewed,
                    // A renewal hanging on an unreachable backend must not
                    // outlive the lease: its client learns with the others.
                    () = local.ended.cancelled() => {
                        self.metrics.renewals.with_label_values(&["lost"]).inc();
                        return Err(Error::LeaseLost);
                    }
                };
                // Finished: its result decides the mark below.
                underway.0 = None;
                renewed
            }
            None => renewal.await,
        };
        let local = self.local_on(key, token);
        match renewed {
            // Given up while the renewal was under way: the client was told.
            Ok(Some(_)) if local.is_none() && self.is_revoked(token) => {
                self.metrics.renewals.with_label_values(&["lost"]).inc();
                Err(Error::LeaseLost)
            }
            Ok(Some(expires_at_ms)) => {
                self.metrics.renewals.with_label_values(&["ok"]).inc();
                if let Some(local) = local {
                    local.set(Some(expires_at_ms), None);
                    local.renewing.store(false, Ordering::Relaxed);
                }
                Ok(expires_at_ms)
            }
            Ok(None) => {
                self.metrics.renewals.with_label_values(&["lost"]).inc();
                if let Some(local) = local {
                    // Answered: the expiry timer must not take the lease
                    // for unreachable while its reason is asked for.
                    local.renewing.store(false, Ordering::Relaxed);
                    let reason = self.gone_reason(&local).await;
                    self.end(&local, End::Lost(reason));
                }
                Err(Error::LeaseLost)
            }
            Err(e) => {
                self.metrics.renewals.with_label_values(&["error"]).inc();
                // Too close to its expiry for another try to be safe.
                if let Some(local) = local
                    && now_ms().saturating_add(margin_ms(local.ttl)) >= local.expires_at_ms()
                {
                    self.revoke(&local);
                }
                // Given up now or while the renewal was under way.
                if self.is_revoked(token) {
                    Err(Error::LeaseLost)
                } else {
                    Err(e)
                }
            }
        }
    }

    /// Gives up a lease whose renewals cannot reach the backend, before the
    /// backend can expire it and grant it to someone else: ends it as lost
    /// (the client is told now), answers 410 for its token from here on, and
    /// releases it in the backend once the backend answers again.
    pub(super) fn revoke(&self, lease: &Arc<Local>) {
        // Marked before the end, so no request sees it neither held nor revoked.
        self.lock_revoked()
            .insert(lease.token.clone(), lease.clone());
        if !self.end(lease, End::Lost(LostReason::Unreachable)) {
            // It had ended already, and the client was told how.
            self.forget_revoked_lease(lease);
            return;
        }
        tracing::warn!(
            lock = %lease.key,
            owner = %lease.owner,
            "backend unreachable near the lease's expiry; lease given up"
        );
        if let Some(me) = self.me.upgrade() {
            if lease.delayed {
                self.tasks.spawn(me.forget_revoked(lease.clone()));
            } else {
                self.tasks.spawn(me.release_revoked(lease.clone()));
            }
        }
    }

    /// Leaves a revoked lease with a lock-delay to expire in the backend:
    /// it ended as lost, and its expiry there starts the delay, which a
    /// release would skip. Its token answers 410 until the backend has
    /// expired it even after a renewal that got through late (one that
    /// asked for the longest ttl, after the expiry seen here), then is
    /// forgotten.
    async fn forget_revoked(self: Arc<Self>, lease: Arc<Local>) {
        let left = lease.expires_at_ms().saturating_sub(now_ms());
        let longest = self.limits.max_ttl.max(lease.ttl);
        let gone = Duration::from_millis(left).saturating_add(longest);
        tokio::select! {
            () = tokio::time::sleep(gone) => {}
            () = self.shutdown.cancelled() => return,
        }
        self.forget_revoked_lease(&lease);
    }

    /// Releases a revoked lease's holds taken through this sidecar in the
    /// backend (its owner may hold others through other sidecars), retrying
    /// until the backend answers (it may have expired the lease meanwhile)
    /// or the token is granted again.
    pub(super) async fn release_revoked(self: Arc<Self>, lease: Arc<Local>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            // Granted again meanwhile (its holds went with the new lease),
            // or revoked again (a task of its own).
            if !self
                .lock_revoked()
                .get(&lease.token)
                .is_some_and(|l| Arc::ptr_eq(l, &lease))
            {
                return;
            }
            if !lease.take_here() {
                self.forget_revoked_lease(&lease);
                return;
            }
            match self.release_own(&lease.key, &lease.token).await {
                (Ok(Some(n)), _) if n > 0 => continue,
                (Ok(_), _) => {
                    self.forget_revoked_lease(&lease);
                    return;
                }
                // Perhaps released: not owed again (a second run could take
                // a hold its owner re-entered since); if it did not run,
                // that hold ends with its ttl.
                (Err(_), true) => {}
                // Not released: still owed, by this lease or by the one
                // that re-entered its token meanwhile (which took the rest).
                (Err(_), false) => {
                    let mine = self
                        .lock_revoked()
                        .get(&lease.token)
                        .is_some_and(|l| Arc::ptr_eq(l, &lease));
                    match self.local(&lease.token).filter(|_| !mine) {
                        Some(current) => current.count_here(true),
                        None => lease.count_here(true),
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = self.shutdown.cancelled() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}
