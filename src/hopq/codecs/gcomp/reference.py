"""GComp's PyTorch reference (the specification the kernels match bit for bit).

Per value (paper 6.1): the exponent's code; if the exponent is not 0, a 2-bit
truncation level and the sign + mantissa with the level's low bits cut off
(zero pruning: exponent 0, zeros and subnormals, sends only its code and
decodes as +0). Exponent 255 (Inf, NaN) always goes at level 0: its mantissa
travels whole, so NaN stays NaN and Inf stays Inf.

Level rule (paper 5.1, hopq's form, see the codec docstring): with ``thr`` the
per-value |A| (delta = A / g), level = #{k in (6, 12, 18) : |v| * 2**k < thr},
in float32 (exact: a power-of-two scaling); or one ``fixed`` level for every
value (the paper's "quantization" baseline), or 0 everywhere.

Decoding is vectorised: the length of the code starting at every bit position
comes from the lookup table, and the chain of code starts from bit 0 is found
by pointer doubling (log2 of the values rounds), so no Python loop runs per value.
"""

from __future__ import annotations

import torch

from hopq.codecs.gcomp import format as fmt
from hopq.codecs.gcomp.huffman import ESC, Table
from hopq.errors import PayloadError

_MSB = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int64)


def levels(v: torch.Tensor, thr: torch.Tensor | None, fixed: int) -> torch.Tensor:
    """Truncation level (0-3) of every value (int64)."""
    if fixed >= 0:
        return torch.full(v.shape, fixed, dtype=torch.int64)
    if thr is None:
        return torch.zeros(v.shape, dtype=torch.int64)
    a = v.abs()
    lv = torch.zeros(v.shape, dtype=torch.int64)
    for k in (64.0, 4096.0, 262144.0):
        lv += (a * k < thr).to(torch.int64)
    return lv


