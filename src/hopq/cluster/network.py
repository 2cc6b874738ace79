"""An emulated cluster network on one machine: network namespaces, veth and tbf.

On one machine loopback is far faster than the links compressed all-reduce is
for, so the training job and the all-reduce benchmark can run their workers
inside a network built here (root and iproute2 needed; ``netem`` is not, only
``tc ... tbf``):

* a "switch" namespace holding a bridge;
* per worker a namespace with one veth link to the bridge, address
  10.213.0.(i+1)/24, shaped with a token bucket at ``rate_mbit`` in each
  direction (upload on the worker's end, download on the switch's end);
* in every worker namespace one TCP congestion control, ``reno`` by default
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
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType

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
    """``with EmulatedNetwork(4, rate_mbit=1000) as net:`` then run worker i in
    ``net.namespaces[i]`` (see :func:`hopq.cluster.launch.run_workers`)."""

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
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    namespaces: list[str] = field(default_factory=list)
    _created: list[str] = field(default_factory=list)
    _old_term: object = None

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("an emulated network needs at least one worker")
        if not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {self.rate_mbit}")
        check_mtu(self.mtu)
        check_congestion(self.congestion)

    def describe(self) -> str:
        """The network in a report's words."""
        return f"{self.rate_mbit:.4g} Mbit/s per worker (tc tbf), MTU {self.mtu}, TCP {self.congestion}"

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

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def _tbf(self, ns: str, dev: str) -> None:
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = self.burst_bytes or max(
            16 * 1024, int(rate_bytes / 250) + self.mtu + 100, 2 * (self.mtu + 100)
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
            f"{self.rate_mbit}mbit",
            "burst",
            str(burst),
            "latency",
            f"{self.latency_ms}ms",
        )

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
            for i in range(self.workers):
                ns = f"hq{self.tag}w{i}"
                a, b = f"hq{self.tag}w{i}a", f"hq{self.tag}w{i}b"
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
                    f"{self.address(i)}/24",
                    "dev",
                    WORKER_IFACE,
                )
                _run("ip", "netns", "exec", ns, "ip", "link", "set", WORKER_IFACE, "up")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                self._congestion(ns)
                _run("ip", "netns", "exec", self.switch, "ip", "link", "set", b, "master", "br0")
                _run("ip", "netns", "exec", self.switch, "ip", "link", "set", b, "up")
                _run("ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "mtu", mtu)
                self._tbf(ns, WORKER_IFACE)  # upload
                self._tbf(self.switch, b)  # download
                self.namespaces.append(ns)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Remove everything this network created (idempotent)."""
        while self._created:
            ns = self._created.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.namespaces.clear()

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
