//! Following watches: a waiting node watches what blocks it and wakes the
//! local waiters when that changes (module doc, # Watches).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use super::names::sorted;
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

/// What the follower's task does next.
enum Plan {
    /// Stop following; wake the local waiters if true.
    Stop(bool),
    /// Look at the lock again.
    Again,
    /// Wait a moment, then look again.
    Pause,
    /// Wait for `watcher`: the deletion of the blocker if `deletion`
    /// (`last` when nothing else blocks the node), else any change.
    Wait {
        watcher: zk::OneshotWatcher,
        deletion: bool,
        last: bool,
    },
}

/// The task that watches what blocks one waiting node of this sidecar and
/// wakes the local waiters on its key when that changes, until the node is
/// granted or leaves (module doc, # Watches).
///
/// A sidecar runs one per waiting node, for as long as it waits: its state
/// is what every waiter costs beyond its request. The node's name and its
/// parent's path are looked up when it looks at the lock (rarely), not
/// kept; the calls are boxed, so the task is small while it waits.
pub(super) struct Follower {
    pub(super) me: Arc<Inner>,
    /// The session the node belongs to.
    pub(super) zk: zk::Client,
    pub(super) key: LockKey,
    /// The node's sequence: its ticket in [`Inner::tickets`].
    pub(super) seq: u64,
    /// The parent's children as the attempt that queued the node saw them
    /// (taken after the node was created), which saves the first listing;
    /// taken by it.
    pub(super) listing: Option<Arc<Listing>>,
}

impl Follower {
    /// Follows the node on a task of its own.
    pub(super) fn spawn(self) {
        tokio::spawn(self.task());
    }

