"""``python -m normkit``: the same as the ``normkit`` command."""

import sys

from normkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
