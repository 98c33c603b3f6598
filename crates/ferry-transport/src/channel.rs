//! Tensor channels and transports this build knows, and the offers a
//! worker makes.
//!
//! | channel | carries tensor bytes | domain (who can use it with whom) | default priority |
//! |---|---|---|---|
//! | `cma` | receiver pulls them from the sender's memory (`process_vm_readv`): one copy | same boot, PID and user namespace, user (only offered where the kernel permits it); selected only with the `shm` transport, reading only from the process the kernel names as the peer | 30 |
//! | `shm` | through a shared-memory ring between the two processes, chunked and pipelined | same boot, network and PID namespace | 20 |
//! | `ucx` (feature `ucx`) | one UCX tag message per tensor, from the tensor's memory straight into the destination (UCX picks shared memory, TCP, InfiniBand/RoCE) | any (offered where `libucp.so.0` loads) | 15 |
//! | `mpt` | over several TCP connections in parallel, reassembled in place | any | 10 |
//! | `cuda_ipc` (feature `cuda`) | CUDA tensors on one host: the receiver opens the sender's IPC memory handle, its stream waits on the sender's IPC event, and it copies device to device (`cuda::ipc`); the sender keeps the tensor until released | same boot, network and PID namespace (offered for each CUDA device where CUDA is available) | 40 |
//! | `cuda_staged` (feature `cuda`) | CUDA tensors: device → pinned host → the connection's stream → pinned host → device, in pipelined chunks ([`crate::cuda::staged`]) | any (offered for the CPU and each CUDA device where CUDA is available) | 5 |
//! | `inline` | after the frame on the connection itself | any | 0 |
//!
//! | transport | carries frames | domain | default priority |
//! |---|---|---|---|
//! | `shm` | a ring pair in shared memory, woken through eventfds only when the peer sleeps | same boot, network and PID namespace | 10 |
//! | `ucx` (feature `ucx`) | UCX tag messages between two UCX workers | any (offered where `libucp.so.0` loads) | 5 |
//! | `tcp` | a TCP connection (also the bootstrap for `shm` and `ucx`) | any | 0 |
//!
//! Selection ([`crate::selection`]) picks per device pair the channel with
//! the highest summed priority both ends offer with equal descriptors, so a
//! pair of workers on one host uses `cma` (or `shm` where CMA is not
//! permitted), and workers on different hosts use `mpt`. A worker can
//! restrict and reorder the lists ([`parse_channels`], [`parse_transports`];
//! the RPC layer reads them from `FERRY_CHANNELS` and `FERRY_TRANSPORTS`).
//!
//! Why the same-host domains hold what they hold:
//! - the boot id: another machine (or a reboot) shares no memory;
//! - the network namespace: the shared memory is passed over an abstract
//!   Unix socket, and those are per network namespace;
//! - the PID namespace: the `shm` set-up watches the peer process through
//!   the pid the kernel reports for that socket (`SO_PEERCRED`), and `cma`
//!   reads that process; across PID namespaces the kernel names no process
//!   (pid 0), so processes in separate PID namespaces on one network (e.g.
//!   containers sharing the host's network) use the cross-host paths.
//!
//! [`not_same_host`] says, typed, why two descriptors differ; a connection
//! logs it when it rules a same-host channel or transport out.

use std::sync::OnceLock;

use ferry_wire::{ChannelOffer, Device, DeviceOffer, TransportOffer};

use crate::TransportError;

/// The universal fallback channel: bytes follow the header on the connection.
pub const INLINE: &str = "inline";
/// Cross-memory attach: the receiver reads the sender's memory.
pub const CMA: &str = "cma";
/// Shared-memory staging: bytes go through a ring in a shared segment.
pub const SHM: &str = "shm";
/// Multi-lane TCP: chunks over several connections in parallel.
pub const MPT: &str = "mpt";
/// UCX (feature `ucx`): tensors as UCX tag messages.
pub const UCX: &str = "ucx";
/// CUDA tensors staged through pinned host memory and the connection's
/// stream (feature `cuda`).
pub const CUDA_STAGED: &str = "cuda_staged";
/// CUDA tensors through CUDA IPC handles on one host (feature `cuda`).
pub const CUDA_IPC: &str = "cuda_ipc";
/// The UCX transport (feature `ucx`; named like the channel).
pub const UCX_TRANSPORT: &str = "ucx";
/// The TCP transport.
pub const TCP: &str = "tcp";
/// The shared-memory ring transport (named like the channel; they are
/// different lists).
pub const SHM_TRANSPORT: &str = "shm";

