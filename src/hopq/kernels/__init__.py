"""Kernel backends: one interface, a small registry, one module per codec and device.

A codec's PyTorch reference is its specification; a kernel backend reproduces it
bit for bit, faster, on some devices. Backends are optional: each names the
packages it needs (checked without importing them, so a torch-only install
never imports numpy or numba) and the codec falls back to its reference when
none is available.

Registered here (a new codec with kernels adds its rows):

============  ==========  ========================================  ===================
codec          backend     module                                     needs
============  ==========  ========================================  ===================
dynamiq        ``cpu``     :mod:`hopq.kernels.dynamiq_cpu` (numba)     ``hopq[cpu]``
gcomp          ``cpu``     :mod:`hopq.kernels.gcomp_cpu` (numba)       ``hopq[cpu]``
dynamiq        ``triton``  :mod:`hopq.kernels.dynamiq_triton`          ``hopq[triton]``
gqsgd-exp      ``cpu``     :mod:`hopq.kernels.gqsgd_cpu` (numba)       ``hopq[cpu]``
============  ==========  ========================================  ===================
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from enum import IntEnum
from types import ModuleType
from typing import Protocol

import torch


class Mode(IntEnum):
    """What a fused segment kernel does (DynamiQ section 4's four kernels)."""

    ENCODE = 0  # local rows -> payload bytes (a leaf's compression)
    DECODE = 1  # payload bytes -> rows (the all-gather receive)
    DECODE_ACC = 2  # rows += decode(bytes)
    DAR = 3  # decode, accumulate, re-encode: the fused hop


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class KernelBackend:
    """One kernel implementation of one codec."""

    codec: str
    name: str
    #: Import path of the module that implements the codec's kernel protocol.
    module: str
    #: Device types whose tensors it takes.
    devices: tuple[str, ...]
    #: Top-level packages it needs, and the pip extra that installs them.
    requires: tuple[str, ...]
    extra: str

    def available(self) -> bool:
        """Whether its packages are installed (found, not imported)."""
        return all(importlib.util.find_spec(p) is not None for p in self.requires)

    def runs_on(self, device_type: str, *, forced: bool = False) -> bool:
        """Whether it takes tensors of ``device_type``. A backend asked for by name
        (``forced``) also counts Triton's interpreter, which runs the GPU kernels on
        CPU tensors (the tests); ``auto`` never picks the interpreter."""
        if device_type in self.devices:
            return True
        return forced and self.name == "triton" and device_type == "cpu" and interpreting()

    def load(self) -> ModuleType:
        if not self.available():
            raise RuntimeError(
                f"{self.codec}: backend {self.name!r} needs {', '.join(self.requires)} "
                f"(pip install 'hopq[{self.extra}]')"
            )
        return importlib.import_module(self.module)


_BACKENDS: list[KernelBackend] = [
    KernelBackend(
        "dynamiq", "triton", "hopq.kernels.dynamiq_triton", ("cuda",), ("triton",), "triton"
    ),
    KernelBackend(
        "dynamiq", "cpu", "hopq.kernels.dynamiq_cpu", ("cpu",), ("numba", "numpy"), "cpu"
    ),
    KernelBackend("gcomp", "cpu", "hopq.kernels.gcomp_cpu", ("cpu",), ("numba", "numpy"), "cpu"),
    KernelBackend(
        "gqsgd-exp", "cpu", "hopq.kernels.gqsgd_cpu", ("cpu",), ("numba", "numpy"), "cpu"
    ),
]


def backends(codec: str) -> list[KernelBackend]:
    """The kernel backends registered for ``codec``, in order of preference."""
    return [b for b in _BACKENDS if b.codec == codec]


def backend(codec: str, name: str) -> KernelBackend:
    for b in backends(codec):
        if b.name == name:
            return b
    raise ValueError(
        f"{codec} has no kernel backend {name!r}; it has {[b.name for b in backends(codec)]}"
    )


def auto_backend(codec: str, device_type: str) -> KernelBackend | None:
    """The first available backend of ``codec`` that runs on ``device_type``."""
    for b in backends(codec):
        if b.runs_on(device_type) and b.available():
            return b
    return None


class DynamiQKernels(Protocol):
    """What a DynamiQ kernel module provides (``dynamiq_cpu``, ``dynamiq_triton``).
    Every function reproduces :mod:`hopq.codecs.dynamiq.reference` bit for bit."""

    def run_segment(
        self,
        mode: Mode,
        width: int,
        rows: int,
        S: int,
        s: int,
        row0: int,
        *,
        payload: torch.Tensor | None,
        local: torch.Tensor | None,
        out_rows: torch.Tensor | None,
        out_payload: torch.Tensor | None,
        gamma_key: tuple[int, int],
        perm_key: tuple[int, int],
        peers: int,
        peer: int,
        units: tuple[int, ...],
        scale_key: tuple[int, int],
        eps: float,
    ) -> None:
        """One width-uniform segment of ``rows`` super-groups in ``mode``."""

    def supergroup_stats(self, x: torch.Tensor, S: int) -> torch.Tensor:
        """[2, m] float32: per super-group mean and sum of squares (tree order)."""
        ...

    def gather_rows(
        self, x: torch.Tensor, perm: torch.Tensor, mu: torch.Tensor, S: int
    ) -> torch.Tensor:
        """The working vector: rows reordered by ``perm``, means subtracted."""
        ...

    def scatter_rows(
        self,
        y: torch.Tensor,
        perm: torch.Tensor,
        mu: torch.Tensor,
        S: int,
        n: int,
        avg: bool,
        d: int,
    ) -> torch.Tensor:
        """The inverse reorder with the means added back (sum or average)."""
        ...


class GQSGDExpKernels(Protocol):
    """What a gqsgd-exp kernel module provides (``gqsgd_cpu``): the exponential
    reduce of :mod:`hopq.codecs.gqsgd`, bit for bit."""

    def exp_reduce(
        self,
        acc: torch.Tensor,
        body: torch.Tensor,
        key: tuple[int, int],
        start: int,
        emin: int,
        out: torch.Tensor | None = None,
    ) -> int:
        """acc <- exp_reduce(acc, codes of body) in place, out <- its bytes; returns
        the number of invalid codes in body."""
        ...


__all__ = [
    "DynamiQKernels",
    "GQSGDExpKernels",
    "KernelBackend",
    "Mode",
    "auto_backend",
    "backend",
    "backends",
    "interpreting",
]
