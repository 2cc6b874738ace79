"""What one CUDA GPU can check of hopq, in one run.

    python tools/gpu_check.py --out DIR

1. every registered codec through ``hopq.simulate`` on CUDA tensors (its
   default backend there): virtual ranks bit-identical, finite where the CPU
   run is finite, the output's bits against the same call on the CPU, and the
   time per call;
2. the engine's other paths (reduce-scatter, the other topologies, several
   calls with keys, bf16 inputs) on CUDA against the same calls on the CPU;
3. several Gloo ranks on the one GPU (real processes, CUDA tensors): torch's
   own send/recv of a CUDA tensor, ``hopq.all_reduce`` against the simulator,
   DDP with hopq's hook, and FSDP2 with hopq's reduce-scatter (its first call
   replayed by the simulator on the CPU);
4. the DDP hook on a single-rank NCCL group with CUDA parameters: the
   overlapped hook (its side stream and the future with devices) against
   ``overlap=False`` bit for bit, and kernel selection under ``backend="auto"``;
5. GComp's truncation thresholds from an optimizer's CUDA state against the
   same state on the CPU (SGD, momentum, Nesterov, Adam, AdamW);
6. the cluster part (``--only-cluster``): 4 Gloo ranks of the GPU as 2 nodes x
   2 workers, every codec's two-tier all-reduce (ring, butterfly and direct
   between the nodes, one piece and a pipeline of pieces), the flat ``direct``
   schedule, the two-tier reduce-scatter, DDP's hook and FSDP2 on the layout,
   and ``codec="auto"`` with the planner calibrated on the GPU's codec speeds,
   each against the simulator on the CPU bit for bit; a summary table last.

Two NCCL ranks cannot share one GPU: the multi-rank NCCL transport stays
unverified by this script (Gloo ranks can, and do). Writes ``gpu_check.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import hopq
from hopq.codecs import available_codecs, codec_info, get_codec


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of a float tensor, to compare with ``torch.equal`` (NaN too)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _reads(name: str) -> bool:
    """Whether codec ``name`` reads the optimizer (GComp's thresholds, DynamiQ's
    step sizes): the hooks then get ``optimizer=``."""
    from hopq.codecs.base import optimizer_unused

    return optimizer_unused(get_codec(name)) is None


def _same_floats(a: object, b: object) -> bool:
    """Equal nested tuples/lists of floats, NaN equal to NaN."""
    fa = torch.tensor(a, dtype=torch.float64).reshape(-1)
    fb = torch.tensor(b, dtype=torch.float64).reshape(-1)
    return fa.shape == fb.shape and bool(((fa == fb) | (fa.isnan() & fb.isnan())).all())


def check_codecs(n: int, world: int, lines: list[str]) -> bool:
    ok = True
    lines += [
        f"## Every codec through `hopq.simulate` on CUDA ({world} virtual ranks, "
        f"{n:,} coordinates each, ring)",
        "",
        "| codec | ranks bit-identical | finite | coords differing from the CPU run "
        "| ms per call (CUDA, median of 3) | ms per call (CPU) |",
        "|---|---|---|---:|---:|---:|",
    ]
    gen = torch.Generator().manual_seed(0)
    xs_cpu = [torch.randn(n, generator=gen) for _ in range(world)]
    xs_gpu = [x.cuda() for x in xs_cpu]
    for name in available_codecs():
        row = [name]
        if "cuda" not in codec_info(name).devices:  # says so itself: not a failure
            lines.append(f"| {name} | CPU only (its registry entry); not run |  |  |  |  |")
            print(lines[-1], flush=True)
            continue
        try:
            res = {}
            times = {}
            for dev, xs in (("cuda", xs_gpu), ("cpu", xs_cpu)):
                codec = get_codec(name)
                hopq.simulate(xs, codec, "ring", seed=1)  # warm-up, compile
                laps = []
                for _ in range(3):
                    codec = get_codec(name)  # the same call again, fresh state
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out = hopq.simulate(xs, codec, "ring", seed=1).outputs
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    laps.append((time.perf_counter() - t0) * 1e3)
                times[dev] = sorted(laps)[1]
                res[dev] = out
            g = res["cuda"]
            same = all(torch.equal(_bits(g[0]), _bits(y)) for y in g[1:])
            finite_gpu = bool(torch.isfinite(g[0]).all())
            finite_cpu = bool(torch.isfinite(res["cpu"][0]).all())
            diff = int((_bits(g[0].cpu()) != _bits(res["cpu"][0])).sum())
            ok &= same and (finite_gpu or not finite_cpu)
            row += [
                "yes" if same else "**NO**",
                "yes" if finite_gpu else ("no (CPU too)" if not finite_cpu else "**NO**"),
                f"{diff:,}",
                f"{times['cuda']:.1f}",
                f"{times['cpu']:.1f}",
            ]
        except Exception as e:  # report every codec, then fail
            ok = False
            row += [f"**error**: {type(e).__name__}: {str(e)[:120]}", "", "", "", ""]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    lines.append("")
    return ok


def _variant(name: str, case: str, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One engine path of codec ``name`` on the inputs' device: every virtual
    rank's outputs (several calls concatenated where the case has several)."""
    codec = get_codec(name)
    if case == "reduce-scatter":
        return hopq.simulate_reduce_scatter(xs, codec, "ring", seed=2).outputs
    if case == "3 calls, keys 0 1 0":  # adaptive state across calls and buckets
        runs = [
            hopq.simulate(xs, codec, "ring", seed=3 + i, key=k) for i, k in enumerate((0, 1, 0))
        ]
        return [torch.cat([r.outputs[q] for r in runs]) for q in range(len(xs))]
    if case == "bf16 inputs":
        return hopq.simulate([x.bfloat16() for x in xs], codec, "ring", seed=4).outputs
    if case == "optimizer input":  # DynamiQ's step sizes, GComp's thresholds
        gen = torch.Generator().manual_seed(9)
        d = xs[0].numel()
        r = (torch.rand(d, generator=gen).pow(4) * 1e-2 + 1e-6).to(xs[0].device)
        r[: d // 8] = 0.0  # a frozen slice: no step at all
        codec.set_optimizer_input(r, 0)  # type: ignore[attr-defined]
        return hopq.simulate(xs, codec, "ring", seed=6, key=0).outputs
    return hopq.simulate(xs, codec, case, seed=5).outputs  # a topology


VARIANTS = (
    "reduce-scatter",
    "butterfly",
    "tree",
    "semiloop",
    "3 calls, keys 0 1 0",
    "bf16 inputs",
    "optimizer input",
)


def check_variants(n: int, world: int, lines: list[str], dev: str = "cuda") -> bool:
    """The engine's other paths on CUDA, each against the same call on the CPU:
    cells say 'same' (bits equal, ranks agree), 'n/a' (the codec refuses it)."""
    ok = True
    lines += [
        f"## The engine's other paths on CUDA ({world} virtual ranks, {n:,} coordinates "
        "each): bits against the same call on the CPU",
        "",
        "| codec | " + " | ".join(VARIANTS) + " |",
        "|---|" + "---|" * len(VARIANTS),
    ]
    gen = torch.Generator().manual_seed(7)
    xs_cpu = [torch.randn(n, generator=gen) for _ in range(world)]
    xs_dev = [x.to(dev) for x in xs_cpu]
    for name in available_codecs():
        info = codec_info(name)
        if "cuda" not in info.devices:
            continue
        row = [name]
        for case in VARIANTS:
            topo = case in ("butterfly", "tree", "semiloop")
            if topo and info.topologies is not None and case not in info.topologies:
                row.append("n/a")
                continue
            if case == "bf16 inputs" and torch.bfloat16 not in info.dtypes:
                row.append("n/a")
                continue
            if case == "optimizer input" and not _reads(name):
                row.append("n/a")
                continue
            try:
                g = _variant(name, case, xs_dev)
                c = _variant(name, case, xs_cpu)
                agree = case == "reduce-scatter" or all(
                    torch.equal(_bits(g[0]), _bits(y)) for y in g[1:]
                )
                diff = sum(
                    int((_bits(a.cpu()) != _bits(b)).sum()) for a, b in zip(g, c, strict=True)
                )
                good = agree and diff == 0
                ok &= good
                row.append(
                    "same" if good else f"**{diff:,} differ{'' if agree else ', ranks differ'}**"
                )
            except Exception as e:
                ok = False
                row.append(f"**{type(e).__name__}: {str(e)[:80]}**")
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    lines.append("")
    return ok


def _raw_p2p(rank: int, n: int, dev: str) -> object:
    """torch's own Gloo send/recv of a CUDA tensor (what hopq stages around)."""
    x = torch.arange(1024, dtype=torch.float32, device=dev) + 1
    if rank == 0:
        dist.send(x, 1)
        return "sent"
    y = torch.zeros(1024, device=dev)
    dist.recv(y, 0)
    return bool(torch.equal(y.cpu(), torch.arange(1024, dtype=torch.float32) + 1))


def _gloo_all_reduce(rank: int, n: int, names: list[str], d: int, dev: str) -> dict[str, object]:
    """hopq.all_reduce of CUDA tensors over a real Gloo group: bits or the error."""
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(d, generator=gen) for _ in range(n)]
    out: dict[str, object] = {}
    for name in names:
        for topo in ("ring", "butterfly"):
            y = xs[rank].to(dev, copy=True)
            try:
                hopq.all_reduce(y, name, topo, seed=3)
                out[f"{name}/{topo}"] = y.cpu()
            except Exception as e:
                out[f"{name}/{topo}"] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def _gloo_ddp(rank: int, n: int, names: list[str], dev: str) -> dict[str, object]:
    """DDP on Gloo with CUDA parameters (the GComp paper's setup) and hopq's hook:
    the parameters after 3 steps, or the error."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, object] = {}
    for name in names:
        try:
            torch.manual_seed(0)
            cuda = dev == "cuda"
            model = DDP(_Net().to(dev), device_ids=[0] if cuda else None, bucket_cap_mb=4)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            state = hopq.HookState(codec=name, optimizer=opt if _reads(name) else None)
            state.measure_error = True  # the gradient's and the update's error
            state.error_optimizer = opt
            model.register_comm_hook(state, hopq.ddp_hook)
            gen = torch.Generator(device=dev).manual_seed(rank)
            calls, errors = 0, []
            for _ in range(3):
                x = torch.randn(64, 1024, device=dev, generator=gen)
                opt.zero_grad()
                model(x).backward()
                opt.step()
                m = state.pop_step()
                calls += m.buckets
                errors.append((m.vnmse, m.update_vnmse))
            if cuda:
                torch.cuda.synchronize()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
            out[name] = (flat, calls, errors)
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def check_gloo(world: int, d: int, lines: list[str], dev: str = "cuda") -> bool:
    """Several Gloo ranks on the one GPU: the multi-rank transport with CUDA
    tensors (NCCL refuses two ranks on one device; Gloo does not care)."""
    from hopq.cluster.launch import run_workers, spawn

    ok = True
    lines += [f"## {world} Gloo ranks on the one GPU (CUDA tensors, real transport)", ""]
    raw = spawn(2, _raw_p2p, dev, timeout=120, clean_exit=False)
    desc = "; ".join(
        f"rank {o.rank}: exit {o.exitcode}, "
        + (
            f"result {o.result!r}"
            if o.error is None
            else f"error {o.error.strip().splitlines()[-1]}"
        )
        for o in raw
    )
    lines += [f"torch's own Gloo send/recv of a CUDA tensor: {desc}", ""]
    print(lines[-2], flush=True)
    names = [c for c in available_codecs() if "cuda" in codec_info(c).devices]
    res = run_workers(world, _gloo_all_reduce, names, d, dev, timeout=600)
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(d, generator=gen) for _ in range(world)]
    lines += [
        f"`hopq.all_reduce` of {d:,} CUDA coordinates per rank against `hopq.simulate` "
        "of the same call on the CPU:",
        "",
        "| codec | ring | butterfly |",
        "|---|---|---|",
    ]
    for name in names:
        row = [name]
        for topo in ("ring", "butterfly"):
            got = [r[f"{name}/{topo}"] for r in res]
            if any(isinstance(g, str) for g in got):
                ok = False
                row.append("**" + next(g for g in got if isinstance(g, str)) + "**")
                continue
            sim = hopq.simulate(xs, name, topo, seed=3).outputs
            same = all(torch.equal(_bits(g), _bits(s)) for g, s in zip(got, sim, strict=True))
            ok &= same
            row.append("same bits" if same else "**differs**")
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    lines.append("")
    ddp_names = ["dynamiq", "gcomp", "bf16", "thc"]
    res = run_workers(world, _gloo_ddp, ddp_names, dev, timeout=600)
    lines += [
        "DDP on Gloo with CUDA parameters and hopq's hook (AdamW, 3 steps; DynamiQ and "
        "GComp with `optimizer=`; `measure_error` with `error_optimizer`):",
        "",
        "| codec | ranks' parameters bit-identical | hook calls | vNMSE per step "
        "| update vNMSE per step | ranks' errors equal |",
        "|---|---|---:|---|---|---|",
    ]
    for name in ddp_names:
        got = [r[name] for r in res]
        if any(isinstance(g, str) for g in got):
            ok = False
            lines.append(f"| {name} | **{next(g for g in got if isinstance(g, str))}** | | | | |")
        else:
            same = all(torch.equal(_bits(g[0]), _bits(got[0][0])) for g in got)
            errs = got[0][2]
            # NaN only before AdamW's first step (no step sizes yet), finite after
            sound = all(e == e for e, _ in errs) and all(u == u for _, u in errs[1:])
            agree = all(_same_floats(g[2], errs) for g in got)
            ok &= same and got[0][1] > 0 and sound and agree
            v = ", ".join(f"{e:.2e}" for e, _ in errs)
            u = ", ".join(f"{x:.2e}" for _, x in errs)
            lines.append(
                f"| {name} | {'yes' if same else '**NO**'} | {got[0][1]} | {v} | {u} "
                f"| {'yes' if agree else '**NO**'} |"
            )
        print(lines[-1], flush=True)
    lines.append("")
    return ok


FSDP_CODECS = ["fp32", "bf16", "dynamiq", "thc", "mxfp8", "equarx", "gcomp"]


FSDP_WIDTHS = (256, 518, 301, 10)  # rows 518, 301, 10: not multiples of 4, FSDP pads


def _fsdp_model(dev: str) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(FSDP_WIDTHS, FSDP_WIDTHS[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1]).to(dev)


def _gloo_fsdp(
    rank: int, n: int, names: list[str], dev: str, layout: str | None = None
) -> dict[str, object]:
    """FSDP2 (``fully_shard`` per Linear, a ``dev`` device mesh over the Gloo group)
    with hopq's reduce-scatter (or native, name "native"), AdamW, 3 steps (GComp
    and DynamiQ with ``optimizer=``; with a two-tier ``layout``, which takes no
    optimizer, without): each rank's first reduce-scatter (key, input, output,
    op), its parameter shards, the calls per step and the losses, or the error.
    The shards leave as local tensors: ``full_tensor()`` of a CUDA DTensor over
    Gloo crashes the process (a segmentation fault in torch's functional
    all-gather, seen on an H200 with torch 2.11)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    first: list[object] = []

    class Capturing(hopq.FSDPReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
            inp = input_tensor.detach().cpu().clone()
            res = super().__call__(output_tensor, input_tensor, group, op, async_op)
            if not first:
                from hopq.comm.collectives import parse_op

                first.append((self.key, inp, output_tensor.detach().cpu().clone(), parse_op(op)))
            return res

    out: dict[str, object] = {}
    for name in names:
        first.clear()
        try:
            model = _fsdp_model(dev)
            mesh = init_device_mesh(dev, (n,))
            for m in model:
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            comm = None
            if name != "native":
                # the codecs that read the optimizer get it: GComp's thresholds
                # (exchanged at every call here), DynamiQ's super-group weights
                extra: dict = {"optimizer": opt} if _reads(name) and not layout else {}
                if hasattr(get_codec(name), "set_thresholds") and extra:
                    extra["thresholds_every"] = 1
                comm = Capturing(name, "ring", seed=7, layout=layout, **extra)
                comm.install(model)
            gen = torch.Generator().manual_seed(100 + rank)
            losses, calls = [], []
            for _ in range(3):
                x = torch.randn(32, FSDP_WIDTHS[0], generator=gen).to(dev)
                y = torch.randn(32, FSDP_WIDTHS[-1], generator=gen).to(dev)
                loss = (model(x) - y).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                if comm is not None:
                    calls.append(comm.pop_step().buckets)
            shards = {k: v.to_local().detach().cpu().clone() for k, v in model.state_dict().items()}
            out[name] = {"first": first[0] if first else None, "shards": shards,
                         "losses": losses, "calls": calls}  # fmt: skip
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def check_fsdp(world: int, lines: list[str], dev: str = "cuda") -> bool:
    """FSDP2 on several Gloo ranks of the one GPU: hopq's reduce-scatter with CUDA
    shards over a real transport, the first call replayed by the simulator on the
    CPU bit for bit, and the trained parameters' distance to native FSDP's (run
    in its own processes: a crash there is torch's and is reported, not fatal)."""
    from hopq.cluster.launch import run_workers, spawn

    ok = True
    names = [c for c in FSDP_CODECS if "cuda" in codec_info(c).devices]
    res = run_workers(world, _gloo_fsdp, names, dev, timeout=600)
    nat = spawn(world, _gloo_fsdp, ["native"], dev, timeout=300, clean_exit=False)

    def failure(o: object) -> str | None:
        """Why a native rank has no result (it raised, crashed or hung), or None."""
        got = o.result.get("native") if isinstance(o.result, dict) else None  # type: ignore[attr-defined]
        if isinstance(got, dict):
            return None
        if isinstance(got, str):
            return got
        last = (o.error or "").strip().splitlines()[-1:]  # type: ignore[attr-defined]
        return last[0] if last else f"no result (exit code {o.exitcode})"  # type: ignore[attr-defined]

    bad = [(o, failure(o)) for o in nat if failure(o) is not None]
    native = None if bad else [o.result["native"] for o in nat]
    why = (
        "ran"
        if not bad
        else f"rank {bad[0][0].rank} (exit {bad[0][0].exitcode}): {bad[0][1][:160]}"
    )
    init = dict(_fsdp_model("cpu").state_dict())

    def full(per_rank: list[dict]) -> dict[str, torch.Tensor]:
        return {k: torch.cat([r["shards"][k] for r in per_rank]) for k in per_rank[0]["shards"]}

    lines += [
        f"## FSDP2 on {world} Gloo ranks of the one GPU ({dev} device mesh, AdamW, 3 steps)",
        "",
        f"Native FSDP2 on the same group: {why}.",
        "",
        "| codec | first reduce-scatter = simulator's on the CPU | reduce-scatters per step "
        "| losses (rank 0) | distance to native's parameters / native's update |",
        "|---|---|---|---|---:|",
    ]
    for name in names:
        got = [r[name] for r in res]
        if any(isinstance(g, str) for g in got):
            ok = False
            lines.append(f"| {name} | **{next(g for g in got if isinstance(g, str))}** | | | |")
            print(lines[-1], flush=True)
            continue
        key, _, _, (red, premul) = got[0]["first"]
        op = red.value if premul is None else dist.ReduceOp.PREMUL_SUM(premul)
        sim = hopq.simulate_reduce_scatter(
            [g["first"][1] for g in got], get_codec(name), "ring", seed=7, op=op, key=key
        )
        eq = all(
            torch.equal(_bits(s), _bits(g["first"][2]))
            for s, g in zip(sim.outputs, got, strict=True)
        )
        ok &= eq and min(got[0]["calls"]) > 0
        dist_ = "—"
        if native is not None:
            mine, theirs = full(got), full(native)
            num = sum(float((mine[k].double() - theirs[k].double()).square().sum()) for k in mine)
            den = sum(float((theirs[k].double() - init[k].double()).square().sum()) for k in mine)
            dist_ = f"{(num / den) ** 0.5:.2e}"
        losses = ", ".join(f"{v:.4f}" for v in got[0]["losses"])
        lines.append(
            f"| {name} | {'same bits' if eq else '**differs**'} | {got[0]['calls']} | {losses} "
            f"| {dist_} |"
        )
        print(lines[-1], flush=True)
    lines.append("")
    return ok


# -- the two-tier all-reduce, the direct schedule and codec="auto" -----------

#: The layout of the two-tier checks: 4 Gloo ranks as 2 nodes of 2 workers.
CLUSTER_LAYOUT = "2x2"
#: The inter-node schedules of the two-tier checks (each a 2-rank schedule here).
CLUSTER_INTER = ("ring", "butterfly", "direct")
#: Pipeline pieces of the pieced two-tier runs (``hierarchy.PIECE_COORDS`` is
#: patched to a quarter of the size, in the ranks and in the simulator alike).
CLUSTER_PIECES = 4
#: The codecs of the DDP and FSDP2 two-tier checks.
CLUSTER_HOOK_CODECS = ("dynamiq", "bf16", "gcomp")
CLUSTER_FSDP_CODECS = ("fp32", "dynamiq")


def _cluster_inputs(d: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(21)
    return [torch.randn(d, generator=gen) for _ in range(n)]


def _runs_on(name: str, topology: str, dev: str) -> bool:
    """Whether codec ``name`` takes float32 on ``dev`` over ``topology``."""
    info = codec_info(name)
    return info.refusal(dtype=torch.float32, device=torch.device(dev), topology=topology) is None


def _try(fn: object) -> object:
    """``fn()``, or its error as a short string (one failed call is reported, not fatal)."""
    try:
        return fn()  # type: ignore[operator]
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"{type(e).__name__}: {str(e)[:160]}"


def _stats(info: object) -> tuple[float, float, float]:
    """(bytes sent, intra-node bits per coordinate, inter-node bits per coordinate)."""
    tiers = getattr(info, "tiers", {})
    intra = tiers["intra"].bits_per_coord if "intra" in tiers else float("nan")
    return float(info.bytes_sent), float(intra), float(info.inter_bits_per_coord)  # type: ignore[attr-defined]


def _ddp_layout(rank: int, name: str, dev: str, layout: str) -> dict[str, object]:
    """DDP with hopq's hook on ``layout`` (overlapped, CUDA parameters over Gloo):
    every bucket's call in order (bucket index, input, output) and the final
    parameters. ``name`` may be "auto": then the planner's summary too."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
        torch.nn.ReLU(), torch.nn.Linear(256, 10),
    ).to(dev)  # fmt: skip
    cuda = dev == "cuda"
    model = DDP(net, device_ids=[0] if cuda else None, bucket_cap_mb=0.25)
    state = hopq.HookState(codec=name, layout=layout, seed=1)
    # GComp without optimizer= truncates nothing (lossless): what this check wants
    warnings.filterwarnings("ignore", message="HookState: codec 'gcomp' without optimizer=")
    calls: list[list[object]] = []

    # no annotations: DDP compares them with its own types, and this module's are strings
    def hook(st, bucket):  # type: ignore[no-untyped-def]
        slot: list[object] = [bucket.index(), bucket.buffer().detach().cpu().clone(), None]
        calls.append(slot)

        def done(f: torch.futures.Future) -> torch.Tensor:
            v = f.value()
            slot[2] = v.detach().cpu().clone()
            return v

        return hopq.ddp_hook(st, bucket).then(done)

    model.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    inter = []
    for _ in range(3):
        x = torch.randn(32, 256, generator=gen).to(dev)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        inter.append(state.step_metrics().get("hopq/inter_bits_per_coordinate", float("nan")))
    if cuda:
        torch.cuda.synchronize()
    summary = state.auto.summary() if state.auto is not None else None
    state.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return {"calls": calls, "params": flat, "inter": inter, "summary": summary}


def _cluster_worker(
    rank: int,
    n: int,
    names: list[str],
    d: int,
    dev: str,
    speeds: dict[str, tuple[float, ...]],
) -> dict[object, object]:
    """Every check of the cluster part on one Gloo rank (one spawn for all):
    two-tier all-reduces (1 and several pieces), flat direct, two-tier
    reduce-scatters, the DDP hook and FSDP2 on the layout, and codec="auto"."""
    from hopq.comm import hierarchy
    from hopq.comm import plan as pm
    from hopq.comm.collectives import reduce_scatter_with_stats

    x = _cluster_inputs(d, n)[rank]
    out: dict[object, object] = {}
    t0 = time.perf_counter()

    def two_tier(name: str, topo: str, layout: str) -> object:
        y = x.to(dev, copy=True)
        info = hopq.all_reduce(y, name, topo, seed=3, layout=layout, timeout=120)
        assert y.device.type == dev
        return (y.cpu(), *_stats(info))

    kept = hierarchy.PIECE_COORDS
    for pieces in (1, CLUSTER_PIECES):
        hierarchy.PIECE_COORDS = kept if pieces == 1 else d // CLUSTER_PIECES
        try:
            for name in names:
                for topo in CLUSTER_INTER:
                    if _runs_on(name, topo, dev):
                        out[("tier", name, topo, pieces)] = _try(
                            lambda name=name, topo=topo: two_tier(name, topo, CLUSTER_LAYOUT)
                        )
        finally:
            hierarchy.PIECE_COORDS = kept
    # "auto" from torchrun's environment (LOCAL_WORLD_SIZE, LOCAL_RANK, GROUP_RANK)
    env = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(rank % 2), "GROUP_RANK": str(rank // 2)}
    os.environ.update(env)
    try:
        out[("tier", "dynamiq", "env")] = _try(lambda: two_tier("dynamiq", "ring", "auto"))
    finally:
        for k in env:
            del os.environ[k]
    out["t_tier"] = time.perf_counter() - t0
    t0 = time.perf_counter()

    def direct(name: str) -> object:
        y = x.to(dev, copy=True)
        info = hopq.all_reduce(y, name, "direct", seed=3, timeout=120)
        return y.cpu(), info.bytes_sent

    def scatter(name: str) -> object:
        y, info = reduce_scatter_with_stats(
            x.to(dev), name, seed=3, layout=CLUSTER_LAYOUT, timeout=120
        )
        return (y.cpu(), *_stats(info))

    for name in names:
        if _runs_on(name, "direct", dev):
            out[("direct", name)] = _try(lambda name=name: direct(name))
        out[("rs", name)] = _try(lambda name=name: scatter(name))
    out["t_flat"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for name in CLUSTER_HOOK_CODECS:
        out[("ddp", name)] = _try(lambda name=name: _ddp_layout(rank, name, dev, CLUSTER_LAYOUT))
    out["fsdp"] = _gloo_fsdp(rank, n, list(CLUSTER_FSDP_CODECS), dev, CLUSTER_LAYOUT)
    out["t_hooks"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # codec="auto": the planner with this device's codec speeds, flat and two-tier
    pm.AUTO_OVERRIDES["speeds"] = dict(speeds)
    try:
        for layout in (None, CLUSTER_LAYOUT):
            y = x.to(dev, copy=True)
            got = _try(lambda y=y, layout=layout: hopq.all_reduce(
                y, "auto", seed=5, layout=layout, timeout=120))  # fmt: skip
            if isinstance(got, str):
                out[("auto", layout)] = got
                continue
            picked = pm.auto_pick(d, layout=layout)
            assert picked is not None, "codec='auto' ran but recorded no pick"
            name, config, topo, lay = picked
            out[("auto", layout)] = (
                y.cpu(), name, config, topo, None if lay is None else lay.describe()
            )  # fmt: skip
        out["probe"] = pm.auto_probe()
        out[("ddp", "auto")] = _try(lambda: _ddp_layout(rank, "auto", dev, CLUSTER_LAYOUT))
    finally:
        pm.AUTO_OVERRIDES.pop("speeds", None)
    out["t_auto"] = time.perf_counter() - t0
    return out


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(_bits(g), _bits(w)) for g, w in zip(got, want, strict=True))


def _cell(got: list[object], check: object) -> tuple[str, bool]:
    """A table cell from every rank's result: the first error, or ``check(got)``'s."""
    bad = next((g for g in got if isinstance(g, str)), None)
    if bad is not None:
        return f"**{bad}**", False
    return check(got)  # type: ignore[operator]


def _cluster_sims(names: list[str], xs: list[torch.Tensor], dev: str) -> dict[object, object]:
    """The simulator's runs (on the CPU) of the ranks' calls that need none of
    their results: the two-tier all-reduces, flat direct and the two-tier
    reduce-scatters, keyed as the ranks' results (each a result or an error)."""
    from hopq.comm import hierarchy

    d = xs[0].numel()
    sims: dict[object, object] = {}
    kept = hierarchy.PIECE_COORDS
    for pieces in (1, CLUSTER_PIECES):
        hierarchy.PIECE_COORDS = kept if pieces == 1 else d // CLUSTER_PIECES
        try:
            for name in names:
                for topo in CLUSTER_INTER:
                    if _runs_on(name, topo, dev):
                        sims[("tier", name, topo, pieces)] = _try(
                            lambda name=name, topo=topo: hopq.simulate(
                                xs, name, topo, seed=3, layout=CLUSTER_LAYOUT
                            )
                        )
        finally:
            hierarchy.PIECE_COORDS = kept
    for name in names:
        if _runs_on(name, "direct", dev):
            sims[("direct", name)] = _try(
                lambda name=name: hopq.simulate(xs, name, "direct", seed=3)
            )
        sims[("rs", name)] = _try(
            lambda name=name: hopq.simulate_reduce_scatter(xs, name, seed=3, layout=CLUSTER_LAYOUT)
        )
    return sims


def check_cluster(
    world: int, d: int, lines: list[str], summary: list[list[str]], dev: str = "cuda"
) -> bool:
    """What hopq added for clusters, on several Gloo ranks of the one GPU: the
    two-tier all-reduce (2 nodes x 2 workers; ring, butterfly and direct between
    the nodes; one piece and a pipeline of pieces), the flat direct schedule,
    the two-tier reduce-scatter, DDP's hook and FSDP2 on the layout, and
    ``codec="auto"`` with the planner calibrated on this device's codec speeds:
    every rank's result against the simulator's on the CPU, bit for bit."""
    from hopq.cli import measure_speeds
    from hopq.cluster.launch import run_workers
    from hopq.comm import hierarchy
    from hopq.comm import plan as pm
    from hopq.comm.layout import NodeLayout

    if world != 4:
        raise ValueError(f"the cluster part runs 2 nodes x 2 workers: --world 4, got {world}")
    t_start = time.perf_counter()
    ok = True
    names = [c for c in available_codecs() if dev in codec_info(c).devices]
    # the planner's codec speeds, timed on this device (hopq plan --measure --device)
    t0 = time.perf_counter()
    calib = [c for c in names if c in pm.DEFAULT_SPEEDS]
    speeds: dict[str, tuple[float, ...]] = {}
    failed: dict[str, str] = {}  # a codec that fails here keeps its CPU default
    for c in calib:
        got = _try(lambda c=c: measure_speeds([c], coords=d, device=dev)[c])
        if isinstance(got, str):
            failed[c] = got
        else:
            speeds[c] = got  # type: ignore[assignment]
    ok &= not failed
    t_speeds = time.perf_counter() - t0
    # the ranks run in a thread of their own while this one runs the simulator
    t0 = time.perf_counter()
    box: dict[str, object] = {}

    def ranks() -> None:
        try:
            box["res"] = run_workers(
                world, _cluster_worker, names, d, dev, speeds, timeout=600, threads=2
            )
        except BaseException as e:  # noqa: BLE001 - raised below
            box["error"] = e
        box["seconds"] = time.perf_counter() - t0

    launcher = threading.Thread(target=ranks, daemon=True)
    launcher.start()
    xs = _cluster_inputs(d, world)
    sims = _cluster_sims(names, xs, dev)
    t_sims = time.perf_counter() - t0
    launcher.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    res: list[dict] = box["res"]  # type: ignore[assignment]
    t_workers = float(box["seconds"])  # type: ignore[arg-type]
    t0 = time.perf_counter()
    pieces_at = d // CLUSTER_PIECES
    cuts = {1: len(hierarchy.tier_pieces(d, 2)) - 1}
    kept = hierarchy.PIECE_COORDS
    hierarchy.PIECE_COORDS = pieces_at
    try:
        cuts[CLUSTER_PIECES] = len(hierarchy.tier_pieces(d, 2)) - 1
    finally:
        hierarchy.PIECE_COORDS = kept

    # 1. the two-tier all-reduce
    cols = [(t, k) for t in CLUSTER_INTER for k in (1, CLUSTER_PIECES)]
    lines += [
        f"## The two-tier all-reduce on {world} Gloo ranks of the one GPU ({dev} tensors)",
        "",
        f"Layout {CLUSTER_LAYOUT} (2 nodes x 2 workers), {d:,} coordinates per rank, "
        f"intra-node codec fp32; {cuts[CLUSTER_PIECES]} pieces with "
        f"`hierarchy.PIECE_COORDS` = {pieces_at:,}. A cell says `same` when every "
        'rank\'s output has the bits of `hopq.simulate(..., layout="2x2")` on the CPU '
        "and every rank sent the simulator's bytes.",
        "",
        "| codec | "
        + " | ".join(f"{t}, {cuts[k]} piece{'s' if cuts[k] > 1 else ''}" for t, k in cols)
        + " | intra bits/coord | inter bits/coord (ring) |",
        "|---|" + "---|" * len(cols) + "---:|---:|",
    ]
    n_ok = n_all = 0
    for name in names:
        row, bits = [name], ["", ""]
        for topo, pieces in cols:
            key = ("tier", name, topo, pieces)
            if key not in res[0]:
                row.append("n/a")
                continue
            got = [r[key] for r in res]
            sim = sims[key]

            def check(got: list, sim: object = sim) -> tuple[str, bool]:
                if isinstance(sim, str):
                    return f"**simulator: {sim}**", False
                same = _same([g[0] for g in got], sim.outputs)  # type: ignore[attr-defined]
                sent = [g[1] for g in got] == sim.bytes_sent  # type: ignore[attr-defined]
                inter = [g[3] for g in got] == [s.inter_bits_per_coord for s in sim.stats]  # type: ignore[attr-defined]
                if same and sent and inter:
                    return "same", True
                return ("**differs**" if not same else "**bits/coord differ**"), False

            cell, good = _cell(got, check)
            n_all += 1
            n_ok += good
            ok &= good
            row.append(cell)
            if topo == "ring" and pieces == 1 and not isinstance(got[0], str):
                bits = [f"{got[0][2]:.2f}", f"{got[0][3]:.2f}"]
        lines.append("| " + " | ".join(row + bits) + " |")
        print(lines[-1], flush=True)
    got = [r[("tier", "dynamiq", "env")] for r in res]
    sim = sims[("tier", "dynamiq", "ring", 1)]
    cell, good = _cell(got, lambda g: ("same", True) if _same([x[0] for x in g], sim.outputs)
                       else ("**differs**", False))  # fmt: skip
    ok &= good
    lines += [
        "",
        '`layout="auto"` from torchrun\'s environment (LOCAL_WORLD_SIZE=2, LOCAL_RANK, '
        f"GROUP_RANK), DynamiQ on a ring between the nodes, against the simulator's 2x2: {cell}",
        "",
    ]
    print(lines[-2], flush=True)
    summary.append(["two-tier all-reduce, every codec x inter schedule x pieces",
                    f"{n_ok + good}/{n_all + 1} same bits"])  # fmt: skip

    # 2. flat direct, and the two-tier reduce-scatter
    lines += [
        f"## The one-shot `direct` schedule (flat, {world} ranks) and the two-tier "
        f"reduce-scatter ({CLUSTER_LAYOUT}) on {dev} tensors",
        "",
        'Against `hopq.simulate(..., "direct")` and '
        '`hopq.simulate_reduce_scatter(..., layout="2x2")` on the CPU (bits and bytes):',
        "",
        "| codec | direct, 4 ranks | bits/coord (direct) | reduce-scatter, 2x2 "
        "| inter bits/coord (reduce-scatter) |",
        "|---|---|---:|---|---:|",
    ]
    d_ok = d_all = r_ok = r_all = 0
    for name in names:
        row = [name]
        if ("direct", name) in res[0]:
            got = [r[("direct", name)] for r in res]
            sim = sims[("direct", name)]

            def check_d(got: list, sim: object = sim) -> tuple[str, bool]:
                if isinstance(sim, str):
                    return f"**simulator: {sim}**", False
                same = _same([g[0] for g in got], sim.outputs)  # type: ignore[attr-defined]
                sent = [g[1] for g in got] == sim.bytes_sent  # type: ignore[attr-defined]
                return ("same" if same and sent else "**differs**"), same and sent

            cell, good = _cell(got, check_d)
            d_all += 1
            d_ok += good
            ok &= good
            row += [cell, "" if isinstance(sim, str) else f"{sim.bits_per_coord:.2f}"]
        else:
            row += ["n/a", ""]
        got = [r[("rs", name)] for r in res]
        simr = sims[("rs", name)]

        def check_r(got: list, sim: object = simr) -> tuple[str, bool]:
            if isinstance(sim, str):
                return f"**simulator: {sim}**", False
            same = _same([g[0] for g in got], sim.outputs)  # type: ignore[attr-defined]
            sent = [g[1] for g in got] == sim.bytes_sent  # type: ignore[attr-defined]
            return ("same" if same and sent else "**differs**"), same and sent

        cell, good = _cell(got, check_r)
        r_all += 1
        r_ok += good
        ok &= good
        inter = "" if isinstance(got[0], str) else f"{got[0][3]:.2f}"
        row += [cell, inter]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    lines.append("")
    summary.append(["flat direct, every codec", f"{d_ok}/{d_all} same bits"])
    summary.append(["two-tier reduce-scatter, every codec", f"{r_ok}/{r_all} same bits"])

    # 3. DDP's hook and FSDP2 on the layout
    lines += [
        f'## DDP\'s hook and FSDP2 with `layout="{CLUSTER_LAYOUT}"` ({dev} parameters, Gloo)',
        "",
        "DDP (overlapped hook, AdamW, 3 steps, `bucket_cap_mb=0.25`): every bucket's call "
        'replayed in order by `hopq.simulate(..., op="avg", key=bucket, layout="2x2")` '
        "on the CPU with one codec instance (its state across calls and keys):",
        "",
        "| codec | ranks' parameters bit-identical | hook calls | calls = simulator's "
        "| inter bits/coord per step |",
        "|---|---|---:|---|---|",
    ]
    h_ok = 0
    for name in CLUSTER_HOOK_CODECS:
        got = [r[("ddp", name)] for r in res]

        def check_h(got: list, name: str = name) -> tuple[str, bool]:
            params = all(torch.equal(_bits(g["params"]), _bits(got[0]["params"])) for g in got)
            codec = get_codec(name)
            calls = got[0]["calls"]
            replay = len(calls) > 0 and all(len(g["calls"]) == len(calls) for g in got)
            for j in range(len(calls) if replay else 0):
                key = calls[j][0]
                sim = hopq.simulate([g["calls"][j][1] for g in got], codec, "ring", seed=1,
                                    op="avg", key=key, layout=CLUSTER_LAYOUT)  # fmt: skip
                replay &= _same([g["calls"][j][2] for g in got], sim.outputs)
            inter = ", ".join(f"{v:.2f}" for v in got[0]["inter"])
            good = params and replay
            cells = ["yes" if params else "**NO**", str(len(calls)),
                     f"{len(calls)} of {len(calls)}" if replay else "**NO**", inter]  # fmt: skip
            return " | ".join(cells), good

        cell, good = _cell(got, check_h)
        h_ok += good
        ok &= good
        lines.append(f"| {name} | {cell} |")
        print(lines[-1], flush=True)
    lines += [
        "",
        'FSDP2 (`fully_shard` per Linear, AdamW, 3 steps, `FSDPReduceScatter(layout="2x2")`, '
        "no optimizer input: a layout takes none): each rank's first reduce-scatter against "
        '`hopq.simulate_reduce_scatter(..., layout="2x2")` on the CPU:',
        "",
        "| codec | first reduce-scatter = simulator's | reduce-scatters per step | losses (rank 0) |",
        "|---|---|---|---|",
    ]
    f_ok = 0
    for name in CLUSTER_FSDP_CODECS:
        got = [r["fsdp"][name] for r in res]

        def check_f(got: list, name: str = name) -> tuple[str, bool]:
            key, _, _, (red, premul) = got[0]["first"]
            op = red.value if premul is None else dist.ReduceOp.PREMUL_SUM(premul)
            sim = hopq.simulate_reduce_scatter(
                [g["first"][1] for g in got], get_codec(name), "ring", seed=7, op=op, key=key,
                layout=CLUSTER_LAYOUT,
            )  # fmt: skip
            eq = _same([g["first"][2] for g in got], sim.outputs)
            good = eq and min(got[0]["calls"]) > 0
            losses = ", ".join(f"{v:.4f}" for v in got[0]["losses"])
            return f"{'same bits' if eq else '**differs**'} | {got[0]['calls']} | {losses}", good

        cell, good = _cell(got, check_f)
        f_ok += good
        ok &= good
        lines.append(f"| {name} | {cell} |")
        print(lines[-1], flush=True)
    lines.append("")
    summary.append(["DDP hook, layout 2x2 (params, every bucket)",
                    f"{h_ok}/{len(CLUSTER_HOOK_CODECS)} codecs same"])  # fmt: skip
    summary.append(["FSDP2, layout 2x2 (first reduce-scatter)",
                    f"{f_ok}/{len(CLUSTER_FSDP_CODECS)} codecs same"])  # fmt: skip

    # 4. codec="auto" with this device's speeds
    lines += [
        f'## `codec="auto"` with the planner calibrated on {dev}',
        "",
        f"Codec speeds timed on {dev} tensors (`hopq plan --measure --device {dev}`, "
        f"{d:,} coordinates, one host thread), ns per coordinate, against the CPU "
        "defaults (`DEFAULT_SPEEDS`, one core of an AMD EPYC):",
        "",
        "| codec | plan | encode | fused hop | decode | bits/coord "
        "| CPU default: plan, encode, hop, decode |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for c in calib:
        dflt = ", ".join(f"{x:g}" for x in pm.DEFAULT_SPEEDS[c][:4])
        if c in failed:
            lines.append(f"| {c} | **{failed[c]}** | | | | | {dflt} |")
            continue
        v = speeds[c]
        lines.append(
            f"| {c} | {v[0]:.3g} | {v[1]:.3g} | {v[2]:.3g} | {v[3]:.3g} | {v[4]:.2f} | {dflt} |"
        )
    lines.append("")
    print(f"codec speeds timed on {dev} in {t_speeds:.1f} s", flush=True)
    summary.append([f"codec speeds timed on {dev}", f"{len(speeds)}/{len(calib)} codecs"])
    a_ok = 0
    auto_rows = []
    for layout in (None, CLUSTER_LAYOUT):
        got = [r[("auto", layout)] for r in res]

        def check_a(got: list) -> tuple[str, bool]:
            same_plan = all(g[1:] == got[0][1:] for g in got)
            name, config, topo, lay = got[0][1:]
            sim = hopq.simulate(xs, get_codec(name, **config), topo, seed=5, layout=lay)
            eq = _same([g[0] for g in got], sim.outputs)
            pick = f"{name}{config or ''} on {topo}" + (f", layout {lay}" if lay else ", flat")
            cells = [pick, "yes" if same_plan else "**NO**", "same bits" if eq else "**differs**"]
            return " | ".join(cells), same_plan and eq

        cell, good = _cell(got, check_a)
        a_ok += good
        ok &= good
        auto_rows.append(f"| {'flat' if layout is None else layout} | {cell} |")
    got = [r[("ddp", "auto")] for r in res]

    def check_da(got: list) -> tuple[str, bool]:
        params = all(torch.equal(_bits(g["params"]), _bits(got[0]["params"])) for g in got)
        plans = all(g["summary"] == got[0]["summary"] for g in got)
        cells = [f"DDP hook: {got[0]['summary']}", "yes" if plans else "**NO**",
                 "parameters bit-identical" if params else "**parameters differ**"]  # fmt: skip
        return " | ".join(cells), params and plans

    cell, good = _cell(got, check_da)
    a_ok += good
    ok &= good
    auto_rows.append(f'| {CLUSTER_LAYOUT}, `HookState(codec="auto")` | {cell} |')
    probe = res[0]["probe"]
    lines += [
        f'`hopq.all_reduce(x, codec="auto")` of {d:,} {dev} coordinates on {world} Gloo '
        'ranks, `hopq.comm.plan.AUTO_OVERRIDES["speeds"]` = the speeds above; the '
        "output against `hopq.simulate` of the picked codec, schedule and layout on the CPU"
        + (
            f" (the ranks' agreed probe: {probe[1]:.3g} Gbit/s, {probe[0] * 1e6:.0f} us per step)"
            if probe
            else ""
        )
        + ":",
        "",
        "| layout | pick | every rank the same plan | output |",
        "|---|---|---|---|",
        *auto_rows,
        "",
    ]
    for row in auto_rows:
        print(row, flush=True)
    if probe:
        with_speeds = {**pm.AUTO_OVERRIDES, "speeds": speeds}
        saved = dict(pm.AUTO_OVERRIDES)
        pm.AUTO_OVERRIDES.update(with_speeds)
        try:
            p = pm.plan_call(d, world, probe, NodeLayout.parse(CLUSTER_LAYOUT))
        finally:
            pm.AUTO_OVERRIDES.clear()
            pm.AUTO_OVERRIDES.update(saved)
        ranks_pick = res[0][("auto", CLUSTER_LAYOUT)]
        mine = (p.codec, p.codec_config, p.topology, p.layout)
        agrees = not isinstance(ranks_pick, str) and tuple(ranks_pick[1:]) == mine
        ok &= agrees
        lines += [
            f"The two-tier call's plan recomputed here from the ranks' probe ({d:,} "
            "coordinates, 2x2, this device's speeds): "
            + ("the ranks' pick" if agrees else f"**not the ranks' pick** ({mine})")
            + "; its fastest 10 candidates:",
            "",
            p.table(10),
            "",
        ]
    big = {"nodes": 2, "per_node": 8, "inter_gbit": 25.0, "params": 125_000_000}
    on_dev, on_cpu = hopq.plan(**big, speeds=speeds), hopq.plan(**big)
    lines += [
        "For 2 nodes x 8 workers, 25 Gbit/s between the nodes, 125M parameters: "
        f"{on_dev.pick.label} on {on_dev.schedule} with these speeds "
        f"({on_dev.pick.sync_s * 1e3:.3g} ms predicted); {on_cpu.pick.label} on "
        f"{on_cpu.schedule} with the CPU defaults ({on_cpu.pick.sync_s * 1e3:.3g} ms).",
        "",
    ]
    print(lines[-2], flush=True)
    summary.append(['codec="auto" (flat, 2x2, DDP hook)', f"{a_ok}/3 same plan and bits"])
    t_sim = time.perf_counter() - t0
    wall = time.perf_counter() - t_start
    times = ", ".join(f"{k} {res[0][f't_{k}']:.1f} s" for k in ("tier", "flat", "hooks", "auto"))
    lines += [
        f"Seconds: codec speeds {t_speeds:.1f}; the ranks {t_workers:.1f} from spawn to exit "
        f"(rank 0: {times}); the simulator on the CPU {t_sims:.1f} alongside the ranks and "
        f"{t_sim:.1f} after them; the part {wall:.1f}.",
        "",
    ]
    summary.append([
        "cluster part's wall time",
        f"{wall:.1f} s (codec speeds {t_speeds:.1f}, ranks {t_workers:.1f}, simulator after "
        f"them {t_sim:.1f})",
    ])  # fmt: skip
    return ok


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def _train(codec: str, overlap: bool, steps: int = 5) -> tuple[list[torch.Tensor], dict]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(_Net().cuda(), device_ids=[0], bucket_cap_mb=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # a codec that reads the optimizer (GComp's thresholds, DynamiQ's step sizes) gets it
    state = hopq.HookState(codec=codec, overlap=overlap, optimizer=opt if _reads(codec) else None)
    state.measure_error = True
    state.error_optimizer = opt
    model.register_comm_hook(state, hopq.ddp_hook)
    gen = torch.Generator(device="cuda").manual_seed(1)
    calls, errors = 0, []
    for _ in range(steps):
        x = torch.randn(64, 1024, device="cuda", generator=gen)
        opt.zero_grad()
        model(x).backward()
        opt.step()
        m = state.pop_step()
        calls += m.buckets
        errors.append((m.vnmse, m.update_vnmse))
    torch.cuda.synchronize()
    info: dict = {"calls": calls, "errors": errors}
    if overlap:  # the thread's group: on NCCL one of its own (HookState's own_group)
        from hopq.integrations.ddp import thread_group

        grp = thread_group(state)
        info["group"] = (  # one rank sends nothing: the group is made, not used
            "DDP's"
            if grp is None or grp is dist.group.WORLD
            else f"own, made ({dist.get_backend(grp)})"
        )
    state.close()
    return [p.detach().clone() for p in model.parameters()], info


def check_hook(lines: list[str]) -> bool:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    import datetime
    import warnings

    from hopq.comm.transport import NCCL_TIMEOUT_SHARE, DistTransport

    dist.init_process_group(
        "nccl",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda:0"),
        timeout=datetime.timedelta(seconds=200),
    )
    ok = True
    # a call's default timeout on NCCL: the share of the group's own, read from
    # the real ProcessGroupNCCL's options (the tests can only fake that object)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            got = DistTransport(None).timeout_s
        except Exception as e:
            got, err = -1.0, f"{type(e).__name__}: {e}"
        else:
            err = ""
    want = 200 * NCCL_TIMEOUT_SHARE
    same = abs(got - want) < 1e-6
    ok &= same
    lines += [
        "## A call's default timeout on NCCL",
        "",
        f"group created with timeout=200 s; hopq's default call timeout: {got:g} s "
        f"(expected {want:g}) {'yes' if same else '**NO** ' + err}",
        "",
    ]
    print(lines[-2], flush=True)
    lines += [
        "## The DDP hook on a single-rank NCCL group (CUDA parameters)",
        "",
        "| codec | overlapped == synchronous (bits, measured errors) | hook calls "
        "| kernels under auto "
        "| the thread's group |",
        "|---|---|---:|---|---|",
    ]
    try:
        for codec in [c for c in available_codecs() if "cuda" in codec_info(c).devices]:
            try:
                a, ia = _train(codec, overlap=True)
                b, ib = _train(codec, overlap=False)
                same = all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b, strict=True))
                same &= _same_floats(ia["errors"], ib["errors"])  # measured alike
                k = get_codec(codec)
                kern = getattr(k, "kernels", None)
                mod = kern(torch.device("cuda")) if callable(kern) else None
                kname = mod.__name__.rsplit(".", 1)[-1] if mod is not None else "reference"
                ok &= same and ia["calls"] > 0
                ok &= ia["group"].startswith("own")
                row = [codec, "yes" if same else "**NO**", str(ia["calls"]), kname, ia["group"]]
            except Exception as e:
                ok = False
                row = [codec, f"**error**: {type(e).__name__}: {str(e)[:160]}", "", "", ""]
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
    finally:
        dist.destroy_process_group()
    lines.append("")
    return ok


_OPTIMIZERS = {
    "SGD, weight decay": lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=1e-2),
    "SGD, momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1),
    "Nesterov": lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "Adam, weight decay": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=1e-2),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2),
}


