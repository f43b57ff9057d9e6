//! The integration suite, linked as one test binary (one link instead of one
//! per file): every test starts the real `sidelock` binary and real backends
//! (`redis-server`, ZooKeeper, PostgreSQL, Chromium) and talks to them over
//! real HTTP. `scripts/test.sh` runs it with the rest.
//!
//! * [`common`]: the harness — sidecar guards, typed API helpers, the SSE
//!   reader, problem-document checks (the servers come from the
//!   `sidelock-test-support` crate, shared with the bench).
//! * [`conformance`]: the HTTP contract, once per backend (leader election in `conformance::elections`).
//! * [`safety`]: the safety checker — several sidecars, random clients, faults.
//! * [`hostile`]: the hostile-client suite; [`holds`]: the bound on a lease's hold count.
//! * [`reliability`], [`partition`], [`outage`]: worst days, cut links, unreachable backends.
//! * [`redis`], [`redlock`], [`postgres`], [`zookeeper`]: each backend beyond the shared contract;
//!   [`lost_answers`]: checks of answers lost on the way back, shared by Redis and PostgreSQL.
//! * [`dashboard`], [`metrics`]: the operator's views.
//! * [`global_work`]: backend-wide work done once, by the elected monitor.
//! * [`cli_run`], [`listen`], [`first_run`], [`readme`]: the command line, its settings and the README.
//! * [`layers`]: the module layering.

mod common;

mod cli_run;
mod conformance;
mod dashboard;
mod first_run;
mod global_work;
mod holds;
mod hostile;
mod layers;
mod listen;
mod lost_answers;
mod metrics;
mod outage;
mod partition;
mod postgres;
mod readme;
mod redis;
mod redlock;
mod reliability;
mod safety;
mod zookeeper;
