//! A lock's node tree: its parent node, the listing shared by concurrent
//! callers (children, the parent's record and the delay node in one
//! request), and the snapshot of claims that deletes expired leases on its
//! way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use zookeeper_client as zk;

use super::data::{CONFIRM_WAIT, Lease, Node, NodeData, Parent, ParentData};
use super::names::{Child, DELAY_NODE, Mark, parse_child, sorted};
use super::request::{
    CLAIM_ROUNDS, Failed, Message, PARENT_ROUNDS, Round, call, commit, retry_on_conflict,
    unavailable,
};
use super::{Inner, lock};
use crate::backend::Error;
use crate::lock::{Kind, LockKey, Mode, Token};

/// What one listing of a lock node found.
#[derive(Debug, Default)]
pub(super) struct Listing {
    /// The claims, sorted by sequence: the queue.
    pub(super) children: Vec<Child>,
    /// The lock node's stat, read after its children; `None` when there is
    /// no lock node.
    pub(super) stat: Option<zk::Stat>,
    /// The lock node's record and version.
    pub(super) parent: Parent,
    /// The end of the lock-delay in the delay node and that node's version,
    /// when there is one.
    pub(super) delay: Option<(u64, i32)>,
    /// The lock-delay marks of leases ([`Mark`]).
    pub(super) marks: Vec<Mark>,
}

impl Listing {
    /// When the lock-delay ends (0: none), in the delay node or, written
    /// by older sidecars, in the lock node's own record.
    pub(super) fn delay_until_ms(&self) -> u64 {
        self.delay
            .map_or(0, |(until, _)| until)
            .max(self.parent.data.delay_until_ms)
    }

    /// The marks whose lease's node is gone: leases lost with their
    /// session, whose lock-delay is still to start.
    pub(super) fn orphans(&self) -> Vec<&Mark> {
        self.marks
            .iter()
            .filter(|m| !self.children.iter().any(|c| c.seq == m.seq))
            .collect()
    }

    /// Whether the mark at path `mark` ([`mark_path`]) was listed.
    pub(super) fn has_mark(&self, mark: &str) -> bool {
        self.marks.iter().any(|m| {
            mark.rsplit_once('/')
                .is_some_and(|(_, name)| name == m.name)
        })
    }

    /// Whether no claim was created or deleted under the lock node after
    /// the write with zxid `zxid` (the lock node's `pzxid` is the zxid of
    /// the last of those).
    pub(super) fn untouched_since(&self, zxid: i64) -> bool {
        self.stat.is_some_and(|s| s.pzxid <= zxid)
    }
}

/// A caller of [`Inner::children`]; the last one to leave (also when its
/// future is dropped) removes the parent's [`Lister`] and its listing.
struct ListerUse<'a> {
    listers: &'a Mutex<HashMap<(i64, String), Arc<Lister>>>,
    id: (i64, String),
    /// This caller's handle of the parent's lister, taken in the map's
    /// entry under the map's lock and given back under it when it leaves.
    lister: Option<Arc<Lister>>,
}

impl ListerUse<'_> {
    fn lister(&self) -> &Lister {
        self.lister
            .as_deref()
            .expect("a caller keeps its lister until it leaves")
    }
}

impl Drop for ListerUse<'_> {
    fn drop(&mut self) {
        let mut listers = lock(self.listers);
        // Its handle goes under the lock, as every handle is taken:
        // dropped after it, two callers leaving at once could each still
        // count the other's, and neither remove the lister.
        drop(self.lister.take());
        // Only the map holds it: nobody waits for a listing.
        if listers
            .get(&self.id)
            .is_some_and(|l| Arc::strong_count(l) == 1)
        {
            listers.remove(&self.id);
        }
    }
}

/// One parent's listings. Callers that arrive while a listing is under way
/// wait for it to end, then share one new listing: one request per batch of
/// callers instead of one each, and every caller's listing is issued after
/// it asked, so it shows every change the caller saw before asking (a
/// session's requests are answered in order; watch events come before
/// later answers).
#[derive(Default)]
pub(super) struct Lister {
    /// Listings issued so far.
    issued: std::sync::atomic::AtomicU64,
    /// The newest completed listing with its issue number. Whoever holds the
    /// lock and finds it stale issues the next listing.
    last: tokio::sync::Mutex<Option<(u64, Arc<Listing>)>>,
}

