"""``normkit bench`` end to end on small shapes, and ``benchmarks/bench_table.py`` on its
report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("numba")


def test_bench_quick_json(capsys):
    from normkit.cli import main

    rc = main(["bench", "--quick", "--json", "--no-progress", "--repeats", "1",
               "--ops", "layer_norm", "batch_norm", "--dtypes", "float32"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["allocators"]) == {"default", "no-mmap"}
    assert report["allocators"]["no-mmap"]["environment"]["malloc_mmap_max"] == "0"
    rows = report["allocators"]["default"]["results"]
    assert {r["op"] for r in rows} == {"layer_norm", "batch_norm"}
    assert {r["layout"] for r in rows} == {"contiguous", "channels_last"}
    for r in rows:
        assert r["normkit_s"] > 0 and r["torch_s"] > 0 and r["copy_s"] > 0
        assert r["normkit_over_torch"] == pytest.approx(r["normkit_s"] / r["torch_s"])

    # benchmarks/bench_table.py turns such reports into the README's tables and summary
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_table.py"
    spec = importlib.util.spec_from_file_location("bench_table", path)
    bench_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_table)
    for full in (False, True):
        lines = bench_table.table([report, report], full=full).splitlines()
        assert len(lines) == 2 + len(report["allocators"]["no-mmap"]["results"])
        assert all(line.count("|") == lines[0].count("|") for line in lines)
    r = report["allocators"]["no-mmap"]["results"][0]
    assert f"{r['normkit_over_torch']:.2f}" in lines[2]
    text = bench_table.summary([report])
    assert "layer_norm" in text and "targets" in text
