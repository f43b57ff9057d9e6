//! Listing a node's keys in use — found by SCAN on every server (every
//! Cluster master), kept a moment for the listings that follow — and
//! `/v1/stale` from the scripts and from SCAN for keys without expiry.

use std::time::{Duration, Instant};

use redis::Value;

use crate::backend::{Cause, Error, MOST_STALE, Outage, StaleKey, Summary};
use crate::clock::ms;
use crate::lock::{Kind, LockKey};

/// The age past which an election's leader would be "held too long":
/// never (ten thousand years), as a leader leads for as long as it lives.
const LEADS_FOREVER_MS: u64 = 10_000 * 365 * 24 * 3_600_000;

/// How long one scan's keys serve the pages after a listing's first: a
/// listing paged through reads the keyspace once, not once a page. A first
/// page is answered from a scan that started after it was asked, so it
/// shows every key in use at the time; one scan runs at a time, and the
/// first pages asked while it runs share the next.
const LISTED_FOR: Duration = Duration::from_secs(2);

use super::conn::{Conn, Target, config, scan, unavailable};
use super::lock;
use super::node::{Listed, Node};
use super::scripts::{glob_escape, int, reason_of, text};

impl Node {
    /// The lock a key of this prefix belongs to: a main key
    /// `<prefix>[semaphores/|elections/]<name>`, or a side key that only a
    /// lock in use has (`{<main key>}:q`, `:holders`, `:expiry`).
    pub(super) fn lock_of(&self, key: &str) -> Option<LockKey> {
        let main = match key.strip_prefix('{') {
            Some(side) => {
                let (main, suffix) = side.rsplit_once("}:")?;
                if !matches!(suffix, "q" | "holders" | "expiry") {
                    return None;
                }
                main
            }
            None => key,
        };
        let path = main.strip_prefix(self.prefix.as_str())?;
        if path.starts_with("semaphores/") || path.starts_with("elections/") {
            LockKey::parse(path)
        } else {
            LockKey::parse(&format!("locks/{path}"))
        }
    }

    /// Every lock, semaphore and election with a key in use, sorted by
    /// their `Display` form (listings' cursors): when `fresh`, from a scan
    /// that started after this call; else from one at most [`LISTED_FOR`]
    /// old.
    pub(super) async fn keys_in_use(&self, fresh: bool) -> Result<Vec<LockKey>, Error> {
        let asked = Instant::now();
        let reusable = |listed: &Listed| {
            if fresh {
                listed.started >= asked
            } else {
                listed.at.elapsed() < LISTED_FOR
            }
        };
        if let Some(listed) = lock(&self.listed).as_ref().filter(|l| reusable(l)) {
            return Ok(listed.keys.clone());
        }
        let _scanning = self.scanning.lock().await;
        // The scan this call waited for may have started after it came:
        // its keys are the answer. And a scan that failed while it waited
        // is its answer too (each waiter trying its own in turn, the last
        // waited for all the others').
        if let Some(listed) = lock(&self.listed).as_ref().filter(|l| reusable(l)) {
            return Ok(listed.keys.clone());
        }
        if let Some((_, cause)) = lock(&self.scan_failed).filter(|(at, _)| *at >= asked) {
            return Err(Error::Unavailable {
                op: "list",
                source: Outage::boxed(cause, "the keyspace scan this listing waited for failed"),
            });
        }
        let started = Instant::now();
        let scanned = self.scan_keys().await;
        match &scanned {
            Ok(keys) => {
                *lock(&self.listed) = Some(Listed {
                    started,
                    at: Instant::now(),
                    keys: keys.clone(),
                });
            }
            Err(e) => {
                *lock(&self.scan_failed) =
                    Some((Instant::now(), e.cause().unwrap_or(Cause::Failed)));
            }
        }
        scanned
    }

