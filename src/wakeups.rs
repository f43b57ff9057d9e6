//! Wake-ups: the handle a backend calls when a key changes, and the local
//! waiter queues behind it — who in this sidecar waits for which key, in order.
//!
//! The backend keeps the global FIFO queue; this sidecar keeps its own
//! waiters sorted by their global ticket order, so a wake-up for a key goes to
//! the local head only (no herd inside the sidecar). The head attempts; when
//! it leaves — granted, timed out, gone — it passes the turn on.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, watch};

use crate::lock::{LockKey, Token};

/// A lease a backend granted to a queued claim by itself (the lock handed
/// over by its release), delivered to the claim's waiter with times in this
/// sidecar's clock.
#[derive(Debug, Clone)]
pub struct Handoff {
    pub token: Token,
    pub fence: u64,
    pub since_ms: u64,
    pub expires_at_ms: u64,
}

/// The handle backends use to wake this sidecar's waiters. Cheap to clone.
#[derive(Clone, Default)]
pub struct Wakeups {
    queues: Arc<Mutex<HashMap<LockKey, LocalQueue>>>,
    /// When the backend last sent this sidecar anything (Unix ms; 0: never).
    heard_ms: Arc<std::sync::atomic::AtomicU64>,
    /// Observers of keys (elections): told of every change the backend reports.
    observers: Arc<Mutex<HashMap<LockKey, Arc<Notify>>>>,
}

/// One key's local waiters, sorted by ticket sequence.
struct LocalQueue {
    slots: Vec<Slot>,
    /// Bumped whenever a waiter leaves, so the rest can report new positions.
    moved: watch::Sender<u64>,
    /// When the lease of the key's latest holder ends, as a lease handed to
    /// one of these waiters told (local ms; 0: none told): the others' timer
    /// for a holder that dies.
    until: watch::Sender<u64>,
}

struct Slot {
    seq: u64,
    notify: Arc<Notify>,
    /// Woken when this waiter becomes the local head.
    promoted: Arc<Notify>,
    /// A lease handed to this waiter, until it takes it.
    handed: Arc<Mutex<Option<Handoff>>>,
}

impl Wakeups {
    /// The backend sent this sidecar something (a message on a channel it
    /// listens on): evidence, with its connection up, that it is reachable.
    pub fn heard(&self) {
        self.heard_ms
            .store(crate::clock::now_ms(), std::sync::atomic::Ordering::Relaxed);
    }

