"""``hopq train``: data-parallel training with compressed gradient sync on an
emulated cluster network, and a time-to-accuracy report (the DynamiQ paper's
section 5: Figures 4-6 and 18).

N Gloo worker processes (default 4), launched here or by ``torchrun``, train one
workload once per codec, with the same initial weights, data order and seeds:

* ``gpt`` (default, quick): a byte-level GPT trained from scratch on the
  standard library's sources;
* ``minilm``: all-MiniLM-L6-v2 fine-tuned as a masked language model on the
  standard library's docstrings (``pip install 'hopq[bench]'``).

The workers talk over an emulated network (namespaces and ``tc tbf``, see
:mod:`hopq.cluster.network`) whose per-worker rate is, unless given, calibrated so
that bf16's communication is ``comm_share`` of its step. Per step the job
records the loss, the time split into compute, compression (codec work) and
exposed communication (time waiting on the network), the bytes sent, and every
``vnmse_every`` steps the vNMSE of the compressed all-reduce against an exact
one on the same gradients; every ``eval_every`` steps the held-out loss. The
report folder holds report.md and PNG plots.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hopq.codecs.registry import codec_choices, resolve_codecs
from hopq.comm.engine import bits_per_coordinate
from hopq.comm.topology import TOPOLOGIES
from hopq.integrations.ddp import HookState, ddp_hook
from hopq.options import option
from hopq.reporting import Progress
from hopq.train.report import CodecRun, StepRecord, report, steady
from hopq.train.workloads import WORKLOADS, Workload


@dataclass(frozen=True)
class TrainOptions:
    workload: str = option("gpt", "what to train", choices=tuple(WORKLOADS))
    codecs: tuple[str, ...] = option(
        ("auto",),
        "codecs to run, one after another; auto: bf16, dynamiq and every other "
        "registered codec except fp32 and fp16; all: every codec",
        choices=codec_choices,
    )
    topology: str = option("ring", "all-reduce schedule", choices=tuple(TOPOLOGIES))
    world_size: int = option(4, "worker processes (ignored under torchrun)")
    #: 60 steps x 7 codecs: about 10 minutes of training (14 in all, with the link
    #: calibration and the evaluations) on 2 cores with the default GPT.
    steps: int = option(60, "training steps per codec")
    batch_size: int = option(8, "sequences per worker and step")
    lr: float = option(0.0, "learning rate; 0: the workload's own (gpt 1e-3, minilm 1e-4)")
    eval_every: int = option(20, "steps between held-out evaluations")
    eval_batches: int = option(8, "held-out batches per evaluation")
    vnmse_every: int = option(
        10, "steps between measurements of the compression error (vNMSE); 0: never"
    )
    rate_mbit: float = option(
        0.0, "per-worker link rate of the emulated network in Mbit/s; 0: calibrate it"
    )
    comm_share: float = option(
        0.4, "when calibrating: the share of bf16's step its communication should take"
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
        for name in ("world_size", "steps", "batch_size", "eval_every", "eval_batches", "context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vnmse_every < 0 or self.rate_mbit < 0 or self.lr < 0:
            raise ValueError("vnmse_every, rate_mbit and lr must be >= 0")
        if not 0 < self.comm_share < 1:
            raise ValueError(f"comm_share must be in (0, 1), got {self.comm_share}")
        codecs = self.resolved_codecs()  # unknown names fail here, before anything runs
        for codec, name, _value in self.codec_options:
            if codec not in codecs:
                raise ValueError(
                    f"codec option {codec}.{name}: {codec!r} is not among the codecs run"
                )
        for c in codecs:  # bad options fail here too
            self.codec_config(c)

    def resolved_codecs(self) -> list[str]:
        return resolve_codecs(self.codecs)

    def codec_config(self, codec: str) -> dict[str, Any]:
        """The options given for ``codec``, validated by building it once."""
        from hopq.codecs.registry import get_codec

        kw = {name: value for c, name, value in self.codec_options if c == codec}
        get_codec(codec, **kw)
        return kw


def make_workload(o: TrainOptions) -> Workload:
    from hopq.train import workloads

    kw = {"context": o.context}
    if o.workload == "gpt":
        kw |= {"dim": o.gpt_dim, "layers": o.gpt_layers}
    return workloads.make(o.workload, o.seed, **kw)


# -- one codec's run on one rank -----------------------------------------------
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


def worker(rank: int, n: int, o: TrainOptions, codec: str) -> CodecRun:
    torch.manual_seed(o.seed)
    w = make_workload(o)
    held = w.held_out(o.eval_batches, o.batch_size)
    model = w.model
    ddp = DDP(model)
    state = HookState(codec=codec, topology=o.topology, seed=o.seed, **o.codec_config(codec))
    ddp.register_comm_hook(state, ddp_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=o.lr or w.lr)
    run = CodecRun(codec, params=sum(p.numel() for p in model.parameters()))
    clock = 0.0
    bar = Progress(codec, o.steps) if rank == 0 else None
    run.evals.append((0.0, _evaluate(model, w, held, rank, n)))
    for step in range(o.steps):
        b = w.batch(o.seed, rank, step, o.batch_size)
        state.measure_error = o.vnmse_every > 0 and step % o.vnmse_every == 0
        dist.barrier()
        t0 = time.perf_counter()
        loss = w.loss(ddp, b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        vnmse, exact_s = state.pop_error()
        calls = state.pop_stats()
        step_s = elapsed - exact_s  # the reference all-reduce is not part of training
        comm = sum(c.comm_seconds for c in calls)
        codec_s = sum(c.seconds - c.comm_seconds for c in calls)
        sent = sum(c.bytes_sent for c in calls)
        bits = bits_per_coordinate(sent, n, sum(c.numel for c in calls))
        lt = torch.tensor([float(loss.detach())], dtype=torch.float64)
        dist.all_reduce(lt)
        clock += step_s
        run.steps.append(
            StepRecord(
                step,
                float(lt) / n,
                step_s,
                step_s - comm - codec_s,
                codec_s,
                comm,
                sent,
                bits,
                vnmse,
            )
        )
        if (step + 1) % o.eval_every == 0 or step == o.steps - 1:
            run.evals.append((clock, _evaluate(model, w, held, rank, n)))
        if bar is not None:
            bar.update(f"loss {run.steps[-1].loss:.3f}  eval {run.evals[-1][1]:.3f}")
    if bar is not None:
        bar.close()
    return run


def _calibrate_worker(rank: int, n: int, o: TrainOptions) -> tuple[float, float]:
    """bf16 on loopback for a few steps: (compute seconds per step, bytes per rank per step)."""
    short = TrainOptions(**{**asdict(o), "steps": 4, "eval_every": 1 << 30, "vnmse_every": 0})
    run = worker(rank, n, short, "bf16")
    compute = steady(run, "compute_s") + steady(run, "codec_s")
    sent = steady(run, "bytes")
    t = torch.tensor([compute, sent], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


# -- the job --------------------------------------------------------------------
def run(o: TrainOptions) -> str | None:
    """Run the job; return the report text (on rank 0; None on other torchrun ranks)."""
    from hopq.cluster.launch import init_from_env, launched_by_torchrun, run_workers
    from hopq.cluster.network import EmulatedNetwork, unavailable_reason

    codecs = o.resolved_codecs()
    folder = Path(o.out)
    if launched_by_torchrun():
        rank, n = init_from_env()
        runs = [worker(rank, n, o, c) for c in codecs]
        dist.destroy_process_group()
        return report(runs, o, "the launcher's (torchrun)", folder) if rank == 0 else None

    n = o.world_size
    why = unavailable_reason() if o.network else "disabled (--no-network)"
    rate = o.rate_mbit
    if why is None and rate <= 0:
        compute, sent = run_workers(n, _calibrate_worker, o)[0]
        # exposed comm = bytes / rate should be comm_share of (compute + comm)
        rate = sent * 8 / 1e6 / (compute * o.comm_share / (1 - o.comm_share))
        print(
            f"calibrated link: bf16 sends {sent / 1e6:.2f} MB per step and computes {compute:.2f} s; "
            f"{rate:.0f} Mbit/s per worker gives it ~{o.comm_share:.0%} communication",
            flush=True,
        )
    runs = []
    if why is None:
        with EmulatedNetwork(n, rate_mbit=rate) as net:
            network = f"emulated, {rate:.0f} Mbit/s per worker (tc tbf)"
            for c in codecs:
                runs.append(run_workers(n, worker, o, c, namespaces=net.namespaces)[0])
    else:
        print(f"no emulated network ({why}): running on plain loopback", flush=True)
        network = f"loopback ({why})"
        for c in codecs:
            runs.append(run_workers(n, worker, o, c)[0])
    text = report(runs, o, network, folder)
    print(f"\nreport written to {folder / 'report.md'}", flush=True)
    return text
