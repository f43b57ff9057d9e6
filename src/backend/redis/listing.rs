//! Listing a node's keys: the index of held and contended keys (and the
//! index older versions kept), `/v1/stale` from the scripts and from SCAN
//! for keys without expiry on every Cluster master.

use std::time::Duration;

use redis::Value;

use crate::backend::{Error, StaleKey, Summary};
use crate::clock::ms;
use crate::lock::{Kind, LockKey};

/// The age past which an election's leader would be "held too long":
/// never (ten thousand years), as a leader leads for as long as it lives.
const LEADS_FOREVER_MS: u64 = 10_000 * 365 * 24 * 3_600_000;

use super::node::{Conn, Node, Target, config, scan, unavailable};
use super::scripts::{glob_escape, int, reason_of, text};

impl Node {
    /// Keys in the index after `after`, in order, `chunk` at a time.
    pub(super) async fn indexed(
        &self,
        after: Option<&str>,
        chunk: usize,
    ) -> Result<Vec<String>, Error> {
        let index = &self.index;
        let min = after.map_or_else(|| "-".to_owned(), |a| format!("({a}"));
        self.with_conn("list", async |c| {
            redis::cmd("ZRANGEBYLEX")
                .arg(index)
                .arg(&min)
                .arg("+")
                .arg("LIMIT")
                .arg(0)
                .arg(chunk)
                .query_async::<Vec<String>>(c)
                .await
        })
        .await
    }

    pub(super) async fn unindex(&self, member: &str) {
        let index = &self.index;
        let _ = self
            .with_conn("list", async |c| {
                redis::cmd("ZREM")
                    .arg(index)
                    .arg(member)
                    .query_async::<i64>(c)
                    .await
            })
            .await;
    }

    /// Moves the entries of the index that earlier versions kept at
    /// `<prefix>index` into the index, so a rolling upgrade loses no
    /// listing: entries older sidecars add there are taken over by the next
    /// listing, and the key goes once they stop (then the lock named `index`
    /// can be used; until then it is a foreign holder). Entries that are no
    /// key are dropped, as the listing drops them from the index.
    pub(super) async fn adopt_legacy_index(&self) -> Result<(), Error> {
        let (old, new) = (&self.legacy_index, &self.index);
        self.with_conn("list", async |c| {
            let found: String = redis::cmd("TYPE").arg(old).query_async(c).await?;
            if found != "zset" {
                return Ok(());
            }
            let members: Vec<String> = redis::cmd("ZRANGE")
                .arg(old)
                .arg(0)
                .arg(-1)
                .query_async(c)
                .await?;
            let keys: Vec<&String> = members
                .iter()
                .filter(|m| LockKey::parse(m).is_some())
                .collect();
            if !keys.is_empty() {
                let mut add = redis::cmd("ZADD");
                add.arg(new).arg("NX");
                for k in &keys {
                    add.arg(0).arg(k.as_str());
                }
                add.query_async::<i64>(c).await?;
            }
            if !members.is_empty() {
                redis::cmd("ZREM")
                    .arg(old)
                    .arg(&members)
                    .query_async::<i64>(c)
                    .await?;
            }
            Ok(())
        })
        .await
    }

    /// Held or contended keys, from the index.
    pub async fn list(
        &self,
        prefix: &str,
        after: Option<&LockKey>,
        limit: usize,
    ) -> Result<Vec<Summary>, Error> {
        self.adopt_legacy_index().await?;
        let mut rows = Vec::new();
        let mut cursor = after.map(ToString::to_string);
        loop {
            let chunk = self.indexed(cursor.as_deref(), 200).await?;
            let Some(last) = chunk.last() else { break };
            cursor = Some(last.clone());
            for member in &chunk {
                let Some(key) = LockKey::parse(member) else {
                    self.unindex(member).await;
                    continue;
                };
                if !key.name.as_str().starts_with(prefix) {
                    continue;
                }
                let state = match self.inspect(&key).await {
                    // Unreadable until an operator removes the key; `/v1/stale` names it.
                    Err(Error::KeyConflict { .. }) => continue,
                    other => other?,
                };
                if state.holders.is_empty() && state.waiters.is_empty() {
                    self.unindex(member).await;
                    continue;
                }
                rows.push(Summary {
                    key,
                    holders: state.holders.len(),
                    waiters: state.waiters.len(),
                    fence: state.fence,
                });
                if rows.len() >= limit {
                    return Ok(rows);
                }
            }
        }
        Ok(rows)
    }

