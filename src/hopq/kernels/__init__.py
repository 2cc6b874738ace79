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
equarx         ``cpu``     :mod:`hopq.kernels.equarx_cpu` (numba)      ``hopq[cpu]``
gqsgd-exp      ``cpu``     :mod:`hopq.kernels.gqsgd_cpu` (numba)       ``hopq[cpu]``
gqsgd-linear   ``cpu``     :mod:`hopq.kernels.gqsgd_cpu` (numba)       ``hopq[cpu]``
mxfp8/6/4      ``cpu``     :mod:`hopq.kernels.mx_cpu` (numba)          ``hopq[cpu]``
thc            ``cpu``     :mod:`hopq.kernels.thc_cpu` (numba)         ``hopq[cpu]``
============  ==========  ========================================  ===================
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass
from enum import Enum, IntEnum
from types import ModuleType
from typing import Protocol

import torch


class CpuBackend(str, Enum):
    """The ``backend`` option of the codecs whose kernels are numba CPU kernels
    (equarx, gcomp, gqsgd, mx, thc): the same bits either way."""

    #: The numba kernels for CPU tensors when numba is installed, else the reference.
    AUTO = "auto"
    REFERENCE = "reference"
    CPU = "cpu"


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
    KernelBackend("equarx", "cpu", "hopq.kernels.equarx_cpu", ("cpu",), ("numba", "numpy"), "cpu"),
    KernelBackend("gcomp", "cpu", "hopq.kernels.gcomp_cpu", ("cpu",), ("numba", "numpy"), "cpu"),
    KernelBackend(
        "gqsgd-exp", "cpu", "hopq.kernels.gqsgd_cpu", ("cpu",), ("numba", "numpy"), "cpu"
    ),
    KernelBackend(
        "gqsgd-linear", "cpu", "hopq.kernels.gqsgd_cpu", ("cpu",), ("numba", "numpy"), "cpu"
    ),
    *(
        KernelBackend(mx, "cpu", "hopq.kernels.mx_cpu", ("cpu",), ("numba", "numpy"), "cpu")
        for mx in ("mxfp8", "mxfp6", "mxfp4")
    ),
    KernelBackend("thc", "cpu", "hopq.kernels.thc_cpu", ("cpu",), ("numba", "numpy"), "cpu"),
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


#: Codecs already warned about running their reference for want of a package.
_warned: set[tuple[str, str]] = set()


def resolve(codec: str, choice: str, device_type: str) -> ModuleType | None:
    """The kernel module a codec's ``backend`` option picks for ``device_type``
    tensors, or None for its PyTorch reference (the same bits).

    ``"reference"``: None. ``"auto"``: the first available backend that runs on
    the device; when one exists for the device but its packages are missing,
    the reference, with a warning (once per codec and device) naming the extra
    that installs them. A backend's name: that backend, or ValueError when it
    does not take tensors of this device (RuntimeError when its packages are
    missing)."""
    if choice == "reference":
        return None
    if choice == "auto":
        found = auto_backend(codec, device_type)
        if found is not None:
            return found.load()
        missing = [b for b in backends(codec) if b.runs_on(device_type)]
        if missing and (codec, device_type) not in _warned:
            _warned.add((codec, device_type))
            b = missing[0]
            warnings.warn(
                f"{codec}: {', '.join(b.requires)} not installed, so {device_type.upper()} "
                f"tensors run its PyTorch reference (the same bits, far slower); "
                f"pip install 'hopq[{b.extra}]' for its kernels",
                RuntimeWarning,
                stacklevel=5,
            )
        return None
    chosen = backend(codec, choice)
    if not chosen.runs_on(device_type, forced=True):
        where = " or ".join(d.upper() for d in chosen.devices) + " tensors"
        if chosen.name == "triton":
            where += " (or CPU tensors with TRITON_INTERPRET=1)"
        raise ValueError(f"{codec}: backend {choice!r} runs on {where}, got {device_type}")
    return chosen.load()


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
    """What a Global-QSGD kernel module provides (``gqsgd_cpu``): both codecs'
    leaf quantization and the exponential reduce of :mod:`hopq.codecs.gqsgd`,
    bit for bit."""

    def linear_quantize(
        self,
        x: torch.Tensor,
        factor: float,
        levels: int,
        key: tuple[int, int],
        start: int = 0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """gqsgd-linear's leaf integers (float32) of element indices start..,
        into ``out`` (may be ``x``) when given."""
        ...

    def exp_quantize(
        self,
        x: torch.Tensor,
        scale: float,
        chain: int,
        key: tuple[int, int],
        start: int = 0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """gqsgd-exp's leaf codes (signed exponents, float32)."""
        ...

    def linear_hop(
        self,
        acc: torch.Tensor,
        body: torch.Tensor,
        bits: int,
        limit: int,
        out: torch.Tensor | None = None,
    ) -> int:
        """gqsgd-linear's hop on 4-, 8- or 16-bit lanes; returns the number of
        out-of-range lanes or sums."""
        ...

    def linear_unpack(self, body: torch.Tensor, bits: int, limit: int, out: torch.Tensor) -> int:
        """gqsgd-linear's lanes as float32 into ``out``; returns the number beyond
        +-limit."""
        ...

    def linear_pack(self, x: torch.Tensor, bits: int) -> torch.Tensor:
        """gqsgd-linear's float32 integers packed into lanes."""
        ...

    def linear_finish(
        self,
        y: torch.Tensor,
        factor: float,
        divisor: float,
        limit: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """gqsgd-linear's decode of the integer sums."""
        ...

    def exp_finish(
        self,
        y: torch.Tensor,
        scale: float,
        chain: int,
        divisor: float,
        limit: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """gqsgd-exp's decode of the signed exponent codes."""
        ...

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
    "CpuBackend",
    "DynamiQKernels",
    "GQSGDExpKernels",
    "KernelBackend",
    "Mode",
    "auto_backend",
    "backend",
    "backends",
    "interpreting",
]
