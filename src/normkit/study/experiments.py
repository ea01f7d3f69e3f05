"""The study's experiments beyond the batch-size grid: one per claim of the articles that
the grid cannot test. Each is trained per method (a *part*), so the parts share the grid's
worker processes and a stopped study resumes part by part.

==========  ====================================================  ========================
name        what it measures                                       module
==========  ====================================================  ========================
depth       gradient norm per layer of a 20-layer plain network    :mod:`.depth`
lr_range    final training loss over a sweep of learning rates     :mod:`.lr_range`
robust      trained CNNs: per-signal style, drift, weight scale,    :mod:`.robust`,
            a batch of one                                         :mod:`.probes`
regularize  test error after fitting small training sets, with     :mod:`.regularize`
            more, less and no batch noise
sequence    a recurrent network along MNIST-1D's time axis         :mod:`.sequence`
vit         the small SigLIP-style transformer, short run           :mod:`.vit`
==========  ====================================================  ========================

``results["experiments"][name]`` holds ``{"config": ..., "parts": {method: result}}``; a
part is rerun when its experiment's config changed.
"""

from __future__ import annotations

import time

from normkit.study import depth, lr_range, regularize, robust, sequence, vit

__all__ = ["EXPERIMENTS", "configs", "tasks", "run_part", "complete", "vit_results", "cost"]

# the short transformer run of the default study (``--model vit`` keeps the longer one)
VIT_STUDY = dict(lrs=(1e-3, 4e-3, 1.6e-2), seeds=(0,), steps=600, batch_size=32, target_loss=1.0)
VIT_STUDY_QUICK = dict(lrs=(1e-3, 1.6e-2), seeds=(0,), steps=15, batch_size=16, target_loss=1.0)


def _vit_part(data, method, cfg):
    start = time.perf_counter()
    runs = [vit.train_vit(data, method, lr, seed, cfg["steps"], cfg["batch_size"])
            for seed in cfg["seeds"] for lr in cfg["lrs"]]
    return {"method": method, "runs": runs, "seconds": time.perf_counter() - start}


# name -> (methods, default config, quick config, run(data, method, config))
EXPERIMENTS = {
    "depth": (depth.METHODS, depth.DEFAULT, depth.QUICK, depth.run),
    "lr_range": (lr_range.METHODS, lr_range.DEFAULT, lr_range.QUICK, lr_range.run),
    "robust": (robust.METHODS, {}, {}, robust.run),
    "regularize": (regularize.METHODS, regularize.DEFAULT, regularize.QUICK, regularize.run),
    "sequence": (sequence.METHODS, sequence.DEFAULT, sequence.QUICK, sequence.run),
    "vit": (vit.NORMS, VIT_STUDY, VIT_STUDY_QUICK, _vit_part),
}


def _plain(cfg):
    """A config as it reads back from results.json (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else _plain(v) if isinstance(v, dict) else v
            for k, v in cfg.items()}


def configs(quick: bool, train: dict) -> dict:
    """``{name: config}``; ``train`` is the grid's training protocol, which the trained CNNs
    of ``robust`` share (so they are the grid's seed-0 networks at batch 32), and those of
    ``regularize`` (for their own number of steps)."""
    out = {}
    for name, (_, default, quick_cfg, _) in EXPERIMENTS.items():
        cfg = dict(quick_cfg if quick else default)
        if name in ("robust", "regularize"):
            cfg["train"] = dict(train)
        out[name] = _plain(cfg)
    return out


def tasks(cfgs: dict, stored: dict) -> list:
    """``(name, method, config)`` of every part not yet in ``stored`` with the same config."""
    out = []
    for name, cfg in cfgs.items():
        old = stored.get(name, {})
        done = old.get("parts", {}) if old.get("config") == cfg else {}
        out += [(name, m, cfg) for m in EXPERIMENTS[name][0] if m not in done]
    return out


def run_part(data, name: str, method: str, cfg: dict) -> dict:
    """One part: experiment ``name`` for ``method``."""
    return EXPERIMENTS[name][3](data, method, cfg)


def cost(name: str, cfg: dict, grid_steps_at_32: int) -> float:
    """A part's rough cost in steps of the CNN at batch 32 (for the progress bar)."""
    if name == "depth":
        return 1.5 * cfg["steps"]
    if name == "lr_range":
        return cfg["steps"] * len(cfg["lrs"])
    if name == "robust":
        return grid_steps_at_32 + 200
    if name == "sequence":
        return 2.0 * cfg["steps"] * len(cfg["seeds"]) * len(cfg["places"])
    if name == "regularize":
        return 1.3 * cfg["steps"] * len(cfg["sizes"]) * len(cfg["seeds"])
    return 2.5 * cfg["steps"] * len(cfg["lrs"]) * len(cfg["seeds"])


def complete(results: dict, name: str) -> dict | None:
    """``{"config", "parts"}`` of experiment ``name`` if every method's part is in
    ``results``, else None."""
    exp = (results or {}).get("experiments", {}).get(name)
    if exp is None or any(m not in exp["parts"] for m in EXPERIMENTS[name][0]):
        return None
    return exp


def vit_results(results: dict) -> dict | None:
    """The default study's transformer runs in the form of ``vit-results.json``."""
    exp = complete(results, "vit")
    if exp is None:
        return None
    cfg = exp["config"]
    parts = [exp["parts"][m] for m in vit.NORMS]
    protocol = dict(cfg, methods=list(vit.NORMS), quick=bool(results["protocol"].get("quick")),
                    weight_decay=vit.WEIGHT_DECAY, warmup_fraction=vit.WARMUP_FRACTION,
                    layer_source=results["protocol"]["layer_source"], dataset="mnist1d",
                    n_train=results["protocol"]["train_images"], n_test=results["protocol"]["test_images"],
                    in_study=True)
    return {"normkit_study_vit": 1, "protocol": protocol, "runs": [r for p in parts for r in p["runs"]],
            "elapsed_seconds": sum(p["seconds"] for p in parts)}
