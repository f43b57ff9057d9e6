//! What the backend has executed, read before and after a measurement.
//!
//! * Redis: `INFO commandstats`. It counts the commands run inside Lua
//!   scripts too, so two figures are kept: `commands` (everything) and
//!   `round_trips` (script calls — `EVAL*`, `FCALL*` — plus the commands a
//!   script cannot run: pub/sub, `SCRIPT`, `CLIENT`, `HELLO`, `PING`, …).
//!   The bench's own `INFO` calls are left out.
//!   Redlock: the same, summed over its nodes.
//! * ZooKeeper: requests received (`zk_packets_received` of `mntr`, summed
//!   over the ensemble's members; session pings included — a client pings
//!   every third of its session timeout when idle). Needs `mntr` in the
//!   server's `4lw.commands.whitelist`.
//! * PostgreSQL: transactions (`xact_commit + xact_rollback` of the database
//!   in `pg_stat_database`); each statement outside a transaction block is
//!   one. PostgreSQL flushes these counters about once a second, so short
//!   windows are approximate.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use sidelock_test_support::redis::parse_commandstats;

/// Operations executed by the backend since some origin.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Ops {
    pub round_trips: u64,
    pub commands: u64,
}

impl Ops {
    #[must_use]
    pub fn since(self, before: Ops) -> Ops {
        Ops {
            round_trips: self.round_trips.saturating_sub(before.round_trips),
            commands: self.commands.saturating_sub(before.commands),
        }
    }
}

/// A connection that reads the backend's counters.
pub enum Counter {
    /// One connection per Redis node (one for Redis, one per Redlock node).
    Redis(Vec<redis::aio::MultiplexedConnection>),
    Postgres(tokio_postgres::Client),
    /// The ensemble's members, `host:port`; `mntr` opens a connection each time.
    ZooKeeper(Vec<String>),
}

/// The server processes of the connections to the counter's database
/// other than its own, when the server runs on this machine.
async fn postgres_pids(client: &tokio_postgres::Client) -> Vec<(&'static str, u32)> {
    let Ok(rows) = client
        .query(
            "SELECT pid FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .await
    else {
        return Vec::new();
    };
    rows.iter()
        .filter_map(|r| u32::try_from(r.get::<_, i32>(0)).ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.starts_with("postgres"))
        })
        .map(|pid| ("postgres", pid))
        .collect()
}

/// Commands a client sends itself (never run inside a script).
fn top_level(name: &str) -> bool {
    let base = name.split('|').next().unwrap_or(name);
    base.starts_with("eval")
        || base.starts_with("fcall")
        || matches!(
            base,
            "subscribe"
                | "unsubscribe"
                | "psubscribe"
                | "punsubscribe"
                | "ssubscribe"
                | "sunsubscribe"
                | "script"
                | "client"
                | "hello"
                | "ping"
                | "select"
                | "auth"
                | "cluster"
                | "scan"
                | "multi"
                | "exec"
        )
}

/// `mntr`'s `zk_packets_received` of one member.
async fn zk_packets_received(host: &str) -> Option<u64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io = async {
        let mut s = tokio::net::TcpStream::connect(host).await.ok()?;
        s.write_all(b"mntr").await.ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        Some(out)
    };
    let out = tokio::time::timeout(std::time::Duration::from_secs(5), io)
        .await
        .ok()??;
    parse_mntr(&out, "zk_packets_received")
}

/// One numeric line of ZooKeeper's `mntr` output (`key<TAB>value`).
#[must_use]
pub fn parse_mntr(out: &str, key: &str) -> Option<u64> {
    out.lines().find_map(|l| {
        let (k, v) = l.split_once('\t')?;
        (k.trim() == key).then(|| v.trim().parse().ok())?
    })
}

impl Counter {
    /// The counter for a backend URL: `redis://`, `rediss://`, `redlock://`,
    /// `redlocks://`, `zk://` or `postgres://`; `None` for other schemes.
    ///
    /// # Errors
    /// When the backend cannot be reached.
    pub async fn open(url: &str) -> Result<Option<Self>, String> {
        let Some((scheme, _)) = url.split_once("://") else {
            return Ok(None);
        };
        match scheme {
            "redis" | "rediss" => Self::redis(&[url.to_owned()]).await.map(Some),
            "redlock" | "redlocks" => {
                let (_, hosts, path) = crate::urls::split_hosts(url)?;
                let base = if scheme == "redlocks" {
                    "rediss"
                } else {
                    "redis"
                };
                let urls: Vec<String> = hosts
                    .iter()
                    .map(|h| format!("{base}://{h}/{path}"))
                    .collect();
                Self::redis(&urls).await.map(Some)
            }
            "zk" => {
                let (_, hosts, _) = crate::urls::split_hosts(url)?;
                for h in &hosts {
                    if zk_packets_received(h).await.is_none() {
                        return Err(format!(
                            "ZooKeeper at {h} does not answer `mntr` (is it in 4lw.commands.whitelist?)"
                        ));
                    }
                }
                Ok(Some(Self::ZooKeeper(hosts)))
            }
            "postgres" | "postgresql" => Self::postgres(url).await.map(Some),
            _ => Ok(None),
        }
    }

