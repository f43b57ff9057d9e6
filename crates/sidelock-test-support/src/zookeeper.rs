//! Real ZooKeeper servers for tests (Debian's `zookeeper` package, Java): a
//! standalone server or an ensemble of three, each member on free loopback
//! ports in its own temp dir, killed and reaped on drop, its log printed when
//! the test fails. Members can be killed and restarted for fault tests, and
//! an ensemble's links between members can go through proxies, so that one
//! member can be cut off from another while both keep running.
//!
//! When Java or the jars are missing the tests fail, naming `scripts/setup.sh`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::free_port;
use crate::process::ChildGuard;
use crate::proxy::CuttingProxy;

/// How long a server may take to answer `ruok` (a cold JVM on a busy machine).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Tries at starting a server before giving up (each on new ports).
const START_ATTEMPTS: u32 = 3;

/// What a member's log says when its port was taken before it bound it.
const PORT_TAKEN: &str = "Address already in use";
/// The server's jar; its manifest names the dependencies.
pub const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";
/// The log binding the package's own scripts use.
const LOG_JARS: &[&str] = &[
    "/usr/share/java/slf4j-log4j12.jar",
    "/usr/share/java/log4j-1.2.jar",
];

fn require() {
    let java = Command::new("sh")
        .arg("-c")
        .arg("command -v java")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        java && Path::new(ZOOKEEPER_JAR).exists(),
        "java or {ZOOKEEPER_JAR} is missing: run scripts/setup.sh (it installs Debian's zookeeper and libcurator-recipes-java)"
    );
}

