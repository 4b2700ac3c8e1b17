"""DataParallel from scratch: equal to the plain module (outputs, gradients), on virtual CPU devices.

GPU tests compare with ``torch.nn.DataParallel`` directly.
"""
import threading
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import ATOL, mlp, ModelOutput, requires_gpus, RTOL, virtual_devices
from mgpu_lab import DataParallel, gather, parallel_apply, replicate, scatter

def grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("batch", [2, 5, 7, 12])
def test_forward_and_gradients_equal_plain_module(n, batch):
    model = mlp()
    torch.manual_seed(1)
    x, y = torch.randn(batch, 6), torch.randint(0, 4, (batch,))
    ref = model(x)
    F.cross_entropy(ref, y).backward()
    ref_grads = grads(model)
    model.zero_grad()

    out = DataParallel(model, device_ids=virtual_devices(n))(x)
    F.cross_entropy(out, y).backward()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    for g, r in zip(grads(model), ref_grads):
        torch.testing.assert_close(g, r, rtol=RTOL, atol=ATOL)


def test_training_steps_match_plain_training():
    plain, par = mlp(3), mlp(3)
    dp = DataParallel(par, device_ids=virtual_devices(3))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, par)]
    torch.manual_seed(2)
    for _ in range(4):
        x, y = torch.randn(11, 6), torch.randint(0, 4, (11,))
        for model, opt in zip((plain, dp), opts):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    for a, b in zip(plain.parameters(), par.parameters()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("batch,n", [(7, 3), (5, 4), (2, 3), (9, 2)])
def test_scatter_uses_torch_chunk_sizes(batch, n):
    x = torch.arange(batch * 2.0).view(batch, 2)
    chunks = scatter(x, virtual_devices(n))
    expected = torch.chunk(x, n)
    assert len(chunks) == len(expected) <= n
    for c, e in zip(chunks, expected):
        assert torch.equal(c, e)


def test_scatter_nested_structures_and_non_tensors():
    Pair = namedtuple("Pair", "a b")
    x = torch.randn(5, 3)
    obj = (x, [x * 2, "tag"], {"k": x + 1, "flag": True}, Pair(x, 7))
    parts = scatter(obj, virtual_devices(2))
    assert len(parts) == 2
    for i, part in enumerate(parts):
        ref = torch.chunk(x, 2)[i]
        assert isinstance(part, tuple) and isinstance(part[1], list) and isinstance(part[3], Pair)
        assert torch.equal(part[0], ref) and torch.equal(part[1][0], ref * 2)
        assert part[1][1] == "tag" and part[2]["flag"] is True and part[3].b == 7
        assert torch.equal(part[2]["k"], ref + 1) and torch.equal(part[3].a, ref)


def test_scatter_rejects_bad_input():
    with pytest.raises(ValueError, match="different numbers of chunks"):
        scatter((torch.randn(5, 2), torch.randn(1, 2)), virtual_devices(3))
    with pytest.raises(ValueError, match="0-dim"):
        scatter(torch.tensor(1.0), virtual_devices(2))
    with pytest.raises(ValueError, match="empty"):
        scatter(torch.randn(0, 3), virtual_devices(2))


class DictNet(nn.Module):
    """Nested inputs and outputs: a dict in, a (tensor, dict) tuple out, a keyword argument."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 5), nn.Linear(2, 5)

    def forward(self, batch, scale=1.0, bias=None):
        h = self.a(batch["x"]) + self.b(batch["z"][0]) * scale
        if bias is not None:
            h = h + bias
        return h.sum(1), {"h": h, "parts": [h.relu(), h.tanh()]}


@pytest.mark.parametrize("n", [2, 3])
def test_nested_inputs_outputs_and_kwargs(n):
    torch.manual_seed(0)
    net = DictNet()
    x, z, bias = torch.randn(7, 3), torch.randn(7, 2), torch.randn(7, 5)
    batch = {"x": x, "z": [z]}
    s_ref, d_ref = net(batch, scale=0.5, bias=bias)
    (s_ref.sum() + d_ref["parts"][1].pow(2).sum()).backward()
    ref_grads = grads(net)
    net.zero_grad()

    s, d = DataParallel(net, device_ids=virtual_devices(n))(batch, scale=0.5, bias=bias)
    (s.sum() + d["parts"][1].pow(2).sum()).backward()
    torch.testing.assert_close(s, s_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(d["h"], d_ref["h"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(d["parts"][0], d_ref["parts"][0], rtol=RTOL, atol=ATOL)
    for g, r in zip(grads(net), ref_grads):
        torch.testing.assert_close(g, r, rtol=RTOL, atol=ATOL)


def test_batch_smaller_than_devices_with_a_plain_keyword_argument():
    # 2 samples on 3 devices: 2 chunks; scale=0.5 (not a tensor) goes to both, it does not make a third.
    torch.manual_seed(0)
    net = DictNet()
    batch = {"x": torch.randn(2, 3), "z": [torch.randn(2, 2)]}
    s_ref, d_ref = net(batch, scale=0.5)
    s_ref.sum().backward()
    ref_grads = grads(net)
    net.zero_grad()
    s, d = DataParallel(net, device_ids=virtual_devices(3))(batch, scale=0.5)
    s.sum().backward()
    torch.testing.assert_close(s, s_ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(d["h"], d_ref["h"], rtol=RTOL, atol=ATOL)
    for g, r in zip(grads(net), ref_grads):
        torch.testing.assert_close(g, r, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="different numbers of chunks"):  # tensors still must agree
        DataParallel(net, device_ids=virtual_devices(3))(batch, bias=torch.randn(1, 5))


def test_replicate_makes_connected_separate_replicas_with_tied_weights():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    model = nn.Sequential(emb, nn.BatchNorm1d(4), head).eval()  # replicas copy the mode
    reps = replicate(model, virtual_devices(3))
    assert len({id(r) for r in reps} | {id(model)}) == 4
    for r in reps:
        assert r[0].weight is r[2].weight  # still tied inside a replica
        assert r[0].weight.grad_fn is not None and not r[0].weight.is_leaf
    assert reps[0][1].running_mean is model[1].running_mean  # replica 0 keeps the buffers
    assert reps[1][1].running_mean is not model[1].running_mean
    assert torch.equal(reps[1][1].running_mean, model[1].running_mean)
    # every replica's gradient lands in the original: sum over 3 replicas = 3x one
    idx = torch.tensor([1, 2, 3, 4])
    sum(r(idx).sum() for r in reps).backward()
    g3 = model[0].weight.grad.clone()
    model.zero_grad()
    model(idx).sum().backward()
    torch.testing.assert_close(g3, 3 * model[0].weight.grad)


def test_batchnorm_keeps_replica_0_statistics_as_torch_does():
    # In train mode each replica normalises its own chunk; only replica 0's running
    # statistics persist in the module (torch.nn.DataParallel's documented behaviour).
    torch.manual_seed(0)
    dp_bn, ref_bn = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    x = torch.randn(7, 3) * 2 + 1
    out = DataParallel(dp_bn, device_ids=virtual_devices(2))(x)
    chunks = torch.chunk(x, 2)
    torch.testing.assert_close(out, torch.cat([nn.BatchNorm1d(3)(c) for c in chunks]), rtol=RTOL, atol=ATOL)
    ref_bn(chunks[0])
    for name, ref in ref_bn.named_buffers():
        torch.testing.assert_close(dp_bn.get_buffer(name), ref, rtol=RTOL, atol=ATOL)


def test_replicate_under_no_grad_is_detached():
    model = mlp()
    with torch.no_grad():
        reps = replicate(model, virtual_devices(2))
    assert all(not p.requires_grad for r in reps for p in r.parameters())


class Probe(nn.Module):
    """Records, per call, the thread and the grad/autocast state it saw."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append((threading.current_thread().name, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
                          torch.get_autocast_dtype("cpu")))
        return self.lin(x)


