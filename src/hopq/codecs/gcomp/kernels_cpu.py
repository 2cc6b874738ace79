"""GComp's CPU kernels (numba): encode a block and decode (or accumulate) one,
chunk by chunk with bit accumulators, a bit buffer and the lookup table; the same bits as
:mod:`hopq.codecs.gcomp.reference` (``tests/test_gcomp.py`` holds them to it).
Headers are checked by :func:`hopq.codecs.gcomp.format.parse` before any stream
is read; the stream checks (a code the table does not know, a read past a
segment's length, counts that disagree with the header) return error codes that
become :class:`~hopq.PayloadError`. numba is optional (``hopq[cpu]``)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from hopq.codecs.gcomp import format as fmt
from hopq.codecs.gcomp.huffman import Table
from hopq.errors import PayloadError
from hopq.kernels import backend

_ERRORS = {
    -1: "the exponent stream does not hold exactly its values' codes",
    -2: "an escaped exponent has a short code",
    -3: "the non-zero count does not match the header",
    -4: "the mantissa stream length does not match its levels",
}


def available() -> bool:
    return backend("gcomp", "cpu").available()


def _jit() -> Any:
    from hopq.codecs.gcomp import _kernels_cpu_jit  # compiled or loaded on first use

    return _kernels_cpu_jit


#: Bits the decoder's code table reads at once (at least n_theta).
TABLE_BITS = 12


@lru_cache(maxsize=64)
def _np_table(table: Table) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(each exponent's code << 6 | length; the lookup table, symbol << 8 |
    length, symbol 257 where no code reaches; the native code lengths; the
    multi-code table of :func:`_multi_table` and the bits it reads)."""
    lut = (table.lut_sym << 8) | table.lut_len
    lut[table.lut_len == 0] = 257 << 8
    lut_np = lut.numpy().astype(np.uint32)
    return (
        ((table.enc_code << 6) | table.enc_len).numpy().astype(np.uint32),
        lut_np,
        table.lengths.numpy().astype(np.int64),
        _multi_table(lut_np, table.n_theta),
        max(TABLE_BITS, table.n_theta),
    )


def _multi_table(lut: np.ndarray, n_theta: int) -> np.ndarray:
    """For every value of the next w = max(TABLE_BITS, n_theta) bits of the
    exponent stream, the codes that lie wholly within them, up to three (a
    prefix code: a code no longer than the bits known is the true next one):
    the first symbol, the second << 8, the third << 16 (0 where absent), their
    lengths' sum << 24 (at most 16: five bits) and the count of codes after the
    first << 29; all ones where the first code is an escape or unknown (the
    decoder's one-code path). Symbols 256 and 257 never follow a first one."""
    w = max(TABLE_BITS, n_theta)
    mask = (1 << w) - 1
    idx = np.arange(1 << w, dtype=np.int64)
    e1 = lut[idx >> (w - n_theta)].astype(np.int64)
    used = e1 & 0xFF
    ent = e1 >> 8
    more = np.zeros_like(idx)
    ok = np.ones(idx.shape, bool)  # every code so far is in the table
    for k in (1, 2):
        rest = (idx << used) & mask  # the bits after the codes so far, zero filled
        e = lut[rest >> (w - n_theta)].astype(np.int64)
        ln = e & 0xFF
        ok &= (e < (256 << 8)) & (ln <= w - used)
        ent |= np.where(ok, (e >> 8) << (8 * k), 0)
        used += np.where(ok, ln, 0)
        more += ok
    ent |= (used << 24) | (more << 29)
    ent[e1 >= (256 << 8)] = 0xFFFFFFFF
    return ent.astype(np.uint32)


_EMPTY_F32 = np.empty(0, np.float32)


def _views(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    xf = x.detach().reshape(-1).contiguous().numpy()
    return xf.view(np.uint32), xf


def _out_and_head(n: int, table: Table, chunk_values: int) -> tuple[torch.Tensor, np.ndarray]:
    k = fmt.n_chunks(n, chunk_values)
    head = np.array(fmt.block_header(table.table_id, table.n_theta, k, n, 0), np.int64)
    return torch.empty(fmt.bound(n, chunk_values, table.n_theta), dtype=torch.uint8), head


def _raise(err: int) -> None:
    raise PayloadError(f"gcomp: {_ERRORS.get(err, 'corrupt payload')}")


def encode(
    x: torch.Tensor, thr: torch.Tensor | None, fixed: int, table: Table, chunk_values: int
) -> torch.Tensor:
    n = x.numel()
    etab = _np_table(table)[0]
    out, head = _out_and_head(n, table, chunk_values)
    xu, xf = _views(x)
    t = _EMPTY_F32 if thr is None else thr.contiguous().numpy()
    size = _jit().encode_block(
        xu, xf, t, thr is not None, fixed, etab, table.n_theta, chunk_values, out.numpy(), head
    )
    return out[:size]


def decode(
    payload: torch.Tensor, n: int, table: Table, chunk_values: int, out: torch.Tensor, acc: bool
) -> None:
    heads = fmt.parse(payload, n, table.table_id, table.n_theta, chunk_values)
    if n == 0:
        return
    _, lut, lengths, plut, pw = _np_table(table)
    o = out.numpy() if out.is_contiguous() else None
    target = o if o is not None else np.zeros(n, np.float32)
    if o is None and acc:
        target[:] = out.numpy()
    err = _jit().decode_chunks(
        payload.numpy(),
        heads.numpy(),
        chunk_values,
        lut,
        plut,
        pw,
        lengths,
        table.n_theta,
        target,
        target.view(np.uint32),
        acc,
    )
    if err:
        _raise(err)
    if o is None:
        out.copy_(torch.from_numpy(target))


def hop(
    payload: torch.Tensor,
    local: torch.Tensor,
    thr: torch.Tensor | None,
    fixed: int,
    table: Table,
    chunk_values: int,
) -> torch.Tensor:
    """The fused hop, chunk by chunk while each is in cache: decode ``payload``,
    add it to ``local`` (a contiguous float32 tensor, overwritten with the sum)
    and encode the sum."""
    n = local.numel()
    heads = fmt.parse(payload, n, table.table_id, table.n_theta, chunk_values)
    if not local.is_contiguous():
        raise ValueError("gcomp: the fused hop needs a contiguous local chunk")
    etab, lut, lengths, plut, pw = _np_table(table)
    out, head = _out_and_head(n, table, chunk_values)
    xf = local.reshape(-1).numpy()
    t = _EMPTY_F32 if thr is None else thr.contiguous().numpy()
    size = _jit().hop_block(
        payload.numpy(),
        heads.numpy(),
        lut,
        plut,
        pw,
        lengths,
        xf.view(np.uint32),
        xf,
        t,
        thr is not None,
        fixed,
        etab,
        table.n_theta,
        chunk_values,
        out.numpy(),
        head,
    )
    if size < 0:
        _raise(size)
    return out[:size]
