"""The study's grid: every (method, batch size, seed), resumable, with a progress bar.

Results go to ``results.json`` in the output folder after *every* finished run (written to
a temporary file, then renamed, so an interrupted run never leaves a half-written file).
Started again with the same protocol, the study skips the runs already in that file.

The grid. Every method is trained at every batch size only with ``all_batches``; by
default the batch size is swept for the methods whose result can depend on it --
BatchNorm and BatchRenorm, with GroupNorm as the batch-independent reference, as in the
GroupNorm paper's Figure 1 -- while the other methods (none, LayerNorm, InstanceNorm,
RMSNorm) run at the smallest, the reference (32) and the largest batch. That keeps the
default MNIST-1D study within ten minutes on an idle 2-core machine (6 min, about 700 CPU
seconds at this version's speed; docs/study.md): a run's cost is dominated by its number
of steps, and the smallest batch has the most.

Reproducible: every run computes with one thread (torch and numba) in whichever process
runs it, and its randomness comes from its seed alone, so the same command gives the same
numbers whatever the number of worker processes.
"""

from __future__ import annotations

import json
import math
import os
import time

from normkit.study import data as data_module
from normkit.study import experiments
from normkit.study import model as model_module
from normkit.study.analysis import reference_batch
from normkit.study.pool import DATA, check_jobs, check_listed, execute, one_thread, save_json
from normkit.study.train import TrainConfig, run_steps, train_one

__all__ = ["DEFAULTS", "QUICK", "SWEPT", "SHIFT_METHODS", "plan", "run_study", "load_results",
           "RESULTS_FILE"]

RESULTS_FILE = "results.json"

# per dataset; n_train / n_test None = the dataset's own split
DEFAULTS = {
    "mnist1d": dict(batch_sizes=(2, 8, 16, 32, 64), seeds=(0, 1, 2), epochs=1, min_steps=1000,
                    n_train=data_module.MNIST1D_TRAIN, n_test=data_module.MNIST1D_TEST,
                    base_lr=0.05),
    "digits": dict(batch_sizes=(2, 4, 8, 16, 32, 64), seeds=(0, 1, 2), epochs=4, min_steps=0, n_train=None,
                   n_test=None, base_lr=0.05),
}
# --quick: a few seconds, for tests and a first look; not meant to show anything
QUICK = {
    "mnist1d": dict(batch_sizes=(4, 16), seeds=(0,), epochs=1, min_steps=0, n_train=200, n_test=100,
                    base_lr=0.05),
    "digits": dict(batch_sizes=(4, 16), seeds=(0,), epochs=1, min_steps=0, n_train=192, n_test=96,
                   base_lr=0.05),
}
SWEPT = ("batch", "batchrenorm", "group")        # trained at every batch size by default
SHIFT_METHODS = ("none", "batch", "group", "layer")  # whose covariate shift is recorded


def _cost(steps: int, batch_size: int) -> float:
    """Rough relative time of a run: per-step overhead plus per-image work (measured on
    this CNN on CPU: a step of 64 images costs about four steps of 2)."""
    return steps * (1.0 + batch_size / 20.0)


def batches_for(method, batch_sizes, all_batches=False) -> tuple:
    """The batch sizes ``method`` is trained at (see the module docstring)."""
    bs = sorted(batch_sizes)
    if all_batches or method in SWEPT:
        return tuple(bs)
    return tuple(sorted({bs[0], reference_batch(bs), bs[-1]}))


def plan(methods, batch_sizes, seeds, all_batches=False):
    """Runs in the order they are trained: seed by seed, so a partial study already has
    every method and batch size for the first seeds."""
    return [(m, b, s) for s in seeds for b in sorted(batch_sizes) for m in methods
            if b in batches_for(m, batch_sizes, all_batches)]


def _records_shift(task, protocol) -> bool:
    """Seed 0's run at the reference batch of the methods in SHIFT_METHODS, on MNIST-1D."""
    m, b, s = task
    return (protocol["dataset"] == "mnist1d" and m in SHIFT_METHODS and s == protocol["seeds"][0]
            and b == reference_batch(protocol["batch_sizes"]))


