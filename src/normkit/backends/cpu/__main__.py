"""``python -m normkit.backends.cpu``: compile the C++ node of the small calls now
(``normkit.backends.cpu.native``) rather than at the first call; ``make setup`` runs it.
Without a compiler it says so and leaves the Python path (``tests/test_native.py`` fails
there)."""

import time

from normkit.backends.cpu import native

start = time.time()
ready = native.extension() is not None
print(f"normkit C++ node: {'ready' if ready else 'unavailable'} ({time.time() - start:.0f} s)")
