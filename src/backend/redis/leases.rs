//! A node's lease operations, one script call each: acquire attempts,
//! dequeue, renew, release, status, inspect, force-release, heartbeats and
//! reconciling, fence raising and ping.

use std::time::Duration;

use redis::Value;

use crate::backend::{Attempt, Busy, Error, Grant, Loss, State, Status, Ticket};
use crate::clock::ms;
use crate::lock::{Claim, LockKey, Token};

use super::HEARTBEAT_TTL;
use super::node::{Node, Step};
use super::scripts::{holders, int, mode_arg, text, waiters};

impl Node {
    /// One acquire attempt with `token` as the new lease's token; see the
    /// `Backend` contract. With `fifo` off the queue is shown but not enforced.
    /// A semaphore whose limit is above `max_permits` (0: any) is refused
    /// with [`Error::Unsupported`] before anything is written.
    pub async fn try_acquire(
        &self,
        claim: &Claim,
        step: Step,
        token: &Token,
        fifo: bool,
        max_permits: u32,
    ) -> Result<Attempt, Error> {
        let mut inv = self.invocation(&self.scripts.acquire, &claim.key);
        let (turn_arg, seq) = match step {
            Step::Once => ("once", String::new()),
            Step::Join => ("join", String::new()),
            Step::Queued(seq) => ("queued", seq.to_string()),
        };
        inv.arg(turn_arg)
            .arg(seq)
            .arg(token.expose())
            .arg(&claim.owner)
            .arg(&claim.sidecar)
            .arg(mode_arg(claim.mode))
            .arg(ms(claim.ttl))
            .arg(claim.max_hold.map_or(0, ms))
            .arg(ms(claim.lock_delay))
            .arg(claim.limit.unwrap_or(0))
            .arg(ms(HEARTBEAT_TTL))
            .arg(if fifo { "1" } else { "0" })
            .arg(max_permits)
            // The short form's owner and sidecar (acquire_fast.lua), encoded
            // here: JSON costs a script more than its commands.
            .arg(serde_json::to_string(&(&claim.owner, &claim.sidecar)).unwrap_or_default());
        let reply: Vec<Value> = self.run("try_acquire", inv).await?;
        let clock = self.clock(&reply, 1);
        let attempt = match int(&reply, 0) {
            1 => Attempt::Granted(Grant {
                token: Token::from_client(text(&reply, 2)),
                fence: int(&reply, 3) as u64,
                count: int(&reply, 4) as u32,
                since_ms: clock.local(int(&reply, 5)),
                expires_at_ms: clock.local(int(&reply, 6)),
            }),
            0 => {
                let seq = int(&reply, 6);
                let position = int(&reply, 4);
                let retry = int(&reply, 5);
                Attempt::Busy(Busy {
                    holders: holders(&text(&reply, 2), claim.key.kind, &clock),
                    queue_length: int(&reply, 3) as usize,
                    position: (position > 0).then_some(position as usize),
                    retry_at_ms: (retry > 0).then(|| clock.local(retry)),
                    ticket: (seq > 0).then(|| Ticket {
                        key: claim.key.clone(),
                        seq: seq as u64,
                    }),
                })
            }
            2 => {
                return Err(Error::LimitMismatch {
                    active: int(&reply, 2) as u32,
                });
            }
            5 => {
                return Err(Error::KeyConflict {
                    key: text(&reply, 2),
                    found: text(&reply, 3),
                });
            }
            4 => {
                return Err(Error::Unsupported(format!(
                    "this semaphore is in use with limit {}, above the {max_permits} this backend allows",
                    int(&reply, 2)
                )));
            }
            _ => return Err(Error::LimitRequired),
        };
        let fresh = matches!(&attempt, Attempt::Granted(g) if g.count == 1)
            || matches!(&attempt, Attempt::Busy(b) if b.ticket.is_some());
        if fresh {
            self.index(&claim.key).await;
        }
        Ok(attempt)
    }

    /// Leaves the queue.
    pub async fn dequeue(&self, key: &LockKey, seq: u64) -> Result<(), Error> {
        let mut inv = self.invocation(&self.scripts.dequeue, key);
        inv.arg(seq);
        self.run::<i64>("dequeue", inv).await.map(|_| ())
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
        let reply: Vec<Value> = self.run("renew", inv).await?;
        let clock = self.clock(&reply, 0);
        let e = int(&reply, 1);
        Ok((e >= 0).then(|| clock.local(e)))
    }

    /// Releases one hold.
    pub async fn release(&self, key: &LockKey, token: &Token) -> Result<Option<u32>, Error> {
        let mut inv = self.invocation(&self.scripts.release, key);
        inv.arg(token.expose());
        let reply: Vec<Value> = self.run("release", inv).await?;
        let n = int(&reply, 1);
        Ok((n >= 0).then_some(n as u32))
    }

    /// Whether the lease still holds.
    pub async fn status(&self, key: &LockKey, token: &Token) -> Result<Status, Error> {
        let mut inv = self.invocation(&self.scripts.status, key);
        inv.arg(token.expose());
        let reply: Vec<Value> = self.run("status", inv).await?;
        let clock = self.clock(&reply, 0);
        let e = int(&reply, 1);
        Ok(if e >= 0 {
            Status::Held {
                expires_at_ms: clock.local(e),
            }
        } else {
            Status::Gone(Loss::Expired)
        })
    }

    /// The global state of one key.
    pub async fn inspect(&self, key: &LockKey) -> Result<State, Error> {
        let inv = self.invocation(&self.scripts.inspect, key);
        let reply: Vec<Value> = self.run("inspect", inv).await?;
        if reply.len() > 5 {
            return Err(Error::KeyConflict {
                key: text(&reply, 5),
                found: text(&reply, 6),
            });
        }
        let clock = self.clock(&reply, 0);
        let limit = int(&reply, 2);
        Ok(State {
            fence: int(&reply, 1) as u64,
            limit: (limit > 0).then_some(limit as u32),
            holders: holders(&text(&reply, 3), key.kind, &clock),
            waiters: waiters(&text(&reply, 4), key.kind, &clock),
        })
    }

    /// Removes every lease of a key, returning their tokens.
    pub async fn force_release(&self, key: &LockKey) -> Result<Vec<Token>, Error> {
        let inv = self.invocation(&self.scripts.force_release, key);
        let tokens: Vec<String> = self.run("force_release", inv).await?;
        Ok(tokens.into_iter().map(Token::from_client).collect())
    }

    /// Keeps this sidecar's waiters on one key alive.
    pub(super) async fn heartbeat(&self, key: &LockKey, sidecar: &str) -> Result<(), Error> {
        let mut inv = self.invocation(&self.scripts.heartbeat, key);
        inv.arg(ms(HEARTBEAT_TTL)).arg(sidecar);
        self.run::<i64>("heartbeat", inv).await.map(|_| ())
    }

    /// Drops `sidecar`'s queued tickets on `key` other than `live`.
    pub(super) async fn reconcile(
        &self,
        key: &LockKey,
        sidecar: &str,
        live: &[u64],
    ) -> Result<(), Error> {
        let mut inv = self.invocation(&self.scripts.reconcile, key);
        inv.arg(sidecar);
        for seq in live {
            inv.arg(*seq);
        }
        self.run::<i64>("reconcile", inv).await.map(|_| ())
    }

    /// Raises the key's fence counter to at least `fence`.
    pub async fn raise_fence(&self, key: &LockKey, fence: u64) -> Result<(), Error> {
        let mut inv = self.invocation(&self.scripts.raise_fence, key);
        inv.arg(fence);
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
}
