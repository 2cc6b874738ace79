"""Guarantees every registered codec keeps at the edges, generated from the
registry so that a new codec inherits them: small tensors are never worse than
zeros, options are validated at construction (type and range, the error names
the option), and finite input near float32's limit gives finite output."""

from __future__ import annotations

import dataclasses
import enum
import statistics
import typing

import pytest
import torch

import hopq
from hopq.codecs.registry import codec_info
from hopq.options import RANGE_KEYS, enum_type, field_types

CODECS = hopq.available_codecs()
F32_MAX = float(torch.finfo(torch.float32).max)


# -- small tensors ------------------------------------------------------------
def _median_vnmse(codec: str, d: int, seeds: int, n: int = 4) -> float:
    out = []
    for s in range(seeds):
        g = torch.Generator().manual_seed(1000 * s + d)
        xs = [torch.randn(d, generator=g) for _ in range(n)]
        out.append(hopq.simulate(xs, codec=codec, seed=s).vnmse)
    return statistics.median(out)


#: The largest median vNMSE a codec may show on i.i.d. Gaussians, 4 ranks, ring,
#: at the sizes below: well under zeros' 1. The sparsifier (OmniReduce) and the
#: exponential quantizer (Global-QSGD exp) measure 0.1-0.27 at every size.
SMALL_LIMIT = 0.35


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("d", [1, 31, 257, 600, 1000])
def test_small_tensors_beat_zeros(codec, d):
    v = _median_vnmse(codec, d, seeds=3)
    assert v < SMALL_LIMIT, f"{codec} at {d} entries: median vNMSE {v:.3g}"


def test_dynamiq_small_call_falls_back_and_counts_its_bits():
    xs = [torch.randn(257) for _ in range(4)]
    r = hopq.simulate(xs, codec="dynamiq")
    s = r.stats[0]
    assert s.fallback == "bf16"
    assert r.bits_per_coord == pytest.approx(16.0)
    big = hopq.simulate([torch.randn(20_000) for _ in range(4)], codec="dynamiq")
    assert big.stats[0].fallback is None and big.bits_per_coord < 6


def test_dynamiq_small_call_rule_counts_padding_per_shard():
    from hopq.codecs.dynamiq.allocation import starved

    cfg = hopq.get_codec("dynamiq").config
    assert [starved(cfg, d) for d in (0, 31, 257, 600, 769, 1100)] == [False] + [True] * 5
    assert not any(starved(cfg, d) for d in (700, 1000, 1150, 1237, 2000, 10_000))
    # 1,150 entries as three shards: each pads its own last super-group
    assert starved(cfg, 1150, [384, 383, 383], 2.0)
    r = hopq.simulate([torch.randn(257) for _ in range(4)], hopq.get_codec("dynamiq"))
    assert r.stats[0].fallback == "bf16"
    off = hopq.get_codec("dynamiq", small_call_fallback=False)
    r = hopq.simulate([torch.randn(257) for _ in range(4)], off)
    assert r.stats[0].fallback is None and r.bits_per_coord < 6


# -- options ------------------------------------------------------------------
def _bare(hint):
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def _bad_values(f, hint):
    """(wrong type, out of range) for option ``f`` of type ``hint``; an option
    whose range the test cannot derive fails the test (declare lo/hi/gt/lt,
    choices or an ``invalid`` example with :func:`hopq.options.option`)."""
    meta = f.metadata
    h = _bare(hint)
    cls = enum_type(h)
    if cls is not None:
        return 3.5, "no-such-choice"
    if h is bool:
        return "no", 2
    if "invalid" in meta:
        return "x", meta["invalid"]
    if typing.get_origin(h) is tuple:
        choices = meta.get("choices")
        assert choices, f"option {f.name} declares no choices for its entries"
        return "248", (max(choices) + 1,)
    wrong = 8.5 if h is int else "1.0"
    choices = meta.get("choices")
    if choices is not None and not callable(choices) and not isinstance(choices, enum.EnumMeta):
        return wrong, max(choices) + 1
    beyond = {"hi": 1, "lt": 0, "lo": -1, "gt": 0}  # RANGE_KEYS: a step past each bound
    for key in RANGE_KEYS[::-1] if "hi" not in meta else ("hi",):
        if key in meta:
            return wrong, meta[key] + beyond[key]
    raise AssertionError(f"option {f.name} declares no range {RANGE_KEYS} nor choices")


