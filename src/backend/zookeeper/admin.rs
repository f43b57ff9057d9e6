//! What operators ask of a lock: inspecting it, listing locks, finding
//! stale nodes, and force-releasing a lock.

use std::sync::Arc;
use std::time::Duration;

use zookeeper_client as zk;

use super::data::{CONFIRM_WAIT, Node, NodeData, fence_of};
use super::names::{DELAY_NODE, Mark, decode_name};
use super::request::{Failed, Message, PARENT_ROUNDS, call, commit, unavailable};
use super::tree::{Listing, add_end_record, conflict, mark_path};
use super::{Inner, lock};
use crate::backend::{Error, Holder, StaleKey, StaleReason, State, Summary, Waiter};
use crate::clock::ms;
use crate::lock::{Held, Kind, LockKey, Token};

/// How long a GET waits for a lease granted by its listing through another
/// sidecar to be written: that sidecar writes it
/// [`CONFIRM_AFTER`](super::lease::CONFIRM_AFTER) after the grant; a first
/// claim not written by then is shown as it reads.
const INSPECT_WAIT: Duration = Duration::from_millis(400);

impl Inner {
    /// [`Backend::inspect`](crate::backend::Backend::inspect): the holders
    /// and waiters of `key`.
    pub(super) async fn inspect(self: &Arc<Self>, key: &LockKey) -> Result<State, Error> {
        let zk = self.client().await?;
        let parent = self.key_path(key);
        let mut snapshot = self.snapshot(&zk, "inspect", key, &parent).await?;
        // The first claim of a free lock, still written as waiting, may hold
        // it (granted by its listing through another sidecar, which writes
        // it held in a moment): shown once written. Still unwritten after
        // the wait, it is shown as it reads.
        if let Some(head) = self.unwritten_head(key, &snapshot.0, &snapshot.1)
            && self
                .confirmed(&zk, "inspect", &parent, head, INSPECT_WAIT)
                .await
                .is_ok()
        {
            snapshot = self.snapshot(&zk, "inspect", key, &parent).await?;
        }
        let (listing, nodes, limit) = snapshot;
        let (children, pdata) = (&listing.children, &listing.parent.data);
        let holders: Vec<Holder> = nodes
            .iter()
            .filter(|n| n.is_held())
            .map(|n| n.holder(key.kind, &self.clock))
            .collect();
        let mut waiters = Vec::new();
        for c in children.iter() {
            // A node being granted is neither: it holds a moment later.
            if nodes.iter().any(|n| n.child.name == c.name && n.is_held()) {
                continue;
            }
            let Some(node) = self.read(&zk, "inspect", &parent, c).await? else {
                continue;
            };
            let (owner, sidecar, since_ms) = match &node.data {
                Some(d) => (d.owner.clone(), d.sidecar.clone(), d.queued_ms),
                None => (
                    "(foreign)".into(),
                    String::new(),
                    u64::try_from(node.stat.ctime).unwrap_or(0),
                ),
            };
            waiters.push(Waiter {
                owner,
                sidecar,
                mode: Held::of(key.kind, c.mode),
                position: waiters.len() + 1,
                since_ms: self.clock.earliest(since_ms),
            });
        }
        let fence = holders
            .iter()
            .map(|h| h.fence)
            .max()
            .unwrap_or(0)
            .max(pdata.fence);
        Ok(State {
            fence,
            limit: (key.kind == Kind::Semaphore && !children.is_empty()).then_some(limit),
            holders,
            waiters,
        })
    }

