"""Tensors between Python workers over each transport and tensor channel:
the link narrowed to one of them by the environment, as the Rust RPC
suite is run once per combination (``cargo xtask test``); every tensor out
of band (``FERRY_SMALL_TENSOR_BYTES=0``). Each combination is a group of
its own (``link_pair.py``), since a process joins one group."""

import pytest

import group
import hosts

#: (transport, channel) pairs on one host, narrowed to each; across hosts
#: the selection itself must rule the same-host ones out.
LINKS = [
    ("shm", "cma"),
    ("shm", "shm"),
    ("shm", "mpt"),
    ("tcp", "inline"),
    ("tcp", "mpt"),
]


@pytest.mark.parametrize("transport,channel", LINKS, ids=[f"{t}-{c}" for t, c in LINKS])
def test_tensors_round_trip_over_the_link_asked_for(transport, channel):
    port = group.free_port()
    env = {
        "FERRY_TRANSPORTS": transport,
        "FERRY_CHANNELS": channel,
        "FERRY_SMALL_TENSOR_BYTES": "0",
    }
    procs = group.start(
        ["link_pair.py", transport, channel],
        ranks=[0, 1],
        world_size=2,
        port=port,
        extra_env=env,
    )
    codes = group.join(procs)
    assert codes == [0, 0], f"workers exited with {codes} (their stderr says why)"


def test_across_hosts_tensors_go_over_tcp_and_mpt():
    """Each worker on a host of its own (network, IPC and PID namespaces
    joined by a veth pair): nothing narrowed, the link must be ``tcp``
    with the ``mpt`` channel, and tensors arrive as on one host."""
    why = hosts.unavailable()
    if why is not None:
        pytest.skip(f"separate hosts cannot be made here: {why}")
    with hosts.Hosts() as h:
        port = group.free_port()
        procs = group.start(
            ["link_pair.py", "tcp", "mpt"],
            ranks=[0, 1],
            world_size=2,
            port=port,
            extra_env={"MASTER_ADDR": h.address(0), "FERRY_SMALL_TENSOR_BYTES": "0"},
            prefix=lambda rank: h.enter(rank, wd=group.HERE),
        )
        codes = group.join(procs)
    assert codes == [0, 0], f"workers exited with {codes} (their stderr says why)"
