"""The report of ``hopq train``: a table per contender, ratios to a baseline, plots.

Everything here works from the records the ranks return (:class:`CodecRun`), so
a report can be rendered again from a run's ``runs.json`` (:func:`load_runs`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from hopq.reporting import machine, markdown_table, pyplot, save_figure
from hopq.train.records import WARMUP_STEPS, CodecRun, StepRecord


class ReportOptions(Protocol):
    """What the report reads of the job's options (``hopq.train.job.TrainOptions``)."""

    @property
    def workload(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def topology(self) -> str: ...
    @property
    def steps(self) -> int: ...
    @property
    def bucket_mb(self) -> float: ...
    @property
    def rate_mbit(self) -> float: ...
    @property
    def vnmse_every(self) -> int: ...


def optimizer_line(runs: list[CodecRun]) -> str | None:
    """Which contenders' hooks read the job's optimizer, and what that changes."""
    handed = [r for r in runs if r.optimizer]
    if not handed:
        return None
    line = (
        f"Handed the job's {handed[0].optimizer} (HookState(optimizer=...)): "
        + ", ".join(r.codec for r in handed)
        + "."
    )
    if any(r.codec == "dynamiq" for r in handed):
        line += (
            " DynamiQ weighs its bit allocation by the optimizer's step sizes, so its vNMSE"
            " (the gradient's error, which that allocation no longer minimises) rises while"
            " the update's error falls (the table's update vNMSE; docs/codecs/dynamiq.md)."
        )
    return line


def tier_line(runs: list[CodecRun]) -> str | None:
    """What the byte columns mean for the two-tier contenders."""
    hier = [r.codec for r in runs if r.codec.endswith("@hier")]
    if not hier:
        return None
    line = (
        f"{', '.join(hier)}: hopq's two-tier all-reduce (an exact float32 reduce-scatter and"
        " all-gather inside each node, the codec between nodes); their MB sent and bits per"
        " coordinate are what crosses between nodes, the figure the slow network pays."
    )
    tiers = {r.node_tier for r in runs if r.codec.endswith("@hier") and r.node_tier}
    if tiers:
        from hopq.comm import shm

        line += " " + shm.describe(1.0 if tiers == {"shared memory"} else 0.0)
    return line


def error_line(runs: list[CodecRun], every: int) -> str | None:
    """What the two error columns measure, when the job measured them."""
    measured = any(not math.isnan(s.vnmse) for r in runs for s in r.steps)
    if not measured:
        return None
    line = (
        f"Every {every} steps each hopq contender's hook also ran an exact float64 all-reduce:"
        " 'mean vNMSE' is the result's squared error over the exact average's squared norm"
        " (those steps are left out of the timings)."
    )
    if any(not math.isnan(s.update_vnmse) for r in runs for s in r.steps):
        line += (
            " 'mean update vNMSE' weighs every coordinate of both by the job's optimizer's"
            " step size (AdamW: lr / (sqrt(v) + eps), from its state before the step): the"
            " relative error of the update the optimizer makes from the gradient, which is"
            " what training feels; it starts at the optimizer's second step."
        )
    return line


#: A last bucket above this share of the gradient leaves every hook little to
#: overlap: the report says so.
LAST_BUCKET_SHARE = 0.5


def bucket_line(runs: list[CodecRun], cap_mb: float) -> str:
    """What DDP's buckets were: how many, and their sizes in reduction order."""
    cap = f"{cap_mb:g} MB" if cap_mb else "DDP's default (25 MB, the first bucket 1 MiB)"
    sizes = next((r.bucket_bytes for r in runs if r.bucket_bytes), [])
    if not sizes:
        return f"DDP's bucket cap: {cap}; DDP had not logged its rebuilt buckets."
    mb = ", ".join(f"{b / 2**20:.1f}" for b in sizes)
    line = (
        f"DDP's bucket cap: {cap}, so {len(sizes)} bucket{'s' * (len(sizes) != 1)}"
        f" per step, in reduction order (MiB): {mb}."
    )
    last = sizes[-1] / sum(sizes)
    if last > LAST_BUCKET_SHARE:
        line += (
            f" **The last bucket holds {last:.0%} of the gradient** and is ready only when "
            "the backward pass ends, so its synchronization cannot hide behind compute, "
            "whatever the hook; a smaller --bucket-mb splits it."
        )
    return line


def timed_steps(run: CodecRun) -> list[StepRecord]:
    """The steps that timings use: after the first (warm-up) one, and without an
    error measurement (its exact reference all-reduce shares the hook's thread)."""
    tail = run.steps[WARMUP_STEPS:] or run.steps
    return [s for s in tail if not s.measured_error] or tail


def steady(run: CodecRun, field: str) -> float:
    """Mean of a StepRecord field over the timed steps (NaN if it is NaN there)."""
    tail = timed_steps(run)
    return sum(getattr(s, field) for s in tail) / len(tail)


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = q * (len(xs) - 1)
    lo = int(i)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def compute_probes(run: CodecRun) -> list[float]:
    return [s.probe_s for s in run.steps[WARMUP_STEPS:] if not math.isnan(s.probe_s)]


#: Compute that differs more than this between contenders makes the timings suspect.
COMPUTE_DRIFT = 0.10


def compute_drift(runs: list[CodecRun]) -> tuple[float, str]:
    """(max/min - 1 of the contenders' median compute probes, a warning or "")."""
    med = {r.codec: quantile(compute_probes(r), 0.5) for r in runs if compute_probes(r)}
    if len(med) < 2:
        return 0.0, ""
    lo, hi = min(med, key=med.__getitem__), max(med, key=med.__getitem__)
    drift = med[hi] / med[lo] - 1
    if drift <= COMPUTE_DRIFT:
        return drift, ""
    return drift, (
        f"**WARNING: the timings are unreliable.** The contenders' compute (forward and "
        f"backward without communication, the same work for all) differs by {drift:.0%}: "
        f"{hi} {med[hi]:.3f} s vs {lo} {med[lo]:.3f} s per step (bound {COMPUTE_DRIFT:.0%}). "
        "Something else loaded the machine, or its speed varied (a shared or virtual "
        "host); rerun on a quiet machine, or repeat the run and compare."
    )


def cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def local_workers(world_size: int) -> int:
    """Workers on this machine: torchrun's LOCAL_WORLD_SIZE when it launched the
    job (its workers may span machines), else all of them (hopq's own spawn)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def last_bucket_wire(run: CodecRun, rate_mbit: float) -> float:
    """Seconds the last bucket's bytes take at the link rate (0.0 without a
    rate or bytes): that bucket is ready only when the backward pass ends."""
    last = steady(run, "last_bytes")
    if math.isnan(last) and run.bucket_bytes:  # torch: the bucket's share of the bytes
        last = steady(run, "bytes") * run.bucket_bytes[-1] / sum(run.bucket_bytes)
    return last * 8 / (rate_mbit * 1e6) if rate_mbit > 0 and not math.isnan(last) else 0.0


def step_floor(runs: list[CodecRun], rate_mbit: float) -> str:
    """The shortest step each contender could take with these buckets, as a line
    of the report ("" without a link rate): its compute probe plus its last
    bucket's bytes at the link rate (no hook moves that bucket before the
    backward pass ends), and its mean step against it."""
    if rate_mbit <= 0:
        return ""
    parts = []
    for r in runs:
        floor = steady(r, "compute_s") + last_bucket_wire(r, rate_mbit)
        if floor > 0 and not math.isnan(floor):
            parts.append(f"{r.codec} {floor:.3f} s ({steady(r, 'step_s') / floor:.2f}x)")
    if not parts:
        return ""
    return (
        "Step floor (compute probe + the last bucket's bytes at the link rate) and the mean"
        f" step against it: {', '.join(parts)}."
    )


def exposure_floor(runs: list[CodecRun], workers: int, n_cores: int, rate_mbit: float) -> str:
    """The least exposed synchronization each contender could reach with these
    buckets on this machine, as a line of the report ("" when nothing bounds it):
    the larger of

    * the last bucket's bytes at the link rate: that bucket is ready only when
      the backward pass ends, so its bytes move after all compute but the
      optimizer's, which waits for them (tbf's burst is a few milliseconds);
    * when the workers' compute alone fills every core, workers / cores x the
      hook's CPU seconds: that work cannot hide behind compute however well it
      overlaps, it takes the compute's cores."""
    full = workers >= n_cores
    parts = []
    for r in runs:
        step = steady(r, "step_s")
        wire = last_bucket_wire(r, rate_mbit)
        hook_cpu = steady(r, "cpu_s")  # NaN for torch's contenders
        cpu = workers / n_cores * hook_cpu if full and not math.isnan(hook_cpu) else 0.0
        floor = max(wire, cpu)
        if floor > 0:
            by = "the wire" if wire >= cpu else "the CPU"
            measured = steady(r, "exposed_s") / step
            parts.append(f"{r.codec} {floor / step:.0%} by {by} (measured {measured:.0%})")
    if not parts:
        return ""
    why = ["the last bucket's bytes at the link rate (they move only after the backward pass)"]
    if full:
        why.append(
            f"{workers / n_cores:g} x the hook's CPU seconds (the {workers} workers' compute fills"
            f" the {n_cores} cores, so that work takes the compute's cores however well it"
            " overlaps)"
        )
    return (
        "Least exposed share these buckets and this machine leave (torch's contenders: the"
        " first bound only), the larger of " + " and ".join(why) + ": " + ", ".join(parts) + "."
    )


