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

from hopq.numerics.sqrt import sqrt_


def thresholds(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> torch.Tensor:
    """|A| for ``params`` (flattened and concatenated in that order, float32).

    Computed in float32 (float64 for float64 parameters), in place in the output
    with the scalar factors folded: a few passes over memory per coordinate, so
    that MiniLM's 22.7M coordinates cost 0.14 s per step on one core with AdamW
    (``hopq bench gcomp --parts sizes`` reports it) rather than the 0.93 s of a
    float64 evaluation with temporaries. The result is float32 either way.
    Where A's two terms nearly cancel, float32 moves it by up to 1e-2 relative
    (elsewhere not at all: the median difference is 0)."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    locals_ = [_local(p.detach()) for p in params]
    if not locals_:
        return torch.zeros(0)
    wide = any(t.dtype == torch.float64 for t in locals_)
    dtype = torch.float64 if wide else torch.float32
    out = torch.empty(sum(t.numel() for t in locals_), dtype=dtype, device=locals_[0].device)
    at = 0
    for p, th in zip(params, locals_, strict=True):
        g = group_of.get(id(p))
        if g is None:
            raise ValueError("gcomp: a parameter of the bucket is not in the optimizer")
        n = th.numel()
        _one(optimizer, p, g, th.reshape(-1).to(dtype), out[at : at + n])
        at += n
    return out.abs_().to(torch.float32)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _one(
    opt: torch.optim.Optimizer,
    p: torch.Tensor,
    g: dict[str, Any],
    th: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """A (signed) for one parameter ``p`` whose flat values are ``th``, into ``out``."""
    lr = float(g["lr"])
    lam = float(g.get("weight_decay", 0.0))
    st = {
        k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in opt.state.get(p, {}).items()
    }

    def flat(name: str) -> torch.Tensor:
        return st[name].reshape(-1).to(out.dtype)

    if isinstance(opt, torch.optim.SGD):
        mu, tau = float(g.get("momentum", 0.0)), float(g.get("dampening", 0.0))
        if mu == 0 or st.get("momentum_buffer") is None:  # no momentum, or step 1 (b = g')
            torch.mul(th, (1 - lr * lam) / lr, out=out)
        elif g.get("nesterov", False):
            # ((1 - eta lambda (1 + mu)) theta - eta mu^2 b) / (eta (1 + mu))
            torch.mul(th, (1 - lr * lam * (1 + mu)) / (lr * (1 + mu)), out=out)
            out.add_(flat("momentum_buffer"), alpha=-mu * mu / (1 + mu))
        else:  # (theta - eta mu b) / (eta (1 - tau)) - lambda theta
            torch.mul(th, 1 / (lr * (1 - tau)) - lam, out=out)
            out.add_(flat("momentum_buffer"), alpha=-mu / (1 - tau))
        return
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        b1, b2 = g["betas"]
        eps = float(g["eps"])
        step = st.get("step")
        t = int(step) + 1 if step is not None else 1
        # (1 - beta1^t)(sqrt(v^) + eps), v^ = beta2 v / (1 - beta2^t); v = 0 before the first step
        if "exp_avg_sq" in st:
            torch.mul(flat("exp_avg_sq"), b2 / (1 - b2**t), out=out)
            sqrt_(out).add_(eps)  # correctly rounded: a GPU gives the same bits
        else:
            out.fill_(eps)
        decoupled = isinstance(opt, torch.optim.AdamW) or bool(g.get("decoupled_weight_decay"))
        keep = 1 - lr * lam if decoupled else 1.0
        out.mul_(th).mul_(keep * (1 - b1**t) / (lr * (1 - b1)))
        if "exp_avg" in st:  # - eta beta1 m / (eta (1 - beta1))
            out.add_(flat("exp_avg"), alpha=-b1 / (1 - b1))
        if not decoupled:
            out.add_(th, alpha=-lam)
        return
    check_rule(opt)


def check_rule(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless Table 2 has a truncation rule for ``optimizer``
    (so that a hook refuses it at construction, not at its first bucket)."""
    if not isinstance(optimizer, torch.optim.SGD | torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(
            f"gcomp: no truncation rule for {type(optimizer).__name__} (SGD, momentum, "
            "Nesterov, Adam and AdamW have one)"
        )


__all__ = ["check_rule", "thresholds"]
