//! `memory://`: every lease, queue and fence in this process.
//!
//! For development, tests and single-process use. It implements the whole
//! [`Backend`] contract with one mutex over a map of keys, so it is also the
//! reference the other backends are checked against. A key's fence counter is
//! kept after the key goes idle (a few dozen bytes per name ever used), so
//! fences never repeat.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use super::{
    Attempt, Backend, Busy, Description, Error, Grant, Holder, Loss, SHOWN_HOLDERS, Safety,
    StaleKey, State, Status, Summary, Ticket, Turn, Waiter, Watch,
};
use crate::clock::{ms, now_ms};
use crate::lock::{Claim, Held, Kind, LockKey, Mode, Name, Token};
use crate::wakeups::Wakeups;

/// The in-process backend.
pub struct Memory {
    keys: Mutex<BTreeMap<LockKey, Entry>>,
    /// Source of ticket sequence numbers (global queue order).
    seq: AtomicU64,
    wakeups: Wakeups,
    /// Entries a listing looked at, for the tests.
    #[cfg(test)]
    looked_at: std::sync::atomic::AtomicUsize,
}

/// Everything known about one key.
#[derive(Default)]
struct Entry {
    /// Highest fence granted so far.
    fence: u64,
    /// Permit count while a semaphore is in use.
    limit: Option<u32>,
    leases: Vec<Lease>,
    /// Waiting tickets in queue order.
    queue: Vec<Queued>,
    /// Nothing is granted before this (lock-delay after an expiry or loss).
    delay_until_ms: u64,
}

struct Lease {
    token: Token,
    owner: String,
    sidecar: String,
    mode: Mode,
    fence: u64,
    count: u32,
    since_ms: u64,
    expires_at_ms: u64,
    /// Renewals stop here (`max_hold`).
    cap_ms: Option<u64>,
    /// The lease's own ttl, for renewals that do not name one.
    ttl: Duration,
    lock_delay: Duration,
}

struct Queued {
    seq: u64,
    owner: String,
    sidecar: String,
    mode: Mode,
    since_ms: u64,
}

impl Entry {
    /// Drops expired leases, starting their lock-delay. True if any was dropped.
    fn prune(&mut self, now: u64) -> bool {
        let before = self.leases.len();
        let mut delay = self.delay_until_ms;
        self.leases.retain(|l| {
            let live = l.expires_at_ms > now;
            if !live {
                delay = delay.max(l.expires_at_ms.saturating_add(ms(l.lock_delay)));
            }
            live
        });
        self.delay_until_ms = delay;
        self.forget_idle_limit();
        self.leases.len() != before
    }

    /// Never granted, nothing held or queued: the same as no entry at all.
    fn unused(&self) -> bool {
        self.fence == 0
            && self.limit.is_none()
            && self.leases.is_empty()
            && self.queue.is_empty()
            && self.delay_until_ms == 0
    }

    /// A semaphore with no holders and no waiters may be reused with another limit.
    fn forget_idle_limit(&mut self) {
        if self.leases.is_empty() && self.queue.is_empty() {
            self.limit = None;
        }
    }

    /// Gives back the room its leases and queue grew to, once they hold
    /// far less: a name keeps its entry for good, and kept its peak's room
    /// with it (a semaphore that once had 100,000 holders, 20 MB).
    fn trim(&mut self) {
        fn fit<T>(v: &mut Vec<T>) {
            if v.capacity() > 4 * v.len().max(1) {
                v.shrink_to(2 * v.len());
            }
        }
        fit(&mut self.leases);
        fit(&mut self.queue);
    }

    /// The first [`SHOWN_HOLDERS`] holders, as a busy answer names them,
    /// and how many others there are: copied under the backend's one
    /// mutex, every holder of a semaphore of 100,000 would hold up every
    /// other call for each refused claim.
    fn shown_holders(&self, kind: Kind) -> (Vec<Holder>, usize) {
        let shown = self.holders_of(kind, SHOWN_HOLDERS);
        let omitted = self.leases.len() - shown.len();
        (shown, omitted)
    }

    fn holders(&self, kind: Kind) -> Vec<Holder> {
        self.holders_of(kind, usize::MAX)
    }