    /// Every key in use, from a scan now (see [`Node::keys_in_use`]).
    async fn scan_keys(&self) -> Result<Vec<LockKey>, Error> {
        self.drop_old_indexes().await?;
        let prefix = glob_escape(&self.prefix);
        let mut keys = Vec::new();
        for mut c in self.scan_connections("list").await? {
            for pattern in [format!("{prefix}*"), format!("{{{prefix}*}}:*")] {
                let mut cursor: u64 = 0;
                loop {
                    // Bytes: a key that is not UTF-8 is nobody's lock,
                    // and must not fail the listing.
                    let (next, found): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(1000)
                        .query_async(&mut c)
                        .await
                        .map_err(|e| unavailable("list", e))?;
                    keys.extend(
                        found
                            .iter()
                            .filter_map(|k| std::str::from_utf8(k).ok())
                            .filter_map(|k| self.lock_of(k)),
                    );
                    if next == 0 {
                        break;
                    }
                    cursor = next;
                }
            }
        }
        keys.sort_by_cached_key(ToString::to_string);
        keys.dedup();
        Ok(keys)
    }

    /// Deletes the indexes of keys in use that older versions kept: at
    /// `<prefix>index` (the main key of the lock named `index`, which they
    /// made a foreign holder of it) and at `<prefix>/index`. Listings scan
    /// for the keys now; a sorted set there whose members are lock keys is
    /// such an index.
    async fn drop_old_indexes(&self) -> Result<(), Error> {
        for index in [
            format!("{}index", self.prefix),
            format!("{}/index", self.prefix),
        ] {
            self.with_conn("list", async |c| {
                let found: String = redis::cmd("TYPE").arg(&index).query_async(c).await?;
                if found != "zset" {
                    return Ok(());
                }
                let members: Vec<String> = redis::cmd("ZRANGE")
                    .arg(&index)
                    .arg(0)
                    .arg(9)
                    .query_async(c)
                    .await?;
                if members.iter().all(|m| LockKey::parse(m).is_some()) {
                    redis::cmd("DEL").arg(&index).query_async::<i64>(c).await?;
                }
                Ok(())
            })
            .await?;
        }
        Ok(())
    }

