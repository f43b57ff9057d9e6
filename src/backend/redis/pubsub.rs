//! Wake-ups over pub/sub: one subscription per watched lock channel on one
//! connection per member, resubscribed (and every watched lock woken) after a
//! reconnect.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use redis::aio::PubSubSink;
use redis::{ErrorKind, RedisError};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::lock::{Kind, LockKey};
use crate::wakeups::{Handoff, Wakeups};

use super::node::Node;
use super::tickets::{Numbering, Tickets, track};
use super::{CALL_TIMEOUT, lock};

/// Requests to a pub/sub task.
pub(super) enum Sub {
    Subscribe(String, oneshot::Sender<Result<(), RedisError>>),
    Unsubscribe(String),
}

/// The lock channels this sidecar subscribes to: one subscription per
/// channel however many local waiters watch it, kept [`LINGER`] after the
/// last one leaves (a lock passed back and forth between sidecars, one
/// waiter on each, costs one `SUBSCRIBE` per sidecar, not two commands per
/// wait), at most [`MAX_LINGERING`] of them at a time.
pub type Watchers = Arc<Mutex<Watched>>;

/// How long a lock's channel stays subscribed after its last local watcher
/// left.
pub(super) const LINGER: Duration = Duration::from_secs(5);

/// How many channels without a watcher may stay subscribed at once; past
/// that, a channel goes with its last watcher.
pub(super) const MAX_LINGERING: usize = 1024;

/// What [`Watchers`] guards.
#[derive(Default)]
pub struct Watched {
    /// The subscribed (or being subscribed) channels.
    pub(super) channels: HashMap<String, Channel>,
    /// How many channels have no watcher.
    pub(super) lingering: usize,
    /// How many times a channel was left to linger: each linger's number,
    /// so that its end acts only on its own.
    pub(super) lingers: u64,
}

/// One subscribed lock channel.
pub(super) struct Channel {
    pub(super) key: LockKey,
    /// Local watchers (0 while it lingers).
    pub(super) watchers: usize,
    /// Whether a watch saw the subscription confirmed: only such a channel
    /// lingers (a new watcher of a lingering channel is not told again).
    pub(super) confirmed: bool,
    /// The number of its linger, while it lingers.
    pub(super) linger: u64,
    /// The subscription under way, while one is: its outcome once known
    /// (why it failed, if it did), for the watchers that came meanwhile.
    pub(super) pending: Option<Subscribing>,
}

/// The outcome of a channel's subscription, once known.
pub(super) type Subscribing = tokio::sync::watch::Receiver<Option<Result<(), RedisError>>>;

