"""An emulated cluster of 2 nodes x 2 workers: the workers of a node share its
namespace and loopback, nodes talk over shaped links; torchrun started once per
node (c10d rendezvous, as on real machines) trains with hopq's DDP hook and every
rank ends with the same parameters."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hopq.cluster.launch import layout_env, run_workers
from hopq.cluster.network import EmulatedNetwork, unavailable_reason


def _why_not() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "building network namespaces needs root"
    return unavailable_reason()  # also: the ip/tc commands missing, namespaces refused


WHY = _why_not()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no emulated cluster here: {WHY}")
SCRIPT = Path(__file__).with_name("cluster_ddp_script.py")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _layout_and_rates(rank: int, n: int, nbytes: int) -> tuple[dict[str, str], dict[int, float]]:
    """This rank's torchrun variables, its namespace, and rank 0's send rates in
    Mbit/s to rank 1 (same node) and rank 2 (the other node)."""
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    env["netns"] = str(os.stat("/proc/self/ns/net").st_ino)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    rates = {}
    for peer in (1, 2):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
        elif rank == peer:
            dist.recv(buf, 0)
        dist.barrier()
        rates[peer] = nbytes * 8 / (time.perf_counter() - t0) / 1e6
    return env, rates


def _sum_of_ranks(rank: int, n: int) -> int:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return int(t.item())


def test_run_workers_without_a_time_limit():
    """``timeout=None`` waits for the ranks however long they take (a long
    training job); they still run and return as with a limit."""
    assert run_workers(2, _sum_of_ranks, timeout=None) == [1, 1]


def test_two_nodes_share_a_namespace_and_their_links_are_shaped():
    """Ranks 0, 1 on node 0 and 2, 3 on node 1, each with torchrun's variables;
    between nodes the link's rate, inside a node the loopback's."""
    before = _namespaces()
    with EmulatedNetwork(4, rate_mbit=80, workers_per_node=2, intra_rate_mbit=320) as net:
        assert net.nodes == 2 and len(net.node_namespaces) == 2
        assert net.namespaces == [net.node_namespaces[r // 2] for r in range(4)]
        assert "2 nodes x 2 workers" in net.describe()
        out = run_workers(
            4, _layout_and_rates, 2 << 20, namespaces=net.namespaces, workers_per_node=2, timeout=120
        )  # fmt: skip
    assert _namespaces() == before  # everything removed
    envs = [e for e, _ in out]
    for r, e in enumerate(envs):
        assert (e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == (
            str(r), str(r % 2), "2", str(r // 2)
        )  # fmt: skip
    assert envs[0]["netns"] == envs[1]["netns"] != envs[2]["netns"] == envs[3]["netns"]
    rates = out[0][1]
    assert 0.6 * 320 < rates[1] < 1.1 * 320, f"inside a node: {rates[1]:.0f} of 320 Mbit/s"
    assert 0.6 * 80 < rates[2] < 1.1 * 80, f"between nodes: {rates[2]:.0f} of 80 Mbit/s"


def test_torchrun_per_node_trains_to_identical_parameters(tmp_path):
    """The recipe of docs/integrations/multinode.md on two emulated machines: one
    torchrun per node (c10d rendezvous at node 0's address), hopq's DDP hook
    (DynamiQ, two-tier with layout="auto" from torchrun's variables) over the
    shaped links; both launches exit 0, every rank knows its node, the calls
    ran two-tier, and all four end with bit-identical parameters."""
    before = _namespaces()
    with EmulatedNetwork(4, rate_mbit=200, workers_per_node=2) as net:

        def torchrun(k: int) -> list[str]:
            cmd = [sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(k),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net.address(0)}:29400",
                   "--rdzv-id", "hopq-test", "--local-addr", net.address(k)]  # fmt: skip
            if k == 0:  # node 0 hosts the rendezvous store
                cmd += ["--rdzv-conf", "is_host=1"]
            return [*cmd, str(SCRIPT), "--steps", "4", "--layout", "auto", "--out", str(tmp_path)]

        done = net.run_per_node(torchrun, timeout=150)
    assert _namespaces() == before
    for k, p in enumerate(done):
        assert p.returncode == 0, f"node {k}'s torchrun exited {p.returncode}:\n{p.stderr[-3000:]}"
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert len({rec["params"] for rec in records}) == 1, [rec["params"] for rec in records]
    for rec in records:  # compressed between the nodes, so two-tier
        assert rec["metrics"]["hopq/inter_bits_per_coordinate"] < 16, rec["metrics"]
    by_node: dict[str, set[int]] = {}
    for rec in records:
        assert (rec["WORLD_SIZE"], rec["LOCAL_WORLD_SIZE"]) == ("4", "2")
        by_node.setdefault(rec["GROUP_RANK"], set()).add(rec["netns"])
    # the c10d rendezvous numbers the nodes itself; each group is one namespace
    assert sorted(by_node) == ["0", "1"] and all(len(v) == 1 for v in by_node.values())
    assert by_node["0"] != by_node["1"]


def test_run_per_node_stops_the_others_when_one_fails():
    with EmulatedNetwork(2, rate_mbit=50) as net:
        t0 = time.monotonic()
        done = net.run_per_node(
            lambda k: ["sh", "-c", "exit 3"] if k == 0 else ["sleep", "60"], timeout=60
        )
        assert time.monotonic() - t0 < 20
    assert done[0].returncode == 3
    assert done[1].returncode is not None and done[1].returncode < 0  # stopped


def test_bad_layouts():
    with pytest.raises(ValueError, match="workers_per_node"):
        EmulatedNetwork(4, rate_mbit=10, workers_per_node=3)
    with pytest.raises(ValueError, match="intra_rate_mbit"):
        EmulatedNetwork(4, rate_mbit=10, workers_per_node=2, intra_rate_mbit=-1)
    with pytest.raises(ValueError, match="workers_per_node"):
        layout_env(0, 4, 3)
    assert layout_env(5, 6, 3) == {
        "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "5", "ROLE_WORLD_SIZE": "6",
    }  # fmt: skip


def test_hopq_cluster_run_fills_in_each_node(capsys):
    """``hopq cluster run``: the command once per node, with its placeholders
    filled in; its exit status is the first failing node's."""
    from hopq.cli import main

    before = _namespaces()
    check = "test {addr} = 10.213.0.$(({node} + 1)) && test {master} = 10.213.0.1 && echo ok {node}"
    argv = ["cluster", "run", "--nodes", "2", "--rate-mbit", "50", "--", "sh", "-c", check]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[node 0] ok 0" in out and "[node 1] ok 1" in out
    assert main([*argv[:-3], "sh", "-c", "exit $(({node} * 3))"]) == 3
    assert _namespaces() == before
