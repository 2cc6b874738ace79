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
import warnings
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


#: Calls per captured graph in :func:`replay_timer`.
REPLAY_CALLS = 10


def replay_timer(repeats: int) -> Callable[[Callable[[], object]], float | None]:
    """The GPU's time of one call with the host's work taken out: ``fn``
    captured in a CUDA graph :data:`REPLAY_CALLS` times, each after the L2
    flush that ``do_bench`` makes, the graph replayed, less a graph of the
    flushes alone (the medians of ``repeats`` replays of each, alternated).
    Where a call's kernels wait for the host's launches (short kernels behind
    the codec's Python), this time is below :func:`timer`'s: the difference is
    the host's. None where the call cannot be captured: it synchronizes with
    the host (EQuARX's decoding reads its scale check back), which a first call
    under ``torch.cuda.set_sync_debug_mode("error")`` finds before any capture."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def capture(body: Callable[[], object]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(REPLAY_CALLS):
                flush.zero_()
                body()
        return graph

    def replay(graph: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    flushes = capture(lambda: None)

    def measure(fn: Callable[[], object]) -> float | None:
        # a first call on a side stream (where graphs capture: torch's recipe),
        # refused where it synchronizes with the host
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        mode = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():  # "a prototype feature", at every setting
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):
                fn()
        except RuntimeError:
            return None
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                torch.cuda.set_sync_debug_mode(mode)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
        try:
            graph = capture(fn)
        except RuntimeError:
            torch.cuda.synchronize()
            return None
        with_fn, alone = [], []
        for _ in range(max(repeats, 3)):
            with_fn.append(replay(graph))
            alone.append(replay(flushes))
        del graph
        spent = statistics.median(with_fn) - statistics.median(alone)
        return max(spent, 0.0) / REPLAY_CALLS

    return measure


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
    device: torch.device,
    n: int,
    bits: str,
    kernel: str,
    t: float,
    moved: float,
    copy_bw: float,
    replayed: tuple[float | None] | None = None,
) -> list[object]:
    """A table row: time, bytes moved, bandwidth, share of copy, coordinates/s;
    on CUDA (``replayed`` given) also the replayed time (:func:`replay_timer`;
    None: not captured) and its bandwidth's share of the same copy."""
    bw = moved / t
    row: list[object] = [device.type, f"{n:,}", bits, kernel, f"{t * 1e3:.3f}", f"{moved / 1e6:.1f}",
                         f"{bw / 1e9:.1f}", f"{bw / copy_bw:.0%}", f"{n / t / 1e6:.0f}"]  # fmt: skip
    if replayed is not None:
        (tr,) = replayed
        row += ["-", "-"] if tr is None else [f"{tr * 1e3:.3f}", f"{moved / tr / copy_bw:.0%}"]
    return row


