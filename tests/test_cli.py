"""The command line: options generated from the option dataclasses, validated
before anything is launched, codec options settable, progress that names what
runs whether or not output is a terminal."""

import io
import sys

import pytest
import torch

import hopq
from hopq import cli
from hopq.reporting import Progress


def _error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2  # a usage error, not a traceback
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["train", "--codecs", "zip"], "invalid choice: 'zip'"),
        (["train", "--workload", "resnet"], "invalid choice: 'resnet'"),
        (["train", "--topology", "butterfy"], "invalid choice: 'butterfy'"),
        (["train", "--steps", "0"], "steps must be >= 1"),
        (["train", "--steps", "many"], "expected int"),
        (["train", "--codec-option", "dynamiq.bugdet=4"], "has no option 'bugdet'"),
        (["train", "--codec-option", "dynamiq.budget=abc"], "expected float"),
        (["train", "--codec-option", "budget=4"], "CODEC.NAME=VALUE"),
        (
            ["train", "--codecs", "bf16", "--codec-option", "dynamiq.budget=4"],
            "not among the codecs",
        ),
        (["train", "--codecs", "dynamiq", "--codec-option", "dynamiq.budget=inf"], "finite"),
        (["train", "--codecs", "dynamiq", "--codec-option", "dynamiq.widths=3"], "widths"),
        (["bench", "kernels", "--widths", "3"], "invalid choice"),
        (["bench", "vnmse", "--tables", "ladder", "nope"], "invalid choice: 'nope'"),
        (["bench", "vnmse", "--codecs", "nope"], "unknown codecs"),
        (["bench", "gqsgd", "--parts", "quality", "nope"], "invalid choice: 'nope'"),
        (["bench", "allreduce", "--mtu", "9000"], "give --rate-mbit too"),
        (["bench", "allreduce", "--rate-mbit", "100", "--mtu", "100"], "between 576 and 65535"),
        (["train", "--no-network", "--mtu", "9000"], "--no-network turns off"),
        (["train", "--no-network", "--tcp-congestion", "bbr"], "--no-network turns off"),
        (["train", "--tcp-congestion", "no-such"], "must name a TCP congestion control"),
        (
            ["bench", "allreduce", "--rate-mbit", "100", "--tcp-congestion", "1x"],
            "must name a TCP congestion control",
        ),
        # options of a part (or optimizer, workload, validation) the run does not have
        (["bench", "gqsgd", "--quality-steps", "5"], "only acts with --parts quality"),
        (["bench", "equarx", "--rate-mbit", "100"], "only acts with --parts timing"),
        (["bench", "gcomp", "--parts", "kernels", "--steps", "3"], "--parts sizes or loss"),
        (["bench", "gcomp", "--optimizers", "sgd", "--adamw-lr", "1e-3"], "--optimizers adamw"),
        (["bench", "model", "--no-validate", "--validate-rate-mbit", "50"], "with --validate,"),
        (["bench", "vnmse", "--workloads", "gpt", "--minilm-warmup", "5"], "--workloads minilm"),
        (["bench", "vnmse", "--tables", "eps", "--sweep-coords", "1000"], "--tables scale"),
        (["bench", "shards", "--data", "synthetic", "--gpt-warmup", "5"], "--data gpt"),
        (["bench", "ranges", "--topology", "star"], "invalid choice: 'star'"),
        (["bench", "ranges", "--size", "abc"], "argument --size: expected int, got 'abc'"),
    ],
)
def test_bad_options_are_usage_errors(capsys, argv, words):
    assert words in _error(capsys, argv)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"hopq {hopq.__version__}"


def test_help_names_choices_and_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    from hopq.comm.topology import TOPOLOGIES

    out = "".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    assert "{gpt,minilm,minilm-cls}" in out and "{" + ",".join(TOPOLOGIES) + "}" in out
    assert "dynamiq" in out and "(default:auto)" in out
    assert "--codec-option" in out


def test_codec_options_are_parsed_by_field_type():
    assert cli.parse_codec_option("dynamiq.budget=4") == ("dynamiq", "budget", 4.0)
    assert cli.parse_codec_option("dynamiq.widths=2,4,8,16") == ("dynamiq", "widths", (2, 4, 8, 16))
    assert cli.parse_codec_option("dynamiq.eps=4:0.3,8:0.1") == (
        "dynamiq",
        "eps",
        ((4, 0.3), (8, 0.1)),
    )
    assert cli.parse_codec_option("dynamiq.zero_class=true")[2] is True
    assert cli.parse_codec_option("mxfp8.mu_init=none")[2] is None
    assert cli.parse_codec_option("thc.lane_bits=12")[2] == 12
    from hopq.train.job import TrainOptions

    o = TrainOptions(codecs=("dynamiq",), codec_options=(("dynamiq", "budget", 4.0),))
    assert o.codec_config("dynamiq") == {"budget": 4.0}


