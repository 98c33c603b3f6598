//! Lighthouse options.

use std::time::Duration;

use crate::access::{Access, ClientTls};

/// The lighthouse's knobs, as torchft's `LighthouseOpt` (which spells the
/// durations in milliseconds: `join_timeout_ms`, `quorum_tick_ms`,
/// `heartbeat_timeout_ms`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LighthouseOptions {
    /// Fewest healthy participants a new (non-fast) quorum may have.
    pub min_replicas: u64,
    /// How long to wait for heartbeating replicas that have not joined yet,
    /// counted from the first healthy participant's join (torchft: 60 s).
    pub join_timeout: Duration,
    /// How often the server re-evaluates the quorum while replicas wait
    /// (torchft: 100 ms). Not used by the pure decision itself.
    pub quorum_tick: Duration,
    /// A replica is healthy while its last heartbeat is younger than this
    /// (torchft: 5 s).
    pub heartbeat_timeout: Duration,
    /// Who may connect: TLS and the allowed client networks (default:
    /// plain text, every client, as torchft).
    pub access: Access,
    /// How the dashboard's `Kill` reaches managers serving over TLS (the
    /// CA to trust; their addresses then read `https://`). `None`: plain
    /// text, torchft's default.
    pub manager_tls: Option<ClientTls>,
    /// Host names the dashboard answers to besides its own, for DNS
    /// rebinding's sake: `NAME` (any port) or `NAME:PORT` (that port only),
    /// compared without regard to case. The dashboard always answers IP
    /// addresses, `localhost` and the machine's host name; a request for
    /// any other name (its `Host`) is refused with 421. Add the names a
    /// browser reaches the lighthouse by: a DNS name, a proxy's name.
    pub allowed_hosts: Vec<String>,
}

impl LighthouseOptions {
    /// torchft's defaults with the given `min_replicas` (which torchft
    /// requires on the command line): join timeout 60 s, quorum tick
    /// 100 ms, heartbeat timeout 5 s.
    pub fn new(min_replicas: u64) -> Self {
        Self {
            min_replicas,
            join_timeout: Duration::from_millis(60_000),
            quorum_tick: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_millis(5_000),
            access: Access::default(),
            manager_tls: None,
            allowed_hosts: Vec::new(),
        }
    }

    /// Sets [`access`](Self::access).
    pub fn with_access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// Sets [`manager_tls`](Self::manager_tls).
    pub fn with_manager_tls(mut self, tls: ClientTls) -> Self {
        self.manager_tls = Some(tls);
        self
    }

    /// Adds `name` to [`allowed_hosts`](Self::allowed_hosts).
    pub fn with_allowed_host(mut self, name: impl Into<String>) -> Self {
        self.allowed_hosts.push(name.into());
        self
    }

    /// Sets [`join_timeout`](Self::join_timeout).
    pub fn with_join_timeout(mut self, join_timeout: Duration) -> Self {
        self.join_timeout = join_timeout;
        self
    }

    /// Sets [`quorum_tick`](Self::quorum_tick).
    pub fn with_quorum_tick(mut self, quorum_tick: Duration) -> Self {
        self.quorum_tick = quorum_tick;
        self
    }

    /// Sets [`heartbeat_timeout`](Self::heartbeat_timeout).
    pub fn with_heartbeat_timeout(mut self, heartbeat_timeout: Duration) -> Self {
        self.heartbeat_timeout = heartbeat_timeout;
        self
    }
}
