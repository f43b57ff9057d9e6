//! Names that try to reach a backend's internal keys, znodes or rows.
//!
//! A lock named `index` once was the Redis index key itself: one acquire
//! made every later acquire and listing answer 503, and left a grant whose
//! token nobody received. Every backend maps user names into a namespace of
//! their own; these tests try every internal name (and its variants) as a
//! lock and as a semaphore on every backend, through two sidecars where the
//! backend shares state, and check that the name works like any other and
//! that nothing else broke. See also the crate doc (`main.rs`).
//!
//! What each backend keeps for itself, and why no name reaches it:
//!
//! * Redis (single, Sentinel, Cluster) and each Redlock node: side keys
//!   `{<base>}:<suffix>` (fence, seq, q, heartbeat, holders, expiry, delay,
//!   limit), channels `{<base>}:wake` and `<prefix>/sidecars/<sidecar>`;
//!   names have no `/`, `{`, `}`, and semaphores
//!   (`<prefix>semaphores/<name>`) and elections (`<prefix>elections/<name>`)
//!   have their own prefix. Keys matched by `--legacy-pattern` are only read.
//! * ZooKeeper: `<root>/{locks,semaphores,elections}/<name>`, with claim
//!   nodes and `_sidelock_delay` one level below a name; `.` and `..` are
//!   stored as `%2e` and `%2e%2e`.
//! * PostgreSQL: tables, functions and the NOTIFY channel of the schema;
//!   names are row data passed as parameters.
//! * Memory: a map keyed by kind and name.

use reqwest::StatusCode;
use rstest::rstest;
use rstest_reuse::apply;

use crate::common::redis::RedisServer;
use crate::common::{
    BackendGuard, Resource, SidecarBuilder, SidecarGuard, SseStream, TestBackend, assert_problem,
    backends, unique_name,
};

/// Valid names that equal, or differ by case, dots, prefixes or suffixes
/// from, a key, znode, table or channel some backend uses itself.
const INTERNAL: &[&str] = &[
    // Redis: the index, the side keys' suffixes, the shared marker, channels.
    "index",
    "INDEX",
    "Index",
    "index:x",
    "x:index",
    "index.",
    ".index",
    "index..",
    "indexes",
    "_index",
    "index-",
    "holders",
    "expiry",
    "fence",
    "fences",
    "queue",
    "waiters",
    "heartbeat",
    "heartbeats",
    "delay",
    "limit",
    "seq",
    "members",
    "MEMBERS",
    "sidecars",
    "shared",
    "sidelock",
    "sidelock:index",
    "sidelock:shared",
    "sidelock:wake:locks",
    "wake",
    "wake:locks",
    "wake:semaphores",
    "wake:locks:x",
    "locks",
    "semaphores",
    "semaphores:x",
    "elections",
    "elections:x",
    // ZooKeeper: the kind directories, node names, the server's own tree.
    "_sidelock_delay",
    "_c_00000000-0000-4000-a000-000000000000-lock-0000000001",
    "lock-0000000001",
    "__READ__0000000001",
    "__WRIT__0000000001",
    "zookeeper",
    "...",
    ".lock",
    // PostgreSQL: tables, functions, the NOTIFY channel, schemas.
    "keys",
    "leases",
    "schema_migrations",
    "sidelock_wake",
    "public",
    "pg_catalog",
    // Bare separators.
    "-",
    "_",
    ":",
];

/// Names that would reach another namespace if they were accepted: each
/// must be refused with 400 `invalid-name`.
const OUTSIDE: &[&str] = &[
    "semaphores/x",
    "locks/index",
    "elections/x",
    "wake:locks/x",
    "{sidelock:x}:holders",
    "sidelock:{x}",
    "%2e",
    "index/",
    "/index",
    "a b",
    "index\u{0}",
];

/// `.` and `..` are dot segments that URL libraries remove before sending;
/// a raw client (`curl --path-as-is`) sends them as names.
const DOT_SEGMENTS: &[&str] = &[".", ".."];

/// One raw HTTP/1.1 request with an empty body and the path as is; the
/// status and the body.
async fn raw(sidecar: &SidecarGuard, method: &str, path: &str) -> (u16, serde_json::Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let port = sidecar.port();
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the sidecar");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.expect("read");
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{method} {path}: no status line in {answer:?}"));
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (
        status,
        serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
    )
}

