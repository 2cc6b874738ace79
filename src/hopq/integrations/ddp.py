"""DDP communication hook: ``model.register_comm_hook(state, hopq.ddp_hook)``.

The hook overlaps like DDP's own all-reduce: it hands the bucket to the state's
communication thread and returns a pending future, so a bucket's compressed
all-reduce runs while autograd computes the gradients of earlier layers. One
thread per state runs the buckets one after another, in the order DDP hands
them over, which is the same on every rank; the codec kernels release the GIL
(numba ``nogil``, torch ops), so codec work and compute use different cores. On
CUDA the thread works on a side stream that first waits for the bucket's
gradients, and the future carries that stream's completion to DDP.
``HookState(overlap=False)`` runs each bucket inside the hook instead; both
paths give the same bits.
"""

# No "from __future__ import annotations": DDP compares the hook's annotations
# with dist.GradBucket and Future[Tensor] as objects.
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from hopq.codecs.base import Codec
from hopq.codecs.registry import get_codec
from hopq.comm.collectives import all_reduce
from hopq.comm.engine import DEFAULT_TIMEOUT_S
from hopq.comm.topology import get_schedule
from hopq.integrations.records import MAX_KEPT_CALLS, CallRecords, StepMetrics
from hopq.options import check_finite, check_int

__all__ = ["MAX_KEPT_CALLS", "HookState", "StepMetrics", "ddp_hook"]


class HookState(CallRecords):
    """State of the hopq DDP hook.

    ``process_group`` may be None (the default group) and is resolved at the
    first call, so the state can be built before ``init_process_group``. One
    codec instance lives here for the whole training, so adaptive codecs keep
    their state and the round counter (part of the RNG key) advances.
    ``overlap`` (default True): run the buckets on a communication thread while
    the backward pass goes on (see the module's docstring).
    """

    records_owner = "HookState"

    def __init__(
        self,
        codec: "str | Codec[Any]" = "bf16",
        topology: str = "ring",
        process_group: "dist.ProcessGroup | None" = None,
        seed: int = 0,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        gather_codec: "str | Codec[Any] | None" = None,
        overlap: bool = True,
        optimizer: "torch.optim.Optimizer | None" = None,
        **codec_config: Any,
    ) -> None:
        self.codec = get_codec(codec, **codec_config)
        #: The optimizer whose state sets the codec's per-coordinate thresholds
        #: before each bucket (codecs with ``set_thresholds``: GComp's
        #: optimizer-aware truncation); None: no thresholds.
        if optimizer is not None and not hasattr(self.codec, "set_thresholds"):
            raise ValueError(f"codec {self.codec.name!r} takes no optimizer")
        self.optimizer = optimizer
        get_schedule(topology, 1)  # an unknown topology fails here, not mid-backward
        self.topology = topology
        self.process_group = process_group
        self.seed = check_int("seed", seed, lo=0)
        self.timeout = check_finite("timeout", timeout, positive=True)
        self.gather_codec = None if gather_codec is None else get_codec(gather_codec)
        if self.gather_codec is not None and not self.gather_codec.gather_stage:
            self.gather_codec.plan_gather(0, ())  # raises why it cannot
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        self.overlap = overlap
        #: Stats of every bucket since the last pop (the most recent
        #: MAX_KEPT_CALLS when nobody pops them): ``calls``.
        self._init_records()
        #: When set, the hook also runs an exact float64 all-reduce of each bucket
        #: and accumulates the compressed result's error against it (vNMSE).
        self.measure_error = False
        self.err_sq = 0.0
        self.ref_sq = 0.0
        #: Seconds spent on those exact all-reduces (to leave out of step timings).
        self.exact_seconds = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._stream: Any = None

    def pop_error(self) -> tuple[float, float]:
        """(vNMSE over the buckets measured since the last pop, seconds of exact
        all-reduces); NaN when nothing was measured."""
        with self._lock:
            v = self.err_sq / self.ref_sq if self.ref_sq > 0 else float("nan")
            out = (v, self.exact_seconds)
            self.err_sq = self.ref_sq = self.exact_seconds = 0.0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.state_dict(), "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state["codec"])
        self.seed = int(state["seed"])

    # -- the communication thread ---------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            # one worker: buckets run in submission order, the same on every rank
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hopq-comm")
        return self._pool

    def close(self) -> None:
        """Finish the queued buckets and stop the communication thread (it is
        also stopped at interpreter exit); the state stays usable."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["_lock"] = d["_pool"] = d["_stream"] = None
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()


def _reduce(state: HookState, buf: torch.Tensor, index: int) -> None:
    """One bucket's all-reduce (and, when asked, its exact reference)."""
    exact = None
    if state.measure_error:
        t0 = time.perf_counter()
        exact = buf.detach().to(torch.float64)
        dist.all_reduce(exact, group=state.process_group)
        exact /= dist.get_world_size(state.process_group)
        with state._lock:
            state.exact_seconds += time.perf_counter() - t0
    # the bucket index names the bucket from step to step (DynamiQ shares the
    # step's bit budget across buckets by it)
    info = all_reduce(
        buf, state.codec, state.topology, "avg", state.process_group, state.seed, index,
        timeout=state.timeout, gather_codec=state.gather_codec,
    )  # fmt: skip
    if exact is not None:
        err = float((buf.to(torch.float64) - exact).square().sum())
        ref = float(exact.square().sum())
        with state._lock:
            state.err_sq += err
            state.ref_sq += ref
    state._record(info)


