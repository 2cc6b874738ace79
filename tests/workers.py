"""Worker bodies for the multi-process tests (imported by spawned ranks)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

import hopq
from hopq.comm.topology import TOPOLOGIES

SIZES = (0, 1, 7, 1000003)


def in_grid(codec: str, kind: str, size: int) -> bool:
    """Whether the grid calls ``codec`` on ``kind`` input of ``size``: float input
    at every size; small integers at the small sizes, and at the large one for
    fp32 alone, which must then give dist.all_reduce's result bit for bit (the
    other codecs' large calls, on float input, already check the simulator's bits)."""
    return kind == "float" or size < SIZES[-1] or codec == "fp32"


def make_input(kind: str, rank: int, size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Deterministic per-rank inputs: small integers (exact in every wire dtype
    when summed over <= 4 ranks) or normal floats."""
    g = torch.Generator().manual_seed(1000 * rank + size + (7 if kind == "float" else 0))
    if kind == "int":
        return torch.randint(-8, 9, (size,), generator=g).to(dtype)
    return torch.randn(size, generator=g).to(dtype)


#: (key, size, scale) of the keyed calls of one "step" (DDP-bucket-like tensors).
KEYED = ((0, 3000, 1.0), (1, 20000, 1e-3), (2, 7001, 0.1))


