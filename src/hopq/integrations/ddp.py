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

On NCCL the thread talks on a process group of its own (``own_group``): NCCL
runs a communicator's operations in the order each rank issues them, and DDP
issues collectives of its own on its group during the backward pass (the
unused parameters' map with ``find_unused_parameters=True``, SyncBatchNorm),
from the autograd thread, while the hopq thread issues its messages; on one
communicator the two could be ordered differently on different ranks and hang.
hopq makes the group at the first bucket, on every rank (a plain ``new_group`` of every rank:
the program must not make other groups from another thread at that moment).
Gloo matches point-to-point messages by tag, apart from collectives, so there
the thread shares the group.
"""

# No "from __future__ import annotations": DDP compares the hook's annotations
# with dist.GradBucket and Future[Tensor] as objects.
import atexit
import contextlib
import datetime
import logging
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from hopq.codecs.base import Codec, check_takes_optimizer, missing_optimizer, optimizer_unused
from hopq.codecs.dynamiq.optim import check_optimizer, step_sizes
from hopq.codecs.registry import get_codec
from hopq.comm import shutdown
from hopq.comm.collectives import all_reduce
from hopq.comm.engine import RunStats
from hopq.comm.layout import resolve_spec
from hopq.comm.plan import AutoPlanner
from hopq.comm.topology import get_schedule
from hopq.comm.transport import carrier, device_backend, group_timeout
from hopq.errors import HookNotEngagedWarning
from hopq.integrations.records import (
    MAX_KEPT_CALLS,
    CallRecords,
    StepMetrics,
    pack_codec_state,
    reads_no_optimizer,
    unpack_codec_state,
)
from hopq.options import check_int, check_timeout

# before DDP imports it after the group exists and keeps the group alive to the
# end of the interpreter (see hopq.comm.shutdown)
shutdown.import_functional_early()

__all__ = ["MAX_KEPT_CALLS", "HookState", "StepMetrics", "ddp_hook"]


class HookState(CallRecords):
    """State of the hopq DDP hook: ``ddp_model.register_comm_hook(state, hopq.ddp_hook)``.

    One codec instance lives here for the whole training, so adaptive codecs
    keep their state and the round counter (part of the RNG key) advances.
    The state keeps every bucket's :class:`~hopq.RunStats`;
    :meth:`step_metrics` sums a step's into scalars for any logger. It is a
    ``torch.distributed.checkpoint`` Stateful (:meth:`state_dict`), so a
    resumed job continues bit for bit. A state that is never called while
    training goes on warns with :class:`hopq.HookNotEngagedWarning`. One state
    serves one DDP model (a GAN makes one per model); the hook refuses a second.

    Args:
        codec: A registered name (built with ``codec_config``), a
            :class:`hopq.Codec` instance, or ``"auto"``: the first buckets probe
            the link and every rank plans the same codec, budget and topology
            per bucket (with ``layout``, also flat or two-tier), re-planned
            when the measured times drift from the prediction; the picks are
            in :meth:`step_metrics` (``hopq/plan/...``) and logged once
            (docs/plan.md). Every rank must pass ``"auto"`` then, or all raise
            :class:`hopq.MismatchError`.
        topology: The schedule, as in :func:`hopq.all_reduce` (with
            ``"auto"``: planned).
        process_group: The DDP model's group (None: the default group),
            resolved at the first call, so the state can be built before
            ``init_process_group``. The hook averages over it, whatever group
            DDP was given (the framework integrations check that they match).
        seed: Seeds the RNG of stochastic codecs; the same on every rank.
        timeout: Seconds to wait for a peer; None: the group's own timeout.
        gather_codec: Codes the all-gather stage with another codec, as in
            :func:`hopq.all_reduce`.
        overlap: Run the buckets on a communication thread while the backward
            pass goes on (the hook returns a pending future); False: each
            bucket inside the hook. Both give the same bits.
        own_group: Whether the thread talks on a process group of its own.
            None: where NCCL carries the buckets and the DDP group holds every
            rank (hopq then makes that group at the first bucket, with every
            rank, the group's backends and timeout); True or False to choose.
            For a DDP group of some ranks only, pass a second group of the same
            ranks, in the same order, made by every rank with
            ``dist.new_group`` as torch asks.
        optimizer: The optimizer that steps the model's parameters, for codecs
            that read its state before each bucket: GComp's truncation needs
            it; DynamiQ weighs its bit allocation by the optimizer's step sizes
            (Adam: lr / (sqrt(v) + eps)), which trains closer to uncompressed
            with adaptive optimizers (docs/codecs/dynamiq.md). With
            ``codec="auto"`` it goes to the buckets whose planned codec reads
            one.
        layout: The nodes the ranks run on, for two-tier all-reduces, as in
            :func:`hopq.all_reduce` (``"auto"``, ``"NxG"``, ``(N, G)`` or a
            ``NodeLayout``); None: flat.
        intra_codec: The intra-node codec of two-tier all-reduces (default
            ``"fp32"``).
        **codec_config: Options of the codec, when ``codec`` is a name.

    Raises:
        TypeError: ``group=`` instead of ``process_group=``, an option the
            codec does not have, or an argument of the wrong type
            (``overlap``, ``own_group``, ``seed``).
        ValueError: An unknown codec or topology, an optimizer the codec has
            no rule for (one given to a codec that reads none is ignored, with a
            UserWarning), ``own_group`` with ``overlap=False``,
            a ``gather_codec`` that cannot code a gather stage, a ``layout``
            that is not one, or an option out of range.

    Example:
        Under ``torchrun``, after ``init_process_group``:

        ```python
        import hopq
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp_model = DDP(model)
        opt = torch.optim.AdamW(ddp_model.parameters())
        state = hopq.HookState(codec="dynamiq", topology="ring", optimizer=opt)
        ddp_model.register_comm_hook(state, hopq.ddp_hook)
        for batch in loader:
            loss_fn(ddp_model(batch)).backward()
            opt.step()
            opt.zero_grad()
            logger.log(state.step_metrics())  # {"hopq/bits_per_coordinate": 4.9, ...}
        ```
    """

    def __init__(
        self,
        codec: "str | Codec[Any]" = "bf16",
        topology: str = "ring",
        process_group: "dist.ProcessGroup | None" = None,
        seed: int = 0,
        *,
        timeout: float | None = None,
        gather_codec: "str | Codec[Any] | None" = None,
        overlap: bool = True,
        own_group: "bool | dist.ProcessGroup | None" = None,
        optimizer: "torch.optim.Optimizer | None" = None,
        layout: Any = None,
        intra_codec: "str | Codec[Any]" = "fp32",
        **codec_config: Any,
    ) -> None:
        if "group" in codec_config:  # hopq.all_reduce's name for it
            raise TypeError(
                "HookState takes the process group as process_group= (DDP's name), not group="
            )
        #: codec="auto": the planner of every bucket's codec (None otherwise);
        #: ``codec`` is then a stand-in (fp32) that no bucket runs.
        self.auto: AutoPlanner | None = None
        if isinstance(codec, str) and codec.strip().lower() == "auto":
            if codec_config:
                raise TypeError(
                    f"HookState(codec='auto') plans the codec's options itself; got "
                    f"{sorted(codec_config)} (hopq.comm.plan.AUTO_OVERRIDES changes what it assumes)"
                )
            self.auto = AutoPlanner(resolve_spec(layout), "HookState", native=True)
            codec = "fp32"
        self.codec = get_codec(codec, **codec_config)
        self._said_optimizer_unused = False
        #: The optimizer whose state the codec reads before each bucket (codecs
        #: with ``use_optimizer``: GComp's per-coordinate thresholds, DynamiQ's
        #: step sizes); None: the codec works without it. One given to a codec
        #: that reads none is accepted, ignored and said once (a UserWarning),
        #: so that changing only the codec's name never breaks a script.
        if optimizer is not None and self.auto is not None:
            # codec="auto": handed to the buckets whose planned codec reads one
            # (DynamiQ's step sizes, GComp's thresholds), ignored by the others
            pass
        elif optimizer is not None:
            why = reads_no_optimizer(self.codec)
            if why:
                self._ignore_optimizer(why, "HookState(optimizer=...)")
                optimizer = None
            else:
                check_takes_optimizer(self.codec, optimizer)
        self.optimizer = optimizer
        #: Whether ``optimizer`` was handed over by a framework integration
        #: (``adopt_optimizer``), which replaces it when the framework makes another.
        self._optimizer_adopted = False
        get_schedule(topology, 1)  # an unknown topology fails here, not mid-backward
        self.topology = topology
        self.process_group = process_group
        self.seed = check_int("seed", seed, lo=0, hi=(1 << 63) - 1)
        self.timeout = check_timeout(timeout)
        self.gather_codec = None if gather_codec is None else get_codec(gather_codec)
        if self.gather_codec is not None and not self.gather_codec.gather_stage:
            self.gather_codec.plan_gather(0, ())  # raises why it cannot
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        self.overlap = overlap
        #: The two-tier layout (None, "auto" or a NodeLayout) and intra-node codec.
        self.layout = resolve_spec(layout)
        get_codec(intra_codec)  # an unknown codec fails here, not mid-backward
        self.intra_codec = intra_codec
        if not isinstance(own_group, (bool, type(None), dist.ProcessGroup)):
            raise TypeError(f"own_group must be None, a bool or a process group, got {own_group!r}")
        if not overlap and own_group not in (None, False):
            raise ValueError(
                "own_group is the overlapped hook's thread's group; with overlap=False the "
                "hook runs each bucket itself, on the DDP group"
            )
        self.own_group = own_group
        #: The communication thread's group once decided (weakly, like the
        #: transports: destroy_process_group frees it), or False: the DDP group.
        self._thread_group: Any = None
        #: Stats of every bucket since the last pop (the most recent
        #: MAX_KEPT_CALLS when nobody pops them), and their sum for the step.
        self._init_records()
        #: When set, the hook also runs an exact float64 all-reduce of each bucket
        #: and accumulates the compressed result's error against it (vNMSE), and
        #: with an optimizer to weigh it by (``error_optimizer``) the update's.
        self.measure_error = False
        self.err_sq = 0.0
        self.ref_sq = 0.0
        self._error_optimizer: torch.optim.Optimizer | None = None
        self._warned_weigh = False
        self.uerr_sq = 0.0
        self.uref_sq = 0.0
        #: Seconds spent on those exact all-reduces and on weighing the error
        #: (to leave out of step timings).
        self.exact_seconds = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._stream: Any = None
        #: Whether the hook was ever called, and each optimizer's steps (by id)
        #: in this process since this state was built while it was not (the
        #: evidence that training went on without it: see
        #: ``_after_optimizer_step``).
        self._engaged = False
        self._optimizer_checked = False
        self._unengaged_by_optimizer: dict[int, int] = {}
        self._world: int | None = None
        self._warned = False
        #: The parameters of the model this state serves (id -> weak reference)
        #: and the bucket indices seen: a second model is refused (_check_one_model).
        self._params_seen: dict[int, Any] = {}
        self._indices_seen: set[int] = set()
        #: Built by the top level of the launching script as a spawned process
        #: re-imports it (multiprocessing's ``__mp_main__``): the launcher's own
        #: state reaches this process by pickling, and this module-level copy
        #: stays idle (see _check_engaged).
        self._spawned_copy = _built_by_spawned_main()
        _watch(self)

    def _ignore_optimizer(self, why: str, where: str, *, handed: bool = False) -> None:
        """Say once per state that an optimizer reached a codec that does not
        read it (``why``) and is ignored: a UserWarning when the user passed it
        (``optimizer=``), an INFO record of the ``hopq`` logger when a framework
        integration handed it over (``handed``: the user asked for nothing)."""
        if self._said_optimizer_unused:
            return
        self._said_optimizer_unused = True
        msg = f"{where}: {why}; the optimizer is ignored"
        if handed:
            logging.getLogger("hopq").info(msg)
        else:
            warnings.warn(msg, UserWarning, stacklevel=3)

    @property
    def _steps_unengaged(self) -> int:
        """The most steps one optimizer took while this state was never called."""
        return max(self._unengaged_by_optimizer.values(), default=0)

    # -- records ------------------------------------------------------------
    records_owner = "HookState"

    @property
    def error_optimizer(self) -> "torch.optim.Optimizer | None":
        """With ``measure_error``: the optimizer whose step sizes per coordinate
        (Adam: lr / (sqrt(v) + eps)) weigh the measured error too, giving the
        error of the update that optimizer makes (``hopq/update_vnmse``) beside
        the gradient's (``hopq/vnmse``). Any codec; None (the default): the
        hook's ``optimizer`` where it has one."""
        return self._error_optimizer

    @error_optimizer.setter
    def error_optimizer(self, optimizer: "torch.optim.Optimizer | None") -> None:
        if optimizer is not None:
            check_optimizer(optimizer)
        self._error_optimizer = optimizer

    def _weighs_error(self) -> "torch.optim.Optimizer | None":
        """The optimizer whose step sizes weigh the measured error, if any (one
        without a step-size rule is said in the hook's warning)."""
        return self._error_optimizer if self._error_optimizer is not None else self.optimizer

    def _record(self, info: RunStats, **errors: float) -> None:
        self._engaged = True  # any path that records a bucket uses the state
        super()._record(info, **errors)

    def pop_step(self) -> StepMetrics:
        """The buckets since the last ``pop_step()`` / :meth:`step_metrics`
        summed into one :class:`~hopq.StepMetrics` record, and popped (warns
        with :class:`hopq.HookNotEngagedWarning` when there is none after an
        optimizer step because the hook was never registered)."""
        out = super().pop_step()
        if out.buckets == 0 and self._steps_unengaged > 0:
            _check_engaged(self, "state.step_metrics() found no bucket after an optimizer step")
        return out

    def pop_error(self) -> tuple[float, float, float]:
        """(vNMSE over the buckets measured since the last pop, the same weighed
        by the optimizer's step sizes (``error_optimizer``), seconds of exact
        all-reduces and weighing); NaN for what was not measured."""
        nan = float("nan")
        with self._lock:
            v = self.err_sq / self.ref_sq if self.ref_sq > 0 else nan
            u = self.uerr_sq / self.uref_sq if self.uref_sq > 0 else nan
            out = (v, u, self.exact_seconds)
            self.err_sq = self.ref_sq = self.uerr_sq = self.uref_sq = 0.0
            self.exact_seconds = 0.0
        return out

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed job needs to continue bit for bit: the seed and the
        codec's state (round counter, adaptive parameters, DynamiQ's budget
        shares). A ``torch.distributed.checkpoint`` Stateful (``dcp.save({"hopq":
        state, ...})``): the codec's state is one opaque entry, because its
        structure grows during training and DCP loads only the keys a fresh
        state has; it is the same on every rank, so DCP keeps one copy.
        Counters that are each rank's own (MX's saturations since the last plan,
        THC's overflow tally) go under ``codec_local/<rank>``, one per rank.

        Returns:
            ``{"codec_name", "seed", "codec"}`` (the codec's shared state,
            packed as bytes) and, where the codec has rank-local counters,
            ``"codec_local"``.

        Example:
            ```python
            import torch.distributed.checkpoint as dcp

            dcp.save({"model": model.state_dict(), "hopq": state}, checkpoint_id=path)
            ```
        """
        return pack_codec_state(self.codec, self.seed, self._rank())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output (also the older form with the
        codec's state as a plain dict). Rank-local counters come from this
        rank's entry; when it is missing (a checkpoint that one rank saved for
        all), they keep their current values: the results stay correct and
        agreed, but are bit-identical to an uninterrupted run only for codecs
        without such counters.

        Args:
            state: What :meth:`state_dict` returned (on any rank).

        Raises:
            ValueError: The checkpoint holds another codec than this state runs.
            KeyError: ``state`` lacks ``"codec"`` or ``"seed"``.

        Example:
            ```python
            state = hopq.HookState(codec="dynamiq")
            to_load = {"model": model.state_dict(), "hopq": state}
            dcp.load(to_load, checkpoint_id=path)  # calls state.load_state_dict
            ```
        """
        self.seed = unpack_codec_state(self.codec, state, self._rank(), "HookState")

    def _rank(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.process_group)
        return 0

    def _check_one_model(self, index: int, params: list[torch.Tensor]) -> None:
        """Raise ValueError when a bucket's parameters belong to another model
        than the buckets before it (a bucket index seen before, none of its
        parameters known while the first model's are alive): one state keyed by
        bucket index would mix two models' budgets and statistics."""
        if not params:
            return
        seen = self._params_seen
        ref = seen.get(id(params[0]))
        if ref is not None and ref() is params[0]:
            return  # the model served so far (one look-up per bucket)
        alive = any(r() is not None for r in list(seen.values()))
        known = any((r := seen.get(id(p))) is not None and r() is p for p in params)
        if index in self._indices_seen and alive and not known:
            raise ValueError(
                "hopq: this HookState is registered on two DDP models (bucket "
                f"{index} came with parameters of another model than before): the "
                "codec keys its round, bit budget and statistics by bucket index, "
                "which the models would share. Make one HookState per model, e.g. "
                "ddp_g.register_comm_hook(hopq.HookState(...), hopq.ddp_hook) and "
                "ddp_d.register_comm_hook(hopq.HookState(...), hopq.ddp_hook)"
            )
        for p in params:
            seen[id(p)] = weakref.ref(p, _forget(seen, id(p)))
        self._indices_seen.add(index)

    def _world_size(self) -> int | None:
        """The group's size once known (remembered: the group may be gone at exit)."""
        if self._world is None and dist.is_available() and dist.is_initialized():
            try:
                self._world = dist.get_world_size(self.process_group)
            except (RuntimeError, ValueError):  # a group this rank is not part of
                return None
        return self._world

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
        d["_lock"] = d["_pool"] = d["_stream"] = d["_thread_group"] = None
        d["_params_seen"], d["_indices_seen"] = {}, set()  # the copy serves its own model
        if not isinstance(d.get("own_group"), (bool, type(None))):
            d["own_group"] = True  # a process group does not travel; the copy makes its own
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.__dict__.setdefault("own_group", None)  # a state pickled before own_group
        self.__dict__.setdefault("_optimizer_adopted", False)  # ... or before adoption
        self.__dict__.setdefault("_said_optimizer_unused", False)
        self.__dict__.setdefault("_params_seen", {})
        self.__dict__.setdefault("_indices_seen", set())
        self._spawned_copy = False  # the launcher's state itself, sent here
        self._lock = threading.Lock()
        self._world = None  # a copy sent to another process: its own group
        self._unengaged_by_optimizer = {}  # optimizers' ids do not travel
        if not self._engaged:
            _watch(self)


def thread_group(
    state: HookState, device: torch.device | None = None
) -> "dist.ProcessGroup | None":
    """The group the communication thread talks on: ``state.process_group``
    (None: the default group), the group given as ``own_group``, or one made
    here at the first call (see the module's docstring). ``device``: the
    buckets' device (which backend carries them decides the default)."""
    if state._thread_group is False:
        return state.process_group
    alive = state._thread_group() if state._thread_group is not None else None
    if alive is not None:
        return alive
    # the first call, or the group made before was destroyed: (re)decide
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("torch.distributed has no default process group")
    mine = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
    own = state.own_group
    if isinstance(own, dist.ProcessGroup):
        theirs = [dist.get_global_rank(own, r) for r in range(dist.get_world_size(own))]
        if theirs != mine:
            raise ValueError(
                f"HookState(own_group=...) holds global ranks {theirs} in that order, the DDP "
                f"group {mine}: the thread's group needs the same ranks in the same order"
            )
        state._thread_group = weakref.ref(own)
        return own
    whole = mine == list(range(dist.get_world_size()))
    if own is None:  # by default only where NCCL carries the buckets (module docstring)
        dev = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        own = whole and device_backend(group, dev.type) == "nccl"
    if not own:
        state._thread_group = False
        return state.process_group
    if not whole:
        raise ValueError(
            f"HookState(own_group=True) makes a group of every rank in order, but the DDP "
            f"group holds global ranks {mine}: make a second group of those ranks in that "
            "order (every rank calling dist.new_group, as torch asks) and pass it as own_group="
        )
    kw: dict[str, Any] = {}
    # the group's own timeout, as hopq's transport reads it (torch's default where
    # this torch does not expose it)
    with contextlib.suppress(Exception):
        kw["timeout"] = group_timeout(group, carrier(group))
    # every rank is a member and comes here at its first bucket: a plain
    # new_group, named by torch's counter like every group the program made
    made_group = dist.new_group(backend=dist.get_backend_config(group), **kw)
    state._thread_group = weakref.ref(made_group)
    return made_group


def _reduce(
    state: HookState,
    buf: torch.Tensor,
    index: int,
    group: Any,
    params: list[torch.Tensor] | None = None,
) -> None:
    """One bucket's all-reduce over ``group`` (and, when asked, its exact
    reference); with ``params``, the optimizer's state for them first (the
    codec's ``use_optimizer``), counted as codec work."""
    t_thr = c_thr = 0.0
    # the bucket index names the bucket from step to step (DynamiQ shares the
    # step's bit budget across buckets by it)
    codec, topology, layout = state.codec, state.topology, state.layout
    if state.auto is not None:  # codec="auto": this bucket's plan (docs/plan.md)
        codec, topology, layout = state.auto.pick(buf, group, index)
    hand = params is not None and state.optimizer is not None
    if hand and state.auto is not None:  # the planned codec's, where it reads one
        hand = not reads_no_optimizer(codec)
        if hand:
            try:
                check_takes_optimizer(codec, state.optimizer)
            except ValueError as why:
                state._ignore_optimizer(str(why), f"HookState(codec='auto') planned {codec.name!r}")
                hand = False
    if hand:
        t0, c0 = time.perf_counter(), time.thread_time()
        codec.use_optimizer(state.optimizer, params, index, buf.device)  # type: ignore[attr-defined]
        t_thr, c_thr = time.perf_counter() - t0, time.thread_time() - c0
    exact = r = None
    uniform = False  # SGD with one learning rate: the update's error is the gradient's
    if state.measure_error:
        t0 = time.perf_counter()
        exact = buf.detach().to(torch.float64)
        dist.all_reduce(exact, group=group)
        exact /= dist.get_world_size(group)
        weigh = state._weighs_error()
        if weigh is not None and params is not None:
            try:
                r = step_sizes(weigh, params)  # None before the optimizer's first step
            except ValueError as why:  # parameters in another optimizer, or no rule for it
                if not state._warned_weigh:
                    state._warned_weigh = True
                    warnings.warn(
                        f"hopq: the update's error (hopq/update_vnmse) is not measured: {why}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            else:
                uniform = r is None and isinstance(weigh, torch.optim.SGD)
        with state._lock:
            state.exact_seconds += time.perf_counter() - t0
    if state.auto is not None and state.auto.is_native(index):
        info = torch_all_reduce(buf, codec.name, group, state.timeout)
    else:
        info = all_reduce(
            buf, codec, topology, "avg", group, state.seed, index,
            timeout=state.timeout, gather_codec=state.gather_codec, layout=layout,
            intra_codec=state.intra_codec,
        )  # fmt: skip
    if state.auto is not None:
        state.auto.observe(index, info.seconds)
    info.seconds += t_thr  # codec work: seconds - comm_seconds
    info.cpu_seconds += c_thr
    err = ref = uerr = uref = 0.0
    if exact is not None:
        t0 = time.perf_counter()
        e = buf.to(torch.float64) - exact
        err = float(e.square().sum())
        ref = float(exact.square().sum())
        if r is not None:
            r64 = r.to(torch.float64)
            uerr = float(e.mul_(r64).square().sum())
            uref = float((exact * r64).square().sum())
        elif uniform:
            uerr, uref = err, ref
        with state._lock:
            state.err_sq += err
            state.ref_sq += ref
            state.uerr_sq += uerr
            state.uref_sq += uref
            state.exact_seconds += time.perf_counter() - t0
    state._record(info, err_sq=err, ref_sq=ref, uerr_sq=uerr, uref_sq=uref)


#: The dtype torch's own all-reduce of an uncompressed plan runs in.
_NATIVE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_all_reduce(
    buf: torch.Tensor, codec: str, group: Any, timeout: float | None = None
) -> RunStats:
    """Average ``buf`` over ``group`` with torch's own all-reduce in the dtype
    of the uncompressed codec ``codec`` ("fp32": DDP's default; "fp16", "bf16":
    as ``fp16_compress_hook`` and ``bf16_compress_hook``, which sum in that
    dtype), in place, waiting at most ``timeout`` seconds (None: the group's
    own timeout); this rank's stats (the bytes of a ring; on CUDA the time
    until the result is on the device)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    n = dist.get_world_size(group)
    dtype = _NATIVE_DTYPES[codec]
    wire = buf if buf.dtype == dtype else buf.to(dtype)
    wire.div_(n)
    work = dist.all_reduce(wire, group=group, async_op=True)
    if timeout is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout))
    if wire is not buf:
        buf.copy_(wire)
    if buf.is_cuda:  # the clock stops when the result is there
        torch.cuda.current_stream(buf.device).synchronize()
    seconds = time.perf_counter() - t0
    chunk = -(-buf.numel() // n)
    return RunStats(
        rank=dist.get_rank(group), world_size=n, numel=buf.numel(),
        payload_bytes=2 * (n - 1) * chunk * wire.element_size(), hops_per_chunk=n - 1,
        seconds=seconds, comm_seconds=seconds, cpu_seconds=time.thread_time() - c0,
    )  # fmt: skip


def _run(
    state: HookState,
    buf: torch.Tensor,
    index: int,
    fut: "torch.futures.Future[torch.Tensor]",
    ready: Any,
    group: Any,
    params: list[torch.Tensor] | None = None,
) -> None:
    """On the communication thread: reduce, then complete (or fail) the future."""
    try:
        if ready is None:
            _reduce(state, buf, index, group, params)
            fut.set_result(buf)
            return
        if state._stream is None:
            state._stream = torch.cuda.Stream(device=buf.device)
        stream = state._stream
        stream.wait_event(ready)  # the bucket's gradients are written
        # the thread's current device is the bucket's (a new thread starts on
        # cuda:0): messages staged to "the current device" go where NCCL wants them
        with torch.cuda.device(buf.device), torch.cuda.stream(stream):
            buf.record_stream(stream)
            _reduce(state, buf, index, group, params)
            fut.set_result(buf)  # the future records this stream's work
    except BaseException as e:  # noqa: BLE001 - every failure reaches the training step
        fut.set_exception(e)  # type: ignore[arg-type]  # torch's stub types it as the value


def ddp_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients over the group with hopq's compressed all-reduce.

    DDP calls it once per gradient bucket during the backward pass; register it
    with ``ddp_model.register_comm_hook(state, hopq.ddp_hook)``. The bucket's
    index is the call's ``key``, so DynamiQ can share a step's bit budget
    across buckets. A codec that reads the optimizer gets its state for the
    bucket's parameters first.

    Args:
        state: The :class:`HookState` holding the codec, topology and
            statistics.
        bucket: DDP's gradient bucket; its buffer is averaged in place.

    Returns:
        A future of the averaged buffer: pending (``state.overlap``, the
        default), completed by the communication thread, or already completed.

    Raises:
        RuntimeError: With ``overlap`` (the default), any error of the
            all-reduce (a :class:`hopq.MismatchError`,
            :class:`hopq.TransportError`, ...) reaches the training step's
            backward pass as a RuntimeError whose message starts with
            ``hopq.ddp_hook:`` and the original error's name. With
            ``overlap=False`` the hook raises the original error itself (the
            errors of :func:`hopq.all_reduce`).
        ValueError: ``state`` already serves another DDP model whose
            parameters are alive (one HookState per model: the codec keys its
            round, budget and statistics by bucket index).

    Example:
        ```python
        state = hopq.HookState(codec="dynamiq")
        ddp_model.register_comm_hook(state, hopq.ddp_hook)
        ```
    """
    buf = bucket.buffer()
    bucket_params = list(bucket.parameters())
    state._check_one_model(bucket.index(), bucket_params)
    if not state._optimizer_checked:  # the first bucket: the optimizer is set by now if ever
        state._optimizer_checked = True
        why = missing_optimizer(state.codec, state.optimizer, "HookState")
        if why:
            warnings.warn(why, UserWarning, stacklevel=2)
    state._engaged = True
    _ENGAGED_HERE[0] = True
    # the optimizer's state is read with the bucket's reduction (on the
    # thread, as codec work): its state and the parameters do not change before
    # the backward pass ends, which waits for every bucket's future
    weighs = state.measure_error and state._weighs_error() is not None
    params = bucket_params if state.optimizer is not None or weighs else None
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buf.device] if buf.is_cuda else None
    )
    if not state.overlap:
        _reduce(state, buf, bucket.index(), state.process_group, params)
        fut.set_result(buf)
        return fut
    group = thread_group(state, buf.device)
    ready = None
    if buf.is_cuda:
        ready = torch.cuda.Event()
        ready.record()  # on the stream that wrote the bucket
    state._executor().submit(_run, state, buf, bucket.index(), fut, ready, group, params)
    # DDP reads the future's value in C++, where an exception set from Python
    # would arrive as "Unable to cast ... to Tensor"; a callback that raises
    # marks the chained future as failed with the error's own words
    return fut.then(_unwrap)


