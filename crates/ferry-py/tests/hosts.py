"""Two "hosts" on one machine for cross-host tests, as ferry-testkit's
``hosts`` module makes them for the Rust suites: each host has its own
network, IPC, PID, UTS and mount namespaces (its own ``/proc``,
``/dev/shm`` and ``/sys``), held by an anchor (``unshare ... sh``), and the
two are joined by a veth pair (``10.77.2.1`` and ``10.77.2.2``). Processes
are placed on a host with ``nsenter`` (:meth:`Hosts.enter`). Closing the
set kills the anchors, and the kernel then ends every process of each
host and frees the links. Needs root, ``unshare``, ``nsenter`` and
``ip``; :func:`unavailable` says why not where they are missing.
"""

import os
import select
import subprocess
import time

FLAGS = ["--net", "--ipc", "--pid", "--uts", "--mount", "--fork", "--kill-child", "--mount-proc"]
SCRIPT = (
    'echo "$1" > /proc/sys/kernel/hostname && '
    "{ [ ! -d /dev/shm ] || mount -t tmpfs -o mode=1777 tmpfs /dev/shm; } && "
    "mount -t sysfs -o ro sysfs /sys && echo ready && read _"
)
LINK = "ferry0"
SUBNET = "10.77.2"
#: How long the link may take to come up (seconds).
LINK_UP_BOUND_S = 10


def unavailable():
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("unshare", "nsenter", "ip"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"`{tool}` is missing"
    probe = subprocess.run(["unshare", *FLAGS, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`unshare {' '.join(FLAGS)}` failed: {probe.stderr.strip()}"
    return None


def _run(*args, input=None):
    out = subprocess.run(list(args), input=input, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {out.stderr.strip()}")


class Hosts:
    """Two hosts joined by a veth pair; a context manager."""

    def __init__(self):
        self.anchors = []
        try:
            for h in range(2):
                self.anchors.append(self._anchor(f"ferry-host-{h}"))
            a, b = (str(p.pid) for p in self.anchors)
            _run("ip", "link", "add", LINK, "netns", a, "type", "veth", "peer", "name", LINK, "netns", b)
            # Watch both ends before bringing them up (a veth end has
            # carrier once both are up): no state change is missed.
            nets = [f"--net={self.ns(h, 'net')}" for h in range(2)]
            monitors = [
                subprocess.Popen(["nsenter", net, "ip", "-o", "monitor", "link"], stdout=subprocess.PIPE, text=True)
                for net in nets
            ]
            try:
                for h, net in enumerate(nets):
                    script = f"link set lo up\naddr add {self.address(h)}/24 dev {LINK}\nlink set {LINK} up\n"
                    _run("nsenter", net, "ip", "-batch", "-", input=script)
                for net, monitor in zip(nets, monitors):
                    self._wait_running(net, monitor)
            finally:
                for monitor in monitors:
                    monitor.kill()
                    monitor.wait()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _anchor(name):
        p = subprocess.Popen(
            ["unshare", *FLAGS, "sh", "-c", SCRIPT, "anchor", name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if p.stdout.readline().strip() != "ready":
            p.kill()
            raise RuntimeError(f"the anchor of {name} did not start: {p.stderr.read().strip()}")
        return p

    @staticmethod
    def _wait_running(net, monitor):
        """Until the link has carrier (LOWER_UP), from `ip link show` or, if
        not yet, from the monitor's lines; bounded."""
        show = subprocess.run(
            ["nsenter", net, "ip", "-o", "link", "show", "dev", LINK], capture_output=True, text=True
        )
        if "LOWER_UP" in show.stdout:
            return
        deadline = time.monotonic() + LINK_UP_BOUND_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{LINK} not up within {LINK_UP_BOUND_S} s")
            ready, _, _ = select.select([monitor.stdout], [], [], left)
            if ready:
                line = monitor.stdout.readline()
                if LINK in line and "LOWER_UP" in line:
                    return

    def ns(self, host, kind):
        return f"/proc/{self.anchors[host].pid}/ns/{kind}"

    def address(self, host):
        return f"{SUBNET}.{host + 1}"

    def enter(self, host, wd=None):
        """The command prefix that runs a program on ``host``, in ``wd``
        (default: this process's directory)."""
        return [
            "nsenter",
            f"--net={self.ns(host, 'net')}",
            f"--ipc={self.ns(host, 'ipc')}",
            f"--uts={self.ns(host, 'uts')}",
            f"--mount={self.ns(host, 'mnt')}",
            f"--pid={self.ns(host, 'pid_for_children')}",
            f"--wd={wd or os.getcwd()}",
            "--",
        ]

    def close(self):
        for p in self.anchors:
            if p.poll() is None:
                p.stdin.close()
                p.kill()
            p.wait()
        self.anchors = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