/// The permits each semaphore gets: as many as the backend can bound.
fn permits(backend: TestBackend) -> usize {
    if backend == TestBackend::Redlock {
        1
    } else {
        2
    }
}

/// An ordinary lock still works end to end, and the listing and the stale
/// report answer 200.
async fn everything_else_works(a: &SidecarGuard, b: &SidecarGuard) {
    let lock = a.api().lock(&unique_name("ordinary"));
    let grant = lock.acquire(&[("owner", "ordinary")]).await;
    b.api()
        .lock(lock.name())
        .acquire_busy(&[("owner", "other")])
        .await;
    assert_eq!(
        b.api().lock(lock.name()).inspect().await.holder_owners(),
        ["ordinary"]
    );
    lock.keepalive(&grant.token, &[]).await;
    assert!(lock.release(&grant.token).await.released);
    for sidecar in [a, b] {
        for path in [["v1", "locks"], ["v1", "stale"]] {
            let response = sidecar.api().get(&path, &[]).await;
            assert_eq!(response.status(), StatusCode::OK, "GET /{}", path.join("/"));
        }
    }
}

/// What `GET /v1/locks` lists, as (kind, name) pairs.
async fn listed(sidecar: &SidecarGuard) -> Vec<(String, String)> {
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut query = vec![("limit", "1000")];
        if let Some(c) = &cursor {
            query.push(("cursor", c));
        }
        let page = sidecar.api().list(&query).await;
        // The sidecars' own monitor election is listed too; no test took it.
        all.extend(
            page.locks
                .into_iter()
                .filter(|l| !(l.kind == "election" && l.name == "sidelock.monitor"))
                .map(|l| (l.kind, l.name)),
        );
        cursor = page.next_cursor;
        if cursor.is_none() {
            return all;
        }
    }
}

/// Takes `name` as exclusive lock or as every permit of a semaphore through
/// `a`, checks `b` sees it busy, and returns the tokens.
async fn take(a: &Resource, b: &Resource, limit: usize) -> Vec<String> {
    let mut tokens = Vec::new();
    let limit_text = limit.to_string();
    let params: Vec<(&str, &str)> = match a.kind() {
        crate::common::Kind::Lock => vec![("owner", "probe"), ("ttl", "10m")],
        crate::common::Kind::Semaphore => {
            vec![("owner", "probe"), ("ttl", "10m"), ("limit", &limit_text)]
        }
    };
    let count = if a.kind() == crate::common::Kind::Lock {
        1
    } else {
        limit
    };
    for _ in 0..count {
        let grant = a.acquire(&params).await;
        assert_eq!(grant.name, a.name());
        assert_eq!(grant.count, 1, "{grant:?}");
        tokens.push(grant.token);
    }
    let mut other = params.clone();
    other[0] = ("owner", "other");
    b.acquire_busy(&other).await;
    let state = b.inspect().await;
    assert_eq!(state.holders.len(), count, "{}: {state:?}", a.name());
    assert!(
        state.holders.iter().all(|h| h.owner == "probe"),
        "{state:?}"
    );
    tokens
}