def test_codecs_command_lists_every_codec(capsys):
    import hopq

    assert cli.main(["codecs"]) == 0
    out = capsys.readouterr().out
    for name in hopq.available_codecs():
        assert f"{name}:" in out
    assert "allocation {heuristic,exact,fixed} = exact" in out


def test_progress_without_a_terminal_prints_lines_with_the_label():
    buf = io.StringIO()
    with Progress("[bf16]", 25, every=10, stream=buf) as p:
        for i in range(25):
            p.update(f"loss {i}")
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("[[bf16]] 1/25")  # the first step, then every 10th and the last
    assert [ln.split()[1] for ln in lines] == ["1/25", "10/25", "20/25", "25/25"]
    assert "loss 24" in lines[-1]


def test_progress_says_a_line_after_a_slow_step(monkeypatch):
    """Steps of minutes (a long training job) still show in a log between the
    every-k lines: a step that ends quiet_s after the last line prints one."""
    import types

    import hopq.reporting as reporting

    now = [0.0]
    monkeypatch.setattr(reporting, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    buf = io.StringIO()
    with Progress("job", 40, every=10, quiet_s=60, stream=buf) as p:
        for _ in range(5):
            now[0] += 100.0  # each step takes 100 s
            p.update()
    assert [ln.split()[1] for ln in buf.getvalue().splitlines()] == [
        "1/40",
        "2/40",
        "3/40",
        "4/40",
        "5/40",
    ]


def test_progress_on_a_terminal_keeps_the_label_rich_would_eat():
    pytest.importorskip("rich")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    buf = Terminal()
    with Progress("[bf16]", 3, stream=buf) as p:
        for _ in range(3):
            p.update("[x] info")
    assert "[bf16]" in buf.getvalue()  # escaped, not taken as a style tag


def test_bench_allreduce_reports_bytes_and_codec_work():
    """The all-reduce benchmark runs end to end (2 ranks, one small size) and says
    what each method sent and how long its codec worked."""
    from hopq.bench import allreduce

    o = allreduce.Options(
        world_size=2, min_bytes=4096, max_bytes=4096, codecs=("bf16",), topologies=("ring",),
        budget_s=0.01, microshards=(0, 3),
    )  # fmt: skip
    report = allreduce.run(o)
    assert "sent / rank" in report and "codec work (ms)" in report
    for method in ("bf16/ring ", "bf16/ring/u3 "):  # the engine's depth, then 3 messages
        row = next(line for line in report.splitlines() if method in line)
        cells = [c.strip() for c in row.split("|")]
        assert cells[8] == "2 KiB"  # 1024 coordinates as bfloat16, once around a 2-rank ring
    # torch's fp16 hook's all-reduce, timed beside hopq's bf16: the same bytes on the wire
    row = next(line for line in report.splitlines() if "torch.distributed/fp16 " in line)
    assert [c.strip() for c in row.split("|")][8] == "2 KiB"
    with pytest.raises(ValueError, match="microshards"):
        allreduce.Options(microshards=(0, -2))
    with pytest.raises(ValueError, match="microshards"):
        hopq.simulate([torch.ones(8)] * 2, "bf16", "ring", microshards=0)


def test_bench_allreduce_says_how_the_nodes_float32_tier_ran(monkeypatch):
    """With a layout, the report says whether the two-tier calls' float32 tier
    went through shared memory or kept the messages (HOPQ_SHM=0)."""
    from hopq.bench import allreduce

    o = allreduce.Options(
        world_size=4, min_bytes=65536, max_bytes=65536, codecs=("bf16",),
        topologies=("hier:ring",), layout="2x2", budget_s=0.01,
    )  # fmt: skip
    assert "float32 tier went through shared memory" in allreduce.run(o)
    monkeypatch.setenv("HOPQ_SHM", "0")
    assert "float32 tier kept Gloo's messages" in allreduce.run(o)


def test_missing_matplotlib_is_said_once(monkeypatch, capsys):
    """Without matplotlib the reports skip their plots, and say so (once)."""
    from hopq import reporting

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(reporting, "_NO_PLOTS_SAID", False)
    assert reporting.pyplot() is None and reporting.pyplot() is None
    err = capsys.readouterr().err
    assert err.count("matplotlib is not installed") == 1 and "hopq[bench]" in err


def test_a_congestion_control_the_host_does_not_allow_is_refused_by_name(tmp_path):
    """Checked against the host's list before any network is built (a usage
    error, not a traceback from the namespace setup); without the list, the
    setup itself refuses."""
    from hopq.cluster.network import check_congestion

    allowed = tmp_path / "allowed"
    allowed.write_text("reno bbr\n")
    assert check_congestion("bbr", allowed) == "bbr"
    with pytest.raises(ValueError, match="only reno, bbr"):
        check_congestion("cubic", allowed)
    assert check_congestion("cubic", tmp_path / "missing") == "cubic"
