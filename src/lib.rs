//! sidelock: a distributed-lock sidecar.
//!
//! # Layout
//!
//! Bottom layer first: a module uses only the modules listed above it
//! (`tests/suite/layers.rs` fails on an import that reaches up).
//!
//! * [`alloc`]: the global allocator — large buffers in mappings of their own (Linux; elsewhere the system's).
//! * [`clock`]: monotonic Unix milliseconds and the clock-drift allowance.
//! * [`lock`]: the shared nouns — names, keys, modes, tokens, claims, why a lease was lost.
//! * [`duration`]: the one duration grammar and the longest duration.
//! * [`shutdown`]: the signal that starts a graceful stop.
//! * [`wakeups`]: the handle backends call when a key changes, and the local waiter queues.
//! * [`backend`]: the [`backend::Backend`] trait, its implementations, and the one URL → backend map.
//! * [`error`]: the error enum of the request path (no HTTP in it).
//! * [`metrics`]: the Prometheus families.
//! * [`core`]: backend-agnostic leases, waiting, watchdog, events, backend health.
//! * [`config`]: flags, `SIDELOCK_*` env and the TOML file, layered into [`config::Settings`].
//! * [`http`]: the server, routes, parameters, auth, problem documents, the OpenAPI document.
//! * [`dashboard`]: the operator page at `GET /` and `/v1/stats`, mounted into [`http`] by the sidecar.
//! * [`run`]: `sidelock run`, a client that holds a lock while a command runs.
//! * [`campaign`]: `sidelock campaign`, a client that runs a command while it leads an election.
//! * [`sidecar`]: the process — open the backend, serve HTTP, shut down cleanly.
//! * [`cli`]: the command line of the `sidelock` binary.
//!
//! Modules are private unless the binary needs them: the public API is
//! [`alloc`], [`cli`], [`config`], [`run`], [`campaign`] and [`sidecar`] (and, with the
//! `fuzz` feature, the fuzz target's `check_fuzz_input`). The load generator
//! is the `sidelock-bench` package, which talks to sidecars over HTTP only.

// The layout list names every module, private ones included, on purpose.
#![allow(rustdoc::private_intra_doc_links)]

pub mod alloc;
mod backend;
pub mod campaign;
pub mod cli;
mod clock;
pub mod config;
mod core;
mod dashboard;
mod duration;
mod error;
mod http;
mod lock;
mod metrics;
pub mod run;
mod shutdown;
pub mod sidecar;
mod wakeups;

/// The fuzz hook, for the cargo-fuzz target (the `fuzz` feature).
#[cfg(feature = "fuzz")]
pub use http::fuzz::check_fuzz_input;
