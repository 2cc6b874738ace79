"""The numba functions behind :mod:`hopq.codecs.dynamiq.kernels_cpu` (imported only when
numba is installed). Module-level so that numba's on-disk cache finds them
again in every process (closures miss it). The width is a compile-time constant
of each ``segmentW`` (one specialised function per width), so unpacking and
packing unroll.

What keeps the loops vectorized (8 float32/int32 lanes on AVX2; each point
measured on the fused hop, 4 ranks, one core of the development machine):
``error_model="numpy"`` (numba's default Python error model guards every float
division with a ZeroDivisionError branch, which leaves those loops scalar:
2-bit 126 -> 247, 4-bit 119 -> 215 M coordinates/s with the int32 changes), and
int32 arithmetic through the intrinsics of :mod:`hopq.numerics.u32` where numba would widen it
to int64 (the correlated-rounding permutation: 4 lanes of emulated 64-bit
multiplies before). Table lookups stay scalar loads inside those loops, so
tables hold two values per 64-bit entry (a level and its gap; a bucket's first
level and the level above it) and one load fetches both: 8-bit hops 169-178
-> 189-194, 4-bit 314-316 -> 346-348 M coordinates/s. The copies in and out of
a segment's rows and the code bytes index with unsigned integers (numba adds
negative-index wrap-around code to signed ones, which kept those loops
scalar): 8-bit hops 165-176 -> 218-219, 4-bit 303-308 -> 388-420 (2026-11-25,
`hopq bench kernels`, the same machine, alternating). Since then the one-step
bucket search reads its two values from two tables in one loop, which beat
the 64-bit pair read in one loop and split in the next (8-bit hops 213-229 ->
226-239, six alternating runs of one harness)."""

# ruff: noqa: E501
# mypy: ignore-errors

import numpy as np
from numba import njit

from hopq.kernels import Mode
from hopq.numerics.u32 import U32, add32, hash32, iadd32, iand32, imul32, lshr32, uniform

I32 = np.int32

# plain ints: numba compiles them in as constants
ENCODE, DECODE, DECODE_ACC = int(Mode.ENCODE), int(Mode.DECODE), int(Mode.DECODE_ACC)


ABS = np.int32(0x7FFFFFFF)
BIG = np.float32(2.0**120)  # hopq.codecs.dynamiq.reference.BIG_SCALE
FLOAT_MAX = float(np.finfo(np.float32).max)  # hopq.codecs.dynamiq.codec._FLOAT_MAX
FASTMOD_MAX = 1 << 16  # fastmod below is exact for numerators and divisors < 2^16
POW2_MAX = 1 << 15  # (2u + 1) me stays below 2^31
COUNT_MAX = 8  # tables of at most this many levels below the top: counted, not searched


@njit(inline="always")
def fastmod16(a, c, d):
    """a % d for a, d < 2^16, with c = ceil(2^32 / d) (Lemire, Kaser and Kurz
    2019: exact when 32 >= 16 + log2(d)); multiplies instead of dividing."""
    return np.int32((((c * np.uint64(a)) & np.uint64(0xFFFFFFFF)) * np.uint64(d)) >> np.uint64(32))


