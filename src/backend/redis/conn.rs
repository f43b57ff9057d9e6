//! One connection to a Redis deployment, below everything else here: how to
//! reach it, the connection of either shape with its time limits, a scan of
//! one server, the server clock as this sidecar reads it, and what a failed
//! call means.

use futures::future::{BoxFuture, Shared};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, Cmd, RedisError, RedisFuture, Value};

use crate::backend::Error;
use crate::clock::within;

use super::CALL_TIMEOUT;

/// How to reach the Redis deployment.
pub(super) enum Target {
    Single(redis::Client),
    Sentinel(tokio::sync::Mutex<SentinelClient>),
    Cluster {
        client: ClusterClient,
        /// The seed nodes, for the pub/sub connection.
        seeds: Vec<redis::Client>,
    },
}

/// A Cluster connect under way, shared by every caller waiting for it.
pub(super) type Connecting = Shared<BoxFuture<'static, Result<Conn, RedisError>>>;

/// A live connection of either shape.
#[derive(Clone)]
pub(super) enum Conn {
    Plain(MultiplexedConnection),
    Cluster(ClusterConnection),
}

/// The error of a call past its time limit: the one the redis crate's own
/// response timeout gives, so that it is classified alike.
pub(super) fn call_timed_out() -> RedisError {
    std::io::Error::from(std::io::ErrorKind::TimedOut).into()
}

/// Every call is timed here, with [`CALL_TIMEOUT`], by [`within`] rather
/// than by the crate's response timeout: a pause of this process through
/// a call's deadline does not fail a call answered meanwhile.
impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let call = match self {
            Conn::Plain(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        };
        Box::pin(async move {
            within(CALL_TIMEOUT, call)
                .await
                .unwrap_or_else(|_| Err(call_timed_out()))
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let call = match self {
            Conn::Plain(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        };
        Box::pin(async move {
            within(CALL_TIMEOUT, call)
                .await
                .unwrap_or_else(|_| Err(call_timed_out()))
        })
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Plain(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// A plain connection's settings: its calls are timed by [`Conn`].
pub(super) fn config() -> AsyncConnectionConfig {
    AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CALL_TIMEOUT))
        .set_response_timeout(None)
}

/// String keys matching `pattern` that have no expiry, on one server; the
/// scan stops once it has found `most`. Keys are bytes, and anyone may
/// write one that is not UTF-8.
pub(super) async fn scan(
    c: &mut Conn,
    pattern: &str,
    most: usize,
) -> Result<Vec<Vec<u8>>, RedisError> {
    let mut found = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .arg("TYPE")
            .arg("string")
            .query_async(c)
            .await?;
        for k in keys {
            let pttl: i64 = redis::cmd("PTTL").arg(&k).query_async(c).await?;
            if pttl == -1 {
                found.push(k);
            }
        }
        if next == 0 || found.len() >= most {
            return Ok(found);
        }
        cursor = next;
    }
}

/// Translates server timestamps into this sidecar's clock.
pub(super) struct Clock {
    /// Server milliseconds minus local milliseconds.
    pub(super) skew: i64,
    /// [`Node::ahead`] as last measured, if ever.
    pub(super) ahead: Option<i64>,
}

impl Clock {
    pub(super) fn local(&self, server_ms: i64) -> u64 {
        (server_ms - self.skew).max(0) as u64
    }

    /// The local time of a lease's end at `server_ms`, never later than
    /// that end. The offset is read off replies as they arrive, so a slow
    /// way back makes every server time look later than it is; counted
    /// with the offset at the sending of a call instead (at least the true
    /// one), the end is early by at most the way there.
    pub(super) fn end(&self, server_ms: i64) -> u64 {
        let local = self.local(server_ms);
        match self.ahead {
            Some(ahead) => local.min((server_ms - ahead).max(0) as u64),
            None => local,
        }
    }
}

/// A call that failed: the backend is unavailable for `op`.
pub(super) fn unavailable(op: &'static str, e: RedisError) -> Error {
    Error::Unavailable {
        op,
        source: Box::new(e),
    }
}

/// A call for which no connection could be made: the backend is
/// unavailable for `op`, and the call surely did not run.
pub(super) fn not_connected(op: &'static str, e: RedisError) -> Error {
    Error::Unavailable {
        op,
        source: Box::new(crate::backend::Unsent(Box::new(e))),
    }
}

/// A server that accepts connections and never answers (a hung Redis),
/// for unit tests: its port, and the task that keeps the connections,
/// aborted on drop.
#[cfg(test)]
pub(super) async fn never_answering() -> (u16, tokio_util::task::AbortOnDropHandle<()>) {
    let hung = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = hung.local_addr().expect("address").port();
    let accepting = tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok((conn, _)) = hung.accept().await {
            kept.push(conn);
        }
    });
    (port, tokio_util::task::AbortOnDropHandle::new(accepting))
}
