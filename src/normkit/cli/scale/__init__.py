"""``normkit scale``: fit, apply and undo a scaler on CSV / Parquet files, streamed in chunks.

::

    normkit scale fit DATA... --method standard|minmax -o scaler.json
    normkit scale transform DATA --scaler scaler.json -o OUT
    normkit scale inverse DATA --scaler scaler.json -o OUT

``fit`` scales the numeric columns (or ``--columns``); ``transform``/``inverse`` scale the
columns named in the scaler file and pass every other column through unchanged. Files are
read and written a chunk at a time: peak memory is the process's start-up (about 150 MiB)
plus about 6 times ``--chunk-mb`` whatever the file size (Parquet: plus up to about 60 MiB
for the file's footer and the reader's and writer's buffers). Outputs are written
atomically.
"""

from __future__ import annotations

import os
import sys

from normkit._extras import EXTRAS


def register(subparsers):
    p = subparsers.add_parser("scale", help="fit / apply / invert a feature scaler on CSV or Parquet files",
                              description=(__doc__ or "").split("\n\n")[0])
    sub = p.add_subparsers(dest="scale_command", metavar="ACTION", required=True)

    def common(q):
        q.add_argument("--chunk-mb", type=float, default=16.0,
                       help="size of one chunk in MiB (default 16); peak memory is about 6x this above "
                            "the ~150 MiB start-up, whatever the file size")
        q.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    f = sub.add_parser("fit", help="fit a scaler on one or more tables and save it as JSON")
    f.add_argument("data", nargs="+", metavar="DATA", help="CSV or Parquet files (same columns)")
    f.add_argument("--method", choices=("standard", "minmax"), default="standard")
    f.add_argument("-o", "--output", required=True, help="scaler file to write (JSON)")
    f.add_argument("--columns", help='comma-separated columns to scale (default: all numeric); '
                   'a name with a comma in double quotes: \'a,"b, c"\'')
    f.add_argument("--feature-range", nargs=2, type=float, metavar=("LO", "HI"),
                   help="target range for --method minmax (default 0 1)")
    f.add_argument("--clip", action="store_true", help="minmax: clip transformed values to the range")
    f.add_argument("--no-center", action="store_true", help="standard: do not subtract the mean")
    common(f)
    f.set_defaults(func=_run)

    for name, what in (("transform", "scale"), ("inverse", "undo the scaling of")):
        t = sub.add_parser(name, help=f"{what} the scaler's columns of a table, others passed through")
        t.add_argument("data", metavar="DATA", help="CSV or Parquet file")
        t.add_argument("--scaler", required=True, help="scaler file written by `normkit scale fit`")
        t.add_argument("-o", "--output", required=True, help="output file (.csv or .parquet)")
        common(t)
        t.set_defaults(func=_run)


def _progress(path, disable):
    from tqdm import tqdm

    from normkit.cli.scale.tables import file_format

    if file_format(path) == "parquet":
        import pyarrow.parquet as pq

        total, unit, scale = pq.read_metadata(path).num_rows, " rows", False
    else:
        total, unit, scale = os.path.getsize(path), "B", True
    return tqdm(total=total, unit=unit, unit_scale=scale, desc=os.path.basename(path),
                file=sys.stderr, disable=disable, leave=False)


