//! A node's lease operations, one script call each: acquire attempts,
//! dequeue, renew, release, status, inspect, force-release, heartbeats and
//! reconciling, fence raising and ping.

use std::time::Duration;

use redis::{ErrorKind, RedisError, Value};

use crate::backend::{Attempt, Busy, Error, Grant, Loss, State, Status, Ticket};
use crate::clock::{ms, now_ms};
use crate::lock::{Claim, LockKey, Token};

use super::HEARTBEAT_TTL;
use super::conn::unavailable;
use super::node::Node;
use super::pubsub::GaveBack;
use super::pubsub::{Handed, handed};
use super::scripts::{granted, holders, int, list, mode_arg, text, waiters};

/// How one attempt takes part in a node's queue.
#[derive(Debug, Clone, Copy)]
pub enum NodeTurn<'a> {
    /// Try once; never queue.
    Once,
    /// Try once, else queue with an entry whose since is `since` (the
    /// node's clock as this sidecar reads it), writing this sidecar's
    /// heartbeat when `beat` (its first waiter on the key).
    Join { since: i64, beat: bool },
    /// Try as the queued claim whose entry (as its join wrote it) is `entry`;
    /// `again` when the same attempt runs again after its connection broke
    /// (a claim no longer queued is then not served twice).
    Queued { entry: &'a str, again: bool },
}

/// What the scripts keep of a claim: its SPEC (`<ttl> <max_hold>
/// <lock_delay> <[owner, sidecar] as JSON>`, see `lean.lua`) and the start
/// of that JSON up to the owner, by which re-entry is recognised.
pub(super) struct Spec {
    pub(super) spec: String,
    pub(super) owner: String,
}

impl Spec {
    pub(super) fn of(claim: &Claim) -> Self {
        let owner = serde_json::to_string(&claim.owner).unwrap_or_default();
        let sidecar = serde_json::to_string(&claim.sidecar).unwrap_or_default();
        Self {
            spec: format!(
                "{} {} {} [{owner},{sidecar}]",
                ms(claim.ttl),
                claim.max_hold.map_or(0, ms),
                ms(claim.lock_delay)
            ),
            owner: format!("[{owner},"),
        }
    }
}

/// The queue entry a join of this process wrote (see `lean.lua`).
pub(super) fn entry(seq: u64, claim: &Claim, token: &Token, since: i64, instance: &str) -> String {
    format!(
        "{seq} {} {} {since} {instance} {}",
        mode_arg(claim.mode),
        token.expose(),
        Spec::of(claim).spec
    )
}

/// What the acquire script reads its arguments 10 to 15 as when they are
/// left out (`acquire.lua`, `acquire_fast.lua`).
const ACQUIRE_DEFAULTS: [&str; 7] = ["", "0", "0", "0", "1", "0", "0"];

/// The acquire script's arguments 10 to 16 (`acquire.lua`), without those
/// at the end that hold their [`ACQUIRE_DEFAULTS`]: each argument costs
/// Redis about 900 instructions to pass, and a try-once claim on Redis
/// needs none of these seven.
fn optional_args(
    entry: &str,
    since: i64,
    beat: u64,
    limit: u32,
    fifo: bool,
    max_permits: u32,
    again: bool,
) -> Vec<String> {
    let mut args = vec![
        entry.to_owned(),
        since.to_string(),
        beat.to_string(),
        limit.to_string(),
        if fifo { "1" } else { "0" }.to_owned(),
        max_permits.to_string(),
        if again { "1" } else { "0" }.to_owned(),
    ];
    let kept = args
        .iter()
        .zip(ACQUIRE_DEFAULTS)
        .rposition(|(arg, default)| arg != default)
        .map_or(0, |last| last + 1);
    args.truncate(kept);
    args
}