/// Sends a four-letter word to `ip:port` and returns the answer.
pub fn four_letter_at(ip: &str, port: u16, word: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(
        &format!("{ip}:{port}").parse().ok()?,
        Duration::from_secs(2),
    )
    .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(word.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// Sends a four-letter word to a server on loopback and returns the answer.
pub fn four_letter(port: u16, word: &str) -> Option<String> {
    four_letter_at("127.0.0.1", port, word)
}

/// How often the servers reap empty container nodes unless told otherwise:
/// every second instead of ZooKeeper's minute, so that tests see it.
const QUICK_REAPING: Duration = Duration::from_secs(1);

/// One member: its ports and process.
struct Member {
    id: usize,
    client_port: u16,
    child: Option<ChildGuard>,
}

/// A standalone server (one member) or an ensemble.
pub struct ZkServer {
    /// Dropped first, so they can still print their logs from `dir`.
    members: Vec<Member>,
    dir: TempDir,
    /// The address every member serves clients on.
    ip: String,
    /// How often empty container nodes (an unused lock's node) are reaped.
    reap_every: Duration,
    /// `(from, to, proxy)`: member `from` reaches member `to`'s quorum port
    /// (where a follower talks to its leader) through `proxy`. Empty unless
    /// started by [`ZkServer::ensemble_with_cuttable_links`].
    links: Vec<(usize, usize, CuttingProxy)>,
}

impl ZkServer {
    /// A standalone server; empty container nodes are reaped every second
    /// (ZooKeeper's default: every minute).
    pub async fn start() -> Self {
        Self::start_members(1, "127.0.0.1", QUICK_REAPING, false).await
    }

    /// A standalone server that reaps empty container nodes every minute,
    /// as ZooKeeper does by default: for a test that needs a lock's node to
    /// outlive its last holder for a while.
    pub async fn start_reaping_slowly() -> Self {
        Self::start_members(1, "127.0.0.1", Duration::from_secs(60), false).await
    }

    /// A standalone server serving clients on `ip` (e.g. the host end of a
    /// [`Link`](crate::netns::Link), so a namespace can reach it).
    pub async fn start_on(ip: &str) -> Self {
        Self::start_members(1, ip, QUICK_REAPING, false).await
    }

    /// An ensemble of three.
    pub async fn ensemble() -> Self {
        Self::start_members(3, "127.0.0.1", QUICK_REAPING, false).await
    }

    /// An ensemble of three whose members reach each other's quorum ports
    /// (follower to leader) through proxies, so that [`cut_link`](Self::cut_link)
    /// can cut a follower off from its leader. Elections go direct.
    pub async fn ensemble_with_cuttable_links() -> Self {
        Self::start_members(3, "127.0.0.1", QUICK_REAPING, true).await
    }

    /// Starts `n` members on free ports; again on new ports, up to
    /// [`START_ATTEMPTS`] times, when a member finds its port taken (another
    /// process may bind a port between its choice and the server's bind).
    async fn start_members(n: usize, ip: &str, reap_every: Duration, proxied: bool) -> Self {
        require();
        for attempt in 1..=START_ATTEMPTS {
            match Self::try_start_members(n, ip, reap_every, proxied).await {
                Ok(server) => return server,
                Err(e) if attempt < START_ATTEMPTS && e.contains(PORT_TAKEN) => {
                    eprintln!("{e}\nstarting again on new ports");
                }
                Err(e) => panic!("{e}"),
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    async fn try_start_members(
        n: usize,
        ip: &str,
        reap_every: Duration,
        proxied: bool,
    ) -> Result<Self, String> {
        let dir = tempfile::tempdir().expect("temp dir for ZooKeeper");
        let ports: Vec<(u16, u16, u16)> = (0..n)
            .map(|_| (free_port(), free_port(), free_port()))
            .collect();
        let mut links = Vec::new();
        if proxied {
            for from in 0..n {
                for (to, (_, peer, _)) in ports.iter().enumerate() {
                    if from != to {
                        links.push((from, to, CuttingProxy::start(*peer).await));
                    }
                }
            }
        }
        std::fs::write(
            dir.path().join("log4j.properties"),
            "log4j.rootLogger=INFO, CONSOLE\n\
             log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender\n\
             log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout\n\
             log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} [myid:%X{myid}] - %-5p [%t:%C{1}@%L] - %m%n\n",
        )
        .expect("write log4j.properties");
        let mut members = Vec::new();
        for (i, (client, peer, election)) in ports.iter().enumerate() {
            let id = i + 1;
            let data = dir.path().join(format!("data-{id}"));
            std::fs::create_dir_all(&data).expect("create data dir");
            std::fs::write(data.join("myid"), id.to_string()).expect("write myid");
            let mut cfg = format!(
                "tickTime=200\ninitLimit=50\nsyncLimit=25\ndataDir={}\nclientPort={client}\n\
                 clientPortAddress={ip}\n4lw.commands.whitelist=*\nadmin.enableServer=false\n\
                 minSessionTimeout=400\nmaxSessionTimeout=60000\n\
                 maxClientCnxns=0\n",
                data.display()
            );
            if n > 1 {
                for (j, (_, p, e)) in ports.iter().enumerate() {
                    let p = links
                        .iter()
                        .find(|(from, to, _)| (*from, *to) == (i, j))
                        .map_or(*p, |(_, _, proxy)| proxy.port());
                    cfg.push_str(&format!("server.{}=127.0.0.1:{p}:{e}\n", j + 1));
                }
            }
            let _ = (peer, election);
            std::fs::write(dir.path().join(format!("zoo-{id}.cfg")), cfg).expect("write zoo.cfg");
            members.push(Member {
                id,
                client_port: *client,
                child: None,
            });
        }
        let mut server = Self {
            members,
            dir,
            ip: ip.to_owned(),
            reap_every,
            links,
        };
        for i in 0..n {
            server.launch(i);
        }
        for i in 0..n {
            server.try_wait_ready(i).await?;
        }
        Ok(server)
    }

    fn launch(&mut self, i: usize) {
        let id = self.members[i].id;
        let mut cp = vec![
            self.dir.path().display().to_string(),
            ZOOKEEPER_JAR.to_owned(),
        ];
        cp.extend(LOG_JARS.iter().map(|s| (*s).to_owned()));
        let mut cmd = Command::new("java");
        cmd.args([
            "-Xms32m",
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
        ])
        .arg("-Dzookeeper.jmx.log4j.disable=true")
        // A system property, not a zoo.cfg key (the file's unknown keys become
        // `zookeeper.`-prefixed properties).
        .arg(format!(
            "-Dznode.container.checkIntervalMs={}",
            self.reap_every.as_millis()
        ))
        .arg("-cp")
        .arg(cp.join(":"))
        .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
        .arg(self.dir.path().join(format!("zoo-{id}.cfg")));
        let log = self.dir.path().join(format!("zookeeper-{id}.log"));
        let label = format!("zookeeper #{id} :{}", self.members[i].client_port);
        self.members[i].child = Some(ChildGuard::spawn(cmd, &label, &log, false));
    }

    async fn wait_ready(&mut self, i: usize) {
        if let Err(e) = self.try_wait_ready(i).await {
            panic!("{e}");
        }
    }

    /// Waits until member `i` serves; the reason, with its log, if it
    /// exits first or does not serve within [`READY_TIMEOUT`].
    async fn try_wait_ready(&mut self, i: usize) -> Result<(), String> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let port = self.members[i].client_port;
        loop {
            let (ip, p) = (self.ip.clone(), port);
            let srvr = tokio::task::spawn_blocking(move || four_letter_at(&ip, p, "srvr"))
                .await
                .ok()
                .flatten();
            if srvr.is_some_and(|s| s.contains("Mode:")) {
                return Ok(());
            }
            let child = self.members[i].child.as_mut().expect("member running");
            if child.try_status().is_some() {
                return Err(format!(
                    "ZooKeeper member {} exited at start-up; log:\n{}",
                    i + 1,
                    child.log()
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "ZooKeeper member {} did not serve within {READY_TIMEOUT:?}; log:\n{}",
                    i + 1,
                    child.log()
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `host:port,…` of every member.
    pub fn hosts(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}:{}", self.ip, m.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `zk://…/chroot`.
    pub fn url(&self, chroot: &str) -> String {
        format!("zk://{}{chroot}", self.hosts())
    }

    /// `zk://…/chroot` naming only `members` (their indices).
    pub fn url_of(&self, members: &[usize], chroot: &str) -> String {
        let hosts: Vec<String> = members
            .iter()
            .map(|&i| format!("{}:{}", self.ip, self.members[i].client_port))
            .collect();
        format!("zk://{}{chroot}", hosts.join(","))
    }

    pub fn client_port(&self, i: usize) -> u16 {
        self.members[i].client_port
    }

    /// How many servers the ensemble has (1 for a standalone server).
    pub fn member_count(&self) -> usize {
        self.members.len()
    }

    /// The index of the member that leads the ensemble (0 for a standalone server).
    pub fn leader(&self) -> Option<usize> {
        (0..self.members.len()).find(|&i| {
            self.members[i].child.is_some()
                && four_letter_at(&self.ip, self.members[i].client_port, "srvr")
                    .is_some_and(|s| s.contains("Mode: leader") || s.contains("Mode: standalone"))
        })
    }

    /// Cuts member `from` off from member `to`'s quorum port without a word
    /// (a follower from its leader): what either sends over the link is
    /// lost from now on and neither is told, so the follower serves its
    /// clients until its own read timeout (`syncLimit × tickTime`, 5 s)
    /// while the leader hears nothing of their sessions. Returns how many
    /// connections it cut.
    ///
    /// # Panics
    /// If the ensemble was not started by [`Self::ensemble_with_cuttable_links`].
    pub fn cut_link(&self, from: usize, to: usize) -> usize {
        let (_, _, proxy) = self
            .links
            .iter()
            .find(|(f, t, _)| (*f, *t) == (from, to))
            .expect("an ensemble started with cuttable links");
        proxy.silence_all()
    }

    /// Kills member `i` (SIGKILL) and reaps it.
    pub fn kill(&mut self, i: usize) {
        self.members[i].child = None;
    }

    /// Starts member `i` again and waits until it serves.
    pub async fn restart(&mut self, i: usize) {
        self.launch(i);
        self.wait_ready(i).await;
    }

    /// Runs a four-letter word on member `i`.
    pub fn word(&self, i: usize, word: &str) -> String {
        four_letter_at(&self.ip, self.members[i].client_port, word).unwrap_or_default()
    }

    /// Requests the running members have received from clients so far
    /// (`zk_packets_received` of `mntr`, summed; session pings included).
    /// Each call is one more: the `mntr` itself counts.
    pub fn packets_received(&self) -> u64 {
        (0..self.members.len())
            .filter(|&i| self.members[i].child.is_some())
            .map(|i| {
                let out = self.word(i, "mntr");
                out.lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once('\t')?;
                        (k.trim() == "zk_packets_received").then(|| v.trim().parse::<u64>().ok())?
                    })
                    .unwrap_or_else(|| panic!("zk_packets_received not in mntr output:\n{out}"))
            })
            .sum()
    }
}
