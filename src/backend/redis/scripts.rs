//! The Lua scripts and their protocol: each script is `prelude.lua` plus its
//! body (the fast paths run before the prelude), one [`Call`] writes an
//! `EVALSHA` straight into one command buffer, and the readers below decode
//! the replies.

use redis::{Cmd, ErrorKind, RedisError, Script, Value};
use serde::Deserialize;

use crate::backend::{Holder, Waiter};
use crate::lock::{Held, Kind, Mode};

use super::node::{Clock, Conn};

pub(super) const PRELUDE: &str = include_str!("prelude.lua");

pub(super) fn script(body: &str) -> Script {
    fast_script("", body)
}

/// A script whose `fast` head runs before the prelude and returns when it
/// can: the prelude's set-up is a good part of a short script's time.
pub(super) fn fast_script(fast: &str, body: &str) -> Script {
    Script::new(&format!("{fast}\n{PRELUDE}\n{body}"))
}

/// The suffixes of a lock's side keys `{<base>}:<suffix>`, in the order the
/// scripts' `KEYS` hold them (after the base key, before the index).
pub(super) const SIDE_KEYS: [&str; 10] = [
    "holders",
    "expiry",
    "fence",
    "queue",
    "waiters",
    "heartbeat",
    "delay",
    "limit",
    "seq",
    "lease",
];

/// The compiled scripts.
pub(super) struct Scripts {
    pub(super) acquire: Script,
    pub(super) release: Script,
    pub(super) renew: Script,
    pub(super) status: Script,
    pub(super) inspect: Script,
    pub(super) force_release: Script,
    pub(super) dequeue: Script,
    pub(super) heartbeat: Script,
    pub(super) reconcile: Script,
    pub(super) raise_fence: Script,
    pub(super) stale: Script,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Self {
            acquire: fast_script(
                include_str!("acquire_fast.lua"),
                include_str!("acquire.lua"),
            ),
            release: fast_script(
                include_str!("release_fast.lua"),
                include_str!("release.lua"),
            ),
            renew: fast_script(include_str!("renew_fast.lua"), include_str!("renew.lua")),
            status: script(include_str!("status.lua")),
            inspect: script(include_str!("inspect.lua")),
            force_release: script(include_str!("force_release.lua")),
            dequeue: script(include_str!("dequeue.lua")),
            heartbeat: script(include_str!("heartbeat.lua")),
            reconcile: script(include_str!("reconcile.lua")),
            raise_fence: script(include_str!("raise_fence.lua")),
            stale: script(include_str!("stale.lua")),
        }
    }
}

/// One script call, `EVALSHA <sha> <keys> <key>… <arg>…`, written straight
/// into one command buffer: redis-rs's `ScriptInvocation` keeps every key
/// and argument in an allocation of its own and copies them into the
/// command at the call, some 40 allocations per uncontended acquire and
/// release.
pub(super) struct Call<'a> {
    pub(super) script: &'a Script,
    pub(super) cmd: Cmd,
}

impl<'a> Call<'a> {
    /// A call whose first `keys` arguments are its keys.
    pub(super) fn new(script: &'a Script, keys: usize) -> Self {
        let mut cmd = Cmd::with_capacity(32, 512);
        cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys);
        Self { script, cmd }
    }

    /// Appends a key or an argument, in order.
    pub(super) fn arg<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.cmd.arg(arg);
        self
    }

    /// Runs the call, loading the script first if the server does not know it.
    pub(super) async fn invoke<T: redis::FromRedisValue>(
        &self,
        c: &mut Conn,
    ) -> Result<T, RedisError> {
        match self.cmd.query_async(c).await {
            Err(e) if e.kind() == ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.script.load_async(c).await?;
                self.cmd.query_async(c).await
            }
            other => other,
        }
    }
}

pub(super) fn int(reply: &[Value], i: usize) -> i64 {
    match reply.get(i) {
        Some(Value::Int(n)) => *n,
        Some(Value::BulkString(b)) => String::from_utf8_lossy(b).parse().unwrap_or(0),
        _ => 0,
    }
}

pub(super) fn text(reply: &[Value], i: usize) -> String {
    match reply.get(i) {
        Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(Value::SimpleString(s)) => s.clone(),
        Some(Value::Int(n)) => n.to_string(),
        _ => String::new(),
    }
}

pub(super) fn mode_arg(mode: Mode) -> &'static str {
    match mode {
        Mode::Exclusive => "x",
        Mode::Shared => "s",
    }
}

/// Holder metadata as the scripts return it.
#[derive(Deserialize)]
pub(super) struct RawHolder {
    pub(super) o: String,
    pub(super) s: String,
    pub(super) m: String,
    pub(super) f: u64,
    pub(super) c: u32,
    pub(super) t0: i64,
    pub(super) e: i64,
}

/// Waiter metadata as the scripts return it.
#[derive(Deserialize)]
pub(super) struct RawWaiter {
    pub(super) o: String,
    pub(super) s: String,
    pub(super) m: String,
    pub(super) t0: i64,
}

pub(super) fn mode_of(m: &str) -> Mode {
    if m == "s" {
        Mode::Shared
    } else {
        Mode::Exclusive
    }
}

pub(super) fn holders(json: &str, kind: Kind, clock: &Clock) -> Vec<Holder> {
    // cjson encodes an empty table as {}; both mean no holders.
    serde_json::from_str::<Vec<RawHolder>>(json)
        .unwrap_or_default()
        .into_iter()
        .map(|h| Holder {
            owner: h.o,
            sidecar: h.s,
            mode: Held::of(kind, mode_of(&h.m)),
            since_ms: if h.t0 > 0 { clock.local(h.t0) } else { 0 },
            expires_at_ms: if h.e > 0 { clock.local(h.e) } else { 0 },
            fence: h.f,
            count: h.c,
        })
        .collect()
}

pub(super) fn waiters(json: &str, kind: Kind, clock: &Clock) -> Vec<Waiter> {
    serde_json::from_str::<Vec<RawWaiter>>(json)
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, w)| Waiter {
            owner: w.o,
            sidecar: w.s,
            mode: Held::of(kind, mode_of(&w.m)),
            position: i + 1,
            since_ms: clock.local(w.t0),
        })
        .collect()
}

/// The reason a stale-key script wrote (`no-expiry` for any word it does not know).
pub(super) fn reason_of(s: &str) -> crate::backend::StaleReason {
    crate::backend::StaleReason::parse(s).unwrap_or(crate::backend::StaleReason::NoExpiry)
}

pub(super) fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
