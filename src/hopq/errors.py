"""Errors of the library."""


class HopqError(Exception):
    """Base class of hopq's own errors."""


class PayloadError(HopqError, ValueError):
    """A received payload failed validation (size, counts or tables out of range)."""


class TransportError(HopqError, RuntimeError):
    """A peer did not answer, or a message did not arrive as the schedule says."""
