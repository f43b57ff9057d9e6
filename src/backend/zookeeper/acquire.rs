//! Claim attempts: creating a claim node, granting it when its place, the
//! lock-delay and fairness allow, queueing it otherwise, and deleting nodes
//! no request accounts for.

use std::sync::Arc;
use std::time::Duration;

use zookeeper_client as zk;

use super::data::{CONFIRM_WAIT, Lease, Node, NodeData, Parent};
use super::names::{EXCLUSIVE, READ, WRITE, matches_any, node_prefix};
use super::request::{CLAIM_ROUNDS, Failed, Message, OP_TIMEOUT, call, commit, unavailable};
use super::tree::{At, Found, Listing, admitted, mark_path};
use super::watch::Follower;
use super::{Inner, Queued, Record, ZooKeeper, lock};
use crate::backend::{Attempt, Busy, Error, Grant, Holder, Ticket, Turn};
use crate::clock::{ms, now_ms};
use crate::lock::{Claim, Kind, LockKey, Mode, Token};

/// A claim node of this sidecar as it last wrote it.
#[derive(Debug, Clone)]
pub(super) struct Own {
    /// The node's name under its lock's parent.
    pub(super) name: String,
    /// Its data.
    pub(super) data: NodeData,
    /// Its stat after that write.
    pub(super) stat: zk::Stat,
}

/// `data`, written as granted, as a waiting node's again: `max_hold` is
/// the hold it asks for.
fn waiting(mut data: NodeData, max_hold: Option<u64>) -> NodeData {
    data.held = false;
    data.tentative = false;
    data.since_ms = 0;
    data.expires_at_ms = 0;
    data.cap_ms = max_hold;
    data.fence = 0;
    data
}

/// `data` as a grant at `now` writes it: held, expiring a ttl from now,
/// and, for a claim with a `max_hold`, capped at `now` plus that. A write
/// sent before the listing that admits it is [`tentative`](NodeData::tentative).
fn granted(mut data: NodeData, max_hold: Option<u64>, now: u64, tentative: bool) -> NodeData {
    data.held = true;
    data.tentative = tentative;
    data.since_ms = now;
    data.cap_ms = max_hold.map(|hold| now.saturating_add(hold));
    data.expires_at_ms = now.saturating_add(data.ttl_ms);
    if let Some(cap) = data.cap_ms {
        data.expires_at_ms = data.expires_at_ms.min(cap);
    }
    // The fence is the granting write's zxid, the node's mzxid until a
    // later write stores it.
    data.fence = 0;
    data
}

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
    /// The node's data version after this sidecar's own writes (0: as
    /// created), and whether a write of its own whose answer may be lost
    /// is on its way (one version more). A later version means its owner
    /// took the lease up through another sidecar (re-entered it): then the
    /// node is left alone.
    version: i32,
    writing: bool,
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
                Some((self.version, self.writing)),
            );
            runtime.spawn(discard);
        }
    }
}

/// A waiting node of this sidecar as read again ([`Inner::reread`]).
enum Reread {
    /// A grant written after the listing that admitted it, whose answer
    /// was lost (its owner may have re-entered it since): the claim's.
    Granted(Grant),
    /// Anything else: the node as it is.
    Own(Own),
}

impl Inner {
    /// Whether this sidecar has a claim waiting for `key`.
    fn has_waiters(&self, key: &LockKey) -> bool {
        lock(&self.tickets)
            .range((key.clone(), 0)..)
            .next()
            .is_some_and(|((k, _), _)| k == key)
    }

    /// Waits, at most `wait`, until the node at `path` is no longer at
    /// `version` (rewritten, or gone).
    pub(super) async fn await_change(
        &self,
        zk: &zk::Client,
        op: &'static str,
        path: &str,
        version: i32,
        wait: Duration,
    ) -> Result<(), Error> {
        let watcher = match call(op, zk.check_and_watch_stat(path)).await? {
            Ok((Some(stat), watcher)) if stat.version == version => watcher,
            Ok(_) => return Ok(()),
            Err(e) => return Err(unavailable(op, e)),
        };
        let _ = tokio::time::timeout(wait, watcher.changed()).await;
        Ok(())
    }