def _replayed(share: float | None) -> str:
    """The replayed share for the progress line, where there is one."""
    return "" if share is None else f" ({share:.0%} replayed)"


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
    replay = None
    if device.type == "cuda":
        try:
            replay = replay_timer(o.repeats)
        except RuntimeError as e:  # no graphs here: the table says so by its columns
            say(f"CUDA graphs unavailable ({e}); the replayed columns are left out")
    #: this size's copy bandwidth (the ceiling of both columns: a copy is one
    #: launch, no host work to take out, and a graph may run a large one as a
    #: copy engine's memcpy rather than a kernel)
    ceiling: dict[str, float] = {}
    rows: list[list[object]] = []
    curves: dict[str, list[tuple[int, float, float | None]]] = {}
    backend_used = "?"
    backends: dict[str, str] = {}  # codec -> the backend its kernels ran on

    def timed(
        n: int, bits: str, kernel: str, fn: Callable[[], object], moved: float, t: float = 0.0
    ) -> tuple[float, float | None]:
        """Time ``fn`` (unless its time ``t`` is given) and replay it on CUDA,
        add its row; its bandwidth's share of copy, and replayed (None where
        not replayed)."""
        t = t or measure(fn)
        tr = None
        if replay is not None:
            try:
                tr = replay(fn)
            except RuntimeError as e:
                say(f"{kernel}: not replayed ({e})")
        replayed = None if replay is None else (tr,)
        rows.append(_row(device, n, bits, kernel, t, moved, ceiling["copy"], replayed))
        return moved / t / ceiling["copy"], None if tr is None else moved / tr / ceiling["copy"]

    def one_width(w: int, x: torch.Tensor) -> Any:
        nonlocal backend_used
        n = x.numel()
        codec = DynamiQ(widths=(w,), budget=w + 1.0, allocation="fixed", backend=o.backend)
        backend_used = backends["dynamiq"] = codec.backend_name(device)
        plan = codec.plan(x, LocalStats())
        work = codec.prepare_all(plan, x)
        ctx = HopContext(0, 0, 0, 1, 0, 2)
        payload = codec.encode(plan, work, ctx)
        for name, fn, moved in _four_kernels(codec, plan, work, work, payload, ctx, n):
            share, again = timed(n, str(w), name, fn, moved)
            if name == "decompress_accumulate_recompress":
                curves.setdefault(f"DynamiQ {w}-bit fused hop", []).append((n, share, again))
                say(f"{'':>11}  {w:>2}-bit fused hop {share:.0%} of copy{_replayed(again)}")
        return codec.kernels(device)

    def one_codec(name: str, x: torch.Tensor) -> None:
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
            share, again = timed(n, bits, f"{name} {kernel}", fn, moved)
            if kernel == "decompress_accumulate_recompress":
                curves.setdefault(f"{name} fused hop", []).append((n, share, again))
                say(f"{'':>11}  {name} fused hop {share:.0%} of copy{_replayed(again)}")

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
        ceiling["copy"] = 2 * 4 * n / t_copy
        say(f"{n:>11,} coords  copy {ceiling['copy'] / 1e9:7.1f} GB/s")
        timed(n, "-", "copy (ceiling)", lambda: dst.copy_(src), 8 * n, t_copy)
        # the uncompressed floor: a bf16 hop (decode, add, encode)
        inb = x.to(torch.bfloat16)

        def bf16_hop() -> torch.Tensor:
            return (src + inb.float()).to(torch.bfloat16)

        timed(n, "16", "bf16 hop (floor)", bf16_hop, 2 * n + 4 * n + 2 * n)
        kern = None
        if "dynamiq" in o.codecs:
            for w in o.widths:
                kern = one_width(w, x)
        # the statistics pre-pass (width-independent)
        if kern is not None:
            stats_kernel = kern.supergroup_stats
            timed(n, "-", "stats pre-pass", lambda: stats_kernel(x, 256), 4 * n + 8 * (n // 256))
        for name in o.codecs:
            if name != "dynamiq":
                one_codec(name, x)

    try:
        for d in sizes:
            one_size(d)
    finally:
        torch.set_num_threads(threads)
    header = ["device", "coords", "bits", "kernel", "ms", "MB moved", "GB/s", "of copy", "Mcoord/s"]
    if replay is not None:
        header += ["ms, replayed", "of copy, replayed"]
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
    if replay is not None:
        text += (
            f"\n\n'replayed': the call captured {REPLAY_CALLS} times in a CUDA graph, each after "
            "the same L2 flush, less the flushes alone: the GPU's time with the host's launches "
            "taken out, against the same copy bandwidth; '-': the call synchronizes with the "
            "host and cannot be captured."
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
            for i, (label, pts) in enumerate(curves.items()):
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=label,
                        color=f"C{i}")  # fmt: skip
                again = [(p[0], p[2]) for p in pts if p[2] is not None]
                if again:  # replayed: the host's launches taken out
                    ax.plot([p[0] for p in again], [100 * p[1] for p in again], ls="--",
                            color=f"C{i}")  # fmt: skip
            if replay is not None:
                ax.plot([], [], ls="--", color="grey", label="dashed: replayed (no host)")
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
