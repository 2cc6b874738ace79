"""Start n worker processes on this machine, each in a Gloo process group.

Used by the benchmarks, the training job and the tests. Under ``torchrun``
(RANK, WORLD_SIZE and MASTER_ADDR in the environment) the same worker functions
join the launcher's process group instead (:func:`init_from_env`).
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

#: A rank that waits this long for a peer has lost it; short, so tests fail fast.
PG_TIMEOUT_S = 120


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (NCCL when CUDA is present)."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    return dist.get_rank(), dist.get_world_size()


def _entry(
    fn: Callable[..., Any],
    rank: int,
    n: int,
    tmp: str,
    threads: int,
    namespace: str | None,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(threads)
    try:
        if namespace is not None:  # before Gloo creates its sockets and threads
            from hopq.cluster.network import WORKER_IFACE, enter_namespace

            enter_namespace(namespace)
            os.environ["GLOO_SOCKET_IFNAME"] = WORKER_IFACE
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


def run_workers(
    n: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 3600,
    threads: int = 1,
    namespaces: list[str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, n, *args)`` in n spawned Gloo ranks (one fresh FileStore);
    return each rank's result. A failing rank's traceback is raised here. With
    ``namespaces`` (an :class:`~hopq.cluster.network.EmulatedNetwork`'s), rank i
    runs in namespace i and talks over the shaped links."""
    if namespaces is not None and len(namespaces) < n:
        raise ValueError(f"{n} ranks need {n} namespaces, got {len(namespaces)}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="hopq-") as tmp:
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, n, tmp, threads, namespaces[r] if namespaces else None, args),
            )
            for r in range(n)
        ]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(timeout)
        finally:
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
            raise RuntimeError(
                "\n".join(errors) or f"{len(alive)} ranks did not finish in {timeout} s"
            )
        return [torch.load(os.path.join(tmp, f"out{r}.pt"), weights_only=False) for r in range(n)]
