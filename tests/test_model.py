"""The alpha-beta-gamma cost model of `hopq bench model` (no network needed)."""

import pytest

from hopq.bench.cost_model import CodecCost, predict

BF16 = CodecCost("bf16", 0.0, 0.0, 0.0, 0.0, 16.0)
SLOW = CodecCost("slow", 1e-9, 5e-9, 1e-8, 2e-9, 5.0)
D = 1 << 20


def test_ring_matches_the_textbook_terms():
    beta, alpha, n = 1e8, 1e-4, 4
    t = predict(BF16, "ring", n, D, beta, alpha, cores=n)
    assert t == pytest.approx(2 * (n - 1) * alpha + 2 * (n - 1) / n * D * 2 / beta)


def test_duplex_applies_to_same_peer_steps_only():
    args = (D, 1e8, 0.0, 8)
    for topo, n, hit in (("ring", 4, False), ("ring", 2, True), ("butterfly", 4, True)):
        a = predict(BF16, topo, n, *args, duplex=1.0)
        b = predict(BF16, topo, n, *args, duplex=2.0)
        assert (b > a) is hit, (topo, n)


def test_fold_costs_the_extra_ranks_vector_both_ways():
    args = (D, 1e8, 0.0, 8)
    folded = predict(BF16, "butterfly", 6, *args)
    core = predict(BF16, "butterfly", 4, *args)
    assert folded - core == pytest.approx(2 * D * 2 / 1e8, rel=0.3)


def test_compression_pays_only_when_the_network_is_slow():
    fast = (D, 1e10, 0.0, 8)
    slow = (D, 1e7, 0.0, 8)
    assert predict(SLOW, "ring", 8, *fast) > predict(BF16, "ring", 8, *fast)
    assert predict(SLOW, "ring", 8, *slow) < predict(BF16, "ring", 8, *slow)


def test_model_resolves_all_and_auto():
    """`--codecs auto` (and `all`) model the codecs they name; they used to be
    filtered out as unknown names, leaving empty tables."""
    from hopq.bench.cost_model import ModelOptions, run

    report = run(ModelOptions(codecs=("all",), validate=False, calib_coords=4096))
    for codec in ("bf16", "dynamiq", "equarx"):
        assert f"| {codec} " in report or f" {codec} |" in report, codec
