"""normkit vs torch native vs a memory copy for instance_norm: `python benchmarks/bench_instance_norm.py`.

Same as `normkit bench --ops instance_norm`; extra arguments are passed on (e.g. `--quick`,
`--json`, `--dtypes float32`).
"""

import sys

from normkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--ops", "instance_norm", *sys.argv[1:]]))
