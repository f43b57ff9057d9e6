//! One throttle of failed token checks for every place a token is checked:
//! the dashboard sign-in, the bearer token on `/v1` (API or admin token) and
//! the admin routes' bearer token, and `Authorization: Bearer` on the
//! dashboard's pages.
//!
//! Each peer address has a token bucket of failures ([`BURST`], refilled at
//! one per [`REFILL`]). A peer whose bucket is empty is answered 429
//! `too-many-failed-tokens` without its token being compared, so guessing
//! runs at one try per second per address. Right tokens take nothing, and a
//! peer that never presented a wrong token has no bucket at all: an attacker
//! at another address cannot lock out the application or the operator.
//! Processes that share an address (the sidecar's loopback) share a bucket.
//!
//! IPv6 peers are keyed by their /64, the block one host usually controls.
//! At most [`MAX_PEERS`] buckets are kept: past that, buckets that have
//! refilled are dropped, then the fullest, so the map cannot grow without
//! bound. Failures are logged in at most one WARN line per [`REPORT_EVERY`],
//! with their count, whichever place and peer they come from.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::Error;

/// Failed token checks a peer may make in a burst before it gets 429.
pub const BURST: u32 = 10;
/// A peer's bucket gives back one failure per this long.
pub const REFILL: Duration = Duration::from_secs(1);
/// Peers whose failures are tracked at most.
pub const MAX_PEERS: usize = 4096;
/// At most one WARN line about wrong tokens per this long.
pub const REPORT_EVERY: Duration = Duration::from_secs(10);

/// Where a token was checked, for the WARN line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// `POST /dashboard/sign-in`.
    SignIn,
    /// `Authorization: Bearer` on `/v1` or the dashboard's pages.
    Bearer,
    /// `Authorization: Bearer` on `/v1/admin/...`.
    Admin,
}

/// The throttle: per-peer buckets and the WARN lines' aggregation.
#[derive(Default)]
pub struct Throttle {
    state: Mutex<State>,
}

/// Everything behind the throttle's lock.
#[derive(Default)]
struct State {
    /// Peer key → its bucket; only peers with recent failures, at most
    /// [`MAX_PEERS`].
    peers: HashMap<IpAddr, Bucket>,
    /// Failures and refusals not yet reported in a WARN line.
    unreported: Unreported,
    /// When the last WARN line was written.
    reported_at: Option<Instant>,
}

/// One peer's failures.
struct Bucket {
    /// Failures the peer may still make now (up to [`BURST`]), as of `at`.
    left: f64,
    /// When `left` was last brought up to date.
    at: Instant,
}

impl Bucket {
    fn refill(&mut self, now: Instant) {
        let refilled = now.duration_since(self.at).as_secs_f64() / REFILL.as_secs_f64();
        self.left = (self.left + refilled).min(f64::from(BURST));
        self.at = now;
    }

    fn full(&self) -> bool {
        self.left >= f64::from(BURST)
    }
}

/// Counts for the next WARN line.
#[derive(Default)]
struct Unreported {
    sign_in: u64,
    bearer: u64,
    admin: u64,
    throttled: u64,
    peer: Option<IpAddr>,
}

impl Throttle {
    /// Runs `check` (does the presented token match?) for `peer` unless the
    /// peer's bucket is empty, and counts a failure when it does not match.
    /// The bucket is looked at, the token compared and the failure counted
    /// under one lock, so concurrent guesses cannot slip past the limit.
    ///
    /// # Errors
    /// [`Error::TooManyFailedTokens`] when the peer's bucket is empty; the
    /// token was not compared.
    pub fn check(
        &self,
        peer: SocketAddr,
        place: Place,
        check: impl FnOnce() -> bool,
    ) -> Result<bool, Error> {
        let key = key(peer.ip());
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(bucket) = state.peers.get_mut(&key) {
            bucket.refill(now);
            if bucket.left < 1.0 {
                state.unreported.throttled += 1;
                state.report(key, now);
                return Err(Error::TooManyFailedTokens { burst: BURST });
            }
        }
        if check() {
            return Ok(true);
        }
        if !state.peers.contains_key(&key) {
            state.make_room(now);
        }
        let bucket = state.peers.entry(key).or_insert(Bucket {
            left: f64::from(BURST),
            at: now,
        });
        bucket.left -= 1.0;
        match place {
            Place::SignIn => state.unreported.sign_in += 1,
            Place::Bearer => state.unreported.bearer += 1,
            Place::Admin => state.unreported.admin += 1,
        }
        state.report(key, now);
        Ok(false)
    }
}

