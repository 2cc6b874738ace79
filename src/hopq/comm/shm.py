"""Shared memory between the ranks of one machine, for the two-tier all-reduce's
intra-node tier (:mod:`hopq.comm.hierarchy`).

That tier moves most of a call's bytes, uncompressed, between ranks that share
a machine. Over Gloo they would go through TCP, loopback included: each byte
copied into the kernel and out again, the TCP stack's work on both ends, and
hopq's per-message Python, which on a machine whose cores also train costs
more than the sums themselves. Where a node's ranks can map each other's
memory, each rank instead owns a segment (:class:`NodeMemory`) that its
node-mates read directly, as NCCL's ranks do between the GPUs of one machine:

* the reduce-scatter: each rank writes the slices of its piece that its
  node-mates own into its segment, and each sums its own slice from theirs, in
  the ring's order (the bits of the message path, :mod:`hopq.comm.engine`);
* the all-gather: each rank writes its node-shard of the result, and each
  copies the others' from their segments.

Only a one-byte all-gather per step crosses the transport (a doorbell), which
also carries failure notices, so that a failing rank still makes every
node-mate raise at once. A segment holds two calls (even and odd), since a
rank may start its next call while a node-mate still reads its last one.

The node-mates agree on the segments in a handshake over their TCP view (two
small all-gathers), each checking a token it reads in every peer's segment.
When any of them cannot (no ``/dev/shm``, not enough room in it, ranks of a
"node" on different machines), every node-mate keeps the message path and
hopq says why once. ``HOPQ_SHM=0`` in the environment keeps the message path
everywhere. A segment's file is unlinked as soon as every node-mate has mapped
it, so nothing stays in ``/dev/shm`` after the job.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import warnings

import torch

from hopq.comm.framing import Deadline, Where
from hopq.comm.transport import SubTransport, Transport

#: Where the segments live (a tmpfs on Linux).
SHM_DIR = "/dev/shm"
#: Bytes of a segment's own header (the handshake's token); the calls' regions
#: follow, 64-byte aligned.
HEAD = 64
#: Bytes of a segment's name in the handshake (padded).
_NAME_BYTES = 96
_TOKEN_BYTES = 16


class Segment:
    """A file of ``capacity`` bytes in :data:`SHM_DIR`, mapped: this rank's
    (``create``) or a node-mate's (opened by name)."""

    def __init__(self, path: str, capacity: int, create: bool) -> None:
        self.path, self.capacity = path, capacity
        fallocate = getattr(os, "posix_fallocate", None)
        if create and fallocate is None:  # without it a full tmpfs shows as SIGBUS
            raise OSError("this platform has no posix_fallocate")
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                assert fallocate is not None
                fallocate(fd, 0, capacity)
            elif os.fstat(fd).st_size < capacity:
                raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, not {capacity}")
            self._map = mmap.mmap(fd, capacity)
        except BaseException:
            os.close(fd)
            if create:
                os.unlink(path)
            raise
        os.close(fd)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.words = self.bytes.view(torch.int64)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self.words = self.bytes = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a tensor still views it: it goes with that
            self._map.close()