OPTION_CASES = [
    (c, f.name) for c in CODECS for f in dataclasses.fields(codec_info(c).cls.config_class)
]


@pytest.mark.parametrize("codec, name", OPTION_CASES)
def test_option_checked_at_construction(codec, name):
    cfg_cls = codec_info(codec).cls.config_class
    f = next(f for f in dataclasses.fields(cfg_cls) if f.name == name)
    wrong, out = _bad_values(f, field_types(cfg_cls)[name])
    for bad in (wrong, out):
        with pytest.raises((TypeError, ValueError)) as e:
            hopq.get_codec(codec, **{name: bad})
        assert name in str(e.value), f"{codec} {name}={bad!r}: {e.value}"
    for bad in (float("nan"), float("inf"), None, object()):
        if bad is None and type(None) in typing.get_args(field_types(cfg_cls)[name]):
            continue
        with pytest.raises((TypeError, ValueError)) as e:
            hopq.get_codec(codec, **{name: bad})
        assert name in str(e.value), f"{codec} {name}={bad!r}: {e.value}"
    hopq.get_codec(codec, **{name: f.default})  # the default itself passes


@pytest.mark.parametrize(
    "codec, options",
    [
        ("mxfp8", {"mu_init": 1e20}),
        ("mxfp8", {"mu_init": 1e-20}),
        ("mxfp8", {"mu_init": 1e-40}),
        ("mxfp8", {"mu_init": 1e38}),
        ("dynamiq", {"share_budget": "no"}),
        ("dynamiq", {"zero_class": None}),
        ("dynamiq", {"optimizer_weights": 2}),
        ("dynamiq", {"eps": ((4, 0.3), (4, 0.2))}),
        ("gqsgd-linear", {"bits": 8.0}),
        ("gqsgd-exp", {"backend": "x"}),
    ],
)
def test_options_that_did_nothing_or_harm_are_refused(codec, options):
    (name,) = options
    with pytest.raises((TypeError, ValueError), match=name):
        hopq.get_codec(codec, **options)


# -- float32's edge -----------------------------------------------------------
def _near_limit(n: int, d: int, share: float, seed: int) -> list[torch.Tensor]:
    """n ranks' inputs whose per-coordinate sum of magnitudes reaches ``share``
    of float32's maximum at its largest: every partial sum is finite."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, d, generator=g, dtype=torch.float64)
    xs *= share * F32_MAX / xs.abs().sum(0).max()
    return list(xs.float().unbind(0))


@pytest.mark.parametrize("codec", CODECS)
def test_finite_input_near_float32_limit_stays_finite(codec):
    cases = [[torch.full((256,), 1.7e38)] * 2, [torch.full((300,), 3.4023e38 / 4)] * 4]
    cases += [
        _near_limit(n, 1000, share, s) for n in (2, 4) for share in (0.92, 0.999) for s in (0, 1)
    ]
    for xs in cases:
        for topology in ("ring", "butterfly"):
            try:
                r = hopq.simulate(xs, codec=codec, topology=topology)
            except ValueError as e:  # a schedule the codec refuses, with its reason
                assert "topology" in str(e)
                continue
            out = r.outputs[0]
            bad = (~torch.isfinite(out)).sum().item()
            assert bad == 0, f"{codec} {topology} n={len(xs)}: {bad} non-finite outputs"


def _kernel_backends(codec: str) -> list[str]:
    cfg = codec_info(codec).cls.config_class
    hint = field_types(cfg).get("backend")
    cls = enum_type(hint) if hint is not None else None
    return [] if cls is None else [b.value for b in cls if b.value in ("cpu",)]


@pytest.mark.parametrize("codec", [c for c in CODECS if _kernel_backends(c)])
def test_kernels_match_reference_near_float32_limit(codec):
    """The saturation and scaling near the limit are the reference's, bit for bit."""
    pytest.importorskip("numba")
    for xs in ([torch.full((256,), 1.7e38)] * 2, _near_limit(3, 1500, 0.999, 0)):
        ref = hopq.simulate(xs, hopq.get_codec(codec, backend="reference"), seed=3)
        for b in _kernel_backends(codec):
            got = hopq.simulate(xs, hopq.get_codec(codec, backend=b), seed=3)
            for o, r in zip(got.outputs, ref.outputs, strict=True):
                assert torch.equal(o.view(torch.int32), r.view(torch.int32)), (codec, b)
