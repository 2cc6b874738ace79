"""``hopq bench kernels``: codec kernels against a copy of the same device.

For each DynamiQ width and size, one width-uniform segment (what the reorder
makes of every chunk) goes through the codec's four kernels as the engine calls
them: compress, decompress, decompress-accumulate and the fused
decompress-accumulate-recompress hop, plus the statistics pre-pass. With
``--codecs``, EQuARX and MXFP8/6/4 (at their defaults, the call as one chunk)
go through the same four through their codec API, whichever backend
``--backend`` picks for the device (the Triton kernels on CUDA). Each row
gives the time (the median; on CUDA triton's ``do_bench``, the GPU's time per
call with the L2 cache flushed before each: :func:`timer`), the bytes the kernel
must move (counted: compressed in, local chunk in, compressed or float out),
the bandwidth this achieves and its ratio to a copy measured in the same run
(``torch.Tensor.copy_`` of the chunk: device-to-device on GPU, ``memcpy`` on one
CPU core). Beside them, the uncompressed bf16 hop (decode bf16, add, encode
bf16) is the floor a compressed hop competes with.

On CPU every timing is single-threaded (the numba kernels use one core, and the
copy and the bf16 hop are held to one thread too), so coordinates per second
read as "per core".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hopq.codecs.base import HopContext, LocalStats
from hopq.codecs.dynamiq import Backend, DynamiQ
from hopq.codecs.registry import get_codec
from hopq.options import check_scoped, option
from hopq.reporting import machine, markdown_table, pyplot, save_figure

#: Codecs ``--codecs`` takes: DynamiQ per width, the others at their defaults.
BENCH_CODECS = ("dynamiq", "equarx", "mxfp8", "mxfp6", "mxfp4")


@dataclass(frozen=True)
class KernelOptions:
    sizes: tuple[int, ...] = option(
        (), "coordinates per segment; default: 1M, 4M, 16M on CPU, up to 256M on GPU"
    )
    codecs: tuple[str, ...] = option(
        ("dynamiq",),
        "codecs whose kernels to time (dynamiq per --widths, the others at their defaults)",
        choices=BENCH_CODECS,
    )
    widths: tuple[int, ...] = option((2, 4, 8, 16), "DynamiQ's bit widths", choices=(2, 4, 8, 16))
    device: str = option(
        "auto", "auto: CUDA when available, else CPU", choices=("auto", "cpu", "cuda")
    )
    backend: str = option(
        "auto",
        "every codec's backend (the same bits; auto: Triton on CUDA, numba on CPU)",
        choices=tuple(b.value for b in Backend),
    )
    repeats: int = option(5, "timed repetitions (median) after a warm-up")
    plot: str = option("kernel_bandwidth.png", "bandwidth plot (PNG); empty: none")

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("--repeats must be at least 1")
        if any(s < 256 for s in self.sizes):
            raise ValueError("--sizes must be at least one super-group (256 coordinates)")
        if any(w not in (2, 4, 8, 16) for w in self.widths):
            raise ValueError("--widths must be among 2 4 8 16")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError("--device must be auto, cpu or cuda")
        if not self.codecs or any(c not in BENCH_CODECS for c in self.codecs):
            raise ValueError(f"--codecs must be among {' '.join(BENCH_CODECS)}")
        check_scoped(self, {"widths": ("dynamiq",)}, self.codecs, "--codecs")


def timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    """The median time of ``fn`` in seconds. On CUDA, triton's ``do_bench``
    where Triton is installed: the GPU's own time per call (events), the L2
    cache flushed before each, after about 25 ms of warm-up calls (which also
    lift the clocks from idle), over about ``repeats`` x 10 ms of calls; the
    host's Python work between kernels of one call is included only where the
    GPU waits for it. Elsewhere: ``repeats`` calls after one warm-up."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:

            def bench(fn: Callable[[], object]) -> float:
                ms = do_bench(fn, warmup=25, rep=10 * repeats, return_mode="median")
                return float(ms) / 1e3

            return bench

    def measure(fn: Callable[[], object]) -> float:
        fn()  # warm-up (compilation, caches)
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    return measure


