"""Clean exits after point-to-point traffic on Gloo.

A process that exits while its Gloo pairs still carry traffic to or from a peer
that has not finished closes those connections under the peer; Gloo's I/O
threads then see a closed pair, and a process torn down with its process group
still alive can end in ``std::terminate`` (``terminate called without an active
exception``, SIGABRT) after it printed correct results, so torchrun reports the
job as failed. torch's documentation asks scripts to call
``destroy_process_group()`` at the end; most do not.

hopq therefore installs, the first time it communicates on a group, an exit
handler that (1) waits for every rank to reach its own exit (a barrier with a
short timeout, so a rank that died does not hold the others) and (2) destroys
the process group in order, unless the script already did. Users need not know.

``hopq bench exits`` runs the README's example under torchrun repeatedly and
counts the exit codes.

A rank that ends with an uncaught exception (a user's bug, or hopq's own
``TransportError`` after a peer failed) skips the barrier: its peers will never
reach theirs in step with it, and while it waits there its connections stay
open, so a peer blocked on a receive from it learns nothing until its own
timeout (the group's, 30 minutes by default). It destroys the group at once
instead and leaves; its peers' pending receives then fail within a second,
naming this rank, and their own uncaught ``TransportError`` ends them the
same way, so the job ends in seconds. hopq learns of the exception from
``sys.excepthook`` (wrapped when the handler is installed) or from
``sys.last_value`` / ``sys.last_exc``, which the interpreter sets when it
reports an uncaught exception; ``sys.exit(code)`` is a normal exit.

Destroying the group only helps if that frees it: Gloo's threads stop when the
group object dies, and a group that outlives the script dies during interpreter
finalization, where a Gloo thread that needs the GIL can still abort the rank.
torch keeps the default group alive itself once DDP is built:
``torch.distributed.nn.functional``, which DDP imports, evaluates
``group=group.WORLD`` as the default argument of ten functions when it is first
imported, so a process that builds DDP after ``init_process_group`` holds its
group in those defaults until exit. hopq therefore imports that module itself
when it is imported before any group exists (the defaults are then None, which
those functions read as the default group, the same behaviour), and its exit
handler replaces defaults that still hold a destroyed group by None, so the
group is freed while the interpreter is fully alive.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import sys
from types import TracebackType
from typing import Any

#: Seconds the exit handler waits for the other ranks to reach their exit.
EXIT_BARRIER_S = 30.0

_installed = False
#: Whether this process is ending with an uncaught exception (set by
#: :func:`_wrap_excepthook`'s hook).
_uncaught = False


def install() -> None:
    global _installed
    if not _installed:
        atexit.register(at_exit)
        _wrap_excepthook()
        _installed = True


def _wrap_excepthook() -> None:
    """Wrap ``sys.excepthook`` so that the exit handler knows the interpreter
    ends with an uncaught exception (the wrapped hook still prints it)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> Any:
        global _uncaught
        if not issubclass(kind, SystemExit):
            _uncaught = True
        return previous(kind, value, tb)

    hook.__wrapped__ = previous  # type: ignore[attr-defined]
    sys.excepthook = hook


def failing() -> bool:
    """Whether the interpreter is ending with an uncaught exception (then the
    exit handler skips its barrier)."""
    if _uncaught:
        return True
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return last is not None and not isinstance(last, SystemExit)


def import_functional_early() -> None:
    """Import ``torch.distributed.nn.functional`` while no group exists, so that
    its default arguments hold None rather than the group (see above)."""
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        with contextlib.suppress(ImportError):  # builds without torch.distributed.nn
            import torch.distributed.nn.functional  # noqa: F401


def release_destroyed_groups() -> int:
    """Replace every default argument of ``torch.distributed.nn.functional``
    that holds a process group no longer registered (destroyed) by None;
    returns how many were replaced."""
    import torch.distributed as dist

    mod = sys.modules.get("torch.distributed.nn.functional")
    if mod is None or not dist.is_available():
        return 0
    from torch.distributed.distributed_c10d import _world

    live = set(_world.pg_map)
    replaced = 0
    for fn in vars(mod).values():
        defaults = getattr(fn, "__defaults__", None)
        if not (callable(fn) and defaults):
            continue
        stale = [isinstance(d, dist.ProcessGroup) and d not in live for d in defaults]
        if any(stale):
            fn.__defaults__ = tuple(None if s else d for d, s in zip(defaults, stale, strict=True))
            replaced += sum(stale)
    return replaced


def at_exit() -> None:
    import gc

    import torch.distributed as dist

    if not dist.is_available():
        return
    if dist.is_initialized():
        if not failing():  # a failing rank's peers must learn at once (see above)
            try:
                work = dist.barrier(async_op=True)
                if work is not None:
                    work.wait(timeout=datetime.timedelta(seconds=EXIT_BARRIER_S))
            except Exception:  # noqa: BLE001 - a peer died: tear down anyway
                pass
        with contextlib.suppress(Exception):  # already gone
            dist.destroy_process_group()
    released = 0
    with contextlib.suppress(Exception):  # torch internals this version lacks
        released = release_destroyed_groups()
    if released:
        gc.collect()  # the group, and with it Gloo's threads, go now
