//! Node data: the JSON sidelock writes into claim nodes and lock nodes, and a
//! claim read back with it.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use zookeeper_client as zk;

use super::names::Child;
use super::server_time::ServerClock;
use crate::backend::Holder;
use crate::lock::{Held, Kind};

/// What sidelock stores in each claim node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct NodeData {
    /// The lease's token.
    pub(super) token: String,
    /// Who asked for the claim.
    pub(super) owner: String,
    /// The sidecar that made the claim.
    pub(super) sidecar: String,
    /// True once granted; a waiting claim is false.
    pub(super) held: bool,
    /// When the lease was granted (0 while waiting).
    pub(super) since_ms: u64,
    /// When the lease ends unless renewed (0 while waiting).
    pub(super) expires_at_ms: u64,
    /// The lease's time to live.
    pub(super) ttl_ms: u64,
    /// The longest hold asked for while waiting; once granted, when the
    /// lease ends at the latest.
    #[serde(default)]
    pub(super) cap_ms: Option<u64>,
    /// How long the lock stays closed after the lease expires or is force-released.
    pub(super) lock_delay_ms: u64,
    /// The hold count (re-entries by the same owner).
    pub(super) count: u32,
    /// The zxid of the write that granted the lease; 0 while waiting, and
    /// in the granting write itself, whose zxid is the node's `mzxid` until
    /// a later write (renewal, re-entry, release of one hold) stores it here
    /// — see [`fence_of`]. One write grants.
    pub(super) fence: u64,
    /// A semaphore's limit, as the claim asked for it.
    #[serde(default)]
    pub(super) limit: Option<u32>,
    /// When the claim joined the queue.
    pub(super) queued_ms: u64,
    /// Written as held before the listing that could admit it (a try-once
    /// claim's create, a waiter's write sent with its listing): until a
    /// later write by the lease's holder, only the sidecar that wrote it
    /// knows whether that listing made it a grant. Another sidecar does
    /// not re-enter it: the write may never have been admitted (its answer
    /// lost, its node not yet deleted), and its zxid would then be a fence
    /// below a grant made since, or fall inside a lock-delay.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) tentative: bool,
}

/// What sidelock stores in a lock's parent node.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct ParentData {
    /// The highest fence of a lease that ended on the lock: recorded by the
    /// write that deleted its node (older sidecars recorded it at the grant).
    #[serde(default)]
    pub(super) fence: u64,
    /// The end of the lock-delay (kept in the delay node; older parents
    /// carry it themselves).
    #[serde(default)]
    pub(super) delay_until_ms: u64,
}

impl ParentData {
    /// This record once a lease with `fence` has ended (the delay is kept).
    pub(super) fn ended(&self, fence: u64) -> Self {
        Self {
            fence: self.fence.max(fence),
            delay_until_ms: self.delay_until_ms,
        }
    }
}

/// A lock's parent node as a listing found it: its record and the version
/// a write to it must match.
#[derive(Debug, Clone, Default)]
pub(super) struct Parent {
    /// The node's data.
    pub(super) data: ParentData,
    /// Its version; `None` when there is no lock node.
    pub(super) version: Option<i32>,
}

/// A held claim node as this sidecar last wrote or read it: what a write to
/// it must match, and the fence of its lease.
#[derive(Debug, Clone)]
pub(super) struct Lease {
    /// The node's path.
    pub(super) path: String,
    /// Its data (whose `fence` may still be 0, see [`fence_of`]).
    pub(super) data: NodeData,
    /// Its version.
    pub(super) version: i32,
    /// The lease's fence.
    pub(super) fence: u64,
}

impl Lease {
    /// The lease of the held node `node` under `parent`.
    pub(super) fn of(parent: &str, node: &Node, data: &NodeData) -> Self {
        Self::read(
            format!("{parent}/{}", node.child.name),
            data.clone(),
            &node.stat,
        )
    }

    /// The lease of the held node at `path`, as read: `data` at `stat`.
    pub(super) fn read(path: String, data: NodeData, stat: &zk::Stat) -> Self {
        Self {
            path,
            fence: fence_of(&data, stat),
            data,
            version: stat.version,
        }
    }

    /// The node's data for its next write, which moves its `mzxid`: with
    /// the fence stored, and no longer tentative (only a holder of the
    /// lease, who knows it was granted, writes it again).
    pub(super) fn next(&self) -> NodeData {
        let mut d = self.data.clone();
        d.fence = self.fence;
        d.tentative = false;
        d
    }
}

/// A child with its data, once read.
#[derive(Debug, Clone)]
pub(super) struct Node {
    /// The node's name, sequence and mode.
    pub(super) child: Child,
    /// `None` for a node sidelock did not write (Curator, other tools).
    pub(super) data: Option<NodeData>,
    /// The node's stat, with the version the next write must match.
    pub(super) stat: zk::Stat,
}

impl Node {
    /// The holder this node stands for, as [`State`](crate::backend::State)
    /// shows it: its times on this process's clock.
    pub(super) fn holder(&self, kind: Kind, clock: &ServerClock) -> Holder {
        match &self.data {
            Some(d) => Holder {
                owner: d.owner.clone(),
                sidecar: d.sidecar.clone(),
                mode: Held::of(kind, self.child.mode),
                since_ms: clock.earliest(d.since_ms),
                expires_at_ms: clock.earliest(d.expires_at_ms),
                fence: fence_of(d, &self.stat).max(1),
                count: d.count,
            },
            None => Holder {
                owner: "(foreign)".into(),
                sidecar: String::new(),
                mode: Held::of(kind, self.child.mode),
                since_ms: clock.earliest(u64::try_from(self.stat.ctime).unwrap_or(0)),
                expires_at_ms: u64::MAX / 2,
                fence: u64::try_from(self.stat.czxid).unwrap_or(0),
                count: 1,
            },
        }
    }

    /// When its lease ends on the servers' clock (far ahead for a node
    /// sidelock did not write, which has no end).
    pub(super) fn expires_at_ms(&self) -> u64 {
        self.data.as_ref().map_or(u64::MAX / 2, |d| d.expires_at_ms)
    }

    /// Whether the node holds the lock: granted, or not written by sidelock.
    pub(super) fn is_held(&self) -> bool {
        self.data.as_ref().is_none_or(|d| d.held)
    }

    /// The fence of the lease this node holds (0 while it waits); a node
    /// sidelock did not write, its create's zxid.
    pub(super) fn fence(&self) -> u64 {
        match &self.data {
            Some(d) => fence_of(d, &self.stat),
            None => u64::try_from(self.stat.czxid).unwrap_or(0),
        }
    }
}

/// The fence of a claim node's lease: the one stored, else, for a held node
/// whose fence was never stored, the zxid of its last write — the granting
/// write, since every later write stores the fence. (A sidecar of an
/// earlier version wrote the fence in a second write; between its two
/// writes this gives the same value.)
pub(super) fn fence_of(d: &NodeData, stat: &zk::Stat) -> u64 {
    if d.fence > 0 {
        d.fence
    } else if d.held {
        u64::try_from(stat.mzxid).unwrap_or(0)
    } else {
        0
    }
}

/// How long an attempt waits for another sidecar to confirm a tentative
/// node of the attempt's owner, or a lease granted by its listing, and a
/// release, keepalive, status or force-release for a node that holds the
/// client's token but still reads as waiting (`Inner::confirm_later`
/// writes both `CONFIRM_AFTER` after the grant).
pub(super) const CONFIRM_WAIT: Duration = Duration::from_secs(1);