def _run(
    state: HookState,
    buf: torch.Tensor,
    index: int,
    fut: "torch.futures.Future[torch.Tensor]",
    ready: Any,
) -> None:
    """On the communication thread: reduce, then complete (or fail) the future."""
    try:
        if ready is None:
            _reduce(state, buf, index)
            fut.set_result(buf)
            return
        if state._stream is None:
            state._stream = torch.cuda.Stream(device=buf.device)
        stream = state._stream
        stream.wait_event(ready)  # the bucket's gradients are written
        with torch.cuda.stream(stream):
            buf.record_stream(stream)
            _reduce(state, buf, index)
            fut.set_result(buf)  # the future records this stream's work
    except BaseException as e:  # noqa: BLE001 - every failure reaches the training step
        fut.set_exception(e)  # type: ignore[arg-type]  # torch's stub types it as the value


def ddp_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients over the group with hopq's compressed all-reduce.

    Returns a pending future (``state.overlap``, the default) that the
    communication thread completes, or a completed one. An error inside the
    all-reduce is raised by DDP in the training step's backward pass.
    """
    buf = bucket.buffer()
    if state.optimizer is not None:  # before the bucket is queued: the state is current
        from hopq.codecs.gcomp.optim import thresholds

        thr = thresholds(state.optimizer, list(bucket.parameters()))
        state.codec.set_thresholds(thr.to(buf.device), bucket.index())  # type: ignore[attr-defined]
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buf.device] if buf.is_cuda else None
    )
    if not state.overlap:
        _reduce(state, buf, bucket.index())
        fut.set_result(buf)
        return fut
    ready = None
    if buf.is_cuda:
        ready = torch.cuda.Event()
        ready.record()  # on the stream that wrote the bucket
    state._executor().submit(_run, state, buf, bucket.index(), fut, ready)
    # DDP reads the future's value in C++, where an exception set from Python
    # would arrive as "Unable to cast ... to Tensor"; a callback that raises
    # marks the chained future as failed with the error's own words
    return fut.then(_unwrap)


def _unwrap(fut: "torch.futures.Future[torch.Tensor]") -> torch.Tensor:
    try:
        return fut.value()
    except Exception as e:
        raise RuntimeError(f"hopq.ddp_hook: {type(e).__name__}: {e}") from e