    /// Reads the waiting node `own` (ticket `seq` of `key` under `parent`)
    /// again, after a write of this sidecar to it may have run without an
    /// answer, and takes on what it holds. A grant written after its
    /// listing is a grant, whoever wrote it since: this claim's answer,
    /// with the fence it has (ended as an expiry ends a lease if it expired
    /// meanwhile). A tentative write proved nothing, and is looked at again
    /// with the lock.
    async fn reread(
        &self,
        zk: &zk::Client,
        key: &LockKey,
        seq: u64,
        parent: &str,
        own: &Own,
        listed: &Parent,
    ) -> Result<Reread, Error> {
        let op = "try_acquire";
        let path = format!("{parent}/{}", own.name);
        let (bytes, stat) = match call(op, zk.get_data(&path)).await? {
            Ok(read) => read,
            Err(zk::Error::NoNode) => {
                self.forget_ticket(key, seq);
                return Err(unavailable(
                    op,
                    Message("this claim's node is gone (ZooKeeper session ended)".into()),
                ));
            }
            Err(e) => return Err(unavailable(op, e)),
        };
        let Ok(data) = serde_json::from_slice::<NodeData>(&bytes) else {
            return Ok(Reread::Own(own.clone()));
        };
        if data.held && !data.tentative {
            let lease = Lease::read(path, data, &stat);
            if lease.data.expires_at_ms <= self.clock.now() {
                // Changed since it was read (renewed elsewhere): the ticket
                // stays, and the next attempt reads it again.
                if self.expire_lease(zk, op, parent, &lease, None).await? {
                    self.forget_ticket(key, seq);
                }
                return Err(unavailable(
                    op,
                    Message("this claim's grant was not answered before it expired".into()),
                ));
            }
            self.forget_ticket(key, seq);
            return Ok(Reread::Granted(
                self.hold(zk, lease, listed.clone(), false).await?,
            ));
        }
        let own = Own {
            name: own.name.clone(),
            data,
            stat,
        };
        if let Some(queued) = lock(&self.tickets).get_mut(&(key.clone(), seq)) {
            queued.own = own.clone();
        }
        Ok(Reread::Own(own))
    }

    /// Forgets the ticket of the waiting node `seq` of `key`.
    fn forget_ticket(&self, key: &LockKey, seq: u64) {
        lock(&self.tickets).remove(&(key.clone(), seq));
    }

    /// Grants our node `own` with one write, marking it held; its fence is
    /// that write's zxid. A lease with a lock-delay gets its mark in the
    /// same request: written held and not tentative, it may be re-entered
    /// through another sidecar at once. `None` when the node changed or
    /// went meanwhile.
    async fn grant(
        &self,
        zk: &zk::Client,
        path: &str,
        own: &Own,
        max_hold: Option<u64>,
        parent: &Parent,
    ) -> Result<Option<Grant>, Error> {
        let op = "try_acquire";
        let data = granted(own.data.clone(), max_hold, self.clock.now_late(), false);
        let bytes = serde_json::to_vec(&data).unwrap_or_default();
        let mut mark = mark_path(path, data.lock_delay_ms);
        let sent = now_ms();
        let stat = loop {
            let Some(m) = &mark else {
                match call(op, zk.set_data(path, &bytes, Some(own.stat.version))).await? {
                    Ok(stat) => break stat,
                    Err(zk::Error::NoNode | zk::Error::BadVersion) => return Ok(None),
                    Err(e) => return Err(unavailable(op, e)),
                }
            };
            let mut writer = zk.new_multi_writer();
            let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
            for added in [
                writer.add_set_data(path, &bytes, Some(own.stat.version)),
                writer.add_create(m, &[], &opts),
            ] {
                added.map_err(|e| unavailable(op, e))?;
            }
            match commit(op, writer.commit()).await? {
                Ok(results) => match results.first() {
                    Some(zk::MultiWriteResult::SetData { stat }) => break *stat,
                    _ => {
                        return Err(unavailable(op, Message("a write without its stat".into())));
                    }
                },
                Err(Failed {
                    index: 0,
                    error: zk::Error::NoNode | zk::Error::BadVersion,
                }) => return Ok(None),
                // Made already (by a write of this grant whose answer was lost).
                Err(Failed {
                    index: 1,
                    error: zk::Error::NodeExists,
                }) if mark.is_some() => mark = None,
                Err(Failed { error, .. }) => return Err(unavailable(op, error)),
            }
        };
        self.clock.observe(sent, &stat);
        let lease = Lease {
            path: path.to_owned(),
            data,
            version: stat.version,
            fence: u64::try_from(stat.mzxid).unwrap_or(0),
        };
        self.hold(zk, lease, parent.clone(), true).await.map(Some)
    }

    /// Records `lease`, just granted, as this sidecar's, marks it if it has
    /// a lock-delay and is not `marked` already ([`Inner::mark`]), and
    /// answers its grant; if the session was given up meanwhile, or the
    /// mark could not be made, deletes its node instead (unless written
    /// since: re-entered through another sidecar, it is its owner's): this
    /// sidecar never vouched for it.
    async fn hold(
        &self,
        zk: &zk::Client,
        lease: Lease,
        parent: Parent,
        marked: bool,
    ) -> Result<Grant, Error> {
        let token = Token::from_client(lease.data.token.clone());
        let grant = Grant {
            token: token.clone(),
            fence: lease.fence,
            count: lease.data.count,
            since_ms: self.clock.earliest(lease.data.since_ms),
            expires_at_ms: self.clock.earliest(lease.data.expires_at_ms),
        };
        let (path, version) = (lease.path.clone(), lease.version);
        let lock_delay_ms = lease.data.lock_delay_ms;
        // Made before the lease is recorded and answered.
        let marked = if marked {
            Ok(())
        } else {
            self.mark(zk, "try_acquire", &lease).await
        };
        let current = {
            let session = lock(&self.session);
            let current = *session == Some(zk.session_id());
            if current && marked.is_ok() {
                lock(&self.leases).insert(token, Box::new(Record { lease, parent }));
            }
            current
        };
        if !current || marked.is_err() {
            // Its mark once the node is gone (a mark left alone starts a
            // lock-delay, which is the safe side).
            if let Ok(Ok(()) | Err(zk::Error::NoNode)) =
                call("try_acquire", zk.delete(&path, Some(version))).await
                && let Some(mark) = mark_path(&path, lock_delay_ms)
            {
                let _ = call("try_acquire", zk.delete(&mark, None)).await;
            }
            marked?;
            return Err(unavailable(
                "try_acquire",
                Message("the ZooKeeper session was given up while granting".into()),
            ));
        }
        Ok(grant)
    }