def keyed_input(rank: int, step: int, size: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(97 * rank + 13 * step + size)
    return torch.randn(size, generator=g) * scale


def grid(rank: int, n: int, codecs: list[str]) -> dict[Any, Any]:
    """Every codec x topology x size x input kind, plus the checks that need a group."""
    out: dict[Any, Any] = {}
    for size in SIZES:
        for kind in ("int", "float"):
            ref = make_input(kind, rank, size)
            dist.all_reduce(ref)
            out[("dist", kind, size)] = ref
            for codec in (c for c in codecs if in_grid(c, kind, size)):
                for topo in TOPOLOGIES:
                    x = make_input(kind, rank, size)
                    info = hopq.all_reduce(x, codec=codec, topology=topo, seed=3)
                    out[(codec, topo, kind, size)] = x
                    out[("bits", codec, topo, kind, size)] = info.bytes_sent
    # avg, in the input dtype; non-contiguous input handled in place
    for topo in TOPOLOGIES:
        x = make_input("float", rank, 4 * 37)
        hopq.all_reduce(x, codec="fp32", topology=topo, op="avg")
        out[("avg", topo)] = x
        y = make_input("float", rank, 6 * 5).view(6, 5).t()  # non-contiguous
        assert not y.is_contiguous()
        hopq.all_reduce(y, codec="fp32", topology=topo)
        out[("noncontig", topo)] = y
        for dt in (torch.bfloat16, torch.float16):
            z = make_input("int", rank, 101, dt)
            hopq.all_reduce(z, codec="fp32", topology=topo)
            out[("dtype", str(dt), topo)] = z
        x = make_input("float", rank, 1000)
        out[("rs", topo)] = hopq.reduce_scatter(
            x.clone(), codec="bf16", topology=topo, shards="topology"
        )
        out[("rs_default", topo)] = hopq.reduce_scatter(x.clone(), codec="dynamiq", topology=topo)
        hopq.all_reduce(x, codec="bf16", topology=topo)
        out[("rs_full", topo)] = x
    # keyed calls over two steps through one codec instance (DynamiQ shares the
    # second step's budget across the keys)
    for topo in TOPOLOGIES:
        codec = hopq.get_codec("dynamiq")
        for step in range(2):
            for key, size, scale in KEYED:
                x = keyed_input(rank, step, size, scale)
                info = hopq.all_reduce(x, codec=codec, topology=topo, seed=5, key=key)
                out[("keyed", topo, step, key)] = x
                out[("keyed_bytes", topo, step, key)] = info.bytes_sent
    # NaN and Inf keep their place on every real rank
    for codec in codecs:
        x = make_input("float", rank, 4 * 256)
        if rank == n - 1:
            x[300] = float("nan")
            x[700] = float("inf")
        hopq.all_reduce(x, codec=codec, topology="butterfly", seed=3)
        out[("nonfinite", codec)] = x
    # microshards and pipelining in real runs: many small microshards, the same
    # bits as the simulator's single-message plan
    from hopq.comm import engine

    saved = engine.MICROSHARD_COORDS, engine.DIRECT_STATS_BYTES
    engine.MICROSHARD_COORDS = 1500
    # statistics of 20011 coordinates take the direct reduce-scatter here: the
    # simulator's all-gather gives the same bits (compared in test_grid)
    engine.DIRECT_STATS_BYTES = 64
    try:
        for codec in codecs:
            for topo in TOPOLOGIES:
                x = make_input("float", rank, 20011)
                info = hopq.all_reduce(x, codec=codec, topology=topo, seed=6)
                out[("micro", codec, topo)] = x
                out[("micro_u", codec, topo)] = info.microshards
    finally:
        engine.MICROSHARD_COORDS, engine.DIRECT_STATS_BYTES = saved
    # bad dtypes are refused before anything is sent: the group stays usable
    refused = []
    for bad in (
        torch.arange(5),
        torch.zeros(3, dtype=torch.complex64),
        torch.zeros(2, dtype=torch.bool),
    ):
        try:
            hopq.all_reduce(bad)
        except TypeError:
            refused.append(str(bad.dtype))
    out["refused"] = refused
    x = torch.full((10,), float(rank + 1))
    hopq.all_reduce(x, codec="fp32")
    out["after_refusal"] = x
    return out


def resume(rank: int, n: int, codecs: list[str]) -> dict[str, Any]:
    """Per codec: four keyed calls straight through, and the same four calls by a
    fresh codec that loaded this rank's state after the second: equal bit for bit."""
    import copy

    out: dict[str, Any] = {}
    for name in codecs:
        for topo in TOPOLOGIES:
            straight = hopq.get_codec(name)
            ys, saved = [], None
            for step in range(4):
                if step == 2:
                    saved = copy.deepcopy(straight.state_dict())
                for key, size, scale in KEYED:
                    x = keyed_input(rank, step, size, scale)
                    hopq.all_reduce(x, codec=straight, topology=topo, seed=8, key=key)
                    ys.append(x)
            resumed = hopq.get_codec(name)
            resumed.load_state_dict(saved)
            zs = []
            for step in range(2, 4):
                for key, size, scale in KEYED:
                    x = keyed_input(rank, step, size, scale)
                    hopq.all_reduce(x, codec=resumed, topology=topo, seed=8, key=key)
                    zs.append(x)
            out[(name, topo)] = all(
                torch.equal(a.view(torch.int32), b.view(torch.int32))
                for a, b in zip(ys[2 * len(KEYED) :], zs, strict=True)
            )
    return out


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def tiny_steps(ddp: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> None:
    """``steps`` training steps of TinyNet's regression on this rank's own data."""
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        y = torch.randn(32, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def ddp_train(
    rank: int, n: int, codecs: list[str | None], steps: int, overlap: bool = True
) -> dict[str, Any]:
    """Train TinyNet with plain DDP (None) or the hopq hook for each codec."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {}
    for codec in codecs:
        torch.manual_seed(0)
        model = TinyNet()
        # small buckets so that the hook sees several of them
        ddp = DDP(model, bucket_cap_mb=0.01)
        state = None
        if codec is not None:
            state = hopq.HookState(
                codec=codec, topology="butterfly" if n == 3 else "ring", overlap=overlap
            )
            ddp.register_comm_hook(state, hopq.ddp_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        tiny_steps(ddp, opt, rank, steps)
        out[str(codec)] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if state is not None:
            out[f"{codec}/calls"] = state.codec.round
            out[f"{codec}/order"] = [c.numel for c in state.pop_stats()]
    return out


def ddp_update_error(rank: int, n: int) -> dict[str, Any]:
    """The hook's measured errors (``measure_error``) against the same computed
    here from this rank's gradient and an exact all-reduce: the gradient's
    vNMSE and the update's (weighed by the optimizer's step sizes), for a codec
    that reads the optimizer (DynamiQ), one that does not (MXFP4, through
    ``error_optimizer``) and SGD (one learning rate: the update's error is the
    gradient's)."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from hopq.codecs.dynamiq.optim import step_sizes

    out: dict[str, Any] = {}
    variants = (
        ("adamw/mxfp4", "mxfp4", torch.optim.AdamW),
        ("adamw/dynamiq", "dynamiq", torch.optim.AdamW),
        ("sgd/mxfp4", "mxfp4", torch.optim.SGD),
    )
    mse = torch.nn.functional.mse_loss
    for name, codec, opt_cls in variants:
        torch.manual_seed(0)
        model = TinyNet()
        params = list(model.parameters())
        ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets
        opt = opt_cls(ddp.parameters(), lr=1e-2)
        state = hopq.HookState(codec=codec, optimizer=opt if codec == "dynamiq" else None)
        if codec != "dynamiq":
            state.error_optimizer = opt
        ddp.register_comm_hook(state, hopq.ddp_hook)
        state.measure_error = True  # the first step: AdamW has no step sizes yet
        tiny_steps(ddp, opt, rank, 1)
        out[f"{name}/first"] = state.pop_error()[:2]
        out[f"{name}/first metrics"] = state.step_metrics()
        state.measure_error = False
        tiny_steps(ddp, opt, rank, 2)
        g = torch.Generator().manual_seed(100 + rank)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        twin = copy.deepcopy(model)  # this rank's own gradient, without DDP
        mse(twin(x), y).backward()
        exact = torch.cat([p.grad.reshape(-1) for p in twin.parameters()]).double()  # type: ignore[union-attr]
        dist.all_reduce(exact)
        exact /= n
        r = step_sizes(opt, params)
        opt.zero_grad()
        state.measure_error = True
        mse(ddp(x), y).backward()
        got = torch.cat([p.grad.reshape(-1) for p in params]).double()  # type: ignore[union-attr]
        e = got - exact
        w = torch.ones_like(e) if r is None else r.double()
        out[name] = state.pop_error()[:2]
        out[f"{name}/want"] = (
            float(e.square().sum() / exact.square().sum()),
            float((e * w).square().sum() / (exact * w).square().sum()),
        )
        out[f"{name}/metrics"] = state.step_metrics()
        out[f"{name}/uniform"] = r is None
    # an error optimizer that holds only some of the parameters (a model with two
    # optimizers): a warning, no update error, and training goes on
    torch.manual_seed(0)
    model = TinyNet()
    ddp = DDP(model, bucket_cap_mb=0.01)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    state = hopq.HookState(codec="bf16")
    state.error_optimizer = torch.optim.AdamW(list(model.parameters())[:1], lr=1e-2)
    ddp.register_comm_hook(state, hopq.ddp_hook)
    tiny_steps(ddp, opt, rank, 1)
    state.measure_error = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_steps(ddp, opt, rank, 2)
    out["partial"] = state.pop_error()[:2]
    out["partial/warnings"] = [str(w.message) for w in caught]
    return out


class WithUnused(TinyNet):
    """TinyNet with a layer that takes no gradient: DDP with
    ``find_unused_parameters=True`` then runs collectives of its own in the
    backward pass, beside the hook's traffic."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(64, 64)


def ddp_own_group(rank: int, n: int, steps: int) -> dict[str, Any]:
    """The hook's thread on a group of its own, on the DDP group, and no thread,
    with DDP's own collectives in the backward pass: parameters and which group
    the thread talked on."""
    import pickle

    from torch.nn.parallel import DistributedDataParallel as DDP

    from hopq.integrations.ddp import thread_group

    out: dict[str, Any] = {}
    given = dist.new_group()  # every rank makes it, as torch asks
    for mode, kw in (
        ("sync", {"overlap": False}),
        ("shared", {"own_group": False}),
        ("auto", {}),
        ("own", {"own_group": True}),
        ("given", {"own_group": given}),
    ):
        torch.manual_seed(0)
        model = WithUnused()
        ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True)
        state = hopq.HookState(codec="dynamiq", **kw)
        state.measure_error = mode == "own"  # the exact all-reduce goes there too
        ddp.register_comm_hook(state, hopq.ddp_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x = torch.randn(32, 16, generator=g)
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
        out[mode] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        grp = thread_group(state) if state.overlap else None
        out[f"{mode}/group"] = (
            None if grp is None else (grp is dist.group.WORLD, dist.get_process_group_ranks(grp))
        )
        out[f"{mode}/calls"] = len(state.pop_stats())
        out[f"{mode}/err"] = state.err_sq
        out[f"{mode}/given"] = grp is given
        state.close()
    # refusals: a thread's group of other ranks, or own_group=True on a subgroup
    backwards = dist.new_group([1, 0], sort_ranks=False)
    sub = dist.new_group([0])
    errors = []
    for kw in ({"own_group": backwards}, {"process_group": sub, "own_group": True}):
        if "process_group" in kw and rank != 0:
            continue
        try:
            thread_group(hopq.HookState(codec="bf16", **kw))
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    # a pickled state's copy makes its own group (a group does not travel)
    out["pickled"] = pickle.loads(pickle.dumps(hopq.HookState(own_group=given))).own_group
    return out


def ddp_failure(rank: int, n: int) -> dict[str, Any]:
    """The overlapped hook with a codec that breaks its size contract on rank 0:
    the error reaches backward() on every rank, nothing hangs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(TinyNet(), bucket_cap_mb=0.01)
    state = hopq.HookState(codec=ShortPayloads(), timeout=20.0)
    ddp.register_comm_hook(state, hopq.ddp_hook)
    x = torch.randn(8, 16)
    try:
        ddp(x).square().mean().backward()
        return {"raised": None}
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "msg": str(e)}


class ShortPayloads(hopq.get_codec("bf16").__class__):  # type: ignore[misc]
    """bf16 whose encode on rank 0 drops (or adds) a byte: a codec bug that the
    sender's size check must catch before anything mis-sized leaves."""

    extra = -1

    def encode(self, plan, chunk, ctx):  # type: ignore[no-untyped-def]
        out = super().encode(plan, chunk, ctx)
        if ctx.rank == 0:
            return out[:-1] if self.extra < 0 else torch.cat([out, out[:1]])
        return out


def wrong_sizes(rank: int, n: int) -> dict[str, Any]:
    """A codec that lies about sizes on rank 0, then a framed message with a short
    body sent by hand: every rank raises, nothing aborts, no stale bytes are read."""
    import time

    from hopq.comm import framing
    from hopq.comm.framing import Deadline, Where
    from hopq.comm.transport import DistTransport

    out: dict[str, Any] = {}
    for extra in (-1, 1):
        codec = ShortPayloads()
        codec.extra = extra
        x = make_input("float", rank, 4000)
        try:
            hopq.all_reduce(x, codec=codec, timeout=20.0)
            out[f"liar{extra}"] = "returned"
        except Exception as e:  # noqa: BLE001
            out[f"liar{extra}"] = type(e).__name__
            out[f"liar{extra}/msg"] = str(e)
    # a hand-made short message: rank 0 says 10 bytes where rank 1 expects 20
    t = DistTransport()
    where = Where("hand-made", 99, 0)
    if rank == 0:
        header = framing.frame(where, [10])
        msg = framing.pack(header, torch.ones(10, dtype=torch.uint8), 20)
        s, _ = t.post([(1, p) for p in msg], [])
        for h in s:
            h.wait(Deadline(20), where)
    elif rank == 1:
        bufs = [torch.full((nb,), 7, dtype=torch.uint8) for nb in framing.expect(1, 20)]
        _, r = t.post([], [(0, b) for b in bufs])
        for h in r:
            h.wait(Deadline(20), where)
        head, _body = framing.unpack(bufs, 1, 20)
        try:
            framing.check(head, where, 0, 1, [20], exact=True)
            out["short"] = "accepted"
        except hopq.TransportError as e:
            out["short"] = str(e)
    time.sleep(0.2)
    return out


def aborts_at_exit(rank: int, n: int) -> int:
    """Returns, then dies with SIGABRT while the interpreter exits (what a Gloo
    teardown fault looks like from the launcher)."""
    import atexit
    import os

    atexit.register(os.abort)
    return rank


def group_freed_on_destroy(rank: int, n: int) -> bool:
    """Communicates through hopq, destroys the group, and says whether the group
    object is gone (nothing in hopq keeps it, and Gloo's threads, alive)."""
    import gc
    import weakref

    x = torch.ones(4096)
    hopq.all_reduce(x, "bf16", "ring")
    ref = weakref.ref(dist.group.WORLD)
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    return ref() is None


def ddp_group_freed_on_destroy(rank: int, n: int, tmp: str) -> dict[str, Any]:
    """Trains a step of DDP with the hopq hook, destroys the group and says
    whether it is gone. Then does it again in a second group after
    ``torch.distributed.nn.functional`` was imported anew while that group lived
    (what an import after ``init_process_group`` does): destroying does not free
    it, hopq's exit handler does."""
    import gc
    import importlib
    import os
    import weakref

    import torch.distributed.nn.functional as functional

    from hopq.comm import shutdown

    out: dict[str, Any] = {}
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    model.register_comm_hook(hopq.HookState(codec="bf16"), hopq.ddp_hook)
    model(torch.randn(2, 8)).sum().backward()
    del model
    ref = weakref.ref(dist.group.WORLD)
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    out["ddp"] = ref() is None
    store = dist.FileStore(os.path.join(tmp, "again"), n)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n)
    importlib.reload(functional)
    hopq.all_reduce(torch.ones(64), "bf16", "ring")
    ref = weakref.ref(dist.group.WORLD)
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    out["held by the defaults"] = ref() is not None
    shutdown.at_exit()
    out["released at exit"] = ref() is None
    return out


def plan_fails_everywhere(rank: int, n: int) -> dict[str, Any]:
    """Every rank's plan raises: the error surfaces, no posted message is left
    behind, and the next call on the group is correct."""
    from hopq.codecs.registry import get_codec

    codec = get_codec("dynamiq")
    planned = codec.plan

    def refuse(x: torch.Tensor, stats: Any) -> Any:
        raise ValueError("this plan refuses")

    codec.plan = refuse  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    x = make_input("float", rank, 4000)
    try:
        hopq.all_reduce(x.clone(), codec=codec, timeout=20.0)
        out["failed"] = "returned"
    except Exception as e:  # noqa: BLE001
        out["failed"] = f"{type(e).__name__}: {e}"
    codec.plan = planned  # type: ignore[method-assign]
    y = x.clone()
    hopq.all_reduce(y, codec=codec, timeout=20.0)
    out["after"] = y
    return out


def plan_fails_on_one_rank(rank: int, n: int) -> dict[str, Any]:
    """Rank 1's plan raises, for DynamiQ (whose agreement rides with its
    statistics) and for bf16 on a signature agreed before (its peers skip the
    round): what every rank raised and in how many seconds, then the next
    call's result."""
    import time

    from hopq.codecs.registry import get_codec

    out: dict[str, Any] = {}
    for name in ("dynamiq", "bf16"):
        codec = get_codec(name)
        x = make_input("float", rank, 4000)
        hopq.all_reduce(x.clone(), codec=codec, timeout=20.0)  # the signature is agreed
        planned = codec.plan
        if rank == 1:

            def refuse(x: torch.Tensor, stats: Any) -> Any:
                raise ValueError("this plan refuses")

            codec.plan = refuse  # type: ignore[method-assign]
        t = time.monotonic()
        try:
            hopq.all_reduce(x.clone(), codec=codec, timeout=20.0)
            out[name] = ("returned", time.monotonic() - t)
        except Exception as e:  # noqa: BLE001
            out[name] = (f"{type(e).__name__}: {e}", time.monotonic() - t)
        codec.plan = planned  # type: ignore[method-assign]
        y = x.clone()
        hopq.all_reduce(y, codec=codec, timeout=20.0)
        out[(name, "after")] = y
    return out


def straggler(rank: int, n: int, late_s: float) -> dict[str, Any]:
    """Rank n - 1 calls ``late_s`` seconds after the others; every call takes the
    default timeout (None: the process group's own). Returns what each saw."""
    import time

    from hopq.comm.collectives import _transport

    out: dict[str, Any] = {"timeout_s": _transport(None).timeout_s}
    if rank == n - 1:
        time.sleep(late_s)
    t = time.monotonic()
    x = torch.full((1000,), float(rank + 1))
    try:
        hopq.all_reduce(x, codec="bf16")
        out["ok"] = float(x[0])
    except hopq.TransportError as e:
        out["error"] = str(e)
    out["waited_s"] = time.monotonic() - t
    return out


def staged(rank: int, n: int, codecs: list[str]) -> dict[Any, Any]:
    """Every message staged through a host copy, as Gloo's CUDA tensors are
    (``transport.STAGE_ALL``): all-reduces with one and with many microshards."""
    from hopq.comm import collectives, engine, transport

    transport.STAGE_ALL = True
    out: dict[Any, Any] = {}
    saved = engine.MICROSHARD_COORDS
    try:
        for codec in codecs:
            for topo in ("ring", "butterfly"):
                x = make_input("float", rank, 20011)
                hopq.all_reduce(x, codec=codec, topology=topo, seed=3)
                out[(codec, topo)] = x
        engine.MICROSHARD_COORDS = 1500
        x = make_input("float", rank, 20011)
        hopq.all_reduce(x, codec="dynamiq", topology="ring", seed=6)
        out["micro"] = x
    finally:
        engine.MICROSHARD_COORDS = saved
        transport.STAGE_ALL = False
    out["staged"] = collectives._transport(None).staged_messages
    return out


def sleep_forever(rank: int, n: int, pids: str) -> None:
    """Write this rank's pid into ``pids``/rank, then wait (for the launcher to die)."""
    import os
    import time

    path = os.path.join(pids, str(rank))
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(600)


def environ_of(rank: int, n: int, names: list[str], marker: str) -> dict[str, str | None]:
    """The values of ``names`` in this rank's environment; at exit, the rank
    creates the file ``marker`` + rank (its exit handlers ran)."""
    import atexit
    import os

    atexit.register(lambda: open(f"{marker}{rank}", "w").close())
    return {k: os.environ.get(k) for k in names}


def setsid_of(rank: int, n: int) -> dict[str, int]:
    """This rank's process id and the ids that ``setsid()`` sets (``getsid``,
    ``getpgid``)."""
    import os

    return {"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0)}