/// Keeps one subscription per watched channel on one pub/sub connection;
/// a message wakes the local queue head of its lock, or delivers the lease
/// a release handed to one of this sidecar's queued claims. After a
/// reconnect it resubscribes and wakes every watched lock, catching up
/// releases missed while disconnected.
#[allow(clippy::too_many_arguments)]
pub(super) async fn pubsub(
    node: Arc<Node>,
    tickets: Arc<std::sync::Mutex<Tickets>>,
    up: Arc<std::sync::atomic::AtomicBool>,
    mut rx: mpsc::UnboundedReceiver<Sub>,
    watchers: Watchers,
    wakeups: Wakeups,
    stop: CancellationToken,
    numbering: Numbering,
) {
    let mut backoff = Duration::from_millis(50);
    // The Cluster seed to try first: the next one after a seed that failed.
    let mut first_seed = 0;
    loop {
        let connected = async {
            let (client, place) = node.pubsub_client(first_seed).await?;
            Ok::<_, RedisError>((client.get_async_pubsub().await?, place))
        };
        let ps = tokio::select! {
            () = stop.cancelled() => return,
            r = crate::clock::within(CALL_TIMEOUT, connected) => r,
        };
        let Ok(Ok((ps, place))) = ps else {
            first_seed += 1;
            if !fail_and_back_off(&mut rx, &mut backoff, &stop, None).await {
                return;
            }
            continue;
        };
        let (mut sink, mut stream) = ps.split();
        let current: Vec<(String, LockKey)> = lock(&watchers)
            .channels
            .iter()
            .map(|(c, ch)| (c.clone(), ch.key.clone()))
            .collect();
        // Its own channel first: where releases hand locks to this sidecar,
        // or wake its waiter that heads a node's queue.
        let own = node.own_channel();
        let mut refused = subscribe(&mut sink, &own).await.err();
        for (channel, _) in &current {
            if refused.is_none() {
                refused = subscribe(&mut sink, channel).await.err();
            }
        }
        if let Some(e) = refused {
            // Refused (a user without the channels' rights) or unanswered:
            // not at once again.
            tracing::warn!(url = %node.url, error = %e, "pub/sub subscription failed; reconnecting after {backoff:?}");
            if !fail_and_back_off(&mut rx, &mut backoff, &stop, Some(e)).await {
                return;
            }
            continue;
        }
        backoff = Duration::from_millis(50);
        up.store(true, std::sync::atomic::Ordering::Relaxed);
        // Releases made meanwhile woke nobody here, and may have passed this
        // process's waiters by: each local head looks again, and the
        // passed-by entries queue again.
        for (_, key) in &current {
            wakeups.wake(key);
        }
        let waiting: Vec<LockKey> = lock(&tickets).queued.keys().cloned().collect();
        for key in &waiting {
            rejoin(&node, &tickets, &wakeups, key);
        }
        // Subscriptions change one at a time, each confirmed before the
        // next, beside the messages: a handoff on the own channel is not
        // held up behind a subscription on its way.
        let ping = tokio::sync::Notify::new();
        let subscribing = subscriptions(sink, &mut rx, &ping);
        tokio::pin!(subscribing);
        let mut probe = Probe::default();
        let mut probe_tick =
            tokio::time::interval_at(tokio::time::Instant::now() + PROBE_EVERY, PROBE_EVERY);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = probe_tick.tick() => {
                    if probe.unheard().await {
                        tracing::warn!(
                            url = %node.url,
                            "the pub/sub connection no longer hears what is published where commands go; reconnecting"
                        );
                        node.ask_for_the_master_again();
                        first_seed = place + 1;
                        break;
                    }
                    // Claims queued, whose handoffs come on this connection
                    // (not watchers: every sidecar watches the monitor
                    // election, idle or not).
                    if lock(&tickets).queued.values().any(|q| !q.is_empty()) {
                        if node.probes_pubsub() {
                            probe.send(&node);
                        } else {
                            ping.notify_one();
                        }
                    }
                }
                end = &mut subscribing => match end {
                    SinkEnd::Closed => return,
                    SinkEnd::Failed => break,
                },
                msg = stream.next() => {
                    let Some(msg) = msg else { break };
                    wakeups.heard();
                    if own == msg.get_channel_name() {
                        let payload = msg.get_payload_bytes();
                        if probe.heard(payload) {
                            continue;
                        }
                        if let Some(h) = handed(payload)
                            && let Some(key) = node.lock_of(&h.main)
                        {
                            deliver(&node, &tickets, &wakeups, &key, h);
                        } else if let Some((seq, key)) = head_named(payload)
                            .and_then(|(seq, main)| Some((seq, node.lock_of(main)?)))
                        {
                            match numbering {
                                Numbering::Shared => wakeups.wake_ticket(&key, seq),
                                Numbering::PerNode => wakeups.wake(&key),
                            }
                        }
                        continue;
                    }
                    let key = lock(&watchers)
                        .channels
                        .get(msg.get_channel_name())
                        .map(|ch| ch.key.clone());
                    if let Some(key) = key {
                        let payload = msg.get_payload_bytes();
                        if payload == b"g" {
                            // A new holder: nobody waiting can get in.
                            wakeups.changed(&key);
                            continue;
                        }
                        if payload == b"p" {
                            // Entries went as dead: ours, if any, queue again.
                            rejoin(&node, &tickets, &wakeups, &key);
                        }
                        match next_ticket(&msg).filter(|_| numbering == Numbering::Shared) {
                            Some(seq) => wakeups.wake_ticket(&key, seq),
                            None => wakeups.wake(&key),
                        }
                    }
                }
            }
        }
        up.store(false, std::sync::atomic::Ordering::Relaxed);
        tracing::warn!(url = %node.url, "pub/sub connection lost; reconnecting");
    }
}

