//! The LISTEN connection: wake-ups from `NOTIFY`, the heartbeat on the same
//! connection, reconnects with backoff (waking every key with local
//! waiters), and the clock offset measured on connecting.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{Notify, mpsc};
use tokio_postgres::types::ToSql;
use tokio_postgres::{AsyncMessage, NoTls, Row};

use crate::backend::{Error, chain};
use crate::clock::{ms, now_ms};
use crate::lock::LockKey;
use crate::wakeups::Handoff;

use super::calls::Params;
use super::errors::Failure;
use super::sql::{NOW_SQL, SESSION_SETUP, ms_i64, quote_ident};
use super::{
    GHOST_AFTER, HEARTBEAT_EVERY, Inner, LAPSE_AFTER, MAX_BACKOFF, MIN_BACKOFF, OP_TIMEOUT,
};

impl Inner {
    /// Sends one heartbeat on `client` (see `heartbeat` in the SQL).
    pub(super) async fn heartbeat(
        &self,
        client: &tokio_postgres::Client,
        statement: &tokio_postgres::Statement,
    ) -> Result<(), tokio_postgres::Error> {
        let beat = self.beat();
        let sent = now_ms();
        let reply = client.query_one(statement, &beat.refs()).await?;
        self.settle_offset((sent, now_ms()), std::slice::from_ref(&reply));
        self.beaten(&beat, Some(&reply));
        Ok(())
    }

    /// Sends one heartbeat through the pool, as `op`: before a join when the
    /// last one is old (see [`Inner::heartbeat_is_old`]), and as the
    /// monitor's housekeeping.
    pub(super) async fn heartbeat_now(&self, op: &'static str) -> Result<(), Error> {
        self.heartbeat_clearing(op).await.map(drop)
    }

