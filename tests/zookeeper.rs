//! ZooKeeper-specific behaviour against real servers: no herd on release,
//! session expiry, a leader failure in an ensemble, and interop with Apache
//! Curator's `InterProcessMutex`. Everything the backends share is in
//! `conformance.rs`.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::zookeeper::ZkServer;
use common::{SidecarBuilder, SidecarGuard, unique_name};
use nix::sys::signal::Signal;
use reqwest::StatusCode;

async fn sidecar(url: &str) -> SidecarGuard {
    SidecarBuilder::new(url).start().await
}

/// A figure from `mntr`.
fn mntr(server: &ZkServer, i: usize, name: &str) -> u64 {
    let out = server.word(i, "mntr");
    out.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in mntr output:\n{out}"))
}

#[tokio::test]
async fn one_release_fires_one_watch_among_200_waiters() {
    let server = ZkServer::start().await;
    let url = server.url("/herd");
    let a = sidecar(&url).await;
    let name = unique_name("herd");
    let lock = a.api().lock(&name);
    let holder = lock.acquire(&[("owner", "holder"), ("ttl", "5m")]).await;

    let mut waiters = Vec::new();
    for i in 0..200 {
        let lock = a.api().lock(&name);
        waiters.push(tokio::spawn(async move {
            let owner = format!("w{i}");
            lock.acquire_raw(&[("owner", &owner), ("wait", "2m"), ("ttl", "5m")])
                .await
                .status()
        }));
    }
    let queued = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let s = lock.inspect().await;
            if s.waiters.len() == 200 {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("200 waiters queue");
    let first = queued.waiter_owners()[0].to_owned();
    tokio::time::sleep(Duration::from_millis(500)).await;

    let deleted = mntr(&server, 0, "zk_sum_node_deleted_watch_count");
    let children = mntr(&server, 0, "zk_sum_node_children_watch_count");
    lock.release(&holder.token).await;
    // Exactly one waiter is granted.
    let state = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let s = lock.inspect().await;
            if s.holders.len() == 1 && s.waiters.len() == 199 {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the next waiter is granted");
    assert_eq!(state.holder_owners(), [first.as_str()]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fired = mntr(&server, 0, "zk_sum_node_deleted_watch_count") - deleted
        + (mntr(&server, 0, "zk_sum_node_children_watch_count") - children);
    assert_eq!(fired, 1, "one release must fire exactly one watch");
    drop(waiters);
}

#[tokio::test]
async fn an_expired_session_loses_its_holds_and_the_sidecar_recovers() {
    let server = ZkServer::start().await;
    let short = format!("{}?session_timeout=1s", server.url("/expiry"));
    let a = sidecar(&short).await;
    let b = sidecar(&server.url("/expiry")).await;
    let name = unique_name("expiry");
    let mut held = a
        .api()
        .lock(&name)
        .hold(&[("owner", "a"), ("ttl", "3s")])
        .await;
    held.expect_acquired().await;
    let mut waiting = b
        .api()
        .lock(&name)
        .hold(&[("owner", "b"), ("ttl", "30s"), ("wait", "1m")])
        .await;
    waiting.expect_queued().await;

    // Freeze sidecar A past its session timeout: the server expires the session.
    a.signal(Signal::SIGSTOP);
    let granted = waiting
        .expect_acquired_within(Duration::from_secs(20))
        .await;
    a.signal(Signal::SIGCONT);
    assert_eq!(granted.owner, "b");
    held.expect_lost_within(Duration::from_secs(20)).await;

    // A opens a new session and serves again.
    let other = unique_name("after");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = a.api().lock(&other).acquire_raw(&[("owner", "a2")]).await;
        if r.status() == StatusCode::OK {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "sidecar A did not recover: {}",
            r.status()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let state = b.api().lock(&name).inspect().await;
    assert_eq!(state.holder_owners(), ["b"]);
}

#[tokio::test]
async fn killing_the_leader_keeps_locks_exclusive_and_waiting_resumes() {
    let mut server = ZkServer::ensemble().await;
    let url = server.url("/ensemble");
    let a = sidecar(&url).await;
    let b = sidecar(&url).await;
    let name = unique_name("leader");
    let holder = a
        .api()
        .lock(&name)
        .acquire(&[("owner", "a"), ("ttl", "2m")])
        .await;
    let mut waiting = b
        .api()
        .lock(&name)
        .hold(&[("owner", "b"), ("ttl", "30s"), ("wait", "2m")])
        .await;
    waiting.expect_queued().await;

    let leader = server.leader().expect("a leader");
    server.kill(leader);
    // A new leader is elected; the holder still holds and the waiter waits.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let state = loop {
        let r = b
            .api()
            .lock(&name)
            .api()
            .get(&["v1", "locks", &name], &[])
            .await;
        if r.status() == StatusCode::OK {
            break r.json::<serde_json::Value>().await.expect("json");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no recovery: {}",
            r.status()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        state["holders"].as_array().map(Vec::len),
        Some(1),
        "{state}"
    );
    assert_eq!(state["holders"][0]["owner"], "a", "{state}");
    let busy = b
        .api()
        .lock(&name)
        .acquire_raw(&[("owner", "c")])
        .await
        .status();
    assert_eq!(busy, StatusCode::CONFLICT);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = a.api().lock(&name).release_raw(&holder.token).await;
        if r.status() == StatusCode::OK {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "release failed: {}",
            r.status()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let granted = waiting
        .expect_acquired_within(Duration::from_secs(30))
        .await;
    assert_eq!(granted.owner, "b");
    assert!(granted.fence > holder.fence);
    server.restart(leader).await;
}

const CURATOR_JARS: &[&str] = &[
    "/usr/share/java/curator-recipes.jar",
    "/usr/share/java/curator-framework.jar",
    "/usr/share/java/curator-client.jar",
    "/usr/share/java/guava.jar",
    "/usr/share/java/zookeeper.jar",
    "/usr/share/java/slf4j-api.jar",
    "/usr/share/java/slf4j-nop.jar",
];

const MUTEX_JAVA: &str = r#"
import java.io.*;
import org.apache.curator.framework.*;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.RetryOneTime;

public class Mutex {
    public static void main(String[] args) throws Exception {
        CuratorFramework c = CuratorFrameworkFactory.newClient(args[0], new RetryOneTime(100));
        c.start();
        c.blockUntilConnected();
        InterProcessMutex m = new InterProcessMutex(c, args[1]);
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        System.out.println("READY");
        System.out.flush();
        String line;
        while ((line = in.readLine()) != null) {
            if (line.equals("try")) {
                System.out.println(m.acquire(0, java.util.concurrent.TimeUnit.MILLISECONDS) ? "ACQUIRED" : "BUSY");
            } else if (line.equals("acquire")) {
                m.acquire();
                System.out.println("ACQUIRED");
            } else if (line.equals("release")) {
                m.release();
                System.out.println("RELEASED");
            } else if (line.equals("quit")) {
                break;
            }
            System.out.flush();
        }
        c.close();
    }
}
"#;

struct Curator {
    child: std::process::Child,
    out: std::sync::mpsc::Receiver<String>,
}

impl Curator {
    fn start(dir: &std::path::Path, connect: &str, path: &str) -> Self {
        let cp = format!("{}:{}", dir.display(), CURATOR_JARS.join(":"));
        let mut child = Command::new("java")
            .args(["-cp", &cp, "Mutex", connect, path])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("run java");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, out) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut me = Self { child, out };
        assert_eq!(me.line(), "READY");
        me
    }

    fn send(&mut self, cmd: &str) {
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{cmd}").expect("write to java");
        stdin.flush().expect("flush");
    }

    fn line(&mut self) -> String {
        self.out
            .recv_timeout(Duration::from_secs(30))
            .expect("the Curator program answers within 30 s")
    }

    fn no_line_within(&mut self, d: Duration) {
        assert!(self.out.recv_timeout(d).is_err(), "Curator did not wait");
    }
}

impl Drop for Curator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// The Curator program is read with blocking calls: keep a worker free for HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_interprocess_mutex_and_sidelock_exclude_each_other() {
    for jar in CURATOR_JARS {
        assert!(
            std::path::Path::new(jar).exists(),
            "{jar} is missing: run scripts/setup.sh (it installs Debian's libcurator-recipes-java and zookeeper)"
        );
    }
    let server = ZkServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("Mutex.java"), MUTEX_JAVA).expect("write Mutex.java");
    let javac = Command::new("javac")
        .args(["-cp", &CURATOR_JARS.join(":"), "-d"])
        .arg(dir.path())
        .arg(dir.path().join("Mutex.java"))
        .output()
        .expect("javac is installed (scripts/setup.sh installs a JDK)");
    assert!(
        javac.status.success(),
        "javac failed: {}",
        String::from_utf8_lossy(&javac.stderr)
    );

    let a = sidecar(&server.url("/interop")).await;
    let name = unique_name("curator");
    let lock = a.api().lock(&name);
    let path = format!("/interop/sidelock/locks/{name}");
    let hosts = server.hosts();
    let classes = dir.path().to_owned();
    let mut curator =
        tokio::task::spawn_blocking(move || (Curator::start(&classes, &hosts, &path), ()))
            .await
            .expect("start curator");

    // Curator holds: sidelock is refused, then waits and is granted after Curator releases.
    curator.0.send("acquire");
    assert_eq!(curator.0.line(), "ACQUIRED");
    let busy = lock.acquire_raw(&[("owner", "s1")]).await;
    assert_eq!(busy.status(), StatusCode::CONFLICT);
    let mut waiting = lock.hold(&[("owner", "s1"), ("wait", "1m")]).await;
    waiting.expect_queued().await;
    curator.0.send("release");
    assert_eq!(curator.0.line(), "RELEASED");
    let grant = waiting
        .expect_acquired_within(Duration::from_secs(20))
        .await;
    assert_eq!(grant.owner, "s1");

    // sidelock holds: Curator is refused, then waits and is granted after sidelock releases.
    curator.0.send("try");
    assert_eq!(curator.0.line(), "BUSY");
    curator.0.send("acquire");
    curator.0.no_line_within(Duration::from_millis(500));
    drop(waiting); // closing the hold stream releases at once
    assert_eq!(curator.0.line(), "ACQUIRED");
    let busy = lock.acquire_raw(&[("owner", "s2")]).await;
    assert_eq!(busy.status(), StatusCode::CONFLICT);
    curator.0.send("release");
    assert_eq!(curator.0.line(), "RELEASED");
    curator.0.send("quit");
}
