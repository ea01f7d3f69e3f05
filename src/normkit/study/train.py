"""One training run of the study: a method, a batch size, a seed -> a dict of numbers.

Protocol (the same for every run)
---------------------------------
* a fixed budget of ``epochs`` passes over the training set, so a batch of ``B`` images
  takes ``epochs * floor(n_train / B)`` steps: small batches take many more steps -- but
  never fewer than ``min_steps`` (more passes for the large batches, which would otherwise
  stop after a few hundred steps, under-trained; see :func:`run_steps`);
* SGD with momentum 0.9 and weight decay 5e-4; the learning rate follows the linear
  scaling rule of Goyal et al. (2017), as in the GroupNorm paper's batch-size study::

      lr(B) = base_lr * B / 32

  with a linear warm-up over the first quarter of the steps and a cosine decay to zero
  after it, per step;
* the training set is reshuffled every epoch from a generator seeded by the run's seed;
  the model's initial weights come from the same seed, so two methods with the same seed
  start from the same convolution and linear weights;
* the last incomplete batch of an epoch is dropped, so every step sees exactly ``B``
  images (BatchNorm's statistics always come from ``B`` images).

Measured at the end of the run
------------------------------
* ``test_error``: test error in eval mode, the normal way to use a trained network
  (BatchNorm uses its running averages);
* ``test_error_train_mode``: test error with the network in training mode, test images
  fed in batches of ``B`` (BatchNorm then uses each test batch's own statistics); the
  running averages are left untouched (the forward runs on a copy). For the methods that
  do not depend on the batch the two errors are equal;
* ``train_error``: error in eval mode on the first 5000 training signals, so that
  ``test_error - train_error`` is the run's generalization gap;
* ``batch_dependence``: the largest change of one image's logits, in training mode, when
  the other ``B - 1`` images of its batch are swapped for different ones. Zero (up to
  rounding) for the per-sample methods, large for BatchNorm;
* ``loss_curve``: the mean training loss over consecutive windows of steps;
* ``seconds`` and ``cpu_seconds``: the run's wall time and the CPU time of its process (the
  CPU time does not grow when other programs share the machine);
* ``shift`` (only when asked for): the 15th, 50th and 85th percentiles of each channel of
  the last block's pre-activation on a fixed probe of test inputs, over training (see
  :mod:`normkit.study.shift`).

Two calls with the same arguments give the same numbers: the weights and the shuffling come
from the seed, and the study computes with one thread per process (see ``runner``).
"""

from __future__ import annotations

import copy
import math
import time

import torch
import torch.nn.functional as F

from normkit.study.model import build_model
from normkit.study.shift import ShiftRecorder

__all__ = ["TrainConfig", "train_one", "train_model", "train_error", "fit", "evaluate", "learning_rate",
           "run_steps"]

REFERENCE_BATCH = 32  # the batch size at which lr == base_lr
CURVE_POINTS = 60     # windows in a run's training-loss curve (at most)
TRAIN_PROBE = 5000    # training signals on which the training error is measured


class TrainConfig(dict):
    """The protocol's knobs, a plain dict so it goes into results.json as it is."""

    def __init__(self, epochs=4, base_lr=0.05, momentum=0.9, weight_decay=5e-4, warmup_fraction=0.25,
                 eval_batch=256, min_steps=0):
        super().__init__(epochs=epochs, base_lr=base_lr, momentum=momentum, weight_decay=weight_decay,
                         warmup_fraction=warmup_fraction, eval_batch=eval_batch,
                         reference_batch=REFERENCE_BATCH, min_steps=min_steps)