/// Channels implemented in this build, highest default priority first.
#[cfg(all(feature = "ucx", feature = "cuda"))]
pub const KNOWN_CHANNELS: &[&str] = &[CUDA_IPC, CMA, SHM, UCX, MPT, CUDA_STAGED, INLINE];
/// Channels implemented in this build, highest default priority first.
#[cfg(all(feature = "ucx", not(feature = "cuda")))]
pub const KNOWN_CHANNELS: &[&str] = &[CMA, SHM, UCX, MPT, INLINE];
/// Channels implemented in this build, highest default priority first.
#[cfg(all(not(feature = "ucx"), feature = "cuda"))]
pub const KNOWN_CHANNELS: &[&str] = &[CUDA_IPC, CMA, SHM, MPT, CUDA_STAGED, INLINE];
/// Channels implemented in this build, highest default priority first.
#[cfg(all(not(feature = "ucx"), not(feature = "cuda")))]
pub const KNOWN_CHANNELS: &[&str] = &[CMA, SHM, MPT, INLINE];
/// Transports implemented in this build, highest default priority first.
#[cfg(feature = "ucx")]
pub const KNOWN_TRANSPORTS: &[&str] = &[SHM_TRANSPORT, UCX_TRANSPORT, TCP];
/// Transports implemented in this build, highest default priority first.
#[cfg(not(feature = "ucx"))]
pub const KNOWN_TRANSPORTS: &[&str] = &[SHM_TRANSPORT, TCP];

/// Default priority of the `ucx` channel: above `mpt` (across hosts UCX
/// wins), below `shm` and `cma` (on one host they copy once with no
/// library in the path; `cargo xtask bench --only ucx` compares them).
pub const UCX_CHANNEL_PRIORITY: i32 = 15;
/// Default priority of the `cuda_staged` channel: above `inline`, below
/// the host channels, so CPU-to-CPU pairs keep those; it is the only
/// channel offering CUDA devices.
pub const CUDA_STAGED_PRIORITY: i32 = 5;
/// Default priority of the `cuda_ipc` channel: above every other (it
/// offers CUDA devices only, where `cuda_staged` is its only rival).
pub const CUDA_IPC_PRIORITY: i32 = 40;
/// Default priority of the `ucx` transport: above `tcp`, below `shm`.
pub const UCX_TRANSPORT_PRIORITY: i32 = 5;

/// The `ucx` domain: `any` (two UCX workers anywhere can talk; UCX picks
/// its transports per peer), or why UCX cannot be used in this process.
#[cfg(feature = "ucx")]
fn ucx_domain() -> Result<String, String> {
    crate::ucx::viability().map(|_| "any".to_owned())
}

/// The domain of same-host shared memory: the boot id, the network
/// namespace (abstract Unix sockets, which pass the segment's descriptors,
/// are per network namespace) and the PID namespace (the set-up watches
/// the peer process the kernel names for that socket, which it names only
/// within one PID namespace).
pub(crate) fn same_host_domain() -> Result<String, String> {
    static DOMAIN: OnceLock<Result<String, String>> = OnceLock::new();
    DOMAIN
        .get_or_init(|| {
            let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .map_err(|e| format!("cannot read the boot id: {e}"))?;
            let ns = |kind: &str, what: &str| {
                std::fs::read_link(format!("/proc/self/ns/{kind}"))
                    .map(|p| p.to_string_lossy().into_owned())
                    .map_err(|e| format!("cannot read the {what} namespace: {e}"))
            };
            Ok(format!(
                "{}/{}/{}",
                boot.trim(),
                ns("net", "network")?,
                ns("pid", "PID")?
            ))
        })
        .clone()
}

/// Why two processes are not on one host as a same-host channel or
/// transport (`cma`, `shm`) needs it: the first part in which their domain
/// descriptors differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotSameHost {
    /// Different boot ids: another machine, or one rebooted in between.
    #[error("different boot ids (another machine)")]
    Boot,
    /// Different network namespaces: the abstract Unix socket that passes
    /// the shared memory cannot be reached.
    #[error("different network namespaces")]
    Network,
    /// Different PID namespaces: the kernel names no peer process to watch
    /// or read.
    #[error("different PID namespaces")]
    Pid,
    /// Different user namespaces: the kernel refuses `cma`.
    #[error("different user namespaces")]
    User,
    /// Different user or group ids: the kernel refuses `cma`.
    #[error("different user or group ids")]
    Ids,
    /// Descriptors of different forms (another build's), or an unknown part.
    #[error("descriptors of different forms")]
    Form,
}

