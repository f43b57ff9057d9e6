//! Following watches: a waiting node watches what blocks it and wakes the
//! local waiters when that changes (module doc, # Watches).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use super::names::{parse_child, sorted};
use super::request::must;
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
    /// The deletion (or grant) of this node.
    Node(String),
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
        let _ = self.follow_loop(&zk, &key, &parent, &name, listing).await;
        if let Some(queued) = lock(&self.tickets).get_mut(&(key.clone(), seq)) {
            queued.following = false;
        }
    }

    // Listings are dropped before every wait for a watch: a waiter parked
    // with the listing it joined on would keep O(queue length) bytes alive
    // for as long as it waits, O(n²) for a queue of n. The calls and the
    // wait are boxed: inline, the largest call's state would be part of
    // every waiter's task for as long as it waits for its watch.
    async fn follow_loop(
        &self,
        zk: &zk::Client,
        key: &LockKey,
        parent: &str,
        name: &str,
        listing: Arc<Listing>,
    ) -> Result<(), Error> {
        let Some(seq) = parse_child(name).map(|c| c.seq) else {
            return Ok(());
        };
        let mut listing = Some(listing);
        loop {
            if !lock(&self.tickets).contains_key(&(key.clone(), seq)) {
                return Ok(());
            }
            let listing = match listing.take() {
                Some(listing) => listing,
                None => Box::pin(self.children(zk, "watch", parent)).await?,
            };
            let children = &listing.children;
            let Some(at) = children.iter().position(|c| c.name == name) else {
                return Ok(());
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
                        std::cmp::Ordering::Greater => {
                            (Blocker::Node(children[at - 1].name.clone()), limit)
                        }
                    }
                }
                (Kind::Lock | Kind::Election, Mode::Exclusive) => (
                    at.checked_sub(1).map_or(Blocker::Nothing, |b| {
                        Blocker::Node(children[b].name.clone())
                    }),
                    0,
                ),
                (Kind::Lock | Kind::Election, Mode::Shared) => (
                    children[..at]
                        .iter()
                        .rev()
                        .find(|c| c.mode == Mode::Exclusive)
                        .map_or(Blocker::Nothing, |c| Blocker::Node(c.name.clone())),
                    0,
                ),
            };
            drop(listing);
            let blocker = match blocker {
                Blocker::Node(blocker) => blocker,
                Blocker::Nothing => {
                    // Nothing blocks it by place: its attempt decides (lock-delay, expiry).
                    self.wakeups.wake(key);
                    return Ok(());
                }
                Blocker::Earlier => {
                    let (now, w) =
                        Box::pin(must("watch", zk.list_and_watch_children(parent))).await?;
                    let position = sorted(now).iter().position(|c| c.name == name);
                    match position {
                        None => return Ok(()),
                        Some(i) if i < limit => {
                            self.wakeups.wake(key);
                            return Ok(());
                        }
                        Some(_) => {
                            Box::pin(self.await_watch(key, w)).await;
                            continue;
                        }
                    }
                }
            };
            let target = format!("{parent}/{blocker}");
            let watcher = match Box::pin(must("watch", zk.check_and_watch_stat(&target))).await? {
                (None, _) => {
                    self.wakeups.wake(key);
                    continue;
                }
                (Some(_), w) => w,
            };
            drop(target);
            if key.kind == Kind::Semaphore {
                // A deletion between the listing and the watch may have made
                // the predecessor head, or admitted it: look again.
                let again = Box::pin(self.children(zk, "watch", parent)).await?;
                let moved = again.children.iter().position(|c| c.name == name) != Some(at);
                drop(again);
                if moved {
                    continue;
                }
            }
            Box::pin(self.await_watch(key, watcher)).await;
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
