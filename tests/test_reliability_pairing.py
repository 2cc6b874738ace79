"""Every call pairs with the same call on every rank, and a peer's message never
aborts its receiver (docs/reliability/index.md): real Gloo ranks."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch

import hopq
from hopq.cluster.launch import run_workers

#: The arguments one rank passes where its peers make a correct call; each is
#: refused on that rank before anything is sent.
REFUSALS = ("int32", "meta", "list", "codec", "seed", "op", "timeout")


def _refused_call(kind: str) -> None:
    x = torch.ones(4)
    if kind == "int32":
        hopq.all_reduce(torch.ones(4, dtype=torch.int32), timeout=20.0)
    elif kind == "meta":
        hopq.all_reduce(torch.ones(4, device="meta"), timeout=20.0)
    elif kind == "list":
        hopq.all_reduce([1.0, 2.0, 3.0, 4.0], timeout=20.0)  # type: ignore[arg-type]
    elif kind == "codec":
        hopq.all_reduce(x, codec="no-such-codec", timeout=20.0)
    elif kind == "seed":
        hopq.all_reduce(x, seed=-1, timeout=20.0)
    elif kind == "op":
        hopq.all_reduce(x, op="max", timeout=20.0)
    else:
        hopq.all_reduce(x, timeout=math.nan)


def refused_on_one_rank(
    rank: int, n: int, kinds: tuple[str, ...], codec: str = "fp32"
) -> dict[str, Any]:
    """Rank 0's first call is refused (bad arguments) and it goes on to its next
    call; ranks 1 and 2 make two correct calls (1+2+3 with ``codec``, then
    100+200+300)."""
    out: dict[str, Any] = {}
    for kind in kinds:
        if rank == 0:
            try:
                _refused_call(kind)
                out[f"{kind}/first"] = "returned"
            except (TypeError, ValueError) as e:
                out[f"{kind}/first"] = type(e).__name__
        else:
            x = torch.full((4 if codec == "fp32" else 4000,), float(rank + 1))
            try:
                hopq.all_reduce(x, codec=codec, timeout=20.0)
                out[f"{kind}/first"] = x[0].item()
            except hopq.HopqError as e:
                out[f"{kind}/first"] = f"{type(e).__name__}: {e}"
        y = torch.full((4,), 100.0 * (rank + 1))
        hopq.all_reduce(y, codec="fp32", timeout=20.0)
        out[f"{kind}/second"] = y[0].item()
    return out


@pytest.mark.parametrize("codec, kinds", [("fp32", REFUSALS), ("dynamiq", REFUSALS[:2])])
def test_a_call_refused_on_one_rank_never_pairs_with_its_next_call(codec, kinds):
    res = run_workers(3, refused_on_one_rank, kinds, codec, timeout=300)
    for kind in kinds:
        assert res[0][f"{kind}/first"] in ("TypeError", "ValueError"), (kind, res[0])
        for r in (1, 2):
            first = res[r][f"{kind}/first"]
            # the peers learn at once that rank 0 refused this call
            assert isinstance(first, str) and "rank 0" in first, (kind, first)
        assert [res[r][f"{kind}/second"] for r in range(3)] == [600.0] * 3, (kind, res)


def oversize_peer(rank: int, n: int) -> dict[str, Any]:
    """Rank 1 sends every hop message 4 KiB longer than the plan says (as a peer
    that is not hopq, or whose plan differs, could): rank 0 raises PayloadError
    naming rank 1 instead of aborting, and the group stays usable."""
    from hopq.bench.faults import longer_messages

    out: dict[str, Any] = {}
    x = torch.full((2048,), float(rank + 1))
    try:
        with longer_messages(4096) if rank == 1 else contextlib.nullcontext():
            hopq.all_reduce(x, codec="bf16", timeout=20.0)
        out["first"] = "returned"
    except hopq.HopqError as e:
        out["first"] = f"{type(e).__name__}: {e}"
    y = torch.full((2048,), float(rank + 1))
    hopq.all_reduce(y, codec="bf16", timeout=20.0)
    out["after"] = y[0].item()
    return out


def test_a_peers_oversize_message_raises_payload_error_instead_of_aborting():
    res = run_workers(2, oversize_peer, timeout=120)
    assert res[0]["first"].startswith("PayloadError") and "rank 1" in res[0]["first"], res[0]
    assert res[1]["first"].startswith("TransportError") and "rank 0" in res[1]["first"], res[1]
    assert [r["after"] for r in res] == [3.0, 3.0]


def _each_rank(transports: list[Any], fn: Any) -> list[Any]:
    """fn(rank, transport) on one thread per in-process rank: result or error."""
    import threading

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


def test_ranks_at_different_call_numbers_raise_mismatch_everywhere_then_recover():
    from hopq.codecs.registry import get_codec
    from hopq.comm import engine
    from hopq.comm.call import Call
    from hopq.comm.transport import make_inprocess_group

    for codec in ("fp32", "dynamiq"):
        ts = make_inprocess_group(3)
        ts[0].calls += 1  # rank 0 made a call its peers never saw

        def call(r: int, t: Any, codec: str = codec) -> float:
            x = torch.full((300,), 100.0 * (r + 1))
            y, _ = engine.run(Call(get_codec(codec), timeout=20.0), x, t)
            return round(float(y.mean()))

        first = _each_rank(ts, call)
        for e in first:
            assert isinstance(e, hopq.MismatchError), (codec, first)
            assert "rank 0 at call 2" in str(e) and "ranks 1,2 at call 1" in str(e), str(e)
        assert _each_rank(ts, call) == [600, 600, 600], codec