/// After a pub/sub connection could not be made (or subscribed): fails the
/// subscription requests waiting, now rather than at their time limit, with
/// `refusal` when Redis refused a subscription (its waiters' 503 names it),
/// and waits `backoff`, doubled for the next time up to 2 s. `false` at
/// shutdown.
async fn fail_and_back_off(
    rx: &mut mpsc::UnboundedReceiver<Sub>,
    backoff: &mut Duration,
    stop: &CancellationToken,
    refusal: Option<RedisError>,
) -> bool {
    while let Ok(sub) = rx.try_recv() {
        if let Sub::Subscribe(_, ack) = sub {
            let down = refusal
                .clone()
                .unwrap_or_else(|| RedisError::from((ErrorKind::Io, "pub/sub connection down")));
            let _ = ack.send(Err(down));
        }
    }
    tokio::select! {
        () = stop.cancelled() => return false,
        () = tokio::time::sleep(*backoff) => {}
    }
    *backoff = (*backoff * 2).min(Duration::from_secs(2));
    true
}

/// Why [`subscriptions`] ended.
enum SinkEnd {
    /// The backend went: nobody can ask for subscriptions any more.
    Closed,
    /// A subscription command failed: the connection is to be made again.
    Failed,
}

/// Carries out the subscription requests in order on `sink`, each answered
/// (a subscription once Redis confirmed it) before the next is sent, and a
/// `PING` at each notification of `ping`. One not answered within
/// [`CALL_TIMEOUT`] fails the connection: on a connection that died without
/// a word every later subscription would wait behind it, and each first
/// waiter of a lock answer 503, for as long as the socket lived; the
/// handoffs to this sidecar's queued claims would be lost with it, and
/// learned only at their retry timers.
///
/// # Cancellation safety
/// Dropped with a subscription on its way, that request's waiter hears the
/// channel closed (not confirmed); later requests stay in `rx`.
async fn subscriptions(
    mut sink: PubSubSink,
    rx: &mut mpsc::UnboundedReceiver<Sub>,
    ping: &tokio::sync::Notify,
) -> SinkEnd {
    loop {
        let sub = tokio::select! {
            sub = rx.recv() => sub,
            () = ping.notified() => {
                let pong = crate::clock::within(CALL_TIMEOUT, sink.ping::<redis::Value>());
                if !matches!(pong.await, Ok(Ok(_))) {
                    return SinkEnd::Failed;
                }
                continue;
            }
        };
        let Some(sub) = sub else { break };
        match sub {
            Sub::Subscribe(channel, ack) => {
                let r = subscribe(&mut sink, &channel).await;
                let failed = r.is_err();
                let _ = ack.send(r);
                if failed {
                    return SinkEnd::Failed;
                }
            }
            Sub::Unsubscribe(channel) => {
                let unsubscribed = crate::clock::within(CALL_TIMEOUT, sink.unsubscribe(&channel));
                if !matches!(unsubscribed.await, Ok(Ok(()))) {
                    return SinkEnd::Failed;
                }
            }
        }
    }
    SinkEnd::Closed
}

/// Subscribes `sink` to `channel`, an error when Redis does not confirm it
/// within [`CALL_TIMEOUT`].
async fn subscribe(sink: &mut PubSubSink, channel: &str) -> Result<(), RedisError> {
    crate::clock::within(CALL_TIMEOUT, sink.subscribe(channel))
        .await
        .unwrap_or_else(|_| {
            Err(RedisError::from((
                ErrorKind::Io,
                "subscription not confirmed in time",
            )))
        })
}

/// How often, while this sidecar has claims queued, its pub/sub connection
/// is checked: with a `PING` on it, which a connection dead without a word
/// (a middlebox dropped it: no reset, no close) leaves unanswered, where it
/// would lose the handoffs to those claims until their retry timers; in a
/// Cluster and with Sentinel with a [`Probe`] ([`Node::probes_pubsub`]).
const PROBE_EVERY: Duration = super::HEARTBEAT_EVERY;

