//! Leases: renewing, releasing and checking the node of one granted claim.
//!
//! A lease granted through this sidecar is written at the version this
//! sidecar knows ([`Record`]), without reading it first: one request per
//! renewal or release. A write through another sidecar (a re-entry, a
//! renewal there) moves the version; the write then fails and the node is
//! read again.

use std::sync::Arc;
use std::time::Duration;

use zookeeper_client as zk;

use super::data::{Lease, NodeData};
use super::request::{
    CLAIM_ROUNDS, Failed, Message, PARENT_ROUNDS, Round, call, retry_on_conflict, unanswered_write,
    unavailable,
};
use super::tree::Listing;
use super::{Inner, Record, lock};
use crate::backend::{Error, Loss, Status};
use crate::clock::{ms, now_ms};
use crate::lock::{LockKey, Token};

/// How long after a tentative grant its sidecar confirms it, unless the
/// lease was released or written (renewed, re-entered) before: most
/// leases granted at once are released sooner, and cost no write more.
pub(super) const CONFIRM_AFTER: Duration = Duration::from_millis(150);

impl Inner {
    /// Confirms the tentative grant of `token` after [`CONFIRM_AFTER`], so
    /// that its owner can re-enter it through other sidecars
    /// ([`NodeData::tentative`]); while ZooKeeper is unreachable, tries
    /// again every second for as long as the lease lives here (a renewal
    /// confirms it too), until the backend closes.
    pub(super) fn confirm_later(self: &Arc<Self>, token: &Token) {
        let (me, token) = (self.clone(), token.clone());
        tokio::spawn(async move {
            let mut pause = CONFIRM_AFTER;
            loop {
                let confirmed = tokio::select! {
                    () = me.closing.cancelled() => return,
                    confirmed = async {
                        tokio::time::sleep(pause).await;
                        me.confirm(&token).await
                    } => confirmed,
                };
                if confirmed.is_ok() {
                    return;
                }
                pause = Duration::from_secs(1);
            }
        });
    }

    /// Watches the node at `path` of the lease `token` on `key`, which
    /// this sidecar re-entered and another one granted: the lease lives in
    /// that sidecar's session, and ends with it (the server deletes the
    /// node as it expires the session, and the next waiter is granted at
    /// once). Its deletion is reported as the lease's loss
    /// ([`Backend::losses`](crate::backend::Backend::losses)) unless this
    /// sidecar was ending the lease itself ([`Inner::ending`]); without
    /// it, this sidecar's holders heard of it at their next renewal, a
    /// third of a ttl later. One children watch (it fires for the node's
    /// deletion only, not for the writes of renewals): one request per
    /// lease followed, and one task, until the node goes. A watch that
    /// ends otherwise (the session ended) leaves the loss to the renewals.
    pub(super) fn follow_reentered(
        self: &Arc<Self>,
        zk: &zk::Client,
        key: &LockKey,
        path: &str,
        token: &Token,
    ) {
        if lock(&self.reentered).insert(token.clone(), false).is_some() {
            // Followed already (and, re-entered just now, not ending).
            return;
        }
        let (me, zk, key, path, token) = (
            self.clone(),
            zk.clone(),
            key.clone(),
            path.to_owned(),
            token.clone(),
        );
        tokio::spawn(async move {
            let gone = async {
                let watched = call("watch", zk.list_and_watch_children(&path)).await;
                // Not held while the watch waits: the last handle dropped
                // closes a session this sidecar gave up (its watcher holds
                // none).
                drop(zk);
                let error = match watched {
                    Ok(Ok((_, watcher))) => {
                        return watcher.changed().await.event_type == zk::EventType::NodeDeleted;
                    }
                    // Gone already, between the re-entry and the watch.
                    Ok(Err(zk::Error::NoNode)) => return true,
                    Ok(Err(e)) => unavailable("watch", e),
                    Err(e) => e,
                };
                tracing::debug!(backend = "zookeeper", lock = %key, error = %error,
                    "could not watch a lease re-entered here");
                false
            };
            let gone = tokio::select! {
                () = me.closing.cancelled() => false,
                gone = gone => gone,
            };
            if lock(&me.reentered).remove(&token) == Some(false) && gone {
                tracing::debug!(backend = "zookeeper", lock = %key,
                    "a lease re-entered here ended in the sidecar that granted it");
                // No receiver (the core not following) only means nobody listens.
                let _ = me.losses.send(token);
            }
        });
    }

