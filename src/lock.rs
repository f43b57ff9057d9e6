//! The nouns every layer shares: lock names, keys, modes, tokens and claims.

use std::fmt;
use std::time::Duration;

use rand::RngExt;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Longest accepted lock name, in characters.
pub const MAX_NAME_LEN: usize = 200;

/// The shortest ttl a watchdog renews a lease by (a hold stream's, a
/// campaign's): it renews every third of it, so a shorter one would ask
/// the backend for a renewal more often than every 33 ms, for as long as
/// the stream stays open.
pub const MIN_RENEWED_TTL: Duration = Duration::from_millis(100);

/// A validated lock or semaphore name: 1–200 characters of `A-Z a-z 0-9 . _ : -`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Name(String);

impl Name {
    /// Checks `s` against the naming rule.
    ///
    /// # Errors
    /// A sentence saying what is wrong and what is allowed.
    pub fn parse(s: &str) -> Result<Self, String> {
        if s.is_empty() {
            return Err(
                "lock name is empty; use 1 to 200 characters of A-Z a-z 0-9 . _ : -".into(),
            );
        }
        let len = s.chars().count();
        if len > MAX_NAME_LEN {
            return Err(format!(
                "lock name is {len} characters long; at most {MAX_NAME_LEN} are allowed"
            ));
        }
        if let Some(bad) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
        {
            return Err(format!(
                "lock name contains {bad:?}; only A-Z a-z 0-9 . _ : - are allowed"
            ));
        }
        Ok(Self(s.to_owned()))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks caller-chosen text that operators read (an owner, a
/// force-release reason): 1 to `max_chars` characters, none that can make
/// it look like other text or like several lines — control characters,
/// format characters (bidi overrides and isolates, zero-width characters,
/// the byte order mark, tags), line and paragraph separators, private-use
/// and unassigned code points, spaces other than U+0020 — and no space at
/// either end.
///
/// # Errors
/// A sentence naming `what`, the first offending character and what is allowed.
pub fn check_plain_text(what: &str, s: &str, max_chars: usize) -> Result<(), String> {
    use unicode_properties::UnicodeGeneralCategory;
    let allowed = format!(
        "allowed: 1 to {max_chars} characters of any script, digits, punctuation, symbols and \
         inner spaces (U+0020); not control, format (bidi, zero-width), line or paragraph \
         separator, private-use, unassigned or invisible (default-ignorable) characters, nor other spaces"
    );
    let len = s.chars().count();
    if len == 0 || len > max_chars {
        return Err(format!("{what} is {len} characters long; {allowed}"));
    }
    if s.starts_with(' ') || s.ends_with(' ') {
        return Err(format!("{what} starts or ends with a space; {allowed}"));
    }
    match s.chars().find(|&c| misleads(c)) {
        Some(c) => Err(format!(
            "{what} contains U+{:04X} ({:?}); {allowed}",
            u32::from(c),
            c.general_category()
        )),
        None => Ok(()),
    }
}

/// Whether `c` can make text look like other text or like several lines
/// (the characters [`check_plain_text`] refuses): control, format, line and
/// paragraph separator, private-use, unassigned, spaces other than U+0020
/// and characters that render as nothing.
pub fn misleads(c: char) -> bool {
    use unicode_properties::{GeneralCategory as G, UnicodeGeneralCategory};
    matches!(
        c.general_category(),
        G::Control
            | G::Format
            | G::LineSeparator
            | G::ParagraphSeparator
            | G::PrivateUse
            | G::Surrogate
            | G::Unassigned
    ) || (c.general_category() == G::SpaceSeparator && c != ' ')
        || invisible(c)
}

/// Letters and marks that render as nothing, outside the categories
/// [`check_plain_text`] refuses: Unicode's Default_Ignorable_Code_Point set
/// (DerivedCoreProperties.txt; its Cf members are refused as format
/// characters anyway) and the blank Braille pattern.
fn invisible(c: char) -> bool {
    matches!(
        u32::from(c),
        0x034F
            | 0x115F..=0x1160
            | 0x17B4..=0x17B5
            | 0x180B..=0x180F
            | 0x2800
            | 0x3164
            | 0xFE00..=0xFE0F
            | 0xFFA0
            | 0xFFF0..=0xFFF8
            | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A
            | 0xE0000..=0xE0FFF
    )
}

/// Whether a key is a lock (exclusive/shared), a counting semaphore or an
/// election. An election's key is an exclusive lock in a namespace of its
/// own: backends treat it as a lock, and its name never meets a lock's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Lock,
    Semaphore,
    Election,
}

impl Kind {
    /// The word as the API, metrics and stored rows write it: `lock` or `semaphore`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Lock => "lock",
            Kind::Semaphore => "semaphore",
            Kind::Election => "election",
        }
    }

