r"""``python -m normkit.conversion.sweep``: convert every transformers base model it can build,
and count what breaks, what differs and what stays on torch.

For each model of ``sweep_models.base_models()`` (built from its default config made small,
``sweep_models.build``; with ``--zoo timm``, one small timm model per family,
``sweep_timm``), three copies: the untouched fp32 model, a float64 copy of it (the
reference), and an fp32 copy given to ``normkit.convert``. Two steps run on each, from the
same inputs and seed:

* **eval**: a forward in eval mode; the outputs compared are every floating tensor the
  model returns;
* **train**: a forward in training mode and a backward of :math:`\sum_t \langle t, w_t
  \rangle` over those outputs (fixed random :math:`w_t`); compared: the outputs and every
  parameter's gradient.

One more copy is converted, then reverted (``normkit.revert``): ``reverted`` is True where
its module classes, state_dict keys and eval outputs, bit for bit, are the untouched
model's, else what differs.

Verdicts, per step:

* **broken**: the step ran on the untouched model and raises on the converted one;
* **different**: with :math:`e(a) = \max_t \lVert a_t - r_t \rVert_2 / \lVert r_t
  \rVert_2` the error of a result against the float64 reference :math:`r` (the worst of
  the compared tensors :math:`t`: each output, each parameter's gradient), the converted
  model is materially worse than the untouched one,

  .. math:: e(\text{converted}) > 4\, e(\text{untouched}) + 10^{-6}

  where :math:`e(\text{untouched})` is the larger of two fp32 runs of the untouched
  model: as it is, and with every parameter moved one unit in the last place, up or down
  at random. Rounding in another order may double an fp32 error, a wrong formula is
  orders of magnitude off; and a training step through a model with large activations
  amplifies rounding by chance, so one fp32 sample is no scale (Gemma-like
  ``embedding_gemma2_text``: normkit's RMSNorms, as accurate as torch's op by op, came out
  4.3x "worse" than the plain fp32 run, and the jittered plain run 5x). A step
  whose reference fails or is not finite is *not judged*.

Per model it also counts the *norm modules* of the untouched model (leaf modules that are
torch norm layers or whose class name contains ``Norm``, not torch's weight-norm
parametrizations: ``convert``'s norm-like) and how many of them run on normkit after
``convert`` (swapped to a normkit layer, or routed), and names the classes left. A module
``convert`` finds to normalize nothing (each output element depends on its own input
element only: MobileBERT's ``NoNorm``, ``x * w + b``) is counted apart, not as a norm.

With ``--fuse`` the converted copy is made with ``convert(model, fuse_residual=True,
fuse_activation=True)`` and judged the same way; each record counts its fused residual adds
(``fused_adds``) and BatchNorm activations (``fused_activations``), and the summary their
totals. Its default output is ``convert-sweep-fused.jsonl`` (``convert-sweep-fused-timm.jsonl``
for timm).

Each model runs in a forked child process (one crash or hang costs one model; ``--timeout``
seconds each), ``--jobs`` at a time. Results are appended to a JSON-lines file as they
come (``--out``), so a run that is stopped resumes where it was (``--fresh`` starts over);
``--time-limit`` stops starting new models after that many seconds. The summary is
printed at the end, or alone with ``--summary``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import multiprocessing
import os
import sys
import time
import traceback
from collections import Counter

import torch
from torch import nn

__all__ = ["run_model", "summarize", "main", "different", "FAST"]

# the CI slice (tests/test_convert_sweep.py): a gated RMSNorm, fp32 LayerNorms without
# bias, per-head q/k norms, plain and offset RMSNorms, LayerNorm, BatchNorm, GroupNorm
FAST = ("mamba2", "cohere", "cohere2", "olmo", "llama", "gemma", "qwen3", "bert", "resnet",
        "convnext", "deberta", "imagegpt")
_FACTOR, _FLOOR = 4.0, 1e-6


def different(converted_err, untouched_err) -> bool:
    """The rule: the converted model's error against float64 is materially worse than the
    untouched fp32 model's (module docstring)."""
    return not converted_err <= _FACTOR * untouched_err + _FLOOR


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def _step(model, kwargs, mode):
    """(outputs, gradients by name) of one eval forward or one training step."""
    model.train(mode == "train")
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with torch.set_grad_enabled(mode == "train"):
        outputs = _tensors(model(**kwargs))
        if mode == "eval":
            return [t.detach() for t in outputs], {}
        gen = torch.Generator().manual_seed(1)
        loss = sum((t * torch.randn(t.shape, generator=gen).to(t.dtype)).sum() for t in outputs)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return [t.detach() for t in outputs], grads


