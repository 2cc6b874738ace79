"""The command line: ``hopq train``, ``hopq bench ...``, ``hopq plan`` and ``hopq codecs``.

Every option is generated from a job's frozen option dataclass (help text and
choices come from the fields' metadata, see :func:`hopq.options.option`), and the
options are validated by that dataclass before anything is launched: a bad value
is a usage error, not a traceback from a worker process.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hopq.options import enum_type, field_types, option, parse_value


def _default_text(v: Any) -> str:
    if isinstance(v, enum.Enum):
        return str(v.value)
    if isinstance(v, tuple):
        return " ".join(_default_text(x) for x in v) or "none"
    return str(v)


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` whose errors print the parser's own message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _parse_as(hint: Any, what: str, text: str) -> Any:
    """parse_value without naming the option: argparse's message names it."""
    try:
        return parse_value(hint, text, what)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg.removeprefix(f"{what}: ")) from None


def parse_codec_option(text: str) -> tuple[str, str, Any]:
    """``--codec-option CODEC.NAME=VALUE`` (e.g. ``dynamiq.budget=4``) -> (codec,
    name, value), the value parsed by the type of the codec's config field."""
    from hopq.codecs.registry import codec_info

    key, sep, raw = text.partition("=")
    codec, dot, name = key.partition(".")
    if not sep or not dot or not codec or not name:
        raise ValueError(f"codec option {text!r}: expected CODEC.NAME=VALUE, e.g. dynamiq.budget=4")
    cfg = codec_info(codec).cls.config_class
    fields = {f.name for f in dataclasses.fields(cfg)}
    if name not in fields:
        raise ValueError(f"codec {codec!r} has no option {name!r}; it has {sorted(fields)}")
    return codec, name, parse_value(field_types(cfg)[name], raw, f"{codec}.{name}")


def add_options(p: argparse.ArgumentParser, cls: type) -> None:
    """One command-line option per field of the option dataclass ``cls``."""
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        meta = f.metadata
        flag = "--" + f.name.replace("_", "-")
        help_text = meta.get("help", "")
        choices = meta.get("choices")
        if callable(choices):
            choices = choices()
        kw: dict[str, Any] = {"dest": f.name, "default": f.default}
        if f.name == "codec_options":
            kw.update(
                action="append",
                type=_typed(parse_codec_option),
                metavar=meta.get("metavar", "CODEC.NAME=VALUE"),
                default=[],
            )
            p.add_argument("--codec-option", **kw, help=help_text + " (repeatable)")
            continue
        if hint is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, **kw)
            continue
        elem = hint
        if typing.get_origin(hint) is tuple:
            elem = typing.get_args(hint)[0]
            kw["nargs"] = "+"
        cls_enum = enum_type(elem)
        if cls_enum is not None:
            choices = [str(e.value) for e in cls_enum]
            kw["type"] = str
        else:
            kw["type"] = _typed(functools.partial(_parse_as, elem, "--" + f.name))
        if choices:
            kw["choices"] = list(choices)
            listed = ",".join(map(str, choices))
            if "nargs" in kw:  # a list: name the choices in the help, keep the usage short
                kw["metavar"] = f.name.rstrip("s").upper()
                help_text += f"; choices: {listed}"
            else:
                kw["metavar"] = "{" + listed + "}"
        p.add_argument(flag, help=f"{help_text} (default: {_default_text(f.default)})", **kw)


