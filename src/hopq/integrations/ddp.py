"""DDP communication hook: ``model.register_comm_hook(state, hopq.ddp_hook)``."""

# No "from __future__ import annotations": DDP compares the hook's annotations
# with dist.GradBucket and Future[Tensor] as objects.
import time
from typing import Any

import torch
import torch.distributed as dist

from hopq.codecs.base import Codec
from hopq.codecs.registry import get_codec
from hopq.comm.collectives import all_reduce
from hopq.comm.engine import DEFAULT_TIMEOUT_S, RunStats
from hopq.comm.topology import get_schedule
from hopq.options import check_finite, check_int


class HookState:
    """State of the hopq DDP hook.

    ``process_group`` may be None (the default group) and is resolved at the
    first call, so the state can be built before ``init_process_group``. One
    codec instance lives here for the whole training, so adaptive codecs keep
    their state and the round counter (part of the RNG key) advances.
    """

    def __init__(
        self,
        codec: "str | Codec[Any]" = "bf16",
        topology: str = "ring",
        process_group: "dist.ProcessGroup | None" = None,
        seed: int = 0,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        gather_codec: "str | Codec[Any] | None" = None,
        **codec_config: Any,
    ) -> None:
        self.codec = get_codec(codec, **codec_config)
        get_schedule(topology, 1)  # an unknown topology fails here, not mid-backward
        self.topology = topology
        self.process_group = process_group
        self.seed = check_int("seed", seed, lo=0)
        self.timeout = check_finite("timeout", timeout, positive=True)
        self.gather_codec = None if gather_codec is None else get_codec(gather_codec)
        if self.gather_codec is not None and not self.gather_codec.gather_stage:
            self.gather_codec.plan_gather(0, ())  # raises why it cannot
        #: Stats of every bucket of the last step, appended by the hook.
        self.calls: list[RunStats] = []
        #: When set, the hook also runs an exact float64 all-reduce of each bucket
        #: and accumulates the compressed result's error against it (vNMSE).
        self.measure_error = False
        self.err_sq = 0.0
        self.ref_sq = 0.0
        #: Seconds spent on those exact all-reduces (to leave out of step timings).
        self.exact_seconds = 0.0

    def pop_stats(self) -> list[RunStats]:
        """The stats of every call since the last pop (e.g. one training step)."""
        out, self.calls = self.calls, []
        return out

    def pop_error(self) -> tuple[float, float]:
        """(vNMSE over the buckets measured since the last pop, seconds of exact
        all-reduces); NaN when nothing was measured."""
        v = self.err_sq / self.ref_sq if self.ref_sq > 0 else float("nan")
        out = (v, self.exact_seconds)
        self.err_sq = self.ref_sq = self.exact_seconds = 0.0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.state_dict(), "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state["codec"])
        self.seed = int(state["seed"])


def ddp_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients over the group with hopq's compressed all-reduce.

    The hops run to completion inside the hook (Gloo's point-to-point works have
    no futures), and a completed future is returned; on CUDA the work is queued
    on the current stream, which DDP waits on.
    """
    buf = bucket.buffer()
    exact = None
    if state.measure_error:
        t0 = time.perf_counter()
        exact = buf.detach().to(torch.float64)
        dist.all_reduce(exact, group=state.process_group)
        exact /= dist.get_world_size(state.process_group)
        state.exact_seconds += time.perf_counter() - t0
    # the bucket index names the bucket from step to step (DynamiQ shares the
    # step's bit budget across buckets by it)
    info = all_reduce(
        buf, state.codec, state.topology, "avg", state.process_group, state.seed, bucket.index(),
        timeout=state.timeout, gather_codec=state.gather_codec,
    )  # fmt: skip
    if exact is not None:
        state.err_sq += float((buf.to(torch.float64) - exact).square().sum())
        state.ref_sq += float(exact.square().sum())
    state.calls.append(info)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buf.device] if buf.is_cuda else None
    )
    fut.set_result(buf)
    return fut
