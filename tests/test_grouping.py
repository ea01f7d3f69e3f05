"""normkit.grouping: the views every method is computed on, and the view check."""

import itertools

import pytest

torch = pytest.importorskip("torch")

from normkit import grouping as G  # noqa: E402


def _layouts():
    """Tensors of many strides: contiguous, channels_last, permuted, sliced, expanded."""
    base = torch.empty(2, 6, 3, 4)
    yield base
    yield base.to(memory_format=torch.channels_last)
    yield base[:, :, :, ::2]
    yield base[:, ::3]
    yield base.transpose(2, 3)
    yield base.permute(3, 1, 0, 2)
    yield torch.empty(1, 6, 1, 4).to(memory_format=torch.channels_last)
    yield torch.empty(6, 1).expand(6, 5)
    yield torch.empty(0, 6, 3, 4)


@pytest.mark.parametrize("x", list(_layouts()), ids=lambda x: f"{tuple(x.shape)}{x.stride()}")
def test_view_strides_agrees_with_view(x):
    # the check says None exactly where Tensor.view raises, and the view's strides otherwise
    n = x.numel()
    shapes = {(n,), (x.shape[0], -1), (x.shape[0], x.shape[1], -1), tuple(reversed(x.shape))}
    if x.dim() == 4:
        shapes.add((x.shape[0], 3, 2, x.shape[2] * x.shape[3]))   # a group view
    for shape in shapes:
        if -1 in shape:
            rest = n // max(1, shape[0] * (shape[1] if len(shape) == 3 else 1))
            shape = (*shape[:-1], rest)
        if len(shape) and n and torch.Size(shape).numel() != n:
            continue
        try:
            want = x.view(shape).stride()
        except RuntimeError:
            want = None
        got = G.view_strides(tuple(x.shape), x.stride(), shape)
        if want is None or got is None:
            assert want == got, (shape, want, got)
        elif n:
            # (the stride of a dim of size 1 is free)
            assert all(w == g or s == 1 for w, g, s in zip(want, got, shape)), (shape, want, got)


def test_view_strides_refuses_what_view_refuses():
    x = torch.empty(4, 5).t()
    assert G.view_strides(tuple(x.shape), x.stride(), (20,)) is None
    assert G.view_strides((2, 3), (3, 1), (6,)) == (1,)
    assert G.view_strides((2, 3), (3, 1), (3, 2)) == (2, 1)
    assert G.view_strides((2, 3), (1, 2), (6,)) is None
    for kind in itertools.product((1, 2), (1, 3)):
        assert G.view_strides(kind, (kind[1], 1), (kind[0] * kind[1],)) == (1,)
