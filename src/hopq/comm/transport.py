"""Transports: how a rank's messages reach its peers.

Two implementations of one small interface:

* :class:`DistTransport` over a real ``torch.distributed`` process group:
  point-to-point ops (``batch_isend_irecv``; Gloo for CPU tensors, NCCL for
  CUDA tensors), every send and receive of a step posted, then waited on.
* :class:`InProcessTransport` for the simulator: n virtual ranks, one thread
  each, exchanging tensors through queues.

``all_gather`` carries the small statistics exchange; the reduction is done by
the caller in rank order, so it is bit-identical on every rank and between a
real run and the simulator (a backend's own all_reduce fixes no order).
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod

import torch

from hopq.errors import TransportError

#: Seconds an in-process rank waits for a peer before declaring it lost.
#: Generous: a simulated hop at n = 64 on 2 cores can take seconds.
SIM_TIMEOUT_S = 600.0


class Transport(ABC):
    rank: int
    world_size: int

    def reserve(self, nbytes: int, device: torch.device) -> None:  # noqa: B027 (optional hook)
        """Announce that the coming call receives ``nbytes`` in all; transports that
        keep a receive arena size it here and reuse it (fresh multi-megabyte
        buffers per step cost page faults comparable to the transfer itself)."""

    @abstractmethod
    def exchange(
        self,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, int]],
        device: torch.device,
    ) -> list[torch.Tensor]:
        """Send each (peer, uint8 tensor); receive each (peer, nbytes); return the
        received tensors in the order of ``recvs``. Zero-byte messages are skipped
        on both sides (sizes are known to both from the plan)."""

    @abstractmethod
    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape and dtype on all ranks), in rank order."""


class DistTransport(Transport):
    """Point-to-point over a torch.distributed process group."""

    def __init__(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call init_process_group first, "
                "or use hopq.simulate for an in-process run"
            )
        self._dist = dist
        resolved = group if group is not None else dist.group.WORLD
        if resolved is None:
            raise RuntimeError("torch.distributed has no default process group")
        self.group = resolved
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        self._arena: torch.Tensor | None = None
        self._offset = 0

    def reserve(self, nbytes: int, device: torch.device) -> None:
        if self._arena is None or self._arena.device != device or self._arena.numel() < nbytes:
            self._arena = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._offset = 0

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        arena = self._arena
        if arena is not None and arena.device == device and self._offset + nbytes <= arena.numel():
            buf = arena[self._offset : self._offset + nbytes]
            # keep slices 64-byte aligned so that payload views of any dtype line up
            self._offset += (nbytes + 63) // 64 * 64
            return buf
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def exchange(
        self,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, int]],
        device: torch.device,
    ) -> list[torch.Tensor]:
        dist = self._dist
        out = [self._buffer(nbytes, device) for _, nbytes in recvs]
        # One batch per step, sends first (NCCL needs a step's ops grouped).
        # Measured on Gloo with 4 ranks on 2 cores: every ordering and grouping
        # costs the same ~1.7-3 ms per step there; the cost is scheduling latency.
        ops = [
            dist.P2POp(dist.isend, t, self._global[peer], self.group)
            for peer, t in sends
            if t.numel()
        ]
        ops += [
            dist.P2POp(dist.irecv, b, self._global[peer], self.group)
            for (peer, nbytes), b in zip(recvs, out, strict=True)
            if nbytes
        ]
        if not ops:
            return out
        works = dist.batch_isend_irecv(ops)
        for work in works:
            if work is not None:
                work.wait()
        return out

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._dist.all_gather(out, t.contiguous(), group=self.group)
        return out


class _Hub:
    """Shared state of one simulated process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.boxes = {(s, d): queue.Queue() for s in range(world_size) for d in range(world_size)}  # type: dict[tuple[int, int], queue.Queue[torch.Tensor]]
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=SIM_TIMEOUT_S)
        self.failed = threading.Event()

    def abort(self) -> None:
        self.failed.set()
        self.barrier.abort()


class InProcessTransport(Transport):
    """One virtual rank of an in-process group (see :func:`make_inprocess_group`)."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size

    def exchange(
        self,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, int]],
        device: torch.device,
    ) -> list[torch.Tensor]:
        for peer, t in sends:
            if t.numel():
                self.hub.boxes[(self.rank, peer)].put(t.clone())
        out = []
        for peer, nbytes in recvs:
            if not nbytes:
                out.append(torch.empty(0, dtype=torch.uint8, device=device))
                continue
            out.append(self._get(peer, nbytes))
        return out

    def _get(self, peer: int, nbytes: int) -> torch.Tensor:
        box = self.hub.boxes[(peer, self.rank)]
        waited = 0.0
        while True:
            if self.hub.failed.is_set():
                raise TransportError(f"rank {self.rank}: another simulated rank failed")
            try:
                t = box.get(timeout=0.5)
                break
            except queue.Empty:
                waited += 0.5
                if waited >= SIM_TIMEOUT_S:
                    raise TransportError(
                        f"rank {self.rank}: no message from rank {peer} after {SIM_TIMEOUT_S} s"
                    ) from None
        if t.numel() != nbytes:
            raise TransportError(
                f"rank {self.rank}: message from rank {peer} has {t.numel()} bytes, expected {nbytes}"
            )
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        try:
            self.hub.slots[self.rank] = t.clone()
            self.hub.barrier.wait()
            out = [s.clone() for s in self.hub.slots if s is not None]
            self.hub.barrier.wait()
        except threading.BrokenBarrierError:
            raise TransportError(f"rank {self.rank}: another simulated rank failed") from None
        return out


def make_inprocess_group(world_size: int) -> list[InProcessTransport]:
    """Transports for ``world_size`` virtual ranks sharing one hub."""
    hub = _Hub(world_size)
    return [InProcessTransport(hub, r) for r in range(world_size)]
