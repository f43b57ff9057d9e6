//! The lock clients the workloads drive: sidelock over HTTP, or Redis
//! directly (the baselines: one `SET NX PX` per try, owner-checked release in
//! Lua, and, for the polling client, a fixed sleep between tries).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Lease asked for by every client.
pub const TTL_MS: u64 = 30_000;

/// Owner-checked release, the usual compare-and-delete.
pub const RELEASE_LUA: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

/// An HTTP client with one keep-alive connection per host.
#[must_use]
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .tcp_nodelay(true)
        .build()
        .unwrap_or_default()
}

/// Why an acquire did not grant.
#[derive(Debug)]
pub enum Refused {
    Busy,
    Failed(String),
}

#[derive(Deserialize)]
struct GrantBody {
    token: String,
}

/// One client of a lock service.
#[derive(Clone)]
pub enum Locker {
    Sidecar {
        client: reqwest::Client,
        base: String,
        api_token: Option<String>,
    },
    Redis {
        conn: redis::aio::MultiplexedConnection,
        /// Sleep between tries; `None` tries once.
        poll: Option<Duration>,
        script: Arc<redis::Script>,
        round_trips: Arc<AtomicU64>,
    },
}

impl Locker {
    /// A sidecar client with its own connection.
    #[must_use]
    pub fn sidecar(base: &str, api_token: Option<&str>) -> Self {
        Self::Sidecar {
            client: http_client(),
            base: base.trim_end_matches('/').to_owned(),
            api_token: api_token.map(str::to_owned),
        }
    }

    /// A direct Redis client on its own multiplexed connection.
    ///
    /// # Errors
    /// When Redis cannot be reached.
    pub async fn redis(
        url: &str,
        poll: Option<Duration>,
        round_trips: Arc<AtomicU64>,
    ) -> Result<Self, String> {
        let client = redis::Client::open(url).map_err(|e| format!("bad Redis URL: {e}"))?;
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| format!("cannot connect to Redis at {url}: {e}"))?;
        Ok(Self::Redis {
            conn,
            poll,
            script: Arc::new(redis::Script::new(RELEASE_LUA)),
            round_trips,
        })
    }

    /// The polling client's sleep between tries.
    #[must_use]
    pub fn poll_interval(&self) -> Option<Duration> {
        match self {
            Self::Redis { poll, .. } => *poll,
            Self::Sidecar { .. } => None,
        }
    }

    /// Acquires `name`, waiting up to `wait` (sidelock queues; the polling
    /// client retries after its sleep). Returns the token.
    pub async fn acquire(&mut self, name: &str, wait: Duration) -> Result<String, Refused> {
        match self {
            Self::Sidecar {
                client,
                base,
                api_token,
            } => {
                let url = format!(
                    "{base}/v1/locks/{name}?ttl={TTL_MS}&wait={}",
                    wait.as_millis()
                );
                let mut req = client.post(url);
                if let Some(t) = api_token {
                    req = req.bearer_auth(t);
                }
                let resp = req
                    .send()
                    .await
                    .map_err(|e| Refused::Failed(e.to_string()))?;
                match resp.status().as_u16() {
                    200 => resp
                        .json::<GrantBody>()
                        .await
                        .map(|g| g.token)
                        .map_err(|e| Refused::Failed(e.to_string())),
                    409 => {
                        let _ = resp.bytes().await;
                        Err(Refused::Busy)
                    }
                    s => Err(Refused::Failed(format!(
                        "acquire answered {s}: {}",
                        resp.text().await.unwrap_or_default()
                    ))),
                }
            }
            Self::Redis {
                conn,
                poll,
                round_trips,
                ..
            } => {
                let token = format!("{:032x}", rand::random::<u128>());
                let key = format!("bench:{name}");
                let deadline = Instant::now() + wait;
                loop {
                    let ok: Option<String> = redis::cmd("SET")
                        .arg(&key)
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(TTL_MS)
                        .query_async(conn)
                        .await
                        .map_err(|e| Refused::Failed(e.to_string()))?;
                    round_trips.fetch_add(1, Ordering::Relaxed);
                    if ok.is_some() {
                        return Ok(token);
                    }
                    match poll {
                        Some(p) if Instant::now() < deadline => tokio::time::sleep(*p).await,
                        _ => return Err(Refused::Busy),
                    }
                }
            }
        }
    }

    /// Releases `name` held with `token`.
    pub async fn release(&mut self, name: &str, token: &str) -> Result<(), String> {
        match self {
            Self::Sidecar {
                client,
                base,
                api_token,
            } => {
                let mut req = client.delete(format!("{base}/v1/locks/{name}?token={token}"));
                if let Some(t) = api_token {
                    req = req.bearer_auth(t);
                }
                let resp = req.send().await.map_err(|e| e.to_string())?;
                let status = resp.status();
                let _ = resp.bytes().await;
                if status.is_success() {
                    Ok(())
                } else {
                    Err(format!("release answered {status}"))
                }
            }
            Self::Redis {
                conn,
                script,
                round_trips,
                ..
            } => {
                let n: i64 = script
                    .key(format!("bench:{name}"))
                    .arg(token)
                    .invoke_async(conn)
                    .await
                    .map_err(|e| e.to_string())?;
                round_trips.fetch_add(1, Ordering::Relaxed);
                if n == 1 {
                    Ok(())
                } else {
                    Err("release found another token".into())
                }
            }
        }
    }
}

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Latency {
    pub count: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
    pub mean_us: f64,
}

/// A histogram of microseconds from 1 µs to 10 minutes, 3 significant digits.
#[must_use]
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).unwrap_or_else(|_| Histogram::new(3).unwrap())
}

/// Records `d` in microseconds (saturating at the histogram's bounds).
pub fn record(h: &mut Histogram<u64>, d: Duration) {
    let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1);
    h.saturating_record(us);
}

/// The percentiles of `h`.
#[must_use]
pub fn latency(h: &Histogram<u64>) -> Latency {
    if h.is_empty() {
        return Latency::default();
    }
    Latency {
        count: h.len(),
        p50_us: h.value_at_quantile(0.50),
        p99_us: h.value_at_quantile(0.99),
        p999_us: h.value_at_quantile(0.999),
        max_us: h.max(),
        mean_us: (h.mean() * 10.0).round() / 10.0,
    }
}
