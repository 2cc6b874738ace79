"""Message framing: every message hopq sends starts with a small header, so that a
receiver never decodes bytes it did not receive and never mistakes a message
of another call or step for its own.

Why a header, with Gloo: a receive posted for N bytes accepts any message of up
to N bytes (the rest of the buffer keeps whatever it held before) and aborts the
process on a longer one. So a receiver posts a buffer of the size the plan gives
(or the bound a variable-size codec agreed), and the header tells what really
arrived. A sender checks its own message against the plan before sending, so a
longer one is never sent: a codec that produced a wrong size reports an error
in the header instead, and every receiver raises :class:`~hopq.TransportError`.

Header (int64): ``[MAGIC, call, step, status, ident, len_0, ..., len_{k-1}]``,
one length per part (chunk payload) the message carries, in order. ``call`` is
the call's sequence number on this group, ``step`` the schedule step and
microshard (``step * 2**20 + microshard``), ``ident`` a digest of the whole call
as its agreement fingerprints it (0 outside the hops): a call that skips its
agreement round (its signature was agreed before, see
:mod:`hopq.comm.agreement`) checks every peer's first message by it. The status
word also says how many parts follow (bits 16 and up) and whether the body
travels as a second message (:data:`SPLIT`), so that a header read alone tells
what comes next from that peer (:mod:`hopq.comm.settle`). Framing bytes are transport overhead, like TCP's:
they are counted apart (``RunStats.frame_bytes``), not in bits per coordinate.

Small bodies travel in one message with their header; bodies over
:data:`COALESCE_BYTES` (by the receiver's bound) as a second message, so that
large payloads are not copied.

A receiver never aborts on what a peer sends, within a margin: on transports
whose receives take shorter messages (Gloo, the simulator) every receive is
posted :func:`slack` bytes larger than the bound, so that a longer message (a
peer whose plan differs, or a sender that is not hopq) still lands in the
buffer, and :func:`check` raises :class:`~hopq.PayloadError` naming the peer
when the header states more than the bound. Posting a larger receive costs no
time (Gloo copies what arrives); the receive arena grows by the margin. A
message longer than bound + slack still ends the process in Gloo (it aborts on
a message longer than the posted receive, which no caller can catch).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import torch

from hopq.errors import PayloadError, TransportError

#: "hopq" in the header's first word.
MAGIC = 0x686F7071
#: Status words (the low byte of the status word). END_MISMATCH and END_FAILED end
#: a peer's messages in a call that failed after it skipped its agreement round
#: (:mod:`hopq.comm.settle`): the call disagreed, or this rank failed.
OK, SENDER_FAILED, END_MISMATCH, END_FAILED = 0, 1, 2, 3
#: Status flag: the body follows as a message of its own (of max(sum(lengths), 1) bytes).
SPLIT = 1 << 8
#: The status word's parts count starts at this bit.
PARTS_SHIFT = 16
#: Bodies up to this many bytes (receiver's bound) share one message with their
#: header: a second message costs ~100-200 us on Gloo, about what copying 1 MiB
#: into the header's buffer costs. (It was 64 KiB until 2026-11-26: on loopback,
#: 4 ranks on 2 cores, bf16's 1 MiB and 4 MiB all-reduces then took 3-6% longer;
#: on a 200 Mbit/s emulated link no difference.)
COALESCE_BYTES = 1 << 20
#: Steps are numbered step * MICRO + microshard in headers.
MICRO = 1 << 20


#: The least extra room of a receive over its bound (:func:`slack`): a peer's
#: message up to this much longer (4 KiB longer at 130 KiB in a bf16 call, say)
#: raises PayloadError rather than Gloo's abort.
SLACK_MIN = 64 << 10
#: Beyond SLACK_MIN, a receive's extra room is this share of its bound (1/8).
SLACK_SHIFT = 3


def slack(bound: int) -> int:
    """Extra bytes a receive for a body of ``bound`` bytes is posted with."""
    return max(SLACK_MIN, bound >> SLACK_SHIFT)


def header_words(parts: int) -> int:
    return 5 + parts


def header_nbytes(parts: int) -> int:
    return 8 * header_words(parts)


class Deadline:
    """The time a call may take: the caller's timeout, else the process group's
    (``Transport.timeout_s``)."""

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.end = time.monotonic() + self.timeout_s

    def remaining(self) -> float:
        return self.end - time.monotonic()


@dataclass(frozen=True)
class Where:
    """Where in a call a message belongs, for headers and error messages."""

    what: str  # e.g. "all_reduce(key=3)"
    call: int
    step: int
    micro: int = 0
    phase: str = ""

    def tag(self) -> int:
        return self.step * MICRO + self.micro

    def describe(self) -> str:
        part = f" microshard {self.micro}" if self.micro else ""
        phase = f" ({self.phase})" if self.phase else ""
        step = f", step {self.step}" if self.step >= 0 else ""  # < 0: before the hops
        return f"{self.what}, call {self.call}{step}{part}{phase}"


def frame(where: Where, lengths: list[int], status: int = OK, ident: int = 0) -> torch.Tensor:
    """A header as uint8 bytes."""
    word = status | (len(lengths) << PARTS_SHIFT)
    # int64 words in the host's byte order, as the receiver's view reads them
    raw = struct.pack(
        f"={5 + len(lengths)}q", MAGIC, where.call, where.tag(), word, ident, *lengths
    )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


#: Most parts a message carries (a schedule's chunks in one transfer), for
#: :data:`ANY_FIRST`.
MAX_PARTS = 256
#: Bytes that hold any message a hopq peer sends first in a call, whatever call
#: it makes: a body up to COALESCE_BYTES shares its message with the header,
#: a longer one travels apart. A call that skips its agreement round posts its
#: first receive from each peer this large, so that a peer making another call
#: never aborts this rank (Gloo ends a receiver on a longer message).
ANY_FIRST = COALESCE_BYTES + 8 * (5 + MAX_PARTS)


def set_split(header: torch.Tensor) -> torch.Tensor:
    """The header with :data:`SPLIT` set (its body goes as a second message)."""
    words = header.clone().view(torch.int64)
    words[3] |= SPLIT
    return words.view(torch.uint8)


def status_of(word: int) -> int:
    """The status in a header's status word."""
    return word & 0xFF


