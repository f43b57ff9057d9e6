//! Elections: a campaign is a hold on the election's lock (kind
//! [`Kind::Election`]); its leader is that lock's holder. This module keeps
//! what a campaign publishes with its leadership ([`Candidate`]), the
//! leader as observers see it ([`Leader`], [`ElectionView`]), which
//! elections a campaign through this sidecar leads (for `…/ready`), and one
//! observer per observed election on this sidecar, shared by every stream
//! that follows it.
//!
//! An observer reads the election with one `inspect` and reads it again
//! when the backend reports a change of the key ([`Backend::observe`]: a
//! release, an expiry, a queue head leaving, the new leader's announcement
//! ([`Backend::announce`]) where the backend delivers one, any change of the
//! election's node on ZooKeeper), when a follower joins, at the leader's
//! expiry, and after at most [`REFRESH`] otherwise. While candidates wait
//! and nobody leads, it looks again soon: the next leader is being granted.
//!
//! [`Backend::observe`]: crate::backend::Backend::observe
//! [`Backend::announce`]: crate::backend::Backend::announce

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::ReusableBoxFuture;
use utoipa::ToSchema;

use crate::backend::State;
use crate::clock::{after, instant_at};
use crate::lock::{Kind, LockKey, Name, Token};

use super::Core;

/// Longest accepted campaign value, in bytes of UTF-8.
pub const MAX_VALUE_BYTES: usize = 1024;

/// The longest an observer goes without reading its election: a safety net
/// for a lost notification. Every backend reports changes (a release, an
/// expiry noticed, an announced grant, a ZooKeeper watch), and a leader
/// that dies without releasing is looked at when its lease expires, so an
/// observer costs about one `inspect` per lease period of its leader.
pub const REFRESH: Duration = Duration::from_secs(30);

/// The first look again after a release while nobody leads.
const SETTLE: Duration = Duration::from_millis(5);

/// What a campaign stores as its lease's owner: the caller's owner, the
/// value it publishes, and a per-campaign id, so that two campaigns of one
/// owner never re-enter each other's lease (re-entry is by owner).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Candidate {
    pub owner: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    pub campaign: String,
}

impl Candidate {
    /// A new campaign's candidate.
    pub fn new(owner: String, value: Option<String>) -> Self {
        Self {
            owner,
            value,
            campaign: Token::generate().expose()[..16].to_owned(),
        }
    }

    /// The lease owner that carries this candidate.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The candidate a stored owner carries; an owner that is not one (a
    /// lease written by something else) is the owner, without a value.
    pub fn decode(stored: &str) -> Self {
        serde_json::from_str(stored).unwrap_or_else(|_| Self {
            owner: stored.to_owned(),
            value: None,
            campaign: String::new(),
        })
    }
}

/// The leader of an election, as every sidecar sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Leader {
    /// The campaign's `owner`.
    pub owner: String,
    /// The sidecar the campaign runs through.
    pub sidecar: String,
    /// What the campaign published (`value`), if anything.
    pub value: Option<String>,
    /// The leadership's fence: strictly greater than every earlier leader's.
    pub fence: u64,
    /// When this leadership began (Unix ms).
    pub since_ms: u64,
}

impl Leader {
    /// Whether two readings show the same leadership: `since_ms` is left
    /// out, as Redlock reads it as the earliest of the nodes that answered,
    /// which a slow node can move without anything having changed.
    pub fn same_as(&self, other: &Self) -> bool {
        (&self.owner, &self.sidecar, &self.value, self.fence)
            == (&other.owner, &other.sidecar, &other.value, other.fence)
    }
}

/// An election as every sidecar sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElectionView {
    pub leader: Option<Leader>,
    /// The campaign id of the leader (not shown to clients).
    pub leader_campaign: Option<String>,
    /// Campaigns leading or waiting, across all sidecars.
    pub candidates: usize,
    /// When the leader's lease expires unless renewed.
    pub leader_expires_at_ms: Option<u64>,
}

