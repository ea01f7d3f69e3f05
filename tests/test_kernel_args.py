"""The kernels' arguments, declared once (``normkit.backends.cpu.args``): every entry reads
only declared slots, in the declared order, and a mismatch on either side is an error
that names it: an entry's parameter that is not a slot, a constant its plan lacks, a
slot table that lacks one the C++ executor fills, a plan's argument array of another
length than the table."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("numba")
from normkit import backends  # noqa: E402
from normkit import grouping as G  # noqa: E402
from normkit.backends.cpu import args, entries, native  # noqa: E402


class _Entry:
    """What ``args`` reads of a numba entry: its Python function and name."""

    def __init__(self, fn):
        self.py_func, self.__name__ = fn, fn.__name__


def test_every_entry_reads_declared_slots_then_the_tail():
    for name in entries.__all__:
        names = args.parameters(getattr(entries, name))
        assert names and all(n in args.SLOTS for n in names), name


def test_an_entry_that_does_not_fit_the_declaration_is_refused():
    def untailed(x, y, lo, hi):
        pass

    def stranger(x, y, offset, lo, hi, eps, proto, sproto):
        pass

    with pytest.raises(TypeError, match="untailed: a kernel entry ends with the parameters"):
        args.parameters(_Entry(untailed))
    with pytest.raises(TypeError, match=r"stranger: parameters \['offset'\] are not declared"):
        args.parameters(_Entry(stranger))


def test_a_constant_the_plan_lacks_is_refused():
    def reads_groups(x, y, groups, lo, hi, eps, proto, sproto):
        pass

    class Plan:
        groups = 4

    base = args.constants(Plan(), _Entry(reads_groups))
    assert base[args.SLOTS["groups"]] == 4 and sum(base) == 4
    with pytest.raises(TypeError, match="object has no 'groups', which reads_groups reads"):
        args.constants(object(), _Entry(reads_groups))


@pytest.mark.skipif(not native.enabled(), reason="NORMKIT_NATIVE=0: no C++ executor")
def test_the_executor_refuses_a_table_or_an_array_that_does_not_fit(monkeypatch):
    ext = native.extension()
    try:
        table = {("grad_x" if k == "dx" else k): v for k, v in args.SLOTS.items()}
        with pytest.raises(RuntimeError, match="has no slot 'dx', which the C\\+\\+ node fills"):
            ext.set_slots(table)
        with pytest.raises(RuntimeError, match="slot 99 of 'x' outside 0.."):
            ext.set_slots(dict(args.SLOTS, x=99))
        x = torch.randn(4, 16)             # a refused table changed nothing
        y = backends.plan(x, G.layer(x.shape, 1)).forward(x, None, None, 1e-5)[0]
        torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (16,)))
    finally:
        ext.set_slots(args.SLOTS)
    short = args.constants
    monkeypatch.setattr(args, "constants", lambda *a: short(*a)[:-1])
    backends.clear_plans()
    with pytest.raises(RuntimeError, match=f"{len(args.SLOTS) - 1} arguments, the table has "
                                           f"{len(args.SLOTS)} slots"):
        backends.plan(x, G.layer(x.shape, 1))
    monkeypatch.undo()
    backends.clear_plans()                 # the table restored: plans build and run again
    y = backends.plan(x, G.layer(x.shape, 1)).forward(x, None, None, 1e-5)[0]
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (16,)))
