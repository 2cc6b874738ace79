"""Worker bodies for the variable-size and GComp multi-process tests."""

from __future__ import annotations

from typing import Any

import torch

import hopq


def varsize_and_gcomp(rank: int, n: int) -> dict[Any, Any]:
    """Variable-size codecs (the test codec, and gcomp when registered) in real Gloo
    runs: outputs and bytes sent per (codec, topology, size)."""
    from tests.varsize_codec import VarBf16

    names = ["varbf16"] + (["gcomp"] if "gcomp" in hopq.available_codecs() else [])
    out: dict[Any, Any] = {}
    for name in names:
        for topo in ("ring", "butterfly"):
            for size in (0, 1, 7, 70001):
                g = torch.Generator().manual_seed(11 * rank + size)
                x = torch.randn(size, generator=g)
                codec = VarBf16() if name == "varbf16" else hopq.get_codec(name)
                info = hopq.all_reduce(x, codec=codec, topology=topo, seed=3)
                out[(name, topo, size)] = (x, info.bytes_sent)
    return out
