//! Claim attempts: creating a claim node, granting it when its place, the
//! lock-delay and fairness allow, queueing it otherwise, and deleting nodes
//! no request accounts for.

use std::sync::Arc;
use std::time::Duration;

use zookeeper_client as zk;

use super::data::{Node, NodeData, fence_of};
use super::names::{EXCLUSIVE, READ, WRITE, matches_any, node_prefix};
use super::request::{Message, OP_TIMEOUT, call, unavailable};
use super::tree::admitted;
use super::{Inner, Queued, ZooKeeper, lock};
use crate::backend::{Attempt, Backend, Busy, Error, Grant, Holder, Ticket, Turn};
use crate::clock::{ms, now_ms};
use crate::lock::{Claim, Kind, LockKey, Mode, Token};

/// A claim node this sidecar is creating, or created, that nothing tracks
/// yet: not a lease, not a ticket. If the create's answer is lost
/// (`ConnectionLoss`: the node may exist all the same), or the request fails
/// or is cancelled before the node becomes a lease or a ticket, dropping
/// this deletes the node in the background. Otherwise the node would stay
/// while this sidecar's session lives, and block the queue for everyone.
/// The node is found by its name prefix, as Curator's protected mode does.
struct Unclaimed {
    me: Arc<Inner>,
    zk: zk::Client,
    parent: String,
    /// The node's name without its sequence: `_c_<uuid>-<infix>`.
    prefix: String,
    armed: bool,
}

impl Unclaimed {
    /// The node in `slot`, if any, is accounted for (a lease, a ticket, or
    /// deleted).
    fn settle(slot: &mut Option<Self>) {
        if let Some(mut node) = slot.take() {
            node.armed = false;
        }
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Outside a runtime (the process is ending) the session closes
        // with it, which deletes the node.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let discard = self.me.clone().discard(
                self.zk.clone(),
                std::mem::take(&mut self.parent),
                std::mem::take(&mut self.prefix),
            );
            runtime.spawn(discard);
        }
    }
}

impl Inner {
    /// Forgets the ticket of the waiting node `seq` of `key`.
    fn forget_ticket(&self, key: &LockKey, seq: u64) {
        lock(&self.tickets).remove(&(key.clone(), seq));
    }

    /// Grants the waiting node `node` (ours): marks it held and takes its fence.
    async fn grant(
        &self,
        zk: &zk::Client,
        parent: &str,
        path: &str,
        mut data: NodeData,
        version: i32,
    ) -> Result<Option<Grant>, Error> {
        let now = now_ms();
        data.held = true;
        data.since_ms = now;
        data.cap_ms = data.cap_ms.map(|hold| now.saturating_add(hold));
        data.expires_at_ms = now.saturating_add(data.ttl_ms);
        if let Some(cap) = data.cap_ms {
            data.expires_at_ms = data.expires_at_ms.min(cap);
        }
        // One write grants: the fence is its zxid, above every earlier
        // grant's, ever (the node's mzxid until a later write stores it).
        data.fence = 0;
        let bytes = serde_json::to_vec(&data).unwrap_or_default();
        let stat = match call("try_acquire", zk.set_data(path, &bytes, Some(version))).await? {
            Ok(stat) => stat,
            Err(zk::Error::NoNode | zk::Error::BadVersion) => return Ok(None),
            Err(e) => return Err(unavailable("try_acquire", e)),
        };
        data.fence = fence_of(&data, &stat);
        let fence = data.fence;
        self.update_parent(zk, "try_acquire", parent, |p| p.fence = p.fence.max(fence))
            .await?;
        let token = Token::from_client(data.token.clone());
        let current = {
            let session = lock(&self.session);
            let current = *session == Some(zk.session_id());
            if current {
                lock(&self.leases).insert(token.clone(), path.to_owned());
            }
            current
        };
        if !current {
            // The session was given up while granting: this lease was never vouched for.
            let _ = call("try_acquire", zk.delete(path, None)).await;
            return Err(unavailable(
                "try_acquire",
                Message("the ZooKeeper session was given up while granting".into()),
            ));
        }
        Ok(Some(Grant {
            token,
            fence: data.fence,
            count: 1,
            since_ms: data.since_ms,
            expires_at_ms: data.expires_at_ms,
        }))
    }

