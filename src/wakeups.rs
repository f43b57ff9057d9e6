//! Wake-ups: the handle a backend calls when a key changes, and the local
//! waiter queues behind it — who in this sidecar waits for which key, in order.
//!
//! The backend keeps the global FIFO queue; this sidecar keeps its own
//! waiters sorted by their global ticket order, so a wake-up for a key goes to
//! the local head only (no herd inside the sidecar). The head attempts; when
//! it leaves — granted, timed out, gone — it passes the turn on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

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
    /// How many of the slots follow their position ([`News::MOVED`]).
    following: usize,
    /// When the lease of the key's latest holder ends, as a lease handed to
    /// one of these waiters told (local ms; 0: none told): the head's timer
    /// for a holder that dies.
    until: u64,
}

struct Slot {
    seq: u64,
    signal: Arc<Signal>,
}

/// What a waiter is told, and its one wake-up for all of it: a waiting
/// request's state is one future for every kind of news, not one each.
struct Signal {
    notify: Notify,
    /// The news not yet taken, [`News`] bits.
    news: AtomicU8,
    /// Whether the waiter wants [`News::MOVED`] (it reports its position).
    follows_moves: bool,
    /// A lease handed to this waiter, until it takes it.
    handed: Mutex<Option<Handoff>>,
}

impl Signal {
    fn tell(&self, news: u8) {
        self.news.fetch_or(news, Ordering::AcqRel);
        self.notify.notify_one();
    }
}

/// What a waiter was told since it last looked, as bits ([`Place::news`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct News(u8);

impl News {
    /// Woken: the waiter may get in now (a release, a handoff).
    pub const WOKEN: u8 = 1;
    /// It became the local head (it alone follows the holder's expiry).
    pub const PROMOTED: u8 = 2;
    /// A waiter ahead of it left: its position moved.
    pub const MOVED: u8 = 4;
    /// The holder's lease end changed (told to the head only).
    pub const UNTIL: u8 = 8;

