//! Lock events: what `/v1/events` streams and the dashboard shows.

use serde::Serialize;
use utoipa::ToSchema;

use crate::clock::now_ms;
use crate::lock::{Held, Kind, LockKey, LostReason, Mode};

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum EventType {
    Acquired,
    Released,
    Expired,
    Lost,
    Queued,
    ForceReleased,
}

/// One lock event of this sidecar. Never carries a token.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Event {
    #[serde(rename = "type")]
    pub event: EventType,
    pub name: String,
    pub kind: Kind,
    pub owner: String,
    pub sidecar: String,
    pub mode: Held,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fence: Option<u64>,
    /// Unix milliseconds.
    pub at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<LostReason>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waited_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position: Option<usize>,
}

impl Event {
    /// An event of type `event` about `owner`'s claim on `key` in `mode`
    /// through `sidecar`, stamped now; `fence` once a lease exists. The
    /// optional details (reason, count, times, position) start empty.
    pub fn new(
        event: EventType,
        key: &LockKey,
        mode: Mode,
        owner: &str,
        sidecar: &str,
        fence: Option<u64>,
    ) -> Self {
        Self {
            event,
            name: key.name.to_string(),
            kind: key.kind,
            // A campaign's lease stores its candidate (owner, value and
            // the campaign's id, never shown): the event names the owner.
            owner: if key.kind == Kind::Election {
                super::election::Candidate::decode(owner).owner
            } else {
                owner.to_owned()
            },
            sidecar: sidecar.to_owned(),
            mode: Held::of(key.kind, mode),
            fence,
            at_ms: now_ms(),
            reason: None,
            count: None,
            waited_ms: None,
            held_ms: None,
            position: None,
        }
    }
}
