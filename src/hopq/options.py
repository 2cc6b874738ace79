"""Helpers for hopq's frozen, validated option dataclasses (codec configs and the
jobs' options): field metadata for the command line, enum coercion, checks.

A field declared with :func:`option` carries its help text (and, where it is
not an enum, its choices) so that ``hopq.cli`` can build ``--help`` from the
dataclass itself; ``__post_init__`` methods call :func:`coerce_enums` once
instead of converting each enum field by hand.

This module is the ground floor: it imports nothing of hopq (the command line's
``--codec-option``, which needs the codec registry, is parsed in :mod:`hopq.cli`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
import typing
from collections.abc import Callable, Sequence
from typing import Any


def option(
    default: Any,
    help: str,
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
    **meta: Any,
) -> Any:
    """A dataclass field with a default, a help text and optional choices (a
    sequence, or a function returning one when the choices are only known at
    run time, e.g. the registered codecs)."""
    md = {"help": help, **meta}
    if choices is not None:
        md["choices"] = choices if callable(choices) else tuple(choices)
    if isinstance(default, list | dict | set):
        raise TypeError("option defaults must be immutable (use a tuple)")
    return dataclasses.field(default=default, metadata=md)


_HINTS: dict[type, dict[str, Any]] = {}


def changed_options(obj: Any) -> set[str]:
    """The fields of the dataclass ``obj`` whose values differ from their defaults."""
    return {f.name for f in dataclasses.fields(obj) if getattr(obj, f.name) != f.default}


def check_scoped(
    obj: Any, needs: dict[str, Sequence[str]], active: Sequence[str], flag: str
) -> None:
    """Refuse options that would do nothing: ``needs`` maps an option (a field of
    the dataclass ``obj``) to the values of ``flag`` (e.g. a benchmark's parts)
    under which it acts; an option changed from its default while none of them
    is in ``active`` raises ValueError."""
    on = set(active)
    for name in sorted(changed_options(obj)):
        scope = needs.get(name)
        if scope is not None and not on & set(scope):
            where = f"{flag} {' or '.join(scope)}".strip()  # scope ("",): the flag itself
            raise ValueError(
                f"--{name.replace('_', '-')} only acts with {where}, which this run "
                "does not have: it would be ignored"
            )


def field_types(cls: type) -> dict[str, Any]:
    """The resolved type hints of a dataclass (cached per class)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def enum_type(hint: Any) -> type[enum.Enum] | None:
    """The Enum class a field hint names (``E`` or ``E | None``), else None."""
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    for arg in typing.get_args(hint):
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return arg
    return None


def coerce_enums(obj: Any, owner: str) -> None:
    """Convert every enum-typed field of the frozen dataclass ``obj`` from its value
    (e.g. the string ``"exact"``) to the member, or raise ValueError naming the
    field and its choices."""
    for name, hint in field_types(type(obj)).items():
        cls = enum_type(hint)
        value = getattr(obj, name, None)
        if cls is None or value is None or isinstance(value, cls):
            continue
        try:
            object.__setattr__(obj, name, cls(value))
        except ValueError:
            choices = [str(e.value) for e in cls]
            raise ValueError(f"{owner}: {name} must be one of {choices}, got {value!r}") from None


def check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int (bools, floats and strings refused), within [lo, hi]."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    v = operator.index(value)
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def check_finite(name: str, value: Any, *, positive: bool = False) -> float:
    """``value`` as a finite float (and > 0 when ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or (positive and not v > 0):
        raise ValueError(
            f"{name} must be a finite{' positive' if positive else ''} number, got {v}"
        )
    return v


def check_timeout(value: Any) -> float | None:
    """A call's timeout in seconds: a finite positive number, or None for the
    process group's own timeout (``init_process_group(timeout=)``)."""
    return None if value is None else check_finite("timeout", value, positive=True)


#: Range keys an :func:`option` may carry: ``lo``/``hi`` inclusive bounds,
#: ``gt``/``lt`` exclusive ones; :func:`check_options` enforces them.
RANGE_KEYS = ("lo", "hi", "gt", "lt")


def _range_text(meta: Any) -> str:
    parts = [
        f"{op} {meta[k]}"
        for k, op in zip(RANGE_KEYS, (">=", "<=", ">", "<"), strict=True)
        if k in meta
    ]
    return " and ".join(parts)


def _check_scalar(owner: str, name: str, hint: Any, value: Any, meta: Any) -> Any:
    """One value of the scalar type ``hint`` (bool, int, float, str), its range
    and choices checked; returns it (an int-valued float option as a float)."""
    what = f"{owner}: {name}"
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{what} must be True or False, got {value!r}")
        return value
    if hint is int:
        v: Any = check_int(what, value)
    elif hint is float:
        v = check_finite(what, value)
    elif hint is str:
        if not isinstance(value, str):
            raise TypeError(f"{what} must be a string, got {value!r}")
        v = value
    else:
        return value
    choices = meta.get("choices")
    if choices is not None and not callable(choices) and v not in choices:
        raise ValueError(f"{what} must be one of {list(choices)}, got {value!r}")
    bounds = (
        ("lo", lambda a, b: a >= b),
        ("hi", lambda a, b: a <= b),
        ("gt", lambda a, b: a > b),
        ("lt", lambda a, b: a < b),
    )
    for key, ok in bounds:
        if key in meta and not ok(v, meta[key]):
            raise ValueError(f"{what} must be {_range_text(meta)}, got {value!r}")
    return v


def check_options(obj: Any, owner: str) -> None:
    """Check every field of the frozen dataclass ``obj`` against its type hint and
    its :func:`option` metadata, so that a wrong value fails at construction
    with an error naming the option and what it accepts: enums are coerced
    (:func:`coerce_enums`), bools must be bools (``"no"`` is not False), ints
    ints (``8.0`` is refused), floats finite numbers, each within its ``lo``,
    ``hi``, ``gt``, ``lt`` and ``choices``; ``X | None`` takes None; a
    ``tuple[int, ...]`` is checked entry by entry. Other types are left to the
    dataclass's own ``__post_init__``. Raises TypeError (a wrong type) or
    ValueError (out of range)."""
    coerce_enums(obj, owner)
    for f in dataclasses.fields(obj):
        hint = field_types(type(obj))[f.name]
        value = getattr(obj, f.name)
        args = typing.get_args(hint)
        if type(None) in args:
            if value is None:
                continue
            rest = [a for a in args if a is not type(None)]
            hint = rest[0] if len(rest) == 1 else hint
        elif value is None:
            raise TypeError(f"{owner}: {f.name} takes no None (its default is {f.default!r})")
        if enum_type(hint) is not None:
            continue  # coerced above
        if typing.get_origin(hint) is tuple:
            targs = typing.get_args(hint)
            if len(targs) == 2 and targs[1] is Ellipsis and targs[0] is int:
                vals = int_tuple(f"{owner}: {f.name}", value)
                for v in vals:
                    _check_scalar(owner, f"{f.name} entry", int, v, f.metadata)
                object.__setattr__(obj, f.name, vals)
            continue
        v = _check_scalar(owner, f.name, hint, value, f.metadata)
        if hint is float and not isinstance(value, float):
            object.__setattr__(obj, f.name, v)


def int_tuple(name: str, value: Any) -> tuple[int, ...]:
    """A tuple of ints from a tuple or list of ints; a string is refused (``"248"``
    is not the widths 2, 4, 8)."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of integers, got {value!r}")
    return tuple(check_int(f"{name} entry", v) for v in value)


def parse_value(hint: Any, text: str, what: str) -> Any:
    """A command-line string as a value of the field type ``hint`` (bool, int,
    float, str, an enum, ``X | None``, ``tuple[int, ...]`` as ``2,4,8``)."""
    args = typing.get_args(hint)
    if type(None) in args:
        if text.lower() in ("none", "null", ""):
            return None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    cls = enum_type(hint)
    if cls is not None:
        return text  # coerce_enums checks it and names the choices
    if hint is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{what}: expected true or false, got {text!r}")
    if typing.get_origin(hint) is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:  # a fixed tuple: "4:0.3"
            parts = text.split(":")
            if len(parts) != len(args):
                raise ValueError(f"{what}: expected {len(args)} values joined by ':', got {text!r}")
            return tuple(parse_value(a, p, what) for a, p in zip(args, parts, strict=True))
        parts = [p for p in text.replace(" ", ",").split(",") if p]
        return tuple(parse_value(args[0], p, what) for p in parts)
    try:
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
    except ValueError:
        raise ValueError(f"{what}: expected {hint.__name__}, got {text!r}") from None
    return text
