"""Child process of ``normkit.bench.ops.run``: ``python -m normkit.bench SPEC OUT``."""

import sys

from normkit.bench.ops import child

child(sys.argv[1], sys.argv[2])
