//! Node names: where a lock's node lives, what a claim node is called, and
//! how a child's name gives its place and mode in the queue.

use rand::RngExt;

use super::Inner;
use crate::lock::{LockKey, Mode, Name};

/// Curator's node infix of an exclusive lock (`InterProcessMutex`).
pub(super) const EXCLUSIVE: &str = "lock-";
/// Curator's node infix of a read lock (`InterProcessReadWriteLock`).
pub(super) const READ: &str = "__READ__";
/// Curator's node infix of a write lock (`InterProcessReadWriteLock`).
pub(super) const WRITE: &str = "__WRIT__";
/// The persistent child of a lock node that carries its lock-delay. It keeps
/// the container parent from being reaped while the delay runs. No claim
/// name: no sequence suffix, and neither `lock-` nor Curator's infixes, so
/// Curator sorts it after every claim.
pub(super) const DELAY_NODE: &str = "_sidelock_delay";
/// The start of the name of a lease's lock-delay mark,
/// `_sidelock_held_<seq>_<lock_delay>ms`: a persistent child of the lock
/// node created before a lease with a lock-delay is answered, and deleted
/// by the request that ends the lease (release, expiry, force-release). A
/// mark whose claim node is gone stands for a lease that ended without
/// that request — lost with its session, whose end deletes the node and
/// nothing else — and whoever lists the lock then starts its lock-delay.
/// No claim name (no `lock-`, no Curator infix, no trailing digits), so
/// Curator sorts it after every claim.
const MARK_PREFIX: &str = "_sidelock_held_";

/// A lease's lock-delay mark ([`MARK_PREFIX`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Mark {
    /// The mark's name under its lock's parent.
    pub(super) name: String,
    /// The sequence of the lease's claim node.
    pub(super) seq: u64,
    /// The lease's lock-delay.
    pub(super) delay_ms: u64,
}

impl Mark {
    /// The mark of the lease in claim node `seq` with `delay_ms` of lock-delay.
    pub(super) fn of(seq: u64, delay_ms: u64) -> Self {
        Self {
            name: format!("{MARK_PREFIX}{seq}_{delay_ms}ms"),
            seq,
            delay_ms,
        }
    }

    /// The mark named `name`, or `None` for other nodes.
    pub(super) fn parse(name: &str) -> Option<Self> {
        let rest = name.strip_prefix(MARK_PREFIX)?.strip_suffix("ms")?;
        let (seq, delay) = rest.split_once('_')?;
        let mark = Self::of(seq.parse().ok()?, delay.parse().ok()?);
        (mark.name == name).then_some(mark)
    }
}

/// One child of a lock node.
#[derive(Debug, Clone)]
pub(super) struct Child {
    /// The node's name under its lock's parent.
    pub(super) name: String,
    /// The sequence suffix the server appended: the place in the queue.
    pub(super) seq: u64,
    /// Shared for a `__READ__` node, else exclusive.
    pub(super) mode: Mode,
}
/// The claim named `name`, or `None` for other nodes (see [`child_from`]).
pub(super) fn parse_child(name: &str) -> Option<Child> {
    child_from(name.to_owned())
}

/// The claim named `name` (its sequence and mode), or `None` for other nodes.
fn child_from(name: String) -> Option<Child> {
    let seq = sequence(&name)?;
    let mode = if name.contains(READ) {
        Mode::Shared
    } else {
        Mode::Exclusive
    };
    Some(Child { name, seq, mode })
}

/// The sequence the server appended to a claim's name: its parent's child
/// version, a signed 32-bit counter, as `%010d` — `-2147483648` and upwards
/// once 2³¹ children were created under one lock node. Taken as unsigned
/// 32 bits, so that numbers keep rising across that wrap (tickets, local
/// queues); [`sorted`] orders across the next one too. A name without one of
/// the claim infixes counts by its trailing digits (at least 10).
fn sequence(name: &str) -> Option<u64> {
    let tail = [EXCLUSIVE, READ, WRITE]
        .iter()
        .filter_map(|infix| name.rfind(infix).map(|at| &name[at + infix.len()..]))
        .min_by_key(|tail| tail.len());
    if let Some(tail) = tail {
        let digits = tail.strip_prefix('-').unwrap_or(tail);
        if tail.len() >= 10 && !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            // Two's complement: -2147483648 follows 2147483647.
            return tail.parse::<i32>().ok().map(|v| u64::from(v as u32));
        }
    }
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    if digits < 10 {
        return None;
    }
    name[name.len() - digits..].parse().ok()
}

/// The claims among `names`, sorted by sequence: the queue. Sequences are
/// compared as serial numbers (RFC 1982) from the first one's, which orders
/// them across the server's counter wrapping at 2³² creates too, as long as
/// the nodes present were created within 2³¹ of each other.
pub(super) fn sorted(names: Vec<String>) -> Vec<Child> {
    let mut children: Vec<Child> = names.into_iter().filter_map(child_from).collect();
    // Truncation intended: serial arithmetic on the server's 32 bits.
    if let Some(first) = children.first().map(|c| c.seq as u32) {
        children.sort_by_key(|c| (c.seq as u32).wrapping_sub(first) as i32);
    }
    children
}
/// The path segment of `name` under its kind's directory.
fn encode_name(name: &Name) -> String {
    // `.` and `..` are not valid ZooKeeper path segments; `%` is not a valid lock name character.
    match name.as_str() {
        "." => "%2e".into(),
        ".." => "%2e%2e".into(),
        other => other.into(),
    }
}