def peek(buf: torch.Tensor) -> list[int] | None:
    """The header words at the start of a received buffer (all its parts), or
    None when it does not start with a hopq header."""
    h0 = header_nbytes(0)
    if buf.numel() < h0:
        return None
    head = _words(buf[:h0])
    if head[0] != MAGIC:
        return None
    parts = head[3] >> PARTS_SHIFT
    if not 0 <= parts <= MAX_PARTS or buf.numel() < header_nbytes(parts):
        return None
    return head if parts == 0 else _words(buf[: header_nbytes(parts)])


def _words(b: torch.Tensor) -> list[int]:
    """The int64 words of a byte buffer (a whole number of words): read in place
    from host memory at a word-aligned offset, else through an aligned copy."""
    if b.device.type != "cpu":
        b = b.cpu()
    elif b.storage_offset() % 8:
        b = b.clone()
    return b.view(torch.int64).tolist()


def body_after(words: list[int]) -> int | None:
    """Bytes of the message that follows this header from the same peer when it
    is its body (:data:`SPLIT`), else None. ``words``: at least the header."""
    if not words[3] & SPLIT:
        return None
    parts = words[3] >> PARTS_SHIFT
    return max(sum(words[5 : 5 + parts]), 1)


def pack(
    header: torch.Tensor, body: torch.Tensor | None, bound: int, pad: bool = False
) -> list[torch.Tensor]:
    """The message's parts as sent: [header + body] when the receiver's bound is
    small, else [header, body]. A body shorter than its bound is fine (the header
    says its length); an empty one is sent as one filler byte when the bound is
    not zero, so that the receiver's posted receive completes. ``pad``: the body
    is zero-filled up to its bound (transports whose receives need the exact size,
    NCCL)."""
    if body is None or body.numel() == 0:
        body = torch.zeros(1 if bound else 0, dtype=torch.uint8, device=header.device)
    if body.numel() > max(bound, 1):
        raise AssertionError(f"message body of {body.numel()} bytes over its bound {bound}")
    if pad and body.numel() < bound:
        body = torch.cat([body, body.new_zeros(bound - body.numel())])
    if bound <= COALESCE_BYTES:
        return [torch.cat([header.to(body.device), body])]
    return [set_split(header).to(body.device), body]