def test_autocast_bf16_and_grad_mode_reach_worker_threads():
    torch.manual_seed(0)
    probe = Probe()
    x = torch.randn(6, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = probe.lin(x)
        out = DataParallel(probe, device_ids=virtual_devices(3))(x)
    assert out.dtype == torch.bfloat16 == ref.dtype
    torch.testing.assert_close(out, ref)
    assert sorted(t for t, *_ in probe.seen) == ["replica-0", "replica-1", "replica-2"]
    assert all(on and dtype == torch.bfloat16 for _, _, on, dtype in probe.seen)

    probe.seen.clear()
    with torch.no_grad():
        out = DataParallel(probe, device_ids=virtual_devices(2))(x)
    assert not out.requires_grad and all(grad is False for _, grad, _, _ in probe.seen)
    probe.seen.clear()
    DataParallel(probe, device_ids=virtual_devices(2))(x)
    assert all(grad is True and on is False for _, grad, on, _ in probe.seen)


class FailOn(nn.Module):
    def forward(self, x):
        if x[0, 0] > 100:
            raise KeyError("bad sample")
        return x * 2


def test_worker_exception_is_reraised_naming_its_device():
    x = torch.zeros(4, 2)
    x[2, 0] = 1000.0  # lands in chunk 1
    with pytest.raises(KeyError, match=r"replica 1 on device cpu \(virtual device 1\)") as info:
        DataParallel(FailOn(), device_ids=virtual_devices(2))(x)
    assert "bad sample" in str(info.value)


class Sleepy(nn.Module):
    def forward(self, x):
        import time

        time.sleep(1.0)
        return x


def test_parallel_apply_times_out():
    reps = [Sleepy(), Sleepy()]
    with pytest.raises(TimeoutError, match=r"replicas \[0, 1\]"):
        parallel_apply(reps, [torch.ones(1), torch.ones(1)], timeout=0.05)
    with pytest.raises(ValueError, match="2 modules but 1 inputs"):
        parallel_apply(reps, [torch.ones(1)])


def test_first_tensor_walks_any_pytree():
    from collections import deque

    from mgpu_lab.parallel.data_parallel import first_tensor

    t = torch.ones(2)
    assert first_tensor(ModelOutput(t)) is t  # a registered dataclass
    assert first_tensor(deque([None, t])) is t
    assert first_tensor({"a": [1, (None, t)], "b": torch.zeros(1)}) is t
    assert first_tensor([1, "x", None]) is None


def test_gather_is_differentiable_and_nested():
    a = torch.randn(3, 2, requires_grad=True)
    b = torch.randn(2, 2, requires_grad=True)
    out = gather([(a, {"v": a * 2}), (b, {"v": b * 2})], "cpu")
    torch.testing.assert_close(out[0], torch.cat([a, b]))
    (out[0].sum() + out[1]["v"].sum()).backward()
    torch.testing.assert_close(a.grad, torch.full_like(a, 3.0))
    with pytest.warns(UserWarning, match="scalars"):
        v = gather([torch.tensor(1.0), torch.tensor(2.0)], -1)
    assert v.tolist() == [1.0, 2.0]
    with pytest.raises(TypeError, match="cannot gather"):
        gather([1, 2], "cpu")


def test_one_device_calls_the_module_directly_and_state_dict_matches_torch():
    probe = Probe()
    x = torch.randn(3, 4)
    out = DataParallel(probe, device_ids=virtual_devices(1))(x)
    assert probe.seen[0][0] == threading.current_thread().name
    torch.testing.assert_close(out, probe.lin(x))
    ours = DataParallel(probe).state_dict().keys()
    theirs = torch.nn.DataParallel(probe, device_ids=[] if not torch.cuda.is_available() else None)
    assert list(ours) == list(theirs.state_dict().keys())


def test_module_on_the_wrong_device_is_a_clear_error():
    with pytest.raises(ValueError, match="call module.to"):
        DataParallel(mlp(), device_ids=["meta", "meta"])(torch.randn(2, 6))


# ----------------------------------------------------------------------- GPUs
needs_gpus = requires_gpus(1)


@needs_gpus
@pytest.mark.parametrize("batch", [5, 8])
def test_matches_torch_dataparallel_on_gpus(batch):
    ids = list(range(torch.cuda.device_count()))
    torch.manual_seed(0)
    ours_m = mlp().cuda()
    theirs_m = mlp().cuda()
    x = torch.randn(batch, 6, device="cuda")
    y = torch.randint(0, 4, (batch,), device="cuda")
    ours = DataParallel(ours_m, device_ids=ids)(x)
    theirs = torch.nn.DataParallel(theirs_m, device_ids=ids)(x)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    F.cross_entropy(ours, y).backward()
    F.cross_entropy(theirs, y).backward()
    for a, b in zip(ours_m.parameters(), theirs_m.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=RTOL, atol=ATOL)
    for c, t in zip(scatter(x, ids), torch.nn.parallel.scatter(x, ids)):
        assert c.device == t.device and torch.equal(c, t)
