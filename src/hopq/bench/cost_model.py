"""``hopq bench model``: an alpha-beta-gamma cost model of compressed ring and
butterfly all-reduce, calibrated on this machine, checked against the emulated
network.

The model (Thakur, Rabenseifner and Gropp's alpha-beta-gamma, with the
compressed terms of Global-QSGD's section 7 made per hop, because here every
hop decompresses, accumulates and recompresses):

    T = steps * alpha                                  (latency per step)
      + bytes_per_rank / beta                          (bandwidth; full-duplex links)
      + stats_steps * alpha + stats_bytes / beta       (the statistics exchange)
      + w * (d * c_plan + H_enc * c_enc + H_hop * c_hop + H_dec * c_dec)

with, for n ranks and d coordinates, bytes_per_rank = 2 (n-1)/n * d * b/8 (b the
codec's bits per coordinate measured by the simulator), and per rank the
coordinates each codec step touches: a ring encodes d/n once as a leaf, runs
the fused hop on (n-1) d/n and decodes (n-1) d/n plus its own chunk; a
butterfly of p = 2^k core ranks runs the fused hop on d (1 - 1/p) and decodes as
much. c_* are seconds per coordinate measured here for each codec (one core);
w = max(1, n / cores) accounts for ranks sharing the machine's cores.

Two terms beyond the textbook model: a butterfly on a non-power-of-two n folds
the extra ranks in (their whole vector, compressed, to a partner before, the
whole result back after: 2 d b/8 more on the critical path, one more encode and
two more decodes of d); and a step in which a rank sends to and receives from
the same peer (a ring of 2, every butterfly exchange) takes ``duplex`` times a
one-way transfer, a factor measured on the network at hand (1 on a full-duplex
link, as the emulated network measures: 1.00-1.06).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from hopq.bench.kernels import one_thread
from hopq.codecs.registry import codec_choices, get_codec, resolve_codecs
from hopq.comm.cost import CodecCost, Network, calibration_vector, time_codec
from hopq.comm.cost import predict as predict_cluster
from hopq.options import check_scoped, option
from hopq.reporting import machine, markdown_table


@dataclass(frozen=True)
class ModelOptions:
    codecs: tuple[str, ...] = option(
        ("bf16", "dynamiq", "mxfp8", "thc", "omnireduce"), "codecs to model", choices=codec_choices
    )
    bandwidth_gbit: float = option(10.0, "prediction: per-worker link bandwidth in Gbit/s")
    latency_us: float = option(20.0, "prediction: latency per step in microseconds")
    worlds: tuple[int, ...] = option((8, 64, 256, 1024), "prediction: world sizes")
    size_mib: float = option(64.0, "prediction: tensor size in MiB")
    validate: bool = option(True, "check the model on the emulated network (needs root and tc)")
    validate_worlds: tuple[int, ...] = option((2, 3, 4, 6, 8), "validation: world sizes")
    validate_rate_mbit: float = option(200.0, "validation: per-worker link in Mbit/s")
    validate_size_mib: float = option(4.0, "validation: tensor size in MiB")
    duplex: float = option(
        0.0,
        "validation: the duplex factor the model uses (1: full-duplex links); 0: the one "
        "measured per run (two ranks sending to each other against one way)",
    )
    calib_coords: int = option(1 << 20, "coordinates of the one-core calibration")
    layouts: tuple[str, ...] = option(
        ("2x2", "8x8", "32x8", "128x8"),
        "two-tier prediction: clusters as NODESxWORKERS (nodes x workers per node)",
    )
    inter_gbit: float = option(100.0, "two-tier prediction: each node's uplink in Gbit/s")
    intra_gbit: float = option(
        900.0, "two-tier prediction: each worker's link inside its node, Gbit/s"
    )
    schedules: tuple[str, ...] = option(
        ("ring", "butterfly", "hier:ring", "hier:butterfly"),
        "two-tier prediction: flat topologies over all ranks, or hier:<topology> between nodes",
    )
    plot: str = option("", "two-tier prediction: write a plot of the predicted times to this PNG")

    def __post_init__(self) -> None:
        resolve_codecs(self.codecs)
        if not (self.duplex == 0 or 1 <= self.duplex <= 4):
            raise ValueError(f"--duplex must be 0 (measured) or between 1 and 4, got {self.duplex}")
        for lay in self.layouts:
            parse_layout(lay)
        check_scoped(
            self,
            dict.fromkeys(
                ("validate_worlds", "validate_rate_mbit", "validate_size_mib", "duplex"), ("",)
            ),
            ("",) if self.validate else (),
            "--validate",
        )


def parse_layout(text: str) -> tuple[int, int]:
    """``"NxG"`` -> (N, G): N nodes of G workers."""
    try:
        n, g = (int(v) for v in str(text).lower().split("x"))
    except ValueError:
        raise ValueError(f"layout {text!r}: expected NODESxWORKERS such as 8x8") from None
    if n < 1 or g < 1:
        raise ValueError(f"layout {text!r}: nodes and workers per node must be at least 1")
    return n, g


def cluster_table(
    costs: dict[str, CodecCost], o: ModelOptions, d: int, exact: CodecCost | None
) -> tuple[list[str], list[tuple[str, str, int, float]]]:
    """The two-tier prediction as table lines, and (codec, schedule, ranks,
    seconds) points for the plot."""
    rows: list[list[Any]] = []
    points: list[tuple[str, str, int, float]] = []
    for lay in o.layouts:
        n, g = parse_layout(lay)
        net = Network(n, g, o.inter_gbit, o.intra_gbit, o.latency_us, cores_per_node=g)
        base = {
            s: predict_cluster(costs["bf16"], s, net, d, exact).seconds
            for s in o.schedules
            if "bf16" in costs
        }
        for sched in o.schedules:
            row: list[Any] = [lay, sched]
            chain = 0
            for c, cost in costs.items():
                p = predict_cluster(cost, sched, net, d, exact)
                chain = p.recompressions
                speed = f" ({base[sched] / p.seconds:.2f}x)" if sched in base else ""
                row.append(f"{p.seconds * 1e3:.1f} ms{speed}")
                points.append((c, sched, n * g, p.seconds))
            row.insert(2, chain)
            rows.append(row)
    lines = [
        "",
        f"### Two tiers: {o.size_mib:g} MiB, uplinks of {o.inter_gbit:g} Gbit/s per node, "
        f"{o.intra_gbit:g} Gbit/s per worker inside a node, {o.latency_us:g} us per step, "
        "one core per worker (time, speed-up over bf16 on the same schedule; "
        "recompressions: the longest chain of compressions a contribution goes through)",
        "",
        markdown_table(["layout", "schedule", "recompressions", *costs], rows),
    ]
    return lines, points


def cluster_plot(points: list[tuple[str, str, int, float]], path: str) -> str | None:
    """Predicted time against the number of ranks, one panel per codec."""
    from hopq.reporting import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return None
    from pathlib import Path

    codecs = sorted({c for c, *_ in points})
    fig, axes = plt.subplots(1, len(codecs), figsize=(4 * len(codecs), 3.6), squeeze=False)
    for ax, c in zip(axes[0], codecs, strict=True):
        for sched in sorted({s for cc, s, *_ in points if cc == c}):
            xs = [(p, t) for cc, s, p, t in points if cc == c and s == sched]
            ax.plot(
                [p for p, _ in xs],
                [t * 1e3 for _, t in xs],
                marker="o",
                ls="-" if sched.startswith("hier:") else "--",
                label=sched,
            )
        ax.set_xscale("log", base=2)
        ax.set_title(c)
        ax.set_xlabel("ranks (nodes x workers)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("predicted all-reduce (ms)")
    axes[0][-1].legend(fontsize=8)
    return str(save_figure(fig, Path(path)))


def calibrate(codec_name: str, coords: int, device: str | torch.device = "cpu") -> CodecCost:
    """Measure a codec's per-coordinate costs with its own API on one core, its
    tensors on ``device`` (on CUDA its GPU kernels, each timing synchronized),
    and its bits per coordinate with the simulator."""
    from hopq.sim import simulate

    with one_thread():
        cost = time_codec(codec_name, coords, device)
        x = calibration_vector(coords)[: 1 << 18]
        bits = simulate([x] * 4, codec_name, "ring").bits_per_coord
    return replace(cost, bits=bits)


def predict(
    cost: CodecCost,
    topology: str,
    n: int,
    d: int,
    beta_bytes: float,
    alpha: float,
    cores: int,
    duplex: float = 1.0,
) -> float:
    """Modelled seconds of one all-reduce of d float32 coordinates on n ranks.
    ``duplex``: how much longer a step takes when a rank sends to and receives
    from the same peer at once (ring of 2, every butterfly exchange) than a
    one-way transfer of the same size; 1 on full-duplex links."""
    if n == 1:
        return d * (cost.plan + cost.enc + cost.dec)
    payload = d * cost.bits / 8
    if topology == "ring":
        steps = 2 * (n - 1)
        enc, hop, dec = d / n, (n - 1) * d / n, d
        wire = 2 * (n - 1) / n * payload * (duplex if n == 2 else 1.0)
    else:
        p = 1 << (n.bit_length() - 1)
        steps = 2 * int(math.log2(p)) + (2 if p != n else 0)
        enc, hop, dec = d / p, d * (1 - 1 / p), d
        wire = 2 * (p - 1) / p * payload * duplex
        if p != n:  # fold: an extra rank's whole vector in, the whole result out
            wire += 2 * payload
            enc, dec = enc + d, dec + 2 * d
    overload = max(1.0, n / cores)
    compute = overload * (d * cost.plan + enc * cost.enc + hop * cost.hop + dec * cost.dec)
    stats_steps = 2 * (n - 1) if cost.bits < 15.5 else 0  # codecs with a stats exchange
    return (steps + stats_steps) * alpha + wire / beta_bytes + compute


def _measure_worker(
    rank: int, n: int, codecs: list[str], topologies: list[str], numel: int
) -> dict[Any, float]:
    import torch.distributed as dist

    from hopq.comm.collectives import all_reduce

    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    out: dict[Any, float] = {}
    # latency: median time of a 4-byte ring step
    s, r = torch.zeros(1), torch.empty(1)
    lat = []
    for _ in range(30):
        dist.barrier()
        t0 = time.perf_counter()
        for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, s, (rank + 1) % n), dist.P2POp(dist.irecv, r, (rank - 1) % n)]
        ):
            w.wait()
        lat.append(time.perf_counter() - t0)
    out["alpha"] = statistics.median(lat)
    # duplex: a same-peer exchange against a one-way transfer of 1 MiB (pairs 2i, 2i+1)
    peer = rank ^ 1
    big, into = torch.zeros(1 << 18), torch.empty(1 << 18)
    one: list[float] = []
    both: list[float] = []
    for mode, acc in (("one", one), ("both", both)):
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            if peer < n:
                ops = []  # receives first, as hopq's engine posts them
                if rank % 2 == 1 or mode == "both":
                    ops.append(dist.P2POp(dist.irecv, into, peer))
                if rank % 2 == 0 or mode == "both":
                    ops.append(dist.P2POp(dist.isend, big, peer))
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            acc.append(time.perf_counter() - t0)
    # each mode lasts until its slowest rank is done: a one-way send completes on
    # the sender once the kernel holds the bytes (as much as its socket buffers
    # take, 4 MiB in 56 ms at 200 Mbit/s), on the receiver once they crossed
    # the link, so only the slowest rank's time is the transfer's; the ratio of
    # one rank's own two times would read the buffering as half duplex
    f = torch.tensor(
        [statistics.median(one), statistics.median(both)] if peer < n else [0.0, 0.0],
        dtype=torch.float64,
    )
    dist.all_reduce(f, op=dist.ReduceOp.MAX)
    out["duplex"] = min(2.0, max(1.0, float(f[1] / f[0]))) if f[0] > 0 else 1.0
    for c in codecs:
        codec = get_codec(c)
        for topo in topologies:
            times = []
            for _ in range(4):
                y = x.clone()
                dist.barrier()
                t0 = time.perf_counter()
                all_reduce(y, codec, topo)
                times.append(time.perf_counter() - t0)
            t = torch.tensor(times[1:], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out[(c, topo)] = float(t.median())
    return out


def run(o: ModelOptions) -> str:
    from hopq.cluster.launch import run_workers
    from hopq.cluster.network import CONGESTION, EmulatedNetwork, unavailable_reason

    codecs = resolve_codecs(o.codecs)  # 'all' and 'auto' name codecs too
    if not codecs:
        raise ValueError("hopq bench model: no codecs to model (--codecs)")
    cores = torch.get_num_threads() or 1
    costs = {c: calibrate(c, o.calib_coords) for c in codecs}
    lines = [f"Machine: {machine()}", "", "### Calibration (one core, this machine)", ""]
    lines.append(
        markdown_table(
            [
                "codec",
                "plan+prepare+finish (ns/coord)",
                "encode (ns/coord)",
                "fused hop (ns/coord)",
                "decode (ns/coord)",
                "bits/coord",
            ],
            [
                [
                    c.codec,
                    f"{c.plan * 1e9:.1f}",
                    f"{c.enc * 1e9:.1f}",
                    f"{c.hop * 1e9:.1f}",
                    f"{c.dec * 1e9:.1f}",
                    f"{c.bits:.2f}",
                ]
                for c in costs.values()
            ],
        )
    )
    d = int(o.size_mib * (1 << 20) / 4)
    beta = o.bandwidth_gbit * 1e9 / 8
    alpha = o.latency_us * 1e-6
    rows = []
    for n in o.worlds:
        for topo in ("ring", "butterfly"):
            base = predict(costs["bf16"], topo, n, d, beta, alpha, n) if "bf16" in costs else None
            row: list[Any] = [n, topo]
            for c in codecs:
                t = predict(costs[c], topo, n, d, beta, alpha, n)  # one core per rank on a cluster
                row.append(f"{t * 1e3:.1f} ms" + (f" ({base / t:.2f}x)" if base else ""))
            rows.append(row)
    lines += [
        "",
        f"### Prediction: {o.size_mib:g} MiB, {o.bandwidth_gbit:g} Gbit/s per worker, {o.latency_us:g} us per step, "
        "one core per rank (time, speedup over bf16)",
        "",
        markdown_table(["n", "topology", *codecs], rows),
    ]
    exact = calibrate("fp32", o.calib_coords) if o.layouts else None
    more, points = cluster_table(costs, o, d, exact)
    lines += more
    if o.plot:
        made = cluster_plot(points, o.plot)
        lines += ["", f"![predicted times]({made})" if made else "(no plot: matplotlib missing)"]
    if o.validate:
        why = unavailable_reason()
        if why:
            lines += ["", f"Validation skipped: no emulated network here ({why})."]
        else:
            numel = int(o.validate_size_mib * (1 << 20) / 4)
            vrows = []
            errs = []
            beta_v = (
                o.validate_rate_mbit * 1e6 / 8 * 0.96
            )  # tbf delivers ~96% (tests/test_network.py)
            for n in o.validate_worlds:
                with EmulatedNetwork(n, rate_mbit=o.validate_rate_mbit) as net:
                    res = run_workers(
                        n,
                        _measure_worker,
                        codecs,
                        ["ring", "butterfly"],
                        numel,
                        namespaces=net.namespaces,
                    )[0]
                if o.duplex:
                    res["duplex"] = o.duplex
                for topo in ("ring", "butterfly"):
                    for c in codecs:
                        pred = predict(
                            costs[c], topo, n, numel, beta_v, res["alpha"], cores, res["duplex"]
                        )
                        meas = res[(c, topo)]
                        errs.append(abs(pred - meas) / meas)
                        vrows.append(
                            [
                                n,
                                f"{res['duplex']:.2f}",
                                topo,
                                c,
                                f"{meas * 1e3:.0f}",
                                f"{pred * 1e3:.0f}",
                                f"{(pred / meas - 1) * 100:+.0f}%",
                            ]
                        )
            lines += [
                "",
                f"### Model vs emulated network: {o.validate_size_mib:g} MiB, {o.validate_rate_mbit:g} Mbit/s per worker "
                f"(TCP {CONGESTION}), "
                f"alpha measured per run, the duplex factor "
                f"{'given' if o.duplex else 'measured per run'}, {cores} cores shared by the ranks",
                "",
                markdown_table(
                    ["n", "duplex", "topology", "codec", "measured (ms)", "model (ms)", "error"],
                    vrows,
                ),
                "",
                f"Mean absolute error {statistics.mean(errs) * 100:.0f}%, median {statistics.median(errs) * 100:.0f}%, "
                f"worst {max(errs) * 100:.0f}%.",
            ]
    return "\n".join(lines)
