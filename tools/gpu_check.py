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
   same state on the CPU (SGD, momentum, Nesterov, Adam, AdamW).

Two NCCL ranks cannot share one GPU: the multi-rank NCCL transport stays
unverified by this script (Gloo ranks can, and do). Writes ``gpu_check.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
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


def _gloo_fsdp(rank: int, n: int, names: list[str], dev: str) -> dict[str, object]:
    """FSDP2 (``fully_shard`` per Linear, a ``dev`` device mesh over the Gloo group)
    with hopq's reduce-scatter (or native, name "native"), AdamW, 3 steps (GComp
    and DynamiQ with ``optimizer=``): each rank's first reduce-scatter (key, input, output,
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
                extra: dict = {"optimizer": opt} if _reads(name) else {}
                if hasattr(get_codec(name), "set_thresholds"):
                    extra["thresholds_every"] = 1
                comm = Capturing(name, "ring", seed=7, **extra)
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
    if args.cpu_dry_run:
        lines: list[str] = []
        ok = check_variants(args.n // 4, args.world, lines, dev="cpu")
        ok &= check_gloo(args.world, args.n // 16, lines, dev="cpu")
        ok &= check_fsdp(args.world, lines, dev="cpu")
        ok &= check_thresholds(lines, dev="cpu")
        print("\n".join(lines))
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
    if not args.skip_hook:
        ok &= check_hook(lines)
    out = Path(args.out) / "gpu_check.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
