"""``normkit bench``: normkit vs torch native vs a memory copy, per op, shape, dtype,
layout and mode, under the default allocator and one that removes page faults."""

from __future__ import annotations

import json
import sys


def register(subparsers):
    p = subparsers.add_parser(
        "bench", help="time normkit's normalizations against torch and a memory copy",
        description="Median time of normkit, torch native and a plain copy_ of the same "
                    "tensor, interleaved in one run, for each op x shape x dtype x layout x "
                    "mode; measured once with the default allocator and once with "
                    "MALLOC_MMAP_MAX_=0 (which removes the page faults of fresh large "
                    "outputs); --allocators thp adds a run with THP_MEM_ALLOC_ENABLE=1 "
                    "(torch's allocator asks for huge pages, as normkit does for its "
                    "outputs).")
    from normkit.bench.ops import ALLOCATORS, DTYPES, MODES, OPS

    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="op families")
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16", "float16",
                                                    "float64"), default=list(DTYPES))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--allocators", nargs="+", choices=tuple(ALLOCATORS),
                   default=["default", "no-mmap"])
    p.add_argument("--threads", type=int, default=2, help="torch and numba threads (2)")
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved repeats per case (7; 3 with --quick)")
    p.add_argument("--quick", action="store_true", help="small shapes (for tests)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--models", nargs="*", metavar="MODEL", default=None,
                   help="whole models, converted against untouched (train, infer, decode; "
                        "train rows also count the bytes saved for backward), and "
                        "the per-call cost of small norms against torch.nn "
                        "(normkit.bench.models); names restrict the models: "
                        "siglip resnet18 resnet18-fused resnet18-small study-cnn-b2 "
                        "study-cnn-b32 resnet18-cl study-cnn-b32-cl convnext bit mlp-bn1d "
                        "llama gemma llama-bf16 llama-bf16-fused llama-decode resnet50 "
                        "mobilenetv2 efficientnet-b0 (default: all; with --quick: "
                        "study-cnn-b2)")
    p.add_argument("--control", action="store_true",
                   help="with --models: time an untouched copy of each model alongside; its "
                        "ratio to the untouched model (column control) is the measurement's "
                        "own spread on this machine")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the Triton kernels vs torch and Liger-Kernel (if installed) "
                        "in GB/s and as a fraction of the memory bandwidth "
                        "(normkit.bench.gpu); with --models, the models on the GPU")
    p.set_defaults(func=_main)


def _refusal(args):
    """Why these arguments cannot be measured, or None."""
    if args.threads < 1:
        return f"--threads must be at least 1, got {args.threads}"
    if args.repeats is not None and args.repeats < 1:
        return f"--repeats must be at least 1, got {args.repeats}"
    if args.control and args.models is None:
        return "--control times a control copy of each model: add --models"
    return None


def _main(args) -> int:
    refusal = _refusal(args)
    if refusal:
        print(f"normkit bench: {refusal}", file=sys.stderr)
        return 2
    import torch  # noqa: F401  (the timing runs in child processes: a missing torch is named here)

    if args.models is not None:
        return _models(args)
    if getattr(args, "device", "cpu") == "cuda":
        from normkit.bench import gpu
        return gpu.main(args)
    from normkit.bench import ops as bench

    case_list = bench.cases(args.ops, args.dtypes, args.modes, quick=args.quick)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    report = bench.run(case_list, repeats=repeats, allocators=args.allocators,
                       threads=args.threads, progress=not args.no_progress)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(bench.format_table(report))
    return 0


def _models(args) -> int:
    import torch

    from normkit.bench import models as bench

    unknown = sorted(set(args.models) - set(bench.MODELS))
    if unknown:
        print(f"normkit bench --models: unknown model(s) {', '.join(unknown)}; choose from "
              f"{', '.join(bench.MODELS)}", file=sys.stderr)
        return 2
    names = args.models or (list(bench.QUICK_MODELS) if args.quick else list(bench.MODELS))
    device = getattr(args, "device", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("normkit bench --models --device cuda: no CUDA device is visible to torch; "
              "run it on a GPU machine or drop --device cuda", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)

    def show(row):
        if not args.json and not args.no_progress:
            print(bench.format_models([row]).splitlines()[-1], file=sys.stderr, flush=True)

    report = {"threads": args.threads, "device": device,
              "models": bench.run_models(names, repeats=repeats, progress=show, device=device,
                                         control=args.control),
              # the per-call table times the calling thread's CPU: CPU tensors only
              "calls": [] if device == "cuda" else bench.run_calls(
                  calls=50 if args.quick else 300, repeats=3 if args.quick else 15)}
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(f"whole models on {device}, {args.threads} threads, best of {repeats} repeats "
              f"(ratio = converted / untouched)")
        print(bench.format_models(report["models"]))
        if report["calls"]:
            print()
            print(bench.format_calls(report["calls"]))
    return 0
