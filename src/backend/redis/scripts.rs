//! The Lua scripts and their protocol: each script is `lean.lua`, its fast
//! path, `hand_over.lua`, `prelude.lua` and its body, in that order (the
//! common cases return before the prelude; the release's fast path, which
//! may hand the lock over, has its handoff after `hand_over.lua`); one
//! [`Call`] writes an `EVALSHA` with the lock's main key straight into one
//! command buffer, and the readers below decode the replies.

use redis::{Cmd, ErrorKind, RedisError, Script, Value};

use crate::backend::{Error, Holder, Waiter};
use crate::lock::{Held, Kind, Mode};

use super::conn::{Clock, Conn, unavailable};

pub(super) const LEAN: &str = include_str!("lean.lua");
pub(super) const HAND_OVER: &str = include_str!("hand_over.lua");
pub(super) const PRELUDE: &str = include_str!("prelude.lua");

pub(super) fn script(body: &str) -> Script {
    fast_script("", body)
}

/// A script whose `fast` head runs after `lean.lua` and before the queue's
/// helpers and the prelude, and returns when it can: creating the helpers'
/// closures and the prelude's set-up are a good part of a short script's
/// time.
pub(super) fn fast_script(fast: &str, body: &str) -> Script {
    Script::new(&format!("{LEAN}\n{fast}\n{HAND_OVER}\n{PRELUDE}\n{body}"))
}

/// As [`fast_script`], for a fast path that may hand the lock over: its
/// `handing` part runs after the queue's helpers, which only a handoff
/// needs.
pub(super) fn handing_script(fast: &str, handing: &str, body: &str) -> Script {
    Script::new(&format!(
        "{LEAN}\n{fast}\n{HAND_OVER}\n{handing}\n{PRELUDE}\n{body}"
    ))
}

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
    pub(super) rejoin: Script,
    pub(super) give_back: Script,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Self {
            acquire: fast_script(
                include_str!("acquire_fast.lua"),
                include_str!("acquire.lua"),
            ),
            release: handing_script(
                include_str!("release_fast.lua"),
                include_str!("release_handing.lua"),
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
            rejoin: script(include_str!("rejoin.lua")),
            give_back: script(include_str!("give_back.lua")),
        }
    }
}

/// One script call, `EVALSHA <sha> 1 <main key> <arg>…`, written straight
/// into one command buffer: redis-rs's `ScriptInvocation` keeps every key
/// and argument in an allocation of its own and copies them into the
/// command at the call.
pub(super) struct Call<'a> {
    pub(super) script: &'a Script,
    pub(super) cmd: Cmd,
}

/// The suffixes of a lock's side keys, `{<main>}:<suffix>` (prelude.lua;
/// the scripts derive them from the main key).
///
/// A Cluster is told all of a script's keys, not only the main key: while
/// a slot moves between masters (`MIGRATE` moves its keys one at a time),
/// a master runs a script only when it has every key it was told of, and
/// otherwise answers `TRYAGAIN` or `ASK` (the call answers 503). Told only
/// the main key, the old master ran a release on part of the lock's keys:
/// with the fence counter already moved, it took the waiter out of the
/// queue and stopped at the counter (Redis 7 checks each key a script
/// touches; a server that did not would have counted fences from 1 again).
pub(super) const SIDE_KEYS: [&str; 9] = [
    "fence",
    "seq",
    "q",
    "heartbeat",
    "holders",
    "expiry",
    "delay",
    "limit",
    "forced",
];

impl<'a> Call<'a> {
    /// A call on the lock whose main key is `main`. The scripts read only
    /// the main key from `KEYS` and derive the side keys; `all_keys` also
    /// names the side keys, for a Cluster (see [`SIDE_KEYS`]).
    pub(super) fn new(script: &'a Script, main: &str, all_keys: bool) -> Self {
        let mut cmd = Cmd::with_capacity(if all_keys { 24 } else { 16 }, 256);
        cmd.arg("EVALSHA").arg(script.get_hash());
        if all_keys {
            cmd.arg(1 + SIDE_KEYS.len()).arg(main);
            for suffix in SIDE_KEYS {
                cmd.arg(format!("{{{main}}}:{suffix}"));
            }
        } else {
            cmd.arg(1).arg(main);
        }
        Self { script, cmd }
    }

