"""``hopq bench vnmse``'s layouts table: flat and two-tier DynamiQ per cluster."""

from __future__ import annotations

import io

import pytest
import torch

from hopq import sim
from hopq.bench.vnmse import VnmseOptions, _layouts_table
from hopq.reporting import Progress


def test_layouts_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layout a row; flat cells only up to ``flat_max`` ranks; the two-tier
    cells (simulated tier by tier above ``sim.TIER_BY_TIER_RANKS``) give their
    inter-node bits; the ratio to the 8-rank flat ring once it is known."""
    monkeypatch.setattr(sim, "TIER_BY_TIER_RANKS", 8)
    o = VnmseOptions(
        workloads=("gpt",), tables=("layouts",), layouts=("1x8", "2x4", "4x4"), flat_max=8,
        sweep_coords=3000,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(3000, generator=g) for _ in range(16)]
    with Progress("t", 12, stream=io.StringIO()) as prog:
        text = _layouts_table(o, "gpt", grads, slice(0, 3000), 0, prog)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "x" in line[:8]]
    assert [r.split("|")[1].strip() for r in rows] == ["1x8", "2x4", "4x4"], text
    cells = [[c.strip() for c in r.split("|")[1:-1]] for r in rows]
    assert cells[2][2] == cells[2][3] == "", cells  # 16 ranks > flat_max: not simulated flat
    assert "(0.00 b)" in cells[0][4]  # one node: nothing crosses between nodes
    for row in cells[1:]:  # DynamiQ's budget of 5 bits between nodes
        for cell in row[4:6]:
            assert 4.5 < float(cell.split("(")[1].split()[0]) <= 5.05, row
    for row in cells:
        assert row[6].endswith("x"), row
    with pytest.raises(ValueError, match="layout"):
        VnmseOptions(tables=("layouts",), layouts=("2y4",))
