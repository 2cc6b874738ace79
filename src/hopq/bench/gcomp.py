"""``hopq bench gcomp``: GComp's compressed size over training (the paper's
Fig. 9), its exponent stream with a static vs a periodically rebuilt code table
(Fig. 13a), and its CPU kernels' throughput.

**Sizes.** A workload (:mod:`hopq.train.workloads`) trains ``steps`` steps on
one process with SGD (momentum) and with AdamW; every step the gradients of
``workers`` simulated workers (each its own micro-batch) are averaged, and that
averaged gradient is what the step applies and what is compressed: the
optimizer's per-coordinate thresholds are computed from its state before the
step, exactly as ``HookState(codec="gcomp", optimizer=opt)`` does, and the
gradient goes through GComp's leaf encoder (one payload per 16M coordinates,
chunks of 65536 values, headers included). Recorded per step: payload bytes /
fp32 bytes with the optimizer's thresholds (Fig. 9), without them (lossless but
for zeros), the share of each stream (exponents, levels, mantissas), and the
exponent stream's bits / 32 bits per coordinate with a table built at step 0
and never again ("static") vs rebuilt every ``rebuild_every`` steps (Fig.
13a). A rebuilt table is fitted to the gradient of the step that rebuilds it
(hopq builds it from that call's histogram).

What this is not: the bytes of a ring all-reduce (inner hops carry partial
sums, ``hopq.simulate`` counts those), and the training applies the exact
averaged gradient (the compressed one differs by bits the optimizer's update
loses; see docs/codecs/gcomp.md).

**Loss (section 7.6).** The same workload, initial weights and micro-batches
trained four ways with ``workers`` simulated workers: ``fp32`` (the exact
average), ``gcomp`` (the workers' gradients all-reduced by GComp on a ring in
``hopq.simulate``, the optimizer's thresholds set before each step as the DDP
hook does), ``truncate-18`` (the paper's quantization baseline: GComp with
``fixed_level=3``, 18 mantissa bits dropped from every value at every hop) and
``periodic`` (its sparsification baseline, read as periodic synchronization:
each worker steps on its own gradient and the workers' parameters are averaged
every ``sync_every``-th step). Reported: each method's loss minus fp32's loss at
the same step (the mean over workers of the micro-batch losses), its mean
absolute value and its variance over the steps; the paper's claim is that GComp
cuts the baselines' average deviation by 73.6-96.8%.

**Bias.** Every hop truncates its own partial sum (docs/codecs/gcomp.md):
``workers`` simulated ranks of ``bias_coords`` N(0, 1e-3) coordinates each,
thresholds A = |exact average| 2^U(0,24) per coordinate, GComp averaged on ring
and butterfly with those thresholds and without them (lossless but for zeros,
the additions in the same order); the difference of the two outputs is the
truncation's error, reported in units of the paper's allowance 2^-23 |A| (one
truncation of the averaged gradient): its mean (signed by the exact average's
sign; negative: toward zero), its largest magnitude and the number of
coordinates beyond the allowance.

**Kernels.** Encode, decode, decode-accumulate and the fused hop of
``n`` synthetic gradient coordinates (log-normal magnitudes, 30% zeros) on one
core, with no truncation, with thresholds (|A| = |x| 2^U(0,24)) and with
``fixed_level=3``; coordinates per second (median of ``repeats``).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hopq.bench.kernels import one_thread
from hopq.bench.quality import set_grad
from hopq.codecs.base import HopContext, LocalStats
from hopq.codecs.gcomp import GComp
from hopq.codecs.gcomp import format as fmt
from hopq.codecs.gcomp.optim import thresholds
from hopq.options import check_scoped, option
from hopq.reporting import machine, markdown_table, pyplot, save_figure
from hopq.train.workloads import WORKLOADS

PARTS = ("kernels", "bias", "sizes", "loss")
#: Section 7.6's methods: GComp against its two lossy baselines.
LOSS_METHODS = ("fp32", "gcomp", "truncate-18", "periodic")
OPTIMIZERS = ("sgd", "adamw")
#: Values per payload: a long gradient goes as several payloads (the plan's chunks).
SEGMENT = 1 << 24


@dataclass(frozen=True)
class GCompBenchOptions:
    parts: tuple[str, ...] = option(PARTS, "what to measure", choices=PARTS)
    workloads: tuple[str, ...] = option(
        ("gpt", "minilm", "minilm-cls"),
        "workloads whose gradients are compressed",
        choices=tuple(WORKLOADS),
    )
    optimizers: tuple[str, ...] = option(OPTIMIZERS, "optimizers", choices=OPTIMIZERS)
    steps: int = option(200, "training steps per workload and optimizer")
    workers: int = option(4, "simulated workers whose gradients are averaged each step")
    batch: int = option(4, "sequences per worker")
    rebuild_every: int = option(50, "steps between table rebuilds (paper: 50)")
    sgd_lr: float = option(0.01, "SGD's learning rate (momentum 0.9)")
    adamw_lr: float = option(0.0, "AdamW's learning rate; 0: the workload's default")
    gpt_dim: int = option(256, "the GPT's width")
    gpt_layers: int = option(4, "the GPT's layers")
    context: int = option(128, "tokens per sequence")
    kernel_coords: int = option(1 << 22, "coordinates of the kernel timings")
    bias_coords: int = option(200_000, "coordinates per simulated rank of part bias")
    repeats: int = option(5, "timed kernel repetitions (median) after a warm-up")
    seed: int = option(0, "seed of the weights and the data")
    plot: str = option("runs/gcomp/gcomp_size.png", "size plot (PNG); empty: none")
    loss_plot: str = option(
        "runs/gcomp/gcomp_loss.png", "loss-deviation plot of part loss (PNG); empty: none"
    )
    sync_every: int = option(8, "the sparse baseline's period (paper: every 8th iteration)")

    def __post_init__(self) -> None:
        bad = set(self.parts) - set(PARTS)
        if bad:
            raise ValueError(f"unknown parts {sorted(bad)}; choose from {PARTS}")
        bad = set(self.workloads) - set(WORKLOADS)
        if bad:
            raise ValueError(f"unknown workloads {sorted(bad)}; choose from {sorted(WORKLOADS)}")
        bad = set(self.optimizers) - set(OPTIMIZERS)
        if bad:
            raise ValueError(f"unknown optimizers {sorted(bad)}; choose from {OPTIMIZERS}")
        for name in ("steps", "workers", "batch", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1")
        if self.rebuild_every < 1:
            raise ValueError("--rebuild-every must be at least 1")
        if self.kernel_coords < 1:
            raise ValueError("--kernel-coords must be at least 1")
        if self.bias_coords < 1:
            raise ValueError("--bias-coords must be at least 1")
        if self.sync_every < 2:
            raise ValueError("--sync-every must be at least 2")
        training = ["workloads", "optimizers", "steps", "workers", "batch", "rebuild_every"]
        training += ["sgd_lr", "adamw_lr", "gpt_dim", "gpt_layers", "context"]
        check_scoped(
            self,
            {
                "kernel_coords": ("kernels",),
                "repeats": ("kernels",),
                "bias_coords": ("bias",),
                "plot": ("sizes",),
                "loss_plot": ("loss",),
                "sync_every": ("loss",),
                **dict.fromkeys(training, ("sizes", "loss")),
                "workers": ("bias", "sizes", "loss"),
            },
            self.parts,
            "--parts",
        )
        check_scoped(
            self, {"sgd_lr": ("sgd",), "adamw_lr": ("adamw",)}, self.optimizers, "--optimizers"
        )
        check_scoped(
            self, {"gpt_dim": ("gpt",), "gpt_layers": ("gpt",)}, self.workloads, "--workloads"
        )


# -- kernels -----------------------------------------------------------------


def synthetic(n: int, seed: int = 0, zeros: float = 0.3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2) * 1e-3
    x[torch.rand(n, generator=g) < zeros] = 0
    return x


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: compilation, caches
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _kernel_speeds(
    x: torch.Tensor, fixed: int, thr: torch.Tensor | None, repeats: int
) -> tuple[float, list[float]]:
    """(size / fp32, [encode, decode, decode-accumulate, fused hop] coordinates/s)."""
    n = x.numel()
    codec = GComp(fixed_level=fixed, backend="cpu")
    if thr is not None:
        codec.set_thresholds(thr, key=0)
    plan = codec.plan(x, LocalStats(n_chunks=1, key=0))
    ctx = HopContext(0, 0, 0, 1, 0, 2)
    payload = codec.encode(plan, x, ctx)
    out = torch.empty_like(x)
    acc = x.clone()
    local = x.clone()

    def hop() -> object:
        local.copy_(x)  # the hop overwrites its local chunk with the sum
        return codec.decode_accumulate_encode(plan, payload, local, ctx)

    t_copy = _median_time(lambda: local.copy_(x), repeats)
    speeds = [
        n / _median_time(lambda: codec.encode(plan, x, ctx), repeats),
        n / _median_time(lambda: codec.decode(plan, payload, ctx, out), repeats),
        n / _median_time(lambda: codec.decode_accumulate(plan, payload, acc, ctx), repeats),
        n / max(_median_time(hop, repeats) - t_copy, 1e-9),  # the copy left out
    ]
    return payload.numel() / (4 * n), speeds


def kernel_rows(n: int, repeats: int, seed: int = 0) -> list[list[Any]]:
    """[mode, size / fp32, encode, decode, decode-accumulate, fused hop] (M coords/s)."""
    with one_thread():
        x = synthetic(n, seed)
        u = torch.rand(n, generator=torch.Generator().manual_seed(seed + 1)) * 24
        thr = x.abs() * torch.exp2(u)
        rows: list[list[Any]] = []
        for mode, fixed, th in (("none", -1, None), ("thresholds", -1, thr), ("fixed 3", 3, None)):
            size, speeds = _kernel_speeds(x, fixed, th, repeats)
            rows.append([mode, f"{size:.3f}", *(f"{s / 1e6:.0f}" for s in speeds)])
        rows.append(
            ["torch fp16 cast", "0.500", *(f"{s / 1e6:.0f}" for s in _fp16_speeds(x, repeats))]
        )
        return rows


def real_kernel_rows(label: str, sr: SizeRun, repeats: int) -> list[list[Any]]:
    """The kernels on a sizes run's last averaged gradient: with its optimizer's
    thresholds, without truncation, and torch's fp16 cast on the same values."""
    x = sr.last_grad
    zeros = f"{float((x == 0).float().mean()):.1%}"
    rows: list[list[Any]] = []
    with one_thread():
        modes = [("thresholds", sr.last_thresholds)] if sr.last_thresholds is not None else []
        for mode, th in [*modes, ("none", None)]:
            size, speeds = _kernel_speeds(x, -1, th, repeats)
            rows.append([label, mode, zeros, f"{size:.3f}", *(f"{v / 1e6:.0f}" for v in speeds)])
        rows.append(
            [label, "torch fp16 cast", zeros, "0.500"]
            + [f"{v / 1e6:.0f}" for v in _fp16_speeds(x, repeats)]
        )
    return rows


