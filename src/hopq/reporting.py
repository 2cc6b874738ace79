"""Helpers shared by the main job and the benchmarks: the machine's name, markdown
tables, byte sizes, plots and progress."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def machine() -> str:
    """One line naming the hardware the numbers were taken on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


_NO_PLOTS_SAID = False


def pyplot() -> Any | None:
    """matplotlib.pyplot on the file-only Agg backend, or None without matplotlib
    (the ``bench`` extra); callers then skip their plots, and the first such call
    says so on stderr (a report without its plots must not look complete)."""
    global _NO_PLOTS_SAID
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _NO_PLOTS_SAID:
            _NO_PLOTS_SAID = True
            print(
                "hopq: matplotlib is not installed, so this report has no plots "
                "(pip install 'hopq[bench]')",
                file=sys.stderr,
                flush=True,
            )
        return None
    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write as PNG and close a figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # legends placed outside the axes
    plt.close(fig)
    return path


class Progress:
    """Progress of a long job: a rich bar on a terminal (when rich is installed),
    otherwise one plain line after the first step, every ``every`` steps, at
    the end, and after any step that ends ``quiet_s`` seconds or more after
    the last line (slow steps), so that a log file or CI output shows the job
    moving. ``label`` names what runs (a codec, a table); it is shown as is
    (rich markup in it is escaped)."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        every: int = 10,
        quiet_s: float = 60.0,
        stream: Any = None,
        transient: bool = False,
    ) -> None:
        self.label, self.total, self.every = label, total, max(1, every)
        self.done = 0
        self.quiet_s = quiet_s
        self.t0 = self._said = time.perf_counter()
        self.stream = stream if stream is not None else sys.stdout
        self._bar: Any = None
        if _is_terminal(self.stream):
            try:
                from rich.console import Console
                from rich.markup import escape
                from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
                from rich.progress import Progress as RichProgress
            except ImportError:
                pass
            else:
                self._bar = RichProgress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(),
                    TextColumn("{task.fields[info]}"),
                    console=Console(file=self.stream),
                    transient=transient,
                )
                self._escape = escape
                self._bar.start()
                self._task = self._bar.add_task(escape(label), total=total, info="")

    def update(self, info: str = "", advance: int = 1, label: str | None = None) -> None:
        """``advance`` steps done; ``info`` is shown beside the bar (or in the line)."""
        self.done += advance
        if label is not None:
            self.label = label
        if self._bar is not None:
            kw = {"description": self._escape(self.label)} if label is not None else {}
            self._bar.update(self._task, advance=advance, info=self._escape(info), **kw)
        elif (
            self.done % self.every == 0
            or self.done >= self.total
            or self.done == advance
            or time.perf_counter() - self._said >= self.quiet_s
        ):
            self._said = time.perf_counter()
            elapsed = self._said - self.t0
            print(
                f"[{self.label}] {self.done}/{self.total} ({elapsed:.0f} s) {info}".rstrip(),
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
