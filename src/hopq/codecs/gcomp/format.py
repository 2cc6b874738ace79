"""GComp's payload layout (paper 6.1, Fig. 7; widths and order are hopq's).

One payload per plan chunk = one *block*: a block header, one header per *chunk*
of at most ``chunk_values`` values, then the chunks' data. All words are
little-endian uint32.

Block header (8 words, 32 bytes)::

    magic "GCMP" | version, dtype (0 = fp32), n_theta, 0 | table id | chunks |
    original bits (2 words) | compressed bits (2 words)

Chunk header (6 words, 24 bytes)::

    byte offset of its data | data bytes | values | values with exponent != 0 |
    exponent-stream bits | mantissa-stream bits

Chunk data: the Huffman-coded exponents (MSB first), then a 2-bit truncation
level per non-zero value, then the sign + kept mantissa bits of each non-zero
value (24, 18, 12 or 6 bits); each stream padded to a byte, so a decoder knows
where every segment starts without decoding the previous one.

Every field is checked against what the plan implies before any stream is
read (:func:`parse`): a corrupt, truncated or foreign payload raises
:class:`~hopq.PayloadError`.
"""

from __future__ import annotations

import torch

from hopq.errors import PayloadError

MAGIC = 0x504D4347  # "GCMP" little-endian
VERSION = 1
BLOCK_WORDS, CHUNK_WORDS = 8, 6
BLOCK_BYTES, CHUNK_BYTES = 4 * BLOCK_WORDS, 4 * CHUNK_WORDS
#: Kept bits per level: sign + 23 - (0, 6, 12, 18) mantissa bits.
KEEP = (24, 18, 12, 6)


def n_chunks(n: int, chunk_values: int) -> int:
    return -(-n // chunk_values)


def data_bytes(exp_bits: int, nnz: int, man_bits: int) -> int:
    return (exp_bits + 7) // 8 + (2 * nnz + 7) // 8 + (man_bits + 7) // 8


def bound(n: int, chunk_values: int, n_theta: int) -> int:
    """Largest payload for n values: every exponent escaped, no truncation."""
    k = n_chunks(n, chunk_values)
    return BLOCK_BYTES + k * CHUNK_BYTES + (n * (n_theta + 8 + 2 + 24) + 8 * 3 * k) // 8 + 3 * k


def block_header(table_id: int, n_theta: int, k: int, n: int, total: int) -> list[int]:
    orig, comp = 32 * n, 8 * total
    return [
        MAGIC,
        VERSION | (0 << 8) | (n_theta << 16),
        table_id,
        k,
        orig & 0xFFFFFFFF,
        orig >> 32,
        comp & 0xFFFFFFFF,
        comp >> 32,
    ]


def words_to_bytes(words: list[int]) -> torch.Tensor:
    return torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.uint8)


def parse(
    payload: torch.Tensor, n: int, table_id: int, n_theta: int, chunk_values: int
) -> torch.Tensor:
    """Validate the headers of a payload that must hold ``n`` values coded with
    table ``table_id``; return [chunks, 6] int64 chunk headers."""
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise PayloadError(
            f"gcomp: a payload must be a contiguous 1-D uint8 tensor, got {payload.dtype} "
            f"{tuple(payload.shape)} with strides {payload.stride()}"
        )
    size = payload.numel()
    k = n_chunks(n, chunk_values)
    need = BLOCK_BYTES + k * CHUNK_BYTES
    if size < need:
        raise PayloadError(f"gcomp: payload of {size} bytes is shorter than its headers ({need})")
    head = payload[:need].clone().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    b = head[:BLOCK_WORDS].tolist()
    if b[0] != MAGIC:
        raise PayloadError("gcomp: not a GComp payload (bad magic)")
    if b[1] != VERSION | (n_theta << 16):
        raise PayloadError(
            f"gcomp: version/dtype/n_theta word {b[1]:#x}, expected {VERSION | (n_theta << 16):#x}"
        )
    if b[2] != table_id:
        raise PayloadError(
            f"gcomp: payload coded with table {b[2]:#010x}, this call's table is {table_id:#010x}"
        )
    if b[3] != k:
        raise PayloadError(f"gcomp: payload has {b[3]} chunks, {n} values need {k}")
    if b[4] | (b[5] << 32) != 32 * n or b[6] | (b[7] << 32) != 8 * size:
        raise PayloadError("gcomp: block lengths do not match the payload and the plan")
    ch = head[BLOCK_WORDS:].view(k, CHUNK_WORDS)
    if k == 0:
        if size != need:
            raise PayloadError(f"gcomp: empty payload has {size - need} trailing bytes")
        return ch
    rows = ch.tolist()
    offset = need
    for i, (off, nbytes, vals, nnz, eb, mb) in enumerate(rows):
        want_vals = min(chunk_values, n - i * chunk_values)
        if off != offset or vals != want_vals or nnz > vals:
            raise PayloadError(f"gcomp: chunk {i} header is inconsistent (offset/values/non-zeros)")
        if not vals <= eb <= vals * (n_theta + 8) or not 6 * nnz <= mb <= 24 * nnz:
            raise PayloadError(f"gcomp: chunk {i} stream lengths are out of range")
        if nbytes != data_bytes(eb, nnz, mb):
            raise PayloadError(f"gcomp: chunk {i} data length does not match its streams")
        offset += nbytes
    if offset != size:
        raise PayloadError(f"gcomp: chunks end at byte {offset}, the payload has {size}")
    return ch
