"""Spawn n Gloo ranks on this machine and collect what each returns.

One fresh FileStore per call, a short process-group timeout, one torch thread
per rank (DESIGN.md, "Tests"). Worker functions live at module level so that
the spawned processes can import them.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT_S = 60


def _entry(fn: Callable[..., Any], rank: int, n: int, tmp: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), n)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=n,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        out = fn(rank, n, *args)
        dist.barrier()
        dist.destroy_process_group()
        torch.save(out, os.path.join(tmp, f"out{rank}.pt"))
    except BaseException:
        with open(os.path.join(tmp, f"err{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(n: int, fn: Callable[..., Any], *args: Any, timeout: float = 240) -> list[Any]:
    """Run ``fn(rank, n, *args)`` on n Gloo ranks; return the per-rank results."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_entry, args=(fn, r, n, tmp, args)) for r in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        errors = []
        for r in range(n):
            path = os.path.join(tmp, f"err{r}.txt")
            if os.path.exists(path):
                with open(path) as f:
                    errors.append(f"rank {r}:\n{f.read()}")
        if errors or alive:
            raise AssertionError("\n".join(errors) or f"{len(alive)} ranks timed out")
        return [torch.load(os.path.join(tmp, f"out{r}.pt"), weights_only=False) for r in range(n)]
