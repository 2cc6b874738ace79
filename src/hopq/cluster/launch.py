"""Start n worker processes on this machine, each in a Gloo process group.

Used by the benchmarks, the training job and the tests. Under ``torchrun``
(RANK, WORLD_SIZE and MASTER_ADDR in the environment) the same worker functions
join the launcher's process group instead (:func:`init_from_env`).

The ranks start from a fork server (:mod:`multiprocessing`'s ``forkserver``
start method): a fresh process, started once per launching process, that
imports :data:`PRELOAD` and nothing else, and forks a rank for each start. A
rank begins with torch and hopq imported instead of importing them (about
1.7 s of CPU each, which four ranks on two cores pay twice over), and inherits
nothing else from the fork server: it takes the launcher's environment as it
is when the ranks start, and imports the worker function's module itself, as a
spawned process does.

Each rank calls ``setsid()`` first, as torchrun starts its workers
(``start_new_session``), and so has a scheduling group of its own where Linux
groups processes that way (autogroup, ``/proc/sys/kernel/sched_autogroup_enabled``):
ranks in one group would share one group's CPU share and wait longer for a
core each time a message wakes one; with more ranks than cores, hopq's small
calls took far longer here than under torchrun (``docs/bench/allreduce.md``,
"Method").
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import faulthandler
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import forkserver
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: A rank that waits this long for a peer has lost it; short, so tests fail fast.
PG_TIMEOUT_S = 120
#: What the fork server imports once for every rank it starts. Importing them
#: starts no thread and touches no device, so forking after it is safe.
PRELOAD = ("torch", "torch.distributed", "hopq")


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


def layout_env(rank: int, n: int, workers_per_node: int) -> dict[str, str]:
    """The variables torchrun gives worker ``rank`` of ``n`` when each node runs
    ``workers_per_node`` of them (rank = node x workers_per_node + local rank):
    what :mod:`hopq.comm`'s layout detection reads (LOCAL_WORLD_SIZE, GROUP_RANK)
    and the rest of torchrun's set (RANK, WORLD_SIZE, LOCAL_RANK,
    GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE). No MASTER_ADDR:
    :func:`launched_by_torchrun` stays false for the spawned ranks."""
    if workers_per_node < 1 or n % workers_per_node:
        raise ValueError(f"workers_per_node must divide {n}, got {workers_per_node}")
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(n),
        "LOCAL_RANK": str(rank % workers_per_node),
        "LOCAL_WORLD_SIZE": str(workers_per_node),
        "GROUP_RANK": str(rank // workers_per_node),
        "GROUP_WORLD_SIZE": str(n // workers_per_node),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(n),
    }


@dataclass
class RankOutcome:
    """How one spawned rank ended."""

    rank: int
    #: The process's exit code (negative: killed by that signal; None: still
    #: running when the launcher gave up and killed it).
    exitcode: int | None
    #: What the worker function returned (None if it did not return).
    result: Any = None
    #: The traceback of the exception it raised, if any.
    error: str | None = None
    #: How far it got: "started", "returned" (its function returned, the
    #: teardown did not finish) or "torn down" (barrier and group destroyed).
    reached: str = "started"
    #: For a rank killed by a signal (SIGABRT, SIGSEGV...): the Python stacks of
    #: its threads at that moment, as :mod:`faulthandler` wrote them.
    fault: str | None = None


def _die_with(launcher: int) -> None:
    """Linux: this worker is killed when the launching process dies, however it
    dies (SIGKILL included), rather than waiting on its peers until the group's
    timeout, with its cores busy. Its parent is the fork server, which exits as
    soon as the launcher is gone (its end of a pipe closes)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    # multiprocessing hands every forked process a copy of the pipe whose other
    # end the server watches: the server would outlive the launcher for as long
    # as a rank held it, and the rank would live on with the server
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]
    try:  # the launcher died before that took effect
        os.kill(launcher, 0)
    except ProcessLookupError:
        os._exit(1)
    except PermissionError:  # alive, under another user
        pass


