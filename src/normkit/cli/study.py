"""``normkit study``: train one small CNN with every normalization over a grid of batch
sizes and seeds, then write report.html, report.md, PNG plots and results.json."""

from __future__ import annotations

import sys


def _ints(text: str) -> list:
    try:
        return [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"normkit study: expected whole numbers separated by commas, got {text!r}") from None


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "study", help="train a small CNN with each normalization over batch sizes; write a report",
        description="Train the same small CNN with no normalization and with each normkit layer over a grid "
                    "of batch sizes and seeds on scikit-learn's bundled digits, then write report.html, "
                    "report.md, PNG plots and results.json. An interrupted run resumes from results.json.")
    p.add_argument("--quick", action="store_true", help="a few seconds on a small subset (checks the pipeline)")
    p.add_argument("--methods", help="comma-separated, from: none, batch, batchrenorm, group, layer, instance, "
                                     "rms (default: all available)")
    p.add_argument("--batch-sizes", help="comma-separated (default 2,4,8,16,32,64; --quick: 4,16)")
    p.add_argument("--seeds", help="comma-separated seeds (default 0,1,2; --quick: 0)")
    p.add_argument("--epochs", type=int, help="epochs for every batch size (default 4; --quick: 1)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate at batch 32, scaled linearly "
                                                          "with the batch (default 0.05)")
    p.add_argument("--jobs", type=int, help="worker processes (default: 2 or the number of CPUs if fewer; "
                                            "--quick: 1)")
    p.add_argument("--out", default="study-out", help="output folder (default study-out/)")
    p.add_argument("--fresh", action="store_true", help="ignore an existing results.json and start over")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        from normkit.study.report import write_report
        from normkit.study.runner import run_study
    except ImportError as e:
        print(f"normkit study needs the 'study' and 'torch' extras ({e}); "
              f"install them with: pip install 'normkit[torch,study]'", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    try:
        results = run_study(args.out, methods=methods,
                            batch_sizes=_ints(args.batch_sizes) if args.batch_sizes else None,
                            seeds=_ints(args.seeds) if args.seeds else None, epochs=args.epochs,
                            quick=args.quick, jobs=args.jobs, fresh=args.fresh,
                            progress=not args.no_progress, base_lr=args.lr)
    except ValueError as e:
        print(f"normkit study: {e}", file=sys.stderr)
        return 2
    results = write_report(results, args.out)
    print(f"{len(results['runs'])} runs in {results['elapsed_seconds']:.0f} s. Findings:")
    for line in results["findings"]:
        print(f"  - {line}")
    print(f"Report: {args.out}/report.html (and report.md, results.json, study-*.png)")
    return 0