    /// Marks the followed lease `token` as being ended by this sidecar
    /// (`true`, before the request that deletes its node is sent: the
    /// watch fires before the answer comes), or no longer (`false`, once
    /// that request failed without running): its node's deletion is then
    /// not reported, or again reported, as its loss
    /// ([`Inner::follow_reentered`]).
    pub(super) fn ending(&self, token: &str, ending: bool) {
        let mut followed = lock(&self.reentered);
        if followed.is_empty() {
            return;
        }
        if let Some(e) = followed.get_mut(&Token::from_client(token.to_owned())) {
            *e = ending;
        }
    }

    /// Whether the lease of `token` on `key`, ending at `end` on the
    /// servers' clock, is over for its holder, who was told it ends at
    /// [`earliest`](super::server_time::ServerClock::earliest)`(end)`,
    /// though the servers' clock may not be there yet. Its node then stays
    /// until that is sure (its owner may hold it re-entered through another
    /// sidecar, whose bounds on the servers' clock are narrower): a check
    /// then deletes it, as it does an expired lease.
    ///
    /// Only for a lease granted through this sidecar, whose holder it told
    /// that end; one check per lease is scheduled at a time.
    fn over_for_holder(self: &Arc<Self>, key: &LockKey, token: &Token, end: u64) -> bool {
        if self.clock.earliest(end) > now_ms() || !lock(&self.leases).contains_key(token) {
            return false;
        }
        if !lock(&self.lapsing).insert(token.clone()) {
            return true;
        }
        let (me, key, token) = (self.clone(), key.clone(), token.clone());
        let at = crate::clock::instant_at(self.clock.surely(end).saturating_add(1));
        tokio::spawn(async move {
            tokio::select! {
                () = me.closing.cancelled() => {}
                () = tokio::time::sleep_until(at) => {
                    lock(&me.lapsing).remove(&token);
                    let _ = Box::pin(me.status(&key, &token)).await;
                }
            }
        });
        true
    }

    /// Rewrites the node of `token` with its fence stored and no longer
    /// tentative, if this sidecar still holds it as a tentative grant; one
    /// that expired first is deleted as an expired lease is (a lease granted
    /// by its listing still reads as waiting, and no other sidecar would
    /// ever expire it).
    async fn confirm(self: &Arc<Self>, token: &Token) -> Result<(), Error> {
        let tentative = || {
            lock(&self.leases)
                .get(token)
                .filter(|r| r.lease.data.tentative)
                .map(|r| Record::clone(r))
        };
        if tentative().is_none() || self.is_revoked(token) {
            return Ok(());
        }
        let op = "renew";
        let zk = self.client().await?;
        let zk = &zk;
        retry_on_conflict(CLAIM_ROUNDS, || async move {
            let Some(record) = tentative() else {
                return Ok(Round::Done(()));
            };
            if record.lease.data.expires_at_ms <= self.clock.now() {
                let parent = record.lease.path.rsplit_once('/').map_or("", |(p, _)| p);
                return Ok(
                    if Box::pin(self.ended(zk, op, parent, token, &record)).await? {
                        Round::Done(())
                    } else {
                        Round::Conflict
                    },
                );
            }
            let next = record.lease.next();
            Ok(match self.rewrite(zk, op, token, &record, next).await? {
                Round::Done(_) => Round::Done(()),
                Round::Conflict => Round::Conflict,
            })
        })
        .await?
        // Tried again, as while ZooKeeper is unreachable.
        .ok_or_else(|| unavailable(op, Message("lease kept changing".into())))
    }

