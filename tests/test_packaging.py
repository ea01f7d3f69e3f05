"""What a user installs: the sdist and the wheel built from this checkout (setuptools'
own build backend, offline, on a copy of the project's files) carry every module and
C++ source of the package, the license and the ``normkit`` command."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p.relative_to(ROOT / "src").as_posix()
                 for p in (ROOT / "src" / "normkit").rglob("*")
                 if p.suffix in (".py", ".cpp") and "__pycache__" not in p.parts)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist names, wheel names, the wheel's entry_points.txt), built from a copy."""
    where = tmp_path_factory.mktemp("project")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, where / name)
    shutil.copytree(ROOT / "src", where / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = where / "dist"
    code = ("import sys; from setuptools import build_meta as b; "     # (b rewrites sys.argv)
            "out = sys.argv[1]; b.build_sdist(out); b.build_wheel(out)")
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=where, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (sdist,), (wheel,) = list(out.glob("*.tar.gz")), list(out.glob("*.whl"))
    with tarfile.open(sdist) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    with zipfile.ZipFile(wheel) as z:
        in_wheel = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in in_wheel
                            if n.endswith(".dist-info/entry_points.txt"))
    return in_sdist, in_wheel, entry_points


def test_the_sdist_carries_the_sources_and_the_license(built):
    in_sdist, _, _ = built
    missing = [n for n in ("LICENSE", "README.md", "pyproject.toml",
                           *(f"src/{s}" for s in SOURCES)) if n not in in_sdist]
    assert not missing, f"not in the sdist: {missing}"


def test_the_wheel_carries_every_module_the_cpp_sources_and_the_license(built):
    _, in_wheel, entry_points = built
    assert any(s.endswith(".cpp") for s in SOURCES)     # (the C++ executor's sources)
    missing = [s for s in SOURCES if s not in in_wheel]
    assert not missing, f"not in the wheel (package-data or packages.find): {missing}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in in_wheel), sorted(in_wheel)
    assert "normkit = normkit.cli:main" in entry_points, entry_points