/// Why the same-host domain descriptors `local` and `peer` (of `cma`,
/// `shm` or the `shm` transport) differ, or `None` when they are equal.
pub fn not_same_host(local: &str, peer: &str) -> Option<NotSameHost> {
    if local == peer {
        return None;
    }
    let (a, b): (Vec<&str>, Vec<&str>) = (local.split('/').collect(), peer.split('/').collect());
    if a.len() != b.len() {
        return Some(NotSameHost::Form);
    }
    let (i, part) = a.iter().zip(&b).enumerate().find(|(_, (x, y))| x != y)?;
    Some(match part.0 {
        _ if i == 0 => NotSameHost::Boot,
        p if p.starts_with("net:") => NotSameHost::Network,
        p if p.starts_with("pid:") => NotSameHost::Pid,
        p if p.starts_with("user:") => NotSameHost::User,
        p if p.starts_with("uid=") || p.starts_with("gid=") => NotSameHost::Ids,
        _ => NotSameHost::Form,
    })
}

/// The `cma` domain descriptor, or why the channel is not viable here.
pub fn cma_viability() -> Result<String, String> {
    static CMA_DOMAIN: OnceLock<Result<String, String>> = OnceLock::new();
    CMA_DOMAIN.get_or_init(crate::cma::descriptor).clone()
}

/// Whether CUDA tensors can travel from or to this process: the number of
/// CUDA devices, or why not (typed; "CUDA not available on this host: …").
/// Without it `cuda_staged` is not offered, and a CUDA tensor transfer
/// fails with this reason.
pub fn cuda_viability() -> Result<usize, crate::cuda::CudaUnavailable> {
    crate::cuda::availability()
}

/// The `cuda_staged` offer: the CPU and every CUDA device, any domain
/// (the bytes travel on the connection's own stream).
#[cfg(feature = "cuda")]
fn cuda_staged_offer(priority: i32) -> Option<ChannelOffer> {
    match cuda_viability() {
        Ok(count) => {
            let mut devices = vec![DeviceOffer {
                device: Device::Cpu,
                descriptor: "any".into(),
            }];
            devices.extend((0..count.min(usize::from(u16::MAX))).map(|i| DeviceOffer {
                device: Device::Cuda(i as u16),
                descriptor: "any".into(),
            }));
            Some(ChannelOffer {
                name: CUDA_STAGED.into(),
                priority,
                devices,
            })
        }
        Err(reason) => {
            tracing::info!(channel = CUDA_STAGED, %reason, "channel not offered");
            None
        }
    }
}

/// The `cuda_ipc` offer: every CUDA device, in the same-host domain (IPC
/// handles open only on the host that made them).
#[cfg(feature = "cuda")]
fn cuda_ipc_offer(priority: i32) -> Option<ChannelOffer> {
    let domain = match (cuda_viability(), same_host_domain()) {
        (Ok(count), Ok(domain)) => Ok((count, domain)),
        (Err(reason), _) => Err(reason.to_string()),
        (_, Err(reason)) => Err(reason),
    };
    match domain {
        Ok((count, descriptor)) => Some(ChannelOffer {
            name: CUDA_IPC.into(),
            priority,
            devices: (0..count.min(usize::from(u16::MAX)))
                .map(|i| DeviceOffer {
                    device: Device::Cuda(i as u16),
                    descriptor: descriptor.clone(),
                })
                .collect(),
        }),
        Err(reason) => {
            tracing::info!(channel = CUDA_IPC, %reason, "channel not offered");
            None
        }
    }
}

fn cpu_offer(name: &str, priority: i32, descriptor: String) -> ChannelOffer {
    ChannelOffer {
        name: name.into(),
        priority,
        devices: vec![DeviceOffer {
            device: Device::Cpu,
            descriptor,
        }],
    }
}

