"""Errors of the library."""


class HopqError(Exception):
    """Base class of hopq's own errors.

    Every error that hopq raises on its own account (rather than a plain
    ``TypeError`` or ``ValueError`` for a bad argument) derives from it:
    :class:`MismatchError`, :class:`TransportError`, :class:`PayloadError` and
    :class:`CodecError`. Each of those also derives from the built-in exception
    that describes it, so handlers written for ``ValueError`` or
    ``RuntimeError`` keep working.

    Raised by:
        Never itself; its subclasses by :func:`hopq.all_reduce`,
        :func:`hopq.reduce_scatter`, :func:`hopq.simulate`, the DDP hook and
        :class:`hopq.FSDPReduceScatter`.

    Example:
        ```python
        try:
            hopq.all_reduce(grad, codec="dynamiq")
        except hopq.HopqError as e:  # any of hopq's own failures
            print(f"rank {dist.get_rank()}: {e}")
            raise
        ```
    """


class PayloadError(HopqError, ValueError):
    """A received payload failed validation (size, counts or tables out of range).

    Every payload carries, or is described by, enough information for its
    receiver to check it before reading: sizes, counts and code tables. A payload
    that fails the check raises this error instead of being read out of bounds.
    Also a ``ValueError``.

    Raised by:
        A codec's ``decode``, ``decode_accumulate`` and
        ``decode_accumulate_encode`` (see :class:`hopq.Codec`), and so by
        :func:`hopq.all_reduce`, :func:`hopq.reduce_scatter` and
        :func:`hopq.simulate` on the rank that received the bad payload; its
        peers get a :class:`TransportError` naming that rank.

    Example:
        >>> import torch, hopq
        >>> from hopq.codecs.base import HopContext, LocalStats
        >>> codec = hopq.get_codec("bf16")
        >>> plan = codec.plan(torch.ones(8), LocalStats())
        >>> ctx = HopContext(seed=0, round=0, chunk=0, hop=0, rank=0, world_size=1)
        >>> codec.decode(plan, torch.zeros(14, dtype=torch.uint8), ctx, torch.empty(8))
        Traceback (most recent call last):
        ...
        hopq.errors.PayloadError: payload has 14 bytes, the plan says 16
    """


class TransportError(HopqError, RuntimeError):
    """A peer did not answer in time, left, or sent a message that does not belong
    to the step the schedule says (wrong size, wrong call, an error report).

    The message names the step, the phase and the peer. Every call has a
    timeout (``timeout=``; by default the process group's own), so a rank that
    died or hangs makes its peers raise this error instead of waiting forever.
    After a timeout the process group is unusable, as after a timeout of
    torch's own collectives. Also a ``RuntimeError``.

    Raised by:
        :func:`hopq.all_reduce`, :func:`hopq.reduce_scatter`, the DDP hook
        (through the backward pass) and :class:`hopq.FSDPReduceScatter` on
        every surviving rank; :func:`hopq.simulate` when a virtual rank does
        not answer within its ``timeout``.

    Example:
        ```python
        try:
            hopq.all_reduce(grad, codec="dynamiq", timeout=60.0)
        except hopq.TransportError as e:  # e.g. "... rank 2 ... timed out ..."
            log.error("peer lost: %s", e)
            raise SystemExit(1)  # the group cannot be reused after a timeout
        ```
    """


class MismatchError(HopqError, ValueError):
    """The ranks disagree about a call (tensor size, dtype, codec and its
    configuration or state, topology, op, seed, round, key): raised on every rank
    before any payload moves, so the group stays usable.

    Every call starts with an agreement in which the ranks compare what they
    are about to do, including the group's call sequence number, so a rank that
    skipped or repeated a call can never pair with another rank's different
    call. The message says which field differs. Also a ``ValueError``.

    Raised by:
        :func:`hopq.all_reduce`, :func:`hopq.reduce_scatter`, the DDP hook
        and :class:`hopq.FSDPReduceScatter`, on every rank of the group.

    Example:
        ```python
        # rank 0 passes codec="dynamiq", rank 1 codec="bf16":
        try:
            hopq.all_reduce(t, codec="dynamiq" if dist.get_rank() == 0 else "bf16")
        except hopq.MismatchError as e:  # on both ranks, nothing was sent
            print(e)
        hopq.all_reduce(t, codec="bf16")  # the group is still usable
        ```
    """


class CodecError(HopqError, RuntimeError):
    """A codec broke its contract (e.g. it produced a payload of a size its plan
    does not allow): raised on the rank where it happened; its peers get a
    TransportError saying which rank failed.

    It points at a bug in a codec (a custom one, typically), not at the input
    or the network. Also a ``RuntimeError``.

    Raised by:
        The engine behind :func:`hopq.all_reduce`, :func:`hopq.reduce_scatter`
        and :func:`hopq.simulate`, when a codec's payload is larger than its
        plan allows (or, for a fixed-size codec, of another size), or its first
        statistics are not the size it declared.

    Example:
        ```python
        try:
            hopq.all_reduce(t, codec=MyCodec())
        except hopq.CodecError as e:  # "codec 'mine' produced 40 bytes ... the plan says 32"
            raise AssertionError(f"MyCodec breaks the codec contract: {e}") from e
        ```
    """


class HookNotEngagedWarning(UserWarning):
    """A ``HookState`` on a group of several ranks whose hook was never called
    although training went on: the gradients are averaged without hopq (by the
    framework's own all-reduce, uncompressed). The message says how to register it.

    Frameworks that build the DDP model themselves may drop a hook they are
    given (Lightning's ``DDPStrategy`` on CPU, Accelerate's
    ``DistributedDataParallelKwargs(comm_hook=...)``); this warning makes that
    visible. It is issued once per state; a state on a group of one rank, or
    one built without training, never warns.

    Raised by:
        :class:`hopq.HookState` (as a warning, not an exception): after 10
        steps of one optimizer while its hook was never called, when
        :meth:`~hopq.HookState.step_metrics` finds no bucket after an optimizer
        step, or at exit after any optimizer step.

    Example:
        ```python
        import warnings

        # fail the job instead of training without hopq
        warnings.simplefilter("error", hopq.HookNotEngagedWarning)
        ```
    """
