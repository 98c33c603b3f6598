//! Separate "hosts" on one machine, for cross-host tests.
//!
//! Network namespaces alone do not make two hosts: processes in them still
//! share System V IPC and see each other's pids, so CMA and shared-memory
//! transports could still work between them. A [`Hosts`] set gives every
//! host its own **network, IPC and PID namespaces**, and a UTS namespace
//! (host name `ferry-host-{h}`) and mount namespace (its own `/proc`,
//! `/dev/shm` and `/sys`, whose `/sys/class/net` lists the host's own
//! interfaces) besides, and joins the hosts by
//! veth links with addresses of the test's own ([`SUBNET`]`.{h+1}/24` for
//! host `h`, loopback up in each):
//!
//! - one host: no link, its address on loopback;
//! - two hosts: one veth pair, one end in each host;
//! - three or more: a veth pair from each host to a bridge in a namespace
//!   of its own (the "switch").
//!
//! Each host's namespaces are held by an *anchor*: `unshare --net --ipc
//! --pid --fork --kill-child` running a shell that waits on a pipe from the
//! test process. The shell is PID 1 of the host's PID namespace. Processes
//! are placed on a host with `nsenter` into the anchor's namespaces
//! ([`Hosts::enter`]). Nothing is named in the file system (no `ip netns
//! add`), so nothing outlives the set:
//!
//! - dropping [`Hosts`] (also while a failing test unwinds) kills the
//!   anchors; the kernel then kills every process of each host's PID
//!   namespace, frees the namespaces and, with them, every veth link and the
//!   bridge;
//! - if the test process dies without unwinding (a signal), the anchors'
//!   pipe closes, their shells exit, and the same follows.
//!
//! Interface names are the same in every host ([`LINK`]); they never meet,
//! since each link is created directly in its namespace. Sets made by
//! tests running in parallel are therefore independent.
//!
//! [`availability`] says precisely why hosts cannot be made here (not
//! root, a missing tool, namespaces refused); tests print `SKIPPED` with
//! that reason (see [`crate::world_on_hosts`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::Ipv4Addr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;

/// The first three octets of the hosts' addresses: host `h` has
/// `10.77.1.{h+1}/24` (each set in namespaces of its own, so sets made at
/// once never meet).
pub const SUBNET: [u8; 3] = [10, 77, 1];

/// Most hosts one set holds (addresses `.1` to `.250`).
pub const MAX_HOSTS: usize = 250;

/// The name of each host's link to the others.
pub const LINK: &str = "ferry0";

/// How long [`Hosts::create`] waits for each host's link to be up.
const LINK_UP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// The bridge's name in the switch namespace (three hosts or more).
const BRIDGE: &str = "br0";

/// The shell a host's anchor runs (`$1`: the host name): it names the host,
/// gives it a `/dev/shm` of its own, says it is up, then waits for its
/// stdin to close (the test process dropping the set, or dying).
///
/// It also mounts a `/sys` of its own: sysfs shows the network devices of
/// the namespace it was mounted in, so the machine's `/sys/class/net`
/// would list the machine's interfaces, not the host's. Programs that
/// enumerate interfaces there (UCX's TCP transport does, then checks each
/// in the current namespace) would otherwise find only `lo` on a host and
/// never its link.
const HOST_SCRIPT: &str = "echo \"$1\" > /proc/sys/kernel/hostname && \
     { [ ! -d /dev/shm ] || mount -t tmpfs -o mode=1777 tmpfs /dev/shm; } && \
     mount -t sysfs -o ro sysfs /sys && \
     echo ready && read _";

/// The shell the switch's anchor runs.
const SWITCH_SCRIPT: &str = "echo ready; read _";

/// The namespaces each host has of its own (`unshare` flags; the mount
/// namespace gets the host's own `/proc` and `/dev/shm`).
const HOST_NAMESPACES: &[&str] = &[
    "--net",
    "--ipc",
    "--pid",
    "--uts",
    "--mount",
    "--fork",
    "--kill-child",
    "--mount-proc",
];

/// Why a set of hosts could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostsError {
    /// This machine or process cannot make hosts at all: the tests that
    /// need them skip, saying this reason.
    #[error("separate hosts cannot be made here: {0}")]
    Unavailable(String),
    /// A step of the set-up failed although hosts can be made here: a test
    /// failure.
    #[error("setting up the hosts failed at `{step}`: {reason}")]
    Setup {
        /// The command that failed.
        step: String,
        /// What it said (its standard error, or why it could not run).
        reason: String,
    },
    /// A set holds from 1 to [`MAX_HOSTS`] hosts.
    #[error("invalid number of hosts {0}: a set holds from 1 to {MAX_HOSTS}")]
    Count(usize),
}

