"""Worker bodies of the two-tier tests (imported by spawned Gloo ranks)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import hopq

#: (codec, inter-node topology) pairs the real runs compare with the simulator.
REAL = (("fp32", "ring"), ("bf16", "butterfly"), ("dynamiq", "ring"), ("dynamiq", "tree"))
SIZES = (0, 1, 7, 3001)
#: A size the pipelined runs use, and the piece size that makes it 4 pieces.
PIPELINED, PIECES_AT = 4003, 1000


def data(rank: int, size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(31 * rank + size)
    return torch.randn(size, generator=g).to(dtype)


def _error(fn: Any) -> tuple[str, str, float]:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e), time.perf_counter() - t0
    return "", "", time.perf_counter() - t0


def _broken(*args: object, **kwargs: object) -> None:
    raise RuntimeError("this rank's codec failed")


def two_tier(rank: int, n: int) -> dict[Any, Any]:
    """Two-tier calls on 2x2: results and stats, the errors of disagreeing
    ranks, and the DDP hook."""
    out: dict[Any, Any] = {}
    for codec, topo in REAL:
        for size in SIZES:
            x = data(rank, size)
            info = hopq.all_reduce(x, codec=codec, topology=topo, seed=4, layout="2x2")
            out[(codec, topo, size)] = x
            out[("bytes", codec, topo, size)] = info.bytes_sent
            out[("inter", codec, topo, size)] = info.inter_bits_per_coord
    # avg in bf16, a non-contiguous tensor
    x = data(rank, 1001, torch.bfloat16)
    hopq.all_reduce(x, codec="dynamiq", op="avg", seed=2, layout=(2, 2))
    out["avg_bf16"] = x
    y = data(rank, 6 * 5).view(6, 5).t()
    hopq.all_reduce(y, codec="bf16", layout="2x2")
    out["noncontig"] = y
    # "auto" from torchrun's environment: the same as "2x2"
    env = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(rank % 2), "GROUP_RANK": str(rank // 2)}
    os.environ.update(env)
    x = data(rank, 3001)
    hopq.all_reduce(x, codec="dynamiq", seed=4, layout="auto")
    out["auto"] = x
    # a pipeline of pieces (the simulator's bits), and a failing codec in it
    from hopq.comm import hierarchy

    kept = hierarchy.PIECE_COORDS
    hierarchy.PIECE_COORDS = PIECES_AT
    try:
        for codec, topo in REAL:
            x = data(rank, PIPELINED)
            hopq.all_reduce(x, codec=codec, topology=topo, seed=4, layout="2x2")
            out[("pieces", codec, topo)] = x
            # the same through a strided view: the result assembled at the end
            # (not written into the input piece by piece), the same bits
            z = torch.zeros(2 * PIPELINED)[::2]
            z.copy_(data(rank, PIPELINED))
            hopq.all_reduce(z, codec=codec, topology=topo, seed=4, layout="2x2")
            out[("pieces strided", codec, topo)] = z.clone()
        codec = hopq.get_codec("dynamiq")
        if rank == 2:
            codec.encode = _broken  # type: ignore[method-assign]
        x = data(rank, PIPELINED)
        out[("failure", "pieces")] = _error(
            lambda: hopq.all_reduce(x, codec=codec, layout="2x2", timeout=60)
        )
    finally:
        hierarchy.PIECE_COORDS = kept
    # a rank with another layout: MismatchError on every rank, at once
    x = data(rank, 500)
    out["mismatch"] = _error(
        lambda: hopq.all_reduce(x, codec="bf16", layout="4x1" if rank == 3 else "2x2", timeout=60)
    )
    # torchrun claims that contradict each other: the same ValueError everywhere
    os.environ["LOCAL_RANK"] = "0"  # rank 1 and 3 claim local rank 0 too
    out["inconsistent"] = _error(
        lambda: hopq.all_reduce(x, codec="bf16", layout="auto", timeout=60)
    )
    for k in env:
        del os.environ[k]
    # the node's float32 sums went through shared memory (where /dev/shm is)
    from hopq.comm import collectives

    memory = getattr(collectives._transport(None), "_node_memory", {})
    out["shared"] = [(m.mine is not None, m.off_reason) for m in memory.values()]
    # a codec failing on one rank, in either tier (inside a node: a bf16 codec
    # over messages, and the float32 sums in shared memory): every rank raises
    for tier in ("intra", "shared", "inter"):
        codec = hopq.get_codec("bf16")
        intra = hopq.get_codec("bf16" if tier == "intra" else "fp32")
        kept_contribution = hierarchy._Pipeline.contribution
        if rank == 1:
            if tier == "shared":
                hierarchy._Pipeline.contribution = _broken  # type: ignore[method-assign]
            else:
                broken = intra if tier == "intra" else codec
                broken.encode = _broken  # type: ignore[method-assign]
        x = data(rank, 500)
        try:
            out[("failure", tier)] = _error(
                lambda x=x, codec=codec, intra=intra: hopq.all_reduce(
                    x, codec=codec, layout="2x2", intra_codec=intra, timeout=60
                )
            )
        finally:
            hierarchy._Pipeline.contribution = kept_contribution  # type: ignore[method-assign]
    # the group is still usable
    x = data(rank, 500)
    hopq.all_reduce(x, codec="bf16", layout="2x2")
    out["after"] = x
    out["ddp"] = ddp_two_tier(rank)
    out["fsdp"] = fsdp_two_tier(rank, n)
    return out


def fsdp_two_tier(rank: int, n: int, steps: int = 2) -> dict[str, Any] | None:
    """FSDP2 with hopq's reduce-scatter on 2x2: native FSDP's parameters, then
    fp32 and DynamiQ as two-tier reduce-scatters (with the first call's input
    and output, for the simulator). None where torch has no FSDP2 hook."""
    try:
        from tests.workers_fsdp import CAPTURED, _capturing_class, build, train

        Capturing = _capturing_class()
        out: dict[str, Any] = {"native": train(build(n), rank, steps)["params"]}
    except (ImportError, AttributeError):
        return None
    for codec in ("fp32", "dynamiq"):
        model = build(n)
        comm = Capturing(codec, seed=7, layout="2x2")
        comm.install(model)
        del CAPTURED[:]
        res = train(model, rank, steps, comm)
        key, inp, got, op = CAPTURED[0]
        calls = res["records"][0][0]
        out[codec] = {
            "params": res["params"],
            "first": (key, inp, got, op),
            "inter": [c.inter_bits_per_coord for c in calls],
            "bytes": calls[0].bytes_sent,
        }
    return out


def ddp_two_tier(rank: int, steps: int = 3) -> dict[str, Any]:
    """The DDP hook with layout="2x2": parameters bit-identical on every rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = hopq.HookState(codec="dynamiq", layout="2x2", seed=1)
    ddp.register_comm_hook(state, hopq.ddp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    metrics = []
    for _ in range(steps):
        xb = torch.randn(16, 32, generator=g)
        loss = ddp(xb).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        metrics.append(state.step_metrics())
    state.close()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": params, "metrics": metrics}