def _error(got, ref):
    """max over the pairs of ||got - ref|| / ||ref|| (2-norms; inf on a shape mismatch or a
    non-finite result)."""
    if len(got) != len(ref) or any(g.shape != r.shape for g, r in zip(got, ref)):
        return float("inf")
    errs = [0.0]
    for g, r in zip(got, ref):
        scale = float(r.norm())
        if scale > 0:
            errs.append(float((g.double() - r).norm()) / scale)
    err = max(errs)
    return err if err == err else float("inf")


def _flat(result, names):
    outputs, grads = result
    return list(outputs) + [grads[n] for n in names if n in grads]


def _jittered(model):
    """A copy of ``model`` with every floating parameter moved one unit in the last place,
    up or down at random: another sample of what fp32 rounding does to it."""
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                up = torch.rand(p.shape, generator=gen) < 0.5
                p.copy_(torch.nextafter(p, torch.where(up, torch.inf, -torch.inf).to(p)))
    return model


def _norm_modules(model):
    """Leaf modules that are torch norm layers or named like one (convert's norm-like)."""
    from normkit.conversion import _norm_like
    return {n: m for n, m in model.named_modules() if not m._modules and _norm_like(m)}


def _on_normkit(module) -> bool:
    from normkit.conversion import _NORMKIT_BASES, route
    return isinstance(module, _NORMKIT_BASES) or route.is_routed(module)


def _as64(kwargs):
    return {k: v.double() if v.is_floating_point() else v for k, v in kwargs.items()}


class _NotTested(Exception):
    """The untouched model did not build (``args[0]`` "not built") or not run ("untouched
    fails"); ``args[1]``: the last error, as text."""


def _transformers_model(model_type, class_name, record):
    """The untouched model and its inputs: the first config level and inputs that build
    and run (``sweep_models``), noted in ``record``."""
    from normkit.conversion import sweep_models

    stage = "not built"
    for level, text_only in itertools.product(sweep_models.LEVELS, (False, True)):
        try:
            untouched = sweep_models.build(model_type, class_name, level=level)
            stage = "untouched fails"
            kwargs = sweep_models.inputs(untouched, text_only=text_only)
            _step(untouched, kwargs, "eval")
        except Exception as err:  # noqa: BLE001 -- any failure of the untouched: not tested
            error = f"{type(err).__name__}: {err}"[:300]
            continue
        record.update(level=level, text_only=text_only)
        return untouched, kwargs
    raise _NotTested(stage, error)


def _timm_model(name, _class_name, _record):
    """The untouched timm model and its input (``sweep_timm``)."""
    from normkit.conversion import sweep_timm

    stage = "not built"
    try:
        untouched = sweep_timm.build(name)
        stage = "untouched fails"
        kwargs = sweep_timm.inputs(untouched)
        _step(untouched, kwargs, "eval")
    except Exception as err:  # noqa: BLE001 -- any failure of the untouched: not tested
        raise _NotTested(stage, f"{type(err).__name__}: {err}"[:300]) from None
    return untouched, kwargs


