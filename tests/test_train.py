"""A tiny `hopq train`: report and plots written, numbers consistent."""

import json

import pytest

from hopq.train import job as train


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    o = train.TrainOptions(
        codecs=("bf16", "dynamiq"),
        world_size=2,
        steps=6,
        eval_every=3,
        vnmse_every=2,
        gpt_dim=32,
        gpt_layers=1,
        context=32,
        batch_size=4,
        network=False,
        out=str(out),
    )
    text = train.run(o)
    return o, out, text


def test_report_and_plots_are_written(tiny):
    o, out, text = tiny
    assert (out / "report.md").read_text().strip() == text.strip()
    for png in ("tta.png", "breakdown.png", "vnmse.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "| bf16 |" in text.replace("  ", " ") or "bf16" in text
    assert "loopback" in text  # network disabled: said so


def test_numbers_are_consistent(tiny):
    o, out, _ = tiny
    runs = {r["codec"]: r for r in json.loads((out / "runs.json").read_text())}
    n, d = o.world_size, runs["bf16"]["params"]
    for s in runs["bf16"]["steps"]:
        # bf16 on the wire: 2 bytes per coordinate, 2(n-1)/n of the vector per rank
        assert s["bytes"] == pytest.approx(2 * (n - 1) / n * d * 2, rel=1e-9)
        assert s["bits_per_coord"] == pytest.approx(16.0)
        assert s["step_s"] == pytest.approx(s["compute_s"] + s["codec_s"] + s["comm_s"], rel=1e-6)
    measured = [s["vnmse"] for s in runs["bf16"]["steps"] if s["vnmse"] == s["vnmse"]]
    assert len(measured) == 3  # steps 0, 2, 4
    assert all(1e-8 < v < 2 * 2**-16 for v in measured)  # bf16 rounding, 2 hops
    for s in runs["dynamiq"]["steps"]:
        assert s["bits_per_coord"] <= 5.0 + 1e-9
        assert 8 * s["bytes"] / (2 * (n - 1) / n * d) == pytest.approx(s["bits_per_coord"])
    dq = [s["vnmse"] for s in runs["dynamiq"]["steps"] if s["vnmse"] == s["vnmse"]]
    assert all(max(measured) < v < 0.5 for v in dq)
    assert len(runs["dynamiq"]["evals"]) == 3  # before training, after step 3 and 6


def test_options_are_validated():
    with pytest.raises(ValueError, match="workload"):
        train.TrainOptions(workload="resnet")
    with pytest.raises(ValueError, match="unknown codec"):
        train.TrainOptions(codecs=("zip",)).resolved_codecs()
    auto = train.TrainOptions().resolved_codecs()
    assert auto[:3] == ["bf16", "dynamiq", "mxfp8"] and "fp32" not in auto


def test_goal_verdicts_say_when_a_codec_misses():
    from hopq.train.report import CodecRun, goal_verdicts

    def run(codec, evals):
        return CodecRun(codec, 10, [], evals)

    bf16 = run("bf16", [(0.0, 10.0), (50.0, 6.0), (100.0, 5.0)])
    fast_close = run("a", [(0.0, 10.0), (40.0, 5.04), (80.0, 5.02)])  # 101% at 40 s, +0.40%
    fast_far = run("b", [(0.0, 10.0), (40.0, 5.04), (80.0, 5.03)])  # +0.60% at the end
    slow = run("c", [(0.0, 10.0), (120.0, 5.0)])
    lines = goal_verdicts([bf16, fast_close, fast_far, slow])
    assert "meets the goal" in lines[0] and "0.40x" in lines[0]
    assert "misses the goal" in lines[1] and "final loss too high" in lines[1]
    assert "misses the goal" in lines[2] and "slower" in lines[2]
    assert goal_verdicts([slow]) == []  # no bf16 baseline, no verdict
