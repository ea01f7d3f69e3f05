"""Shared test helpers: per-dtype tolerances and a comparison that reports the worst error."""

try:  # the scaler tests run without torch; the layer tests import it themselves
    import torch
except ImportError:  # pragma: no cover
    torch = None

if torch is not None:
    # (atol, rtol) for comparing against torch; half types carry ~3 significant digits and
    # the two implementations round at different places
    TOL = {
        torch.float64: (1e-10, 1e-10),
        torch.float32: (2e-5, 2e-5),
        torch.bfloat16: (6e-2, 2e-2),
        torch.float16: (6e-3, 4e-3),
    }

    # gradients sum many terms; allow more for the half types
    GRAD_TOL = {
        torch.float64: (1e-9, 1e-9),
        torch.float32: (1e-4, 1e-4),
        torch.bfloat16: (2.5e-1, 5e-2),
        torch.float16: (3e-2, 1e-2),
    }


def assert_close(actual, expected, dtype=None, grad=False, msg=""):
    """Compare in float64 with the tolerance of ``dtype`` (default: expected's dtype)."""
    if actual is None or expected is None:
        assert actual is None and expected is None, f"{msg}: one side is None"
        return
    dtype = dtype or expected.dtype
    atol, rtol = (GRAD_TOL if grad else TOL)[dtype]
    # gradients scale with the size of the reductions; normalize the tolerance by magnitude
    big = float(expected.detach().double().abs().max()) if expected.numel() else 0.0
    scale = max(1.0, big) if grad else 1.0
    torch.testing.assert_close(actual.detach().double(), expected.detach().double(),
                               atol=atol * scale, rtol=rtol, equal_nan=True, msg=msg or None)