/// Where a request works: its session, its name in errors, the key and
/// the path of the key's lock node.
#[derive(Clone, Copy)]
pub(super) struct At<'a> {
    pub(super) zk: &'a zk::Client,
    pub(super) op: &'static str,
    pub(super) key: &'a LockKey,
    pub(super) parent: &'a str,
}

/// What [`Inner::admitted_nodes`] found besides the nodes it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Found {
    /// Every node listed was there, none expired.
    Current,
    /// A node listed was gone when read.
    Gone,
    /// An expired lease was deleted.
    Expired,
}

/// Whether the child at `index` is admitted by its place alone.
pub(super) fn admitted(children: &[Child], index: usize, kind: Kind, limit: u32) -> bool {
    match (kind, children[index].mode) {
        (Kind::Semaphore, _) => index < limit as usize,
        (Kind::Lock | Kind::Election, Mode::Exclusive) => index == 0,
        (Kind::Lock | Kind::Election, Mode::Shared) => {
            children[..index].iter().all(|c| c.mode == Mode::Shared)
        }
    }
}

/// The delay node's end and version from its data and stat.
fn delay_of(bytes: &[u8], stat: &zk::Stat) -> (u64, i32) {
    let until = serde_json::from_slice::<ParentData>(bytes).map_or(0, |d| d.delay_until_ms);
    (until, stat.version)
}

impl Inner {
    /// Creates the parent of `key` (a container node where the server has
    /// them), and the node of its kind if that has gone.
    pub(super) async fn ensure_parent(&self, zk: &zk::Client, path: &str) -> Result<(), Error> {
        let data = serde_json::to_vec(&ParentData::default()).unwrap_or_default();
        let containers = self.containers.load(std::sync::atomic::Ordering::Relaxed);
        let mode = if containers {
            zk::CreateMode::Container
        } else {
            zk::CreateMode::Persistent
        };
        let opts = mode.with_acls(zk::Acls::anyone_all());
        let mut made_kind = false;
        loop {
            match call("try_acquire", zk.create(path, &data, &opts)).await? {
                Ok(_) | Err(zk::Error::NodeExists) => return Ok(()),
                Err(zk::Error::Unimplemented) if containers => {
                    self.containers
                        .store(false, std::sync::atomic::Ordering::Relaxed);
                    return Box::pin(self.ensure_parent(zk, path)).await;
                }
                // The node of its kind is gone: a Curator client that came
                // first made it a container (its parents' kind), and the
                // server reaped it once every lock was idle. Made again as
                // at the session's start, once.
                Err(zk::Error::NoNode) if !made_kind => {
                    made_kind = true;
                    let kind = path.rsplit_once('/').map_or(path, |(kind, _)| kind);
                    let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                    match call("try_acquire", zk.mkdir(kind, &persistent)).await? {
                        Ok(()) | Err(zk::Error::NodeExists) => {}
                        Err(e) => return Err(unavailable("try_acquire", e)),
                    }
                }
                Err(e) => return Err(unavailable("try_acquire", e)),
            }
        }
    }

    /// The lock node `path` listed after this call began (shared with
    /// concurrent callers, see [`Lister`]).
    pub(super) async fn children(
        &self,
        zk: &zk::Client,
        op: &'static str,
        path: &str,
    ) -> Result<Arc<Listing>, Error> {
        use std::sync::atomic::Ordering::SeqCst;
        let id = (zk.session_id().0, path.to_owned());
        let lister = lock(&self.listers).entry(id.clone()).or_default().clone();
        let user = ListerUse {
            listers: &self.listers,
            id,
            lister: Some(lister),
        };
        let lister = user.lister();
        let seen = lister.issued.load(SeqCst);
        let mut last = lister.last.lock().await;
        if let Some((n, listing)) = &*last
            && *n > seen
        {
            return Ok(listing.clone());
        }
        let n = lister.issued.fetch_add(1, SeqCst) + 1;
        let listing = Arc::new(self.list_once(zk, op, path).await?);
        *last = Some((n, listing.clone()));
        Ok(listing)
    }

