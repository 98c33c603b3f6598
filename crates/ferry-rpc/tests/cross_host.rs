//! A real cross-host test on one machine: workers on separate "hosts"
//! (`ferry_testkit::hosts`: their own network, IPC, PID, UTS and mount
//! namespaces, joined by a veth pair with addresses of the test's own),
//! rendezvous at host 0's address.
//!
//! Each host offers every channel and transport it can use by itself (`cma`
//! and `shm` included), yet their domain descriptors differ across hosts,
//! so selection rules them out and picks a cross-host path; the test
//! asserts the selected link and moves tensors over it. The whole RPC suite
//! (`tests/rpc.rs`) also runs across hosts over each path: `cargo xtask
//! test` runs it with `FERRY_TEST_CROSS_HOST=1` (see its
//! `CROSS_HOST_PATHS`).
//!
//! Where hosts cannot be made (not root, no `ip`/`unshare`, namespaces
//! refused), each test prints `SKIPPED` with the reason.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use ferry_rpc::{Function, Functions, RpcError, RpcOptions};
use ferry_testkit::{hosts, worker_rank, world_across_hosts, world_wrapped, Output};
use ferry_transport::channel::{self, NotSameHost};
use ferry_transport::{RawTensor, TransportError};
use ferry_wire::DType;

const ADD: Function<(i64, i64), i64> = Function::new("add");
const IDENTITY_MANY: Function<Vec<RawTensor>, Vec<RawTensor>> = Function::new("identity_many");
/// A tensor of `n` floats, made by the callee.
const MAKE_TENSOR: Function<i64, RawTensor> = Function::new("make_tensor");

/// A cross-host path: the channel list a worker is given (`None`: every
/// channel this build knows, as by default) and the link selection must
/// then make between two hosts. The `ucx` paths (built with feature
/// `ucx`) are in [`ucx`] below.
struct Path {
    /// `FERRY_CHANNELS`-style list, or `None` for the defaults.
    channels: Option<&'static str>,
    /// The transport and channel the link must select.
    expect: (&'static str, &'static str),
}

/// Across hosts the defaults select `mpt` (over the `tcp` transport).
const MPT: Path = Path {
    channels: None,
    expect: (channel::TCP, channel::MPT),
};
/// Forced to `inline`: tensors follow their frame on the TCP connection.
const TCP: Path = Path {
    channels: Some("inline"),
    expect: (channel::TCP, channel::INLINE),
};

fn sample(dtype: DType, shape: &[i64], seed: u8) -> RawTensor {
    let n: i64 = shape.iter().product();
    let bytes: Vec<u8> = (0..n as usize * dtype.size())
        .map(|i| (i as u8).wrapping_mul(37) ^ seed)
        .collect();
    RawTensor::from_bytes(dtype, shape, &bytes).unwrap()
}

/// Tensors from empty to 12 MiB, and a view.
fn many_sizes(seed: u8) -> Vec<RawTensor> {
    let mut out: Vec<RawTensor> = [0i64, 1, 1000, 70_000, 3 << 20]
        .iter()
        .enumerate()
        .map(|(i, &n)| sample(DType::F32, &[n], seed ^ i as u8))
        .collect();
    out.push(sample(DType::U8, &[(12 << 20) + 5], seed));
    out.push(sample(DType::F64, &[300, 700], seed).t().unwrap());
    out
}

/// Options with every known channel and transport but UCX's (whatever
/// the environment says), restricted to `channels` if given.
fn options(rank: u32, channels: Option<&str>) -> RpcOptions {
    let mut f = Functions::new();
    f.add(ADD, |(a, b)| a + b);
    f.add(IDENTITY_MANY, |v| v);
    f.add(MAKE_TENSOR, |n| sample(DType::F32, &[n], 0));
    let mut o = RpcOptions::from_env(format!("worker{rank}"))
        .unwrap()
        .functions(f)
        .init_timeout(Duration::from_secs(60));
    o.channels = channel::default_channels();
    o.transports = channel::default_transports();
    // The UCX paths (feature `ucx`) have tests of their own (module
    // `ucx`): these keep to the paths of a build without UCX.
    o.channels.retain(|c| c.name != channel::UCX);
    o.transports.retain(|t| t.name != channel::UCX_TRANSPORT);
    o.channel_config.small_tensor_bytes = 0;
    match channels {
        Some(list) => o.channels(list).unwrap(),
        None => o,
    }
}

