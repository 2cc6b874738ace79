"""Node layouts: which ranks of a group share a machine (DESIGN.md, "Two tiers").

A :class:`NodeLayout` describes a world of N nodes x G workers: ``node_of[r]`` is
the node of rank r, and a rank's *local rank* is its position among its node's
ranks in rank order. The two-tier all-reduce (:mod:`hopq.comm.hierarchy`) reads
it to build its intra-node groups (the G ranks of a node) and inter-node groups
(the N ranks that have the same local rank).

A layout comes from an explicit ``"NxG"`` string or ``(N, G)`` pair (ranks
``n*G .. n*G + G - 1`` on node n, as torchrun places them), from torchrun's
environment, or from the hosts. Every rank states its own *claim* (a node key,
its local rank and its node's size, :func:`claim_of`); the claims of all
ranks are exchanged before any data moves and :func:`from_claims` builds the
one layout they describe, or raises the same ValueError on every rank.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: What ``layout=`` may be: None (flat), "auto", "NxG", (N, G) or a NodeLayout.
LayoutSpec = Any

_NXG = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*$")


@dataclass(frozen=True)
class NodeLayout:
    """N nodes x G workers: the node of every rank of a group.

    Attributes:
        nodes: N, the number of nodes.
        per_node: G, the workers on each node (every node has as many).
        node_of: The node index (0 to N-1) of every rank, in rank order.

    Example:
        >>> from hopq.comm.layout import NodeLayout
        >>> lay = NodeLayout.parse("2x3")
        >>> lay.node_of, lay.local_rank(4), lay.node_ranks(1), lay.peers(4)
        ((0, 0, 0, 1, 1, 1), 1, (3, 4, 5), (1, 4))
    """

    nodes: int
    per_node: int
    node_of: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("nodes", "per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"NodeLayout's {name} must be a positive int, got {v!r}")
        node_of = tuple(int(k) for k in self.node_of)
        object.__setattr__(self, "node_of", node_of)
        if len(node_of) != self.nodes * self.per_node:
            raise ValueError(
                f"NodeLayout of {self.nodes} x {self.per_node} needs "
                f"{self.nodes * self.per_node} ranks, node_of has {len(node_of)}"
            )
        counts = [0] * self.nodes
        for r, k in enumerate(node_of):
            if not 0 <= k < self.nodes:
                raise ValueError(f"rank {r}'s node {k} is not in 0..{self.nodes - 1}")
            counts[k] += 1
        if any(c != self.per_node for c in counts):
            raise ValueError(
                f"every node must hold {self.per_node} ranks; the nodes hold {counts} "
                "(hopq's two-tier all-reduce needs equal nodes)"
            )

    @classmethod
    def parse(cls, spec: str | Sequence[int]) -> NodeLayout:
        """``"NxG"`` or ``(N, G)``: N nodes of G consecutive ranks each.

        Args:
            spec: ``"2x4"`` (also ``"2*4"``) or a pair ``(2, 4)``.

        Returns:
            The layout with ranks ``n*G .. n*G + G - 1`` on node n.

        Raises:
            ValueError: A string that is not ``NxG``, or counts below 1.
            TypeError: Neither a string nor a pair of ints.
        """
        if isinstance(spec, str):
            m = _NXG.match(spec)
            if m is None:
                raise ValueError(
                    f"a layout string is 'NxG' (N nodes of G workers, e.g. '2x4') or 'auto', "
                    f"got {spec!r}"
                )
            n, g = int(m.group(1)), int(m.group(2))
        elif isinstance(spec, Sequence) and len(spec) == 2:
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in spec):
                raise TypeError(f"a layout pair is (nodes, per_node) ints, got {spec!r}")
            n, g = int(spec[0]), int(spec[1])
        else:
            raise TypeError(
                f"layout must be None, 'auto', 'NxG', (N, G) or a NodeLayout, got {spec!r}"
            )
        if n < 1 or g < 1:
            raise ValueError(f"a layout needs at least 1 node of 1 worker, got {n}x{g}")
        return cls(n, g, tuple(r // g for r in range(n * g)))

    @property
    def world_size(self) -> int:
        """N x G, the ranks the layout places."""
        return len(self.node_of)

    @property
    def flat(self) -> bool:
        """Whether there is only one tier (one node, or one worker per node)."""
        return self.nodes == 1 or self.per_node == 1

    def node_ranks(self, node: int) -> tuple[int, ...]:
        """The ranks of node ``node``, in rank order (local rank = position)."""
        return tuple(r for r, k in enumerate(self.node_of) if k == node)

    def local_rank(self, rank: int) -> int:
        """``rank``'s position among its node's ranks."""
        return self.node_ranks(self.node_of[rank]).index(rank)

    def peers(self, rank: int) -> tuple[int, ...]:
        """The ranks with ``rank``'s local rank, one per node, in node order: the
        inter-node group of ``rank``."""
        g = self.local_rank(rank)
        return tuple(self.node_ranks(k)[g] for k in range(self.nodes))

    def describe(self) -> str:
        """``"NxG"``, with the ranks of each node when they are not consecutive."""
        if self == NodeLayout.parse((self.nodes, self.per_node)):
            return f"{self.nodes}x{self.per_node}"
        nodes = ";".join(",".join(map(str, self.node_ranks(k))) for k in range(self.nodes))
        return f"{self.nodes}x{self.per_node}[{nodes}]"


def resolve_spec(layout: LayoutSpec) -> NodeLayout | str | None:
    """A user's ``layout=`` checked locally: None, ``"auto"``, or a NodeLayout
    (what the ranks then agree on). Raises TypeError/ValueError for input that
    cannot be a layout."""
    if layout is None or isinstance(layout, NodeLayout):
        return layout
    if isinstance(layout, str) and layout.strip().lower() == "auto":
        return "auto"
    return NodeLayout.parse(layout)


#: A rank's claim: (node key, local rank or -1 when unknown, local size or -1).
Claim = tuple[int, int, int]


def env_claim(env: Mapping[str, str] | None = None) -> Claim | None:
    """This rank's claim from torchrun's environment (``LOCAL_WORLD_SIZE`` with
    ``GROUP_RANK``, or ``LOCAL_RANK`` and ``RANK``), or None outside torchrun."""
    env = os.environ if env is None else env
    try:
        size = int(env["LOCAL_WORLD_SIZE"])
        local = int(env["LOCAL_RANK"])
    except (KeyError, ValueError):
        return None
    if "GROUP_RANK" in env:
        node = int(env["GROUP_RANK"])
    elif "RANK" in env and size > 0:
        node = int(env["RANK"]) // size
    else:
        return None
    return (node, local, size)


def host_claim() -> Claim:
    """This rank's claim from its host name (local rank and size unknown)."""
    from hopq.comm.agreement import digest

    return (digest(socket.gethostname()), -1, -1)


