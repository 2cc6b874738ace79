"""Variable-size payloads as an engine capability (DESIGN.md, "Variable-size
payloads"): the plan gives bounds, each message's header the real sizes; the
bytes counted are the bytes sent, the simulator equals a real Gloo run."""

import pytest
import torch

import hopq
from hopq.comm import framing
from tests.varsize_codec import VarBf16


def _inputs(n, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) for _ in range(n)]


@pytest.mark.parametrize("topology", ["ring", "butterfly"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_variable_payloads_same_bits_real_bytes(topology, n):
    for size in (0, 1, 7, 1000):
        xs = _inputs(n, size, seed=size + n)
        var = hopq.simulate(xs, VarBf16(), topology, seed=1)
        ref = hopq.simulate(xs, "bf16", topology, seed=1)
        assert var.identical
        for a, b in zip(var.outputs, ref.outputs, strict=True):
            assert torch.equal(a, b)  # the filler changes sizes, never values
        # bytes counted: bf16's plus the header and filler of every payload sent
        extra = [v - b for v, b in zip(var.bytes_sent, ref.bytes_sent, strict=True)]
        if n > 1 and size:
            assert all(e >= 4 for e in extra)
            assert len(set(extra)) > 1 or size == 1  # sizes differ across ranks


def test_counted_bytes_equal_produced_payloads():
    """Every byte counted is a payload byte some rank produced and sent: per rank,
    the engine's count equals the sizes its codec produced (leaves and fused hops)
    plus the final payloads it forwards in the all-gather."""
    from hopq.sim import virtual_ranks

    n = 4
    xs = _inputs(n, 4001, seed=3)
    codec = VarBf16()
    r = hopq.simulate(xs, codec, "ring", seed=2, microshards=1)
    ranks = virtual_ranks(codec)
    bound = 4 + 2 * 1001 + 37 + 100
    for q in range(n):
        sent = r.stats[q].payload_bytes
        produced = ranks[q].produced
        # ring: rank q encodes n chunks (n - 1 sent in the reduce-scatter, its own
        # final payload sent in the first all-gather step), then forwards n - 2
        # final payloads of other owners, whose sizes those owners produced
        owned_final = produced[-1]
        forwarded = sum(ranks[p].produced[-1] for p in range(n) if p != q and p != (q + 1) % n)
        assert sent == sum(produced[:-1]) + owned_final + forwarded
        assert sent < 2 * (n - 1) * bound - 100
    assert len({r.stats[q].payload_bytes for q in range(n)}) > 1


def test_a_header_reads_the_same_at_any_offset_of_a_buffer():
    """Headers are read in place from aligned buffers and through a copy
    otherwise: the same words either way, as they were written."""
    where = framing.Where("t", 7, 3, 2)
    h = framing.frame(where, [5, 9], ident=11)
    want = [framing.MAGIC, 7, where.tag(), 2 << framing.PARTS_SHIFT, 11, 5, 9]
    for off in (0, 1, 8, 13):
        buf = torch.zeros(off + h.numel() + 4, dtype=torch.uint8)
        buf[off : off + h.numel()] = h
        assert framing.peek(buf[off:]) == want, off
        head, _ = framing.unpack([buf[off:]], 2, 4)
        assert framing.check(head, where, 0, 1, [5, 9], exact=False) == [5, 9], off


def test_padding_for_exact_size_transports():
    h = framing.frame(framing.Where("t", 1, 0), [3])
    body = torch.arange(3, dtype=torch.uint8)
    (msg,) = framing.pack(h, body, 10, pad=True)
    assert msg.numel() == framing.header_nbytes(1) + 10
    head, got = framing.unpack([msg], 1, 10)
    assert framing.check(head, framing.Where("t", 1, 0), 0, 1, [10], exact=False) == [3]
    assert torch.equal(got[:3], body)
    big = torch.ones(framing.COALESCE_BYTES + 5, dtype=torch.uint8)
    parts = framing.pack(h, big[:7], big.numel(), pad=True)
    assert [p.numel() for p in parts] == framing.expect(1, big.numel(), room=False)


@pytest.mark.filterwarnings("ignore:.*padded to their bound")
def test_engine_pads_where_the_transport_needs_exact_sizes(monkeypatch):
    """A transport without short messages (NCCL) gets bound-sized bodies, and the
    engine counts the padded bytes it really sent; the bits do not change."""
    from hopq.comm import transport as tr

    xs = _inputs(3, 500, seed=9)
    ref = hopq.simulate(xs, VarBf16(), "ring", seed=1)
    monkeypatch.setattr(tr.InProcessTransport, "short_messages", False)
    padded = hopq.simulate(xs, VarBf16(), "ring", seed=1)
    for a, b in zip(ref.outputs, padded.outputs, strict=True):
        assert torch.equal(a, b)
    assert all(p > q for p, q in zip(padded.bytes_sent, ref.bytes_sent, strict=True))


def test_gloo_run_equals_simulator():
    from hopq.cluster.launch import run_workers
    from tests.workers_gcomp import varsize_and_gcomp

    n = 3
    res = run_workers(n, varsize_and_gcomp)
    for key, (y, _nbytes) in res[0].items():
        codec_name, topo, size = key
        xs = [
            torch.randn(size, generator=torch.Generator().manual_seed(11 * r + size))
            for r in range(n)
        ]
        codec = VarBf16() if codec_name == "varbf16" else hopq.get_codec(codec_name)
        sim = hopq.simulate(xs, codec, topo, seed=3)
        assert torch.equal(sim.outputs[0].view(torch.int32), y.view(torch.int32)), key
        assert sim.bytes_sent == [res[r][key][1] for r in range(n)], key
        for r in range(1, n):
            assert torch.equal(res[r][key][0].view(torch.int32), y.view(torch.int32)), key
