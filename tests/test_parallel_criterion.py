"""DataParallelModel + DataParallelCriterion = the full-batch loss and gradients, also with uneven chunks."""
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mgpu_lab import DataParallelCriterion, DataParallelModel, gather
from conftest import requires_gpus, virtual_devices

RTOL, ATOL = 1e-5, 1e-6


def mlp(out=4, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, out))


def data(batch, kind):
    torch.manual_seed(1)
    x = torch.randn(batch, 6)
    y = torch.randint(0, 4, (batch,)) if kind == "ce" else torch.randn(batch, 4)
    return x, y


CRITERIA = {"ce": nn.CrossEntropyLoss, "mse": nn.MSELoss}


@pytest.mark.parametrize("kind", ["ce", "mse"])
@pytest.mark.parametrize("batch,n", [(5, 2), (7, 3), (10, 3), (2, 3), (8, 2)])
def test_loss_and_gradients_equal_full_batch(kind, batch, n):
    model = mlp()
    x, y = data(batch, kind)
    ref = CRITERIA[kind]()(model(x), y)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    devs = virtual_devices(n)
    outputs = DataParallelModel(model, device_ids=devs)(x)
    assert isinstance(outputs, list) and len(outputs) == len(torch.chunk(x, n))
    loss = DataParallelCriterion(CRITERIA[kind](), device_ids=devs)(outputs, y)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    loss.backward()
    for p, r in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, r, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", ["ce", "mse"])
def test_mean_of_per_device_means_is_wrong_with_uneven_chunks(kind):
    """The PyTorch-Encoding version (plain mean over devices) misses the full-batch loss; ours does not."""
    model = mlp()
    x, y = data(5, kind)  # chunks of 3 and 2
    outputs = DataParallelModel(model, device_ids=virtual_devices(2))(x)
    crit = CRITERIA[kind]()
    per_device = [crit(o, t) for o, t in zip(outputs, torch.chunk(y, 2))]
    naive = torch.stack(per_device).mean()
    full = crit(model(x), y)
    assert not torch.allclose(naive, full, rtol=1e-3)
    torch.testing.assert_close(DataParallelCriterion(crit, virtual_devices(2))(outputs, y), full, rtol=RTOL, atol=ATOL)


def test_sum_reduction_sums_the_per_device_sums():
    model = mlp()
    x, y = data(7, "mse")
    outputs = DataParallelModel(model, device_ids=virtual_devices(3))(x)
    loss = DataParallelCriterion(nn.MSELoss(reduction="sum"), virtual_devices(3))(outputs, y)
    torch.testing.assert_close(loss, F.mse_loss(model(x), y, reduction="sum"), rtol=RTOL, atol=ATOL)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h), self.b(h).squeeze(1)


class TwoHeadLoss(nn.Module):
    def forward(self, logits, score, y, s):
        return F.cross_entropy(logits, y) + 0.5 * F.mse_loss(score, s)


def test_tuple_outputs_are_unpacked_into_the_criterion():
    torch.manual_seed(0)
    model = TwoHeads()
    x, y, s = torch.randn(7, 6), torch.randint(0, 4, (7,)), torch.randn(7)
    ref = TwoHeadLoss()(*model(x), y, s)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    outputs = DataParallelModel(model, device_ids=virtual_devices(3))(x)
    assert all(isinstance(o, tuple) and len(o) == 2 for o in outputs)
    loss = DataParallelCriterion(TwoHeadLoss(), virtual_devices(3))(outputs, y, s)
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    loss.backward()
    for p, r in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, r, rtol=RTOL, atol=ATOL)
    # the outputs can still be gathered by hand, as in the seed article
    logits = gather([o[0] for o in outputs], "cpu")
    torch.testing.assert_close(logits, model(x)[0], rtol=RTOL, atol=ATOL)


class ProbeLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, out, y):
        self.seen.append((threading.current_thread().name, torch.is_autocast_enabled("cpu")))
        return F.cross_entropy(out, y)


def test_autocast_reaches_the_criterion_threads():
    model, probe = mlp(), ProbeLoss()
    x, y = data(6, "ce")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = DataParallelModel(model, device_ids=virtual_devices(2))(x)
        loss = DataParallelCriterion(probe, virtual_devices(2))(outputs, y)
        ref = F.cross_entropy(model(x), y)
    assert all(o.dtype == torch.bfloat16 for o in outputs)
    assert sorted(probe.seen) == [("replica-0", True), ("replica-1", True)]
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


def test_one_device_returns_a_one_element_list():
    model = mlp()
    x, y = data(5, "ce")
    outputs = DataParallelModel(model, device_ids=virtual_devices(1))(x)
    assert len(outputs) == 1
    loss = DataParallelCriterion(nn.CrossEntropyLoss(), virtual_devices(1))(outputs, y)
    torch.testing.assert_close(loss, F.cross_entropy(model(x), y))


def test_bad_input_is_a_clear_error():
    model = mlp()
    x, y = data(6, "ce")
    outputs = DataParallelModel(model, device_ids=virtual_devices(3))(x)
    with pytest.raises(ValueError, match="scalar per device"):
        DataParallelCriterion(nn.CrossEntropyLoss(reduction="none"), virtual_devices(3))(outputs, y)
    with pytest.raises(ValueError, match="targets split into 2 chunks"):
        DataParallelCriterion(nn.CrossEntropyLoss(), virtual_devices(3))(outputs, y[:2])
    with pytest.raises(TypeError, match="per-device outputs"):
        DataParallelCriterion(nn.CrossEntropyLoss(), virtual_devices(3))(model(x), y)
    with pytest.raises(ValueError, match="only 2 device_ids"):
        DataParallelCriterion(nn.CrossEntropyLoss(), virtual_devices(2))(outputs, y)


@requires_gpus(1)
def test_matches_torch_dataparallel_loss_on_gpus():
    ids = list(range(torch.cuda.device_count()))
    ours_m, theirs_m = mlp().cuda(), mlp().cuda()
    x = torch.randn(7, 6, device="cuda")
    y = torch.randint(0, 4, (7,), device="cuda")
    ref = F.cross_entropy(torch.nn.DataParallel(theirs_m, device_ids=ids)(x), y)
    ref.backward()
    loss = DataParallelCriterion(nn.CrossEntropyLoss(), ids)(DataParallelModel(ours_m, ids)(x), y)
    assert loss.device == torch.device("cuda", ids[0])
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    loss.backward()
    for a, b in zip(ours_m.parameters(), theirs_m.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_with_padding_and_class_weights_is_exact(weighted, smoothing):
    """ignore_index hits and class weights change the mean's denominator: still the full-batch loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))
    x, y = torch.randn(7, 6), torch.randint(0, 5, (7,))
    y[[0, 1, 2]] = -100  # padding: chunk 0 (rows 0-2 on 3 devices) is all padding
    crit = nn.CrossEntropyLoss(weight=torch.rand(5) + 0.5 if weighted else None, label_smoothing=smoothing)
    ref = crit(model(x), y)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    outputs = DataParallelModel(model, device_ids=virtual_devices(3))(x)
    loss = DataParallelCriterion(crit, virtual_devices(3))(outputs, y)
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
    loss.backward()
    for p, r in zip(model.parameters(), ref_grads):
        assert torch.isfinite(p.grad).all()
        torch.testing.assert_close(p.grad, r, rtol=RTOL, atol=ATOL)
    assert crit.reduction == "mean"  # the user's criterion is left as it was
