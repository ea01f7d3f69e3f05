"""The study's grid: every (method, batch size, seed), resumable, with a progress bar.

Results go to ``results.json`` in the output folder after *every* finished run (written to
a temporary file, then renamed, so an interrupted run never leaves a half-written file).
Started again with the same protocol, the study skips the runs already in that file.
"""

from __future__ import annotations

import json
import os
import time

from normkit._atomic import write_text_atomic
from normkit.study import data as data_module
from normkit.study import model as model_module
from normkit.study.train import TrainConfig, train_one

__all__ = ["DEFAULTS", "QUICK", "plan", "run_study", "load_results", "RESULTS_FILE"]

RESULTS_FILE = "results.json"

DEFAULTS = dict(batch_sizes=(2, 4, 8, 16, 32, 64), seeds=(0, 1, 2), epochs=4, n_train=None, n_test=None)
# --quick: a few seconds, for tests and a first look; not meant to show anything
QUICK = dict(batch_sizes=(4, 16), seeds=(0,), epochs=1, n_train=192, n_test=96)


def _cost(steps: int, batch_size: int) -> float:
    """Rough relative time of a run: per-step overhead plus per-image work (measured on
    this CNN on CPU: a step of 64 images costs about four steps of 2)."""
    return steps * (1.0 + batch_size / 20.0)


def plan(methods, batch_sizes, seeds):
    """Runs in the order they are trained: seed by seed, so a partial study already has
    every method and batch size for the first seeds."""
    return [(m, b, s) for s in seeds for b in batch_sizes for m in methods]


def load_results(path) -> dict | None:
    """The contents of ``path`` or None if it does not exist."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _save(path, results):
    write_text_atomic(path, json.dumps(results, indent=1, allow_nan=True))


# worker processes keep the data loaded between runs
_DATA = {}


def _one_thread():
    """One compute thread for torch and for numba (normkit's CPU kernels): the tensors are
    tiny, so threads only add overhead -- and oversubscribe the CPUs with two workers."""
    import torch

    torch.set_num_threads(1)
    try:
        import numba
    except ImportError:
        return
    numba.set_num_threads(1)


def _run(task):
    method, batch_size, seed, protocol = task
    _one_thread()
    key = (protocol["n_train"], protocol["n_test"])
    if key not in _DATA:
        _DATA[key] = data_module.load(*key)
    return train_one(_DATA[key], method, batch_size, seed, protocol["train"])


def _fingerprint(protocol):
    """The parts of the protocol that must match for old runs to be reused."""
    return {k: protocol[k] for k in ("dataset", "n_train", "n_test", "train", "layer_source", "model")}


def run_study(out_dir, methods=None, batch_sizes=None, seeds=None, epochs=None, quick=False, jobs=None,
              fresh=False, progress=True, base_lr=0.05) -> dict:
    """Train the grid, resuming from ``out_dir/results.json``; return the results dict
    (protocol, runs, elapsed time). The report is made separately (see ``report``)."""
    base = QUICK if quick else DEFAULTS
    available = model_module.available_methods()
    methods = tuple(methods) if methods else available
    unknown = [m for m in methods if m not in model_module.METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(available)}")
    missing = [m for m in methods if m not in available]
    if missing:
        raise ValueError(f"method(s) {', '.join(missing)} are not available in this installation "
                         f"(normkit.nn has no BatchRenorm2d yet); leave them out of --methods")
    batch_sizes = tuple(sorted(set(int(b) for b in (batch_sizes or base["batch_sizes"]))))
    seeds = tuple(int(s) for s in (seeds if seeds is not None else base["seeds"]))
    epochs = int(epochs or base["epochs"])
    if min(batch_sizes) < 2:
        raise ValueError(f"batch sizes must be at least 2 (BatchNorm cannot normalize one image "
                         f"with a single value per channel); got {batch_sizes}")
    if epochs < 1:
        raise ValueError(f"--epochs must be at least 1, got {epochs}")
    if jobs is None:
        jobs = 1 if quick else min(2, os.cpu_count() or 1)

    data = data_module.load(base["n_train"], base["n_test"])
    protocol = {
        "dataset": data.name,
        "n_train": base["n_train"], "n_test": base["n_test"],
        "train_images": int(len(data.y_train)), "test_images": int(len(data.y_test)),
        "train": dict(TrainConfig(epochs=epochs, base_lr=base_lr)),
        "layer_source": model_module.layer_source(),
        "model": "SmallCNN(4 conv 3x3: 16-32-64-64, maps 8-8-4-2, GAP, linear); "
                 "BatchRenorm warm-up 1/8, ramps 1/4 of the steps",
        "methods": list(methods), "batch_sizes": list(batch_sizes), "seeds": list(seeds),
        "quick": bool(quick),
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
    todo = [t for t in plan(methods, batch_sizes, seeds) if t not in runs]
    wanted = set(plan(methods, batch_sizes, seeds))
    n_train = protocol["train_images"]
    cost = {t: _cost(epochs * (n_train // t[1]), t[1]) for t in todo}
    results = {"normkit_study": 1, "protocol": protocol, "runs": [], "elapsed_seconds": 0.0}
    elapsed_before = float(old.get("elapsed_seconds", 0.0)) if old else 0.0

    def store():
        # the grid's runs in order, then any older runs outside this grid (kept, not reported)
        order = [t for t in plan(methods, batch_sizes, seeds) if t in runs]
        results["runs"] = [runs[t] for t in order] + [r for t, r in runs.items() if t not in wanted]
        results["elapsed_seconds"] = elapsed_before + (time.perf_counter() - start)
        _save(path, results)

    start = time.perf_counter()
    tasks = [(m, b, s, protocol) for (m, b, s) in todo]
    pool = futures = None
    if jobs > 1 and len(tasks) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn, not fork: forked workers inherit torch's and numba's thread-pool state and
        # ran ten times slower here. Spawn re-imports the caller's main module only when it is
        # a script (the `normkit` script has a main guard) -- never for `python -m normkit`.
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
        futures = {pool.submit(_run, task): task[:3] for task in tasks}
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(cost.values()), dynamic_ncols=True,
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed} elapsed, {remaining} left]")
        bar.set_description_str(f"{len(wanted) - len(todo)}/{len(wanted)} runs")

    def done(r):
        key = (r["method"], r["batch_size"], r["seed"])
        runs[key] = r
        store()
        if bar is not None:
            bar.update(cost[key])
            bar.set_description_str(f"{len(runs)}/{len(wanted)} runs")

    try:
        if pool is None:
            import torch

            threads = torch.get_num_threads()
            try:
                for task in tasks:
                    done(_run(task))
            finally:
                torch.set_num_threads(threads)
                try:
                    import numba

                    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
                except ImportError:
                    pass
        else:
            from concurrent.futures import as_completed

            for fut in as_completed(futures):
                done(fut.result())
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
    store()
    return results
