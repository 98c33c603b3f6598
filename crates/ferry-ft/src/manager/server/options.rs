//! [`ManagerOptions`] and the [`KillHook`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tracing::error;

use crate::access::{Access, ClientTls};

/// What the manager does on `Kill`: called with the request's message.
/// torchft's manager exits the process; see [`exit_on_kill`].
pub type KillHook = Arc<dyn Fn(String) + Send + Sync>;

/// The default [`KillHook`], torchft's behaviour: logs the message and
/// exits the process with status 1.
pub fn exit_on_kill() -> KillHook {
    Arc::new(|msg: String| {
        // The message is the requester's: escaped and bounded.
        error!(
            "got kill request: {}; exiting",
            ferry_wire::PeerText::new(&msg)
        );
        std::process::exit(1)
    })
}

/// A manager's knobs, as torchft's `Manager::new` takes them.
///
/// ```
/// use std::time::Duration;
/// use ferry_ft::manager::ManagerOptions;
///
/// let options = ManagerOptions {
///     quorum_retries: 3,
///     ..ManagerOptions::new("replica_a", "http://lighthouse:29510", "replica_a:29500", 8)
/// }
/// .with_heartbeat_interval(Duration::from_millis(200));
/// assert_eq!(options.world_size, 8);
/// ```
#[derive(Clone)]
pub struct ManagerOptions {
    /// The replica group's id (torchft: `{name}:{uuid}` or a uuid).
    pub replica_id: String,
    /// The lighthouse's address (`http://host:port`, or `host:port`).
    pub lighthouse_addr: String,
    /// The host name the manager advertises in its address (torchft's
    /// `hostname`). Without one: the bound IP, or, bound to an unspecified
    /// address (`0.0.0.0`, `[::]`), the machine's host name.
    pub hostname: Option<String>,
    /// The replica group's store address, handed to the lighthouse.
    pub store_address: String,
    /// Ranks in the replica group: a quorum round starts when this many have
    /// asked.
    pub world_size: u64,
    /// How often to heartbeat to the lighthouse (torchft: 100 ms). Zero is
    /// taken as 1 ms.
    pub heartbeat_interval: Duration,
    /// How long connecting to the lighthouse may take (torchft's Python
    /// `Manager`: 60 s). Also bounds each heartbeat.
    pub connect_timeout: Duration,
    /// How many times a failed lighthouse quorum request is retried before
    /// the ranks are told it failed (torchft: 0).
    pub quorum_retries: u32,
    /// Opaque data sent to the lighthouse with the group (`QuorumMember.data`;
    /// JSON in torchft, empty by default).
    pub data: String,
    /// What `Kill` does; [`exit_on_kill`] by default.
    pub on_kill: KillHook,
    /// Who may connect to this manager: TLS and the allowed client
    /// networks (default: plain text, every client, as torchft).
    pub access: Access,
    /// How to reach a lighthouse serving over TLS: the CA certificate to
    /// trust and the name its certificate carries ([`ClientTls`]; the
    /// address is then `https://host:port` or `host:port`). `None`: plain
    /// text, torchft's default.
    pub lighthouse_tls: Option<ClientTls>,
}

impl fmt::Debug for ManagerOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManagerOptions")
            .field("replica_id", &self.replica_id)
            .field("lighthouse_addr", &self.lighthouse_addr)
            .field("hostname", &self.hostname)
            .field("store_address", &self.store_address)
            .field("world_size", &self.world_size)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("connect_timeout", &self.connect_timeout)
            .field("quorum_retries", &self.quorum_retries)
            .field("data", &self.data)
            .finish_non_exhaustive()
    }
}

impl ManagerOptions {
    /// torchft's defaults for the rest: heartbeat every 100 ms, connect
    /// timeout 60 s, no quorum retries, no data, the hostname from the bound
    /// address, and exit on `Kill`.
    pub fn new(
        replica_id: impl Into<String>,
        lighthouse_addr: impl Into<String>,
        store_address: impl Into<String>,
        world_size: u64,
    ) -> Self {
        Self {
            replica_id: replica_id.into(),
            lighthouse_addr: lighthouse_addr.into(),
            hostname: None,
            store_address: store_address.into(),
            world_size,
            heartbeat_interval: Duration::from_millis(100),
            connect_timeout: Duration::from_secs(60),
            quorum_retries: 0,
            data: String::new(),
            on_kill: exit_on_kill(),
            access: Access::default(),
            lighthouse_tls: None,
        }
    }

    /// Sets [`access`](Self::access).
    pub fn with_access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// Sets [`lighthouse_tls`](Self::lighthouse_tls).
    pub fn with_lighthouse_tls(mut self, tls: ClientTls) -> Self {
        self.lighthouse_tls = Some(tls);
        self
    }

    /// Sets [`hostname`](Self::hostname).
    pub fn with_hostname(mut self, hostname: impl Into<String>) -> Self {
        self.hostname = Some(hostname.into());
        self
    }

    /// Sets [`heartbeat_interval`](Self::heartbeat_interval).
    pub fn with_heartbeat_interval(mut self, heartbeat_interval: Duration) -> Self {
        self.heartbeat_interval = heartbeat_interval;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    pub fn with_connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }

    /// Sets [`quorum_retries`](Self::quorum_retries).
    pub fn with_quorum_retries(mut self, quorum_retries: u32) -> Self {
        self.quorum_retries = quorum_retries;
        self
    }

    /// Sets [`data`](Self::data).
    pub fn with_data(mut self, data: impl Into<String>) -> Self {
        self.data = data.into();
        self
    }

    /// Sets [`on_kill`](Self::on_kill).
    pub fn with_on_kill(mut self, on_kill: impl Fn(String) + Send + Sync + 'static) -> Self {
        self.on_kill = Arc::new(on_kill);
        self
    }
}
