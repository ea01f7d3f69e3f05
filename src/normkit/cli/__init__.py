"""The ``normkit`` command.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with the parsed
arguments, returning an exit code). Heavy imports happen inside ``func``, so
``normkit --help`` stays fast and works without the optional extras.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# one line per subcommand module, in the order shown by --help
SUBCOMMANDS = (
    "demo",
    "bench",
    "study",
    "explain",
    "scale",
)


def build_parser() -> argparse.ArgumentParser:
    from normkit import __version__

    parser = argparse.ArgumentParser(
        prog="normkit",
        description="Normalization layers, scalers and the study behind them.",
    )
    parser.add_argument("--version", action="version", version=f"normkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"normkit.cli.{name}").register(sub)
    return parser


def out_folder_refusal(command: str, path: str):
    """None if ``path`` (``--out``) is a folder the command can write into, or can be made
    one; otherwise the message that says why not. Checked before any work, creating nothing."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"normkit {command}: --out {path} is a file, not a folder; choose another --out"
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"normkit {command}: --out {path} cannot be made a folder ({parent} is a file)"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"normkit {command}: --out {path}: {parent} is not writable here; choose another --out"
    return None


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as error:
        from normkit._extras import message

        text = message(error, f"normkit {args.command}")
        if text is None:
            raise
        print(text, file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