/// Every internal-looking name works as a lock (exclusive and shared) and
/// as a semaphore on every backend, through two sidecars where they share
/// state, while ordinary locks, the listing and the stale report keep
/// working; names outside the naming rule are refused.
#[apply(backends)]
#[tokio::test]
async fn internal_names_are_ordinary_names(#[case] backend: TestBackend) {
    let guard: BackendGuard = backend.start().await;
    let sidecars = guard.sidecars(2).await;
    let (a, b) = (&sidecars[0], &sidecars[sidecars.len() - 1]);
    let limit = permits(backend);

    for name in OUTSIDE {
        for resource in [a.api().lock(name), a.api().semaphore(name)] {
            let response = resource.acquire_raw(&[("limit", "1")]).await;
            assert_problem(response, StatusCode::BAD_REQUEST, "invalid-name").await;
        }
    }

    let mut held = Vec::new();
    for name in INTERNAL {
        for (mine, theirs) in [
            (a.api().lock(name), b.api().lock(name)),
            (a.api().semaphore(name), b.api().semaphore(name)),
        ] {
            let tokens = take(&mine, &theirs, limit).await;
            held.push((mine, tokens));
        }
        everything_else_works(a, b).await;
    }

    // Every one of them is listed, none is lost, and nothing else shows up.
    let mut expected: Vec<(String, String)> = held
        .iter()
        .map(|(r, _)| (r.kind().as_str().to_owned(), r.name().to_owned()))
        .collect();
    expected.sort();
    for sidecar in [a, b] {
        let mut got = listed(sidecar).await;
        got.sort();
        assert_eq!(got, expected);
    }

    for (resource, tokens) in &held {
        for token in tokens {
            resource.keepalive(token, &[]).await;
            assert!(resource.release(token).await.released);
        }
        let state = resource.inspect().await;
        assert!(state.holders.is_empty(), "{}: {state:?}", resource.name());
    }
    everything_else_works(a, b).await;

    // Shared holders through both sidecars, then an exclusive claim waits.
    for name in INTERNAL {
        let (ra, rb) = (a.api().lock(name), b.api().lock(name));
        let first = ra.acquire(&[("mode", "shared"), ("owner", "r1")]).await;
        let second = rb.acquire(&[("mode", "shared"), ("owner", "r2")]).await;
        rb.acquire_busy(&[("owner", "writer")]).await;
        assert_eq!(ra.inspect().await.holders.len(), 2, "{name}");
        ra.release(&first.token).await;
        rb.release(&second.token).await;
        let grant = rb.acquire(&[("owner", "writer")]).await;
        rb.release(&grant.token).await;
    }
    assert!(listed(a).await.is_empty());
    everything_else_works(a, b).await;

    for name in DOT_SEGMENTS {
        for kind in ["locks", "semaphores"] {
            let path = format!("/v1/{kind}/{name}");
            let limit = if kind == "semaphores" { "&limit=1" } else { "" };
            let (status, grant) = raw(a, "POST", &format!("{path}?owner=dot{limit}")).await;
            assert_eq!(status, 200, "POST {path}: {grant}");
            assert_eq!(grant["name"], *name, "{grant}");
            let (status, busy) = raw(b, "POST", &format!("{path}?owner=other{limit}")).await;
            assert_eq!(status, 409, "POST {path} through the other sidecar: {busy}");
            let (status, state) = raw(b, "GET", &path).await;
            assert_eq!(status, 200, "GET {path}: {state}");
            assert_eq!(state["holders"][0]["owner"], "dot", "{state}");
            everything_else_works(a, b).await;
            let token = grant["token"].as_str().expect("token");
            let (status, released) = raw(a, "DELETE", &format!("{path}?token={token}")).await;
            assert_eq!(status, 200, "DELETE {path}: {released}");
        }
    }
    assert!(listed(a).await.is_empty());
}

/// The side keys of one Redis lock (`{<prefix><name>}:<suffix>`) that exist.
async fn side_keys(redis: &RedisServer, name: &str) -> Vec<String> {
    let mut keys: Vec<String> = redis
        .cmd(&["KEYS", &format!("{{sidelock:{name}}}:*")])
        .await;
    keys.sort();
    keys
}

/// A hold stream that must end with `timeout` (busy, wait=0).
async fn hold_times_out(resource: &Resource) {
    let response = resource.hold_raw(&[("owner", "hold")]).await;
    let mut stream = SseStream::from_response(response).await;
    let event = stream.next().await.expect("an event");
    assert_eq!(event.event, "timeout", "{}", event.data);
}

/// A key at a lock's main key that sidelock did not write — a legacy string
/// without expiry, or a hash, list, set, sorted set or stream written by hand
/// — is a foreign holder, like a key of the classic `SET NX` protocol: every
/// claim is busy (also after waiting), nothing is granted or left behind,
/// the key stays as it was, and everything else keeps working.
#[tokio::test]
async fn a_hand_written_key_of_any_type_at_a_lock_is_a_foreign_holder() {
    let redis = RedisServer::start().await;
    let a = SidecarBuilder::new(&redis.url()).start().await;
    let b = SidecarBuilder::new(&redis.url()).start().await;
    let kinds: &[(&str, &[&str])] = &[
        ("string", &["SET", "KEY", "legacy-token"]),
        ("hash", &["HSET", "KEY", "field", "value"]),
        ("list", &["RPUSH", "KEY", "a"]),
        ("set", &["SADD", "KEY", "a"]),
        ("zset", &["ZADD", "KEY", "0", "locks/x"]),
        ("stream", &["XADD", "KEY", "*", "f", "v"]),
    ];
    for (kind, write) in kinds {
        let name = format!("legacy-{kind}");
        let key = format!("sidelock:{name}");
        let write: Vec<&str> = write
            .iter()
            .map(|a| if *a == "KEY" { key.as_str() } else { a })
            .collect();
        let _: redis::Value = redis.cmd(&write).await;

        let lock = a.api().lock(&name);
        let busy = lock.acquire_busy(&[("owner", "new")]).await;
        assert_eq!(busy["holders"][0]["owner"], "(foreign)", "{kind}: {busy}");
        b.api()
            .lock(&name)
            .acquire_busy(&[("owner", "waiter"), ("wait", "300ms")])
            .await;
        lock.acquire_busy(&[("owner", "reader"), ("mode", "shared")])
            .await;
        hold_times_out(&lock).await;
        let state = lock.inspect().await;
        assert_eq!(state.holder_owners(), ["(foreign)"], "{kind}: {state:?}");
        lock.release_lost("0123456789abcdef0123456789abcdef").await;
        lock.keepalive_lost("0123456789abcdef0123456789abcdef")
            .await;

        let found: String = redis.cmd(&["TYPE", &key]).await;
        assert_eq!(&found, kind, "the hand-written key is untouched");
        let left = side_keys(&redis, &name).await;
        assert!(
            left.iter().all(|k| k.ends_with(":seq")),
            "{kind}: nothing granted or queued is left behind: {left:?}"
        );
        everything_else_works(&a, &b).await;
    }
}

