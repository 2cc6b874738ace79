"""The planner (hopq.plan) and ``hopq plan``: picks on clear cases, the error
budget, the plain-data round trip, and agreement with the cost model."""

from __future__ import annotations

import itertools
import json
import time

import pytest

import hopq
from hopq.cli import main
from hopq.comm import cost as cost_mod
from hopq.comm.cost import Network, predict
from hopq.comm.plan import LOSS_GAP, LOSSLESS, UNCOMPRESSED, PlanInputs, _cost

GPT = 3_257_856


def test_slow_link_picks_a_compressed_codec() -> None:
    p = hopq.plan(nodes=2, per_node=2, inter_gbit=0.18, params=GPT)
    assert p.codec not in UNCOMPRESSED
    assert p.pick.time_s < 0.5 * min(c.time_s for c in p.candidates if c.codec == "fp16")
    assert "predicted vNMSE" in p.reason


def test_fast_link_on_cpu_picks_uncompressed() -> None:
    p = hopq.plan(nodes=8, inter_gbit=10, params=25_000_000)
    assert p.codec in ("bf16", "fp16", "fp32")
    assert "nothing compressed pays" in p.reason
    # the compressed candidates were weighed and are slower
    comp = [c for c in p.candidates if c.codec not in UNCOMPRESSED and not c.excluded]
    assert comp and min(c.time_s for c in comp) > p.pick.time_s


def test_lossless_mode_keeps_only_lossless_codecs() -> None:
    p = hopq.plan(nodes=4, inter_gbit=0.15, params=GPT, lossless=True)
    assert p.codec in LOSSLESS
    assert {c.codec for c in p.candidates} <= set(LOSSLESS)


def test_error_budget_excludes_codecs_above_it() -> None:
    p = hopq.plan(nodes=4, inter_gbit=0.15, params=GPT)
    for c in p.candidates:
        if c.loss_gap is not None and c.loss_gap > 0.5:
            assert c.excluded.startswith("loss"), c
    assert {"thc", "omnireduce", "gqsgd-linear"} <= {c.codec for c in p.candidates if c.excluded}
    assert LOSS_GAP[p.codec] <= 0.5
    # a tight vNMSE limit moves the pick to a more accurate candidate
    tight = hopq.plan(nodes=4, inter_gbit=0.15, params=GPT, max_vnmse=1e-3)
    assert tight.pick.vnmse <= 1e-3 < p.pick.vnmse
    assert all(c.excluded for c in tight.candidates if c.vnmse > 1e-3)
    assert tight.pick.time_s >= p.pick.time_s
    # DynamiQ below its trained budget counts as never trained; without a loss
    # limit it may win
    free = hopq.plan(nodes=4, inter_gbit=0.15, params=GPT, max_loss_gap=None, max_vnmse=None)
    assert free.pick.time_s <= p.pick.time_s
    with pytest.raises(ValueError, match="no candidate within the error budget"):
        hopq.plan(nodes=4, params=GPT, max_vnmse=1e-20)


def test_dynamiq_budgets_are_candidates() -> None:
    p = hopq.plan(nodes=4, inter_gbit=0.15, params=GPT, codecs=("dynamiq",), budgets=(5, 6, 8))
    bits = sorted({c.bits for c in p.candidates})
    assert bits == [5.0, 6.0, 8.0]
    errs = {c.bits: c.vnmse for c in p.candidates if c.schedule == "ring"}
    assert errs[5.0] > errs[6.0] > errs[8.0]
    p6 = hopq.plan(p.inputs, max_vnmse=errs[6.0] * 1.01, schedules=("ring",))
    assert p6.codec_config == {"budget": 6.0}
    assert p6.hook_kwargs() == {
        "codec": "dynamiq",
        "topology": "ring",
        "layout": None,
        "budget": 6.0,
    }
    assert hopq.get_codec("dynamiq", **p6.codec_config).config.budget == 6.0


