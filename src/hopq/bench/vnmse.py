"""``hopq bench vnmse``: compression error of every codec on real gradients.

Each worker's gradient comes from its own micro-batch (see
:mod:`hopq.train.workloads`); every figure is ``hopq.simulate`` of those
gradients: vNMSE against the exact float64 sum and the bits per coordinate
counted from the bytes sent. Tables: the super-group norm distribution
(the paper's Figures 1 and 3), the eps sweep of the non-uniform levels, the
ablation ladder of Table 6, the bit-budget sweep of Table 4, vNMSE against the
world size (ring and butterfly, appendix B), and the beyond-the-paper variants.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hopq.codecs.base import Codec
from hopq.codecs.dynamiq import DEFAULT_EPS, PAPER, DynamiQ
from hopq.codecs.registry import available_codecs, get_codec
from hopq.comm.layout import NodeLayout
from hopq.comm.topology import TOPOLOGIES, get_schedule
from hopq.options import check_scoped, option
from hopq.reporting import Progress, machine, markdown_table, pyplot, save_figure
from hopq.sim import simulate
from hopq.train.workloads import WORKLOADS

TABLES = ("norms", "eps", "ladder", "budget", "scale", "beyond", "codecs", "layouts")


@dataclass(frozen=True)
class VnmseOptions:
    workloads: tuple[str, ...] = option(
        ("minilm", "gpt"),
        "workloads whose gradients are measured (the eps table: the first only)",
        choices=tuple(WORKLOADS),
    )
    worlds: tuple[int, ...] = option(
        (4, 8), "world sizes of the ladder, beyond and codecs tables (eps and budget: n = 4)"
    )
    topologies: tuple[str, ...] = option(
        ("ring", "butterfly"),
        "schedules of the ladder, budget, scale and codecs tables (eps and beyond: ring)",
        choices=lambda: sorted(TOPOLOGIES),
    )
    sweep_worlds: tuple[int, ...] = option(
        (2, 3, 4, 6, 8, 16, 32, 64), "world sizes of the scaling table"
    )
    sweep_coords: int = option(
        1_000_000, "coordinates per worker in the scaling and layouts tables"
    )
    layouts: tuple[str, ...] = option(
        ("1x8", "8x8", "32x8", "128x8"),
        "clusters (nodes x workers per node) of the layouts table: DynamiQ flat and two-tier",
    )
    flat_max: int = option(
        64,
        "largest world the layouts table simulates flat (one thread per rank; above: tier by tier only)",
    )
    minilm_warmup: int = option(20, "AdamW steps before MiniLM's gradients are taken")
    gpt_warmup: int = option(300, "AdamW steps before the GPT's gradients are taken")
    batch: int = option(4, "sequences per worker")
    seed: int = option(0, "seed of the data and the codecs")
    plots: str = option("runs/vnmse", "folder of the plots")
    tables: tuple[str, ...] = option(TABLES, "tables to compute", choices=TABLES)
    codecs: tuple[str, ...] = option(
        (), "codecs beside DynamiQ in the ladder, scale and codecs tables; empty: every one"
    )

    def __post_init__(self) -> None:
        unknown = set(self.tables) - set(TABLES)
        if unknown:
            raise ValueError(f"unknown tables {sorted(unknown)}; choose from {TABLES}")
        bad = set(self.workloads) - set(WORKLOADS)
        if bad:
            raise ValueError(f"unknown workloads {sorted(bad)}; choose from {sorted(WORKLOADS)}")
        for t in self.topologies:
            get_schedule(t, 1)
        bad = set(self.codecs) - set(available_codecs())
        if bad:
            raise ValueError(f"unknown codecs {sorted(bad)}; choose from {available_codecs()}")
        if any(n < 1 for n in (*self.worlds, *self.sweep_worlds)):
            raise ValueError("world sizes must be >= 1")
        for spec in self.layouts:
            NodeLayout.parse(spec)  # a bad layout is refused here, not after the gradients
        check_scoped(
            self, {"minilm_warmup": ("minilm", "minilm-cls"), "gpt_warmup": ("gpt",)}, self.workloads,
            "--workloads",
        )  # fmt: skip
        check_scoped(
            self,
            {
                "sweep_worlds": ("scale",),
                "sweep_coords": ("scale", "layouts"),
                "plots": ("norms",),
                "layouts": ("layouts",),
                "flat_max": ("layouts",),
            },
            self.tables,
            "--tables",
        )


#: The paper's Table 6 ladder: each row adds one technique. Without hierarchical
#: scales the paper uses groups of 32 (a bfloat16 scale per group), with them 16.
LADDER: list[tuple[str, dict[str, Any]]] = [
    (
        "uniform",
        dict(
            allocation="fixed",
            levels="uniform",
            scales="full",
            group_size=32,
            rounding="independent",
        ),
    ),
    ("non-uniform", dict(allocation="fixed", scales="full", group_size=32, rounding="independent")),
    ("+ variable bitwidth", dict(scales="full", group_size=32, rounding="independent")),
    ("+ hierarchical scales", dict(rounding="independent")),
    ("+ correlated rounding (DynamiQ)", dict()),
    ("paper's path correlation (biased)", dict(rounding="path")),
]

#: The paper's configuration, spelled out (hopq's defaults differ: see BEYOND).
PAPER_DYNAMIQ: dict[str, Any] = dict(PAPER)
BEYOND: list[tuple[str, dict[str, Any]]] = [
    ("paper (heuristic allocation, W = {2,4,8})", PAPER_DYNAMIQ),
    ("exact allocation (greedy)", PAPER_DYNAMIQ | dict(allocation="exact")),
    ("+ zero class", PAPER_DYNAMIQ | dict(zero_class=True)),
    ("W = {2,4,8,16}", PAPER_DYNAMIQ | dict(widths=(2, 4, 8, 16))),
    ("exact + W = {2,4,8,16}", PAPER_DYNAMIQ | dict(allocation="exact", widths=(2, 4, 8, 16))),
    (
        "exact + zero + W = {2,4,8,16}",
        PAPER_DYNAMIQ | dict(allocation="exact", zero_class=True, widths=(2, 4, 8, 16)),
    ),
    (
        "exact + zero + W = {2,4,8,16}, groups of 64",
        dict(allocation="exact", zero_class=True, widths=(2, 4, 8, 16), group_size=64),
    ),
    ("hopq's default (the same, groups of 32)", dict()),
]

EPS_GRID = {4: (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0), 8: (0.0, 0.02, 0.05, 0.08, 0.1, 0.15, 0.2)}


def _fmt(v: float) -> str:
    return f"{v:.5f}" if v >= 1e-4 else f"{v:.2e}"


def _norm_distribution(grad: torch.Tensor, S: int, seed: int) -> tuple[list[float], list[float]]:
    """log10 of super-group squared norms relative to their median, for the
    gradient and for a random shuffle of it (no spatial locality)."""
    d = grad.numel() // S * S
    g = torch.Generator().manual_seed(seed)
    out = []
    for v in (grad[:d], grad[:d][torch.randperm(d, generator=g)]):
        F = v.view(-1, S).double().square().sum(1)
        rel = F / F.median().clamp(min=1e-300)
        out.append(torch.log10(rel.clamp(min=1e-30)).sort().values.tolist())
    return out[0], out[1]


def _plot_norms(curves: dict[str, tuple[list[float], list[float]]], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, (orig, shuf) in curves.items():
        for vals, style, tag in ((orig, "-", "gradient"), (shuf, "--", "shuffled")):
            ys = [(i + 1) / len(vals) for i in range(len(vals))]
            ax.plot(vals, ys, style, label=f"{name} ({tag})")
    ax.set_xlim(-8, 8)  # exactly-zero super-groups (clamped to -30) sit off the left edge
    ax.set_xlabel("log10( super-group squared norm / median ), zero norms off the left edge")
    ax.set_ylabel("CDF")
    ax.set_title("Super-group (S = 256) norms: real gradients vs shuffled")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _layouts_table(
    o: VnmseOptions,
    w: str,
    grads: list[torch.Tensor],
    subset: slice,
    nfull: int,
    prog: Progress,
) -> str:
    """DynamiQ (hopq's default, 5 bits) flat and two-tier on each layout of
    ``o.layouts``: vNMSE, and the two-tier call's inter-node bits per
    coordinate; flat only up to ``o.flat_max`` ranks."""
    rows = []
    base = None
    for spec in o.layouts:
        lay = NodeLayout.parse(spec)
        p = lay.world_size
        xs = [g[subset] if i < nfull else g for i, g in enumerate(grads[:p])]
        row = [spec, str(p)]
        for topo in ("ring", "butterfly"):
            if p <= o.flat_max:
                r = simulate(xs, "dynamiq", topo, seed=o.seed)
                row.append(f"{_fmt(r.vnmse)} ({r.bits_per_coord:.2f} b)")
                if p == 8 and topo == "ring":
                    base = r.vnmse
            else:
                row.append("")
            prog.update(f"{w} {spec} flat {topo}")
        hier = []
        for topo in ("ring", "butterfly"):
            r = simulate(xs, "dynamiq", topo, seed=o.seed, layout=lay)
            bits = sum(s.inter_bits_per_coord for s in r.stats) / len(r.stats)
            row.append(f"{_fmt(r.vnmse)} ({bits:.2f} b)")
            hier.append(r.vnmse)
            prog.update(f"{w} {spec} two-tier {topo}")
        row.append("" if base is None else f"{min(hier) / base:.2f}x")
        rows.append(row)
    return (
        f"\n### Flat and two-tier DynamiQ against the cluster, {w} ({o.sweep_coords:,} "
        "coordinates per worker)\n\nvNMSE (bits per coordinate: a flat call's, a two-tier "
        "call's between nodes); two-tier: exact float32 sums inside a node, DynamiQ between "
        "nodes on a ring or a butterfly; flat cells above "
        f"{o.flat_max} ranks are not simulated. The last column: the better two-tier "
        "vNMSE over the 8-rank flat ring's.\n\n"
        + markdown_table(
            [
                "layout",
                "ranks",
                "flat ring",
                "flat butterfly",
                "two-tier ring",
                "two-tier butterfly",
                "two-tier / 8-rank ring",
            ],
            rows,
        )  # fmt: skip
    )


def run(o: VnmseOptions, log: Callable[[str], None] | None = None) -> str:
    from hopq.train import workloads

    def _stderr(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    say: Callable[[str], None] = log or _stderr

    class _Sections(list[str]):
        def append(self, text: str) -> None:  # every finished section is shown at once
            super().append(text)
            say(text)

    torch.manual_seed(o.seed)
    sections = _Sections([f"Machine: {machine()}\n"])
    grads: dict[str, list[torch.Tensor]] = {}
    descs: dict[str, str] = {}
    subsets: dict[str, slice] = {}
    nfull = max(*o.worlds, 4)  # the eps and budget tables use n = 4
    nmax = max(max(o.sweep_worlds), nfull) if "scale" in o.tables else nfull
    if "layouts" in o.tables:
        nmax = max(nmax, *(NodeLayout.parse(s).world_size for s in o.layouts))
    for w in o.workloads:
        say(f"collecting {nmax} worker gradients for {w} ...")
        wl = workloads.make(w, o.seed)
        if w.startswith("minilm"):  # inside the encoder layers, after the 11.7M word embeddings
            subsets[w] = slice(12_000_000, 12_000_000 + o.sweep_coords)
            warmup, warm_batch, warm_lr = o.minilm_warmup, o.batch, 5e-5
        else:  # the GPT has ~3.2M parameters: the middle of it
            start = max(0, (3_200_000 - o.sweep_coords) // 2)
            subsets[w] = slice(start, start + o.sweep_coords)
            warmup, warm_batch, warm_lr = o.gpt_warmup, 16, 1e-3
        grads[w] = workloads.gradients(
            wl, nmax, warmup, warm_batch, warm_lr, o.batch, o.seed, nfull, subsets[w]
        )
        descs[w] = (
            f"{wl.description}; gradients after {warmup} steps of AdamW (lr {warm_lr:g}), "
            f"{o.batch} sequences per worker"
        )
        sections.append(f"- **{w}**: {descs[w]}")

    others = [
        c
        for c in available_codecs()
        if c not in ("dynamiq", "fp32", "fp16") and (not o.codecs or c in o.codecs)
    ]
    every = [c for c in available_codecs() if not o.codecs or c in o.codecs or c == "dynamiq"]
    counts = {
        "ladder": len(o.workloads)
        * len(o.worlds)
        * len(o.topologies)
        * (len(LADDER) + len(others)),
        "eps": sum(len(v) for v in EPS_GRID.values()),
        "budget": len(o.workloads) * len(o.topologies) * 6,
        "scale": len(o.workloads) * len(o.topologies) * len(o.sweep_worlds) * (1 + len(others)),
        "beyond": len(o.workloads) * len(o.worlds) * len(BEYOND),
        "layouts": len(o.workloads) * len(o.layouts) * 4,
        "codecs": len(o.workloads) * len(o.worlds) * len(o.topologies) * len(every),
    }
    results: dict[Any, tuple[float, float]] = {}
    rows: list[list[Any]]

    total = sum(v for k, v in counts.items() if k in o.tables)
    with Progress("vnmse", total, every=5, stream=sys.stderr, transient=True) as prog:

        def sim(
            key: Any, xs: list[torch.Tensor], codec: Codec | str, topo: str, what: str
        ) -> tuple[float, float]:
            inst = get_codec(codec)
            for k in range(inst.warmup_rounds):
                simulate(xs, inst, topo, seed=o.seed + 1 + k)
            res = simulate(xs, inst, topo, seed=o.seed)
            results[key] = (res.vnmse, res.bits_per_coord)
            prog.update(what)
            return results[key]

        # 1. super-group norms
        if "norms" in o.tables:
            curves = {w: _norm_distribution(grads[w][0], 256, o.seed) for w in o.workloads}
            rows = []
            for w, (orig, shuf) in curves.items():
                for tag, vals in (("gradient", orig), ("shuffled", shuf)):
                    lv = torch.tensor(vals)
                    q = torch.quantile(lv[: min(len(lv), 1 << 24)], torch.tensor([0.1, 0.5, 0.9]))
                    rows.append(
                        [
                            w,
                            tag,
                            *(f"{v:.2f}" for v in q.tolist()),
                            f"{(lv < -2).float().mean().item():.1%}",
                            f"{(lv <= -30).float().mean().item():.2%}",
                        ]
                    )
            png = _plot_norms(curves, Path(o.plots) / "supergroup_norms.png")
            sections.append(
                "\n### Super-group norm distribution (paper Figures 1 and 3)\n\n"
                "log10 of F_j / median(F_j) for S = 256, worker 0's gradient and a random shuffle of it."
                + (f" Plot: `{png}`." if png else "")
                + "\n\n"
                + markdown_table(
                    ["workload", "order", "p10", "p50", "p90", "F_j < median/100", "F_j = 0"],
                    rows,
                )
            )

        # 2. eps sweep (MiniLM, or the first workload), fixed width, n = 4 ring
        if "eps" in o.tables:
            w0 = o.workloads[0]
            xs = grads[w0][:4]
            rows = []
            best: dict[int, tuple[float, float]] = {}
            for width, grid in EPS_GRID.items():
                for eps in grid:
                    eps_codec = DynamiQ(
                        allocation="fixed",
                        widths=(width,),
                        budget=width + 1.0,
                        rounding="independent",
                        eps=((width, eps),),
                        zero_class=False,
                        levels="uniform" if eps == 0 else "nonuniform",
                    )
                    v, b = sim(("eps", width, eps), xs, eps_codec, "ring", f"eps {width}b {eps}")
                    rows.append([width, eps, _fmt(v), f"{b:.3f}"])
                    if width not in best or v < best[width][1]:
                        best[width] = (eps, v)
            chosen = ", ".join(
                f"{w} bits: eps = {e} (default {DEFAULT_EPS.get(w)})" for w, (e, _) in best.items()
            )
            sections.append(
                f"\n### Choosing eps (non-uniform levels), {w0}, n = 4, ring\n\n"
                "Every super-group at one width, hierarchical scales, independent rounding; "
                "eps = 0 is the uniform grid. (2 bits has two levels, {0, 1}: eps has no effect.)\n\n"
                + markdown_table(["width", "eps", "vNMSE", "bits/coord"], rows)
                + f"\n\nLowest vNMSE: {chosen}."
            )

        # 3. ablation ladder + the other codecs
        if "ladder" in o.tables:
            for w in o.workloads:
                header = ["variant"] + [f"n={n} {t}" for n in o.worlds for t in o.topologies]
                rows = []
                for name, kw in LADDER + [(c, None) for c in others]:
                    row = [name]
                    for n in o.worlds:
                        for t in o.topologies:
                            codec: Codec = (
                                DynamiQ(**(PAPER_DYNAMIQ | kw))
                                if kw is not None
                                else get_codec(name)
                            )
                            v, b = sim(
                                ("ladder", w, name, n, t),
                                grads[w][:n],
                                codec,
                                t,
                                f"{w} {name} n={n} {t}",
                            )
                            row.append(f"{_fmt(v)} ({b:.2f} b)")
                    rows.append(row)
                sections.append(
                    f"\n### Ablation ladder (paper Table 6), {w}: vNMSE (measured bits/coordinate)\n\n"
                    + markdown_table(header, rows)
                    + "\n\nOmniReduce first runs 15 rounds on the same gradients so that its k "
                    "settles (as during training); MX is measured at its initial scale factor "
                    "mu = n, which FP8-LM's rule lowers only over thousands of rounds."
                )

        # 3b. every codec at its defaults, side by side
        if "codecs" in o.tables:
            for w in o.workloads:
                header = ["codec"] + [f"n={n} {t}" for n in o.worlds for t in o.topologies]
                rows = []
                for c in every:
                    row = [c]
                    for n in o.worlds:
                        for t in o.topologies:
                            v, b = sim(("codecs", w, c, n, t), grads[w][:n], c, t, f"{w} {c}")
                            row.append(f"{_fmt(v)} ({b:.2f} b)")
                    rows.append(row)
                sections.append(
                    f"\n### Every codec at its defaults, {w}: vNMSE (measured bits/coordinate)\n\n"
                    + markdown_table(header, rows)
                    + "\n\nDynamiQ here is hopq's default (exact allocation, zero class, "
                    "W = {2,4,8,16}), not the paper's configuration of the ladder above."
                )

        # 4. budget sweep (Table 4)
        if "budget" in o.tables:
            for w in o.workloads:
                rows = []
                for b in (3, 4, 5, 6, 7, 8):
                    row = [str(b)]
                    for t in o.topologies:
                        v, bits = sim(
                            ("budget", w, b, t),
                            grads[w][:4],
                            DynamiQ(**PAPER_DYNAMIQ, budget=float(b)),
                            t,
                            f"{w} b={b} {t}",
                        )
                        row.append(f"{_fmt(v)} ({bits:.2f} b)")
                    rows.append(row)
                sections.append(
                    f"\n### Bit budget (paper Table 4), {w}, n = 4: vNMSE (measured bits/coordinate)\n\n"
                    + markdown_table(["budget b"] + list(o.topologies), rows)
                )

        # 5. vNMSE against the world size (appendix B)
        if "scale" in o.tables:
            for w in o.workloads:
                rows = []
                for n in o.sweep_worlds:
                    xs = [g[subsets[w]] if i < nfull else g for i, g in enumerate(grads[w][:n])]
                    row = [str(n)]
                    for t in o.topologies:
                        for c in ["dynamiq", *others]:
                            inst = DynamiQ(**PAPER_DYNAMIQ) if c == "dynamiq" else get_codec(c)
                            v, _ = sim(("scale", w, n, t, c), xs, inst, t, f"{w} n={n} {t} {c}")
                            row.append(_fmt(v))
                    rows.append(row)
                sections.append(
                    f"\n### vNMSE against the world size, {w} ({o.sweep_coords:,} coordinates per worker)\n\n"
                    + markdown_table(
                        ["n"] + [f"{c} {t}" for t in o.topologies for c in ["dynamiq", *others]],
                        rows,
                    )
                )

        # 6. flat and two-tier DynamiQ on clusters of up to 128 x 8
        if "layouts" in o.tables:
            for w in o.workloads:
                sections.append(_layouts_table(o, w, grads[w], subsets[w], nfull, prog))

        # 7. beyond the paper
        if "beyond" in o.tables:
            for w in o.workloads:
                rows = []
                for name, kw in BEYOND:
                    row = [name]
                    for n in o.worlds:
                        v, b = sim(
                            ("beyond", w, name, n),
                            grads[w][:n],
                            DynamiQ(**kw),
                            "ring",
                            f"{w} {name} n={n}",
                        )
                        row.append(f"{_fmt(v)} ({b:.2f} b)")
                    rows.append(row)
                sections.append(
                    f"\n### Beyond the paper, {w}, ring, b = 5: vNMSE (measured bits/coordinate)\n\n"
                    + markdown_table(["variant"] + [f"n={n}" for n in o.worlds], rows)
                )

    # headline: DynamiQ vs MXFP8 when MXFP8 exists
    if "mxfp8" in available_codecs() and "ladder" in o.tables:
        for w in o.workloads:
            for n in o.worlds:
                dq_key = ("ladder", w, LADDER[4][0], n, "ring")
                mx_key = ("ladder", w, "mxfp8", n, "ring")
                if dq_key not in results or mx_key not in results:  # not asked for
                    continue
                dq, mx = results[dq_key][0], results[mx_key][0]
                sections.append(f"\n{w}, n = {n}, ring: MXFP8 / DynamiQ vNMSE = {mx / dq:.2f}x")
    return "\n".join(sections)