/// A side key of another type than sidelock writes there (written by hand),
/// or a counter that is not a number, fails no acquire midway: a claim that
/// would write it is refused with 409 `key-conflict` naming the key, and
/// nothing is granted (no main key, no holder entry). An uncontended
/// exclusive claim, which writes only the main key and the fence, is instead
/// granted whole when the broken key is not the fence; then it releases
/// cleanly. An entry in the queue that is no queue entry is dropped, and keys
/// older versions kept (`queue`, `waiters`, `lease`) are not read at all.
/// Other locks keep working.
#[tokio::test]
async fn a_corrupted_side_key_refuses_the_claim_without_a_partial_grant() {
    let redis = RedisServer::start().await;
    let a = SidecarBuilder::new(&redis.url()).start().await;
    let b = SidecarBuilder::new(&redis.url()).start().await;
    let corruptions: &[(&str, &[&str])] = &[
        ("holders", &["SET", "KEY", "not a hash"]),
        ("expiry", &["HSET", "KEY", "f", "v"]),
        ("fence", &["SET", "KEY", "not a number"]),
        // A number INCR refuses, and one past which fences are not exact.
        ("fence", &["SET", "KEY", "007"]),
        ("fence", &["SET", "KEY", "9007199254740991"]),
        // A signed one INCR takes: a grant's fence would be -1, then 0.
        ("fence", &["SET", "KEY", "-2"]),
        ("seq", &["SET", "KEY", "-2"]),
        ("seq", &["SET", "KEY", "1e3"]),
        ("limit", &["SET", "KEY", "1.5"]),
        ("fence", &["HSET", "KEY", "f", "v"]),
        ("q", &["SET", "KEY", "1"]),
        ("heartbeat", &["SADD", "KEY", "x"]),
        ("delay", &["HSET", "KEY", "f", "v"]),
        ("limit", &["RPUSH", "KEY", "x"]),
        ("seq", &["SET", "KEY", "x"]),
        // Not a queue entry: dropped.
        ("q", &["RPUSH", "KEY", "not an entry"]),
        // Keys of older versions: not read.
        ("queue", &["SET", "KEY", "1"]),
        ("waiters", &["RPUSH", "KEY", "x"]),
        ("lease", &["HSET", "KEY", "f", "v"]),
    ];
    for (i, (suffix, write)) in corruptions.iter().enumerate() {
        let name = format!("corrupt-{i}-{suffix}");
        let key = format!("{{sidelock:{name}}}:{suffix}");
        let write: Vec<&str> = write
            .iter()
            .map(|a| if *a == "KEY" { key.as_str() } else { a })
            .collect();
        let _: redis::Value = redis.cmd(&write).await;
        let main = format!("sidelock:{name}");
        let lock = a.api().lock(&name);
        let ignored = ["queue", "waiters", "lease"].contains(suffix)
            || (*suffix == "q" && write[0] == "RPUSH");
        for params in [
            vec![("owner", "r"), ("mode", "shared")],
            vec![("owner", "w"), ("wait", "200ms")],
            vec![("owner", "x")],
        ] {
            let response = lock.acquire_raw(&params).await;
            let shared = params.contains(&("mode", "shared"));
            let core = *suffix == "fence";
            if ignored || (response.status() == StatusCode::OK && !shared && !core) {
                assert_eq!(response.status(), StatusCode::OK, "{key}: {params:?}");
                let grant: crate::common::Grant = response.json().await.expect("grant");
                assert!(lock.release(&grant.token).await.released);
                continue;
            }
            let problem = assert_problem(response, StatusCode::CONFLICT, "key-conflict").await;
            let detail = problem["detail"].as_str().unwrap_or_default();
            assert!(detail.contains(&key), "{detail}");
            let exists: i64 = redis.cmd(&["EXISTS", &main]).await;
            assert_eq!(exists, 0, "{key}: no main key was written");
        }
        let mut left = side_keys(&redis, &name).await;
        left.retain(|k| k != &key && !k.ends_with(":fence") && !k.ends_with(":seq"));
        assert!(left.is_empty(), "{key}: nothing else was left: {left:?}");
        everything_else_works(&a, &b).await;
    }
}

