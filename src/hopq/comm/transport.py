"""Transports: how a rank's messages reach its peers.

Two implementations of one small interface (post operations, then wait on them
within a deadline):

* :class:`DistTransport` over a real ``torch.distributed`` process group:
  point-to-point ``isend``/``irecv`` (on NCCL a step's operations are posted
  as one ``batch_isend_irecv`` group, which NCCL needs). Each backend takes
  one kind of memory: Gloo's point-to-point operations host memory (a CUDA
  pointer aborts the process), NCCL's CUDA memory. A message in the other kind
  (CUDA tensors on Gloo, as when DDP trains on GPUs over Gloo; the agreement's
  host-built fingerprints on NCCL) is staged: a send copies its bytes over
  first, a receive lands in a buffer of the right kind and is copied to its own
  buffer when waited on.
* :class:`InProcessTransport` for the simulator: n virtual ranks, one thread
  each, exchanging tensors through queues.

Every wait has a deadline (the call's timeout: the caller's, else the process
group's own); a peer that does not answer in
time, or whose connection closes, raises :class:`~hopq.TransportError` naming
the peer and where in the call this rank was.

:func:`all_gather` (the statistics exchange) runs over the same point-to-point
operations (Bruck's algorithm: ceil(log2 n) rounds), so its failures name a
peer too, and its result is assembled in rank order: bit-identical on every
rank and in the simulator. The agreement before a call uses :func:`exchange`
(one round to every peer, Bruck beyond 32 ranks), or :func:`exchange_tails`,
which also carries a different tail to each peer. Statistics of many
bytes (DynamiQ's, two per super-group) go through :func:`direct_all_reduce`
instead, which sends 2(n-1)/n of them rather than n-1 copies, with the same
bits; its first round can ride with the agreement as those tails.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import warnings
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator

import torch

from hopq.comm import framing
from hopq.comm.framing import Deadline, Where
from hopq.errors import TransportError

#: Seconds an in-process rank waits for a peer by default. Generous: a simulated
#: hop at n = 64 on 2 cores can take seconds.
SIM_TIMEOUT_S = 600.0


class Handle(ABC):
    """A posted send or receive."""

    peer: int
    kind: str  # "send" or "recv"

    @abstractmethod
    def wait(self, deadline: Deadline, where: Where) -> None: ...


#: A call's timeout when neither the caller nor the process group gives one:
#: torch's default process-group timeout on Gloo (30 minutes).
FALLBACK_TIMEOUT_S = 1800.0
#: On NCCL a call's default timeout is this share of the group's: NCCL's
#: watchdog tears the process down once an operation outlives the group's
#: timeout, so hopq raises its TransportError first.
NCCL_TIMEOUT_SHARE = 0.9
#: Stage every Gloo message through a host copy, CPU tensors too: lets the tests
#: run the staging that CUDA tensors take on machines without a GPU.
STAGE_ALL = False


class Transport(ABC):
    rank: int
    world_size: int
    #: Whether receives may be posted long before the matching sends (Gloo and
    #: the simulator: yes; NCCL runs a step's operations as one group).
    prepost: bool = True
    #: Whether a receive posted for N bytes accepts a shorter message (Gloo and the
    #: simulator: yes). NCCL needs equal counts on both sides, so a variable-size
    #: payload is padded to its agreed bound there (the padding is sent and counted).
    short_messages: bool = True
    #: Whether a call whose signature the ranks agreed on before may skip its
    #: agreement round (:mod:`hopq.comm.settle`): where receives are preposted and
    #: take shorter messages (Gloo, the simulator), not on a view of some ranks
    #: (a two-tier call's tiers, which the whole group's agreement covers).
    skips_agreement: bool = True

    def __init__(self) -> None:
        self._arena: torch.Tensor | None = None
        self._offset = 0
        #: Calls made on this transport (every rank counts the same; agreed),
        #: refused ones included (:func:`hopq.comm.engine.refuse`).
        self.calls = 0
        #: Operations of a call that failed on this rank, completed at its next
        #: call: a refused call's notices and the receives of what its peers
        #: send in it, or sends a failed agreement did not wait for.
        self.owed: list[tuple[Handle, Where]] = []
        #: Digests of the call signatures the ranks agreed on in a round of their
        #: own (:mod:`hopq.comm.agreement`): a later call of one of them skips
        #: the round. The same on every rank: a signature enters only when every
        #: rank's agreement found every fingerprint equal.
        self.agreed: set[int] = set()
        #: The schedule (topology, kind) of the agreed signatures: calls that skip
        #: their round all run the same schedule (see :mod:`hopq.comm.settle`).
        self.agreed_pattern: tuple[str, str] | None = None
        #: A refused call's receives (one per peer, with its buffer) and where,
        #: settled at the next call (:mod:`hopq.comm.settle`).
        self.unsettled: tuple[Where, dict[int, tuple[Handle, torch.Tensor]]] | None = None

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Everything posted inside goes out as one group where the backend runs
        groups one after another (NCCL: a group of receives alone would wait
        for sends its peers queue behind their own such group). Handles posted
        inside may be waited on only after the block."""
        yield

    def next_call(self, deadline: Deadline | None = None) -> int:
        """Number the next call on this group (every rank's k-th call is call k).
        First completes what a refused call left posted (within ``deadline``,
        else :attr:`timeout_s`), so that its peers' messages of that call are
        taken and dropped and never meet this call's receives."""
        owed, self.owed = self.owed, []
        for h, where in owed:
            # that call failed anyway; this one reports what goes wrong now
            with contextlib.suppress(Exception):
                h.wait(deadline or Deadline(self.timeout_s), where)
        if self.unsettled is not None:
            from hopq.comm import settle

            where, recvs = self.unsettled
            self.unsettled = None
            streams = {
                q: settle.Stream(q, deque([hb]), sent=1, posted=1, send_end=False, block_ends=True)
                for q, hb in recvs.items()
            }
            with contextlib.suppress(Exception):  # best effort, as the notices
                settle.settle(self, streams, framing.END_FAILED, deadline or Deadline(
                    self.timeout_s), where)  # fmt: skip
        self.calls += 1
        return self.calls

    @property
    def timeout_s(self) -> float:
        """Seconds a call may take when the caller gives no timeout."""
        return FALLBACK_TIMEOUT_S

    def call_timeout(self, timeout: float | None) -> float:
        """The seconds a call may take: the caller's ``timeout``, else
        :attr:`timeout_s`."""
        return self.timeout_s if timeout is None else timeout

    def reserve(self, nbytes: int, device: torch.device) -> None:
        """Announce that the coming call receives ``nbytes`` in all; the receive
        arena is sized here and reused across calls (fresh multi-megabyte buffers
        per step cost page faults comparable to the transfer itself). Stale bytes
        in it are never read: every message's header says what arrived."""
        if self._arena is None or self._arena.device != device or self._arena.numel() < nbytes:
            self._arena = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._offset = 0

    def buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A receive buffer: from the arena while it lasts, 64-byte aligned so that
        payload views of any dtype line up."""
        arena = self._arena
        if arena is not None and arena.device == device and self._offset + nbytes <= arena.numel():
            buf = arena[self._offset : self._offset + nbytes]
            self._offset += (nbytes + 63) // 64 * 64
            return buf
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    @abstractmethod
    def post(
        self,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, torch.Tensor]],
        where: Where | None = None,
        tag: int = 0,
    ) -> tuple[list[Handle], list[Handle]]:
        """Post sends of (peer, bytes) and receives into (peer, buffer); return their
        handles. Messages between two ranks match in posting order, each
        ``tag`` apart from the others (two views of the same ranks can run
        calls at once under different tags). ``where`` names the step for
        error messages."""


#: The work of an operation whose batch has not been posted yet.
_UNPOSTED = object()


class _DistHandle(Handle):
    def __init__(
        self,
        work: object,
        peer: int,
        kind: str,
        rank: int,
        staged: torch.Tensor | None = None,
        dest: torch.Tensor | None = None,
    ) -> None:
        self.work, self.peer, self.kind, self.rank = work, peer, kind, rank
        #: The staged copy the operation works on (kept alive until it
        #: completes), and for a receive the buffer its bytes go to on arrival.
        self.staged, self.dest = staged, dest

    def wait(self, deadline: Deadline, where: Where) -> None:
        if self.work is None:
            return
        if self.work is _UNPOSTED:
            raise RuntimeError(
                f"hopq internal error: an operation of {where.describe()} was waited on "
                "before its batch was posted"
            )
        left = deadline.remaining()
        try:
            if left <= 0:
                raise RuntimeError("Timed out before waiting")
            # at least 1 ms: NCCL reads a zero timeout as none at all
            wait_s = max(left, 1e-3)
            self.work.wait(timeout=datetime.timedelta(seconds=wait_s))  # type: ignore[attr-defined]
        except RuntimeError as e:
            raise _transport_error(str(e), self.rank, self.peer, self.kind, deadline, where) from e
        self.work = None
        if self.dest is not None and self.staged is not None:
            self.dest.copy_(self.staged)
        self.staged = self.dest = None


def device_backend(group: torch.distributed.ProcessGroup, device_type: str) -> str | None:
    """The name of the backend that carries ``device_type`` tensors on
    ``group``, or None where the group cannot say."""
    try:
        return str(group._get_backend(torch.device(device_type)).name()).lower()
    except Exception:  # noqa: BLE001 - no backend for that device type, or no such API
        return None


def group_timeout(group: torch.distributed.ProcessGroup, via: str) -> datetime.timedelta:
    """The process group's own timeout (the ``timeout=`` it was created with),
    read from the options of its backend that carries hopq's messages
    (``via``: "nccl", or another for the CPU's), a private attribute: raises
    where torch does not expose it."""
    dev = torch.device("cuda" if via == "nccl" else "cpu")
    return group._get_backend(dev).options._timeout


def _carrier(group: torch.distributed.ProcessGroup, name: str) -> str:
    """The backend hopq's messages take on ``group``: its name, or for a group
    of several backends (``init_process_group()`` without one: "undefined", or
    "cpu:gloo,cuda:nccl") the one that carries CUDA tensors when this process
    has a GPU (training tensors live there), else the CPU's."""
    if name in ("gloo", "nccl"):
        return name
    for dev in ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",):
        via = device_backend(group, dev)
        if via is not None:
            return via
    return name


def carrier(group: torch.distributed.ProcessGroup) -> str:
    """The backend hopq's messages take on ``group`` (see :func:`_carrier`)."""
    return _carrier(group, str(torch.distributed.get_backend(group)).lower())


class _Works:
    """Several works waited as one (a coalesced batch's, for each of its ops)."""

    def __init__(self, works: list[object]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for w in self.works:
            w.wait(timeout=timeout)  # type: ignore[attr-defined]
        return True


def _transport_error(
    msg: str, rank: int, peer: int, kind: str, deadline: Deadline, where: Where
) -> TransportError:
    direction = "to" if kind == "send" else "from"
    low = msg.lower()
    if "timed out" in low or "timeout" in low or "timing out" in low:  # Gloo's, NCCL's
        return TransportError(
            f"rank {rank}: no answer {direction} rank {peer} within the call's timeout "
            f"of {deadline.timeout_s:g} s, in {where.describe()}"
        )
    if "closed" in msg.lower() or "reset" in msg.lower() or "broken pipe" in msg.lower():
        return TransportError(
            f"rank {rank}: rank {peer} closed its connection in {where.describe()}: it "
            "exited, died, or gave up waiting for this rank (its own timeout ran out "
            "first; it raised TransportError there)"
        )
    return TransportError(
        f"rank {rank}: {kind} {direction} rank {peer} failed in {where.describe()}: {msg}"
    )


class DistTransport(Transport):
    """Point-to-point over a torch.distributed process group."""

    def __init__(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        super().__init__()
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
        # weakly: a transport must not keep a destroyed group (and Gloo's threads)
        # alive until interpreter exit (see hopq.comm.collectives._TRANSPORTS)
        self._group = weakref.ref(resolved)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        self.backend = carrier(self.group)
        self._warned_timeout = False
        self._warned_cap = False
        self.prepost = self.backend != "nccl"
        self.short_messages = self.backend != "nccl"
        self.skips_agreement = self.prepost and self.short_messages
        #: Messages staged into the memory their backend takes (see the module's
        #: docstring), and per device type where its messages are staged to.
        self.staged_messages = 0
        self._stage_to: dict[str, torch.device | None] = {}
        #: The operations of an open batch (NCCL), posted when it closes.
        self._batching: list[tuple[str, int, torch.Tensor, _DistHandle, int]] | None = None

    @property
    def group(self) -> torch.distributed.ProcessGroup:
        g = self._group()
        if g is None:
            raise RuntimeError(
                "this transport's process group was destroyed (destroy_process_group); "
                "hopq communicates on live groups only"
            )
        return g

    @property
    def timeout_s(self) -> float:
        """The process group's own timeout (the ``timeout=`` it was created with;
        torch's default: 30 minutes on Gloo, 10 on NCCL), read from its
        backend's options, a private attribute; on NCCL
        :data:`NCCL_TIMEOUT_SHARE` of it. Where torch does not expose it: a
        warning (once) and :data:`FALLBACK_TIMEOUT_S`."""
        nccl = self.backend == "nccl"
        try:
            t = float(group_timeout(self.group, self.backend).total_seconds())
        except Exception as e:  # a torch version without it
            t, why = 0.0, f"{type(e).__name__}: {e}"
        else:
            why = f"it reads {t} s"
        if t > 0:
            return t * NCCL_TIMEOUT_SHARE if nccl else t
        if not self._warned_timeout:
            self._warned_timeout = True
            warnings.warn(
                f"hopq could not read the process group's timeout ({why}); calls without "
                f"timeout= wait {FALLBACK_TIMEOUT_S:g} s for a peer",
                RuntimeWarning,
                stacklevel=2,
            )
        return FALLBACK_TIMEOUT_S

    def call_timeout(self, timeout: float | None) -> float:
        """On NCCL a caller's timeout beyond :attr:`timeout_s` is capped to it
        (NCCL's watchdog would end the process before hopq could raise), with a
        warning once."""
        if timeout is None or self.backend != "nccl" or timeout <= self.timeout_s:
            return super().call_timeout(timeout)
        if not self._warned_cap:
            self._warned_cap = True
            warnings.warn(
                f"timeout={timeout:g} s is longer than this NCCL group allows hopq "
                f"({self.timeout_s:g} s, {NCCL_TIMEOUT_SHARE:.0%} of its own timeout): "
                "NCCL's watchdog would end the process before hopq could raise; "
                "hopq waits that long instead",
                RuntimeWarning,
                stacklevel=3,
            )
        return self.timeout_s

    def staging(self, device: torch.device) -> torch.device | None:
        """Where messages of ``device`` tensors are staged to (None: posted as
        they are), from the backend that carries that device type: Gloo takes
        host memory, NCCL CUDA memory (the group's device, else the current
        one)."""
        if device.type == "cpu" and STAGE_ALL:
            return device
        if device.type not in self._stage_to:
            # a group may carry each device type on another backend
            via = device_backend(self.group, device.type) or self.backend
            to: torch.device | None = None
            if via == "nccl" and device.type != "cuda":
                # the group's device (init_process_group(device_id=)), else the current one
                bound = getattr(self.group, "bound_device_id", None)
                to = bound or torch.device("cuda", torch.cuda.current_device())
            elif via != "nccl" and device.type != "cpu":
                to = torch.device("cpu")
            self._stage_to[device.type] = to
        return self._stage_to[device.type]

    def _staged(self, kind: str, peer: int, t: torch.Tensor) -> tuple[torch.Tensor, _DistHandle]:
        """The tensor to post for ``t`` and a handle (its work still None)
        holding what the staging keeps."""
        to = self.staging(t.device)
        if to is None:
            return t, _DistHandle(None, peer, kind, self.rank)
        self.staged_messages += 1
        if kind == "send":
            posted = t.to(to, copy=True)
            return posted, _DistHandle(None, peer, kind, self.rank, posted)
        posted = torch.empty(t.shape, dtype=t.dtype, device=to)
        return posted, _DistHandle(None, peer, kind, self.rank, posted, t)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        if self.prepost or self._batching is not None:
            yield
            return
        self._batching = []
        try:
            yield
        finally:  # also after an error inside: its receives must be live for the drain
            ops, self._batching = self._batching, None
            self._launch(ops)

    def _launch(self, ops: list[tuple[str, int, torch.Tensor, _DistHandle, int]]) -> None:
        """Post ``ops`` as one group (NCCL's batch_isend_irecv)."""
        if not ops:
            return
        dist = self._dist
        group = self.group
        p2p = [
            dist.P2POp(dist.isend if k == "send" else dist.irecv, t, self._global[p], group, tag)
            for k, p, t, _, tag in ops
        ]
        works = dist.batch_isend_irecv(p2p)
        # NCCL coalesces a batch into one work; other backends give one per op
        each = works if len(works) == len(ops) else [_Works(works)] * len(ops)
        for w, (_, _, _, h, _) in zip(each, ops, strict=True):
            h.work = w

    def post(
        self,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, torch.Tensor]],
        where: Where | None = None,
        tag: int = 0,
    ) -> tuple[list[Handle], list[Handle]]:
        group = self.group
        ops: list[tuple[str, int, torch.Tensor, _DistHandle, int]] = []
        for kind, items in (("send", sends), ("recv", recvs)):
            for p, t in items:
                posted, h = self._staged(kind, p, t)
                ops.append((kind, p, posted, h, tag))
        if not self.prepost:  # NCCL: every post, or every open batch, one group
            if self._batching is not None:
                for *_, h, _ in ops:
                    h.work = _UNPOSTED
                self._batching += ops
            else:
                self._launch(ops)
        else:
            # the group's own posts, without isend's and irecv's checks around
            # them (they cost as much as the post; hopq's messages are plain
            # byte tensors, addressed by group rank)
            for kind, p, t, h, _ in ops:
                try:
                    post = group.send if kind == "send" else group.recv
                    h.work = post([t], p, tag)
                except RuntimeError as e:  # a pair already closed fails at posting
                    raise _transport_error(
                        str(e), self.rank, p, kind, Deadline(1.0), where or Where("a call", 0, 0)
                    ) from e
        handles: list[Handle] = [h for _, _, _, h, _ in ops]
        return handles[: len(sends)], handles[len(sends) :]


class _Hub:
    """Shared state of one simulated process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.boxes: dict[tuple[int, int, int], queue.Queue[torch.Tensor]] = {
            (s, d, 0): queue.Queue() for s in range(world_size) for d in range(world_size)
        }
        self._lock = threading.Lock()
        self.failed = threading.Event()

    def box(self, src: int, dst: int, tag: int) -> queue.Queue[torch.Tensor]:
        """Messages from ``src`` to ``dst`` under ``tag``."""
        key = (src, dst, tag)
        if key not in self.boxes:
            with self._lock:
                self.boxes.setdefault(key, queue.Queue())
        return self.boxes[key]

    def abort(self) -> None:
        self.failed.set()


class _SimHandle(Handle):
    def __init__(
        self, hub: _Hub, rank: int, peer: int, buf: torch.Tensor | None, tag: int = 0
    ) -> None:
        self.hub, self.rank, self.peer, self.buf, self.tag = hub, rank, peer, buf, tag
        self.kind = "send" if buf is None else "recv"

    def wait(self, deadline: Deadline, where: Where) -> None:
        if self.buf is None:
            return
        box = self.hub.box(self.peer, self.rank, self.tag)
        while True:
            if self.hub.failed.is_set():
                raise TransportError(f"rank {self.rank}: another simulated rank failed")
            left = deadline.remaining()
            if left <= 0:
                raise TransportError(
                    f"rank {self.rank}: no answer from rank {self.peer} within the call's timeout "
                    f"of {deadline.timeout_s:g} s, in {where.describe()}"
                )
            try:
                msg = box.get(timeout=min(0.5, left))
                break
            except queue.Empty:
                continue
        if msg.numel() > self.buf.numel():  # Gloo would abort here; senders never do this
            raise TransportError(
                f"rank {self.rank}: message from rank {self.peer} has {msg.numel()} bytes, "
                f"more than the {self.buf.numel()} posted, in {where.describe()}"
            )
        self.buf[: msg.numel()].copy_(msg)
        self.buf = None


class InProcessTransport(Transport):
    """One virtual rank of an in-process group (see :func:`make_inprocess_group`)."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        super().__init__()
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size

    @property
    def timeout_s(self) -> float:
        return SIM_TIMEOUT_S

    def post(
        self,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, torch.Tensor]],
        where: Where | None = None,
        tag: int = 0,
    ) -> tuple[list[Handle], list[Handle]]:
        out_s: list[Handle] = []
        for p, t in sends:
            self.hub.box(self.rank, p, tag).put(t.clone())
            out_s.append(_SimHandle(self.hub, self.rank, p, None, tag))
        out_r: list[Handle] = [_SimHandle(self.hub, self.rank, p, b, tag) for p, b in recvs]
        return out_s, out_r