/// The offer for one known channel with its default priority, `Ok(None)`
/// when the channel is known but not viable in this process (the reason is
/// logged), and an error listing the known names for an unknown one.
pub fn channel_offer(name: &str) -> Result<Option<ChannelOffer>, TransportError> {
    let viable = |name: &str, priority, domain: Result<String, String>| match domain {
        Ok(d) => Some(cpu_offer(name, priority, d)),
        Err(reason) => {
            tracing::info!(channel = name, %reason, "channel not offered");
            None
        }
    };
    Ok(match name {
        CMA => viable(CMA, 30, cma_viability()),
        SHM => viable(SHM, 20, same_host_domain()),
        #[cfg(feature = "ucx")]
        UCX => viable(UCX, UCX_CHANNEL_PRIORITY, ucx_domain()),
        MPT => Some(cpu_offer(MPT, 10, "any".into())),
        #[cfg(feature = "cuda")]
        CUDA_STAGED => cuda_staged_offer(CUDA_STAGED_PRIORITY),
        #[cfg(feature = "cuda")]
        CUDA_IPC => cuda_ipc_offer(CUDA_IPC_PRIORITY),
        INLINE => Some(cpu_offer(INLINE, 0, "any".into())),
        other => {
            return Err(TransportError::Unknown {
                what: "channel",
                name: other.into(),
                known: KNOWN_CHANNELS.join(", "),
            })
        }
    })
}

/// The offer for one known transport, `Ok(None)` when not viable here.
pub fn transport_offer(name: &str) -> Result<Option<TransportOffer>, TransportError> {
    Ok(match name {
        SHM_TRANSPORT => match same_host_domain() {
            Ok(descriptor) => Some(TransportOffer {
                name: SHM_TRANSPORT.into(),
                priority: 10,
                descriptor,
            }),
            Err(reason) => {
                tracing::info!(transport = name, %reason, "transport not offered");
                None
            }
        },
        #[cfg(feature = "ucx")]
        UCX_TRANSPORT => match ucx_domain() {
            Ok(descriptor) => Some(TransportOffer {
                name: UCX_TRANSPORT.into(),
                priority: UCX_TRANSPORT_PRIORITY,
                descriptor,
            }),
            Err(reason) => {
                tracing::info!(transport = name, %reason, "transport not offered");
                None
            }
        },
        TCP => Some(TransportOffer {
            name: TCP.into(),
            priority: 0,
            descriptor: "any".into(),
        }),
        other => {
            return Err(TransportError::Unknown {
                what: "transport",
                name: other.into(),
                known: KNOWN_TRANSPORTS.join(", "),
            })
        }
    })
}

/// Offers for every known channel.
pub fn default_channels() -> Vec<ChannelOffer> {
    KNOWN_CHANNELS
        .iter()
        .filter_map(|n| channel_offer(n).ok().flatten())
        .collect()
}

/// Offers for every known transport.
pub fn default_transports() -> Vec<TransportOffer> {
    KNOWN_TRANSPORTS
        .iter()
        .filter_map(|n| transport_offer(n).ok().flatten())
        .collect()
}

/// Parses a comma-separated channel list (e.g. from an environment
/// variable), in the given order of preference: the first gets the highest
/// priority. Unknown names are an error listing the known ones; a known
/// channel that is not viable here is left out (selection falls back).
pub fn parse_channels(list: &str) -> Result<Vec<ChannelOffer>, TransportError> {
    parse_list(list, channel_offer, |o, p| o.priority = p)
}

/// Parses a comma-separated transport list, like [`parse_channels`].
pub fn parse_transports(list: &str) -> Result<Vec<TransportOffer>, TransportError> {
    parse_list(list, transport_offer, |o, p| o.priority = p)
}