def test_exposed_time_with_compute() -> None:
    slow = PlanInputs(nodes=2, per_node=2, inter_gbit=0.2, params=GPT)
    p = hopq.plan(slow, compute_s=0.05)
    for c in p.candidates:
        assert c.exposed_s is not None and 0 <= c.exposed_s <= c.sync_s + 1e-12
    # a long backward pass hides every bucket but the last, ready at its end
    two = hopq.plan(slow, buckets=(1 << 20, 1 << 20), compute_s=100.0)
    for c in two.candidates:
        assert c.exposed_s == pytest.approx(c.sync_s / 2, rel=1e-9)
    # no backward pass: nothing hides
    none = hopq.plan(slow, compute_s=0.0)
    assert all(c.exposed_s == pytest.approx(c.sync_s) for c in none.candidates)


def test_1024_ranks_plan_fast() -> None:
    t0 = time.perf_counter()
    p = hopq.plan(nodes=128, per_node=8, inter_gbit=100, intra_gbit=900, params=125_000_000)
    took = time.perf_counter() - t0
    assert p.layout in ("128x8", None)
    assert {c.schedule for c in p.candidates} == {"ring", "hier:ring", "hier:butterfly"}
    assert took < 60, took  # seconds on a loaded 2-core machine; well under one normally
    # the flat ring over 1024 ranks recompresses 1024 times: its error is far above the tree's
    ring = next(c for c in p.candidates if c.codec == "dynamiq" and c.schedule == "ring")
    tree = next(c for c in p.candidates if c.codec == "dynamiq" and c.schedule == "hier:butterfly")
    assert ring.recompressions == 1024 and tree.recompressions < 16
    assert ring.vnmse > 3 * tree.vnmse


def test_plan_round_trips_as_plain_data() -> None:
    p = hopq.plan(nodes=2, per_node=4, inter_gbit=0.5, params=GPT, compute_s=0.2)
    d = json.loads(json.dumps(p.to_dict()))
    assert hopq.Plan.from_dict(d) == p
    assert hopq.Plan.from_json(p.to_json()) == p
    assert PlanInputs.from_dict(p.inputs.to_dict()) == p.inputs
    # replanning from the printed inputs gives the same plan
    assert hopq.plan(PlanInputs.from_dict(d["inputs"])) == p
    kw = p.all_reduce_kwargs()
    assert kw["topology"] == p.topology and kw["layout"] == p.layout


def test_closed_form_ring_matches_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost model's closed-form ring (large rings) gives the walk's terms."""
    exact = _cost("fp32", {})
    assert exact is not None
    for (n, g), s in itertools.product(
        [(2, 1), (2, 2), (3, 2), (5, 1), (4, 4), (8, 8)], ["ring", "hier:ring"]
    ):
        net = Network(n, g, 0.5, 20, 30, 3, duplex=2.0)
        cost = _cost("dynamiq", {})
        assert cost is not None
        want = predict(cost, s, net, 123_457, exact)  # walked
        with monkeypatch.context() as m:
            m.setattr(cost_mod, "_WALK_RING_UP_TO", 1)
            got = predict(cost, s, net, 123_457, exact)  # closed form
        assert got.seconds == pytest.approx(want.seconds, rel=1e-12), (n, g, s)
        assert got.uplink_bytes == pytest.approx(want.uplink_bytes, rel=1e-12)
        assert got.recompressions == want.recompressions


def test_inputs_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown codecs"):
        PlanInputs(codecs=("nope",))
    with pytest.raises(ValueError, match="nodes"):
        PlanInputs(nodes=0)
    with pytest.raises(ValueError, match="speeds"):
        PlanInputs(speeds={"bf16": (1.0, 2.0)})
    with pytest.raises(ValueError, match="schedule 'hier:foo'"):
        PlanInputs(schedules=("ring", "hier:foo"))
    with pytest.raises(TypeError):
        hopq.plan(colour="blue")


def test_cli_prints_a_table_and_a_pick(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--nodes", "2", "--workers-per-node", "2", "--inter-mbit", "180"]
    assert main([*argv, "--workload", "gpt", "--rows", "6"]) == 0
    out = capsys.readouterr().out
    assert "| candidate" in out and "| vNMSE" not in out.splitlines()[0]
    assert "Pick: " in out and "Pin it: hopq.HookState(codec=" in out
    assert "3,257,856 coordinates" in out
    table_rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table_rows) == 1 + 6
    assert main([*argv, "--params", "1000000", "--json"]) == 0
    p = hopq.Plan.from_json(capsys.readouterr().out)
    assert p.inputs.inter_gbit == pytest.approx(0.18) and p.inputs.params == 1_000_000
    assert (
        main(["plan", "--nodes", "128", "--workers-per-node", "8", "--lossless", "--rows", "3"])
        == 0
    )
    out = capsys.readouterr().out
    assert "128 x 8 ranks" in out and ("gcomp" in out or "fp32" in out)


def test_cli_rejects_conflicting_rates(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--inter-gbit", "1", "--inter-mbit", "100"])
    assert e.value.code == 2
    assert "not both" in capsys.readouterr().err


def test_cli_measure(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "plan",
                "--nodes",
                "4",
                "--inter-mbit",
                "150",
                "--codecs",
                "bf16",
                "dynamiq",
                "--measure",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "measured on this machine" in out and "Pick: " in out


def test_cli_measure_device(capsys: pytest.CaptureFixture[str]) -> None:
    """--device says where --measure times the codecs: refused without --measure,
    and without a GPU for cuda; the speeds have the planner's shape."""
    import torch

    from hopq.cli import measure_speeds

    with pytest.raises(SystemExit) as e:
        main(["plan", "--device", "cuda"])
    assert e.value.code == 2 and "add --measure" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            main(["plan", "--measure", "--device", "cuda"])
        assert e.value.code == 2 and "no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", "--measure-coords", "65536"])
    assert e.value.code == 2 and "add --measure" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", "--measure", "--measure-coords", "10"])
    assert e.value.code == 2
    capsys.readouterr()
    main(["plan", "--measure", "--measure-coords", "4096", "--codecs", "bf16", "--rows", "2"])
    assert "measured on this machine" in capsys.readouterr().out
    speeds = measure_speeds(["bf16", "dynamiq"], coords=4096, device="cpu")
    assert set(speeds) == {"bf16", "dynamiq"}
    assert all(len(v) == 5 and min(v) >= 0 for v in speeds.values())
    assert speeds["bf16"][4] == pytest.approx(16.0, rel=0.05)
    hopq.plan(nodes=2, inter_gbit=10, speeds=speeds, codecs=("bf16", "dynamiq"))