    /// Writes `data` over our node `own` at `path`, at the version this
    /// sidecar last wrote, and keeps `unclaimed` and the ticket of `queued`
    /// (key and sequence) in step with it.
    async fn rewrite_own(
        &self,
        (zk, op): (&zk::Client, &'static str),
        path: &str,
        own: Own,
        data: NodeData,
        unclaimed: &mut Option<Unclaimed>,
        queued: (&LockKey, u64),
    ) -> Result<Own, Error> {
        let bytes = serde_json::to_vec(&data).unwrap_or_default();
        if let Some(node) = unclaimed.as_mut() {
            node.writing = true;
        }
        let own = match call(op, zk.set_data(path, &bytes, Some(own.stat.version))).await? {
            Ok(stat) => Own { data, stat, ..own },
            Err(e) => {
                // Answered: the write did not run (a node written since, by
                // a sidecar that ignores `tentative`, is not this one's to
                // delete at a later version).
                if let (Some(node), zk::Error::BadVersion | zk::Error::NoNode) =
                    (unclaimed.as_mut(), &e)
                {
                    node.writing = false;
                }
                return Err(unavailable(op, e));
            }
        };
        if let Some(node) = unclaimed.as_mut() {
            (node.version, node.writing) = (own.stat.version, false);
        }
        if let Some(ticket) = lock(&self.tickets).get_mut(&(queued.0.clone(), queued.1)) {
            ticket.own = own.clone();
        }
        Ok(own)
    }

    /// Re-enters `lease` (held by `claim`'s owner) for `claim` and deletes
    /// our own node `own_path` in the same request, which also makes the
    /// lease's lock-delay mark when `listing` shows none (a lease whose
    /// granting sidecar lost the answer of its grant has none yet). `None`
    /// when either changed meanwhile.
    async fn reenter(
        self: &Arc<Self>,
        zk: &zk::Client,
        lease: &Lease,
        claim: &Claim,
        own: (&str, i32),
        listing: &Listing,
    ) -> Result<Option<Grant>, Error> {
        let op = "try_acquire";
        let mut next = lease.next();
        let now = self.clock.now_late();
        next.count += 1;
        next.expires_at_ms = next.expires_at_ms.max(now.saturating_add(ms(claim.ttl)));
        if let Some(cap) = next.cap_ms {
            next.expires_at_ms = next.expires_at_ms.min(cap);
        }
        let bytes = serde_json::to_vec(&next).unwrap_or_default();
        let mut mark =
            mark_path(&lease.path, lease.data.lock_delay_ms).filter(|m| !listing.has_mark(m));
        let results = loop {
            let mut writer = zk.new_multi_writer();
            for added in [
                writer.add_set_data(&lease.path, &bytes, Some(lease.version)),
                writer.add_delete(own.0, Some(own.1)),
            ] {
                added.map_err(|e| unavailable(op, e))?;
            }
            if let Some(m) = &mark {
                let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                writer
                    .add_create(m, &[], &opts)
                    .map_err(|e| unavailable(op, e))?;
            }
            match commit(op, writer.commit()).await? {
                Ok(results) => break results,
                // Made since the listing.
                Err(Failed {
                    index: 2,
                    error: zk::Error::NodeExists,
                }) if mark.is_some() => mark = None,
                Err(Failed {
                    error: zk::Error::NoNode | zk::Error::BadVersion,
                    ..
                }) => return Ok(None),
                Err(Failed { error, .. }) => return Err(unavailable(op, error)),
            }
        };
        let token = Token::from_client(next.token.clone());
        let ours = match (results.first(), lock(&self.leases).get_mut(&token)) {
            (Some(zk::MultiWriteResult::SetData { stat }), Some(record)) => {
                record.lease.data = next.clone();
                record.lease.version = stat.version;
                true
            }
            (_, record) => record.is_some(),
        };
        if !ours {
            self.follow_reentered(zk, &claim.key, &lease.path, &token);
        }
        Ok(Some(Grant {
            token,
            fence: lease.fence,
            count: next.count,
            since_ms: self.clock.earliest(next.since_ms),
            expires_at_ms: self.clock.earliest(next.expires_at_ms),
        }))
    }

    /// Deletes the children of `parent` whose names start with `prefix`,
    /// retrying while ZooKeeper is unreachable, until they are gone, the
    /// session that owns them ends (which deletes them) or the backend
    /// closes. With `expected` (this sidecar's last version of the node,
    /// and whether a write of its own may have added one), a node written
    /// since by someone else — its owner re-entered the lease through
    /// another sidecar — is theirs, and stays.
    pub(super) async fn discard(
        self: Arc<Self>,
        zk: zk::Client,
        parent: String,
        prefix: String,
        expected: Option<(i32, bool)>,
    ) {
        let mut pause = Duration::from_millis(100);
        loop {
            let attempt = async {
                for name in zk.list_children(&parent).await? {
                    if !name.starts_with(&prefix) {
                        continue;
                    }
                    let path = format!("{parent}/{name}");
                    let mut deleted = zk.delete(&path, expected.map(|(v, _)| v)).await;
                    if let (Err(zk::Error::BadVersion), Some((v, true))) = (&deleted, expected) {
                        deleted = zk.delete(&path, Some(v + 1)).await;
                    }
                    match deleted {
                        Ok(()) | Err(zk::Error::NoNode) => {
                            tracing::info!(backend = "zookeeper", node = %name, %parent,
                                "deleted a claim node its request could not account for");
                        }
                        Err(zk::Error::BadVersion) => {
                            tracing::info!(backend = "zookeeper", node = %name, %parent,
                                "left a claim node its request could not account for: its owner took the lease up");
                        }
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            };
            let done = tokio::select! {
                () = self.closing.cancelled() => return,
                r = crate::clock::within(OP_TIMEOUT, attempt) => r,
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
    ///
    /// A new claim creates its node first, then lists the lock (children,
    /// the lock node's record and the delay node in one request): with
    /// nobody ahead, a try-once claim, written as granted, holds from its
    /// creation (2 requests); a waiting claim is granted by one more write.
    pub(super) async fn attempt(&self, claim: &Claim, turn: Turn<'_>) -> Result<Attempt, Error> {
        let me = &self.inner;
        let zk = me.client().await?;
        let key = &claim.key;
        let parent = me.key_path(key);
        let op = "try_acquire";
        let max_hold = claim.max_hold.map(ms);

        // Our node: the ticket's, or a new one (then untracked until it is
        // a lease or a ticket); and whether the ticket's follower saw what
        // blocked it go.
        // The lock as listed right after our node was created.
        let mut listed = None;
        let (mut own, mut unclaimed, hinted) = match turn {
            Turn::Queued(t) => {
                let (own, hinted, unsure) = {
                    let mut tickets = lock(&me.tickets);
                    let Some(queued) = tickets.get_mut(&(key.clone(), t.seq)) else {
                        return Err(unavailable(
                            op,
                            Message(
                                "the ZooKeeper session ended and this waiter's place went with it"
                                    .into(),
                            ),
                        ));
                    };
                    // Nothing that blocks it changed since it was queued (its
                    // follower would have dropped the answer): the answer then
                    // still holds, unless a timer woke it.
                    if let Some(busy) = queued.answer.take()
                        && busy.retry_at_ms.is_none_or(|at| at > now_ms())
                    {
                        return Ok(Attempt::Busy(*busy));
                    }
                    (
                        queued.own.clone(),
                        std::mem::take(&mut queued.hint),
                        std::mem::take(&mut queued.unsure),
                    )
                };
                if unsure {
                    match me
                        .reread(&zk, key, t.seq, &parent, &own, &Parent::default())
                        .await?
                    {
                        Reread::Granted(grant) => return Ok(Attempt::Granted(grant)),
                        Reread::Own(own) => (own, None, false),
                    }
                } else {
                    (own, None, hinted)
                }
            }
            Turn::Once | Turn::Join => {
                // A permit asked without a limit takes the one in use, and
                // its node records it, as every permit's does: admitted
                // only behind nodes of its own limit, it never holds
                // beside permits taken under another.
                let mut limit = claim.limit;
                if key.kind == Kind::Semaphore && limit.is_none() {
                    let listing = me.children(&zk, op, &parent).await?;
                    let mut known = Vec::new();
                    limit = me
                        .active_limit(&zk, op, &parent, &listing.children, &mut known)
                        .await?;
                    if limit.is_none() {
                        return Err(Error::LimitRequired);
                    }
                }
                let now = me.clock.now_late();
                let mut data = NodeData {
                    token: Token::generate().expose().to_owned(),
                    owner: claim.owner.clone(),
                    sidecar: claim.sidecar.clone(),
                    held: false,
                    since_ms: 0,
                    expires_at_ms: 0,
                    ttl_ms: ms(claim.ttl),
                    cap_ms: max_hold,
                    lock_delay_ms: ms(claim.lock_delay),
                    count: 1,
                    fence: 0,
                    limit,
                    queued_ms: now,
                    tentative: false,
                };
                // A try-once claim never waits: written as granted, it
                // holds from its creation if it is admitted then, and is
                // deleted again if not. So is a join for a lock when this
                // sidecar has nobody waiting for it, which is then most
                // likely free: admitted at once, it needs no granting write
                // (one round trip and one durable write less); else it is
                // written back as waiting below, as a queued claim written
                // as granted with its listing is. Both are tentative on a
                // lock; a permit is never re-entered, and a semaphore
                // waiter's data changes only when it is granted.
                if matches!(turn, Turn::Once) || (key.kind == Kind::Lock && !me.has_waiters(key)) {
                    data = granted(data, max_hold, now, key.kind.is_lock());
                }
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
                    version: 0,
                    writing: false,
                    armed: true,
                };
                let prefix = format!("{parent}/{}", unclaimed.prefix);
                let opts = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
                let mut tries = 0;
                let (stat, seq) = loop {
                    // The listing goes out right behind the create, which
                    // the server answers first: one round trip for both.
                    let sent = now_ms();
                    let create = call(op, zk.create(&prefix, &bytes, &opts));
                    let (created, listing) = tokio::join!(create, me.children(&zk, op, &parent));
                    match created? {
                        Ok(created) => {
                            me.clock.observe(sent, &created.0);
                            listed = listing.ok();
                            break created;
                        }
                        Err(zk::Error::NoNode) if tries < 5 => {
                            tries += 1;
                            me.ensure_parent(&zk, &parent).await?;
                        }
                        Err(e) => return Err(unavailable(op, e)),
                    }
                };
                let own = Own {
                    name: format!("{}{seq}", unclaimed.prefix),
                    data,
                    stat,
                };
                (own, Some(unclaimed), false)
            }
        };
        let path = format!("{parent}/{}", own.name);
        let at = At {
            zk: &zk,
            op,
            key,
            parent: &parent,
        };

        // Whether this attempt waited for a tentative node of its owner, and
        // whether that node is still unconfirmed.
        let (mut awaited, mut unconfirmed) = (false, false);
        // Whether `own` was written as granted by this attempt (its create,
        // or the write sent with its first listing): only then is the
        // listing that follows it the one that tells whether it is a grant.
        let mut fresh = unclaimed.is_some() && own.data.held;
        for round in 0..CLAIM_ROUNDS {
            // A lock waiter whose blocker went is first now, most likely:
            // the write that grants it goes out before the listing that
            // confirms it, both in one round trip (see below for when the
            // write counts as the grant, and for its undoing).
            let listing = if let Some(listing) = listed.take() {
                listing
            } else if round == 0
                && hinted
                && key.kind.is_lock()
                && !me.grants_by_listing(key.kind, claim.mode)
                && !own.data.held
            {
                let data = granted(own.data.clone(), max_hold, me.clock.now_late(), true);
                let bytes = serde_json::to_vec(&data).unwrap_or_default();
                // Sent as the request's future is made, before the listing's.
                if let Some(node) = unclaimed.as_mut() {
                    node.writing = true;
                }
                let sent = now_ms();
                let write = call(op, zk.set_data(&path, &bytes, Some(own.stat.version)));
                let (written, listing) = tokio::join!(write, me.children(&zk, op, &parent));
                match written? {
                    Ok(stat) => {
                        me.clock.observe(sent, &stat);
                        if let Some(node) = unclaimed.as_mut() {
                            (node.version, node.writing) = (stat.version, false);
                        }
                        own = Own { data, stat, ..own };
                        fresh = true;
                        if let Turn::Queued(t) = turn
                            && let Some(queued) = lock(&me.tickets).get_mut(&(key.clone(), t.seq))
                        {
                            queued.own = own.clone();
                        }
                    }
                    Err(zk::Error::NoNode) => {
                        if let Turn::Queued(t) = turn {
                            me.forget_ticket(key, t.seq);
                        }
                        return Err(unavailable(
                            op,
                            Message("this claim's node is gone (ZooKeeper session ended)".into()),
                        ));
                    }
                    Err(e) => return Err(unavailable(op, e)),
                }
                listing?
            } else {
                me.children(&zk, op, &parent).await?
            };
            // A lease lost with its session: its lock-delay starts now,
            // before anyone is admitted (a claim written as granted before
            // it is then no grant: it would fall inside the delay).
            if me.start_lost_delays(&zk, op, &parent, &listing).await? {
                continue;
            }
            let children = &listing.children;
            let Some(index) = children.iter().position(|c| c.name == own.name) else {
                if let Turn::Queued(t) = turn {
                    me.forget_ticket(key, t.seq);
                }
                return Err(unavailable(
                    op,
                    Message("this claim's node is gone (ZooKeeper session ended)".into()),
                ));
            };
            let seq = children[index].seq;
            let mut known = vec![Node {
                child: children[index].clone(),
                data: Some(own.data.clone()),
                stat: own.stat,
            }];
            // Semaphore limit: the first node's limit is the active one.
            let mut limit = 0;
            if key.kind == Kind::Semaphore {
                let asked = own.data.limit.or(claim.limit);
                limit = me
                    .active_limit(&zk, op, &parent, children, &mut known)
                    .await?
                    .or(asked)
                    .unwrap_or(1);
                if let Some(asked) = asked
                    && asked != limit
                    && claim.limit.is_none()
                {
                    // Sent without a limit, it took the one in use when
                    // it was made; the semaphore has another since (it
                    // went idle, and a claim brought a new one): it takes
                    // that one, as it would have had it come now.
                    let mut data = own.data.clone();
                    data.limit = Some(limit);
                    own = me
                        .rewrite_own((&zk, op), &path, own, data, &mut unclaimed, (key, seq))
                        .await?;
                    continue;
                }
                if let Some(asked) = asked
                    && asked != limit
                {
                    if unclaimed.is_some()
                        && let Ok(()) | Err(zk::Error::NoNode) =
                            call(op, zk.delete(&path, None)).await?
                    {
                        Unclaimed::settle(&mut unclaimed);
                    }
                    return Err(Error::LimitMismatch { active: limit });
                }
            }
            let by_place = admitted(children, index, key.kind, limit);
            // The admitted nodes ahead of ours (expired leases deleted).
            // One found gone changes nothing for a claim that waits anyway
            // (its follower sees what blocks it); for one admitted by
            // place, the holders and the fairness it saw are out of date.
            let (ahead, found) = me
                .admitted_nodes(at, &listing, limit, Some(index), &known)
                .await?;
            if found == Found::Expired || (found == Found::Gone && by_place) {
                continue;
            }
            // A permit is admitted only behind permits of its own limit: a
            // node ahead with another (a claim that has not yet seen that
            // it mismatches, or one whose answer was lost) would make its
            // limit the active one once the first node leaves, while the
            // permits admitted under this one are still held. Its place
            // admits it (every node ahead is in `ahead`): it waits for
            // that node to go.
            let mixed = (key.kind == Kind::Semaphore && by_place)
                .then(|| {
                    ahead
                        .iter()
                        .find(|n| n.data.as_ref().and_then(|d| d.limit) != Some(limit))
                        .map(|n| n.child.name.clone())
                })
                .flatten();
            let by_place = by_place && mixed.is_none();

            // Re-entry: the same owner holding the lock in the same mode,
            // by a grant this sidecar made or one its holder wrote since.
            // A tentative node of another sidecar may never have been a
            // grant: wait a moment for its sidecar to confirm it (or for it
            // to go); unconfirmed, it is a holder like any other.
            // A waiting exclusive node first in line may be a lease its
            // sidecar granted by its listing and has not written yet: the
            // same.
            // (A lease over for its holder — told it ended, though the
            // servers' clock may not be there yet — is never re-entered:
            // its owner was told it is lost. Nor is a lease of a session
            // this sidecar gave up, whose token it revoked and reported
            // lost: its node stays until the session, resumed, is buried
            // or the server expires it, and is a holder like any other
            // until then.)
            // No grant by listing is made while a lock-delay runs: a
            // waiting node is then only a waiter.
            let may_be_granted = |mode| {
                me.grants_by_listing(key.kind, mode) && listing.delay_until_ms() <= me.clock.now()
            };
            let same_owner = ahead.iter().find(|n| {
                n.data.as_ref().is_some_and(|d| {
                    d.owner == claim.owner
                        && (d.held || may_be_granted(n.child.mode))
                        && !(d.held && me.clock.earliest(d.expires_at_ms) <= now_ms())
                        && !me.is_revoked(&Token::from_client(d.token.clone()))
                }) && n.child.mode == claim.mode
            });
            // (This sidecar reads its own lease granted by its listing as
            // held and tentative: `Inner::read`.)
            let reentered = same_owner.and_then(|node| {
                let d = node.data.as_ref().filter(|d| d.held)?;
                let ours = || lock(&me.leases).contains_key(&Token::from_client(d.token.clone()));
                (!d.tentative || ours()).then(|| Lease::of(&parent, node, d))
            });
            if key.kind.is_lock()
                && let Some(node) = same_owner
                && reentered.is_none()
            {
                if !awaited {
                    awaited = true;
                    let path = format!("{parent}/{}", node.child.name);
                    me.await_change(&zk, op, &path, node.stat.version, CONFIRM_WAIT)
                        .await?;
                    continue;
                }
                unconfirmed = true;
            } else if key.kind.is_lock()
                && let Some(lease) = &reentered
            {
                match me
                    .reenter(&zk, lease, claim, (&path, own.stat.version), &listing)
                    .await?
                {
                    Some(grant) => {
                        if let Turn::Queued(t) = turn {
                            me.forget_ticket(key, t.seq);
                        }
                        Unclaimed::settle(&mut unclaimed);
                        return Ok(Attempt::Granted(grant));
                    }
                    None => continue,
                }
            }

            let now = me.clock.now();
            let queue_ahead = ahead.iter().filter(|n| !n.is_held()).count();
            // Once/Join: busy while anyone waits ahead (fairness).
            let fair = !matches!(turn, Turn::Once | Turn::Join)
                || (queue_ahead == 0 && ahead.len() == index);
            let delay_until = listing.delay_until_ms();
            let delayed = delay_until > now;
            if !delayed && let Some((_, version)) = listing.delay {
                me.clear_delay(&zk, op, &parent, version).await;
            }
            if by_place && fair && !delayed {
                // Written as granted (created so, or by the write sent
                // with the listing), no claim joined or left since that
                // write, and no holder ahead (a reader, a permit) granted
                // after it: it held from that write, whose zxid is its
                // fence, above every earlier grant's. Else a claim ahead
                // may have been granted after that write (a grant by
                // `setData` moves no `pzxid`), and this grant, which
                // counted on it being held (fairness), is answered after
                // it: only a new write's zxid is sure to be above that.
                // (Not after waiting for a tentative node: the write is
                // then a second old, and a lock-delay may have ended in
                // between — the write's zxid would be inside it.)
                // (Nor when a lock-delay ended after the write was made:
                // the write would be inside it.)
                let grant = if own.data.held
                    && fresh
                    && !awaited
                    && i64::try_from(delay_until).is_ok_and(|until| until <= own.stat.mtime)
                    && listing.untouched_since(own.stat.mzxid)
                    && ahead
                        .iter()
                        .all(|n| n.fence() < u64::try_from(own.stat.mzxid).unwrap_or(0))
                {
                    let lease = Lease::read(path.clone(), own.data.clone(), &own.stat);
                    let grant = me.hold(&zk, lease, listing.parent.clone(), false).await?;
                    if own.data.tentative {
                        me.confirm_later(&grant.token);
                    }
                    Some(grant)
                } else if me.grants_by_listing(key.kind, claim.mode)
                    && !own.data.held
                    && let Some(stat) = listing.stat
                {
                    // Granted by this listing, without a write: every
                    // earlier holder's node was deleted before it, so the
                    // lock node's `pzxid` (the zxid of the last claim
                    // created or deleted) is above every earlier fence, and
                    // no later grant comes before this node is deleted.
                    // Written held with that fence once it has been held
                    // a moment (as a tentative grant is confirmed): a
                    // lease released at once costs no write.
                    let lease = Lease {
                        path: path.clone(),
                        data: granted(own.data.clone(), max_hold, me.clock.now_late(), true),
                        version: own.stat.version,
                        fence: u64::try_from(stat.pzxid).unwrap_or(0),
                    };
                    let grant = me.hold(&zk, lease, listing.parent.clone(), false).await?;
                    me.confirm_later(&grant.token);
                    Some(grant)
                } else {
                    if let Some(node) = unclaimed.as_mut() {
                        node.writing = true;
                    }
                    let grant = me
                        .grant(&zk, &path, &own, max_hold, &listing.parent)
                        .await?;
                    if let Some(node) = unclaimed.as_mut() {
                        node.writing = false;
                    }
                    grant
                };
                if let Some(grant) = grant {
                    if let Turn::Queued(t) = turn {
                        me.forget_ticket(key, t.seq);
                    }
                    Unclaimed::settle(&mut unclaimed);
                    return Ok(Attempt::Granted(grant));
                }
                // Nobody else writes a waiting node: its version moved by a
                // write of this sidecar whose answer was lost. Read it
                // again: else every later grant missed the version, and the
                // node, held, blocked the lock until the waiter gave up.
                if let Turn::Queued(t) = turn {
                    match me
                        .reread(&zk, key, t.seq, &parent, &own, &listing.parent)
                        .await?
                    {
                        Reread::Granted(grant) => return Ok(Attempt::Granted(grant)),
                        Reread::Own(read) => {
                            (own, fresh) = (read, false);
                            continue;
                        }
                    }
                }
            }
            // Busy.
            let holders: Vec<Holder> = ahead
                .iter()
                .filter(|n| n.is_held())
                .map(|n| n.holder(claim.key.kind, &me.clock))
                .collect();
            let blocking = ahead
                .iter()
                .filter(|n| n.is_held())
                .filter(|n| claim.mode == Mode::Exclusive || n.child.mode == Mode::Exclusive)
                .map(Node::expires_at_ms)
                .min();
            let mut retry_at_ms =
                if delayed { Some(delay_until) } else { blocking }.map(|at| me.clock.surely(at));
            // A waiter's follower sees its blocker go, not its confirmation:
            // one behind its owner's unconfirmed node looks again soon.
            if unconfirmed {
                let soon = now_ms() + ms(CONFIRM_WAIT);
                retry_at_ms = Some(retry_at_ms.map_or(soon, |at| at.min(soon)));
            }
            let waiting_total = children.len() - holders.len().min(children.len());
            let mut busy = Busy {
                holders,
                omitted: 0,
                queue_length: waiting_total,
                position: None,
                retry_at_ms,
                ticket: None,
            };
            let position = children[..index]
                .iter()
                .filter(|c| !ahead.iter().any(|n| n.child.name == c.name && n.is_held()))
                .count()
                + 1;
            // A waiter written as granted (created so, or with its
            // listing) waits again.
            if own.data.held && !matches!(turn, Turn::Once) {
                let data = waiting(own.data.clone(), max_hold);
                own = me
                    .rewrite_own((&zk, op), &path, own, data, &mut unclaimed, (key, seq))
                    .await?;
            }
            match turn {
                Turn::Once => {
                    if let Ok(()) | Err(zk::Error::NoNode) =
                        call(op, zk.delete(&path, None)).await?
                    {
                        Unclaimed::settle(&mut unclaimed);
                    }
                    busy.queue_length = waiting_total.saturating_sub(1);
                    return Ok(Attempt::Busy(busy));
                }
                Turn::Join => {
                    busy.position = Some(position);
                    let mut tickets = lock(&me.tickets);
                    // Only this sidecar's first waiter on the key attempts
                    // at once; the others keep no answer (it would stay in
                    // memory for as long as they wait).
                    let first = tickets
                        .range((key.clone(), 0)..(key.clone(), seq))
                        .next()
                        .is_none();
                    tickets.insert(
                        (key.clone(), seq),
                        Box::new(Queued {
                            own: own.clone(),
                            follower: None,
                            answer: first.then(|| Box::new(busy.clone())),
                            hint: false,
                            unsure: false,
                            mixed: None,
                        }),
                    );
                    drop(tickets);
                    Unclaimed::settle(&mut unclaimed);
                    busy.ticket = Some(Ticket {
                        key: key.clone(),
                        seq,
                    });
                }
                Turn::Queued(_) => busy.position = Some(position),
            }
            // Admitted by place and fair, it waits for the lock-delay to
            // end: its timer (`retry_at_ms`) wakes it, no node blocks it.
            // Else watch what blocks it before answering, so no release
            // is missed.
            let waits_for_delay = by_place && fair && delayed;
            let following = lock(&me.tickets)
                .get_mut(&(key.clone(), seq))
                .is_some_and(|q| {
                    q.mixed.clone_from(&mixed);
                    q.follower.is_some()
                });
            if !waits_for_delay && !following {
                Follower {
                    me: me.clone(),
                    zk: zk.clone(),
                    key: key.clone(),
                    seq,
                    listing: Some(listing),
                }
                .spawn();
            }
            return Ok(Attempt::Busy(busy));
        }
        Err(unavailable(
            op,
            Message("the lock's children kept changing".into()),
        ))
    }

    /// [`Backend::dequeue`]: deletes the ticket's node, in the background
    /// while ZooKeeper is unreachable.
    pub(super) async fn dequeue_node(&self, ticket: &Ticket) -> Result<(), Error> {
        let me = &self.inner;
        let queued = lock(&me.tickets).remove(&(ticket.key.clone(), ticket.seq));
        let Some(queued) = queued else { return Ok(()) };
        let (name, version) = (queued.own.name.clone(), queued.own.stat.version);
        let zk = me.client().await?;
        let parent = me.key_path(&ticket.key);
        let path = format!("{parent}/{name}");
        let mut deleted = call("dequeue", zk.delete(&path, Some(version))).await;
        // Written since this sidecar last knew it: by a write of its own
        // whose answer was lost, or whose attempt was given up. A granting
        // write after the listing that admitted it made the node a lease
        // (its owner may have re-entered it since): the waiter leaving
        // gives back its one hold, as a grant that races with a disconnect
        // is released. Anything else is deleted.
        if let Ok(Err(zk::Error::BadVersion)) = deleted {
            let read = match call("dequeue", zk.get_data(&path)).await {
                Ok(read) => read,
                Err(e) => {
                    let expected = Some((version, true));
                    tokio::spawn(me.clone().discard(zk, parent, name, expected));
                    return Err(e);
                }
            };
            match read {
                Ok((bytes, stat)) => {
                    if let Ok(data) = serde_json::from_slice::<NodeData>(&bytes)
                        && data.held
                        && !data.tentative
                    {
                        let token = Token::from_client(data.token.clone());
                        let lease = Lease::read(path, data, &stat);
                        me.hold(&zk, lease, Parent::default(), false).await?;
                        me.release(&ticket.key, &token).await?;
                        return Ok(());
                    }
                    deleted = call("dequeue", zk.delete(&path, Some(stat.version))).await;
                }
                Err(zk::Error::NoNode) => return Ok(()),
                Err(e) => return Err(unavailable("dequeue", e)),
            }
        }
        match deleted {
            Ok(Ok(()) | Err(zk::Error::NoNode)) => Ok(()),
            Ok(Err(e)) => Err(unavailable("dequeue", e)),
            // The ticket is forgotten already: its node must not outlive it
            // (unless a write of its own since made it its owner's lease).
            Err(e) => {
                let expected = Some((version, true));
                tokio::spawn(me.clone().discard(zk, parent, name, expected));
                Err(e)
            }
        }
    }
}