    /// The task: a plain `fn` returning a block, which holds the follower
    /// once (an `async fn` would hold its arguments twice: 568 bytes, not
    /// 400), and waits for its watches in one place, inline (what it waits
    /// for most of the time), while looking at the lock is boxed.
    #[allow(clippy::manual_async_fn)]
    fn task(mut self) -> impl Future<Output = ()> + Send + 'static {
        async move {
            let Some(mut left) = self.start() else {
                return;
            };
            let wake = loop {
                let listing = self.listing.take();
                let looked = Box::pin(self.look(listing)).await;
                // Passed on whole: a binding matched by parts would keep
                // its storage in the task for the wait.
                let (watcher, deletion, last) = match self.settle(looked) {
                    Plan::Stop(wake) => break wake,
                    Plan::Again => continue,
                    Plan::Pause => {
                        if Box::pin(self.pause()).await {
                            break false;
                        }
                        continue;
                    }
                    Plan::Wait {
                        watcher,
                        deletion,
                        last,
                    } => (watcher, deletion, last),
                };
                // Until the node stops waiting here: a waiter that left
                // would otherwise keep its task, watch and client handle
                // until the holder changed, hours later perhaps.
                let event = tokio::select! {
                    event = watcher.changed() => event,
                    _ = &mut left => break false,
                };
                self.fired(&event);
                let ended = event.session_state.is_terminated();
                if !deletion {
                    if !ended && event.event_type != zk::EventType::NodeDataChanged {
                        self.me.wakeups.wake(&self.key);
                    }
                    continue;
                }
                if ended {
                    break false;
                }
                if event.event_type == zk::EventType::NodeDeleted && self.admits(last) {
                    break true;
                }
            };
            self.stop(wake);
        }
    }

    /// Marks the node followed, and returns what tells the task that the
    /// node no longer waits; `None` when it is followed already, or no
    /// longer waits.
    fn start(&self) -> Option<tokio::sync::oneshot::Receiver<()>> {
        match lock(&self.me.tickets).get_mut(&(self.key.clone(), self.seq)) {
            Some(queued) if queued.follower.is_none() => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                queued.follower = Some(tx);
                Some(rx)
            }
            _ => None,
        }
    }

    /// What the task does after looking at the lock: what it found, or
    /// after a failure, wait a moment and look again — unless the session
    /// ended, which forgets its tickets and wakes every local waiter.
    fn settle(&self, looked: Result<Plan, Error>) -> Plan {
        match looked {
            Ok(plan) => plan,
            Err(_) if !self.zk.state().is_terminated() => Plan::Pause,
            Err(_) => Plan::Stop(false),
        }
    }

    /// Marks the node no longer followed and, if `wake`, wakes the local
    /// waiters: after `follower` is cleared, so that an attempt this wakes
    /// that finds the node still blocked follows it again, with its own
    /// listing.
    fn stop(&self, wake: bool) {
        if let Some(queued) = lock(&self.me.tickets).get_mut(&(self.key.clone(), self.seq)) {
            queued.follower = None;
            queued.answer = None;
            queued.hint = wake;
        }
        if wake {
            self.me.wakeups.wake(&self.key);
        }
    }

    /// The node's blocker is gone. Nothing else blocked the node (`last`):
    /// it is admitted. Or it is this sidecar's first waiter on the key,
    /// whose attempt lists the lock anyway and follows it again if it is
    /// still blocked. Else (false) it lists the lock itself.
    fn admits(&self, last: bool) -> bool {
        last || self.me.first_here(&self.key, self.seq)
    }

    /// Waits a moment before following again; true when the backend closes
    /// meanwhile.
    async fn pause(&self) -> bool {
        tokio::select! {
            () = self.me.closing.cancelled() => true,
            () = tokio::time::sleep(Duration::from_millis(500)) => false,
        }
    }

    fn fired(&self, event: &zk::WatchedEvent) {
        tracing::debug!(
            backend = "zookeeper",
            lock = %self.key,
            path = %event.path,
            event = ?event.event_type,
            "watch fired"
        );
    }

    /// Looks at the lock — with `listing`, or a new one — and sets up the
    /// watch on what blocks the node.
    ///
    /// Listings are dropped before the follower waits for its watch: a
    /// waiter parked with the listing it joined on would keep O(queue
    /// length) bytes alive for as long as it waits, O(n²) for a queue of n.
    async fn look(&self, listing: Option<Arc<Listing>>) -> Result<Plan, Error> {
        let (me, zk, key, seq) = (&self.me, &self.zk, &self.key, self.seq);
        let Some(name) = lock(&me.tickets)
            .get(&(key.clone(), seq))
            .map(|q| q.own.name.clone())
        else {
            return Ok(Plan::Stop(false));
        };
        let parent = me.key_path(key);
        let listing = match listing {
            Some(listing) => listing,
            None => {
                // Around again: something changed.
                me.changed(key, seq);
                me.children(zk, "watch", &parent).await?
            }
        };
        let children = &listing.children;
        let Some(at) = children.iter().position(|c| c.name == name) else {
            return Ok(Plan::Stop(false));
        };
        let (blocker, limit) = match (key.kind, children[at].mode) {
            (Kind::Semaphore, _) => {
                let limit = me
                    .active_limit(zk, "watch", &parent, children, &mut Vec::new())
                    .await?
                    .unwrap_or(1) as usize;
                match at.cmp(&limit) {
                    // Admitted by place, unless its attempt found a node
                    // ahead with another limit: it watches that one.
                    std::cmp::Ordering::Less => {
                        let mixed = lock(&me.tickets)
                            .get(&(key.clone(), seq))
                            .and_then(|q| q.mixed.clone())
                            .filter(|m| children[..at].iter().any(|c| c.name == *m));
                        (
                            mixed.map_or(Blocker::Nothing, |name| Blocker::Node {
                                name,
                                last: false,
                            }),
                            limit,
                        )
                    }
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
            Blocker::Nothing => return Ok(Plan::Stop(true)),
            Blocker::Earlier => {
                let (now, w) = must("watch", zk.list_and_watch_children(&parent)).await?;
                let position = sorted(now).iter().position(|c| c.name == name);
                return Ok(match position {
                    None => Plan::Stop(false),
                    Some(i) if i < limit => Plan::Stop(true),
                    Some(_) => Plan::Wait {
                        watcher: w,
                        deletion: false,
                        last: false,
                    },
                });
            }
        };
        let target = format!("{parent}/{blocker}");
        if key.kind == Kind::Semaphore {
            let watcher = match must("watch", zk.check_and_watch_stat(&target)).await? {
                (None, _) => {
                    me.wakeups.wake(key);
                    return Ok(Plan::Again);
                }
                (Some(_), w) => w,
            };
            // A deletion between the listing and the watch may have made
            // the predecessor head, or admitted it: look again.
            let again = me.children(zk, "watch", &parent).await?;
            let moved = again.children.iter().position(|c| c.name == name) != Some(at);
            return Ok(if moved {
                Plan::Again
            } else {
                Plan::Wait {
                    watcher,
                    deletion: false,
                    last: false,
                }
            });
        }
        // A lock waiter needs only the blocker's deletion: a children
        // watch on it fires for that alone, not for the data changes of
        // its grant and renewals.
        match call("watch", zk.list_and_watch_children(&target)).await? {
            Ok((_, watcher)) => Ok(Plan::Wait {
                watcher,
                deletion: true,
                last,
            }),
            // Gone already: as if its deletion had fired.
            Err(zk::Error::NoNode) if self.admits(last) => Ok(Plan::Stop(true)),
            Err(zk::Error::NoNode) => Ok(Plan::Again),
            Err(e) => Err(unavailable("watch", e)),
        }
    }
}

impl Inner {
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

#[cfg(test)]
mod tests {
    use super::Follower;

    /// The size of what `f` returns, without calling it.
    fn returned_size<A, F>(_: impl FnOnce(A) -> F) -> usize {
        size_of::<F>()
    }

    /// A sidecar runs a follower task for every waiting node, for as
    /// long as it waits: 10,000 waiters are 10,000 tasks. tokio adds a
    /// header and a trailer (104 bytes) to the future and aligns the task
    /// to 128 bytes, so up to 408 bytes the task takes 512 (it took 1,024
    /// when the follower was an `async fn` taking its state as arguments).
    #[test]
    fn a_follower_task_fits_in_512_bytes() {
        let size = returned_size(Follower::task);
        assert!(size <= 408, "the follower's task future is {size} bytes");
    }
}
