"""Training quality with a codec in the loop, in one process: the benchmarks
that ask "what does this codec do to the loss" (Global-QSGD's Table 4, GComp's
section 7.6) without a network.

A workload (:mod:`hopq.train.workloads`) trains ``steps`` steps; each step
``workers`` simulated workers compute the gradient of their own micro-batch
(the same micro-batches for every method of a seed), the gradients are
all-reduced (averaged) by the codec in :func:`hopq.simulate` on ``topology``,
exactly as ranks would, and the result is what the optimizer applies. ``None``
as the codec is the exact float32 average. Two variants serve GComp's
comparisons: ``thresholds`` (the optimizer's per-coordinate thresholds set on
the codec before each step, as ``HookState(optimizer=...)`` does) and
``sync_every`` (no all-reduce: each worker steps on its own gradient and the
workers' parameters are averaged every ``sync_every`` steps).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hopq.codecs.base import Codec
from hopq.codecs.registry import get_codec
from hopq.sim import simulate

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class SimTraining:
    """What is trained, and how (everything but the codec)."""

    workload: str = "gpt"
    optimizer: str = "adamw"
    steps: int = 50
    workers: int = 4
    batch: int = 4
    seed: int = 0
    topology: str = "ring"
    sgd_lr: float = 0.01
    #: AdamW's learning rate; 0: the workload's default.
    adamw_lr: float = 0.0
    gpt_dim: int = 256
    gpt_layers: int = 4
    context: int = 128
    #: Held-out batches evaluated after the last step (0: none).
    held_out: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose from {OPTIMIZERS}")
        for name in ("steps", "workers", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


@dataclass
class Curve:
    #: Training loss per step (mean over the workers' micro-batches).
    losses: list[float]
    #: Mean loss on the held-out batches after the last step (NaN: not measured).
    held_out: float
    #: Measured bits per coordinate of the all-reduces (NaN: exact or periodic).
    bits: float
    seconds: float


def set_grad(params: list[torch.Tensor], g: torch.Tensor) -> None:
    """Hand the flat gradient ``g`` (``workloads.flat_grad``'s layout) back to ``params``."""
    off = 0
    for p in params:
        p.grad = g[off : off + p.numel()].view_as(p).clone()
        off += p.numel()


def train(
    cfg: SimTraining,
    codec: Codec[Any] | str | None,
    *,
    thresholds: bool = False,
    sync_every: int = 0,
    say: Callable[[str], None] | None = None,
    label: str = "",
) -> Curve:
    """Train ``cfg`` with ``codec`` in the loop (see the module's docstring)."""
    from hopq.train import workloads

    kw = (
        {"dim": cfg.gpt_dim, "layers": cfg.gpt_layers, "context": cfg.context}
        if cfg.workload == "gpt"
        else {"context": cfg.context}
    )
    wl = workloads.make(cfg.workload, cfg.seed, **kw)
    local = sync_every > 0
    if local and codec is not None:
        raise ValueError("periodic synchronization (sync_every) runs without a codec")
    inst = None if codec is None else get_codec(codec)
    if thresholds and not hasattr(inst, "set_thresholds"):
        raise ValueError("thresholds need an optimizer-aware codec (GComp)")
    models = [copy.deepcopy(wl.model) for _ in range(cfg.workers)] if local else [wl.model]
    plist: list[list[torch.Tensor]] = [
        [p for p in m.parameters() if p.requires_grad] for m in models
    ]
    lr = cfg.adamw_lr or wl.lr
    opts: list[torch.optim.Optimizer] = [
        torch.optim.SGD(ps, lr=cfg.sgd_lr, momentum=0.9)
        if cfg.optimizer == "sgd"
        else torch.optim.AdamW(ps, lr=lr)
        for ps in plist
    ]
    losses: list[float] = []
    bits: list[float] = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        grads, step_losses = [], []
        for r in range(cfg.workers):
            i = r if local else 0
            models[i].zero_grad()
            loss = wl.loss(models[i], wl.batch(cfg.seed, r, step, cfg.batch))
            loss.backward()
            step_losses.append(loss.item())
            grads.append(workloads.flat_grad(models[i]))
        losses.append(sum(step_losses) / len(step_losses))
        if local:
            for ps, g, opt in zip(plist, grads, opts, strict=True):
                set_grad(ps, g)
                opt.step()
            if (step + 1) % sync_every == 0:
                with torch.no_grad():
                    for group in zip(*plist, strict=True):
                        mean = torch.stack([p.detach() for p in group]).mean(0)
                        for p in group:
                            p.copy_(mean)
        else:
            if inst is None:
                g = torch.stack(grads).mean(0)
            else:
                if thresholds:
                    from hopq.codecs.gcomp.optim import thresholds as opt_thresholds

                    inst.set_thresholds(opt_thresholds(opts[0], plist[0]))  # type: ignore[attr-defined]
                res = simulate(grads, inst, cfg.topology, seed=cfg.seed * 7919 + step, op="avg")
                g = res.outputs[0]
                bits.append(res.bits_per_coord)
            set_grad(plist[0], g)
            opts[0].step()
        if say is not None and (step % 10 == 0 or step == cfg.steps - 1):
            say(
                f"  {label or cfg.workload} step {step}: loss {losses[-1]:.4f}, "
                f"{time.perf_counter() - t0:.0f} s"
            )
    held = float("nan")
    if cfg.held_out:
        m = models[0]
        m.eval()
        with torch.no_grad():
            vals = [float(wl.loss(m, b)) for b in wl.held_out(cfg.held_out, cfg.batch * 2)]
        m.train()
        held = sum(vals) / len(vals)
    return Curve(
        losses,
        held,
        sum(bits) / len(bits) if bits else math.nan,
        time.perf_counter() - t0,
    )
