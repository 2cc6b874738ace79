"""``hopq train``: data-parallel training with compressed gradient sync on an
emulated cluster network, and a time-to-accuracy report (the DynamiQ paper's
section 5: Figures 4-6 and 18).

N Gloo worker processes (default 4), launched here or by ``torchrun``, train one
workload with every *contender* (a hopq codec, or one of torch's own options:
``torch:ddp``, ``torch:fp16``, ``torch:powersgd``, see
:mod:`hopq.train.contenders`), each with its own replica from the same initial
weights, the same data order and seeds, and the same dropout masks at every
step (MiniLM's; the global generator is reseeded before each contender's step):

* ``gpt`` (default, quick): a byte-level GPT trained from random weights on the
  standard library's sources;
* ``minilm``: all-MiniLM-L6-v2 fine-tuned as a masked language model on the
  standard library's docstrings (``pip install 'hopq[bench]'``);
* ``minilm-cls``: all-MiniLM-L6-v2 fine-tuned as a sentence classifier (which
  standard-library module a docstring comes from), the GComp paper's BERT
  regime, whose word-embedding gradient is mostly zeros (same extra).

**Interleaved.** Step k of every contender runs before step k + 1 of any, so a
change in the machine's load (a 2-core machine shared with anything) hits all
contenders alike instead of flattering whichever ran in a quiet moment.

**Timings.** The workers talk over an emulated network (namespaces and
``tc tbf``, see :mod:`hopq.cluster.network`) whose per-worker rate is, unless
given, calibrated so that torch:fp16's *exposed* communication is
``comm_share`` of its step. Every hook overlaps the backward pass, so a step's
time is not compute plus communication: the job probes each contender's compute
every ``probe_every`` steps (a forward and backward pass under DDP's
``no_sync``, no communication, gradients dropped) and adds the measured
optimizer step. Exposed communication is the step minus that compute; hopq's
hook also reports its codec work and its communication (on its thread), so the
report can say how much of them was hidden behind compute. The report flags
compute that differs by more than 10% between contenders (a loaded machine)
and gives each contender's step-time spread.

Every ``vnmse_every`` steps the hook also measures the vNMSE of the compressed
all-reduce against an exact one on the same gradients (those steps are left out
of the timings); every ``eval_every`` steps the held-out loss. The report folder
holds report.md, runs.json and PNG plots.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hopq.cluster.network import (
    CONGESTION,
    EmulatedNetwork,
    check_congestion,
    check_mtu,
    check_nodes,
)
from hopq.comm.engine import bits_per_coordinate
from hopq.comm.topology import TOPOLOGIES
from hopq.options import changed_options, option
from hopq.reporting import Progress
from hopq.train.contenders import (
    Sync,
    codec_of,
    contender_choices,
    is_auto,
    is_hierarchical,
    is_torch,
    resolve_contenders,
)
from hopq.train.records import WARMUP_STEPS, CodecRun, StepRecord
from hopq.train.report import report
from hopq.train.workloads import WORKLOADS, Workload, step_seed

#: The contender the link is calibrated against: torch's fp16 hook, what a
#: PyTorch user who compresses at all already has.
CALIBRATION_CONTENDER = "torch:fp16"


@dataclass(frozen=True)
class TrainOptions:
    workload: str = option("gpt", "what to train", choices=tuple(WORKLOADS))
    codecs: tuple[str, ...] = option(
        ("auto",),
        "contenders, trained interleaved step by step: hopq codecs and torch's own "
        "options (torch:ddp, torch:fp16, torch:powersgd); auto: torch's three, bf16, "
        "dynamiq and every other registered codec except fp32 and fp16; all: every codec",
        choices=contender_choices,
    )
    topology: str = option("ring", "all-reduce schedule", choices=tuple(TOPOLOGIES))
    world_size: int = option(4, "worker processes (ignored under torchrun)")
    #: 60 steps x 7 codecs: about 10 minutes of training (14 in all, with the link
    #: calibration and the evaluations) on 2 cores with the default GPT.
    steps: int = option(60, "training steps per codec")
    batch_size: int = option(8, "sequences per worker and step")
    bucket_mb: float = option(
        0.0,
        "DDP's bucket_cap_mb for every contender: smaller buckets become ready earlier in "
        "the backward pass, so more of their all-reduce can hide behind it; 0: DDP's "
        "default (25 MB, and 1 MiB for the first bucket, which DDP only uses when no cap "
        "is given)",
    )
    lr: float = option(
        0.0, "learning rate; 0: the workload's own (gpt 1e-3, minilm and minilm-cls 1e-4)"
    )
    eval_every: int = option(20, "steps between held-out evaluations")
    time_limit: float = option(
        0.0,
        "seconds the training ranks may run before they are stopped; 0: no limit (a rank "
        "that loses a peer still fails within its process group's timeout)",
    )
    eval_batches: int = option(8, "held-out batches per evaluation")
    vnmse_every: int = option(
        10, "steps between measurements of the compression error (vNMSE); 0: never"
    )
    rate_mbit: float = option(
        0.0, "per-worker link rate of the emulated network in Mbit/s; 0: calibrate it"
    )
    mtu: int = option(1500, "the emulated links' MTU (9000: jumbo frames)")
    tcp_congestion: str = option(
        CONGESTION,
        "TCP congestion control in the emulated network's namespaces (reno: the link "
        "is the only limit; bbr: the host's default here, whose probing slows some calls)",
    )
    nodes: int = option(
        0,
        "nodes of the emulated network: --world-size becomes nodes x --workers-per-node; "
        "0: world size / workers per node",
    )
    workers_per_node: int = option(
        1,
        "workers sharing each emulated node: they talk over its loopback, and only traffic "
        "between nodes crosses the (calibrated or --rate-mbit) link, one per node",
    )
    intra_rate_mbit: float = option(
        0.0,
        "rate of each emulated node's loopback in Mbit/s (all traffic between its workers "
        "together); 0: unshaped",
    )
    comm_share: float = option(
        0.4,
        "when calibrating: the share of torch:fp16's step (with its overlap) that its "
        "exposed communication should take",
    )
    powersgd_start: int = option(
        10,
        "torch:powersgd: steps of plain all-reduce before it compresses (torch requires > 1: "
        "DDP rebuilds its buckets after the first step)",
    )
    probe_every: int = option(
        10, "steps between compute probes (a forward and backward pass without communication)"
    )
    network: bool = option(True, "emulate the network when the machine allows it (root, tc)")
    gpt_dim: int = option(256, "GPT width")
    gpt_layers: int = option(4, "GPT layers")
    context: int = option(128, "sequence length")
    seed: int = option(0, "seed of the weights, the data order and the codecs")
    out: str = option("runs/train", "report folder")
    #: Codec options, ((codec, name, value), ...): ``--codec-option dynamiq.budget=4``.
    codec_options: tuple[tuple[str, str, Any], ...] = option(
        (), "codec options as CODEC.NAME=VALUE, e.g. dynamiq.budget=4", metavar="CODEC.NAME=VALUE"
    )

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {self.workload!r}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {sorted(TOPOLOGIES)}, got {self.topology!r}")
        for name in (
            "world_size",
            "steps",
            "batch_size",
            "eval_every",
            "eval_batches",
            "context",
            "probe_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        n = check_nodes(
            self.world_size, "world_size" in changed_options(self), self.nodes,
            self.workers_per_node, self.intra_rate_mbit,
        )  # fmt: skip
        object.__setattr__(self, "world_size", n)
        if not self.network and (self.nodes or self.workers_per_node > 1 or self.intra_rate_mbit):
            raise ValueError(
                "--nodes, --workers-per-node and --intra-rate-mbit shape the emulated "
                "network, which --no-network turns off"
            )
        if not self.time_limit >= 0:
            raise ValueError(f"time_limit must be >= 0 (0: no limit), got {self.time_limit}")
        if self.powersgd_start < 2:
            raise ValueError(f"powersgd_start must be >= 2, got {self.powersgd_start}")
        if not self.bucket_mb >= 0:
            raise ValueError(f"bucket_mb must be >= 0 (0: DDP's default), got {self.bucket_mb}")
        check_mtu(self.mtu)
        if self.mtu != 1500 and not self.network:
            raise ValueError(
                "--mtu sets the emulated network's links, which --no-network turns off"
            )
        check_congestion(self.tcp_congestion)
        if self.tcp_congestion != CONGESTION and not self.network:
            raise ValueError(
                "--tcp-congestion sets the emulated network's TCP, which --no-network turns off"
            )
        if self.rate_mbit > 0 and not self.network:
            raise ValueError(
                "--rate-mbit sets the emulated network's links, which --no-network turns off"
            )
        changed = changed_options(self)
        if "comm_share" in changed and (self.rate_mbit > 0 or not self.network):
            raise ValueError(
                "--comm-share only sets the calibrated link rate: it does nothing with "
                "--rate-mbit or --no-network"
            )
        if self.workload != "gpt" and changed & {"gpt_dim", "gpt_layers"}:
            raise ValueError(f"--gpt-dim/--gpt-layers shape the GPT, not {self.workload}")
        if self.vnmse_every < 0 or self.rate_mbit < 0 or self.lr < 0:
            raise ValueError("vnmse_every, rate_mbit and lr must be >= 0")
        if not 0 < self.comm_share < 1:
            raise ValueError(f"comm_share must be in (0, 1), got {self.comm_share}")
        codecs = self.resolved_codecs()  # unknown names fail here, before anything runs
        if "powersgd_start" in changed and "torch:powersgd" not in codecs:
            raise ValueError("--powersgd-start sets torch:powersgd, which is not among the codecs")
        given = [(c, name) for c, name, _ in self.codec_options]
        twice = sorted({f"{c}.{name}" for c, name in given if given.count((c, name)) > 1})
        if twice:
            raise ValueError(f"codec option given twice: {', '.join(twice)}")
        hier = [c for c in codecs if is_hierarchical(c)]
        if hier and self.workers_per_node == 1 and "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError(
                f"{', '.join(hier)}: the two-tier all-reduce needs nodes of several workers "
                "(--workers-per-node, or torchrun's --nproc_per_node on several nodes); with "
                "one worker per node it is the flat call"
            )
        for codec, name, _value in self.codec_options:
            if codec not in {codec_of(c) for c in codecs}:
                raise ValueError(
                    f"codec option {codec}.{name}: {codec!r} is not among the codecs run"
                )
        for c in codecs:  # bad options fail here too
            self.codec_config(c)

    def resolved_codecs(self) -> list[str]:
        """The contenders, in order (unknown names raise ValueError)."""
        return resolve_contenders(self.codecs, self.topology)

    def codec_config(self, codec: str) -> dict[str, Any]:
        """The options given for ``codec``, validated by building it once."""
        from hopq.codecs.registry import get_codec

        if is_torch(codec) or is_auto(codec):
            return {}
        kw = {name: value for c, name, value in self.codec_options if c == codec_of(codec)}
        get_codec(codec_of(codec), **kw)
        return kw


def make_workload(o: TrainOptions) -> Workload:
    from hopq.train import workloads

    kw = {"context": o.context}
    if o.workload == "gpt":
        kw |= {"dim": o.gpt_dim, "layers": o.gpt_layers}
    return workloads.make(o.workload, o.seed, **kw)


# -- the contenders' runs on one rank ---------------------------------------------
def _evaluate(model: nn.Module, w: Workload, held: list[Any], rank: int, n: int) -> float:
    """Held-out loss; ranks split the evaluation batches and sum."""
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(rank, len(held), n):
            tot[0] += float(w.loss(model, held[i]))
            tot[1] += 1
    model.train()
    dist.all_reduce(tot)
    return float(tot[0] / tot[1])


@dataclass
class _Lane:
    """One contender on this rank: its own model replica, optimizer and hook."""

    name: str
    w: Workload
    ddp: DDP
    opt: torch.optim.Optimizer
    sync: Sync
    run: CodecRun
    clock: float = 0.0
    #: The latest compute probe: forward and backward without communication.
    fwd_bwd_s: float = float("nan")
    #: That probe's CPU seconds on this rank (every thread of the process).
    fwd_bwd_cpu: float = float("nan")


def _lane(o: TrainOptions, name: str, n: int) -> _Lane:
    torch.manual_seed(o.seed)
    w = make_workload(o)  # the same initial weights for every contender
    # no cap given: DDP's default layout (25 MB, the first bucket 1 MiB); any
    # explicit cap, even 25, also sets the first bucket's
    ddp = DDP(w.model, bucket_cap_mb=o.bucket_mb or None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=o.lr or w.lr)
    sync = Sync(name, ddp, n, o.seed, o.topology, o.codec_config(name), o.powersgd_start, opt)
    # the codecs that read the optimizer (GComp's thresholds, DynamiQ's step sizes)
    handed = (
        type(opt).__name__ if sync.state is not None and sync.state.optimizer is not None else ""
    )
    return _Lane(name, w, ddp, opt, sync, CodecRun(name, params=sync.numel, optimizer=handed))


def _probe(lane: _Lane, b: Any) -> tuple[float, float]:
    """Seconds of a forward and backward pass with no communication (DDP's
    ``no_sync``; the slowest rank's) and this rank's CPU seconds in it; the
    gradients are dropped, so training is unchanged."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    with lane.ddp.no_sync():
        lane.w.loss(lane.ddp, b).backward()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    lane.opt.zero_grad(set_to_none=True)
    t = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
    return float(t), cpu


def _step(lane: _Lane, b: Any, step: int, o: TrainOptions, n: int, probe: bool) -> None:
    probe_s = float("nan")
    if probe:
        probe_s, lane.fwd_bwd_cpu = _probe(lane, b)
        lane.fwd_bwd_s = probe_s
    measure = o.vnmse_every > 0 and step % o.vnmse_every == 0
    lane.sync.begin(measure)
    # every contender draws the same dropout masks at this step on this rank
    # (MiniLM's dropout; the contenders share one generator and run in turn),
    # from a seed offset from the micro-batch's so that masks and data draw apart
    torch.manual_seed(step_seed(o.seed, step, dist.get_rank()) + (1 << 40))
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = lane.w.loss(lane.ddp, b)
    loss.backward()  # returns once every bucket's future completed
    t1 = time.perf_counter()
    # what synchronization cost this rank's cores: the process's CPU in the
    # forward and backward beyond the probe's (every thread: the hook's, torch's
    # and the backend's), for torch's contenders as for hopq's
    sync_cpu = time.process_time() - c0 - lane.fwd_bwd_cpu
    lane.opt.step()
    lane.opt.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    sync = lane.sync.end(t0)
    sent, exact_s = sync.sent, sync.exact_s
    t = torch.tensor(
        [t2 - t0 - exact_s, t2 - t1, float(loss.detach()), sync_cpu], dtype=torch.float64
    )
    dist.all_reduce(t[:2], op=dist.ReduceOp.MAX)
    dist.all_reduce(t[2:])  # summed: the loss and the CPU are means over the ranks
    step_s, opt_s = float(t[0]), float(t[1])
    if step >= WARMUP_STEPS:  # warm-up is out of the times to a loss too
        lane.clock += step_s
    compute = lane.fwd_bwd_s + opt_s
    lane.run.steps.append(
        StepRecord(
            step,
            float(t[2]) / n,
            step_s,
            compute,
            sync.codec_s,
            sync.comm_s,
            sent,
            sync.bits if sync.bits == sync.bits else bits_per_coordinate(sent, n, lane.sync.numel),
            sync.vnmse,
            update_vnmse=sync.update_vnmse,
            exposed_s=max(0.0, step_s - compute),
            probe_s=probe_s,
            cpu_s=sync.cpu_s,
            sync_cpu_s=float(t[3]) / n,
            last_bytes=sync.last_bytes,
            bucket_ready_s=list(sync.ready_s),
            bucket_done_s=list(sync.done_s),
            measured_error=measure,
        )
    )


def _probe_steps(o: TrainOptions) -> set[int]:
    """Steps whose compute is probed: the second (after warm-up), every
    ``probe_every`` after it, and the last."""
    return {1 % o.steps, o.steps - 1, *range(1, o.steps, o.probe_every)}


def worker(rank: int, n: int, o: TrainOptions, contenders: list[str]) -> list[CodecRun]:
    """Train every contender, interleaved: step k of each contender runs before
    step k + 1 of any, so that a change in the machine's load hits them alike."""
    lanes = [_lane(o, c, n) for c in contenders]
    held = lanes[0].w.held_out(o.eval_batches, o.batch_size)
    for lane in lanes:
        lane.run.evals.append((0.0, _evaluate(lane.ddp, lane.w, held, rank, n)))
    probes = _probe_steps(o)
    label = contenders[0] if len(contenders) == 1 else f"{len(contenders)} contenders"
    bar = Progress(label, o.steps) if rank == 0 else None
    for step in range(o.steps):
        b = lanes[0].w.batch(o.seed, rank, step, o.batch_size)
        for lane in lanes:
            _step(lane, b, step, o, n, step in probes)
            if (step + 1) % o.eval_every == 0 or step == o.steps - 1:
                lane.run.evals.append((lane.clock, _evaluate(lane.ddp, lane.w, held, rank, n)))
        if bar is not None:
            bar.update(
                "  ".join(f"{x.name} {x.run.evals[-1][1]:.3f}" for x in lanes[:4])
                + ("  ..." if len(lanes) > 4 else "")
            )
    if bar is not None:
        bar.close()
    tier = _node_tier()
    for lane in lanes:
        lane.run.bucket_bytes = bucket_bytes(lane.ddp)
        if is_hierarchical(lane.name):
            lane.run.node_tier = tier
        planner = lane.sync.state.auto if lane.sync.state is not None else None
        if planner is not None:  # the report names what codec="auto" picked
            lane.run.codec = f"{lane.name} ({planner.summary()})"
            lane.run.plan_note = planner.report(lane.clock)
    return [lane.run for lane in lanes]


def _node_tier() -> str:
    """How the two-tier calls' float32 tier ran inside the nodes, every rank's
    (:func:`hopq.comm.shm.ranks_state`, a collective): "shared memory",
    "messages" where some kept Gloo's messages, "" where none ran."""
    from hopq.comm import shm

    node = shm.ranks_state()
    return "" if node is None else "shared memory" if node == 1.0 else "messages"


def bucket_bytes(ddp: DDP) -> list[int]:
    """Bytes of each of ``ddp``'s gradient buckets in reduction order, as DDP
    rebuilt them after the first step (empty when it has not logged them yet,
    or this torch's DDP does not report them)."""
    sizes = ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes") or ""
    return [int(x) for x in str(sizes).split(",") if x.strip()]


def _calibrate_worker(rank: int, n: int, o: TrainOptions) -> tuple[float, float, float]:
    """torch:fp16 for a few steps: (compute s, exposed s, bytes per rank) per step."""
    short = TrainOptions(
        **{**asdict(o), "steps": 5, "eval_every": 1 << 30, "vnmse_every": 0, "probe_every": 1}
    )
    (run,) = worker(rank, n, short, [CALIBRATION_CONTENDER])
    tail = run.steps[2:]
    m = [sum(getattr(s, f) for s in tail) / len(tail) for f in ("compute_s", "exposed_s", "bytes")]
    return m[0], m[1], m[2]


# -- the job --------------------------------------------------------------------
def _network(o: TrainOptions, n: int, rate: float) -> EmulatedNetwork:
    """The emulated network the options ask for, at ``rate`` Mbit/s per node uplink."""
    from hopq.cluster.network import EmulatedNetwork

    return EmulatedNetwork(
        n,
        rate_mbit=rate,
        mtu=o.mtu,
        congestion=o.tcp_congestion,
        workers_per_node=o.workers_per_node,
        intra_rate_mbit=o.intra_rate_mbit,
    )


def _calibrate(o: TrainOptions, n: int) -> tuple[float, str]:
    """A link rate at which torch:fp16's *exposed* communication is ``comm_share``
    of its step, with the overlap it already has. First guess: no overlap
    (communication time = bytes / rate); then one correction from a short run on
    that link, taking the hidden part as fixed."""
    from hopq.cluster.launch import run_workers

    compute, _, sent = run_workers(n, _calibrate_worker, o)[0]
    want = compute * o.comm_share / (1 - o.comm_share)  # exposed seconds per step
    rate0 = sent * 8 / 1e6 / want
    with _network(o, n, rate0) as net:
        compute0, exposed0, _ = run_workers(
            n,
            _calibrate_worker,
            o,
            namespaces=net.namespaces,
            workers_per_node=net.workers_per_node,
        )[0]
    hidden = max(0.0, sent * 8 / 1e6 / rate0 - exposed0)
    rate = sent * 8 / 1e6 / (hidden + want)
    msg = (
        f"calibrated link: {CALIBRATION_CONTENDER} sends {sent / 1e6:.2f} MB per rank and step "
        f"and computes {compute:.2f} s; at {rate0:.0f} Mbit/s its exposed communication was "
        f"{exposed0:.2f} s ({hidden:.2f} s hidden), so {rate:.0f} Mbit/s per "
        f"{'worker' if o.workers_per_node == 1 else 'node'} should "
        f"expose ~{o.comm_share:.0%} of its step"
    )
    return rate, msg


def ignored_under_torchrun(o: TrainOptions) -> str:
    """What the options ask that a torchrun launch cannot do (the launcher sets
    the workers and the network is the real one), as a sentence; "" if nothing."""
    changed = changed_options(o)
    flags = [
        f"--{name.replace('_', '-')} {getattr(o, name)}"
        for name in (
            "world_size",
            "nodes",
            "workers_per_node",
            "intra_rate_mbit",
            "rate_mbit",
            "mtu",
            "tcp_congestion",
            "comm_share",
            "time_limit",
        )
        if name in changed
    ]
    if not o.network:
        flags.append("--no-network")
    if not flags:
        return ""
    return (
        f"{', '.join(flags)} ignored under torchrun: the launcher starts and stops the "
        "workers, and the network is the real one, not an emulated link"
    )


def run(o: TrainOptions) -> str | None:
    """Run the job; return the report text (on rank 0; None on other torchrun ranks)."""
    from hopq.cluster.launch import init_from_env, launched_by_torchrun, run_workers
    from hopq.cluster.network import unavailable_reason

    contenders = o.resolved_codecs()
    folder = Path(o.out)
    if launched_by_torchrun():
        rank, n = init_from_env("gloo")  # the workloads train on the CPU
        note = ignored_under_torchrun(o)
        if note and rank == 0:
            print(f"warning: {note}", flush=True)
        runs = worker(rank, n, o, contenders)
        dist.destroy_process_group()
        if rank != 0:
            return None
        network = "the launcher's (torchrun)" + (f"; {note}" if note else "")
        flat = replace(o, nodes=0, workers_per_node=1, intra_rate_mbit=0.0)  # not ours to shape
        return report(runs, replace(flat, world_size=n, rate_mbit=0.0), network, folder)

    from hopq.train import workloads

    workloads.prepare(o.workload)  # once here, not once per worker
    n = o.world_size
    why = unavailable_reason() if o.network else "disabled (--no-network)"
    rate = o.rate_mbit
    if why is None and rate <= 0:
        rate, msg = _calibrate(o, n)
        print(msg, flush=True)
    if why is None:
        with _network(o, n, rate) as net:
            network = f"emulated, {net.describe()}"
            runs = run_workers(
                n,
                worker,
                o,
                contenders,
                timeout=o.time_limit or None,
                namespaces=net.namespaces,
                workers_per_node=net.workers_per_node,
            )[0]
        o = replace(o, rate_mbit=rate)  # the report's floor needs the link's rate
    else:
        print(f"no emulated network ({why}): running on plain loopback", flush=True)
        network = f"loopback ({why})"
        runs = run_workers(n, worker, o, contenders, timeout=o.time_limit or None)[0]
    text = report(runs, o, network, folder)
    print(f"\nreport written to {folder / 'report.md'}", flush=True)
    return text
