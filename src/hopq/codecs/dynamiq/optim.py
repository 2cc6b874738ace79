"""The optimizer's step size per coordinate, for DynamiQ's allocation (beyond
the paper).

DynamiQ's allocation minimises the error of the averaged gradient (vNMSE). An
adaptive optimizer does not apply the gradient as it is: Adam moves coordinate
i by lr m_i / (sqrt(v_i) + eps), so an error e_i in the gradient moves the
parameter by about lr e_i / (sqrt(v_i) + eps). Coordinates whose gradients are
small relative to their own history (a small v_i) carry a large share of the
update while they hold little of the gradient's energy, which is where vNMSE
puts the fewest bits. Weighing each coordinate by its step size,

    r_i = lr / (sqrt(v_i / (1 - beta2^t)) + eps)   (Adam, AdamW, NAdam, RAdam; AMSGrad: max v)
    r_i = lr / (sqrt(square_avg_i) + eps)           (RMSprop; centered: minus grad_avg_i^2)
    r_i = clr / (sqrt(sum_i) + eps)                 (Adagrad, clr = lr / (1 + (t-1) lr_decay))
    r_i = lr                                        (SGD, with or without momentum)

makes the allocation minimise the error of the update instead. A super-group's
quantization error spreads over its entries through the group scales, whatever
each entry's own size, so the codec multiplies each super-group's energy by
the mean of r_i^2 over its entries (``DynamiQ.plan``; weighing each entry's
square by its own r_i^2 instead missed the quiet entries of loud groups and
trained worse: docs/codecs/dynamiq.md). Each rank sends its energies already
weighed, so the ranks allocate alike whatever their step sizes. v is the state
after the last step (the current gradient is not in it yet), as in GComp's
thresholds.
"""

from __future__ import annotations

from typing import Any

import torch

from hopq.numerics.div import div
from hopq.numerics.sqrt import sqrt_

#: The optimizers whose step size per coordinate ``step_sizes`` knows.
SUPPORTED = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
)


def check_optimizer(optimizer: Any) -> None:
    """Raise ValueError unless ``step_sizes`` has a rule for ``optimizer``."""
    if not isinstance(optimizer, SUPPORTED):
        names = ", ".join(c.__name__ for c in SUPPORTED)
        raise ValueError(
            f"dynamiq: no step-size rule for {type(optimizer).__name__} ({names} have one); "
            "pass no optimizer (the allocation then minimises the gradient's error) or "
            "optimizer_weights=False"
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _scale(opt: Any, group: dict[str, Any], st: dict[str, Any], out: torch.Tensor) -> bool:
    """r for one parameter into ``out`` (float32, flat, a pass or two over
    memory), or False when the optimizer holds no state for it yet."""
    lr = float(group["lr"])
    if isinstance(opt, torch.optim.SGD):
        out.fill_(lr)
        return True
    eps = float(group["eps"])

    def flat(name: str) -> torch.Tensor:
        return _local(st[name]).reshape(-1).float()  # float64 or bf16 state: float32

    if isinstance(opt, torch.optim.Adagrad):
        if "sum" not in st:
            return False
        lr /= 1 + (float(st["step"]) - 1) * float(group.get("lr_decay", 0.0))
        sqrt_(out.copy_(flat("sum")))
    elif isinstance(opt, torch.optim.RMSprop):
        if "square_avg" not in st:
            return False
        if group.get("centered") and "grad_avg" in st:
            torch.square(flat("grad_avg"), out=out)
            sqrt_(torch.sub(flat("square_avg"), out, out=out).clamp_(min=0))
        else:
            sqrt_(out.copy_(flat("square_avg")))
    else:  # the Adam family: v / (1 - beta2^t), bias-corrected; AMSGrad's max of v
        if "exp_avg_sq" not in st:
            return False
        v = "max_exp_avg_sq" if group.get("amsgrad") and "max_exp_avg_sq" in st else "exp_avg_sq"
        beta2 = float(group["betas"][1])
        sqrt_(div(flat(v), 1 - beta2 ** float(st["step"]), out=out))
    out.add_(eps).reciprocal_().mul_(lr)
    return True


def step_sizes(optimizer: Any, params: list[torch.Tensor]) -> torch.Tensor | None:
    """r per coordinate of ``params`` (flattened and concatenated in that order,
    float32), or None where it would not change the allocation: the optimizer
    holds state for none of them yet (Adam before its first step), or r is the
    same everywhere (SGD with one learning rate). Parameters without state among
    others with it (no gradient yet: an unused or newly unfrozen layer) take the
    mean r of the rest; an all-zero gradient is the zero class's whatever its r."""
    check_optimizer(optimizer)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    groups = []
    for p in params:
        g = group_of.get(id(p))
        if g is None:
            raise ValueError("dynamiq: a parameter of the bucket is not in the optimizer")
        groups.append(g)
    if not params or (
        isinstance(optimizer, torch.optim.SGD) and len({float(g["lr"]) for g in groups}) == 1
    ):
        return None
    locals_ = [_local(p.detach()) for p in params]
    out = torch.empty(
        sum(t.numel() for t in locals_), dtype=torch.float32, device=locals_[0].device
    )
    missing = []
    at = 0
    for p, t, g in zip(params, locals_, groups, strict=True):
        n = t.numel()
        if not _scale(optimizer, g, optimizer.state.get(p, {}), out[at : at + n]):
            missing.append((at, at + n))
        at += n
    if missing:
        have = torch.ones(out.numel(), dtype=torch.bool, device=out.device)
        for a, b in missing:
            have[a:b] = False
        if not bool(have.any()):
            return None
        mean = out[have].double().mean()
        for a, b in missing:
            out[a:b] = mean
    # eps = 0 with v = 0, or a state gone NaN: the largest step, not Inf (0 x Inf
    # would make an all-zero super-group's energy NaN)
    big = torch.finfo(torch.float32).max
    return out.nan_to_num_(nan=big, posinf=big)


__all__ = ["SUPPORTED", "check_optimizer", "step_sizes"]
