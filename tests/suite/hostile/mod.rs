//! The hostile-client suite: the probes of the independent safety and
//! security review, as tests. Each module attacks one guarantee from outside
//! — as a hostile client, a browser on the same host, or a careful user with
//! extreme inputs — against the real `sidelock` binary and real backends.
//!
//! * [`names`]: lock, semaphore and election names that try to reach internal keys.
//! * [`leases`]: tokens used under the wrong name, huge durations, spoofable strings, global caps.
//! * [`transport`]: slow and idle connections, Host/Origin/Content-Type rules, metric labels.
//! * [`messages`]: wrong types, huge numbers and mislabelled bodies get the API's words, quoting what was sent.
//! * [`secrets`]: no token or password in logs, metrics, events, `/v1/info` or the dashboard.
//! * [`dashboard`]: per-sign-in sessions, sign-out, throttled sign-ins.
//!
//! Run by the README's test command (`scripts/test.sh`) with the rest of the suite.

mod dashboard;
mod leases;
mod messages;
mod names;
mod secrets;
mod transport;
