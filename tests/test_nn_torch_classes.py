"""normkit's layers are subclasses of their torch.nn twins, so code that finds norm layers by
``isinstance`` -- torch's own utilities, trainers choosing weight decay, a model's weight
init -- treats a converted model as the untouched one (docs/architecture.md, "torch's
classes"). Each test runs the utility on both and compares."""

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import normkit  # noqa: E402
import normkit.nn as nknn  # noqa: E402

TWINS = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "InstanceNorm1d", "InstanceNorm2d",
         "InstanceNorm3d", "LayerNorm", "GroupNorm", "RMSNorm"]


@pytest.mark.parametrize("name", TWINS)
def test_each_layer_is_an_instance_of_its_torch_twin(name):
    ours, theirs = getattr(nknn, name), getattr(nn, name)
    assert issubclass(ours, theirs)
    assert ours.__mro__.index(theirs) > ours.__mro__.index(nknn._kept.KeptPlan
                                                           if "Instance" not in name
                                                           else nknn._base.NormBase)
    # every method a normkit layer calls is its own, not the twin's
    for method in ("__init__", "forward", "extra_repr", "reset_parameters"):
        assert getattr(ours, method) is not getattr(theirs, method), method


def test_sync_batchnorm_and_batch_renorm_classes():
    """SyncBatchNorm is a torch ``_BatchNorm`` but not a ``torch.nn.SyncBatchNorm``, which
    DistributedDataParallel refuses on CPU (normkit's runs there); BatchRenorm computes
    other statistics, so torch's BatchNorm utilities must not take it for a BatchNorm."""
    assert isinstance(nknn.SyncBatchNorm(3), nn.modules.batchnorm._BatchNorm)
    assert not isinstance(nknn.SyncBatchNorm(3), nn.SyncBatchNorm)
    assert not isinstance(nknn.BatchRenorm2d(3), nn.modules.batchnorm._NormBase)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.BatchNorm2d(4, momentum=0.3), nn.Flatten(), nn.Linear(64, 2))


def test_swa_update_bn_on_a_converted_model():
    """``torch.optim.swa_utils.update_bn`` recomputes a converted model's running
    statistics as the untouched model's, on normkit's layers (before they subclassed
    torch's it returned at once and left them as they were)."""
    from torch.optim.swa_utils import AveragedModel, update_bn

    untouched = _cnn()
    model = copy.deepcopy(untouched)
    normkit.convert(model)
    swa, swa_untouched = AveragedModel(model), AveragedModel(untouched)
    loader = [torch.randn(8, 3, 6, 6) * 3 + 2 for _ in range(4)]
    update_bn(loader, swa)
    update_bn(loader, swa_untouched)
    assert type(swa.module[1]) is nknn.BatchNorm2d and swa.module[3].momentum == 0.3
    assert swa.module[1].running_mean.abs().min() > 0
    for got, want in zip(swa.buffers(), swa_untouched.buffers()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_torch_convert_sync_batchnorm_takes_normkit_batchnorms():
    """torch's converter makes its own SyncBatchNorm of every BatchNorm, normkit's too, around
    the same tensors (normkit's converter makes normkit's: tests/test_sync_batchnorm.py)."""
    model = _cnn()
    normkit.convert(model)
    tensors = model[1].weight, model[1].running_mean
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert type(synced[1]) is nn.SyncBatchNorm and type(synced[3]) is nn.SyncBatchNorm
    assert synced[1].weight is tensors[0] and synced[1].running_mean is tensors[1]
    assert synced[3].momentum == 0.3


def test_functorch_batch_norm_replacement_and_per_sample_gradients():
    """``torch.func.replace_all_batch_norm_modules_`` stops normkit's BatchNorms tracking
    running statistics, as torch's, so that per-sample gradients (``vmap(grad(...))``)
    run; they equal the untouched model's."""
    from torch.func import functional_call, grad, replace_all_batch_norm_modules_, vmap

    untouched = _cnn()
    model = copy.deepcopy(untouched)
    normkit.convert(model)
    for m in (untouched, model):
        replace_all_batch_norm_modules_(m)
    assert model[1].running_mean is None and not model[1].track_running_stats
    x = torch.randn(5, 3, 6, 6)
    y = torch.randint(0, 2, (5,))

    def per_sample(net):
        params = {n: p.detach() for n, p in net.named_parameters()}

        def loss(p, xi, yi):
            return nn.functional.cross_entropy(functional_call(net, p, (xi[None],)), yi[None])

        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)

    got, want = per_sample(model), per_sample(untouched)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_weight_init_and_decay_groups_by_isinstance():
    """A model's own init (``model.apply`` with ``isinstance(m, nn.LayerNorm)``) and a
    trainer's weight-decay groups (transformers' ``get_parameter_names`` leaves out the
    parameters of ``nn.LayerNorm`` instances) see the converted layers."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.ln, self.gn = nn.Linear(4, 4), nn.LayerNorm(4), nn.GroupNorm(2, 4)

    def init(m):
        if isinstance(m, (nn.LayerNorm, nn.GroupNorm)):
            nn.init.constant_(m.weight, 0.5)

    untouched = Net()
    model = copy.deepcopy(untouched)
    normkit.convert(model)
    assert type(model.ln) is nknn.LayerNorm
    model.apply(init)
    assert (model.ln.weight == 0.5).all() and (model.gn.weight == 0.5).all()
    trainer_utils = pytest.importorskip("transformers.trainer_pt_utils")
    want = trainer_utils.get_parameter_names(untouched, [nn.LayerNorm])
    assert "ln.weight" not in want
    assert trainer_utils.get_parameter_names(model, [nn.LayerNorm]) == want