    /// [`Backend::list`](crate::backend::Backend::list): keys with claims
    /// whose name starts with `prefix`, by key, after `after`, at most `limit`.
    pub(super) async fn list(
        self: &Arc<Self>,
        prefix: &str,
        after: Option<&LockKey>,
        limit: usize,
    ) -> Result<Vec<Summary>, Error> {
        let zk = self.client().await?;
        let mut keys = Vec::new();
        for kind in Kind::ALL {
            let dir = format!("{}/{}", self.root, kind.plural());
            let names = match call("list", zk.list_children(&dir)).await? {
                Ok(n) => n,
                Err(zk::Error::NoNode) => Vec::new(),
                Err(e) => return Err(unavailable("list", e)),
            };
            keys.extend(
                names
                    .iter()
                    .filter_map(|n| decode_name(n))
                    .map(|name| LockKey { kind, name }),
            );
        }
        keys.sort();
        let mut rows = Vec::new();
        for key in keys {
            if rows.len() >= limit {
                break;
            }
            if !key.name.as_str().starts_with(prefix) || after.is_some_and(|a| &key <= a) {
                continue;
            }
            let parent = self.key_path(&key);
            let (listing, nodes, _) = self.snapshot(&zk, "list", &key, &parent).await?;
            let (children, pdata) = (&listing.children, &listing.parent.data);
            if children.is_empty() {
                continue;
            }
            let held = nodes.iter().filter(|n| n.is_held()).count();
            let fence = nodes
                .iter()
                .filter(|n| n.is_held())
                .map(|n| n.holder(key.kind, &self.clock).fence)
                .max()
                .unwrap_or(0)
                .max(pdata.fence);
            rows.push(Summary {
                key,
                holders: held,
                waiters: children.len() - held,
                fence,
            });
        }
        Ok(rows)
    }

