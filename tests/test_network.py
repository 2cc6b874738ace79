"""The emulated cluster network: built, shaped to the rate asked, cleaned up."""

import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from hopq.cluster import network
from hopq.cluster.launch import run_workers
from hopq.cluster.network import (
    CONGESTION,
    WORKER_IFACE,
    EmulatedNetwork,
    payload_fraction,
    unavailable_reason,
)

WHY = unavailable_reason()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no emulated network here: {WHY}")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _transfer(rank: int, n: int, nbytes: int) -> float:
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(buf, 1)
    else:
        dist.recv(buf, 0)
    dist.barrier()
    return time.perf_counter() - t0


def test_shaped_rate_and_cleanup():
    before = _namespaces()
    with EmulatedNetwork(2, rate_mbit=80) as net:
        assert len(net.namespaces) == 2 and set(net.namespaces) <= _namespaces()
        nbytes = 4 << 20
        seconds = run_workers(2, _transfer, nbytes, namespaces=net.namespaces, timeout=120)[0]
    rate = nbytes * 8 / seconds / 1e6
    assert 0.6 * 80 < rate < 1.1 * 80, f"measured {rate:.1f} Mbit/s on an 80 Mbit/s link"
    assert _namespaces() == before  # everything removed


def test_cleanup_on_failure():
    before = _namespaces()
    with pytest.raises(RuntimeError), EmulatedNetwork(2, rate_mbit=50):
        raise RuntimeError("a worker failed")
    assert _namespaces() == before


def test_jumbo_frames():
    """mtu=9000: every link has that MTU, and a transfer crosses it at the rate."""
    with EmulatedNetwork(2, rate_mbit=80, mtu=9000) as net:
        shown = subprocess.run(
            ["ip", "netns", "exec", net.namespaces[0], "ip", "link", "show", WORKER_IFACE],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "mtu 9000" in shown
        nbytes = 4 << 20
        seconds = run_workers(2, _transfer, nbytes, namespaces=net.namespaces, timeout=120)[0]
    rate = nbytes * 8 / seconds / 1e6
    assert 0.6 * 80 < rate < 1.1 * 80, f"measured {rate:.1f} Mbit/s on an 80 Mbit/s link"


def test_tcp_congestion_is_pinned_not_inherited(monkeypatch, tmp_path):
    """Every worker namespace runs the congestion control asked for (reno by
    default, whatever the host's default is), and the report says which; one the
    host does not allow is refused by name instead of silently left at the host's:
    before any namespace is built where the host lists the allowed ones, else by
    the namespace setup."""
    with EmulatedNetwork(2, rate_mbit=80) as net:
        for ns in net.namespaces:
            got = subprocess.run(
                ["ip", "netns", "exec", ns, "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                capture_output=True, text=True, check=True,
            ).stdout.strip()  # fmt: skip
            assert got == CONGESTION == "reno"
        assert net.describe().endswith("TCP reno")
    before = _namespaces()
    if network.ALLOWED_CONGESTION.exists():
        with pytest.raises(ValueError, match="nosuchcc: this host lets network namespaces"):
            EmulatedNetwork(2, rate_mbit=80, congestion="nosuchcc")
    monkeypatch.setattr(network, "ALLOWED_CONGESTION", tmp_path / "unreadable")
    refused = EmulatedNetwork(2, rate_mbit=80, congestion="nosuchcc")
    with pytest.raises(RuntimeError, match="nosuchcc.*allowed"), refused:
        pass
    assert _namespaces() == before  # cleaned up after the refusal


def test_payload_fraction():
    assert payload_fraction(1500) == pytest.approx(1448 / 1514)
    assert payload_fraction(9000) == pytest.approx(8948 / 9014)


def test_bad_arguments():
    with pytest.raises(ValueError):
        EmulatedNetwork(0, rate_mbit=10)
    with pytest.raises(ValueError):
        EmulatedNetwork(2, rate_mbit=0)
    with pytest.raises(ValueError, match="mtu"):
        EmulatedNetwork(2, rate_mbit=10, mtu=100)
    with pytest.raises(ValueError, match="congestion"):
        EmulatedNetwork(2, rate_mbit=10, congestion="reno; rm")


def test_agreement_cost_runs_on_the_emulated_network():
    """--agreement-cost with --rate-mbit measures on the shaped links, and its
    report says so (it used to ignore the rate and run over loopback); it
    times every --microshards depth asked for (it used to ignore them too)."""
    from hopq.bench import allreduce

    o = allreduce.Options(
        world_size=2, min_bytes=4096, max_bytes=4096, codecs=("bf16",), topologies=("ring",),
        budget_s=0.01, rate_mbit=100, agreement_cost=True, microshards=(0, 2),
    )  # fmt: skip
    report = allreduce.run(o)
    assert "over an emulated network, 100 Mbit/s per worker" in report
    assert " bf16/ring |" in report and " bf16/ring/u2 |" in report
