//! This sidecar's queue tickets on one node ([`Tickets`]): the claims it
//! queued there, the tickets that left the queue lately and those whose
//! leaving is still to be told; and whose numbering they follow.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use crate::lock::{LockKey, Token};

use super::lock;

/// One of this sidecar's queue entries on a node: the token it queued with
/// (the lease's, when the lock is handed to it) and the entry as its join
/// wrote it, by which the scripts find it.
#[derive(Clone)]
pub(super) struct Queued {
    pub(super) token: Token,
    pub(super) entry: String,
}

/// A ticket whose leaving is still to be sent ([`Tickets::abandoned`]).
pub(super) struct Abandoned {
    pub(super) queued: Queued,
    /// A leaving that may have run was sent with the ticket's token: sent
    /// again, it only takes the entry out of the queue, as a second run by
    /// the token would take a hold its owner may have re-entered since.
    pub(super) token_spent: bool,
    /// Set once that entry-only leaving found the entry gone (a release may
    /// have handed the lock to the ticket before): nothing more is sent,
    /// and the ticket is kept until then so that the handoff's message,
    /// which waits [`UNKNOWN_GRACE`](super::pubsub::UNKNOWN_GRACE) for a
    /// ticket it does not know, still finds it abandoned and gives that
    /// lease back (by its fence, unless it was re-entered).
    pub(super) kept_until: Option<std::time::Instant>,
}

/// How long a ticket that left the queue is remembered ([`Tickets::finished`]).
const FINISHED_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// This sidecar's tickets on one node, shared by its member and its pub/sub task.
#[derive(Default)]
pub(super) struct Tickets {
    /// Queued tickets per key, by the node's ticket numbers.
    pub(super) queued: HashMap<LockKey, BTreeMap<u64, Queued>>,
    /// Tickets that left the queue lately (granted, handed over, dequeued):
    /// a handoff message for one of them is no lease nobody knows.
    pub(super) finished: Finished,
    /// Tickets whose waiter left while the node could not be told: their
    /// leaving is sent again (the key's reconciling, the caller's retries),
    /// and a lock handed to one meanwhile is given back.
    pub(super) abandoned: HashMap<(LockKey, u64), Abandoned>,
    /// Tokens of joins whose answer was lost, while their background
    /// release may still take the lost grant's hold (`false`) or has taken
    /// it (`true`, until the lease's ttl): a lock handed to one of them is
    /// left to that release, not given back as well, which would take a
    /// second hold (one its owner took again by re-entering).
    pub(super) lost: HashMap<(LockKey, Token), bool>,
}

/// Tickets that left the queue in the last [`FINISHED_FOR`]. Each is
/// forgotten once, oldest first, when a later one is added: a sidecar that
/// hands over a thousand locks a second remembers sixty thousand, and
/// adding one must not look at all of them.
#[derive(Default)]
pub(super) struct Finished {
    /// When each ticket last left.
    at: HashMap<(LockKey, u64), std::time::Instant>,
    /// The same tickets (a ticket that left twice: twice), oldest first.
    order: std::collections::VecDeque<(std::time::Instant, LockKey, u64)>,
}

impl Finished {
    /// Remembers that ticket `seq` on `key` left at `now`, and forgets the
    /// tickets that left [`FINISHED_FOR`] before it. Returns how many it
    /// forgot.
    pub(super) fn add(&mut self, key: &LockKey, seq: u64, now: std::time::Instant) -> usize {
        let mut forgot = 0;
        while let Some((left, ..)) = self.order.front() {
            if now.saturating_duration_since(*left) < FINISHED_FOR {
                break;
            }
            let Some((left, old_key, old_seq)) = self.order.pop_front() else {
                break;
            };
            let id = (old_key, old_seq);
            // Not when it left again later: that entry is further back.
            if self.at.get(&id) == Some(&left) {
                self.at.remove(&id);
                forgot += 1;
            }
        }
        self.at.insert((key.clone(), seq), now);
        self.order.push_back((now, key.clone(), seq));
        forgot
    }

    /// Whether ticket `seq` on `key` left lately.
    pub(super) fn has(&self, key: &LockKey, seq: u64) -> bool {
        self.at.contains_key(&(key.clone(), seq))
    }

    /// Forgets ticket `seq` on `key` at once (its place in the order is
    /// skipped when its turn comes).
    fn forget(&mut self, key: &LockKey, seq: u64) {
        self.at.remove(&(key.clone(), seq));
    }

    /// How many tickets are remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.at.len()
    }
}

impl Tickets {
    /// Whether a ticket of this sidecar on `key` may still be on the node:
    /// queued, abandoned, or a lost join's.
    pub(super) fn on(&self, key: &LockKey) -> bool {
        self.queued.contains_key(key)
            || self.abandoned.keys().any(|(k, _)| k == key)
            || self.lost.keys().any(|(k, _)| k == key)
    }

    /// The tokens of lost joins on `key` whose background release is under
    /// way or took the lost grant's hold, and whether one is under way.
    pub(super) fn lost_on(&self, key: &LockKey) -> (Vec<Token>, bool) {
        let mut pending = false;
        let tokens = self
            .lost
            .iter()
            .filter(|((k, _), _)| k == key)
            .map(|((_, token), taken)| {
                pending |= !taken;
                token.clone()
            })
            .collect();
        (tokens, pending)
    }

    /// Whether ticket `seq` on `key` is queued or left lately.
    pub(super) fn knows(&self, key: &LockKey, seq: u64) -> bool {
        self.queued.get(key).is_some_and(|s| s.contains_key(&seq)) || self.finished.has(key, seq)
    }