    /// [`Inner::heartbeat_now`], answering how many expired leases it
    /// removed. Its tickets are read once a connection is had, not before
    /// a wait for one: a row queued meanwhile would be older than a ghost
    /// by the time a long wait ended, and dropped as one.
    pub(super) async fn heartbeat_clearing(&self, op: &'static str) -> Result<u64, Error> {
        let sent = std::sync::Mutex::new(None);
        let build = || {
            let beat = self.beat();
            *sent
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(beat.clone());
            Some(beat)
        };
        let reply = self
            .rows_as_of_sending(op, &self.sql.heartbeat, build)
            .await
            .map_err(|(e, _)| e)?
            .unwrap_or_default();
        if let Some(beat) = sent
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            self.beaten(&beat, reply.first());
        }
        let cleared = reply
            .first()
            .and_then(|r| r.try_get::<_, String>(0).ok())
            .and_then(|json| serde_json::from_str::<serde_json::Value>(&json).ok())
            .and_then(|v| v["leases"].as_u64());
        Ok(cleared.unwrap_or(0))
    }

    /// The arguments of one heartbeat, from this sidecar's tickets now.
    fn beat(&self) -> Beat {
        let as_i64 = |seqs: &mut dyn Iterator<Item = &u64>| -> Vec<i64> {
            seqs.filter_map(|&s| i64::try_from(s).ok()).collect()
        };
        let t = self.tickets();
        Beat {
            instance: self.instance.clone(),
            sidecar: self.sidecar.clone(),
            live: as_i64(&mut t.live.keys()),
            gone: as_i64(&mut t.gone.iter()),
            lapse_ms: ms_i64(LAPSE_AFTER),
            ghost_ms: ms_i64(GHOST_AFTER),
        }
    }

    /// Whether the last heartbeat is older than the interval: this sidecar
    /// had no tickets for a while, so it sent none.
    pub(super) fn heartbeat_is_old(&self) -> bool {
        let beat = self.beat_ms.load(Ordering::Relaxed);
        now_ms().saturating_sub(beat) > ms(HEARTBEAT_EVERY)
    }

    /// Whether this sidecar has tickets to keep alive or to remove: only
    /// then does the interval send a heartbeat.
    fn has_tickets(&self) -> bool {
        let t = self.tickets();
        !t.live.is_empty() || !t.gone.is_empty()
    }

    /// Heartbeat `beat` was answered with `reply`: the rows it sent as
    /// gone are removed. When the one before it was about a lapse ago on
    /// the database's clock ([`suspect_gap_ms`]: this process was paused,
    /// a VM frozen, while its LISTEN connection stayed up), any heartbeat
    /// in between may have dropped this sidecar's waiter rows, and no
    /// notification says so: every local waiter takes its place back, as
    /// after the LISTEN connection reconnects (the rejoin task is asked
    /// for). (A sidecar that had no waiters for a while sends a heartbeat
    /// before its next join: that one is the last.)
    fn beaten(&self, beat: &Beat, reply: Option<&Row>) {
        self.beat_ms.store(now_ms(), Ordering::Relaxed);
        {
            let mut t = self.tickets();
            for seq in &beat.gone {
                t.gone.remove(&u64::try_from(*seq).unwrap_or(0));
            }
        }
        let Some(db_now) = reply.and_then(|r| r.try_get::<_, i64>("db_now").ok()) else {
            return;
        };
        // The latest: a slow pooled heartbeat may answer after a later one.
        let last = self.beat_db_ms.fetch_max(db_now, Ordering::Relaxed);
        let suspect =
            !beat.live.is_empty() && last > 0 && db_now.saturating_sub(last) >= suspect_gap_ms();
        if suspect {
            tracing::warn!(
                silent_ms = db_now - last,
                "no heartbeat for longer than the lapse; every waiter takes its place back"
            );
            self.rejoin_soon.notify_one();
        }
    }

    /// Puts back the waiter rows of this sidecar's queued tickets that may
    /// have gone while it could not be heard (dropped as a silent
    /// sidecar's, or passed by as a dead one's), each at its own ticket, in
    /// one statement under the keys' row locks: a row that is there, or
    /// whose token holds a lease (handed to it meanwhile), stays as it is;
    /// a ticket being dequeued is left out. Then each local queue head
    /// looks, and every other waiter when it heads its queue (as before
    /// this put them back, which it did one by one, each only once it was
    /// the head: a release, or permits freed together, in the meantime
    /// went to a claim queued later through another sidecar).
    async fn rejoin(&self) {
        // Observers need no rows back, only to look: a leader announced
        // meanwhile is read at once, whatever the pool's wait.
        self.wakeups.wake_observers();
        self.put_rows_back().await;
        for key in self.wakeups.keys() {
            self.wakeups.wake_all(&key);
        }
    }

    /// [`Inner::rejoin`]'s statement, and the removal of rows it put back
    /// for tickets delivered meanwhile.
    async fn put_rows_back(&self) {
        // Its own row first: rows put back for a sidecar whose heartbeat is
        // a lapse old would be dropped again by the next release.
        if let Err(e) = self.heartbeat_now("rejoin").await {
            tracing::warn!(error = %e, "could not put waiter rows back");
            return;
        }
        let delivered = {
            let _rejoining = self.rejoining.write().await;
            // The tickets as the statement goes, not before its wait for a
            // connection: one delivered meanwhile, its lease ended since
            // (expired, or released), would be put back with the token its
            // client was told, and handed that token again — its client's
            // keepalives then renewing a lease someone held in between.
            let build = || {
                let mut params = Rejoin {
                    instance: self.instance.clone(),
                    ..Rejoin::default()
                };
                let t = self.tickets();
                for (seq, live) in t.live.iter() {
                    if !t.gone.contains(seq) && !t.leaving.contains(seq) {
                        params.add(*seq, live);
                    }
                }
                (!params.seqs.is_empty()).then_some(params)
            };
            let rows = match self
                .rows_as_of_sending("rejoin", &self.sql.rejoin, build)
                .await
            {
                Ok(Some(rows)) => rows,
                Ok(None) => return,
                Err((e, _)) => {
                    tracing::warn!(error = %e, "could not put waiter rows back");
                    return;
                }
            };
            tracing::debug!(rows = rows.len(), "waiter rows put back");
            // Chosen while the sidecar's own attempts and dequeues wait: a
            // ticket gone from `live` now was delivered a handoff (before
            // the statement, its lease released since; or after it, to the
            // row put back).
            let t = self.tickets();
            rows.iter()
                .filter_map(|r| r.try_get::<_, i64>(0).ok())
                .filter(|seq| u64::try_from(*seq).is_ok_and(|s| !t.live.contains_key(&s)))
                .collect::<Vec<i64>>()
        };
        // By the row alone: a lease handed to the row after the statement
        // is its waiter's now. (Handed to one put back for a lease already
        // released, it lasts its ttl: a window of one round trip.)
        for seq in delivered {
            let removed: Result<bool, Error> = self
                .value(
                    "dequeue",
                    &self.sql.dequeue,
                    &[&seq, &"", &ms_i64(LAPSE_AFTER)],
                )
                .await;
            if removed.is_err() {
                self.tickets().gone.insert(u64::try_from(seq).unwrap_or(0));
            }
        }
    }

    /// Background task: runs [`Inner::rejoin`] whenever `asked` (one at a
    /// time; asks that come meanwhile make one more), apart from the LISTEN
    /// connection's loop, which goes on reading notifications and sending
    /// heartbeats within their time limit however long a rejoin waits for
    /// connections and row locks. Holds the backend only while it runs one.
    pub(super) async fn rejoins(
        me: std::sync::Weak<Self>,
        asked: Arc<Notify>,
        stop: tokio_util::sync::CancellationToken,
    ) {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = asked.notified() => {}
            }
            let Some(inner) = me.upgrade() else {
                return;
            };
            inner.rejoin().await;
        }
    }
}