/// A message this sidecar publishes to itself where its commands go, to see
/// that its pub/sub connection still hears what is published there (a node
/// removed from a Cluster, or a Sentinel master failed over while cut off
/// from the sentinels, keeps answering, and hears none): `probe <n>`.
#[derive(Default)]
struct Probe {
    sent: u64,
    /// The probe on its way: its number, and the call that publishes it
    /// (`true` once published).
    pending: Option<(u64, tokio::task::JoinHandle<bool>)>,
}

impl Probe {
    /// Publishes the next probe, in the background.
    fn send(&mut self, node: &Arc<Node>) {
        self.sent += 1;
        let payload = format!("probe {}", self.sent);
        let node = node.clone();
        let call = tokio::spawn(async move { node.publish_own(&payload).await.is_ok() });
        if let Some((_, old)) = self.pending.replace((self.sent, call)) {
            old.abort();
        }
    }

    /// Whether `payload` is a probe (the pending one is then heard).
    fn heard(&mut self, payload: &[u8]) -> bool {
        let Some(n) = payload.strip_prefix(b"probe ") else {
            return false;
        };
        if self
            .pending
            .as_ref()
            .is_some_and(|(sent, _)| n == sent.to_string().as_bytes())
        {
            self.pending = None;
        }
        true
    }

    /// Whether the pending probe was published and never heard. One whose
    /// call failed or is still going (the cluster itself is in trouble)
    /// tells nothing about the pub/sub node.
    async fn unheard(&mut self) -> bool {
        match self.pending.take() {
            Some((_, call)) if call.is_finished() => call.await.unwrap_or(false),
            Some((_, call)) => {
                call.abort();
                false
            }
            None => false,
        }
    }
}

/// A lease a release handed to a queued claim, as its message on the
/// claim's sidecar's own channel says: `t<seq> <fence> <since> <expires>
/// <main key>` (server times).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Handed {
    seq: u64,
    fence: u64,
    since: i64,
    expires: i64,
    main: String,
}

pub(super) fn handed(payload: &[u8]) -> Option<Handed> {
    let text = std::str::from_utf8(payload.strip_prefix(b"t")?).ok()?;
    let mut fields = text.splitn(5, ' ');
    let mut next = || fields.next()?.parse::<i64>().ok();
    let (seq, fence, since, expires) = (next()?, next()?, next()?, next()?);
    Some(Handed {
        seq: u64::try_from(seq).ok()?,
        fence: u64::try_from(fence).ok()?,
        since,
        expires,
        main: fields.next()?.to_owned(),
    })
}

/// How long a handoff for a ticket this process does not know waits for
/// the join that queued it to answer (a call's own time limit) before the
/// lease is given back.
pub(super) const UNKNOWN_GRACE: Duration = CALL_TIMEOUT;

/// Gives a handed lease to the local waiter whose ticket it names (the
/// ticket is done with once it took it). A ticket this process never knew
/// (its join's answer came back later, or was lost) is looked at again after
/// [`UNKNOWN_GRACE`]: delivered if known by then, the lease given back if
/// the ticket never was or its waiter left while the node could not be
/// told (one that finished otherwise is the waiter's own business: its
/// grant or dequeue saw to the lease).
pub(super) fn deliver(
    node: &Arc<Node>,
    tickets: &Arc<std::sync::Mutex<Tickets>>,
    wakeups: &Wakeups,
    key: &LockKey,
    h: Handed,
) {
    let mine = lock(tickets)
        .queued
        .get(key)
        .and_then(|seqs| seqs.get(&h.seq))
        .map(|q| q.token.clone());
    if let Some(token) = mine {
        hand(node, tickets, wakeups, key, &h, token);
        return;
    }
    let (node, tickets, wakeups, key) =
        (node.clone(), tickets.clone(), wakeups.clone(), key.clone());
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(UNKNOWN_GRACE).await;
            let (known, mine, abandoned, (lost, pending)) = {
                let t = lock(&tickets);
                let mine = t
                    .queued
                    .get(&key)
                    .and_then(|s| s.get(&h.seq))
                    .map(|q| q.token.clone());
                let abandoned = t.abandoned.contains_key(&(key.clone(), h.seq));
                (t.knows(&key, h.seq), mine, abandoned, t.lost_on(&key))
            };
            match mine {
                Some(token) => hand(&node, &tickets, &wakeups, &key, &h, token),
                // Unknown, or its waiter left while the node could not be told.
                None if !known || abandoned => match node.give_back(&key, h.fence, &lost).await {
                    // A lost join's, whose release may still take it: looked at
                    // again once that release has run (it may find nothing).
                    Ok(GaveBack::LeftToRelease) if pending => continue,
                    // Observers elsewhere may have read its campaign leading.
                    Ok(GaveBack::Given) if key.kind == Kind::Election => {
                        let _ = node.announce(&key).await;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(lock = %key, error = %e, "could not give back a lease nobody waits for");
                    }
                },
                None => {}
            }
            return;
        }
    });
}