    /// [`Backend::stale`](crate::backend::Backend::stale): nodes that
    /// block a lock for no live holder; empty lock nodes whose lock-delay
    /// is over are removed on the way.
    pub(super) async fn stale(
        self: &Arc<Self>,
        stale_after: Duration,
    ) -> Result<Vec<StaleKey>, Error> {
        let zk = self.client().await?;
        let now = self.clock.now();
        let mut out = Vec::new();
        for kind in Kind::ALL {
            let dir = format!("{}/{}", self.root, kind.plural());
            let names = match call("stale", zk.list_children(&dir)).await? {
                Ok(n) => n,
                Err(zk::Error::NoNode) => Vec::new(),
                Err(e) => return Err(unavailable("stale", e)),
            };
            for segment in names {
                let parent = format!("{dir}/{segment}");
                let shown = format!("{}/{segment}", kind.plural());
                let (mut raw, pstat) = match call("stale", zk.get_children(&parent)).await? {
                    Ok(r) => r,
                    Err(zk::Error::NoNode) => continue,
                    Err(e) => return Err(unavailable("stale", e)),
                };
                raw.retain(|n| n != DELAY_NODE);
                let marked = raw.iter().any(|n| Mark::parse(n).is_some());
                raw.retain(|n| Mark::parse(n).is_none());
                if marked {
                    // Leases lost with their session while nobody waited:
                    // their lock-delay starts here, about when they were
                    // lost, rather than when the next claim comes.
                    // One lock that fails here does not end the scan.
                    let started = async {
                        let listing = self.children(&zk, "stale", &parent).await?;
                        self.start_lost_delays(&zk, "stale", &parent, &listing)
                            .await
                    };
                    if let Err(e) = started.await {
                        tracing::debug!(backend = "zookeeper", %parent, error = %e,
                            "could not start the lock-delay of leases lost with their session");
                    }
                }
                if raw.is_empty() {
                    let age = now.saturating_sub(u64::try_from(pstat.mtime).unwrap_or(0));
                    let listing = self.children(&zk, "stale", &parent).await?;
                    let over = listing.delay_until_ms() <= now;
                    if over && let Some((_, version)) = listing.delay {
                        self.clear_delay(&zk, "stale", &parent, version).await;
                    }
                    // An empty parent whose lock-delay is over is removed; a
                    // container node would be removed by the server anyway.
                    let cleaned = over
                        && matches!(
                            call("stale", zk.delete(&parent, Some(pstat.version))).await?,
                            Ok(())
                        );
                    out.push(StaleKey {
                        key: parent.clone(),
                        reason: StaleReason::EmptyParent,
                        age_ms: age,
                        detail: if cleaned {
                            "lock node without claims; removed".into()
                        } else {
                            "lock node without claims".into()
                        },
                    });
                    continue;
                }
                for name in raw {
                    let path = format!("{parent}/{name}");
                    let (bytes, stat) = match call("stale", zk.get_data(&path)).await? {
                        Ok(r) => r,
                        Err(zk::Error::NoNode) => continue,
                        Err(e) => return Err(unavailable("stale", e)),
                    };
                    let age = now.saturating_sub(u64::try_from(stat.ctime).unwrap_or(0));
                    if stat.ephemeral_owner == 0 {
                        out.push(StaleKey {
                            key: path,
                            reason: StaleReason::NoExpiry,
                            age_ms: age,
                            detail: format!(
                                "non-ephemeral node under {shown}: it outlives every session and blocks the lock until deleted"
                            ),
                        });
                        continue;
                    }
                    let Ok(d) = serde_json::from_slice::<NodeData>(&bytes) else {
                        continue;
                    };
                    if !d.held {
                        continue;
                    }
                    if d.expires_at_ms <= now {
                        out.push(StaleKey {
                            key: path,
                            reason: StaleReason::ExpiredNotCleaned,
                            age_ms: now - d.since_ms.min(now),
                            detail: format!(
                                "lease of owner {:?} on sidecar {:?} expired {} ms ago",
                                d.owner,
                                d.sidecar,
                                now - d.expires_at_ms
                            ),
                        });
                    } else if kind != Kind::Election
                        && now.saturating_sub(d.since_ms) > ms(stale_after)
                    {
                        out.push(StaleKey {
                            key: shown.clone(),
                            reason: StaleReason::HeldTooLong,
                            age_ms: now - d.since_ms,
                            detail: format!(
                                "held by owner {:?} on sidecar {:?} with fence {} for longer than {}",
                                d.owner,
                                d.sidecar,
                                fence_of(&d, &stat),
                                humantime::format_duration(stale_after)
                            ),
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    /// The first claim of `key`'s listing when it may be a lease granted by
    /// its listing and not written yet: an exclusive lock claim written as
    /// waiting, first in line, with no holder and no lock-delay.
    fn unwritten_head<'a>(
        &self,
        key: &LockKey,
        listing: &Listing,
        nodes: &'a [Node],
    ) -> Option<&'a Node> {
        let head = nodes.first()?;
        let first = listing.children.first()?;
        let waiting = head.data.as_ref().is_some_and(|d| !d.held);
        (head.child.name == first.name
            && waiting
            && self.grants_by_listing(key.kind, head.child.mode)
            && listing.delay_until_ms() <= self.clock.now_late())
        .then_some(head)
    }

    /// [`Backend::force_release`](crate::backend::Backend::force_release):
    /// deletes every holder's node of `key`, records their highest fence and
    /// starts the longest of their lock-delays, in one request — so that a
    /// sidecar cut off midway leaves every lease or none, never a free lock
    /// inside a lock-delay.
    pub(super) async fn force_release(
        self: &Arc<Self>,
        key: &LockKey,
    ) -> Result<Vec<Token>, Error> {
        const OP: &str = "force_release";
        let zk = self.client().await?;
        let parent = self.key_path(key);
        let mut rounds = 0;
        let mut unmarked = std::collections::HashSet::new();
        let ended = 'read: loop {
            let (mut listing, nodes, _) = self.snapshot(&zk, OP, key, &parent).await?;
            let mut ending = self
                .holders_to_end(&zk, key, &parent, &listing, &nodes)
                .await?;
            loop {
                if ending.is_empty() {
                    break 'read ending;
                }
                if rounds == PARENT_ROUNDS {
                    return Err(unavailable(OP, Message("the lock kept changing".into())));
                }
                rounds += 1;
                let mut writer = zk.new_multi_writer();
                for e in &ending {
                    writer
                        .add_delete(&e.path, e.version)
                        .map_err(|e| unavailable(OP, e))?;
                }
                // Their lock-delay marks go with them (this request starts
                // their lock-delay itself), except those found missing.
                let marks: Vec<String> = ending
                    .iter()
                    .filter_map(|e| mark_path(&e.path, e.lock_delay_ms))
                    .filter(|m| !unmarked.contains(m))
                    .collect();
                for mark in &marks {
                    writer
                        .add_delete(mark, None)
                        .map_err(|e| unavailable(OP, e))?;
                }
                let fence = ending.iter().map(|e| e.fence).max().unwrap_or(0);
                let delay = ending.iter().map(|e| e.lock_delay_ms).max().unwrap_or(0);
                let until = if delay > 0 {
                    self.clock.now_late().saturating_add(delay)
                } else {
                    0
                };
                let now = self.clock.now();
                add_end_record(&mut writer, OP, &parent, &listing, fence, until, now)?;
                // Its holders here hear of it as a force-release, not as a
                // loss (the watch of a lease re-entered here fires first).
                let mark_ending = |on| {
                    for e in &ending {
                        self.ending(e.token.expose(), on);
                    }
                };
                mark_ending(true);
                let committed = commit(OP, writer.commit()).await?;
                if committed.is_err() {
                    mark_ending(false);
                }
                match committed {
                    Ok(_) => break 'read ending,
                    // A lease that ended meanwhile is left out (its end was
                    // recorded with it); a tentative grant that changed may
                    // no longer hold: everything is read again.
                    Err(Failed {
                        index,
                        error: zk::Error::NoNode,
                    }) if index < ending.len() => {
                        ending.remove(index);
                    }
                    Err(Failed {
                        index,
                        error: zk::Error::BadVersion,
                    }) if index < ending.len() => continue 'read,
                    // A lease without its mark (granted by an older
                    // version, or its mark not made yet).
                    Err(Failed {
                        index,
                        error: zk::Error::NoNode,
                    }) if index < ending.len() + marks.len() => {
                        // Not counted: each mark is found missing once.
                        unmarked.insert(marks[index - ending.len()].clone());
                        rounds -= 1;
                        continue;
                    }
                    // The lock node's record or the delay node changed (a
                    // lease ended): only they are read again, not every
                    // holder.
                    Err(failed) => {
                        conflict::<()>(OP, failed)?;
                    }
                }
                listing = self.children(&zk, OP, &parent).await?;
            }
        };
        let tokens: Vec<Token> = ended.into_iter().map(|e| e.token).collect();
        if !tokens.is_empty() {
            let mut leases = lock(&self.leases);
            for token in &tokens {
                leases.remove(token);
            }
            drop(leases);
            self.wakeups.wake(key);
        }
        Ok(tokens)
    }

    /// The holders of `key` among `nodes` (as `listing` showed them), for a
    /// force-release to end.
    async fn holders_to_end(
        self: &Arc<Self>,
        zk: &zk::Client,
        key: &LockKey,
        parent: &str,
        listing: &Listing,
        nodes: &[Node],
    ) -> Result<Vec<Ending>, Error> {
        let head = self.unwritten_head(key, listing, nodes);
        let mut ending = Vec::new();
        for node in nodes {
            // The first claim of a free lock, still written as waiting, may
            // hold it: granted by its listing through another sidecar, which
            // writes it held in a moment. Released once it does (503 while it
            // does not: it may be a waiter whose sidecar is cut off, which
            // must not be deleted as a holder).
            let mut node = node.clone();
            if head.is_some_and(|h| h.child.name == node.child.name) {
                match self
                    .confirmed(zk, "force_release", parent, &node, CONFIRM_WAIT)
                    .await?
                {
                    Some(written) => node = written,
                    None => continue,
                }
            }
            let Some(d) = node.data.as_ref().filter(|d| d.held) else {
                continue;
            };
            ending.push(Ending {
                path: format!("{parent}/{}", node.child.name),
                // A lease written held stays held until its node goes (its
                // renewals rewrite it, and must not make the request fail);
                // a tentative grant may yet be written back as waiting.
                version: d.tentative.then_some(node.stat.version),
                token: Token::from_client(d.token.clone()),
                fence: fence_of(d, &node.stat),
                lock_delay_ms: d.lock_delay_ms,
            });
        }
        Ok(ending)
    }
}

/// A holder's node that a force-release deletes.
struct Ending {
    path: String,
    /// The version it is deleted at, if it must not have changed.
    version: Option<i32>,
    token: Token,
    fence: u64,
    lock_delay_ms: u64,
}