def is_torch_run(run: CodecRun) -> bool:
    return run.codec.startswith("torch:")


def best_torch(runs: list[CodecRun]) -> CodecRun | None:
    """The torch contender the others are compared with: the quickest to its own
    final loss among those whose final loss is within 1% of the best torch
    contender's."""
    torch_runs = [r for r in runs if is_torch_run(r) and r.evals]
    if not torch_runs:
        return None
    best_loss = min(r.evals[-1][1] for r in torch_runs)
    ok = [r for r in torch_runs if r.evals[-1][1] <= best_loss * 1.01]
    return min(ok, key=lambda r: time_to_target(r, r.evals[-1][1]) or math.inf)


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
    # Left: the whole run; right: the end of it, where the contenders part. One
    # colour per contender (tab20 past ten), torch's own hooks dashed.
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    cmap = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20")
    base = baseline(runs)
    for ax in axes:
        for i, r in enumerate(runs):
            ax.plot(
                [t for t, _ in r.evals],
                [v for _, v in r.evals],
                marker="o",
                ms=3,
                color=cmap(i % cmap.N),
                ls="--" if r.codec.startswith("torch:") else "-",
                label=r.codec,
            )
        if base:
            ax.axhline(base.evals[-1][1], color="gray", ls=":", lw=1, label=f"{base.codec} final")
        ax.set_xlabel("training wall-clock (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("evaluation loss")
    axes[0].set_title("Time to accuracy")
    finals = [r.evals[-1][1] for r in runs if r.evals]
    if base and finals:
        ref = base.evals[-1][1]
        lo, hi = min(min(finals), ref), max(finals + [ref])
        pad = 0.25 * (hi - lo) + 0.005 * abs(ref)
        axes[1].set_ylim(lo - pad, hi + pad)
        axes[1].set_xlim(left=0.5 * max(t for r in runs for t, _ in r.evals))
    axes[1].set_title("The end of training")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    made.append(save_figure(fig, folder / "tta.png").name)

    fig, ax = plt.subplots(figsize=(max(7, 0.8 * len(runs)), 4))
    names = [r.codec for r in runs]
    compute = [steady(r, "compute_s") for r in runs]
    exposed = [steady(r, "exposed_s") for r in runs]
    ax.bar(names, compute, label="compute (probed)")
    ax.bar(names, exposed, bottom=compute, label="exposed synchronization")
    work = [
        c + steady(r, "codec_s") + steady(r, "comm_s") for c, r in zip(compute, runs, strict=True)
    ]
    shown = [(n, w) for n, w in zip(names, work, strict=True) if not math.isnan(w)]
    if shown:
        ax.scatter(
            [n for n, _ in shown],
            [w for _, w in shown],
            marker="_",
            s=400,
            color="black",
            label="compute + hook's codec and communication work (the gap is hidden)",
        )
    ax.set_ylabel("seconds per step")
    ax.set_title("Step time breakdown (the hooks overlap the backward pass)")
    ax.tick_params(axis="x", labelrotation=30)
    tops = [c + e for c, e in zip(compute, exposed, strict=True)] + [w for _, w in shown]
    tops = [t for t in tops if not math.isnan(t)]
    if tops:  # headroom, so that the legend sits above the bars, not over them
        ax.set_ylim(0, 1.4 * max(tops))
    ax.legend(fontsize=7, loc="upper left")
    made.append(save_figure(fig, folder / "breakdown.png").name)
    timeline = _timeline_plot(plt, runs, folder)
    if timeline:
        made.append(timeline)

    def points(r: CodecRun, field: str) -> list[tuple[int, float]]:
        return [(s.step, v) for s in r.steps if not math.isnan(v := getattr(s, field)) and v > 0]

    series = {r.codec: (points(r, "vnmse"), points(r, "update_vnmse")) for r in runs}
    if not any(g or u for g, u in series.values()):  # --vnmse-every 0: nothing to plot
        return made
    weighed = any(u for _, u in series.values())
    panels = [("of the gradient (vNMSE)", 0)] + (
        [("of the update (weighed by the optimizer's step sizes)", 1)] if weighed else []
    )
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(5 + 3.5 * len(panels), 4.2),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    cmap = plt.get_cmap("tab10" if len(series) <= 10 else "tab20")
    for ax, (title, which) in zip(axes[0], panels, strict=True):
        for i, (codec, pair) in enumerate(series.items()):
            pts = pair[which]
            if pts:
                ax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], marker=".",
                    color=cmap(i % cmap.N), label=codec,
                )  # fmt: skip
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(f"Compression error {title}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("squared error / squared norm")
    # one legend for both panels, from every line drawn (a codec may lack a panel)
    seen: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    axes[0][-1].legend(
        list(seen.values()), list(seen), fontsize=7, loc="upper left",
        bbox_to_anchor=(1.02, 1), borderaxespad=0,
    )  # fmt: skip
    made.append(save_figure(fig, folder / "vnmse.png").name)
    return made


def bucket_times(run: CodecRun) -> list[tuple[float, float]]:
    """Each bucket's median (hook called, future completed), seconds after the
    step's start, over the timed steps with the usual bucket count; [] without
    a hook."""
    steps = [s for s in timed_steps(run) if s.bucket_ready_s]
    if not steps:
        return []
    counts = [len(s.bucket_ready_s) for s in steps]
    k = max(set(counts), key=counts.count)
    steps = [s for s in steps if len(s.bucket_ready_s) == k]
    return [
        (
            quantile([s.bucket_ready_s[i] for s in steps], 0.5),
            quantile([s.bucket_done_s[i] for s in steps], 0.5),
        )
        for i in range(k)
    ]


def backward_line(runs: list[CodecRun]) -> str:
    """What each hook's work costs the backward pass that it overlaps, as a line
    of the report: when the last bucket's gradients are ready (its hook called,
    the end of the backward pass; median on rank 0), against the same of the
    first of torch's hooks in the run and the compute probe (forward and
    backward without communication, the slowest rank). On cores that the
    workers fill, a hook's CPU work lengthens the backward pass."""
    ends = {r.codec: t[-1][0] for r in runs if (t := bucket_times(r))}
    base = next((c for c in ends if c.startswith("torch:")), None)
    if base is None or len(ends) < 2:
        return ""
    probes = [p for r in runs for p in compute_probes(r)]
    probe = quantile(probes, 0.5) if probes else float("nan")
    parts = [
        f"{c} {t * 1e3:.0f} ms ({(t - ends[base]) * 1e3:+.0f})"
        if c != base
        else f"{c} {t * 1e3:.0f} ms"
        for c, t in ends.items()
    ]
    tail = "" if probe != probe else f"; the compute probe: {probe * 1e3:.0f} ms"
    return (
        "The backward pass under each hook, to its last bucket's gradients (median ms after "
        f"the step's start on rank 0; in brackets, against {base}'s){tail}: "
        + ", ".join(parts)
        + "."
    )


def sync_cpu_line(runs: list[CodecRun]) -> str:
    """What synchronization cost each worker's cores per step, for every
    contender, as a line of the report: the process's CPU seconds in the step's
    forward and backward beyond its compute probe's (every thread: a hook's,
    torch's, the backend's), mean over the timed steps, against torch's first
    hook in the run (else torch's first contender)."""
    cpu = {r.codec: v for r in runs if not math.isnan(v := steady(r, "sync_cpu_s"))}
    if not cpu:
        return ""
    torch_ones = [c for c in cpu if c.startswith("torch:")]
    base = next((c for c in torch_ones if c != "torch:ddp"), torch_ones[0] if torch_ones else "")
    parts = [
        f"{c} {v * 1e3:.0f} ms"
        + (f" ({v / cpu[base]:.2f}x)" if base and c != base and cpu[base] > 0 else "")
        for c, v in cpu.items()
    ]
    against = f"; in brackets, against {base}'s" if base and len(cpu) > 1 else ""
    return (
        "CPU that synchronization cost each worker per step (the process's CPU seconds in the"
        " forward and backward beyond the compute probe's, every thread counted: the hook's,"
        f" torch's, the backend's; mean over the ranks and timed steps{against}): "
        + ", ".join(parts)
        + "."
    )


def timeline_line(runs: list[CodecRun]) -> str:
    """The buckets' synchronization in the step, as a line of the report."""
    parts = []
    for r in runs:
        times = bucket_times(r)
        if times:
            spans = ", ".join(f"{a * 1e3:.0f}-{b * 1e3:.0f}" for a, b in times)
            parts.append(f"{r.codec} {spans}")
    if not parts:
        return ""
    return (
        "Each bucket's synchronization, from the hook's call (its gradients ready) to its "
        "future's completion, median ms after the step's start on rank 0 (timeline.png): "
        + "; ".join(parts)
        + "."
    )


def _timeline_plot(plt: Any, runs: list[CodecRun], folder: Path) -> str | None:
    shown = [(r, bucket_times(r)) for r in runs]
    shown = [(r, t) for r, t in shown if t]
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(shown) + 1.6))
    colors = ("tab:blue", "tab:orange")
    for y, (r, times) in enumerate(shown):
        for i, (a, b) in enumerate(times):
            ax.barh(y, (b - a) * 1e3, left=a * 1e3, height=0.5, color=colors[i % 2], alpha=0.8)
        steps = [s.step_s for s in timed_steps(r)]
        ax.plot([quantile(steps, 0.5) * 1e3] * 2, [y - 0.35, y + 0.35], color="black", lw=2)
        compute = steady(r, "compute_s") * 1e3
        ax.plot([compute] * 2, [y - 0.35, y + 0.35], color="gray", lw=1, ls="--")
    ax.set_yticks(range(len(shown)), [r.codec for r, _ in shown])
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel("ms after the step's start (rank 0, medians)")
    ax.set_title(
        "Buckets' synchronization: hook called to future completed\n"
        "(bars alternate by bucket; black: median step end; dashed: compute alone)",
        fontsize=9,
    )
    ax.grid(axis="x", alpha=0.3)
    return save_figure(fig, folder / "timeline.png").name


