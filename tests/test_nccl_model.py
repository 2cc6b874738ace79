"""hopq's message pattern under NCCL's rules, without a GPU.

NCCL runs each rank's groups of sends and receives (one ``batch_isend_irecv``
each) one after another on one stream, and a receive must be posted for exactly
the bytes sent. A rank whose first group holds only receives waits for sends
its peers queued behind their own such group: the whole job hangs. The
simulator's transport with NCCL's settings (no early receives, no short
messages) records each rank's groups; a model then replays them in NCCL's order
(a group completes once every operation's counterpart is in the peer's running
or completed group) and checks that every group completes and that sizes match,
for the codecs, topologies, a reduce-scatter and a rank whose codec fails."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch

from hopq.codecs.registry import get_codec
from hopq.comm import engine
from hopq.comm.call import Call
from hopq.comm.transport import InProcessTransport, _Hub

Op = tuple[str, int, int, int]  # kind, sender, receiver, bytes


class _NcclLike(InProcessTransport):
    """The simulator's transport with NCCL's settings, recording each group."""

    prepost = False
    short_messages = False

    def __init__(self, hub: _Hub, rank: int) -> None:
        super().__init__(hub, rank)
        self.groups: list[list[Op]] = []
        self._open: list[Op] | None = None

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        if self._open is not None:
            yield
            return
        self._open = []
        self._held: list[_Held] = []
        try:
            yield
        finally:
            group, self._open = self._open, None
            if group:
                self.groups.append(group)
            for h in self._held:  # posted now: they may be waited on
                h.posted = True

    def post(self, sends, recvs, where=None, tag=0):  # type: ignore[no-untyped-def]
        ops = [("S", self.rank, p, int(t.numel())) for p, t in sends]
        ops += [("R", p, self.rank, int(t.numel())) for p, t in recvs]
        s, r = super().post(sends, recvs, where, tag)
        if self._open is None:
            if ops:
                self.groups.append(ops)
            return s, r
        self._open += ops
        s, r = [_Held(h) for h in s], [_Held(h) for h in r]
        self._held += s + r
        return s, r


class _Held:
    """A handle of an open group: waiting on it before the group is posted is
    an error (on NCCL it would wait forever), as DistTransport raises."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.posted = inner, False

    def wait(self, deadline, where) -> None:  # type: ignore[no-untyped-def]
        assert self.posted, f"waited on before its group was posted, in {where.describe()}"
        self.inner.wait(deadline, where)


def replay(groups: list[list[list[Op]]]) -> tuple[bool, list[str]]:
    """Whether every rank's groups complete in NCCL's order, and size mismatches.
    The k-th send from a to b meets the k-th receive at b from a."""
    at: dict[tuple[str, int, int, int], tuple[int, int, int]] = {}  # op -> rank, group, bytes
    keys: list[list[list[tuple[str, int, int, int]]]] = []
    for r, gs in enumerate(groups):
        count: dict[tuple[str, int, int], int] = {}
        keys.append([])
        for g, ops in enumerate(gs):
            keys[r].append([])
            for kind, src, dst, nb in ops:
                k = count[(kind, src, dst)] = count.get((kind, src, dst), -1) + 1
                at[(kind, src, dst, k)] = (r, g, nb)
                keys[r][g].append((kind, src, dst, k))
    bad = []
    for (kind, src, dst, k), (_, _, nb) in at.items():
        other = at.get(("R" if kind == "S" else "S", src, dst, k))
        if other is None or other[2] != nb:
            bad.append(f"{kind} {src}->{dst} #{k}: {nb} bytes, counterpart {other}")
    pos = [0] * len(groups)
    moved = True
    while moved:
        moved = False
        for r in range(len(groups)):
            if pos[r] >= len(keys[r]):
                continue
            ready = True
            for kind, src, dst, k in keys[r][pos[r]]:
                other = at.get(("R" if kind == "S" else "S", src, dst, k))
                if other is None or pos[other[0]] < other[1]:
                    ready = False  # its counterpart sits in a later group of the peer
                    break
            if ready:
                pos[r] += 1
                moved = True
    return all(p == len(ks) for p, ks in zip(pos, keys, strict=True)), bad


