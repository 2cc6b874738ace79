"""The numba functions behind :mod:`hopq.kernels.thc_cpu` (imported only when
numba is installed): THC's random signs and uniforms (the lowbias32 hash of
:mod:`hopq.numerics.rng` in 32-bit lanes, ``_u32``) and the Walsh-Hadamard
butterflies of :func:`hopq.codecs.thc.fwht`, in place, one cache-sized block
at a time instead of one pass over the whole vector per butterfly level."""

# mypy: ignore-errors

import numpy as np
from numba import njit

from hopq.kernels._u32 import U32, add32, hash32, uniform


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def signs(out, k0, k1):
    """out[i] = 1 - 2 (hash32(i) & 1): THC's random signs, as float32."""
    idx = U32(0)
    a, b = U32(k0), U32(k1)
    for i in range(out.size):
        out[i] = np.float32(1.0) - np.float32(2.0) * np.float32(hash32(idx, a, b) & U32(1))
        idx = add32(idx, U32(1))


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def uniforms(out, offset, k0, k1):
    """out[i] = hopq.numerics.rng.uniform's draw for element offset + i."""
    idx = U32(offset)
    a, b = U32(k0), U32(k1)
    for i in range(out.size):
        out[i] = uniform(idx, a, b)
        idx = add32(idx, U32(1))


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def fwht_rows(y, scale):
    """Each row of the 2-D array y (length H, a power of two) through the
    butterflies (a, b) -> (a + b, a - b) for h = 1, 2, 4, ..., H/2, then times
    ``scale``: the reference's passes, element by element the same arithmetic."""
    rows, H = y.shape
    for r in range(rows):
        row = y[r]
        h = 1
        while h < H:
            for i in range(0, H, 2 * h):
                for j in range(i, i + h):
                    a = row[j]
                    b = row[j + h]
                    row[j] = a + b
                    row[j + h] = a - b
            h *= 2
        for j in range(H):
            row[j] = row[j] * scale
