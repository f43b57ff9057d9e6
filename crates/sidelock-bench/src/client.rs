//! The lock clients the workloads drive: sidelock over HTTP, or Redis
//! directly (the baselines: one `SET NX PX` per try, owner-checked release in
//! Lua, and, for the polling client, a fixed sleep between tries), or
//! PostgreSQL directly (the plain recipe: a session advisory lock on its own
//! connection, `pg_advisory_lock` waiting in the server, `pg_advisory_unlock`).

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

/// One keep-alive HTTP/1.1 connection to a sidecar, opened on first use and
/// again after an error: hyper's own client connection, the HTTP
/// counterpart of the direct baseline's one multiplexed Redis connection, so
/// the bench's client costs little next to the sidecar it measures (a pooled
/// client such as reqwest spends more CPU per request than the sidecar's
/// memory backend).
pub struct Connection {
    /// `host:port` of the sidecar, or why its URL cannot be used.
    authority: Result<String, String>,
    /// The Unix socket to connect to instead (a `unix:/path` base).
    socket: Option<std::path::PathBuf>,
    /// The URL's path, put before every request's path.
    prefix: String,
    /// `Authorization` header value, when the API needs a token.
    auth: Option<http::HeaderValue>,
    /// The open connection's request handle; `None` until used or after an error.
    sender: Option<Sender>,
}

/// The request handle of an open connection.
type Sender = hyper::client::conn::http1::SendRequest<http_body_util::Empty<bytes::Bytes>>;

impl Clone for Connection {
    /// A clone opens a connection of its own.
    fn clone(&self) -> Self {
        Self {
            authority: self.authority.clone(),
            socket: self.socket.clone(),
            prefix: self.prefix.clone(),
            auth: self.auth.clone(),
            sender: None,
        }
    }
}

/// A response's status and body.
pub struct Response {
    pub status: u16,
    pub body: bytes::Bytes,
}

impl Connection {
    /// A connection to the sidecar at `base` (`http://host[:port][/path]`,
    /// or `unix:/path/to.sock`). A URL it cannot use makes every request
    /// fail, saying why.
    #[must_use]
    pub fn new(base: &str, api_token: Option<&str>) -> Self {
        let auth = api_token.and_then(|t| http::HeaderValue::try_from(format!("Bearer {t}")).ok());
        if let Some(path) = base.strip_prefix("unix:") {
            return Self {
                authority: Ok("localhost".into()),
                socket: Some(path.into()),
                prefix: String::new(),
                auth,
                sender: None,
            };
        }
        let uri = base.parse::<http::Uri>();
        let authority = match &uri {
            Ok(u) if u.scheme_str() == Some("http") => match u.authority() {
                Some(a) => Ok(format!("{}:{}", a.host(), a.port_u16().unwrap_or(80))),
                None => Err(format!("{base}: no host")),
            },
            Ok(_) => Err(format!("{base}: the bench speaks plain http:// only")),
            Err(e) => Err(format!("{base}: {e}")),
        };
        let prefix = uri
            .map(|u| u.path().trim_end_matches('/').to_owned())
            .unwrap_or_default();
        Self {
            authority,
            socket: None,
            prefix,
            auth,
            sender: None,
        }
    }

    async fn open(&self) -> Result<Sender, String> {
        if let Some(path) = &self.socket {
            let stream = tokio::net::UnixStream::connect(path)
                .await
                .map_err(|e| format!("cannot connect to {}: {e}", path.display()))?;
            let (sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            return Ok(sender);
        }
        let authority = self.authority.as_deref().map_err(Clone::clone)?;
        let stream = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| format!("cannot connect to {authority}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        Ok(sender)
    }

    /// Sends `method path_and_query` and reads the whole response.
    ///
    /// # Errors
    /// When the sidecar cannot be reached or the connection fails.
    pub async fn send(&mut self, method: http::Method, path: &str) -> Result<Response, String> {
        use http_body_util::BodyExt as _;
        let mut sender = match self.sender.take() {
            Some(s) if !s.is_closed() => s,
            _ => self.open().await?,
        };
        let authority = self.authority.as_deref().map_err(Clone::clone)?;
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.prefix))
            .header(http::header::HOST, authority);
        if let Some(auth) = &self.auth {
            req = req.header(http::header::AUTHORIZATION, auth.clone());
        }
        let req = req
            .body(http_body_util::Empty::new())
            .map_err(|e| e.to_string())?;
        sender.ready().await.map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        self.sender = Some(sender);
        Ok(Response { status, body })
    }
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
        conn: Connection,
    },
    Redis {
        conn: redis::aio::MultiplexedConnection,
        /// Sleep between tries; `None` tries once.
        poll: Option<Duration>,
        script: Arc<redis::Script>,
        round_trips: Arc<AtomicU64>,
    },
    Postgres {
        /// Its own session: advisory locks belong to the session.
        client: Arc<tokio_postgres::Client>,
        /// `pg_try_advisory_lock`, `pg_advisory_lock`, `pg_advisory_unlock`.
        statements: Arc<[tokio_postgres::Statement; 3]>,
        round_trips: Arc<AtomicU64>,
    },
}