def run_model(model_type, class_name, fuse=False):
    """The sweep's record of one model (a dict; see the module docstring); ``fuse``:
    converted with ``fuse_residual`` and ``fuse_activation``."""
    import normkit
    from normkit.conversion import NO_NORMALIZATION
    from normkit.conversion.classes import qualified

    record = {"model": model_type, "class": class_name}
    make = _timm_model if class_name == "timm" else _transformers_model
    try:
        untouched, kwargs = make(model_type, class_name, record)
    except _NotTested as err:
        return dict(record, status=err.args[0], error=err.args[1])
    converted, pristine = copy.deepcopy(untouched), copy.deepcopy(untouched)
    norms = _norm_modules(untouched)
    report = normkit.convert(converted, fuse_residual=fuse, fuse_activation=fuse)
    converted = report.model
    if fuse:
        record.update(fused_adds=len(report.fused),
                      fused_activations=len(report.activations_fused))
    reasons = {n: why for n, _, why in report.left}
    # named like a norm, but normalizing nothing (MobileBERT's NoNorm): counted apart
    no_norm = {n for n, why in reasons.items() if NO_NORMALIZATION in why and n in norms}
    left = {n: qualified(type(m)) for n, m in norms.items() if n not in no_norm and
            not _on_normkit(converted.get_submodule(n) if n else converted)}
    record.update(norms=len(norms) - len(no_norm), on_normkit=len(norms) - len(no_norm) -
                  len(left), no_normalization=sorted(no_norm),
                  left=[[n, c, reasons.get(n, "")] for n, c in sorted(left.items())],
                  steps={})
    reference = jitter = evaluated = None
    for mode in ("eval", "train"):
        try:
            want = _step(untouched, kwargs, mode)     # (eval again: converted runs after it)
        except Exception as err:  # noqa: BLE001
            record["steps"][mode] = {"untouched": f"{type(err).__name__}: {err}"[:300]}
            continue
        evaluated = want[0] if mode == "eval" else evaluated
        step = {}
        try:
            got = _step(converted, kwargs, mode)
        except Exception as err:  # noqa: BLE001
            step["broken"] = "".join(traceback.format_exception_only(err)).strip()[:500]
            record["steps"][mode] = step
            continue
        try:
            reference = reference or copy.deepcopy(untouched).double()
            ref = _step(reference, _as64(kwargs), mode)
        except Exception as err:  # noqa: BLE001
            step["not judged"] = f"float64 copy fails: {type(err).__name__}: {err}"[:300]
            record["steps"][mode] = step
            continue
        names = sorted(ref[1])
        r = _flat(ref, names)
        if not all(bool(t.isfinite().all()) for t in r):
            step["not judged"] = "float64 reference not finite"
        else:
            jitter = jitter or _jittered(untouched)
            e_untouched = max(_error(_flat(want, names), r),
                              _error(_flat(_step(jitter, kwargs, mode), names), r))
            e_converted = _error(_flat(got, names), r)
            step.update(untouched_err=e_untouched, converted_err=e_converted,
                        different=different(e_converted, e_untouched))
        record["steps"][mode] = step
    ran = [s for s in record["steps"].values() if "untouched" not in s]
    record["status"] = "tested" if ran else "untouched fails"
    if evaluated is not None:
        record["reverted"] = _reverted(pristine, untouched, kwargs, evaluated, fuse)
    return record


def _reverted(model, untouched, kwargs, evaluated, fuse):
    """``model`` (a copy of the untouched one) converted, then reverted: True where its
    module classes, state_dict keys and eval outputs (bit for bit) are the untouched
    model's; else what differs, or the error."""
    import normkit

    try:
        normkit.convert(model, fuse_residual=fuse, fuse_activation=fuse)
        normkit.revert(model)
        if [type(m) for m in model.modules()] != [type(m) for m in untouched.modules()]:
            return "module classes differ"
        if list(model.state_dict()) != list(untouched.state_dict()):
            return "state_dict keys differ"
        outputs = _step(model, kwargs, "eval")[0]
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"[:300]
    same = len(outputs) == len(evaluated) and all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(outputs, evaluated))
    return same or "eval outputs differ"