    /// The path segment and key prefix: `locks` or `semaphores`.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Lock => "locks",
            Kind::Semaphore => "semaphores",
            Kind::Election => "elections",
        }
    }

    /// Every kind, in key order.
    pub const ALL: [Kind; 3] = [Kind::Lock, Kind::Semaphore, Kind::Election];

    /// Whether keys of this kind are locks (exclusive or shared holders,
    /// re-entry by owner) rather than a semaphore's permits.
    pub fn is_lock(self) -> bool {
        self != Kind::Semaphore
    }
}

/// A lock's identity in a backend: its kind and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey {
    pub kind: Kind,
    pub name: Name,
}

impl LockKey {
    /// Parses the `locks/<name>`, `semaphores/<name>` or `elections/<name>` form that `Display`
    /// writes (cursors, event payloads, index members).
    pub fn parse(s: &str) -> Option<Self> {
        let (kind, name) = s.split_once('/')?;
        let kind = match kind {
            "locks" => Kind::Lock,
            "semaphores" => Kind::Semaphore,
            "elections" => Kind::Election,
            _ => return None,
        };
        Some(Self {
            kind,
            name: Name::parse(name).ok()?,
        })
    }
}

#[cfg(test)]
impl LockKey {
    /// The lock named `name` (tests).
    pub(crate) fn lock(name: &str) -> Self {
        Self {
            kind: Kind::Lock,
            name: Name::parse(name).unwrap(),
        }
    }
}

impl fmt::Display for LockKey {
    /// `locks/<name>`, `semaphores/<name>` or `elections/<name>`: the form used in events, stale keys and cursors.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind.plural(), self.name)
    }
}

/// How a lock is held. Semaphore permits are always `Exclusive` (each permit is one holder's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// One holder at a time (write lock).
    Exclusive,
    /// Any number of shared holders, none while an exclusive holder exists (read lock).
    Shared,
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

/// How a lease is held, in the API's words (answers, listings, events, the
/// dashboard): a lock's `exclusive` or `shared`, a semaphore's `permit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Held {
    /// One holder of a lock at a time.
    Exclusive,
    /// One of the readers of a lock.
    Shared,
    /// One of a semaphore's permits.
    Permit,
}

impl Held {
    /// How a claim of `mode` on a key of `kind` holds it.
    pub fn of(kind: Kind, mode: Mode) -> Self {
        match (kind, mode) {
            (Kind::Semaphore, _) => Held::Permit,
            (Kind::Lock | Kind::Election, Mode::Exclusive) => Held::Exclusive,
            (Kind::Lock | Kind::Election, Mode::Shared) => Held::Shared,
        }
    }

    /// The word as the API writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Held::Exclusive => "exclusive",
            Held::Shared => "shared",
            Held::Permit => "permit",
        }
    }
}

impl Mode {
    /// The word as the API and stored rows write it: `exclusive` or `shared`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Exclusive => "exclusive",
            Mode::Shared => "shared",
        }
    }
}

/// The secret that proves a lease: 128 random bits from the OS generator, as hex.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Token(String);

impl Token {
    /// A fresh unguessable token.
    pub fn generate() -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let bytes: [u8; 16] = rand::rng().random();
        let mut hex = String::with_capacity(32);
        for b in bytes {
            hex.push(char::from(HEX[usize::from(b >> 4)]));
            hex.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        Self(hex)
    }

    /// Wraps a token a client presented.
    pub fn from_client(s: String) -> Self {
        Self(s)
    }

    /// The secret itself, for the one response that hands it out.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    /// Never prints the secret, so tokens cannot leak into logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

/// How the owner made up for a claim sent without one begins (followed by
/// [`ANONYMOUS_DIGITS`] random lowercase hex digits): such a claim never
/// re-enters anything, and no client may give such an owner.
pub const ANONYMOUS: &str = "anonymous-";

/// The random hex digits after [`ANONYMOUS`] in a made-up owner.
pub const ANONYMOUS_DIGITS: usize = 12;

/// What a client asks a backend for: everything needed to grant one lease.
#[derive(Debug, Clone)]
pub struct Claim {
    pub key: LockKey,
    pub mode: Mode,
    /// Caller-chosen identity; the same owner re-acquiring re-enters.
    pub owner: String,
    /// The sidecar that asks (shown to operators).
    pub sidecar: String,
    pub ttl: Duration,
    /// Number of permits; semaphores only.
    pub limit: Option<u32>,
    /// After this lease ends by expiry or loss, nobody is granted for this long.
    pub lock_delay: Duration,
    /// Renewals never extend the lease past acquisition + this.
    pub max_hold: Option<Duration>,
}
