"""``python -m normkit.backends.cpu``: build the C++ executor of the CPU calls now
(``normkit.backends.cpu.native``) rather than at the first call; ``make setup`` runs it.
Without a compiler it says so (the composite torch path then runs every CPU call, and
``make test`` fails at once)."""

import time

from normkit.backends.cpu import native

start = time.time()
ready = native.extension() is not None
print(f"normkit C++ executor: {'ready' if ready else 'unavailable'} ({time.time() - start:.0f} s)")
