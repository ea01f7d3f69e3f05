"""convert on every norm class that transformers' and diffusers' models define, each class
alone, as convert meets it inside a model: convert never raises, and decides on the meta
device as on the CPU; a module it takes computes
what the class computes -- in fp32, in bf16, and on a bf16 input with fp32 parameters (mixed
precision), in the class's output dtype, and equal to its output or no less accurate than it
against the class's own float64 forward; a module it leaves is named with a reason."""

import copy
import importlib
import inspect
import pathlib
import pkgutil
import re

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import normkit  # noqa: E402

# constructor arguments by name; a class that needs another is passed over
_WIDTHS = {"hidden_size", "dim", "normalized_shape", "num_channels", "channels", "in_channels",
           "embedding_dim", "embed_dim", "num_features", "features", "hidden_dim", "out_dim",
           "size", "d_model", "n_embd", "head_dim", "normalized_dim"}
_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
           (torch.float32, torch.bfloat16))                      # (parameters, input)
_SHAPES = ((2, 5, 24), (2, 24, 4, 4))                             # the first the class takes


def _arguments(kind):
    """Keyword arguments that build ``kind`` (width 24), or None."""
    kwargs = {}
    for p in list(inspect.signature(kind.__init__).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in _WIDTHS:
            kwargs[p.name] = 24
        elif "eps" in p.name:
            kwargs[p.name] = 1e-6
        elif p.name in ("num_groups", "groups"):
            kwargs[p.name] = 4
        elif p.default is inspect.Parameter.empty:
            return None
    return kwargs


def _classes_of(module):
    """``{path: (class, kwargs)}`` of the classes defined in ``module`` named like a norm,
    with a bias as well where the constructor takes one."""
    found = {}
    for name, kind in vars(module).items():
        if not (inspect.isclass(kind) and issubclass(kind, nn.Module) and "Norm" in name
                and kind.__module__ == module.__name__):
            continue
        kwargs = _arguments(kind)
        if kwargs is None:
            continue
        found[f"{module.__name__}.{name}"] = (kind, kwargs)
        if "bias" in inspect.signature(kind.__init__).parameters:
            found[f"{module.__name__}.{name}(bias=True)"] = (kind, dict(kwargs, bias=True))
    return found


def _transformers_classes():
    transformers = pytest.importorskip("transformers")
    root = pathlib.Path(transformers.__file__).parent
    found = {}
    for path in sorted((root / "models").rglob("modeling_*.py")):
        if not re.search(r"^class \w*Norm\w*\(", path.read_text(errors="ignore"), re.M):
            continue                                   # (only the modules that define one)
        name = "transformers." + ".".join(path.relative_to(root).with_suffix("").parts)
        try:
            found.update(_classes_of(importlib.import_module(name)))
        except Exception:  # noqa: BLE001 -- a model module needing a library not installed
            continue
    return found


def _diffusers_classes():
    diffusers = pytest.importorskip("diffusers")
    found = {}
    for info in pkgutil.walk_packages(diffusers.models.__path__, "diffusers.models."):
        try:
            found.update(_classes_of(importlib.import_module(info.name)))
        except Exception:  # noqa: BLE001 -- a model module needing a library not installed
            continue
    return found


def _output(module, x):
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def _check(path, module, converted):
    """The cases run: per (parameters, input) dtype pair, the first probe shape the class
    takes, the converted module against it."""
    cases = 0
    for p_dtype, x_dtype in _DTYPES:
        mine = copy.deepcopy(module).to(p_dtype)
        theirs = copy.deepcopy(converted).to(p_dtype)
        for shape in _SHAPES:
            gen = torch.Generator().manual_seed(1)
            x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(x_dtype)
            try:
                want = _output(mine, x).detach()
            except Exception:  # noqa: BLE001 -- the class takes another input layout
                continue
            got = _output(theirs, x).detach()
            what = f"{path}: {p_dtype} parameters, {x_dtype} input"
            assert got.dtype == want.dtype and got.shape == want.shape, what
            tol = 1e-5 if want.dtype == torch.float32 else 1.6e-2
            scale = float(want.abs().max().float()) or 1.0
            if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * scale):
                # a class that computes in bf16 what normkit computes with fp32 statistics
                # (ImageGPT's): no less accurate than the class against itself in float64
                truth = _output(copy.deepcopy(module).double(), x.double()).detach()
                err = lambda y: float((y.double() - truth).abs().max())  # noqa: E731
                assert err(got) <= 2 * err(want) + 1e-6, (what, err(got), err(want))
            cases += 1
            break
    return cases


@pytest.mark.parametrize("library, least", [("transformers", 150), ("diffusers", 6)])
def test_every_norm_class_converts_exactly_or_is_left_with_a_reason(library, least):
    # taken (a class with and without a bias counted twice): transformers 5.25 257, diffusers
    # 0.42 12, 0.32 7
    classes = _transformers_classes() if library == "transformers" else _diffusers_classes()
    taken = set()
    for path, (kind, kwargs) in sorted(classes.items()):
        try:
            torch.manual_seed(0)
            module = kind(**kwargs)
        except Exception:  # noqa: BLE001 -- arguments this test guessed wrong
            continue
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape) * 0.5 + 0.3)
        # on the meta device (a model built there, its weights loaded later) convert
        # decides as on the CPU; first, so that no probe's cache answers for it
        on_meta = nn.ModuleDict({"m": copy.deepcopy(module).to("meta")})
        meta_report = str(normkit.convert(on_meta))
        holder = nn.ModuleDict({"m": copy.deepcopy(module)})
        report = normkit.convert(holder)
        assert meta_report == str(report), path
        assert all(reason for _, _, reason in report.left), (path, str(report))
        if (report.swapped or report.routed) and _check(path, module, holder["m"]):
            taken.add(path)
    assert len(taken) >= least, f"only {len(taken)} {library} classes converted and checked"