def baseline(runs: list[CodecRun]) -> CodecRun | None:
    """What every other contender is compared with: the best torch contender when
    torch's options ran, otherwise hopq's bf16."""
    return best_torch(runs) or next((r for r in runs if r.codec == "bf16"), None)


def comparisons(runs: list[CodecRun]) -> list[str]:
    """One line per other contender, measured against the baseline: its step time
    as a ratio of the baseline's (and the share of it that is exposed
    synchronization), its time to 101% of the baseline's final loss as a ratio of
    the time the baseline took to its own final loss, and the gap between the
    two final losses."""
    base = baseline(runs)
    if base is None or not base.evals:
        return []
    name = base.codec
    final = base.evals[-1][1]
    t_base = time_to_target(base, final)
    lines = []
    for r in runs:
        if r is base or not r.evals:
            continue
        parts = []
        if r.steps and base.steps:
            ratio = steady(r, "step_s") / steady(base, "step_s")
            share = steady(r, "exposed_s") / steady(r, "step_s")
            parts.append(
                f"{ratio:.2f}x of {name}'s step (exposed synchronization {share:.0%} of it)"
            )
        t = time_to_target(r, final * 1.01)
        if t is None:
            parts.append(f"101% of {name}'s final loss not reached")
        elif t_base:
            parts.append(
                f"101% of {name}'s final loss in {t / t_base:.2f}x the time {name} took to"
                f" its final loss ({t:.0f} s vs {t_base:.0f} s)"
            )
        else:
            parts.append(f"101% of {name}'s final loss in {t:.0f} s")
        gap = r.evals[-1][1] / final - 1
        parts.append(f"final loss {gap * 100:+.2f}%")
        lines.append(f"- {r.codec}: " + ", ".join(parts))
    return lines


