"""`normkit scale` end to end: CSV and Parquet, pass-through columns, errors, bounded memory.

Expected values come from scikit-learn fitted on the same numbers read with pyarrow.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("tqdm")
pytest.importorskip("sklearn")
import pyarrow.csv as pcsv  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from sklearn import preprocessing as skp  # noqa: E402

# the scale subcommand alone (the other subcommands belong to other modules)
RUNNER = textwrap.dedent("""
    import argparse, resource, sys
    from normkit.cli import scale
    parser = argparse.ArgumentParser(prog="normkit")
    scale.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(sys.argv[1:])
    rc = args.func(args)
    print("maxrss_kb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    sys.exit(rc)
""")


def normkit(*argv):
    """Run ``normkit <argv>`` in-process through the scale parser; return the exit code."""
    import argparse

    from normkit.cli import scale

    parser = argparse.ArgumentParser(prog="normkit")
    scale.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args([str(a) for a in argv])
    return args.func(args)


def make_table(n, seed=0):
    rng = np.random.default_rng(seed)
    return pa.table({
        "id": [f"row{i}" for i in range(n)],
        "x": rng.normal(size=n) * 3 + 1e6,
        "y": rng.integers(-50, 50, size=n),
        "when": [f"2024-01-{i % 28 + 1:02d}" for i in range(n)],
        "z": np.where(rng.random(n) < 0.1, np.nan, rng.normal(size=n) * 1e-3),
    })


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
@pytest.mark.parametrize("method", ["standard", "minmax"])
def test_fit_transform_inverse_round_trip(tmp_path, fmt, method):
    table = make_table(2500)
    data = tmp_path / f"d.{fmt}"
    (pcsv.write_csv if fmt == "csv" else pq.write_table)(table, data)
    scaler = tmp_path / "s.json"
    assert normkit("scale", "fit", data, "--method", method, "-o", scaler, "--chunk-mb", "0.02",
                   "--no-progress") == 0
    doc = json.loads(scaler.read_text())
    assert doc["feature_names_in"] == ["x", "y", "z"]

    X = np.column_stack([np.asarray(table[c].to_numpy(zero_copy_only=False), np.float64) for c in "xyz"])
    if fmt == "csv":  # what a CSV round trip of the floats gives back
        back = pcsv.read_csv(data)
        X = np.column_stack([back[c].to_numpy(zero_copy_only=False).astype(np.float64) for c in "xyz"])
    ref = (skp.StandardScaler() if method == "standard" else skp.MinMaxScaler()).fit(X)

    out = tmp_path / f"o.{fmt}"
    assert normkit("scale", "transform", data, "--scaler", scaler, "-o", out, "--chunk-mb", "0.02",
                   "--no-progress") == 0
    got = pcsv.read_csv(out, convert_options=pcsv.ConvertOptions(
        column_types={"id": pa.string(), "when": pa.string()})) if fmt == "csv" else pq.read_table(out)
    assert got.column_names == table.column_names
    assert got["id"].to_pylist() == table["id"].to_pylist()  # passed through unchanged
    assert got["when"].to_pylist() == table["when"].to_pylist()
    Z = np.column_stack([got[c].to_numpy(zero_copy_only=False).astype(np.float64) for c in "xyz"])
    np.testing.assert_allclose(Z, ref.transform(X), rtol=1e-9, atol=1e-9)

    inv = tmp_path / "inv.parquet"
    assert normkit("scale", "inverse", out, "--scaler", scaler, "-o", inv, "--no-progress") == 0
    W = np.column_stack([pq.read_table(inv)[c].to_numpy(zero_copy_only=False) for c in "xyz"])
    np.testing.assert_allclose(W, ref.inverse_transform(ref.transform(X)), rtol=1e-12)


def test_fit_several_files_equals_one(tmp_path):
    t = make_table(3000)
    pcsv.write_csv(t.slice(0, 1000), tmp_path / "a.csv")
    pq.write_table(t.slice(1000), tmp_path / "b.parquet")
    pcsv.write_csv(t, tmp_path / "all.csv")
    assert normkit("scale", "fit", tmp_path / "a.csv", tmp_path / "b.parquet", "-o", tmp_path / "s1.json",
                   "--no-progress") == 0
    assert normkit("scale", "fit", tmp_path / "all.csv", "-o", tmp_path / "s2.json", "--no-progress") == 0
    a, b = (json.loads((tmp_path / f"s{i}.json").read_text())["state"] for i in (1, 2))
    np.testing.assert_allclose(a["mean_"], b["mean_"], rtol=1e-12)
    np.testing.assert_allclose(a["var_"], b["var_"], rtol=1e-9)


def test_malformed_rows_name_file_and_line(tmp_path, capsys):
    good = tmp_path / "good.csv"
    good.write_text("id,x\na,1\nb,2\nc,4\n")
    assert normkit("scale", "fit", good, "-o", tmp_path / "s.json", "--no-progress") == 0
    bad = tmp_path / "bad.csv"
    bad.write_text("id,x\na,1\nb,2,3\nc,4\n")
    out = tmp_path / "out.csv"
    assert normkit("scale", "transform", bad, "--scaler", tmp_path / "s.json", "-o", out, "--no-progress") == 1
    assert f"{bad}:3: malformed row: expected 2 fields, got 3" in capsys.readouterr().err
    assert not out.exists()
    bad.write_text("id,x\na,1\nb,2\nc,four\n")
    assert normkit("scale", "fit", bad, "-o", tmp_path / "t.json", "--columns", "x", "--no-progress") == 1
    assert f"{bad}:4: column x holds 'four', not a number" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("named", [False, True])
def test_stray_text_in_a_numeric_column_stops_the_fit(tmp_path, capsys, named):
    rows = [f"r{i},{i * 0.5},{i % 7}" for i in range(50)]
    rows[29] = "r29,n/a,3"  # a null token: read as missing, not as text
    rows[40] = "r40,12..5,3"  # line 42 of the file (the header is line 1)
    data = tmp_path / "stray.csv"
    data.write_text("id,x,k\n" + "\n".join(rows) + "\n")
    columns = ("--columns", "x,k") if named else ()
    assert normkit("scale", "fit", data, *columns, "-o", tmp_path / "s.json", "--no-progress") == 1
    assert f"{data}:42: column x holds '12..5', not a number" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()  # never fitted without the column


def test_stray_text_past_the_sample_stops_the_fit(tmp_path, capsys):
    n = 120_000  # ~1.6 MB: the stray value lies beyond the first MiB that decides the types
    lines = ["x,y"] + [f"{i},{i % 13}" for i in range(n)]
    lines[n - 10] = "oops,1"
    data = tmp_path / "late.csv"
    data.write_text("\n".join(lines) + "\n")
    assert normkit("scale", "fit", data, "-o", tmp_path / "s.json", "--chunk-mb", "0.25", "--no-progress") == 1
    assert f"{data}:{n - 9}: column x holds 'oops', not a number" in capsys.readouterr().err


def test_text_columns_are_listed_on_stderr(tmp_path, capsys):
    table = make_table(300)
    pcsv.write_csv(table, tmp_path / "d.csv")
    pq.write_table(table, tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        assert normkit("scale", "fit", tmp_path / name, "-o", tmp_path / "s.json", "--no-progress") == 0
        err = capsys.readouterr().err
        listed = ("not scaling 2 column(s) that hold text, not numbers: id, when" if name == "d.csv"
                  else "not scaling 2 column(s) of types other than numbers: id (string), when (string)")
        assert listed in err
        assert json.loads((tmp_path / "s.json").read_text())["feature_names_in"] == ["x", "y", "z"]
    assert normkit("scale", "fit", tmp_path / "d.csv", "--columns", "x", "-o", tmp_path / "s.json",
                   "--no-progress") == 0
    assert "not scaling" not in capsys.readouterr().err  # the user chose the columns
    assert normkit("scale", "fit", tmp_path / "d.parquet", "--columns", "x,when", "-o", tmp_path / "t.json",
                   "--no-progress") == 1
    assert "the columns ['when'] hold no numbers (types string)" in capsys.readouterr().err


def test_empty_columns_are_listed_apart_and_bad_values_named_by_column(tmp_path, capsys):
    """A column with no value is said to hold none (not text); a scaler's complaint about
    infinite or overflowing values names the table's columns, and what to do in a table."""
    table = pa.table({"a": [1.0, 2.0, 4.0], "nothing": pa.nulls(3), "b c": [1.0, np.inf, 3.0],
                      "d": [1.0, 1e300, 5.0]})
    pq.write_table(table, tmp_path / "t.parquet")
    (tmp_path / "t.csv").write_text('a,nothing,"b c",d,note\n1,,1,1,x\n2,,inf,1e300,y\n'
                                    '4,,3,5,z\n')
    for name, where in (("t.parquet", ""), ("t.csv", " in the first MiB")):
        data = tmp_path / name
        assert normkit("scale", "fit", data, "--columns", "a,b c", "-o", tmp_path / "s.json",
                       "--no-progress") == 1
        err = capsys.readouterr().err
        assert f"{data}: Input X contains infinity in fit (column 'b c')" in err
        assert "Replace them with empty cells" in err and "np.isinf" not in err
        assert normkit("scale", "fit", data, "--columns", "a,d", "-o", tmp_path / "s.json",
                       "--no-progress") == 1
        assert "The variance of column 'd' overflows float64" in capsys.readouterr().err
        assert normkit("scale", "fit", data, "-o", tmp_path / "s.json", "--no-progress") == 1
        err = capsys.readouterr().err
        assert f"not scaling 1 column(s) with no values{where}: nothing" in err
        assert not any("nothing" in line for line in err.splitlines() if "hold text" in line)
    (tmp_path / "ok.csv").write_text("a,nothing\n1,\n3,\n")
    assert normkit("scale", "fit", tmp_path / "ok.csv", "-o", tmp_path / "s.json",
                   "--no-progress") == 0
    assert normkit("scale", "transform", tmp_path / "t.csv", "--scaler", tmp_path / "s.json",
                   "-o", tmp_path / "out.csv", "--no-progress") == 0
    (tmp_path / "inf.csv").write_text("a,nothing\n1,\ninf,\n")
    assert normkit("scale", "transform", tmp_path / "inf.csv", "--scaler", tmp_path / "s.json",
                   "-o", tmp_path / "out.csv", "--no-progress") == 1
    assert "Replace them with empty cells" in capsys.readouterr().err


def test_a_column_name_used_twice_is_refused(tmp_path, capsys):
    (tmp_path / "d.csv").write_text("a,b,a\n1,2,3\n4,5,6\n")
    (tmp_path / "ok.csv").write_text("a,b\n1,2\n4,5\n")
    assert normkit("scale", "fit", tmp_path / "ok.csv", "-o", tmp_path / "s.json", "--no-progress") == 0
    for argv in (("fit", tmp_path / "d.csv", "-o", tmp_path / "t.json"),
                 ("transform", tmp_path / "d.csv", "--scaler", tmp_path / "s.json", "-o",
                  tmp_path / "out.csv")):
        assert normkit("scale", *argv, "--no-progress") == 1
        assert (f"{tmp_path / 'd.csv'}: the column names ['a'] are each used more than once"
                in capsys.readouterr().err)


def test_parquet_types(tmp_path, capsys):
    """Integers of every width (uint64 past 2^53 rounded to float64, as NumPy's astype
    rounds them), float16 and decimals are scaled; bool, date, dictionary and list columns
    are listed with their types and passed through unchanged."""
    import datetime
    import decimal

    n = 6
    table = pa.table({
        "i8": pa.array(np.arange(n, dtype=np.int8)),
        "u64": pa.array(np.array([0, 1, 2**63, 5, 7, 2**64 - 1], dtype=np.uint64)),
        "f16": pa.array(np.arange(n, dtype=np.float16)),
        "dec": pa.array([decimal.Decimal(f"{i}.25") for i in range(n)], type=pa.decimal128(5, 2)),
        "b": pa.array([True, False, True, True, False, None]),
        "date": pa.array([datetime.date(2024, 1, i + 1) for i in range(n)]),
        "dict": pa.array(["a", "b", "a", "c", "b", "a"]).dictionary_encode(),
    })
    pq.write_table(table, tmp_path / "t.parquet")
    assert normkit("scale", "fit", tmp_path / "t.parquet", "-o", tmp_path / "s.json", "--no-progress") == 0
    assert ("not scaling 3 column(s) of types other than numbers: b (bool), date (date32[day]), "
            "dict (dictionary<values=string, indices=int32, ordered=0>)") in capsys.readouterr().err
    assert normkit("scale", "transform", tmp_path / "t.parquet", "--scaler", tmp_path / "s.json",
                   "-o", tmp_path / "out.parquet", "--no-progress") == 0
    out = pq.read_table(tmp_path / "out.parquet")
    numbers = np.column_stack([np.asarray(table.column(c).to_pylist(), dtype=np.float64)
                               for c in ("i8", "u64", "f16", "dec")])
    np.testing.assert_allclose(np.column_stack([out.column(c).to_numpy() for c in ("i8", "u64", "f16", "dec")]),
                               skp.StandardScaler().fit_transform(numbers), rtol=1e-12, atol=1e-12)
    for name in ("b", "date", "dict"):
        assert out.column(name).equals(table.column(name))


def test_gzipped_csv_is_read(tmp_path):
    import gzip

    table = make_table(500)
    pcsv.write_csv(table, tmp_path / "d.csv")
    with open(tmp_path / "d.csv", "rb") as f, gzip.open(tmp_path / "d.csv.gz", "wb") as g:
        g.write(f.read())
    for name in ("d.csv", "d.csv.gz"):
        assert normkit("scale", "fit", tmp_path / name, "-o", tmp_path / f"{name}.json", "--no-progress") == 0
    a, b = (json.loads((tmp_path / f"{n}.json").read_text())["state"] for n in ("d.csv", "d.csv.gz"))
    assert a == b
    assert normkit("scale", "transform", tmp_path / "d.csv.gz", "--scaler", tmp_path / "d.csv.json",
                   "-o", tmp_path / "o.csv", "--no-progress") == 0
    assert pcsv.read_csv(tmp_path / "o.csv").num_rows == 500
    # and written: a .csv.gz output is gzip, which reads back as the plain one
    assert normkit("scale", "transform", tmp_path / "d.csv", "--scaler", tmp_path / "d.csv.json",
                   "-o", tmp_path / "o.csv.gz", "--no-progress") == 0
    with gzip.open(tmp_path / "o.csv.gz", "rb") as g:
        assert g.read() == (tmp_path / "o.csv").read_bytes()
    assert normkit("scale", "inverse", tmp_path / "o.csv.gz", "--scaler", tmp_path / "d.csv.json",
                   "-o", tmp_path / "back.csv", "--no-progress") == 0


def test_a_later_run_removes_stale_temporaries(tmp_path):
    import fcntl
    import os

    pcsv.write_csv(make_table(200), tmp_path / "d.csv")
    assert normkit("scale", "fit", tmp_path / "d.csv", "-o", tmp_path / "s.json", "--no-progress") == 0
    stale = [tmp_path / ".out.csv.k3j9x_2a.tmp", tmp_path / ".s.json.zz81q0kd.tmp"]
    for path in stale:  # what a killed transform / fit leaves behind
        path.write_bytes(b"x" * 1000)
    busy = tmp_path / ".out.csv.live0001.tmp"  # a writer still at work holds its lock
    busy.write_bytes(b"partial")
    fd = os.open(busy, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    other = tmp_path / ".other.csv.a1b2c3d4.tmp"  # another destination's: not ours to remove
    other.write_bytes(b"y")
    try:
        assert normkit("scale", "transform", tmp_path / "d.csv", "--scaler", tmp_path / "s.json",
                       "-o", tmp_path / "out.csv", "--no-progress") == 0
        assert normkit("scale", "fit", tmp_path / "d.csv", "-o", tmp_path / "s.json", "--no-progress") == 0
        assert busy.exists()
    finally:
        os.close(fd)
    assert not any(p.exists() for p in stale)
    assert other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".other.csv.a1b2c3d4.tmp", ".out.csv.live0001.tmp", "d.csv", "out.csv", "s.json"]


def test_errors_name_the_users_paths(tmp_path, capsys):
    pcsv.write_csv(make_table(50), tmp_path / "d.csv")
    missing = tmp_path / "no" / "such"
    assert normkit("scale", "fit", tmp_path / "d.csv", "-o", missing / "s.json", "--no-progress") == 1
    err = capsys.readouterr().err
    assert f"{missing / 's.json'}: the folder {missing} does not exist" in err
    assert ".tmp" not in err
    assert normkit("scale", "fit", tmp_path / "d.csv", "-o", tmp_path / "s.json", "--no-progress") == 0
    assert normkit("scale", "transform", tmp_path / "d.csv", "--scaler", tmp_path / "s.json",
                   "-o", missing / "o.parquet", "--no-progress") == 1
    err = capsys.readouterr().err
    assert f"the folder {missing} does not exist" in err and ".tmp" not in err
    assert not missing.exists()
    (tmp_path / "dir.csv").mkdir()
    assert normkit("scale", "transform", tmp_path / "d.csv", "--scaler", tmp_path / "s.json",
                   "-o", tmp_path / "dir.csv", "--no-progress") == 1
    assert f"{tmp_path / 'dir.csv'} is a folder" in capsys.readouterr().err


def test_failure_leaves_no_partial_output(tmp_path, capsys):
    n = 20000
    lines = ["id,x"] + [f"r{i},{i}" for i in range(n)]
    lines[n - 5] = "oops,not-a-number"  # late in the file: several chunks are written before it
    data = tmp_path / "late.csv"
    data.write_text("\n".join(lines) + "\n")
    pcsv.write_csv(pa.table({"x": np.arange(10.0)}), tmp_path / "fit.csv")
    assert normkit("scale", "fit", tmp_path / "fit.csv", "-o", tmp_path / "s.json", "--no-progress") == 0
    out = tmp_path / "out.csv"
    out.write_text("previous content\n")
    rc = normkit("scale", "transform", data, "--scaler", tmp_path / "s.json", "-o", out,
                 "--chunk-mb", "0.01", "--no-progress")
    assert rc == 1
    assert f"{data}:{n - 4}:" in capsys.readouterr().err
    assert out.read_text() == "previous content\n"  # untouched: the new output was never renamed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fit.csv", "late.csv", "out.csv", "s.json"]


def test_errors_for_unknown_columns_and_formats(tmp_path, capsys):
    pcsv.write_csv(pa.table({"name": ["a", "b"]}), tmp_path / "text.csv")
    assert normkit("scale", "fit", tmp_path / "text.csv", "-o", tmp_path / "s.json", "--no-progress") == 1
    assert "no numeric columns" in capsys.readouterr().err
    assert normkit("scale", "fit", tmp_path / "text.csv", "--columns", "nope", "-o", tmp_path / "s.json",
                   "--no-progress") == 1
    assert "has no column 'nope' (it has" in capsys.readouterr().err
    (tmp_path / "d.xlsx").write_text("")
    assert normkit("scale", "fit", tmp_path / "d.xlsx", "-o", tmp_path / "s.json", "--no-progress") == 1
    assert "unknown table format" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{")
    pcsv.write_csv(pa.table({"x": [1.0]}), tmp_path / "x.csv")
    assert normkit("scale", "transform", tmp_path / "x.csv", "--scaler", tmp_path / "broken.json",
                   "-o", tmp_path / "o.csv", "--no-progress") == 1
    assert "not valid JSON" in capsys.readouterr().err


def _peak_kb(tmp_path, data, scaler, out):
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, "scale", "transform", str(data), "--scaler", str(scaler),
         "-o", str(out), "--chunk-mb", "0.25"],
        capture_output=True, text=True, check=True)
    assert "%" in proc.stderr  # the progress bar went to stderr
    return int(proc.stdout.split("maxrss_kb")[1])


