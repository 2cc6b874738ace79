"""The fused hop's launch settings on a GPU: each setting's time for one chunk,
its share of a copy's bandwidth, and whether its payload has the default
setting's bits. The figures behind the register caps and tile sizes of
docs/bench/kernels.md. Run it on a machine with a CUDA GPU:

    python docs/bench/scripts/hop_launch_sweep.py --codecs mxfp8 mxfp6 mxfp4 equarx

Each codec's kernel module reads its settings at every call (MX and EQuARX:
``TILE``, ``HOP_MAXNREG``; EQuARX also ``WARPS``; DynamiQ: ``_LAUNCH``'s
``maxnreg``), so the script sets them between calls. Times are triton's
``do_bench`` medians (the L2 cache flushed before each call), the better of
two; a setting whose bits differ from the default's is marked, never kept.
``--device cpu`` runs the same sweep under Triton's interpreter
(``TRITON_INTERPRET=1``) on a small chunk: a check of the script, not a
timing."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from hopq.codecs.base import HopContext, LocalStats
from hopq.codecs.dynamiq import DynamiQ
from hopq.codecs.registry import get_codec

#: Settings per kernel module: (label, {module attribute: value}).
CAPS = (None, 64, 56, 48, 40)


def _settings(codec: str) -> tuple[Any, list[tuple[str, dict[str, Any]]]]:
    if codec.startswith("mxfp"):
        import hopq.codecs.mx.kernels_triton as mod

        return mod, [
            (f"tile {tile}, cap {cap}", {"TILE": tile, "HOP_MAXNREG": cap})
            for tile in (2048, 1024)
            for cap in CAPS
        ]
    if codec == "equarx":
        import hopq.codecs.equarx.kernels_triton as mod

        return mod, [
            (f"tile {tile}, cap {cap}", {"TILE": tile, "HOP_MAXNREG": cap})
            for tile in (2048, 1024)
            for cap in CAPS
        ]
    import hopq.codecs.dynamiq.kernels_triton as mod

    base = dict(mod._LAUNCH)
    return mod, [
        (f"cap {cap}", {"_LAUNCH": {**base, **({} if cap is None else {"maxnreg": cap})}})
        for cap in CAPS
    ]


def _codec(name: str) -> Any:
    """The codec on its Triton kernels (on CPU tensors: under the interpreter)."""
    if name.startswith("dynamiq"):  # dynamiq4: one width
        w = int(name[len("dynamiq") :] or 4)
        return DynamiQ(widths=(w,), budget=w + 1.0, allocation="fixed", backend="triton")
    return get_codec(name, backend="triton")


def _hop(codec: Any, x: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], Any], int]:
    """(timed hop, hop on a fresh local chunk, bytes it must move)."""
    plan = codec.plan(x, LocalStats())
    work = codec.prepare_all(plan, x)
    if not isinstance(codec, DynamiQ):  # one chunk: the whole vector
        work = plan.chunk_view(work, 0)
    ctx = HopContext(0, 0, 0, 1, 0, 2)
    payload = codec.encode(plan, work, ctx)
    local = work.clone()
    return (
        lambda: codec.decode_accumulate_encode(plan, payload, local, ctx),
        lambda: codec.decode_accumulate_encode(plan, payload, work.clone(), ctx),
        2 * payload.numel() + 4 * work.numel(),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codecs", nargs="+", default=["mxfp8", "mxfp6", "mxfp4", "equarx"])
    p.add_argument("--n", type=int, default=1 << 26, help="coordinates per chunk")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = p.parse_args()
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here (--device cpu checks the script)")
    n = a.n if cuda else min(a.n, 1 << 13)
    if cuda:
        from triton.testing import do_bench

        def bench(fn: Callable[[], Any]) -> float:
            return min(do_bench(fn, warmup=25, rep=150, return_mode="median") for _ in range(2))
    else:

        def bench(fn: Callable[[], Any]) -> float:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3

    g = torch.Generator(device=a.device).manual_seed(0)
    x = torch.randn(n, device=a.device, generator=g)
    x *= torch.exp(2 * torch.randn(n, device=a.device, generator=g))  # magnitudes apart
    dst = torch.empty_like(x)
    copy_ms = bench(lambda: dst.copy_(x))
    copy_bw = 8 * n / (copy_ms * 1e-3)
    print(f"{a.device}, {n:,} coordinates; copy {copy_ms * 1e3:.1f} us ({copy_bw / 1e9:.0f} GB/s)")
    print("| codec | setting | us | of copy | bits |\n|---|---|---:|---:|---|")
    for name in a.codecs:
        mod, settings = _settings(name)
        timed, fresh, moved = _hop(_codec(name), x)
        reference = fresh().clone()
        for label, patch in settings:
            saved = {k: getattr(mod, k) for k in patch}
            try:
                for k, v in patch.items():
                    setattr(mod, k, v)
                same = torch.equal(fresh(), reference)
                ms = bench(timed)
            finally:
                for k, v in saved.items():
                    setattr(mod, k, v)
            share = moved / (ms * 1e-3) / copy_bw
            bits = "default's" if same else "**differ**"
            print(f"| {name} | {label} | {ms * 1e3:.1f} | {share:.0%} | {bits} |", flush=True)


if __name__ == "__main__":
    main()