def _four_kernels(
    codec: Any,
    plan: Any,
    work: torch.Tensor,
    local: torch.Tensor,
    payload: torch.Tensor,
    ctx: HopContext,
    n: int,
) -> list[tuple[str, Callable[[], object], int]]:
    """A codec's four kernels as the engine calls them, with the bytes each must
    move: compress ``work``, decompress and decompress-accumulate ``payload``,
    and the fused hop on ``local`` (which a codec may overwrite)."""
    P = payload.numel()
    acc, out = work.clone(), torch.empty_like(work)
    return [
        ("compress", lambda: codec.encode(plan, work, ctx), 4 * n + P),
        ("decompress", lambda: codec.decode(plan, payload, ctx, out), P + 4 * n),
        (
            "decompress_accumulate",
            lambda: codec.decode_accumulate(plan, payload, acc, ctx),
            P + 8 * n,
        ),
        (
            "decompress_accumulate_recompress",
            lambda: codec.decode_accumulate_encode(plan, payload, local, ctx),
            P + 4 * n + P,
        ),
    ]


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads off for the block, so that references run on one
    core like the kernels they are compared with."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _row(
    device: torch.device, n: int, bits: str, kernel: str, t: float, moved: float, copy_bw: float
) -> list[object]:
    """A table row: time, bytes moved, bandwidth, share of copy, coordinates/s."""
    bw = moved / t
    return [device.type, f"{n:,}", bits, kernel, f"{t * 1e3:.3f}", f"{moved / 1e6:.1f}",
            f"{bw / 1e9:.1f}", f"{bw / copy_bw:.0%}", f"{n / t / 1e6:.0f}"]  # fmt: skip