    /// The lease of `token` under `parent`: this sidecar's record, else
    /// found by a scan (a lease granted through another sidecar); `None`
    /// when it holds nothing there.
    async fn lease_of(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        token: &Token,
    ) -> Result<Option<Record>, Error> {
        let prefix = format!("{parent}/");
        let known = lock(&self.leases)
            .get(token)
            .filter(|r| r.lease.path.starts_with(&prefix))
            .map(|r| Record::clone(r));
        if known.is_some() {
            return Ok(known);
        }
        // Boxed, as are the other rare paths below: a renewal's future is
        // as large as its largest state, and with thousands of holds
        // renewing at once the common one (a write) is what should count.
        Box::pin(self.look_up(zk, op, parent, token)).await
    }

    /// [`Self::lease_of`] for a lease this sidecar has no record of.
    async fn look_up(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        token: &Token,
    ) -> Result<Option<Record>, Error> {
        let listing = self.children(zk, op, parent).await?;
        let Some(node) = self.scan_for(zk, op, parent, token, &listing).await? else {
            return Ok(None);
        };
        Ok(node.data.as_ref().map(|d| Record {
            lease: Lease::of(parent, &node, d),
            parent: listing.parent.clone(),
        }))
    }

    /// Reads the node of `record` again after a write to it failed on its
    /// version: the fresh lease, which this sidecar's record takes on;
    /// `None` (and no record) once it no longer holds `token`.
    async fn refresh(
        &self,
        zk: &zk::Client,
        op: &'static str,
        token: &Token,
        record: &Record,
    ) -> Result<Option<Lease>, Error> {
        let fresh = match call(op, zk.get_data(&record.lease.path)).await? {
            // A lease granted by its listing reads as written waiting until
            // it is confirmed: as kept here, so that an expired one is
            // deleted, not forgotten with its node left first in line.
            Ok((bytes, stat)) => self
                .as_kept(serde_json::from_slice(&bytes).ok(), &stat)
                .filter(|d| d.held && d.token == token.expose())
                .map(|d| Lease::read(record.lease.path.clone(), d, &stat)),
            Err(zk::Error::NoNode) => None,
            Err(e) => return Err(unavailable(op, e)),
        };
        let mut leases = lock(&self.leases);
        match &fresh {
            Some(lease) => {
                if let Some(r) = leases.get_mut(token) {
                    r.lease = lease.clone();
                }
            }
            None => {
                leases.remove(token);
            }
        }
        Ok(fresh)
    }

    /// Takes on `lease` as written at `version` in this sidecar's record of
    /// `token`, if it has one.
    /// Writes `next` over the lease node of `record` if it is unchanged:
    /// `Done(true)` when written, `Done(false)` when the node is gone
    /// (forgotten here), `Conflict` when it changed (read again first).
    async fn rewrite(
        &self,
        zk: &zk::Client,
        op: &'static str,
        token: &Token,
        record: &Record,
        next: NodeData,
    ) -> Result<Round<bool>, Error> {
        let lease = &record.lease;
        let bytes = serde_json::to_vec(&next).unwrap_or_default();
        let sent = now_ms();
        match call(op, zk.set_data(&lease.path, &bytes, Some(lease.version))).await? {
            Ok(stat) => {
                self.clock.observe(sent, &stat);
                let written = Lease {
                    data: next,
                    ..lease.clone()
                };
                self.wrote(token, &written, stat.version);
                Ok(Round::Done(true))
            }
            Err(zk::Error::NoNode) => {
                lock(&self.leases).remove(token);
                Ok(Round::Done(false))
            }
            Err(zk::Error::BadVersion) => {
                Box::pin(self.refresh(zk, op, token, record)).await?;
                Ok(Round::Conflict)
            }
            Err(e) => Err(unavailable(op, e)),
        }
    }

    fn wrote(&self, token: &Token, lease: &Lease, version: i32) {
        if let Some(r) = lock(&self.leases).get_mut(token) {
            r.lease = Lease {
                version,
                ..lease.clone()
            };
        }
    }