def _forget(seen: dict[int, Any], key: int) -> Any:
    def drop(_ref: Any) -> None:
        seen.pop(key, None)

    return drop


def _built_by_spawned_main() -> bool:
    """Whether the caller runs in a process that multiprocessing spawned, as it
    re-imports the launching script under ``__mp_main__`` (Lightning's
    ``start_method="spawn"``, ``torch.multiprocessing.spawn``): the script's
    module-level code builds its objects again there."""
    if "__mp_main__" not in sys.modules:
        return False
    f: Any = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "<module>" and f.f_globals.get("__name__") == "__mp_main__":
            return True
        f = f.f_back
    return False


def _unwrap(fut: "torch.futures.Future[torch.Tensor]") -> torch.Tensor:
    try:
        return fut.value()
    except Exception as e:
        raise RuntimeError(f"hopq.ddp_hook: {type(e).__name__}: {e}") from e


# -- "is the hook engaged?" ------------------------------------------------------
# A HookState handed to a framework that never registers it (Lightning's
# DDPStrategy on CPU, Accelerate's DistributedDataParallelKwargs(comm_hook=...))
# leaves training running on the framework's own all-reduce, silently. The
# evidence that training went on without the hook is optimizer steps: every
# torch optimizer runs the global step post-hook below. A state warns once, when
# it was never called and its group has several ranks, after UNENGAGED_STEPS
# steps of one optimizer in this process since it was built, when
# ``step_metrics()`` finds no bucket after an optimizer step, or at exit after
# any. A state built without training (tests, a single process, a group of one)
# never warns.
#
# Steps are counted per optimizer, not in total: a process may train several
# models in turn, each with its own optimizer and hook (``hopq train`` trains 14
# contenders step by step, a GAN its generator and critic), and a model whose
# turn comes late would otherwise see the others' steps before its own first
# backward and warn although its hook is registered.