impl Node {
    /// One acquire attempt with `token` as the new lease's token; see the
    /// `Backend` contract. With `fifo` off the queue is shown but not enforced.
    /// A semaphore whose limit is above `max_permits` (0: any) is refused
    /// with [`Error::Unsupported`] before anything is written.
    pub async fn try_acquire(
        &self,
        claim: &Claim,
        turn: NodeTurn<'_>,
        token: &Token,
        fifo: bool,
        max_permits: u32,
    ) -> Result<Attempt, Error> {
        let mut inv = self.invocation(&self.scripts.acquire, &claim.key);
        let spec = Spec::of(claim);
        let span = match claim.max_hold {
            Some(m) if m < claim.ttl => m,
            _ => claim.ttl,
        };
        let (turn_arg, entry, since, beat, again) = match turn {
            NodeTurn::Once => ("o", "", 0, false, false),
            NodeTurn::Join { since, beat } => ("j", "", since, beat, false),
            NodeTurn::Queued { entry, again } => ("q", entry, 0, true, again),
        };
        inv.arg(turn_arg)
            .arg(mode_arg(claim.mode))
            .arg(token.expose())
            .arg(&spec.spec)
            .arg(ms(span))
            .arg(ms(claim.lock_delay))
            .arg(&spec.owner)
            .arg(&self.instance);
        let beat = if beat { ms(HEARTBEAT_TTL) } else { 0 };
        let limit = claim.limit.unwrap_or(0);
        for arg in optional_args(entry, since, beat, limit, fifo, max_permits, again) {
            inv.arg(arg);
        }
        let sent = now_ms();
        let reply = match self.run("try_acquire", inv).await? {
            Value::BulkString(lease) => granted("try_acquire", &lease)?,
            reply => list("try_acquire", reply)?,
        };
        let clock = self.clock(&reply, 1, sent);
        match int(&reply, 0) {
            1 => Ok(Attempt::Granted(Grant {
                token: Token::from_client(text(&reply, 2)),
                fence: int(&reply, 3) as u64,
                count: int(&reply, 4) as u32,
                since_ms: clock.local(int(&reply, 5)),
                expires_at_ms: clock.end(int(&reply, 6)),
            })),
            0 => {
                let seq = int(&reply, 6);
                let position = int(&reply, 4);
                let mut retry = int(&reply, 5);
                let mut holders = holders(reply.get(2), claim.key.kind, &clock);
                // A short path's answer, which did not read the clock: the
                // blocking lease, and its lock-delay for when it has expired.
                if reply.len() > 7 && clock.local(retry) <= now_ms() {
                    holders.clear();
                    retry += int(&reply, 7);
                }
                Ok(Attempt::Busy(Busy {
                    holders,
                    omitted: 0,
                    queue_length: int(&reply, 3) as usize,
                    position: (position > 0).then_some(position as usize),
                    retry_at_ms: (retry > 0).then(|| clock.local(retry)),
                    ticket: (seq > 0).then(|| Ticket {
                        key: claim.key.clone(),
                        seq: seq as u64,
                    }),
                }))
            }
            2 => Err(Error::LimitMismatch {
                active: int(&reply, 2) as u32,
            }),
            5 => Err(Error::KeyConflict {
                key: text(&reply, 2),
                found: text(&reply, 3),
            }),
            6 => Err(unavailable(
                "try_acquire",
                RedisError::from((
                    ErrorKind::Io,
                    "run again, the queued claim was no longer queued or would re-enter: its first run may have re-entered a lease",
                )),
            )),
            4 => Err(Error::Unsupported(format!(
                "this semaphore is in use with limit {}, above the {max_permits} this backend allows",
                int(&reply, 2)
            ))),
            _ => Err(Error::LimitRequired),
        }
    }

    /// Leaves the queue: removes `entry`, or releases `token`'s exclusive
    /// lease when the lock was handed to it meanwhile. 1 when the entry was
    /// queued, 2 when the lease was released, 0 when neither.
    pub async fn dequeue(&self, key: &LockKey, entry: &str, token: &Token) -> Result<i64, Error> {
        self.leave(key, entry, token.expose()).await
    }

    /// Removes `entry` from `key`'s queue and nothing else (no lease
    /// matches the empty token): an entry [`Node::rejoin`] put back for a
    /// waiter that had left meanwhile.
    pub(super) async fn drop_entry(&self, key: &LockKey, entry: &str) -> Result<i64, Error> {
        self.leave(key, entry, "").await
    }

    /// Runs `dequeue.lua` for `entry` and `token`.
    async fn leave(&self, key: &LockKey, entry: &str, token: &str) -> Result<i64, Error> {
        let mut inv = self.invocation(&self.scripts.dequeue, key);
        inv.arg(entry)
            .arg(token)
            .arg(self.handoff_arg())
            .arg(&self.instance)
            .arg(&self.stem);
        self.run::<i64>("dequeue", inv).await
    }