    /// A lease past its expiry by `record`: read again (a renewal through
    /// another sidecar may have moved it) and, still expired, deleted with
    /// its lock-delay. True when it was deleted or is gone.
    async fn ended(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        token: &Token,
        record: &Record,
    ) -> Result<bool, Error> {
        let Some(lease) = self.refresh(zk, op, token, record).await? else {
            return Ok(true);
        };
        if lease.data.expires_at_ms > self.clock.now() {
            return Ok(false);
        }
        let gone = self.expire_lease(zk, op, parent, &lease, None).await?;
        if gone {
            lock(&self.leases).remove(token);
        }
        Ok(gone)
    }

    /// [`Backend::renew`](crate::backend::Backend::renew): moves the expiry
    /// of `token`'s node; `None` when it holds nothing.
    pub(super) async fn renew(
        self: &Arc<Self>,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, Error> {
        if self.is_revoked(token) {
            return Ok(None);
        }
        let op = "renew";
        let zk = self.client().await?;
        let parent = self.key_path(key);
        // References, which every round's future copies.
        let (zk, parent) = (&zk, &parent);
        let renewed = retry_on_conflict(CLAIM_ROUNDS, || async move {
            let Some(record) = self.lease_of(zk, op, parent, token).await? else {
                return Ok(Round::Done(None));
            };
            if record.lease.data.expires_at_ms <= self.clock.now() {
                return Ok(
                    if Box::pin(self.ended(zk, op, parent, token, &record)).await? {
                        Round::Done(None)
                    } else {
                        Round::Conflict
                    },
                );
            }
            if self.over_for_holder(key, token, record.lease.data.expires_at_ms) {
                return Ok(Round::Done(None));
            }
            let lease = &record.lease;
            // This write moves the node's mzxid: the fence is stored in it.
            let mut next = lease.next();
            let mut until = self
                .clock
                .now_late()
                .saturating_add(ttl.map_or(next.ttl_ms, ms));
            if let Some(cap) = next.cap_ms {
                until = until.min(cap);
            }
            // Never sooner than it ends now: a re-entry through another
            // sidecar may have given it longer, and told its client so.
            let until = until.max(next.expires_at_ms);
            next.expires_at_ms = until;
            Ok(match self.rewrite(zk, op, token, &record, next).await? {
                Round::Done(written) => Round::Done(written.then(|| self.clock.earliest(until))),
                Round::Conflict => Round::Conflict,
            })
        })
        .await?;
        renewed.ok_or_else(|| unavailable(op, Message("lease kept changing".into())))
    }

    /// [`Backend::release`](crate::backend::Backend::release): lowers the
    /// hold count of `token`'s node, deleting it at zero — in the same
    /// request as it records the lease's fence in the lock node, unless the
    /// record is there already; `None` when it holds nothing.
    pub(super) async fn release(
        self: &Arc<Self>,
        key: &LockKey,
        token: &Token,
    ) -> Result<Option<u32>, Error> {
        if self.is_revoked(token) {
            return Ok(None);
        }
        let op = "release";
        let zk = self.client().await?;
        let parent = self.key_path(key);
        // References, which every round's future copies.
        let (zk, parent) = (&zk, &parent);
        // Concurrent releases of a semaphore's permits or of shared holds
        // all write the lock node's record: as many rounds as for the
        // lock's other records, and more while others go through (below).
        let released = retry_on_conflict(PARENT_ROUNDS, || async move {
            let Some(mut record) = self.lease_of(zk, op, parent, token).await? else {
                return Ok(Round::Done(None));
            };
            if record.lease.data.expires_at_ms <= self.clock.now() {
                return Ok(
                    if Box::pin(self.ended(zk, op, parent, token, &record)).await? {
                        self.wakeups.wake(key);
                        Round::Done(None)
                    } else {
                        Round::Conflict
                    },
                );
            }
            if self.over_for_holder(key, token, record.lease.data.expires_at_ms) {
                return Ok(Round::Done(None));
            }
            let lease = &record.lease;
            if lease.data.count > 1 {
                let mut next = lease.next();
                next.count -= 1;
                let count = next.count;
                // Lost after it was sent, the write may have taken the hold
                // off: sent again, it would take a second one, which its
                // owner may have re-entered meanwhile. (A lease's last hold
                // ends with its node, which a second run finds gone.)
                let written = self
                    .rewrite(zk, op, token, &record, next)
                    .await
                    .map_err(unanswered_write)?;
                return Ok(match written {
                    Round::Done(written) => Round::Done(written.then_some(count)),
                    Round::Conflict => Round::Conflict,
                });
            }
            if record.parent.version.is_none() {
                record.parent = self.parent_data(zk, op, parent).await?;
            }
            let mut listing = Listing {
                parent: record.parent.clone(),
                ..Listing::default()
            };
            // No wake-up here: the next waiter's watch on this node fires.
            loop {
                let Err(failed) = self.end_lease(zk, op, parent, lease, 0, &listing).await? else {
                    lock(&self.leases).remove(token);
                    return Ok(Round::Done(Some(0)));
                };
                match failed {
                    Failed {
                        index: 0,
                        error: zk::Error::NoNode,
                    } => {
                        lock(&self.leases).remove(token);
                        return Ok(Round::Done(None));
                    }
                    Failed {
                        index: 0,
                        error: zk::Error::BadVersion,
                    } => {
                        self.refresh(zk, op, token, &record).await?;
                        return Ok(Round::Conflict);
                    }
                    // The lock node's record changed since it was read.
                    Failed {
                        error: zk::Error::BadVersion,
                        ..
                    } => {
                        let fresh = self.parent_data(zk, op, parent).await?;
                        if let Some(r) = lock(&self.leases).get_mut(token) {
                            r.parent = fresh.clone();
                        }
                        // Raised by the end of another lease, which went
                        // through: tried again at once, uncounted. Only
                        // ends of leases granted before this one raise it
                        // below this lease's fence (any later one's covers
                        // it, and this end then writes no record), so
                        // these tries end; a change that raised nothing
                        // counts as a round.
                        let raised = fresh.data.fence > listing.parent.data.fence;
                        listing.parent = fresh;
                        if !raised {
                            return Ok(Round::Conflict);
                        }
                    }
                    Failed { error, .. } => return Err(unavailable(op, error)),
                }
            }
        })
        .await?;
        released.ok_or_else(|| unavailable(op, Message("lease kept changing".into())))
    }

    /// [`Backend::status`](crate::backend::Backend::status): whether `token`
    /// still holds `key`, and until when.
    pub(super) async fn status(
        self: &Arc<Self>,
        key: &LockKey,
        token: &Token,
    ) -> Result<Status, Error> {
        if self.is_revoked(token) {
            return Ok(Status::Gone(Loss::Backend));
        }
        let ours = lock(&self.leases).contains_key(token);
        let zk = self.client().await?;
        let parent = self.key_path(key);
        let Some(node) = self.find(&zk, "status", &parent, token).await? else {
            // Our own lease gone without our knowledge: the session took it.
            return Ok(Status::Gone(if ours {
                Loss::Expired
            } else {
                Loss::Backend
            }));
        };
        let Some(d) = &node.data else {
            return Ok(Status::Gone(Loss::Backend));
        };
        if d.expires_at_ms <= self.clock.now() {
            self.expire(&zk, "status", &parent, &node, None).await?;
            lock(&self.leases).remove(token);
            self.wakeups.wake(key);
            return Ok(Status::Gone(Loss::Expired));
        }
        if self.over_for_holder(key, token, d.expires_at_ms) {
            return Ok(Status::Gone(Loss::Expired));
        }
        Ok(Status::Held {
            expires_at_ms: self.clock.earliest(d.expires_at_ms),
        })
    }
}