class SubTransport(Transport):
    """A view of some ranks of a parent transport as a group of their own (the
    tiers of the two-tier all-reduce, :mod:`hopq.comm.hierarchy`).

    Rank i of the view is the parent's rank ``members[i]``; messages go through
    the parent, to the parent's ranks. The view numbers its own calls and has
    its own receive arena; batching, timeouts and what the backend takes are
    the parent's. Views whose members never share a pair of ranks (a node's
    ranks, and the ranks of one local rank across nodes) can run one after
    another on the same parent without their messages meeting; views of the
    same ranks under different ``tag`` values can run calls at once.
    """

    def __init__(
        self, parent: Transport, members: tuple[int, ...] | list[int], tag: int = 0
    ) -> None:
        super().__init__()
        members = tuple(int(m) for m in members)
        if parent.rank not in members:
            raise ValueError(f"rank {parent.rank} is not among the view's members {members}")
        if len(set(members)) != len(members) or not all(
            0 <= m < parent.world_size for m in members
        ):
            raise ValueError(
                f"a view's members must be distinct ranks of 0..{parent.world_size - 1}, "
                f"got {members}"
            )
        self.parent = parent
        self.members = members
        self.tag = tag
        self.rank = members.index(parent.rank)
        self.world_size = len(members)
        self.prepost = parent.prepost
        self.short_messages = parent.short_messages
        self.skips_agreement = False

    @property
    def timeout_s(self) -> float:
        return self.parent.timeout_s

    def call_timeout(self, timeout: float | None) -> float:
        return self.parent.call_timeout(timeout)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        with self.parent.batch():
            yield

    def post(
        self,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, torch.Tensor]],
        where: Where | None = None,
        tag: int = 0,
    ) -> tuple[list[Handle], list[Handle]]:
        m = self.members
        return self.parent.post(
            [(m[p], t) for p, t in sends], [(m[p], b) for p, b in recvs], where, self.tag + tag
        )