def auto_worker(rank: int, n: int) -> dict[str, object]:
    """codec="auto" on a real Gloo group: the same pick on every rank, one log line."""
    import logging

    import torch

    from hopq.comm import plan as pm

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.getMessage()}")

    log = logging.getLogger("hopq")
    log.addHandler(Keep(level=logging.DEBUG))
    log.setLevel(logging.DEBUG)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(50_000, generator=g)
    want = sum(torch.randn(50_000, generator=torch.Generator().manual_seed(r)) for r in range(n))
    y = x.clone()
    hopq.all_reduce(y, codec="auto")
    z = x.clone()
    hopq.all_reduce(z, codec="auto")  # planned once: no second probe
    picks = {k: dict(v) for k, v in pm._PICKS.items()}
    w = torch.zeros(7)
    hopq.all_reduce(w, codec="auto")  # another size: another plan, at debug level
    lx = x.clone()
    hopq.all_reduce(lx, codec="auto", layout="1x2")  # the two-tier candidates weighed too
    layout_err = float(((lx.double() - want.double()).norm() / want.double().norm()) ** 2)
    err = float(((y.double() - want.double()).norm() / want.double().norm()) ** 2)
    # a slow link (the probe's result replaced): a compressed codec, fewer bits
    import torch.distributed as dist

    pm._PROBES[dist.group.WORLD] = (1e-3, 0.1)
    big = torch.randn(400_000, generator=g)
    slow = hopq.all_reduce(big, codec="auto")
    slow_pick = pm.auto_pick(400_000)
    assert pm.auto_pick(400_000, layout="1x2") is None  # asked for flat only
    firsts: list[float] = []  # each timed codec's untimed first pass
    speeds = pm.agree_speeds(400_000, n, (1e-3, 0.1), None, None, torch.device("cpu"), firsts)
    return {
        "y": y,
        "same": bool(torch.equal(y, z)),
        "err": err,
        "picks": [v for d in picks.values() for v in d.values()],
        "info": [m for m in records if "hopq codec='auto'" in m],
        "probes": len(pm._PROBES),
        "layout_err": layout_err,
        "slow_pick": slow_pick,
        "slow_bits": slow.bits_per_coord,
        "firsts": firsts,
        "speeds": speeds,
    }