def load_runs(path: Path) -> list[CodecRun]:
    """The runs of a report folder's runs.json (to render a report again)."""
    data = json.loads(Path(path).read_text())
    return [
        CodecRun(
            d["codec"],
            d["params"],
            [StepRecord(**s) for s in d["steps"]],  # older runs lack the newer fields
            [tuple(e) for e in d["evals"]],
            d.get("bucket_bytes", []),
            d.get("optimizer", ""),
            d.get("plan_note", ""),
            d.get("node_tier", ""),
        )
        for d in data
    ]


def _f(x: float, fmt: str = ".3f") -> str:
    return "n/a" if math.isnan(x) else format(x, fmt)


def report(runs: list[CodecRun], o: ReportOptions, network: str, folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    base = baseline(runs) or runs[0]
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
        uv = [s.update_vnmse for s in r.steps if not math.isnan(s.update_vnmse)]
        steps = [s.step_s for s in timed_steps(r)]
        work = steady(r, "codec_s") + steady(r, "comm_s")
        hidden = 1 - steady(r, "exposed_s") / work if work > 0 else float("nan")
        rows.append(
            [
                r.codec,
                f"{r.evals[-1][1]:.4f}",
                f"{(r.evals[-1][1] / final - 1) * 100:+.2f}%",
                *ttt,
                f"{quantile(steps, 0.5):.3f} ({quantile(steps, 0.1):.3f}-{quantile(steps, 0.9):.3f})",
                _f(steady(r, "compute_s")),
                _f(steady(r, "exposed_s")),
                _f(steady(r, "codec_s")),
                _f(steady(r, "comm_s")),
                _f(steady(r, "cpu_s")),
                _f(steady(r, "sync_cpu_s")),
                "n/a" if math.isnan(hidden) else f"{max(0.0, min(1.0, hidden)):.0%}",
                f"{steady(r, 'bytes') / 1e6:.3f}",
                f"{steady(r, 'bits_per_coord'):.2f}",
                f"{sum(vn) / len(vn):.2e}" if vn else "n/a",
                f"{sum(uv) / len(uv):.2e}" if uv else "n/a",
            ]
        )
    table = markdown_table(
        [
            "contender",
            "final eval loss",
            f"vs {base.codec}",
            "time to 100%",
            "time to 101%",
            "time to 105%",
            "step (s): median (p10-p90)",
            "compute (s)",
            "exposed sync (s)",
            "codec work (s)",
            "comm work (s)",
            "hook CPU (s)",
            "sync CPU (s)",
            "hidden",
            "MB sent/rank/step",
            "bits/coord",
            "mean vNMSE",
            "mean update vNMSE",
        ],
        rows,
    )
    drift, warning = compute_drift(runs)
    plots = _plots(runs, folder)
    compared = comparisons(runs)
    share = [f"{r.codec} {steady(r, 'exposed_s') / steady(r, 'step_s'):.0%}" for r in runs]
    probes = {r.codec: compute_probes(r) for r in runs}
    n_probes = min((len(p) for p in probes.values() if p), default=0)
    text = "\n".join(
        [
            f"# hopq train: {o.workload}, {o.world_size} workers, {o.topology}, {o.steps} steps",
            "",
            *([warning, ""] if warning else []),
            f"Machine: {machine()}. Network: {network}. Model: {runs[0].params:,} parameters.",
            bucket_line(runs, o.bucket_mb),
            *([line] if (line := optimizer_line(runs)) else []),
            *[f"{r.codec}: {r.plan_note}" for r in runs if r.plan_note],
            *([line] if (line := tier_line(runs)) else []),
            "The contenders trained interleaved (step k of each before step k + 1 of any), so a",
            "change in the machine's load hits them alike. Compute was probed at least"
            f" {n_probes} times per contender (forward and backward without communication);",
            f"the contenders' median compute differs by {drift:.1%} (bound {COMPUTE_DRIFT:.0%}).",
            f"Exposed synchronization share of the step: {', '.join(share)}.",
            f"Targets are {base.codec}'s final evaluation loss x 1.00, 1.01, 1.05; times are"
            f" training wall-clock relative to {base.codec}'s (evaluation time and the first,"
            " warm-up step excluded).",
            "Codec and comm work are the seconds hopq's hook spent on its thread (overlapping",
            "the backward pass); 'hidden' is the share of them that did not lengthen the step;",
            "'hook CPU' is the CPU time that thread used in them: codec kernels, hopq's Python",
            "and the socket calls it makes (waiting not counted). 'sync CPU' is, for every",
            "contender, the CPU per worker that the step's forward and backward used beyond the",
            "compute probe's, every thread of the process counted (the hook's, torch's, Gloo's).",
            *(
                [floor]
                if (
                    floor := exposure_floor(runs, local_workers(o.world_size), cores(), o.rate_mbit)
                )
                else []
            ),
            *([line] if (line := step_floor(runs, o.rate_mbit)) else []),
            *([line] if (line := timeline_line(runs)) else []),
            *([line] if (line := backward_line(runs)) else []),
            *([line] if (line := sync_cpu_line(runs)) else []),
            *([line] if (line := error_line(runs, o.vnmse_every)) else []),
            "",
            table,
            "",
            *(
                [
                    f"Against {base.codec}"
                    + (
                        " (of torch's options, the quickest to its own final loss among"
                        " those ending within 1% of the lowest)"
                        if is_torch_run(base)
                        else ""
                    )
                    + ": each contender's mean step time as a ratio of"
                    f" {base.codec}'s, its training wall-clock to 101% of {base.codec}'s"
                    f" final evaluation loss as a ratio of the wall-clock {base.codec} took"
                    " to its own final loss, and its final evaluation loss relative to"
                    f" {base.codec}'s.",
                    "",
                    *compared,
                    "",
                ]
                if compared
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
                    "bucket_bytes": r.bucket_bytes,
                    "optimizer": r.optimizer,
                    "plan_note": r.plan_note,
                    "node_tier": r.node_tier,
                    "steps": [asdict(s) for s in r.steps],
                }
                for r in runs
            ],
            indent=1,
        )
    )
    return text