    /// The first `most` holders.
    fn holders_of(&self, kind: Kind, most: usize) -> Vec<Holder> {
        self.leases
            .iter()
            .take(most)
            .map(|l| Holder {
                owner: l.owner.clone(),
                sidecar: l.sidecar.clone(),
                mode: Held::of(kind, l.mode),
                since_ms: l.since_ms,
                expires_at_ms: l.expires_at_ms,
                fence: l.fence,
                count: l.count,
            })
            .collect()
    }

    fn lease_mut(&mut self, token: &Token) -> Option<&mut Lease> {
        self.leases.iter_mut().find(|l| &l.token == token)
    }

    /// Checks the claim's `limit` against the semaphore's active one.
    fn settle_limit(&mut self, claim: &Claim) -> Result<(), Error> {
        if claim.key.kind != Kind::Semaphore {
            return Ok(());
        }
        match (self.limit, claim.limit) {
            (Some(active), Some(asked)) if active != asked => Err(Error::LimitMismatch { active }),
            (Some(_), _) => Ok(()),
            (None, Some(asked)) => {
                self.limit = Some(asked);
                Ok(())
            }
            (None, None) => Err(Error::LimitRequired),
        }
    }

    /// Whether the held leases leave room for `claim`.
    fn room_for(&self, claim: &Claim) -> bool {
        match (claim.key.kind, claim.mode) {
            (Kind::Semaphore, _) => (self.leases.len() as u64) < u64::from(self.limit.unwrap_or(0)),
            (Kind::Lock | Kind::Election, Mode::Exclusive) => self.leases.is_empty(),
            (Kind::Lock | Kind::Election, Mode::Shared) => {
                self.leases.iter().all(|l| l.mode == Mode::Shared)
            }
        }
    }

    /// Whether the queue lets `claim` in now (FIFO fairness).
    fn turn_has_come(&self, claim: &Claim, turn: Turn<'_>) -> bool {
        let Turn::Queued(ticket) = turn else {
            return self.queue.is_empty();
        };
        let Some(pos) = self.queue.iter().position(|q| q.seq == ticket.seq) else {
            return false;
        };
        let ahead = &self.queue[..pos];
        match (claim.key.kind, claim.mode) {
            (Kind::Semaphore, _) => {
                let free =
                    u64::from(self.limit.unwrap_or(0)).saturating_sub(self.leases.len() as u64);
                (pos as u64) < free
            }
            (Kind::Lock | Kind::Election, Mode::Exclusive) => pos == 0,
            (Kind::Lock | Kind::Election, Mode::Shared) => {
                ahead.iter().all(|q| q.mode == Mode::Shared)
            }
        }
    }

    /// When the state blocking `claim` can lapse by itself.
    fn retry_at(&self, claim: &Claim, now: u64) -> Option<u64> {
        if self.delay_until_ms > now {
            return Some(self.delay_until_ms);
        }
        self.leases
            .iter()
            .filter(|l| claim.mode == Mode::Exclusive || l.mode == Mode::Exclusive)
            .map(|l| l.expires_at_ms)
            .min()
    }

    fn position(&self, seq: u64) -> Option<usize> {
        self.queue.iter().position(|q| q.seq == seq).map(|p| p + 1)
    }
}

