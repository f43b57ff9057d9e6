//! Leases: renewing, releasing and checking the node of one granted claim.

use std::sync::Arc;
use std::time::Duration;

use zookeeper_client as zk;

use super::data::fence_of;
use super::request::{CLAIM_ROUNDS, Message, Round, call, retry_on_conflict, unavailable};
use super::{Inner, lock};
use crate::backend::{Error, Loss, Status};
use crate::clock::{ms, now_ms};
use crate::lock::{LockKey, Token};

impl Inner {
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
        let zk = self.client().await?;
        let parent = self.key_path(key);
        // References, which every round's future copies.
        let (zk, parent) = (&zk, &parent);
        let renewed = retry_on_conflict(CLAIM_ROUNDS, || async move {
            let Some(node) = self.find(zk, "renew", parent, token).await? else {
                return Ok(Round::Done(None));
            };
            let Some(mut d) = node.data.clone() else {
                return Ok(Round::Done(None));
            };
            // This write moves the node's mzxid: store the fence first.
            d.fence = fence_of(&d, &node.stat);
            let now = now_ms();
            if d.expires_at_ms <= now {
                self.expire(zk, "renew", parent, &node).await?;
                return Ok(Round::Done(None));
            }
            let mut until = now.saturating_add(ttl.map_or(d.ttl_ms, ms));
            if let Some(cap) = d.cap_ms {
                until = until.min(cap);
            }
            d.expires_at_ms = until;
            let bytes = serde_json::to_vec(&d).unwrap_or_default();
            let path = format!("{parent}/{}", node.child.name);
            match call("renew", zk.set_data(&path, &bytes, Some(node.stat.version))).await? {
                Ok(_) => Ok(Round::Done(Some(until))),
                Err(zk::Error::NoNode) => Ok(Round::Done(None)),
                Err(zk::Error::BadVersion) => Ok(Round::Conflict),
                Err(e) => Err(unavailable("renew", e)),
            }
        })
        .await?;
        renewed.ok_or_else(|| unavailable("renew", Message("lease kept changing".into())))
    }

    /// [`Backend::release`](crate::backend::Backend::release): lowers the
    /// hold count of `token`'s node, deleting it at zero; `None` when it
    /// holds nothing.
    pub(super) async fn release(
        self: &Arc<Self>,
        key: &LockKey,
        token: &Token,
    ) -> Result<Option<u32>, Error> {
        if self.is_revoked(token) {
            return Ok(None);
        }
        let zk = self.client().await?;
        let parent = self.key_path(key);
        // References, which every round's future copies.
        let (zk, parent) = (&zk, &parent);
        let released = retry_on_conflict(CLAIM_ROUNDS, || async move {
            let Some(node) = self.find(zk, "release", parent, token).await? else {
                return Ok(Round::Done(None));
            };
            let Some(mut d) = node.data.clone() else {
                return Ok(Round::Done(None));
            };
            d.fence = fence_of(&d, &node.stat);
            if d.expires_at_ms <= now_ms() {
                self.expire(zk, "release", parent, &node).await?;
                self.wakeups.wake(key);
                return Ok(Round::Done(None));
            }
            let path = format!("{parent}/{}", node.child.name);
            let version = Some(node.stat.version);
            let result = if d.count > 1 {
                d.count -= 1;
                let bytes = serde_json::to_vec(&d).unwrap_or_default();
                call("release", zk.set_data(&path, &bytes, version))
                    .await?
                    .map(|_| ())
            } else {
                d.count = 0;
                call("release", zk.delete(&path, version)).await?
            };
            match result {
                Ok(()) => {
                    if d.count == 0 {
                        lock(&self.leases).remove(token);
                        self.wakeups.wake(key);
                    }
                    Ok(Round::Done(Some(d.count)))
                }
                Err(zk::Error::NoNode) => Ok(Round::Done(None)),
                Err(zk::Error::BadVersion) => Ok(Round::Conflict),
                Err(e) => Err(unavailable("release", e)),
            }
        })
        .await?;
        released.ok_or_else(|| unavailable("release", Message("lease kept changing".into())))
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
        if d.expires_at_ms <= now_ms() {
            self.expire(&zk, "status", &parent, &node).await?;
            lock(&self.leases).remove(token);
            self.wakeups.wake(key);
            return Ok(Status::Gone(Loss::Expired));
        }
        Ok(Status::Held {
            expires_at_ms: d.expires_at_ms,
        })
    }
}