def run(o: KernelOptions, log: Callable[[str], None] | None = print) -> str:
    say = log or (lambda _s: None)
    if o.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(o.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    sizes = o.sizes or (
        (1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28)
        if device.type == "cuda"
        else (1 << 20, 1 << 22, 1 << 24)
    )
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    measure = timer(device, o.repeats)
    rows: list[list[object]] = []
    curves: dict[str, list[tuple[int, float]]] = {}
    backend_used = "?"
    backends: dict[str, str] = {}  # codec -> the backend its kernels ran on

    def one_width(w: int, x: torch.Tensor, copy_bw: float) -> Any:
        nonlocal backend_used
        n = x.numel()
        codec = DynamiQ(widths=(w,), budget=w + 1.0, allocation="fixed", backend=o.backend)
        backend_used = backends["dynamiq"] = codec.backend_name(device)
        plan = codec.plan(x, LocalStats())
        work = codec.prepare_all(plan, x)
        ctx = HopContext(0, 0, 0, 1, 0, 2)
        payload = codec.encode(plan, work, ctx)
        for name, fn, moved in _four_kernels(codec, plan, work, work, payload, ctx, n):
            t = measure(fn)
            bw = moved / t
            rows.append(_row(device, n, str(w), name, t, moved, copy_bw))
            if name == "decompress_accumulate_recompress":
                curves.setdefault(f"{w}-bit fused hop", []).append((n, bw / copy_bw))
                say(
                    f"{'':>11}  {w:>2}-bit fused hop {n / t / 1e6:7.0f} Mcoord/s, {bw / copy_bw:.0%} of copy"
                )
        return codec.kernels(device)

    def one_codec(name: str, x: torch.Tensor, copy_bw: float) -> None:
        """A codec at its defaults, the call as one chunk, through its codec API."""
        n = x.numel()
        codec = get_codec(name, backend=o.backend)
        kern = getattr(codec, "kernels", lambda _d: None)(device)
        backends[name] = "reference" if kern is None else kern.__name__.rsplit("_", 1)[-1]
        plan = codec.plan(x, LocalStats())
        work = plan.chunk_view(codec.prepare_all(plan, x), 0)
        ctx = HopContext(0, 0, 0, 1, 0, 2)
        payload = codec.encode(plan, work, ctx)
        P = payload.numel()
        bits = f"{8 * P / n:.2f}"
        kernels = _four_kernels(codec, plan, work, work.clone(), payload, ctx, n)
        for kernel, fn, moved in kernels:
            t = measure(fn)
            rows.append(_row(device, n, bits, f"{name} {kernel}", t, moved, copy_bw))
            if kernel == "decompress_accumulate_recompress":
                bw = moved / t
                curves.setdefault(f"{name} fused hop", []).append((n, bw / copy_bw))
                say(
                    f"{'':>11}  {name} fused hop {n / t / 1e6:7.0f} Mcoord/s, "
                    f"{bw / copy_bw:.0%} of copy"
                )

    def one_size(d: int) -> None:
        nonlocal backend_used
        g = torch.Generator().manual_seed(d)
        m = d // 256
        scale = torch.logspace(-4, 0, m)[torch.randperm(m, generator=g)].repeat_interleave(256)
        x = (torch.randn(m * 256, generator=g) * scale).to(device)
        n = x.numel()
        src = x.clone()
        dst = torch.empty_like(x)
        t_copy = measure(lambda: dst.copy_(src))
        copy_bw = 2 * 4 * n / t_copy
        say(f"{n:>11,} coords  copy {copy_bw / 1e9:7.1f} GB/s")
        rows.append(_row(device, n, "-", "copy (ceiling)", t_copy, 8 * n, copy_bw))
        # the uncompressed floor: a bf16 hop (decode, add, encode)
        inb = x.to(torch.bfloat16)

        def bf16_hop() -> torch.Tensor:
            return (src + inb.float()).to(torch.bfloat16)

        t = measure(bf16_hop)
        rows.append(_row(device, n, "16", "bf16 hop (floor)", t, 2 * n + 4 * n + 2 * n, copy_bw))
        kern = None
        if "dynamiq" in o.codecs:
            for w in o.widths:
                kern = one_width(w, x, copy_bw)
        # the statistics pre-pass (width-independent)
        if kern is not None:
            stats_kernel = kern.supergroup_stats
            t = measure(lambda: stats_kernel(x, 256))
            moved = 4 * n + 8 * (n // 256)
            rows.append(_row(device, n, "-", "stats pre-pass", t, moved, copy_bw))
        for name in o.codecs:
            if name != "dynamiq":
                one_codec(name, x, copy_bw)

    try:
        for d in sizes:
            one_size(d)
    finally:
        torch.set_num_threads(threads)
    header = ["device", "coords", "bits", "kernel", "ms", "MB moved", "GB/s", "of copy", "Mcoord/s"]
    where = "GPU" if device.type == "cuda" else "CPU, one core"
    if o.codecs == ("dynamiq",):
        title = f"DynamiQ kernels ({where}; backend: {backend_used})"
    else:
        used = ", ".join(f"{c} {b}" for c, b in backends.items())
        title = f"Codec kernels ({where}; backends: {used})"
    text = (
        f"# {title}\n\n"
        f"Machine: {machine()}\n\n"
        + markdown_table(header, rows)
        + "\n\nMB moved counts compressed in, local chunk in, compressed or float32 out "
        "(bits: the payload's per coordinate); "
        "'of copy' is the bandwidth over that of copy_() of the chunk (read + write) in the same run."
    )
    if device.type == "cpu":
        text += (
            "\n\nRan on CPU: the GPU rows (Triton kernels on a CUDA device) are not measured "
            "by this run; `hopq bench kernels --device cuda` on a GPU machine measures them."
        )
    if o.plot and curves:
        plt = pyplot()
        if plt is not None:
            fig, ax = plt.subplots(figsize=(6, 3.6))
            for label, pts in curves.items():
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("coordinates")
            ax.set_ylabel("% of copy bandwidth")
            what = "DynamiQ" if o.codecs == ("dynamiq",) else "Codec"
            ax.set_title(f"{what} fused hop ({where}, {', '.join(sorted(set(backends.values())))})")
            ax.grid(alpha=0.3)
            ax.legend()
            path = save_figure(fig, Path(o.plot))
            text += f"\n\nPlot: {path}"
    return text
