"""``hopq bench exits``: the standalone example (``examples/allreduce.py``, the
README's collectives snippet) under torchrun, run again and again; every run
must exit 0 on every rank.

Gloo's point-to-point teardown could abort processes that had finished their
work (``terminate called without an active exception``), and torchrun then
reports the job as failed; hopq's exit handler (:mod:`hopq.comm.shutdown`) is
what this checks. Each failing run's output tail goes into the report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hopq.options import option
from hopq.reporting import Progress, machine

#: Relative to the working directory: the repository's root (the examples are
#: not part of an installed package).
EXAMPLE = "examples/allreduce.py"


@dataclass(frozen=True)
class ExitOptions:
    runs: int = option(30, "torchrun launches")
    nproc: int = option(3, "ranks per launch (--nproc_per_node)")
    script: str = option(EXAMPLE, "the script torchrun runs")
    timeout: float = option(300.0, "seconds one launch may take")

    def __post_init__(self) -> None:
        if self.runs < 1 or self.nproc < 1:
            raise ValueError("runs and nproc must be >= 1")
        if not Path(self.script).exists():
            raise ValueError(
                f"no script at {self.script} (from {Path.cwd()}): run from the repository's "
                "root, or pass --script"
            )


def launch(o: ExitOptions, port: int) -> tuple[int, str, float]:
    """One torchrun launch: (exit code, output, seconds)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={o.nproc}",
        f"--master_port={port}", o.script,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=o.timeout, env=env)
        code, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        text = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
        code, text = -1, f"timed out after {o.timeout} s\n{text}"
    return code, text, time.perf_counter() - t0


def run(o: ExitOptions) -> str:
    failures = []
    times = []
    with Progress("exits", o.runs, every=5) as bar:
        for i in range(o.runs):
            code, text, seconds = launch(o, 29500 + 17 * i % 500 + os.getpid() % 300)
            times.append(seconds)
            if code != 0 or "terminate called" in text:
                failures.append((i, code, text))
            bar.update(f"{len(failures)} failed")
    lines = [
        f"Machine: {machine()}",
        "",
        f"`torchrun --nproc_per_node {o.nproc} {Path(o.script).name}`, {o.runs} launches: "
        f"**{o.runs - len(failures)} exited 0**, {len(failures)} failed "
        f"(median {sorted(times)[len(times) // 2]:.1f} s per launch).",
    ]
    for i, code, text in failures[:5]:
        tail = "\n".join(text.strip().splitlines()[-15:])
        lines += ["", f"Launch {i}: exit code {code}", "```", tail, "```"]
    return "\n".join(lines)