def expect(parts: int, bound: int, room: bool = True) -> list[int]:
    """Byte sizes of the receives matching :func:`pack` for a body bound, each
    with :func:`slack` bytes of extra room where ``room`` (transports whose
    receives take shorter messages; NCCL's need the exact size)."""
    h = header_nbytes(parts)
    extra = slack(bound) if room else 0
    return [h + bound + extra] if bound <= COALESCE_BYTES else [h, bound + extra]


def unpack(received: list[torch.Tensor], parts: int, bound: int) -> tuple[list[int], torch.Tensor]:
    """(header words, body buffer of at least ``bound`` bytes) from the received
    parts (:func:`check` says how many of them are the message's)."""
    h = header_nbytes(parts)
    if bound <= COALESCE_BYTES:
        (buf,) = received
        head, body = buf[:h], buf[h:]
    else:
        head, body = received
    return _words(head), body


def check(
    head: list[int],
    where: Where,
    peer: int,
    rank: int,
    bounds: list[int],
    exact: bool,
) -> list[int]:
    """Validate a received header against what this rank expects; return the part
    lengths. Raises TransportError naming the peer and the step."""
    words = head
    if len(words) != header_words(len(bounds)) or words[0] != MAGIC:
        raise TransportError(
            f"rank {rank}: message from rank {peer} in {where.describe()} is not a hopq "
            "message (bad header)"
        )
    _, call, tag, word, _ident, *lengths = words
    status = status_of(word)
    if status in (END_MISMATCH, END_FAILED):
        raise TransportError(
            f"rank {rank}: rank {peer} ended its messages in {where.describe()}: "
            + ("the ranks disagree about the call" if status == END_MISMATCH else "it failed")
        )
    if status == SENDER_FAILED:
        raise TransportError(
            f"rank {rank}: rank {peer} failed in {where.describe()} and sent no payload "
            f"(see rank {peer}'s error)"
        )
    # the agreement's fingerprints carry the call number: ranks at different
    # calls raise MismatchError there, on every rank
    other_call = call != where.call and not where.phase.endswith("agreement")
    if other_call or tag != where.tag() or status != OK:
        raise TransportError(
            f"rank {rank}: message from rank {peer} belongs to call {call}, step "
            f"{tag // MICRO} microshard {tag % MICRO}, while this rank is in "
            f"{where.describe()}"
        )
    if sum(lengths) > sum(bounds):
        raise PayloadError(
            f"rank {rank}: the message from rank {peer} in {where.describe()} states "
            f"{sum(lengths)} bytes, more than the {sum(bounds)} this rank's plan allows "
            f"(rank {peer}'s plan differs, or it is not a hopq rank of this version); "
            "nothing of it was read"
        )
    for i, (n, b) in enumerate(zip(lengths, bounds, strict=True)):
        if n < 0 or n > b or (exact and n != b):
            want = f"{b}" if exact else f"at most {b}"
            raise TransportError(
                f"rank {rank}: part {i} of the message from rank {peer} in "
                f"{where.describe()} has {n} bytes, the plan says {want}"
            )
    return lengths
