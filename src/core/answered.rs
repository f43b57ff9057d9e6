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

/// The turn of the requests of one release under way: a request sent
/// again while the first is under way waits for it.
pub(super) type Turn = Arc<tokio::sync::Mutex<()>>;

/// One release: a hash of the lock, the token and the client's key (the
/// token itself is not kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Release(u64);

/// The answers of the releases answered lately, and the turns of those
/// under way.
pub(super) struct Answered {
    /// The holds each release left, once it was answered. Only answers
    /// are kept: a request that was refused (a made-up token) or failed
    /// takes no place, so requests cannot push real answers out.
    kept: HashMap<Release, (u32, Instant)>,
    /// The same releases with when each was answered, oldest first (one
    /// answered twice, its time up in between: twice).
    order: VecDeque<(Instant, Release)>,
    /// The turns of releases under way with how many requests hold each,
    /// removed by the last of them ([`Answered::leave`]): never pushed out
    /// while in use.
    under_way: HashMap<Release, (Turn, usize)>,
    /// Keyed at random per process, so nobody can choose colliding keys.
    hasher: RandomState,
}

impl Default for Answered {
    fn default() -> Self {
        Self {
            kept: HashMap::new(),
            order: VecDeque::new(),
            under_way: HashMap::new(),
            hasher: RandomState::new(),
        }
    }
}

impl Answered {
    /// The release of `token` on `key` with the client's `idempotency` key.
    pub(super) fn release(&self, key: &LockKey, token: &Token, idempotency: &str) -> Release {
        Release(self.hasher.hash_one((
            key.kind.as_str(),
            key.name.as_str(),
            token.expose(),
            idempotency,
        )))
    }

    /// The holds `release` left, if it was answered in the last [`KEPT_FOR`]
    /// (as of `now`).
    pub(super) fn answer(&self, release: Release, now: Instant) -> Option<u32> {
        let &(left, answered) = self.kept.get(&release)?;
        (now.saturating_duration_since(answered) < KEPT_FOR).then_some(left)
    }

    /// Keeps `left`, the answer of `release`, as of `now`; answers older
    /// than [`KEPT_FOR`], and beyond [`MOST_KEPT`] the oldest, are forgotten.
    pub(super) fn keep(&mut self, release: Release, left: u32, now: Instant) {
        while let Some(&(answered, old)) = self.order.front() {
            if now.saturating_duration_since(answered) < KEPT_FOR && self.order.len() < MOST_KEPT {
                break;
            }
            self.order.pop_front();
            // Not when it was answered again later: that entry is further back.
            if self.kept.get(&old).is_some_and(|&(_, at)| at == answered) {
                self.kept.remove(&old);
            }
        }
        self.kept.insert(release, (left, now));
        self.order.push_back((now, release));
    }

    /// The turn of `release` for one more request, which must
    /// [`leave`](Answered::leave) it.
    pub(super) fn join(&mut self, release: Release) -> Turn {
        let (turn, requests) = self.under_way.entry(release).or_default();
        *requests += 1;
        turn.clone()
    }

    /// A request of `release` is done with its turn: the last one removes it.
    pub(super) fn leave(&mut self, release: Release) {
        if let Some((_, requests)) = self.under_way.get_mut(&release) {
            *requests -= 1;
            if *requests == 0 {
                self.under_way.remove(&release);
            }
        }
    }

    /// How many answers are kept, and how many releases are under way.
    #[cfg(test)]
    fn len(&self) -> (usize, usize) {
        (self.kept.len(), self.under_way.len())
    }
}

/// A request's place in the turn of its release: leaves it when dropped,
/// however the request ends.
pub(super) struct Leaving<'a> {
    pub(super) answered: &'a std::sync::Mutex<Answered>,
    pub(super) release: Release,
}

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        self.answered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .leave(self.release);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{Answered, KEPT_FOR, MOST_KEPT};
    use crate::lock::{LockKey, Token};

    /// A key names one release of one lease: the same key on another
    /// lease, or another key on the same lease, is another release; and
    /// what is kept is bounded in time and in number, and only answers.
    #[test]
    fn a_key_names_one_release_of_one_lease_for_a_bounded_while() {
        let (a, b) = (LockKey::lock("a"), LockKey::lock("b"));
        let (t1, t2) = (Token::generate(), Token::generate());
        let t0 = Instant::now();
        let mut answered = Answered::default();
        let first = answered.release(&a, &t1, "k");
        answered.keep(first, 1, t0);
        assert_eq!(answered.answer(first, t0), Some(1));
        assert_eq!(answered.release(&a, &t1, "k"), first);
        for other in [
            answered.release(&a, &t2, "k"),
            answered.release(&b, &t1, "k"),
            answered.release(&a, &t1, "k2"),
            answered.release(
                &LockKey {
                    kind: crate::lock::Kind::Semaphore,
                    ..a.clone()
                },
                &t1,
                "k",
            ),
        ] {
            assert_eq!(answered.answer(other, t0), None);
        }
        // Past its time.
        let later = t0 + KEPT_FOR + Duration::from_millis(1);
        assert_eq!(answered.answer(first, later), None);
        // Never more than MOST_KEPT, the oldest out first.
        for i in 0..MOST_KEPT + 10 {
            let r = answered.release(&a, &t1, &i.to_string());
            answered.keep(r, 0, later);
        }
        assert_eq!(answered.len().0, MOST_KEPT);
        let oldest = answered.release(&a, &t1, "0");
        let newest = answered.release(&a, &t1, &(MOST_KEPT + 9).to_string());
        assert_eq!(answered.answer(oldest, later), None);
        assert_eq!(answered.answer(newest, later), Some(0));
    }

    /// A release under way keeps its turn however many answers come and
    /// go, until its last request leaves it.
    #[test]
    fn a_release_under_way_keeps_its_turn_until_its_last_request_leaves() {
        let key = LockKey::lock("a");
        let token = Token::generate();
        let now = Instant::now();
        let mut answered = Answered::default();
        let release = answered.release(&key, &token, "k");
        let first = answered.join(release);
        let second = answered.join(release);
        assert!(std::sync::Arc::ptr_eq(&first, &second));
        for i in 0..MOST_KEPT + 1 {
            let r = answered.release(&key, &token, &i.to_string());
            answered.keep(r, 0, now);
        }
        // Each leaves while the other still holds its turn (the order in
        // which two requests' ends can interleave).
        answered.leave(release);
        assert_eq!(answered.len().1, 1, "the second request still waits");
        let third = answered.join(release);
        assert!(std::sync::Arc::ptr_eq(&third, &second));
        answered.leave(release);
        answered.leave(release);
        assert_eq!(answered.len().1, 0, "the last one out removed the turn");
        drop((first, second, third));
    }
}