impl ElectionView {
    /// The view of an election's lock state.
    pub fn of(state: &State) -> Self {
        let holder = state.holders.first();
        let candidate = holder.map(|h| Candidate::decode(&h.owner));
        Self {
            leader: holder.zip(candidate.as_ref()).map(|(h, c)| Leader {
                owner: c.owner.clone(),
                sidecar: h.sidecar.clone(),
                value: c.value.clone(),
                fence: h.fence,
                since_ms: h.since_ms,
            }),
            leader_campaign: candidate.map(|c| c.campaign),
            candidates: state.holders.len() + state.waiters.len(),
            leader_expires_at_ms: holder.map(|h| h.expires_at_ms),
        }
    }
}

/// The elections of this sidecar: its observers and its leaders.
#[derive(Default)]
pub struct Elections {
    /// One observer per election someone on this sidecar follows.
    observers: Mutex<HashMap<Name, Weak<watch::Sender<Option<ElectionView>>>>>,
    /// Campaigns through this sidecar that lead, by election.
    leading: Mutex<HashMap<Name, usize>>,
}

/// Marks a campaign through this sidecar as leading while it lives.
pub struct Leading {
    core: Weak<Core>,
    name: Name,
}

impl Drop for Leading {
    fn drop(&mut self) {
        let Some(core) = self.core.upgrade() else {
            return;
        };
        let mut leading = lock(&core.elections.leading);
        if let Some(n) = leading.get_mut(&self.name) {
            *n -= 1;
            if *n == 0 {
                leading.remove(&self.name);
            }
        }
        core.metrics.elections_leading.dec();
    }
}

/// A follower of one election: yields its view when first read and
/// whenever it changes.
pub struct Following {
    /// The next change, and the receiver it came through.
    changes: ReusableBoxFuture<'static, watch::Receiver<Option<ElectionView>>>,
    // Keeps the observer alive.
    _observer: Arc<watch::Sender<Option<ElectionView>>>,
}

impl Following {
    /// A follower whose first view is the observer's next read (a view
    /// already read may be stale: grants are not announced everywhere).
    fn new(observer: Arc<watch::Sender<Option<ElectionView>>>) -> Self {
        let mut views = observer.subscribe();
        views.borrow_and_update();
        Self {
            changes: ReusableBoxFuture::new(async move {
                let _ = views.changed().await;
                views
            }),
            _observer: observer,
        }
    }

    /// The view at the observer's next read, then at every read after it
    /// (streams report only what changed).
    pub fn poll_view(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<ElectionView> {
        loop {
            let mut views = std::task::ready!(self.changes.poll(cx));
            let view = views.borrow_and_update().clone();
            self.changes.set(async move {
                // Never closed: this follower keeps the sender.
                let _ = views.changed().await;
                views
            });
            if let Some(view) = view {
                return std::task::Poll::Ready(view);
            }
        }
    }
}

impl Core {
    /// Whether a campaign through this sidecar leads `name`.
    pub fn leads(&self, name: &Name) -> bool {
        lock(&self.elections.leading).contains_key(name)
    }

    /// Marks a campaign of `name` as leading until the guard drops, and
    /// counts the leader change (each change is counted once, by the
    /// sidecar of the new leader).
    pub fn lead(&self, name: &Name) -> Leading {
        *lock(&self.elections.leading)
            .entry(name.clone())
            .or_default() += 1;
        let m = &self.metrics;
        m.elections_leading.inc();
        m.leader_changed(name);
        Leading {
            core: self.me.clone(),
            name: name.clone(),
        }
    }

    /// Tells every sidecar that `name` has a new leader (or lost its
    /// leader: see [`Core::end`](super::Core)), where the backend
    /// can (observers elsewhere see it at once rather than at their next
    /// look). Runs in a task: the campaign does not wait for it.
    pub fn announce(&self, name: &Name) {
        self.announce_key(&election_key(name));
    }

    /// [`Core::announce`] for an election's key: a new leader, or none.
    pub(super) fn announce_key(&self, key: &LockKey) {
        let Some(me) = self.me.upgrade() else {
            return;
        };
        let key = key.clone();
        self.tasks.spawn(async move {
            let _ = me.op("announce", me.backend.announce(&key)).await;
        });
    }

