"""GComp's exponent code (paper section 4): canonical, length-limited Huffman over
the 256 fp32 exponents, with the escape for long codes and a lookup table.

* Build (4.2): Huffman on a 256-bin histogram (every bin + 1, so that every
  exponent has a code), ties broken by a fixed order (weight, then node id:
  symbols are 0..255, internal nodes 256.. in creation order); lengths limited
  to :data:`MAX_LEN`; canonical codes in (length, symbol) order. The same
  histogram gives the same table on every rank.
* Escape (4.3): every code longer than ``n_theta`` is replaced by one special
  ``n_theta``-bit prefix (the first over-long code in canonical order, cut to
  ``n_theta`` bits) followed by the raw 8-bit exponent: n_theta + 8 bits.
* Decoding (4.5): a table of 2**n_theta entries (symbol, length); the escape
  entry has symbol :data:`ESC`; entries no code reaches have length 0 (invalid).
* The table id (named by every payload) is the CRC-32 of the code lengths and
  n_theta: a payload coded with another table is refused.
"""

from __future__ import annotations

import heapq
import zlib
from dataclasses import dataclass

import torch

#: Longest code length kept (canonical codes fit in 32 bits); longer codes are
#: shortened deterministically (Kraft sum kept <= 1). Only codes up to n_theta
#: bits ever travel, so this limit only shapes which prefix the escape takes.
MAX_LEN = 30
#: Symbol of the escape entry in the lookup table.
ESC = 256


@dataclass(frozen=True)
class Table:
    n_theta: int
    #: [256] int64 code length per exponent (its native Huffman length).
    lengths: torch.Tensor
    #: [256] int64: the bits that travel for each exponent (escape prefix + raw
    #: 8 bits for long codes) and their number.
    enc_code: torch.Tensor
    enc_len: torch.Tensor
    #: [2**n_theta] int64: decoded symbol (ESC for the escape) and code length
    #: (0: no code starts with these bits).
    lut_sym: torch.Tensor
    lut_len: torch.Tensor
    #: The escape prefix (-1 when no code is over-long).
    esc: int
    table_id: int


def huffman_lengths(hist: list[int]) -> list[int]:
    """Code lengths of a Huffman code for 256 weights (all > 0), deterministic."""
    heap: list[tuple[int, int]] = [(w, s) for s, w in enumerate(hist)]
    heapq.heapify(heap)
    parent: dict[int, int] = {}
    nxt = len(hist)
    while len(heap) > 1:
        w1, a = heapq.heappop(heap)
        w2, b = heapq.heappop(heap)
        parent[a] = parent[b] = nxt
        heapq.heappush(heap, (w1 + w2, nxt))
        nxt += 1
    lengths = []
    for s in range(len(hist)):
        d, v = 0, s
        while v in parent:
            v, d = parent[v], d + 1
        lengths.append(max(d, 1))
    return lengths


def limit_lengths(lengths: list[int], hist: list[int], max_len: int) -> list[int]:
    """Clamp to ``max_len`` and restore Kraft's inequality by lengthening the
    longest codes below ``max_len`` (rarest first, then the highest symbol)."""
    out = [min(n, max_len) for n in lengths]
    kraft = sum(1 << (max_len - n) for n in out)
    order = sorted(range(len(out)), key=lambda s: (hist[s], -s))
    while kraft > 1 << max_len:
        _, i = max((out[s], -i) for i, s in enumerate(order) if out[s] < max_len)
        s = order[-i]
        kraft -= 1 << (max_len - out[s] - 1)
        out[s] += 1
    return out


def canonical_codes(lengths: list[int]) -> list[int]:
    codes = [0] * len(lengths)
    code, prev = 0, 0
    for s in sorted(range(len(lengths)), key=lambda s: (lengths[s], s)):
        code <<= lengths[s] - prev
        prev = lengths[s]
        codes[s] = code
        code += 1
    return codes


def build_table(hist: torch.Tensor | list[int], n_theta: int) -> Table:
    """The table for a 256-bin exponent histogram (counts summed over ranks)."""
    counts = [int(c) + 1 for c in (hist.tolist() if isinstance(hist, torch.Tensor) else hist)]
    if len(counts) != 256:
        raise ValueError(f"gcomp: the exponent histogram has 256 bins, got {len(counts)}")
    lengths = limit_lengths(huffman_lengths(counts), counts, MAX_LEN)
    return table_from_lengths(lengths, n_theta)


def table_from_lengths(lengths: list[int], n_theta: int) -> Table:
    codes = canonical_codes(lengths)
    longs = sorted((s for s in range(256) if lengths[s] > n_theta), key=lambda s: (lengths[s], s))
    esc = codes[longs[0]] >> (lengths[longs[0]] - n_theta) if longs else -1
    enc_code, enc_len = [], []
    for s in range(256):
        if lengths[s] <= n_theta:
            enc_code.append(codes[s])
            enc_len.append(lengths[s])
        else:
            enc_code.append((esc << 8) | s)
            enc_len.append(n_theta + 8)
    size = 1 << n_theta
    lut_sym = [0] * size
    lut_len = [0] * size
    for s in range(256):
        n = lengths[s]
        if n <= n_theta:
            first = codes[s] << (n_theta - n)
            for e in range(first, first + (1 << (n_theta - n))):
                lut_sym[e], lut_len[e] = s, n
    if esc >= 0:
        lut_sym[esc], lut_len[esc] = ESC, n_theta + 8
    tid = zlib.crc32(bytes([n_theta, *lengths]))
    i64 = torch.int64
    return Table(
        n_theta,
        torch.tensor(lengths, dtype=i64),
        torch.tensor(enc_code, dtype=i64),
        torch.tensor(enc_len, dtype=i64),
        torch.tensor(lut_sym, dtype=i64),
        torch.tensor(lut_len, dtype=i64),
        esc,
        tid,
    )
