"""GComp's CPU kernels (numba): encode a block and decode (or accumulate) one,
one pass per chunk with bit accumulators and the lookup table; the same bits as
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
    from hopq.kernels import _gcomp_cpu_jit  # compiled or loaded on first use

    return _gcomp_cpu_jit


@lru_cache(maxsize=64)
def _np_table(table: Table) -> tuple[np.ndarray, ...]:
    return (
        table.enc_code.numpy().astype(np.int64),
        table.enc_len.numpy().astype(np.int64),
        table.lut_sym.numpy().astype(np.int64),
        table.lut_len.numpy().astype(np.int64),
        table.lengths.numpy().astype(np.int64),
    )


_EMPTY_F32 = np.empty(0, np.float32)


def encode(
    x: torch.Tensor, thr: torch.Tensor | None, fixed: int, table: Table, chunk_values: int
) -> torch.Tensor:
    j = _jit()
    n = x.numel()
    code, ln, _, _, _ = _np_table(table)
    out = torch.empty(fmt.bound(n, chunk_values, table.n_theta), dtype=torch.uint8)
    C = chunk_values
    lv_buf = np.empty((2 * min(C, max(n, 1)) + 7) // 8 + 1, np.uint8)
    mt_buf = np.empty(3 * min(C, max(n, 1)) + 4, np.uint8)
    xs = x.detach().reshape(-1).contiguous().view(torch.int32).numpy().view(np.uint32)
    t = _EMPTY_F32 if thr is None else thr.contiguous().numpy()
    k = fmt.n_chunks(n, C)
    head = np.array(fmt.block_header(table.table_id, table.n_theta, k, n, 0), np.int64)
    size = j.encode_block(
        xs, t, thr is not None, fixed, code, ln, C, out.numpy(), lv_buf, mt_buf, head
    )
    return out[:size]


def decode(
    payload: torch.Tensor, n: int, table: Table, chunk_values: int, out: torch.Tensor, acc: bool
) -> None:
    heads = fmt.parse(payload, n, table.table_id, table.n_theta, chunk_values)
    if n == 0:
        return
    _, _, sym, ln, lengths = _np_table(table)
    o = out.numpy() if out.is_contiguous() else None
    target = o if o is not None else np.zeros(n, np.float32)
    if o is None and acc:
        target[:] = out.numpy()
    err = _jit().decode_chunks(
        payload.numpy(), heads.numpy(), chunk_values, sym, ln, lengths, table.n_theta, target, acc
    )
    if err:
        raise PayloadError(f"gcomp: {_ERRORS.get(err, 'corrupt payload')}")
    if o is None:
        out.copy_(torch.from_numpy(target))