    /// Renews; `Some(local expiry)` or `None` when the token holds nothing.
    pub async fn renew(
        &self,
        key: &LockKey,
        token: &Token,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, Error> {
        let mut inv = self.invocation(&self.scripts.renew, key);
        inv.arg(token.expose()).arg(ttl.map_or(0, ms));
        let sent = now_ms();
        let reply: Vec<Value> = self.run("renew", inv).await?;
        let clock = self.clock(&reply, 0, sent);
        let e = int(&reply, 1);
        Ok((e >= 0).then(|| clock.end(e)))
    }

    /// Releases one hold: the holds left (`None`: the token holds nothing).
    /// A lock it passed to a claim of this process is its caller's to
    /// deliver: use [`release_handing`](Self::release_handing) where that can
    /// happen (not on a node that wakes the next claim instead).
    pub async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, Error> {
        Ok(self.release_handing(key, token).await?.0)
    }

    /// Releases one hold: the holds left (`None`: the token holds nothing)
    /// and, when the lock passed to a claim of this process, the grant the
    /// release handed it, which nobody else tells it.
    pub(super) async fn release_handing(
        &self,
        key: &LockKey,
        token: &Token,
    ) -> Result<(Option<u32>, Option<Handed>), Error> {
        let mut inv = self.invocation(&self.scripts.release, key);
        inv.arg(token.expose())
            .arg(self.handoff_arg())
            .arg(&self.instance)
            .arg(&self.stem);
        let reply = match self.run("release", inv).await? {
            // The fast path: no holds left, and the grant kept for this
            // process, if any.
            Value::Int(0) => return Ok((Some(0), None)),
            Value::BulkString(told) => return Ok((Some(0), handed(&told))),
            reply => list("release", reply)?,
        };
        let n = int(&reply, 1);
        let kept = match reply.get(2) {
            Some(Value::BulkString(told)) => handed(told),
            _ => None,
        };
        Ok(((n >= 0).then_some(n as u32), kept))
    }

    /// Whether the lease still holds.
    pub async fn status(&self, key: &LockKey, token: &Token) -> Result<Status, Error> {
        let mut inv = self.invocation(&self.scripts.status, key);
        inv.arg(token.expose());
        let sent = now_ms();
        let reply: Vec<Value> = self.run("status", inv).await?;
        let clock = self.clock(&reply, 0, sent);
        let e = int(&reply, 1);
        Ok(match e {
            0.. => Status::Held {
                expires_at_ms: clock.end(e),
            },
            -2 => Status::Gone(Loss::ForceReleased),
            _ => Status::Gone(Loss::Expired),
        })
    }

    /// The global state of one key.
    pub async fn inspect(&self, key: &LockKey) -> Result<State, Error> {
        let inv = self.invocation(&self.scripts.inspect, key);
        let sent = now_ms();
        let reply: Vec<Value> = self.run("inspect", inv).await?;
        if reply.len() > 5 {
            return Err(Error::KeyConflict {
                key: text(&reply, 5),
                found: text(&reply, 6),
            });
        }
        let clock = self.clock(&reply, 0, sent);
        let limit = int(&reply, 2);
        Ok(State {
            fence: int(&reply, 1) as u64,
            limit: (limit > 0).then_some(limit as u32),
            holders: holders(reply.get(3), key.kind, &clock),
            waiters: waiters(reply.get(4), key.kind, &clock),
        })
    }

    /// Removes every lease of a key, returning their tokens.
    pub async fn force_release(&self, key: &LockKey) -> Result<Vec<Token>, Error> {
        let inv = self.invocation(&self.scripts.force_release, key);
        let tokens: Vec<String> = self.run("force_release", inv).await?;
        Ok(tokens.into_iter().map(Token::from_client).collect())
    }

    /// Keeps this sidecar's waiters on one key alive (and passes a lock
    /// found free while claims wait on to the first of them).
    pub(super) async fn heartbeat(&self, key: &LockKey) -> Result<(), Error> {
        let mut inv = self.invocation(&self.scripts.heartbeat, key);
        inv.arg(ms(HEARTBEAT_TTL))
            .arg(&self.instance)
            .arg(self.handoff_arg())
            .arg(&self.stem);
        self.run::<i64>("heartbeat", inv).await.map(|_| ())
    }

    /// Drops this sidecar's queued tickets on `key` other than `live`.
    pub(super) async fn reconcile(&self, key: &LockKey, live: &[u64]) -> Result<(), Error> {
        let mut inv = self.invocation(&self.scripts.reconcile, key);
        inv.arg(&self.instance);
        for seq in live {
            inv.arg(*seq);
        }
        self.run::<i64>("reconcile", inv).await.map(|_| ())
    }

    /// Puts this process's `entries` on `key` back in the queue, each at
    /// its place, where a release passed them by; the entries that went back.
    pub(super) async fn rejoin(
        &self,
        key: &LockKey,
        entries: &[String],
    ) -> Result<Vec<String>, Error> {
        let mut inv = self.invocation(&self.scripts.rejoin, key);
        inv.arg(&self.instance).arg(ms(HEARTBEAT_TTL));
        for entry in entries {
            inv.arg(entry);
        }
        self.run("rejoin", inv).await
    }

    /// Gives back the lease of fence `fence` on `key` that a release handed
    /// to this process for a claim it does not know.
    pub(super) async fn give_back(
        &self,
        key: &LockKey,
        fence: u64,
        left_to_release: &[Token],
    ) -> Result<GaveBack, Error> {
        let mut inv = self.invocation(&self.scripts.give_back, key);
        inv.arg(fence)
            .arg(self.handoff_arg())
            .arg(&self.instance)
            .arg(&self.stem);
        for token in left_to_release {
            inv.arg(token.expose());
        }
        Ok(match self.run::<i64>("give_back", inv).await? {
            1 => GaveBack::Given,
            2 => GaveBack::LeftToRelease,
            _ => GaveBack::NotHeld,
        })
    }

    /// Raises the key's fence counter to at least `fence`, and the fence
    /// stored for the lease of `token` to `fence`.
    pub async fn raise_fence(&self, key: &LockKey, fence: u64, token: &Token) -> Result<(), Error> {
        let mut inv = self.invocation(&self.scripts.raise_fence, key);
        inv.arg(fence).arg(token.expose());
        self.run::<i64>("raise_fence", inv).await.map(|_| ())
    }

    /// Publishes `g` (a new holder) on the key's wake channel.
    pub async fn announce(&self, key: &LockKey) -> Result<(), Error> {
        let channel = self.channel(key);
        self.with_conn("announce", async |c| {
            redis::cmd("PUBLISH")
                .arg(&channel)
                .arg("g")
                .query_async::<i64>(c)
                .await
        })
        .await
        .map(|_| ())
    }

    /// Answers PING.
    pub async fn ping(&self) -> Result<(), Error> {
        self.with_conn("ping", async |c| {
            redis::cmd("PING").query_async::<String>(c).await
        })
        .await
        .map(|_| ())
    }

    /// How a release passes the lock on (`hand_over()` in `hand_over.lua`): it
    /// hands it over, counting the new holder's sidecar's listeners to see
    /// that it lives, except in a Cluster, whose PUBLISH counts only the
    /// node's own; or it wakes the next claim (Redlock).
    fn handoff_arg(&self) -> &'static str {
        match (self.handoff, &self.target) {
            (false, _) => "0",
            (true, super::conn::Target::Cluster { .. }) => "2",
            (true, _) => "1",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ACQUIRE_DEFAULTS, optional_args};

    #[test]
    fn the_acquire_scripts_read_every_left_out_argument_as_its_default() {
        // Read where each path needs it (one place for all cost Redis
        // about 2,000 instructions per pair, counted), so every read of
        // arguments 10 to 15 must name the default.
        for (file, lua) in [
            ("acquire_fast.lua", include_str!("acquire_fast.lua")),
            ("acquire.lua", include_str!("acquire.lua")),
        ] {
            for (i, default) in ACQUIRE_DEFAULTS.iter().enumerate() {
                let arg = format!("ARGV[{}]", 10 + i);
                let read = format!("{arg} or \"{default}\"");
                assert_eq!(
                    lua.matches(&arg).count(),
                    lua.matches(&read).count(),
                    "{file} reads {arg} other than as `{read}`"
                );
            }
        }
    }

    #[test]
    fn only_the_trailing_defaults_of_the_acquire_arguments_are_left_out() {
        // A try-once claim on Redis: none of the seven.
        assert!(optional_args("", 0, 0, 0, true, 0, false).is_empty());
        // A join whose sidecar's heartbeat is kept already: up to its since.
        assert_eq!(optional_args("", 17, 0, 0, true, 0, false), ["", "17"]);
        // A queued claim: up to its heartbeat, defaults before it kept.
        assert_eq!(
            optional_args("3 x ab 5 i s", 0, 15_000, 0, true, 0, false),
            ["3 x ab 5 i s", "0", "15000"]
        );
        // Redlock (no FIFO, at most one permit): the first six.
        assert_eq!(
            optional_args("", 0, 0, 0, false, 1, false),
            ["", "0", "0", "0", "0", "1"]
        );
        // A semaphore's limit.
        assert_eq!(
            optional_args("", 0, 0, 3, true, 0, false),
            ["", "0", "0", "3"]
        );
        // A queued claim run again: all seven.
        assert_eq!(
            optional_args("3 x ab 5 i s", 0, 15_000, 0, true, 0, true),
            ["3 x ab 5 i s", "0", "15000", "0", "1", "0", "1"]
        );
    }
}
