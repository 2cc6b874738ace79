"""Codec registry: codecs register by name; the engine and the test grid read it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hopq.codecs.base import FLOAT_DTYPES, Codec


@dataclass(frozen=True)
class CodecInfo:
    """What a registered codec supports, and why it refuses what it does not."""

    name: str
    cls: type[Codec]
    summary: str
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    devices: tuple[str, ...] = ("cpu", "cuda")
    topologies: tuple[str, ...] | None = None  # None: every topology

    def refusal(self, *, dtype: torch.dtype, device: torch.device, topology: str) -> str | None:
        if dtype not in self.dtypes:
            return f"codec {self.name!r} does not take {dtype}; it takes {[str(d) for d in self.dtypes]}"
        if device.type not in self.devices:
            return f"codec {self.name!r} does not run on {device.type}"
        if self.topologies is not None and topology not in self.topologies:
            return f"codec {self.name!r} does not run on topology {topology!r}; it runs on {self.topologies}"
        return None


_REGISTRY: dict[str, CodecInfo] = {}


def register(name: str, summary: str, **support: Any) -> Callable[[type[Codec]], type[Codec]]:
    """Class decorator: register a Codec subclass under ``name``."""

    def deco(cls: type[Codec]) -> type[Codec]:
        if name in _REGISTRY:
            raise ValueError(f"codec {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = CodecInfo(name=name, cls=cls, summary=summary, **support)
        return cls

    return deco


def available_codecs() -> list[str]:
    """Names of every registered codec, in registration order."""
    return list(_REGISTRY)


def codec_info(name: str) -> CodecInfo:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; available: {available_codecs()}") from None


def get_codec(codec: str | Codec, **config: Any) -> Codec:
    """A codec instance from a name (fresh, with ``config``) or an instance (as is)."""
    if isinstance(codec, Codec):
        if config:
            raise ValueError("pass config overrides only with a codec name")
        return codec
    return codec_info(codec).cls(**config)
