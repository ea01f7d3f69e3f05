"""A converted model saved whole (``torch.save(model)``, pickle) loads in a fresh process,
which has made none of the classes ``convert`` made (``normkit.conversion.classes``): each
kind of made class, its outputs bit for bit, and ``revert`` after loading."""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# a module of the model's own classes, importable by both processes: one per kind of class
# that convert makes
MODELS = '''
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNormGated


class PlainGroupNorm(nn.GroupNorm):          # swapped, in a class made for it
    hint = 3


class ChannelsFirstLayerNorm(nn.LayerNorm):  # routed: forward is normkit's layer_norm
    def forward(self, x):
        y = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight,
                         self.bias, self.eps)
        return y.permute(0, 3, 1, 2)


class GroupNormSiLU(nn.GroupNorm):           # routed: its F.group_norm runs on normkit
    def forward(self, x):
        return F.silu(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class PostNorm(nn.Module):                   # fused: the add before its norm
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(6, 6), LlamaRMSNorm(6)   # swapped: an LLM's RMSNorm

    def forward(self, x):
        y = self.fc(x)
        return self.norm(x + y)


class ConvBNReLU(nn.Module):                 # fused: the ReLU into the BatchNorm
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(6, 6, 1), nn.BatchNorm2d(6), nn.ReLU()

    def forward(self, x):
        y = self.bn(self.conv(x))
        y = self.relu(y)
        return y


def build():
    torch.manual_seed(0)
    return nn.ModuleDict(dict(
        gn=PlainGroupNorm(2, 6), ln=ChannelsFirstLayerNorm(6), gn_silu=GroupNormSiLU(3, 6),
        post=PostNorm(), cbr=ConvBNReLU(),
        gated=Mamba2RMSNormGated(6, group_size=6)))   # routed to a recipe


def outputs(model):
    gen = torch.Generator().manual_seed(1)
    image = torch.randn(2, 6, 4, 5, generator=gen)
    rows, gate = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    return [model[k](image) for k in ("gn", "ln", "gn_silu", "cbr")] + [
        model.post(rows), model.gated(rows, gate)]
'''

SAVE = '''
import torch, normkit, models
model = models.build()
report = normkit.convert(model, fuse_residual=True, fuse_activation=True)
assert (len(report.swapped), len(report.routed), len(report.left)) == (3, 3, 0), str(report)
assert len(report.fused) == 1 and len(report.activations_fused) == 1, str(report)
made = {k: type(m).__module__ for k, m in model.named_modules()}
assert list(made.values()).count("normkit.conversion.classes") == 7, made
torch.save((model, models.outputs(model)), "saved.pt")
'''

LOAD = '''
import torch, normkit, models
import normkit.conversion.classes as made
assert not [n for n in vars(made) if "__models__" in n]           # none made yet
model, want = torch.load("saved.pt", weights_only=False)
assert len([n for n in vars(made) if "__models__" in n]) == 5     # (and two of transformers')
got = models.outputs(model)
for a, b in zip(got, want):
    assert torch.equal(a, b)
names = {k: (type(m).__module__, type(m).__name__) for k, m in model.named_modules()}
assert names["gn"] == ("normkit.conversion.classes", "PlainGroupNorm") and \\
    model.gn.hint == 3, names
normkit.revert(model)
fresh = models.build()
assert [type(m) for m in model.modules()] == [type(m) for m in fresh.modules()]
print("ok")
'''


def _run(code, folder):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(folder)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_saved_converted_model_loads_in_a_fresh_process(tmp_path):
    (tmp_path / "models.py").write_text(MODELS)
    _run(SAVE, tmp_path)
    assert _run(LOAD, tmp_path).strip().endswith("ok")