    /// One listing of the lock node `path`: its children, then its data
    /// and stat, then the delay node's data, in one multi-read request
    /// (three requests where the server has no multi-read, ZooKeeper
    /// before 3.6; two when there is no delay node).
    async fn list_once(
        &self,
        zk: &zk::Client,
        op: &'static str,
        path: &str,
    ) -> Result<Listing, Error> {
        use std::sync::atomic::Ordering::Relaxed;
        let delay_path = format!("{path}/{DELAY_NODE}");
        if self.multi_read.load(Relaxed) {
            let mut reader = zk.new_multi_reader();
            for added in [
                reader.add_get_children(path),
                reader.add_get_data(path),
                reader.add_get_data(&delay_path),
            ] {
                added.map_err(|e| unavailable(op, e))?;
            }
            match call(op, reader.commit()).await? {
                Ok(results) => return Self::listing_of(op, results),
                // A server that has no multi-read answers UNIMPLEMENTED.
                // Anything else (a connection reset comes as an I/O error)
                // says nothing of the server: an outage, and the next
                // listing is a multi-read again.
                Err(zk::Error::Unimplemented) => {
                    tracing::info!(
                        backend = "zookeeper",
                        "ZooKeeper refused a multi-read (it has one from 3.6 on); listing with separate requests"
                    );
                    self.multi_read.store(false, Relaxed);
                }
                Err(e) => return Err(unavailable(op, e)),
            }
        }
        let names = match call(op, zk.list_children(path)).await? {
            Ok(names) => names,
            Err(zk::Error::NoNode) => return Ok(Listing::default()),
            Err(e) => return Err(unavailable(op, e)),
        };
        let delayed = names.iter().any(|n| n == DELAY_NODE);
        let (data, stat) = match call(op, zk.get_data(path)).await? {
            Ok(r) => r,
            Err(zk::Error::NoNode) => return Ok(Listing::default()),
            Err(e) => return Err(unavailable(op, e)),
        };
        let delay = if delayed {
            match call(op, zk.get_data(&delay_path)).await? {
                Ok((bytes, stat)) => Some(delay_of(&bytes, &stat)),
                Err(zk::Error::NoNode) => None,
                Err(e) => return Err(unavailable(op, e)),
            }
        } else {
            None
        };
        Ok(Listing {
            marks: names.iter().filter_map(|n| Mark::parse(n)).collect(),
            children: sorted(names),
            stat: Some(stat),
            parent: Parent {
                data: serde_json::from_slice(&data).unwrap_or_default(),
                version: Some(stat.version),
            },
            delay,
        })
    }

    /// The listing in the answers of [`Inner::list_once`]'s multi-read.
    fn listing_of(op: &'static str, results: Vec<zk::MultiReadResult>) -> Result<Listing, Error> {
        let mut results = results.into_iter();
        let mut listing = Listing::default();
        match results.next() {
            Some(zk::MultiReadResult::Children { children }) => {
                listing.marks = children.iter().filter_map(|n| Mark::parse(n)).collect();
                listing.children = sorted(children);
            }
            Some(zk::MultiReadResult::Error {
                err: zk::Error::NoNode,
            }) => return Ok(Listing::default()),
            Some(zk::MultiReadResult::Error { err }) => return Err(unavailable(op, err)),
            _ => {
                return Err(unavailable(
                    op,
                    Message("a listing without children".into()),
                ));
            }
        }
        match results.next() {
            Some(zk::MultiReadResult::Data { data, stat }) => {
                listing.parent = Parent {
                    data: serde_json::from_slice(&data).unwrap_or_default(),
                    version: Some(stat.version),
                };
                listing.stat = Some(stat);
            }
            // Removed between the two reads: as good as no lock node.
            Some(zk::MultiReadResult::Error {
                err: zk::Error::NoNode,
            }) => return Ok(Listing::default()),
            Some(zk::MultiReadResult::Error { err }) => return Err(unavailable(op, err)),
            _ => {
                return Err(unavailable(
                    op,
                    Message("a listing without its lock node".into()),
                ));
            }
        }
        match results.next() {
            Some(zk::MultiReadResult::Data { data, stat }) => {
                listing.delay = Some(delay_of(&data, &stat));
            }
            Some(zk::MultiReadResult::Error {
                err: zk::Error::NoNode,
            }) => {}
            Some(zk::MultiReadResult::Error { err }) => return Err(unavailable(op, err)),
            _ => {
                return Err(unavailable(
                    op,
                    Message("a listing without its delay node".into()),
                ));
            }
        }
        Ok(listing)
    }

