"""Per-coordinate thresholds |A| from an optimizer's state (paper Table 2, App. A).

For every optimizer of Table 2, delta (the rest of the update over the term
carrying g) is A / g with A independent of the current gradient g, except
Adam's v_t: like the paper we cannot know it before the all-reduce and use
beta2 * v_{t-1} (bias-corrected) in its place, an approximation that is not
guaranteed conservative. theta is theta_{t-1}; lambda the weight decay.

* SGD: A = theta (1 - eta lambda) / eta
* momentum mu, dampening tau: A = (theta - eta mu b) / (eta (1 - tau)) - lambda theta
* Nesterov: A = ((1 - eta lambda (1 + mu)) theta - eta mu^2 b) / (eta (1 + mu))
* Adam: A = [theta (1 - beta1^t)(sqrt(v^) + eps) - eta beta1 m] / (eta (1 - beta1)) - lambda theta
* AdamW: A = [theta (1 - eta lambda)(1 - beta1^t)(sqrt(v^) + eps) - eta beta1 m] / (eta (1 - beta1))

(t is the step being taken; before the first step torch's buffers are empty:
b = g' and m = v = 0.) Other optimizers are refused with their name.

A parameter held as a DTensor (FSDP2's sharded parameters, whose optimizer
state is sharded alike) gives the thresholds of this rank's local shard.
"""

from __future__ import annotations

from typing import Any

import torch


def thresholds(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> torch.Tensor:
    """|A| for ``params`` (flattened and concatenated in that order, float32)."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = []
    for p in params:
        g = group_of.get(id(p))
        if g is None:
            raise ValueError("gcomp: a parameter of the bucket is not in the optimizer")
        out.append(_one(optimizer, p, g).reshape(-1))
    if not out:
        return torch.zeros(0)
    return torch.cat(out).abs().to(torch.float32)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _one(opt: torch.optim.Optimizer, p: torch.Tensor, g: dict[str, Any]) -> torch.Tensor:
    th = _local(p.detach()).double()
    lr = float(g["lr"])
    lam = float(g.get("weight_decay", 0.0))
    st = {
        k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in opt.state.get(p, {}).items()
    }
    if isinstance(opt, torch.optim.SGD):
        mu, tau = float(g.get("momentum", 0.0)), float(g.get("dampening", 0.0))
        b = st.get("momentum_buffer")
        if mu == 0 or b is None:  # no momentum, or the first step (b = g')
            return th * (1 - lr * lam) / lr
        b = b.double()
        if g.get("nesterov", False):
            return ((1 - lr * lam * (1 + mu)) * th - lr * mu * mu * b) / (lr * (1 + mu))
        return (th - lr * mu * b) / (lr * (1 - tau)) - lam * th
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        b1, b2 = g["betas"]
        eps = float(g["eps"])
        step = st.get("step")
        t = int(step) + 1 if step is not None else 1
        m = st["exp_avg"].double() if "exp_avg" in st else torch.zeros_like(th)
        v = st["exp_avg_sq"].double() if "exp_avg_sq" in st else torch.zeros_like(th)
        vhat = (b2 * v) / (1 - b2**t)
        denom = (1 - b1**t) * (vhat.sqrt() + eps)
        decoupled = isinstance(opt, torch.optim.AdamW) or bool(g.get("decoupled_weight_decay"))
        if decoupled:
            return (th * (1 - lr * lam) * denom - lr * b1 * m) / (lr * (1 - b1))
        return (th * denom - lr * b1 * m) / (lr * (1 - b1)) - lam * th
    raise ValueError(
        f"gcomp: no truncation rule for {type(opt).__name__} (SGD, momentum, Nesterov, "
        "Adam and AdamW have one)"
    )


__all__ = ["thresholds"]
