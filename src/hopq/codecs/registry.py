"""Codec registry: codecs register by name; the engine, the command line and the
test grid read it."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hopq.codecs.base import FLOAT_DTYPES, Codec


@dataclass(frozen=True)
class Refusal:
    """Why a codec refuses a call, and the exception that says so."""

    reason: str
    #: TypeError for an input dtype it does not take, ValueError otherwise.
    error: type[Exception] = ValueError

    def exception(self) -> Exception:
        return self.error(self.reason)


@dataclass(frozen=True)
class CodecInfo:
    """What a registered codec supports, and why it refuses what it does not."""

    name: str
    cls: type[Codec[Any]]
    summary: str
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    devices: tuple[str, ...] = ("cpu", "cuda")
    topologies: tuple[str, ...] | None = None  # None: every topology
    #: Uncompressed baselines, left out of the "auto" comparisons (bf16 stays in).
    baseline: bool = False

    def refusal(self, *, dtype: torch.dtype, device: torch.device, topology: str) -> Refusal | None:
        if dtype not in self.dtypes:
            return Refusal(
                f"codec {self.name!r} does not take {dtype}; it takes {[str(d) for d in self.dtypes]}",
                TypeError,
            )
        if device.type not in self.devices:
            return Refusal(f"codec {self.name!r} does not run on {device.type}")
        if self.topologies is not None and topology not in self.topologies:
            return Refusal(
                f"codec {self.name!r} does not run on topology {topology!r}; it runs on {self.topologies}"
            )
        return None


_REGISTRY: dict[str, CodecInfo] = {}


def register(
    name: str, summary: str, **support: Any
) -> Callable[[type[Codec[Any]]], type[Codec[Any]]]:
    """Class decorator: register a Codec subclass under ``name``."""

    def deco(cls: type[Codec[Any]]) -> type[Codec[Any]]:
        if name in _REGISTRY:
            raise ValueError(f"codec {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = CodecInfo(name=name, cls=cls, summary=summary, **support)
        return cls

    return deco


def available_codecs() -> list[str]:
    """Names of every registered codec, in registration order.

    Any of them may be passed as ``codec=`` to :func:`hopq.all_reduce`,
    :func:`hopq.simulate`, :class:`hopq.HookState` and the other entry points;
    ``hopq codecs`` on the command line lists them with their options. It
    takes no arguments and raises nothing.

    Returns:
        A new list of names, e.g. ``"dynamiq"``, ``"bf16"``, ``"mxfp8"``.

    Example:
        >>> import hopq
        >>> "dynamiq" in hopq.available_codecs()
        True
    """
    return list(_REGISTRY)


def codec_info(name: str) -> CodecInfo:
    """The registered codec called ``name``, in any case (``"DynamiQ"`` is
    ``"dynamiq"``); an unknown name raises ValueError naming the close ones."""
    info = _REGISTRY.get(name)
    if info is None and isinstance(name, str):
        info = next((i for n, i in _REGISTRY.items() if n.lower() == name.lower()), None)
    if info is not None:
        return info
    close = difflib.get_close_matches(str(name).lower(), list(_REGISTRY), n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise ValueError(f"unknown codec {name!r}{hint}; available: {available_codecs()}")


#: The order of the "auto" selection: the baseline first, then the flagship.
_AUTO_FIRST = ("bf16", "dynamiq")


def resolve_codecs(names: Sequence[str]) -> list[str]:
    """Codec names as the jobs take them: ``("auto",)`` means bf16, DynamiQ and every
    other registered codec except the redundant uncompressed baselines (fp32,
    fp16); ``("all",)`` every registered codec. Unknown names raise ValueError."""
    names = tuple(names)
    if names == ("all",):
        return available_codecs()
    if names == ("auto",):
        first = [c for c in _AUTO_FIRST if c in _REGISTRY]
        rest = [c for c, i in _REGISTRY.items() if c not in first and not i.baseline]
        return first + rest
    return [codec_info(c).name for c in names]


def codec_choices() -> list[str]:
    """What a job's ``codecs`` option accepts."""
    return ["auto", "all", *available_codecs()]


def get_codec(codec: str | Codec[Any], **config: Any) -> Codec[Any]:
    """A codec instance from a name (fresh, with ``config``) or an instance (as is).

    Options are validated when the codec is built: their type and range, and
    the error names the option. Keep the instance to carry its state (round
    counter, adaptive parameters) across calls.

    Args:
        codec: A registered name (see :func:`available_codecs`) or a
            :class:`hopq.Codec` instance, returned as it is.
        **config: Options of the codec's configuration dataclass (e.g.
            DynamiQ's ``budget``); only with a name.

    Returns:
        The codec instance.

    Raises:
        TypeError: ``codec`` is neither a name nor a Codec, or an option is
            unknown to the codec or has the wrong type.
        ValueError: An unknown name, an option out of range, or options passed
            with an instance.

    Example:
        >>> import hopq
        >>> codec = hopq.get_codec("mxfp8", block=32)
        >>> codec.name, codec.config.block
        ('mxfp8', 32)
        >>> hopq.get_codec("dynamiq", bits=3)
        Traceback (most recent call last):
        ...
        TypeError: codec 'dynamiq' has no option 'bits'; ...
    """
    if isinstance(codec, Codec):
        if config:
            raise ValueError("pass config overrides only with a codec name")
        return codec
    if not isinstance(codec, str):
        raise TypeError(f"codec must be a registered name or a Codec, got {codec!r}")
    return codec_info(codec).cls(**config)
