"""An emulated cluster network on one machine: network namespaces, veth and tbf.

On one machine loopback is far faster than the links compressed all-reduce is
for, so the training job and the all-reduce benchmark can run their workers
inside a network built here (root and iproute2 needed; ``netem`` is not, only
``tc ... tbf``):

* a "switch" namespace holding a bridge;
* per node a namespace with one veth link to the bridge, address
  10.213.0.(k+1)/24, shaped with a token bucket at ``rate_mbit`` in each
  direction (upload on the node's end, download on the switch's end); a node
  runs one worker by default, or ``workers_per_node`` that share its namespace
  and talk to each other over its loopback (shaped to ``intra_rate_mbit`` when
  given), as the workers of one machine do;
* in every node namespace one TCP congestion control, ``reno`` by default
  (:data:`CONGESTION`), set explicitly rather than inherited from the host.

Why the congestion control is pinned: a new namespace takes the host's default,
and on a host whose default is BBR (this project's machines) BBR paces each
connection at its own estimate of the bottleneck rate, with phases at 0.75x
of it and a drain to four packets every 10 s. All-reduce traffic comes in
messages with gaps, not one long stream, and on a 200 Mbit/s link that showed
up as runs of messages at 15 ms instead of 11.3 ms and stalls of 20-50 ms, on
one rank or two per call: the slowest rank's time (what a collective costs)
varied by 10% from call to call for reasons that belong to the host, not to
the link. Reno (Linux's built-in loss-based control, allowed in every
namespace) never paces below the link on this loss-free, deep-queued bucket,
so the link is the only limit, as on a cluster whose switches are the
bottleneck. ``congestion="bbr"`` (or any algorithm the host allows in
namespaces) brings the host's behaviour back.

The token bucket counts whole Ethernet frames, headers included: at the default
MTU of 1500 a TCP stream carries 1448 payload bytes per 1514 bytes on the link
(:func:`payload_fraction`, 95.6%), so no transfer's payload moves faster than
that share of ``rate_mbit``. ``mtu=9000`` (jumbo frames, as datacenter fabrics
run) raises it to 99.3%.

Every namespace and interface this creates is removed on exit, on Ctrl-C, on
SIGTERM and on failure (deleting a namespace deletes the veth ends in it).
Without root or the tools, :func:`unavailable_reason` says why and callers run
on plain loopback.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO

CLONE_NEWNET = 0x40000000
#: The worker's interface name inside its namespace (GLOO_SOCKET_IFNAME).
WORKER_IFACE = "hq0"
SUBNET = "10.213.0"
#: Bytes of every TCP/IPv4 segment that are not payload (IP 20, TCP 20, the
#: timestamp option Linux sends 12), and of the Ethernet header the token
#: bucket also counts.
TCP_IP_HEADER_BYTES = 52
ETHERNET_HEADER_BYTES = 14
#: The TCP congestion control every worker namespace uses unless told otherwise.
CONGESTION = "reno"


def check_mtu(mtu: int) -> int:
    """``mtu`` if a link can take it (576, IPv4's minimum, to 65535), else ValueError."""
    if not 576 <= mtu <= 65535:
        raise ValueError(f"--mtu must be between 576 and 65535, got {mtu}")
    return mtu


#: Where Linux lists the congestion controls that network namespaces may set.
ALLOWED_CONGESTION = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")


def check_nodes(
    world_size: int, world_size_given: bool, nodes: int, workers_per_node: int,
    intra_rate_mbit: float,
) -> int:  # fmt: skip
    """The world size of ``nodes`` x ``workers_per_node`` (``nodes`` 0: the given
    world size), checked: a world size given beside nodes must match, the workers
    must fill whole nodes, and a node's loopback is shaped only with several
    workers. Raises ValueError naming the command-line option."""
    if workers_per_node < 1 or nodes < 0:
        raise ValueError("--workers-per-node must be >= 1 and --nodes >= 0")
    if nodes:
        n = nodes * workers_per_node
        if world_size_given and world_size != n:
            raise ValueError(
                f"--world-size {world_size} is not --nodes {nodes} x "
                f"--workers-per-node {workers_per_node}: give one or the other"
            )
        world_size = n
    if world_size % workers_per_node:
        raise ValueError(
            f"--workers-per-node {workers_per_node} must divide the {world_size} workers"
        )
    if not intra_rate_mbit >= 0:
        raise ValueError("--intra-rate-mbit must be >= 0 (0: unshaped)")
    if intra_rate_mbit and workers_per_node == 1:
        raise ValueError("--intra-rate-mbit shapes a node's loopback: give --workers-per-node > 1")
    return world_size


def check_congestion(name: str, allowed_file: Path | None = None) -> str:
    """``name`` if it names a TCP congestion control that this host lets network
    namespaces set (``allowed_file``, by default :data:`ALLOWED_CONGESTION`,
    lists them; where it cannot be read, any identifier passes and the
    namespace setup refuses a bad one), else ValueError naming the allowed ones."""
    if not name or not name.isidentifier():
        raise ValueError(f"--tcp-congestion must name a TCP congestion control, got {name!r}")
    allowed_file = allowed_file or ALLOWED_CONGESTION
    try:
        allowed = allowed_file.read_text().split()
    except OSError:
        return name
    if allowed and name not in allowed:
        raise ValueError(
            f"--tcp-congestion {name}: this host lets network namespaces set only "
            f"{', '.join(allowed)} ({allowed_file})"
        )
    return name


def payload_fraction(mtu: int = 1500) -> float:
    """The share of a link's bytes that a long TCP transfer's payload gets at
    this MTU (the rest are TCP/IP and Ethernet headers)."""
    return (mtu - TCP_IP_HEADER_BYTES) / (mtu + ETHERNET_HEADER_BYTES)


def unavailable_reason() -> str | None:
    """None if an emulated network can be built here, else why not."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command (iproute2) is missing"
    probe = f"hqprobe{secrets.token_hex(3)}"
    try:
        _run("ip", "netns", "add", probe)
    except RuntimeError as e:
        return f"cannot create a network namespace: {e}"
    try:
        _run("ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up")
        _run(
            "ip",
            "netns",
            "exec",
            probe,
            "tc",
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            "100mbit",
            "burst",
            "32kb",
            "latency",
            "50ms",
        )
    except RuntimeError as e:
        return f"tc tbf does not work here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _run(*cmd: str) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.returncode}")


def _read_sysctl(ns: str, key: str) -> str:
    r = subprocess.run(
        ["ip", "netns", "exec", ns, "sysctl", "-n", key],
        capture_output=True,
        text=True,
        check=False,
    )
    return r.stdout.strip()


#: Seconds a launcher gets to stop its own workers after SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """End every process still running, and its process group: SIGTERM first (a
    launcher such as torchrun then stops its workers, which it starts outside
    its own process group), SIGKILL after :data:`STOP_GRACE_S`."""
    live = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
        end = time.monotonic() + STOP_GRACE_S
        while any(p.poll() is None for p in live) and time.monotonic() < end:
            time.sleep(0.05)
        live = [p for p in live if p.poll() is None]
        if not live:
            return


def enter_namespace(name: str) -> None:
    """Move the calling process's (main) thread into network namespace ``name``.
    Call it before creating sockets or threads that must live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class EmulatedNetwork:
    """``with EmulatedNetwork(4, rate_mbit=1000) as net:`` then run rank i in
    ``net.namespaces[i]`` (see :func:`hopq.cluster.launch.run_workers`).

    ``workers_per_node=G`` groups the ranks into ``workers // G`` nodes as a
    cluster of machines does: ranks ``k*G .. k*G+G-1`` share node k's namespace
    (``net.namespaces[i] == net.node_namespaces[i // G]``), so their traffic to
    each other stays on that namespace's loopback, shaped to ``intra_rate_mbit``
    when given (one token bucket on ``lo``: every byte between the node's
    workers, all directions together, as on a shared bus); only traffic between
    nodes crosses node k's uplink, shaped to ``rate_mbit`` each way. The
    default, one worker per node, is the flat network of the module's docstring.
    """

    workers: int
    rate_mbit: float
    #: Token bucket depth: at least one MTU and one scheduler tick at the rate.
    burst_bytes: int | None = None
    #: Longest a packet may wait in the bucket before it is dropped.
    latency_ms: float = 200.0
    #: Every link's MTU (1500: plain Ethernet; 9000: jumbo frames).
    mtu: int = 1500
    #: TCP congestion control in every worker namespace (see the module's docstring).
    congestion: str = CONGESTION
    #: Workers per node (namespace); ``workers`` must be a multiple of it.
    workers_per_node: int = 1
    #: Rate of each node's loopback in Mbit/s (all its intra-node traffic); 0: unshaped.
    intra_rate_mbit: float = 0.0
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    #: Per rank: the namespace it runs in (its node's).
    namespaces: list[str] = field(default_factory=list)
    #: Per node: its namespace.
    node_namespaces: list[str] = field(default_factory=list)
    _created: list[str] = field(default_factory=list)
    _old_term: object = None

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("an emulated network needs at least one worker")
        if not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {self.rate_mbit}")
        if self.workers_per_node < 1 or self.workers % self.workers_per_node:
            raise ValueError(
                f"workers_per_node must divide the {self.workers} workers, "
                f"got {self.workers_per_node}"
            )
        if not self.intra_rate_mbit >= 0:
            raise ValueError(
                f"intra_rate_mbit must be >= 0 (0: unshaped), got {self.intra_rate_mbit}"
            )
        if self.nodes > 254:
            raise ValueError(f"at most 254 nodes fit the emulated subnet, got {self.nodes}")
        check_mtu(self.mtu)
        check_congestion(self.congestion)

    @property
    def nodes(self) -> int:
        """How many nodes (namespaces joined by shaped links)."""
        return self.workers // self.workers_per_node

    def node_of(self, rank: int) -> int:
        """The node that rank ``rank`` runs on."""
        return rank // self.workers_per_node

    def describe(self) -> str:
        """The network in a report's words."""
        link = (
            f"{self.rate_mbit:.4g} Mbit/s per {'worker' if self.workers_per_node == 1 else 'node'}"
        )
        if self.workers_per_node > 1:
            lo = f"{self.intra_rate_mbit:.4g} Mbit/s" if self.intra_rate_mbit else "unshaped"
            link = (
                f"{self.nodes} nodes x {self.workers_per_node} workers, {link}, "
                f"loopback inside a node {lo}"
            )
        return f"{link} (tc tbf), MTU {self.mtu}, TCP {self.congestion}"

    def _congestion(self, ns: str) -> None:
        """Set the namespace's TCP congestion control; refuse one the host does not
        allow in namespaces, naming those it does."""
        key = "net.ipv4.tcp_congestion_control"
        try:
            _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={self.congestion}")
        except RuntimeError as e:
            allowed = _read_sysctl(ns, "net.ipv4.tcp_allowed_congestion_control")
            raise RuntimeError(
                f"TCP congestion control {self.congestion!r} cannot be set in a network "
                f"namespace here (allowed: {allowed or 'unknown'}): {e}"
            ) from e
        got = _read_sysctl(ns, key)
        if got != self.congestion:  # never silently another one
            raise RuntimeError(f"asked for TCP {self.congestion}, the namespace uses {got!r}")

    @property
    def switch(self) -> str:
        return f"hq{self.tag}sw"

    def address(self, node: int) -> str:
        """Node ``node``'s address on the emulated network (its workers' too)."""
        return f"{SUBNET}.{node + 1}"

    def _tbf(self, ns: str, dev: str, rate_mbit: float, packet: int) -> None:
        """A token bucket at ``rate_mbit`` on ``dev``'s egress; ``packet``: the
        largest frame it must pass whole (a bucket shallower than a frame drops it)."""
        rate_bytes = rate_mbit * 1e6 / 8
        burst = self.burst_bytes or max(
            16 * 1024, int(rate_bytes / 250) + packet + 100, 2 * (packet + 100)
        )
        _run(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{rate_mbit}mbit",
            "burst",
            str(burst),
            "latency",
            f"{self.latency_ms}ms",
        )

    def _loopback_mtu(self, ns: str) -> int:
        r = subprocess.run(
            ["ip", "netns", "exec", ns, "cat", "/sys/class/net/lo/mtu"],
            capture_output=True,
            text=True,
            check=False,
        )
        return int(r.stdout.strip() or 65536)

    def build(self) -> EmulatedNetwork:
        why = unavailable_reason()
        if why:
            raise RuntimeError(why)
        try:
            _run("ip", "netns", "add", self.switch)
            self._created.append(self.switch)
            _run("ip", "netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge")
            _run("ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "up")
            mtu = str(self.mtu)
            for k in range(self.nodes):
                ns = f"hq{self.tag}n{k}"
                a, b = f"hq{self.tag}n{k}a", f"hq{self.tag}n{k}b"
                _run("ip", "netns", "add", ns)
                self._created.append(ns)
                _run(
                    "ip",
                    "link",
                    "add",
                    a,
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    b,
                    "netns",
                    self.switch,
                )
                _run("ip", "netns", "exec", ns, "ip", "link", "set", a, "mtu", mtu)
                _run("ip", "netns", "exec", self.switch, "ip", "link", "set", b, "mtu", mtu)
                _run("ip", "netns", "exec", ns, "ip", "link", "set", a, "name", WORKER_IFACE)
                _run(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "ip",
                    "addr",
                    "add",
                    f"{self.address(k)}/24",
                    "dev",
                    WORKER_IFACE,
                )
                _run("ip", "netns", "exec", ns, "ip", "link", "set", WORKER_IFACE, "up")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                self._congestion(ns)
                _run("ip", "netns", "exec", self.switch, "ip", "link", "set", b, "master", "br0")
                _run("ip", "netns", "exec", self.switch, "ip", "link", "set", b, "up")
                _run("ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "mtu", mtu)
                self._tbf(ns, WORKER_IFACE, self.rate_mbit, self.mtu)  # upload
                self._tbf(self.switch, b, self.rate_mbit, self.mtu)  # download
                if self.intra_rate_mbit > 0:
                    # traffic between two processes of one namespace goes through
                    # lo (to any local address, the hq0 one included): one
                    # bucket there shapes all of it, both directions together
                    self._tbf(ns, "lo", self.intra_rate_mbit, self._loopback_mtu(ns))
                self.node_namespaces.append(ns)
            self.namespaces.extend(
                self.node_namespaces[self.node_of(r)] for r in range(self.workers)
            )
        except BaseException:
            self.close()
            raise
        return self

    def run_per_node(
        self,
        command: Callable[[int], Sequence[str]],
        env: Callable[[int], dict[str, str]] | None = None,
        timeout: float = 600,
    ) -> list[subprocess.CompletedProcess[str]]:
        """Run ``command(k)`` in node k's namespace for every node at once (as
        ``ip netns exec``), with ``env(k)`` added to this process's environment,
        ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` set to the node's interface,
        ``NODE_RANK``, ``NNODES`` and ``MASTER_ADDR`` (node 0's address). Wait
        for all; return each node's outcome (stdout and stderr captured, as
        text). When one fails or ``timeout`` seconds pass, the others are
        stopped (a launch that lost a node would otherwise wait on it until its
        own timeout); a timed-out node's return code is then negative.

        Example:
            ``net.run_per_node(lambda k: ["torchrun", "--nnodes", str(net.nodes), ...])``
        """
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[tuple[IO[bytes], IO[bytes]]] = []
        with contextlib.ExitStack() as files:
            try:
                for k, ns in enumerate(self.node_namespaces):
                    e = {
                        **os.environ,
                        "GLOO_SOCKET_IFNAME": WORKER_IFACE,
                        "NCCL_SOCKET_IFNAME": WORKER_IFACE,
                        "NODE_RANK": str(k),
                        "NNODES": str(self.nodes),
                        "MASTER_ADDR": self.address(0),
                        **(env(k) if env else {}),
                    }
                    # files, not pipes: a chatty launcher never blocks on a full pipe
                    o, err = (files.enter_context(tempfile.TemporaryFile()) for _ in range(2))
                    logs.append((o, err))
                    procs.append(
                        subprocess.Popen(
                            ["ip", "netns", "exec", ns, *command(k)],
                            env=e,
                            stdout=o,
                            stderr=err,
                            start_new_session=True,  # its own group: stopped whole below
                        )
                    )
                end = time.monotonic() + timeout
                while time.monotonic() < end:
                    codes = [p.poll() for p in procs]
                    if all(c is not None for c in codes) or any(c for c in codes):
                        break  # all done, or one node failed: stop the rest
                    time.sleep(0.05)
            finally:
                _stop(procs)
            out = []
            for p, pair in zip(procs, logs, strict=True):
                texts = []
                for f in pair:
                    f.seek(0)
                    texts.append(f.read().decode(errors="replace"))
                out.append(subprocess.CompletedProcess(p.args, p.returncode, *texts))
        return out

    def close(self) -> None:
        """Remove everything this network created (idempotent)."""
        while self._created:
            ns = self._created.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.namespaces.clear()
        self.node_namespaces.clear()

    def __enter__(self) -> EmulatedNetwork:
        atexit.register(self.close)

        def on_term(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)  # unwinds through __exit__

        try:
            self._old_term = signal.signal(signal.SIGTERM, on_term)
        except ValueError:  # not the main thread: atexit still cleans up
            self._old_term = None
        return self.build()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        atexit.unregister(self.close)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)  # type: ignore[arg-type]
