"""Errors of the library."""


class HopqError(Exception):
    """Base class of hopq's own errors."""


class PayloadError(HopqError, ValueError):
    """A received payload failed validation (size, counts or tables out of range)."""


class TransportError(HopqError, RuntimeError):
    """A peer did not answer in time, left, or sent a message that does not belong
    to the step the schedule says (wrong size, wrong call, an error report)."""


class MismatchError(HopqError, ValueError):
    """The ranks disagree about a call (tensor size, dtype, codec and its
    configuration or state, topology, op, seed, round, key): raised on every rank
    before any payload moves, so the group stays usable."""


class CodecError(HopqError, RuntimeError):
    """A codec broke its contract (e.g. it produced a payload of a size its plan
    does not allow): raised on the rank where it happened; its peers get a
    TransportError saying which rank failed."""


class HookNotEngagedWarning(UserWarning):
    """A ``HookState`` on a group of several ranks whose hook was never called
    although training went on: the gradients are averaged without hopq (by the
    framework's own all-reduce, uncompressed). The message says how to register it."""