impl Memory {
    /// An empty store that wakes local waiters through `wakeups`.
    pub fn new(wakeups: Wakeups) -> Self {
        Self {
            keys: Mutex::new(BTreeMap::new()),
            seq: AtomicU64::new(0),
            wakeups,
            #[cfg(test)]
            looked_at: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Runs `f` on the key's entry with expired leases pruned; wakes waiters
    /// afterwards if `f` or the pruning says so. An entry left unused is
    /// not kept: requests on names never granted (an inspect, a release
    /// with a made-up token) kept one each, for the process's life.
    fn with_entry<T>(&self, key: &LockKey, f: impl FnOnce(&mut Entry, u64) -> (T, bool)) -> T {
        let now = now_ms();
        let (out, wake) = {
            let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
            let entry = keys.entry(key.clone()).or_default();
            let pruned = entry.prune(now);
            let (out, wake) = f(entry, now);
            entry.trim();
            if entry.unused() {
                keys.remove(key);
            }
            (out, wake || pruned)
        };
        if wake {
            self.wakeups.wake(key);
        }
        out
    }
}

#[async_trait]
impl Backend for Memory {
    fn describe(&self) -> Description {
        Description {
            kind: super::BackendKind::Memory,
            url: "memory://".into(),
            safety: Safety::SingleProcess,
        }
    }

    async fn ping(&self) -> Result<(), Error> {
        Ok(())
    }

    async fn try_acquire(&self, claim: &Claim, turn: Turn<'_>) -> Result<Attempt, Error> {
        self.with_entry(&claim.key, |e, now| {
            if let Err(err) = e.settle_limit(claim) {
                return (Err(err), false);
            }
            let reentry = claim
                .key
                .kind
                .is_lock()
                .then(|| {
                    e.leases
                        .iter_mut()
                        .find(|l| l.owner == claim.owner && l.mode == claim.mode)
                })
                .flatten();
            if let Some(l) = reentry {
                l.count += 1;
                l.expires_at_ms = l.expires_at_ms.max(now.saturating_add(ms(claim.ttl)));
                if let Some(cap) = l.cap_ms {
                    l.expires_at_ms = l.expires_at_ms.min(cap);
                }
                let grant = Grant {
                    token: l.token.clone(),
                    fence: l.fence,
                    count: l.count,
                    since_ms: l.since_ms,
                    expires_at_ms: l.expires_at_ms,
                };
                if let Turn::Queued(t) = turn {
                    e.queue.retain(|q| q.seq != t.seq);
                }
                return (Ok(Attempt::Granted(grant)), false);
            }
            if now >= e.delay_until_ms && e.room_for(claim) && e.turn_has_come(claim, turn) {
                e.fence += 1;
                let cap_ms = claim.max_hold.map(|m| now.saturating_add(ms(m)));
                let mut expires_at_ms = now.saturating_add(ms(claim.ttl));
                if let Some(cap) = cap_ms {
                    expires_at_ms = expires_at_ms.min(cap);
                }
                let lease = Lease {
                    token: Token::generate(),
                    owner: claim.owner.clone(),
                    sidecar: claim.sidecar.clone(),
                    mode: claim.mode,
                    fence: e.fence,
                    count: 1,
                    since_ms: now,
                    expires_at_ms,
                    cap_ms,
                    ttl: claim.ttl,
                    lock_delay: claim.lock_delay,
                };
                let grant = Grant {
                    token: lease.token.clone(),
                    fence: lease.fence,
                    count: 1,
                    since_ms: now,
                    expires_at_ms,
                };
                if e.leases.is_empty() {
                    // Most locks have one holder: room for one, not Vec's default four.
                    e.leases.reserve_exact(1);
                }
                e.leases.push(lease);
                if let Turn::Queued(t) = turn {
                    e.queue.retain(|q| q.seq != t.seq);
                }
                return (Ok(Attempt::Granted(grant)), false);
            }
            let (holders, omitted) = e.shown_holders(claim.key.kind);
            let mut busy = Busy {
                holders,
                omitted,
                queue_length: e.queue.len(),
                position: None,
                retry_at_ms: e.retry_at(claim, now),
                ticket: None,
            };
            match turn {
                Turn::Once => {}
                Turn::Join => {
                    let seq = self.seq.fetch_add(1, Ordering::Relaxed);
                    e.queue.push(Queued {
                        seq,
                        owner: claim.owner.clone(),
                        sidecar: claim.sidecar.clone(),
                        mode: claim.mode,
                        since_ms: now,
                    });
                    busy.queue_length = e.queue.len();
                    busy.position = Some(e.queue.len());
                    busy.ticket = Some(Ticket {
                        key: claim.key.clone(),
                        seq,
                    });
                }
                Turn::Queued(t) => busy.position = e.position(t.seq),
            }
            (Ok(Attempt::Busy(busy)), false)
        })
    }

    async fn dequeue(&self, ticket: &Ticket) -> Result<(), Error> {
        self.with_entry(&ticket.key, |e, _| {
            let before = e.queue.len();
            e.queue.retain(|q| q.seq != ticket.seq);
            e.forget_idle_limit();
            ((), e.queue.len() != before)
        });
        Ok(())
    }

    async fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, Error> {
        Ok(self.with_entry(key, |e, now| {
            let renewed = e.lease_mut(token).map(|l| {
                let mut until = now.saturating_add(ms(ttl.unwrap_or(l.ttl)));
                if let Some(cap) = l.cap_ms {
                    until = until.min(cap);
                }
                // Never sooner than it ends now: a re-entry may have given
                // it longer, and told its client so.
                let until = until.max(l.expires_at_ms);
                l.expires_at_ms = until;
                until
            });
            (renewed, false)
        }))
    }

    async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, Error> {
        Ok(self.with_entry(key, |e, _| {
            let Some(l) = e.lease_mut(token) else {
                return (None, false);
            };
            l.count -= 1;
            let remaining = l.count;
            if remaining == 0 {
                e.leases.retain(|l| &l.token != token);
                e.forget_idle_limit();
            }
            (Some(remaining), remaining == 0)
        }))
    }

    async fn status(&self, key: &LockKey, token: &Token) -> Result<Status, Error> {
        Ok(self.with_entry(key, |e, _| {
            let status = match e.lease_mut(token) {
                Some(l) => Status::Held {
                    expires_at_ms: l.expires_at_ms,
                },
                None => Status::Gone(Loss::Expired),
            };
            (status, false)
        }))
    }

    async fn inspect(&self, key: &LockKey) -> Result<State, Error> {
        Ok(self.with_entry(key, |e, _| {
            let waiters = e
                .queue
                .iter()
                .enumerate()
                .map(|(i, q)| Waiter {
                    owner: q.owner.clone(),
                    sidecar: q.sidecar.clone(),
                    mode: Held::of(key.kind, q.mode),
                    position: i + 1,
                    since_ms: q.since_ms,
                })
                .collect();
            let state = State {
                fence: e.fence,
                limit: e.limit,
                holders: e.holders(key.kind),
                waiters,
            };
            (state, false)
        }))
    }

    async fn list(
        &self,
        prefix: &str,
        after: Option<&LockKey>,
        limit: usize,
    ) -> Result<Vec<Summary>, Error> {
        let now = now_ms();
        let mut woken = Vec::new();
        let rows = {
            let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
            let mut rows = Vec::new();
            // Each kind's names that start with the prefix are together in
            // the map: only they are looked at, not every name ever used
            // (all kept, for their fences), under the backend's one mutex.
            let mut spans = Vec::new();
            if prefix.is_empty() {
                spans.push((
                    after.cloned().map_or(Bound::Unbounded, Bound::Excluded),
                    None,
                ));
            } else if let Ok(start) = Name::parse(prefix) {
                let mut kinds = [Kind::Lock, Kind::Semaphore, Kind::Election];
                kinds.sort();
                for kind in kinds {
                    let first = LockKey {
                        kind,
                        name: start.clone(),
                    };
                    let lower = match after {
                        Some(after) if *after >= first => Bound::Excluded(after.clone()),
                        _ => Bound::Included(first),
                    };
                    spans.push((lower, Some(kind)));
                }
            }
            'spans: for (lower, kind) in spans {
                for (key, e) in keys.range_mut((lower, Bound::Unbounded)) {
                    #[cfg(test)]
                    self.looked_at.fetch_add(1, Ordering::Relaxed);
                    if rows.len() >= limit {
                        break 'spans;
                    }
                    if kind.is_some_and(|k| k != key.kind) || !key.name.as_str().starts_with(prefix)
                    {
                        break;
                    }
                    if e.prune(now) {
                        woken.push(key.clone());
                        e.trim();
                    }
                    if e.leases.is_empty() && e.queue.is_empty() {
                        continue;
                    }
                    rows.push(Summary {
                        key: key.clone(),
                        holders: e.leases.len(),
                        waiters: e.queue.len(),
                        fence: e.fence,
                    });
                }
            }
            rows
        };
        for key in &woken {
            self.wakeups.wake(key);
        }
        Ok(rows)
    }

    async fn stale(&self, stale_after: Duration) -> Result<Vec<StaleKey>, Error> {
        let keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        // Read after taking the mutex, so no lease in the map was granted
        // with a later reading; ages saturate all the same, as the wall
        // clock may step back.
        let now = now_ms();
        Ok(keys
            .iter()
            .flat_map(|(key, e)| {
                e.leases
                    .iter()
                    .filter(move |l| {
                        key.kind != Kind::Election
                            && l.expires_at_ms > now
                            && now.saturating_sub(l.since_ms) > ms(stale_after)
                    })
                    .map(move |l| StaleKey {
                        key: key.to_string(),
                        reason: super::StaleReason::HeldTooLong,
                        age_ms: now.saturating_sub(l.since_ms),
                        detail: format!(
                            "held by owner {:?} on sidecar {:?} with fence {} for longer than {}",
                            l.owner,
                            l.sidecar,
                            l.fence,
                            humantime::format_duration(stale_after)
                        ),
                    })
            })
            .collect())
    }

    async fn force_release(&self, key: &LockKey) -> Result<Vec<Token>, Error> {
        Ok(self.with_entry(key, |e, now| {
            let leases = std::mem::take(&mut e.leases);
            for l in &leases {
                e.delay_until_ms = e.delay_until_ms.max(now.saturating_add(ms(l.lock_delay)));
            }
            e.forget_idle_limit();
            let tokens: Vec<Token> = leases.into_iter().map(|l| l.token).collect();
            let any = !tokens.is_empty();
            (tokens, any)
        }))
    }

    async fn announce(&self, key: &LockKey) -> Result<(), Error> {
        self.wakeups.changed(key);
        Ok(())
    }

    async fn watch(&self, _key: &LockKey) -> Result<Watch, Error> {
        // Every change happens in this process and wakes through `Wakeups` directly.
        Ok(Box::new(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock::Name;

    fn key(name: &str) -> LockKey {
        LockKey {
            kind: Kind::Lock,
            name: Name::parse(name).expect("a valid name"),
        }
    }

    /// An exclusive claim of `name` by one owner, 30 s.
    fn claim(name: &str) -> Claim {
        Claim {
            key: key(name),
            mode: Mode::Exclusive,
            owner: "owner".into(),
            sidecar: "sidecar".into(),
            ttl: Duration::from_secs(30),
            limit: None,
            lock_delay: Duration::ZERO,
            max_hold: None,
        }
    }

    /// Requests on names never granted keep nothing; a name once granted
    /// keeps its entry (its fence) after its release.
    #[tokio::test]
    async fn only_names_once_granted_are_kept() {
        let memory = Memory::new(Wakeups::default());
        let token = Token::generate();
        for i in 0..100 {
            let key = key(&format!("never-{i}"));
            memory.inspect(&key).await.expect("inspect");
            memory.release(&key, &token).await.expect("release");
            memory.renew(&key, &token, None).await.expect("renew");
            memory.status(&key, &token).await.expect("status");
            memory.force_release(&key).await.expect("force-release");
        }
        assert_eq!(memory.keys.lock().unwrap().len(), 0);
        let claim = claim("granted");
        let grant = granted(&memory, &claim).await;
        memory
            .release(&claim.key, &grant.token)
            .await
            .expect("release");
        assert_eq!(memory.keys.lock().unwrap().len(), 1);
        let again = granted(&memory, &claim).await;
        assert!(again.fence > grant.fence);
    }

    /// A lease granted with a clock read later than the scan's (the grant
    /// read it before the scan took the mutex, or the wall clock stepped
    /// back) is not stale: its age is 0, not an underflow (a panic in a
    /// debug build, an age of 584 million years in a release build).
    #[tokio::test]
    async fn a_lease_from_the_scans_future_is_not_stale() {
        let memory = Memory::new(Wakeups::default());
        let claim = claim("future");
        memory
            .try_acquire(&claim, Turn::Once)
            .await
            .expect("acquire");
        for entry in memory.keys.lock().unwrap().values_mut() {
            for lease in &mut entry.leases {
                lease.since_ms += 60_000;
            }
        }
        let stale = memory.stale(Duration::ZERO).await.expect("stale");
        assert!(stale.is_empty(), "{stale:?}");
    }

    /// `claim`'s grant, tried once: it must be granted.
    async fn granted(memory: &Memory, claim: &Claim) -> Grant {
        match memory.try_acquire(claim, Turn::Once).await {
            Ok(Attempt::Granted(g)) => g,
            other => panic!("not granted: {other:?}"),
        }
    }

    /// A semaphore claim of `name` by `owner`, with `limit` permits.
    fn permit(name: &str, owner: &str, limit: u32) -> Claim {
        Claim {
            key: LockKey {
                kind: Kind::Semaphore,
                name: Name::parse(name).expect("a valid name"),
            },
            owner: owner.into(),
            limit: Some(limit),
            ..claim(name)
        }
    }

    /// The room a name's leases and queue grew to is given back once they
    /// empty: its entry is kept for good, and kept its peak's room (20 MB
    /// for a semaphore that once had 100,000 holders, however many names).
    #[tokio::test]
    async fn a_name_does_not_keep_the_room_of_its_busiest_moment() {
        const N: u32 = 1_000;
        let memory = Memory::new(Wakeups::default());
        let mut tokens = Vec::new();
        for i in 0..N {
            let claim = permit("busiest", &format!("holder-{i}"), N);
            let g = granted(&memory, &claim).await;
            tokens.push(g.token);
        }
        let waiter = permit("busiest", "waiter", N);
        let mut tickets = Vec::new();
        for _ in 0..N {
            let Attempt::Busy(b) = memory.try_acquire(&waiter, Turn::Join).await.expect("join")
            else {
                panic!("granted");
            };
            tickets.push(b.ticket.expect("a ticket"));
        }
        let key = permit("busiest", "", N).key;
        for token in &tokens {
            memory.release(&key, token).await.expect("release");
        }
        for ticket in &tickets {
            memory.dequeue(ticket).await.expect("dequeue");
        }
        let keys = memory.keys.lock().unwrap();
        let entry = keys.get(&key).expect("kept: it was granted");
        assert!(
            entry.leases.capacity() <= 4 && entry.queue.capacity() <= 4,
            "room kept: {} leases, {} queued",
            entry.leases.capacity(),
            entry.queue.capacity()
        );
    }

    /// A refused claim names the first [`SHOWN_HOLDERS`] holders and counts
    /// the others: the answer is built under the backend's one mutex, and
    /// copying every holder of a large semaphore for each refusal held up
    /// every other call meanwhile.
    #[tokio::test]
    async fn a_refusal_copies_no_more_holders_than_it_shows() {
        let memory = Memory::new(Wakeups::default());
        let held = 3 * SHOWN_HOLDERS as u32;
        for i in 0..held {
            let claim = permit("full", &format!("holder-{i}"), held);
            memory
                .try_acquire(&claim, Turn::Once)
                .await
                .expect("acquire");
        }
        let refused = permit("full", "late", held);
        let Attempt::Busy(busy) = memory
            .try_acquire(&refused, Turn::Once)
            .await
            .expect("acquire")
        else {
            panic!("granted past the limit");
        };
        assert_eq!(busy.holders.len(), SHOWN_HOLDERS);
        assert_eq!(busy.omitted, held as usize - SHOWN_HOLDERS);
        assert_eq!(busy.holders[0].owner, "holder-0");
    }

    /// A listing by prefix looks at the names that start with it, not at
    /// every name ever used (each is kept, for its fence) under the
    /// backend's one mutex; pages by prefix and after a name go on across
    /// kinds as before.
    #[tokio::test]
    async fn a_listing_by_prefix_looks_only_at_names_with_it() {
        let memory = Memory::new(Wakeups::default());
        for i in 0..1_000 {
            let claim = claim(&format!("idle-{i}"));
            let g = granted(&memory, &claim).await;
            memory.release(&claim.key, &g.token).await.expect("release");
        }
        for claim in [
            claim("held-a"),
            claim("held-b"),
            permit("held-c", "o", 2),
            claim("other"),
        ] {
            memory
                .try_acquire(&claim, Turn::Once)
                .await
                .expect("acquire");
        }
        let names = |rows: Vec<Summary>| -> Vec<String> {
            rows.iter().map(|r| r.key.to_string()).collect()
        };
        let before = memory.looked_at.load(Ordering::Relaxed);
        let all = memory.list("held-", None, 10).await.expect("list");
        let looked = memory.looked_at.load(Ordering::Relaxed) - before;
        assert_eq!(
            names(all.clone()),
            ["locks/held-a", "locks/held-b", "semaphores/held-c"]
        );
        assert!(looked <= 6, "{looked} entries looked at");
        let first = memory.list("held-", None, 1).await.expect("list");
        assert_eq!(names(first.clone()), ["locks/held-a"]);
        let rest = memory
            .list("held-", Some(&first[0].key), 10)
            .await
            .expect("list");
        assert_eq!(names(rest), ["locks/held-b", "semaphores/held-c"]);
        let after_kind = memory
            .list("held-", Some(&all[2].key), 10)
            .await
            .expect("list");
        assert!(after_kind.is_empty());
        assert_eq!(memory.list("", None, 10).await.expect("list").len(), 4);
        assert!(
            memory
                .list("no such/", None, 10)
                .await
                .expect("list")
                .is_empty()
        );
    }
}
