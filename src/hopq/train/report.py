"""The report of ``hopq train``: a table per contender, goal verdicts, plots.

Everything here works from the records the ranks return (:class:`CodecRun`), so
a report can be rendered again from a run's ``runs.json`` (:func:`load_runs`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hopq.reporting import machine, markdown_table, pyplot, save_figure

if TYPE_CHECKING:
    from hopq.train.job import TrainOptions


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


def time_to_target(run: CodecRun, target: float) -> float | None:
    for t, loss in run.evals:
        if loss <= target:
            return t
    return None


def _plots(runs: list[CodecRun], folder: Path) -> list[str]:
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