/// A side key of a lock in use broken by hand does not take the listing or
/// the stale report down: the listing leaves that lock out, `/v1/stale`
/// names the key (`wrong-type`), the lock itself answers 409 `key-conflict`,
/// and once the key is removed the lease is there as before.
#[tokio::test]
async fn a_corrupted_key_of_a_lock_in_use_leaves_the_listing_working() {
    let redis = RedisServer::start().await;
    let a = SidecarBuilder::new(&redis.url()).start().await;
    let b = SidecarBuilder::new(&redis.url()).start().await;
    let lock = a.api().lock("in-use");
    let grant = lock.acquire(&[("owner", "holder")]).await;
    let other = a.api().lock("other").acquire(&[("owner", "other")]).await;
    let broken = "{sidelock:in-use}:q";
    let _: String = redis.cmd(&["SET", broken, "1"]).await;

    for sidecar in [&a, &b] {
        assert_eq!(
            listed(sidecar).await,
            [("lock".to_owned(), "other".to_owned())]
        );
        let stale = sidecar.api().stale().await;
        assert!(
            stale
                .iter()
                .any(|s| s.reason == "wrong-type" && s.key == broken),
            "{stale:?}"
        );
        let inspect = sidecar.api().get(&["v1", "locks", "in-use"], &[]).await;
        assert_problem(inspect, StatusCode::CONFLICT, "key-conflict").await;
        let claim = sidecar.api().lock("in-use").acquire_raw(&[]).await;
        assert_problem(claim, StatusCode::CONFLICT, "key-conflict").await;
    }
    everything_else_works(&a, &b).await;

    let _: i64 = redis.cmd(&["DEL", broken]).await;
    assert_eq!(
        b.api().lock("in-use").inspect().await.holder_owners(),
        ["holder"]
    );
    lock.release(&grant.token).await;
    a.api().lock("other").release(&other.token).await;
    assert!(listed(&b).await.is_empty());
}

/// The indexes older versions kept — at `sidelock:index`, the main key of
/// the lock named `index`, and later at `sidelock:/index` — are dropped by
/// the next listing (which finds the keys in use by scanning), after which
/// the lock named `index` is an ordinary lock.
#[tokio::test]
async fn an_index_left_by_an_older_version_is_dropped() {
    let redis = RedisServer::start().await;
    let a = SidecarBuilder::new(&redis.url()).start().await;
    let b = SidecarBuilder::new(&redis.url()).start().await;
    let held = a
        .api()
        .lock("held-before")
        .acquire(&[("owner", "old")])
        .await;
    for index in ["sidelock:index", "sidelock:/index"] {
        let _: i64 = redis.cmd(&["ZADD", index, "0", "locks/held-before"]).await;
    }

    let before = listed(&b).await;
    assert_eq!(before, [("lock".to_owned(), "held-before".to_owned())]);
    let gone: i64 = redis
        .cmd(&["EXISTS", "sidelock:index", "sidelock:/index"])
        .await;
    assert_eq!(gone, 0, "the old indexes were dropped");

    let lock = a.api().lock("index");
    let grant = lock.acquire(&[("owner", "new")]).await;
    b.api().lock("index").acquire_busy(&[]).await;
    let mut names: Vec<String> = listed(&b).await.into_iter().map(|(_, n)| n).collect();
    names.sort();
    assert_eq!(names, ["held-before", "index"]);
    lock.release(&grant.token).await;
    a.api().lock("held-before").release(&held.token).await;
    everything_else_works(&a, &b).await;
}
