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
"""

from __future__ import annotations

import atexit
import contextlib
import datetime

#: Seconds the exit handler waits for the other ranks to reach their exit.
EXIT_BARRIER_S = 30.0

_installed = False


def install() -> None:
    global _installed
    if not _installed:
        atexit.register(at_exit)
        _installed = True


def at_exit() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        work = dist.barrier(async_op=True)
        if work is not None:
            work.wait(timeout=datetime.timedelta(seconds=EXIT_BARRIER_S))
    except Exception:  # noqa: BLE001 - a peer died: tear down anyway
        pass
    with contextlib.suppress(Exception):  # already gone
        dist.destroy_process_group()
