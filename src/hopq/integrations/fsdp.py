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

GComp's optimizer-aware truncation (``optimizer=``): rank r holds the
optimizer state of its slice only, while the hops that truncate a slice's
partial sums run on the other ranks. So each rank computes the thresholds
|A| of its own slice (its shards of the group's trainable parameters, in
FSDP's order, padding at 0) and the ranks all-gather them, as one byte per
coordinate (|A|'s float32 exponent: 2^e <= |A|, so at an exchange a rank never
truncates more than the exact threshold allows), every ``thresholds_every``
calls of a key and at its first call after the optimizer's first step; the
gathered bytes count in the call's bits per coordinate. Between exchanges a
key's thresholds are those of its last exchange: they lag the optimizer
(during a learning-rate warm-up |A| ~ 1/lr falls, and stale thresholds
truncate more than fresh ones would).

DynamiQ's step-size weights (``optimizer=``): the allocation weighs each
super-group's energy by the mean of the optimizer's squared step sizes over
its entries (docs/codecs/dynamiq.md). In FSDP's reduce-scatter the super-groups
start at every rank's slice, so each rank computes the weights of its own
slice's super-groups from the state it holds (FSDP's padding left out of the
means) and the ranks all-gather them before every call: 32 bits per 256
coordinates, 1/8 bit per coordinate, counted in the call's bits. Before the
optimizer's first step there are none, and the allocation is the paper's.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hopq.codecs.base import Codec, check_takes_optimizer, missing_optimizer
from hopq.codecs.registry import get_codec
from hopq.comm.collectives import Op, reduce_scatter_with_stats
from hopq.comm.engine import RunStats
from hopq.comm.layout import resolve_spec
from hopq.comm.plan import AutoPlanner
from hopq.comm.topology import get_schedule
from hopq.integrations.records import (
    CallRecords,
    StepMetrics,
    pack_codec_state,
    reads_no_optimizer,
    unpack_codec_state,
)
from hopq.options import check_int, check_timeout

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

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


#: Calls of a module between refreshes of an optimizer's thresholds (GComp).
THRESHOLDS_EVERY = 10