def bias_rows(n: int, world: int, seed: int = 0) -> list[list[Any]]:
    """Part bias (see the module's docstring): one row per topology."""
    import hopq

    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=gen) * 1e-3 for _ in range(world)]
    exact = torch.stack(xs).double().mean(0)
    a = (exact.abs() * torch.exp2(torch.rand(n, generator=gen) * 24)).float()
    allow = a.double() * 2.0**-23
    keep = allow > 0
    rows: list[list[Any]] = []
    for topo in ("ring", "butterfly"):
        plain = hopq.simulate(xs, GComp(), topo, seed=seed, op="avg")
        cut_codec = GComp()
        cut_codec.set_thresholds(a)
        cut = hopq.simulate(xs, cut_codec, topo, seed=seed, op="avg")
        err = (cut.outputs[0].double() - plain.outputs[0].double())[keep] / allow[keep]
        err = err * exact[keep].sign()  # negative: toward zero
        rows.append(
            [
                topo,
                f"{err.mean().item():+.3f}",
                f"{err.abs().max().item():.3f}",
                int((err.abs() > 1).sum()),
                f"{cut.bits_per_coord / 32:.3f}",
                f"{plain.bits_per_coord / 32:.3f}",
            ]
        )
    return rows


def _ratio(rows: list[list[Any]]) -> str:
    """GComp's fused hops over torch's fp16 one (the last row), as a range."""
    ref = float(rows[-1][-1])
    rs = [float(r[-1]) / ref for r in rows[:-1]] if ref > 0 else []
    return f"{min(rs):.2f}-{max(rs):.2f}x" if rs else "n/a"


