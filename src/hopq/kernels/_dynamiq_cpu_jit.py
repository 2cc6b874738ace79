"""The numba functions behind :mod:`hopq.kernels.dynamiq_cpu` (imported only when
numba is installed). Module-level so that numba's on-disk cache finds them
again in every process (closures miss it). The width is a compile-time constant
of each ``segmentW`` (one specialised function per width), so unpacking and
packing unroll."""

# ruff: noqa: E501
# mypy: ignore-errors

import numpy as np
from numba import njit

from hopq.kernels import Mode
from hopq.numerics.rng import M1, M2

# plain ints: numba compiles them in as constants
ENCODE, DECODE, DECODE_ACC = int(Mode.ENCODE), int(Mode.DECODE), int(Mode.DECODE_ACC)


MASK = np.uint64(0xFFFFFFFF)
U16, U15, U8 = np.uint64(16), np.uint64(15), np.uint64(8)
ABS = np.int32(0x7FFFFFFF)
BIG = np.float32(2.0**120)  # hopq.codecs.dynamiq.reference.BIG_SCALE


@njit(inline="always")
def mix(x):
    x = x ^ (x >> U16)
    x = (x * np.uint64(M1)) & MASK
    x = x ^ (x >> U15)
    x = (x * np.uint64(M2)) & MASK
    return x ^ (x >> U16)


@njit(inline="always")
def hash32(i, k0, k1):
    return mix(mix(np.uint64(i) ^ k0) ^ k1)


@njit(inline="always")
def uniform(i, k0, k1):
    return np.float32(hash32(i, k0, k1) >> U8) * np.float32(2.0**-24)


