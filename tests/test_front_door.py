"""What a newcomer meets first: the README's size and commands, and a tree that
speaks of the product alone (no words about how the project was made, in any
file or file name)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_LIMIT = 12 * 1024
TEXT_SUFFIXES = {".md", ".py", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".ini", ".sh"}
SCANNED = ("README.md", "CHANGELOG.md", "docs", "src", "tests", "examples", "tools", "Makefile")

# Built from pieces so that this file does not match itself.
_W = "|".join(
    ["sess" + "ions?", "lea" + "s(?:e|es|ed)", "scr" + "atch", "go" + "als?", "ver" + "dicts?"]
)
#: The words of a project's making, whole words, any case.
WORDS = re.compile(rf"\b(?:{_W})\b", re.IGNORECASE)
#: pytest's fixture scope is the one legitimate use of the first word.
ALLOWED = re.compile(r"""scope=["']sess""" + "ion" + r"""["']""")
#: A tracker's numbers: "#" and digits (a hex colour or a format spec is not one).
NUMBERS = re.compile(r"(?<![\w&{:])#\d{1,4}(?![\w])")
#: Files named after runs ("gpt16_s33_report.md").
RUN_NAMES = re.compile(r"(?:^|[_-])s\d{1,3}(?:[_.-]|$)")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", *SCANNED],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        files = [ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        files = [p for s in SCANNED for p in (ROOT / s).rglob("*") if p.is_file()]
    return [f for f in files if f.exists() and "egg-info" not in str(f)]


def test_readme_is_a_product_page_of_at_most_12_kib():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; details belong in docs/"


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    assert "make train" in first_block and "make test" in first_block


def test_the_tree_speaks_of_the_product_alone():
    me = Path(__file__).resolve()
    found = []
    for path in tracked_files():
        rel = path.relative_to(ROOT)
        stem = path.name.rsplit(".", 1)[0]
        if WORDS.search(path.name) or RUN_NAMES.search(stem):
            found.append(f"{rel}: file name")
        if path.resolve() == me or path.suffix not in TEXT_SUFFIXES and path.name != "Makefile":
            continue
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            line = ALLOWED.sub("", line)
            m = WORDS.search(line) or NUMBERS.search(line)
            if m:
                found.append(f"{rel}:{no}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert not found, "words of the project's making:\n" + "\n".join(found)


def test_readme_links_resolve():
    text = README.read_text()
    missing = [
        target
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
        if "://" not in target and not (ROOT / target).exists()
    ]
    assert not missing, f"README links to files that do not exist: {missing}"
