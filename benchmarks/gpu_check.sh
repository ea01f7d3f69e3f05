#!/usr/bin/env bash
# On a machine with a CUDA GPU and triton: the CUDA correctness tests of the Triton kernels
# (tests/test_gpu_kernels.py::TestCuda, through the public ops, against torch), then
# `normkit bench --device cuda` (normkit vs torch vs Liger-Kernel if installed, GB/s and
# fraction of the memory bandwidth), benchmarks/gpu_profile.py (host and device time per
# call), benchmarks/gpu_launch_cost.py (what one Triton launch costs the host) and
# `normkit bench --models --device cuda` (converted against untouched models).
# Budget: under 10 minutes (240 s tests, 150 s bench, 100 s profile, 200 s models; about
# 3.5 minutes on an H200). Writes benchmarks/results/gpu-<stamp>-{device.csv,tests.txt,
# bench.json,bench.txt,profile.txt,launch.txt,models.txt}.
#   usage: benchmarks/gpu_check.sh            (PYTHON=... to choose the interpreter)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
out=benchmarks/results
mkdir -p "$out"
stamp=$(date +%Y%m%d-%H%M%S)

if ! "$PY" -c "import torch, triton; assert torch.cuda.is_available()"; then
    echo "gpu_check: needs a CUDA device visible to torch and triton (pip install 'normkit[gpu]')" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
    > "$out/gpu-$stamp-device.csv" 2>/dev/null || true

# Triton compiles each kernel specialization on first use: spread the tests over workers
# (pytest-xdist) when it is installed; GPU_CHECK_WORKERS=0 runs them in one process.
workers=()
if "$PY" -c "import xdist" 2>/dev/null && [ "${GPU_CHECK_WORKERS:-8}" != 0 ]; then
    workers=(-n "${GPU_CHECK_WORKERS:-8}")
fi
timeout "${GPU_CHECK_TEST_S:-240}" "$PY" -m pytest -q -p no:cacheprovider --maxfail=25 -rfE \
    --tb=short "${workers[@]}" tests/test_gpu_kernels.py -k "TestCuda" 2>&1 \
    | tee "$out/gpu-$stamp-tests.txt"
tests_rc=${PIPESTATUS[0]}

timeout 150 "$PY" -m normkit bench --device cuda --json > "$out/gpu-$stamp-bench.json"
bench_rc=$?
if [ "$bench_rc" -eq 0 ]; then
    "$PY" -c "import json, sys; from normkit.bench.gpu import format_table; \
print(format_table(json.load(open(sys.argv[1]))))" "$out/gpu-$stamp-bench.json" \
        | tee "$out/gpu-$stamp-bench.txt"
fi
timeout 100 "$PY" benchmarks/gpu_profile.py > "$out/gpu-$stamp-profile.txt" 2>&1
profile_rc=$?
timeout 60 "$PY" benchmarks/gpu_launch_cost.py 2>&1 | tee "$out/gpu-$stamp-launch.txt"
timeout 200 "$PY" -m normkit bench --models resnet18 resnet18-small study-cnn-b2 \
    study-cnn-b32 siglip llama --device cuda --repeats 3 --no-progress \
    > "$out/gpu-$stamp-models.txt" 2>&1
models_rc=$?
tail -n 13 "$out/gpu-$stamp-models.txt"
echo "gpu_check: tests rc=$tests_rc, bench rc=$bench_rc, profile rc=$profile_rc," \
     "models rc=$models_rc; results in $out/gpu-$stamp-*"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$profile_rc" -eq 0 ] && [ "$models_rc" -eq 0 ]