def check_thresholds(lines: list[str], dev: str = "cuda") -> bool:
    """GComp's thresholds |A| from an optimizer's state on ``dev`` against the
    same parameters and state moved to the CPU (bits, and the share that differ)."""
    from hopq.codecs.dynamiq.optim import step_sizes
    from hopq.codecs.gcomp.optim import thresholds

    lines += [
        "## GComp's thresholds and DynamiQ's step sizes from the optimizer's state: "
        + dev
        + " against the CPU",
        "",
        "| optimizer | coordinates | thresholds differing | largest relative difference "
        "| step sizes differing |",
        "|---|---:|---:|---:|---:|",
    ]
    ok = True
    for name, make in _OPTIMIZERS.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(512, 1000), torch.nn.Linear(1000, 333), torch.nn.Linear(333, 7)
        ).to(dev)
        opt = make(list(model.parameters()))
        gen = torch.Generator(device=dev).manual_seed(2)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(32, 512, device=dev, generator=gen)).square().mean().backward()
            opt.step()
        cpu = copy.deepcopy(model).cpu()
        ocpu = make(list(cpu.parameters()))
        ocpu.load_state_dict(opt.state_dict())  # the state follows the CPU parameters
        a = thresholds(opt, list(model.parameters())).cpu()
        b = thresholds(ocpu, list(cpu.parameters()))
        diff = ~torch.eq(_bits(a), _bits(b))
        rel = ((a - b).abs() / b.abs().clamp_min(1e-30))[diff]
        worst = f"{rel.max().item():.2e}" if rel.numel() else "0"
        ok &= bool(torch.isfinite(a).all())
        ra = step_sizes(opt, list(model.parameters()))
        rb = step_sizes(ocpu, list(cpu.parameters()))
        if ra is None or rb is None:  # SGD with one learning rate: no weights at all
            rcell = "none (uniform)" if ra is None and rb is None else "**one side None**"
            ok &= ra is None and rb is None
        else:
            rdiff = int((~torch.eq(_bits(ra.cpu()), _bits(rb))).sum())
            ok &= rdiff == 0 and bool(torch.isfinite(ra).all())
            rcell = f"{rdiff:,}"
        lines.append(f"| {name} | {a.numel():,} | {int(diff.sum()):,} | {worst} | {rcell} |")
        print(lines[-1], flush=True)
    lines.append("")
    return ok


