"""Reading and writing the tables of ``normkit scale``: CSV and Parquet in bounded memory.

A table is read as a stream of ``pyarrow.Table`` chunks of about ``chunk_bytes`` each, and
nothing is kept from one chunk to the next, so memory does not depend on the file's size.
What bounds it is how the readers are opened:

* CSV through ``pyarrow.csv.open_csv``. Its I/O thread reads up to about 32 blocks ahead of
  the parser whatever ``use_threads`` says, so the block size, not the file, sets the memory:
  blocks are ``chunk_bytes / 32`` and gathered into chunks here. The columns to scale are
  read as float64 and all others as strings, so pass-through columns are written back as
  they were read (no re-formatting of integers, dates or decimals).
* Parquet through ``ParquetFile.iter_batches`` with ``pre_buffer=False`` and a read buffer:
  pre-buffering (pyarrow's default) loads every row group of the file before the first
  batch, and without a buffer a whole column chunk is loaded at a time.

pyarrow's CSV reader does not know line numbers, so when it rejects a row the file is
scanned again with Python's ``csv`` module (streaming too) to name the first bad line.
"""

from __future__ import annotations

import collections
import csv
import os

__all__ = ["TableFormatError", "TableWriter", "column_names", "file_format", "iter_chunks", "read_columns"]

# pyarrow's CSV reader keeps about this many blocks in flight (read ahead, parsing, converting)
BLOCKS_PER_CHUNK = 32
# a Parquet column is read through a buffer of this size instead of a whole column chunk at once
PARQUET_BUFFER = 1 << 20
# the start of a CSV file that decides which columns hold numbers
SAMPLE_BYTES = 1 << 20


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


def _parquet(path):
    import pyarrow.parquet as pq

    return pq.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_BUFFER)


def _csv_stream(raw, path):
    """``raw`` (a ``pyarrow.OSFile``) as the CSV reader reads it: decompressed if ``path`` ends
    in .gz. A native file, not a Python one: pyarrow's I/O thread then reads without waiting
    for the GIL."""
    import pyarrow as pa

    if os.fspath(path).lower().endswith(".gz"):
        return pa.CompressedInputStream(raw, "gzip")
    return raw


def _null_values():
    import pyarrow.csv as pcsv

    return frozenset(pcsv.ConvertOptions().null_values)


def _is_number(text: str, nulls) -> bool:
    """Whether pyarrow reads ``text`` as a float64 (a null token counts: it becomes NaN)."""
    text = text.strip()
    if text in nulls:
        return True
    if "_" in text:  # Python's float() takes 1_000; pyarrow does not
        return False
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_numeric_type(pa, dtype) -> bool:
    return pa.types.is_integer(dtype) or pa.types.is_floating(dtype) or pa.types.is_decimal(dtype)