@njit(inline="always")
def uniforms(ubuf, count, first, g0, g1, p0, p1, n, me, pm, ib, tb):
    """u of the reference's _uniforms for entries first .. first + count, into ubuf[:count].
    ``pm[u] = (units[u] * me) % n``; ``ib``/``tb`` are int32 temporary buffers. Split into
    simple loops so that each vectorizes (the hashes in 8 uint32 lanes)."""
    idx = U32(first)
    for j in range(count):
        ubuf[j] = uniform(idx, g0, g1)
        idx = add32(idx, U32(1))
    base = U32(first)
    if n > 1:
        nu = pm.size
        n32 = np.int32(n)
        fn = np.float32(n)
        if n & (n - 1) == 0 and n <= POW2_MAX:
            # n a power of two: the units are the odd numbers below n in order
            # (mult = 2 u + 1) and every modulo is a mask; one loop, no gather
            m = n32 - np.int32(1)
            hm = np.int32(nu - 1)
            me32 = np.int32(me)
            idx = U32(first)
            for j in range(count):
                h = hash32(idx, p0, p1)
                idx = add32(idx, U32(1))
                ui = iand32(I32(lshr32(h, U32(16))), hm)
                mult = iadd32(iadd32(ui, ui), I32(1))
                # h & m = (h & 0xFFFF) & m: m < POW2_MAX <= 2^16
                pi = iand32(iadd32(imul32(mult, me32), iand32(I32(h), m)), m)
                ubuf[j] = (np.float32(pi) + ubuf[j]) / fn
            return
        if n < FASTMOD_MAX:
            cu = np.uint64(-(-(1 << 32) // nu))
            cn = np.uint64(-(-(1 << 32) // n))
            for j in range(count):
                h = hash32(base + U32(j), p0, p1)
                ib[j] = fastmod16(h >> U32(16), cu, nu)
                tb[j] = fastmod16(h & U32(0xFFFF), cn, n)
        else:
            for j in range(count):
                h = np.int64(hash32(base + U32(j), p0, p1))
                ib[j] = np.int32((h >> 16) % nu)
                tb[j] = np.int32((h & 0xFFFF) % n)
        for j in range(count):
            tb[j] += pm[ib[j]]  # (mult * me) % n + shift % n, < 2n
        for j in range(count):
            pi = tb[j]
            pi = pi - n32 if pi >= n32 else pi
            ubuf[j] = (np.float32(pi) + ubuf[j]) / fn


@njit(inline="always")
def unit_multiples(units, n, me):
    pm = np.empty(units.size, np.int32)
    for u in range(units.size):
        pm[u] = np.int32((np.int64(units[u]) * me) % n)
    return pm


@njit(inline="always")
def stage(mode, dec, local, base, m, x, outf):
    """The values a hop encodes, in x[:m]: ``local[base:]`` (ENCODE) or the decoded
    ``dec`` plus it; DECODE and DECODE_ACC write their result to ``outf[base:]``
    instead and return True (nothing to encode)."""
    bu = np.uint64(base)
    if mode == ENCODE:
        for i in range(m):
            x[i] = local[bu + np.uint64(i)]
        return False
    if mode == DECODE:
        for i in range(m):
            outf[bu + np.uint64(i)] = dec[i]
        return True
    for i in range(m):
        x[i] = local[bu + np.uint64(i)] + dec[i]
    if mode == DECODE_ACC:
        for i in range(m):
            outf[bu + np.uint64(i)] = x[i]
        return True
    return False


@njit(inline="always")
def impl(
    w, mode, k, S, s, row0, inb, local, outf, outb,
    gk, pk, n, me, units, sk, tab, bucket, nb_log, steps,
):  # fmt: skip
    top = 1 << (w - 1)
    mask = (1 << w) - 1
    per_log = 0 if w == 8 else (1 if w == 4 else 2)
    per = 1 << per_log
    ng = S // s
    code_bytes = (S * w) >> 3
    codes_at = 2 * k + k * ng
    nbm = np.int32((1 << nb_log) - 1)
    fnb = np.float32(1 << nb_log)
    g0, g1 = U32(gk[0]), U32(gk[1])
    p0, p1 = U32(pk[0]), U32(pk[1])
    s0, s1 = U32(sk[0]), U32(sk[1])
    pm = unit_multiples(units, n, me)
    zero = np.float32(0.0)
    f255 = np.float32(255.0)
    tm = np.int32(top - 1)
    buf = np.empty(S, np.float32)
    bufi = buf.view(np.int32)
    ubuf = np.empty(S, np.float32)
    ybuf = np.empty(S, np.float32)
    gme = np.empty(S, np.float32)
    lvb = np.empty(S, np.int32)
    codes = np.empty(S, np.int32)
    ib = np.empty(S, np.int32)
    tb = np.empty(S, np.int32)
    gmi = np.empty(ng, np.int32)
    gmax = gmi.view(np.float32)
    sc = np.empty(1, np.int32)
    scf = sc.view(np.float32)
    dtab = np.empty(top, np.float32)
    for i in range(top):
        dtab[i] = tab[i + 1] - tab[i]  # the reference's hi - lo
    # 64-bit entries, so that one gather fetches two values: ltab[lv] = (the
    # level, its gap) as float32 pairs
    pk = np.empty(S, np.uint64)
    pkf = pk.view(np.float32)
    ltab = np.empty(top, np.uint64)
    ltf = ltab.view(np.float32)
    for i in range(top):
        ltf[2 * i] = tab[i]
        ltf[2 * i + 1] = dtab[i]
    # the one-step bucket search: bucket b's first level and the level above
    # it, in two tables read in the same loop (a 64-bit table of both, read in
    # one loop and split in another, was 3-5% slower per hop)
    nbk = bucket.size if top > COUNT_MAX else 0
    bst = np.empty(nbk, np.int32)
    blv = np.empty(nbk, np.float32)
    for b in range(nbk):
        blv[b] = tab[bucket[b] + 1]
        bst[b] = bucket[b]
    for r in range(k):
        R = row0 + r
        base = r * S
        if mode != ENCODE:
            # -- decode (+ accumulate), in loops that vectorize: scales spread
            # per entry, codes unpacked, magnitudes looked up and scaled, the
            # sign put in as a bit (what the reference's negation does).
            sc[0] = np.int32((np.int32(inb[2 * r]) | (np.int32(inb[2 * r + 1]) << 8)) << 16)
            M = scf[0]
            cb = codes_at + r * code_bytes
            for gi in range(ng):
                rg = np.float32(inb[2 * k + r * ng + gi])
                # reference.group_scales: no overflow for huge M
                sf = rg * M / f255 if M < BIG else rg * (M / f255)
                for t in range(s):
                    gme[gi * s + t] = sf
            cbu = np.uint64(cb)
            for o in range(code_bytes):
                byte = np.int32(inb[cbu + np.uint64(o)])
                for t in range(per):
                    codes[o * per + t] = (byte >> (t * w)) & mask
            for j in range(S):
                buf[j] = tab[codes[j] & tm] * gme[j]
            for j in range(S):
                bufi[j] ^= (codes[j] >> (w - 1)) << 31
        if stage(mode, buf, local, base, S, buf, outf):
            continue
        # -- encode: scales. Maxima of |x| on the bit patterns (same order as
        # the floats for x >= 0; a NaN's pattern tops them all, like amax).
        mi = np.int32(0)
        for gi in range(ng):
            gm = np.int32(0)
            for t in range(s):
                gm = max(gm, bufi[gi * s + t] & ABS)
            gmi[gi] = gm
            mi = max(mi, gm)
        if mi > 0x7F800000:  # a NaN: torch's amax returns the canonical one
            mi = np.int32(0x7FC00000)
        mb = (np.int64(mi) + 0xFFFF) >> 16  # round_up_bf16
        if mb == 0x7F80 and mi < 0x7F800000:  # finite in, finite out: the largest bf16
            mb = 0x7F7F
        sc[0] = np.int32((mb & 0xFFFF) << 16)
        Mf = scf[0]
        outb[2 * r] = np.uint8(mb & 0xFF)
        outb[2 * r + 1] = np.uint8((mb >> 8) & 0xFF)
        for gi in range(ng):
            g = gmax[gi] / Mf * f255 if Mf > zero else zero
            if not (abs(g) < np.float32(np.inf)):  # nan_to_num
                g = zero
            us = uniform(U32(R * ng + gi), s0, s1)
            fl = np.floor(g)
            q = fl + (np.float32(1.0) if us < g - fl else zero)
            outb[2 * k + r * ng + gi] = np.uint8(min(max(q, zero), f255))
        # -- encode: entries --------------------------------------------
        uniforms(ubuf, S, R * S, g0, g1, p0, p1, n, me, pm, ib, tb)
        for gi in range(ng):
            gm = gmax[gi]
            for t in range(s):
                gme[gi * s + t] = gm
        for j in range(S):
            gm = gme[j]
            ybuf[j] = abs(buf[j]) / gm if gm > zero else zero
        if top == 1:  # levels {0, 1}: p = (y - 0) / (1 - 0) = y
            for j in range(S):
                codes[j] = np.int32(ubuf[j] < ybuf[j]) | (np.int32(buf[j] < zero) << (w - 1))
        else:
            if top <= COUNT_MAX:
                # small tables: the level is the number of levels 1 .. top-1 at
                # or below y (the reference's searchsorted index), counted in a
                # loop that vectorizes; a NaN goes to the top level below
                for j in range(S):
                    y = ybuf[j]
                    lv = I32(0)
                    for i in range(1, top):
                        lv += np.int32(tab[i] <= y)
                    lvb[j] = lv if y == y else tm
            else:
                if steps == 1:
                    for j in range(S):
                        y = ybuf[j]
                        bi = min(np.int32((y if y == y else zero) * fnb), nbm)
                        lv = bst[bi] + np.int32(blv[bi] <= y)
                        lvb[j] = min(lv, tm) if y == y else tm
                else:
                    for j in range(S):  # a bucket table gives a start a few levels below
                        y = ybuf[j]
                        lvb[j] = bucket[min(np.int32((y if y == y else zero) * fnb), nbm)]
                    for _ in range(steps):  # step up while the next level is <= y
                        for j in range(S):
                            lvb[j] += np.int32(tab[lvb[j] + 1] <= ybuf[j])
                    for j in range(S):
                        y = ybuf[j]
                        lvb[j] = min(lvb[j], tm) if y == y else tm
            for j in range(S):  # the level and its gap, in one 64-bit gather
                pk[j] = ltab[lvb[j]]
            sgn = I32(1 << (w - 1))
            for j in range(S):
                p = (ybuf[j] - pkf[2 * j]) / pkf[2 * j + 1]
                up = I32(1) if ubuf[j] < p else I32(0)
                neg = sgn if buf[j] < zero else I32(0)
                codes[j] = iadd32(lvb[j], up) | neg
        cb = codes_at + r * code_bytes
        cbu = np.uint64(cb)
        for o in range(code_bytes):
            acc = np.int32(0)
            for t in range(per):
                acc |= codes[o * per + t] << (t * w)
            outb[cbu + np.uint64(o)] = np.uint8(acc & 0xFF)


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def segment2(mode, k, S, s, row0, inb, local, outf, outb, gk, pk, n, me, units, sk, tab, bucket, nb_log, steps):  # fmt: skip
    impl(2, mode, k, S, s, row0, inb, local, outf, outb, gk, pk, n, me, units, sk, tab, bucket, nb_log, steps)  # fmt: skip


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def segment4(mode, k, S, s, row0, inb, local, outf, outb, gk, pk, n, me, units, sk, tab, bucket, nb_log, steps):  # fmt: skip
    impl(4, mode, k, S, s, row0, inb, local, outf, outb, gk, pk, n, me, units, sk, tab, bucket, nb_log, steps)  # fmt: skip


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def segment8(mode, k, S, s, row0, inb, local, outf, outb, gk, pk, n, me, units, sk, tab, bucket, nb_log, steps):  # fmt: skip
    impl(8, mode, k, S, s, row0, inb, local, outf, outb, gk, pk, n, me, units, sk, tab, bucket, nb_log, steps)  # fmt: skip


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def segment16(mode, k, S, row0, inb, local, outf, outb, gk, pk, n, me, units):
    """bf16 with stochastic rounding, in blocks of B entries whose temporary buffers stay
    in cache (whole-segment buffers cost page faults on every call)."""
    g0, g1 = U32(gk[0]), U32(gk[1])
    p0, p1 = U32(pk[0]), U32(pk[1])
    pm = unit_multiples(units, n, me)
    B = 4096
    xs = np.empty(B, np.float32)
    xi = xs.view(np.int32)
    vi = np.empty(B, np.int32)
    v = vi.view(np.float32)
    ubuf = np.empty(B, np.float32)
    ib = np.empty(B, np.int32)
    tb = np.empty(B, np.int32)
    total = k * S
    for b0 in range(0, total, B):
        m = min(B, total - b0)
        if mode != ENCODE:
            for i in range(m):
                q = 2 * (b0 + i)
                vi[i] = np.int32((np.int32(inb[q]) | (np.int32(inb[q + 1]) << 8)) << 16)
        if stage(mode, v, local, b0, m, xs, outf):
            continue
        uniforms(ubuf, m, row0 * S + b0, g0, g1, p0, p1, n, me, pm, ib, tb)
        for i in range(m):
            # bf16 rounded up with probability (low 16 bits) / 2^16, on the bits
            up = (np.int64(xi[i]) + np.int64(ubuf[i] * np.float32(65536.0))) >> 16
            if (up & 0x7FFF) == 0x7F80 and (xi[i] & ABS) < 0x7F800000:  # saturate, as the reference
                up -= 1
            q = 2 * (b0 + i)
            outb[q] = np.uint8(up & 0xFF)
            outb[q + 1] = np.uint8((up >> 8) & 0xFF)


SEGMENT = {2: segment2, 4: segment4, 8: segment8, 16: segment16}


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def supergroup_stats(x, S, out):
    """out[0, j] = mean, out[1, j] = sum of squares of super-group j, both summed
    in numerics.reduce.tree_sum's order (halves added pairwise). The first level
    reads x directly (a full row's loop has no padding test and vectorizes), and
    a row's non-zero test runs only when its squares sum to zero (underflow)."""
    d = x.size
    m = out.shape[1]
    if S == 1:
        for r in range(m):
            out[0, r] = x[r]
            sq = x[r] * x[r]
            out[1, r] = np.float32(1.1754943508222875e-38) if sq == 0 and x[r] != 0 else sq
        return
    h0 = S // 2
    a = np.empty(S, np.float32)
    q = np.empty(S, np.float32)
    for r in range(m):
        base = r * S
        cnt = min(S, d - base)
        if cnt == S:
            for j in range(h0):
                u = x[base + j]
                v = x[base + j + h0]
                a[j] = u + v
                q[j] = u * u + v * v
        else:
            for j in range(h0):
                u = x[base + j] if j < cnt else np.float32(0.0)
                v = x[base + j + h0] if j + h0 < cnt else np.float32(0.0)
                a[j] = u + v
                q[j] = u * u + v * v
        h = h0 // 2
        while h >= 1:
            for j in range(h):
                a[j] = a[j] + a[j + h]
                q[j] = q[j] + q[j + h]
            h //= 2
        out[0, r] = a[0] / np.float32(cnt)
        sq = q[0]
        if sq == 0:
            for j in range(cnt):
                if x[base + j] != 0:
                    sq = np.float32(1.1754943508222875e-38)  # the smallest normal
                    break
        out[1, r] = sq


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def gather_rows(x, perm, mu, S, out):
    """out row k = (x row perm[k]) - mu[perm[k]], the padding exactly zero."""
    d = x.size
    for k in range(perm.size):
        src = perm[k]
        base = src * S
        cnt = min(S, d - base)
        m = mu[src]
        bu = np.uint64(base)
        ou = np.uint64(k * S)
        for j in range(cnt):
            out[ou + np.uint64(j)] = x[bu + np.uint64(j)] - m
        for j in range(cnt, S):
            out[ou + np.uint64(j)] = np.float32(0.0)


@njit(nogil=True, cache=True, boundscheck=False, error_model="numpy")
def scatter_rows(y, perm, mu, S, n, avg, sat, out):
    """out row perm[k] = y row k + n mu (sum) or y / n + mu (average), cut at out.size.
    With ``sat``: an infinite entry of a row whose mean is finite saturates at
    float32's largest value (``saturate_finite_rows``, done row by row here)."""
    d = out.size
    fn = np.float32(n)
    big = np.float32(FLOAT_MAX)
    inf = np.float32(np.inf)
    for k in range(perm.size):
        dst = perm[k]
        base = dst * S
        cnt = min(S, d - base)
        m = mu[dst]
        bu = np.uint64(base)
        yu = np.uint64(k * S)
        if avg:
            for j in range(cnt):
                out[bu + np.uint64(j)] = y[yu + np.uint64(j)] / fn + m
        else:
            mn = m * fn
            for j in range(cnt):
                out[bu + np.uint64(j)] = y[yu + np.uint64(j)] + mn
        if sat and abs(m) < inf:
            for j in range(cnt):
                v = out[bu + np.uint64(j)]
                out[bu + np.uint64(j)] = big if v == inf else (-big if v == -inf else v)
