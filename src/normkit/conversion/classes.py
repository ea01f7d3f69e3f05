"""Classes made at conversion time, one per source class, and how their instances pickle.

``convert`` gives a module a class derived for it: a normkit layer that carries a torch
subclass's (or a language model's) extra attributes, or a routed or fused subclass of the
module's own class. Each is made once per source class and cached; its ``__name__`` stays
the source's, so ``repr`` reads the same. It is registered in this module under a mangled
``__qualname__``, and its instances pickle as the call that makes the class again (the
maker, a module-level function, with the source class and names as arguments) followed by
their state, so that ``torch.save(model)`` loads in a fresh process, which has made no
such class yet.
"""

from __future__ import annotations

import re
import sys

__all__ = ["derived_class", "qualified", "remade"]

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


def derived_class(role: str, source: type, bases: tuple, namespace_fn, remake: tuple):
    """The class ``role`` derived from ``source``: ``type(source.__name__, bases,
    namespace_fn())``, made on first request and cached. ``remake = (maker, *args)``:
    ``maker(*args)`` returns this class, in any process (see the module's docstring)."""
    key = (role, source, bases)
    if key not in _CACHE:
        mangled = re.sub(r"\W", "_", f"{role}__{source.__module__}__{source.__qualname__}")
        namespace = dict(namespace_fn())
        namespace.update(__module__=__name__, __qualname__=mangled, _normkit_remake=remake,
                         __reduce_ex__=_reduce_ex)
        kind = type(source.__name__, bases, namespace)
        setattr(sys.modules[__name__], mangled, kind)
        _CACHE[key] = kind
    return _CACHE[key]


def _reduce_ex(self, protocol):
    """Pickle an instance of a made class as ``remade(maker, *args)``, then its state."""
    remake = vars(type(self)).get("_normkit_remake")
    if remake is None or not all(_by_name(a) for a in remake if isinstance(a, type)):
        # a subclass made elsewhere, or a source class pickle cannot find (one defined in
        # a function): by the made class's name, found in this process only
        return object.__reduce_ex__(self, protocol)
    return remade, remake, self.__getstate__()


def _by_name(kind) -> bool:
    """Whether pickle finds the class ``kind`` by its module and qualified name."""
    found = sys.modules.get(kind.__module__)
    for part in kind.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is kind


def remade(maker, *args):
    """A bare instance of the class ``maker(*args)`` makes (unpickling fills in its
    state)."""
    kind = maker(*args)
    return kind.__new__(kind)
