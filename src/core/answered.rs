//! Releases answered lately, by the `Idempotency-Key` their client sent: a
//! release sent again with the same key (its answer lost on the way, or the
//! client gave up waiting for it) gets the first answer instead of
//! releasing one hold more.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::lock::{LockKey, Token};

/// How long an answer is kept for a release sent again.
pub(super) const KEPT_FOR: Duration = Duration::from_secs(300);

/// The most answers kept; the oldest goes first when a new one comes.
pub(super) const MOST_KEPT: usize = 65_536;

/// One release's place: its answer (the holds left), once it has one. A
/// release sent again while the first is under way waits on its lock.
pub(super) type Slot = Arc<tokio::sync::Mutex<Option<u32>>>;

/// The places of the releases answered lately, by a hash of the lock, the
/// token and the client's key: the token itself is not kept.
pub(super) struct Answered {
    slots: HashMap<u64, Slot>,
    /// The same hashes, oldest first, with when each was made.
    order: VecDeque<(Instant, u64)>,
    /// Keyed at random per process, so nobody can choose colliding keys.
    hasher: RandomState,
}

impl Default for Answered {
    fn default() -> Self {
        Self {
            slots: HashMap::new(),
            order: VecDeque::new(),
            hasher: RandomState::new(),
        }
    }
}

impl Answered {
    /// The place of the release of `token` on `key` with the client's
    /// `idempotency` key, made at `now` if it is new; places older than
    /// [`KEPT_FOR`], and beyond [`MOST_KEPT`] the oldest, are forgotten.
    pub(super) fn slot(
        &mut self,
        key: &LockKey,
        token: &Token,
        idempotency: &str,
        now: Instant,
    ) -> Slot {
        while let Some(&(made, hash)) = self.order.front() {
            if now.saturating_duration_since(made) < KEPT_FOR && self.order.len() < MOST_KEPT {
                break;
            }
            self.order.pop_front();
            self.slots.remove(&hash);
        }
        let hash = self.hasher.hash_one((
            key.kind.as_str(),
            key.name.as_str(),
            token.expose(),
            idempotency,
        ));
        self.slots
            .entry(hash)
            .or_insert_with(|| {
                self.order.push_back((now, hash));
                Slot::default()
            })
            .clone()
    }

    /// How many places are kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{Answered, KEPT_FOR, MOST_KEPT};
    use crate::lock::{LockKey, Token};

    /// A key names one release of one lease: the same key on another
    /// lease, or another key on the same lease, is another release; and
    /// what is kept is bounded in time and in number.
    #[tokio::test]
    async fn a_key_names_one_release_of_one_lease_for_a_bounded_while() {
        let (a, b) = (LockKey::lock("a"), LockKey::lock("b"));
        let (t1, t2) = (Token::generate(), Token::generate());
        let t0 = Instant::now();
        let mut answered = Answered::default();
        *answered.slot(&a, &t1, "k", t0).lock().await = Some(1);
        assert_eq!(*answered.slot(&a, &t1, "k", t0).lock().await, Some(1));
        assert_eq!(*answered.slot(&a, &t2, "k", t0).lock().await, None);
        assert_eq!(*answered.slot(&b, &t1, "k", t0).lock().await, None);
        assert_eq!(*answered.slot(&a, &t1, "k2", t0).lock().await, None);
        assert_eq!(answered.len(), 4);
        // Forgotten after its time.
        let later = t0 + KEPT_FOR + Duration::from_millis(1);
        assert_eq!(*answered.slot(&a, &t1, "k", later).lock().await, None);
        assert_eq!(answered.len(), 1);
        // Never more than MOST_KEPT.
        for i in 0..MOST_KEPT + 10 {
            answered.slot(&a, &t1, &i.to_string(), later);
        }
        assert_eq!(answered.len(), MOST_KEPT);
    }
}