def _child(model_type, class_name, fuse, conn):
    torch.set_num_threads(1)
    try:
        conn.send(run_model(model_type, class_name, fuse))
    except Exception as err:  # noqa: BLE001
        conn.send({"model": model_type, "class": class_name, "status": "sweep error",
                   "error": f"{type(err).__name__}: {err}"[:300]})
    conn.close()


def _warm(todo):
    """Import every model class and run normkit's ops once in the parent, so that each
    forked child starts with both done (about 4 s each otherwise)."""
    import normkit.nn as nknn

    torch.set_num_threads(1)
    for _, class_name in todo:
        try:
            if class_name != "timm":
                import transformers

                getattr(transformers, class_name)
        except Exception:  # noqa: BLE001 -- the child reports it
            pass
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = torch.randn(4, 8, 6, dtype=dtype, requires_grad=True)
        layers = [nknn.LayerNorm(6), nknn.RMSNorm(6), nknn.GroupNorm(2, 8),
                  nknn.BatchNorm1d(8)]
        for layer in layers:
            layer.to(dtype)(x).sum().backward()


def _run_all(todo, out, jobs, timeout, time_limit, fuse=False):
    ctx = multiprocessing.get_context("fork")
    _warm(todo)
    start, running = time.monotonic(), []
    todo = list(todo)
    with open(out, "a") as f:
        while todo or running:
            while todo and len(running) < jobs and time.monotonic() - start < time_limit:
                model_type, class_name = todo.pop(0)
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child, args=(model_type, class_name, fuse, child))
                p.start()
                child.close()
                running.append((p, parent, model_type, class_name, time.monotonic()))
            if not running:
                break
            time.sleep(0.05)
            for item in list(running):
                p, conn, model_type, class_name, t0 = item
                record = None
                if conn.poll():
                    try:
                        record = conn.recv()
                    except EOFError:
                        record = {"status": "sweep error", "error": "child died"}
                elif not p.is_alive():
                    record = {"status": "sweep error", "error": f"exit code {p.exitcode}"}
                elif time.monotonic() - t0 > timeout:
                    p.kill()
                    record = {"status": "timed out", "error": f"over {timeout} s"}
                if record is None:
                    continue
                p.join()
                record.update(model=model_type, seconds=round(time.monotonic() - t0, 1))
                record.setdefault("class", class_name)
                f.write(json.dumps(record) + "\n")
                f.flush()
                running.remove(item)
                print(f"{record['model']}: {record['status']} ({record['seconds']} s)",
                      file=sys.stderr, flush=True)


def summarize(records) -> dict:
    """Totals over sweep records: models tested, broken, different, norm modules, share on
    normkit, classes left with counts."""
    tested = [r for r in records if r.get("status") == "tested"]
    broken = sorted(r["model"] for r in tested
                    if any("broken" in s for s in r["steps"].values()))
    diff = sorted(r["model"] for r in tested
                  if any(s.get("different") for s in r["steps"].values()))
    judged = sum(1 for r in tested for s in r["steps"].values() if "different" in s)
    norms = sum(r.get("norms", 0) for r in tested)
    on = sum(r.get("on_normkit", 0) for r in tested)
    left = Counter(c for r in tested for _, c, _ in r.get("left", []))
    no_norm = sum(len(r.get("no_normalization", [])) for r in tested)
    not_reverted = sorted(r["model"] for r in tested if r.get("reverted", True) is not True)
    fused = {key: sum(r.get(key, 0) for r in tested) for key in ("fused_adds",
                                                                   "fused_activations")}
    return dict(models=len(records), tested=len(tested), broken=broken, different=diff,
                steps_judged=judged, norm_modules=norms, on_normkit=on,
                no_normalization=no_norm, **fused,
                reverted=sum(1 for r in tested if r.get("reverted") is True),
                not_reverted=not_reverted,
                models_fused=sum(1 for r in tested if r.get("fused_adds") or
                                 r.get("fused_activations")),
                share=on / norms if norms else 1.0, left=dict(left.most_common()),
                not_tested=dict(Counter(r.get("status") for r in records
                                        if r.get("status") != "tested")))