@njit(inline="always")
def uniforms(ubuf, first, g0, g1, p0, p1, n, me, units):
    """u of the reference's _uniforms for entries first .. first + len(ubuf)."""
    for j in range(ubuf.size):
        ubuf[j] = uniform(first + j, g0, g1)
    if n > 1:
        un = np.uint64(n)
        nu = np.uint64(units.size)
        fn = np.float32(n)
        for j in range(ubuf.size):
            h = hash32(first + j, p0, p1)
            mult = np.uint64(units[(h >> U16) % nu])
            pi = (mult * np.uint64(me) + (h & np.uint64(0xFFFF)) % un) % un
            ubuf[j] = (np.float32(pi) + ubuf[j]) / fn


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
    g0, g1 = np.uint64(gk[0]), np.uint64(gk[1])
    p0, p1 = np.uint64(pk[0]), np.uint64(pk[1])
    s0, s1 = np.uint64(sk[0]), np.uint64(sk[1])
    zero = np.float32(0.0)
    f255 = np.float32(255.0)
    tm = np.int32(top - 1)
    buf = np.empty(S, np.float32)
    bufi = buf.view(np.int32)
    ubuf = np.empty(S, np.float32)
    ybuf = np.empty(S, np.float32)
    lob = np.empty(S, np.float32)
    db = np.empty(S, np.float32)
    lvb = np.empty(S, np.int32)
    codes = np.empty(S, np.int32)
    gmi = np.empty(ng, np.int32)
    gmax = gmi.view(np.float32)
    sc = np.empty(1, np.int32)
    scf = sc.view(np.float32)
    dtab = np.empty(top + 1, np.float32)
    for i in range(top + 1):
        dtab[i] = tab[i + 1] - tab[i]  # the reference's hi - lo
    for r in range(k):
        R = row0 + r
        base = r * S
        if mode != ENCODE:
            # -- decode (+ accumulate) ------------------------------------
            sc[0] = np.int32((np.int32(inb[2 * r]) | (np.int32(inb[2 * r + 1]) << 8)) << 16)
            M = scf[0]
            cb = codes_at + r * code_bytes
            for gi in range(ng):
                rg = np.float32(inb[2 * k + r * ng + gi])
                # reference.group_scales: no overflow for huge M
                sf = rg * M / f255 if M < BIG else rg * (M / f255)
                for t in range(s):
                    j = gi * s + t
                    c = (np.int32(inb[cb + (j >> per_log)]) >> ((j & (per - 1)) * w)) & mask
                    mag = tab[c & (top - 1)] * sf
                    buf[j] = -mag if c >= top else mag
            if mode == DECODE:
                for j in range(S):
                    outf[base + j] = buf[j]
                continue
            for j in range(S):
                buf[j] = local[base + j] + buf[j]
            if mode == DECODE_ACC:
                for j in range(S):
                    outf[base + j] = buf[j]
                continue
        else:
            for j in range(S):
                buf[j] = local[base + j]
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
            us = uniform(R * ng + gi, s0, s1)
            fl = np.floor(g)
            q = fl + (np.float32(1.0) if us < g - fl else zero)
            outb[2 * k + r * ng + gi] = np.uint8(min(max(q, zero), f255))
        # -- encode: entries --------------------------------------------
        uniforms(ubuf, R * S, g0, g1, p0, p1, n, me, units)
        for gi in range(ng):
            gm = gmax[gi]
            for t in range(s):
                j = gi * s + t
                ybuf[j] = abs(buf[j]) / gm if gm > zero else zero
        if top == 1:  # levels {0, 1}: p = (y - 0) / (1 - 0) = y
            for j in range(S):
                codes[j] = np.int32(ubuf[j] < ybuf[j]) | (np.int32(buf[j] < zero) << (w - 1))
        else:
            for j in range(S):  # the level search (scalar: gathers)
                y = ybuf[j]
                b = min(np.int32((y if y == y else zero) * fnb), nbm)
                lv = bucket[b]
                # step up while the next level is <= y (an extra step is harmless)
                lv += np.int32(tab[lv + 1] <= y)
                lv += np.int32(tab[lv + 1] <= y)
                lvb[j] = lv
            if steps > 2:  # uneven tables (large eps) only
                for j in range(S):
                    for _ in range(steps - 2):
                        lvb[j] += np.int32(tab[lvb[j] + 1] <= ybuf[j])
            for j in range(S):
                y = ybuf[j]
                lv = min(lvb[j], tm) if y == y else tm
                lvb[j] = lv
                lob[j] = tab[lv]
                db[j] = dtab[lv]
            for j in range(S):
                p = (ybuf[j] - lob[j]) / db[j]
                codes[j] = (lvb[j] + np.int32(ubuf[j] < p)) | (np.int32(buf[j] < zero) << (w - 1))
        cb = codes_at + r * code_bytes
        for o in range(code_bytes):
            acc = np.int32(0)
            for t in range(per):
                acc |= codes[o * per + t] << (t * w)
            outb[cb + o] = np.uint8(acc & 0xFF)


@njit(nogil=True, cache=True, boundscheck=False)
def segment2(mode, k, S, s, row0, inb, local, outf, outb, gk, pk, n, me, units, sk, tab, bucket, nb_log, steps):  # fmt: skip
    impl(2, mode, k, S, s, row0, inb, local, outf, outb, gk, pk, n, me, units, sk, tab, bucket, nb_log, steps)  # fmt: skip


@njit(nogil=True, cache=True, boundscheck=False)
def segment4(mode, k, S, s, row0, inb, local, outf, outb, gk, pk, n, me, units, sk, tab, bucket, nb_log, steps):  # fmt: skip
    impl(4, mode, k, S, s, row0, inb, local, outf, outb, gk, pk, n, me, units, sk, tab, bucket, nb_log, steps)  # fmt: skip


@njit(nogil=True, cache=True, boundscheck=False)
def segment8(mode, k, S, s, row0, inb, local, outf, outb, gk, pk, n, me, units, sk, tab, bucket, nb_log, steps):  # fmt: skip
    impl(8, mode, k, S, s, row0, inb, local, outf, outb, gk, pk, n, me, units, sk, tab, bucket, nb_log, steps)  # fmt: skip