class NodeMemory:
    """The segments of a node's ranks ``members`` of a transport: this rank's
    (written) and its node-mates' (read), each holding an even and an odd
    call's regions; see the module's docstring."""

    def __init__(self, members: tuple[int, ...], rank: int) -> None:
        self.members, self.rank = members, rank
        self.g = members.index(rank)
        self.mine: Segment | None = None
        self.peers: dict[int, Segment] = {}
        #: Calls made through the segments (the same count on every node-mate).
        self.calls = 0
        #: Why shared memory is not used ("" while it may be).
        self.off_reason = ""
        #: Segments of this many bytes could not be made: calls that need as
        #: much keep the transport (smaller ones may still use shared memory).
        self.too_big: int | None = None
        self._warned = False

    def ensure(self, capacity: int, plain: Transport, deadline: Deadline, label: str) -> bool:
        """Whether the coming call (whose two regions take ``capacity`` bytes
        together) goes through shared memory: sets up, or grows, every
        node-mate's segment by a handshake over ``plain`` (the node's TCP
        view) when needed; the same answer on every node-mate. Counts the call."""
        if self.off_reason:
            return False
        need = HEAD + 2 * capacity
        if self.mine is None or self.mine.capacity < need:
            need = -(-need // (1 << 20)) * (1 << 20)
            if self.too_big is not None and need >= self.too_big:
                return False
            ok, reason = self._handshake(need, plain, deadline, label)
            if not ok:
                # the same on every node-mate: ``need`` and the gathered flags
                if need > 1 << 20:  # smaller calls may still fit: they try again
                    self.too_big = need
                    what = f"calls that need {need >> 20} MiB or more of it per rank"
                else:
                    self.off_reason = reason
                    self._drop()
                    what = "every call"
                if not self._warned or self.off_reason:
                    self._warned = True
                    warnings.warn(
                        f"hopq: the ranks of node {list(self.members)} keep the intra-node "
                        f"traffic of {what} on the transport, not shared memory: {reason}",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                return False
        self.calls += 1
        return True

    def region(self, q: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` entries of ``dtype`` at byte ``offset`` of the current call's
        half of local rank ``q``'s segment."""
        seg = self.mine if q == self.g else self.peers[q]
        assert seg is not None
        half = (seg.capacity - HEAD) // 2 // 64 * 64
        start = HEAD + (self.calls % 2) * half + offset
        size = numel * dtype.itemsize
        return seg.bytes[start : start + size].view(dtype)

    def _handshake(
        self, capacity: int, plain: Transport, deadline: Deadline, label: str
    ) -> tuple[bool, str]:
        from hopq.comm.hierarchy import node_gather  # the node's all-gather of raw bytes

        number = plain.next_call()
        path = os.path.join(SHM_DIR, f"hopq-{os.getpid()}-{self.rank}-{secrets.token_hex(6)}")
        token = secrets.token_bytes(_TOKEN_BYTES)
        mine: Segment | None = None
        why = ""
        try:
            mine = Segment(path, capacity, create=True)
            mine.bytes[:_TOKEN_BYTES].copy_(torch.frombuffer(bytearray(token), dtype=torch.uint8))
        except OSError as e:
            why = f"rank {self.rank} could not make {capacity} bytes of {SHM_DIR} its own ({e})"
        block = torch.zeros(1 + _NAME_BYTES + _TOKEN_BYTES, dtype=torch.uint8)
        if mine is not None:
            encoded = path.encode()[:_NAME_BYTES]
            block[0] = 1
            block[1 : 1 + len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
            block[1 + _NAME_BYTES :] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
        where = Where(f"{label}, shared-memory handshake", number, -4000, 0, "node gather")
        try:
            got = node_gather(plain, block, deadline, where)
        except BaseException:
            if mine is not None:
                mine.unlink()
                mine.close()
            raise
        opened: dict[int, Segment] = {}
        if all(int(b[0]) == 1 for b in got):
            for q, b in enumerate(got):
                if q == self.g:
                    continue
                name = bytes(b[1 : 1 + _NAME_BYTES].tolist()).rstrip(b"\0").decode()
                try:
                    seg = Segment(name, capacity, create=False)
                except OSError as e:
                    why = f"rank {self.rank} could not open rank {self.members[q]}'s segment ({e})"
                    break
                opened[q] = seg
                if bytes(seg.bytes[:_TOKEN_BYTES].tolist()) != bytes(b[1 + _NAME_BYTES :].tolist()):
                    why = (
                        f"rank {self.rank} found another segment under rank {self.members[q]}'s "
                        "name (the node's ranks are not on one machine)"
                    )
                    break
        elif not why:
            why = "a node-mate could not make its segment (its own warning says why)"
        flag = torch.tensor([0 if why else 1], dtype=torch.uint8)
        try:
            flags = node_gather(
                plain, flag, deadline, Where(where.what, number, -4001, 0, "node gather")
            )
        finally:
            if mine is not None:
                mine.unlink()  # every node-mate has opened it, or none will
        if why or not all(int(f[0]) == 1 for f in flags):
            for seg in opened.values():
                seg.close()
            if mine is not None:
                mine.close()
            return False, why or "a node-mate could not open this rank's segment"
        self._drop()
        self.mine, self.peers = mine, opened
        return True, ""

    def _drop(self) -> None:
        for seg in [self.mine, *self.peers.values()]:
            if seg is not None:
                seg.close()
        self.mine, self.peers = None, {}


def enabled() -> bool:
    """Whether nodes may use shared memory: not where the environment says
    ``HOPQ_SHM=0`` (read at each call: a rank takes its launcher's environment)."""
    return os.environ.get("HOPQ_SHM", "1") != "0"


def state(transport: Transport) -> float | None:
    """How this rank's node tier ran on ``transport``: None where no two-tier call
    has run, 1.0 where every node view's calls went through shared memory, 0.0
    where some kept the messages (turned off, or a call too large)."""
    per: dict[tuple[int, ...], NodeMemory] = getattr(transport, "_node_memory", {})
    if not per and not enabled() and getattr(transport, "_tier_views", None):
        return 0.0
    if not per:
        return None
    whole = all(m.mine is not None and not m.off_reason and m.too_big is None for m in per.values())
    return 1.0 if whole else 0.0


def ranks_state() -> float | None:
    """:func:`state` over every process group's transport in this process,
    combined over the default group's ranks (a collective: every rank calls
    it): None where no rank made a two-tier call, 1.0 where every such call
    went through shared memory, 0.0 where some kept the messages."""
    import torch.distributed as dist

    from hopq.comm import collectives

    states = [s for t in list(collectives._TRANSPORTS.values()) if (s := state(t)) is not None]
    # [-(made any), lowest state]: one MIN over the ranks gives both
    both = torch.tensor([-1.0 if states else 0.0, min(states, default=1.0)], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    return None if float(both[0]) == 0.0 else float(both[1])


def describe(node: float) -> str:
    """A report's sentence for :func:`ranks_state`'s 1.0 or 0.0."""
    if node == 1.0:
        return "Inside each node the float32 tier went through shared memory."
    return (
        "Inside a node, some two-tier calls' float32 tier kept Gloo's messages instead of "
        "shared memory (HOPQ_SHM=0, or /dev/shm unusable: the ranks' warnings say why), "
        "which makes them slower than they need be."
    )


def _serves(transport: Transport) -> bool:
    """Whether shared memory may carry this transport's intra-node tier: Gloo's
    (real processes; NCCL moves GPU memory its own way)."""
    from hopq.comm.transport import DistTransport

    return isinstance(transport, DistTransport) and transport.backend == "gloo"


def node_memory(transport: Transport, intra: SubTransport) -> NodeMemory | None:
    """The shared memory of the node whose ranks ``intra`` views (kept on
    ``transport``), or None where it cannot serve: turned off
    (``HOPQ_SHM=0``), or a transport other than Gloo's (NCCL has its own)."""
    if not enabled() or not _serves(transport):
        return None
    per: dict[tuple[int, ...], NodeMemory] | None = getattr(transport, "_node_memory", None)
    if per is None:
        per = {}
        transport._node_memory = per  # type: ignore[attr-defined]
    if intra.members not in per:
        per[intra.members] = NodeMemory(intra.members, transport.rank)
    return per[intra.members]
