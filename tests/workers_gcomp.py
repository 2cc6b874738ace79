"""Worker bodies for the variable-size and GComp multi-process tests."""

from __future__ import annotations

from typing import Any

import torch

import hopq


def varsize_and_gcomp(rank: int, n: int) -> dict[Any, Any]:
    """Variable-size codecs (the test codec, and gcomp when registered) in real Gloo
    runs: outputs and bytes sent per (codec, topology, size)."""
    from tests.varsize_codec import VarBf16

    names = ["varbf16"] + (["gcomp"] if "gcomp" in hopq.available_codecs() else [])
    out: dict[Any, Any] = {}
    for name in names:
        for topo in ("ring", "butterfly"):
            for size in (0, 1, 7, 70001):
                g = torch.Generator().manual_seed(11 * rank + size)
                x = torch.randn(size, generator=g)
                codec = VarBf16() if name == "varbf16" else hopq.get_codec(name)
                info = hopq.all_reduce(x, codec=codec, topology=topo, seed=3)
                out[(name, topo, size)] = (x, info.bytes_sent)
    return out


def ddp_gcomp_adamw(rank: int, n: int, steps: int) -> dict[str, Any]:
    """TinyNet trained with AdamW through plain DDP, the fp32 hook and
    ``HookState(codec="gcomp", optimizer=opt)``: final parameters, losses and
    payload bytes per variant."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.workers import TinyNet

    out: dict[str, Any] = {}
    for name in (None, "fp32", "gcomp"):
        torch.manual_seed(0)
        model = TinyNet()
        ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets per step
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=1e-2)
        state = None
        if name is not None:
            state = hopq.HookState(
                codec=name, optimizer=opt if name == "gcomp" else None, overlap=True
            )
            ddp.register_comm_hook(state, hopq.ddp_hook)
        g = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(steps):
            x = torch.randn(32, 16, generator=g)
            y = torch.randn(32, 4, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        key = str(name)
        out[key] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[f"{key}/losses"] = losses
        if state is not None:
            calls = state.pop_stats()
            out[f"{key}/payload"] = sum(c.payload_bytes for c in calls)
            out[f"{key}/calls"] = len(calls)
            out[f"{key}/thresholds"] = sorted(getattr(state.codec, "thresholds", {}))
    return out


def gcomp_optimizer_warning(rank: int, n: int) -> dict[str, list[str]]:
    """The warnings of a DDP job's first steps with HookState("gcomp"): no
    optimizer ever, or one set on the state after it was built."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, list[str]] = {}
    for case in ("none", "later"):
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(32, 32))
        state = hopq.HookState("gcomp", overlap=False)
        model.register_comm_hook(state, hopq.ddp_hook)
        opt = torch.optim.AdamW(model.parameters())
        if case == "later":
            state.optimizer = opt
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(4, 32)).square().sum().backward()
                opt.step()
        out[case] = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
    return out


def ddp_dynamiq_adamw(rank: int, n: int, steps: int) -> dict[str, Any]:
    """TinyNet trained with AdamW through ``HookState(codec="dynamiq")`` without
    and with ``optimizer=opt`` (its step sizes weigh the allocation): final
    parameters, and the bits per coordinate of the calls of each variant."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.workers import TinyNet, tiny_steps

    out: dict[str, Any] = {}
    for with_opt in (False, True):
        torch.manual_seed(0)
        model = TinyNet()
        ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets per step
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        state = hopq.HookState(codec="dynamiq", optimizer=opt if with_opt else None)
        ddp.register_comm_hook(state, hopq.ddp_hook)
        tiny_steps(ddp, opt, rank, steps)
        key = "opt" if with_opt else "none"
        out[key] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        # the bits of DynamiQ's own calls (a bucket too small for it runs bf16)
        every = state.pop_stats()
        calls = [c for c in every if c.fallback is None]
        out[f"{key}/fallbacks"] = len(every) - len(calls)
        out[f"{key}/bits"] = (
            8 * sum(c.bytes_sent for c in calls) / sum(2 * (n - 1) / n * c.numel for c in calls)
        )
        out[f"{key}/pending"] = len(state.codec._step_sizes)  # type: ignore[attr-defined]
    return out