/// Offers for the names in `list`, prioritised by their order.
fn parse_list<T>(
    list: &str,
    offer: fn(&str) -> Result<Option<T>, TransportError>,
    set_priority: fn(&mut T, i32),
) -> Result<Vec<T>, TransportError> {
    let names: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let count = names.len() as i32;
    let mut out = Vec::new();
    for (i, n) in names.iter().enumerate() {
        if let Some(mut o) = offer(n)? {
            set_priority(&mut o, count - i as i32);
            out.push(o);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_host_domain_holds_boot_network_and_pid_namespace() {
        let d = same_host_domain().unwrap();
        let parts: Vec<&str> = d.split('/').collect();
        assert_eq!(parts.len(), 3, "{d}");
        assert!(parts[1].starts_with("net:["), "{d}");
        assert!(parts[2].starts_with("pid:["), "{d}");
        assert_eq!(not_same_host(&d, &d), None);
    }

    #[test]
    fn not_same_host_names_the_first_difference() {
        let shm = |boot: &str, net: u32, pid: u32| format!("{boot}/net:[{net}]/pid:[{pid}]");
        let a = shm("b1", 1, 2);
        assert_eq!(not_same_host(&a, &shm("b2", 1, 2)), Some(NotSameHost::Boot));
        assert_eq!(not_same_host(&a, &shm("b2", 5, 6)), Some(NotSameHost::Boot));
        assert_eq!(
            not_same_host(&a, &shm("b1", 5, 6)),
            Some(NotSameHost::Network)
        );
        assert_eq!(not_same_host(&a, &shm("b1", 1, 6)), Some(NotSameHost::Pid));
        let cma =
            |pid: u32, user: u32, uid: u32| format!("b1/pid:[{pid}]/user:[{user}]/uid={uid}/gid=0");
        let c = cma(1, 2, 0);
        assert_eq!(not_same_host(&c, &cma(1, 3, 0)), Some(NotSameHost::User));
        assert_eq!(not_same_host(&c, &cma(1, 2, 1000)), Some(NotSameHost::Ids));
        assert_eq!(not_same_host(&c, &cma(9, 2, 0)), Some(NotSameHost::Pid));
        // The same-host domain of an older build (no PID namespace).
        assert_eq!(not_same_host(&a, "b1/net:[1]"), Some(NotSameHost::Form));
        assert_eq!(not_same_host("b1/x", "b1/y"), Some(NotSameHost::Form));
        assert_eq!(NotSameHost::Pid.to_string(), "different PID namespaces");
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let err = parse_channels("inline, rdma").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "unknown channel \"rdma\"; known: {}",
                KNOWN_CHANNELS.join(", ")
            )
        );
        let err = parse_transports("ibv").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "unknown transport \"ibv\"; known: {}",
                KNOWN_TRANSPORTS.join(", ")
            )
        );
        let forced = parse_channels("inline, mpt").unwrap();
        let named: Vec<_> = forced
            .iter()
            .map(|o| (o.name.as_str(), o.priority))
            .collect();
        assert_eq!(named, [("inline", 2), ("mpt", 1)]);
    }

    /// The CUDA channels' default priorities and domains pick, per pair:
    /// `cuda_ipc` for GPU to GPU on one host, `cuda_staged` across hosts and
    /// between the CPU and a GPU, the host channels for CPU to CPU.
    #[test]
    fn cuda_channels_are_chosen_per_device_pair() {
        use crate::selection::{select_channels, Selection};
        use ferry_wire::DeviceOffer;
        let offers = |host: &str| {
            let d = |device, descriptor: &str| DeviceOffer {
                device,
                descriptor: descriptor.into(),
            };
            vec![
                ChannelOffer {
                    name: CUDA_IPC.into(),
                    priority: CUDA_IPC_PRIORITY,
                    devices: vec![d(Device::Cuda(0), host), d(Device::Cuda(1), host)],
                },
                ChannelOffer {
                    name: CUDA_STAGED.into(),
                    priority: CUDA_STAGED_PRIORITY,
                    devices: vec![
                        d(Device::Cpu, "any"),
                        d(Device::Cuda(0), "any"),
                        d(Device::Cuda(1), "any"),
                    ],
                },
                cpu_offer(SHM, 20, host.into()),
                cpu_offer(MPT, 10, "any".into()),
                cpu_offer(INLINE, 0, "any".into()),
            ]
        };
        let one = Selection::new(select_channels(&offers("h1"), &offers("h1")).unwrap());
        let two = Selection::new(select_channels(&offers("h1"), &offers("h2")).unwrap());
        let (cpu, g0, g1) = (Device::Cpu, Device::Cuda(0), Device::Cuda(1));
        assert_eq!(one.channel_for(g0, g1), Ok(CUDA_IPC));
        assert_eq!(one.channel_for(g0, cpu), Ok(CUDA_STAGED));
        assert_eq!(one.channel_for(cpu, g1), Ok(CUDA_STAGED));
        assert_eq!(one.channel_for(cpu, cpu), Ok(SHM));
        assert_eq!(two.channel_for(g0, g1), Ok(CUDA_STAGED));
        assert_eq!(two.channel_for(cpu, cpu), Ok(MPT));
    }
}
