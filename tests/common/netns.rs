//! Network namespaces for partition tests: a [`Netns`] is a namespace of the
//! test's own, joined to the host by veth [`Link`]s that can be cut and
//! healed. Only namespaces and addresses the test creates carry its traffic.
//!
//! Cutting a link takes its host end down: the namespace's end keeps its
//! address and route but loses its carrier, so packets vanish without an
//! error, as in a real partition (no RST, no ICMP).

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Namespaces made by this test process so far (part of their names).
static MADE: AtomicU32 = AtomicU32::new(0);

/// Runs `ip args…`, panicking with its stderr when it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap_or_else(|e| {
        panic!("cannot run `ip` ({e}): run scripts/setup.sh (it installs Debian's iproute2)")
    });
    assert!(
        out.status.success(),
        "ip {} failed (partition tests need root and iproute2; run scripts/setup.sh): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// One veth pair between the host and a namespace, on its own /30.
pub struct Link {
    /// The interface name on the host side.
    host_if: String,
    /// The host side's address.
    pub host_ip: String,
    /// The namespace side's address.
    pub ns_ip: String,
}

/// A network namespace, deleted (with its veth pairs) on drop.
pub struct Netns {
    name: String,
    /// The third octet's base of this namespace's 10.x.y.z addresses.
    subnet: (u8, u8),
    links: u8,
}

impl Netns {
    /// Creates a namespace with its loopback up.
    pub fn create() -> Self {
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // Unique across the parallel test processes of one run.
        let name = format!("sl{}n{n}", pid % 1_000_000);
        let subnet = (
            100 + u8::try_from(pid % 100).expect("< 100"),
            u8::try_from((pid / 100 % 16) * 16 + n % 16).expect("< 256"),
        );
        // A namespace left by a killed earlier run with the same pid.
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        let ns = Self {
            name,
            subnet,
            links: 0,
        };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Adds a veth pair to the host, both ends up and addressed.
    pub fn link(&mut self) -> Link {
        let i = self.links;
        self.links += 1;
        let host_if = format!("{}h{i}", self.name);
        let ns_if = format!("{}p{i}", self.name);
        let (a, b) = self.subnet;
        let base = i * 4;
        let host_ip = format!("10.{a}.{b}.{}", base + 1);
        let ns_ip = format!("10.{a}.{b}.{}", base + 2);
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if, "netns", &self.name,
        ]);
        ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip(&[
            "-n",
            &self.name,
            "addr",
            "add",
            &format!("{ns_ip}/30"),
            "dev",
            &ns_if,
        ]);
        ip(&["-n", &self.name, "link", "set", &ns_if, "up"]);
        Link {
            host_if,
            host_ip,
            ns_ip,
        }
    }

    /// Partitions `link`: nothing crosses it until [`Netns::heal`].
    pub fn cut(&self, link: &Link) {
        ip(&["link", "set", &link.host_if, "down"]);
    }

    /// Undoes [`Netns::cut`].
    pub fn heal(&self, link: &Link) {
        ip(&["link", "set", &link.host_if, "up"]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace deletes the veth pairs with it.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}
