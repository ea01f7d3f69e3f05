"""Chunked reading and atomic writing of CSV and Parquet tables (pyarrow, extra ``io``).

Tables are read as a stream of ``pyarrow.RecordBatch`` whose size is bounded by a byte
budget, so a file of any size is processed in bounded memory:

* CSV through ``pyarrow.csv.open_csv`` (a serial streaming reader; ``block_size`` bytes per
  batch). The columns to scale are read as float64, all others as strings, so that the
  pass-through columns are written back as they were read (no re-formatting of integers,
  dates or decimals).
* Parquet through ``ParquetFile.iter_batches``.

pyarrow's streaming CSV reader does not know line numbers, so when it rejects a row this
module re-scans the file with Python's ``csv`` module (streaming too) to name the first bad
line and what is wrong with it. Output goes to a temporary file next to the destination,
renamed over it only when everything was written: a failure leaves no partial output.
"""

from __future__ import annotations

import csv
import math
import os
import tempfile
from contextlib import contextmanager

__all__ = ["TableFormatError", "atomic_path", "file_format", "iter_batches", "read_schema"]


class TableFormatError(ValueError):
    """A table that cannot be read: malformed row, wrong columns, unknown format."""


def file_format(path) -> str:
    """``"csv"`` or ``"parquet"`` from the file name."""
    name = os.fspath(path).lower()
    if name.endswith((".csv", ".csv.gz", ".txt")):
        return "csv"
    if name.endswith((".parquet", ".pq", ".parq")):
        return "parquet"
    raise TableFormatError(f"{path}: unknown table format; name the file *.csv or *.parquet.")


def _is_numeric(pa, dtype) -> bool:
    return pa.types.is_integer(dtype) or pa.types.is_floating(dtype) or pa.types.is_decimal(dtype)


def read_schema(path):
    """``(column names, names of the numeric columns)`` of a table (CSV: inferred from its
    first block, as pyarrow does)."""
    import pyarrow as pa

    if file_format(path) == "parquet":
        import pyarrow.parquet as pq

        schema = pq.ParquetFile(path).schema_arrow
    else:
        import pyarrow.csv as pcsv

        try:
            with pcsv.open_csv(path) as reader:
                schema = reader.schema
        except pa.ArrowInvalid as exc:
            raise _csv_error(path, exc) from None
    names = list(schema.names)
    return names, [f.name for f in schema if _is_numeric(pa, f.type)]


def _open_text(path):
    if os.fspath(path).lower().endswith(".gz"):
        import gzip

        return gzip.open(path, "rt", newline="", encoding="utf-8", errors="replace")
    return open(path, newline="", encoding="utf-8", errors="replace")


def _first_bad_csv_line(path, numeric):
    """Scan ``path`` with the csv module; return ``(line, what)`` of the first bad row."""
    with _open_text(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return None
        names = [h.strip() for h in header]
        index = [names.index(c) for c in numeric if c in names]
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                return reader.line_num, f"expected {len(header)} fields, got {len(row)}"
            for j in index:
                value = row[j].strip()
                if value:
                    try:
                        float(value)
                    except ValueError:
                        return reader.line_num, f"column {names[j]!r} has the non-numeric value {row[j]!r}"
    return None


def _csv_error(path, exc, numeric=()):
    located = _first_bad_csv_line(path, list(numeric))
    if located is not None:
        line, what = located
        return TableFormatError(f"{path}:{line}: malformed row: {what}. Fix or remove that line.")
    return TableFormatError(f"{path}: cannot read the CSV: {exc}")


def iter_batches(path, float_columns, chunk_bytes=16 << 20, progress=None):
    """Yield the record batches of a table, ``float_columns`` as float64 (CSV: all others as
    strings). ``progress`` (a tqdm bar or None) is advanced by bytes (CSV) or rows (Parquet).
    """
    import pyarrow as pa

    float_columns = list(float_columns)
    if file_format(path) == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        row_bytes = max(1, 8 * len(pf.schema_arrow.names))
        batch_rows = max(1024, chunk_bytes // row_bytes)
        for batch in pf.iter_batches(batch_size=batch_rows):
            if progress is not None:
                progress.update(batch.num_rows)
            yield batch
        return

    import pyarrow.csv as pcsv

    names, _ = read_schema(path)
    missing = [c for c in float_columns if c not in names]
    if missing:
        raise TableFormatError(f"{path}: lacks the columns {missing} (it has {names}).")
    types = {c: (pa.float64() if c in float_columns else pa.string()) for c in names}
    read = pcsv.ReadOptions(block_size=int(chunk_bytes))
    convert = pcsv.ConvertOptions(column_types=types, strings_can_be_null=False)
    with open(path, "rb") as raw:
        try:
            reader = pcsv.open_csv(raw, read_options=read, convert_options=convert)
            done = 0
            for batch in reader:
                if progress is not None:
                    pos = raw.tell()
                    progress.update(pos - done)
                    done = pos
                yield batch
        except pa.ArrowInvalid as exc:
            raise _csv_error(path, exc, float_columns) from None


@contextmanager
def atomic_path(path):
    """Yield a temporary path next to ``path``; rename it to ``path`` if the block succeeds,
    delete it otherwise."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class TableWriter:
    """Streaming CSV (``fmt="csv"``) or Parquet (``fmt="parquet"``) writer."""

    def __init__(self, path, schema, fmt):
        if fmt == "parquet":
            import pyarrow.parquet as pq

            self._writer = pq.ParquetWriter(path, schema)
        else:
            import pyarrow.csv as pcsv

            # quote only where needed, so pass-through text is written as it was read
            options = pcsv.WriteOptions(quoting_style="needed")
            self._writer = pcsv.CSVWriter(path, schema, write_options=options)

    def write(self, batch):
        self._writer.write_batch(batch)

    def close(self):
        self._writer.close()


def rows_estimate(paths) -> float:
    """Total rows of Parquet files, or NaN when any is CSV (whose progress counts bytes)."""
    total = 0
    for p in paths:
        if file_format(p) != "parquet":
            return math.nan
        import pyarrow.parquet as pq

        total += pq.ParquetFile(p).metadata.num_rows
    return total