def run_steps(n_train: int, batch_size: int, epochs: int, min_steps: int = 0) -> int:
    """Steps of a run: ``epochs`` passes of ``floor(n_train / batch_size)`` batches, or
    ``min_steps`` if that is more (the data are then passed over again, reshuffled, and
    the last pass stops part-way)."""
    return max(epochs * (n_train // batch_size), min_steps)


def learning_rate(base_lr: float, batch_size: int) -> float:
    """Peak learning rate for ``batch_size`` by the linear scaling rule:
    ``base_lr * batch_size / 32``."""
    return base_lr * batch_size / REFERENCE_BATCH


def _schedule(step: int, total: int, warmup: int) -> float:
    """Multiplier of the peak rate: linear warm-up, then cosine decay to zero."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * t))


@torch.no_grad()
def _error(model, x, y, batch) -> float:
    wrong = 0
    for i in range(0, len(y), batch):
        wrong += (model(x[i:i + batch]).argmax(1) != y[i:i + batch]).sum().item()
    return wrong / len(y)


@torch.no_grad()
def _train_mode_error(model, x, y, batch) -> float:
    """Error with batch statistics from test batches of ``batch`` images (on a copy, so
    the trained model's running averages stay as they are). A last batch smaller than
    ``batch`` is merged into the one before it rather than normalized on its own."""
    probe = copy.deepcopy(model).train()
    n = (len(y) // batch) * batch
    wrong = 0
    for i in range(0, n, batch):
        end = len(y) if i + batch >= n else i + batch
        wrong += (probe(x[i:end]).argmax(1) != y[i:end]).sum().item()
    return wrong / len(y)


@torch.no_grad()
def _batch_dependence(model, x, batch) -> float:
    """Largest change of image 0's logits (training mode) when its batch-mates change."""
    if batch < 2 or len(x) < 2 * batch:
        return 0.0
    probe = copy.deepcopy(model).train()
    first = probe(x[:batch])[0]
    other = probe(torch.cat([x[:1], x[batch:2 * batch - 1]]))[0]
    return float((first - other).abs().max())


def fit(model, opt, batches, x, y, total: int, peak_lr: float, warmup: int, after_step=None):
    """Train ``model`` on the index batches ``batches`` (``total`` of them) of ``x``, ``y``
    with cross-entropy, setting ``opt``'s rate to ``peak_lr * _schedule(...)`` before each
    step and calling ``after_step(step)`` after it. Stops at the first non-finite loss.
    Returns ``(steps done, diverged, curve steps, curve losses)``, the curve being the mean
    loss over windows of ``total / CURVE_POINTS`` steps."""
    window = max(1, math.ceil(total / CURVE_POINTS))
    curve_steps, curve_loss, acc, acc_n, step = [], [], 0.0, 0, 0
    model.train()
    for idx in batches:
        for group in opt.param_groups:
            group["lr"] = peak_lr * _schedule(step, total, warmup)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        if not torch.isfinite(loss):
            return step, True, curve_steps, curve_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if after_step is not None:
            after_step(step)
        acc += loss.item()
        acc_n += 1
        if acc_n == window or step == total:
            curve_steps.append(step)
            curve_loss.append(acc / acc_n)
            acc, acc_n = 0.0, 0
    return step, False, curve_steps, curve_loss


def evaluate(model, x_test, y_test, batch_size: int, eval_batch: int, diverged: bool, n_classes: int) -> dict:
    """Test error in eval and in training mode, and the batch dependence (module docstring);
    chance level and nan for a run that diverged."""
    model.eval()
    if diverged:
        chance = 1.0 - 1.0 / n_classes
        return {"test_error": chance, "test_error_train_mode": chance, "batch_dependence": float("nan")}
    return {"test_error": _error(model, x_test, y_test, eval_batch),
            "test_error_train_mode": _train_mode_error(model, x_test, y_test, batch_size),
            "batch_dependence": _batch_dependence(model, x_test, batch_size)}


def _batches(n, batch_size, total, gen):
    """``total`` index batches: passes over ``n`` samples, reshuffled each pass, the last
    incomplete batch of a pass dropped."""
    step = 0
    while step < total:
        order = torch.randperm(n, generator=gen)
        for b in range(min(n // batch_size, total - step)):
            yield order[b * batch_size:(b + 1) * batch_size]
        step += n // batch_size


def train_model(data, method: str, batch_size: int, seed: int, config: TrainConfig, after_step=None,
                net=None, steps: int | None = None):
    """Train ``net(total_steps)`` (default: the study's CNN with ``method``) on ``data`` with
    the protocol of the module docstring, for ``steps`` steps if given (else the budget of
    ``config``); return ``(model, info)``, info holding the run's ``lr``, ``steps``,
    ``diverged`` and loss curve. ``after_step(model, total)`` returns a per-step callback
    (the covariate-shift recorder)."""
    x_train, y_train = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    n = len(y_train)
    if batch_size > n:
        raise ValueError(f"batch size {batch_size} is larger than the {n} training images; "
                         f"pass smaller --batch-sizes")
    total = steps or run_steps(n, batch_size, config["epochs"], config.get("min_steps", 0))
    torch.manual_seed(seed)
    model = net(total) if net is not None else build_model(method, data.spatial, data.n_classes, total)
    warmup = min(total, max(1, round(config["warmup_fraction"] * total)))
    peak_lr = learning_rate(config["base_lr"], batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=config["momentum"],
                          weight_decay=config["weight_decay"])
    gen = torch.Generator().manual_seed(seed)
    callback = after_step(model, total) if after_step is not None else None
    step, diverged, curve_steps, curve_loss = fit(
        model, opt, _batches(n, batch_size, total, gen), x_train, y_train, total, peak_lr, warmup, callback)
    return model, {"lr": peak_lr, "steps": step, "diverged": diverged,
                   "final_train_loss": curve_loss[-1] if curve_loss else float("nan"),
                   "loss_curve": {"step": curve_steps, "loss": [round(v, 5) for v in curve_loss]}}


def train_one(data, method: str, batch_size: int, seed: int, config: TrainConfig,
              record_shift: bool = False) -> dict:
    """Train the study's CNN with ``method`` on ``data`` with ``batch_size`` and ``seed``;
    return its numbers (see the module docstring). ``record_shift`` also follows the last
    block's pre-activation over training (:class:`~normkit.study.shift.ShiftRecorder`)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    x_test, y_test = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    recorders = []

    def record(model, total):
        recorders.append(ShiftRecorder(model, x_test, total))
        return recorders[0].after_step

    model, info = train_model(data, method, batch_size, seed, config, record if record_shift else None)
    out = {"method": method, "batch_size": batch_size, "seed": seed, "lr": info["lr"], "steps": info["steps"],
           "diverged": info["diverged"],
           **evaluate(model, x_test, y_test, batch_size, config["eval_batch"], info["diverged"], data.n_classes),
           "train_error": train_error(model, data, config["eval_batch"], info["diverged"]),
           "final_train_loss": info["final_train_loss"], "loss_curve": info["loss_curve"],
           "seconds": time.perf_counter() - start,
           "cpu_seconds": time.process_time() - cpu_start}
    if recorders:
        out["shift"] = recorders[0].result()
    return out


def train_error(model, data, eval_batch: int, diverged: bool) -> float:
    """Error in eval mode on the first :data:`TRAIN_PROBE` training signals (for the gap
    between training and test error); chance level for a run that diverged."""
    if diverged:
        return 1.0 - 1.0 / data.n_classes
    model.eval()
    x, y = torch.from_numpy(data.x_train[:TRAIN_PROBE]), torch.from_numpy(data.y_train[:TRAIN_PROBE])
    return _error(model, x, y, eval_batch)