def make_inprocess_group(world_size: int) -> list[InProcessTransport]:
    """Transports for ``world_size`` virtual ranks sharing one hub."""
    hub = _Hub(world_size)
    return [InProcessTransport(hub, r) for r in range(world_size)]


def all_gather(
    transport: Transport, t: torch.Tensor, deadline: Deadline, where: Where
) -> list[torch.Tensor]:
    """Every rank's ``t`` (the same number of bytes on every rank), in rank order.
    Bruck's algorithm: in round k each rank sends the blocks it holds (at most
    2^k) to rank - 2^k and receives as many from rank + 2^k; ceil(log2 n) rounds.
    Each message is framed (the header's step is the round)."""
    n, r = transport.world_size, transport.rank
    block = t.contiguous().reshape(-1).view(torch.uint8)
    size = block.numel()
    held = [block]  # blocks of ranks r, r+1, ... in that order
    dist_ = 1
    rnd = 0
    while dist_ < n:
        count = min(dist_, n - dist_)
        to, frm = (r - dist_) % n, (r + dist_) % n
        here = Where(where.what, where.call, where.step, rnd, where.phase)
        body = torch.cat(held[:count]) if count > 1 else held[0]
        bound = count * size
        header = framing.frame(here, [bound])
        parts = framing.pack(header, body, bound)
        bufs = [
            transport.buffer(nb, t.device)
            for nb in framing.expect(1, bound, transport.short_messages)
        ]
        sends, recvs = transport.post([(to, p) for p in parts], [(frm, b) for b in bufs], here)
        for h in recvs:
            h.wait(deadline, here)
        head, got = framing.unpack(bufs, 1, bound)
        framing.check(head, here, frm, r, [bound], exact=True)
        for h in sends:
            h.wait(deadline, here)
        got = got[:bound].clone()
        held += [got[i * size : (i + 1) * size] for i in range(count)]
        dist_ *= 2
        rnd += 1
    ordered = [held[(q - r) % n] for q in range(n)]
    return [b.view(t.dtype).view(t.shape) for b in ordered]