    /// The child `child` of `parent` with its data; `None` once it is gone.
    pub(super) async fn read(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        child: &Child,
    ) -> Result<Option<Node>, Error> {
        match call(op, zk.get_data(&format!("{parent}/{}", child.name))).await? {
            Ok((bytes, stat)) => Ok(Some(Node {
                child: child.clone(),
                data: self.as_kept(serde_json::from_slice(&bytes).ok(), &stat),
                stat,
            })),
            Err(zk::Error::NoNode) => Ok(None),
            Err(e) => Err(unavailable(op, e)),
        }
    }

    /// Whether a claim of `mode` on a key of `kind` is granted by the
    /// listing that admits it, without a write: an exclusive lock's (its
    /// fence is the lock node's `pzxid`, which no other claim admitted by
    /// the same listing shares), on a server with multi-reads (ZooKeeper
    /// 3.6 and later: older ones could revert a `pzxid` when replaying
    /// their log over a snapshot, ZOOKEEPER-3145). Its node stays written
    /// as waiting until its sidecar confirms it, as a
    /// [tentative](NodeData::tentative) grant is confirmed. Not an
    /// election's: observers take a leader from a node written held.
    pub(super) fn grants_by_listing(&self, kind: Kind, mode: Mode) -> bool {
        kind == Kind::Lock
            && mode == Mode::Exclusive
            && self.multi_read.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `data`, read at `stat`, or, for a lease this sidecar granted by the
    /// listing that admitted it and has not written yet (its node still
    /// reads as waiting), the lease as this sidecar keeps it: held, with
    /// its fence. This sidecar's answers never show a lease it granted as
    /// a waiter.
    pub(super) fn as_kept(&self, data: Option<NodeData>, stat: &zk::Stat) -> Option<NodeData> {
        let Some(d) = data.as_ref().filter(|d| !d.held) else {
            return data;
        };
        let leases = lock(&self.leases);
        match leases.get(&Token::from_client(d.token.clone())) {
            Some(r) if r.lease.version == stat.version => {
                // Still to be written: its confirmation goes on.
                let mut kept = r.lease.next();
                kept.tentative = r.lease.data.tentative;
                Some(kept)
            }
            _ => data,
        }
    }

    /// The record and version of the lock node `path`, read alone.
    pub(super) async fn parent_data(
        &self,
        zk: &zk::Client,
        op: &'static str,
        path: &str,
    ) -> Result<Parent, Error> {
        match call(op, zk.get_data(path)).await? {
            Ok((bytes, stat)) => Ok(Parent {
                data: serde_json::from_slice(&bytes).unwrap_or_default(),
                version: Some(stat.version),
            }),
            Err(zk::Error::NoNode) => Ok(Parent::default()),
            Err(e) => Err(unavailable(op, e)),
        }
    }

    /// Ends `lease` under `parent` in one request: deletes its node (if it
    /// is still at its version), records its fence in the lock node and,
    /// when `delay_until` is ahead, the lock-delay in the delay node
    /// (created, or extended), all or nothing — so whoever sees the node
    /// gone also sees the delay. `listing` is the lock node as last listed.
    /// The lease's lock-delay mark goes with its node, so that nobody takes
    /// this end for a loss.
    pub(super) async fn end_lease(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        lease: &Lease,
        delay_until: u64,
        listing: &Listing,
    ) -> Result<Result<(), Failed>, Error> {
        let mut mark = mark_path(&lease.path, lease.data.lock_delay_ms);
        loop {
            let mut writer = zk.new_multi_writer();
            writer
                .add_delete(&lease.path, Some(lease.version))
                .map_err(|e| unavailable(op, e))?;
            if let Some(m) = &mark {
                writer.add_delete(m, None).map_err(|e| unavailable(op, e))?;
            }
            let now = self.clock.now();
            add_end_record(
                &mut writer,
                op,
                parent,
                listing,
                lease.fence,
                delay_until,
                now,
            )?;
            self.ending(&lease.data.token, true);
            let ended = commit(op, writer.commit()).await?;
            if ended.is_err() {
                // Did not run: the lease goes on (an answer that did not
                // come leaves it marked, as it may have ended).
                self.ending(&lease.data.token, false);
            }
            match ended {
                // A lease without its mark: granted by an older version,
                // or its mark was never made.
                Err(Failed {
                    index: 1,
                    error: zk::Error::NoNode,
                }) if mark.is_some() => mark = None,
                ended => return Ok(ended.map(|_| ())),
            }
        }
    }

    /// Makes the lock-delay mark of `lease`, just granted, if it has a
    /// lock-delay: in one request with a check that its node is still
    /// there, so that no mark outlives a lease that ended before it. `Ok`
    /// also when it was made before (a grant read again) or the lease is
    /// gone already (its end was written with it).
    pub(super) async fn mark(
        &self,
        zk: &zk::Client,
        op: &'static str,
        lease: &Lease,
    ) -> Result<(), Error> {
        let Some(mark) = mark_path(&lease.path, lease.data.lock_delay_ms) else {
            return Ok(());
        };
        let mut writer = zk.new_multi_writer();
        let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        for added in [
            writer.add_check_version(&lease.path, -1),
            writer.add_create(&mark, &[], &opts),
        ] {
            added.map_err(|e| unavailable(op, e))?;
        }
        match commit(op, writer.commit()).await? {
            Ok(_)
            | Err(Failed {
                error: zk::Error::NoNode | zk::Error::NodeExists,
                ..
            }) => Ok(()),
            Err(Failed { error, .. }) => Err(unavailable(op, error)),
        }
    }

    /// Starts the lock-delay of the leases lost with their session that
    /// `listing` shows ([`Listing::orphans`]), from now: deletes their
    /// marks and writes the delay node in one request. True when there
    /// were any: the caller lists the lock again (the request also fails
    /// when another sidecar did it first).
    pub(super) async fn start_lost_delays(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        listing: &Listing,
    ) -> Result<bool, Error> {
        let orphans = listing.orphans();
        let Some(delay) = orphans.iter().map(|m| m.delay_ms).max() else {
            return Ok(false);
        };
        let mut writer = zk.new_multi_writer();
        for m in &orphans {
            writer
                .add_delete(&format!("{parent}/{}", m.name), None)
                .map_err(|e| unavailable(op, e))?;
        }
        let now = self.clock.now();
        add_delay(
            &mut writer,
            op,
            parent,
            listing,
            self.clock.now_late().saturating_add(delay),
            now,
        )?;
        match commit(op, writer.commit()).await? {
            Ok(_) => {
                tracing::info!(backend = "zookeeper", %parent, leases = orphans.len(),
                    "leases lost with their ZooKeeper session: their lock-delay starts");
                Ok(true)
            }
            Err(failed) => conflict::<()>(op, failed).map(|_| true),
        }
    }

    /// Deletes the held node `node` of `parent` if its lease expired and it
    /// is still that lease, starting its lock-delay and recording its
    /// fence ([`Inner::end_lease`]); `listing` is the lock node as last
    /// listed, if at hand. True when the node is gone.
    pub(super) async fn expire(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        node: &Node,
        listing: Option<Arc<Listing>>,
    ) -> Result<bool, Error> {
        let Some(d) = node.data.as_ref().filter(|d| d.held) else {
            return Ok(false);
        };
        self.expire_lease(zk, op, parent, &Lease::of(parent, node, d), listing)
            .await
    }

    /// [`Inner::expire`] for a lease known as a [`Lease`].
    pub(super) async fn expire_lease(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        lease: &Lease,
        mut listing: Option<Arc<Listing>>,
    ) -> Result<bool, Error> {
        let until = lease
            .data
            .expires_at_ms
            .saturating_add(lease.data.lock_delay_ms);
        let until = if lease.data.lock_delay_ms > 0 {
            until
        } else {
            0
        };
        let gone = retry_on_conflict(PARENT_ROUNDS, || {
            let known = listing.take();
            async move {
                let listing = match known {
                    Some(l) => l,
                    None => self.children(zk, op, parent).await?,
                };
                match self
                    .end_lease(zk, op, parent, lease, until, &listing)
                    .await?
                {
                    Ok(()) => Ok(Round::Done(true)),
                    Err(Failed {
                        index: 0,
                        error: zk::Error::NoNode,
                    }) => Ok(Round::Done(true)),
                    Err(Failed {
                        index: 0,
                        error: zk::Error::BadVersion,
                    }) => Ok(Round::Done(false)),
                    // The lock node or the delay node changed since listed.
                    Err(Failed {
                        error: zk::Error::BadVersion | zk::Error::NodeExists | zk::Error::NoNode,
                        ..
                    }) => Ok(Round::Conflict),
                    Err(Failed { error, .. }) => Err(unavailable(op, error)),
                }
            }
        })
        .await?;
        gone.ok_or_else(|| unavailable(op, Message("lock-delay kept changing".into())))
    }

    /// Records the highest `fence` of leases whose nodes went otherwise (lost
    /// with the session) in the lock node, in one request per round.
    pub(super) async fn record_end(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        fence: u64,
    ) -> Result<(), Error> {
        let recorded = retry_on_conflict(PARENT_ROUNDS, || async move {
            let listing = self.children(zk, op, parent).await?;
            let mut writer = zk.new_multi_writer();
            if !add_end_record(&mut writer, op, parent, &listing, fence, 0, 0)? {
                return Ok(Round::Done(()));
            }
            Ok(match commit(op, writer.commit()).await? {
                Ok(_) => Round::Done(()),
                Err(failed) => conflict(op, failed)?,
            })
        })
        .await?;
        recorded.ok_or_else(|| unavailable(op, Message("the lock node kept changing".into())))
    }

    /// Deletes a delay node that is over, unless it changed since it was read.
    pub(super) async fn clear_delay(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        version: i32,
    ) {
        let path = format!("{parent}/{DELAY_NODE}");
        // Losing the race to a new delay (BadVersion) or to another cleaner is fine.
        let _ = call(op, zk.delete(&path, Some(version))).await;
    }

    /// Reads the children of `listing` admitted by place, before `until`
    /// (the index of a claim whose data the caller knows; all when `None`),
    /// deleting expired leases among them; the nodes still there, and
    /// whether any was gone or expired. `limit` is a semaphore's; nodes in
    /// `known` are not read again.
    pub(super) async fn admitted_nodes(
        &self,
        at: At<'_>,
        listing: &Arc<Listing>,
        limit: u32,
        until: Option<usize>,
        known: &[Node],
    ) -> Result<(Vec<Node>, Found), Error> {
        let At {
            zk,
            op,
            key,
            parent,
        } = at;
        let children = &listing.children;
        let mut nodes = Vec::new();
        let (mut gone, mut expired) = (false, false);
        let now = self.clock.now();
        for (i, c) in children.iter().enumerate() {
            if until.is_some_and(|u| i >= u) {
                break;
            }
            if !admitted(children, i, key.kind, limit) {
                if key.kind.is_lock() && c.mode == Mode::Exclusive {
                    break;
                }
                continue;
            }
            let node = match known.iter().find(|n| n.child.name == c.name) {
                Some(n) => Some(n.clone()),
                None => self.read(zk, op, parent, c).await?,
            };
            let Some(node) = node else {
                gone = true;
                continue;
            };
            if let Some(d) = &node.data
                && d.held
                && d.expires_at_ms <= now
                && self
                    .expire(zk, op, parent, &node, Some(listing.clone()))
                    .await?
            {
                expired = true;
                continue;
            }
            nodes.push(node);
        }
        // A node that went fired the watches on it; one this request
        // deleted fires them too, and the local head is woken at once.
        let found = if expired {
            self.wakeups.wake(key);
            Found::Expired
        } else if gone {
            Found::Gone
        } else {
            Found::Current
        };
        Ok((nodes, found))
    }

    /// The lock's listing with the data of the claims admitted by place;
    /// expired leases among them are deleted first. Returns the listing,
    /// the admitted nodes and a semaphore's limit.
    pub(super) async fn snapshot(
        &self,
        zk: &zk::Client,
        op: &'static str,
        key: &LockKey,
        parent: &str,
    ) -> Result<(Arc<Listing>, Vec<Node>, u32), Error> {
        let snapshot = retry_on_conflict(CLAIM_ROUNDS, || async move {
            let listing = self.children(zk, op, parent).await?;
            let mut known = Vec::new();
            let mut limit = 0;
            if key.kind == Kind::Semaphore && !listing.children.is_empty() {
                limit = self
                    .active_limit(zk, op, parent, &listing.children, &mut known)
                    .await?
                    .unwrap_or(1);
            }
            let at = At {
                zk,
                op,
                key,
                parent,
            };
            match self
                .admitted_nodes(at, &listing, limit, None, &known)
                .await?
            {
                (nodes, Found::Current) => Ok(Round::Done((listing, nodes, limit))),
                (_, Found::Gone | Found::Expired) => Ok(Round::Conflict),
            }
        })
        .await?;
        snapshot.ok_or_else(|| unavailable(op, Message("the lock's children kept changing".into())))
    }

    /// A semaphore's limit: the one recorded by its first sidelock node
    /// that records one (`None`: none does). Nodes in `known` are not read
    /// again; those read are added to it.
    pub(super) async fn active_limit(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        children: &[Child],
        known: &mut Vec<Node>,
    ) -> Result<Option<u32>, Error> {
        for c in children {
            let node = match known.iter().find(|n| n.child.name == c.name) {
                Some(n) => Some(n.clone()),
                None => {
                    let read = self.read(zk, op, parent, c).await?;
                    known.extend(read.clone());
                    read
                }
            };
            if let Some(limit) = node.and_then(|n| n.data).and_then(|d| d.limit) {
                return Ok(Some(limit));
            }
        }
        Ok(None)
    }

    /// Finds the node of `token` under `parent`: this sidecar's record first, else a scan.
    pub(super) async fn find(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        token: &Token,
    ) -> Result<Option<Node>, Error> {
        let known = lock(&self.leases).get(token).map(|r| r.lease.path.clone());
        if let Some(path) = known
            && let Some(name) = path.strip_prefix(&format!("{parent}/"))
            && let Some(child) = parse_child(name)
        {
            if let Some(node) = self.read(zk, op, parent, &child).await?
                && node
                    .data
                    .as_ref()
                    .is_some_and(|d| d.token == token.expose())
            {
                return Ok(Some(node));
            }
            lock(&self.leases).remove(token);
            return Ok(None);
        }
        let listing = self.children(zk, op, parent).await?;
        self.scan_for(zk, op, parent, token, &listing).await
    }

    /// The node of `listing` (under `parent`) that holds `token` as a
    /// lease, read; one that still reads as waiting is taken once its
    /// sidecar writes it ([`Self::confirmed`]).
    pub(super) async fn scan_for(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        token: &Token,
        listing: &Listing,
    ) -> Result<Option<Node>, Error> {
        for c in &listing.children {
            if let Some(node) = self.read(zk, op, parent, c).await?
                && let Some(d) = node.data.as_ref()
                && d.token == token.expose()
            {
                return if d.held {
                    Ok(Some(node))
                } else {
                    Box::pin(self.confirmed(zk, op, parent, &node, CONFIRM_WAIT)).await
                };
            }
        }
        Ok(None)
    }

    /// A node of another sidecar that holds a client's token and still
    /// reads as waiting: a lease that sidecar granted by its listing and
    /// has not written yet (a token is given out only with a grant). Waits
    /// at most `wait` for that sidecar to write it, and reads it again:
    /// `None` once it is gone.
    ///
    /// # Errors
    /// [`Error::Unavailable`] while it is still unwritten: the client may
    /// ask again.
    pub(super) async fn confirmed(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        node: &Node,
        wait: Duration,
    ) -> Result<Option<Node>, Error> {
        let path = format!("{parent}/{}", node.child.name);
        self.await_change(zk, op, &path, node.stat.version, wait)
            .await?;
        match self.read(zk, op, parent, &node.child).await? {
            Some(n) if n.data.as_ref().is_some_and(|d| d.held) => Ok(Some(n)),
            Some(_) => Err(unavailable(
                op,
                Message("the sidecar that granted this lease has not recorded it yet".into()),
            )),
            None => Ok(None),
        }
    }
}

/// The path of the lock-delay mark of the lease in the claim node at
/// `path`, if it has a lock-delay (`lock_delay_ms`).
pub(super) fn mark_path(path: &str, lock_delay_ms: u64) -> Option<String> {
    if lock_delay_ms == 0 {
        return None;
    }
    let (parent, name) = path.rsplit_once('/')?;
    let mark = Mark::of(parse_child(name)?.seq, lock_delay_ms);
    Some(format!("{parent}/{}", mark.name))
}

/// Adds to `writer` the record of leases that end under `parent`, as
/// `listing` last showed the lock node: their highest `fence` in the lock
/// node (at the version listed, when there is one, and unless its record
/// is at `fence` or above already) and, when `delay_until` is ahead of
/// `now` (both on the servers' clock), the lock-delay in the delay node
/// (created, or extended). `false` when there is nothing to write.
pub(super) fn add_end_record(
    writer: &mut zk::MultiWriter<'_>,
    op: &'static str,
    parent: &str,
    listing: &Listing,
    fence: u64,
    delay_until: u64,
    now: u64,
) -> Result<bool, Error> {
    let mut any = false;
    // Every write of the record is at the version its writer read, and
    // only raises it: a record at `fence` or above stays so. Leaving it
    // alone then spares the write, and the end does not race the lock's
    // other ends for its version (a semaphore's permits released at once
    // all did, each after the one whose write went through).
    if let Some(version) = listing.parent.version
        && listing.parent.data.fence < fence
    {
        let record = serde_json::to_vec(&listing.parent.data.ended(fence)).unwrap_or_default();
        writer
            .add_set_data(parent, &record, Some(version))
            .map_err(|e| unavailable(op, e))?;
        any = true;
    }
    Ok(add_delay(writer, op, parent, listing, delay_until, now)? || any)
}

/// Adds to `writer` the lock-delay of the lock node `parent` until
/// `delay_until`, when that is ahead of `now` and later than the delay
/// `listing` shows (created, or extended at the version listed). True when
/// it added it.
fn add_delay(
    writer: &mut zk::MultiWriter<'_>,
    op: &'static str,
    parent: &str,
    listing: &Listing,
    delay_until: u64,
    now: u64,
) -> Result<bool, Error> {
    let mut added = Vec::new();
    if delay_until > now {
        let delay_path = format!("{parent}/{DELAY_NODE}");
        let delay = serde_json::to_vec(&ParentData {
            fence: 0,
            delay_until_ms: delay_until,
        })
        .unwrap_or_default();
        match listing.delay {
            Some((until, _)) if until >= delay_until => {}
            Some((_, version)) => {
                added.push(writer.add_set_data(&delay_path, &delay, Some(version)))
            }
            None => {
                let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                added.push(writer.add_create(&delay_path, &delay, &opts));
            }
        }
    }
    let any = !added.is_empty();
    for a in added {
        a.map_err(|e| unavailable(op, e))?;
    }
    Ok(any)
}

/// What a multi-request that failed on `failed` means to a caller that read
/// before writing: a conflict (what it read changed: read again), or an
/// outage.
pub(super) fn conflict<T>(op: &'static str, failed: Failed) -> Result<Round<T>, Error> {
    match failed.error {
        zk::Error::BadVersion | zk::Error::NodeExists | zk::Error::NoNode => Ok(Round::Conflict),
        error => Err(unavailable(op, error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A caller of the listing of `id` in `listers`, as [`Inner::children`]
    /// makes one.
    fn caller<'a>(
        listers: &'a Mutex<HashMap<(i64, String), Arc<Lister>>>,
        id: &(i64, String),
    ) -> ListerUse<'a> {
        let lister = lock(listers).entry(id.clone()).or_default().clone();
        ListerUse {
            listers,
            id: id.clone(),
            lister: Some(lister),
        }
    }

    // Two callers of one lock's listing leave at once, on two threads, while
    // a third holds the map of listers (taking its own entry): each checked
    // whether it was the last one with its own handle of the lister still
    // held, so both could find the other there, and the lister stayed in the
    // map for good, with its last listing.
    #[test]
    fn the_last_of_two_callers_leaving_at_once_removes_their_lister() {
        const ROUNDS: usize = 200;
        let listers = Mutex::new(HashMap::new());
        let id = (1, "/sidelock/locks/l".to_owned());
        let slots: [Mutex<Option<ListerUse<'_>>>; 2] = [Mutex::new(None), Mutex::new(None)];
        let (leave, left) = (std::sync::Barrier::new(3), std::sync::Barrier::new(3));
        let mut kept = 0;
        std::thread::scope(|s| {
            for slot in &slots {
                let (leave, left) = (&leave, &left);
                s.spawn(move || {
                    for _ in 0..ROUNDS {
                        leave.wait();
                        drop(lock(slot).take());
                        left.wait();
                    }
                });
            }
            for _ in 0..ROUNDS {
                for slot in &slots {
                    *lock(slot) = Some(caller(&listers, &id));
                }
                let busy = lock(&listers);
                leave.wait();
                // Both wait for the map now.
                std::thread::sleep(Duration::from_millis(1));
                drop(busy);
                left.wait();
                if lock(&listers).remove(&id).is_some() {
                    kept += 1;
                }
            }
        });
        assert_eq!(kept, 0, "{kept} of {ROUNDS} rounds left the lister behind");
    }
}
