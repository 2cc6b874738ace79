"""Agreement before bytes move: every call starts by checking that all ranks make
the same call.

Each rank sends a fixed-size fingerprint of its call to every peer (so the
exchange itself cannot go wrong when the calls differ; one round of messages,
:func:`~hopq.comm.transport.exchange`): the call's number on this group,
the tensor's size, dtype and device type, the codecs of both stages with their
full configuration and their agreed adaptive state, the topology, the op, the
seed, the round and the key. Every rank then compares all fingerprints and, on
any difference, raises :class:`~hopq.MismatchError` naming the field and the
ranks, before any payload is sent and before any statistic is read: every rank
raises the same error, and the group stays usable.

A codec's first statistics may travel in the same round, read only once the
fingerprints agree: small fixed-size ones inside the block, to every peer
(``extra``), and the first round of a direct statistics all-reduce as a
different tail per peer (``tails``, :func:`~hopq.comm.transport.exchange_tails`:
DynamiQ's reduce-scatter, which saves the call a round before its plan), or a
small all-gather whole, the same tail to every peer (statistics under
:data:`~hopq.comm.engine.DIRECT_STATS_BYTES`, which saves it ceil(log2 n) rounds).
Wherever tails can ride, every rank's receives have room for them whether it
sends any or not, so ranks that disagree about what rides still fit.

A call whose signature (the fingerprint without the call's number, round and
state) every rank's round found equal before, on a transport where receives
are preposted and take shorter messages, skips the round when its codecs have
no statistics and no adaptive state: see :mod:`hopq.comm.settle` for how its
messages are checked and how a disagreement found in them still raises
MismatchError on every rank (:func:`agree` runs once more after settling).

Configurations and states are compared by a 63-bit digest (tensors in a state by
a position-weighted integer checksum of their bits, computed with torch).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch

from hopq.comm.framing import Deadline, Where
from hopq.comm.transport import Transport, exchange, exchange_tails, tails_ride
from hopq.errors import MismatchError, TransportError

#: Fields of the fingerprint, in order; values are int64.
FIELDS = (
    "call",
    "numel",
    "dtype",
    "device",
    "codec",
    "config",
    "state",
    "gather codec",
    "topology",
    "op",
    "seed",
    "round",
    "key",
    "kind",
    "microshards",
)
#: The header step of the agreement round that follows a settled call (the same
#: on every rank, whichever round each began with: the engine's, a two-tier
#: call's layout agreement).
SETTLED_STEP = -1000
#: Readable names for the digests of small vocabularies.
_NONE_KEY = -(1 << 62)


def digest(value: Any) -> int:
    """A stable 63-bit digest of a value built from dicts, sequences, scalars,
    strings, enums and tensors (the same on every rank and in every process)."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, value)
    return int.from_bytes(h.digest(), "little") >> 1


def _feed(h: Any, v: Any) -> None:
    t = type(v)
    if t is int:  # the common cases first, the same bytes as the general one
        h.update(b"int:%d;" % v)
    elif t is str:
        h.update(f"str:{v!r};".encode())
    elif isinstance(v, torch.Tensor):
        h.update(f"T{v.dtype}{tuple(v.shape)}:{tensor_checksum(v)};".encode())
    elif isinstance(v, dict):
        keys = sorted(v, key=repr)
        if all(type(k) is str and type(v[k]) is int for k in keys):  # a round counter
            h.update(
                b"{%s}" % b"".join([b"str:%s;int:%d;" % (repr(k).encode(), v[k]) for k in keys])
            )
            return
        h.update(b"{")
        for k in keys:
            _feed(h, k)
            _feed(h, v[k])
        h.update(b"}")
    elif isinstance(v, list | tuple):
        if all(type(x) is int for x in v):  # the fingerprint's words
            h.update(b"[%s]" % b"".join([b"int:%d;" % x for x in v]))
            return
        h.update(b"[")
        for x in v:
            _feed(h, x)
        h.update(b"]")
    else:
        h.update(f"{type(v).__name__}:{v!r};".encode())