def test_memory_stays_flat_as_the_file_grows(tmp_path):
    rng = np.random.default_rng(0)
    small, big = 20_000, 160_000  # ~3 MB and ~27 MB of CSV, chunks of 0.25 MB
    cols = {f"c{j}": rng.normal(size=big) for j in range(8)}
    cols["tag"] = np.array(["abcdefgh"] * big)
    table = pa.table(cols)
    pcsv.write_csv(table.slice(0, small), tmp_path / "small.csv")
    pcsv.write_csv(table, tmp_path / "big.csv")
    subprocess.run([sys.executable, "-c", RUNNER, "scale", "fit", str(tmp_path / "small.csv"),
                    "-o", str(tmp_path / "s.json"), "--no-progress"], check=True, capture_output=True)
    size_growth_kb = ((tmp_path / "big.csv").stat().st_size - (tmp_path / "small.csv").stat().st_size) // 1024
    peak_small = _peak_kb(tmp_path, tmp_path / "small.csv", tmp_path / "s.json", tmp_path / "o1.csv")
    peak_big = _peak_kb(tmp_path, tmp_path / "big.csv", tmp_path / "s.json", tmp_path / "o2.csv")
    assert peak_big - peak_small < size_growth_kb / 4, (peak_small, peak_big, size_growth_kb)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_streaming_holds_one_chunk_at_a_time(tmp_path, monkeypatch, fmt):
    import weakref

    from normkit.cli.scale import tables
    from normkit.preprocessing import StandardScaler

    table = make_table(400_000)  # ~20 MB in memory: many chunks of 1 MiB
    data = tmp_path / f"d.{fmt}"
    (pcsv.write_csv if fmt == "csv" else pq.write_table)(table, data, **({} if fmt == "csv" else
                                                                        {"row_group_size": 20_000}))
    total = table.nbytes
    del table
    baseline = pa.total_allocated_bytes()
    chunk = 1
    used, allocated = [], []
    streaming = tables.iter_chunks

    def watched(*args, **kwargs):
        for piece in streaming(*args, **kwargs):
            assert all(ref() is None for ref in used), "a chunk is still held after it was used"
            allocated.append(pa.total_allocated_bytes())
            used.append(weakref.ref(piece))
            yield piece
            del piece

    monkeypatch.setattr(tables, "iter_chunks", watched)
    scaler, out = tmp_path / "s.json", tmp_path / f"o.{fmt}"
    assert normkit("scale", "fit", data, "-o", scaler, "--chunk-mb", chunk, "--no-progress") == 0
    fit_chunks = len(used)
    assert normkit("scale", "transform", data, "--scaler", scaler, "-o", out, "--chunk-mb", chunk,
                   "--no-progress") == 0
    assert fit_chunks >= 5 and len(used) - fit_chunks >= 5
    # what pyarrow holds at any time: a few chunks (Parquet: the row groups being decoded too, and
    # the output row group being encoded), not the table
    held = max(allocated) - baseline
    assert held < 8 * chunk * (1 << 20) < total / 2, (held, total)

    back = pcsv.read_csv(data) if fmt == "csv" else pq.read_table(data)
    X = np.column_stack([back[c].to_numpy(zero_copy_only=False).astype(np.float64) for c in "xyz"])
    whole = StandardScaler().fit(X)  # the in-memory fit of the whole table
    sk = skp.StandardScaler().fit(X)
    state = json.loads(scaler.read_text())["state"]
    np.testing.assert_allclose(state["mean_"], whole.mean_, rtol=1e-13)
    np.testing.assert_allclose(state["var_"], whole.var_, rtol=1e-12)
    np.testing.assert_allclose(state["var_"], sk.var_, rtol=1e-6)  # sklearn sums 3e5 values near 1e6
    got = pcsv.read_csv(out) if fmt == "csv" else pq.read_table(out)
    Z = np.column_stack([got[c].to_numpy(zero_copy_only=False).astype(np.float64) for c in "xyz"])
    np.testing.assert_allclose(Z, whole.transform(X), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(Z, sk.transform(X), rtol=1e-6, atol=1e-6)


def test_columns_with_spaces_and_commas_in_their_names_can_be_listed(tmp_path, capsys):
    """A header "a, b" has the column " b", which ``--columns a,b`` and ``"a, b"`` name (the
    spaces were stripped from the list, so no list could name it); a name holding a comma
    is listed in double quotes."""
    data = tmp_path / "d.csv"
    data.write_text('a, b,"c,d",e\n1,2,3,x\n3,5,7,y\n')
    for listed in ("a,b", "a, b", ' b,"c,d",a,a'):
        out = tmp_path / "s.json"
        assert normkit("scale", "fit", data, "--columns", listed, "-o", out, "--no-progress") == 0
        names = json.loads(out.read_text())["feature_names_in"]
        assert names == (["a", " b"] if listed.startswith("a") else [" b", "c,d", "a"]), names
    assert normkit("scale", "fit", data, "--columns", "a,c", "-o", tmp_path / "t.json",
                   "--no-progress") == 1
    assert "has no column 'c' (it has ['a', ' b', 'c,d', 'e']); a name holding a comma" in (
        capsys.readouterr().err)
    assert normkit("scale", "fit", data, "--columns", " ,", "-o", tmp_path / "t.json",
                   "--no-progress") == 1
    assert "--columns ' ,' names no column" in capsys.readouterr().err


@pytest.mark.parametrize("header,bad,column", [("a, b", "3,x", " b"), ("\ufeffa,b", "x,3", "a")])
def test_a_bad_value_is_located_under_a_spaced_header_or_a_byte_order_mark(
        tmp_path, capsys, header, bad, column):
    # the line finder stripped the header's names (" b" became "b", not pyarrow's name) and
    # kept the mark ("\ufeffa"), so it found no column and gave pyarrow's bare message
    data = tmp_path / "d.csv"
    data.write_text(f"{header}\n1,2\n{bad}\n4,5\n6,7\n8,9\n", encoding="utf-8")
    assert normkit("scale", "fit", data, "-o", tmp_path / "s.json", "--no-progress") == 1
    err = capsys.readouterr().err
    assert f"d.csv:3: column {column} holds 'x', not a number" in err, err


@pytest.mark.parametrize("text", ["a;b\n1;2\n3;5\n", "a;b\n1,5;2\n3;5\n", "a\tb\n1\t2\n"])
def test_a_file_separated_by_another_character_is_named_as_such(tmp_path, capsys, text):
    # a semicolon-separated file read as one column: "no numeric columns", or a row of two
    # fields where the decimal mark is a comma ("expected 1 fields, got 2")
    data = tmp_path / "d.csv"
    data.write_text(text)
    assert normkit("scale", "fit", data, "-o", tmp_path / "s.json", "--no-progress") == 1
    sep = "tabs" if "\t" in text else "semicolons"
    assert (f"its header has no comma but {sep}: normkit scale reads comma-separated files, so "
            "convert it first.") in capsys.readouterr().err


@pytest.mark.parametrize("args, said", [
    (["fit", "--chunk-mb", "0"], "--chunk-mb must be a positive number of MiB, got 0.0"),
    (["fit", "--chunk-mb", "-1"], "--chunk-mb must be a positive number"),
    (["transform", "--chunk-mb", "0"], "--chunk-mb must be a positive number"),
    (["fit", "--clip"], "--clip is for --method minmax"),                    # ignored
    (["fit", "--feature-range", "0", "2"], "--feature-range is for --method minmax"),
    (["fit", "--method", "minmax", "--no-center"], "--no-center is for --method standard"),
])
def test_options_that_would_do_nothing_are_refused(tmp_path, capsys, args, said):
    # each was taken silently: a chunk size of 0 or less, an option of the other method
    pcsv.write_csv(pa.table({"x": [1.0, 2.0, 4.0]}), tmp_path / "x.csv")
    normkit("scale", "fit", tmp_path / "x.csv", "-o", tmp_path / "s.json", "--no-progress")
    action, *rest = args
    where = ["-o", tmp_path / "out.json"] if action == "fit" else [
        "--scaler", tmp_path / "s.json", "-o", tmp_path / "out.csv"]
    assert normkit("scale", action, tmp_path / "x.csv", *where, "--no-progress", *rest) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "out.csv").exists()


@pytest.mark.parametrize("bounds, said", [((1, 1), "give two different bounds"),
                                          ((2, 1), "swap the bounds")])
def test_a_feature_range_of_equal_bounds_is_not_told_to_swap_them(bounds, said):
    from normkit.preprocessing import MinMaxScaler

    with pytest.raises(ValueError, match=said):
        MinMaxScaler(feature_range=bounds).fit(np.ones((3, 1)))