def _context() -> Any:
    """The fork server's context (:data:`PRELOAD` imported once); where the
    platform has no fork server (Windows), fresh interpreters."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _entry(
    fn: Callable[..., Any],
    rank: int,
    n: int,
    tmp: str,
    threads: int,
    namespace: str | None,
    args: tuple[Any, ...],
    pg_timeout: float,
    clean_exit: bool,
    launcher: int,
    env: dict[str, str],
    workers_per_node: int | None = None,
) -> None:
    _die_with(launcher)
    with contextlib.suppress(OSError):  # its own scheduling group, as under torchrun
        os.setsid()
    # the launcher's environment now, not the fork server's from its start
    os.environ.clear()
    os.environ.update(env)
    if workers_per_node is not None:  # before anything reads the layout
        os.environ.update(layout_env(rank, n, workers_per_node))
    torch.set_num_threads(threads)
    # a crash, even one at interpreter exit, leaves every thread's Python stack
    # here (the file stays open until the process ends)
    faulthandler.enable(open(os.path.join(tmp, f"fault{rank}.txt"), "w"), all_threads=True)  # noqa: SIM115
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
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        out = fn(rank, n, *args)
        torch.save(out, os.path.join(tmp, f"out{rank}.pt"))
        if clean_exit:
            dist.barrier()
            dist.destroy_process_group()
            open(os.path.join(tmp, f"gone{rank}"), "w").close()
    except BaseException:
        with open(os.path.join(tmp, f"err{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        if clean_exit:
            raise
    finally:
        if clean_exit:  # a forked process ends without the interpreter's exit
            # handlers (hopq's, the worker's): they run here, as a script's would
            atexit._run_exitfuncs()
    if not clean_exit:  # the group may be broken (fault tests): leave at once
        sys.stdout.flush()
        os._exit(0)


def spawn(
    n: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float | None = 3600,
    threads: int = 1,
    namespaces: list[str] | None = None,
    pg_timeout: float = PG_TIMEOUT_S,
    clean_exit: bool = True,
    workers_per_node: int | None = None,
) -> list[RankOutcome]:
    """Run ``fn(rank, n, *args)`` in n Gloo ranks started by the fork server (one
    fresh FileStore) and report how each ended, whatever happened (the fault
    tests kill ranks on purpose). ``timeout``: seconds to wait for all ranks
    before killing the rest (None: no limit; a rank that loses a peer still
    fails within ``pg_timeout``).
    ``clean_exit=False``: ranks leave right after their function returns or
    raises, without the final barrier (for groups a fault has broken).
    ``workers_per_node``: each rank gets torchrun's layout variables for nodes of
    that many workers (:func:`layout_env`); None: none are set."""
    if namespaces is not None and len(namespaces) < n:
        raise ValueError(f"{n} ranks need {n} namespaces, got {len(namespaces)}")
    if workers_per_node is not None:
        layout_env(0, n, workers_per_node)  # refuse a bad layout before spawning
    ctx = _context()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="hopq-") as tmp:
        procs = [
            ctx.Process(
                target=_entry,
                args=(
                    fn,
                    r,
                    n,
                    tmp,
                    threads,
                    namespaces[r] if namespaces else None,
                    args,
                    pg_timeout,
                    clean_exit,
                    os.getpid(),
                    env,
                    workers_per_node,
                ),
            )  # fmt: skip
            for r in range(n)
        ]

        def on_term(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)  # unwinds through the kill below

        try:  # SIGTERM (a scheduler, timeout, kill) kills the ranks too
            old_term = signal.signal(signal.SIGTERM, on_term)
        except ValueError:  # not the main thread: the ranks still die with this process
            old_term = None
        end = time.monotonic() + timeout if timeout is not None else None
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(None if end is None else max(0.0, end - time.monotonic()))
        finally:
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        outcomes = []
        for r, p in enumerate(procs):
            code = p.exitcode
            if code == -9 and end is not None and time.monotonic() >= end:
                code = None  # killed by us: it hung
            out = RankOutcome(r, code)
            err = os.path.join(tmp, f"err{r}.txt")
            if os.path.exists(err):
                with open(err) as f:
                    out.error = f.read()
            res = os.path.join(tmp, f"out{r}.pt")
            if os.path.exists(res):
                out.result = torch.load(res, weights_only=False)
                out.reached = "returned"
            if os.path.exists(os.path.join(tmp, f"gone{r}")):
                out.reached = "torn down"
            fault = os.path.join(tmp, f"fault{r}.txt")
            if code is not None and code < 0 and os.path.exists(fault):
                with open(fault) as f:
                    out.fault = f.read().strip() or None
            outcomes.append(out)
        return outcomes


def _stage(o: RankOutcome) -> str:
    return {
        "started": "before its function returned",
        "returned": "after its function returned, in the final barrier or teardown",
        "torn down": "after the process group was destroyed, at interpreter exit",
    }[o.reached]


def run_workers(
    n: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float | None = 3600,
    threads: int = 1,
    namespaces: list[str] | None = None,
    workers_per_node: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, n, *args)`` in n Gloo ranks (:func:`spawn`; one fresh FileStore);
    return each rank's result. A failing rank's traceback is raised here. With
    ``namespaces`` (an :class:`~hopq.cluster.network.EmulatedNetwork`'s), rank i
    runs in namespace i and talks over the shaped links; with ``workers_per_node``
    (the network's), each rank also gets torchrun's layout variables
    (:func:`layout_env`), so that it knows which ranks share its node."""
    outcomes = spawn(
        n,
        fn,
        *args,
        timeout=timeout,
        threads=threads,
        namespaces=namespaces,
        workers_per_node=workers_per_node,
    )
    errors = [f"rank {o.rank}:\n{o.error}" for o in outcomes if o.error]
    hung = [o for o in outcomes if o.exitcode is None]
    dead = [o for o in outcomes if o.exitcode not in (0, None) and not o.error]
    if errors or hung or dead:
        raise RuntimeError(
            "\n".join(errors)
            or (f"{len(hung)} ranks did not finish in {timeout} s" if hung else "")
            or "ranks died: "
            + "; ".join(f"rank {o.rank} with exit code {o.exitcode} ({_stage(o)})" for o in dead)
            + "".join(
                f"\nrank {o.rank}'s threads when it died:\n{o.fault}" for o in dead if o.fault
            )
        )
    return [o.result for o in outcomes]