    /// This process's queued tickets on `key` and their entries, in ticket order.
    pub(super) fn entries(&self, key: &LockKey) -> Vec<(u64, String)> {
        self.queued
            .get(key)
            .map(|s| s.iter().map(|(seq, q)| (*seq, q.entry.clone())).collect())
            .unwrap_or_default()
    }

    /// Of `entries` (a ticket and its entry each), those that are no longer
    /// queued here as that entry: their waiters left (or, on a Redlock
    /// node, queued again with another entry). Each ticket is forgotten as
    /// finished, so a lock handed to it is given back as one handed to a
    /// ticket nobody knows.
    pub(super) fn take_left(&mut self, key: &LockKey, entries: Vec<(u64, String)>) -> Vec<String> {
        let queued = self.queued.get(key);
        entries
            .into_iter()
            .filter(|(seq, entry)| {
                queued.is_none_or(|s| s.get(seq).is_none_or(|q| q.entry != *entry))
            })
            .map(|(seq, entry)| {
                self.finished.forget(key, seq);
                entry
            })
            .collect()
    }
}

/// Whose numbering a node's queue tickets follow, which decides how a
/// release message that names the next ticket (`h<seq>`) wakes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Numbering {
    /// The node's tickets are the local queues' own (one Redis): only the
    /// named ticket is woken.
    Shared,
    /// Each node numbers its tickets its own way (Redlock): every named
    /// ticket wakes the local queue head, as a plain release does.
    PerNode,
}

/// Adds (`Some`) or removes this sidecar's ticket `seq` on `key`; a removed
/// one is remembered as finished for a while.
pub(super) fn track(tickets: &Mutex<Tickets>, key: &LockKey, seq: u64, queued: Option<Queued>) {
    let mut tickets = lock(tickets);
    match queued {
        Some(q) => {
            tickets
                .queued
                .entry(key.clone())
                .or_default()
                .insert(seq, q);
        }
        None => {
            if let Some(seqs) = tickets.queued.get_mut(key) {
                seqs.remove(&seq);
                if seqs.is_empty() {
                    tickets.queued.remove(key);
                }
            }
            tickets.finished.add(key, seq, std::time::Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use std::sync::Mutex;

    use super::{FINISHED_FOR, Finished, Queued, Tickets, track};
    use crate::lock::{LockKey, Token};

    fn key(name: &str) -> LockKey {
        LockKey::lock(name)
    }

    /// A ticket is known for [`FINISHED_FOR`] after it last left, and then
    /// forgotten; adding one forgets only the tickets whose time is up, so
    /// a busy sidecar's handoffs do not each look at every ticket of the
    /// last minute (they did: sixty thousand at a thousand handoffs a second).
    #[test]
    fn finished_tickets_are_forgotten_oldest_first_one_by_one() {
        let (a, b) = (key("a"), key("b"));
        let t0 = Instant::now();
        let mut finished = Finished::default();
        let step = Duration::from_millis(1);
        let n = 3 * FINISHED_FOR.as_millis() as u64;
        let mut forgot = 0;
        for i in 0..n {
            forgot += finished.add(&a, i, t0 + step * i as u32);
            // No more than a minute's worth is ever remembered.
            assert!(finished.len() <= FINISHED_FOR.as_millis() as usize + 1);
        }
        assert_eq!(
            forgot + finished.len(),
            n as usize,
            "each ticket forgotten once"
        );
        assert!(finished.has(&a, n - 1));
        assert!(!finished.has(&a, 0));
        assert!(!finished.has(&b, n - 1));

        // A ticket that leaves again is kept from its last time.
        let mut finished = Finished::default();
        finished.add(&b, 7, t0);
        finished.add(&b, 7, t0 + FINISHED_FOR / 2);
        assert_eq!(finished.add(&a, 1, t0 + FINISHED_FOR), 0);
        assert!(finished.has(&b, 7));
        assert_eq!(finished.add(&a, 2, t0 + FINISHED_FOR * 2), 2);
        assert!(!finished.has(&b, 7));
        assert!(!finished.has(&a, 1));
    }

    /// The entries put back for waiters that left are those no longer
    /// queued as that entry: a ticket queued again with another entry (a
    /// Redlock node whose grant was undone) left its first one; the tickets
    /// taken are no longer known as finished.
    #[test]
    fn entries_put_back_for_tickets_that_left_are_taken() {
        let tickets = Mutex::new(Tickets::default());
        let a = key("a");
        let queued = |entry: &str| Queued {
            token: Token::generate(),
            entry: entry.to_owned(),
        };
        track(&tickets, &a, 1, Some(queued("1 x first")));
        track(&tickets, &a, 2, Some(queued("2 x stays")));
        track(&tickets, &a, 3, Some(queued("3 x leaves")));
        // Ticket 1 is granted and undone, and queued again; 3 leaves.
        track(&tickets, &a, 1, None);
        track(&tickets, &a, 1, Some(queued("1 x again")));
        track(&tickets, &a, 3, None);
        let snapshot = vec![
            (1, "1 x first".to_owned()),
            (2, "2 x stays".to_owned()),
            (3, "3 x leaves".to_owned()),
        ];
        let mut t = tickets.lock().unwrap();
        assert!(t.knows(&a, 3));
        assert_eq!(t.take_left(&a, snapshot), ["1 x first", "3 x leaves"]);
        assert!(!t.knows(&a, 3));
        assert!(t.knows(&a, 1) && t.knows(&a, 2));
    }
}
