"""One language-model norm, converted against untouched: transformers' LlamaRMSNorm and
GemmaRMSNorm (their casting rules: ``normkit.rms_casting``) at (4, 256, 512), fp32 and
bf16, one thread; forward + backward (the input's and the weight's gradients) and forward
without grad, per call, ``thread_time``, best of 40 rounds of 10 calls, the two sides taking
turns; the ratio converted / untouched (docs/performance.md, "Saved for backward").

    python benchmarks/bench_llm_norms.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import copy

import torch

import normkit
from normkit.bench.models import per_call_us


def _us(fn):
    return per_call_us(fn, 10, 40)                     # thread_time, best of 40 rounds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="measurements of each case")
    opts = ap.parse_args(argv)
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.set_num_threads(1)
    print("norm,dtype,fwd+bwd converted/untouched,fwd converted/untouched (us)")
    for cls in (LlamaRMSNorm, GemmaRMSNorm):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            untouched = torch.nn.Sequential(cls(512)).to(dtype)
            with torch.no_grad():
                untouched[0].weight.normal_()
            converted = copy.deepcopy(untouched)
            normkit.convert(converted)
            x = torch.randn(4, 256, 512, dtype=dtype, requires_grad=True)
            gy = torch.randn(4, 256, 512, dtype=dtype)

            def step(model):
                model.zero_grad(set_to_none=True)
                x.grad = None
                model(x).backward(gy)

            for _ in range(opts.rounds):
                both = _us(lambda: step(converted)), _us(lambda: step(untouched))
                with torch.no_grad():
                    fwd = _us(lambda: converted(x)), _us(lambda: untouched(x))
                print(f"{cls.__name__},{str(dtype)[6:]},{both[0] / both[1]:.2f} ({both[0]:.0f}/"
                      f"{both[1]:.0f}),{fwd[0] / fwd[1]:.2f} ({fwd[0]:.0f}/{fwd[1]:.0f})",
                      flush=True)


if __name__ == "__main__":
    main()
