"""``hopq bench faults``: hopq against mismatched calls and dying ranks, on real
Gloo groups; the table of outcomes in docs/reliability/faults.md comes from here, and
``tests/test_faults.py`` asserts the same outcomes on a subset.

Mismatches (generated from the codec registry): for every codec, topology and
world size, rank 0 makes a call that differs from the others' in one field
(the tensor's size or dtype, the codec, its configuration, its adaptive state,
its round, the topology, the op, the seed, the key). Expected: every rank raises
:class:`~hopq.MismatchError`, before any payload moves, and the next correct
call returns the simulator's result (the group is still usable).

Deaths: one rank never calls, dies before calling, dies right after its
agreement message went out, dies inside the statistics exchange, dies right
after its first send, or dies in the middle of a step. Expected: every other
rank raises :class:`~hopq.TransportError` within hopq's timeout plus a margin;
nothing hangs, no process aborts, nobody returns a result. After a death in the
agreement the survivors stay alive for the calls' timeout after they raise (a
script that catches the error): only hopq's failure notices, not closed
connections, can then tell the ranks that never exchange with the victim.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import enum
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hopq.cluster.launch import RankOutcome, spawn
from hopq.codecs.registry import codec_choices, codec_info, get_codec, resolve_codecs
from hopq.comm.topology import TOPOLOGIES
from hopq.errors import MismatchError, PayloadError, TransportError
from hopq.options import field_types, option
from hopq.reporting import machine, markdown_table

MISMATCHES = (
    "size",
    "dtype",
    "codec",
    "config",
    "adaptive state",
    "round",
    "topology",
    "op",
    "seed",
    "key",
    "call number",
    "refused call",
    "oversize message",
)
#: Bytes by which rank 0's messages overrun their bound in "oversize message".
OVERSIZE_B = 4096
DEATHS = (
    "never calls",
    "dies before calling",
    "dies in the agreement",
    "dies in the statistics exchange",
    "dies after its first send",
    "dies mid-step",
    "raises an exception",
)
#: The calls' timeout where the victim raises an exception (a user's bug) between
#: two calls: long enough that a survivor's error within it comes from being told,
#: not from the deadline.
USER_BUG_TIMEOUT_S = 60.0
#: Seconds beyond the calls' timeout within which every survivor must have raised.
MARGIN_S = 15.0


@dataclass(frozen=True)
class FaultOptions:
    codecs: tuple[str, ...] = option(("all",), "codecs of the mismatch grid", choices=codec_choices)
    topologies: tuple[str, ...] = option(
        ("ring", "butterfly"), "schedules", choices=lambda: sorted(TOPOLOGIES)
    )
    worlds: tuple[int, ...] = option((2, 3, 4), "world sizes")
    mismatches: tuple[str, ...] = option(MISMATCHES, "mismatch kinds", choices=MISMATCHES)
    deaths: tuple[str, ...] = option(DEATHS, "rank-death kinds", choices=DEATHS)
    timeout: float = option(3.0, "the calls' timeout in the death runs, seconds")
    size: int = option(4099, "coordinates per call")

    def __post_init__(self) -> None:
        resolve_codecs(self.codecs)
        if any(n < 2 for n in self.worlds):
            raise ValueError("fault runs need world sizes of at least 2")
        if not self.timeout > 0:
            raise ValueError("timeout must be > 0")


def _input(rank: int, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(d, generator=g).to(dtype)


def other_config(name: str) -> dict[str, Any] | None:
    """A valid configuration of codec ``name`` that differs from its default in one
    field (the first field whose changed value the config accepts), or None."""
    cfg = codec_info(name).cls.config_class
    hints = field_types(cfg)
    for f in dataclasses.fields(cfg):
        v, hint = f.default, hints[f.name]
        candidates: list[Any] = []
        if isinstance(v, bool):
            candidates = [not v]
        elif isinstance(v, enum.Enum):
            candidates = [m for m in type(v) if m is not v]
        elif isinstance(v, int):
            candidates = [2 * v if v else 1, v + 1]
        elif isinstance(v, float):
            candidates = [0.9 * v if v else 0.5]
        del hint
        for c in candidates:
            try:
                get_codec(name, **{f.name: c})
            except (ValueError, TypeError):
                continue
            return {f.name: c}
    return None


def _adapted(name: str, n: int, d: int) -> Any:
    """A codec whose adaptive state (MX's mu, OmniReduce's k, ...) moved by one
    simulated round, with its round counter reset; None if it has none."""
    from hopq.comm.agreement import digest
    from hopq.sim import simulate

    fresh = get_codec(name)
    moved = get_codec(name)
    simulate([_input(r, d) for r in range(n)], moved, "ring", seed=9)
    state = moved.state_dict()
    state["round"] = 0
    moved.load_state_dict(state)
    return None if digest(moved.agreed_state()) == digest(fresh.agreed_state()) else moved


def _variant(kind: str, rank: int, codec: str, topo: str, n: int, d: int) -> dict[str, Any] | None:
    """The call of ``rank``: rank 0 differs from the others in ``kind``; None where
    the kind does not apply to the codec."""
    odd = rank == 0
    call: dict[str, Any] = {"tensor": _input(rank, d), "codec": codec, "topology": topo, "seed": 1}
    if kind == "size":
        call["tensor"] = _input(rank, d + (1 if odd else 0))
    elif kind == "dtype":
        call["tensor"] = _input(rank, d, torch.bfloat16 if odd else torch.float32)
    elif kind == "codec":
        call["codec"] = ("fp16" if codec != "fp16" else "bf16") if odd else codec
    elif kind == "config":
        alt = other_config(codec)
        if alt is None:
            return None
        call["codec"] = get_codec(codec, **alt) if odd else get_codec(codec)
    elif kind == "adaptive state":
        moved = _adapted(codec, n, d)
        if moved is None:
            return None
        call["codec"] = moved if odd else get_codec(codec)
    elif kind == "round":
        c = get_codec(codec)
        c.round = 1 if odd else 0
        call["codec"] = c
    elif kind == "topology":
        others = sorted(t for t in TOPOLOGIES if t != topo)
        call["topology"] = others[0] if odd else topo
    elif kind == "op":
        call["op"] = "avg" if odd else "sum"
    elif kind == "seed":
        call["seed"] = 2 if odd else 1
    elif kind == "key":
        call["key"] = 1 if odd else 0
    elif kind == "refused call":  # rank 0's call is refused before anything is sent
        if odd:
            call["tensor"] = _input(rank, d).to(torch.int32)
    elif kind == "oversize message":  # rank 0's hop messages overrun (longer_messages)
        pass
    elif kind == "call number":
        if odd:  # rank 0 is one call ahead, as after a call its peers never made
            from hopq.comm.collectives import _transport

            _transport(None).calls += 1
    else:
        raise ValueError(f"unknown mismatch {kind!r}")
    return call


@contextlib.contextmanager
def longer_messages(extra: int = OVERSIZE_B) -> Iterator[None]:
    """While active, every hop message this process sends is ``extra`` bytes longer
    than its plan's bound says (its header tells the true length), as a peer that is
    not hopq, or whose plan differs, could send."""
    from hopq.comm import framing

    real_pack = framing.pack

    def longer(
        header: torch.Tensor, body: torch.Tensor | None, bound: int, pad: bool = False
    ) -> list[torch.Tensor]:
        words = header.clone().view(torch.int64)
        if int(words[2]) >= 0 and body is not None and body.numel():  # a hop, not the agreement
            words[-1] += extra
            body = torch.cat([body, torch.zeros(extra, dtype=torch.uint8)])
            bound += extra
        return real_pack(words.view(torch.uint8), body, bound, pad)

    framing.pack = longer
    try:
        yield
    finally:
        framing.pack = real_pack


def _outcome(e: BaseException | None) -> str:
    if e is None:
        return "returned"
    if isinstance(e, MismatchError):
        return "MismatchError"
    if isinstance(e, PayloadError):
        return "PayloadError"
    if isinstance(e, TransportError):
        return "TransportError"
    if isinstance(e, TypeError | ValueError):
        return f"refused ({type(e).__name__})"
    return f"{type(e).__name__}: {e}"


def mismatch_worker(
    rank: int, n: int, codecs: list[str], topologies: list[str], kinds: list[str], d: int
) -> list[tuple[Any, ...]]:
    """Every mismatch of every codec and topology, then a correct call each."""
    import hopq

    rows: list[tuple[Any, ...]] = []
    for codec in codecs:
        for topo in topologies:
            for kind in kinds:
                call = _variant(kind, rank, codec, topo, n, d)
                applies = torch.tensor([call is not None], dtype=torch.int32)
                torch.distributed.all_reduce(applies, op=torch.distributed.ReduceOp.MIN)
                if not applies.item() or call is None:
                    continue
                t0 = time.perf_counter()
                err: BaseException | None = None
                odd = kind == "oversize message" and rank == 0
                try:
                    with longer_messages() if odd else contextlib.nullcontext():
                        hopq.all_reduce(**call, timeout=60.0)
                except Exception as e:  # noqa: BLE001 - classified below
                    err = e
                rows.append((codec, topo, kind, _outcome(err), time.perf_counter() - t0))
            # the group is still usable: a correct call returns the simulator's bits
            x = _input(rank, d)
            hopq.all_reduce(x, codec=codec, topology=topo, seed=1, timeout=60.0)
            rows.append((codec, topo, "recovery", x, 0.0))
    return rows


def _die() -> None:
    os._exit(3)


def death_worker(
    rank: int, n: int, kind: str, victim: int, codec: str, topo: str, d: int, timeout: float
) -> tuple[str, float, str]:
    import hopq
    from hopq.comm import engine, transport

    x = _input(rank, d)
    if kind == "raises an exception":  # a first call together, as in a training loop
        hopq.all_reduce(x.clone(), codec=codec, topology=topo, seed=1, timeout=timeout)
    # every rank has joined the group before the victim acts: a victim that dies
    # while a peer is still in init_process_group fails that peer's init (Gloo's
    # "remote worker crashing"), not hopq's call, and the run measures nothing
    torch.distributed.barrier()
    if rank == victim:
        if kind == "never calls":
            time.sleep(timeout + 5.0)
            return ("did not call", 0.0, "")
        if kind == "dies before calling":
            time.sleep(0.5)  # the peers' barriers have completed: they are in their call
            _die()
        if kind == "dies in the agreement":
            each = transport._each_peer

            def exchange_then_die(*a: Any, **k: Any) -> Any:
                each(*a, **k)
                _die()

            transport._each_peer = exchange_then_die
        if kind == "dies in the statistics exchange":
            engine._StatsExchange.all_reduce = lambda *a, **k: _die()  # type: ignore[method-assign,assignment]
        if kind == "dies after its first send":
            build = engine._Hops.build_and_post

            def build_then_die(self: Any, s: int, j: int) -> None:
                build(self, s, j)
                if self.sends:  # its first payload message is posted
                    for h, where, _ in self.sends:
                        h.wait(engine.Deadline(5.0), where)
                    _die()

            engine._Hops.build_and_post = build_then_die  # type: ignore[method-assign]
        if kind == "raises an exception":
            time.sleep(0.5)  # the peers are in their next call
            # what the interpreter does with an uncaught exception: the hook prints
            # it, the exit handlers run (hopq's among them), the exit status is 1
            try:
                raise RuntimeError("user bug")
            except RuntimeError:
                sys.excepthook(*sys.exc_info())
            atexit._run_exitfuncs()
            os._exit(1)
        if kind == "dies mid-step":
            # it received a partial sum, and dies before passing it on
            engine._Hops.process_payload = lambda *a, **k: _die()  # type: ignore[method-assign]
    t0 = time.perf_counter()
    err: BaseException | None = None
    try:
        hopq.all_reduce(x, codec=codec, topology=topo, seed=1, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - classified below
        err = e
    seconds = time.perf_counter() - t0
    if kind == "dies in the agreement":
        time.sleep(timeout)  # alive: its connections tell the peers nothing
    return (_outcome(err), seconds, "" if err is None else str(err))


@dataclass
class DeathResult:
    kind: str
    n: int
    topology: str
    codec: str
    outcomes: list[RankOutcome]
    victim: int


def run_mismatches(o: FaultOptions, n: int) -> list[list[tuple[Any, ...]]]:
    codecs = resolve_codecs(o.codecs)
    outs = spawn(
        n, mismatch_worker, codecs, list(o.topologies), list(o.mismatches), o.size,
        timeout=600, clean_exit=False,
    )  # fmt: skip
    for out in outs:
        if out.error or out.exitcode != 0:
            raise RuntimeError(f"rank {out.rank} of the mismatch run failed:\n{out.error}")
    return [out.result for out in outs]


def death_timeout(o: FaultOptions, kind: str) -> float:
    """The calls' timeout of a death run."""
    return max(o.timeout, USER_BUG_TIMEOUT_S) if kind == "raises an exception" else o.timeout


