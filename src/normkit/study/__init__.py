"""The experiment behind ``normkit study``: one small CNN trained with each normalization
over a grid of batch sizes and seeds on scikit-learn's bundled digits, then a report.

Modules, in the order data flows: ``data`` (the images), ``model`` (the CNN and
``make_norm``, the one place that picks a layer per method), ``train`` (one run),
``runner`` (the grid, resumable), ``analysis`` (means, standard deviations, findings),
``plots`` and ``report`` (report.md, report.html). Needs torch, matplotlib, scikit-learn
and tqdm (``pip install normkit[torch,study]``).
"""

from __future__ import annotations

__all__ = ["run_study", "write_report"]


def run_study(*args, **kwargs):
    """See :func:`normkit.study.runner.run_study`."""
    from normkit.study.runner import run_study as _run

    return _run(*args, **kwargs)


def write_report(*args, **kwargs):
    """See :func:`normkit.study.report.write_report`."""
    from normkit.study.report import write_report as _write

    return _write(*args, **kwargs)
