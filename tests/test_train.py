"""A tiny `hopq train`: report and plots written, numbers consistent."""

import importlib.util
import json
from dataclasses import replace

import pytest
import torch

from hopq.train import job as train

#: Words of judgement that a report of measurements never prints (built from
#: pieces so that tests/test_front_door.py's scan does not find them here).
JUDGEMENTS = ("go" + "al", "meets", "misses", "ver" + "dict")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    o = train.TrainOptions(
        codecs=("torch:ddp", "torch:fp16", "torch:powersgd", "bf16", "dynamiq", "gcomp"),
        world_size=2,
        steps=6,
        powersgd_start=2,
        probe_every=2,
        eval_every=3,
        vnmse_every=2,
        gpt_dim=32,
        gpt_layers=1,
        context=32,
        batch_size=4,
        bucket_mb=0.02,  # several DDP buckets, so the hooks overlap bucket by bucket
        network=False,
        out=str(out),
    )
    text = train.run(o)
    return o, out, text


def test_report_and_plots_are_written(tiny):
    o, out, text = tiny
    assert (out / "report.md").read_text().strip() == text.strip()
    for png in ("tta.png", "breakdown.png", "timeline.png", "vnmse.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "| bf16 |" in text.replace("  ", " ") or "bf16" in text
    assert "loopback" in text  # network disabled: said so


def test_numbers_are_consistent(tiny):
    o, out, text = tiny
    runs = {r["codec"]: r for r in json.loads((out / "runs.json").read_text())}
    assert list(runs) == list(o.codecs)  # every contender, in order
    n, d = o.world_size, runs["bf16"]["params"]
    ring = 2 * (n - 1) / n * d
    for s in runs["bf16"]["steps"]:
        # bf16 on the wire: 2 bytes per coordinate, 2(n-1)/n of the vector per rank
        assert s["bytes"] == pytest.approx(ring * 2, rel=1e-9)
        assert s["bits_per_coord"] == pytest.approx(16.0)
        assert s["exposed_s"] == pytest.approx(max(0.0, s["step_s"] - s["compute_s"]))
        assert s["codec_s"] > 0 and s["comm_s"] > 0  # the hook's thread reported its work
        assert 0 < s["cpu_s"] < s["codec_s"] + s["comm_s"]  # its CPU, waiting not counted
    last = runs["bf16"]["bucket_bytes"][-1] // 4  # the last bucket's coordinates
    for s in runs["bf16"]["steps"][1:]:  # after DDP rebuilt its buckets in step 0
        assert s["last_bytes"] == pytest.approx(2 * (n - 1) / n * last * 2, rel=1e-9)
    for s in runs["torch:fp16"]["steps"]:  # counted from what torch's hook all-reduced
        assert s["bits_per_coord"] == pytest.approx(16.0)
    assert all(s["bits_per_coord"] == pytest.approx(32.0) for s in runs["torch:ddp"]["steps"])
    psgd = [s["bits_per_coord"] for s in runs["torch:powersgd"]["steps"]]
    assert psgd[0] == pytest.approx(32.0) and max(psgd[2:]) < 32.0  # compresses from step 2
    for r in runs.values():  # compute probed at steps 1, 3, 5 for every contender
        probed = [s["step"] for s in r["steps"] if s["probe_s"] == s["probe_s"]]
        assert probed == [1, 3, 5]
        assert all(s["compute_s"] > 0 for s in r["steps"][1:])
    for r in runs.values():  # the sync's CPU, torch's contenders' too, from the first probe
        cpu = [s["sync_cpu_s"] for s in r["steps"]]
        assert cpu[0] != cpu[0] and all(c == c for c in cpu[1:]), cpu
    assert "sync CPU (s)" in text and "CPU that synchronization cost each worker" in text
    measured = [s["vnmse"] for s in runs["bf16"]["steps"] if s["vnmse"] == s["vnmse"]]
    assert len(measured) == 3  # steps 0, 2, 4
    assert all(1e-8 < v < 2 * 2**-16 for v in measured)  # bf16 rounding, 2 hops
    for s in runs["dynamiq"]["steps"]:
        assert s["bits_per_coord"] <= 5.0 + 1e-9
        assert 8 * s["bytes"] / ring == pytest.approx(s["bits_per_coord"])
    # the codecs that read the optimizer get the job's AdamW, and the report says so
    assert [r["optimizer"] for r in runs.values()] == ["", "", "", "", "AdamW", "AdamW"]
    assert (
        "Handed the job's AdamW (HookState(optimizer=...)): dynamiq, gcomp."
        in (out / "report.md").read_text()
    )
    # GComp's truncation thresholds cut bytes below fp32's
    gc = [s["bits_per_coord"] for s in runs["gcomp"]["steps"]]
    assert max(gc[1:]) < 32.0 and gc[-1] <= gc[1]
    dq = [s["vnmse"] for s in runs["dynamiq"]["steps"] if s["vnmse"] == s["vnmse"]]
    assert all(max(measured) < v < 0.5 for v in dq)
    # every hopq contender's error is also weighed by AdamW's step sizes, from its
    # second step (step 0 has none); torch's contenders measure neither
    for name in ("bf16", "dynamiq", "gcomp"):
        upd = [s["update_vnmse"] for s in runs[name]["steps"] if s["measured_error"]]
        assert upd[0] != upd[0] and all(0 < u < 1 for u in upd[1:]), (name, upd)
    assert all(s["update_vnmse"] != s["update_vnmse"] for s in runs["torch:fp16"]["steps"])
    assert "mean update vNMSE" in text and "'mean update vNMSE' weighs every coordinate" in text
    assert len(runs["dynamiq"]["evals"]) == 3  # before training, after step 3 and 6
    for r in runs.values():  # time to loss: the steps' times, the warm-up step left out
        steps = [s["step_s"] for s in r["steps"]]
        assert r["evals"][-1][0] == pytest.approx(sum(steps[1:]))
        assert r["evals"][1][0] == pytest.approx(sum(steps[1:3]))
    for r in runs.values():  # --bucket-mb reached DDP: several buckets, all gradients
        sizes = r["bucket_bytes"]
        assert len(sizes) > 2 and sum(sizes) == 4 * d
    for name, r in runs.items():  # every hook's buckets timed, in the step, in order
        for s in r["steps"][1:]:
            ready, done = s["bucket_ready_s"], s["bucket_done_s"]
            if name == "torch:ddp":  # DDP's own all-reduce: no hook to time
                assert ready == [] and done == []
                continue
            assert len(ready) == len(done) == len(r["bucket_bytes"])
            assert all(0 < a <= b <= s["step_s"] + 0.05 for a, b in zip(ready, done, strict=True))
            assert ready == sorted(ready)  # DDP hands the buckets over in order


def test_report_names_the_baseline_and_the_interleaving(tiny):
    _, _, text = tiny
    assert "Against torch:" in text  # compared with torch's best option
    for word in JUDGEMENTS:
        assert word not in text.lower()
    assert "interleaved" in text
    assert "median compute differs by" in text
    assert "DDP's bucket cap: 0.02 MB, so " in text and " buckets per step" in text


def test_options_are_validated():
    with pytest.raises(ValueError, match="workload"):
        train.TrainOptions(workload="resnet")
    with pytest.raises(ValueError, match="unknown codec"):
        train.TrainOptions(codecs=("zip",)).resolved_codecs()
    with pytest.raises(ValueError, match="unknown contender"):
        train.TrainOptions(codecs=("torch:fp8",))
    with pytest.raises(ValueError, match="bucket_mb"):
        train.TrainOptions(bucket_mb=-1)
    with pytest.raises(ValueError, match="powersgd_start"):
        train.TrainOptions(powersgd_start=1)
    with pytest.raises(ValueError, match="time_limit"):
        train.TrainOptions(time_limit=-1)
    # options that would do nothing in the run asked for are refused
    for kw, match in (
        ({"rate_mbit": 100.0, "network": False}, "--no-network"),
        ({"comm_share": 0.3, "rate_mbit": 100.0}, "--comm-share"),
        ({"comm_share": 0.3, "network": False}, "--comm-share"),
        ({"workload": "minilm", "gpt_dim": 64}, "--gpt-dim"),
        ({"codecs": ("bf16",), "powersgd_start": 5}, "--powersgd-start"),
        (
            {
                "codecs": ("dynamiq",),
                "codec_options": (("dynamiq", "budget", 4), ("dynamiq", "budget", 6)),
            },
            "given twice",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            train.TrainOptions(**kw)
    auto = train.TrainOptions().resolved_codecs()
    assert auto[:5] == ["torch:ddp", "torch:fp16", "torch:powersgd", "bf16", "dynamiq"]
    assert "fp32" not in auto


def test_comparisons_state_ratios_without_judging():
    from hopq.train.records import CodecRun, StepRecord
    from hopq.train.report import comparisons

    def run(codec, evals, step_s=None):
        steps = (
            []
            if step_s is None
            else [StepRecord(i, 1.0, step_s, 0.5, 0.0, 0.0, 1.0, 16.0, exposed_s=step_s / 4)
                  for i in range(3)]
        )  # fmt: skip
        return CodecRun(codec, 10, steps, evals)

    bf16 = run("bf16", [(0.0, 10.0), (50.0, 6.0), (100.0, 5.0)], step_s=2.0)
    fast_close = run("a", [(0.0, 10.0), (40.0, 5.04), (80.0, 5.02)], step_s=1.28)
    fast_far = run("b", [(0.0, 10.0), (40.0, 5.04), (80.0, 5.03)])  # +0.60% at the end
    slow = run("c", [(0.0, 10.0), (120.0, 5.0)])
    never = run("d", [(0.0, 10.0), (120.0, 5.2)])
    lines = comparisons([bf16, fast_close, fast_far, slow, never])
    assert len(lines) == 4
    # 101% of bf16's final loss at 40 s, bf16 at its final loss at 100 s; +0.40% at the end
    assert lines[0] == (
        "- a: 0.64x of bf16's step (exposed synchronization 25% of it), 101% of bf16's final"
        " loss in 0.40x the time bf16 took to its final loss (40 s vs 100 s), final loss +0.40%"
    )
    assert "in 0.40x the time" in lines[1] and "final loss +0.60%" in lines[1]
    assert "step" not in lines[1]  # no steps recorded: no step ratio
    assert "in 1.20x the time" in lines[2] and "final loss +0.00%" in lines[2]
    assert "not reached" in lines[3] and "final loss +4.00%" in lines[3]
    for line in lines:
        for word in (*JUDGEMENTS, "slower", "too high"):
            assert word not in line.lower()
    assert comparisons([slow]) == []  # no baseline, nothing to compare with


def _timed(codec, probes, step_s=1.0):
    from hopq.train.records import CodecRun, StepRecord

    steps = [
        StepRecord(i, 1.0, step_s, p, 0.0, 0.0, 1.0, 16.0, probe_s=p, exposed_s=step_s - p)
        for i, p in enumerate([0.0, *probes])
    ]
    return CodecRun(codec, 10, steps, [(0.0, 1.0)])


def test_a_last_bucket_holding_most_of_the_gradient_is_named():
    from hopq.train.records import CodecRun
    from hopq.train.report import bucket_line

    # the GPT with DDP's default buckets: 1 MiB, then 11.4 MiB at the backward's end
    default = bucket_line([CodecRun("bf16", bucket_bytes=[1 << 20, 11_950_000])], 0.0)
    assert "2 buckets" in default and "holds 92% of the gradient" in default
    assert "--bucket-mb" in default
    small = bucket_line([CodecRun("bf16", bucket_bytes=[2 << 20] * 6 + [400_000])], 2.0)
    assert "7 buckets" in small and "last bucket" not in small


def test_the_least_exposed_share_is_bounded_by_the_last_bucket_and_the_cores():
    from hopq.train.records import CodecRun, StepRecord
    from hopq.train.report import exposure_floor

    def run(codec, cpu, last):
        # 1.0 s steps, 0.6 s of compute, 10 MB sent, the last bucket 9 of 10 MiB
        steps = [
            StepRecord(i, 1.0, 1.0, 0.6, 0.1, 0.3, 10e6, 16.0, exposed_s=0.4, cpu_s=cpu,
                       last_bytes=last)
            for i in range(3)
        ]  # fmt: skip
        return CodecRun(codec, 10, steps, [(0.0, 1.0)], bucket_bytes=[1 << 20, 9 << 20])

    nan = float("nan")
    runs = [run("torch:fp16", nan, nan), run("dynamiq", 0.05, 2e6)]
    # 100 Mbit/s: fp16's last bucket is 9 MB (90% of its bytes), 0.72 s on the
    # wire; DynamiQ's 2 MB, 0.16 s, but 4 workers on 2 cores double its 0.05 s
    # of CPU to 0.10 s: the wire bounds both
    line = exposure_floor(runs, 4, 2, 100.0)
    assert "torch:fp16 72% by the wire (measured 40%)" in line
    assert "dynamiq 16% by the wire (measured 40%)" in line
    assert "fills the 2 cores" in line
    # a slow codec on a faster link: its CPU bounds it
    line = exposure_floor([run("dynamiq", 0.2, 2e6)], 4, 2, 1000.0)
    assert "dynamiq 40% by the CPU" in line
    # spare cores and no link rate (no emulated network): nothing bounds it
    assert exposure_floor(runs, 4, 16, 0.0) == ""


def test_the_step_floor_is_the_compute_plus_the_last_buckets_wire_time():
    from hopq.train.records import CodecRun, StepRecord
    from hopq.train.report import step_floor

    def run(codec, step, last):
        # 0.6 s of compute, 10 MB sent, the last bucket 9 of 10 MiB
        steps = [
            StepRecord(i, step, step, 0.6, 0.1, 0.3, 10e6, 16.0, exposed_s=step - 0.6,
                       last_bytes=last)
            for i in range(3)
        ]  # fmt: skip
        return CodecRun(codec, 10, steps, [(0.0, 1.0)], bucket_bytes=[1 << 20, 9 << 20])

    runs = [run("torch:fp16", 1.5, float("nan")), run("dynamiq", 0.88, 2e6)]
    line = step_floor(runs, 100.0)
    # torch: 90% of its 10 MB, 0.72 s at 100 Mbit/s; DynamiQ: 2 MB, 0.16 s
    assert "torch:fp16 1.320 s (1.14x)" in line
    assert "dynamiq 0.760 s (1.16x)" in line
    assert step_floor(runs, 0.0) == ""  # no emulated link: no floor


def test_the_cpu_bound_counts_this_machines_workers_only(monkeypatch):
    from hopq.train.report import local_workers

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_workers(4) == 4  # hopq's own spawn: every worker is here
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun over several machines
    assert local_workers(16) == 2


def test_the_timeline_gives_each_buckets_median_span():
    from hopq.train.records import CodecRun, StepRecord
    from hopq.train.report import timeline_line

    def step(i, ready, done):
        return StepRecord(i, 1.0, 1.0, 0.6, 0.0, 0.0, 1.0, 16.0, bucket_ready_s=ready,
                          bucket_done_s=done)  # fmt: skip

    r = CodecRun("bf16", 10, [
        step(0, [0.5], [0.9]),  # warm-up: left out
        step(1, [0.20, 0.60], [0.25, 0.98]),
        step(2, [0.24, 0.62], [0.29, 1.00]),
        step(3, [0.22, 0.61], [0.27, 0.99]),
    ], [(0.0, 1.0)])  # fmt: skip
    ddp = CodecRun("torch:ddp", 10, [step(0, [], []), step(1, [], [])], [(0.0, 1.0)])
    line = timeline_line([r, ddp])
    assert "bf16 220-270, 610-990" in line and "torch:ddp" not in line
    assert timeline_line([ddp]) == ""


def test_the_backward_pass_under_each_hook_is_set_against_torchs():
    """The report says when each hook's last bucket was ready (the backward pass's
    end, which a hook's CPU work delays on filled cores) against torch's hook's
    and the compute probe; without a torch contender or a hook, nothing."""
    from hopq.train.records import CodecRun, StepRecord
    from hopq.train.report import backward_line

    def run(name, last, probe=float("nan")):
        steps = [
            StepRecord(
                i,
                1.0,
                1.0,
                0.6,
                0.0,
                0.0,
                1.0,
                16.0,
                bucket_ready_s=[0.1, last + i * 1e-3],
                bucket_done_s=[0.2, last + 0.3],
                probe_s=probe,
            )  # fmt: skip
            for i in range(4)
        ]
        return CodecRun(name, 10, steps, [(0.0, 1.0)])

    line = backward_line([run("torch:fp16", 0.580, 0.575), run("dynamiq", 0.610)])
    assert "torch:fp16 582 ms" in line and "dynamiq 612 ms (+30)" in line
    assert "the compute probe: 575 ms" in line
    assert backward_line([run("bf16", 0.6), run("dynamiq", 0.61)]) == ""  # no torch hook
    assert backward_line([run("torch:fp16", 0.58)]) == ""


def test_what_synchronization_costs_the_cores_is_set_against_torchs_hook():
    """Every contender's CPU beyond its compute, torch's too, against torch's first
    hook (not DDP's own all-reduce, which has none); nothing when unmeasured."""
    from hopq.train.records import CodecRun, StepRecord
    from hopq.train.report import sync_cpu_line

    def run(name, cpu):
        steps = [
            StepRecord(i, 1.0, 1.0, 0.6, 0.0, 0.0, 1.0, 16.0, sync_cpu_s=cpu) for i in range(4)
        ]
        return CodecRun(name, 10, steps, [(0.0, 1.0)])

    line = sync_cpu_line([run("torch:ddp", 0.010), run("torch:fp16", 0.040), run("bf16", 0.030)])
    assert "torch:ddp 10 ms (0.25x)" in line and "bf16 30 ms (0.75x)" in line
    assert "torch:fp16 40 ms," in line and "against torch:fp16's" in line
    assert sync_cpu_line([run("bf16", float("nan"))]) == ""


def test_compute_drift_between_contenders_is_flagged():
    from hopq.train.report import compute_drift

    drift, warning = compute_drift([_timed("a", [1.0, 1.02, 0.98]), _timed("b", [1.05, 1.04])])
    assert drift == pytest.approx(0.045) and warning == ""  # medians 1.0 and 1.045
    drift, warning = compute_drift([_timed("a", [1.0, 1.0]), _timed("b", [4.5, 4.4, 4.6])])
    assert drift == pytest.approx(3.5) and "unreliable" in warning and "b 4.500 s" in warning


def test_the_baseline_is_the_best_torch_contender():
    from hopq.train.records import CodecRun
    from hopq.train.report import baseline

    def run(codec, evals):
        return CodecRun(codec, 10, [], evals)

    slow = run("torch:ddp", [(0.0, 10.0), (100.0, 5.0)])
    fast = run("torch:fp16", [(0.0, 10.0), (60.0, 5.02)])
    bad = run("torch:powersgd", [(0.0, 10.0), (30.0, 5.5)])  # quick but 10% worse: not it
    assert baseline([run("bf16", [(0.0, 5.0)]), slow, fast, bad]) is fast
    only_hopq = run("bf16", [(0.0, 5.0)])
    assert baseline([only_hopq, run("dynamiq", [(0.0, 5.0)])]) is only_hopq


def test_in_order_starts_each_bucket_after_the_previous_one_completed():
    import torch

    from hopq.train.contenders import in_order

    started, pending = [], []

    def hook(state, bucket):
        started.append(bucket)
        if bucket == "bad":
            raise RuntimeError("hook failed")
        fut = torch.futures.Future()
        pending.append((bucket, fut))
        return fut

    ordered = in_order(hook)
    a, b, c = (ordered(None, name) for name in ("a", "b", "c"))
    assert started == ["a"]  # b and c wait for the bucket before them
    pending[0][1].set_result(torch.ones(1))
    assert started == ["a", "b"] and a.value().item() == 1
    pending[1][1].set_exception(ValueError("gloo broke"))
    assert started == ["a", "b", "c"]  # the next bucket starts even after an error
    with pytest.raises(ValueError, match="gloo broke"):
        b.wait()
    pending[2][1].set_result(torch.zeros(1))
    assert c.value().item() == 0
    # the next step: the previous future is done, so the hook starts at once;
    # a hook that raises fails its bucket's future, not the caller
    d = ordered(None, "bad")
    assert started[-1] == "bad"
    with pytest.raises(RuntimeError, match="hook failed"):
        d.wait()


def test_torchrun_says_which_options_it_ignores():
    """Under torchrun the launcher sets the workers and the network is real: the
    emulated link's options and --world-size are named as ignored, not dropped
    silently."""
    from hopq.train.job import TrainOptions, ignored_under_torchrun

    assert ignored_under_torchrun(TrainOptions()) == ""
    note = ignored_under_torchrun(
        TrainOptions(rate_mbit=100, mtu=9000, world_size=2, tcp_congestion="bbr")
    )
    for flag in ("--rate-mbit 100", "--mtu 9000", "--world-size 2", "--tcp-congestion bbr"):
        assert flag in note
    assert "--comm-share" not in note and "ignored under torchrun" in note
    assert "--no-network ignored" in ignored_under_torchrun(TrainOptions(network=False))
    assert "--time-limit 60 ignored" in ignored_under_torchrun(TrainOptions(time_limit=60))


def test_minilm_classifier_workload_has_the_papers_sparse_embedding_gradient():
    """minilm-cls: docstrings labelled by their stdlib module, train and held-out
    apart; the word embeddings' gradient is non-zero exactly on the batch's tokens
    (what GComp's zero pruning removes, as on the paper's BERT fine-tuning)."""
    pytest.importorskip("transformers")
    from hopq.train import workloads

    if importlib.util.find_spec(workloads.MINILM_PACKAGE) is None:
        pytest.skip("the bench extra's MiniLM package is not installed")
    data = workloads.docstring_classes(seq_len=64, classes=4)
    assert len(data.classes) == 4 and data.classes == sorted(data.classes)
    assert data.train.shape[1] == data.eval.shape[1] == 64
    assert set(data.train_labels.tolist()) == set(data.eval_labels.tolist()) == set(range(4))
    assert len(data.eval) * 15 < len(data.train) < len(data.eval) * 25
    assert (data.train[:, 0] != data.pad_id).all()  # [CLS], never padding

    w = workloads.make("minilm-cls", seed=0, context=64)
    ids, labels = w.batch(seed=0, rank=1, step=2, size=3)
    assert torch.equal(ids, w.batch(seed=0, rank=1, step=2, size=3)[0])
    loss = w.loss(w.model, (ids, labels))
    assert torch.isfinite(loss) and 1.0 < loss.item() < 5.0  # about ln 16 untrained
    loss.backward()
    emb = w.model.bert.embeddings.word_embeddings.weight.grad
    used = torch.zeros(emb.shape[0], dtype=torch.bool)
    used[ids[ids != data.pad_id].unique()] = True
    assert (emb[used].abs().sum(1) > 0).all() and (emb[~used] == 0).all()
    assert (workloads.flat_grad(w.model) == 0).float().mean() > 0.45
    assert len(w.held_out(2, 4)) == 2


def test_contenders_draw_the_same_dropout_masks():
    """MiniLM has dropout and the contenders share one generator, taking their
    steps in turn: each step reseeds it, so on one rank (where torch's DDP and
    hopq's fp32 both leave the gradient as it is) the two train bit-identically."""
    pytest.importorskip("transformers")
    from hopq.cluster.launch import run_workers
    from hopq.train import workloads

    if importlib.util.find_spec(workloads.MINILM_PACKAGE) is None:
        pytest.skip("the bench extra's MiniLM package is not installed")
    o = train.TrainOptions(
        workload="minilm-cls", codecs=("torch:ddp", "fp32"), world_size=1, steps=3,
        probe_every=2, eval_every=3, vnmse_every=0, context=16, batch_size=2, network=False,
    )  # fmt: skip
    ddp, fp32 = run_workers(1, train.worker, o, ["torch:ddp", "fp32"])[0]
    assert [s.loss for s in ddp.steps] == [s.loss for s in fp32.steps]
    assert ddp.evals[-1][1] == fp32.evals[-1][1]
    assert len({s.loss for s in ddp.steps}) == 3  # it trains


def test_a_two_tier_calls_bytes_on_the_link_are_its_nodes():
    """The exposure floor's bytes: a flat call's are the rank's own; a two-tier
    call's are what its node's workers send between nodes together (they share
    the node's link), not the float32 tier inside the node."""
    from hopq.comm.engine import RunStats
    from hopq.train.contenders import _link_bytes

    inter = RunStats(0, 2, 100, payload_bytes=1000.0)
    intra = RunStats(0, 4, 100, payload_bytes=50000.0)
    two = RunStats(0, 8, 100, payload_bytes=51000.0, tiers={"intra": intra, "inter": inter})
    assert _link_bytes(two) == inter.bytes_sent * 4
    flat = RunStats(0, 8, 100, payload_bytes=3000.0)
    assert _link_bytes(flat) == flat.bytes_sent


def test_the_docstring_corpus_is_parsed_once_and_kept(tmp_path, monkeypatch):
    """The MiniLM corpus is parsed once and read back from the cache (every
    worker would parse the standard library otherwise); a damaged cache file is
    parsed again and replaced; a cache that cannot be written says so and
    still gives the corpus."""
    from hopq.train import workloads

    monkeypatch.setenv("HOPQ_CACHE_DIR", str(tmp_path / "cache"))
    first = workloads.stdlib_docstrings_by_module(200_000)
    assert first and first == workloads._parse_stdlib_docstrings(200_000)
    (kept,) = (tmp_path / "cache").glob("stdlib-docstrings-*.json")
    parse = workloads._parse_stdlib_docstrings
    monkeypatch.setattr(workloads, "_parse_stdlib_docstrings", lambda m: pytest.fail("parsed"))
    assert workloads.stdlib_docstrings_by_module(200_000) == first

    kept.write_text('[["email", "a docstring cut sho')
    monkeypatch.setattr(workloads, "_parse_stdlib_docstrings", parse)
    assert workloads.stdlib_docstrings_by_module(200_000) == first
    assert json.loads(kept.read_text()) == [list(p) for p in first]
    assert workloads._corpus_path(100_000) != kept  # another size, another file

    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("HOPQ_CACHE_DIR", str(tmp_path / "a file" / "cache"))
    monkeypatch.setattr(workloads, "_cache_warned", False)
    with pytest.warns(RuntimeWarning, match="cannot cache the docstring corpus"):
        assert workloads.stdlib_docstrings_by_module(200_000) == first


def _no_cluster() -> str | None:
    import os

    from hopq.cluster.network import unavailable_reason

    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "building network namespaces needs root"
    return unavailable_reason()


@pytest.mark.skipif(_no_cluster() is not None, reason="no emulated cluster here")
def test_the_report_says_how_the_two_tier_contenders_nodes_ran(tmp_path, monkeypatch):
    """On 2 emulated nodes of 2 workers, the report says whether a two-tier
    contender's float32 tier went through shared memory, and says so when it
    kept Gloo's messages (HOPQ_SHM=0): a tier that quietly lost its fast path
    would make the contender slower with nothing to show why."""
    o = train.TrainOptions(
        codecs=("bf16@hier",), world_size=4, workers_per_node=2, rate_mbit=1000, steps=2,
        probe_every=2, eval_every=2, gpt_dim=32, gpt_layers=1, context=32, batch_size=4,
        bucket_mb=0.02, out=str(tmp_path / "shm"),
    )  # fmt: skip
    text = train.run(o)
    assert "Inside each node the float32 tier went through shared memory." in text
    monkeypatch.setenv("HOPQ_SHM", "0")
    text = train.run(replace(o, out=str(tmp_path / "messages")))
    assert "kept Gloo's messages instead of shared memory (HOPQ_SHM=0" in text
    from hopq.train.report import load_runs

    # runs.json keeps it, so that a report rendered again says it too
    assert [r.node_tier for r in load_runs(tmp_path / "messages" / "runs.json")] == ["messages"]
