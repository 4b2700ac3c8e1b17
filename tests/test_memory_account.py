"""The device-memory account: exact byte counts on virtual devices, and the device-0 imbalance."""
import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mgpu_lab import DataParallel, DataParallelCriterion, DataParallelModel, devices
from mgpu_lab.measure.memory_account import account_memory, plot_memory
from mgpu_lab.measure import memory_account as acct_mod
from conftest import ModelOutput, requires_gpus, virtual_devices

B, D, V = 10, 8, 2048  # batch, features, classes; fp32
F32 = 4


def setup(n=2):
    torch.manual_seed(0)
    model = nn.Linear(D, V)
    x, y = torch.randn(B, D), torch.randint(0, V, (B,))
    return model, x, y, virtual_devices(n)


def dp_step(model, x, y, devs):
    return lambda: F.cross_entropy(DataParallel(model, devs)(x), y).backward()


def balanced_step(model, x, y, devs):
    return lambda: DataParallelCriterion(nn.CrossEntropyLoss(), devs)(DataParallelModel(model, devs)(x), y).backward()


def test_dataparallel_counts_are_exact():
    model, x, y, devs = setup(2)
    acc = account_memory(dp_step(model, x, y, devs), devs)
    params = sum(p.numel() for p in model.parameters()) * F32
    chunk = [5, 5]
    assert acc.method == "accounted on virtual devices"
    for i in range(2):
        b = acc.breakdown[i]
        assert b["inputs"] == chunk[i] * D * F32
        assert b["weights"] == params
        assert b["outputs"] == chunk[i] * V * F32
    # device 0: the gathered logits, log_softmax saved by the loss, the gradient of the gathered logits
    assert acc.breakdown[0]["gathered"] == B * V * F32 and acc.breakdown[1]["gathered"] == 0
    small = 1024  # the loss also saves the targets and a scalar: a few bytes
    assert B * V * F32 <= acc.breakdown[0]["activations"] < B * V * F32 + small
    assert acc.breakdown[1]["activations"] < small  # the Linear saves its input and weight: counted already
    # gradients: output chunk + replica params on each; device 0 adds the gathered gradient and the summed params
    assert chunk[1] * V * F32 + params <= acc.breakdown[1]["gradients"] < chunk[1] * V * F32 + params + small
    grad0 = B * V * F32 + chunk[0] * V * F32 + 2 * params
    assert grad0 <= acc.breakdown[0]["gradients"] < grad0 + small
    assert acc.bytes == [sum(b.values()) for b in acc.breakdown]
    assert acc.imbalance() > 1.5


def test_balanced_criterion_removes_the_device0_imbalance():
    model, x, y, devs = setup(2)
    dp = account_memory(dp_step(model, x, y, devs), devs)
    bal = account_memory(balanced_step(model, x, y, devs), devs)
    assert bal.breakdown[0]["gathered"] == 0
    small = 1024
    assert 5 * V * F32 <= bal.breakdown[1]["activations"] < 5 * V * F32 + small  # log_softmax of its chunk
    assert bal.bytes[0] < dp.bytes[0]
    # device 0 only keeps the summed parameter gradient on top of the others' share
    params = sum(p.numel() for p in model.parameters()) * F32
    assert params <= bal.bytes[0] - bal.bytes[1] < params + small  # + the scalar losses it receives
    assert bal.imbalance() < dp.imbalance()


def test_structured_outputs_are_charged():
    """Outputs in any container torch.utils._pytree knows (here a registered dataclass) are counted."""
    model, x, _, devs = setup(2)

    class Structured(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, h):
            return ModelOutput(self.inner(h), note="logits")

    acc = account_memory(lambda: DataParallelModel(Structured(), devs)(x), devs)
    assert [b["outputs"] for b in acc.breakdown] == [5 * V * F32, 5 * V * F32]


def test_account_closes_and_removes_its_hooks():
    model, x, y, devs = setup(3)
    account_memory(dp_step(model, x, y, devs), devs)
    assert not acct_mod.active()
    assert not model.weight._backward_hooks
    with pytest.raises(RuntimeError, match="do not nest"):
        account_memory(lambda: account_memory(lambda: None, devs), devs)
    assert not acct_mod.active()


def test_table_and_plot():
    model, x, y, devs = setup(2)
    accs = {"DataParallel": account_memory(dp_step(model, x, y, devs), devs),
            "balanced": account_memory(balanced_step(model, x, y, devs), devs)}
    table = accs["DataParallel"].table()
    assert "cpu (virtual device 1)" in table and "gathered" in table
    ax = plot_memory(accs)
    heights = [p.get_height() for p in ax.patches]
    expected = [b / 2**20 for a in accs.values() for b in a.bytes]
    assert heights == pytest.approx(expected)


@requires_gpus(2)
def test_measured_on_gpus_shows_the_imbalance():
    devs = devices(2)
    torch.manual_seed(0)
    model = nn.Linear(64, 32000).to(devs[0])
    x, y = torch.randn(64, 64, device=devs[0]), torch.randint(0, 32000, (64,), device=devs[0])
    dp = account_memory(dp_step(model, x, y, devs), devs)
    bal = account_memory(balanced_step(model, x, y, devs), devs)
    assert dp.method.startswith("measured")
    assert dp.bytes[0] > dp.bytes[1] and bal.bytes[0] < dp.bytes[0]
