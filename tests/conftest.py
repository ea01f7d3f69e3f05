"""Shared test helpers: per-dtype tolerances, a comparison that reports the worst error, and
the source articles' worked LayerNorm example (its input is ``WORKED_INPUT`` of
``normkit.cli.explain.drawing``; here is the output the article prints, to 4 decimals)."""

import os

# scikit-learn's array API checks of the scalers (check_array_api_input, and
# test_scaler_array_api.py) need SciPy's array API mode, set before SciPy is imported;
# it leaves SciPy's results on NumPy inputs as they are
os.environ.setdefault("SCIPY_ARRAY_API", "1")

import numpy as np  # noqa: E402
import pytest

# the source article's printed output of torch.nn.LayerNorm(5) on WORKED_INPUT
ARTICLE_OUTPUT = np.array(
    [[[-0.2675, 1.4464, -1.1036, 0.8611, -0.9364], [1.2167, -0.6042, -1.5147, -0.0248, 0.9270],
      [-0.5116, -0.1403, 0.8087, -1.5018, 1.3450]],
     [[0.4601, 1.3051, -0.9483, 0.5539, -1.3708], [-0.7518, 0.2088, -1.3366, 0.2924, 1.5872],
      [1.5204, -0.9409, -1.2525, 0.2742, 0.3988]]])

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


def triton_interpreter_refusal():
    """Why Triton's interpreter cannot run normkit's kernels on this machine, or None.
    Before Triton 3.7 the interpreter turns a 1-element array into an index with
    ``int()``, which NumPy refuses from 2.4 on (3.7 squeezes the array first); its
    compiled kernels are not affected."""
    import importlib.util
    from importlib.metadata import version

    from packaging.version import Version

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'normkit[gpu]')"
    triton = version("triton")
    if Version(triton) < Version("3.7") and Version(np.__version__) >= Version("2.4"):
        return (f"Triton {triton}'s interpreter indexes with int() of 1-element arrays, "
                f"which NumPy {np.__version__} refuses (Triton 3.7 and newer do not)")
    return None


_REFUSAL = triton_interpreter_refusal()
#: for the tests that run the Triton kernels in its interpreter
needs_triton_interpreter = pytest.mark.skipif(_REFUSAL is not None, reason=str(_REFUSAL))


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Every test starts and ends with no cached normalization plan, so that a plan built
    under one test's tuning numbers never serves another test."""
    if torch is None:
        yield
        return
    from normkit import backends

    backends.clear_plans()
    yield
    backends.clear_plans()


@pytest.fixture
def native_on():
    """The C++ executor switched on before and after a test (for the files of tests that
    switch it off: ``pytestmark = pytest.mark.usefixtures("native_on")``)."""
    from normkit.backends.cpu import native

    native.switch(True)
    yield
    native.switch(True)


def pytest_sessionstart(session):
    """The suite tests normkit's kernels, so it fails at once where they are missing
    (numba, the ``fast`` extra; the C++ node, which needs a C++ compiler), instead of
    passing while testing almost none of them. ``NORMKIT_NATIVE=0`` runs it with the node
    switched off on purpose (the composite torch path)."""
    missing = []
    try:
        import numba  # noqa: F401
    except ImportError:
        missing.append("numba (pip install -e '.[fast]')")
    switched_off = os.environ.get("NORMKIT_NATIVE", "1").strip().lower() in (
        "0", "false", "no", "off")
    if torch is not None and not missing and not switched_off:
        from normkit.backends.cpu import native

        if native.extension() is None:
            missing.append("normkit's C++ node (a C++ compiler and ninja; see the warning "
                           "above, or run python -m normkit.backends.cpu)")
    if missing:
        pytest.exit("the kernels under test are missing: " + "; ".join(missing), returncode=3)