def pack_fields(values: torch.Tensor, widths: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Concatenate fields of ``widths`` (<= 24) bits, MSB first; (bytes, bits)."""
    nbits = int(widths.sum())
    if nbits == 0:
        return torch.zeros(0, dtype=torch.uint8), 0
    al = values << (24 - widths)
    bits = (al[:, None] >> torch.arange(23, -1, -1)) & 1
    mask = torch.arange(24)[None, :] < widths[:, None]
    stream = bits[mask]
    pad = (-nbits) % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    return (stream.view(-1, 8) * _MSB).sum(1).to(torch.uint8), nbits


def read_fields(
    stream: torch.Tensor, starts: torch.Tensor, width: torch.Tensor | int
) -> torch.Tensor:
    """Fields of ``width`` (<= 24) bits starting at bit ``starts`` (zeros past the end)."""
    b = torch.cat([stream.to(torch.int64), torch.zeros(4, dtype=torch.int64)])
    i = starts >> 3
    word = (b[i] << 24) | (b[i + 1] << 16) | (b[i + 2] << 8) | b[i + 3]
    w = torch.as_tensor(width, dtype=torch.int64)
    return (word >> (32 - (starts & 7) - w)) & ((1 << w) - 1)


def encode(
    x: torch.Tensor, thr: torch.Tensor | None, fixed: int, table: Table, chunk_values: int
) -> torch.Tensor:
    """A block for the float32 values ``x`` (thr: |A| per value or None)."""
    n = x.numel()
    bits = x.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    k = fmt.n_chunks(n, chunk_values)
    heads: list[int] = []
    datas: list[torch.Tensor] = []
    offset = fmt.BLOCK_BYTES + k * fmt.CHUNK_BYTES
    for c in range(k):
        s, e = c * chunk_values, min(n, (c + 1) * chunk_values)
        b = bits[s:e]
        ex = (b >> 23) & 0xFF
        nz = ex != 0
        xb, eb = pack_fields(table.enc_code[ex], table.enc_len[ex])
        lv = levels(x[s:e][nz], None if thr is None else thr[s:e][nz], fixed)
        lv[ex[nz] == 255] = 0
        lb, _ = pack_fields(lv, torch.full_like(lv, 2))
        keep = 24 - 6 * lv
        field = (b[nz] >> 31 << 23 | (b[nz] & 0x7FFFFF)) >> (6 * lv)
        mb_, mb = pack_fields(field, keep)
        nnz = int(nz.sum())
        nbytes = fmt.data_bytes(eb, nnz, mb)
        heads += [offset, nbytes, e - s, nnz, eb, mb]
        datas += [xb, lb, mb_]
        offset += nbytes
    words = fmt.block_header(table.table_id, table.n_theta, k, n, offset) + heads
    return torch.cat([fmt.words_to_bytes(words), *datas])


def decode_exponents(stream: torch.Tensor, nbits: int, n: int, table: Table) -> torch.Tensor:
    """The n exponents of a stream of ``nbits`` bits (PayloadError if it does not
    hold exactly n valid codes)."""
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    nt = table.n_theta
    pos = torch.arange(nbits, dtype=torch.int64)
    win = read_fields(stream, pos, nt)
    ln = table.lut_len[win]
    end, bad = nbits, nbits + 1
    nxt = pos + ln
    nxt[(ln == 0) | (nxt > nbits)] = bad
    jump = torch.cat([nxt, torch.tensor([end, bad])])
    reached = torch.zeros(nbits + 2, dtype=torch.bool)
    reached[0] = True
    span = 1
    while span < n + 1:
        reached[jump[reached.nonzero().flatten()]] = True
        jump = jump[jump]
        span *= 2
    starts = reached[:nbits].nonzero().flatten()
    if bool(reached[bad]) or not bool(reached[end]) or starts.numel() != n:
        raise PayloadError("gcomp: the exponent stream does not hold exactly its values' codes")
    sym = table.lut_sym[win[starts]]
    esc = sym == ESC
    if bool(esc.any()):
        raw = read_fields(stream, starts[esc] + nt, 8)
        if bool((table.lengths[raw] <= nt).any()):
            raise PayloadError("gcomp: an escaped exponent has a short code")
        sym[esc] = raw
    return sym


def decode(payload: torch.Tensor, n: int, table: Table, chunk_values: int) -> torch.Tensor:
    """The n float32 values of a block."""
    heads = fmt.parse(payload, n, table.table_id, table.n_theta, chunk_values)
    out = torch.zeros(n, dtype=torch.int64)
    for c, (off, _nb, vals, nnz, eb, mb) in enumerate(heads.tolist()):
        s = c * chunk_values
        e1 = off + (eb + 7) // 8
        e2 = e1 + (2 * nnz + 7) // 8
        ex = decode_exponents(payload[off:e1], eb, vals, table)
        nz = ex != 0
        if int(nz.sum()) != nnz:
            raise PayloadError(
                f"gcomp: chunk {c} has {int(nz.sum())} non-zero exponents, header {nnz}"
            )
        lv = read_fields(payload[e1:e2], torch.arange(nnz, dtype=torch.int64) * 2, 2)
        keep = 24 - 6 * lv
        if int(keep.sum()) != mb:
            raise PayloadError(f"gcomp: chunk {c} mantissa stream length does not match its levels")
        starts = torch.cumsum(keep, 0) - keep
        field = read_fields(payload[e2 : e2 + (mb + 7) // 8], starts, keep)
        sign = (field >> (keep - 1)) & 1
        mant = (field & ((1 << (keep - 1)) - 1)) << (6 * lv)
        out[s : s + vals][nz] = sign << 31 | ex[nz] << 23 | mant
    return out.to(torch.int32).view(torch.float32)


def histogram(x: torch.Tensor) -> torch.Tensor:
    """[256] int64 counts of the float32 exponents of x."""
    ex = (x.reshape(-1).view(torch.int32) >> 23) & 0xFF
    return torch.bincount(ex, minlength=256).to(torch.int64)
