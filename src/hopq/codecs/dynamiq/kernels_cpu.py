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

from hopq.codecs.dynamiq.segment import SegmentCall, Streams
from hopq.kernels import Mode, backend
from hopq.numerics.levels import search_tables


def available() -> bool:
    return backend("dynamiq", "cpu").available()


@lru_cache(maxsize=64)
def _np_tables(width: int, eps: float) -> tuple[np.ndarray, np.ndarray, int, int]:
    ext, bucket, nb_log, steps = search_tables(width, eps)
    return ext.numpy(), bucket.numpy(), nb_log, steps


def _get():
    from hopq.codecs.dynamiq._kernels_cpu_jit import SEGMENT  # compiled or loaded on first use

    return SEGMENT


@lru_cache(maxsize=64)
def _units_array(units: tuple[int, ...]) -> np.ndarray:
    return np.array(units, np.int64)


_EMPTY_U8 = np.empty(0, np.uint8)
_EMPTY_F32 = np.empty(0, np.float32)


def run_segment(call: SegmentCall) -> None:
    """One width-uniform segment (see the module docstring for the modes and
    :class:`~hopq.codecs.dynamiq.segment.SegmentCall` for the tensors), on CPU."""
    kern = _get()
    mode = int(call.mode)  # numba takes a plain int
    inb = call.payload.detach().numpy() if call.payload is not None else _EMPTY_U8
    loc = call.local.detach().numpy() if call.local is not None else _EMPTY_F32
    outf = call.out_rows.detach().numpy() if call.out_rows is not None else _EMPTY_F32
    outb = call.out_payload.detach().numpy() if call.out_payload is not None else _EMPTY_U8
    st = call.streams
    gk = np.array(st.gamma_key, np.uint64)
    pk = np.array(st.perm_key, np.uint64)
    un = _units_array(st.units)
    rows, S, row0 = call.rows, call.S, call.row0
    if call.width == 16:
        kern[16](mode, rows, S, row0, inb, loc, outf, outb, gk, pk, st.peers, st.peer, un)
        return
    tab, bucket, nb_log, steps = _np_tables(call.width, call.eps)
    sk = np.array(st.scale_key, np.uint64)
    kern[call.width](
        mode, rows, S, call.s, row0, inb, loc, outf, outb,
        gk, pk, st.peers, st.peer, un, sk, tab, bucket, nb_log, steps,
    )  # fmt: skip


#: Whether :func:`warm_up` ran in this process.
_warm = False


def warm_up() -> None:
    """Compile (or load from numba's disk cache) every kernel a call runs: the
    segments of every width, the super-group statistics and the row gather and
    scatter; once per process (DynamiQ calls it before a call's timeout starts:
    with a cold cache this takes tens of seconds)."""
    global _warm
    if _warm:
        return
    x = torch.randn(512)
    streams = Streams(
        gamma_key=(1, 2), perm_key=(3, 4), peers=1, peer=0, units=(1,), scale_key=(5, 6)
    )
    for w in (2, 4, 8, 16):
        nb = 2 * 512 if w == 16 else 2 * (2 + 16 + 256 * w // 8)
        out = torch.empty(nb, dtype=torch.uint8)
        for mode in (Mode.ENCODE, Mode.DAR):
            payload = None if mode is Mode.ENCODE else out.clone()
            # 2 super-groups of 256 entries in groups of 16, from row 0, eps 0
            run_segment(SegmentCall(mode, w, 2, 256, 16, 0, 0.0, streams, payload, x, None, out))
    perm = torch.tensor([1, 0], dtype=torch.int64)
    mu = supergroup_stats(x, 256)[0].contiguous()
    rows = gather_rows(x, perm, mu, 256)
    gather_rows(x, perm[:1], mu, 256, out=rows[:256])
    for avg in (False, True):
        for saturate in (False, True):
            scatter_rows(rows, perm, mu, 256, 2, avg, 512, saturate=saturate)
    _warm = True


def supergroup_stats(x: torch.Tensor, S: int) -> torch.Tensor:
    """[2, m] float32: per super-group mean (over its real entries) and sum of
    squares, bit-identical to the reference plan's before the bfloat16 rounding."""
    from hopq.codecs.dynamiq._kernels_cpu_jit import supergroup_stats as kernel

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
    from hopq.codecs.dynamiq._kernels_cpu_jit import gather_rows as kernel

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
    y: torch.Tensor,
    perm: torch.Tensor,
    mu: torch.Tensor,
    S: int,
    n: int,
    avg: bool,
    d: int,
    out: torch.Tensor | None = None,
    saturate: bool = False,
) -> torch.Tensor:
    """The reference ``finish``: the inverse reorder, means added back; rows of y
    go to rows ``perm`` of ``out`` (float32 of d entries) when given, so that a
    part of the working vector lands in the result (:meth:`DynamiQ.finish_part`).
    ``saturate``: also :func:`~hopq.codecs.dynamiq.codec.saturate_finite_rows`
    on the rows written (the result of a whole finish, a part at a time)."""
    from hopq.codecs.dynamiq._kernels_cpu_jit import scatter_rows as kernel

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