def _matrix(table, columns):
    """The listed columns of a table as one (rows, columns) float64 array, nulls as NaN."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    out = np.empty((table.num_rows, len(columns)), dtype=np.float64)
    for j, name in enumerate(columns):
        start = 0
        for piece in table.column(name).chunks:  # piece by piece: no concatenated copy
            if not pa.types.is_float64(piece.type):  # (integers past 2^53 rounded, as NumPy's
                piece = pc.cast(piece, pa.float64(), safe=False)  # astype(float64) rounds them)
            out[start:start + len(piece), j] = piece.to_numpy(zero_copy_only=False)
            start += len(piece)
    return out


def _fit_columns(args):
    """The columns to fit: ``--columns``, or the numeric ones (the others listed on stderr)."""
    from normkit.cli.scale.tables import TableFormatError, file_format, read_columns, separator_hint

    names, numeric, text, empty = read_columns(args.data[0])
    if args.columns:
        columns = _listed(args.columns, names, args.data[0])
        typed_text = [c for c in columns if c in text and file_format(args.data[0]) == "parquet"]
        if typed_text:  # a CSV column is checked value by value as it is read, with its line
            raise TableFormatError(f"{args.data[0]}: the columns {typed_text} hold no numbers (types "
                                   f"{', '.join(text[c] for c in typed_text)}); leave them out of "
                                   "--columns.")
        return columns
    if not numeric:
        raise TableFormatError(f"{args.data[0]}: has no numeric columns to scale (columns: {names}); "
                               f"{separator_hint(names) or 'name them with --columns'}.")
    if text and file_format(args.data[0]) == "parquet":
        print(f"normkit scale: not scaling {len(text)} column(s) of types other than numbers: "
              f"{', '.join(f'{c} ({t})' for c, t in text.items())}", file=sys.stderr)
    elif text:
        print(f"normkit scale: not scaling {len(text)} column(s) that hold text, not numbers: "
              f"{', '.join(text)}", file=sys.stderr)
    if empty:
        where = " in the first MiB" if file_format(args.data[0]) == "csv" else ""
        print(f"normkit scale: not scaling {len(empty)} column(s) with no values{where}: "
              f"{', '.join(empty)} (--columns names them to scale them all the same)",
              file=sys.stderr)
    return numeric


def _listed(text, names, path):
    """The table's columns that ``--columns`` lists: one CSV record of names (a name holding
    a comma in double quotes). A name matches a column exactly, else a column alike but for
    surrounding spaces (a header "a, b" has the column " b")."""
    import csv

    from normkit.cli.scale.tables import TableFormatError

    picked, unknown = [], []
    for name in next(csv.reader([text])):
        alike = [c for c in names if c.strip() == name.strip()]
        if name in names or len(alike) == 1:
            picked.append(name if name in names else alike[0])
        elif name.strip():
            unknown.append(name)
    if not picked and not unknown:
        raise TableFormatError(f"--columns {text!r} names no column; list them by name (it has {names}).")
    if unknown:
        raise TableFormatError(f"{path}: has no column {' and no column '.join(map(repr, unknown))} "
                               f"(it has {names}); a name holding a comma goes in double quotes: "
                               '--columns \'a,"b, c"\'')
    return list(dict.fromkeys(picked))


def _named(error, columns) -> str:
    """A scaler's message about ``features [i, ...]`` of the matrix, told of the table's
    columns by name, and what to do in a table rather than in NumPy."""
    import re

    def names(match):
        picked = [columns[int(i)] for i in match.group(1).split(",")]
        return f"column{'s' if len(picked) > 1 else ''} {', '.join(map(repr, picked))}"

    message = re.sub(r"features \[([\d, ]+)\]", names, str(error))
    return message.replace("Replace them, e.g. X[np.isinf(X)] = np.nan (NaN is ignored in fit "
                           "and kept in transform).", "Replace them with empty cells (missing "
                           "values are ignored in fit and kept in transform).").replace(
        "Divide X by a power of ten first.", "Divide those columns by a power of ten first.")


def _fit(args):
    import numpy as np

    from normkit.cli.scale.tables import TableFormatError, iter_chunks
    from normkit.preprocessing import MinMaxScaler, StandardScaler

    columns = _fit_columns(args)
    if args.method == "standard":
        scaler = StandardScaler(with_mean=not args.no_center)
    else:
        scaler = MinMaxScaler(feature_range=tuple(args.feature_range or (0.0, 1.0)), clip=args.clip)
    chunk = int(args.chunk_mb * (1 << 20))
    for path in args.data:
        with _progress(path, args.no_progress) as bar:
            for table in iter_chunks(path, columns, chunk, bar, only=True):
                if table.num_rows:
                    try:
                        scaler.partial_fit(_matrix(table, columns))
                    except ValueError as error:
                        raise TableFormatError(f"{path}: {_named(error, columns)}") from None
                del table  # not kept while the next chunk is read
    if not hasattr(scaler, "n_features_in_"):
        raise TableFormatError(f"{', '.join(args.data)}: no data rows to fit on.")
    scaler.feature_names_in_ = np.asarray(columns, dtype=object)
    scaler.save(args.output)
    return 0


def _scaled(table, columns, scaler, inverse):
    """``table`` with its ``columns`` scaled (or unscaled), the other columns as they are."""
    import pyarrow as pa

    from normkit.cli.scale.tables import TableFormatError

    X = _matrix(table, columns)
    try:
        Z = scaler._apply(X, X, inverse=inverse)  # in place on our own buffer
    except ValueError as error:
        raise TableFormatError(_named(error, columns)) from None
    for j, name in enumerate(columns):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, pa.array(Z[:, j], type=pa.float64(), from_pandas=True))
    return table


def _apply(args, inverse):
    import pyarrow as pa

    from normkit._atomic import atomic_path
    from normkit.cli.scale.tables import TableFormatError, TableWriter, column_names, file_format, iter_chunks
    from normkit.preprocessing import load_scaler

    out_format = file_format(args.output)
    scaler = load_scaler(args.scaler)
    names = getattr(scaler, "feature_names_in_", None)
    if names is None:
        raise TableFormatError(f"{args.scaler}: the scaler has no feature names, so its columns cannot be "
                               "found in a table; fit it with `normkit scale fit` or on a DataFrame.")
    columns = [str(c) for c in names]
    chunk = int(args.chunk_mb * (1 << 20))
    gzip = os.fspath(args.output).lower().endswith(".gz")
    with atomic_path(args.output) as tmp, _progress(args.data, args.no_progress) as bar:
        writer = None
        try:
            for table in iter_chunks(args.data, columns, chunk, bar):
                out = _scaled(table, columns, scaler, inverse)
                if writer is None:
                    writer = TableWriter(tmp, out.schema, out_format, gzip)
                writer.write(out)
                del table, out  # not kept while the next chunk is read
            if writer is None:  # an empty table: write its header / schema only
                all_names = column_names(args.data)
                writer = TableWriter(tmp, pa.schema([(n, pa.float64() if n in columns else pa.string())
                                                     for n in all_names]), out_format, gzip)
        finally:
            if writer is not None:
                writer.close()
    return 0


#: options of one --method only, with that method
_METHOD_ONLY = {"clip": "minmax", "feature_range": "minmax", "no_center": "standard"}


def _refusal(args):
    """Why these arguments would not do what they say, or None."""
    if not 0 < args.chunk_mb < float("inf"):
        return f"--chunk-mb must be a positive number of MiB, got {args.chunk_mb}"
    for name, method in _METHOD_ONLY.items():
        given = getattr(args, name, None)
        if given not in (None, False) and args.method != method:
            return (f"--{name.replace('_', '-')} is for --method {method} (this is --method "
                    f"{args.method}); add --method {method} or leave it out")
    return None


def _run(args):
    refusal = _refusal(args)
    if refusal:
        print(f"normkit scale: error: {refusal}", file=sys.stderr)
        return 2
    try:
        if args.scale_command == "fit":
            return _fit(args)
        return _apply(args, inverse=args.scale_command == "inverse")
    except ModuleNotFoundError as exc:  # one message naming both extras the command needs
        missing = (exc.name or "").partition(".")[0]
        if missing not in EXTRAS:
            raise
        print(f"normkit scale: error: it needs {missing}, which is not installed here: "
              "pip install 'normkit[io,sklearn]'", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"normkit scale: error: {exc}", file=sys.stderr)
        return 1