def tensor_checksum(t: torch.Tensor) -> int:
    """A position-weighted checksum of a tensor's bits (wrapping int64 arithmetic):
    any change of any element changes it with overwhelming probability."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    if flat.numel() == 0:
        return 0
    size = flat.element_size()
    if size == 8:
        words = flat.view(torch.int64)
    elif size == 4:
        words = flat.view(torch.int32).to(torch.int64)
    elif size == 2:
        words = flat.view(torch.int16).to(torch.int64)
    else:
        words = flat.view(torch.uint8).to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, dtype=torch.int64) * 0x9E3779B1 | 1
    return int((words * weights).sum()) ^ words.numel()


@functools.lru_cache(maxsize=1024)
def _name_digest(s: str) -> int:
    return digest(s)


#: Digests of codec configurations (frozen: a configuration's digest never
#: changes), by the configuration's id, with the configuration kept so that its
#: id stays its own.
_CONFIG_DIGESTS: dict[int, tuple[Any, int]] = {}


def config_digest(config: Any) -> int:
    """``digest(repr(config))`` of a frozen codec configuration, computed once per
    configuration."""
    hit = _CONFIG_DIGESTS.get(id(config))
    if hit is not None and hit[0] is config:
        return hit[1]
    value = digest(repr(config))
    if len(_CONFIG_DIGESTS) >= 1024:
        _CONFIG_DIGESTS.clear()
    _CONFIG_DIGESTS[id(config)] = (config, value)
    return value


def fingerprint(
    *,
    call: int,
    x: torch.Tensor,
    codec: Any,
    gather_codec: Any,
    topology: str,
    op: str,
    seed: int,
    key: int | None,
    kind: str,
    microshards: int,
) -> list[int]:
    """This rank's fingerprint of the call (one int64 per :data:`FIELDS`)."""

    def codec_parts(c: Any) -> tuple[int, int]:
        return _name_digest(c.name), config_digest(c.config)

    name, config = codec_parts(codec)
    gname, gconfig = codec_parts(gather_codec) if gather_codec is not codec else (0, 0)
    return [
        call,
        x.numel(),
        _name_digest(str(x.dtype)),
        _name_digest(x.device.type),
        name,
        config,
        digest(codec.agreed_state()),
        digest((gname, gconfig, digest(gather_codec.agreed_state()) if gname else 0)),
        _name_digest(topology),
        _name_digest(op),
        seed,
        codec.round,
        _NONE_KEY if key is None else key,
        _name_digest(kind),
        microshards,
    ]


#: Bytes of a codec's first statistics that may ride along with the fingerprint
#: (a codec whose first statistics have a fixed size, ``Codec.first_stats_nbytes``,
#: saves a round of messages). Every rank's message has this room, used or not,
#: so that messages of ranks that disagree still have equal sizes.
FOLD_BYTES = 64


def agree(
    transport: Transport,
    mine: list[int],
    deadline: Deadline,
    where: Where,
    describe: dict[str, str],
    extra: torch.Tensor | None = None,
    tails: dict[int, torch.Tensor] | None = None,
    settled: bool = False,
) -> tuple[list[torch.Tensor] | None, dict[int, torch.Tensor]]:
    """Exchange the fingerprints; raise MismatchError on every rank if they differ.
    ``describe`` gives this rank's readable value of each field (for the message).
    ``extra`` (at most FOLD_BYTES bytes) rides along to every peer; every rank's
    is returned, in rank order, once the fingerprints agree. ``tails`` (peer ->
    at most :data:`~hopq.comm.transport.TAIL_BYTES`; only where
    :func:`~hopq.comm.transport.tails_ride`) ride to one peer each; returned:
    the tail each peer sent this rank. Wherever tails can ride, every rank's
    receives leave room for them, sent or not, so that ranks that disagree
    about the call still exchange their fingerprints and raise the same error.

    A peer whose call skipped its round (its signature was agreed before: it
    sends the call's messages, not a fingerprint) or that ended its messages
    (:mod:`hopq.comm.settle`) disagrees about the call: this rank settles the
    call's messages with every peer, then runs this round once more, which
    names the fields that differ (``settled``: that second round)."""
    k = len(FIELDS)
    block = torch.zeros(8 * (k + 1) + FOLD_BYTES, dtype=torch.uint8)
    block[: 8 * k] = torch.tensor(mine, dtype=torch.int64).view(torch.uint8)
    raw = None if extra is None else extra.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    if raw is not None:
        if raw.numel() > FOLD_BYTES:
            raise ValueError(
                f"at most {FOLD_BYTES} bytes ride with the agreement, got {raw.numel()}"
            )
        block[8 * k : 8 * k + 8] = torch.tensor([raw.numel()], dtype=torch.int64).view(torch.uint8)
        block[8 * k + 8 : 8 * k + 8 + raw.numel()] = raw
    got: dict[int, torch.Tensor] = {}
    if tails_ride(transport):
        foreign: dict[int, tuple[list[int], torch.Tensor]] = {}
        blocks, got = exchange_tails(transport, block, tails or {}, deadline, where, foreign)
        if foreign:
            _foreign(transport, mine, deadline, where, describe, foreign, settled)
    elif tails:
        raise ValueError("tails ride only where tails_ride(transport)")
    else:
        blocks = exchange(transport, block, deadline, where)
    prints = [b[: 8 * k].clone().view(torch.int64).tolist() for b in blocks]
    diffs = []
    for i, field in enumerate(FIELDS):
        values = [p[i] for p in prints]
        if len(set(values)) > 1 and field != "call":  # the call: below
            groups: dict[int, list[int]] = {}
            for rank, v in enumerate(values):
                groups.setdefault(v, []).append(rank)
            split = " vs ".join(
                "ranks " + ",".join(map(str, g)) if len(g) > 1 else f"rank {g[0]}"
                for g in groups.values()
            )
            shown = _show(field, values)
            diffs.append(f"{field} ({split}{shown})")
    calls = [p[0] for p in prints]
    if len(set(calls)) > 1:
        # a rank made a call its peers did not (or skipped one): say who is where,
        # and number the next call alike on every rank, so that the group stays usable
        at = "; ".join(
            f"{'ranks ' + ','.join(map(str, g)) if len(g) > 1 else f'rank {g[0]}'} at call {c}"
            for c, g in _groups(calls).items()
        )
        diffs.insert(0, f"the call's number on this group ({at})")
        transport.calls = max(transport.calls, *calls)
    if settled and not diffs:
        diffs.append("whether they agreed on this call's signature before")
    if diffs:
        sent = (
            "The payloads already sent were received and dropped"
            if settled
            else "No payload was sent"
        )
        raise MismatchError(
            f"rank {transport.rank}: the ranks disagree about {where.what} (call "
            f"{where.call}): {'; '.join(diffs)}. This rank has {describe_line(describe, diffs)}. "
            f"{sent}; the group is still usable."
        )
    if raw is None:
        return None, got
    out = []
    for b in blocks:
        n = int(b[8 * k : 8 * k + 8].clone().view(torch.int64))
        if n != raw.numel():
            raise MismatchError(
                f"rank {transport.rank}: the ranks' first statistics differ in size in "
                f"{where.what} (call {where.call})"
            )
        out.append(b[8 * k + 8 : 8 * k + 8 + n].clone())
    return out, got