#: Ranks up to which :func:`exchange` sends its block to every peer at once (one
#: round of n - 1 messages); beyond, Bruck's all-gather (ceil(log2 n) rounds).
DIRECT_EXCHANGE_MAX = 32


def _each_peer(
    transport: Transport,
    bodies: dict[int, torch.Tensor],
    sizes: dict[int, int],
    deadline: Deadline,
    where: Where,
    bound: int | None = None,
    *,
    foreign: dict[int, tuple[list[int], torch.Tensor]] | None = None,
) -> dict[int, torch.Tensor]:
    """One round with every peer q at once: send ``bodies[q]`` (framed), receive
    ``sizes[q]`` bytes from q (its header checked); the received bytes by peer.
    With ``bound`` (transports that take short messages), every message in the
    round (either way) has a body of at most ``bound`` bytes, whose length its
    header gives: receives are posted for the bound (``sizes`` is ignored) and
    what arrived is returned. With ``foreign`` (the agreement's rounds), each
    receive is posted :data:`~hopq.comm.framing.ANY_FIRST` bytes or more, and a
    message that is not of this round (another call's, a peer's notice) goes
    into ``foreign`` (its header words and buffer) instead of raising."""
    sends, recvs, bufs = [], [], {}
    for q, body in bodies.items():
        raw = body.contiguous().reshape(-1).view(torch.uint8)
        cap = raw.numel() if bound is None else bound
        head = framing.frame(where, [raw.numel()])
        sends += [(q, p) for p in framing.pack(head, raw, cap)]
        want = sizes[q] if bound is None else bound
        shapes = framing.expect(1, want, transport.short_messages)
        if foreign is not None and len(shapes) == 1:
            shapes = [max(shapes[0], framing.ANY_FIRST)]
        bufs[q] = [transport.buffer(nb, body.device) for nb in shapes]
        recvs += [(q, b) for b in bufs[q]]
    sh, rh = transport.post(sends, recvs, where)
    for h in rh:
        h.wait(deadline, where)
    got = {}
    try:
        for q in bodies:
            want = sizes[q] if bound is None else bound
            if foreign is not None:
                words = framing.peek(bufs[q][0])
                if words is not None and (
                    framing.status_of(words[3]) != framing.OK or words[2] != where.tag()
                ):
                    foreign[q] = (words, bufs[q][0])
                    continue
            hwords, body = framing.unpack(bufs[q], 1, want)
            (length,) = framing.check(hwords, where, q, transport.rank, [want], exact=bound is None)
            got[q] = body[:length].clone()
    except Exception:
        # a dropped send may never leave (Gloo): its peer still expects it
        transport.owed += [(h, where) for h in sh]
        raise
    if foreign:
        transport.owed += [(h, where) for h in sh]  # the caller settles (and waits)
        return got
    for h in sh:
        h.wait(deadline, where)
    return got


