//! The backends the conformance suite runs against.
//!
//! To add a backend: add a variant to [`TestBackend`], start its server in
//! [`TestBackend::start`] (keeping the server's guard in
//! [`BackendGuard::server`]), answer its capabilities, and add one
//! `#[case::…]` line to the [`backends`] template.

use std::any::Any;

use rstest_reuse::template;

use super::sidecar::{SidecarBuilder, SidecarGuard};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestBackend {
    /// `memory://`: in-process, one sidecar only.
    Memory,
    /// `redis://`: a real `redis-server` started for the test.
    Redis,
    /// `redis+sentinel://`: master, replica and `redis-sentinel`.
    RedisSentinel,
    /// `redis+cluster://`: a three-master Redis Cluster.
    RedisCluster,
    /// `redlock://`: three independent Redis masters.
    Redlock,
    /// `postgres://` on the machine's server, in a schema of the test's own.
    Postgres,
    /// `zk://` on a standalone ZooKeeper started for the test.
    ZooKeeper,
}

impl TestBackend {
    /// Starts whatever server the backend needs and returns its URL holder.
    pub async fn start(self) -> BackendGuard {
        match self {
            TestBackend::Memory => BackendGuard {
                backend: self,
                url: "memory://".to_owned(),
                env: Vec::new(),
                server: None,
            },
            TestBackend::Redis => {
                let server = super::redis::RedisServer::start().await;
                BackendGuard {
                    backend: self,
                    url: server.url(),
                    env: Vec::new(),
                    server: Some(Box::new(server)),
                }
            }
            TestBackend::RedisSentinel => {
                let servers = super::redis::RedisSentinel::start().await;
                BackendGuard {
                    backend: self,
                    url: servers.url(),
                    env: Vec::new(),
                    server: Some(Box::new(servers)),
                }
            }
            TestBackend::RedisCluster => {
                let cluster = super::redis::RedisCluster::start().await;
                BackendGuard {
                    backend: self,
                    url: cluster.url(),
                    env: Vec::new(),
                    server: Some(Box::new(cluster)),
                }
            }
            TestBackend::Redlock => {
                let nodes = super::redis::RedisNodes::start(3).await;
                BackendGuard {
                    backend: self,
                    url: nodes.url(),
                    env: Vec::new(),
                    server: Some(Box::new(nodes)),
                }
            }

            TestBackend::ZooKeeper => {
                // Reaping as ZooKeeper does by default, every minute: a
                // lock nobody holds shows the fence recorded in its node,
                // which quick reaping could remove between a release and the
                // look that checks it (the ZooKeeper suite tests reaping).
                let server = super::zookeeper::ZkServer::start_reaping_slowly().await;
                BackendGuard {
                    backend: self,
                    url: server.url("/conformance"),
                    env: Vec::new(),
                    server: Some(Box::new(server)),
                }
            }
            TestBackend::Postgres => {
                let schema = super::postgres::TestSchema::new().await;
                BackendGuard {
                    backend: self,
                    url: schema.url.clone(),
                    env: vec![("SIDELOCK_PG_SCHEMA".to_owned(), schema.name.clone())],
                    server: Some(Box::new(schema)),
                }
            }
        }
    }

    /// Whether two sidecars on the same backend URL see the same locks.
    /// Tests that exercise several sidecars run with one when this is false.
    pub fn two_sidecars_share_state(self) -> bool {
        match self {
            TestBackend::Memory => false,
            TestBackend::Postgres | TestBackend::ZooKeeper => true,
            TestBackend::Redis
            | TestBackend::RedisSentinel
            | TestBackend::RedisCluster
            | TestBackend::Redlock => true,
        }
    }

    /// How much shorter than `ttl_ms` a reported lease may be: Redlock
    /// subtracts a clock-drift allowance (1% + 2 ms) and the time the
    /// attempt took from every validity (50 ms covers that on loopback).
    pub fn drift_ms(self, ttl_ms: u64) -> u64 {
        match self {
            TestBackend::Redlock => ttl_ms / 100 + 2 + 50,
            _ => 0,
        }
    }