/// The advisory-lock key of a lock name (64 bits of its hash).
const PG_KEY: &str = "hashtextextended('bench:' || $1, 0)";

impl Locker {
    /// A sidecar client with its own connection.
    #[must_use]
    pub fn sidecar(base: &str, api_token: Option<&str>) -> Self {
        Self::Sidecar {
            conn: Connection::new(base, api_token),
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

    /// A direct PostgreSQL client on a session of its own.
    ///
    /// # Errors
    /// When PostgreSQL cannot be reached.
    pub async fn postgres(url: &str, round_trips: Arc<AtomicU64>) -> Result<Self, String> {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .map_err(|e| format!("cannot connect to PostgreSQL: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut prepared = Vec::new();
        for f in [
            "pg_try_advisory_lock",
            "pg_advisory_lock",
            "pg_advisory_unlock",
        ] {
            let sql = format!("SELECT {f}({PG_KEY})::text");
            prepared.push(client.prepare(&sql).await.map_err(|e| e.to_string())?);
        }
        let statements: [tokio_postgres::Statement; 3] = prepared
            .try_into()
            .map_err(|_| "three statements".to_owned())?;
        Ok(Self::Postgres {
            client: Arc::new(client),
            statements: Arc::new(statements),
            round_trips,
        })
    }

    /// The polling client's sleep between tries.
    #[must_use]
    pub fn poll_interval(&self) -> Option<Duration> {
        match self {
            Self::Redis { poll, .. } => *poll,
            Self::Sidecar { .. } | Self::Postgres { .. } => None,
        }
    }

    /// Acquires `name`, waiting up to `wait` (sidelock queues; the polling
    /// client retries after its sleep). Returns the token.
    pub async fn acquire(&mut self, name: &str, wait: Duration) -> Result<String, Refused> {
        match self {
            Self::Sidecar { conn } => {
                let path = format!("/v1/locks/{name}?ttl={TTL_MS}&wait={}", wait.as_millis());
                let resp = conn
                    .send(http::Method::POST, &path)
                    .await
                    .map_err(Refused::Failed)?;
                match resp.status {
                    200 => serde_json::from_slice::<GrantBody>(&resp.body)
                        .map(|g| g.token)
                        .map_err(|e| Refused::Failed(e.to_string())),
                    409 => Err(Refused::Busy),
                    s => Err(Refused::Failed(format!(
                        "acquire answered {s}: {}",
                        String::from_utf8_lossy(&resp.body)
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
            Self::Postgres {
                client,
                statements,
                round_trips,
            } => {
                // Waiting: the server queues the session until the lock is free.
                let statement = if wait.is_zero() {
                    &statements[0]
                } else {
                    &statements[1]
                };
                let row = client
                    .query_one(statement, &[&name])
                    .await
                    .map_err(|e| Refused::Failed(e.to_string()))?;
                round_trips.fetch_add(1, Ordering::Relaxed);
                match row.get::<_, Option<String>>(0).as_deref() {
                    Some("false") => Err(Refused::Busy),
                    // `true`, or the empty answer of the waiting form.
                    _ => Ok(String::new()),
                }
            }
        }
    }

    /// Releases `name` held with `token`.
    pub async fn release(&mut self, name: &str, token: &str) -> Result<(), String> {
        match self {
            Self::Sidecar { conn } => {
                let path = format!("/v1/locks/{name}?token={token}");
                let resp = conn.send(http::Method::DELETE, &path).await?;
                if resp.status == 200 {
                    Ok(())
                } else {
                    Err(format!("release answered {}", resp.status))
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
            Self::Postgres {
                client,
                statements,
                round_trips,
            } => {
                let row = client
                    .query_one(&statements[2], &[&name])
                    .await
                    .map_err(|e| e.to_string())?;
                round_trips.fetch_add(1, Ordering::Relaxed);
                if row.get::<_, Option<String>>(0).as_deref() == Some("true") {
                    Ok(())
                } else {
                    Err("pg_advisory_unlock: this session did not hold it".into())
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

#[cfg(test)]
mod tests {
    use super::Connection;

    #[test]
    fn sidecar_urls_give_the_address_and_path_or_say_why_not() {
        let c = Connection::new("http://127.0.0.1:7070/", None);
        assert_eq!(c.authority.as_deref(), Ok("127.0.0.1:7070"));
        assert_eq!(c.prefix, "");
        let c = Connection::new("http://sidecar/base/", None);
        assert_eq!(c.authority.as_deref(), Ok("sidecar:80"));
        assert_eq!(c.prefix, "/base");
        let c = Connection::new("unix:/run/sidelock/s.sock", None);
        assert_eq!(
            c.socket.as_deref(),
            Some(std::path::Path::new("/run/sidelock/s.sock"))
        );
        assert_eq!(c.authority.as_deref(), Ok("localhost"));
        let e = Connection::new("https://sidecar:7070", None).authority;
        assert!(e.unwrap_err().contains("plain http://"));
        assert!(Connection::new("not a url", None).authority.is_err());
    }
}
