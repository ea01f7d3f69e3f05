"""timm's image models for ``python -m normkit.conversion.sweep --zoo timm``: one small
model per architecture family, built with random weights (never downloaded).

timm names its models ``<family><variant>``: ``convnext_atto``, ``resnet18``,
``efficientvit_b0``. ``models`` groups ``timm.list_models()`` by family (the name up to its
first digit or underscore), orders each family's names by the smallest size tag they carry
(``SIZES``, in that order), then the rest, and takes the first within
``sweep_models.MAX_PARAMETERS`` (counted on the meta device). ``build`` makes it with ten
classes; ``inputs`` a batch of two images
at the model's own input size. The sweep then runs as for transformers' models (eval, one
training step, every parameter's gradient against a float64 copy).
"""

from __future__ import annotations

import re

import torch

__all__ = ["candidates", "pick", "models", "build", "inputs", "SIZES"]

#: size tags, smallest first
SIZES = ("atto", "femto", "pico", "nano", "tiny", "xxs", "xs", "mini", "small", "s_",
         "mobile", "lite", "b0", "t_", "18", "26", "50")


def _tagged(name, tag) -> bool:
    """Whether ``name`` carries the size ``tag`` (a number tag as a whole number: "50"
    not in "resnetrs350")."""
    if tag.isdigit():
        return re.search(rf"(?<!\d){tag}(?!\d)", name) is not None
    return tag in name


def candidates(names) -> dict:
    """Each family of ``names`` (module docstring) with its members, those carrying the
    smallest size tag first (``SIZES``), then the rest in sorted order."""
    families: dict = {}
    for name in sorted(names):
        families.setdefault(re.split(r"[_\d]", name)[0], []).append(name)
    ordered = {}
    for family, members in families.items():
        first = [n for tag in SIZES for n in members if _tagged(n, tag)]
        ordered[family] = list(dict.fromkeys(first + members))
    return ordered


def pick(names, fits=lambda name: True) -> list:
    """One name per family of ``names``: its first candidate that ``fits``, else its first;
    sorted."""
    return sorted(next((n for n in members if fits(n)), members[0])
                  for members in candidates(names).values())


def _fits(name) -> bool:
    """Whether timm's ``name`` has at most ``MAX_PARAMETERS`` (counted on the meta device,
    no memory; a model that cannot be made there is tried as it is)."""
    import timm

    from normkit.conversion.sweep_models import MAX_PARAMETERS

    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False, num_classes=10)
    except Exception:  # noqa: BLE001 -- built for real in the sweep, which reports it
        return True
    return sum(p.numel() for p in model.parameters()) <= MAX_PARAMETERS


def models() -> list:
    """``(name, "timm")`` for the sweep: ``pick`` over every model timm lists, each
    family's first candidate within the parameter limit."""
    import timm

    return [(name, "timm") for name in pick(timm.list_models(), _fits)]


def build(name, seed=0):
    """The fp32 model ``name`` with random weights drawn from ``seed``, in eval mode;
    raises ValueError above ``sweep_models.MAX_PARAMETERS``."""
    import timm

    from normkit.conversion.sweep_models import MAX_PARAMETERS

    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, num_classes=10)
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"{count} parameters (limit {MAX_PARAMETERS})")
    return model.float().eval()


def inputs(model, seed=0, batch=2):
    """``{"x": images}`` at the model's own input size (its pretrained config's)."""
    size = tuple((getattr(model, "pretrained_cfg", None) or {}).get("input_size",
                                                                     (3, 224, 224)))
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(batch, *size, generator=gen)}