def _foreign(
    transport: Transport,
    mine: list[int],
    deadline: Deadline,
    where: Where,
    describe: dict[str, str],
    foreign: dict[int, tuple[list[int], torch.Tensor]],
    settled: bool,
) -> None:
    """Some peers sent something else than their fingerprint: raise. Refusals
    alone (a peer refused the call, :func:`hopq.comm.engine.refuse`) raise
    TransportError naming them, as before; a peer's message of a call that
    skipped its round, or its END, means the ranks disagree: settle with every
    peer (:mod:`hopq.comm.settle`; this rank sent each its block and posted one
    receive from each), then agree once more, which raises MismatchError."""
    from hopq.comm import framing, settle

    refused = sorted(
        q for q, (w, _) in foreign.items() if framing.status_of(w[3]) == framing.SENDER_FAILED
    )
    if len(refused) < len(foreign) and not settled:
        streams = {}
        for q in range(transport.world_size):
            if q == transport.rank:
                continue
            s = settle.Stream(q, sent=1, posted=1, send_end=q not in refused)
            s.read = 1  # the message of the round, read
            if q in foreign:
                settle.note(s, foreign[q][0], first=True)
            streams[q] = s
        owed, transport.owed = transport.owed, []
        ends = settle.settle(
            transport, streams, framing.END_MISMATCH, deadline, where, [h for h, _ in owed]
        )
        refused = sorted(q for q, e in ends.items() if e == framing.SENDER_FAILED)
        if not refused:
            # every rank's round after settling has the same step, whatever it began
            again = Where(where.what, where.call, SETTLED_STEP, 0, "agreement")
            agree(transport, mine, deadline, again, describe, settled=True)
    if refused:
        who = ", ".join(map(str, refused))
        raise TransportError(
            f"rank {transport.rank}: rank{'s' if len(refused) > 1 else ''} {who} failed in "
            f"{where.describe()} and sent no payload (see rank {refused[0]}'s error)"
        )
    raise TransportError(
        f"rank {transport.rank}: the ranks could not settle {where.describe()} after they "
        "disagreed about it"
    )


def _groups(values: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    return groups


def _show(field: str, values: list[int]) -> str:
    if field in ("call", "numel", "seed", "round", "microshards"):
        return ": " + ", ".join(map(str, values))
    if field == "key":
        return ": " + ", ".join("None" if v == _NONE_KEY else str(v) for v in values)
    return ""


def describe_line(describe: dict[str, str], diffs: list[str]) -> str:
    fields = [d.split(" (", 1)[0] for d in diffs]
    return ", ".join(f"{f} = {describe[f]}" for f in fields if f in describe) or "the values above"
