"""normkit vs torch native vs a memory copy for batch_norm: `python benchmarks/bench_batch_norm.py`.

Same as `normkit bench --ops batch_norm`; extra arguments are passed on (e.g. `--quick`,
`--json`, `--dtypes float32`).
"""

import sys

from normkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--ops", "batch_norm", *sys.argv[1:]]))
