"""hopq's layers, read from its import graph: nothing imports upward.

Every module under ``src/hopq`` is parsed with :mod:`ast` (nothing is imported);
its imports of ``hopq`` modules are collected, relative ones and those inside
functions included, ``if TYPE_CHECKING:`` blocks left out (they never run).
Each module belongs to a *group* (``hopq.codecs``, ``hopq.sim``, ...: its
sub-package, or itself for a top-level module) and each group to a level:

=====  ==========================================  ============================================
level  groups                                      what they are
=====  ==========================================  ============================================
0      ``errors``, ``options``                     the ground floor: hopq's exceptions and the
                                                   option checks every config uses; anyone may
                                                   import them, they import no hopq module
1      ``numerics``                                rng, bit packing, level tables, fp formats
2      ``kernels``                                 the kernel backend table and its selection
3      ``codecs``                                  each codec with its reference and kernels
4      ``comm``                                    schedules, transport, engine, collectives
5      ``integrations``, ``sim``                   DDP/FSDP and frameworks; the simulator
6      ``hopq`` (``hopq/__init__.py``)             the public API, gathered from the above
7      ``cli``, ``train``, ``bench``, ``cluster``,  the harness above the library, which the
       ``reporting``, ``__main__``                 library never imports (``reporting``: the
                                                   report helpers of the job and benchmarks)
=====  ==========================================  ============================================

A module may import a module of its own group or of a lower level; groups of one
level do not import each other (``sim`` and ``integrations`` are siblings), except
in the harness, whose parts call one another (``cli`` runs ``bench`` and ``train``).
A new top-level module or sub-package needs a row in :data:`LEVELS`.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

#: Group -> level (see the module docstring). A group is ``hopq.<first name>``.
LEVELS: dict[str, int] = {
    "hopq.errors": 0,
    "hopq.options": 0,
    "hopq.numerics": 1,
    "hopq.kernels": 2,
    "hopq.codecs": 3,
    "hopq.comm": 4,
    "hopq.integrations": 5,
    "hopq.sim": 5,
    "hopq": 6,
    "hopq.cli": 7,
    "hopq.train": 7,
    "hopq.bench": 7,
    "hopq.cluster": 7,
    "hopq.reporting": 7,
    "hopq.__main__": 7,
}
#: The level whose groups may import one another.
HARNESS = 7


@dataclass(frozen=True)
class Import:
    module: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}"


@cache
def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, whether it is a package's ``__init__``)."""
    out = {}
    for path in sorted((SRC / "hopq").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts.pop()
        out[".".join(parts)] = (path, package)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_in(module: str, package: bool, text: str) -> list[Import]:
    """The imports of hopq modules in ``text``, the source of ``module``.
    ``from a import b`` targets the module ``a.b`` where it exists, else ``a``
    (a name in ``a``'s namespace)."""
    mods = modules()
    here = module if package else module.rpartition(".")[0]
    out = []
    for node in _nodes(ast.parse(text)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")
                base = parts[: len(parts) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [
                f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names
            ]
        else:
            continue
        out += [Import(module, node.lineno, t) for t in targets if t.split(".")[0] == "hopq"]
    return sorted(out, key=lambda i: i.line)


@cache
def imports() -> tuple[Import, ...]:
    """Every import of a hopq module by a hopq module."""
    return tuple(
        imp
        for name, (path, package) in modules().items()
        for imp in imports_in(name, package, path.read_text())
    )


def group(module: str) -> str:
    return ".".join(module.split(".")[:2])


def allowed(imp: Import) -> bool:
    src, dst = group(imp.module), group(imp.target)
    if src == dst:
        return True
    lo, hi = LEVELS[dst], LEVELS[src]
    return lo < hi or lo == hi == HARNESS


def _report(bad: list[Import]) -> str:
    return "\n".join(
        f"  {b}  ({group(b.module)}: level {LEVELS[group(b.module)]}, "
        f"{group(b.target)}: level {LEVELS[group(b.target)]})"
        for b in bad
    )


def test_every_module_has_a_level():
    missing = sorted({group(m) for m in modules()} - set(LEVELS))
    assert not missing, f"groups without a level in LEVELS: {missing}"
    assert imports(), "no imports found: the parser is broken"


def test_nothing_imports_upward():
    bad = [imp for imp in imports() if not allowed(imp)]
    assert not bad, "imports against the layers (module:line imports target):\n" + _report(bad)


def test_codecs_never_import_comm():
    """A codec does not know which schedule or transport carries it (DESIGN)."""
    bad = [
        imp
        for imp in imports()
        if group(imp.module) == "hopq.codecs" and group(imp.target) == "hopq.comm"
    ]
    assert not bad, "codecs importing comm:\n" + _report(bad)


def _reachable(start: str) -> set[str]:
    graph: dict[str, set[str]] = {}
    for imp in imports():
        graph.setdefault(imp.module, set()).add(imp.target)
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for t in graph.get(m, ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def test_no_cycle_between_the_job_and_its_report():
    """The report reads the job's records; the job must not be needed to read them."""
    job, report = "hopq.train.job", "hopq.train.report"
    assert job in modules() and report in modules()
    assert not (report in _reachable(job) and job in _reachable(report)), (
        "hopq.train.job and hopq.train.report import each other:\n"
        + _report([i for i in imports() if {i.module, i.target} == {job, report}])
    )


def _guarded(node: ast.AST) -> bool:
    """Whether ``node`` is a ``try`` whose handler catches a missing package."""
    names = {"ImportError", "ModuleNotFoundError"}
    return isinstance(node, ast.Try) and any(
        h.type is not None and {n.id for n in ast.walk(h.type) if isinstance(n, ast.Name)} & names
        for h in node.handlers
    )


def _required_packages(module: str) -> set[str]:
    """The packages outside the standard library that ``module`` imports, but for
    those it imports in a ``try`` that handles their absence."""
    path, _ = modules()[module]
    out = set()
    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
        if _guarded(node):
            assert isinstance(node, ast.Try)
            stack += node.handlers + node.orelse + node.finalbody
        else:
            stack += ast.iter_child_nodes(node)
    return out - set(sys.stdlib_module_names) - {"hopq", "__future__"}


def test_kernel_table_and_numerics_need_torch_alone():
    """``hopq.kernels`` names the backends' packages without importing them, and
    the numerics are torch code (numpy where present, with a fallback); only the
    numba kernels' integer intrinsics (``numerics/u32.py``, imported by those
    kernels alone) need numba."""
    bad = {
        m: sorted(_required_packages(m) - {"torch"})
        for m in modules()
        if group(m) in ("hopq.kernels", "hopq.numerics") and m != "hopq.numerics.u32"
    }
    bad = {m: pkgs for m, pkgs in bad.items() if pkgs}
    assert not bad, f"modules that need more than torch: {bad}"


def test_the_checks_see_what_they_check():
    """The rules above can fail: an upward import, a relative one, one inside a
    function and one under TYPE_CHECKING are classified as they should be."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "from ..comm import engine\n"
        "def f():\n"
        "    from hopq.sim import simulate\n"
        "if TYPE_CHECKING:\n"
        "    from hopq.integrations import ddp\n"
        "from . import base\n"
    )
    found = imports_in("hopq.codecs.x", False, src)
    assert [str(i) for i in found] == [
        "hopq.codecs.x:2 imports hopq.comm.engine",
        "hopq.codecs.x:4 imports hopq.sim",
        "hopq.codecs.x:7 imports hopq.codecs.base",
    ]
    assert [allowed(i) for i in found] == [False, False, True]
    assert allowed(Import("hopq.comm.engine", 1, "hopq.codecs.base"))
    assert allowed(Import("hopq.bench.x", 1, "hopq.train.job"))  # the harness
    assert not allowed(Import("hopq.sim", 1, "hopq.integrations.ddp"))  # siblings
    assert not allowed(Import("hopq.codecs.x", 1, "hopq"))  # the API sits above the codecs