def load_results(path) -> dict | None:
    """The contents of ``path`` or None if it does not exist."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _run(task):
    """A grid run ``(method, batch, seed, protocol)`` or an experiment's part
    ``("experiment", name, method, config)``."""
    one_thread()
    if task[0] == "experiment":
        _, name, method, cfg = task
        result = experiments.run_part(DATA["data"], name, method, cfg)
        return {"experiment": name, "method": method, "result": result}
    method, batch_size, seed, protocol = task
    return train_one(DATA["data"], method, batch_size, seed, protocol["train"],
                     record_shift=_records_shift((method, batch_size, seed), protocol))


def _fingerprint(protocol):
    """The parts of the protocol that must match for old runs to be reused."""
    return {k: protocol.get(k) for k in ("dataset", "n_train", "n_test", "train", "layer_source", "model")}


MODELS = {
    "mnist1d": "Conv1dNet (3 conv: k5, k3/2, k3/2, 32 channels, lengths 40-20-10, GAP, linear)",
    "digits": "SmallCNN(4 conv 3x3: 16-32-64-64, maps 8-8-4-2, GAP, linear)",
}


def run_study(out_dir, methods=None, batch_sizes=None, seeds=None, epochs=None, quick=False, jobs=None,
              fresh=False, progress=True, base_lr=None, dataset="mnist1d", all_batches=False,
              min_steps=None, extra=True) -> dict:
    """Train the grid and, with ``extra`` on MNIST-1D, the experiments of
    :mod:`normkit.study.experiments`, resuming from ``out_dir/results.json``; return the
    results dict (protocol, runs, experiments, elapsed time). The report is made separately
    (see ``report``)."""
    if dataset not in data_module.DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(data_module.DATASETS)}")
    base = (QUICK if quick else DEFAULTS)[dataset]
    available = model_module.available_methods()
    methods = check_listed("--methods", available if methods is None else methods)
    unknown = [m for m in methods if m not in model_module.METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(available)}")
    batch_sizes = check_listed("--batch-sizes", sorted(set(int(b) for b in (
        base["batch_sizes"] if batch_sizes is None else batch_sizes))))
    seeds = check_listed("--seeds", (int(s) for s in (base["seeds"] if seeds is None else seeds)))
    epochs = int(base["epochs"] if epochs is None else epochs)
    min_steps = int(base["min_steps"] if min_steps is None else min_steps)
    base_lr = float(base["base_lr"] if base_lr is None else base_lr)
    if min(batch_sizes) < 2:
        raise ValueError(f"batch sizes must be at least 2 (BatchNorm cannot normalize one image "
                         f"with a single value per channel); got {batch_sizes}")
    if epochs < 1:
        raise ValueError(f"--epochs must be at least 1, got {epochs}")
    if min_steps < 0:
        raise ValueError(f"--min-steps must be 0 or more, got {min_steps}")
    if not 0 < base_lr < math.inf:
        raise ValueError(f"--lr must be a positive number, got {base_lr}")
    jobs = check_jobs(jobs, quick)

    data = data_module.load(dataset, base["n_train"], base["n_test"])
    protocol = {
        "dataset": dataset,
        "n_train": base["n_train"], "n_test": base["n_test"],
        "train_images": int(len(data.y_train)), "test_images": int(len(data.y_test)),
        "train": dict(TrainConfig(epochs=epochs, base_lr=base_lr,
                                  min_steps=min_steps)),
        "layer_source": model_module.layer_source(),
        "model": MODELS[dataset] + "; BatchRenorm warm-up 1/8, ramps 1/4 of the steps",
        "methods": list(methods), "batch_sizes": list(batch_sizes), "seeds": list(seeds),
        "swept": [m for m in methods if all_batches or m in SWEPT],
        "all_batches": bool(all_batches), "quick": bool(quick),
    }

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, RESULTS_FILE)
    old = None if fresh else load_results(path)
    runs = {}
    if old is not None:
        if _fingerprint(old.get("protocol", {})) != _fingerprint(protocol):
            raise ValueError(f"{path} holds runs of a different protocol (epochs, data, learning rate "
                             f"or layers differ); pass --fresh to start over, or a new --out folder")
        runs = {(r["method"], r["batch_size"], r["seed"]): r for r in old.get("runs", [])}
    todo = [t for t in plan(methods, batch_sizes, seeds, all_batches) if t not in runs]
    wanted = set(plan(methods, batch_sizes, seeds, all_batches))
    n_train = protocol["train_images"]
    cost = {t: _cost(run_steps(n_train, t[1], epochs, min_steps), t[1]) for t in todo}
    stored = dict(old.get("experiments", {})) if old else {}
    exp_todo = []
    if extra and dataset == "mnist1d":
        cfgs = experiments.configs(quick, protocol["train"])
        exp_todo = experiments.tasks(cfgs, stored)
        for name, cfg in cfgs.items():
            if stored.get(name, {}).get("config") != cfg:
                stored[name] = {"config": cfg, "parts": {}}
        at_32 = run_steps(n_train, 32, epochs, min_steps)
        cost.update({("experiment", name, m): _cost(experiments.cost(name, cfg, at_32), 32)
                     for name, m, cfg in exp_todo})
    results = {"normkit_study": 1, "protocol": protocol, "runs": [], "experiments": stored,
               "elapsed_seconds": 0.0}
    elapsed_before = float(old.get("elapsed_seconds", 0.0)) if old else 0.0

    def store():
        # the grid's runs in order, then any older runs outside this grid (kept, not reported)
        order = [t for t in plan(methods, batch_sizes, seeds, all_batches) if t in runs]
        results["runs"] = [runs[t] for t in order] + [r for t, r in runs.items() if t not in wanted]
        results["elapsed_seconds"] = elapsed_before + (time.perf_counter() - start)
        save_json(path, results)

    start = time.perf_counter()
    # the grid first, seed by seed; the experiments' parts, longest first, fill the workers at its end
    exp_todo.sort(key=lambda t: -cost[("experiment", t[0], t[1])])
    tasks = [(m, b, s, protocol) for (m, b, s) in todo] + [("experiment", *t) for t in exp_todo]
    n_all = len(wanted) + sum(len(experiments.EXPERIMENTS[k][0]) for k in stored)
    finished = [n_all - len(tasks)]
    bar = None
    if progress and tasks:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(cost.values()), dynamic_ncols=True,
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed} elapsed, {remaining} left]")
        bar.set_description_str(f"{finished[0]}/{n_all} runs")

    def done(r):
        if "experiment" in r:
            key = ("experiment", r["experiment"], r["method"])
            stored[r["experiment"]]["parts"][r["method"]] = r["result"]
        else:
            key = (r["method"], r["batch_size"], r["seed"])
            runs[key] = r
        store()
        if bar is not None:
            bar.update(cost[key])
            finished[0] += 1
            bar.set_description_str(f"{finished[0]}/{n_all} runs")

    try:
        execute(_run, tasks, data, jobs, done)
    finally:
        if bar is not None:
            bar.close()
    store()
    return results