    /// Whether any of `bits` is set.
    pub fn has(self, bits: u8) -> bool {
        self.0 & bits != 0
    }
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
            head.signal.tell(News::WOKEN);
        }
    }

    /// Every local waiter on `key` may have lost its place in the
    /// backend's queue (passed by while this sidecar could not be reached):
    /// the head looks at once, every other one as soon as it heads the
    /// local queue, which puts its place back before its turn comes.
    pub fn wake_all(&self, key: &LockKey) {
        self.changed(key);
        let queues = self.lock();
        for slot in queues
            .get(key)
            .map(|q| q.slots.iter())
            .into_iter()
            .flatten()
        {
            slot.signal.tell(News::WOKEN);
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
            head.signal.tell(News::WOKEN);
        }
    }

    /// The backend handed `key` to the waiter holding ticket `seq`: deliver
    /// the lease to it and wake it. False when no local waiter holds that
    /// ticket (it left, or has not taken its place yet; the lease is then
    /// still the backend's to give back), or when the lease ended before
    /// this process heard of it (it was stopped, while it still counted as
    /// alive): the lock may be another's by now, with a higher fence, so
    /// the waiter is only woken, to ask again with its ticket (which queues
    /// it again at its place, or finds the lease were it still there).
    pub fn granted(&self, key: &LockKey, seq: u64, lease: Handoff) -> bool {
        self.changed(key);
        let mut queues = self.lock();
        let Some(q) = queues.get_mut(key) else {
            return false;
        };
        set_until(q, lease.expires_at_ms);
        let Some(slot) = q.slots.iter().find(|s| s.seq == seq) else {
            return false;
        };
        if lease.expires_at_ms <= crate::clock::now_ms() {
            slot.signal.tell(News::WOKEN);
            return false;
        }
        *lock(&slot.signal.handed) = Some(lease);
        slot.signal.tell(News::WOKEN);
        true
    }

    /// Every observer looks again: changes may have gone unheard
    /// (notifications missed while the backend's connection was down).
    pub fn wake_observers(&self) {
        let observers: Vec<Arc<Notify>> = lock(&self.observers).values().cloned().collect();
        for notify in observers {
            notify.notify_one();
        }
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

    /// Adds a waiter holding ticket `seq` in its global order;
    /// `follows_moves`: it is told when its position moves.
    pub(crate) fn join(&self, key: &LockKey, seq: u64, follows_moves: bool) -> Place {
        let signal = Arc::new(Signal {
            notify: Notify::new(),
            news: AtomicU8::new(0),
            follows_moves,
            handed: Mutex::new(None),
        });
        let mut queues = self.lock();
        let q = queues.entry(key.clone()).or_insert_with(|| LocalQueue {
            slots: Vec::new(),
            following: 0,
            until: 0,
        });
        q.following += usize::from(follows_moves);
        let at = q.slots.partition_point(|s| s.seq < seq);
        q.slots.insert(
            at,
            Slot {
                seq,
                signal: signal.clone(),
            },
        );
        Place {
            wakeups: self.clone(),
            key: key.clone(),
            seq,
            signal,
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
    /// Its news and wake-up, shared with its slot in the queue.
    signal: Arc<Signal>,
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

    /// Resolves with what this waiter was told since it last looked (news
    /// told while it was not waiting is kept): woken, promoted to the local
    /// head, its position moved (when it follows moves), the holder's lease
    /// end changed (told to the head only, [`Self::holder_until`]).
    ///
    /// # Cancellation safety
    /// Cancellation safe: news is taken only when this resolves.
    pub async fn news(&self) -> News {
        loop {
            let news = self.signal.news.swap(0, Ordering::AcqRel);
            if news != 0 {
                return News(news);
            }
            self.signal.notify.notified().await;
        }
    }

    /// When the key's latest holder's lease ends, as a lease handed to a
    /// local waiter told ([`Wakeups::granted`]; Unix ms, 0: none told).
    pub fn holder_until(&self) -> u64 {
        self.wakeups.lock().get(&self.key).map_or(0, |q| q.until)
    }

    /// Whether the backend handed this waiter a lease not taken yet.
    pub fn has_handoff(&self) -> bool {
        lock(&self.signal.handed).is_some()
    }

    /// The lease the backend handed to this waiter, once.
    pub fn take_handoff(&self) -> Option<Handoff> {
        lock(&self.signal.handed).take()
    }

    /// Leaves after a grant of a lease that ends at `until_ms` unless renewed;
    /// `pass_on` says whether the next waiter might be granted too (shared
    /// locks, semaphore permits), and when not, the others time their next
    /// look by that end.
    pub fn leave_granted(mut self, pass_on: bool, until_ms: u64) {
        self.pass_on = pass_on;
        if !pass_on && let Some(q) = self.wakeups.lock().get_mut(&self.key) {
            set_until(q, until_ms);
        }
    }

    /// Leaves without a grant (timed out, cancelled, failed), in one step
    /// with taking a lease handed to it meanwhile: the caller gives that back,
    /// and a lease handed later finds no place (see [`Wakeups::granted`]).
    pub fn leave(self) -> Option<Handoff> {
        let handed = {
            let mut queues = self.wakeups.lock();
            let handed = lock(&self.signal.handed).take();
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

/// Records when the key's holder's lease ends and tells the local head,
/// only when that changed: only the head follows the holder (the others
/// read it when promoted), and a handoff is told twice (by the backend's
/// message and by the grant).
fn set_until(q: &mut LocalQueue, ms: u64) {
    if q.until == ms {
        return;
    }
    q.until = ms;
    if let Some(head) = q.slots.first() {
        head.signal.tell(News::UNTIL);
    }
}

/// Takes waiter `seq` out of `key`'s local queue; the waiters behind it that
/// follow their position are told it moved, and if it was the head, the
/// next is promoted (and woken when `pass_on`).
fn remove(queues: &mut HashMap<LockKey, LocalQueue>, key: &LockKey, seq: u64, pass_on: bool) {
    let Some(q) = queues.get_mut(key) else {
        return;
    };
    let Some(at) = q.slots.iter().position(|s| s.seq == seq) else {
        return;
    };
    let gone = q.slots.remove(at);
    q.following -= usize::from(gone.signal.follows_moves);
    if q.slots.is_empty() {
        queues.remove(key);
        return;
    }
    // Only followers care past the new head.
    let told = if q.following == 0 {
        usize::from(at == 0)
    } else {
        q.slots.len()
    };
    for (i, slot) in q.slots.iter().enumerate().take(told).skip(at) {
        let mut news = if slot.signal.follows_moves {
            News::MOVED
        } else {
            0
        };
        if i == 0 {
            news |= News::PROMOTED;
            if pass_on {
                news |= News::WOKEN;
            }
        }
        if news != 0 {
            slot.signal.tell(news);
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;

    use super::Wakeups;
    use crate::lock::LockKey;

    #[test]
    fn a_named_ticket_wakes_only_its_holder_at_the_head() {
        let wakeups = Wakeups::default();
        let key = key();
        let head = wakeups.join(&key, 5, false);
        let second = wakeups.join(&key, 7, false);

        wakeups.wake_ticket(&key, 7);
        assert!(head.news().now_or_never().is_none(), "7 is not the head");
        assert!(second.news().now_or_never().is_none(), "only heads wake");

        wakeups.wake_ticket(&key, 5);
        assert!(head.news().now_or_never().is_some(), "5 is the head");
    }

    /// After this sidecar could not be reached, every local waiter may
    /// have lost its place: all of them are told, not only the head (the
    /// others look once they head the queue).
    #[test]
    fn waking_all_tells_every_waiter_of_the_key_alone() {
        use super::News;
        let wakeups = Wakeups::default();
        let (key, other) = (key(), LockKey::lock("other"));
        let waiters: Vec<_> = (1..=3).map(|seq| wakeups.join(&key, seq, false)).collect();
        let elsewhere = wakeups.join(&other, 4, false);

        wakeups.wake_all(&key);
        for (i, w) in waiters.iter().enumerate() {
            let news = w.news().now_or_never().expect("told");
            assert!(news.has(News::WOKEN), "waiter {i}");
        }
        assert!(elsewhere.news().now_or_never().is_none(), "another key");
        wakeups.wake_all(&LockKey::lock("nobody"));
    }

    #[test]
    fn a_leaver_tells_the_new_head_and_the_followers_behind_it() {
        use super::News;
        let wakeups = Wakeups::default();
        let key = key();
        let first = wakeups.join(&key, 1, true);
        let second = wakeups.join(&key, 2, false);
        let third = wakeups.join(&key, 3, true);
        let fourth = wakeups.join(&key, 4, true);

        drop(third);
        assert_eq!(first.news().now_or_never(), None, "ahead of the leaver");
        assert_eq!(second.news().now_or_never(), None, "follows no moves");
        assert_eq!(fourth.news().now_or_never(), Some(News(News::MOVED)));

        drop(first);
        let news = second.news().now_or_never().expect("promoted");
        assert!(news.has(News::PROMOTED) && news.has(News::WOKEN));
        assert!(!news.has(News::MOVED), "second follows no moves");
        assert!(second.is_head());
        assert_eq!(fourth.news().now_or_never(), Some(News(News::MOVED)));
        assert_eq!(fourth.news().now_or_never(), None, "news is taken once");
    }

    #[test]
    fn only_the_head_is_told_the_holders_end_and_a_new_head_reads_it() {
        use super::News;
        let wakeups = Wakeups::default();
        let key = key();
        let head = wakeups.join(&key, 1, false);
        let next = wakeups.join(&key, 2, false);
        head.leave_granted(false, 5_000);
        let news = next.news().now_or_never().expect("promoted");
        assert!(news.has(News::PROMOTED) && !news.has(News::WOKEN));
        assert_eq!(next.holder_until(), 5_000);
        let last = wakeups.join(&key, 3, false);
        let until = crate::clock::now_ms() + 9_000;
        assert!(wakeups.granted(&key, 3, handoff(until)));
        assert_eq!(next.news().now_or_never(), Some(News(News::UNTIL)));
        assert_eq!(last.news().now_or_never(), Some(News(News::WOKEN)));
        assert_eq!(next.holder_until(), until);
        assert!(last.take_handoff().is_some());
    }

    /// A handoff whose lease ended before it came (its process was
    /// stopped) is not delivered: its waiter is woken to ask again.
    #[test]
    fn a_handoff_that_lapsed_before_it_came_only_wakes_its_waiter() {
        use super::News;
        let wakeups = Wakeups::default();
        let key = key();
        let waiter = wakeups.join(&key, 1, false);
        assert!(!wakeups.granted(&key, 1, handoff(crate::clock::now_ms() - 1)));
        let news = waiter.news().now_or_never().expect("woken");
        assert!(news.has(News::WOKEN));
        assert!(waiter.take_handoff().is_none());
    }

    fn key() -> LockKey {
        LockKey::lock("q")
    }

    fn handoff(expires_at_ms: u64) -> super::Handoff {
        super::Handoff {
            token: crate::lock::Token::generate(),
            fence: 1,
            since_ms: 0,
            expires_at_ms,
        }
    }
}