/// The arguments of the `rejoin` statement: one array per column.
#[derive(Default)]
struct Rejoin {
    instance: String,
    seqs: Vec<i64>,
    kinds: Vec<&'static str>,
    names: Vec<String>,
    modes: Vec<&'static str>,
    owners: Vec<String>,
    sidecars: Vec<String>,
    tokens: Vec<String>,
    ttls: Vec<i64>,
    max_holds: Vec<Option<i64>>,
    lock_delays: Vec<i64>,
}

impl Rejoin {
    fn add(&mut self, seq: u64, live: &super::Live) {
        let claim = &live.claim;
        self.seqs.push(i64::try_from(seq).unwrap_or(i64::MAX));
        self.kinds.push(claim.key.kind.as_str());
        self.names.push(claim.key.name.as_str().to_owned());
        self.modes.push(claim.mode.as_str());
        self.owners.push(claim.owner.clone());
        self.sidecars.push(claim.sidecar.clone());
        self.tokens.push(live.token.expose().to_owned());
        self.ttls.push(ms_i64(claim.ttl));
        self.max_holds.push(claim.max_hold.map(ms_i64));
        self.lock_delays.push(ms_i64(claim.lock_delay));
    }
}

impl Params for Rejoin {
    fn refs(&self) -> Vec<&(dyn ToSql + Sync)> {
        vec![
            &self.instance,
            &self.seqs,
            &self.kinds,
            &self.names,
            &self.modes,
            &self.owners,
            &self.sidecars,
            &self.tokens,
            &self.ttls,
            &self.max_holds,
            &self.lock_delays,
        ]
    }
}

/// A gap between two heartbeats (their statements' arrival, on the
/// database's clock) after which this sidecar's waiter rows may have been
/// dropped: the lapse, less two intervals, since a heartbeat's row takes
/// effect only when it commits (after any key lock it waits for), and a
/// pooled heartbeat that arrived earlier may commit after the LISTEN
/// connection's. Normal heartbeats are one interval apart; a wrong guess
/// costs one attempt per waiter.
fn suspect_gap_ms() -> i64 {
    ms_i64(LAPSE_AFTER.saturating_sub(HEARTBEAT_EVERY * 2))
}

/// The arguments of `heartbeat` in the SQL.
#[derive(Clone)]
struct Beat {
    instance: String,
    sidecar: String,
    live: Vec<i64>,
    gone: Vec<i64>,
    lapse_ms: i64,
    ghost_ms: i64,
}

impl Params for Beat {
    fn refs(&self) -> Vec<&(dyn ToSql + Sync)> {
        vec![
            &self.instance,
            &self.sidecar,
            &self.lapse_ms,
            &self.live,
            &self.gone,
            &self.ghost_ms,
        ]
    }
}

impl Inner {
    /// Background task: sets the schema up if start-up could not, then keeps
    /// the LISTEN connection (and with it the heartbeat) alive.
    pub(super) async fn run(self: Arc<Self>) {
        let mut backoff = MIN_BACKOFF;
        while !self.stop.is_cancelled() {
            if !*self.ready.borrow() {
                match self.setup().await {
                    Ok(()) => {
                        tracing::info!(schema = %self.schema, "PostgreSQL is reachable; schema ready")
                    }
                    Err(f) => {
                        // The sidecar's health check warns once per outage.
                        self.setup_failed(&f);
                        tracing::debug!(error = %f.describe(), "PostgreSQL is not reachable; retrying");
                        self.pause(&mut backoff).await;
                        continue;
                    }
                }
            }
            match crate::clock::within(OP_TIMEOUT, self.connect_listener()).await {
                Ok(Ok((client, notifications))) => {
                    backoff = MIN_BACKOFF;
                    self.listen(client, notifications).await;
                }
                Ok(Err(f)) => {
                    tracing::warn!(error = %f.describe(), "cannot LISTEN on PostgreSQL; retrying");
                }
                Err(_) => tracing::warn!("connecting the LISTEN connection timed out; retrying"),
            }
            self.pause(&mut backoff).await;
        }
    }

