//! The session: connecting, the lifeline that decides when this sidecar
//! stops vouching for the session's leases, and what happens to them when
//! the session ends or is given up (module doc, # Sessions).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use zookeeper_client as zk;

use super::request::{Message, OP_TIMEOUT, call, must, unavailable};
use super::{Inner, Record, lock};
use crate::backend::Error;
use crate::clock::ms;
use crate::lock::Token;

/// Part of the session timeout that may pass without a confirmed round trip
/// before this sidecar stops vouching for its leases (see the module doc).
const SUSPEND_AFTER: (u32, u32) = (2, 3);

impl Inner {
    /// The current session, connecting (again) when there is none or it expired.
    pub(super) async fn client(self: &Arc<Self>) -> Result<zk::Client, Error> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.state().is_terminated() {
                return Ok(c.clone());
            }
            tracing::warn!(backend = "zookeeper", "session ended; opening a new one");
            self.session_lost(c.session_id());
            *slot = None;
        }
        // Boxed: every operation awaits this function, and inline the
        // connect's state (7 KB) would size every operation's future — a
        // renewal in flight, times thousands of holds renewing at once.
        let client = Box::pin(self.open_session()).await?;
        *slot = Some(client.clone());
        Ok(client)
    }

    /// Opens a session: connects, makes the root's folders, and starts
    /// following it ([`Self::client`] keeps it).
    async fn open_session(self: &Arc<Self>) -> Result<zk::Client, Error> {
        // The server heard from this session no earlier than now.
        let started = Instant::now();
        let connect = zk::Client::connector()
            .with_session_timeout(self.session_timeout)
            .with_connection_timeout(Duration::from_secs(2))
            .with_fail_eagerly()
            .connect(&self.hosts);
        let client = must("connect", connect).await?;
        let client = if self.chroot.is_empty() {
            client
        } else {
            // Create the chroot itself before entering it.
            let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
            must("connect", client.mkdir(&self.chroot, &opts)).await?;
            client
                .chroot(self.chroot.clone())
                .map_err(|_| unavailable("connect", Message("bad chroot".into())))?
        };
        let opts = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        for kind in crate::lock::Kind::ALL {
            must(
                "connect",
                client.mkdir(&format!("{}/{}", self.root, kind.plural()), &opts),
            )
            .await?;
        }
        // Times in nodes are on the servers' clock: learn it before the
        // session's first use (an empty write to the node of locks, which
        // sidelock made and which holds no data; the root may be the
        // operator's).
        let sent = crate::clock::now_ms();
        let locks = format!("{}/{}", self.root, crate::lock::Kind::Lock.plural());
        let stat = must("connect", client.set_data(&locks, &[], None)).await?;
        self.clock.observe(sent, &stat);
        tracing::info!(
            backend = "zookeeper",
            session = ?client.session_id(),
            "ZooKeeper session established"
        );
        let sid = client.session_id();
        *lock(&self.session) = Some(sid);
        let lifeline = Self::lifeline(Arc::downgrade(self), client.clone(), started);
        let closing = self.closing.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = closing.cancelled() => {}
                () = lifeline => {}
            }
        });
        // Follow the session: when it ends, forget its nodes and wake every local
        // waiter (their attempts then report the loss).
        let me = Arc::downgrade(self);
        let mut states = client.state_watcher();
        tokio::spawn(async move {
            loop {
                let state = states.changed().await;
                let Some(me) = me.upgrade() else { return };
                if state.is_terminated() {
                    me.session_lost(sid);
                    return;
                }
                if state == zk::SessionState::SyncConnected {
                    // Watches are re-armed by the client; wake anyway in case one fired unseen.
                    for key in me.wakeups.keys() {
                        me.wakeups.wake(&key);
                    }
                }
            }
        });
        Ok(client)
    }

    /// Session `sid` ended or was given up: its leases are announced lost and
    /// revoked, their fences recorded through the next session, its tickets
    /// forgotten, every local waiter woken (their attempts then report the
    /// loss). Nothing happens if `sid` is no longer the current session (it
    /// was handled already).
    fn session_lost(self: &Arc<Self>, sid: zk::SessionId) {
        let (lost, records): (Vec<Token>, Vec<Record>) = {
            let mut session = lock(&self.session);
            if *session != Some(sid) {
                return;
            }
            *session = None;
            lock(&self.leases)
                .drain()
                .map(|(token, record)| (token, *record))
                .unzip()
        };
        if !records.is_empty() {
            tokio::spawn(self.clone().record_lost(records));
        }
        if !lost.is_empty() {
            tracing::warn!(
                backend = "zookeeper",
                session = ?sid,
                leases = lost.len(),
                "leases of the ZooKeeper session are lost"
            );
            let now = Instant::now();
            // Long enough for the abandoned session to be closed or expired.
            let keep = self.session_timeout * 3 + OP_TIMEOUT;
            let mut revoked = lock(&self.revoked);
            revoked.retain(|_, at| now.duration_since(*at) < keep);
            revoked.extend(lost.iter().map(|t| (t.clone(), now)));
        }
        for token in lost {
            // No receiver (the core not following) only means nobody listens.
            let _ = self.losses.send(token);
        }
        lock(&self.tickets).clear();
        for key in self.wakeups.keys() {
            self.wakeups.wake(&key);
        }
    }

    /// Records the fences of `lost` leases in their lock nodes, as their
    /// release would have: the session's end deletes their nodes without
    /// it. Best effort, through the next session; a sidecar that dies with
    /// its session records nothing, and the lock's next grant is fenced
    /// higher all the same.
    async fn record_lost(self: Arc<Self>, lost: Vec<Record>) {
        let mut fences: HashMap<String, u64> = HashMap::new();
        for record in lost {
            if let Some((parent, _)) = record.lease.path.rsplit_once('/') {
                let fence = fences.entry(parent.to_owned()).or_default();
                *fence = (*fence).max(record.lease.fence);
            }
        }
        let recorded = async {
            let zk = self.client().await?;
            for (parent, fence) in &fences {
                self.record_end(&zk, "record_lost", parent, *fence).await?;
            }
            Ok::<(), Error>(())
        };
        let recorded = tokio::select! {
            () = self.closing.cancelled() => return,
            r = recorded => r,
        };
        if let Err(e) = recorded {
            tracing::debug!(backend = "zookeeper", error = %e,
                "the fences of leases lost with their session were not recorded");
        }
    }

    /// Whether `token` was reported lost: it holds nothing, whatever its node says.
    pub(super) fn is_revoked(&self, token: &Token) -> bool {
        lock(&self.revoked).contains_key(token)
    }

    /// Confirms session `sid` is alive by round trips and gives it up when none
    /// succeeded for [`SUSPEND_AFTER`] of its timeout: the server may expire it
    /// soon after, and another sidecar be granted its locks (module doc).
    async fn lifeline(me: std::sync::Weak<Self>, zk: zk::Client, established: Instant) {
        let timeout = zk.session_timeout();
        let (num, den) = SUSPEND_AFTER;
        let budget = timeout * num / den;
        let every = (timeout / 6).max(Duration::from_millis(50));
        let root = match me.upgrade() {
            Some(me) => me.root.clone(),
            None => return,
        };
        let sid = zk.session_id();
        // The server last heard from the session no earlier than this.
        let mut heard = established;
        // When the last answered round was sent: the round after it proves
        // the leader heard of it (module doc, # Sessions).
        let mut last_sent = established;
        loop {
            if zk.state().is_terminated() {
                return;
            }
            let Some(inner) = me.upgrade() else { return };
            if *lock(&inner.session) != Some(sid) {
                return;
            }
            drop(inner);
            let deadline = tokio::time::Instant::from_std(heard + budget);
            let sent = Instant::now();
            // A `sync`, not a read: a follower answers reads by itself, even
            // cut off from its leader, which then expires the session.
            match tokio::time::timeout_at(deadline, zk.sync(&root)).await {
                Ok(Ok(()) | Err(zk::Error::NoNode)) => {
                    heard = last_sent;
                    last_sent = sent;
                    if let Some(inner) = me.upgrade() {
                        inner.wakeups.heard();
                    }
                    tokio::time::sleep(every).await;
                }
                Ok(Err(_)) => {
                    let retry = tokio::time::Instant::now() + every.min(Duration::from_millis(100));
                    tokio::time::sleep_until(retry.min(deadline)).await;
                }
                Err(_) => {}
            }
            if Instant::now() >= heard + budget {
                let Some(inner) = me.upgrade() else { return };
                tracing::warn!(
                    backend = "zookeeper",
                    session = ?sid,
                    silent_ms = ms(heard.elapsed()),
                    session_timeout_ms = ms(timeout),
                    "no answer from ZooKeeper for too long; giving up the session and its leases"
                );
                inner.session_lost(sid);
                {
                    let mut slot = inner.client.lock().await;
                    if slot.as_ref().is_some_and(|c| c.session_id() == sid) {
                        *slot = None;
                    }
                }
                drop(inner);
                Self::bury(zk, root, timeout).await;
                return;
            }
        }
    }

    /// Deletes the nodes of an abandoned session as soon as it is reachable
    /// again, so no token reported lost can hold anything there. If it never
    /// reconnects the server expires it, which deletes them too.
    async fn bury(zk: zk::Client, root: String, timeout: Duration) {
        let mut states = zk.state_watcher();
        let give_up = tokio::time::Instant::now() + timeout * 2 + OP_TIMEOUT;
        loop {
            let state = zk.state();
            if state.is_terminated() {
                return;
            }
            if state == zk::SessionState::SyncConnected {
                if let Ok(Ok(paths)) = call("bury", zk.list_ephemerals(&root)).await {
                    for path in paths {
                        let _ = call("bury", zk.delete(&path, None)).await;
                    }
                    tracing::info!(backend = "zookeeper", session = ?zk.session_id(), "nodes of the abandoned session deleted");
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            } else if tokio::time::timeout_at(give_up, states.changed())
                .await
                .is_err()
            {
                return;
            }
            if tokio::time::Instant::now() >= give_up {
                return;
            }
        }
    }
}