def exchange(
    transport: Transport, block: torch.Tensor, deadline: Deadline, where: Where
) -> list[torch.Tensor]:
    """Every rank's ``block`` (the same number of bytes everywhere) as uint8, in
    rank order: one round to every peer for n <= :data:`DIRECT_EXCHANGE_MAX`
    (the agreement's fingerprints), Bruck's :func:`all_gather` beyond."""
    n, r = transport.world_size, transport.rank
    raw = block.contiguous().reshape(-1).view(torch.uint8)
    if n == 1:
        return [raw]
    if n > DIRECT_EXCHANGE_MAX:
        return all_gather(transport, raw, deadline, where)
    peers = [q for q in range(n) if q != r]
    got = _each_peer(
        transport, dict.fromkeys(peers, raw), dict.fromkeys(peers, raw.numel()), deadline, where
    )
    got[r] = raw
    return [got[q] for q in range(n)]


#: Bytes that may ride after :func:`exchange_tails`'s block, per peer (every
#: rank's receives are posted that large, for every call, so it stays small;
#: block, tail and header travel as one message, see framing.COALESCE_BYTES).
TAIL_BYTES = (64 << 10) - 1024


def tails_ride(transport: Transport) -> bool:
    """Whether :func:`exchange_tails` runs on this transport: one round to every
    peer (n <= :data:`DIRECT_EXCHANGE_MAX`) on a transport whose receives take
    shorter messages (Gloo, the simulator; not NCCL)."""
    return transport.short_messages and 1 < transport.world_size <= DIRECT_EXCHANGE_MAX


