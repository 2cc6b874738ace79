"""``hopq train``: data-parallel training with compressed gradient sync on an
emulated cluster network, and a time-to-accuracy report (the DynamiQ paper's
section 5: Figures 4-6 and 18).

N Gloo worker processes (default 4), launched here or by ``torchrun``, train one
workload once per codec, with the same initial weights, data order and seeds:

* ``gpt`` (default, quick): a byte-level GPT trained from scratch on the
  standard library's sources;
* ``minilm``: all-MiniLM-L6-v2 fine-tuned as a masked language model on the
  standard library's docstrings (``pip install 'hopq[bench]'``).

The workers talk over an emulated network (namespaces and ``tc tbf``, see
:mod:`hopq.bench.network`) whose per-worker rate is, unless given, calibrated so
that bf16's communication is ``comm_share`` of its step. Per step the job
records the loss, the time split into compute, compression (codec work) and
exposed communication (time waiting on the network), the bytes sent, and every
``vnmse_every`` steps the vNMSE of the compressed all-reduce against an exact
one on the same gradients; every ``eval_every`` steps the held-out loss. The
report folder holds report.md and PNG plots.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hopq.integrations.ddp import HookState, ddp_hook

WORKLOADS = ("gpt", "minilm")


@dataclass(frozen=True)
class TrainOptions:
    workload: str = "gpt"
    #: Codecs to run, one after another; "auto": bf16, dynamiq, mxfp8 and every
    #: other registered codec (fp32 and fp16 left out).
    codecs: tuple[str, ...] = ("auto",)
    topology: str = "ring"
    world_size: int = 4
    #: 60 steps x 7 codecs: about 10 minutes of training (14 in all, with the link
    #: calibration and the evaluations) on 2 cores with the default GPT.
    steps: int = 60
    batch_size: int = 8
    #: 0: the workload's default (gpt 1e-3, minilm 1e-4).
    lr: float = 0.0
    eval_every: int = 20
    eval_batches: int = 8
    vnmse_every: int = 10
    #: Per-worker link rate in Mbit/s; 0: calibrate from comm_share.
    rate_mbit: float = 0.0
    #: Share of bf16's step that its communication should take when calibrating.
    comm_share: float = 0.4
    #: Emulate the network when the machine allows it (else plain loopback).
    network: bool = True
    #: GPT size (the CI test shrinks it).
    gpt_dim: int = 256
    gpt_layers: int = 4
    context: int = 128
    seed: int = 0
    out: str = "runs/train"

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.world_size < 1 or self.steps < 1:
            raise ValueError("world_size and steps must be >= 1")
        if not 0 < self.comm_share < 1:
            raise ValueError(f"comm_share must be in (0, 1), got {self.comm_share}")

    def resolved_codecs(self) -> list[str]:
        from hopq.codecs.registry import available_codecs, codec_info

        if tuple(self.codecs) == ("auto",):
            first = ["bf16", "dynamiq", "mxfp8"]
            rest = [c for c in available_codecs() if c not in first and c not in ("fp32", "fp16")]
            return [c for c in first if c in available_codecs()] + rest
        for c in self.codecs:
            codec_info(c)  # unknown names fail here, before anything runs
        return list(self.codecs)


# -- workloads ---------------------------------------------------------------
@dataclass
class Workload:
    """A :class:`hopq.bench.workloads.Workload` bound to this job's seeds."""

    model: nn.Module
    lr: float
    #: (rank, step) -> a micro-batch; a pure function of the seed, rank and step.
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
    eval_batches: list[tuple[torch.Tensor, torch.Tensor]]


def make_workload(o: TrainOptions) -> Workload:
    from hopq.bench import workloads

    kw = {"context": o.context}
    if o.workload == "gpt":
        kw |= {"dim": o.gpt_dim, "layers": o.gpt_layers}
    w = workloads.make(o.workload, o.seed, **kw)

    def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return w.sample(
            torch.Generator().manual_seed(o.seed * 1_000_003 + step * 1009 + rank), o.batch_size
        )

    return Workload(w.model, o.lr or w.lr, batch, w.loss, w.held_out(o.eval_batches, o.batch_size))