#: Steps of one optimizer without a call after which a state warns. Not 1: a
#: state may be built before other models train in the same process (a GAN's
#: critic steps several times before the generator's first backward).
UNENGAGED_STEPS = 10

#: States not yet called nor warned about (weak: a dropped state is forgotten).
_WATCHED: "weakref.WeakSet[HookState]" = weakref.WeakSet()
_STEP_HOOK: Any = None
_AT_EXIT = False
_WATCH_LOCK = threading.Lock()
#: Whether any state's hook ran in this process (a spawned copy of the
#: launching script's state stays silent then: the launcher's own state, sent to
#: this process, is the one that served).
_ENGAGED_HERE = [False]


def _watch(state: HookState) -> None:
    global _STEP_HOOK, _AT_EXIT
    with _WATCH_LOCK:
        _WATCHED.add(state)
        if _STEP_HOOK is None:
            _STEP_HOOK = register_optimizer_step_post_hook(_after_optimizer_step)
        if not _AT_EXIT:
            atexit.register(_at_exit)
            _AT_EXIT = True


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    # stays installed once there is nothing to watch (removing it here would
    # change the dict torch is iterating over): an empty set costs nothing
    with _WATCH_LOCK:
        states = list(_WATCHED)
    for state in states:
        if state._engaged or state._warned:
            _WATCHED.discard(state)
            continue
        counts = state._unengaged_by_optimizer
        counts[id(optimizer)] = k = counts.get(id(optimizer), 0) + 1
        state._world_size()  # remembered while the group exists
        if k >= UNENGAGED_STEPS:
            _check_engaged(state, f"after {k} steps of one optimizer")


