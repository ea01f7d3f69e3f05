"""Classes made at conversion time, one per source class, findable by pickle.

``convert`` gives a module a class derived for it: a normkit layer that carries a torch
subclass's (or a language model's) extra attributes, or a routed subclass of the
module's own class. Each is made once per source class, cached, and registered in this
module under a mangled ``__qualname__`` so that ``pickle`` finds it in a process that
converted the same class (its ``__name__`` stays the source's, so ``repr`` reads the same).
"""

from __future__ import annotations

import re
import sys

__all__ = ["derived_class", "qualified"]

_CACHE: dict = {}


def qualified(kind) -> str:
    """``package.module.Class`` for a class (``normkit.nn.X`` for normkit's layers)."""
    module = kind.__module__
    for package in ("normkit.nn", "torch.nn"):
        if module.startswith(package + "."):
            module = package
    if module == __name__:      # a class made at conversion time: name its first base
        return f"{qualified(kind.__mro__[1])} (as {kind.__name__})"
    return f"{module}.{kind.__qualname__}"


def derived_class(role: str, source: type, bases: tuple, namespace_fn):
    """The class ``role`` derived from ``source``: ``type(source.__name__, bases,
    namespace_fn())``, made on first request and cached."""
    key = (role, source, bases)
    if key not in _CACHE:
        mangled = re.sub(r"\W", "_", f"{role}__{source.__module__}__{source.__qualname__}")
        namespace = dict(namespace_fn())
        namespace.update(__module__=__name__, __qualname__=mangled)
        kind = type(source.__name__, bases, namespace)
        setattr(sys.modules[__name__], mangled, kind)
        _CACHE[key] = kind
    return _CACHE[key]
