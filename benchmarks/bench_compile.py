"""Compiled converted model against compiled torch.nn model (``docs/pytorch2.md``).

Small transformers models built from configs (SigLIP vision tower, ResNet), fp32 CPU,
``torch.compile`` with the default (inductor) backend: torch.nn layers, normkit layers
decomposed under the compiler (the default), and normkit layers kept as the opaque
``torch.ops.normkit.norm_forward`` operator (``normkit.ops.compile_decomposed(False)``).
Train step (forward + backward) and eval forward, rounds interleaved across the three;
prints the fastest and the median round in milliseconds per call as CSV.

    PYTHONPATH=src python benchmarks/bench_compile.py [--rounds 7] [--calls 10]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import ResNetConfig, ResNetModel, SiglipVisionConfig, SiglipVisionModel

import normkit
from normkit import ops


def models():
    sig = SiglipVisionModel(SiglipVisionConfig(hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=2,
                                               image_size=64, patch_size=8))
    res = ResNetModel(ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                   layer_type="basic"))
    return {"SigLIP (64 px, hidden 64, 2 layers)": sig, "ResNet (64 px, [16, 32])": res}


def variants(model, train):
    """(name, compiled callable); the normkit variants compile with their path fixed."""
    model.train(train)
    conv = normkit.convert(copy.deepcopy(model)).model
    out = []
    for name, m, decomposed in (("torch.nn", model, True),
                                ("normkit, decomposed", conv, True),
                                ("normkit, operator", copy.deepcopy(conv), False)):
        ops.compile_decomposed(decomposed)
        cm = torch.compile(m, fullgraph=True)
        x = torch.randn(8, 3, 64, 64)

        def step(cm=cm, x=x, decomposed=decomposed):
            ops.compile_decomposed(decomposed)  # dynamo guards on it: the entry of this path
            o = cm(x).last_hidden_state
            if train:
                o.mean().backward()

        with torch.set_grad_enabled(train):
            step()  # compile now, with this path
        out.append((name, step))
    ops.compile_decomposed(True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print("model,pass,variant,ms_min,ms_median")
    for mname, model in models().items():
        for train in (True, False):
            runs = variants(model, train)
            times = {name: [] for name, _ in runs}
            with torch.set_grad_enabled(train):
                for _ in range(args.rounds):
                    for name, step in runs:
                        t0 = time.perf_counter()
                        for _ in range(args.calls):
                            step()
                        times[name].append((time.perf_counter() - t0) / args.calls * 1e3)
            kind = "train step" if train else "eval forward"
            for name, ts in times.items():
                print(f"{mname},{kind},{name},{min(ts):.2f},{statistics.median(ts):.2f}")


if __name__ == "__main__":
    main()