def _fp16_speeds(x: torch.Tensor, repeats: int) -> list[float]:
    """What torch users have, in the same run: ``fp16_compress_hook``'s codec
    (a cast to float16 and back), as [encode, decode, decode-accumulate, fused
    hop] coordinates/s."""
    n = x.numel()
    payload = x.to(torch.float16)
    out = torch.empty_like(x)
    acc = x.clone()
    local = x.clone()

    def hop() -> object:
        local.copy_(x)
        local.add_(payload)
        return local.to(torch.float16)

    t_copy = _median_time(lambda: local.copy_(x), repeats)
    return [
        n / _median_time(lambda: x.to(torch.float16), repeats),
        n / _median_time(lambda: out.copy_(payload), repeats),
        n / _median_time(lambda: acc.add_(payload), repeats),
        n / max(_median_time(hop, repeats) - t_copy, 1e-9),
    ]


# -- sizes over training -------------------------------------------------------


@dataclass
class StepSizes:
    step: int
    loss: float
    #: payload bytes / fp32 bytes with the optimizer's thresholds, and without
    size: float
    lossless: float
    #: bits per coordinate of each stream (with thresholds, rebuilt table)
    exp_bits: float
    level_bits: float
    mant_bits: float
    #: exponent-stream bits per coordinate with the static table
    exp_static: float
    zeros: float