    /// Appends an argument, in order.
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

/// A script's reply as a list, as every full script answers.
///
/// # Errors
/// [`Error::Unavailable`] for any other reply: the server answered
/// something no script of ours returns.
pub(super) fn list(op: &'static str, reply: Value) -> Result<Vec<Value>, Error> {
    match reply {
        Value::Array(reply) => Ok(reply),
        _ => Err(unexpected(op)),
    }
}

/// The acquire script's reply for the fast path's grant, which answers the
/// main key's new value (`<token> <fence> <since> <expires> <count> <SPEC>`,
/// lean.lua; its since is the server's now), as the full script answers a
/// grant: `{1, now, token, fence, count, since, expires}`.
///
/// # Errors
/// [`Error::Unavailable`] when `lease` is no such value.
pub(super) fn granted(op: &'static str, lease: &[u8]) -> Result<Vec<Value>, Error> {
    let read = || {
        let mut fields = std::str::from_utf8(lease).ok()?.splitn(6, ' ');
        let token = fields.next()?;
        let mut next = || fields.next()?.parse::<i64>().ok();
        let (fence, since, expires, count) = (next()?, next()?, next()?, next()?);
        Some(vec![
            Value::Int(1),
            Value::Int(since),
            Value::BulkString(token.as_bytes().to_vec()),
            Value::Int(fence),
            Value::Int(count),
            Value::Int(since),
            Value::Int(expires),
        ])
    };
    read().ok_or_else(|| unexpected(op))
}

fn unexpected(op: &'static str) -> Error {
    unavailable(
        op,
        RedisError::from((ErrorKind::UnexpectedReturnType, "a reply no script answers")),
    )
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

pub(super) fn mode_of(m: &[u8]) -> Mode {
    if m == b"s" {
        Mode::Shared
    } else {
        Mode::Exclusive
    }
}

/// An owner and sidecar as the scripts keep them: `["<owner>","<sidecar>"]`.
pub(super) fn who(v: Option<&Value>) -> (String, String) {
    match v {
        Some(Value::BulkString(b)) => serde_json::from_slice(b).unwrap_or_default(),
        _ => Default::default(),
    }
}

/// The elements of an array reply (an empty one for anything else).
pub(super) fn rows(v: Option<&Value>) -> &[Value] {
    match v {
        Some(Value::Array(items)) => items,
        _ => &[],
    }
}

/// Holders as the scripts return them: `{who, mode, fence, count, since, expires}` each.
pub(super) fn holders(v: Option<&Value>, kind: Kind, clock: &Clock) -> Vec<Holder> {
    rows(v)
        .iter()
        .map(|row| {
            let row = rows(Some(row));
            let (owner, sidecar) = who(row.first());
            let (t0, e) = (int(row, 4), int(row, 5));
            Holder {
                owner,
                sidecar,
                mode: Held::of(kind, mode_of(text(row, 1).as_bytes())),
                since_ms: if t0 > 0 { clock.local(t0) } else { 0 },
                expires_at_ms: if e > 0 { clock.end(e) } else { 0 },
                fence: int(row, 2) as u64,
                count: int(row, 3) as u32,
            }
        })
        .collect()
}

/// Waiters as the scripts return them: `{who, mode, since}` each, in queue order.
pub(super) fn waiters(v: Option<&Value>, kind: Kind, clock: &Clock) -> Vec<Waiter> {
    rows(v)
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let row = rows(Some(row));
            let (owner, sidecar) = who(row.first());
            Waiter {
                owner,
                sidecar,
                mode: Held::of(kind, mode_of(text(row, 1).as_bytes())),
                position: i + 1,
                since_ms: clock.local(int(row, 2)),
            }
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

#[cfg(test)]
mod tests {
    use redis::Value::{BulkString, Int};

    use super::granted;

    #[test]
    fn a_fast_paths_grant_reads_as_the_full_scripts_grant() {
        let lease = br#"ab12 77 1700000000123 1700000030123 1 30000 0 0 ["o","s"]"#;
        assert_eq!(
            granted("try_acquire", lease).expect("a lease"),
            [
                Int(1),
                Int(1_700_000_000_123),
                BulkString(b"ab12".to_vec()),
                Int(77),
                Int(1),
                Int(1_700_000_000_123),
                Int(1_700_000_030_123),
            ]
        );
        for bad in [
            &b""[..],
            b"ab12",
            b"ab12 77 x 2 1 s",
            b"ab12 77 1 2",
            b"\xff 1 2 3 4 s",
        ] {
            assert!(granted("try_acquire", bad).is_err(), "{bad:?}");
        }
    }
}
