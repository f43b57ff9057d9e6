//! The servers' clock. ZooKeeper has no clock a client can read, but it
//! stamps every write with its leader's wall clock (the node's `mtime`):
//! a write sent at `s` and answered at `r` on this process's clock was
//! stamped between the two, which bounds the offset from this process's
//! clock to the servers'. Every time the backend writes into a node (a
//! lease's end, its start, its cap, a lock-delay's end) is the servers',
//! and every sidecar judges them on the servers' clock, so sidecars whose
//! clocks disagree still agree on when a lease ends.
//!
//! The bounds are taken from writes the backend makes anyway (claims'
//! creates, grants, renewals) and from one write when a session opens. Each
//! use widens them by a thousandth of their age, more than a clock drifts.
//! Times are judged and written on the safe side of the bounds: a time the
//! servers wrote has passed only when the earliest the servers' clock can
//! read has reached it, and an end is written as the latest it can read
//! when this process's clock reaches it.

use std::sync::Mutex;

use zookeeper_client as zk;

use crate::clock::now_ms;

/// What one write told of the offset (the servers' clock minus this
/// process's, in milliseconds).
#[derive(Debug, Clone, Copy)]
struct Bounds {
    /// The offset is at least this.
    low: i64,
    /// The offset is at most this.
    high: i64,
    /// When the write was answered, on this process's clock.
    at: u64,
}

impl Bounds {
    /// These bounds `now`, widened by a thousandth of their age.
    fn aged(self, now: u64) -> (i64, i64) {
        let spread = i64::try_from(now.saturating_sub(self.at) / 1000).unwrap_or(i64::MAX);
        (
            self.low.saturating_sub(spread),
            self.high.saturating_add(spread),
        )
    }
}

/// The offset from this process's clock to the ZooKeeper servers', as the
/// writes of this sidecar bound it.
#[derive(Debug, Default)]
pub(super) struct ServerClock {
    /// The bounds in use: the narrowest of the recent writes'; `None`
    /// before the first write (the servers' clock is then taken for this
    /// process's).
    bounds: Mutex<Option<Bounds>>,
}

impl ServerClock {
    /// Takes what a write sent at `sent` (this process's [`now_ms`]) and
    /// answered now, with `stat`, tells of the servers' clock.
    pub(super) fn observe(&self, sent: u64, stat: &zk::Stat) {
        self.observe_at(sent, now_ms(), stat);
    }

    /// [`Self::observe`] for a write answered at `received`. The bounds it
    /// gives always hold the offset as it is now, so they are kept: alone
    /// when they are no wider than those in use (aged) or disagree with
    /// them (a clock was stepped), else joined with those (the join holds
    /// the offset if either does, also after a step smaller than they are
    /// wide).
    fn observe_at(&self, sent: u64, received: u64, stat: &zk::Stat) {
        // A server without the stat of a create answers zeros.
        if stat.mtime <= 0 {
            return;
        }
        let (sent_ms, received_ms) = (
            i64::try_from(sent).unwrap_or(i64::MAX),
            i64::try_from(received).unwrap_or(i64::MAX),
        );
        // Both clocks count whole milliseconds: the server's stamp lies in
        // [mtime, mtime + 1), this process's moment in [sent, received + 1).
        let new = Bounds {
            low: stat.mtime.saturating_sub(received_ms).saturating_sub(1),
            high: stat.mtime.saturating_add(1).saturating_sub(sent_ms),
            at: received,
        };
        let mut bounds = self.bounds.lock().unwrap_or_else(|e| e.into_inner());
        *bounds = Some(match *bounds {
            None => new,
            Some(old) => {
                let (low, high) = old.aged(new.at);
                let narrower = new.high - new.low <= high - low;
                let apart = new.high < low || new.low > high;
                if narrower || apart {
                    new
                } else {
                    Bounds {
                        low: low.min(new.low),
                        high: high.max(new.high),
                        at: new.at,
                    }
                }
            }
        });
    }

