"""FSDP2 reduce-scatter: ``hopq.FSDPReduceScatter("dynamiq").install(model)``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) reduce-scatters each parameter
group's flat gradient (padded to a multiple of the world size) and keeps rank
r's r-th equal slice; ``FSDPModule.set_custom_reduce_scatter`` (torch 2.9 and
later) lets that collective be replaced. :class:`FSDPReduceScatter` runs it as
hopq's compressed reduce-scatter over equal rank-ordered shards
(``hopq.reduce_scatter(shards="equal")``), with any registered codec on any
topology.

How FSDP calls it (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
``foreach_reduce``): once per parameter group and backward pass, synchronously
(``async_op`` is left False and the returned work is ignored, so the call
finishes its hops before it returns), inside the reduce-scatter stream on
CUDA, with ``op`` = ``ReduceOp.AVG`` for float32 and bfloat16 gradients,
``ReduceOp.PREMUL_SUM(1 / factor)`` under ``set_gradient_divide_factor``, and
``ReduceOp.SUM`` with a pre- and post-division of its own for float16 (or
``force_sum_reduction_for_comms``). All three are accepted.

Each FSDP module's reduce-scatter gets its own key (its index among the FSDP
modules of the model that ``install`` walks), stable from step to step and the
same on every rank, like the DDP hook's bucket index: DynamiQ shares a step's
bit budget across them (``share_budget``). All of a model's keyed views share
one codec instance (its round counter and adaptive state) and one list of
call records (``step_metrics``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hopq.codecs.base import Codec
from hopq.codecs.registry import get_codec
from hopq.comm.collectives import Op, reduce_scatter_with_stats
from hopq.comm.engine import DEFAULT_TIMEOUT_S, RunStats
from hopq.comm.topology import get_schedule
from hopq.integrations.records import CallRecords, StepMetrics
from hopq.options import check_finite, check_int

#: The torch release whose FSDP2 first takes a custom reduce-scatter.
MIN_TORCH = "2.9"

if TYPE_CHECKING:  # mypy sees the interface; at run time it may be missing
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase

    HAVE_FSDP_API = True
else:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import (
            ReduceScatter as _ReduceScatterBase,
        )

        HAVE_FSDP_API = True
    except ImportError:  # torch < 2.9, or built without distributed

        class _ReduceScatterBase:
            pass

        HAVE_FSDP_API = False


def _require_api() -> None:
    if not HAVE_FSDP_API:
        raise ImportError(
            f"hopq.FSDPReduceScatter needs torch >= {MIN_TORCH} (FSDP2's "
            "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter and "
            f"FSDPModule.set_custom_reduce_scatter); this is torch {torch.__version__}"
        )


class _Shared(CallRecords):
    """What the keyed views of one model share: the codec and the records."""

    records_owner = "FSDPReduceScatter"

    def __init__(self, codec: Codec[Any], topology: str, seed: int, timeout: float) -> None:
        self.codec, self.topology, self.seed, self.timeout = codec, topology, seed, timeout
        self._init_records()


class FSDPReduceScatter(_ReduceScatterBase):
    """hopq's compressed reduce-scatter in FSDP2's place.

    ``codec`` (a registered name with ``codec_config`` options, or a Codec
    instance), ``topology`` and ``seed`` as in :func:`hopq.all_reduce`. Use
    :meth:`install` to hand every FSDP module of a model its own keyed view
    (``module.set_custom_reduce_scatter(comm)`` on one module works too; its
    calls then carry ``key``, None by default). Bits per coordinate in
    :meth:`step_metrics` count a reduce-scatter's (n-1)/n x d coordinates, so
    that bf16 is 16.
    """

    def __init__(
        self,
        codec: str | Codec[Any] = "bf16",
        topology: str = "ring",
        seed: int = 0,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        key: int | None = None,
        **codec_config: Any,
    ) -> None:
        _require_api()
        get_schedule(topology, 1)  # an unknown topology fails here, not mid-backward
        self._shared = _Shared(
            get_codec(codec, **codec_config),
            topology,
            check_int("seed", seed, lo=0),
            check_finite("timeout", timeout, positive=True),
        )
        self.key = None if key is None else check_int("key", key, lo=0)

    # -- what the views share --------------------------------------------------
    @property
    def codec(self) -> Codec[Any]:
        return self._shared.codec

    @property
    def topology(self) -> str:
        return self._shared.topology

    @property
    def seed(self) -> int:
        return self._shared.seed

    def for_key(self, key: int | None) -> FSDPReduceScatter:
        """A view with its own key that shares this one's codec and records."""
        view = object.__new__(type(self))
        view._shared = self._shared
        view.key = None if key is None else check_int("key", key, lo=0)
        return view

    def install(self, module: torch.nn.Module) -> int:
        """Set a keyed view as the reduce-scatter of every FSDP module in
        ``module`` (itself included), key i for the i-th in ``module.modules()``
        order, which is the same on every rank. Returns how many were set."""
        from torch.distributed.fsdp import FSDPModule

        count = 0
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(self.for_key(count))
                count += 1
        if not count:
            raise ValueError("no FSDP module found: call fully_shard on the model first")
        return count

    # -- the ReduceScatter interface ---------------------------------------------
    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """FSDP's staging buffers: plain tensors (hopq's transport keeps its own
        receive arena)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: torch.distributed.ProcessGroup,
        op: Op,
        async_op: bool = False,
    ) -> torch.distributed.Work | None:
        """Reduce ``input_tensor`` over ``group`` and write rank r's r-th equal
        slice into ``output_tensor``. The call completes before it returns; with
        ``async_op`` it returns an already completed work object."""
        n = group.size()
        if input_tensor.numel() != n * output_tensor.numel():
            raise ValueError(
                f"hopq FSDPReduceScatter: the input has {input_tensor.numel()} entries, "
                f"not {n} x the output's {output_tensor.numel()}"
            )
        shared = self._shared
        shard, info = reduce_scatter_with_stats(
            input_tensor, shared.codec, shared.topology, op, group, shared.seed,
            key=self.key, timeout=shared.timeout, shards="equal",
        )  # fmt: skip
        with torch.no_grad():
            output_tensor.copy_(shard.view(output_tensor.shape))
        shared._record(info)
        if not async_op:
            return None
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result([output_tensor])
        return torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]

    # -- statistics and state ----------------------------------------------------
    @property
    def calls(self) -> list[RunStats]:
        """The records of every call since the last pop (all views)."""
        return self._shared.calls

    def pop_stats(self) -> list[RunStats]:
        """The stats of every reduce-scatter since the last pop (all views)."""
        return self._shared.pop_stats()

    def pop_step(self) -> StepMetrics:
        """The reduce-scatters since the last pop summed into one record (and
        popped). Bits per coordinate over (n-1)/n x d coordinates."""
        return self._shared.pop_step()

    def step_metrics(self, prefix: str = "hopq/") -> dict[str, float]:
        """This step's reduce-scatters as flat scalars for any logger (and
        popped), the keys of ``HookState.step_metrics()``: call it once per
        training step."""
        return self._shared.step_metrics(prefix)

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.state_dict(), "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state["codec"])
        self._shared.seed = int(state["seed"])

    def __repr__(self) -> str:
        return f"FSDPReduceScatter({self.codec.name!r}, topology={self.topology!r}, key={self.key})"
