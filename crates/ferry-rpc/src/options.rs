//! How an agent is configured: from `MASTER_ADDR`, `MASTER_PORT`, `RANK`,
//! `WORLD_SIZE` like PyTorch, or explicitly.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use ferry_transport::auth::Secret;
use ferry_transport::{channel, Allocator, ChannelConfig, Keepalive, RawAllocator};
use ferry_wire::{ChannelOffer, Limits, MessageKind, TransportOffer};

use crate::service::{Hooks, Interceptor, Service};
use crate::store::Store;
use crate::topology::LocalTopology;
use crate::torchelastic::TorchElastic;
use crate::{Functions, RpcError};

/// Default per-call timeout (PyTorch's default is 60 s too).
pub const DEFAULT_RPC_TIMEOUT: Duration = Duration::from_secs(60);
/// Default bound on rendezvous and on graceful shutdown without progress.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(120);
/// Default bound on the wait for an incoming connection's first message
/// (as long as [`AUTH_TIMEOUT`](ferry_transport::auth::AUTH_TIMEOUT)).
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Options of one worker's agent.
#[derive(Clone)]
pub struct RpcOptions {
    /// This worker's name (unique in the group).
    pub name: String,
    /// This worker's rank, `0..world_size`.
    pub rank: u32,
    /// Number of workers.
    pub world_size: u32,
    /// Where this worker sits on its host, as torchrun says it
    /// (`LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`); by default the
    /// whole group on one host.
    pub local: LocalTopology,
    /// Address of the rendezvous store, hosted by rank 0.
    pub master_addr: SocketAddr,
    /// IP this worker listens on for RPC (port chosen by the OS): by
    /// default only the address of the interface `MASTER_ADDR` routes
    /// through (loopback when `MASTER_ADDR` is); `0.0.0.0` binds every
    /// interface ([`listen_ip`](Self::listen_ip), `FERRY_LISTEN_IP`).
    pub listen_ip: IpAddr,
    /// Default per-call timeout; zero means none.
    pub rpc_timeout: Duration,
    /// Bound on rendezvous and connecting to peers, and on graceful
    /// shutdown without progress unless
    /// [`shutdown_timeout`](Self::shutdown_timeout) is set.
    pub init_timeout: Duration,
    /// Bound on graceful shutdown ([`Agent::shutdown`](crate::Agent::shutdown))
    /// without progress: each wait for the other workers' shutdown records,
    /// for this worker's calls to end, for a store operation and for each
    /// layer's shutdown hook. A worker that does not take part and is not
    /// known gone ends shutdown with [`RpcError::Absent`] after it; rank 0
    /// may wait once more as long for the others to learn it. `None` (the
    /// default) takes `init_timeout`. Not zero. `FERRY_SHUTDOWN_TIMEOUT_MS`
    /// sets it from the environment.
    pub shutdown_timeout: Option<Duration>,
    /// How long an incoming connection may take to send its first message
    /// (its Ferry handshake frame, or with a secret its authentication
    /// `Hello`) before it is dropped, whatever `init_timeout` says: an
    /// outsider that connects and stays silent holds a socket no longer.
    /// A peer offering UCX creates its UCX worker before it sends its
    /// handshake, within this too. What follows (authentication, channel
    /// set-up) has its own bounds. Must not be zero. Default
    /// [`DEFAULT_HANDSHAKE_TIMEOUT`].
    pub handshake_timeout: Duration,
    /// TCP keepalive and `TCP_USER_TIMEOUT` on connections to peers, so
    /// that a partition fails calls with `PeerUnreachable` within bounds.
    pub keepalive: Keepalive,
    /// Worker threads of the agent's runtime.
    pub io_threads: usize,
    /// The remote functions this worker serves.
    pub functions: Functions,
    /// Services and interceptors of the layers above.
    pub hooks: Hooks,
    /// Channels offered, by preference.
    pub channels: Vec<ChannelOffer>,
    /// Transports offered, by preference.
    pub transports: Vec<TransportOffer>,
    /// Channel settings: small-tensor size, copy threads, lanes, ring sizes.
    pub channel_config: ChannelConfig,
    /// Limits on everything read from the network.
    pub limits: Limits,
    /// Receive hook for incoming tensors.
    pub allocator: Arc<dyn Allocator>,
    /// A store to rendezvous through instead of the TCP store rank 0 hosts.
    pub store: Option<Arc<dyn Store>>,
    /// Set when torchrun started this worker ([`from_env`](Self::from_env)
    /// reads it): the group rendezvous in this attempt's namespace, through
    /// the store torchrun's agent hosts when it says so.
    pub torchelastic: Option<TorchElastic>,
    /// The group's shared secret (`FERRY_AUTH_SECRET`): with one, every
    /// connection to this worker's RPC port, the rendezvous store rank 0
    /// hosts, and the shared-memory and `mpt` set-up of each connection
    /// authenticate the peer before a frame is read
    /// ([`ferry_transport::auth`]). Every worker of the group needs the
    /// same one.
    pub auth: Option<Secret>,
}