    /// The offset's bounds now.
    fn offsets(&self, now: u64) -> (i64, i64) {
        self.bounds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map_or((0, 0), |b| b.aged(now))
    }

    /// The servers' time now, at the earliest: a time written on the
    /// servers' clock has surely passed once this reached it.
    pub(super) fn now(&self) -> u64 {
        let now = now_ms();
        shift(now, self.offsets(now).0)
    }

    /// The servers' time now, at the latest: where an end written from
    /// now starts (a lease's expiry, a lock-delay, a cap), so that none
    /// ends earlier on the servers' clock than on this process's.
    pub(super) fn now_late(&self) -> u64 {
        let now = now_ms();
        shift(now, self.offsets(now).1)
    }

    /// The earliest moment on this process's clock at which the servers'
    /// clock may read `at`: a lease's end as its holder and listings
    /// report it.
    pub(super) fn earliest(&self, at: u64) -> u64 {
        shift(at, -self.offsets(now_ms()).1)
    }

    /// The moment on this process's clock by which the servers' clock
    /// surely reads `at`: when to look again for an end to have passed.
    pub(super) fn surely(&self, at: u64) -> u64 {
        shift(at, -self.offsets(now_ms()).0)
    }
}

/// `ms` moved by `offset`, within `u64` (0 and the far future stay as they
/// are: they mean none and never).
fn shift(ms: u64, offset: i64) -> u64 {
    if ms == 0 || ms >= u64::MAX / 4 {
        return ms;
    }
    ms.saturating_add_signed(offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(mtime: i64) -> zk::Stat {
        zk::Stat {
            czxid: 1,
            mzxid: 1,
            pzxid: 1,
            ctime: mtime,
            mtime,
            version: 0,
            cversion: 0,
            aversion: 0,
            ephemeral_owner: 0,
            data_length: 0,
            num_children: 0,
        }
    }

    #[test]
    fn a_clock_ahead_is_judged_on_the_safe_side() {
        let clock = ServerClock::default();
        let sent = now_ms();
        clock.observe(sent, &stat(i64::try_from(sent).unwrap() + 4_000));
        let (low, high) = clock.offsets(now_ms());
        assert!(low <= 4_000 && high >= 4_000, "{low}..{high}");
        assert!(high - low < 1_000, "{low}..{high}");
        let before = now_ms();
        let end = clock.now_late() + 6_000;
        assert!(clock.earliest(end) <= now_ms() + 6_000);
        assert!(clock.surely(end) >= before + 6_000);
        assert!(clock.now() <= clock.now_late());
    }

    #[test]
    fn a_wider_answer_widens_the_bounds_and_a_narrower_or_disagreeing_one_replaces_them() {
        const T: u64 = 1_000_000;
        let clock = ServerClock::default();
        let mtime = i64::try_from(T).unwrap() + 500;
        clock.observe_at(T, T + 2, &stat(mtime));
        assert_eq!(clock.offsets(T + 2), (497, 501));
        // A slow answer, which overlaps: joined.
        clock.observe_at(T - 3_000, T + 2, &stat(mtime));
        assert_eq!(clock.offsets(T + 2), (497, 3_501));
        // A narrower one replaces them.
        clock.observe_at(T + 10, T + 11, &stat(mtime + 10));
        assert_eq!(clock.offsets(T + 11), (498, 501));
        // Older bounds widen by a thousandth of their age.
        assert_eq!(clock.offsets(T + 5_011), (493, 506));
        // A step of the servers' clock by a minute, answered slowly: apart.
        clock.observe_at(T + 5_000, T + 7_000, &stat(mtime + 66_000));
        assert_eq!(clock.offsets(T + 7_000), (59_499, 61_501));
    }

    #[test]
    fn none_and_never_stay_as_they_are() {
        let clock = ServerClock::default();
        clock.observe(now_ms(), &stat(i64::try_from(now_ms()).unwrap() - 5_000));
        assert_eq!(clock.earliest(0), 0);
        assert_eq!(clock.surely(u64::MAX / 2), u64::MAX / 2);
    }
}
