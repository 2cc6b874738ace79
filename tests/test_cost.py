"""The two-tier cost model (hopq.comm.cost): pure, checked against closed forms."""

import math

import pytest

from hopq.comm import cost as C
from hopq.comm.topology import TOPOLOGIES, get_schedule

BF16 = C.CodecCost("bf16", 0.0, 1e-9, 2e-9, 1e-9, 16.0)
DQ = C.CodecCost("dynamiq", 2e-9, 3e-9, 4e-9, 2e-9, 5.0)
FP32 = C.CodecCost("fp32", 0.0, 0.5e-9, 1e-9, 0.5e-9, 32.0)
D = 1 << 20


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_the_walk_counts_the_schedules_own_compression_chains(topology):
    for n in range(2, 9):
        s = get_schedule(topology, n)
        assert C._walk(s, 1, 1, 1.0).chain == max(s.compression_chains())


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_a_flat_ring_on_one_tier_is_the_textbook_formula(n):
    net = C.Network(n, 1, inter_gbit=1.0, inter_latency_us=10.0)
    p = C.predict(BF16, "ring", net, D)
    beta = 1e9 / 8
    wire = 2 * (n - 1) / n * D * 2 / beta
    assert math.isclose(p.inter_seconds, 2 * (n - 1) * 10e-6 + wire, rel_tol=1e-9)
    assert p.intra_seconds == 0
    assert math.isclose(p.uplink_bytes, 2 * (n - 1) / n * D * 2, rel_tol=1e-9)
    assert p.recompressions == n


def test_hierarchy_sends_two_thirds_of_a_flat_rings_bytes_through_each_uplink_at_2x2():
    net = C.Network(2, 2, inter_gbit=0.2, intra_gbit=10.0)
    flat, hier = (C.predict(DQ, s, net, D, FP32) for s in ("ring", "hier:ring"))
    assert math.isclose(hier.uplink_bytes / flat.uplink_bytes, 2 / 3, rel_tol=1e-9)
    assert hier.recompressions == 2 < flat.recompressions == 4
    assert hier.seconds < flat.seconds


def test_one_worker_per_node_makes_the_hierarchy_the_flat_schedule():
    net = C.Network(4, 1, inter_gbit=1.0)
    for topology in ("ring", "butterfly", "tree"):
        assert C.predict(DQ, f"hier:{topology}", net, D).seconds == pytest.approx(
            C.predict(DQ, topology, net, D).seconds
        )


def test_one_node_compresses_nothing_and_uses_no_uplink():
    p = C.predict(DQ, "hier:ring", C.Network(1, 8), D, FP32)
    assert p.uplink_bytes == 0 and p.inter_seconds == 0 and p.intra_seconds > 0


def test_a_flat_ring_over_many_nodes_recompresses_per_rank_the_hierarchy_per_node():
    net = C.Network(16, 8, inter_gbit=100.0, intra_gbit=900.0)
    flat = C.predict(DQ, "ring", net, D, FP32)
    hier = C.predict(DQ, "hier:butterfly", net, D, FP32)
    assert flat.recompressions == 128 and hier.recompressions == 5
    # each worker codes 1/8 of the vector, plus the exact tier's float32 additions
    assert hier.codec_seconds < flat.codec_seconds / 3


def test_workers_sharing_cores_scale_the_codec_work():
    one = C.predict(DQ, "ring", C.Network(2, 4, cores_per_node=4), D)
    shared = C.predict(DQ, "ring", C.Network(2, 4, cores_per_node=1), D)
    assert shared.codec_seconds == pytest.approx(4 * one.codec_seconds)


@pytest.mark.parametrize(
    "kwargs",
    [dict(nodes=0), dict(nodes=2, per_node=1.5), dict(nodes=2, inter_gbit=0),
     dict(nodes=2, intra_latency_us=-1), dict(nodes=2, cores_per_node=0)],
)  # fmt: skip
def test_a_bad_network_names_its_field(kwargs):
    with pytest.raises(ValueError, match="Network."):
        C.Network(**kwargs)


def test_an_unknown_topology_is_refused():
    with pytest.raises(ValueError, match="unknown topology"):
        C.predict(DQ, "hier:moebius", C.Network(2, 2), D)


def test_duplex_slows_only_two_ranks_that_exchange_with_each_other():
    def wire(net):
        return C.predict(BF16, "ring", net, D).inter_seconds

    # a ring of 2: ranks 0 and 1 send to each other at every step
    assert wire(C.Network(2, 1, duplex=2.0)) > 1.9 * wire(C.Network(2, 1))
    # 2 nodes of 2 in a ring: 1 -> 2 and 3 -> 0 cross, different pairs of ranks
    assert wire(C.Network(2, 2, duplex=2.0)) == pytest.approx(wire(C.Network(2, 2)))
