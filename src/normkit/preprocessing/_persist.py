"""Scaler files: readable JSON with a format version and the feature names.

Layout (format version 1)::

    {
      "format": "normkit-scaler",
      "format_version": 1,
      "estimator": "StandardScaler",
      "normkit_version": "0.1.0",
      "params": {"copy": true, "with_mean": true, "with_std": true},
      "n_features_in": 3,
      "feature_names_in": ["a", "b", "c"],        (null when the input had none)
      "state": {...}                              (per estimator, see ``_get_state``)
    }

Floats are written with ``repr`` precision, so a saved scaler reloads bit for bit; NaN is
written as ``null``. A StandardScaler stores its moments (count, shift, shift-relative mean,
m2), so ``partial_fit`` can continue after loading. The readable attributes stored beside
the statistics (``mean_``, ``scale_``, ...) are recomputed on load and must agree: a file
edited by hand into an inconsistent state is refused rather than silently trusted.
"""

from __future__ import annotations

import json
import os

import numpy as np

from normkit._atomic import write_text_atomic

FORMAT = "normkit-scaler"
FORMAT_VERSION = 1


class ScalerFileError(ValueError):
    """A scaler file that cannot be read: corrupt, of another version, or of another kind."""


def _encode(value):
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (np.ndarray, np.generic)):
        value = np.asarray(value).tolist()
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None  # NaN; infinities never reach a fitted scaler
    if isinstance(value, (np.bool_,)):
        return bool(value)
    return value


def save(est, path):
    from normkit import __version__

    names = getattr(est, "feature_names_in_", None)
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "estimator": type(est).__name__,
        "normkit_version": __version__,
        "params": _encode(est.get_params()),
        "n_features_in": int(est.n_features_in_),
        "feature_names_in": None if names is None else [str(n) for n in names],
        "state": _encode(est._get_state()),
    }
    write_text_atomic(path, json.dumps(doc, indent=2, allow_nan=False) + "\n")


def load(path, classes, expected=None):
    """Read a scaler file; ``classes`` maps the estimator names a file may hold to their
    classes; ``expected`` (a class) must match the stored estimator if given."""
    path = os.fspath(path)

    def fail(what, fix="refit the scaler and save it again"):
        raise ScalerFileError(f"{path}: {what}; {fix}.")

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as exc:
        fail(f"is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); the file is "
             "corrupt or truncated")
    except UnicodeDecodeError:
        fail("is not a text file, so not a normkit scaler file")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        fail(f"is not a normkit scaler file (format {got!r}, expected {FORMAT!r})",
             "pass a file written by scaler.save() or `normkit scale fit`")
    version = doc.get("format_version")
    if not isinstance(version, int) or version < 1:
        fail(f"has an invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        fail(f"has format_version {version}, newer than this normkit reads ({FORMAT_VERSION})",
             "upgrade normkit")
    name = doc.get("estimator")
    if not isinstance(name, str) or name not in classes:
        fail(f"holds an unknown estimator {name!r} (known: {sorted(classes)})")
    cls = classes[name]
    if expected is not None and cls is not expected:
        fail(f"holds a {name}, not a {expected.__name__}",
             f"use {name}.load(path) or normkit.preprocessing.load_scaler(path)")
    try:
        params = doc["params"]
        if not isinstance(params, dict):
            fail(f"has params that are not a mapping: {params!r}")
        missing = sorted(set(cls().get_params()) - set(params))
        if missing:       # (a default in their place could scale otherwise than fitted)
            fail(f"lacks the params {missing}")
        est = cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()})
        est._check_params()
        n = doc["n_features_in"]
        names = doc["feature_names_in"]
        state = doc["state"]
    except KeyError as exc:
        fail(f"lacks the entry {exc.args[0]!r}")
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ScalerFileError):
            raise
        fail(f"has invalid params ({exc})")
    if not isinstance(n, int) or n < 1:
        fail(f"has an invalid n_features_in {n!r}")
    if names is not None:
        if not (isinstance(names, list) and all(isinstance(s, str) for s in names)):
            fail("has feature_names_in that are not a list of strings")
        if len(names) != n:
            fail(f"lists {len(names)} feature names for n_features_in={n}")

    def check(key, values):
        try:
            arr = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
        except (TypeError, ValueError):
            fail(f"has non-numeric values in state.{key}")
        if arr.shape != (n,):
            fail(f"has {arr.size} values in state.{key} for n_features_in={n}")
        return arr

    try:
        derived = est._set_state(state, check)
        for key, value in derived.items():
            if value is None:
                continue
            stored = check(key, state[key])
            close = np.isclose(stored, value, rtol=1e-12, atol=0.0, equal_nan=True)
            if not close.all():
                fail(f"state.{key} disagrees with the stored statistics at features "
                     f"{np.flatnonzero(~close).tolist()}; the file was edited or damaged")
    except KeyError as exc:
        fail(f"lacks the entry state.{exc.args[0]}")
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ScalerFileError):
            raise
        fail(f"has invalid state ({exc})")
    est.n_features_in_ = n
    if names is not None:
        est.feature_names_in_ = np.asarray(names, dtype=object)
    return est