    /// When the backend last sent this sidecar anything (Unix ms; 0: never).
    pub fn heard_at(&self) -> u64 {
        self.heard_ms.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Something changed on `key` that may let a waiter in: wake the local head.
    pub fn wake(&self, key: &LockKey) {
        self.changed(key);
        let queues = self.lock();
        if let Some(head) = queues.get(key).and_then(|q| q.slots.first()) {
            head.notify.notify_one();
        }
    }

    /// Only the waiter holding ticket `seq` may get in: wake it if it is the
    /// local head (tickets sort globally, so the global head is the head of
    /// its sidecar's queue).
    pub fn wake_ticket(&self, key: &LockKey, seq: u64) {
        self.changed(key);
        let queues = self.lock();
        if let Some(head) = queues.get(key).and_then(|q| q.slots.first())
            && head.seq == seq
        {
            head.notify.notify_one();
        }
    }

    /// The backend handed `key` to the waiter holding ticket `seq`: deliver
    /// the lease to it and wake it. False when no local waiter holds that
    /// ticket (it left, or has not taken its place yet); the lease is then
    /// still the backend's to give back.
    pub fn granted(&self, key: &LockKey, seq: u64, lease: Handoff) -> bool {
        self.changed(key);
        let queues = self.lock();
        let Some(q) = queues.get(key) else {
            return false;
        };
        set_until(&q.until, lease.expires_at_ms);
        let Some(slot) = q.slots.iter().find(|s| s.seq == seq) else {
            return false;
        };
        *lock(&slot.handed) = Some(lease);
        slot.notify.notify_one();
        true
    }

    /// Something changed on `key` that lets no waiter in (a new holder was
    /// announced): tell its observer only. [`wake`](Self::wake) tells it too.
    pub fn changed(&self, key: &LockKey) {
        let observers = lock(&self.observers);
        if let Some(notify) = observers.get(key) {
            notify.notify_one();
        }
    }

    /// Starts observing `key`: the returned guard is notified of every
    /// change reported for it until dropped. One observer per key.
    pub(crate) fn observe(&self, key: &LockKey) -> Observer {
        let notify = Arc::new(Notify::new());
        lock(&self.observers).insert(key.clone(), notify.clone());
        Observer {
            wakeups: self.clone(),
            key: key.clone(),
            notify,
        }
    }

    /// Number of local waiters on `key`.
    pub fn len(&self, key: &LockKey) -> usize {
        self.lock().get(key).map_or(0, |q| q.slots.len())
    }

    /// The keys that have local waiters (for backends that must wake them all,
    /// e.g. after missing notifications while reconnecting).
    pub fn keys(&self) -> Vec<LockKey> {
        self.lock().keys().cloned().collect()
    }

    /// Number of local waiters on all keys.
    pub fn total(&self) -> usize {
        self.lock().values().map(|q| q.slots.len()).sum()
    }

    /// Adds a waiter holding ticket `seq` in its global order.
    pub(crate) fn join(&self, key: &LockKey, seq: u64) -> Place {
        let notify = Arc::new(Notify::new());
        let promoted = Arc::new(Notify::new());
        let handed = Arc::new(Mutex::new(None));
        let mut queues = self.lock();
        let q = queues.entry(key.clone()).or_insert_with(|| LocalQueue {
            slots: Vec::new(),
            moved: watch::channel(0).0,
            until: watch::channel(0).0,
        });
        let at = q.slots.partition_point(|s| s.seq < seq);
        q.slots.insert(
            at,
            Slot {
                seq,
                notify: notify.clone(),
                promoted: promoted.clone(),
                handed: handed.clone(),
            },
        );
        let mut until = q.until.subscribe();
        until.mark_unchanged();
        Place {
            wakeups: self.clone(),
            key: key.clone(),
            seq,
            notify,
            promoted,
            moved: q.moved.subscribe(),
            until,
            handed,
            pass_on: true,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<LockKey, LocalQueue>> {
        lock(&self.queues)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An observer's registration for one key; dropping it stops the notifications.
pub(crate) struct Observer {
    wakeups: Wakeups,
    key: LockKey,
    notify: Arc<Notify>,
}

impl Observer {
    /// Resolves at the next change (one that came since the last call counts).
    pub async fn notified(&self) {
        self.notify.notified().await;
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        let mut observers = lock(&self.wakeups.observers);
        if observers
            .get(&self.key)
            .is_some_and(|n| Arc::ptr_eq(n, &self.notify))
        {
            observers.remove(&self.key);
        }
    }
}

/// A waiter's place in its key's local queue. Dropping it leaves the queue
/// and, if it was the head, wakes the next waiter.
pub(crate) struct Place {
    wakeups: Wakeups,
    key: LockKey,
    seq: u64,
    notify: Arc<Notify>,
    /// Woken when this waiter becomes the local head (see [`Place::promoted`]).
    promoted: Arc<Notify>,
    moved: watch::Receiver<u64>,
    until: watch::Receiver<u64>,
    /// A lease the backend handed to this waiter ([`Wakeups::granted`]).
    handed: Arc<Mutex<Option<Handoff>>>,
    /// Whether leaving wakes the next waiter (false after an exclusive grant,
    /// which the next waiter cannot follow).
    pass_on: bool,
}

impl Place {
    /// Whether this waiter is first among the local ones.
    pub fn is_head(&self) -> bool {
        let queues = self.wakeups.lock();
        queues
            .get(&self.key)
            .and_then(|q| q.slots.first())
            .is_some_and(|s| s.seq == self.seq)
    }

    /// 1-based local position and local queue length.
    pub fn position(&self) -> (usize, usize) {
        let queues = self.wakeups.lock();
        queues.get(&self.key).map_or((1, 1), |q| {
            let at = q.slots.partition_point(|s| s.seq < self.seq);
            (at + 1, q.slots.len())
        })
    }

    /// Resolves when this waiter is woken (a permit is kept if it is not waiting yet).
    pub async fn notified(&self) {
        self.notify.notified().await;
    }

    /// Resolves when this waiter has become the local head: only the head
    /// follows the holder's expiry ([`Self::holder_until`]), so that a
    /// handoff does not stir every waiter of the key.
    pub async fn promoted(&self) {
        self.promoted.notified().await;
    }

    /// A receiver that changes whenever a waiter of this key leaves, i.e.
    /// positions moved.
    pub fn moves(&self) -> watch::Receiver<u64> {
        self.moved.clone()
    }

    /// A receiver of when the key's latest holder's lease ends, as a lease
    /// handed to a local waiter told ([`Wakeups::granted`]).
    pub fn holder_until(&self) -> watch::Receiver<u64> {
        self.until.clone()
    }

    /// The lease the backend handed to this waiter, once.
    pub fn take_handoff(&self) -> Option<Handoff> {
        lock(&self.handed).take()
    }

    /// Leaves after a grant of a lease that ends at `until_ms` unless renewed;
    /// `pass_on` says whether the next waiter might be granted too (shared
    /// locks, semaphore permits), and when not, the others time their next
    /// look by that end.
    pub fn leave_granted(mut self, pass_on: bool, until_ms: u64) {
        self.pass_on = pass_on;
        if !pass_on && let Some(q) = self.wakeups.lock().get(&self.key) {
            set_until(&q.until, until_ms);
        }
    }

    /// Leaves without a grant (timed out, cancelled, failed), in one step
    /// with taking a lease handed to it meanwhile: the caller gives that back,
    /// and a lease handed later finds no place (see [`Wakeups::granted`]).
    pub fn leave(self) -> Option<Handoff> {
        let handed = {
            let mut queues = self.wakeups.lock();
            let handed = lock(&self.handed).take();
            remove(&mut queues, &self.key, self.seq, self.pass_on);
            handed
        };
        // Its slot is gone: dropping it finds nothing to do.
        drop(self);
        handed
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut queues = self.wakeups.lock();
        remove(&mut queues, &self.key, self.seq, self.pass_on);
    }
}

/// Tells a key's waiters when its holder's lease ends, waking them only when
/// that changed: each wake-up costs every local waiter of the key a turn (a
/// handoff is told twice, by the backend's message and by the grant).
fn set_until(until: &watch::Sender<u64>, ms: u64) {
    until.send_if_modified(|at| {
        let changed = *at != ms;
        *at = ms;
        changed
    });
}

/// Takes waiter `seq` out of `key`'s local queue; if it was the head and
/// `pass_on`, the next waiter is woken.
fn remove(queues: &mut HashMap<LockKey, LocalQueue>, key: &LockKey, seq: u64, pass_on: bool) {
    let Some(q) = queues.get_mut(key) else {
        return;
    };
    let Some(at) = q.slots.iter().position(|s| s.seq == seq) else {
        return;
    };
    q.slots.remove(at);
    if q.slots.is_empty() {
        queues.remove(key);
        return;
    }
    q.moved.send_modify(|n| *n += 1);
    if at == 0
        && let Some(next) = q.slots.first()
    {
        next.promoted.notify_one();
        if pass_on {
            next.notify.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;

    use super::Wakeups;
    use crate::lock::{Kind, LockKey, Name};

    #[test]
    fn a_named_ticket_wakes_only_its_holder_at_the_head() {
        let wakeups = Wakeups::default();
        let key = LockKey {
            kind: Kind::Lock,
            name: Name::parse("q").unwrap(),
        };
        let head = wakeups.join(&key, 5);
        let second = wakeups.join(&key, 7);

        wakeups.wake_ticket(&key, 7);
        assert!(
            head.notified().now_or_never().is_none(),
            "7 is not the head"
        );
        assert!(
            second.notified().now_or_never().is_none(),
            "only heads wake"
        );

        wakeups.wake_ticket(&key, 5);
        assert!(head.notified().now_or_never().is_some(), "5 is the head");
    }
}