impl State {
    /// Keeps the map below [`MAX_PEERS`]: refilled buckets say nothing and
    /// go first, then the fullest (the peer that failed least lately).
    fn make_room(&mut self, now: Instant) {
        if self.peers.len() < MAX_PEERS {
            return;
        }
        self.peers.retain(|_, b| {
            b.refill(now);
            !b.full()
        });
        while self.peers.len() >= MAX_PEERS {
            let Some(fullest) = self
                .peers
                .iter()
                .max_by(|a, b| a.1.left.total_cmp(&b.1.left))
                .map(|(k, _)| *k)
            else {
                break;
            };
            self.peers.remove(&fullest);
        }
    }

    /// Writes the WARN line when the last one is [`REPORT_EVERY`] old, so a
    /// flood cannot fill the log. Never the token: only counts and a peer.
    fn report(&mut self, peer: IpAddr, now: Instant) {
        self.unreported.peer = Some(peer);
        if self
            .reported_at
            .is_some_and(|at| now.duration_since(at) < REPORT_EVERY)
        {
            return;
        }
        let u = std::mem::take(&mut self.unreported);
        tracing::warn!(
            last_peer = %peer,
            sign_in = u.sign_in,
            bearer = u.bearer,
            admin = u.admin,
            throttled = u.throttled,
            peers_tracked = self.peers.len(),
            "wrong tokens presented (counts since the last such line; at most one line per 10 s)"
        );
        self.reported_at = Some(now);
    }
}

/// The bucket's key of a peer address: IPv4 (also IPv4-mapped IPv6) as
/// is, other IPv6 addresses by their /64.
fn key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(prefix))
        }
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(last: u8) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, last], 1))
    }

    #[test]
    fn a_peer_gets_a_burst_then_is_refused_without_a_comparison() {
        let throttle = Throttle::default();
        for _ in 0..BURST {
            assert!(!throttle.check(peer(1), Place::Bearer, || false).unwrap());
        }
        let compared = std::cell::Cell::new(false);
        let refused = throttle.check(peer(1), Place::SignIn, || {
            compared.set(true);
            true
        });
        assert!(matches!(refused, Err(Error::TooManyFailedTokens { .. })));
        assert!(!compared.get(), "a throttled peer's token was compared");
        // Another peer is not affected, and right tokens take nothing.
        for _ in 0..3 * BURST {
            assert!(throttle.check(peer(2), Place::Admin, || true).unwrap());
        }
        assert!(throttle.state.lock().unwrap().peers.len() == 1);
    }

    #[test]
    fn the_peers_tracked_stay_bounded() {
        let throttle = Throttle::default();
        for i in 0..(MAX_PEERS as u32 + 100) {
            let ip = SocketAddr::from((std::net::Ipv4Addr::from(0x0a00_0000 + i), 1));
            throttle.check(ip, Place::Bearer, || false).unwrap();
        }
        assert!(throttle.state.lock().unwrap().peers.len() <= MAX_PEERS);
    }

    #[test]
    fn ipv6_peers_share_their_64_and_mapped_ipv4_is_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::2".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(key(a), key(b));
        assert_ne!(key(a), key(c));
        let mapped: IpAddr = "::ffff:127.0.0.2".parse().unwrap();
        assert_eq!(key(mapped), "127.0.0.2".parse::<IpAddr>().unwrap());
        let loopback: IpAddr = "::1".parse().unwrap();
        assert_ne!(key(loopback), key(mapped));
    }
}
