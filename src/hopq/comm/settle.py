"""Settling a call that failed after it skipped its agreement round.

A call whose signature (size, dtype, codecs and their configuration, topology,
op, seed, key, kind, microshards) the ranks agreed on before skips the round
(:mod:`hopq.comm.agreement`): its messages carry the call's identity in their
headers, and each rank checks every peer's first message before it posts any
other receive from that peer. When the ranks turn out to disagree (a rank made
another call, skipped one or made one twice), or one of them fails, some
messages of the call may already be on their way, of sizes their receivers do
not expect. Gloo takes a message only into a receive at least as long, and
never cancels a receive, so they cannot just be dropped: each rank settles with
every peer instead, so that every message sent is received and every receive
posted gets a message, and the group stays usable.

The protocol (every rank that takes part, with every peer):

1. send an END notice (a header with status END_MISMATCH or END_FAILED, whose one
   length word says how many receives this rank had posted from that peer, and
   whose identity word names the rank that failed, if one did);
2. read that peer's messages in order until its END: the receives already
   posted first, then new ones of :data:`~hopq.comm.framing.ANY_FIRST` bytes
   (any first message fits) or, after a header that says its body travels
   apart, of the body's size;
3. send the peer one filler byte for each of its receives that this rank's
   messages did not fill (its END says how many it posted), and wait on this
   rank's receives that the peer's messages did not fill (the peer's fillers).

A rank that refused the call (:func:`hopq.comm.engine.refuse`) sent a failure
notice to every peer in place of its END, posted one receive per peer, and
settles in its next call (:meth:`~hopq.comm.transport.Transport.next_call`): it
reads each peer until that peer's END, or takes a rank that sent its agreement
block (a call that did not skip its round) as done.

Every rank learns every peer's END status, so every rank draws the same
conclusion: a disagreement (then every rank runs an agreement round, which
raises :class:`~hopq.MismatchError` naming the fields, as a call that did not
skip its round does), a refusal or a failure (:class:`~hopq.TransportError`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

import torch

from hopq.comm import framing
from hopq.comm.framing import Deadline, Where
from hopq.comm.transport import Handle, Transport
from hopq.errors import TransportError


@dataclass
class Stream:
    """What this rank has of one peer's messages in a call being settled."""

    peer: int
    #: Receives posted from the peer and not yet read, in posting order.
    pending: deque[tuple[Handle, torch.Tensor]] = field(default_factory=deque)
    #: Messages this rank sent the peer in the call (its END not included).
    sent: int = 0
    #: Receives this rank posted from the peer in the call (what its END says).
    posted: int = 0
    #: The peer's next message is a body of this many bytes (its header was read).
    body: int | None = None
    #: The peer's last message: its END status, or SENDER_FAILED (a refusal).
    ended: int | None = None
    #: Receives the peer posted from this rank (its END says).
    wants: int = 0
    #: Whether this rank sends the peer an END (not to a refusing peer when this
    #: rank's only message to it was its agreement block).
    send_end: bool = True
    #: A message of an earlier step (negative tag, status OK) as the peer's first
    #: ends it: a refusing rank's view of a peer that ran its agreement round.
    block_ends: bool = False
    #: Messages read from the peer.
    read: int = 0
    #: The rank whose failure the peer's END_FAILED reports (-1: not known).
    origin: int = -1


def note(stream: Stream, words: list[int] | None, first: bool) -> None:
    """Take one message read from the peer (its header words; None for a body or
    filler) into ``stream``."""
    stream.read += 1
    if stream.body is not None or words is None:  # the body of the header before
        stream.body = None
        return
    status = framing.status_of(words[3])
    if status in (framing.END_MISMATCH, framing.END_FAILED):
        stream.ended = status
        stream.wants = words[5] if len(words) > 5 else 0
        stream.origin = words[4] - 1  # an END's identity word: the failed rank + 1
        return
    if status == framing.SENDER_FAILED:
        stream.ended = status
        stream.origin = stream.peer
        stream.wants = 1  # a refusal posts one receive per peer
        stream.body = framing.body_after(words)
        return
    if first and stream.block_ends and words[2] < 0:
        stream.ended = framing.OK
        return
    stream.body = framing.body_after(words)


def settle(
    transport: Transport,
    streams: dict[int, Stream],
    status: int,
    deadline: Deadline,
    where: Where,
    sends: list[Handle] | None = None,
    origin: int = -1,
) -> dict[int, int]:
    """Run the protocol above with every peer in ``streams``; return each peer's
    END status (SENDER_FAILED for a refusal, OK for a peer that ran its
    agreement round, as a refusing rank sees it). ``status``: this rank's END
    (END_MISMATCH or END_FAILED); ``sends``: this rank's sends of the call still
    to wait on; ``origin``: the rank whose failure this rank's END_FAILED reports
    (-1: not known), which the END carries in its identity word. Raises
    TransportError when a peer does not settle in time."""
    mine: list[Handle] = list(sends or [])
    own = len(mine)
    try:
        return _settle(transport, streams, status, deadline, where, mine, origin)
    except BaseException:
        # whatever ends this rank's settling, the ENDs and fillers it posted
        # leave before it raises: a rank that exits at once would otherwise take
        # its END to a live peer with it, and that peer would blame it
        grace = Deadline(max(0.05, min(0.5, deadline.remaining())))
        for h in mine[own:]:
            with contextlib.suppress(Exception):
                h.wait(grace, where)
        raise


def _settle(
    transport: Transport,
    streams: dict[int, Stream],
    status: int,
    deadline: Deadline,
    where: Where,
    mine: list[Handle],
    origin: int,
) -> dict[int, int]:
    rank = transport.rank
    failed: TransportError | None = None
    for q, s in streams.items():
        if s.send_end:
            # one length word: the END fits any receive a peer posted from this rank
            head = framing.frame(where, [s.posted], status, ident=origin + 1)
            try:  # every live peer gets its END, whichever peer is gone
                ends, _ = transport.post([(q, head)], [], where)
            except TransportError as e:
                failed = failed or e
                continue
            mine += ends
            s.sent += 1
    if failed is not None:
        raise failed
    for q, s in streams.items():
        while s.ended is None or s.body is not None:
            first = s.read == 0
            if s.pending:
                h, buf = s.pending.popleft()
            else:
                size = s.body if s.body is not None else framing.ANY_FIRST
                buf = torch.empty(size, dtype=torch.uint8)
                _, (h,) = transport.post([], [(q, buf)], where)
            h.wait(deadline, where)
            words = None if s.body is not None else framing.peek(buf)
            if s.body is None and words is None:
                raise TransportError(
                    f"rank {rank}: a message from rank {q} in {where.describe()} does not "
                    "start with a hopq header; the group cannot be settled"
                )
            note(s, words, first)
    for q, s in streams.items():
        extra = s.wants - s.sent if s.ended in (framing.END_MISMATCH, framing.END_FAILED) else 0
        if extra > 0:
            fill, _ = transport.post([(q, torch.zeros(1, dtype=torch.uint8))] * extra, [], where)
            mine += fill
        while s.pending:  # filled by the peer's fillers
            h, _buf = s.pending.popleft()
            h.wait(deadline, where)
    for h in mine:
        h.wait(deadline, where)
    return {q: s.ended if s.ended is not None else framing.OK for q, s in streams.items()}
