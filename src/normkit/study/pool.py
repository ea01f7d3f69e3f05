"""Where the study's runs execute: worker processes (or this process), each computing with
one thread and holding the data it was handed once, at start; the atomic JSON save; and
the checks of the options both take (``--jobs``, the lists).

Shared by the grid (:mod:`normkit.study.runner`, with the experiments' parts) and the
transformer runs (:mod:`normkit.study.vit`).
"""

from __future__ import annotations

import json
import os

from normkit._atomic import write_text_atomic

__all__ = ["DATA", "check_jobs", "check_listed", "execute", "one_thread", "save_json"]

# the data, loaded once in the main process and handed to each worker when it starts
DATA = {}


def save_json(path, results) -> None:
    """Write ``results`` to ``path`` as JSON, atomically (a temporary file, then a rename)."""
    write_text_atomic(path, json.dumps(results, indent=1, allow_nan=True))


def check_jobs(jobs, quick) -> int:
    """The number of worker processes: ``jobs`` (at least 1), or by default 1 with ``quick``
    and otherwise 2 or the number of CPUs if fewer."""
    if jobs is None:
        return 1 if quick else min(2, os.cpu_count() or 1)
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1 (1: run in this process), got {jobs}")
    return int(jobs)


def check_listed(option, values) -> tuple:
    """``values`` as a tuple, refused where empty (an empty ``--seeds`` is not "the default")."""
    values = tuple(values)
    if not values:
        raise ValueError(f"{option} is empty; name at least one, or leave the option out for its "
                         "default")
    return values


def _init_worker(dataset):
    DATA["data"] = dataset


def one_thread() -> None:
    """One compute thread for torch and for numba (normkit's CPU kernels): the tensors are
    tiny, so threads only add overhead -- and oversubscribe the CPUs with two workers."""
    import torch

    torch.set_num_threads(1)
    try:
        import numba
    except ImportError:
        return
    numba.set_num_threads(1)


def execute(run, tasks, data, jobs, done) -> None:
    """``done(run(task))`` for every task, in ``jobs`` worker processes (each given ``data``
    once, at start) or in this process when ``jobs`` is 1; ``run`` must be a module-level
    function that reads the data from ``DATA["data"]``."""
    if jobs > 1 and len(tasks) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # spawn, not fork: forked workers inherit torch's and numba's thread-pool state and
        # ran ten times slower here. Spawn re-imports the caller's main module only when it is
        # a script (the `normkit` script has a main guard) -- never for `python -m normkit`.
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(data,))
        try:
            for fut in as_completed([pool.submit(run, task) for task in tasks]):
                done(fut.result())
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return
    import torch

    threads = torch.get_num_threads()
    _init_worker(data)
    try:
        for task in tasks:
            done(run(task))
    finally:
        torch.set_num_threads(threads)
        try:
            import numba

            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        except ImportError:
            pass