impl RpcOptions {
    /// Options for worker `name` of rank `rank` in a group of `world_size`,
    /// rendezvousing at `master_addr`.
    pub fn new(
        name: impl Into<String>,
        rank: u32,
        world_size: u32,
        master_addr: SocketAddr,
    ) -> Self {
        // Only the interface the group is reached through, not every one.
        let listen_ip = if master_addr.ip().is_loopback() {
            master_addr.ip()
        } else {
            crate::rendezvous::route_to(master_addr).unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
        };
        Self {
            name: name.into(),
            rank,
            world_size,
            local: LocalTopology {
                local_rank: rank,
                local_world_size: world_size,
                group_rank: 0,
            },
            master_addr,
            listen_ip,
            rpc_timeout: DEFAULT_RPC_TIMEOUT,
            init_timeout: DEFAULT_INIT_TIMEOUT,
            shutdown_timeout: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            keepalive: Keepalive::default(),
            io_threads: 2,
            functions: Functions::new(),
            hooks: Hooks::default(),
            channels: channel::default_channels(),
            transports: channel::default_transports(),
            channel_config: ChannelConfig::default(),
            limits: Limits::default(),
            allocator: Arc::new(RawAllocator),
            store: None,
            torchelastic: None,
            auth: None,
        }
    }

    /// Options from the environment: `MASTER_ADDR` (default `127.0.0.1`),
    /// `MASTER_PORT`, `RANK`, `WORLD_SIZE`; optional `FERRY_RPC_TIMEOUT_MS`,
    /// `FERRY_SHUTDOWN_TIMEOUT_MS` ([`shutdown_timeout`](Self::shutdown_timeout)),
    /// `FERRY_IO_THREADS`, `FERRY_CHANNELS` and `FERRY_TRANSPORTS` (comma-separated,
    /// by preference; e.g. `FERRY_CHANNELS=shm,inline` keeps `cma` and `mpt`
    /// out), `FERRY_SMALL_TENSOR_BYTES` (tensors below it go inline whatever
    /// the channel; 0 sends every tensor over its channel) and
    /// `FERRY_MPT_LANES`; with the `ucx` feature `FERRY_UCX_TLS` (UCX's
    /// transports for Ferry's UCX context, e.g. `shm,self` or `tcp`; the
    /// `UCX_*` variables pass through to UCX too); `FERRY_SPIN_US` (how
    /// long a side waiting for a peer on this host, an `shm` ring, a UCX
    /// request or a caller awaiting its reply, polls before it sleeps,
    /// [`ChannelConfig::spin`]); and the receive limits `FERRY_MAX_TENSOR_BYTES`,
    /// `FERRY_MAX_MESSAGE_TENSOR_BYTES` and `FERRY_FRAME_STALL_TIMEOUT_MS`
    /// (see [`Limits`]); `FERRY_AUTH_SECRET` (the group's shared secret,
    /// [`auth`](Self::auth)) and `FERRY_LISTEN_IP` (see
    /// [`listen_ip`](Self::listen_ip)).
    ///
    /// The names torchrun sets are read too: `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE` and `GROUP_RANK` (the node's rank) fill
    /// [`local`](Self::local), checked against each other and against
    /// `RANK` and `WORLD_SIZE`. Without them, the whole group is taken to
    /// share one host. So are torchrun's `TORCHELASTIC_RUN_ID`,
    /// `TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_MAX_RESTARTS` and
    /// `TORCHELASTIC_USE_AGENT_STORE` ([`TorchElastic`]): with them the
    /// group meets in a namespace of its own attempt, and through the store
    /// torchrun's agent hosts at `MASTER_ADDR:MASTER_PORT` when
    /// `TORCHELASTIC_USE_AGENT_STORE=True` (torchrun's default).
    pub fn from_env(name: impl Into<String>) -> Result<Self, RpcError> {
        Self::from_vars(name, |k| std::env::var(k).ok())
    }

