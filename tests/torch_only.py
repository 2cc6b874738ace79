"""Run with an environment that has torch and hopq only (``make test`` builds
one in .venv-torch): every codec through a 2-rank all-reduce and the DDP hook,
with none of the optional packages (numpy, numba, triton) importable.

Not a pytest module (pytest is not installed there): a plain script that exits 1
on the first failure."""

from __future__ import annotations

import importlib.util
import sys
import warnings


def rank_work(rank: int, n: int) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hopq

    out = {}
    for codec in hopq.available_codecs():
        x = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            hopq.all_reduce(x, codec=codec, topology="ring", seed=1)
        out[codec] = x
        out[f"{codec}/warnings"] = [str(m.message) for m in w]
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)
        )
        ddp = DDP(model)
        ddp.register_comm_hook(hopq.HookState(codec=codec), hopq.ddp_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(3):
            ddp(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out[f"{codec}/ddp"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return out


def main() -> int:
    for mod in ("numpy", "numba", "triton"):
        if importlib.util.find_spec(mod) is not None:
            print(
                f"torch_only: {mod} is installed here; this check needs an environment without it"
            )
            return 1
    import torch

    import hopq
    from hopq.cluster.launch import run_workers

    res = run_workers(2, rank_work)
    failures = []
    for codec in hopq.available_codecs():
        xs = [torch.randn(5000, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        sim = hopq.simulate(xs, codec, "ring", seed=1).outputs[0]
        if not (torch.equal(res[0][codec], sim) and torch.equal(res[1][codec], sim)):
            failures.append(f"{codec}: all_reduce differs from the simulator")
        if not torch.equal(res[0][f"{codec}/ddp"], res[1][f"{codec}/ddp"]):
            failures.append(f"{codec}: DDP replicas differ")
    warned = [w for w in res[0]["dynamiq/warnings"] if "hopq[cpu]" in w]
    if not warned:
        failures.append("dynamiq did not warn that it runs its reference without numba")
    for f in failures:
        print("torch_only: FAILED", f)
    if not failures:
        print(f"torch_only: every codec ({len(hopq.available_codecs())}) ran with torch alone")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