def _at_exit() -> None:
    for state in list(_WATCHED):
        if state._steps_unengaged > 0:
            _check_engaged(state, "at the end of the program, after optimizer steps")


def _check_engaged(state: HookState, when: str) -> None:
    """Warn (once) if this state was never called and its group has several ranks."""
    if state._engaged or state._warned:
        return
    if state._spawned_copy and _ENGAGED_HERE[0]:
        return
    world = state._world_size()
    if world is None or world <= 1:
        return
    state._warned = True
    _WATCHED.discard(state)
    warnings.warn(not_engaged_message(state, world, when), HookNotEngagedWarning, stacklevel=2)


def not_engaged_message(state: HookState, world: int, when: str) -> str:
    import sys

    hints = []
    if "lightning" in sys.modules or "pytorch_lightning" in sys.modules:
        hints.append(
            "Lightning's DDPStrategy(ddp_comm_hook=...) registers hooks only on CUDA devices "
            "and Fabric's passes them to DDP as an unknown argument: use "
            "hopq.integrations.lightning.HopqDDPStrategy(state) or "
            "hopq.integrations.fabric.HopqDDPStrategy(state)"
        )
    if "accelerate" in sys.modules:
        hints.append(
            "Accelerate ignores DistributedDataParallelKwargs(comm_hook=<a function>) (it takes "
            "only its built-in hooks): call hopq.integrations.accelerate.register_hook("
            "accelerator, model, state) after accelerator.prepare"
        )
    if "transformers" in sys.modules:
        hints.append(
            "the HF Trainer has no hook option: hopq.integrations.transformers.attach("
            "trainer, state) registers it when training begins"
        )
    if "ray.train" in sys.modules:
        hints.append(
            "Ray Train's ray.train.torch.prepare_model takes no hook: use "
            "hopq.integrations.ray.prepare_model(model, state) in the training function"
        )
    hint = "; ".join(hints)
    return (
        f"hopq: the DDP hook of HookState(codec={state.codec.name!r}) is not engaged: it was "
        f"never called ({when}) on a group of {world} ranks, so the gradients are averaged "
        "without hopq (by DDP's own uncompressed all-reduce, or not at all). Register it on "
        "the DDP-wrapped model: ddp_model.register_comm_hook(state, hopq.ddp_hook)"
        + (f"; {hint}" if hint else "")
        + ". See docs/integrations/frameworks.md."
    )