/// Prints what this worker offers and its same-host domains, for the
/// parent to compare across hosts.
fn print_offers() {
    let names: Vec<String> = channel::default_channels()
        .into_iter()
        .map(|o| o.name)
        .collect();
    println!("OFFERED={}", names.join(","));
    let descriptor = |name| match channel::channel_offer(name).unwrap() {
        Some(o) => o.devices[0].descriptor.clone(),
        None => "not offered".into(),
    };
    println!("SHM_DOMAIN={}", descriptor(channel::SHM));
    println!("CMA_DOMAIN={}", descriptor(channel::CMA));
    println!(
        "SHM_TRANSPORT_DOMAIN={}",
        channel::transport_offer(channel::SHM_TRANSPORT)
            .unwrap()
            .map_or("not offered".into(), |o| o.descriptor)
    );
}

/// Calls the peer with tensors of many sizes, several in flight, and
/// prints the link the two selected.
fn exchange_and_report(rank: u32, world: u32) {
    let calls: Vec<_> = (0..world)
        .filter(|&p| p != rank)
        .flat_map(|p| (0..2u8).map(move |i| (p, i)))
        .map(|(p, i)| (IDENTITY_MANY.rpc_async(p, many_sizes(i ^ rank as u8)), i))
        .collect();
    for (f, i) in calls {
        assert!(f.wait().unwrap() == many_sizes(i ^ rank as u8));
    }
    let agent = ferry_rpc::agent().unwrap();
    for peer in (0..world).filter(|&p| p != rank) {
        let link = agent
            .link_info(peer)
            .unwrap()
            .expect("a connection was made");
        let out: Vec<&str> = link.outgoing.iter().map(|c| c.channel.as_str()).collect();
        let inc: Vec<&str> = link.incoming.iter().map(|c| c.channel.as_str()).collect();
        println!(
            "LINK{peer}={}/{}/{}",
            link.transport,
            out.join("+"),
            inc.join("+")
        );
    }
}

fn all_succeeded(test: &str, outputs: &[Output]) {
    for (rank, o) in outputs.iter().enumerate() {
        assert!(
            o.success,
            "rank {rank} of {test} failed\n--- stdout ---\n{}\n--- stderr ---\n{}",
            o.stdout, o.stderr
        );
    }
}

fn one(o: &Output, key: &str) -> String {
    let v = o.values(key);
    assert_eq!(v.len(), 1, "{key}= in\n{}", o.stdout);
    v[0].clone()
}

/// Both workers could use `cma` and `shm` by themselves (they offer what
/// the parent does), but their descriptors differ, for the reason `why`
/// gives per domain, so neither is selected.
fn assert_same_host_paths_ruled_out(outputs: &[Output], why: [(&str, NotSameHost); 3]) {
    let here: Vec<String> = channel::default_channels()
        .into_iter()
        .map(|o| o.name)
        .collect();
    for (rank, o) in outputs.iter().enumerate() {
        let offered = one(o, "OFFERED");
        assert_eq!(
            offered,
            here.join(","),
            "rank {rank} offers what this host does"
        );
        assert!(offered.split(',').any(|c| c == channel::SHM), "{offered}");
    }
    for (key, why) in why {
        let (a, b) = (one(&outputs[0], key), one(&outputs[1], key));
        if a == "not offered" && b == "not offered" {
            continue;
        }
        assert_eq!(
            channel::not_same_host(&a, &b),
            Some(why),
            "{key}: {a} vs {b}"
        );
    }
}

