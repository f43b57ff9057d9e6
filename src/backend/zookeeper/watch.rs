//! Following watches: a waiting node watches what blocks it and wakes the
//! local waiters when that changes (module doc, # Watches).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use super::names::{parse_child, sorted};
use super::request::{call, must, unavailable};
use super::tree::Listing;
use super::{Inner, lock};
use crate::backend::Error;
use crate::lock::{Kind, LockKey, Mode};

/// What a waiting node waits for, by its place among the parent's children.
enum Blocker {
    /// Nothing: it is admitted by place.
    Nothing,
    /// Any deletion before it (a semaphore's queue head watches the children).
    Earlier,
    /// The deletion (or, for a semaphore, the grant) of this node; `last`
    /// when nothing else blocks the waiting node, so that the deletion
    /// admits it.
    Node { name: String, last: bool },
}

impl Inner {
    /// Watches what blocks the waiting node `name` and wakes local waiters on
    /// `key` when it changes, until the node is granted or leaves. `listing`
    /// is the parent's children as the attempt that queued the node saw them
    /// (taken after the node was created), which saves the first listing.
    pub(super) async fn follow(
        self: Arc<Self>,
        zk: zk::Client,
        key: LockKey,
        parent: String,
        name: String,
        listing: Arc<Listing>,
    ) {
        let Some(seq) = parse_child(&name).map(|c| c.seq) else {
            return;
        };
        match lock(&self.tickets).get_mut(&(key.clone(), seq)) {
            Some(queued) if !queued.following => queued.following = true,
            // Followed already, or no longer waiting.
            _ => return,
        }
        let mut listing = Some(listing);
        let wake = loop {
            match self
                .follow_loop(&zk, &key, &parent, &name, listing.take())
                .await
            {
                Ok(wake) => break wake,
                // Cut off for a moment: follow again, with a new listing.
                // A session that ended forgets its tickets and wakes every
                // local waiter; a waiter that left ends this too.
                Err(_) if !zk.state().is_terminated() => {
                    tokio::select! {
                        () = self.closing.cancelled() => break false,
                        () = tokio::time::sleep(Duration::from_millis(500)) => {}
                    }
                }
                Err(_) => break false,
            }
        };
        if let Some(queued) = lock(&self.tickets).get_mut(&(key.clone(), seq)) {
            queued.following = false;
            queued.answer = None;
            queued.hint = wake;
        }
        // After `following` is cleared: an attempt this wakes that finds
        // the node still blocked follows it again, with its own listing.
        if wake {
            self.wakeups.wake(&key);
        }
    }

    /// Something that blocks the waiting node `seq` of `key` changed: the
    /// answer of the attempt that queued it no longer holds.
    fn changed(&self, key: &LockKey, seq: u64) {
        if let Some(queued) = lock(&self.tickets).get_mut(&(key.clone(), seq)) {
            queued.answer = None;
        }
    }

    /// Whether the waiting node `seq` of `key` is this sidecar's first on
    /// `key`: the one its local queue wakes.
    fn first_here(&self, key: &LockKey, seq: u64) -> bool {
        let tickets = lock(&self.tickets);
        tickets
            .range((key.clone(), 0)..=(key.clone(), u64::MAX))
            .next()
            .is_some_and(|((_, first), _)| *first == seq)
    }

