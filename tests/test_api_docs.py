"""The API reference: every public name documented, and the site builds strictly.

Every name in ``hopq.__all__`` has a Google-style docstring (the sections
mkdocstrings renders in docs/api.md), by kind:

* functions: ``Args:`` naming every parameter (left out only when there is
  none), ``Returns:``, ``Raises:`` (or the words "raises nothing" where that
  is the truth) and ``Example:``;
* classes: ``Args:`` naming every constructor parameter, or for dataclasses
  ``Attributes:`` naming every field; and ``Example:``;
* exceptions and warnings: a description beyond the summary line, a
  ``Raised by:`` section saying which calls raise (or issue) it, and
  ``Example:``.

The public methods users call (``HookState.step_metrics`` ...) have ``Args:``
naming their parameters and ``Returns:`` where they return something; the
user-facing ones also an ``Example:``. No ``Args:`` entry names a parameter
the signature lacks. Every ``>>>`` example runs as a doctest. With mkdocs
installed (the ``docs`` extra, which ``make setup`` installs), ``mkdocs build
--strict`` must succeed: a broken link between pages or a docstring that
mkdocstrings cannot read fails it.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import hopq

ROOT = Path(__file__).resolve().parent.parent

#: Section titles (a line of their own, not indented, ending in a colon).
_SECTION = re.compile(r"^(?P<title>[A-Z][A-Za-z ]*):\s*$")
#: An entry of Args/Attributes/Raises: ``name:`` or ``name (type):``, indented.
_ENTRY = re.compile(r"^    (?P<name>\*{0,2}[A-Za-z_][\w.]*)(?:\s*\([^)]*\))?:")


def sections(doc: str) -> dict[str, list[str]]:
    """Section title -> its lines ("" holds the text before the first section)."""
    out: dict[str, list[str]] = {"": []}
    current = ""
    for line in doc.splitlines():
        m = _SECTION.match(line)
        if m:
            current = m["title"]
            out.setdefault(current, [])
        else:
            out[current].append(line)
    return out


def entries(lines: list[str]) -> list[str]:
    """The names an Args/Attributes/Raises section documents."""
    return [m["name"] for line in lines if (m := _ENTRY.match(line))]


def doc_of(obj: Any) -> str:
    doc = inspect.getdoc(obj)
    assert doc, f"{obj!r} has no docstring"
    return doc


def params(func: Any) -> list[str]:
    """The parameters an Args section must name (``**kw`` as ``**kw``)."""
    out = []
    for p in inspect.signature(func).parameters.values():
        if p.name == "self":
            continue
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        out.append(prefix + p.name)
    return out


def check_args(where: str, secs: dict[str, list[str]], expected: list[str]) -> None:
    if not expected:
        return
    assert "Args" in secs, f"{where}: no Args section"
    got = entries(secs["Args"])
    assert got == expected, f"{where}: Args documents {got}, the signature has {expected}"


def public_objects() -> list[tuple[str, Any]]:
    # FSDPReduceScatter resolves lazily through hopq.__getattr__
    return [(name, getattr(hopq, name)) for name in hopq.__all__]


def kind(obj: Any) -> str:
    if inspect.isclass(obj) and issubclass(obj, BaseException | Warning):
        return "exception"
    return "class" if inspect.isclass(obj) else "function"


@pytest.mark.parametrize(
    ("name", "obj"), public_objects(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_public_name_documented(name: str, obj: Any) -> None:
    doc = doc_of(obj)
    secs = sections(doc)
    summary = secs[""][0] if secs[""] else ""
    assert summary.strip(), f"{name}: no summary line"
    k = kind(obj)
    if k == "function":
        check_args(name, secs, params(obj))
        assert "Returns" in secs, f"{name}: no Returns section"
        assert "Raises" in secs or "raises nothing" in doc.lower(), f"{name}: no Raises section"
        assert "Example" in secs or "Examples" in secs, f"{name}: no Example section"
    elif k == "class":
        if dataclasses.is_dataclass(obj):
            fields = [f.name for f in dataclasses.fields(obj)]
            assert "Attributes" in secs, f"{name}: a dataclass needs an Attributes section"
            got = entries(secs["Attributes"])
            assert got == fields, f"{name}: Attributes documents {got}, the fields are {fields}"
        else:
            check_args(name, secs, params(obj.__init__))
        assert "Example" in secs or "Examples" in secs, f"{name}: no Example section"
    else:
        text = [line for line in secs[""] if line.strip()]
        assert len(text) > 1, f"{name}: an exception needs a description beyond its summary"
        assert secs.get("Raised by"), f"{name}: no 'Raised by:' section"
        assert "Example" in secs or "Examples" in secs, f"{name}: no Example section"
    for title in ("Args", "Raises", "Attributes"):
        if title in secs:
            assert entries(secs[title]), f"{name}: an empty {title} section"


#: Public methods users call: (class name in hopq, method, needs an Example).
METHODS = [
    ("HookState", "step_metrics", True),
    ("HookState", "state_dict", True),
    ("HookState", "load_state_dict", True),
    ("FSDPReduceScatter", "install", True),
    ("FSDPReduceScatter", "step_metrics", True),
    ("FSDPReduceScatter", "state_dict", True),
    ("FSDPReduceScatter", "load_state_dict", True),
    *[
        ("Codec", m, False)
        for m in (
            "plan",
            "prepare",
            "encode",
            "decode_accumulate",
            "decode_accumulate_encode",
            "decode",
            "finish",
            "state_dict",
            "load_state_dict",
        )
    ],
]


@pytest.mark.parametrize(("cls", "method", "example"), METHODS, ids=lambda v: str(v))
def test_public_method_documented(cls: str, method: str, example: bool) -> None:
    func = getattr(getattr(hopq, cls), method)
    where = f"{cls}.{method}"
    doc = doc_of(func)
    secs = sections(doc)
    check_args(where, secs, params(func))
    returns = inspect.signature(func).return_annotation
    if returns not in (None, "None", inspect.Signature.empty):
        assert "Returns" in secs, f"{where}: no Returns section"
    if example:
        assert "Example" in secs or "Examples" in secs, f"{where}: no Example section"


def test_docstring_examples_run() -> None:
    """Every ``>>>`` example in the public docstrings gives the output it shows."""
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    objs = [obj for _, obj in public_objects()]
    objs += [getattr(getattr(hopq, c), m) for c, m, _ in METHODS]
    ran = 0
    for obj in objs:
        for test in finder.find(obj, getattr(obj, "__qualname__", repr(obj)), globs={}):
            if test.examples:
                runner.run(test)
                ran += len(test.examples)
    assert ran > 0
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {ran} docstring examples failed"


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason="mkdocs is not installed (the 'docs' extra: pip install -e '.[docs]')",
)
def test_docs_build_strict(tmp_path: Path) -> None:
    """The site and its API reference build with warnings as errors."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q"]
        + ["-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "api" / "index.html").is_file()