/// Two workers on two hosts: the link is `path`'s, both ways, and tensors
/// of every size cross it.
fn cross_host_link(test: &str, path: &Path) {
    let Some(outputs) = world_across_hosts(test, 2, |rank| {
        print_offers();
        init_rpc(options(rank, path.channels)).unwrap();
        println!(
            "HOSTNAME={}",
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .unwrap()
                .trim()
        );
        exchange_and_report(rank, 2);
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    all_succeeded(test, &outputs);
    assert_eq!(one(&outputs[0], "HOSTNAME"), "ferry-host-0");
    assert_eq!(one(&outputs[1], "HOSTNAME"), "ferry-host-1");
    // The shared-memory domains differ in the network namespace first,
    // `cma`'s (which has none) in the PID namespace.
    assert_same_host_paths_ruled_out(
        &outputs,
        [
            ("SHM_DOMAIN", NotSameHost::Network),
            ("SHM_TRANSPORT_DOMAIN", NotSameHost::Network),
            ("CMA_DOMAIN", NotSameHost::Pid),
        ],
    );
    let (transport, ch) = path.expect;
    let want = format!("{transport}/{ch}/{ch}");
    assert_eq!(one(&outputs[0], "LINK1"), want);
    assert_eq!(one(&outputs[1], "LINK0"), want);
}

#[test]
fn across_hosts_the_default_link_is_mpt_over_tcp() {
    cross_host_link("across_hosts_the_default_link_is_mpt_over_tcp", &MPT);
}

#[test]
fn across_hosts_a_forced_inline_channel_goes_over_tcp() {
    cross_host_link("across_hosts_a_forced_inline_channel_goes_over_tcp", &TCP);
}

/// Three hosts on a bridge: every pair of workers selects `mpt`.
#[test]
fn three_hosts_on_a_bridge_all_select_mpt() {
    const TEST: &str = "three_hosts_on_a_bridge_all_select_mpt";
    let Some(outputs) = world_across_hosts(TEST, 3, |rank| {
        init_rpc(options(rank, None)).unwrap();
        exchange_and_report(rank, 3);
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    all_succeeded(TEST, &outputs);
    for (rank, o) in outputs.iter().enumerate() {
        for peer in (0..3).filter(|&p| p != rank) {
            assert_eq!(
                one(o, &format!("LINK{peer}")),
                "tcp/mpt/mpt",
                "{rank}->{peer}"
            );
        }
    }
}

/// Workers that ask only for the same-host paths (`shm` transport, `shm`
/// and `cma` channels) across hosts: the frames fall back to TCP, calls
/// without tensors work, and a call or a result with a tensor fails at
/// once with the typed selection error (the connection stays up) instead
/// of hanging, whether it was queued before the connection was made or
/// sent on it.
#[test]
fn same_host_paths_forced_across_hosts_fail_clearly() {
    const TEST: &str = "same_host_paths_forced_across_hosts_fail_clearly";
    let Some(outputs) = world_across_hosts(TEST, 2, |rank| {
        let mut o = options(rank, Some("cma,shm"));
        o.transports = channel::parse_transports("shm").unwrap();
        init_rpc(o).unwrap();
        let peer = 1 - rank;
        let tensor_call = || {
            let err = IDENTITY_MANY
                .rpc_sync(peer, vec![sample(DType::F32, &[1000], 1)])
                .unwrap_err();
            assert!(
                matches!(err, RpcError::Transport(TransportError::Selection(_))),
                "{err:?}"
            );
            err
        };
        // A tensor in the first call, queued while the connection is made:
        // the writer task refuses it before it leaves.
        println!("QUEUED={}", tensor_call());
        let s: i64 = ADD.rpc_sync(peer, (rank as i64, 1)).unwrap();
        assert_eq!(s, rank as i64 + 1);
        let link = ferry_rpc::agent()
            .unwrap()
            .link_info(peer)
            .unwrap()
            .unwrap();
        println!("TRANSPORT={}", link.transport);
        println!("CHANNELS={}", link.outgoing.len() + link.incoming.len());
        // A tensor in a call on the established connection: refused by
        // the send itself.
        println!("SENT={}", tensor_call());
        // A tensor in the result: the caller gets a remote error.
        let err = MAKE_TENSOR.rpc_sync(peer, 10).unwrap_err();
        assert!(matches!(err, RpcError::Remote { .. }), "{err:?}");
        println!("REMOTE={err}");
        // The connection is still up.
        let s: i64 = ADD.rpc_sync(peer, (2, 2)).unwrap();
        assert_eq!(s, 4);
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    all_succeeded(TEST, &outputs);
    let no_channel = "no channel carries tensors from cpu on the sender to cpu on the receiver: \
                      no channel offered by both workers serves these devices with equal descriptors";
    for o in &outputs {
        assert_eq!(one(o, "TRANSPORT"), "tcp");
        assert_eq!(one(o, "CHANNELS"), "0");
        assert_eq!(one(o, "QUEUED"), no_channel);
        assert_eq!(one(o, "SENT"), no_channel);
        let remote = one(o, "REMOTE");
        assert!(
            remote.contains(&format!("the result was not sent: {no_channel}")),
            "{remote}"
        );
    }
}

/// One network, separate PID (and IPC) namespaces, as containers sharing
/// the host's network: the kernel cannot name the peer process across the
/// PID namespaces, which the shared-memory set-up needs (and `cma` reads
/// by), so `shm` and `cma` must not be selected; the link is `mpt`.
#[test]
fn separate_pid_namespaces_on_one_network_select_mpt() {
    const TEST: &str = "separate_pid_namespaces_on_one_network_select_mpt";
    if worker_rank(TEST).is_none() {
        if let Err(why) = hosts::availability() {
            println!("SKIPPED {TEST}: {why}");
            eprintln!("SKIPPED {TEST}: {why}");
            return;
        }
    }
    let wrapper = |rank: u32| match rank {
        1 => vec![
            "unshare",
            "--pid",
            "--ipc",
            "--mount",
            "--mount-proc",
            "--fork",
            "--kill-child",
        ],
        _ => Vec::new(),
    };
    let Some(outputs) = world_wrapped(TEST, 2, wrapper, |rank| {
        print_offers();
        init_rpc(options(rank, None)).unwrap();
        exchange_and_report(rank, 2);
        ferry_rpc::shutdown().unwrap();
    }) else {
        return;
    };
    all_succeeded(TEST, &outputs);
    assert_eq!(one(&outputs[0], "LINK1"), "tcp/mpt/mpt");
    assert_eq!(one(&outputs[1], "LINK0"), "tcp/mpt/mpt");
    assert_same_host_paths_ruled_out(
        &outputs,
        [
            ("SHM_DOMAIN", NotSameHost::Pid),
            ("SHM_TRANSPORT_DOMAIN", NotSameHost::Pid),
            ("CMA_DOMAIN", NotSameHost::Pid),
        ],
    );
}

/// UCX across hosts (feature `ucx`): UCX's TCP transport reaches the other
/// host over the hosts' link and is selected; UCX's shared-memory
/// transports do not reach it, nor does a UCX bound to loopback, and the
/// link falls back to `mpt` over `tcp` with the typed reason recorded.
#[cfg(feature = "ucx")]
mod ucx {
    use super::*;

    /// Workers offering `ucx`, `mpt` and `inline` over the `ucx` and `tcp`
    /// transports with UCX's transports `tls`; each prints its link and,
    /// if UCX fell back, what each side found (`FALLBACK{peer}=local/peer`,
    /// each `endpoint`, `exchange` or `ok`).
    fn ucx_across_hosts(
        test: &str,
        tls: &'static str,
        env: &'static [(&str, &str)],
    ) -> Option<Vec<Output>> {
        let outputs = world_across_hosts(test, 2, |rank| {
            for (k, v) in env {
                // Before UCX reads its configuration (at the first context).
                std::env::set_var(k, v);
            }
            if let Err(why) = ferry_transport::ucx::viability() {
                println!("SKIPPED {test}: {why}");
                return;
            }
            let mut o = options(rank, Some("ucx,mpt,inline"));
            o.transports = channel::parse_transports("ucx,tcp").unwrap();
            o.channel_config.ucx_tls = Some(tls.into());
            init_rpc(o).unwrap();
            exchange_and_report(rank, 2);
            let agent = ferry_rpc::agent().unwrap();
            let peer = 1 - rank;
            let link = agent.link_info(peer).unwrap().unwrap();
            let side = |u: &Option<ferry_transport::UcxUnusable>| match u {
                None => "ok",
                Some(ferry_transport::UcxUnusable::Endpoint(_)) => "endpoint",
                Some(ferry_transport::UcxUnusable::Exchange(_)) => "exchange",
            };
            match link.ucx_fallback {
                Some(why) => {
                    println!("FALLBACK{peer}={}/{}", side(&why.local), side(&why.peer));
                    println!("REASON{peer}={why}");
                }
                None => println!("FALLBACK{peer}=none"),
            }
            ferry_rpc::shutdown().unwrap();
        })?;
        all_succeeded(test, &outputs);
        if outputs.iter().any(|o| o.stdout.contains("SKIPPED")) {
            return None;
        }
        Some(outputs)
    }

    #[test]
    fn across_hosts_ucx_over_its_tcp_transport_is_selected() {
        const TEST: &str = "ucx::across_hosts_ucx_over_its_tcp_transport_is_selected";
        let Some(outputs) = ucx_across_hosts(TEST, "tcp", &[]) else {
            return;
        };
        assert_eq!(
            one(&outputs[0], "LINK1"),
            "ucx/ucx/ucx",
            "{}",
            outputs[0].stdout
        );
        assert_eq!(
            one(&outputs[1], "LINK0"),
            "ucx/ucx/ucx",
            "{}",
            outputs[1].stdout
        );
        assert_eq!(one(&outputs[0], "FALLBACK1"), "none");
        assert_eq!(one(&outputs[1], "FALLBACK0"), "none");
    }

    /// UCX's shared-memory transports cannot reach another host: both
    /// sides find no endpoint (or no first exchange) and fall back.
    #[test]
    fn across_hosts_ucx_shared_memory_is_not_viable_and_falls_back_to_mpt() {
        const TEST: &str =
            "ucx::across_hosts_ucx_shared_memory_is_not_viable_and_falls_back_to_mpt";
        let Some(outputs) = ucx_across_hosts(TEST, "shm,self", &[]) else {
            return;
        };
        assert_fell_back(&outputs);
    }

    /// A UCX whose TCP transport is bound to loopback advertises an
    /// address the other host cannot reach: the first exchange (or the
    /// endpoint) fails and the link falls back.
    #[test]
    fn across_hosts_ucx_bound_to_loopback_falls_back_to_mpt() {
        const TEST: &str = "ucx::across_hosts_ucx_bound_to_loopback_falls_back_to_mpt";
        let Some(outputs) = ucx_across_hosts(TEST, "tcp", &[("UCX_NET_DEVICES", "lo")]) else {
            return;
        };
        assert_fell_back(&outputs);
    }

    fn assert_fell_back(outputs: &[Output]) {
        assert_eq!(one(&outputs[0], "LINK1"), "tcp/mpt/mpt");
        assert_eq!(one(&outputs[1], "LINK0"), "tcp/mpt/mpt");
        let (a, b) = (one(&outputs[0], "FALLBACK1"), one(&outputs[1], "FALLBACK0"));
        assert_ne!(a, "none", "{}", outputs[0].stdout);
        // Each side's view of the other is the other's view of itself.
        let swap = |s: &str| {
            let (l, p) = s.split_once('/').unwrap();
            format!("{p}/{l}")
        };
        assert_eq!(swap(&a), b);
        assert_ne!(a, "ok/ok");
        println!("rank 0: {}", one(&outputs[0], "REASON1"));
        println!("rank 1: {}", one(&outputs[1], "REASON0"));
    }
}

/// Starts this process's agent and makes it the process's (what
/// `ferry::init_rpc` does, with only the layers `options` has).
fn init_rpc(options: ferry_rpc::RpcOptions) -> Result<ferry_rpc::Agent, ferry_rpc::RpcError> {
    let agent = ferry_rpc::Agent::start(options)?;
    ferry_rpc::set_process_agent(&agent)?;
    Ok(agent)
}
