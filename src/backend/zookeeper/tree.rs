//! A lock's node tree: its parent node, the children listing shared by
//! concurrent callers, the delay node, and the snapshot of claims that
//! deletes expired leases on its way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use zookeeper_client as zk;

use super::data::{Node, ParentData};
use super::names::{Child, DELAY_NODE, parse_child, sorted};
use super::request::{
    CLAIM_ROUNDS, Message, PARENT_ROUNDS, Round, call, retry_on_conflict, unavailable,
};
use super::{Inner, lock};
use crate::backend::Error;
use crate::clock::now_ms;
use crate::lock::{Kind, LockKey, Mode, Token};

/// A parent's children sorted by sequence, shared by the callers that
/// asked for them at about the same time.
pub(super) type Listing = Arc<Vec<Child>>;

/// A caller of [`Inner::children`]; the last one to leave (also when its
/// future is dropped) removes the parent's [`Lister`] and its listing.
struct ListerUse<'a> {
    listers: &'a Mutex<HashMap<(i64, String), Arc<Lister>>>,
    id: (i64, String),
    lister: Arc<Lister>,
}

impl Drop for ListerUse<'_> {
    fn drop(&mut self) {
        let mut listers = lock(self.listers);
        // Only the map and this caller hold it: nobody waits for a listing.
        if Arc::strong_count(&self.lister) == 2 {
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
    last: tokio::sync::Mutex<Option<(u64, Listing)>>,
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
impl Inner {
    /// Creates the parent of `key` (a container node where the server has them).
    pub(super) async fn ensure_parent(&self, zk: &zk::Client, path: &str) -> Result<(), Error> {
        let data = serde_json::to_vec(&ParentData::default()).unwrap_or_default();
        let containers = self.containers.load(std::sync::atomic::Ordering::Relaxed);
        let mode = if containers {
            zk::CreateMode::Container
        } else {
            zk::CreateMode::Persistent
        };
        let opts = mode.with_acls(zk::Acls::anyone_all());
        match call("try_acquire", zk.create(path, &data, &opts)).await? {
            Ok(_) | Err(zk::Error::NodeExists) => Ok(()),
            Err(zk::Error::Unimplemented) if containers => {
                self.containers
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                Box::pin(self.ensure_parent(zk, path)).await
            }
            Err(e) => Err(unavailable("try_acquire", e)),
        }
    }

    /// The children of `path`, listed after this call began (shared with
    /// concurrent callers, see [`Lister`]).
    pub(super) async fn children(
        &self,
        zk: &zk::Client,
        op: &'static str,
        path: &str,
    ) -> Result<Listing, Error> {
        use std::sync::atomic::Ordering::SeqCst;
        let id = (zk.session_id().0, path.to_owned());
        let lister = lock(&self.listers).entry(id.clone()).or_default().clone();
        let user = ListerUse {
            listers: &self.listers,
            id,
            lister,
        };
        let lister = &user.lister;
        let seen = lister.issued.load(SeqCst);
        let mut last = lister.last.lock().await;
        if let Some((n, listing)) = &*last
            && *n > seen
        {
            return Ok(listing.clone());
        }
        let n = lister.issued.fetch_add(1, SeqCst) + 1;
        let listed = match call(op, zk.list_children(path)).await {
            Ok(Ok(names)) => Ok(Arc::new(sorted(names))),
            Ok(Err(zk::Error::NoNode)) => Ok(Arc::new(Vec::new())),
            Ok(Err(e)) => Err(unavailable(op, e)),
            Err(e) => Err(e),
        };
        if let Ok(listing) = &listed {
            *last = Some((n, listing.clone()));
        }
        listed
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
                data: serde_json::from_slice(&bytes).ok(),
                stat,
            })),
            Err(zk::Error::NoNode) => Ok(None),
            Err(e) => Err(unavailable(op, e)),
        }
    }

    /// The data of the lock node `path` and its version (`None`: no such node).
    pub(super) async fn parent_data(
        &self,
        zk: &zk::Client,
        op: &'static str,
        path: &str,
    ) -> Result<(ParentData, Option<i32>), Error> {
        match call(op, zk.get_data(path)).await? {
            Ok((bytes, stat)) => Ok((
                serde_json::from_slice(&bytes).unwrap_or_default(),
                Some(stat.version),
            )),
            Err(zk::Error::NoNode) => Ok((ParentData::default(), None)),
            Err(e) => Err(unavailable(op, e)),
        }
    }

    /// Read-modify-write of the parent's data (compare-and-set on its version).
    pub(super) async fn update_parent(
        &self,
        zk: &zk::Client,
        op: &'static str,
        path: &str,
        f: impl Fn(&mut ParentData),
    ) -> Result<(), Error> {
        // A reference, which every round's future copies.
        let f = &f;
        // Still conflicting after every round, the update is given up
        // without an error: the grant it records has been made already.
        retry_on_conflict(PARENT_ROUNDS, || async move {
            let (mut data, version) = self.parent_data(zk, op, path).await?;
            let Some(version) = version else {
                return Ok(Round::Done(()));
            };
            f(&mut data);
            let bytes = serde_json::to_vec(&data).unwrap_or_default();
            match call(op, zk.set_data(path, &bytes, Some(version))).await? {
                Ok(_) | Err(zk::Error::NoNode) => Ok(Round::Done(())),
                Err(zk::Error::BadVersion) => Ok(Round::Conflict),
                Err(e) => Err(unavailable(op, e)),
            }
        })
        .await?;
        Ok(())
    }

    /// The end of `parent`'s lock-delay (0: none) and the version of its delay node.
    pub(super) async fn delay(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
    ) -> Result<(u64, Option<i32>), Error> {
        let path = format!("{parent}/{DELAY_NODE}");
        match call(op, zk.get_data(&path)).await? {
            Ok((bytes, stat)) => {
                let until =
                    serde_json::from_slice::<ParentData>(&bytes).map_or(0, |d| d.delay_until_ms);
                Ok((until, Some(stat.version)))
            }
            Err(zk::Error::NoNode) => Ok((0, None)),
            Err(e) => Err(unavailable(op, e)),
        }
    }

    /// Extends `parent`'s lock-delay to `until` in its delay node, which a
    /// container parent cannot be reaped with (the parent's own data would be lost with it).
    pub(super) async fn record_delay(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        until: u64,
    ) -> Result<(), Error> {
        let path = format!("{parent}/{DELAY_NODE}");
        let data = ParentData {
            fence: 0,
            delay_until_ms: until,
        };
        let bytes = serde_json::to_vec(&data).unwrap_or_default();
        // References, which every round's future copies.
        let (path, bytes) = (&path, &bytes);
        let recorded = retry_on_conflict(PARENT_ROUNDS, || async move {
            let result = match self.delay(zk, op, parent).await? {
                (current, Some(_)) if current >= until => return Ok(Round::Done(())),
                (_, Some(version)) => call(op, zk.set_data(path, bytes, Some(version)))
                    .await?
                    .map(|_| ()),
                (_, None) => {
                    let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                    call(op, zk.create(path, bytes, &opts)).await?.map(|_| ())
                }
            };
            match result {
                Ok(()) => Ok(Round::Done(())),
                Err(zk::Error::BadVersion | zk::Error::NodeExists) => Ok(Round::Conflict),
                // The parent went (reaped when its last claim left): the delay still applies.
                Err(zk::Error::NoNode) => {
                    self.ensure_parent(zk, parent).await?;
                    Ok(Round::Conflict)
                }
                Err(e) => Err(unavailable(op, e)),
            }
        })
        .await?;
        recorded.ok_or_else(|| unavailable(op, Message("lock-delay kept changing".into())))
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

    /// Deletes a node whose lease expired (if it still is that lease), starting its lock-delay.
    pub(super) async fn expire(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        node: &Node,
    ) -> Result<bool, Error> {
        let Some(d) = &node.data else {
            return Ok(false);
        };
        let path = format!("{parent}/{}", node.child.name);
        match call(op, zk.delete(&path, Some(node.stat.version))).await? {
            Ok(()) => {
                let until = d.expires_at_ms.saturating_add(d.lock_delay_ms);
                if d.lock_delay_ms > 0 && until > now_ms() {
                    self.record_delay(zk, op, parent, until).await?;
                }
                Ok(true)
            }
            Err(zk::Error::NoNode) => Ok(true),
            Err(zk::Error::BadVersion) => Ok(false),
            Err(e) => Err(unavailable(op, e)),
        }
    }

    /// Children with the data of those admitted by place; expired leases among
    /// them are deleted first. Returns the children and the admitted nodes.
    pub(super) async fn snapshot(
        &self,
        zk: &zk::Client,
        op: &'static str,
        key: &LockKey,
        parent: &str,
    ) -> Result<(Listing, Vec<Node>, u32), Error> {
        let snapshot = retry_on_conflict(CLAIM_ROUNDS, || async move {
            let children = self.children(zk, op, parent).await?;
            let mut limit = 0;
            if key.kind == Kind::Semaphore && !children.is_empty() {
                limit = self.active_limit(zk, op, parent, &children).await?;
            }
            let mut nodes = Vec::new();
            let mut changed = false;
            let now = now_ms();
            for (i, c) in children.iter().enumerate() {
                if !admitted(&children, i, key.kind, limit) {
                    if key.kind.is_lock() && c.mode == Mode::Exclusive {
                        break;
                    }
                    continue;
                }
                let Some(node) = self.read(zk, op, parent, c).await? else {
                    changed = true;
                    continue;
                };
                if let Some(d) = &node.data
                    && d.held
                    && d.expires_at_ms <= now
                    && self.expire(zk, op, parent, &node).await?
                {
                    changed = true;
                    continue;
                }
                nodes.push(node);
            }
            if changed {
                self.wakeups.wake(key);
                return Ok(Round::Conflict);
            }
            Ok(Round::Done((children, nodes, limit)))
        })
        .await?;
        snapshot.ok_or_else(|| unavailable(op, Message("the lock's children kept changing".into())))
    }

    /// A semaphore's limit: the one recorded by its first sidelock node.
    pub(super) async fn active_limit(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        children: &[Child],
    ) -> Result<u32, Error> {
        for c in children {
            if let Some(node) = self.read(zk, op, parent, c).await?
                && let Some(limit) = node.data.and_then(|d| d.limit)
            {
                return Ok(limit);
            }
        }
        Ok(1)
    }

    /// Finds the node of `token` under `parent`: this sidecar's record first, else a scan.
    pub(super) async fn find(
        &self,
        zk: &zk::Client,
        op: &'static str,
        parent: &str,
        token: &Token,
    ) -> Result<Option<Node>, Error> {
        let known = lock(&self.leases).get(token).cloned();
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
        for c in self.children(zk, op, parent).await?.iter() {
            if let Some(node) = self.read(zk, op, parent, c).await?
                && node
                    .data
                    .as_ref()
                    .is_some_and(|d| d.held && d.token == token.expose())
            {
                return Ok(Some(node));
            }
        }
        Ok(None)
    }
}