def profile(name: str, n: int, world: int) -> None:
    """Where one ``hopq.simulate`` call of ``name`` spends its time on CUDA (the
    Python side: kernel launches and host synchronizations show up here)."""
    import cProfile
    import pstats

    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=gen).cuda() for _ in range(world)]
    codec = get_codec(name)
    hopq.simulate(xs, codec, "ring", seed=1)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    hopq.simulate(xs, codec, "ring", seed=1)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def _cluster_part(world: int, d: int, lines: list[str], summary: list[list[str]], dev: str) -> bool:
    """:func:`check_cluster`; an error that stops it (a rank that crashed) is
    reported in the section and the summary, so that the other parts' results
    are still written."""
    import traceback

    try:
        return check_cluster(world, d, lines, summary, dev)
    except Exception as e:  # noqa: BLE001 - reported, the run fails
        tail = traceback.format_exc().strip().splitlines()[-12:]
        lines += ["## The cluster part stopped", "", "```", *tail, "```", ""]
        print("\n".join(lines[-len(tail) - 4 :]), flush=True)
        summary.append(["cluster part", f"**stopped: {type(e).__name__}: {str(e)[:200]}**"])
        return False


def _print_summary(summary: list[list[str]], ok: bool) -> None:
    """The cluster part's results, shortest, printed last (a run's output tail)."""
    if not summary:
        return
    print("\nSummary of the cluster part:\n")
    print("| check | result |\n|---|---|")
    for what, result in summary:
        print(f"| {what} | {result} |")
    print(f"\nall checks of this run passed: {'yes' if ok else 'NO'}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--n", type=int, default=1 << 22)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--skip-hook", action="store_true")
    p.add_argument(
        "--profile", metavar="CODEC", help="only profile one simulate call of CODEC on CUDA"
    )
    p.add_argument("--only-gloo", action="store_true", help="only the Gloo ranks' sections")
    p.add_argument("--only-fsdp", action="store_true", help="only the FSDP2 section")
    p.add_argument(
        "--only-cluster",
        action="store_true",
        help="only the two-tier, direct and codec='auto' checks on Gloo ranks of the GPU",
    )
    p.add_argument(
        "--cluster-n", type=int, default=1 << 18, help="coordinates per rank of the cluster part"
    )
    p.add_argument("--only-hook", action="store_true", help="only the NCCL hook section")
    p.add_argument(
        "--only-thresholds", action="store_true", help="only GComp's thresholds on CUDA vs CPU"
    )
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the engine-paths table with the CPU standing in for CUDA (checks the script)",
    )
    args = p.parse_args()
    # the report's folder, made here: a run of minutes must not end unwritten
    Path(args.out).mkdir(parents=True, exist_ok=True)
    summary: list[list[str]] = []
    if args.cpu_dry_run:
        lines: list[str] = []
        if args.only_cluster:
            ok = _cluster_part(args.world, args.cluster_n, lines, summary, "cpu")
        else:
            ok = check_variants(args.n // 4, args.world, lines, dev="cpu")
            ok &= check_gloo(args.world, args.n // 16, lines, dev="cpu")
            ok &= check_fsdp(args.world, lines, dev="cpu")
            ok &= check_thresholds(lines, dev="cpu")
            ok &= _cluster_part(args.world, args.cluster_n, lines, summary, "cpu")
        print("\n".join(lines))
        _print_summary(summary, ok)
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    if args.profile:
        profile(args.profile, args.n, args.world)
        return 0
    lines = [
        f"# hopq on {torch.cuda.get_device_name(0)}",
        "",
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}",
        "",
    ]
    if args.only_thresholds:
        ok = check_thresholds(lines)
        (Path(args.out) / "gpu_check.md").write_text("\n".join(lines) + "\n")
        return 0 if ok else 1
    if args.only_hook:
        ok = check_hook(lines)
        (Path(args.out) / "gpu_check.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0 if ok else 1
    if args.only_fsdp:
        ok = check_fsdp(args.world, lines)
        (Path(args.out) / "gpu_check.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0 if ok else 1
    if args.only_cluster:
        ok = _cluster_part(args.world, args.cluster_n, lines, summary, "cuda")
        (Path(args.out) / "gpu_check.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        _print_summary(summary, ok)
        return 0 if ok else 1
    if args.only_gloo:
        ok = check_gloo(args.world, args.n // 16, lines)
        ok &= check_fsdp(args.world, lines)
        out = Path(args.out) / "gpu_check.md"
        out.write_text("\n".join(lines) + "\n")
        return 0 if ok else 1
    ok = check_codecs(args.n, args.world, lines)
    ok &= check_thresholds(lines)
    ok &= check_variants(args.n // 4, args.world, lines)
    ok &= check_gloo(args.world, args.n // 16, lines)
    ok &= check_fsdp(args.world, lines)
    ok &= _cluster_part(args.world, args.cluster_n, lines, summary, "cuda")
    if not args.skip_hook:
        ok &= check_hook(lines)
    out = Path(args.out) / "gpu_check.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _print_summary(summary, ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
