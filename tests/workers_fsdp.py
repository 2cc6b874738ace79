"""Worker bodies for the FSDP2 tests (imported by spawned Gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import hopq
from hopq.comm.collectives import parse_op

#: Every reduce-scatter this process ran through :class:`Capturing`, in order:
#: (key, input, output, op as hopq's (reduction, pre-multiplier)).
CAPTURED: list[tuple[int | None, torch.Tensor, torch.Tensor, Any]] = []


def _capturing_class() -> type:
    class Capturing(hopq.FSDPReduceScatter):
        """The real thing, keeping what went in and out (for the simulator)."""

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
            inp = input_tensor.detach().clone()
            out = super().__call__(output_tensor, input_tensor, group, op, async_op)
            CAPTURED.append((self.key, inp, output_tensor.detach().clone(), parse_op(op)))
            return out

    return Capturing


def build(
    n: int, widths: tuple[int, ...] = (40, 96, 72, 5), freeze_bias: bool = False
) -> torch.nn.Module:
    """A small MLP, every Linear its own FSDP module, on a CPU device mesh. The
    sizes are not multiples of 3: FSDP pads them for three ranks.
    ``freeze_bias``: the first layer's bias takes no gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    if freeze_bias:
        model[0].bias.requires_grad_(False)
    mesh = init_device_mesh("cpu", (n,))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(
    model: torch.nn.Module, rank: int, steps: int, comm: Any = None, widths=(40, 96, 72, 5)
) -> dict[str, Any]:
    """SGD steps on per-rank data; losses, per-step records and the full parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    losses, records = [], []
    for _ in range(steps):
        x = torch.randn(8, widths[0], generator=g)
        y = torch.randn(8, widths[-1], generator=g)
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if comm is not None:
            calls = list(comm.calls)
            records.append((calls, comm.pop_step()))  # pops the calls too
    full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "records": records, "params": full}


def fsdp_codecs(rank: int, n: int, runs: list[dict[str, Any]], steps: int) -> dict[Any, Any]:
    """Native FSDP, then one training per run ({codec, topology, divide, reduce_dtype})."""
    Capturing = _capturing_class()
    model = build(n)
    out: dict[Any, Any] = {
        "init": {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    }
    out["native"] = train(model, rank, steps)
    for i, run in enumerate(runs):
        model = build(n)
        if run.get("divide"):
            for m in model.modules():
                if hasattr(m, "set_gradient_divide_factor"):
                    m.set_gradient_divide_factor(run["divide"])
        if run.get("force_sum"):
            for m in model.modules():
                if hasattr(m, "set_force_sum_reduction_for_comms"):
                    m.set_force_sum_reduction_for_comms(True)
        comm = Capturing(run["codec"], run.get("topology", "ring"), seed=7)
        out[("installed", i)] = comm.install(model)
        del CAPTURED[:]
        res = train(model, rank, steps, comm)
        res["first"] = CAPTURED[0]
        res["ops"] = sorted({str(c[3]) for c in CAPTURED})
        res["keys"] = [c[0] for c in CAPTURED]
        # DynamiQ's per-key budget shares, split from the last finished step
        res["shares"] = dict(getattr(comm.codec, "_shares", {}))
        out[i] = res
    # the interface's async path hands back a completed work
    comm = hopq.FSDPReduceScatter("bf16")
    o = comm.allocate((3,), dtype=torch.float32, device=torch.device("cpu"))
    work = comm(o, torch.ones(3 * n), dist.group.WORLD, dist.ReduceOp.SUM, async_op=True)
    work.wait()
    out["async"] = o.clone()
    return out


def fsdp_gcomp_optimizer(rank: int, n: int, steps: int) -> dict[str, Any]:
    """AdamW under native FSDP, then GComp with and without the optimizer handed
    over (thresholds exchanged every 2 calls), and with a frozen bias and two
    micro-batches per step (thresholds every 8 calls): losses, parameters, bits
    per coordinate, and the thresholds the codec held for one key at the end."""
    widths = (40, 96, 72, 5)
    out: dict[str, Any] = {}
    for name, kwargs in (
        ("native", None),
        ("lossless", {}),
        ("optimizer", {"thresholds_every": 2}),
        ("frozen", {"thresholds_every": 8}),
    ):
        model = build(n, widths, freeze_bias=name == "frozen")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        comm = None
        if kwargs is not None:
            if name in ("optimizer", "frozen"):
                kwargs = {**kwargs, "optimizer": opt}
            comm = hopq.FSDPReduceScatter("gcomp", seed=7, **kwargs)
            comm.install(model)
        g = torch.Generator().manual_seed(100 + rank)
        losses, bits = [], []
        for _ in range(steps):
            x = torch.randn(8, widths[0], generator=g)
            y = torch.randn(8, widths[-1], generator=g)
            loss = (model(x) - y).square().mean()
            if name == "frozen":  # two micro-batches, FSDP reduce-scatters both
                (model(x[:4]) - y[:4]).square().mean().backward()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if comm is not None:
                bits.append(comm.pop_step().bits_per_coordinate)
        out[name] = {
            "losses": losses,
            "bits": bits,
            "params": {k: v.full_tensor().clone() for k, v in model.state_dict().items()},
        }
        if comm is not None:
            out[name]["thr"] = comm.codec.thresholds.get("1")
    return out


def _expected_weights(model: torch.nn.Module, opt: Any, n: int) -> dict[int, torch.Tensor]:
    """Per FSDP module key (as ``install`` numbers them): DynamiQ's super-group
    weights of a reduce-scatter, computed apart from hopq's FSDP code, from the
    full (gathered) optimizer state laid out as FSDP lays out its input: rank
    after rank, each parameter's dim-0 shard padded to ceil(rows / n) rows."""
    from torch.distributed.fsdp import FSDPModule

    from hopq.codecs.dynamiq import DynamiQ
    from hopq.numerics.div import div_
    from hopq.numerics.sqrt import sqrt_

    codec = DynamiQ()
    group = opt.param_groups[0]
    beta2, eps, lr = group["betas"][1], group["eps"], group["lr"]
    out: dict[int, torch.Tensor] = {}
    key = -1
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        key += 1
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(n)]
        masks: list[list[torch.Tensor]] = [[] for _ in range(n)]
        for p in own:
            st = opt.state[p]
            v = st["exp_avg_sq"].full_tensor().float()
            r = sqrt_(div_(v.clone().reshape(-1), 1 - beta2 ** float(st["step"])))
            r = r.add_(eps).reciprocal_().mul_(lr).view(v.shape)
            rows = -(-v.shape[0] // n)
            for q in range(n):
                part = r[q * rows : (q + 1) * rows].reshape(-1)
                size = rows * (r[0].numel() if r.dim() > 1 else 1)
                pad = size - part.numel()
                per_rank[q].append(torch.cat([part, part.new_zeros(pad)]))
                masks[q].append(torch.cat([torch.ones(part.numel()), torch.zeros(pad)]))
        out[key] = torch.cat(
            [
                codec.supergroup_weights(torch.cat(per_rank[q]), torch.cat(masks[q]))
                for q in range(n)
            ]
        )
    return out


def fsdp_dynamiq_optimizer(rank: int, n: int, steps: int) -> dict[str, Any]:
    """DynamiQ with AdamW's step sizes under FSDP (``optimizer=``): the weights
    each call received with a snapshot of the codec as the call began, the
    weights expected from the gathered state, the captured calls, losses,
    parameters; then the same training without the optimizer handed over."""
    import copy

    widths = (40, 96, 72, 5)
    Capturing = _capturing_class()
    out: dict[str, Any] = {}
    for name in ("native", "weighed", "plain"):
        model = build(n, widths)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        comm = None
        got: list[tuple[int | None, torch.Tensor, Any]] = []
        if name != "native":
            comm = Capturing("dynamiq", seed=7, optimizer=opt if name == "weighed" else None)
            comm.install(model)
            codec = comm.codec
            real_set = codec.set_supergroup_weights  # type: ignore[attr-defined]

            def spy(w, key=None, spent_bits=0.0, *, _set=real_set, _codec=codec, _got=got):  # type: ignore[no-untyped-def]
                _set(w, key, spent_bits)
                snap = copy.deepcopy(_codec)
                del snap.set_supergroup_weights  # the spy: back to the method
                _got.append((key, w.detach().clone(), snap, spent_bits))

            codec.set_supergroup_weights = spy  # type: ignore[attr-defined]
        del CAPTURED[:]
        g = torch.Generator().manual_seed(100 + rank)
        losses, bits, expected = [], [], []
        for step in range(steps):
            x = torch.randn(8, widths[0], generator=g)
            y = torch.randn(8, widths[-1], generator=g)
            expected.append(_expected_weights(model, opt, n) if step and comm else {})
            loss = (model(x) - y).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if comm is not None:
                bits.append(comm.pop_step().bits_per_coordinate)
        out[name] = {
            "losses": losses,
            "bits": bits,
            "params": {k: v.full_tensor().clone() for k, v in model.state_dict().items()},
            "got": got,
            "expected": expected,
            "captured": list(CAPTURED),
        }
    return out