def build(cls: type, ns: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """The option dataclass from parsed arguments; its validation errors become
    usage errors (exit status 2, no traceback)."""
    kw = {}
    for f in dataclasses.fields(cls):
        v = getattr(ns, f.name)
        kw[f.name] = tuple(v) if isinstance(v, list) else v
    try:
        return cls(**kw)
    except (ValueError, TypeError) as e:
        parser.error(str(e))


def _emit(text: str | None, out: str | None) -> None:
    if text is None:
        return
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
        print(f"\nwritten to {out}")


def codecs_text() -> str:
    """``hopq codecs``: every registered codec, with its options and defaults."""
    from hopq.codecs.registry import available_codecs, codec_info

    lines = []
    for name in available_codecs():
        info = codec_info(name)
        lines.append(f"{name}: {info.summary}")
        cfg = info.cls.config_class
        hints = field_types(cfg)
        for f in dataclasses.fields(cfg):
            cls_enum = enum_type(hints[f.name])
            choice = f" {{{','.join(str(e.value) for e in cls_enum)}}}" if cls_enum else ""
            lines.append(
                f"    {f.name}{choice} = {_default_text(f.default)}: {f.metadata.get('help', '')}"
            )
    lines.append("\nSet them with --codec-option CODEC.NAME=VALUE (hopq train) or")
    lines.append("hopq.get_codec(name, **options) / hopq.HookState(codec=name, **options).")
    return "\n".join(lines)


#: Gradient coordinates of the workloads of ``hopq train`` (docs/bench/vnmse.md).
WORKLOAD_PARAMS = {"gpt": 3_257_856, "minilm": 22_744_506}
_SCHEDULES = ("ring", "butterfly", "hier:ring", "hier:butterfly")


def _codec_names() -> list[str]:
    from hopq.codecs.registry import available_codecs

    return available_codecs()


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """``hopq plan``: the cluster and the model to plan for."""

    nodes: int = option(1, "N, the machines", lo=1)
    workers_per_node: int = option(1, "G, the workers (GPUs, processes) of each machine", lo=1)
    inter_gbit: float | None = option(
        None, "each node's uplink to the others, Gbit/s per direction (none: 10)"
    )
    inter_mbit: float | None = option(None, "the same in Mbit/s")
    intra_gbit: float | None = option(
        None, "each worker's link inside its node, Gbit/s (none: 100)"
    )
    intra_mbit: float | None = option(None, "the same in Mbit/s")
    inter_latency_us: float = option(20.0, "latency of a step between nodes, microseconds")
    intra_latency_us: float = option(2.0, "latency of a step inside a node, microseconds")
    cores_per_node: int | None = option(
        None, "CPU cores each node's workers share for codec work (none: one per worker)"
    )
    duplex: float = option(
        1.0, "how much longer two ranks sending to each other take (1: full duplex)"
    )
    params: int | None = option(
        None, "gradient coordinates of the model (none: 25,000,000, or --workload)"
    )
    workload: str | None = option(
        None, "take the model size of a workload of hopq train", choices=tuple(WORKLOAD_PARAMS)
    )
    bucket_mb: float = option(25.0, "DDP's bucket_cap_mb (the first bucket 1 MiB, as DDP)")
    compute_s: float | None = option(
        None, "seconds of the backward pass, to predict the exposed time (none: sync time)"
    )
    lossless: bool = option(False, "only codecs that return the exact sum (fp32, GComp)")
    max_loss_gap: float | None = option(
        0.5,
        "percent of training loss above torch's fp16 hook a codec may have had (none: no limit)",
    )
    max_vnmse: float | None = option(0.1, "largest predicted vNMSE allowed (none: no limit)")
    max_vnmse_ratio: float | None = option(
        1.0,
        "largest predicted vNMSE relative to DynamiQ's at 5 bits on the same chain "
        "(none: no limit)",
    )
    codecs: tuple[str, ...] = option((), "codecs to consider (default: all)", choices=_codec_names)
    schedules: tuple[str, ...] = option(_SCHEDULES, "flat topologies and hier:<topology>")
    budgets: tuple[float, ...] = option((4.0, 5.0, 6.0, 8.0), "DynamiQ's bit budgets to consider")
    measure: bool = option(False, "time this machine's codec kernels first (one core, seconds)")
    device: str = option(
        "cpu",
        "where --measure times the codecs (cuda: this machine's GPU)",
        choices=("cpu", "cuda"),
    )
    measure_coords: int = option(
        1 << 19,
        "coordinates per timed call of --measure (on a GPU give a bucket's size: small calls "
        "time the host's launches, not the kernels)",
        lo=256,
    )
    rows: int = option(0, "show the fastest ROWS candidates only (0: all)", lo=0)
    json: bool = option(False, "print the plan as JSON (to pin it) instead of the table")

    def __post_init__(self) -> None:
        for a, b in (("inter_gbit", "inter_mbit"), ("intra_gbit", "intra_mbit")):
            if getattr(self, a) is not None and getattr(self, b) is not None:
                raise ValueError(
                    f"give --{a.replace('_', '-')} or --{b.replace('_', '-')}, not both"
                )
        if self.params is not None and self.workload is not None:
            raise ValueError("give --params or --workload, not both")
        if self.measure_coords < 256:
            raise ValueError("--measure-coords must be at least 256")
        if self.measure_coords != 1 << 19 and not self.measure:
            raise ValueError("--measure-coords sets what --measure times: add --measure")
        if self.device != "cpu":
            if not self.measure:
                raise ValueError(f"--device {self.device} times the codecs there: add --measure")
            import torch

            if self.device == "cuda" and not torch.cuda.is_available():
                raise ValueError("--device cuda: torch sees no CUDA device here")
        self.inputs()  # checks the rest

    def inputs(self, speeds: dict[str, tuple[float, ...]] | None = None) -> Any:
        """The planner's inputs."""
        from hopq.comm.plan import PlanInputs

        def rate(gbit: float | None, mbit: float | None, default: float) -> float:
            return gbit if gbit is not None else mbit / 1000 if mbit is not None else default

        params = self.params
        if params is None:
            params = WORKLOAD_PARAMS[self.workload] if self.workload else 25_000_000
        return PlanInputs(
            nodes=self.nodes,
            per_node=self.workers_per_node,
            inter_gbit=rate(self.inter_gbit, self.inter_mbit, 10.0),
            intra_gbit=rate(self.intra_gbit, self.intra_mbit, 100.0),
            inter_latency_us=self.inter_latency_us,
            intra_latency_us=self.intra_latency_us,
            cores_per_node=self.cores_per_node,
            duplex=self.duplex,
            params=params,
            bucket_mb=self.bucket_mb,
            compute_s=self.compute_s,
            lossless=self.lossless,
            max_loss_gap=self.max_loss_gap,
            max_vnmse=self.max_vnmse,
            max_vnmse_ratio=self.max_vnmse_ratio,
            codecs=self.codecs,
            schedules=self.schedules,
            budgets=self.budgets,
            speeds=speeds or {},
        )


def measure_speeds(
    codecs: Sequence[str], coords: int = 1 << 19, device: str = "cpu"
) -> dict[str, tuple[float, ...]]:
    """This machine's codec speeds on one core (``hopq bench model``'s calibration),
    their tensors on ``device`` (``"cuda"``: the GPU's kernels), in ns per
    coordinate; the bits of GComp and OmniReduce, which depend on the gradient,
    stay those measured in training."""
    from hopq.bench.cost_model import calibrate
    from hopq.comm.plan import DEFAULT_SPEEDS

    out: dict[str, tuple[float, ...]] = {}
    for c in codecs:
        k = calibrate(c, coords, device)
        bits = DEFAULT_SPEEDS[c][4] if c in ("gcomp", "omnireduce") else k.bits
        out[c] = (k.plan * 1e9, k.enc * 1e9, k.hop * 1e9, k.dec * 1e9, bits)
    return out


def plan_text(o: PlanOptions) -> str:
    """``hopq plan``: the candidates' predicted time and error, and the pick."""
    import time

    from hopq.comm.plan import DEFAULT_SPEEDS
    from hopq.comm.plan import plan as make_plan

    lines = []
    speeds = None
    if o.measure:
        t0 = time.perf_counter()
        names = list(o.codecs) or [c for c in _codec_names() if c in DEFAULT_SPEEDS]
        speeds = measure_speeds(names, coords=o.measure_coords, device=o.device)
        where = "one core" if o.device == "cpu" else f"{o.device} tensors"
        lines.append(
            f"Codec speeds measured on this machine, {where}, in {time.perf_counter() - t0:.1f} s."
        )
    else:
        lines.append(
            "Codec speeds: the calibrated defaults (one CPU core; --measure times this machine)."
        )
    inp = o.inputs(speeds)
    p = make_plan(inp)
    if o.json:
        return p.to_json()
    sizes = inp.bucket_sizes()
    lines.append(
        f"Cluster: {inp.nodes} x {inp.per_node} ranks, {inp.inter_gbit:g} Gbit/s between nodes "
        f"({inp.inter_latency_us:g} us), {inp.intra_gbit:g} Gbit/s inside ({inp.intra_latency_us:g} us); "
        f"{sum(sizes):,} coordinates in {len(sizes)} buckets"
        + (f", {inp.compute_s:g} s of backward pass" if inp.compute_s is not None else "")
        + "."
    )
    lines += ["", p.table(o.rows or None), ""]
    kw = ", ".join(f"{k}={v!r}" for k, v in p.hook_kwargs().items())
    lines.append(f"Pin it: hopq.HookState({kw}) (hopq plan --json keeps the whole plan)")
    return "\n".join(lines)


def parser() -> tuple[
    argparse.ArgumentParser, dict[str, tuple[argparse.ArgumentParser, type, Any]]
]:
    """The parser, and per command: its sub-parser, option class and runner."""
    from hopq.bench.allreduce import Options as AllreduceOptions
    from hopq.bench.cost_model import ModelOptions
    from hopq.bench.equarx import EquarxOptions
    from hopq.bench.exits import ExitOptions
    from hopq.bench.faults import FaultOptions
    from hopq.bench.gcomp import GCompBenchOptions
    from hopq.bench.gqsgd import GQSGDOptions
    from hopq.bench.kernels import KernelOptions
    from hopq.bench.ranges import RangeOptions
    from hopq.bench.shards import ShardOptions
    from hopq.bench.vnmse import VnmseOptions
    from hopq.train.job import TrainOptions

    top = argparse.ArgumentParser(
        prog="hopq", description="Compressed gradient synchronization inside multi-hop all-reduce."
    )
    from hopq import __version__

    top.add_argument("--version", action="version", version=f"hopq {__version__}")
    sub = top.add_subparsers(dest="cmd", required=True, metavar="{train,bench,codecs,cluster,plan}")
    commands: dict[str, tuple[argparse.ArgumentParser, type, Any]] = {}
    tr = sub.add_parser(
        "train",
        help="the main job: data-parallel training, hopq's codecs against torch's own options, "
        "over an emulated network, with a report",
        description="N workers train a workload with every contender (hopq codecs and torch's "
        "own hooks; same weights and data, interleaved step by step), over an emulated network "
        "when root and tc are available; report in --out.",
    )
    add_options(tr, TrainOptions)
    commands["train"] = (tr, TrainOptions, "hopq.train.job")
    sub.add_parser("codecs", help="list the registered codecs and their options")
    what_plan = (
        "pick the codec, bit budget and schedule for a cluster from the calibrated cost model "
        "and the measured errors; prints every candidate's predicted time and error"
    )
    pl = sub.add_parser("plan", help=what_plan, description=what_plan)
    add_options(pl, PlanOptions)
    commands["plan"] = (pl, PlanOptions, None)
    from hopq.cluster.run import ClusterRunOptions

    cluster = sub.add_parser("cluster", help="an emulated cluster on this machine (root, tc)")
    csub = cluster.add_subparsers(dest="cluster", required=True, metavar="{run}")
    what = (
        "run a command once per node of an emulated cluster (network namespaces joined by "
        "tc-shaped links), as on one machine each; {node}, {nodes}, {workers_per_node}, "
        "{addr}, {master} and {is_host} in the command are filled in per node"
    )
    cr = csub.add_parser("run", help=what, description=what)
    add_options(cr, ClusterRunOptions)
    cr.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    commands["cluster run"] = (cr, ClusterRunOptions, "hopq.cluster.run")
    bench = sub.add_parser("bench", help="benchmarks")
    table = (
        ("allreduce", AllreduceOptions, "hopq.bench.allreduce",
         "nccl-tests style all-reduce timings beside torch.distributed's"),
        ("kernels", KernelOptions, "hopq.bench.kernels",
         "codec kernel time and bandwidth (DynamiQ; --codecs: EQuARX, MX) against a copy "
         "on the same device"),
        ("vnmse", VnmseOptions, "hopq.bench.vnmse",
         "compression error of every codec on real gradients"),
        ("model", ModelOptions, "hopq.bench.cost_model",
         "alpha-beta-gamma cost model: calibrate, predict, validate"),
        ("gcomp", GCompBenchOptions, "hopq.bench.gcomp",
         "GComp: compressed size over training (Fig. 9), static vs rebuilt table (Fig. 13a), kernels"),
        ("faults", FaultOptions, "hopq.bench.faults",
         "mismatched calls and dying ranks on real Gloo groups: the outcome table"),
        ("exits", ExitOptions, "hopq.bench.exits",
         "the README's example under torchrun, again and again: every run must exit 0"),
        ("gqsgd", GQSGDOptions, "hopq.bench.gqsgd",
         "Global-QSGD: variance growth on the tree vs (9/8)^levels, exponential reduce speed"),
        ("equarx", EquarxOptions, "hopq.bench.equarx",
         "EQuARX's Fig. 7 (error per schedule and stage) and Fig. 6 (time vs bf16) analogues"),
        ("ranges", RangeOptions, "hopq.bench.ranges",
         "the range of magnitudes each codec handles; finite in, finite out"),
        ("shards", ShardOptions, "hopq.bench.shards",
         "DynamiQ over FSDP's rank shards (chunk-local) vs the whole vector: vNMSE and bits"),
    )  # fmt: skip
    bsub = bench.add_subparsers(
        dest="bench", required=True, metavar="{" + ",".join(t[0] for t in table) + "}"
    )
    for name, cls, module, what in table:
        bp = bsub.add_parser(name, help=what, description=what)
        add_options(bp, cls)
        bp.add_argument("--out", help="also write the report to this file")
        commands[f"bench {name}"] = (bp, cls, module)
    return top, commands


def main(argv: Sequence[str] | None = None) -> int:
    import importlib

    top, commands = parser()
    ns = top.parse_args(argv)
    if ns.cmd == "codecs":
        print(codecs_text())
        return 0
    if ns.cmd == "plan":
        p, cls, _ = commands["plan"]
        print(plan_text(build(cls, ns, p)))
        return 0
    if ns.cmd == "cluster":
        from hopq.cluster.run import run as run_cluster

        p, cls, _ = commands["cluster run"]
        command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
        if not command:
            p.error("give the command to run in each node after --")
        return run_cluster(build(cls, ns, p), command)
    key = "train" if ns.cmd == "train" else f"bench {ns.bench}"
    p, cls, module = commands[key]
    options = build(cls, ns, p)
    text = importlib.import_module(module).run(options)
    _emit(text, getattr(ns, "out", None) if key != "train" else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
