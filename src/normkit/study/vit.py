"""``normkit study --model vit``: the first source article's claim that a vision transformer
(SigLIP) normalizes with LayerNorm, per token, where BatchNorm is not used.

A small SigLIP-style vision transformer on MNIST-1D (shapes per sample)::

    signal 1 x 40 -> patch embedding (Conv1d k4 stride 4)   10 tokens x 32
                  + learned position embedding
    2 x pre-norm block:  x + Attention(norm(x)),  x + MLP(norm(x))   (4 heads, MLP 32-128-32, GELU)
    final norm ("post_layernorm" in SigLIP), mean over tokens, linear 32 -> 10

SigLIP pools with an attention head; the mean over tokens is the simpler choice here and
does not touch the normalization. The norm (all five in a network the same kind) is one of

* ``layer``: ``LayerNorm(32)`` over each token's features -- what SigLIP uses;
* ``rms``: ``RMSNorm(32)`` per token (no centering; LLaMA-style transformers);
* ``none``: identity;
* ``batch``: ``BatchNorm1d(32)`` over tokens -- one mean and variance per feature over every
  token of every sample in the batch, so a token's output depends on its batch-mates.

Each is trained with AdamW at a few peak learning rates (warm-up, cosine decay) for the
same number of steps at one batch size and one seed per rate; a run that reaches a
non-finite loss is marked diverged. Per run: the training-loss curve, the first step at
which it reaches :data:`TARGET_LOSS`, test error in eval mode and in training mode, and the
batch dependence of a sample's logits (as in :mod:`normkit.study.train`).
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import normkit.nn as nk
from normkit.study import data as data_module
from normkit.study.pool import DATA, check_jobs, check_listed, execute, one_thread, save_json
from normkit.study.train import evaluate, fit

__all__ = ["NORMS", "TARGET_LOSS", "VIT_DEFAULTS", "VIT_QUICK", "VIT_FILE", "TinyViT", "make_token_norm",
           "train_vit", "run_vit"]

NORMS = ("layer", "rms", "none", "batch")
TARGET_LOSS = 0.5
VIT_FILE = "vit-results.json"
VIT_DEFAULTS = dict(lrs=(1e-3, 4e-3, 1.6e-2), seeds=(0,), steps=1500, batch_size=32, n_train=12000, n_test=5000)
VIT_QUICK = dict(lrs=(1e-3, 1.6e-2), seeds=(0,), steps=15, batch_size=16, n_train=200, n_test=100)
WEIGHT_DECAY = 0.05
WARMUP_FRACTION = 0.1


class TokenBatchNorm(nn.Module):
    """``BatchNorm1d(dim)`` applied to tokens ``(N, T, D)``: statistics per feature over the
    N x T tokens of the batch."""

    def __init__(self, dim: int):
        super().__init__()
        self.bn = nk.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.transpose(1, 2)).transpose(1, 2)  # N,T,D


def make_token_norm(method: str, dim: int) -> nn.Module:
    """The norm over a token's ``dim`` features for ``method`` (one of :data:`NORMS`)."""
    if method == "layer":
        return nk.LayerNorm(dim)
    if method == "rms":
        return nk.RMSNorm(dim)
    if method == "none":
        return nn.Identity()
    if method == "batch":
        return TokenBatchNorm(dim)
    raise ValueError(f"unknown transformer norm {method!r}; choose from {', '.join(NORMS)}")


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, method: str, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = make_token_norm(method, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = make_token_norm(method, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)         # N,H,T,D/H
        x = x + self.proj(a.transpose(1, 2).reshape(n, t, d))  # N,T,D
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """The SigLIP-style transformer of the module docstring, with ``method`` as every norm."""

    def __init__(self, method: str, length: int = 40, patch: int = 4, dim: int = 32, depth: int = 2,
                 heads: int = 4, n_classes: int = 10):
        super().__init__()
        self.method = method
        self.embed = nn.Conv1d(1, dim, patch, stride=patch)
        self.pos = nn.Parameter(0.02 * torch.randn(length // patch, dim))
        self.blocks = nn.ModuleList(Block(method, dim, heads) for _ in range(depth))
        self.post_norm = make_token_norm(method, dim)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).transpose(1, 2) + self.pos  # N,T,D
        for block in self.blocks:
            h = block(h)
        return self.head(self.post_norm(h).mean(dim=1))  # N,10


def train_vit(data, method: str, lr: float, seed: int, steps: int, batch_size: int) -> dict:
    """Train ``TinyViT(method)`` for ``steps`` steps of ``batch_size`` at peak rate ``lr``."""
    start, cpu_start = time.perf_counter(), time.process_time()
    x_train, y_train = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    x_test, y_test = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    torch.manual_seed(seed)
    model = TinyViT(method, length=data.spatial[0], n_classes=data.n_classes)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    gen = torch.Generator().manual_seed(seed)
    warmup = max(1, round(WARMUP_FRACTION * steps))
    step, diverged, curve_steps, curve_loss = fit(
        model, opt, _stream(len(y_train), batch_size, steps, gen), x_train, y_train, steps, lr, warmup)
    curve_loss = [round(v, 5) for v in curve_loss]
    return {"method": method, "lr": lr, "seed": seed, "batch_size": batch_size, "steps": step,
            "diverged": diverged, **evaluate(model, x_test, y_test, batch_size, 256, diverged, data.n_classes),
            "final_train_loss": curve_loss[-1] if curve_loss else float("nan"),
            "loss_curve": {"step": curve_steps, "loss": curve_loss}, "seconds": time.perf_counter() - start,
            "cpu_seconds": time.process_time() - cpu_start}


def _stream(n, batch_size, steps, gen):
    """``steps`` index batches of ``batch_size`` from ``n`` samples, reshuffled whenever the
    rest of a pass is too short for a batch."""
    order, pos = torch.randperm(n, generator=gen), 0
    for _ in range(steps):
        if pos + batch_size > n:
            order, pos = torch.randperm(n, generator=gen), 0
        yield order[pos:pos + batch_size]
        pos += batch_size


def _run(task):
    method, lr, seed, cfg = task
    one_thread()
    return train_vit(DATA["data"], method, lr, seed, cfg["steps"], cfg["batch_size"])


def run_vit(out_dir, quick=False, jobs=None, methods=None) -> dict:
    """Train every norm at every learning rate (``VIT_QUICK`` with ``quick``) and write
    ``out_dir/vit-results.json``; return its contents. Not resumable: a few minutes at most."""
    cfg = dict(VIT_QUICK if quick else VIT_DEFAULTS)
    methods = check_listed("--methods", NORMS if methods is None else methods)
    unknown = [m for m in methods if m not in NORMS]
    if unknown:
        raise ValueError(f"unknown transformer norm(s) {', '.join(unknown)} for --model vit; choose from "
                         f"{', '.join(NORMS)}")
    jobs = check_jobs(jobs, quick)
    data = data_module.load("mnist1d", cfg["n_train"], cfg["n_test"])
    cfg.update(lrs=list(cfg["lrs"]), seeds=list(cfg["seeds"]), methods=list(methods), quick=bool(quick),
               weight_decay=WEIGHT_DECAY, warmup_fraction=WARMUP_FRACTION, target_loss=TARGET_LOSS,
               layer_source=nk.__name__, dataset="mnist1d")
    tasks = [(m, lr, s, cfg) for s in cfg["seeds"] for lr in cfg["lrs"] for m in methods]
    runs = []
    start = time.perf_counter()
    execute(_run, tasks, data, jobs, runs.append)
    key = {(m, lr, s): i for i, (m, lr, s, _) in enumerate(tasks)}
    runs.sort(key=lambda r: key[(r["method"], r["lr"], r["seed"])])
    results = {"normkit_study_vit": 1, "protocol": cfg, "runs": runs,
               "elapsed_seconds": time.perf_counter() - start}
    os.makedirs(out_dir, exist_ok=True)
    save_json(os.path.join(out_dir, VIT_FILE), results)
    return results