    /// [`from_env`](Self::from_env) reading variables through `lookup`
    /// instead of the process environment.
    ///
    /// ```
    /// use std::collections::HashMap;
    /// use ferry_rpc::RpcOptions;
    ///
    /// let env: HashMap<&str, &str> = [
    ///     ("MASTER_PORT", "29500"), ("RANK", "3"), ("WORLD_SIZE", "4"),
    ///     ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2"), ("GROUP_RANK", "1"),
    /// ].into();
    /// let o = RpcOptions::from_vars("worker3", |k| env.get(k).map(|v| v.to_string()))?;
    /// assert_eq!((o.rank, o.local.local_rank, o.local.group_rank), (3, 1, 1));
    /// # Ok::<(), ferry_rpc::RpcError>(())
    /// ```
    pub fn from_vars(
        name: impl Into<String>,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, RpcError> {
        let var = |k: &str| lookup(k).ok_or_else(|| RpcError::Config(format!("{k} is not set")));
        let num = |k: &str| -> Result<u32, RpcError> {
            let v = var(k)?;
            v.trim()
                .parse()
                .map_err(|_| RpcError::Config(format!("{k} is not a number: {v:?}")))
        };
        let opt_num = |k: &str| -> Result<Option<u32>, RpcError> {
            match lookup(k) {
                Some(_) => num(k).map(Some),
                None => Ok(None),
            }
        };
        let host = lookup("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port: u16 = var("MASTER_PORT")?
            .trim()
            .parse()
            .map_err(|_| RpcError::Config("MASTER_PORT is not a port number".into()))?;
        let master = (host.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| RpcError::Config(format!("cannot resolve MASTER_ADDR {host:?}: {e}")))?
            .next()
            .ok_or_else(|| RpcError::Config(format!("MASTER_ADDR {host:?} resolves to nothing")))?;
        let (rank, world_size) = (num("RANK")?, num("WORLD_SIZE")?);
        if rank >= world_size {
            return Err(RpcError::Config(format!(
                "RANK {rank} is not below WORLD_SIZE {world_size}"
            )));
        }
        let mut o = Self::new(name, rank, world_size, master);
        o.local = LocalTopology::from_parts(
            rank,
            world_size,
            opt_num("LOCAL_RANK")?,
            opt_num("LOCAL_WORLD_SIZE")?,
            opt_num("GROUP_RANK")?,
        )?;
        o.torchelastic = TorchElastic::from_vars(&lookup)?;
        if let Some(s) = lookup(ferry_transport::auth::SECRET_ENV).filter(|s| !s.is_empty()) {
            o.auth = Some(Secret::new(s.into_bytes()).map_err(|e| {
                RpcError::Config(format!("{}: {e}", ferry_transport::auth::SECRET_ENV))
            })?);
        }
        if let Some(ip) = lookup("FERRY_LISTEN_IP") {
            o.listen_ip = ip.trim().parse().map_err(|_| {
                RpcError::Config(format!("FERRY_LISTEN_IP is not an IP address: {ip:?}"))
            })?;
        }
        if let Some(ms) = lookup("FERRY_RPC_TIMEOUT_MS") {
            let ms: u64 = ms
                .parse()
                .map_err(|_| RpcError::Config("FERRY_RPC_TIMEOUT_MS is not a number".into()))?;
            o.rpc_timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = lookup("FERRY_SHUTDOWN_TIMEOUT_MS") {
            let ms: u64 = ms.trim().parse().map_err(|_| {
                RpcError::Config(format!("FERRY_SHUTDOWN_TIMEOUT_MS is not a number: {ms:?}"))
            })?;
            o.shutdown_timeout = Some(Duration::from_millis(ms));
        }
        if let Some(n) = lookup("FERRY_IO_THREADS") {
            o.io_threads = n
                .parse()
                .map_err(|_| RpcError::Config("FERRY_IO_THREADS is not a number".into()))?;
        }
        if let Some(list) = lookup("FERRY_CHANNELS") {
            o.channels = channel::parse_channels(&list)?;
        }
        if let Some(list) = lookup("FERRY_TRANSPORTS") {
            o.transports = channel::parse_transports(&list)?;
        }
        let size = |key: &str| -> Result<Option<usize>, RpcError> {
            match lookup(key) {
                Some(v) => v
                    .trim()
                    .parse()
                    .map(Some)
                    .map_err(|_| RpcError::Config(format!("{key} is not a number: {v:?}"))),
                None => Ok(None),
            }
        };
        if let Some(n) = size("FERRY_SMALL_TENSOR_BYTES")? {
            o.channel_config.small_tensor_bytes = n;
        }
        if let Some(n) = size("FERRY_MPT_LANES")? {
            if !(1..=ferry_transport::MAX_MPT_LANES).contains(&n) {
                return Err(RpcError::Config(format!(
                    "FERRY_MPT_LANES must be 1..={}, got {n}",
                    ferry_transport::MAX_MPT_LANES
                )));
            }
            o.channel_config.mpt_lanes = n;
        }
        if let Some(tls) = lookup("FERRY_UCX_TLS") {
            let tls = tls.trim();
            o.channel_config.ucx_tls = (!tls.is_empty()).then(|| tls.to_owned());
        }
        if let Some(us) = size("FERRY_SPIN_US")? {
            o.channel_config.spin = Duration::from_micros(us as u64);
        }
        if let Some(n) = size("FERRY_MAX_TENSOR_BYTES")? {
            o.limits.max_tensor_bytes = n as u64;
        }
        if let Some(n) = size("FERRY_MAX_MESSAGE_TENSOR_BYTES")? {
            o.limits.max_message_tensor_bytes = n as u64;
        }
        if let Some(ms) = size("FERRY_FRAME_STALL_TIMEOUT_MS")? {
            if ms == 0 {
                return Err(RpcError::Config(
                    "FERRY_FRAME_STALL_TIMEOUT_MS must be at least 1".into(),
                ));
            }
            o.limits.frame_stall_timeout = Duration::from_millis(ms as u64);
        }
        Ok(o)
    }

    /// Sets the remote functions.
    pub fn functions(mut self, functions: Functions) -> Self {
        self.functions = functions;
        self
    }

    /// Sets the default per-call timeout (zero: none).
    pub fn rpc_timeout(mut self, timeout: Duration) -> Self {
        self.rpc_timeout = timeout;
        self
    }

    /// Sets the rendezvous / connect bound (and graceful shutdown's, when
    /// [`shutdown_timeout`](Self::shutdown_timeout) is not set).
    pub fn init_timeout(mut self, timeout: Duration) -> Self {
        self.init_timeout = timeout;
        self
    }

    /// Sets graceful shutdown's bound without progress (see
    /// [`shutdown_timeout`](Self::shutdown_timeout)).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = Some(timeout);
        self
    }

    /// Sets how long an incoming connection may take to send its first
    /// message (see [`handshake_timeout`](Self::handshake_timeout)).
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// Sets TCP keepalive and `TCP_USER_TIMEOUT` on connections to peers
    /// ([`Keepalive::disabled`] turns them off).
    pub fn keepalive(mut self, keepalive: Keepalive) -> Self {
        self.keepalive = keepalive;
        self
    }

    /// Registers a service for `kind` (must be at or above [`MessageKind::FIRST_SERVICE`]).
    pub fn service(mut self, kind: MessageKind, service: Arc<dyn Service>) -> Self {
        self.hooks.service(kind, service);
        self
    }

    /// Adds an interceptor.
    pub fn interceptor(mut self, interceptor: Arc<dyn Interceptor>) -> Self {
        self.hooks.interceptor(interceptor);
        self
    }

    /// Restricts and orders the channels by name (unknown names are an error).
    pub fn channels(mut self, names: &str) -> Result<Self, RpcError> {
        self.channels = channel::parse_channels(names)?;
        Ok(self)
    }

    /// Adds device mappings for worker `to`, as PyTorch's
    /// `TensorPipeRpcBackendOptions.set_device_map(to, {"cuda:0": "cuda:1"})`:
    /// a tensor sent to `to` from a local device lands on the mapped device
    /// there, and a tensor `to` sends from a mapped device lands on the
    /// local one (see [`ferry_transport::device_map`]). Refused here when
    /// the merged map is not one-to-one or names something that is not a
    /// device; checked against this host's devices at init.
    pub fn set_device_map(mut self, to: &str, map: &[(&str, &str)]) -> Result<Self, RpcError> {
        std::sync::Arc::make_mut(&mut self.channel_config.device_maps)
            .set_device_map_str(to, map)
            .map_err(ferry_transport::TransportError::from)?;
        Ok(self)
    }

    /// Sets the receive hook.
    pub fn allocator(mut self, allocator: Arc<dyn Allocator>) -> Self {
        self.allocator = allocator;
        self
    }

    /// Sets the group's shared secret (see [`auth`](Self::auth)).
    pub fn auth_secret(mut self, secret: Secret) -> Self {
        self.auth = Some(secret);
        self
    }

    /// Listens for RPC on `ip` (`0.0.0.0` or `::`: every interface)
    /// instead of only the interface `MASTER_ADDR` routes through.
    pub fn listen_ip(mut self, ip: IpAddr) -> Self {
        self.listen_ip = ip;
        self
    }

    /// Rendezvous through `store` instead of a TCP store hosted by rank 0.
    pub fn store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = Some(store);
        self
    }

    pub(crate) fn validate(&self) -> Result<(), RpcError> {
        crate::name::validate_name(&self.name)?;
        if self.world_size == 0 {
            return Err(RpcError::Config("world size must be at least 1".into()));
        }
        if self.rank >= self.world_size {
            return Err(RpcError::InvalidRank {
                rank: self.rank,
                world_size: self.world_size,
            });
        }
        if self.io_threads == 0 {
            return Err(RpcError::Config("io_threads must be at least 1".into()));
        }
        if self.shutdown_timeout.is_some_and(|t| t.is_zero()) {
            return Err(RpcError::Config(
                "the shutdown timeout must be longer than zero".into(),
            ));
        }
        if self.handshake_timeout.is_zero() {
            return Err(RpcError::Config(
                "the handshake timeout must be longer than zero".into(),
            ));
        }
        self.keepalive
            .validate()
            .map_err(|e| RpcError::Config(e.to_string()))?;
        // Local devices of the device maps exist here (worker names are
        // checked once the group is known).
        self.channel_config
            .device_maps
            .validate(None, ferry_transport::cuda::availability())
            .map_err(ferry_transport::TransportError::from)?;
        for (kind, s) in &self.hooks.services {
            if !kind.is_service() {
                return Err(RpcError::Config(format!(
                    "service {:?} uses {kind}, below the first service kind {}",
                    s.name(),
                    MessageKind::FIRST_SERVICE
                )));
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for RpcOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcOptions")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("master_addr", &self.master_addr)
            .field("rpc_timeout", &self.rpc_timeout)
            .field("functions", &self.functions)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod env_tests {
    use std::collections::HashMap;

    use super::*;

    fn refused(vars: &[(&str, &str)]) -> RpcError {
        match from(vars) {
            Ok(_) => panic!("{vars:?} accepted"),
            Err(e) => e,
        }
    }

    fn from(vars: &[(&str, &str)]) -> Result<RpcOptions, RpcError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RpcOptions::from_vars("w", |k| map.get(k).cloned())
    }

    #[test]
    fn torchrun_names_fill_the_local_topology() {
        let o = from(&[
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "1"),
        ])
        .unwrap();
        assert_eq!((o.rank, o.world_size), (3, 4));
        assert_eq!(
            o.local,
            LocalTopology {
                local_rank: 1,
                local_world_size: 2,
                group_rank: 1
            }
        );
    }

    #[test]
    fn spin_is_read_in_microseconds() {
        let base = [("MASTER_PORT", "29500"), ("RANK", "0"), ("WORLD_SIZE", "2")];
        assert_eq!(
            from(&base).unwrap().channel_config.spin,
            ferry_transport::spin::SPIN_BUDGET
        );
        let mut vars = base.to_vec();
        vars.push(("FERRY_SPIN_US", "5"));
        assert_eq!(
            from(&vars).unwrap().channel_config.spin,
            Duration::from_micros(5)
        );
        vars.pop();
        vars.push(("FERRY_SPIN_US", "5us"));
        let e = refused(&vars);
        assert!(
            e.to_string().contains("FERRY_SPIN_US is not a number"),
            "{e}"
        );
    }

    #[test]
    fn the_shutdown_timeout_is_read_in_milliseconds_and_defaults_to_init() {
        let base = [("MASTER_PORT", "29500"), ("RANK", "0"), ("WORLD_SIZE", "2")];
        assert_eq!(from(&base).unwrap().shutdown_timeout, None);
        let mut vars = base.to_vec();
        vars.push(("FERRY_SHUTDOWN_TIMEOUT_MS", "2500"));
        let o = from(&vars).unwrap();
        assert_eq!(o.shutdown_timeout, Some(Duration::from_millis(2500)));
        vars.pop();
        vars.push(("FERRY_SHUTDOWN_TIMEOUT_MS", "2s"));
        let e = refused(&vars);
        assert!(
            e.to_string()
                .contains("FERRY_SHUTDOWN_TIMEOUT_MS is not a number: \"2s\""),
            "{e}"
        );
        // Zero would end every shutdown at once: refused before rendezvous.
        let o = from(&base).unwrap().shutdown_timeout(Duration::ZERO);
        let e = o.validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid RPC options: the shutdown timeout must be longer than zero"
        );
    }

    #[test]
    fn bad_values_name_the_variable() {
        let base = [("MASTER_PORT", "29500"), ("RANK", "0"), ("WORLD_SIZE", "2")];
        for (extra, text) in [
            (("LOCAL_RANK", "x"), "LOCAL_RANK is not a number: \"x\""),
            (
                ("LOCAL_RANK", "1"),
                "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not",
            ),
            (("GROUP_RANK", "-1"), "GROUP_RANK is not a number"),
        ] {
            let mut vars = base.to_vec();
            vars.push(extra);
            let e = refused(&vars);
            assert!(e.to_string().contains(text), "{e} lacks {text}");
        }
        let e = refused(&[("MASTER_PORT", "29500"), ("RANK", "2"), ("WORLD_SIZE", "2")]);
        assert!(
            e.to_string().contains("RANK 2 is not below WORLD_SIZE 2"),
            "{e}"
        );
        let e = refused(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert!(e.to_string().contains("MASTER_PORT is not set"), "{e}");
    }

    #[test]
    fn device_maps_are_checked_when_set_and_at_init() {
        let base =
            || from(&[("MASTER_PORT", "29500"), ("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap();
        let e = base()
            .set_device_map("w1", &[("cuda:0", "cuda:1"), ("cuda:2", "cuda:1")])
            .unwrap_err();
        assert!(
            e.to_string().contains("a device map must be one-to-one"),
            "{e}"
        );
        let e = base()
            .set_device_map("w1", &[("gpu", "cuda:1")])
            .unwrap_err();
        assert!(e.to_string().contains("\"gpu\" is not a device"), "{e}");
        // CPU-only maps need no CUDA.
        let o = base().set_device_map("w1", &[("cpu", "cpu")]).unwrap();
        o.validate().unwrap();
        let o = base()
            .set_device_map("w1", &[("cuda:0", "cuda:0")])
            .unwrap();
        match ferry_transport::cuda::availability() {
            Ok(_) => o.validate().unwrap(),
            Err(reason) => {
                let e = o.validate().unwrap_err();
                assert!(e.to_string().contains("names local device cuda:0"), "{e}");
                assert!(e.to_string().contains(&reason.to_string()), "{e}");
            }
        }
    }
}