def run_death(o: FaultOptions, kind: str, n: int, topo: str, codec: str) -> DeathResult:
    victim = n - 1
    timeout = death_timeout(o, kind)
    outs = spawn(
        n, death_worker, kind, victim, codec, topo, o.size, timeout,
        timeout=timeout + MARGIN_S + 30, clean_exit=False, pg_timeout=timeout + MARGIN_S,
    )  # fmt: skip
    return DeathResult(kind, n, topo, codec, outs, victim)


def survivor_outcomes(r: DeathResult, timeout: float) -> Counter[str]:
    """Per survivor: "TransportError in time", or what went wrong."""
    c: Counter[str] = Counter()
    for out in r.outcomes:
        if out.rank == r.victim:
            continue
        if out.exitcode is None:
            c["hang"] += 1
        elif out.exitcode < 0:
            c[f"abort (signal {-out.exitcode})"] += 1
        elif out.result is None:
            c["no result"] += 1
        else:
            what, seconds, message = out.result
            if what == "TransportError":
                when = "in time" if seconds <= timeout + MARGIN_S else "late"
                named = f" naming rank {r.victim}" if f"rank {r.victim}" in message else ""
                c[f"TransportError{named} {when}"] += 1
            else:
                c[what] += 1
    return c


def run(o: FaultOptions) -> str:
    """Run the grid; return the report (markdown)."""
    import hopq

    lines = [f"Machine: {machine()}; Gloo process groups.", ""]
    # -- mismatches
    rows = []
    for n in o.worlds:
        per_rank = run_mismatches(o, n)
        tally: dict[str, Counter[str]] = {}
        for res in per_rank:
            for row in res:
                codec, topo, kind, what, _ = row
                if kind == "recovery":
                    xs = [_input(q, o.size) for q in range(n)]
                    sim = hopq.simulate(xs, codec, topo, seed=1).outputs[0]
                    what = "recovered" if torch.equal(sim, what) else "WRONG after mismatch"
                tally.setdefault(kind, Counter())[what] += 1
        for kind in (*o.mismatches, "recovery"):
            if kind in tally:
                cases = sum(tally[kind].values()) // n
                rows.append(
                    [
                        n,
                        kind,
                        cases,
                        ", ".join(f"{v} x {k}" for k, v in sorted(tally[kind].items())),
                    ]
                )
    lines += [
        "### Mismatched calls: rank 0 differs in one field",
        "",
        f"Codecs {', '.join(resolve_codecs(o.codecs))}; topologies {', '.join(o.topologies)}; "
        f"{o.size} coordinates. Outcomes are counted per rank (cases x n ranks); "
        "'recovery' is the correct call after the mismatches of a codec and topology, "
        "compared bit for bit with the simulator.",
        "",
        markdown_table(["n", "mismatch", "cases", "outcomes (per rank)"], rows),
    ]
    # -- deaths
    drows = []
    for kind in o.deaths:
        for n in o.worlds:
            for topo in o.topologies:
                codec = "dynamiq" if kind == "dies in the statistics exchange" else "bf16"
                r = run_death(o, kind, n, topo, codec)
                outcome = survivor_outcomes(r, death_timeout(o, kind))
                worst = max(
                    (out.result[1] for out in r.outcomes if out.rank != r.victim and out.result),
                    default=float("nan"),
                )
                drows.append(
                    [
                        kind,
                        n,
                        topo,
                        codec,
                        ", ".join(f"{v} x {k}" for k, v in sorted(outcome.items())),
                        f"{worst:.1f}",
                    ]
                )
    if drows:
        lines += [
            "",
            f"### A rank dies or never calls (hopq timeout {o.timeout:g} s)",
            "",
            "The last rank is the victim; outcomes are counted over the other ranks, 'in "
            f"time' meaning within the timeout plus {MARGIN_S:g} s. A victim that raises "
            "an exception (a user's bug) does so between two calls and ends as the "
            "interpreter ends it (its exit handlers run); its peers' calls have a "
            f"{USER_BUG_TIMEOUT_S:g} s timeout, so that their error comes from being "
            "told, not from the deadline.",
            "",
            markdown_table(
                ["fault", "n", "topology", "codec", "survivors", "slowest survivor (s)"], drows
            ),
        ]
    return "\n".join(lines)
