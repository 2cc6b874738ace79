"""Griffe extension for the API reference: hopq's docstrings name other objects
with Sphinx roles (``:func:`hopq.all_reduce```, ``:meth:`install```), which
mkdocstrings would print as they are. This turns each into inline code, linked
to the object's entry in the reference where it has one (an optional autoref:
no link, and no warning, where the object is not rendered)."""

from __future__ import annotations

import re
from typing import Any

import griffe

#: ``:role:`target``` or ``:role:`title <target>```, ``~`` shortening the title
#: to the last component.
_ROLE = re.compile(
    r":(?:py:)?(?:func|meth|class|attr|mod|data|exc|obj|const|ref):"
    r"`(?P<tilde>~?)(?P<body>[^`<]+?)(?:\s*<(?P<target>[^`>]+)>)?`"
)


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx cross-reference roles in docstrings as markdown."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        doc = obj.docstring
        if doc is None or ":" not in doc.value:
            return
        doc.value = _ROLE.sub(lambda m: _render(m, obj, loader), doc.value)


def _render(m: re.Match[str], obj: griffe.Object, loader: griffe.GriffeLoader) -> str:
    target = (m["target"] or m["body"]).strip().rstrip("()")
    title = m["body"].strip() if m["target"] else target
    if m["tilde"]:
        title = title.rsplit(".", 1)[-1]
    path = _resolve(target, obj, loader)
    code = f"<code>{title}</code>"
    if path is None:
        return code
    return f'<autoref identifier="{path}" optional>{code}</autoref>'


def _resolve(target: str, obj: griffe.Object, loader: griffe.GriffeLoader) -> str | None:
    """The path of the object ``target`` names, seen from ``obj``: as written,
    or relative to ``obj``'s class and module; None when none exists."""
    candidates = [target]
    scope: griffe.Object | None = obj if obj.is_class or obj.is_module else obj.parent
    while scope is not None:
        candidates.append(f"{scope.path}.{target}")
        scope = scope.parent
    for path in candidates:
        try:
            found = loader.modules_collection[path]
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        return str(found.path)
    return None
