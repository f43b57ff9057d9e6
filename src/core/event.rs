//! Lock events: what `/v1/events` streams and the dashboard shows.

use serde::Serialize;
use utoipa::ToSchema;

use crate::lock::{Held, Kind};

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

/// Why a lease ended without its holder releasing it (the `lost` event's `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LostReason {
    /// Not renewed in time.
    Expired,
    /// An operator force-released it.
    ForceReleased,
    /// `max_hold` reached: renewals stopped and the lease ran out.
    MaxHold,
    /// The sidecar is shutting down.
    Shutdown,
    /// The backend no longer has the lease (key deleted, token changed, session lost).
    Backend,
    /// Released with its token by a request outside the hold stream.
    Released,
    /// Renewals could not reach the backend before the lease's safety margin
    /// ran out, so the sidecar gave the lease up before the backend could
    /// expire it and grant it elsewhere.
    Unreachable,
}

impl LostReason {
    /// The label value of `sidelock_lost_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            LostReason::Expired => "expired",
            LostReason::ForceReleased => "force_released",
            LostReason::MaxHold => "max_hold",
            LostReason::Shutdown => "shutdown",
            LostReason::Backend => "backend",
            LostReason::Released => "released",
            LostReason::Unreachable => "unreachable",
        }
    }
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
