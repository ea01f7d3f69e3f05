"""docs/architecture.md names files that exist, and every module of backends/ and nn/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "normkit"
DOC = (ROOT / "docs" / "architecture.md").read_text()


def _files():
    return [p.relative_to(SRC).as_posix() for p in SRC.rglob("*")
            if p.suffix in (".py", ".cpp") and "__pycache__" not in p.parts]


def test_every_file_named_exists():
    files = _files()
    named = set(re.findall(r"[\w/]*\w\.(?:py|cpp)\b", DOC))
    assert named
    elsewhere = [p.relative_to(ROOT).as_posix() for folder in ("benchmarks", "tests")
                 for p in (ROOT / folder).rglob("*.py")]
    missing = sorted(n for n in named
                     if not (ROOT / n).exists()
                     and not any(f == n or f.endswith("/" + n) for f in files + elsewhere))
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_module_of_backends_and_nn_is_named():
    tree = DOC[DOC.index("```"):DOC.index("```", DOC.index("```") + 3)]
    names = set(re.findall(r"\b[\w]+\.(?:py|cpp)\b", tree))
    unnamed = sorted(f for f in _files()
                     if f.startswith(("backends/", "nn/")) and f.split("/")[-1] not in names
                     and f.split("/")[-1] != "__init__.py" or
                     (f in ("backends/__init__.py", "backends/cpu/__init__.py")
                      and "__init__.py" not in names))
    assert not unnamed, f"docs/architecture.md's tree leaves out {unnamed}"