def _run(codec: str, topo: str, n: int, gather: bool = True, fail_rank: int = -1):
    hub = _Hub(n)
    ts = [_NcclLike(hub, r) for r in range(n)]
    errors: list[BaseException | None] = [None] * n

    def work(r: int) -> None:
        c = get_codec(codec)
        if r == fail_rank:
            encode, calls = c.encode, [0]

            def failing(*a):  # type: ignore[no-untyped-def]
                calls[0] += 1
                if calls[0] == 3:
                    raise RuntimeError("codec failed")
                return encode(*a)

            c.encode = failing  # type: ignore[method-assign]
        x = torch.randn(6000, generator=torch.Generator().manual_seed(r))
        try:
            call = Call(c, topo, seed=1, gather=gather, microshards=2, timeout=60)
            engine.run(call, x, ts[r])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[r] = e

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [t.groups for t in ts], errors


@pytest.mark.filterwarnings("ignore:.*padded to their bound")
@pytest.mark.parametrize(
    ("codec", "topo", "n"),
    [
        ("bf16", "ring", 2),
        ("bf16", "ring", 4),
        ("dynamiq", "ring", 4),
        ("gcomp", "ring", 3),
        ("thc", "butterfly", 4),
        ("mxfp8", "tree", 3),
        ("equarx", "semiloop", 5),
        ("bf16", "biring", 3),
    ],
)
def test_every_group_completes_under_nccl_rules(codec, topo, n):
    groups, errors = _run(codec, topo, n)
    assert errors == [None] * n
    done, bad = replay(groups)
    assert not bad, bad[:3]
    assert done, "a rank's group waits on a peer's later group: NCCL would hang"
    groups, errors = _run(codec, topo, n, gather=False)  # reduce-scatter
    assert errors == [None] * n
    assert replay(groups) == (True, [])


def test_a_failing_rank_leaves_no_group_waiting_under_nccl_rules():
    """Rank 1's codec fails at its third encode: every rank raises, and the
    failure notices and the drained receives still complete as NCCL groups."""
    groups, errors = _run("bf16", "ring", 3, fail_rank=1)
    assert all(e is not None for e in errors)
    done, bad = replay(groups)
    assert not bad, bad[:3]
    assert done


def test_padded_payloads_say_so():
    """On NCCL a variable-size codec's payloads travel padded to their bound
    (GComp's bound exceeds fp32): the first such call warns, once."""
    engine._PADDED.discard("gcomp")
    with pytest.warns(RuntimeWarning, match="padded to their bound, 44 bits per coordinate"):
        _, errors = _run("gcomp", "ring", 2)
    assert errors == [None, None]
    assert "gcomp" in engine._PADDED


def test_transport_reads_nccl_and_mixed_groups():
    """NCCL's timeout text is a timeout; a group of several backends
    ("undefined", "cpu:gloo,cuda:nccl") is carried by its GPU's backend where
    there is a GPU, else by its CPU's."""
    import types

    from hopq.comm import transport as tr
    from hopq.comm.framing import Deadline, Where

    msg = "Watchdog caught collective operation timeout: ran for 600000 ms before timing out."
    err = tr._transport_error(msg, 0, 1, "recv", Deadline(5.0), Where("a call", 0, 0))
    assert "within the call's timeout" in str(err)

    def backend(name):
        return types.SimpleNamespace(name=lambda: name)

    mixed = types.SimpleNamespace(
        _get_backend=lambda d: backend({"cpu": "gloo", "cuda": "nccl"}[d.type])
    )
    want = "nccl" if torch.cuda.is_available() else "gloo"
    assert tr._carrier(mixed, "cpu:gloo,cuda:nccl") == want
    assert tr._carrier(mixed, "undefined") == want
    assert tr._carrier(mixed, "nccl") == "nccl"