# -- one codec's run on one rank -----------------------------------------------
@dataclass
class StepRecord:
    step: int
    loss: float
    step_s: float
    compute_s: float
    codec_s: float
    comm_s: float
    bytes: float
    bits_per_coord: float
    vnmse: float = float("nan")


@dataclass
class CodecRun:
    codec: str
    params: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    #: (training wall-clock seconds, evaluation loss)
    evals: list[tuple[float, float]] = field(default_factory=list)


def steady(run: CodecRun, field: str) -> float:
    """Mean of a StepRecord field over the steps after the first (warm-up) one."""
    tail = run.steps[1:] or run.steps
    return sum(getattr(s, field) for s in tail) / len(tail)


def _evaluate(model: nn.Module, w: Workload, rank: int, n: int) -> float:
    """Held-out loss; ranks split the evaluation batches and sum."""
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(rank, len(w.eval_batches), n):
            tot[0] += float(w.loss(model, w.eval_batches[i]))
            tot[1] += 1
    model.train()
    dist.all_reduce(tot)
    return float(tot[0] / tot[1])


def _progress(codec: str, total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        p = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
        )
        p.start()
        p.add_task(f"[{codec}]", total=total, info="")
        return p
    except ImportError:
        return None


def worker(rank: int, n: int, o: TrainOptions, codec: str) -> CodecRun:
    torch.manual_seed(o.seed)
    w = make_workload(o)
    model = w.model
    ddp = DDP(model)
    state = HookState(codec=codec, topology=o.topology, seed=o.seed)
    ddp.register_comm_hook(state, ddp_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=w.lr)
    run = CodecRun(codec, params=sum(p.numel() for p in model.parameters()))
    clock = 0.0
    bar = _progress(codec, o.steps, rank == 0)
    run.evals.append((0.0, _evaluate(model, w, rank, n)))
    for step in range(o.steps):
        b = w.batch(rank, step)
        state.measure_error = o.vnmse_every > 0 and step % o.vnmse_every == 0
        dist.barrier()
        t0 = time.perf_counter()
        loss = w.loss(ddp, b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        vnmse, exact_s = state.pop_error()
        calls = state.pop_stats()
        step_s = elapsed - exact_s  # the reference all-reduce is not part of training
        comm = sum(c.comm_seconds for c in calls)
        codec_s = sum(c.seconds - c.comm_seconds for c in calls)
        sent = sum(c.bytes_sent for c in calls)
        d = sum(c.numel for c in calls)
        bits = 8 * sent / (2 * (n - 1) / n * d) if n > 1 and d else float("nan")
        lt = torch.tensor([float(loss.detach())], dtype=torch.float64)
        dist.all_reduce(lt)
        clock += step_s
        run.steps.append(
            StepRecord(
                step,
                float(lt) / n,
                step_s,
                step_s - comm - codec_s,
                codec_s,
                comm,
                sent,
                bits,
                vnmse,
            )
        )
        if (step + 1) % o.eval_every == 0 or step == o.steps - 1:
            run.evals.append((clock, _evaluate(model, w, rank, n)))
        if bar is not None:
            bar.update(
                bar.task_ids[0],
                advance=1,
                info=f"loss {run.steps[-1].loss:.3f}  eval {run.evals[-1][1]:.3f}",
            )
        elif rank == 0 and (step % 10 == 0 or step == o.steps - 1):
            print(
                f"[{codec}] step {step} loss {run.steps[-1].loss:.4f} eval {run.evals[-1][1]:.4f}",
                flush=True,
            )
    if bar is not None:
        bar.stop()
    return run


def _calibrate_worker(rank: int, n: int, o: TrainOptions) -> tuple[float, float]:
    """bf16 on loopback for a few steps: (compute seconds per step, bytes per rank per step)."""
    short = TrainOptions(**{**asdict(o), "steps": 4, "eval_every": 1 << 30, "vnmse_every": 0})
    run = worker(rank, n, short, "bf16")
    compute = steady(run, "compute_s") + steady(run, "codec_s")
    sent = steady(run, "bytes")
    t = torch.tensor([compute, sent], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


# -- the report ----------------------------------------------------------------
def time_to_target(run: CodecRun, target: float) -> float | None:
    for t, loss in run.evals:
        if loss <= target:
            return t
    return None


def _plots(runs: list[CodecRun], folder: Path) -> list[str]:
    from hopq.bench.report import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return []
    made = []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in runs:
        ax.plot([t for t, _ in r.evals], [v for _, v in r.evals], marker="o", ms=3, label=r.codec)
    base = next((r for r in runs if r.codec == "bf16"), None)
    if base:
        ax.axhline(base.evals[-1][1], color="gray", ls="--", lw=1, label="bf16 final")
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("evaluation loss")
    ax.set_title("Time to accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    made.append(save_figure(fig, folder / "tta.png").name)

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r.codec for r in runs]
    parts: dict[str, list[float]] = {"compute": [], "compression": [], "exposed communication": []}
    for r in runs:
        parts["compute"].append(steady(r, "compute_s"))
        parts["compression"].append(steady(r, "codec_s"))
        parts["exposed communication"].append(steady(r, "comm_s"))
    bottom = [0.0] * len(runs)
    for label, vals in parts.items():
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("seconds per step")
    ax.set_title("Step time breakdown")
    ax.legend(fontsize=8)
    made.append(save_figure(fig, folder / "breakdown.png").name)

    series = {
        r.codec: [(s.step, s.vnmse) for s in r.steps if not math.isnan(s.vnmse) and s.vnmse > 0]
        for r in runs
    }
    if not any(series.values()):  # --vnmse-every 0: nothing to plot
        return made
    fig, ax = plt.subplots(figsize=(7, 4))
    for codec, pts in series.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=codec)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("vNMSE")
    ax.set_title("Compression error during training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    made.append(save_figure(fig, folder / "vnmse.png").name)
    return made


def goal_verdicts(runs: list[CodecRun]) -> list[str]:
    """One line per compressed codec: does it meet the goal against bf16?"""
    base = next((r for r in runs if r.codec == "bf16"), None)
    if base is None or not base.evals:
        return []
    final = base.evals[-1][1]
    t_bf16 = time_to_target(base, final)
    lines = []
    for r in runs:
        if r is base or not r.evals:
            continue
        t = time_to_target(r, final * 1.01)
        gap = r.evals[-1][1] / final - 1
        fast = t is not None and t_bf16 is not None and t < t_bf16
        close = gap <= 0.005
        reach = (
            "never reaches 101% of bf16's final loss"
            if t is None
            else f"reaches 101% of bf16's final loss in {t:.0f} s vs bf16's {t_bf16:.0f} s"
            f" ({t / t_bf16:.2f}x)"
            if t_bf16
            else f"reaches 101% of bf16's final loss in {t:.0f} s"
        )
        verdict = "**meets the goal**" if fast and close else "**misses the goal**"
        why = [w for w, bad in (("slower", not fast), ("final loss too high", not close)) if bad]
        lines.append(
            f"- {r.codec}: {reach}; final loss {gap * 100:+.2f}% vs bf16 (bound +0.50%): "
            f"{verdict}" + (f" ({', '.join(why)})" if why else "")
        )
    return lines


def load_runs(path: Path) -> list[CodecRun]:
    """The runs of a report folder's runs.json (to render a report again)."""
    data = json.loads(Path(path).read_text())
    return [
        CodecRun(
            d["codec"],
            d["params"],
            [StepRecord(**s) for s in d["steps"]],
            [tuple(e) for e in d["evals"]],
        )
        for d in data
    ]


def report(runs: list[CodecRun], o: TrainOptions, network: str, folder: Path) -> str:
    from hopq.bench.report import machine, markdown_table

    folder.mkdir(parents=True, exist_ok=True)
    base = next((r for r in runs if r.codec == "bf16"), runs[0])
    final = base.evals[-1][1]
    targets = (1.00, 1.01, 1.05)
    t_base = {f: time_to_target(base, final * f) for f in targets}
    rows = []
    for r in runs:
        ttt = []
        for f in targets:
            t = time_to_target(r, final * f)
            tb = t_base[f]
            ttt.append(
                "not reached"
                if t is None
                else (f"{t / tb:.2f}x ({t:.0f} s)" if tb else f"{t:.0f} s")
            )
        vn = [s.vnmse for s in r.steps if not math.isnan(s.vnmse)]
        rows.append(
            [
                r.codec,
                f"{r.evals[-1][1]:.4f}",
                f"{(r.evals[-1][1] / final - 1) * 100:+.2f}%",
                *ttt,
                f"{steady(r, 'step_s'):.3f}",
                f"{steady(r, 'compute_s'):.3f}",
                f"{steady(r, 'codec_s'):.3f}",
                f"{steady(r, 'comm_s'):.3f}",
                f"{steady(r, 'bytes') / 1e6:.3f}",
                f"{steady(r, 'bits_per_coord'):.2f}",
                f"{sum(vn) / len(vn):.2e}" if vn else "n/a",
            ]
        )
    table = markdown_table(
        [
            "codec",
            "final eval loss",
            "vs bf16",
            "time to 100%",
            "time to 101%",
            "time to 105%",
            "step (s)",
            "compute (s)",
            "compression (s)",
            "exposed comm (s)",
            "MB sent/rank/step",
            "bits/coord",
            "mean vNMSE",
        ],
        rows,
    )
    plots = _plots(runs, folder)
    verdicts = goal_verdicts(runs)
    share = []
    for r in runs:
        share.append(f"{r.codec} {steady(r, 'comm_s') / steady(r, 'step_s'):.0%}")
    text = "\n".join(
        [
            f"# hopq train: {o.workload}, {o.world_size} workers, {o.topology}, {o.steps} steps",
            "",
            f"Machine: {machine()}. Network: {network}. Model: {runs[0].params:,} parameters.",
            f"Exposed communication share of the step: {', '.join(share)}.",
            "Targets are bf16's final evaluation loss x 1.00, 1.01, 1.05; times are training",
            "wall-clock relative to bf16's (evaluation time excluded).",
            "",
            table,
            "",
            *(
                [
                    "Goal (the training-benchmark issue: reach bf16's final evaluation loss within"
                    " 1% in less wall-clock than bf16 takes to reach it, and end within 0.5% of it):",
                    "",
                    *verdicts,
                    "",
                ]
                if verdicts
                else []
            ),
            *[f"![{p}]({p})" for p in plots],
        ]
    )
    (folder / "report.md").write_text(text + "\n")
    (folder / "runs.json").write_text(
        json.dumps(
            [
                {
                    "codec": r.codec,
                    "params": r.params,
                    "evals": r.evals,
                    "steps": [asdict(s) for s in r.steps],
                }
                for r in runs
            ],
            indent=1,
        )
    )
    return text


def run(o: TrainOptions) -> str | None:
    """Run the job; return the report text (on rank 0; None on other torchrun ranks)."""
    from hopq.bench.launch import init_from_env, launched_by_torchrun, run_workers
    from hopq.bench.network import EmulatedNetwork, unavailable_reason

    codecs = o.resolved_codecs()
    folder = Path(o.out)
    if launched_by_torchrun():
        rank, n = init_from_env()
        runs = [worker(rank, n, o, c) for c in codecs]
        dist.destroy_process_group()
        return report(runs, o, "the launcher's (torchrun)", folder) if rank == 0 else None

    n = o.world_size
    why = unavailable_reason() if o.network else "disabled (--no-network)"
    rate = o.rate_mbit
    if why is None and rate <= 0:
        compute, sent = run_workers(n, _calibrate_worker, o)[0]
        # exposed comm = bytes / rate should be comm_share of (compute + comm)
        rate = sent * 8 / 1e6 / (compute * o.comm_share / (1 - o.comm_share))
        print(
            f"calibrated link: bf16 sends {sent / 1e6:.2f} MB per step and computes {compute:.2f} s; "
            f"{rate:.0f} Mbit/s per worker gives it ~{o.comm_share:.0%} communication",
            flush=True,
        )
    runs = []
    if why is None:
        with EmulatedNetwork(n, rate_mbit=rate) as net:
            network = f"emulated, {rate:.0f} Mbit/s per worker (tc tbf)"
            for c in codecs:
                runs.append(run_workers(n, worker, o, c, namespaces=net.namespaces)[0])
    else:
        print(f"no emulated network ({why}): running on plain loopback", flush=True)
        network = f"loopback ({why})"
        for c in codecs:
            runs.append(run_workers(n, worker, o, c)[0])
    text = report(runs, o, network, folder)
    print(f"\nreport written to {folder / 'report.md'}", flush=True)
    return text
