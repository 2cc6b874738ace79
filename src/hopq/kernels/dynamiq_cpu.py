"""DynamiQ's fused CPU kernels (numba): the same bits as the PyTorch reference.

The reference (``hopq.codecs.dynamiq.reference``) is a chain of tensor operations, each of
which reads and writes the whole chunk; its fused hop runs at 6-8 million
coordinates per second on one core (``hopq bench kernels --backend reference``).
These kernels walk one super-group at a time (256 entries stay in L1) and do
decode, accumulate and encode in one pass:

* ``Mode.ENCODE``: local rows -> segment bytes (the leaf);
* ``Mode.DECODE``: segment bytes -> rows (the all-gather receive);
* ``Mode.DECODE_ACC``: rows += decode(bytes);
* ``Mode.DAR``: bytes, local rows -> bytes of decode(bytes) + local (the fused hop).

Every float operation is the reference's float32 operation in the reference's
order (numba without ``fastmath`` keeps IEEE semantics: no reassociation, no
fused multiply-add), the hash is the same lowbias32, and the level search finds
the reference's ``searchsorted`` index exactly: a bucket table gives a start a
few levels below the answer and compare-and-step moves finish it
(:func:`hopq.numerics.levels.search_tables` says how many suffice: one for the
default tables).
``tests/test_kernels.py`` holds them to the reference bit for bit.

numba is optional (``pip install hopq[cpu]``); without it the codec runs the
reference. The first call compiles (a few seconds, cached on disk afterwards).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from hopq.kernels import Mode, backend
from hopq.numerics.levels import search_tables


def available() -> bool:
    return backend("dynamiq", "cpu").available()


@lru_cache(maxsize=64)
def _np_tables(width: int, eps: float) -> tuple[np.ndarray, np.ndarray, int, int]:
    ext, bucket, nb_log, steps = search_tables(width, eps)
    return ext.numpy(), bucket.numpy(), nb_log, steps


def _get():
    from hopq.kernels._dynamiq_cpu_jit import SEGMENT  # compiled or loaded on first use

    return SEGMENT


@lru_cache(maxsize=64)
def _units_array(units: tuple[int, ...]) -> np.ndarray:
    return np.array(units, np.int64)


_EMPTY_U8 = np.empty(0, np.uint8)
_EMPTY_F32 = np.empty(0, np.float32)


def run_segment(
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
    """One width-uniform segment of ``rows`` super-groups (see the module docstring
    for the modes). Tensors are contiguous CPU tensors: ``payload``/``out_payload``
    uint8 (the segment's bytes), ``local``/``out_rows`` float32 of rows * S."""
    kern = _get()
    mode = int(mode)  # type: ignore[assignment]  # numba takes a plain int
    inb = payload.detach().numpy() if payload is not None else _EMPTY_U8
    loc = local.detach().numpy() if local is not None else _EMPTY_F32
    outf = out_rows.detach().numpy() if out_rows is not None else _EMPTY_F32
    outb = out_payload.detach().numpy() if out_payload is not None else _EMPTY_U8
    gk = np.array(gamma_key, np.uint64)
    pk = np.array(perm_key, np.uint64)
    un = _units_array(units)
    if width == 16:
        kern[16](mode, rows, S, row0, inb, loc, outf, outb, gk, pk, peers, peer, un)
        return
    tab, bucket, nb_log, steps = _np_tables(width, eps)
    sk = np.array(scale_key, np.uint64)
    kern[width](
        mode, rows, S, s, row0, inb, loc, outf, outb,
        gk, pk, peers, peer, un, sk, tab, bucket, nb_log, steps,
    )  # fmt: skip


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the kernels of every width."""
    x = torch.randn(512)
    for w in (2, 4, 8, 16):
        nb = 2 * 512 if w == 16 else 2 * (2 + 16 + 256 * w // 8)
        out = torch.empty(nb, dtype=torch.uint8)
        for mode in (Mode.ENCODE, Mode.DAR):
            run_segment(
                mode, w, 2, 256, 16, 0,
                payload=None if mode is Mode.ENCODE else out.clone(), local=x, out_rows=None,
                out_payload=out, gamma_key=(1, 2), perm_key=(3, 4), peers=1, peer=0,
                units=(1,), scale_key=(5, 6), eps=0.0,
            )  # fmt: skip


def supergroup_stats(x: torch.Tensor, S: int) -> torch.Tensor:
    """[2, m] float32: per super-group mean (over its real entries) and sum of
    squares, bit-identical to the reference plan's before the bfloat16 rounding."""
    from hopq.kernels._dynamiq_cpu_jit import supergroup_stats as kernel

    x = x.detach().reshape(-1).contiguous()
    m = -(-x.numel() // S)
    out = torch.empty(2, m, dtype=torch.float32)
    kernel(x.numpy(), S, out.numpy())
    return out


def gather_rows(
    x: torch.Tensor, perm: torch.Tensor, mu: torch.Tensor, S: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference ``prepare``: rows reordered by ``perm``, means subtracted;
    into ``out`` (contiguous float32 of len(perm) * S) when given: with a slice
    of ``perm``, a part of the working vector (:meth:`DynamiQ.prepare_part`)."""
    from hopq.kernels._dynamiq_cpu_jit import gather_rows as kernel

    if out is None:
        out = torch.empty(perm.numel() * S, dtype=torch.float32)
    kernel(
        x.detach().reshape(-1).contiguous().numpy(),
        perm.contiguous().numpy(),
        mu.numpy(),
        S,
        out.numpy(),
    )
    return out


def scatter_rows(
    y: torch.Tensor, perm: torch.Tensor, mu: torch.Tensor, S: int, n: int, avg: bool, d: int,
    out: torch.Tensor | None = None, saturate: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The reference ``finish``: the inverse reorder, means added back; rows of y
    go to rows ``perm`` of ``out`` (float32 of d entries) when given, so that a
    part of the working vector lands in the result (:meth:`DynamiQ.finish_part`).
    ``saturate``: also :func:`~hopq.codecs.dynamiq.codec.saturate_finite_rows`
    on the rows written (the result of a whole finish, a part at a time)."""
    from hopq.kernels._dynamiq_cpu_jit import scatter_rows as kernel

    if out is None:
        out = torch.empty(d, dtype=torch.float32)
    kernel(
        y.detach().contiguous().numpy(),
        perm.contiguous().numpy(),
        mu.numpy(),
        S,
        n,
        avg,
        saturate,
        out.numpy(),
    )
    return out


#: gather_rows and scatter_rows take ``out`` and a slice of the permutation:
#: DynamiQ prepares and finishes the working vector part by part with them.
PARTWISE_ROWS = True
