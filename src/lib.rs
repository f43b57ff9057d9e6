//! sidelock: a distributed-lock sidecar.
//!
//! # Layout
//!
//! * [`config`]: flags, `SIDELOCK_*` env and the TOML file, layered into [`config::Settings`].
//! * [`sidecar`]: the process — open the backend, serve HTTP, shut down cleanly.
//! * [`http`]: routes, parameter extraction, auth, SSE, the OpenAPI document.
//! * [`dashboard`]: the operator page at `GET /`, its assets and chart history.
//! * [`core`]: backend-agnostic queues, leases, watchdog, events.
//! * [`backend`]: the [`backend::Backend`] trait and its implementations, one file each.
//! * [`lock`]: the shared nouns — names, keys, modes, tokens, claims.
//! * [`error`]: the error enum and its `application/problem+json` form.
//! * [`metrics`]: the Prometheus families.
//! * [`shutdown`]: the signal that starts a graceful stop.
//! * [`run`]: `sidelock run`, a client that holds a lock while a command runs.
//! * [`bench`]: `sidelock bench`, the load generator behind BENCHMARKS.md.
//! * [`clock`]: monotonic Unix milliseconds.
//! * [`alloc`]: the global allocator — large buffers in mappings of their own (Linux).

#[cfg(target_os = "linux")]
pub mod alloc;
pub mod backend;
pub mod bench;
pub mod clock;
pub mod config;
pub mod core;
pub mod dashboard;
pub mod error;
pub mod http;
pub mod lock;
pub mod metrics;
pub mod run;
pub mod shutdown;
pub mod sidecar;
