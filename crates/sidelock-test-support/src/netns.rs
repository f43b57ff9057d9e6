//! Network namespaces for partition tests: a process started inside a
//! [`Netns`] reaches the host only through veth links this guard creates, and
//! a test cuts and heals those links to make real network partitions (no
//! mocks, no proxies). Needs root and `ip` (iproute2).
//!
//! ```ignore
//! let ns = Netns::create();
//! let http = ns.link();   // the test talks to the process over this one
//! let data = ns.link();   // the process reaches its backend over this one
//! let sidecar = SidecarBuilder::new(&url).netns(&ns, &http.peer_ip).start().await;
//! ns.cut(&data);          // the backend is unreachable from inside
//! ns.heal(&data);
//! ```
//!
//! Every name and address is unique per test run; dropping the guard deletes
//! the namespace, which removes its links with it.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Runs `ip <args>`, panicking with its stderr on failure.
fn ip(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().unwrap_or_else(|e| {
        panic!("cannot run `ip` ({e}): install it with `apt-get install iproute2`")
    });
    assert!(
        out.status.success(),
        "`ip {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One veth pair between the host and a namespace, on its own /30.
#[derive(Debug, Clone)]
pub struct Link {
    /// The host end's interface and address.
    pub host_if: String,
    pub host_ip: String,
    /// The namespace end's interface and address.
    pub peer_if: String,
    pub peer_ip: String,
}

/// A network namespace with veth links to the host; deleted on drop.
pub struct Netns {
    name: String,
    links: std::sync::Mutex<Vec<Link>>,
}

static SERIAL: AtomicU32 = AtomicU32::new(0);

impl Netns {
    /// Creates a namespace with its loopback up.
    pub fn create() -> Self {
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        let name = format!("sidelock-t{}-{serial}", std::process::id());
        ip(&["netns", "add", &name]);
        let ns = Self {
            name,
            links: std::sync::Mutex::new(Vec::new()),
        };
        ns.exec(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    /// The namespace's name, for `ip netns exec`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The command prefix that runs a program inside the namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    fn exec(&self, args: &[&str]) {
        let mut all = vec!["netns", "exec", &self.name];
        all.extend_from_slice(args);
        ip(&all);
    }

    /// Adds a veth pair: one end on the host, one in the namespace, both up,
    /// addressed on a /30 of 10.0.0.0/8 no interface of the host uses yet.
    pub fn link(&self) -> Link {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let tag = format!(
            "{:x}-{:x}",
            std::process::id() % 0x10000,
            SERIAL.fetch_add(1, Ordering::Relaxed) % 0x100
        );
        let host_if = format!("slh{tag}");
        let peer_if = format!("slp{tag}");
        let used = ip(&["-4", "-o", "addr", "show"]);
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() >> 10)
            ^ std::process::id();
        let (host_ip, peer_ip) = (0..256u32)
            .map(|i| {
                let n = seed.wrapping_add(i * 7919) % 0xfffc;
                let (b, c) = (100 + (n >> 8) % 100, n & 0xff);
                (format!("10.{b}.{c}.1"), format!("10.{b}.{c}.2"))
            })
            .find(|(h, _)| {
                let net = &h[..h.len() - 1];
                !used.contains(net)
            })
            .expect("a free /30 in 10.100.0.0/8..10.199.0.0");
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &peer_if, "netns", &self.name,
        ]);
        ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        self.exec(&[
            "ip",
            "addr",
            "add",
            &format!("{peer_ip}/30"),
            "dev",
            &peer_if,
        ]);
        self.exec(&["ip", "link", "set", &peer_if, "up"]);
        let link = Link {
            host_if,
            host_ip,
            peer_if,
            peer_ip,
        };
        links.push(link.clone());
        link
    }

    /// Sets a sysctl of the namespace's own network stack (`net.ipv4.tcp_wmem`,
    /// say); the host's is unchanged.
    pub fn sysctl(&self, key: &str, value: &str) {
        self.exec(&["sysctl", "-q", "-w", &format!("{key}={value}")]);
    }

    /// Cuts `link`: its namespace end goes down, so nothing crosses it in
    /// either direction (no reset is sent: peers only notice by timeouts).
    pub fn cut(&self, link: &Link) {
        self.exec(&["ip", "link", "set", &link.peer_if, "down"]);
    }

    /// Brings a cut link back.
    pub fn heal(&self, link: &Link) {
        self.exec(&["ip", "link", "set", &link.peer_if, "up"]);
        // Bringing a link down drops its address's routes; `up` restores them.
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace deletes its veth ends, and with them the host ends.
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.name])
            .status();
        let links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        for link in links.iter() {
            let _ = Command::new("ip")
                .args(["link", "delete", &link.host_if])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}