/// Whether this process can make hosts, and if not, precisely why: it
/// lacks `CAP_SYS_ADMIN` or `CAP_NET_ADMIN` (not root), `ip` (iproute2) or
/// `unshare`/`nsenter` (util-linux) are missing, or the kernel refuses the
/// namespaces a host gets (e.g. `EPERM` in a container). Checked once per
/// process.
pub fn availability() -> Result<(), HostsError> {
    static CHECK: OnceLock<Result<(), String>> = OnceLock::new();
    CHECK
        .get_or_init(check)
        .clone()
        .map_err(HostsError::Unavailable)
}

fn check() -> Result<(), String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("cannot read /proc/self/status: {e}"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .unwrap_or_default()
            .to_string()
    };
    let euid = field("Uid:")
        .split_whitespace()
        .nth(1)
        .unwrap_or("?")
        .to_string();
    let caps = u64::from_str_radix(&field("CapEff:"), 16).unwrap_or(0);
    const CAP_NET_ADMIN: u32 = 12;
    const CAP_SYS_ADMIN: u32 = 21;
    let missing: Vec<&str> = [
        (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"),
        (CAP_NET_ADMIN, "CAP_NET_ADMIN"),
    ]
    .iter()
    .filter(|(bit, _)| caps & (1 << bit) == 0)
    .map(|(_, name)| *name)
    .collect();
    if !missing.is_empty() {
        return Err(format!(
            "this process (euid {euid}) lacks {}: making namespaces and veth links needs root",
            missing.join(" and ")
        ));
    }
    for (tool, arg, package) in [
        ("ip", "-V", "iproute2"),
        ("unshare", "--version", "util-linux"),
        ("nsenter", "--version", "util-linux"),
    ] {
        match Command::new(tool).arg(arg).output() {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                return Err(format!(
                    "`{tool} {arg}` failed ({}): {}",
                    o.status,
                    String::from_utf8_lossy(&o.stderr).trim()
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(format!("no `{tool}` on PATH (install {package})"))
            }
            Err(e) => return Err(format!("cannot run `{tool}`: {e}")),
        }
    }
    // The namespaces a host gets, as it gets them.
    let probe: Vec<&str> = HOST_NAMESPACES.iter().copied().chain(["true"]).collect();
    let out = Command::new("unshare")
        .args(&probe)
        .output()
        .map_err(|e| format!("cannot run `unshare`: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`unshare {}` failed: {}",
            probe.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// A process holding namespaces until it is dropped.
struct Anchor {
    child: Child,
    /// Closing it ends the anchor's shell.
    stdin: Option<ChildStdin>,
}

impl Anchor {
    /// Starts `unshare <flags> sh -c <script> anchor <args>` and waits until
    /// its shell runs inside the new namespaces and says `ready`.
    fn start(flags: &[&str], script: &str, args: &[&str]) -> Result<Anchor, HostsError> {
        let step = format!(
            "unshare {} sh -c '{script}' anchor {}",
            flags.join(" "),
            args.join(" ")
        );
        let setup = |reason: String| HostsError::Setup {
            step: step.clone(),
            reason,
        };
        let mut child = Command::new("unshare")
            .args(flags)
            .args(["sh", "-c", script, "anchor"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| setup(format!("cannot run it: {e}")))?;
        let stdin = child.stdin.take();
        let mut line = String::new();
        let read = child
            .stdout
            .take()
            .map(|out| BufReader::new(out).read_line(&mut line));
        let mut anchor = Anchor { child, stdin };
        if line.trim() != "ready" {
            // It exited before its shell ran: what did it say?
            anchor.stdin = None;
            let _ = anchor.child.wait();
            let mut err = String::new();
            if let Some(mut e) = anchor.child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            return Err(setup(match read {
                Some(Err(e)) => format!("cannot read its output: {e}"),
                _ => format!("it exited before its shell ran: {}", err.trim()),
            }));
        }
        Ok(anchor)
    }

    /// The anchor's namespace of `kind` (`net`, `ipc`, `uts`, `mnt`,
    /// `pid_for_children`).
    fn ns(&self, kind: &str) -> String {
        format!("/proc/{}/ns/{kind}", self.child.id())
    }

    /// The pid `ip link ... netns <pid>` moves a link into.
    fn pid(&self) -> String {
        self.child.id().to_string()
    }
}

impl Drop for Anchor {
    fn drop(&mut self) {
        self.stdin = None;
        // `--kill-child`: the shell (the host's PID 1) dies with `unshare`,
        // and every process of its PID namespace with it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The host name of host `h`.
fn host_name(h: usize) -> String {
    format!("ferry-host-{h}")
}

/// Runs `program args` and maps a failure to [`HostsError::Setup`];
/// `input` is written to its stdin (for `ip -batch -`).
fn run(program: &str, args: &[&str], input: Option<&str>) -> Result<(), HostsError> {
    let step = format!("{program} {}", args.join(" "));
    tracing::debug!(%step, input = input.unwrap_or_default(), "hosts set-up");
    let setup = |reason: String| HostsError::Setup {
        step: step.clone(),
        reason,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| setup(format!("cannot run it: {e}")))?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin
            .write_all(text.as_bytes())
            .map_err(|e| setup(format!("cannot write its input: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| setup(format!("cannot wait for it: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        Err(setup(format!("{} ({})", stderr, out.status)))
    }
}

/// Hosts with their own network, IPC and PID namespaces, linked by veth;
/// all removed on drop. See the [module](self) documentation.
pub struct Hosts {
    hosts: Vec<Anchor>,
    /// The bridge's namespace, with three hosts or more.
    switch: Option<Anchor>,
}

impl std::fmt::Debug for Hosts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hosts")
            .field("count", &self.hosts.len())
            .field(
                "anchors",
                &self.hosts.iter().map(Anchor::pid).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Hosts {
    /// Makes `count` hosts and links them. [`HostsError::Unavailable`]
    /// (from [`availability`]) means this machine cannot; any other error is
    /// a failed step, and whatever was made is removed again.
    pub fn create(count: usize) -> Result<Hosts, HostsError> {
        if count == 0 || count > MAX_HOSTS {
            return Err(HostsError::Count(count));
        }
        availability()?;
        let mut set = Hosts {
            hosts: Vec::with_capacity(count),
            switch: None,
        };
        for h in 0..count {
            let name = host_name(h);
            set.hosts
                .push(Anchor::start(HOST_NAMESPACES, HOST_SCRIPT, &[&name])?);
        }
        if count == 2 {
            let [a, b] = [set.hosts[0].pid(), set.hosts[1].pid()];
            run(
                "ip",
                &[
                    "link", "add", LINK, "netns", &a, "type", "veth", "peer", "name", LINK,
                    "netns", &b,
                ],
                None,
            )?;
        } else if count > 2 {
            let switch = Anchor::start(&["--net"], SWITCH_SCRIPT, &[])?;
            let net = format!("--net={}", switch.ns("net"));
            let mut script = format!("link add {BRIDGE} type bridge\nlink set {BRIDGE} up\n");
            for (h, host) in set.hosts.iter().enumerate() {
                let port = format!("host{h}");
                run(
                    "ip",
                    &[
                        "link",
                        "add",
                        LINK,
                        "netns",
                        &host.pid(),
                        "type",
                        "veth",
                        "peer",
                        "name",
                        &port,
                        "netns",
                        &switch.pid(),
                    ],
                    None,
                )?;
                script.push_str(&format!(
                    "link set {port} master {BRIDGE}\nlink set {port} up\n"
                ));
            }
            run("nsenter", &[&net, "ip", "-batch", "-"], Some(&script))?;
            set.switch = Some(switch);
        }
        for h in 0..count {
            let net = format!("--net={}", set.hosts[h].ns("net"));
            let mut script = "link set lo up\n".to_string();
            if count > 1 {
                script.push_str(&format!(
                    "addr add {}/24 dev {LINK}\nlink set {LINK} up\n",
                    set.address(h)
                ));
            } else {
                // A lone host still has its address (on loopback).
                script.push_str(&format!("addr add {}/32 dev lo\n", set.address(h)));
            }
            run("nsenter", &[&net, "ip", "-batch", "-"], Some(&script))?;
        }
        if count > 1 {
            for h in 0..count {
                set.wait_link_running(h)?;
            }
        }
        tracing::debug!(hosts = ?set, "hosts ready");
        Ok(set)
    }

    /// Waits until host `host`'s link is operationally up (`state UP`:
    /// the kernel reports it `IFF_RUNNING`). A veth end becomes so
    /// asynchronously after `ip link set up` (the kernel's link watch), and
    /// programs that look for running interfaces when they start (UCX's
    /// TCP transport) would otherwise find only `lo` on a loaded machine.
    /// Woken by `ip monitor link` in the host's network namespace, with
    /// the state checked again at each event (and every 50 ms, should the
    /// monitor have subscribed after the change); [`LINK_UP_DEADLINE`] at
    /// most.
    fn wait_link_running(&self, host: usize) -> Result<(), HostsError> {
        let net = format!("--net={}", self.hosts[host].ns("net"));
        let step = format!("nsenter {net} ip -o monitor link (waiting for {LINK} to be up)");
        let setup = |reason: String| HostsError::Setup {
            step: step.clone(),
            reason,
        };
        let is_up = || -> Result<bool, HostsError> {
            let out = Command::new("nsenter")
                .args([&net, "ip", "-o", "link", "show", "dev", LINK])
                .output()
                .map_err(|e| setup(format!("cannot run `ip link show`: {e}")))?;
            Ok(String::from_utf8_lossy(&out.stdout).contains("state UP"))
        };
        let mut monitor = Command::new("nsenter")
            .args([&net, "ip", "-o", "monitor", "link"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| setup(format!("cannot run it: {e}")))?;
        let (tx, rx) = std::sync::mpsc::channel();
        if let Some(out) = monitor.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    if line.is_err() || tx.send(()).is_err() {
                        return;
                    }
                }
            });
        }
        let deadline = std::time::Instant::now() + LINK_UP_DEADLINE;
        let result = loop {
            match is_up() {
                Ok(true) => break Ok(()),
                Ok(false) => {}
                Err(e) => break Err(e),
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                break Err(setup(format!(
                    "{LINK} on host {host} was not up within {LINK_UP_DEADLINE:?}"
                )));
            }
            // An event, the tick, or the monitor's end: check again.
            let _ = rx.recv_timeout((deadline - now).min(std::time::Duration::from_millis(50)));
        };
        let _ = monitor.kill();
        let _ = monitor.wait();
        result
    }

    /// How many hosts the set holds.
    pub fn count(&self) -> usize {
        self.hosts.len()
    }

    /// Host `host`'s address on the link ([`SUBNET`]`.{host+1}`).
    ///
    /// # Panics
    /// If `host` is not below [`count`](Self::count).
    pub fn address(&self, host: usize) -> Ipv4Addr {
        assert!(host < self.hosts.len(), "no host {host} in {self:?}");
        let [a, b, c] = SUBNET;
        Ipv4Addr::new(a, b, c, host as u8 + 1)
    }

    /// The command prefix that runs a program on host `host`: `nsenter`
    /// into its network, IPC, PID, UTS and mount namespaces, keeping this
    /// process's working directory (the program then runs as a process of
    /// that host, not as its PID 1).
    ///
    /// # Panics
    /// If `host` is not below [`count`](Self::count).
    pub fn enter(&self, host: usize) -> Vec<String> {
        assert!(host < self.hosts.len(), "no host {host} in {self:?}");
        let a = &self.hosts[host];
        let mut prefix = vec![
            "nsenter".into(),
            format!("--net={}", a.ns("net")),
            format!("--ipc={}", a.ns("ipc")),
            format!("--uts={}", a.ns("uts")),
            format!("--mount={}", a.ns("mnt")),
            format!("--pid={}", a.ns("pid_for_children")),
        ];
        // Entering a mount namespace moves to its root directory.
        if let Ok(dir) = std::env::current_dir() {
            prefix.push(format!("--wd={}", dir.display()));
        }
        prefix.push("--".into());
        prefix
    }

    /// Host `host`'s host name (`ferry-host-{host}`).
    pub fn name(&self, host: usize) -> String {
        host_name(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `sh -c script` on `host` and returns its stdout.
    fn on(hosts: &Hosts, host: usize, script: &str) -> String {
        let prefix = hosts.enter(host);
        let out = Command::new(&prefix[0])
            .args(&prefix[1..])
            .args(["sh", "-c", script])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    fn hosts_or_skip(count: usize, test: &str) -> Option<Hosts> {
        match Hosts::create(count) {
            Ok(h) => Some(h),
            Err(why @ HostsError::Unavailable(_)) => {
                println!("SKIPPED {test}: {why}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn a_host_count_out_of_range_is_refused() {
        assert_eq!(Hosts::create(0).unwrap_err(), HostsError::Count(0));
        assert_eq!(
            Hosts::create(MAX_HOSTS + 1).unwrap_err().to_string(),
            "invalid number of hosts 251: a set holds from 1 to 250"
        );
    }

    /// Every host has namespaces of its own, its address on the link, and
    /// no other host's; dropping the set ends every process on it.
    fn hosts_are_separate(count: usize, test: &str) {
        let Some(hosts) = hosts_or_skip(count, test) else {
            return;
        };
        let ns = |h: usize| {
            on(
                &hosts,
                h,
                "readlink /proc/self/ns/net /proc/self/ns/ipc /proc/self/ns/pid \
                 /proc/self/ns/uts /proc/self/ns/mnt",
            )
        };
        let mine = ns_of_self();
        let seen: Vec<String> = (0..count).map(ns).collect();
        for (h, s) in seen.iter().enumerate() {
            let kinds: Vec<&str> = s.lines().collect();
            assert_eq!(kinds.len(), 5, "{s}");
            for (k, id) in kinds.iter().enumerate() {
                assert_ne!(*id, mine[k], "host {h} shares the test's namespace {id}");
                for (o, other) in seen.iter().enumerate().filter(|(o, _)| *o != h) {
                    assert_ne!(
                        *id,
                        other.lines().nth(k).unwrap(),
                        "hosts {h} and {o} share a namespace"
                    );
                }
            }
            let addrs = on(&hosts, h, &format!("ip -4 -o addr show dev {LINK}"));
            assert!(
                addrs.contains(&format!("{}/24", hosts.address(h))),
                "{addrs}"
            );
            assert!(on(&hosts, h, "ip -o link show lo").contains("UP"));
            // Its own sysfs: the host's interfaces, not the machine's.
            assert_eq!(
                on(&hosts, h, "ls /sys/class/net"),
                format!("{LINK}\nlo"),
                "host {h}"
            );
            assert_eq!(
                on(&hosts, h, "cat /proc/sys/kernel/hostname"),
                hosts.name(h)
            );
            // Its own /proc: only the host's processes (its anchor, `sh`, `ls` and `wc`).
            let pids = on(&hosts, h, "ls -d /proc/[0-9]* | wc -l");
            assert!(pids.parse::<u32>().unwrap() <= 4, "{pids} processes seen");
        }
        // A process on host 0 outlives nothing: the drop ends it.
        let prefix = hosts.enter(0);
        let mut sleeper = Command::new(&prefix[0])
            .args(&prefix[1..])
            .args(["sleep", "1000"])
            .spawn()
            .unwrap();
        drop(hosts);
        let status = sleeper.wait().unwrap();
        assert!(!status.success(), "{status}");
    }

    fn ns_of_self() -> Vec<String> {
        ["net", "ipc", "pid", "uts", "mnt"]
            .iter()
            .map(|k| {
                std::fs::read_link(format!("/proc/self/ns/{k}"))
                    .unwrap()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    }

    #[test]
    fn a_lone_host_has_its_address_on_loopback() {
        let Some(hosts) = hosts_or_skip(1, "a_lone_host_has_its_address_on_loopback") else {
            return;
        };
        let addrs = on(&hosts, 0, "ip -4 -o addr show dev lo");
        assert!(addrs.contains("10.77.1.1/32"), "{addrs}");
    }

    #[test]
    fn two_hosts_on_a_veth_pair_are_separate() {
        hosts_are_separate(2, "two_hosts_on_a_veth_pair_are_separate");
    }

    #[test]
    fn three_hosts_on_a_bridge_are_separate() {
        hosts_are_separate(3, "three_hosts_on_a_bridge_are_separate");
    }

    /// Every host routes to every other over its link, and has no route
    /// out of the set. (TCP between hosts: `tests/hosts.rs`.)
    #[test]
    fn hosts_route_to_each_other_and_nowhere_else() {
        let Some(hosts) = hosts_or_skip(3, "hosts_route_to_each_other_and_nowhere_else") else {
            return;
        };
        for (from, to) in [(0, 1), (1, 2), (2, 0)] {
            let route = on(
                &hosts,
                from,
                &format!("ip -o route get {}", hosts.address(to)),
            );
            assert!(route.contains(&format!("dev {LINK}")), "{route}");
        }
        // No way out of the set: no default route.
        let routes = on(&hosts, 0, "ip -o route show");
        assert!(!routes.contains("default"), "{routes}");
    }
}
