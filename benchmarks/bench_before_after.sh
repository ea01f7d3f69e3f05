#!/usr/bin/env bash
# normkit's benchmarks before and after a change, in one run, the two sides taking turns.
#
#   bash benchmarks/bench_before_after.sh BASE_WORKTREE OUT_DIR [ROUNDS]
#
# BASE_WORKTREE: a checkout of the revision to compare with, set up with `make setup`
# (e.g. `git worktree add ../base <rev> && make -C ../base setup`); this checkout's own
# .venv is the "after" side. Each round runs, for before then after (reversed every other
# round): `normkit bench` (fwd and fwd+bwd, fp32 and bf16, the default and no-mmap
# allocators) and `normkit bench --models --control`, each writing JSON to OUT_DIR.
# Each side builds its C++ executor in an extension folder of its own.
# `python benchmarks/bench_table.py OUT_DIR/ops-*.json --format docs` tabulates the ops.
set -euo pipefail
base=$(cd "$1" && pwd)
out=$2
rounds=${3:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"

run_side() {   # side, checkout, round
  local side=$1 tree=$2 round=$3
  export TORCH_EXTENSIONS_DIR="$out/torch-extensions-$side"
  (cd "$tree" && .venv/bin/normkit bench --dtypes float32 bfloat16 --modes fwd fwd+bwd \
     --allocators default no-mmap --json --no-progress) > "$out/ops-$side-$round.json"
  (cd "$tree" && .venv/bin/normkit bench --models --control --json --no-progress) \
     > "$out/models-$side-$round.json"
  echo "round $round: $side done ($(date +%T))"
}

for round in $(seq 1 "$rounds"); do
  if (( round % 2 )); then
    run_side before "$base" "$round"; run_side after "$here" "$round"
  else
    run_side after "$here" "$round"; run_side before "$base" "$round"
  fi
done