def _encode_sizes(
    codec: GComp, x: torch.Tensor, thr: torch.Tensor | None
) -> tuple[int, int, int, int]:
    """(payload bytes, exponent bits, level bits, mantissa bits) of x's leaf
    encoding (one payload per SEGMENT values); advances the codec's table."""
    codec.set_thresholds(thr, key=0)
    plan = codec.plan(x, LocalStats(n_chunks=-(-x.numel() // SEGMENT), key=0))
    total = eb = lb = mb = 0
    for c, (s, e) in enumerate(plan.chunks):
        p = codec.encode(plan, x[s:e], HopContext(0, 0, c, 1, 0, 2))
        heads = fmt.parse(
            p, e - s, plan.table.table_id, plan.table.n_theta, codec.config.chunk_values
        )
        total += p.numel()
        eb += int(heads[:, 4].sum())
        lb += 2 * int(heads[:, 3].sum())
        mb += int(heads[:, 5].sum())
    codec.end_round(plan)
    return total, eb, lb, mb


@dataclass
class SizeRun:
    steps: list[StepSizes]
    description: str
    #: the last step's averaged gradient and the optimizer's thresholds for it
    last_grad: torch.Tensor
    last_thresholds: torch.Tensor | None


def train_sizes(
    o: GCompBenchOptions, workload: str, optimizer: str, say: Callable[[str], None]
) -> SizeRun:
    from hopq.train import workloads

    kw = {"dim": o.gpt_dim, "layers": o.gpt_layers} if workload == "gpt" else {}
    wl = workloads.make(workload, o.seed, context=o.context, **kw)
    params: list[torch.Tensor] = [p for p in wl.model.parameters() if p.requires_grad]
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=o.sgd_lr, momentum=0.9)
        what = f"SGD (lr {o.sgd_lr:g}, momentum 0.9)"
    else:
        lr = o.adamw_lr or wl.lr
        opt = torch.optim.AdamW(params, lr=lr)
        what = f"AdamW (lr {lr:g}, weight decay 0.01)"
    rebuilt = GComp(rebuild_every=o.rebuild_every)
    static = GComp(rebuild_every=0)
    lossless = GComp(rebuild_every=o.rebuild_every)
    out = []
    thr_s: list[float] = []
    n = sum(p.numel() for p in params)
    t0 = time.perf_counter()
    for step in range(o.steps):
        grads = []
        losses = []
        for r in range(o.workers):
            wl.model.zero_grad()
            loss = wl.loss(wl.model, wl.batch(o.seed, r, step, o.batch))
            loss.backward()
            losses.append(loss.item())
            grads.append(workloads.flat_grad(wl.model))
        g = torch.stack(grads).mean(0)
        with one_thread():  # timed on one core, as the hook's thread computes them
            t_thr = time.perf_counter()
            thr = thresholds(opt, params)  # before the step: what the DDP hook does
            thr_s.append(time.perf_counter() - t_thr)
        nb, eb, lb, mb = _encode_sizes(rebuilt, g, thr)
        ll = _encode_sizes(lossless, g, None)[0]
        se = _encode_sizes(static, g, thr)[1]
        out.append(
            StepSizes(
                step,
                sum(losses) / len(losses),
                nb / (4 * n),
                ll / (4 * n),
                eb / n,
                lb / n,
                mb / n,
                se / n,
                float((g == 0).float().mean()),
            )
        )
        set_grad(params, g)
        opt.step()
        if step % 10 == 0 or step == o.steps - 1:
            s = out[-1]
            say(
                f"  {workload}/{optimizer} step {step}: loss {s.loss:.3f}, size {s.size:.1%} "
                f"(lossless {s.lossless:.1%}), exponents {s.exp_bits / 32:.1%} "
                f"(static {s.exp_static / 32:.1%}), {time.perf_counter() - t0:.0f} s"
            )
    desc = (
        f"{wl.description}; {n:,} coordinates, {what}, {o.workers} workers x {o.batch} "
        f"sequences averaged per step; the optimizer's thresholds took "
        f"{statistics.median(thr_s):.3f} s per step on one core (median)"
    )
    return SizeRun(out, desc, g, thr)


# -- loss deviation (section 7.6) ------------------------------------------------


def train_losses(
    o: GCompBenchOptions, workload: str, optimizer: str, method: str, say: Callable[[str], None]
) -> list[float]:
    """Per-step training loss (mean over workers) of one method of section 7.6."""
    from hopq.bench.quality import SimTraining, train

    cfg = SimTraining(
        workload=workload, optimizer=optimizer, steps=o.steps, workers=o.workers,
        batch=o.batch, seed=o.seed, topology="ring", sgd_lr=o.sgd_lr, adamw_lr=o.adamw_lr,
        gpt_dim=o.gpt_dim, gpt_layers=o.gpt_layers, context=o.context,
    )  # fmt: skip
    label = f"{workload}/{optimizer}/{method}"
    if method == "fp32":
        return train(cfg, None, say=say, label=label).losses
    if method == "periodic":
        return train(cfg, None, sync_every=o.sync_every, say=say, label=label).losses
    fixed = 3 if method == "truncate-18" else -1
    codec = GComp(rebuild_every=o.rebuild_every, fixed_level=fixed)
    return train(cfg, codec, thresholds=method == "gcomp", say=say, label=label).losses


def loss_section(
    o: GCompBenchOptions, say: Callable[[str], None]
) -> tuple[str, dict[tuple[str, str], dict[str, list[float]]]]:
    curves: dict[tuple[str, str], dict[str, list[float]]] = {}
    rows = []
    for w in o.workloads:
        for opt in o.optimizers:
            say(f"section 7.6: {w} with {opt}, {o.steps} steps, four methods ...")
            c = {m: train_losses(o, w, opt, m, say) for m in LOSS_METHODS}
            curves[(w, opt)] = c
            base = c["fp32"]
            dev = {m: [a - b for a, b in zip(c[m], base, strict=True)] for m in LOSS_METHODS[1:]}
            mad = {m: _mean([abs(v) for v in d]) for m, d in dev.items()}
            var = {m: statistics.pvariance(d) for m, d in dev.items()}
            cut_q = (
                1 - mad["gcomp"] / mad["truncate-18"] if mad["truncate-18"] > 0 else float("nan")
            )
            cut_s = 1 - mad["gcomp"] / mad["periodic"] if mad["periodic"] > 0 else float("nan")
            rows.append(
                [
                    w,
                    opt,
                    f"{base[-1]:.4f}",
                    *(f"{mad[m]:.2e}" for m in LOSS_METHODS[1:]),
                    *(f"{var[m]:.2e}" for m in LOSS_METHODS[1:]),
                    f"{cut_q:.2%}",
                    f"{cut_s:.2%}",
                ]
            )
    header = [
        "workload",
        "optimizer",
        "fp32 final loss",
        *(f"mean abs dev. {m}" for m in LOSS_METHODS[1:]),
        *(f"dev. variance {m}" for m in LOSS_METHODS[1:]),
        "GComp's cut vs truncate-18",
        f"vs periodic (every {o.sync_every} steps)",
    ]
    text = (
        "## Loss deviation from the uncompressed run (section 7.6)\n\n"
        f"{o.workers} workers x {o.batch} sequences, {o.steps} steps from the same weights and "
        "micro-batches; deviation = the method's training loss minus fp32's at the same step "
        "(mean over workers). 'truncate-18': 18 mantissa bits dropped from every value at every "
        f"hop; 'periodic': local steps, parameters averaged every {o.sync_every} "
        "steps. Cut = 1 - GComp's mean absolute deviation / the baseline's. Paper: 73.6-93.1% vs "
        "quantization, 77.4-96.8% vs sparsification (ResNet-50, BERT-base).\n\n"
        + markdown_table(header, rows)
    )
    return text, curves


def plot_losses(
    curves: dict[tuple[str, str], dict[str, list[float]]], path: Path, sync_every: int
) -> Path | None:
    plt = pyplot()
    if plt is None or not curves:
        return None
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False)
    for ax, ((w, opt), c) in zip(axes[0], curves.items(), strict=True):
        base = c["fp32"]
        for m in LOSS_METHODS[1:]:
            label = f"periodic ({sync_every} steps)" if m == "periodic" else m
            ax.plot([a - b for a, b in zip(c[m], base, strict=True)], label=label)
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_title(f"{w} / {opt}: loss - fp32 loss")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def run(o: GCompBenchOptions, log: Callable[[str], None] | None = None) -> str:
    def _stderr(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    say: Callable[[str], None] = log or _stderr
    torch.manual_seed(o.seed)
    sections = [f"Machine: {machine()}\n"]
    if "kernels" in o.parts:
        say(f"kernels on {o.kernel_coords:,} coordinates ...")
        rows = kernel_rows(o.kernel_coords, o.repeats, o.seed)
        sections.append(
            f"## Kernels (one core, {o.kernel_coords:,} synthetic coordinates: log-normal "
            "magnitudes, 30% zeros; M coordinates/s, median of "
            f"{o.repeats}; on a shared machine: indicative)\n\n"
            + markdown_table(
                ["truncation", "size / fp32", "encode", "decode", "decode+acc", "fused hop"], rows
            )
            + "\n\n'torch fp16 cast' is the codec of torch's `fp16_compress_hook` (a cast to "
            "float16 and back, no compression beyond it) timed the same way in the same run; "
            f"GComp's fused hop runs at {_ratio(rows)} of its speed.\n"
        )
    if "bias" in o.parts:
        say(f"truncation bias on {o.workers} simulated ranks ...")
        sections.append(
            f"## Bias of per-hop truncation ({o.workers} simulated ranks, {o.bias_coords:,} "
            "coordinates each)\n\nThe averaged output with thresholds minus the one without "
            "(the same additions), in units of the allowance 2^-23 |A| per coordinate, signed "
            "by the exact average's sign (negative: toward zero); "
            "'size': payload bytes / fp32 bytes over the call, with thresholds and without.\n\n"
            + markdown_table(
                [
                    "topology",
                    "mean error",
                    "largest |error|",
                    "beyond allowance",
                    "size",
                    "lossless",
                ],
                bias_rows(o.bias_coords, o.workers, o.seed),
            )
        )
    if "sizes" in o.parts:
        runs: dict[tuple[str, str], list[StepSizes]] = {}
        descs = []
        real: list[list[Any]] = []
        for w in o.workloads:
            for opt in o.optimizers:
                say(f"training {w} with {opt} for {o.steps} steps ...")
                sr = train_sizes(o, w, opt, say)
                runs[(w, opt)] = sr.steps
                descs.append(f"- **{w} / {opt}**: {sr.description}")
                if "kernels" in o.parts:
                    say(f"kernels on {w} / {opt}'s last gradient ...")
                    real += real_kernel_rows(f"{w} / {opt}", sr, o.repeats)
                del sr
        header = [
            "workload",
            "optimizer",
            "size / fp32",
            "last step",
            "lossless",
            "exponents",
            "levels",
            "mantissas",
            f"exp. static -> rebuilt/{o.rebuild_every}",
            "zeros",
        ]
        rows = []
        for (w, opt), ss in runs.items():
            rows.append(
                [
                    w,
                    opt,
                    f"{_mean([s.size for s in ss]):.1%}",
                    f"{ss[-1].size:.1%}",
                    f"{_mean([s.lossless for s in ss]):.1%}",
                    f"{_mean([s.exp_bits for s in ss]) / 32:.1%}",
                    f"{_mean([s.level_bits for s in ss]) / 32:.1%}",
                    f"{_mean([s.mant_bits for s in ss]) / 32:.1%}",
                    f"{_mean([s.exp_static for s in ss]) / 32:.1%} -> "
                    f"{_mean([s.exp_bits for s in ss]) / 32:.1%}",
                    f"{_mean([s.zeros for s in ss]):.1%}",
                ]
            )
        sections.append(
            "## Compressed size over training (Fig. 9) and exponent stream (Fig. 13a)\n\n"
            + "\n".join(descs)
            + "\n\nMeans over the steps of payload bytes / fp32 bytes (headers included) "
            "with the optimizer's thresholds; 'lossless': without them; the streams' "
            "shares of the fp32 size; exponents with a static table (built at step 0) "
            f"vs rebuilt every {o.rebuild_every} steps. Paper: 32.9% (ResNet-50), 36.5% "
            "(BERT-base); exponents 14.5% -> 11.6%.\n\n" + markdown_table(header, rows)
        )
        if o.plot:
            path = plot_sizes(runs, Path(o.plot))
            if path is not None:
                sections.append(f"Plot: `{path}`")
        if real:
            sections.append(
                "## Kernels on the real gradients (one core; the last step's averaged "
                f"gradient of each run above, whole; M coordinates/s, median of {o.repeats})\n\n"
                "The same kernels and timing as the synthetic table, on what the sizes part "
                "compresses: the run's last averaged gradient with its optimizer's thresholds "
                "(as the DDP hook sets them) and without truncation; the fused hop decodes "
                "that gradient's payload onto the gradient itself. 'torch fp16 cast' is timed "
                "on the same gradient.\n\n"
                + markdown_table(
                    [
                        "gradient",
                        "truncation",
                        "zeros",
                        "size / fp32",
                        "encode",
                        "decode",
                        "decode+acc",
                        "fused hop",
                    ],
                    real,
                )
            )
    if "loss" in o.parts:
        text, curves = loss_section(o, say)
        sections.append(text)
        if o.loss_plot:
            path = plot_losses(curves, Path(o.loss_plot), o.sync_every)
            if path is not None:
                sections.append(f"Plot: `{path}`")
    return "\n\n".join(sections) + "\n"


def plot_sizes(runs: dict[tuple[str, str], list[StepSizes]], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for (w, opt), ss in runs.items():
        steps = [s.step for s in ss]
        (line,) = a.plot(steps, [100 * s.size for s in ss], label=f"{w} / {opt}")
        a.plot(steps, [100 * s.lossless for s in ss], ls=":", color=line.get_color())
        (line,) = b.plot(steps, [100 * s.exp_bits / 32 for s in ss], label=f"{w} / {opt} rebuilt")
        b.plot(
            steps,
            [100 * s.exp_static / 32 for s in ss],
            ls="--",
            color=line.get_color(),
            label=f"{w} / {opt} static",
        )
    a.set_xlabel("step")
    a.set_ylabel("compressed / fp32 (%)")
    a.set_title("GComp size over training (dotted: no truncation)")
    a.legend(fontsize=7)
    b.set_xlabel("step")
    b.set_ylabel("exponent stream / fp32 (%)")
    b.set_title("Exponent stream: static vs rebuilt table")
    b.legend(fontsize=7)
    return save_figure(fig, path)