    /// Waits before the next connection attempt: `backoff` (doubling up to
    /// [`MAX_BACKOFF`]), or [`MIN_BACKOFF`] once a pooled call shows the
    /// database is back.
    pub(super) async fn pause(&self, backoff: &mut Duration) {
        let started = tokio::time::Instant::now();
        tokio::select! {
            () = tokio::time::sleep(*backoff) => {}
            () = self.reconnect.notified() => {
                tokio::time::sleep_until(started + MIN_BACKOFF).await;
            }
            () = self.stop.cancelled() => {}
        }
        *backoff = (*backoff * 2).min(MAX_BACKOFF);
    }

    /// Opens the dedicated LISTEN connection — on the shared channel and on
    /// this process's own (`own_channel()` in `0004_handoff.sql`), holding
    /// this instance's advisory lock; its notifications arrive on the
    /// returned channel, which closes when the connection ends.
    pub(super) async fn connect_listener(
        &self,
    ) -> Result<(tokio_postgres::Client, mpsc::UnboundedReceiver<String>), Failure> {
        let (client, mut connection) = self.listen_config.connect(NoTls).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(n)) => {
                        if tx.send(n.payload().to_owned()).is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %chain(&e), "the LISTEN connection ended");
                        return;
                    }
                }
            }
        });
        client
            .batch_execute(&format!(
                "{}; LISTEN {}; LISTEN {}",
                SESSION_SETUP,
                quote_ident(&self.channel),
                quote_ident(&self.own_channel())
            ))
            .await?;
        // Held while this connection lives: a release hands a lock only to
        // the waiter of a sidecar that holds it (see `pass_on()`).
        let taken: bool = client
            .query_one(
                "SELECT pg_try_advisory_lock(hashtextextended('sidelock instance ' || $1, 0))",
                &[&self.instance],
            )
            .await?
            .get(0);
        if !taken {
            // The instance is this process's alone: an idle holder is an
            // earlier connection of ours the server has not seen die (a
            // dropped network). Handoffs would go to it, unheard, for as
            // long as it lasts: end it, then wait for the lock it frees. A
            // holder in a transaction is another sidecar's release asking
            // whether we are alive (`pass_on()`, which takes it shared, so
            // one that just committed is not taken for ours): it is waited
            // for, not ended.
            tracing::warn!(
                "an earlier LISTEN connection of this sidecar still holds its session: ending it"
            );
            client
                .execute(
                    "SELECT pg_terminate_backend(l.pid) FROM pg_locks l
                      WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                        AND l.mode = 'ExclusiveLock'
                        AND l.pid <> pg_backend_pid()
                        AND EXISTS (SELECT 1 FROM pg_stat_activity a
                                     WHERE a.pid = l.pid AND a.state = 'idle')
                        AND ((l.classid::bigint << 32) | l.objid::bigint)
                            = hashtextextended('sidelock instance ' || $1, 0)",
                    &[&self.instance],
                )
                .await?;
            // Not forever (a role that may not end it): the connection is
            // retried, as after any failure.
            client.batch_execute("SET lock_timeout = '10s'").await?;
            client
                .execute(
                    "SELECT pg_advisory_lock(hashtextextended('sidelock instance ' || $1, 0))",
                    &[&self.instance],
                )
                .await?;
            // Not RESET: that is the database's default, which may be short.
            client.batch_execute("SET lock_timeout = 0").await?;
        }
        Ok((client, rx))
    }

    /// Delivers notifications and sends heartbeats until the connection fails.
    pub(super) async fn listen(
        &self,
        client: tokio_postgres::Client,
        mut notifications: mpsc::UnboundedReceiver<String>,
    ) {
        let beat = match client.prepare(&self.sql.heartbeat).await {
            Ok(statement) => statement,
            Err(e) => {
                tracing::warn!(error = %chain(&e), "cannot prepare the heartbeat");
                return;
            }
        };
        match measure_offset(&client).await {
            Ok(offset) => self.adopt_offset(offset),
            Err(e) => {
                tracing::warn!(error = %chain(&e), "cannot read the database clock");
                return;
            }
        }
        self.listening.send_replace(true);
        tracing::debug!(channel = %self.channel, "listening for wake-ups");
        // Releases made while this connection was down were not heard, and
        // may have passed every local waiter by (`pass_on()` takes a
        // waiter's row when its instance's advisory lock is free, and then
        // every row of that instance, whose lock the transaction holds):
        // their rows are put back, and each local queue head looks again.
        self.rejoin_soon.notify_one();
        let mut ticker = tokio::time::interval(HEARTBEAT_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = self.stop.cancelled() => break,
                payload = notifications.recv() => match payload.inspect(|_| self.wakeups.heard()) {
                    Some(payload) => match (LockKey::parse(&payload), Handed::parse(&payload)) {
                        (Some(key), _) => self.wakeups.wake(&key),
                        (None, Some(handed)) => self.deliver(handed),
                        (None, None) => tracing::debug!(payload, "ignoring a foreign notification"),
                    },
                    None => {
                        tracing::warn!("lost the LISTEN connection to PostgreSQL; reconnecting");
                        break;
                    }
                },
                _ = ticker.tick() => {
                    if !self.has_tickets() {
                        continue;
                    }
                    match crate::clock::within(OP_TIMEOUT, self.heartbeat(&client, &beat)).await {
                        Ok(Ok(_)) => self.wakeups.heard(),
                        Ok(Err(e)) => {
                            tracing::warn!(error = %chain(&e), "heartbeat failed; reconnecting");
                            break;
                        }
                        Err(_) => {
                            tracing::warn!("heartbeat timed out; reconnecting");
                            break;
                        }
                    }
                }
            }
        }
        self.listening.send_replace(false);
    }
}

