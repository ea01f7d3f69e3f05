"""normkit vs torch native vs a memory copy for group_norm: `python benchmarks/bench_group_norm.py`.

Same as `normkit bench --ops group_norm`; extra arguments are passed on (e.g. `--quick`,
`--json`, `--dtypes float32`).
"""

import sys

from normkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--ops", "group_norm", *sys.argv[1:]]))
