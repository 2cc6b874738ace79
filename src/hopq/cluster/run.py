"""``hopq cluster run``: a command once per node of an emulated cluster, as it
would be started once per machine (``torchrun ...`` on each, or ``srun``).

    hopq cluster run --nodes 2 --workers-per-node 2 --rate-mbit 1000 -- \\
        torchrun --nnodes {nodes} --nproc_per_node {workers_per_node} \\
        --rdzv-backend c10d --rdzv-endpoint {master}:29400 --rdzv-id demo \\
        --local-addr {addr} --rdzv-conf is_host={is_host} train.py

In every argument of the command, ``{node}`` becomes the node's index,
``{nodes}`` the node count, ``{workers_per_node}`` the workers per node,
``{addr}`` the node's address, ``{master}`` node 0's address and ``{is_host}``
1 on node 0 and 0 elsewhere (torchrun's c10d rendezvous needs to be told which
node hosts its store when the address is not one the host name resolves to).
The environment also carries ``NODE_RANK``, ``NNODES``, ``MASTER_ADDR`` and
``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` (the node's interface); see
:meth:`hopq.cluster.network.EmulatedNetwork.run_per_node`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from hopq.cluster.network import CONGESTION, EmulatedNetwork, check_congestion, check_mtu
from hopq.options import option


@dataclass(frozen=True)
class ClusterRunOptions:
    nodes: int = option(2, "emulated nodes (network namespaces); the command runs once in each")
    workers_per_node: int = option(
        1, "workers each node's command starts ({workers_per_node} in the command)"
    )
    rate_mbit: float = option(1000.0, "each node's link to the others in Mbit/s (tc tbf)")
    intra_rate_mbit: float = option(
        0.0,
        "rate of each node's loopback in Mbit/s (all traffic between its workers together); "
        "0: unshaped",
    )
    mtu: int = option(1500, "the links' MTU (9000: jumbo frames)")
    tcp_congestion: str = option(CONGESTION, "TCP congestion control in the nodes' namespaces")
    timeout_s: float = option(3600.0, "seconds before every node's command is stopped")

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.workers_per_node < 1:
            raise ValueError("--nodes and --workers-per-node must be >= 1")
        if not self.rate_mbit > 0 or not self.intra_rate_mbit >= 0 or not self.timeout_s > 0:
            raise ValueError("--rate-mbit and --timeout-s must be > 0, --intra-rate-mbit >= 0")
        check_mtu(self.mtu)
        check_congestion(self.tcp_congestion)

    def network(self) -> EmulatedNetwork:
        """The emulated cluster these options describe (not built yet)."""
        return EmulatedNetwork(
            self.nodes * self.workers_per_node,
            rate_mbit=self.rate_mbit,
            mtu=self.mtu,
            congestion=self.tcp_congestion,
            workers_per_node=self.workers_per_node,
            intra_rate_mbit=self.intra_rate_mbit,
        )


def node_command(command: Sequence[str], net: EmulatedNetwork, node: int) -> list[str]:
    """``command`` with the placeholders of this module's docstring filled in for
    ``node``; other braces are left as they are."""
    values = {
        "{node}": str(node),
        "{nodes}": str(net.nodes),
        "{workers_per_node}": str(net.workers_per_node),
        "{addr}": net.address(node),
        "{master}": net.address(0),
        "{is_host}": "1" if node == 0 else "0",
    }
    out = []
    for arg in command:
        for key, value in values.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out


def run(o: ClusterRunOptions, command: Sequence[str]) -> int:
    """Build the network, run ``command`` in every node, print each node's output;
    return 0 when every node's command exited 0, else the first failure's code
    (1 for one killed by a signal or stopped)."""
    if not command:
        raise ValueError("give the command to run in each node after --")
    with o.network() as net:
        print(f"emulated cluster: {net.describe()}", flush=True)
        done = net.run_per_node(lambda k: node_command(command, net, k), timeout=o.timeout_s)
    status = 0
    for k, p in enumerate(done):
        for text, stream in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            for line in str(text).splitlines():
                print(f"[node {k}] {line}", file=stream)
        print(f"[node {k}] exited {p.returncode}", flush=True)
        if p.returncode and not status:
            status = p.returncode if p.returncode > 0 else 1
    return status