def claim_of(spec: NodeLayout | str, rank: int, world_size: int) -> Claim:
    """What this rank states about its place: for a NodeLayout, the place it
    gives (or (-1, -1, -1) when its size is not the group's); for ``"auto"``,
    torchrun's environment when set (its node only, for a group smaller than
    torchrun's world), else the host name."""
    if isinstance(spec, NodeLayout):
        if spec.world_size != world_size:
            return (-1, -1, -1)
        return (spec.node_of[rank], spec.local_rank(rank), spec.per_node)
    env = env_claim()
    if env is None:
        return host_claim()
    if os.environ.get("WORLD_SIZE", str(world_size)) != str(world_size):
        # a group of some ranks only: torchrun's local ranks count all of the node's
        return (env[0], -1, -1)
    return env


def from_claims(claims: Sequence[Claim], spec: NodeLayout | str) -> NodeLayout:
    """The layout every rank's claim describes (the same on every rank, since
    every rank reads the same claims).

    Nodes are numbered in the order their first rank appears; a rank's local
    rank is its position among its node's ranks. Where ranks state their local
    rank and size (torchrun), those must match what the claims give.

    Raises:
        ValueError: The claims do not make a layout of equal nodes, contradict
            one another, or (an explicit layout) do not fit the group's size.
    """
    n = len(claims)
    if isinstance(spec, NodeLayout):  # the ranks agreed on it: only its size to check
        if spec.world_size != n:
            raise ValueError(
                f"layout {spec.describe()} places {spec.world_size} ranks, the group has {n}"
            )
        return spec
    order: dict[int, int] = {}
    node_of = []
    for key, _, _ in claims:
        node_of.append(order.setdefault(key, len(order)))
    nodes = len(order)
    sizes = [node_of.count(k) for k in range(nodes)]
    if len(set(sizes)) != 1:
        per = ", ".join(
            f"node {k} (ranks {_ranks([r for r in range(n) if node_of[r] == k])}): {s}"
            for k, s in enumerate(sizes)
        )
        raise ValueError(
            f"the ranks' nodes hold unequal numbers of ranks ({per}); hopq's two-tier "
            "all-reduce needs N nodes of G ranks each (pass layout=None for a flat call)"
        )
    lay = NodeLayout(nodes, sizes[0], tuple(node_of))
    bad = []
    for r, (_, local, size) in enumerate(claims):
        if size != -1 and size != lay.per_node:
            bad.append(f"rank {r} states {size} ranks on its node, the group has {lay.per_node}")
        elif local != -1 and local != lay.local_rank(r):
            bad.append(f"rank {r} states local rank {local}, its place gives {lay.local_rank(r)}")
    if bad:
        raise ValueError(
            "the ranks' node layout is inconsistent: " + "; ".join(bad[:4])
            + ("; ..." if len(bad) > 4 else "")
        )  # fmt: skip
    return lay


def _ranks(rs: list[int]) -> str:
    return ",".join(map(str, rs[:8])) + (",..." if len(rs) > 8 else "")


def as_dict(layout: NodeLayout) -> dict[str, Any]:
    """The layout as plain data (for a state dict or a log)."""
    return {"nodes": layout.nodes, "per_node": layout.per_node, "node_of": list(layout.node_of)}
