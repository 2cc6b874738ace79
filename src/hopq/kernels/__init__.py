"""Kernel backends: the table of which backends each codec has and how one is chosen.

A codec's PyTorch reference is its specification; a kernel backend reproduces it
bit for bit, faster, on some devices. The kernels themselves live beside their
codec (``hopq/codecs/<codec>/kernels_cpu.py``, ``kernels_triton.py``); this
package holds no codec logic, only what selection needs. Backends are optional:
each names the packages it needs (checked without importing them, so a
torch-only install never imports numpy or numba) and the codec falls back to
its reference when none is available.

Registered here (a new codec with kernels adds its rows):

============  ==========  ==============================================  ===============
codec         backend     module                                          needs
============  ==========  ==============================================  ===============
dynamiq       ``triton``  :mod:`hopq.codecs.dynamiq.kernels_triton`       ``hopq[triton]``
dynamiq       ``cpu``     :mod:`hopq.codecs.dynamiq.kernels_cpu` (numba)  ``hopq[cpu]``
equarx        ``triton``  :mod:`hopq.codecs.equarx.kernels_triton`        ``hopq[triton]``
equarx        ``cpu``     :mod:`hopq.codecs.equarx.kernels_cpu` (numba)   ``hopq[cpu]``
gcomp         ``cpu``     :mod:`hopq.codecs.gcomp.kernels_cpu` (numba)    ``hopq[cpu]``
gqsgd-exp     ``cpu``     :mod:`hopq.codecs.gqsgd.kernels_cpu` (numba)    ``hopq[cpu]``
gqsgd-linear  ``cpu``     :mod:`hopq.codecs.gqsgd.kernels_cpu` (numba)    ``hopq[cpu]``
mxfp8/6/4     ``triton``  :mod:`hopq.codecs.mx.kernels_triton`            ``hopq[triton]``
mxfp8/6/4     ``cpu``     :mod:`hopq.codecs.mx.kernels_cpu` (numba)       ``hopq[cpu]``
thc           ``cpu``     :mod:`hopq.codecs.thc.kernels_cpu` (numba)      ``hopq[cpu]``
============  ==========  ==============================================  ===============
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass, fields
from enum import Enum, IntEnum
from functools import lru_cache
from types import ModuleType


class CpuBackend(str, Enum):
    """The ``backend`` option of the codecs whose kernels are numba CPU kernels
    (gcomp, gqsgd, thc; equarx and mx have their own, with ``triton``): the same
    bits either way."""

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


@lru_cache(maxsize=1)
def register_caps() -> bool:
    """Whether the installed Triton's CUDA backend takes a register cap per
    kernel (the ``maxnreg`` launch option); where it does not, kernels launch
    without one (ptxas's choice: the same bits, maybe slower), and hopq says so
    once."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    if "maxnreg" in {f.name for f in fields(CUDAOptions)}:
        return True
    warnings.warn(
        "hopq: this Triton takes no register cap (maxnreg): the MX and EQuARX fused hops "
        "launch without theirs (the same bits, slower on some GPUs)",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


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


def _numba(codec: str, module: str) -> KernelBackend:
    """A codec's numba kernels for CPU tensors (``hopq[cpu]``)."""
    return KernelBackend(codec, "cpu", module, ("cpu",), ("numba", "numpy"), "cpu")


#: The backends, by codec in order of preference. Modules are named, not imported:
#: a codec's kernels live in its own folder (``hopq.codecs.<codec>``), above this
#: package, and are imported only when that codec asks for them (:func:`resolve`).
_BACKENDS: list[KernelBackend] = [
    KernelBackend(
        "dynamiq", "triton", "hopq.codecs.dynamiq.kernels_triton", ("cuda",), ("triton",), "triton"
    ),
    _numba("dynamiq", "hopq.codecs.dynamiq.kernels_cpu"),
    KernelBackend(
        "equarx", "triton", "hopq.codecs.equarx.kernels_triton", ("cuda",), ("triton",), "triton"
    ),
    _numba("equarx", "hopq.codecs.equarx.kernels_cpu"),
    _numba("gcomp", "hopq.codecs.gcomp.kernels_cpu"),
    _numba("gqsgd-exp", "hopq.codecs.gqsgd.kernels_cpu"),
    _numba("gqsgd-linear", "hopq.codecs.gqsgd.kernels_cpu"),
    *(
        KernelBackend(
            mx, "triton", "hopq.codecs.mx.kernels_triton", ("cuda",), ("triton",), "triton"
        )
        for mx in ("mxfp8", "mxfp6", "mxfp4")
    ),
    *(_numba(mx, "hopq.codecs.mx.kernels_cpu") for mx in ("mxfp8", "mxfp6", "mxfp4")),
    _numba("thc", "hopq.codecs.thc.kernels_cpu"),
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


__all__ = [
    "CpuBackend",
    "KernelBackend",
    "Mode",
    "auto_backend",
    "backend",
    "backends",
    "interpreting",
]