/// The name a path segment under a kind's directory stands for ([`encode_name`] reversed).
pub(super) fn decode_name(segment: &str) -> Option<Name> {
    let s = match segment {
        "%2e" => ".",
        "%2e%2e" => "..",
        other => other,
    };
    Name::parse(s).ok()
}

/// Whether `name` matches one of the `?rw_locks=` patterns (exact, or a prefix ending in `*`).
pub(super) fn matches_any(patterns: &[String], name: &str) -> bool {
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == p,
    })
}

/// A new claim node's name without its sequence, as Curator names it:
/// `_c_<uuid>-<infix>`.
pub(super) fn node_prefix(infix: &str) -> String {
    let b: [u8; 16] = rand::rng().random();
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    let uuid = format!(
        "{}-{}-4{}-a{}-{}",
        &h[0..8],
        &h[8..12],
        &h[13..16],
        &h[17..20],
        &h[20..32]
    );
    format!("_c_{uuid}-{infix}")
}
impl Inner {
    /// The path of `key`'s parent node.
    pub(super) fn key_path(&self, key: &LockKey) -> String {
        format!(
            "{}/{}/{}",
            self.root,
            key.kind.plural(),
            encode_name(&key.name)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::{DELAY_NODE, Mark, Mode, matches_any, parse_child, sorted};

    #[test]
    fn rw_lock_patterns_match_names_and_prefixes() {
        let patterns = vec!["orders".to_owned(), "billing-*".to_owned()];
        assert!(matches_any(&patterns, "orders"));
        assert!(!matches_any(&patterns, "orders-2"));
        assert!(matches_any(&patterns, "billing-eu"));
        assert!(matches_any(&patterns, "billing-"));
        assert!(!matches_any(&patterns, "billing"));
        assert!(!matches_any(&[], "orders"));
    }

    #[test]
    fn curator_names_parse_to_modes_and_the_delay_node_is_no_claim() {
        let write = parse_child("_c_0a-__WRIT__0000000007").expect("a claim");
        assert_eq!((write.seq, write.mode), (7, Mode::Exclusive));
        let read = parse_child("_c_0a-__READ__0000000005").expect("a claim");
        assert_eq!((read.seq, read.mode), (5, Mode::Shared));
        let mutex = parse_child("_c_0a-lock-0000000006").expect("a claim");
        assert_eq!(mutex.mode, Mode::Exclusive);
        assert!(parse_child(DELAY_NODE).is_none());
        let mark = Mark::of(12, 5000);
        assert_eq!(mark.name, "_sidelock_held_12_5000ms");
        assert_eq!(Mark::parse(&mark.name), Some(mark.clone()));
        assert!(parse_child(&mark.name).is_none());
        // Ten digits and more of lock-delay are no claim's sequence either.
        assert!(parse_child(&Mark::of(7, 12_345_678_901).name).is_none());
        assert!(Mark::parse(DELAY_NODE).is_none());
        assert!(Mark::parse("_sidelock_held_012_5ms").is_none());
        let order: Vec<u64> = sorted(vec![
            "_c_0a-__WRIT__0000000007".into(),
            DELAY_NODE.into(),
            "_c_0b-lock-0000000006".into(),
            "_c_0c-__READ__0000000005".into(),
        ])
        .iter()
        .map(|c| c.seq)
        .collect();
        assert_eq!(order, [5, 6, 7]);
    }

    /// The server names a sequential node after its parent's child
    /// version, a signed 32-bit counter formatted `%010d`: after
    /// 2,147,483,647 creates under one lock node it goes on at
    /// `-2147483648`, upwards. Read as the digits alone, every later name
    /// sorted before the older ones (a try-once claim came first, ahead of
    /// the holder: two holders), and `-000000005` was no claim at all.
    #[test]
    fn sequences_past_the_servers_counter_wrap_keep_their_order() {
        let names = |names: &[&str]| -> Vec<String> {
            sorted(names.iter().map(|n| (*n).to_owned()).collect())
                .into_iter()
                .map(|c| c.name)
                .collect()
        };
        let created = [
            "_c_0a-lock-2147483646",
            "_c_0b-lock-2147483647",
            "_c_0c-lock--2147483648",
            "_c_0d-__READ__-2147483647",
            "_c_0e-__WRIT__-2147483646",
        ];
        let mut shuffled = created;
        shuffled.reverse();
        assert_eq!(names(&shuffled), created);
        // And where the counter passes zero again.
        let created = [
            "_c_0a-lock--000000002",
            "_c_0b-__READ__-000000001",
            "_c_0c-lock-0000000000",
            "_c_0d-lock-0000000001",
        ];
        let mut shuffled = created;
        shuffled.rotate_left(2);
        assert_eq!(names(&shuffled), created);
        let read = parse_child("_c_0b-__READ__-000000001").expect("a claim");
        assert_eq!(read.mode, Mode::Shared);
        assert_ne!(
            parse_child("_c_0c-lock--2147483648").map(|c| c.seq),
            parse_child("_c_0c-lock-2147483648").map(|c| c.seq),
        );
    }
}
