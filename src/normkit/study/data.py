"""The study's data: scikit-learn's bundled handwritten digits, split once, kept in memory.

Why digits: it ships inside scikit-learn (no download), it is small enough that a grid of
a few hundred training runs fits in minutes on two cores, and it is an image task, so a
convolutional network with BatchNorm sees the same (N, C, H, W) statistics as in the
GroupNorm paper. It is an *easy* task (a small CNN reaches about 98 % test accuracy), so
differences between methods are a few percentage points, not tens; the small-batch
failure of BatchNorm is still plain to see because the network's last convolution works on
2 x 2 maps, where a batch of two images gives only eight numbers per channel statistic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Dataset", "load"]

# the split is part of the protocol, not of a run: every seed sees the same test set
SPLIT_SEED = 0
N_TEST = 597  # 1797 images -> 1200 for training, 597 for testing


@dataclass(frozen=True)
class Dataset:
    """Images as float32 arrays ``(n, 1, 8, 8)`` standardized with the training set's one
    mean and standard deviation, labels as int64 ``(n,)``."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    name: str = "sklearn-digits"

    @property
    def n_classes(self) -> int:
        return int(self.y_train.max()) + 1


def load(n_train: int | None = None, n_test: int | None = None) -> Dataset:
    """Load scikit-learn's digits (bundled, offline) and split them with a fixed seed.

    ``n_train`` / ``n_test`` keep only the first images of each split (``--quick``).
    The inputs are scaled as ``x' = (x - m) / s`` with one scalar ``m`` and ``s`` from the
    training images, so that the network without normalization layers starts from
    zero-mean, unit-variance inputs like the others.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = bunch.images.astype(np.float64)[:, None, :, :]  # N,1,8,8
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    test, train = order[:N_TEST], order[N_TEST:]
    if n_train is not None:
        train = train[:n_train]
    if n_test is not None:
        test = test[:n_test]
    m, s = x[train].mean(), x[train].std()
    scale = lambda a: ((a - m) / s).astype(np.float32)  # noqa: E731
    return Dataset(scale(x[train]), y[train], scale(x[test]), y[test])