    // Listings are dropped before every wait for a watch: a waiter parked
    // with the listing it joined on would keep O(queue length) bytes alive
    // for as long as it waits, O(n²) for a queue of n. The calls and the
    // wait are boxed: inline, the largest call's state would be part of
    // every waiter's task for as long as it waits for its watch. True when
    // the local waiters are to be woken once it stopped following.
    async fn follow_loop(
        &self,
        zk: &zk::Client,
        key: &LockKey,
        parent: &str,
        name: &str,
        mut listing: Option<Arc<Listing>>,
    ) -> Result<bool, Error> {
        let Some(seq) = parse_child(name).map(|c| c.seq) else {
            return Ok(false);
        };
        loop {
            if !lock(&self.tickets).contains_key(&(key.clone(), seq)) {
                return Ok(false);
            }
            let listing = match listing.take() {
                Some(listing) => listing,
                None => {
                    // Around again: something changed.
                    self.changed(key, seq);
                    Box::pin(self.children(zk, "watch", parent)).await?
                }
            };
            let children = &listing.children;
            let Some(at) = children.iter().position(|c| c.name == name) else {
                return Ok(false);
            };
            let (blocker, limit) = match (key.kind, children[at].mode) {
                (Kind::Semaphore, _) => {
                    let limit =
                        Box::pin(self.active_limit(zk, "watch", parent, children, &mut Vec::new()))
                            .await? as usize;
                    match at.cmp(&limit) {
                        std::cmp::Ordering::Less => (Blocker::Nothing, limit),
                        // The head of the queue: any deletion before it admits it.
                        std::cmp::Ordering::Equal => (Blocker::Earlier, limit),
                        // Further back: its predecessor, which is deleted or
                        // granted (a data change) before this node can be head.
                        std::cmp::Ordering::Greater => (
                            Blocker::Node {
                                name: children[at - 1].name.clone(),
                                last: false,
                            },
                            limit,
                        ),
                    }
                }
                (Kind::Lock | Kind::Election, Mode::Exclusive) => (
                    at.checked_sub(1)
                        .map_or(Blocker::Nothing, |b| Blocker::Node {
                            name: children[b].name.clone(),
                            last: b == 0,
                        }),
                    0,
                ),
                (Kind::Lock | Kind::Election, Mode::Shared) => {
                    let mut writers = children[..at]
                        .iter()
                        .rev()
                        .filter(|c| c.mode == Mode::Exclusive);
                    let blocker = writers.next().map(|c| c.name.clone());
                    let last = writers.next().is_none();
                    (
                        blocker.map_or(Blocker::Nothing, |name| Blocker::Node { name, last }),
                        0,
                    )
                }
            };
            drop(listing);
            let (blocker, last) = match blocker {
                Blocker::Node { name, last } => (name, last),
                // Nothing blocks it by place: its attempt decides (lock-delay, expiry).
                Blocker::Nothing => return Ok(true),
                Blocker::Earlier => {
                    let (now, w) =
                        Box::pin(must("watch", zk.list_and_watch_children(parent))).await?;
                    let position = sorted(now).iter().position(|c| c.name == name);
                    match position {
                        None => return Ok(false),
                        Some(i) if i < limit => return Ok(true),
                        Some(_) => {
                            Box::pin(self.await_watch(key, w)).await;
                            continue;
                        }
                    }
                }
            };
            let target = format!("{parent}/{blocker}");
            if key.kind == Kind::Semaphore {
                let watcher =
                    match Box::pin(must("watch", zk.check_and_watch_stat(&target))).await? {
                        (None, _) => {
                            self.wakeups.wake(key);
                            continue;
                        }
                        (Some(_), w) => w,
                    };
                drop(target);
                // A deletion between the listing and the watch may have made
                // the predecessor head, or admitted it: look again.
                let again = Box::pin(self.children(zk, "watch", parent)).await?;
                let moved = again.children.iter().position(|c| c.name == name) != Some(at);
                drop(again);
                if moved {
                    continue;
                }
                Box::pin(self.await_watch(key, watcher)).await;
                continue;
            }
            // A lock waiter needs only the blocker's deletion: a children
            // watch on it fires for that alone, not for the data changes of
            // its grant and renewals.
            match Box::pin(call("watch", zk.list_and_watch_children(&target))).await? {
                Ok((_, watcher)) => {
                    drop(target);
                    let event = Box::pin(watcher.changed()).await;
                    tracing::debug!(
                        backend = "zookeeper",
                        lock = %key,
                        path = %event.path,
                        event = ?event.event_type,
                        "watch fired"
                    );
                    if event.session_state.is_terminated() {
                        return Ok(false);
                    }
                    if event.event_type != zk::EventType::NodeDeleted {
                        continue;
                    }
                }
                Err(zk::Error::NoNode) => {}
                Err(e) => return Err(unavailable("watch", e)),
            }
            // The blocker is gone. Nothing else blocked this node: it is
            // admitted. Or it is this sidecar's first waiter on the key,
            // whose attempt lists the lock anyway and follows it again if
            // it is still blocked. Else it lists the lock itself.
            if last || self.first_here(key, seq) {
                return Ok(true);
            }
        }
    }

    /// Waits for one watch event; wakes local waiters unless it was a data change.
    async fn await_watch(&self, key: &LockKey, watcher: zk::OneshotWatcher) {
        let event = watcher.changed().await;
        tracing::debug!(
            backend = "zookeeper",
            lock = %key,
            path = %event.path,
            event = ?event.event_type,
            "watch fired"
        );
        if !event.session_state.is_terminated()
            && event.event_type != zk::EventType::NodeDataChanged
        {
            self.wakeups.wake(key);
        }
    }
}

impl Inner {
    /// Follows every change of `key`'s parent node — children created or
    /// deleted, the node itself created or removed — with a persistent watch,
    /// and tells the key's observer ([`Wakeups::changed`]) until `stop`.
    /// After a lost session or a failed call it watches again, telling the
    /// observer, which may have missed changes meanwhile.
    ///
    /// [`Wakeups::changed`]: crate::wakeups::Wakeups::changed
    pub(super) async fn observe(self: Arc<Self>, key: LockKey, stop: CancellationToken) {
        let path = self.key_path(&key);
        loop {
            let watched = async {
                let zk = self.client().await?;
                must("observe", zk.watch(&path, zk::AddWatchMode::Persistent)).await
            };
            let watcher = tokio::select! {
                () = stop.cancelled() => return,
                w = watched => w,
            };
            if let Ok(mut watcher) = watcher {
                loop {
                    let event = tokio::select! {
                        () = stop.cancelled() => return,
                        e = watcher.changed() => e,
                    };
                    self.wakeups.changed(&key);
                    // The watcher must not be asked again after its session ended.
                    if event.event_type == zk::EventType::Session
                        && event.session_state.is_terminated()
                    {
                        break;
                    }
                }
            }
            self.wakeups.changed(&key);
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    }
}
