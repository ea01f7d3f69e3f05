"""normkit vs torch native vs a memory copy for rms_norm: `python benchmarks/bench_rms_norm.py`.

Same as `normkit bench --ops rms_norm`; extra arguments are passed on (e.g. `--quick`,
`--json`, `--dtypes float32`).
"""

import sys

from normkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--ops", "rms_norm", *sys.argv[1:]]))
