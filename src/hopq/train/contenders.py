"""What ``hopq train`` compares: hopq's codecs and what PyTorch users already have.

A contender is a hopq codec name (``dynamiq``, ``bf16``, ...), ``auto`` among
other names (``HookState(codec="auto")``: the planner picks per bucket from a
probe of the link; the report names its picks; ``auto`` alone means the default
set of contenders), the same with ``@hier`` (``dynamiq@hier``: hopq's two-tier
all-reduce over the job's nodes, exact inside a node and the codec between
nodes), or one of torch's own options, named ``torch:...``:

* ``torch:ddp``: DDP's built-in fp32 all-reduce (no hook);
* ``torch:fp16``: torch's ``fp16_compress_hook`` (its bf16 hook refuses CPU);
* ``torch:powersgd``: torch's ``powerSGD_hook`` with the settings its
  documentation suggests (rank 4, error feedback, warm start), vanilla
  all-reduce for the first ``powersgd_start`` steps (default 10), its buckets
  started one after another (:func:`in_order`: on Gloo it hangs otherwise).

torch's hooks overlap the backward pass (they return pending futures), and so
does hopq's. Bytes are counted for every contender: hopq's from what its engine
sent, torch's from the tensors its hooks hand to ``all_reduce``, converted to a
ring's per-rank traffic, 2(n-1)/n of each tensor, as hopq's bits per coordinate
are defined.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hopq.codecs.base import optimizer_unused
from hopq.codecs.registry import codec_choices, codec_info, get_codec, resolve_codecs
from hopq.comm.engine import RunStats
from hopq.integrations.ddp import HookState, ddp_hook

TORCH_CONTENDERS: dict[str, str] = {
    "torch:ddp": "DDP's own fp32 all-reduce, no hook",
    "torch:fp16": "torch's fp16_compress_hook",
    "torch:powersgd": "torch's powerSGD_hook (rank 4, error feedback, warm start)",
}
#: PowerSGD's rank: torch's documentation suggests starting from 1-4 and says
#: rank 4 reaches the uncompressed accuracy on the models it was tried on.
POWERSGD_RANK = 4


#: The suffix of a hopq contender that runs the two-tier all-reduce.
HIER = "@hier"
#: The contender that plans its codec (``HookState(codec="auto")``) when named
#: among others; alone, ``auto`` is the default set of contenders.
AUTO = "auto"


def is_auto(name: str) -> bool:
    """Whether a contender plans its codec (``auto``, ``auto@hier``)."""
    return codec_of(name) == AUTO


def is_torch(name: str) -> bool:
    return name.startswith("torch:")


def codec_of(name: str) -> str:
    """The codec a hopq contender runs (``dynamiq@hier`` -> ``dynamiq``)."""
    return name.removesuffix(HIER)


def is_hierarchical(name: str) -> bool:
    return name.endswith(HIER) and not is_torch(name)


def contender_choices() -> list[str]:
    codecs = codec_choices()
    hier = [f"{c}{HIER}" for c in codecs if c != "all"]
    return [*codecs, *hier, *TORCH_CONTENDERS]


def _refusal(codec: str, topology: str) -> str | None:
    r = codec_info(codec).refusal(
        dtype=torch.float32, device=torch.device("cpu"), topology=topology
    )
    return None if r is None else r.reason


def resolve_contenders(names: Sequence[str], topology: str = "ring") -> list[str]:
    """``("auto",)``: torch's three, then hopq's ``auto`` codecs that run on
    ``topology`` (float32 on CPU); otherwise the names as given. Unknown names, and
    a named codec that refuses the topology, raise ValueError before anything runs."""
    names = tuple(names)
    if names in (("auto",), ("all",)):
        hopq = [c for c in resolve_codecs(names) if _refusal(c, topology) is None]
        return [*TORCH_CONTENDERS, *hopq]
    for c in names:
        if is_torch(c) and c not in TORCH_CONTENDERS:
            raise ValueError(f"unknown contender {c!r}; torch's are {', '.join(TORCH_CONTENDERS)}")
    named = [codec_of(c) for c in names if not is_torch(c) and not is_auto(c)]
    for c in resolve_codecs(named) if named else []:  # unknown raise
        why = _refusal(c, topology)
        if why:
            raise ValueError(why)
    return list(names)


class ByteCounter:
    """Bytes that torch's hooks hand to ``all_reduce`` while ``active``.

    torch's hooks call ``torch.distributed.all_reduce`` through the module
    attribute, in the hook and in their futures' callbacks, all of which finish
    before DDP's backward returns; so counting between the start of a step and
    the end of its backward pass sees exactly that step's tensors.
    """

    _lock = threading.Lock()
    _installed: Callable[..., Any] | None = None
    _counters: list[ByteCounter] = []

    def __init__(self) -> None:
        self.active = False
        self.bytes = 0.0
        with ByteCounter._lock:
            if ByteCounter._installed is None:
                original = dist.all_reduce
                ByteCounter._installed = original

                def counted(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
                    for c in ByteCounter._counters:
                        if c.active:
                            c.bytes += tensor.numel() * tensor.element_size()
                    return original(tensor, *a, **k)

                dist.all_reduce = counted
            ByteCounter._counters.append(self)

    def pop(self) -> float:
        b, self.bytes = self.bytes, 0.0
        return b


def in_order(hook: Callable[..., torch.futures.Future[torch.Tensor]]) -> Callable[..., Any]:
    """``hook``, run on one bucket after another.

    torch's ``powerSGD_hook`` issues its second and third all-reduces from the
    completion callbacks of the first. On Gloo those callbacks run on Gloo's own
    threads while autograd hands the hook the next bucket, so with more than a
    bucket or two the ranks issue their collectives in different orders; Gloo
    matches collectives by order, and the job hangs or fails with "Received data
    size doesn't match expected size". Starting each bucket's hook only when the
    previous bucket's future completed gives every rank the same order; the
    result is unchanged and the hook still overlaps the backward pass (its
    buckets run one after another, as they do on hopq's communication thread).
    """
    last: list[torch.futures.Future[torch.Tensor] | None] = [None]

    # no annotations: DDP compares them with dist.GradBucket and Future[Tensor],
    # and here they would be strings (from __future__ import annotations)
    def ordered(state, bucket):
        out: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def settle(fut: torch.futures.Future[torch.Tensor]) -> None:
            try:
                out.set_result(fut.value())
            except Exception as e:  # the hook's error reaches the training step
                out.set_exception(e)  # type: ignore[arg-type]  # torch types it as the value

        def start(_: object = None) -> None:
            try:
                hook(state, bucket).add_done_callback(settle)
            except Exception as e:
                out.set_exception(e)  # type: ignore[arg-type]

        previous, last[0] = last[0], out
        if previous is None:
            start()
        else:
            previous.add_done_callback(start)  # at once when it is already done
        return out

    ordered.__name__ = ordered.__qualname__ = f"in_order({getattr(hook, '__name__', 'hook')})"
    return ordered


class BucketClock:
    """When each DDP bucket's synchronization started and ended, for the report's
    timeline: a hook wrapped by :meth:`wrap` notes when DDP calls it (the bucket's
    gradients are ready) and when its future completes."""

    def __init__(self) -> None:
        self.ready: dict[int, float] = {}
        self.done: dict[int, float] = {}

    def wrap(self, hook: Callable[..., torch.futures.Future[torch.Tensor]]) -> Callable[..., Any]:
        # no annotations: DDP compares them with dist.GradBucket and Future[Tensor]
        def timed(state, bucket):
            i = bucket.index()
            self.ready[i] = time.perf_counter()

            def mark(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                self.done[i] = time.perf_counter()
                return fut.value()  # an error goes on to DDP

            # chained, so that DDP's wait ends only after the mark
            return hook(state, bucket).then(mark)

        timed.__name__ = timed.__qualname__ = getattr(hook, "__name__", "hook")
        return timed

    def pop(self, t0: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(ready, done) seconds after ``t0`` of every bucket since the last pop,
        in bucket order (empty when a bucket's future has not completed)."""
        ready, done = self.ready, self.done
        self.ready, self.done = {}, {}
        if set(ready) != set(done):
            return (), ()
        order = sorted(ready)
        return tuple(ready[i] - t0 for i in order), tuple(done[i] - t0 for i in order)


def _link_bytes(call: RunStats) -> float:
    """Bytes a call put on the link between machines: this rank's; for a
    two-tier call its node's, the inter-node bytes of each of the node's
    workers (they share the node's link; the tier inside the node stays off
    it)."""
    if "inter" in call.tiers and "intra" in call.tiers:
        return float(call.tiers["inter"].bytes_sent * call.tiers["intra"].world_size)
    return float(call.bytes_sent)


class StepSync(NamedTuple):
    """One step's synchronization on this rank (NaN: not known for torch's
    contenders)."""

    #: Bytes sent (a ring's per-rank traffic for torch's contenders).
    sent: float
    #: hopq's hook: seconds of codec work and of communication on its thread.
    codec_s: float
    comm_s: float
    vnmse: float
    #: The same error weighed by the job's optimizer's step sizes (the update's).
    update_vnmse: float
    #: Seconds of exact reference all-reduces (left out of the step's time).
    exact_s: float
    #: hopq's hook: CPU seconds of its thread.
    cpu_s: float
    #: hopq's hook: bytes the step's last bucket (the call after the backward
    #: pass's end) put on the link: this rank's, or a two-tier call's node's
    #: (:func:`_link_bytes`).
    last_bytes: float
    #: Seconds after the step's start when each bucket's hook was called and when
    #: its future completed, in bucket order (empty for DDP's own all-reduce).
    ready_s: tuple[float, ...] = ()
    done_s: tuple[float, ...] = ()
    #: hopq's two-tier calls: bits per coordinate between nodes (``sent`` is
    #: then the bytes that left this rank's node); NaN: from ``sent``.
    bits: float = float("nan")


class Sync:
    """One contender's gradient synchronization on one rank: registers the hook
    on ``ddp`` and, after each step, says what it sent and what its hook did."""

    def __init__(
        self,
        name: str,
        ddp: DDP,
        n: int,
        seed: int,
        topology: str,
        codec_config: dict[str, Any],
        powersgd_start: int = 10,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.name, self.n = name, n
        self.state: HookState | None = None
        self.counter: ByteCounter | None = None
        self.clock = BucketClock()
        self.numel = sum(p.numel() for p in ddp.module.parameters() if p.requires_grad)
        if is_auto(name):  # the planner's picks, per bucket, from a probe of the link
            self.state = HookState(
                codec="auto", topology=topology, seed=seed, optimizer=optimizer,
                layout="auto" if is_hierarchical(name) else None,
            )  # fmt: skip
            self.state.error_optimizer = optimizer
            ddp.register_comm_hook(self.state, self.clock.wrap(ddp_hook))
            return
        if not is_torch(name):
            codec = get_codec(codec_of(name), **codec_config)
            # optimizer-aware codecs (GComp) get the job's optimizer, unless their
            # configuration would not use it (fixed_level: the thresholds would be
            # computed every step and thrown away)
            takes = optimizer_unused(codec) is None
            self.state = HookState(
                codec=codec,
                topology=topology,
                seed=seed,
                optimizer=optimizer if takes else None,
                # the layout from the launcher's variables (LOCAL_WORLD_SIZE, GROUP_RANK)
                layout="auto" if is_hierarchical(name) else None,
            )
            # every hopq contender's measured error is also weighed by the job's
            # optimizer's step sizes: the error of the update it makes
            self.state.error_optimizer = optimizer
            ddp.register_comm_hook(self.state, self.clock.wrap(ddp_hook))
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if name == "torch:ddp":
            return
        self.counter = ByteCounter()
        if name == "torch:fp16":
            ddp.register_comm_hook(None, self.clock.wrap(default_hooks.fp16_compress_hook))
        else:
            ps = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=POWERSGD_RANK,
                start_powerSGD_iter=powersgd_start,
                use_error_feedback=True,
                warm_start=True,
                random_seed=seed,
            )
            ddp.register_comm_hook(ps, self.clock.wrap(in_order(powerSGD_hook.powerSGD_hook)))

    def begin(self, measure_error: bool) -> None:
        if self.state is not None:
            self.state.measure_error = measure_error
        if self.counter is not None:
            self.counter.active = True

    def end(self, t0: float) -> StepSync:
        """What the step that started at ``t0`` (``time.perf_counter``) synchronized
        (:class:`StepSync`)."""
        ring = 2 * (self.n - 1) / self.n
        nan = float("nan")
        times = self.clock.pop(t0)
        if self.state is not None:
            vnmse, update_vnmse, exact_s = self.state.pop_error()
            calls = self.state.pop_stats()
            inter = [c.tiers["inter"] for c in calls if "inter" in c.tiers]
            bits = nan
            if calls and len(inter) == len(calls):  # what crosses between nodes
                moved = sum(c.coords_moved for c in inter)
                bits = 8 * sum(c.bytes_sent for c in inter) / moved if moved else nan
            return StepSync(
                sum(c.bytes_sent for c in (inter if bits == bits else calls)),
                sum(c.seconds - c.comm_seconds for c in calls),
                sum(c.comm_seconds for c in calls),
                vnmse,
                update_vnmse,
                exact_s,
                sum(c.cpu_seconds for c in calls),
                _link_bytes(calls[-1]) if calls else nan,
                *times,
                bits=bits,
            )
        if self.counter is not None:
            self.counter.active = False
            return StepSync(self.counter.pop() * ring, nan, nan, nan, nan, 0.0, nan, nan, *times)
        return StepSync(self.numel * 4 * ring, nan, nan, nan, nan, 0.0, nan, nan)  # DDP's fp32
