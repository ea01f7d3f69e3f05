"""Bytes a bf16 Llama training step keeps for backward, untouched vs ``normkit.convert``, and
both models' error against a float64 run: `python benchmarks/bench_llm_saved.py [--hidden
512 --layers 4 --kv-heads 2 --seq 256 --batch 4]` (issue #35's target: at most 0.85).

The three models share their weights (``normkit.bench.models.llm``, from a config: nothing
is downloaded): the untouched one and the converted one in bf16, and the untouched one in
float64 as the reference. Saved bytes are ``normkit.bench.models.saved_bytes`` (every
storage the graph saves, once, the parameters left out); the table below them lists what
the untouched step saves, grouped by dtype and shape, largest first, so that the share of
the norms can be read off. The error of each bf16 model against float64: the loss, and
the gradients of all parameters together (``|g - g64| / |g64|``, 2-norms) and of the
norms' weights alone.
"""

from __future__ import annotations

import argparse
import collections
import copy

import torch

import normkit
from normkit.bench.models import llm, saved_bytes


def _saved_by_kind(model, ids):
    """{(dtype, shape): [count, bytes]} of the storages a step saves (parameters left out)."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            seen.setdefault(s.data_ptr(), (str(t.dtype).split(".")[-1], tuple(t.shape),
                                           s.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    kinds = collections.defaultdict(lambda: [0, 0])
    for dtype, shape, nbytes in seen.values():
        kinds[dtype, shape][0] += 1
        kinds[dtype, shape][1] += nbytes
    return kinds


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def _error(grads, truth, names):
    num = sum(float((grads[n] - truth[n]).square().sum()) for n in names)
    den = sum(float(truth[n].square().sum()) for n in names)
    return (num / den) ** 0.5


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    base = llm("llama", args.hidden, args.layers, args.kv_heads)
    plain = copy.deepcopy(base).to(torch.bfloat16)
    converted = copy.deepcopy(plain)
    report = normkit.convert(converted)
    exact = copy.deepcopy(base).double()
    ids = torch.randint(0, 8192, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0))
    print(f"Llama, bf16, hidden {args.hidden}, {args.layers} layers, "
          f"{args.hidden // 64} heads, {args.kv_heads} KV heads, batch {args.batch} x "
          f"{args.seq} tokens; {len(report.swapped)} norms swapped")

    a, b = saved_bytes(plain, ids), saved_bytes(converted, ids)
    mib = 2 ** 20
    print(f"saved for backward: untouched {a / mib:.2f} MiB, converted {b / mib:.2f} MiB, "
          f"ratio {b / a:.4f}")
    print("what the untouched step saves (count x dtype shape: MiB), then the converted one's "
          "difference:")
    kinds_a, kinds_b = _saved_by_kind(plain, ids), _saved_by_kind(converted, ids)
    for key in sorted(set(kinds_a) | set(kinds_b),
                      key=lambda k: -max(kinds_a.get(k, [0, 0])[1], kinds_b.get(k, [0, 0])[1])):
        na, ba = kinds_a.get(key, [0, 0])
        nb, bb = kinds_b.get(key, [0, 0])
        print(f"  {na:3d} x {key[0]:8s} {str(key[1]):22s} {ba / mib:8.3f}"
              + (f"   converted: {nb:3d} x, {bb / mib:8.3f}" if (na, ba) != (nb, bb) else ""))

    loss64, grads64 = _step(exact, ids)
    names = list(grads64)
    norm_names = [n for n in names if "norm" in n]
    print(f"against float64 (loss {loss64:.6f}):")
    for key, model in (("untouched", plain), ("converted", converted)):
        loss, grads = _step(model, ids)
        print(f"  {key:9s} loss error {abs(loss - loss64):.2e}, gradient error "
              f"{_error(grads, grads64, names):.4e} (all parameters), "
              f"{_error(grads, grads64, norm_names):.4e} (the norms' weights)")


if __name__ == "__main__":
    main()