def adopt_optimizer(state: HookState, optimizers: Any, where: str) -> None:
    """For frameworks that make the optimizer after the hook's state (Lightning,
    Fabric, Accelerate, the HF Trainer): hand ``state`` the optimizer when its
    codec reads one (GComp's thresholds, DynamiQ's step sizes) and none was
    given, or replace the one it handed over before (a second ``fit`` or
    ``train()`` makes a new optimizer). ``optimizers``: the framework's,
    wrappers allowed (their ``.optimizer``). Where that cannot be decided
    (several optimizers, or one the codec has no rule for) it warns and the
    codec works without one."""
    why = None if state.auto is not None else optimizer_unused(state.codec)
    if why is not None:
        if reads_no_optimizer(state.codec) and any(o is not None for o in optimizers):
            state._ignore_optimizer(why, where, handed=True)
        return
    if state.optimizer is not None and not state._optimizer_adopted:
        return  # the user's
    opts = [getattr(o, "optimizer", o) for o in optimizers]
    opts = [o for o in opts if isinstance(o, torch.optim.Optimizer)]
    name = state.codec.name
    state.optimizer, state._optimizer_adopted = None, False  # none stale
    if len(opts) != 1:
        warnings.warn(
            f"{where}: {len(opts)} optimizers, so hopq cannot tell which steps the DDP model; "
            f"codec {name!r} works without one: pass HookState(optimizer=...)",
            UserWarning,
            stacklevel=3,
        )
        return
    try:
        if state.auto is None:  # codec="auto": checked against each planned codec
            check_takes_optimizer(state.codec, opts[0])
    except ValueError as e:
        warnings.warn(f"{where}: {e}; {name!r} works without it", UserWarning, stacklevel=3)
        return
    state.optimizer, state._optimizer_adopted = opts[0], True


def check_same_group(model: Any, state: HookState) -> None:
    """Raise ValueError when a DDP model averages over another group than the
    hook's ``state.process_group`` (None: the default group): the hook would
    reduce over its own group, and DDP's ``process_group`` would do nothing.
    The integrations call it before they register the hook."""
    theirs = getattr(model, "process_group", None)
    if theirs is None or not dist.is_initialized():
        return
    mine = state.process_group if state.process_group is not None else dist.group.WORLD
    if mine is theirs:
        return
    a, b = dist.get_process_group_ranks(mine), dist.get_process_group_ranks(theirs)
    if sorted(a) != sorted(b):
        raise ValueError(
            f"the DDP model averages over ranks {sorted(b)}, hopq's hook over ranks "
            f"{sorted(a)}: pass the model's group to HookState(process_group=...)"
        )
