"""normkit vs torch native vs a memory copy for layer_norm: `python benchmarks/bench_layer_norm.py`.

Same as `normkit bench --ops layer_norm`; extra arguments are passed on (e.g. `--quick`,
`--json`, `--dtypes float32`).
"""

import sys

from normkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--ops", "layer_norm", *sys.argv[1:]]))