/// What a give-back of a lock handed to a ticket nobody knows did.
pub(super) enum GaveBack {
    /// The lock passed on.
    Given,
    /// The lease is a lost join's, left to that join's background release.
    LeftToRelease,
    /// The lease is not there any more, or was re-entered.
    NotHeld,
}

/// Puts a handed lease into its waiter's place.
fn hand(
    node: &Node,
    tickets: &std::sync::Mutex<Tickets>,
    wakeups: &Wakeups,
    key: &LockKey,
    h: &Handed,
    token: crate::lock::Token,
) {
    let clock = node.settled_clock();
    let lease = Handoff {
        token,
        fence: h.fence,
        since_ms: clock.local(h.since),
        expires_at_ms: clock.end(h.expires),
    };
    if wakeups.granted(key, h.seq, lease) {
        track(tickets, key, h.seq, None);
    }
}

/// Puts this process's entries on `key` that a release passed by back in
/// the queue, then lets its local head look.
fn rejoin(
    node: &Arc<Node>,
    tickets: &Arc<std::sync::Mutex<Tickets>>,
    wakeups: &Wakeups,
    key: &LockKey,
) {
    let entries = lock(tickets).entries(key);
    if entries.is_empty() {
        return;
    }
    let (node, tickets, wakeups, key) =
        (node.clone(), tickets.clone(), wakeups.clone(), key.clone());
    tokio::spawn(async move {
        let raw: Vec<String> = entries.iter().map(|(_, e)| e.clone()).collect();
        // Unanswered, the script may have run: any entry may be back.
        let back: Option<std::collections::HashSet<String>> = match node.rejoin(&key, &raw).await {
            Ok(back) => Some(back.into_iter().collect()),
            Err(e) => {
                tracing::debug!(lock = %key, error = %e, "could not queue passed-by waiters again");
                None
            }
        };
        // A waiter that left after `entries` was read had its entry removed
        // before the script put it back: a release would hand the lock to
        // that entry, and nobody here would take or give back the lease
        // (its ticket finished) until its ttl.
        let put_back: Vec<(u64, String)> = entries
            .into_iter()
            .filter(|(_, e)| back.as_ref().is_none_or(|back| back.contains(e)))
            .collect();
        let left = lock(&tickets).take_left(&key, put_back);
        // Last first: a first one removed while the lock is free hands the
        // lock on, to the next of them were it still there.
        for entry in left.iter().rev() {
            if let Err(e) = node.drop_entry(&key, entry).await {
                tracing::debug!(lock = %key, error = %e, "could not remove the entry of a waiter that left");
            }
        }
        if back.is_some_and(|back| back.len() > left.len()) {
            wakeups.wake(&key);
        }
    });
}

/// The ticket and main key a wake-up on this sidecar's own channel names
/// (`h<seq> <main key>`: its waiter heads a node's queue).
pub(super) fn head_named(payload: &[u8]) -> Option<(u64, &str)> {
    let (seq, main) = std::str::from_utf8(payload.strip_prefix(b"h")?)
        .ok()?
        .split_once(' ')?;
    Some((seq.parse().ok()?, main))
}

/// The ticket a release message names (`h<seq>`: only its holder can be
/// admitted), if it names one.
pub(super) fn next_ticket(msg: &redis::Msg) -> Option<u64> {
    std::str::from_utf8(msg.get_payload_bytes().strip_prefix(b"h")?)
        .ok()?
        .parse()
        .ok()
}