def _rank() -> int:
    """This process's rank in the default group (0 without one): the key of its
    rank-local counters in a checkpoint."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _Shared(CallRecords):
    """What the keyed views of one model share: the codec, the records and the
    optimizer with the thresholds last exchanged per key."""

    records_owner = "FSDPReduceScatter"

    def __init__(
        self, codec: Codec[Any], topology: str, seed: int, timeout: float | None,
        optimizer: torch.optim.Optimizer | None = None, thresholds_every: int = THRESHOLDS_EVERY,
    ) -> None:  # fmt: skip
        self.codec, self.topology, self.seed, self.timeout = codec, topology, seed, timeout
        self.optimizer, self.thresholds_every = optimizer, thresholds_every
        #: key -> (calls so far, whether the optimizer had state at the key's
        #: last exchange); the thresholds themselves live in the codec
        self.thresholds: dict[int | None, tuple[int, bool, int]] = {}
        self.warned: set[int | None] = set()
        self.called = False
        #: The two-tier layout and intra-node codec (set by FSDPReduceScatter).
        self.layout: Any = None
        self.intra_codec: str | Codec[Any] = "fp32"
        #: codec="auto"'s planner (None: the codec above runs every call).
        self.auto: AutoPlanner | None = None
        self._init_records()


class FSDPReduceScatter(_ReduceScatterBase):
    """hopq's compressed reduce-scatter in FSDP2's place.

    Use :meth:`install` to hand every FSDP module of a model its own keyed view
    (``module.set_custom_reduce_scatter(comm)`` on one module works too; its
    calls then carry ``key``, None by default). Every view shares one codec
    instance and one list of call records. Bits per coordinate in
    :meth:`step_metrics` count a reduce-scatter's (n-1)/n x d coordinates, so
    that bf16 is 16. Needs torch >= 2.9 (``FSDPModule.set_custom_reduce_scatter``).

    Args:
        codec: A registered name (built with ``codec_config``), a
            :class:`hopq.Codec` instance, as in :func:`hopq.all_reduce`, or
            ``"auto"``: the first reduce-scatter probes the link and every rank
            plans the same codec, budget and topology per module's size,
            re-planned when the measured times drift from the prediction (as
            :class:`hopq.HookState` does; docs/plan.md). Every rank must pass
            ``"auto"`` then, or all raise :class:`hopq.MismatchError`.
        topology: The schedule, as in :func:`hopq.all_reduce` (with
            ``"auto"``: planned).
        seed: Seeds the RNG of stochastic codecs; the same on every rank.
        timeout: Seconds to wait for a peer; None: the group's own timeout.
        key: The calls' key when this object is set on one module by hand
            (:meth:`install` keys the modules itself and refuses one).
        optimizer: The optimizer of the sharded parameters, for GComp (its
            state sets the truncation thresholds, exchanged every
            ``thresholds_every`` calls of a module, one byte per coordinate)
            and DynamiQ (its step sizes weigh the bit allocation, exchanged
            before every call); it needs :meth:`install`. One given to a codec
            that reads none is ignored, with a UserWarning; with ``"auto"`` it
            goes to the modules whose planned codec reads one.
        thresholds_every: Calls of a module between refreshes of GComp's
            thresholds; only with GComp and ``optimizer``.
        layout: The nodes the ranks run on, for two-tier reduce-scatters, as
            in :func:`hopq.reduce_scatter` (``"auto"``, ``"NxG"``, ``(N, G)``
            or a ``NodeLayout``; not with ``optimizer``); None: flat.
        intra_codec: The intra-node codec of two-tier reduce-scatters
            (default ``"fp32"``).
        **codec_config: Options of the codec, when ``codec`` is a name.

    Raises:
        ImportError: torch is older than 2.9.
        TypeError: An option the codec does not have, or an argument of the
            wrong type.
        ValueError: An unknown codec or topology, ``thresholds_every`` without GComp and
            an optimizer, a ``layout`` that is not one or comes with an
            ``optimizer``, or an option out of range.

    Example:
        Under ``torchrun``, with torch >= 2.9:

        ```python
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters())
        comm = hopq.FSDPReduceScatter("dynamiq", topology="ring", optimizer=opt)
        comm.install(model)  # every FSDP module's reduce-scatter
        ...
        logger.log(comm.step_metrics())  # once per step
        ```
    """

    def __init__(
        self,
        codec: str | Codec[Any] = "bf16",
        topology: str = "ring",
        seed: int = 0,
        *,
        timeout: float | None = None,
        key: int | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        thresholds_every: int = THRESHOLDS_EVERY,
        layout: Any = None,
        intra_codec: str | Codec[Any] = "fp32",
        **codec_config: Any,
    ) -> None:
        _require_api()
        spec = resolve_spec(layout)
        get_codec(intra_codec)  # an unknown codec fails here, not mid-backward
        if spec is not None and optimizer is not None:
            raise ValueError(
                "hopq FSDPReduceScatter: a two-tier layout permutes the vector between its "
                "tiers, which the optimizer's exchanged state does not follow: pass layout or "
                "optimizer, not both"
            )
        get_schedule(topology, 1)  # an unknown topology fails here, not mid-backward
        planner = None
        if isinstance(codec, str) and codec.strip().lower() == "auto":
            if codec_config:
                raise ValueError(
                    "FSDPReduceScatter(codec='auto') plans the codec's options itself: pass "
                    "none (hopq.comm.plan.AUTO_OVERRIDES changes what it assumes)"
                )
            planner = AutoPlanner(spec, "FSDPReduceScatter")
            codec = "fp32"  # a stand-in: every call runs its plan's codec
        c = get_codec(codec, **codec_config)
        # with "auto", an optimizer goes to the modules whose planned codec reads one
        unused = reads_no_optimizer(c) if optimizer is not None and planner is None else None
        if unused:  # accepted and ignored, as HookState does: said once
            warnings.warn(
                f"FSDPReduceScatter(optimizer=...): {unused}; the optimizer is ignored",
                UserWarning,
                stacklevel=2,
            )
            optimizer = None
        if optimizer is not None and planner is None:
            check_takes_optimizer(c, optimizer)
            if not hasattr(c, "set_thresholds") and not hasattr(c, "set_supergroup_weights"):
                raise ValueError(
                    f"hopq FSDPReduceScatter: {c.name} reads the optimizer's state for the "
                    "whole vector before each call, and FSDP shards that state across the "
                    "ranks (only GComp's thresholds and DynamiQ's super-group weights are "
                    "exchanged between them): pass no optimizer"
                )
        if thresholds_every != THRESHOLDS_EVERY and (
            optimizer is None or not (hasattr(c, "set_thresholds") or planner is not None)
        ):
            raise ValueError(
                "thresholds_every sets how often GComp's thresholds are refreshed: "
                + (
                    "pass optimizer= too, or leave it out"
                    if optimizer is None
                    else f"{c.name} exchanges what it reads of the optimizer at every call; "
                    "leave it out"
                )
            )
        self._shared = _Shared(
            c,
            topology,
            check_int("seed", seed, lo=0, hi=(1 << 63) - 1),
            check_timeout(timeout),
            optimizer,
            check_int("thresholds_every", thresholds_every, lo=1),
        )
        #: The two-tier layout (None, "auto" or a NodeLayout) and intra-node codec.
        self._shared.layout, self._shared.intra_codec = spec, intra_codec
        self._shared.auto = planner
        self.key = None if key is None else check_int("key", key, lo=0)
        self._module: FSDPModule | None = None

    # -- what the views share --------------------------------------------------
    @property
    def codec(self) -> Codec[Any]:
        """The codec instance every view shares."""
        return self._shared.codec

    @property
    def topology(self) -> str:
        """The schedule's name."""
        return self._shared.topology

    @property
    def seed(self) -> int:
        """The RNG seed of stochastic codecs."""
        return self._shared.seed

    def for_key(self, key: int | None) -> FSDPReduceScatter:
        """A view with its own key that shares this one's codec and records."""
        view = object.__new__(type(self))
        view._shared = self._shared
        view.key = None if key is None else check_int("key", key, lo=0)
        view._module = None
        return view

    def install(self, module: torch.nn.Module) -> int:
        """Set a keyed view as the reduce-scatter of every FSDP module in
        ``module`` (itself included), key i for the i-th in ``module.modules()``
        order, which is the same on every rank.

        Args:
            module: A model on which ``fully_shard`` was called.

        Returns:
            How many FSDP modules were set.

        Raises:
            ValueError: This object has a ``key`` (install keys the modules
                itself), or ``module`` holds no FSDP module.

        Example:
            ```python
            fully_shard(model)
            n = hopq.FSDPReduceScatter("dynamiq").install(model)
            ```
        """
        from torch.distributed.fsdp import FSDPModule

        if self.key is not None:
            raise ValueError(
                f"install() keys the FSDP modules 0, 1, ... itself, so key={self.key} would "
                "be ignored: pass no key, or set this view on one module with "
                "module.set_custom_reduce_scatter(comm)"
            )
        count = 0
        for m in module.modules():
            if isinstance(m, FSDPModule):
                view = self.for_key(count)
                view._module = m  # whose parameters the thresholds are for
                m.set_custom_reduce_scatter(view)
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
        if not shared.called:  # the first call: warn about a missing optimizer once
            shared.called = True
            why = missing_optimizer(shared.codec, shared.optimizer, "FSDPReduceScatter")
            if why:
                warnings.warn(why, UserWarning, stacklevel=2)
        codec, topology, layout = shared.codec, shared.topology, shared.layout
        if shared.auto is not None:  # codec="auto": this module's plan (docs/plan.md)
            codec, topology, layout = shared.auto.pick(input_tensor, group, self.key)
        gathered = 0
        # the optimizer's state goes to the codecs that read it (with "auto": a
        # planned GComp or DynamiQ on a flat schedule; every rank plans alike)
        if shared.optimizer is not None and layout is None:
            exchange = (
                self._set_thresholds
                if hasattr(codec, "set_thresholds")
                else self._set_step_weights
                if hasattr(codec, "set_supergroup_weights")
                else None
            )
            if exchange is not None and shared.auto is not None:
                try:  # the planned codec's rule for this optimizer (every rank alike)
                    check_takes_optimizer(codec, shared.optimizer)
                except ValueError as why:
                    self._warn_once(
                        f"FSDPReduceScatter(codec='auto') planned {codec.name!r} for module "
                        f"{self.key}, which runs without the optimizer: {why}"
                    )
                    exchange = None
            if exchange is not None:
                gathered = exchange(codec, output_tensor.numel(), group, input_tensor.device)
        shard, info = reduce_scatter_with_stats(
            input_tensor, codec, topology, op, group, shared.seed,
            key=self.key, timeout=shared.timeout, shards="equal", layout=layout,
            intra_codec=shared.intra_codec,
        )  # fmt: skip
        if shared.auto is not None:
            shared.auto.observe(self.key, info.seconds)
        info.stats_bytes += gathered
        with torch.no_grad():
            output_tensor.copy_(shard.view(output_tensor.shape))
        shared._record(info)
        if not async_op:
            return None
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result([output_tensor])
        return torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]

    # -- GComp's thresholds --------------------------------------------------------
    def _params(self, numel: int) -> tuple[list[Any] | None, str]:
        """The module's FSDP parameters that this reduce-scatter carries, in its
        order, or (None, why not) where the slice is not laid out as assumed."""
        module = self._module
        if module is None:
            return None, "the view was not set by install(model), so its parameters are unknown"
        try:
            group = module._get_fsdp_state()._fsdp_param_group
        except AssertionError:  # several parameter groups (one per mesh)
            return None, "it has several FSDP parameter groups"
        params = [] if group is None else list(group.fsdp_params)
        # FSDP reduce-scatters the gradients there are: frozen parameters have none
        params = [fp for fp in params if fp.sharded_param.requires_grad]
        if any(fp.fsdp_placement.dim != 0 for fp in params):
            return None, "a parameter is sharded on a dimension other than 0"
        if sum(fp.padded_sharded_param_size.numel() for fp in params) != numel:
            return None, "some of its trainable parameters have no gradient in this backward pass"
        return params, ""

    def _local_thresholds(self, params: list[Any] | None, why: str) -> torch.Tensor | None:
        """|A| of this rank's slice (its shards of ``params`` in FSDP's order, each
        padded with 0 to FSDP's padded shard size; NaN as 0: no truncation), or
        None, with a warning once per key, when ``params`` is None."""
        from hopq.codecs.gcomp.optim import thresholds

        shared = self._shared
        if params is None:
            self._warn_once(f"GComp truncates nothing for FSDP module {self.key}: {why}")
            return None
        assert shared.optimizer is not None
        parts: list[torch.Tensor] = []
        for fp in params:
            a = thresholds(shared.optimizer, [fp.sharded_param]).nan_to_num_(nan=0.0)
            parts += [a, a.new_zeros(fp.padded_sharded_param_size.numel() - a.numel())]
        return torch.cat(parts) if parts else torch.zeros(0)

    def _warn_once(self, what: str) -> None:
        """Warn (once per key) that the optimizer's input is left out for this key."""
        shared = self._shared
        if self.key not in shared.warned:
            shared.warned.add(self.key)
            warnings.warn(f"hopq FSDPReduceScatter: {what}", RuntimeWarning, stacklevel=5)

    def _has_state(self, params: list[Any] | None) -> bool:
        """Whether the optimizer holds state for the parameters (it has stepped)."""
        opt = self._shared.optimizer
        return (
            opt is not None
            and params is not None
            and any(bool(opt.state.get(fp.sharded_param)) for fp in params)
        )

    def _set_thresholds(
        self,
        codec: Codec[Any],
        numel: int,
        group: torch.distributed.ProcessGroup,
        device: torch.device,
    ) -> int:
        """Hand the codec this key's thresholds, exchanged anew every
        ``thresholds_every`` calls, and at the first call after the optimizer's
        first step (before it, momentum and second moments are empty and the
        thresholds tiny); returns the bytes this rank sent for them. Every rank
        decides alike: the same calls, the same optimizer steps."""
        shared = self._shared
        calls, had_state, owner = shared.thresholds.get(self.key, (0, False, 0))
        if owner != id(codec):  # a codec that has none yet (codec="auto" planned a new one)
            calls, had_state = 0, False
        params, why = self._params(numel)
        state = self._has_state(params)
        sent = 0
        if calls % shared.thresholds_every == 0 or (state and not had_state):
            local = self._local_thresholds(params, why)
            # every rank takes part in the exchange, each saying whether it has them
            # (on the collective's device: NCCL takes CUDA tensors only)
            have = torch.tensor([local is not None], dtype=torch.int32, device=device)
            torch.distributed.all_reduce(have, torch.distributed.ReduceOp.MIN, group=group)
            full, had_state = None, state
            if bool(have.item()) and local is not None:
                bits = local.to(device).view(torch.int32)
                e = ((bits >> 23) & 0xFF).clamp_(max=254).to(torch.uint8)
                out = [torch.empty_like(e) for _ in range(group.size())]
                torch.distributed.all_gather(out, e, group=group)
                full = (torch.cat(out).to(torch.int32) << 23).view(torch.float32)
                sent = (group.size() - 1) * e.numel()
            # the codec keeps them for this key until the next exchange
            codec.set_thresholds(full, self.key)  # type: ignore[attr-defined]
        shared.thresholds[self.key] = (calls + 1, had_state, id(codec))
        return sent

    # -- DynamiQ's step-size weights -------------------------------------------------
    def _local_weights(
        self, codec: Codec[Any], params: list[Any] | None, why: str
    ) -> torch.Tensor | None:
        """The weights of this rank's slice's super-groups (its shards of
        ``params`` in FSDP's order, each padded to FSDP's padded shard size; the
        padding in no mean), or None: no step sizes yet (before the optimizer's
        first step), none that differ (SGD with one learning rate), or, with a
        warning once per key, ``params`` None."""
        from hopq.codecs.dynamiq.optim import step_sizes

        shared = self._shared
        if params is None:
            self._warn_once(
                f"DynamiQ allocates without the optimizer's step sizes for FSDP module "
                f"{self.key}: {why}"
            )
            return None
        r = step_sizes(shared.optimizer, [fp.sharded_param for fp in params])
        if r is None:
            return None
        total = sum(fp.padded_sharded_param_size.numel() for fp in params)
        padded = r.new_zeros(total)
        real = r.new_zeros(total)
        at = src = 0
        for fp in params:
            n = fp.sharded_param.to_local().numel()
            padded[at : at + n] = r[src : src + n]
            real[at : at + n] = 1.0
            at += fp.padded_sharded_param_size.numel()
            src += n
        return codec.supergroup_weights(padded, real)  # type: ignore[attr-defined]

    def _set_step_weights(
        self,
        codec: Codec[Any],
        numel: int,
        group: torch.distributed.ProcessGroup,
        device: torch.device,
    ) -> int:
        """Hand DynamiQ this call's super-group weights, every rank's slice's,
        all-gathered (each rank decides alike: the same optimizer steps); returns
        the bytes this rank sent for them."""
        params, why = self._params(numel)
        local = self._local_weights(codec, params, why)
        have = torch.tensor([local is not None], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(have, torch.distributed.ReduceOp.MIN, group=group)
        if not bool(have.item()) or local is None:
            return 0
        w = local.to(device)
        n = group.size()
        out = [torch.empty_like(w) for _ in range(n)]
        torch.distributed.all_gather(out, w, group=group)
        sent = (n - 1) * w.numel() * w.element_size()
        # in a reduce-scatter's accounting (bits over (n-1)/n of its coordinates):
        # 32 bits per super-group, 1/8 bit per coordinate, paid from its budget
        spent = 8 * sent / ((n - 1) * numel) if n > 1 else 0.0
        codec.set_supergroup_weights(torch.cat(out), self.key, spent)  # type: ignore[attr-defined]
        return sent

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
        training step.

        Args:
            prefix: Prepended to every key.

        Returns:
            Per-step means over every view's calls since the last pop:
            ``bits_per_coordinate`` (over (n-1)/n x d coordinates),
            ``bytes_sent``, ``codec_seconds``, ``comm_seconds``,
            ``cpu_seconds``, ``buckets`` (reduce-scatters) and ``numel``.

        Example:
            ```python
            opt.step()
            logger.log(comm.step_metrics())  # {"hopq/bits_per_coordinate": 5.0, ...}
            ```
        """
        return self._shared.step_metrics(prefix)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed job needs to continue bit for bit: the seed and the
        codec's state (round counter, DynamiQ's budget shares and statistics),
        shared by every view. A ``torch.distributed.checkpoint`` Stateful: the
        codec's state is one opaque entry (bytes), because its structure grows
        during training and DCP loads only the keys a fresh instance has (the
        same packed form as :meth:`hopq.HookState.state_dict`); rank-local
        counters go under ``codec_local/<rank>``.

        Returns:
            ``{"codec_name", "seed", "codec"}`` and, where the codec has
            rank-local counters, ``"codec_local"``.

        Example:
            ```python
            import torch.distributed.checkpoint as dcp

            dcp.save({"model": model.state_dict(), "hopq": comm}, checkpoint_id=path)
            ```
        """
        return pack_codec_state(self.codec, self.seed, _rank())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (for every view; also the older
        form with the codec's state as a plain dict).

        Args:
            state: What :meth:`state_dict` returned (on any rank).

        Raises:
            ValueError: The checkpoint holds another codec than this one runs.
            KeyError: ``state`` lacks ``"codec"`` or ``"seed"``.

        Example:
            ```python
            comm = hopq.FSDPReduceScatter("dynamiq")
            dcp.load({"model": model.state_dict(), "hopq": comm}, checkpoint_id=path)
            ```
        """
        self._shared.seed = unpack_codec_state(self.codec, state, _rank(), "FSDPReduceScatter")

    def __repr__(self) -> str:
        return f"FSDPReduceScatter({self.codec.name!r}, topology={self.topology!r}, key={self.key})"