    /// Follows election `name`, starting its observer on this sidecar if
    /// nobody here follows it yet.
    pub fn follow(&self, name: &Name) -> Following {
        let mut observers = lock(&self.elections.observers);
        if let Some(sender) = observers.get(name).and_then(Weak::upgrade) {
            let following = Following::new(sender);
            // Read now, for the new follower.
            self.wakeups.changed(&election_key(name));
            return following;
        }
        let sender = Arc::new(watch::channel(None).0);
        observers.insert(name.clone(), Arc::downgrade(&sender));
        drop(observers);
        let following = Following::new(sender.clone());
        if let Some(me) = self.me.upgrade() {
            let weak = Arc::downgrade(&sender);
            let name = name.clone();
            self.tasks
                .spawn(async move { me.observe(name, weak).await });
        }
        following
    }

    /// The observer of `name`: reads the election and publishes its view
    /// until nobody follows it or the sidecar shuts down.
    async fn observe(
        self: Arc<Self>,
        name: Name,
        sender: Weak<watch::Sender<Option<ElectionView>>>,
    ) {
        let key = election_key(&name);
        let changed = self.wakeups.observe(&key);
        // Wake-ups for the key, where the backend delivers them by subscription.
        let mut delivery = None;
        let mut settle = SETTLE;
        loop {
            let Some(tx) = sender.upgrade() else {
                // Every follower left while this read (or before the first):
                // the entry goes, unless a new observer has taken its place.
                let mut observers = lock(&self.elections.observers);
                if observers.get(&name).is_some_and(|s| s.ptr_eq(&sender)) {
                    observers.remove(&name);
                }
                break;
            };
            if delivery.is_none() {
                delivery = self.op("observe", self.backend.observe(&key)).await.ok();
            }
            let mut next = after(REFRESH);
            match self.op("inspect", self.backend.inspect(&key)).await {
                Ok(state) => {
                    let view = ElectionView::of(&state);
                    if view.leader.is_none() && view.candidates > 0 {
                        // Someone is being granted: look again soon.
                        next = next.min(after(settle));
                        settle = (settle * 2).min(REFRESH);
                    } else {
                        settle = SETTLE;
                    }
                    // 0: a leader with no expiry (a key written by hand),
                    // which only the refresh looks at again.
                    if let Some(expires) = view.leader_expires_at_ms.filter(|&e| e > 0) {
                        // A leader that dies without releasing lapses then.
                        let lapse = instant_at(expires.saturating_add(1)).max(after(SETTLE));
                        next = next.min(lapse);
                    }
                    // Every read reaches every follower: one that joined
                    // since the last read waits for this one.
                    tx.send_replace(Some(view));
                }
                Err(_) => next = after(REFRESH.min(Duration::from_millis(500))),
            }
            tokio::select! {
                () = tx.closed() => {
                    // A follower may have joined since: leave only if none has.
                    let mut observers = lock(&self.elections.observers);
                    if tx.receiver_count() == 0 {
                        observers.remove(&name);
                        break;
                    }
                }
                () = self.shutdown.cancelled() => break,
                () = changed.notified() => settle = SETTLE,
                () = tokio::time::sleep_until(next) => {}
            }
        }
        drop(delivery);
    }
}

/// The lock key of election `name`.
pub fn election_key(name: &Name) -> LockKey {
    LockKey {
        kind: Kind::Election,
        name: name.clone(),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::core::expiry::tests::core;
    use crate::lock::Name;

    /// A follower that leaves before its observer's first read (or while
    /// a read is under way) leaves no entry behind: each name left one for
    /// good, so clients opening and closing observe streams under new
    /// names grew the map without bound.
    #[tokio::test]
    async fn an_observer_whose_followers_left_leaves_no_entry() {
        let core = core();
        for i in 0..20 {
            let name = Name::parse(&format!("e{i}")).unwrap();
            drop(core.follow(&name));
        }
        let followed = core.follow(&Name::parse("kept").unwrap());
        for _ in 0..100 {
            if super::lock(&core.elections.observers).len() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let observers = super::lock(&core.elections.observers);
        assert_eq!(
            observers.len(),
            1,
            "{:?}",
            observers.keys().collect::<Vec<_>>()
        );
        drop((observers, followed));
    }
}
