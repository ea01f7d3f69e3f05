#!/usr/bin/env bash
# The GPU check (issue 38), one run of at most 8 minutes on a machine with a CUDA GPU, torch
# and triton (docs/gpu.md, "The GPU check"). Stages, each under its own timeout:
#   setup    30 s  device and versions; Liger-Kernel from .whl/ (or the registry) if absent
#   correct 200 s  benchmarks/gpu_check.py correct (real shapes against float64, 2^31
#                  elements, autocast dtypes, CUDA graphs), and beside it, in parallel, the
#                  CUDA tests (tests/test_gpu_kernels.py::TestCuda)
#   bench   160 s  benchmarks/gpu_check.py bench (device-only GB/s of normkit, torch, Liger
#                  and copy_, host time per call, A/B of the kernel switches, registers)
#   launch   20 s  benchmarks/gpu_launch_cost.py (host cost of one Triton launch, three ways)
#   models   70 s  normkit bench --models ... --device cuda
# 450 s of stages plus setup. Results, at most 8 files, in the folder OUT: summary.txt,
# setup.txt, tests.txt, correct.json, bench.json, launch.txt, models.txt.
#   usage: bash benchmarks/gpu_check.sh OUT [--dry-run]     (PYTHON=... picks the interpreter)
# --dry-run: the Python stages on the CPU with tiny shapes and Triton's interpreter (no
# setup, tests or models); tests/test_gpu_check.py runs it.
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu_check.sh OUT [--dry-run]}
dry=${2:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
PY=${PYTHON:-python3}
# normkit from this checkout, unbuffered; no install: the device machine reaches no registry,
# and its image holds normkit's dependencies (torch, triton, numpy, numba)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/normkit-torch-extensions}
say() { echo "gpu_check: $*" | tee -a "$out/summary.txt"; }
# stage timeouts (s): correct (the CUDA tests beside it), bench, launch, models: 450 in all
T_SETUP=30 T_CORRECT=200 T_BENCH=160 T_LAUNCH=20 T_MODELS=70
start=$(date +%s)
status=0

if [ "$dry" = "--dry-run" ]; then
    say "dry run: CPU, tiny shapes, Triton's interpreter; setup, CUDA tests and models skipped"
    flags=(--dry-run --workers 1)
else
    flags=()
    if ! "$PY" -c "import torch, triton; assert torch.cuda.is_available()" 2>/dev/null; then
        say "needs a CUDA device visible to torch, and triton (pip install 'normkit[gpu]')"
        exit 2
    fi
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
            --format=csv
        "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', \
triton.__version__, 'cuda', torch.version.cuda)"
        if ! "$PY" -c "import liger_kernel" 2>/dev/null; then
            # a wheel carried in .whl/ (docs/gpu.md), else the registry where one is reachable
            if ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
                timeout "$T_SETUP" "$PY" -m pip install -q --no-deps --no-index \
                    .whl/liger_kernel-*.whl
            else
                timeout "$T_SETUP" "$PY" -m pip install -q --no-deps --retries 0 \
                    --timeout 5 liger-kernel
            fi
        fi
        "$PY" -c "import liger_kernel; print('liger-kernel importable')" \
            || echo "liger-kernel not importable: its columns are left out"
    } > "$out/setup.txt" 2>&1
    say "setup: $(tr '\n' ' ' < "$out/setup.txt" | cut -c1-400)"
    timeout "$T_CORRECT" "$PY" -m pytest -q -p no:cacheprovider -rfE --tb=short -n 6 \
        tests/test_gpu_kernels.py -k TestCuda > "$out/tests.txt" 2>&1 &
    tests_pid=$!
fi

timeout "$T_CORRECT" "$PY" benchmarks/gpu_check.py correct "$out" ${flags[@]+"${flags[@]}"}
rc=$?; say "correct rc=$rc"; [ $rc -eq 0 ] || status=1
if [ -z "$dry" ]; then
    wait "$tests_pid"
    rc=$?; say "CUDA tests rc=$rc: $(tail -n 1 "$out/tests.txt")"; [ $rc -eq 0 ] || status=1
fi

timeout "$T_BENCH" "$PY" benchmarks/gpu_check.py bench "$out" ${flags[@]+"${flags[@]}"}
rc=$?; say "bench rc=$rc"; [ $rc -eq 0 ] || status=1

if [ -z "$dry" ]; then
    timeout "$T_LAUNCH" "$PY" benchmarks/gpu_launch_cost.py > "$out/launch.txt" 2>&1
    rc=$?; say "launch rc=$rc"; cat "$out/launch.txt"
    timeout "$T_MODELS" "$PY" -m normkit bench --models resnet18 siglip llama --device cuda \
        --repeats 2 --no-progress > "$out/models.txt" 2>&1
    rc=$?; say "models rc=$rc (124: stopped at $T_MODELS s)"; tail -n 8 "$out/models.txt"
fi
say "done in $(( $(date +%s) - start )) s, results in $out"
exit $status