    /// `backend.kind` in `GET /v1/info`.
    pub fn info_kind(self) -> &'static str {
        match self {
            TestBackend::Memory => "memory",
            TestBackend::Redis | TestBackend::RedisSentinel | TestBackend::RedisCluster => "redis",
            TestBackend::Redlock => "redlock",
            TestBackend::Postgres => "postgres",
            TestBackend::ZooKeeper => "zookeeper",
        }
    }

    /// `backend.safety` in `GET /v1/info`.
    pub fn safety(self) -> &'static str {
        match self {
            TestBackend::Memory => "single-process",
            TestBackend::Redis
            | TestBackend::RedisSentinel
            | TestBackend::RedisCluster
            | TestBackend::Redlock => "efficiency",
            TestBackend::Postgres | TestBackend::ZooKeeper => "correctness",
        }
    }
}

/// A started backend. Declare it before the sidecars that use it, so it is
/// dropped after them.
pub struct BackendGuard {
    backend: TestBackend,
    url: String,
    /// Environment every sidecar on this backend gets (e.g. its PostgreSQL schema).
    env: Vec<(String, String)>,
    /// The guard of a backend server started for this test (none for memory).
    server: Option<Box<dyn Any + Send>>,
}

impl BackendGuard {
    pub fn backend(&self) -> TestBackend {
        self.backend
    }

    /// The URL passed to `--backend`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A sidecar builder on this backend, for tests that need extra flags.
    pub fn sidecar(&self) -> SidecarBuilder {
        self.env
            .iter()
            .fold(SidecarBuilder::new(&self.url), |b, (k, v)| b.env(k, v))
    }

    /// The started server's guard, e.g. [`super::postgres::TestSchema`].
    pub fn server<T: 'static>(&self) -> Option<&T> {
        self.server.as_ref()?.downcast_ref()
    }

    /// A sidecar with default settings.
    pub async fn start_sidecar(&self) -> SidecarGuard {
        self.sidecar().start().await
    }

    /// `wanted` sidecars sharing this backend, or just one if the backend
    /// cannot share state between sidecars. Tests spread their clients over
    /// whatever this returns.
    pub async fn sidecars(&self, wanted: usize) -> Vec<SidecarGuard> {
        let count = if self.backend.two_sidecars_share_state() {
            wanted
        } else {
            1
        };
        let mut sidecars = Vec::with_capacity(count);
        for _ in 0..count {
            sidecars.push(self.start_sidecar().await);
        }
        sidecars
    }
}

/// Every conformance test runs once per case here:
///
/// ```ignore
/// #[apply(backends)]
/// #[tokio::test]
/// async fn some_test(#[case] backend: TestBackend) { … }
/// ```
#[template]
#[rstest]
#[case::memory(crate::common::TestBackend::Memory)]
#[case::redis(crate::common::TestBackend::Redis)]
#[case::redis_sentinel(crate::common::TestBackend::RedisSentinel)]
#[case::redis_cluster(crate::common::TestBackend::RedisCluster)]
#[case::redlock(crate::common::TestBackend::Redlock)]
#[case::postgres(crate::common::TestBackend::Postgres)]
#[case::zookeeper(crate::common::TestBackend::ZooKeeper)]
pub fn backends(#[case] backend: crate::common::TestBackend) {}

/// The networked backends two sidecars share, Sentinel and Cluster left out
/// (their Redis scripts are single Redis's): for tests of what one sidecar
/// leaves to another.
#[template]
#[rstest]
#[case::redis(crate::common::TestBackend::Redis)]
#[case::redlock(crate::common::TestBackend::Redlock)]
#[case::postgres(crate::common::TestBackend::Postgres)]
#[case::zookeeper(crate::common::TestBackend::ZooKeeper)]
pub fn shared_backends(#[case] backend: crate::common::TestBackend) {}
