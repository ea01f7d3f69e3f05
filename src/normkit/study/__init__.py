"""The experiment behind ``normkit study``: one small CNN trained with each normalization
over a grid of batch sizes and seeds on MNIST-1D (or scikit-learn's digits), the shift of a
hidden layer's input over training, and a small vision transformer with each token norm;
then a report.

Modules, in the order data flows: ``data`` (MNIST-1D, generated; digits, bundled),
``model`` (the CNNs and ``make_norm``, the one place that picks a layer per method),
``shift`` (the covariate-shift recording), ``train`` (one run), ``runner`` (the grid,
resumable), ``vit`` (the transformer runs), ``analysis`` (means, standard deviations,
findings), ``claims`` (the articles' claims against the numbers), ``plots`` and ``report``
(report.md, report.html). Needs torch, matplotlib, scikit-learn, mnist1d and tqdm
(``pip install normkit[torch,study]``).
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
