"""``benchmarks/gpu_check.sh``, the GPU check of at most 8 minutes: its dry run (the
Python stages on the CPU with tiny shapes and Triton's interpreter) writes the files the
device run writes, with every part present; its stage timeouts add up to at most 450 s."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import needs_triton_interpreter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
SWITCHES = ("STAGES", "X0_MEAN", "LANES", "SMALL_ROW", "OCCUPANCY")


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install 'normkit[gpu]')")


@needs_triton_interpreter
def test_dry_run_writes_every_part(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", SCRIPT, str(tmp_path / "out"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["bench.json", "correct.json", "summary.txt"]
    correct = json.loads((out / "correct.json").read_text())
    assert correct["dry_run"] and correct["stage"] == "correct"
    labels = " ".join(correct["cases"])
    for name in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "batch_norm ",
                 "batch_norm_eval", "group_norm", "instance_norm"):
        assert name in labels
    assert all(r["ok"] for r in correct["cases"].values()), correct["cases"]
    assert correct["big"]["ok"] and correct["graphs"]["skipped"]
    assert {"normkit", "torch"} <= set(correct["autocast"]["layer_norm float16"])
    bench = json.loads((out / "bench.json").read_text())
    assert bench["rows"] and all("ms" in r["normkit"] and "ms" in r["torch"]
                                 for r in bench["rows"])
    assert {key.split()[0] for key in bench["ab"]} == set(SWITCHES)
    assert all(r.get("max_diff") == 0.0 or r["max_diff"] < 1e-2 for r in bench["ab"].values())
    summary = (out / "summary.txt").read_text()
    assert "correct rc=0" in summary and "bench rc=0" in summary


def test_stages_fit_eight_minutes():
    """Every timeout of the script is one of its stage budgets, and the stages after the
    setup (the CUDA tests run beside the correctness stage, under the same budget) add
    up to at most 450 s."""
    text = open(SCRIPT).read()
    budgets = {k: int(v) for k, v in re.findall(r"\b(T_[A-Z]+)=(\d+)", text)}
    assert set(budgets) == {"T_SETUP", "T_CORRECT", "T_BENCH", "T_LAUNCH", "T_MODELS"}
    assert set(re.findall(r'\btimeout "\$(T_[A-Z]+)"', text)) == set(budgets)
    assert not re.findall(r"(?<![-\w])timeout \d", text)
    assert sum(budgets.values()) - budgets["T_SETUP"] <= 450
    assert "PYTHONUNBUFFERED=1" in text


@needs_triton
def test_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """The compile stage: the kernels of one case compiled by Triton for sm_90a here (the
    interpreter does not compile), with registers and local memory read back."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"),
                           "compile", str(tmp_path), "--only", "rms_norm 65536x128"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    regs = json.loads((tmp_path / "compile.json").read_text())["registers"]
    assert {r["kernel"] for r in regs} >= {"_rows_fwd_kernel", "_rows_bwd_kernel"}
    assert all(0 < r["n_regs"] <= 255 and r["local_bytes"] == 0 for r in regs)
