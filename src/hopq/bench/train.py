"""``hopq train``: data-parallel training with hopq's DDP hook, one codec after another.

N Gloo worker processes on this machine (or the ranks of ``torchrun``) train a
small byte-level GPT on the standard library's source code. Every codec sees
the same initial weights and the same data order; per codec the job reports
the training loss, the held-out evaluation loss, the bytes each rank put on the
wire per step, and the time per step split into compute and all-reduce.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hopq.bench.data import batch, byte_split, stdlib_source
from hopq.bench.models import TinyGPT
from hopq.integrations.ddp import HookState, ddp_hook


@dataclass(frozen=True)
class TrainOptions:
    codecs: tuple[str, ...] = ("fp32", "bf16", "fp16")
    topology: str = "ring"
    world_size: int = 4
    steps: int = 150
    batch_size: int = 8
    context: int = 128
    dim: int = 128
    layers: int = 2
    lr: float = 3e-3
    eval_batches: int = 8
    log_every: int = 25
    seed: int = 0
    corpus_bytes: int = 4 << 20


@dataclass
class CodecRun:
    codec: str
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    comm_s: list[float] = field(default_factory=list)
    bytes_per_step: list[float] = field(default_factory=list)
    bits_per_coord: float = float("nan")
    eval_loss: float = float("nan")
    params: int = 0


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a (possibly DDP-wrapped) language model."""
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _evaluate(model: torch.nn.Module, tokens: torch.Tensor, o: TrainOptions) -> float:
    g = torch.Generator().manual_seed(12345)
    with torch.no_grad():
        losses = [
            loss_of(model, *batch(tokens, o.batch_size, o.context, g)).item()
            for _ in range(o.eval_batches)
        ]
    return sum(losses) / len(losses)


def worker(rank: int, n: int, o: TrainOptions) -> list[CodecRun]:
    train_tok, eval_tok = byte_split(stdlib_source(o.corpus_bytes))
    runs = []
    for codec in o.codecs:
        torch.manual_seed(o.seed)
        model = TinyGPT(dim=o.dim, layers=o.layers, context=o.context)
        ddp = DDP(model)
        state = HookState(codec=codec, topology=o.topology, seed=o.seed)
        ddp.register_comm_hook(state, ddp_hook)
        opt = torch.optim.AdamW(ddp.parameters(), lr=o.lr)
        g = torch.Generator().manual_seed(o.seed * 1000 + rank)  # same data order for every codec
        run = CodecRun(codec, params=sum(p.numel() for p in model.parameters()))
        for step in range(o.steps):
            x, y = batch(train_tok, o.batch_size, o.context, g)
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            logits = ddp(x)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
            )
            loss.backward()
            opt.step()
            run.step_s.append(time.perf_counter() - t0)
            calls = state.pop_stats()
            run.comm_s.append(sum(c.seconds for c in calls))
            run.bytes_per_step.append(sum(c.bytes_sent for c in calls))
            lt = torch.tensor([loss.item()])
            dist.all_reduce(lt)
            run.losses.append(lt.item() / n)
            if rank == 0 and (step % o.log_every == 0 or step == o.steps - 1):
                print(
                    f"[{codec}] step {step:4d}  loss {run.losses[-1]:.4f}  "
                    f"step {run.step_s[-1] * 1e3:6.1f} ms (all-reduce {run.comm_s[-1] * 1e3:6.1f} ms)  "
                    f"{run.bytes_per_step[-1] / 1e6:.3f} MB sent",
                    flush=True,
                )
        if n > 1:
            d = run.params
            run.bits_per_coord = (
                8 * sum(run.bytes_per_step) / len(run.bytes_per_step) / (2 * (n - 1) / n * d)
            )
        run.eval_loss = _evaluate(model, eval_tok, o)
        runs.append(run)
    return runs


def summarize(runs: list[CodecRun], o: TrainOptions) -> str:
    from hopq.bench.report import machine, markdown_table

    skip = min(5, o.steps // 4)  # warm-up steps left out of the timings
    rows = []
    for r in runs:
        st = r.step_s[skip:] or r.step_s
        cm = r.comm_s[skip:] or r.comm_s
        rows.append(
            [
                r.codec,
                f"{r.losses[-1]:.4f}",
                f"{r.eval_loss:.4f} (ppl {math.exp(r.eval_loss):.2f})",
                f"{sum(st) / len(st) * 1e3:.1f}",
                f"{sum(cm) / len(cm) * 1e3:.1f}",
                f"{sum(r.bytes_per_step) / len(r.bytes_per_step) / 1e6:.3f}",
                f"{r.bits_per_coord:.2f}",
            ]
        )
    head = (
        f"{o.world_size} Gloo workers, TinyGPT ({runs[0].params:,} parameters) on the stdlib sources, "
        f"{o.steps} steps, {o.topology} all-reduce; {machine()}\n\n"
    )
    return head + markdown_table(
        [
            "codec",
            "final train loss",
            "eval loss",
            "step (ms)",
            "all-reduce (ms)",
            "MB sent / rank / step",
            "bits / coord",
        ],
        rows,
    )


def run(o: TrainOptions) -> str | None:
    """Run the job; return the summary (on rank 0; None on other torchrun ranks)."""
    from hopq.bench.launch import init_from_env, launched_by_torchrun, run_workers

    if launched_by_torchrun():
        rank, n = init_from_env("gloo")  # the job's tensors live on the CPU
        runs = worker(rank, n, o)
        dist.destroy_process_group()
        return summarize(runs, o) if rank == 0 else None
    return summarize(run_workers(o.world_size, worker, o)[0], o)