def exchange_tails(
    transport: Transport,
    block: torch.Tensor,
    tails: dict[int, torch.Tensor],
    deadline: Deadline,
    where: Where,
    foreign: dict[int, tuple[list[int], torch.Tensor]] | None = None,
) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """:func:`exchange`, where the message to peer q also carries ``tails[q]``
    (at most :data:`TAIL_BYTES`; a peer without one gets the block alone), in the
    same single round. Every rank posts its receives for a block plus
    TAIL_BYTES whether it sends tails or not, so that ranks that disagree about
    what rides (the agreement's case: ranks making different calls) still
    exchange messages that fit and can compare their blocks. Returns every
    rank's block in rank order, and the tail each peer sent this rank (empty
    when none). Needs :func:`tails_ride`."""
    n, r = transport.world_size, transport.rank
    if not tails_ride(transport):
        raise ValueError("tails ride only on a direct exchange over short-message transports")
    raw = block.contiguous().reshape(-1).view(torch.uint8)
    k = raw.numel()
    peers = [q for q in range(n) if q != r]
    bodies = {}
    for q in peers:
        tail = tails.get(q)
        if tail is None:
            bodies[q] = raw
            continue
        t8 = tail.detach().contiguous().reshape(-1).view(torch.uint8).to(raw.device)
        if t8.numel() > TAIL_BYTES:
            raise ValueError(f"at most {TAIL_BYTES} bytes ride after a block, got {t8.numel()}")
        bodies[q] = torch.cat([raw, t8])
    got = _each_peer(transport, bodies, {}, deadline, where, bound=k + TAIL_BYTES, foreign=foreign)
    if foreign:
        return [], {}
    for q, b in got.items():
        if b.numel() < k:
            raise TransportError(
                f"rank {r}: the message from rank {q} in {where.describe()} is shorter "
                f"({b.numel()} bytes) than the {k} bytes of this rank's block"
            )
    blocks = [raw if q == r else got[q][:k] for q in range(n)]
    return blocks, {q: got[q][k:] for q in peers}