    /// Stale entries of the keys in use (holders too old, expired but not
    /// cleaned, orphaned waiters), plus keys without expiry among lock keys
    /// and keys matching `legacy`.
    pub async fn stale(
        &self,
        stale_after: Duration,
        legacy: Option<&str>,
    ) -> Result<Vec<StaleKey>, Error> {
        self.adopt_legacy_index().await?;
        let mut out = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let chunk = self.indexed(cursor.as_deref(), 200).await?;
            let Some(last) = chunk.last() else { break };
            cursor = Some(last.clone());
            for member in &chunk {
                let Some(key) = LockKey::parse(member) else {
                    continue;
                };
                let mut inv = self.invocation(&self.scripts.stale, &key);
                // A leader leads for as long as its campaign lives.
                inv.arg(if key.kind == Kind::Election {
                    LEADS_FOREVER_MS
                } else {
                    ms(stale_after)
                });
                let found: Vec<Vec<Value>> = self.run("stale", inv).await?;
                for entry in found {
                    out.push(StaleKey {
                        key: text(&entry, 0),
                        reason: reason_of(&text(&entry, 1)),
                        age_ms: int(&entry, 2).max(0) as u64,
                        detail: text(&entry, 3),
                    });
                }
            }
        }
        {
            let mut patterns = vec![format!("{}*", glob_escape(&self.prefix))];
            patterns.extend(legacy.map(str::to_owned));
            for pattern in patterns {
                for k in self.scan_without_expiry(&pattern).await? {
                    let legacy_key = !k.starts_with(&self.prefix);
                    out.push(StaleKey {
                        detail: if legacy_key {
                            format!("key {k:?} matches --legacy-pattern and has no expiry: a lock left by hand-written SETNX code blocks forever")
                        } else {
                            format!("lock key {k:?} has no expiry: whoever set it never set PX, so it will never be freed")
                        },
                        key: k,
                        reason: crate::backend::StaleReason::NoExpiry,
                        age_ms: 0,
                    });
                }
            }
        }
        Ok(out)
    }

    /// Connections that together see every key: the server, or each Cluster
    /// master (from `CLUSTER NODES`), for SCAN.
    pub(super) async fn scan_connections(&self) -> Result<Vec<Conn>, Error> {
        let Target::Cluster { seeds, .. } = &self.target else {
            return self.with_conn("stale", async |c| Ok(vec![c.clone()])).await;
        };
        let nodes: String = self
            .with_conn("stale", async |c| {
                redis::cmd("CLUSTER").arg("NODES").query_async(c).await
            })
            .await?;
        let tls = seeds.first().is_some_and(|s| {
            matches!(
                s.get_connection_info().addr(),
                redis::ConnectionAddr::TcpTls { .. }
            )
        });
        let mut conns = Vec::new();
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(addr), Some(flags)) = (fields.get(1), fields.get(2)) else {
                continue;
            };
            if !flags.split(',').any(|f| f == "master") || flags.contains("fail") {
                continue;
            }
            let host_port = addr.split('@').next().unwrap_or(addr);
            let url = format!("{}://{host_port}", if tls { "rediss" } else { "redis" });
            let conn = async {
                redis::Client::open(url.as_str())?
                    .get_multiplexed_async_connection_with_config(&config())
                    .await
            }
            .await
            .map_err(|e| unavailable("stale", e))?;
            conns.push(Conn::Plain(conn));
        }
        Ok(conns)
    }

    pub(super) async fn scan_without_expiry(&self, pattern: &str) -> Result<Vec<String>, Error> {
        let mut found = Vec::new();
        for mut c in self.scan_connections().await? {
            found.extend(
                scan(&mut c, pattern)
                    .await
                    .map_err(|e| unavailable("stale", e))?,
            );
        }
        Ok(found)
    }
}