/// A lease a release handed to a queued claim, as its notification
/// `g <instance> <seq> <fence> <since ms> <expires ms> <key>` says.
pub(super) struct Handed {
    instance: String,
    seq: u64,
    fence: u64,
    since_ms: i64,
    expires_ms: i64,
    key: LockKey,
}

impl Handed {
    pub(super) fn parse(payload: &str) -> Option<Self> {
        let mut fields = payload.strip_prefix("g ")?.split(' ');
        let instance = fields.next()?.to_owned();
        let mut number = || fields.next()?.parse::<i64>().ok();
        let (seq, fence, since_ms, expires_ms) = (number()?, number()?, number()?, number()?);
        Some(Self {
            instance,
            seq: u64::try_from(seq).ok()?,
            fence: u64::try_from(fence).ok()?,
            since_ms,
            expires_ms,
            key: LockKey::parse(fields.next()?)?,
        })
    }
}

impl Inner {
    /// This process's own channel, as `own_channel()` in `0004_handoff.sql` names it.
    fn own_channel(&self) -> String {
        let short: String = self.instance.chars().take(8).collect();
        format!("{}_{short}", self.channel)
    }

    /// Gives a lease handed to one of this sidecar's tickets to its waiter
    /// (the ticket is done with once it took it; one nobody waits on any
    /// more is released by its dequeue). Anyone else's tells observers.
    fn deliver(&self, h: Handed) {
        let token = (h.instance == self.instance)
            .then(|| self.tickets().live.get(&h.seq).map(|l| l.token.clone()))
            .flatten();
        let Some(token) = token else {
            self.wakeups.changed(&h.key);
            return;
        };
        // No statement of ours read the clock for this lease: its grant's
        // database time came before its notification did.
        self.cap_offset(
            i64::try_from(crate::clock::now_ms())
                .unwrap_or(i64::MAX)
                .saturating_sub(h.since_ms),
        );
        let lease = Handoff {
            token,
            fence: h.fence,
            since_ms: self.local(h.since_ms),
            expires_at_ms: self.local(h.expires_ms),
        };
        if self.wakeups.granted(&h.key, h.seq, lease) {
            self.tickets().live.remove(&h.seq);
        }
    }
}

/// Local clock minus database clock, in ms, measured so it errs towards
/// making database times look early here (never late): the best of three
/// probes, each taking the local time before the query was sent.
pub(super) async fn measure_offset(
    client: &tokio_postgres::Client,
) -> Result<i64, tokio_postgres::Error> {
    let mut best = i64::MIN;
    for _ in 0..3 {
        let before = i64::try_from(now_ms()).unwrap_or(i64::MAX);
        let db: i64 = client.query_one(NOW_SQL, &[]).await?.get(0);
        best = best.max(before - db);
    }
    Ok(best - 1)
}