@njit(nogil=True, cache=True, boundscheck=False)
def segment16(mode, k, S, row0, inb, local, outf, outb, gk, pk, n, me, units):
    g0, g1 = np.uint64(gk[0]), np.uint64(gk[1])
    p0, p1 = np.uint64(pk[0]), np.uint64(pk[1])
    xs = np.empty(k * S, np.float32)
    xi = xs.view(np.int32)
    ubuf = np.empty(k * S, np.float32)
    if mode != ENCODE:
        vi = np.empty(k * S, np.int32)
        for i in range(k * S):
            vi[i] = np.int32((np.int32(inb[2 * i]) | (np.int32(inb[2 * i + 1]) << 8)) << 16)
        v = vi.view(np.float32)
        if mode == DECODE:
            for i in range(k * S):
                outf[i] = v[i]
            return
        for i in range(k * S):
            xs[i] = local[i] + v[i]
        if mode == DECODE_ACC:
            for i in range(k * S):
                outf[i] = xs[i]
            return
    else:
        for i in range(k * S):
            xs[i] = local[i]
    uniforms(ubuf, row0 * S, g0, g1, p0, p1, n, me, units)
    for i in range(k * S):
        # bf16 rounded up with probability (low 16 bits) / 2^16, on the bits
        up = (np.int64(xi[i]) + np.int64(ubuf[i] * np.float32(65536.0))) >> 16
        if (up & 0x7FFF) == 0x7F80 and (xi[i] & ABS) < 0x7F800000:  # saturate, as the reference
            up -= 1
        outb[2 * i] = np.uint8(up & 0xFF)
        outb[2 * i + 1] = np.uint8((up >> 8) & 0xFF)


SEGMENT = {2: segment2, 4: segment4, 8: segment8, 16: segment16}


@njit(nogil=True, cache=True, boundscheck=False)
def supergroup_stats(x, S, out):
    """out[0, j] = mean, out[1, j] = sum of squares of super-group j, both summed
    in numerics.reduce.tree_sum's order (halves added pairwise)."""
    d = x.size
    m = out.shape[1]
    a = np.empty(S, np.float32)
    q = np.empty(S, np.float32)
    for r in range(m):
        base = r * S
        cnt = min(S, d - base)
        nz = False
        for j in range(S):
            v = x[base + j] if j < cnt else np.float32(0.0)
            nz |= v != 0
            a[j] = v
            q[j] = v * v
        h = S // 2
        while h >= 1:
            for j in range(h):
                a[j] = a[j] + a[j + h]
                q[j] = q[j] + q[j + h]
            h //= 2
        out[0, r] = a[0] / np.float32(cnt)
        sq = q[0]
        if nz and sq == 0:
            sq = np.float32(1.1754943508222875e-38)  # the smallest normal
        out[1, r] = sq


@njit(nogil=True, cache=True, boundscheck=False)
def gather_rows(x, perm, mu, S, out):
    """out row k = (x row perm[k]) - mu[perm[k]], the padding exactly zero."""
    d = x.size
    for k in range(perm.size):
        src = perm[k]
        base = src * S
        cnt = min(S, d - base)
        m = mu[src]
        for j in range(cnt):
            out[k * S + j] = x[base + j] - m
        for j in range(cnt, S):
            out[k * S + j] = np.float32(0.0)


@njit(nogil=True, cache=True, boundscheck=False)
def scatter_rows(y, perm, mu, S, n, avg, out):
    """out row perm[k] = y row k + n mu (sum) or y / n + mu (average), cut at out.size."""
    d = out.size
    fn = np.float32(n)
    for k in range(perm.size):
        dst = perm[k]
        base = dst * S
        cnt = min(S, d - base)
        if avg:
            m = mu[dst]
            for j in range(cnt):
                out[base + j] = y[k * S + j] / fn + m
        else:
            m = mu[dst] * fn
            for j in range(cnt):
                out[base + j] = y[k * S + j] + m