    /// Held or contended keys whose name starts with `prefix`, after `after`.
    pub async fn list(
        &self,
        prefix: &str,
        after: Option<&LockKey>,
        limit: usize,
    ) -> Result<Vec<Summary>, Error> {
        let keys = self.keys_in_use(after.is_none()).await?;
        let after = after.map(ToString::to_string);
        let mut rows = Vec::new();
        for key in keys {
            if !key.name.as_str().starts_with(prefix)
                || after.as_ref().is_some_and(|a| key.to_string() <= *a)
            {
                continue;
            }
            let state = match self.inspect(&key).await {
                // Unreadable until an operator removes the key; `/v1/stale` names it.
                Err(Error::KeyConflict { .. }) => continue,
                other => other?,
            };
            if state.holders.is_empty() && state.waiters.is_empty() {
                continue;
            }
            rows.push(Summary {
                key,
                holders: state.holders.len(),
                waiters: state.waiters.len(),
                fence: state.fence,
            });
            if rows.len() >= limit {
                break;
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
        // One more than are shown tells that there are more.
        let most = MOST_STALE + 1;
        let mut out = Vec::new();
        for key in self.keys_in_use(true).await? {
            if out.len() >= most {
                break;
            }
            let mut inv = self.invocation(&self.scripts.stale, &key);
            // A leader leads for as long as its campaign lives.
            inv.arg(if key.kind == Kind::Election {
                LEADS_FOREVER_MS
            } else {
                ms(stale_after)
            })
            .arg(key.to_string());
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
        {
            let mut patterns = vec![format!("{}*", glob_escape(&self.prefix))];
            patterns.extend(legacy.map(str::to_owned));
            for pattern in patterns {
                let left = most.saturating_sub(out.len());
                if left == 0 {
                    break;
                }
                for raw in self.scan_without_expiry(&pattern, left).await? {
                    let legacy_key = !raw.starts_with(self.prefix.as_bytes());
                    let k = shown_key(&raw);
                    out.push(StaleKey {
                        detail: if legacy_key {
                            format!("key \"{k}\" matches --legacy-pattern and has no expiry: a lock left by hand-written SETNX code blocks forever")
                        } else {
                            format!("lock key \"{k}\" has no expiry: whoever set it never set PX, so it will never be freed")
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
    pub(super) async fn scan_connections(&self, op: &'static str) -> Result<Vec<Conn>, Error> {
        let Target::Cluster { seeds, .. } = &self.target else {
            return self.with_conn(op, async |c| Ok(vec![c.clone()])).await;
        };
        let nodes: String = self
            .with_conn(op, async |c| {
                redis::cmd("CLUSTER").arg("NODES").query_async(c).await
            })
            .await?;
        // Each master as the seed is reached: its credentials, database
        // and TLS settings, at the master's address.
        let Some(seed) = seeds.first().map(redis::Client::get_connection_info) else {
            return Ok(Vec::new());
        };
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
            let Some((host, port)) = host_port
                .rsplit_once(':')
                .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
            else {
                continue;
            };
            let at = match seed.addr() {
                redis::ConnectionAddr::TcpTls {
                    insecure,
                    tls_params,
                    ..
                } => redis::ConnectionAddr::TcpTls {
                    host,
                    port,
                    insecure: *insecure,
                    tls_params: tls_params.clone(),
                },
                _ => redis::ConnectionAddr::Tcp(host, port),
            };
            let info = seed.clone().set_addr(at);
            let conn = async {
                redis::Client::open(info)?
                    .get_multiplexed_async_connection_with_config(&config())
                    .await
            }
            .await
            .map_err(|e| unavailable(op, e))?;
            conns.push(Conn::Plain(conn));
        }
        Ok(conns)
    }

    /// String keys matching `pattern` without expiry, on every server that
    /// holds keys; at most `most` (or a few more).
    pub(super) async fn scan_without_expiry(
        &self,
        pattern: &str,
        most: usize,
    ) -> Result<Vec<Vec<u8>>, Error> {
        let mut found = Vec::new();
        for mut c in self.scan_connections("stale").await? {
            if found.len() >= most {
                break;
            }
            found.extend(
                scan(&mut c, pattern, most - found.len())
                    .await
                    .map_err(|e| unavailable("stale", e))?,
            );
        }
        Ok(found)
    }
}

/// A key as an operator may read it, and paste between double quotes
/// into `redis-cli`: bytes that are not UTF-8 and the bytes of characters
/// that can make it look like another key ([`crate::lock::misleads`]:
/// controls, bidi overrides, invisible letters) as `\xNN`, backslashes and
/// double quotes escaped.
fn shown_key(raw: &[u8]) -> String {
    let mut shown = String::with_capacity(raw.len());
    let hex = |bytes: &[u8], shown: &mut String| {
        for b in bytes {
            shown.push_str(&format!("\\x{b:02x}"));
        }
    };
    for chunk in raw.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => shown.push_str("\\\\"),
                '"' => shown.push_str("\\\""),
                c if crate::lock::misleads(c) => {
                    hex(c.encode_utf8(&mut [0; 4]).as_bytes(), &mut shown)
                }
                c => shown.push(c),
            }
        }
        hex(chunk.invalid(), &mut shown);
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::shown_key;

    #[test]
    fn keys_are_shown_escaped_where_they_would_not_read_as_themselves() {
        assert_eq!(shown_key(b"lock:plain-1.2"), "lock:plain-1.2");
        assert_eq!(shown_key(b"lock:\xff\xfe"), "lock:\\xff\\xfe");
        assert_eq!(
            shown_key("lock:\u{202e}gnp.exe".as_bytes()),
            "lock:\\xe2\\x80\\xaegnp.exe"
        );
        assert_eq!(
            shown_key("lock:a\u{3164}".as_bytes()),
            "lock:a\\xe3\\x85\\xa4"
        );
        assert_eq!(shown_key(b"a\\b \"c\" \n"), "a\\\\b \\\"c\\\" \\x0a");
        assert_eq!(shown_key("équipe".as_bytes()), "équipe");
    }
}