def check_held(held: dict[int, torch.Tensor], nbytes: int, rank: int, where: Where) -> None:
    """Raise TransportError unless every peer's statistics that rode with the
    agreement (or came in a first round) have the ``nbytes`` this rank expects."""
    for q, b in held.items():
        if b.numel() != nbytes:
            raise TransportError(
                f"rank {rank}: rank {q} sent {b.numel()} bytes of its statistics, "
                f"this rank expects {nbytes}, in {where.describe()}"
            )


def direct_pieces(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The n near-equal pieces :func:`direct_all_reduce` cuts ``t`` into (piece q
    goes to rank q), as views of its flat form."""
    flat = t.contiguous().reshape(-1)
    if flat.numel() < n:
        raise ValueError(f"a direct all-reduce over {n} ranks needs at least {n} elements")
    cuts = [flat.numel() * i // n for i in range(n + 1)]
    return [flat[cuts[q] : cuts[q + 1]] for q in range(n)]


def direct_all_reduce(
    transport: Transport,
    t: torch.Tensor,
    combine: Callable[[torch.Tensor, torch.Tensor], None],
    deadline: Deadline,
    where: Where,
    held: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The reduction of every rank's ``t`` (same shape and dtype on every rank)
    in two rounds, each rank sending 2(n-1)/n of the bytes where an all-gather
    sends n-1 whole copies: t is cut into n near-equal pieces
    (:func:`direct_pieces`), every rank sends piece q to rank q (one message per
    peer, all at once), rank q folds the n pieces it holds in rank order with
    ``combine(acc, next)`` (in place), and sends its result to every peer. The
    order is the one :func:`all_gather` followed by a fold in rank order gives,
    so the bits are the same as that way's, on every rank and in the simulator.
    Needs at least n elements. ``held``: the first round already happened (the
    pieces rode with the call's agreement): the bytes of this rank's piece
    from each peer."""
    n, r = transport.world_size, transport.rank
    pieces = direct_pieces(t, n)
    item = t.element_size()
    peers = [q for q in range(n) if q != r]

    def at(rnd: int) -> Where:
        return Where(where.what, where.call, where.step, rnd, where.phase)

    mine = pieces[r].numel() * item
    if held is None:
        held = _each_peer(
            transport, {q: pieces[q] for q in peers}, dict.fromkeys(peers, mine), deadline, at(0)
        )
    check_held(held, mine, r, where)
    # received bytes may sit on another device than t (pieces that rode with the
    # agreement arrive in its host buffers)
    got = {q: b.view(t.dtype).to(t.device) for q, b in held.items()}
    got[r] = pieces[r]
    acc = got[0].clone()
    for q in range(1, n):
        combine(acc, got[q])
    sizes = {q: pieces[q].numel() * item for q in peers}
    done = {
        q: b.view(t.dtype).to(t.device)
        for q, b in _each_peer(transport, dict.fromkeys(peers, acc), sizes, deadline, at(1)).items()
    }
    done[r] = acc
    return torch.cat([done[q] for q in range(n)]).view(t.shape)