def test_auto_all_reduce_on_gloo_ranks() -> None:
    from hopq.cluster.launch import run_workers

    res = run_workers(2, auto_worker)
    assert torch_equal(res[0]["y"], res[1]["y"])  # the same pick and bits on both ranks
    for r in res:
        assert r["same"] and r["err"] < 0.2
        assert r["picks"] == res[0]["picks"] and len(r["picks"]) == 1
        assert r["probes"] == 1
        assert len(r["info"]) == 4 and "probed" in r["info"][0]
        # logged once per group and layout
        assert [m.split()[0] for m in r["info"]] == ["INFO", "DEBUG", "INFO", "DEBUG"]
        assert r["layout_err"] < 0.2
        assert r["slow_pick"] == res[0]["slow_pick"]
        assert r["slow_pick"][0] not in ("fp32", "fp16", "bf16")
        assert r["slow_bits"] < 10
        assert r["speeds"] == res[0]["speeds"]  # agreed: the slowest rank's
        assert r["firsts"] and all(f > 0 for f in r["firsts"])


def torch_equal(a: object, b: object) -> bool:
    import torch

    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return bool(torch.equal(a, b))


def test_default_budget_is_dynamiqs_error_at_the_same_chain() -> None:
    def status(p: hopq.Plan, codec: str, schedule: str = "ring") -> str:
        (c,) = [c for c in p.candidates if c.label == codec and c.schedule == schedule]
        return c.excluded

    four = hopq.plan(nodes=4, inter_gbit=0.15, params=GPT)
    assert status(four, "dynamiq") == "" and status(four, "mxfp8") == ""
    # MXFP4 on 2 x 2 (a chain of 2): vNMSE 0.026, within 0.1 but 20x DynamiQ's
    two = hopq.plan(nodes=2, per_node=2, inter_gbit=0.18, params=GPT)
    assert "DynamiQ's" in status(two, "mxfp4", "hier:ring")
    assert two.codec == "dynamiq"
    # MXFP8's error grows faster with the hops than DynamiQ's: out at 64 ranks
    many = hopq.plan(nodes=64, inter_gbit=0.15, params=GPT)
    assert "DynamiQ's" in status(many, "mxfp8") and status(many, "dynamiq") == ""
    assert status(many, "bf16") == ""
    # loosened: MXFP4 back in at 4 ranks
    loose = hopq.plan(two.inputs, max_vnmse_ratio=100)
    assert status(loose, "mxfp4", "hier:ring") == "" and loose.codec == "mxfp4"
    with pytest.raises(ValueError, match="max_vnmse_ratio"):
        PlanInputs(max_vnmse_ratio=0)


def test_long_chains_of_lossy_codecs_are_named_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A schedule that recompresses a lossy codec's contributions far more often
    than a ring of 8 does is said once (codec, schedule, world size); short
    chains, 16-bit formats and lossless codecs stay silent."""
    import warnings

    import torch

    from hopq.comm import engine
    from hopq.comm.plan import long_chain_note

    assert long_chain_note("dynamiq", "ring", 8, 8) is None
    assert long_chain_note("dynamiq", "ring", 16, 16) is None  # 1.6x a chain of 8
    note = long_chain_note("dynamiq", "ring", 128, 128)
    assert note is not None and "128 times" in note and "butterfly" in note
    for quiet in ("bf16", "fp16", "fp32", "gcomp", "thc", "omnireduce"):
        assert long_chain_note(quiet, "ring", 128, 128) is None, quiet

    monkeypatch.setattr(engine, "_LONG_CHAINS", set())
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4096, generator=g) for _ in range(16)]

    def said(topology: str) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hopq.simulate(xs, "mxfp4", topology, seed=0)
        return [str(w.message) for w in caught if "recompresses" in str(w.message)]

    first = said("ring")
    assert len(first) == 1 and "mxfp4 on a ring of 16 ranks" in first[0]
    assert said("ring") == []  # once
    assert said("butterfly") == []  # a chain of 5
    # made an error, it refuses the call before it is numbered: every rank ends at once
    monkeypatch.setattr(engine, "_LONG_CHAINS", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="recompresses"):
            hopq.simulate(xs, "mxfp4", "ring", seed=0)