def _print_summary(s, records):
    print(f"models: {s['models']} swept, {s['tested']} tested "
          f"(not tested: {', '.join(f'{k} {v}' for k, v in s['not_tested'].items()) or '-'})")
    print(f"broken: {len(s['broken'])} {' '.join(s['broken'])}")
    print(f"different: {len(s['different'])} {' '.join(s['different'])} "
          f"({s['steps_judged']} steps judged against float64)")
    print(f"norm modules: {s['norm_modules']}, on normkit {s['on_normkit']} "
          f"({100 * s['share']:.2f} %); named like a norm but normalizing nothing, counted "
          f"apart: {s['no_normalization']}")
    print(f"reverted: {s['reverted']} equal to the untouched model (classes, state_dict "
          f"keys, eval outputs bit for bit); not: {len(s['not_reverted'])} "
          f"{' '.join(s['not_reverted'])}")
    if any("fused_adds" in r for r in records):
        print(f"fused: {s['fused_adds']} residual adds, {s['fused_activations']} BatchNorm "
              f"activations, in {s['models_fused']} models")
    reasons = {c: why for r in records for _, c, why in r.get("left", [])}
    for cls, count in s["left"].items():
        print(f"  left {count:4d} {cls}: {reasons.get(cls, '')}")


def _read(out):
    records = {}
    if os.path.exists(out):
        with open(out) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    records[r["model"]] = r
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m normkit.conversion.sweep",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("models", nargs="*", help="model types (default: all base models)")
    parser.add_argument("--zoo", choices=("transformers", "timm"), default="transformers",
                        help="transformers' base models, or one small timm model per "
                             "family (sweep_timm)")
    parser.add_argument("--fast", action="store_true", help="only the CI slice: " +
                        " ".join(FAST))
    parser.add_argument("--out", default=None,
                        help="JSON-lines results, appended to and resumed from "
                             "(convert-sweep.jsonl; convert-sweep-timm.jsonl for timm)")
    parser.add_argument("--fresh", action="store_true", help="discard earlier results")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model")
    parser.add_argument("--time-limit", type=float, default=float("inf"),
                        help="start no model after this many seconds")
    parser.add_argument("--summary", action="store_true", help="only print the summary")
    parser.add_argument("--fuse", action="store_true",
                        help="convert with fuse_residual and fuse_activation "
                             "(convert-sweep-fused.jsonl)")
    args = parser.parse_args(argv)
    timm = args.zoo == "timm"
    args.out = args.out or ("convert-sweep" + ("-fused" if args.fuse else "") +
                            ("-timm" if timm else "") + ".jsonl")
    if timm:
        import timm as _  # noqa: F401 -- imported once, before the children fork

        from normkit.conversion import sweep_timm

        everything = sweep_timm.models()
    else:
        import transformers  # noqa: F401 -- imported once, before the children fork

        from normkit.conversion import sweep_models

        everything = sweep_models.base_models()
    wanted = set(args.models) | (set(FAST) if args.fast and not timm else set())
    if wanted:
        unknown = wanted - {t for t, _ in everything}
        if unknown:
            parser.error(f"unknown model(s) {sorted(unknown)}; " + (
                "the sweep takes one timm model per family (sweep_timm.pick)" if timm else
                "transformers' base models are the keys of MODEL_MAPPING_NAMES"))
        everything = [(t, n) for t, n in everything if t in wanted]
    if args.fresh and os.path.exists(args.out):
        os.remove(args.out)
    if not args.summary:
        done = _read(args.out)
        _run_all([m for m in everything if m[0] not in done], args.out, args.jobs,
                 args.timeout, args.time_limit, args.fuse)
    records = [r for t, r in _read(args.out).items() if t in {m for m, _ in everything}]
    _print_summary(summarize(records), records)


if __name__ == "__main__":
    main()