    /// Deletes the children of `parent` whose names start with `prefix`,
    /// retrying while ZooKeeper is unreachable, until they are gone, the
    /// session that owns them ends (which deletes them) or the backend
    /// closes.
    async fn discard(self: Arc<Self>, zk: zk::Client, parent: String, prefix: String) {
        let mut pause = Duration::from_millis(100);
        loop {
            let attempt = async {
                for name in zk.list_children(&parent).await? {
                    if name.starts_with(&prefix) {
                        match zk.delete(&format!("{parent}/{name}"), None).await {
                            Ok(()) | Err(zk::Error::NoNode) => {
                                tracing::info!(backend = "zookeeper", node = %name, %parent,
                                    "deleted a claim node its request could not account for");
                            }
                            Err(e) => return Err(e),
                        }
                    }
                }
                Ok(())
            };
            let done = tokio::select! {
                () = self.closing.cancelled() => return,
                r = tokio::time::timeout(OP_TIMEOUT, attempt) => r,
            };
            match done {
                Ok(
                    Ok(())
                    | Err(zk::Error::NoNode | zk::Error::SessionExpired | zk::Error::ClientClosed),
                ) => return,
                Ok(Err(e)) => tracing::debug!(backend = "zookeeper", error = %e, %parent,
                    "retrying the deletion of an unaccounted claim node"),
                Err(_) => {}
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }
}

impl ZooKeeper {
    /// One claim attempt ([`Backend::try_acquire`] without its retry of a
    /// waiter cut off for a moment).
    pub(super) async fn attempt(&self, claim: &Claim, turn: Turn<'_>) -> Result<Attempt, Error> {
        let me = &self.inner;
        let zk = me.client().await?;
        let key = &claim.key;
        let parent = me.key_path(key);
        let op = "try_acquire";

        // Re-entry: the same owner holding the lock in the same mode.
        if key.kind.is_lock() {
            let (_, nodes, _) = me.snapshot(&zk, op, key, &parent).await?;
            for node in &nodes {
                let Some(d) = &node.data else { continue };
                if !(d.held && d.owner == claim.owner && node.child.mode == claim.mode) {
                    continue;
                }
                let mut d = d.clone();
                d.fence = fence_of(&d, &node.stat);
                let now = now_ms();
                d.count += 1;
                d.expires_at_ms = d.expires_at_ms.max(now.saturating_add(ms(claim.ttl)));
                if let Some(cap) = d.cap_ms {
                    d.expires_at_ms = d.expires_at_ms.min(cap);
                }
                let path = format!("{parent}/{}", node.child.name);
                let bytes = serde_json::to_vec(&d).unwrap_or_default();
                match call(op, zk.set_data(&path, &bytes, Some(node.stat.version))).await? {
                    Ok(_) => {}
                    Err(zk::Error::NoNode | zk::Error::BadVersion) => {
                        return Box::pin(self.try_acquire(claim, turn)).await;
                    }
                    Err(e) => return Err(unavailable(op, e)),
                }
                if let Turn::Queued(t) = turn {
                    self.dequeue(t).await?;
                }
                return Ok(Attempt::Granted(Grant {
                    token: Token::from_client(d.token.clone()),
                    fence: d.fence,
                    count: d.count,
                    since_ms: d.since_ms,
                    expires_at_ms: d.expires_at_ms,
                }));
            }
        }

        // Our node: the ticket's, or a new one (then untracked until it is
        // a lease or a ticket).
        let (name, mut unclaimed) = match turn {
            Turn::Queued(t) => {
                let known = lock(&me.tickets)
                    .get(&(key.clone(), t.seq))
                    .map(|q| q.name.clone());
                let Some(name) = known else {
                    return Err(unavailable(
                        op,
                        Message(
                            "the ZooKeeper session ended and this waiter's place went with it"
                                .into(),
                        ),
                    ));
                };
                (name, None)
            }
            Turn::Once | Turn::Join => {
                if key.kind == Kind::Semaphore && claim.limit.is_none() {
                    let children = me.children(&zk, op, &parent).await?;
                    if children.is_empty() {
                        return Err(Error::LimitRequired);
                    }
                }
                let data = NodeData {
                    token: Token::generate().expose().to_owned(),
                    owner: claim.owner.clone(),
                    sidecar: claim.sidecar.clone(),
                    held: false,
                    since_ms: 0,
                    expires_at_ms: 0,
                    ttl_ms: ms(claim.ttl),
                    cap_ms: claim.max_hold.map(ms),
                    lock_delay_ms: ms(claim.lock_delay),
                    count: 1,
                    fence: 0,
                    limit: claim.limit,
                    queued_ms: now_ms(),
                };
                let bytes = serde_json::to_vec(&data).unwrap_or_default();
                let infix = match (key.kind, claim.mode) {
                    (Kind::Semaphore, _) => EXCLUSIVE,
                    (Kind::Lock | Kind::Election, Mode::Shared) => READ,
                    (Kind::Lock, Mode::Exclusive)
                        if matches_any(&me.rw_locks, key.name.as_str()) =>
                    {
                        WRITE
                    }
                    (Kind::Lock | Kind::Election, Mode::Exclusive) => EXCLUSIVE,
                };
                // Armed before the create: its answer may be lost.
                let unclaimed = Unclaimed {
                    me: me.clone(),
                    zk: zk.clone(),
                    parent: parent.clone(),
                    prefix: node_prefix(infix),
                    armed: true,
                };
                let prefix = format!("{parent}/{}", unclaimed.prefix);
                let opts = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
                let mut tries = 0;
                let seq = loop {
                    match call(op, zk.create(&prefix, &bytes, &opts)).await? {
                        Ok((_, seq)) => break seq,
                        Err(zk::Error::NoNode) if tries < 5 => {
                            tries += 1;
                            me.ensure_parent(&zk, &parent).await?;
                        }
                        Err(e) => return Err(unavailable(op, e)),
                    }
                };
                (format!("{}{seq}", unclaimed.prefix), Some(unclaimed))
            }
        };
        let path = format!("{parent}/{name}");

        let (children, nodes, limit) = me.snapshot(&zk, op, key, &parent).await?;
        let Some(at) = children.iter().position(|c| c.name == name) else {
            if let Turn::Queued(t) = turn {
                me.forget_ticket(key, t.seq);
            }
            return Err(unavailable(
                op,
                Message("this waiter's node is gone (ZooKeeper session ended)".into()),
            ));
        };
        let seq = children[at].seq;
        // Semaphore limit: the first node's limit is the active one.
        if key.kind == Kind::Semaphore
            && let Some(asked) = claim.limit
            && asked != limit
        {
            if unclaimed.is_some()
                && let Ok(()) | Err(zk::Error::NoNode) = call(op, zk.delete(&path, None)).await?
            {
                Unclaimed::settle(&mut unclaimed);
            }
            return Err(Error::LimitMismatch { active: limit });
        }
        // Read by the snapshot when admitted by place; else read it now.
        let own = match nodes.iter().find(|n| n.child.name == name) {
            Some(node) => Some(node.clone()),
            None => me.read(&zk, op, &parent, &children[at]).await?,
        };
        let Some(own) = own else {
            return Err(unavailable(
                op,
                Message("this claim's node vanished".into()),
            ));
        };
        let now = now_ms();
        let (pdata, _) = me.parent_data(&zk, op, &parent).await?;
        let ahead: Vec<&Node> = nodes.iter().filter(|n| n.child.seq < seq).collect();
        let queue_ahead = ahead.iter().filter(|n| !n.is_held()).count();
        let by_place = admitted(&children, at, key.kind, limit);
        // Once/Join: busy while anyone waits ahead (fairness).
        let fair = !matches!(turn, Turn::Once | Turn::Join)
            || (queue_ahead == 0
                && children[..at]
                    .iter()
                    .all(|c| nodes.iter().any(|n| n.child.name == c.name)));
        // Parents written before delay nodes existed may carry a delay too.
        let (marked, marker) = me.delay(&zk, op, &parent).await?;
        let delay_until = marked.max(pdata.delay_until_ms);
        let delayed = delay_until > now;
        if !delayed && let Some(version) = marker {
            me.clear_delay(&zk, op, &parent, version).await;
        }
        if by_place
            && fair
            && !delayed
            && let Some(d) = own.data.clone()
            && let Some(grant) = me.grant(&zk, &parent, &path, d, own.stat.version).await?
        {
            if let Turn::Queued(t) = turn {
                me.forget_ticket(key, t.seq);
            }
            Unclaimed::settle(&mut unclaimed);
            return Ok(Attempt::Granted(grant));
        }

        // Busy.
        let holders: Vec<Holder> = nodes
            .iter()
            .filter(|n| n.is_held())
            .map(|n| n.holder(claim.key.kind))
            .collect();
        let blocking = nodes
            .iter()
            .filter(|n| n.child.seq < seq && n.is_held())
            .filter(|n| claim.mode == Mode::Exclusive || n.child.mode == Mode::Exclusive)
            .map(|n| n.holder(claim.key.kind).expires_at_ms)
            .min();
        let retry_at_ms = if delayed { Some(delay_until) } else { blocking };
        let waiting_total = children.len() - holders.len().min(children.len());
        let mut busy = Busy {
            holders,
            queue_length: waiting_total,
            position: None,
            retry_at_ms,
            ticket: None,
        };
        let position = children[..at]
            .iter()
            .filter(|c| !nodes.iter().any(|n| n.child.name == c.name && n.is_held()))
            .count()
            + 1;
        match turn {
            Turn::Once => {
                if let Ok(()) | Err(zk::Error::NoNode) = call(op, zk.delete(&path, None)).await? {
                    Unclaimed::settle(&mut unclaimed);
                }
                busy.queue_length = waiting_total.saturating_sub(1);
                return Ok(Attempt::Busy(busy));
            }
            Turn::Join => {
                lock(&me.tickets).insert(
                    (key.clone(), seq),
                    Queued {
                        name: name.clone(),
                        following: false,
                    },
                );
                Unclaimed::settle(&mut unclaimed);
                busy.ticket = Some(Ticket {
                    key: key.clone(),
                    seq,
                });
                busy.position = Some(position);
            }
            Turn::Queued(_) => busy.position = Some(position),
        }
        // Watch what blocks this node before answering, so no release is missed.
        let follower = me.clone();
        let (zk2, key2, parent2) = (zk.clone(), key.clone(), parent.clone());
        let following = lock(&me.tickets)
            .get(&(key.clone(), seq))
            .is_some_and(|q| q.following);
        if !following {
            tokio::spawn(follower.follow(zk2, key2, parent2, name, children));
        }
        Ok(Attempt::Busy(busy))
    }

    /// [`Backend::dequeue`]: deletes the ticket's node, in the background
    /// while ZooKeeper is unreachable.
    pub(super) async fn dequeue_node(&self, ticket: &Ticket) -> Result<(), Error> {
        let me = &self.inner;
        let name = lock(&me.tickets)
            .remove(&(ticket.key.clone(), ticket.seq))
            .map(|q| q.name);
        let Some(name) = name else { return Ok(()) };
        let zk = me.client().await?;
        let parent = me.key_path(&ticket.key);
        let path = format!("{parent}/{name}");
        match call("dequeue", zk.delete(&path, None)).await {
            Ok(Ok(()) | Err(zk::Error::NoNode)) => Ok(()),
            Ok(Err(e)) => Err(unavailable("dequeue", e)),
            // The ticket is forgotten already: its node must not outlive it.
            Err(e) => {
                tokio::spawn(me.clone().discard(zk, parent, name));
                Err(e)
            }
        }
    }
}