    /// Connects to every Redis URL (`redis://…`); the counts are summed.
    ///
    /// # Errors
    /// When a node cannot be reached.
    pub async fn redis(urls: &[String]) -> Result<Self, String> {
        let mut conns = Vec::new();
        for url in urls {
            let client = redis::Client::open(url.as_str())
                .map_err(|e| format!("bad Redis URL {url}: {e}"))?;
            let c = client
                .get_multiplexed_async_connection()
                .await
                .map_err(|e| format!("cannot connect to Redis at {url}: {e}"))?;
            conns.push(c);
        }
        Ok(Self::Redis(conns))
    }

    /// Connects to a PostgreSQL URL.
    ///
    /// # Errors
    /// When PostgreSQL cannot be reached.
    pub async fn postgres(url: &str) -> Result<Self, String> {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .map_err(|e| format!("cannot connect to PostgreSQL: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Self::Postgres(client))
    }

    /// The counters now; `None` when they cannot be read.
    pub async fn read(&mut self) -> Option<Ops> {
        match self {
            Self::Redis(conns) => {
                let mut ops = Ops::default();
                for c in conns {
                    let info: String = redis::cmd("INFO")
                        .arg("commandstats")
                        .query_async(c)
                        .await
                        .ok()?;
                    let stats = parse_commandstats(&info);
                    ops.round_trips += stats
                        .iter()
                        .filter(|(n, _)| top_level(n))
                        .map(|(_, c)| c)
                        .sum::<u64>();
                    ops.commands += stats.values().sum::<u64>();
                }
                Some(ops)
            }
            Self::ZooKeeper(hosts) => {
                let mut n = 0;
                for h in hosts {
                    n += zk_packets_received(h).await?;
                }
                Some(Ops {
                    round_trips: n,
                    commands: n,
                })
            }
            Self::Postgres(c) => {
                let row = c
                    .query_one(
                        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database \
                         WHERE datname = current_database()",
                        &[],
                    )
                    .await
                    .ok()?;
                let n = u64::try_from(row.get::<_, i64>(0)).ok()?;
                Some(Ops {
                    round_trips: n,
                    commands: n,
                })
            }
        }
    }

    /// The backend's server processes that run on this machine, for CPU
    /// readings: Redis nodes whose `INFO server` `process_id` is a local
    /// `redis-server`. Other backends: none.
    pub async fn local_pids(&mut self) -> Vec<(&'static str, u32)> {
        if let Self::Postgres(client) = self {
            return postgres_pids(client).await;
        }
        let Self::Redis(conns) = self else {
            return Vec::new();
        };
        let mut pids = Vec::new();
        for c in conns {
            let Ok(info) = redis::cmd("INFO")
                .arg("server")
                .query_async::<String>(c)
                .await
            else {
                continue;
            };
            let pid = info
                .lines()
                .find_map(|l| l.strip_prefix("process_id:"))
                .and_then(|v| v.trim().parse::<u32>().ok());
            // A remote server's PID may be some other local process.
            if let Some(pid) = pid
                && std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|comm| comm.starts_with("redis"))
            {
                pids.push(("redis", pid));
            }
        }
        pids
    }

    /// Whether this counts a PostgreSQL database (whose server processes
    /// are one per connection, so they are known only once connected).
    #[must_use]
    pub fn is_postgres(&self) -> bool {
        matches!(self, Self::Postgres(_))
    }

    /// What the backend did while `f` ran. With `client_round_trips` (the
    /// baselines count what they send), round trips are taken from there.
    pub async fn around<T>(
        c: &mut Option<Self>,
        client_round_trips: Option<&AtomicU64>,
        f: impl Future<Output = T>,
    ) -> (T, Option<Ops>) {
        let before = match c {
            Some(c) => c.read().await,
            None => None,
        };
        let sent = client_round_trips.map(|n| n.load(Ordering::Relaxed));
        let out = f.await;
        let after = match c {
            Some(c) => c.read().await,
            None => None,
        };
        let mut ops = before.zip(after).map(|(b, a)| a.since(b));
        if let (Some(o), Some(n), Some(s)) = (ops.as_mut(), client_round_trips, sent) {
            o.round_trips = n.load(Ordering::Relaxed) - s;
        }
        (out, ops)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_split_round_trips_from_script_commands() {
        let info = "# Commandstats\r\ncmdstat_evalsha:calls=10,usec=1\r\ncmdstat_set:calls=20,usec=1\r\n\
                    cmdstat_info:calls=5,usec=1\r\ncmdstat_script|load:calls=1,usec=1\r\n";
        let stats = parse_commandstats(info);
        assert_eq!(stats.get("info"), None);
        assert_eq!(stats["evalsha"], 10);
        let rt: u64 = stats
            .iter()
            .filter(|(n, _)| top_level(n))
            .map(|(_, c)| c)
            .sum();
        assert_eq!(rt, 11);
    }

    #[test]
    fn mntr_lines_are_read_by_key() {
        let out = "zk_version\t3.8.0\nzk_packets_received\t1234\nzk_packets_sent\t99\n";
        assert_eq!(parse_mntr(out, "zk_packets_received"), Some(1234));
        assert_eq!(parse_mntr(out, "zk_packets_sent"), Some(99));
        assert_eq!(parse_mntr(out, "zk_version"), None);
        assert_eq!(parse_mntr(out, "zk_missing"), None);
    }
}
