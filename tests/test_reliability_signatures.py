"""A call whose signature the ranks agreed on before skips its agreement round
(hopq.comm.settle): it gives the same bits, and a disagreement first seen in
such a call (another shape, dtype, codec, key, option or round on one rank, a
rank that skips a call or makes one twice, a refusal) still raises on every
rank, at once, and the group stays usable. Real Gloo ranks and the simulator's
transport."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import hopq
from hopq.cluster.launch import run_workers
from hopq.codecs.registry import get_codec
from hopq.comm import engine
from hopq.comm.call import Call
from hopq.comm.transport import make_inprocess_group

#: Entries of the two sizes the Gloo checks use: one whose messages share a
#: message with their header, one whose chunks (1.5 MB of bf16) travel apart
#: and in several microshards.
SMALL, LARGE = 3000, 3_000_000


def _each_rank(transports: list[Any], fn: Any) -> list[Any]:
    """fn(rank, transport) on one thread per in-process rank: result or error."""
    out: list[Any] = [None] * len(transports)

    def body(r: int) -> None:
        try:
            out[r] = fn(r, transports[r])
        except Exception as e:  # noqa: BLE001
            out[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(transports))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _inputs(n: int, size: int, step: int) -> list[torch.Tensor]:
    return [
        torch.randn(size, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(n)
    ]


@pytest.mark.parametrize("codec", ["bf16", "fp32", "equarx"])
def test_a_call_of_an_agreed_signature_skips_the_round_with_the_same_bits(codec):
    n = 4
    ts = make_inprocess_group(n)
    codecs = [get_codec(codec) for _ in range(n)]
    ref = get_codec(codec)
    for step in range(3):
        xs = _inputs(n, 5000, step)
        got = _each_rank(ts, lambda r, t, xs=xs: engine.run(Call(codecs[r], seed=3), xs[r], t))
        want = hopq.simulate(xs, ref, seed=3).outputs
        for r in range(n):
            y, info = got[r]
            assert torch.equal(y, want[r]), (codec, step, r)
            # the first call runs the round (fingerprints to 3 peers), the later ones do not
            assert (info.frame_bytes > 400) == (step == 0), (codec, step, info.frame_bytes)
    assert all(len(t.agreed) == 1 for t in ts)


def test_codecs_with_statistics_keep_their_round():
    """DynamiQ's first statistics ride with the agreement's round: the round is
    the statistics exchange itself, so its calls keep it."""
    n = 3
    ts = make_inprocess_group(n)
    codecs = [get_codec("dynamiq") for _ in range(n)]
    for step in range(2):
        xs = _inputs(n, 20000, step)
        _each_rank(ts, lambda r, t, xs=xs: engine.run(Call(codecs[r]), xs[r], t))
    assert all(not t.agreed for t in ts)


#: (what, the argument one rank changes): each applied, on rank 2, to a call of
#: a signature every rank agreed on before.
SIM_MISMATCHES = ["numel", "dtype", "codec", "key", "seed", "op", "topology", "round", "number"]


@pytest.mark.parametrize("kind", SIM_MISMATCHES)
def test_a_mismatch_after_the_signature_was_agreed_raises_everywhere(kind):
    n = 4
    ts = make_inprocess_group(n)
    codecs = [get_codec("bf16") for _ in range(n)]
    other = [get_codec("fp32") for _ in range(n)]

    def call(odd: bool) -> Any:
        def fn(r: int, t: Any) -> float:
            x = torch.full((3000,), float(r + 1))
            kw: dict[str, Any] = {"codec": codecs[r], "key": 7, "timeout": 20.0}
            if odd and r == 2:
                if kind == "numel":
                    x = torch.full((5000,), float(r + 1))
                elif kind == "dtype":
                    x = x.to(torch.float16)
                elif kind == "codec":
                    kw["codec"] = other[r]
                elif kind == "key":
                    kw["key"] = 8
                elif kind == "seed":
                    kw["seed"] = 1
                elif kind == "op":
                    kw["op"] = "avg"
                elif kind == "topology":
                    kw["topology"] = "butterfly"
                elif kind == "round":
                    codecs[r].round += 1
                elif kind == "number":
                    t.calls += 1
            y, _ = engine.run(Call(**kw), x, t)
            return float(y.float().mean())

        return fn

    # every signature the odd rank uses is agreed first, where it can be
    for _ in range(2):
        assert _each_rank(ts, call(False)) == [10.0] * n
    if kind == "codec":
        assert _each_rank(ts, lambda r, t: engine.run(Call(other[r], key=7), torch.ones(3000), t))
    if kind == "key":
        _each_rank(ts, lambda r, t: engine.run(Call(codecs[r], key=8), torch.ones(3000), t))
    t0 = time.monotonic()
    got = _each_rank(ts, call(True))
    assert time.monotonic() - t0 < 10
    for e in got:
        assert isinstance(e, hopq.MismatchError), (kind, got)
        assert "dropped" in str(e) or kind == "topology", str(e)
    if kind == "round":  # put the odd rank's codec back in step
        codecs[2].round = codecs[0].round
    assert _each_rank(ts, call(False)) == [10.0] * n, kind


def keyed_calls(rank: int, n: int) -> dict[str, Any]:
    """Gloo ranks: every check below is a call of signatures agreed on before
    (keys 0 and 1 of both sizes, bf16 and fp32), then a correct call."""
    out: dict[str, Any] = {}

    def ar(name: str, x: torch.Tensor, **kw: Any) -> None:
        t0 = time.monotonic()
        try:
            info = hopq.all_reduce(x, timeout=30.0, **kw)
            out[name] = round(float(x.float().mean()), 3)
            out[name + "/fb"] = info.frame_bytes
        except hopq.HopqError as e:
            out[name] = f"{type(e).__name__}: {e}"
        out[name + "/s"] = time.monotonic() - t0

    def full(size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((size,), float(rank + 1), dtype=dtype)

    for tag, size in (("small", SMALL), ("large", LARGE)):
        for codec in ("bf16", "fp32"):
            for k in (0, 1):
                for i in range(2):
                    ar(f"{tag}/warm/{codec}/{k}/{i}", full(size), codec=codec, key=k)
        other = LARGE if size == SMALL else SMALL
        odd: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {
            "numel": (full(other), {}),
            "dtype": (full(size, torch.float16), {}),
            "codec": (full(size), {"codec": "fp32"}),
            "key": (full(size), {"key": 1}),
            "seed": (full(size), {"seed": 5}),
        }
        for kind, (x, kw) in odd.items():
            args = {"codec": "bf16", "key": 0, **kw} if rank == 1 else {"codec": "bf16", "key": 0}
            ar(f"{tag}/{kind}", x if rank == 1 else full(size), **args)
            ar(f"{tag}/{kind}/after", full(size), codec="bf16", key=0)
        # a rank skips a call (DDP's buckets 0 and 1: rank 2 goes to bucket 1),
        # then every rank makes bucket 1's call
        ar(f"{tag}/skip", full(size), codec="bf16", key=1 if rank == 2 else 0)
        ar(f"{tag}/skip/next", full(size), codec="bf16", key=1)
        ar(f"{tag}/skip/after", full(size), codec="bf16", key=0)
        # a rank makes a call twice (bucket 0 again where the others run bucket 1)
        ar(f"{tag}/twice/first", full(size), codec="bf16", key=0)
        ar(f"{tag}/twice", full(size), codec="bf16", key=0 if rank == 3 else 1)
        ar(f"{tag}/twice/next", full(size), codec="bf16", key=1)
        ar(f"{tag}/twice/after", full(size), codec="bf16", key=0)
    # a refusal on rank 0 where the peers' call skips its round
    if rank == 0:
        try:
            hopq.all_reduce(torch.ones(SMALL, dtype=torch.int32), timeout=30.0)
        except (TypeError, ValueError) as e:
            out["refused"] = type(e).__name__
    else:
        ar("refused", full(SMALL), codec="bf16", key=0)
    ar("refused/after", full(SMALL), codec="bf16", key=0)
    # a two-tier call on one rank (its agreement on the layout) where the others'
    # flat call skips its round
    ar("layout", full(SMALL), codec="bf16", key=0, **({"layout": "2x2"} if rank == 0 else {}))
    ar("layout/after", full(SMALL), codec="bf16", key=0)
    # a statistics codec (its round, with its statistics) on one rank where the
    # others skip theirs
    ar("stats", full(LARGE), codec="dynamiq" if rank == 2 else "bf16", key=0)
    ar("stats/after", full(SMALL), codec="bf16", key=0)
    return out


def test_mismatches_where_the_round_was_skipped_raise_on_every_gloo_rank():
    n = 4
    res = run_workers(n, keyed_calls, timeout=600)
    total = float(sum(range(1, n + 1)))  # every rank's full(r + 1), summed
    for r in res:  # the second call of a signature skipped the round: fewer frame bytes
        for tag in ("small", "large"):
            for ck in ("bf16/0", "bf16/1", "fp32/0", "fp32/1"):
                slow, fast = r[f"{tag}/warm/{ck}/0/fb"], r[f"{tag}/warm/{ck}/1/fb"]
                assert fast < slow - 300, (tag, ck, slow, fast)
    for name in res[0]:
        if name.endswith("/fb"):
            continue
        if name.endswith("/s"):
            assert max(r[name] for r in res) < 15, (name, [r[name] for r in res])
            continue
        got = [r.get(name) for r in res]
        kind = name.split("/", 1)[1] if "/" in name else name
        if kind.startswith("warm/") or (
            kind.endswith("after") or kind in ("skip/next", "twice/first", "twice/next")
        ):
            assert got == [total] * n, (name, got)
        elif name == "refused":
            assert got[0] == "TypeError", got
            for g in got[1:]:
                assert isinstance(g, str) and g.startswith("TransportError") and "rank 0" in g, g
        else:
            for g in got:
                assert isinstance(g, str) and g.startswith("MismatchError"), (name, got)


def test_a_failure_in_a_call_that_skipped_its_round_raises_everywhere_then_recovers():
    """Rank 1's codec fails in its hops (a call of an agreed signature): rank 1
    raises its own error, every peer TransportError naming it, and the next
    call sums right (the call's messages were settled, none left behind)."""
    n = 4
    ts = make_inprocess_group(n)
    codecs = [get_codec("bf16") for _ in range(n)]
    fail = {"now": False}
    real = codecs[1].decode_accumulate_encode

    def flaky(*a: Any, **k: Any) -> Any:
        if fail["now"]:
            raise hopq.CodecError("injected")
        return real(*a, **k)

    codecs[1].decode_accumulate_encode = flaky  # type: ignore[method-assign]

    def call(r: int, t: Any) -> float:
        y, _ = engine.run(Call(codecs[r], timeout=20.0), torch.full((3000,), float(r + 1)), t)
        return float(y.mean())

    assert _each_rank(ts, call) == [10.0] * n
    fail["now"] = True
    t0 = time.monotonic()
    got = _each_rank(ts, call)
    assert time.monotonic() - t0 < 10
    assert isinstance(got[1], hopq.CodecError), got
    for r in (0, 2, 3):
        assert isinstance(got[r], hopq.TransportError) and "rank 1" in str(got[r]), got
    fail["now"] = False
    assert _each_rank(ts, call) == [10.0] * n


def dies_in_a_call_that_skipped_its_round(rank: int, n: int, kind: str) -> tuple:
    """Rank 3 dies (os._exit) after its first send, or on its first received
    partial sum, in a call of an agreed signature; the survivors stay alive."""
    import os

    x = torch.full((300_000,), float(rank + 1))
    for _ in range(2):
        hopq.all_reduce(x.clone(), codec="bf16", timeout=15.0)
    torch.distributed.barrier()
    if rank == 3:
        if kind == "after its first send":
            build = engine._Hops.build_and_post

            def build_then_die(self: Any, s: int, j: int) -> None:
                build(self, s, j)
                if self.sends:
                    for h, where, _ in self.sends:
                        h.wait(engine.Deadline(5.0), where)
                    os._exit(3)

            engine._Hops.build_and_post = build_then_die  # type: ignore[method-assign]
        else:
            engine._Hops.process_payload = lambda *a, **k: os._exit(3)  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        hopq.all_reduce(x.clone(), codec="bf16", timeout=15.0)
        return ("returned", time.perf_counter() - t0, "")
    except Exception as e:  # noqa: BLE001 - classified by the test
        return (type(e).__name__, time.perf_counter() - t0, str(e))


@pytest.mark.parametrize("kind", ["after its first send", "mid-step"])
def test_a_rank_dying_in_a_call_that_skipped_its_round_fails_every_survivor_at_once(kind):
    from hopq.cluster.launch import spawn

    outs = spawn(
        4, dies_in_a_call_that_skipped_its_round, kind, timeout=120, clean_exit=False,
        pg_timeout=60,
    )  # fmt: skip
    for o in outs[:3]:
        what, seconds, msg = o.result
        assert what == "TransportError" and "rank 3" in msg, (o.rank, o.result)
        assert seconds < 9.0, (o.rank, o.result)