def _csv_sample(path):
    """The first MiB of whole lines of a CSV file, parsed with the types pyarrow infers.

    Read here, not with ``open_csv``, so that no reader is left reading ahead of it."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    with pa.OSFile(os.fspath(path)) as raw:
        head = _csv_stream(raw, path).read(SAMPLE_BYTES)
    if len(head) == SAMPLE_BYTES and b"\n" in head:
        head = head[:head.rindex(b"\n") + 1]
    try:
        return pcsv.read_csv(pa.BufferReader(head))
    except pa.ArrowInvalid as exc:
        raise _csv_error(path, exc) from None


def column_names(path):
    """The column names of a table, each one once (a name used twice is refused)."""
    if file_format(path) == "parquet":
        return _unique(path, _parquet(path).schema_arrow.names)
    return _unique(path, _csv_sample(path).column_names)


def _unique(path, names):
    twice = sorted(n for n, count in collections.Counter(names).items() if count > 1)
    if twice:
        raise TableFormatError(f"{path}: the column names {twice} are each used more than once; "
                               "a column is found by its name, so give each its own.")
    return list(names)


def read_columns(path):
    """``(names, numeric, text, empty)``: all column names, those holding numbers, those
    holding text or another type that is no number (a dict of their type names), and those
    holding nothing.

    Parquet: by type (``null``: empty). CSV: from its first MiB; a column is numeric when
    most of its non-empty values there are numbers (a stray text value, there or further
    down, then stops the read with its line), text when most are text, and empty when it has
    no value there.
    """
    import pyarrow as pa

    if file_format(path) == "parquet":
        schema = _parquet(path).schema_arrow
    else:
        sample = _csv_sample(path)
        schema = sample.schema
    numeric, empty = [], []
    nulls = _null_values()
    for field in schema:
        if _is_numeric_type(pa, field.type):
            numeric.append(field.name)
        elif pa.types.is_null(field.type):
            empty.append(field.name)
        elif file_format(path) == "csv" and pa.types.is_string(field.type):
            values = [v for v in sample[field.name].to_pylist() if v is not None and v.strip() not in nulls]
            if not values:
                empty.append(field.name)
            elif 2 * sum(_is_number(v, nulls) for v in values) > len(values):
                numeric.append(field.name)
    text = {f.name: str(f.type) for f in schema if f.name not in numeric and f.name not in empty}
    return _unique(path, schema.names), numeric, text, empty


def _open_text(path):
    if os.fspath(path).lower().endswith(".gz"):
        import gzip

        return gzip.open(path, "rt", newline="", encoding="utf-8-sig", errors="replace")
    return open(path, newline="", encoding="utf-8-sig", errors="replace")


def _first_bad_csv_line(path, numeric):
    """Scan ``path`` with the csv module; return ``(line, what, fix)`` of the first bad row."""
    nulls = _null_values()
    with _open_text(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return None
        # names as pyarrow gives them: surrounding spaces kept, a byte-order mark dropped
        index = [header.index(c) for c in numeric if c in header]
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                return (reader.line_num, f"malformed row: expected {len(header)} fields, got {len(row)}",
                        separator_hint(header) or "fix or remove that line")
            for j in index:
                if not _is_number(row[j], nulls):
                    return (reader.line_num, f"column {header[j]} holds {row[j]!r}, not a number",
                            "fix that value, or leave the column out with --columns")
    return None


def separator_hint(names) -> str:
    """What to do with a CSV file whose header is one name holding another separator (a
    semicolon-separated file, as spreadsheets write where the comma is the decimal mark,
    or a tab-separated one); "" for any other header."""
    seps = [name for name, sep in (("semicolons", ";"), ("tabs", "\t"), ("bars", "|"))
            if len(names) == 1 and sep in names[0]]
    return (f"its header has no comma but {seps[0]}: normkit scale reads comma-separated "
            "files, so convert it first" if seps else "")


def _csv_error(path, exc, numeric=()):
    located = _first_bad_csv_line(path, list(numeric))
    if located is not None:
        line, what, fix = located
        return TableFormatError(f"{path}:{line}: {what}; {fix}.")
    return TableFormatError(f"{path}: cannot read the CSV: {exc}")


def _gather(batches, chunk_bytes):
    """Group record batches into tables of at least ``chunk_bytes`` (the last may be smaller)."""
    import pyarrow as pa

    group, size = [], 0
    for batch in batches:
        group.append(batch)
        size += batch.nbytes
        del batch  # held by the group only
        if size >= chunk_bytes:
            yield pa.Table.from_batches(group)
            group, size = [], 0
    if group:
        yield pa.Table.from_batches(group)


def iter_chunks(path, float_columns, chunk_bytes=16 << 20, progress=None, only=False):
    """Yield a table as ``pyarrow.Table`` chunks of about ``chunk_bytes``: ``float_columns`` as
    float64, the others (CSV) as strings, or left out when ``only``. ``progress`` (a tqdm bar
    or None) is advanced by bytes (CSV) or rows (Parquet)."""
    import pyarrow as pa

    float_columns = list(float_columns)
    names = column_names(path)
    missing = [c for c in float_columns if c not in names]
    if missing:
        raise TableFormatError(f"{path}: lacks the columns {missing} (it has {names}).")
    if file_format(path) == "parquet":
        pf = _parquet(path)
        row_bytes = 8 * max(1, len(float_columns) if only else len(names))
        batches = pf.iter_batches(batch_size=max(1024, chunk_bytes // row_bytes),
                                  columns=float_columns if only else None)
        for batch in batches:
            if progress is not None:
                progress.update(batch.num_rows)
            yield pa.Table.from_batches([batch])
            del batch  # not held while the next one is read
        return

    import pyarrow.csv as pcsv

    types = {c: (pa.float64() if c in float_columns else pa.string()) for c in names}
    read = pcsv.ReadOptions(block_size=max(1 << 16, int(chunk_bytes) // BLOCKS_PER_CHUNK))
    convert = pcsv.ConvertOptions(column_types=types, strings_can_be_null=False,
                                  include_columns=float_columns if only else None)
    with pa.OSFile(os.fspath(path)) as raw:

        def counted(reader):
            done = 0
            for batch in reader:
                if progress is not None:
                    pos = raw.tell()
                    progress.update(pos - done)
                    done = pos
                yield batch
                del batch  # not held while the next one is read

        try:
            reader = pcsv.open_csv(_csv_stream(raw, path), read_options=read, convert_options=convert)
            yield from _gather(counted(reader), chunk_bytes)
        except pa.ArrowInvalid as exc:
            raise _csv_error(path, exc, float_columns) from None


class TableWriter:
    """Streaming CSV (``fmt="csv"``, gzip-compressed with ``gzip``) or Parquet
    (``fmt="parquet"``) writer of tables."""

    def __init__(self, path, schema, fmt, gzip=False):
        self._stream = None
        if fmt == "parquet":
            import pyarrow.parquet as pq

            self._writer = pq.ParquetWriter(path, schema)
        else:
            import pyarrow as pa
            import pyarrow.csv as pcsv

            if gzip:
                path = self._stream = pa.CompressedOutputStream(path, "gzip")
            # quote only where needed, so pass-through text is written as it was read
            options = pcsv.WriteOptions(quoting_style="needed")
            self._writer = pcsv.CSVWriter(path, schema, write_options=options)

    def write(self, table):
        self._writer.write_table(table)

    def close(self):
        self._writer.close()
        if self._stream is not None:
            self._stream.close()
