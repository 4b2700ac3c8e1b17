"""Activation checkpointing: same gradients as a plain run and as torch.utils.checkpoint,
fewer saved bytes, and correct under torch DDP."""
import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as tc
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import ATOL, RTOL, TiedNet, VOCAB, requires_gpus
from mgpu_lab import checkpoint, checkpoint_sequential, launch, peak_memory, saved_tensor_bytes


class Block(nn.Module):
    """A transformer-style MLP block: x + dropout(fc2(gelu(fc1(x))))."""

    def __init__(self, width, p=0.1):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(x))))


def stack(n=16, width=8, p=0.1, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(*[Block(width, p) for _ in range(n)])
    net[1].fc1.requires_grad_(False)  # a frozen layer
    return net


def grads_of(run, model, x, seed=1):
    """Output and gradients (parameters that require grad, then the input) of one backward."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    torch.manual_seed(seed)
    out = run(x)
    (out.float() ** 2).sum().backward()
    gs = [p.grad for p in model.parameters() if p.requires_grad]
    return [out.detach()] + gs + ([x.grad] if x.requires_grad else [])


def assert_same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=RTOL, atol=ATOL)


def test_checkpoint_gradients_equal_plain_and_torch_with_dropout():
    net, x = stack(n=4, p=0.3), torch.randn(5, 8)
    plain = grads_of(net, net, x)
    mine = grads_of(lambda h: checkpoint(net, h), net, x)
    ref = grads_of(lambda h: tc.checkpoint(net, h, use_reentrant=False), net, x)
    assert_same(mine, plain)
    assert_same(mine, ref)
    other_masks = grads_of(net, net, x, seed=2)  # the comparison can fail: dropout matters
    assert (other_masks[0] - plain[0]).abs().max() > 1e-3


def test_checkpoint_tied_weights_and_integer_input():
    net, idx = TiedNet(), torch.randint(0, VOCAB, (4, 6))
    assert_same(grads_of(lambda i: checkpoint(net, i), net, idx), grads_of(net, net, idx))


def test_checkpoint_mixed_arguments_and_outputs():
    """Tensors that require grad or not, non-tensors, kwargs, a tuple out."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    mask = (torch.rand(3, 6) > 0.5).float()  # does not require grad

    def fn(x, mask, scale, *, act=torch.tanh, bias=None):
        h = act(lin(x)) * mask * scale + bias
        return h, h.sum(-1)

    x, bias = torch.randn(3, 6), torch.randn(6)

    def run(f):
        lin.zero_grad()
        xx, bb = x.clone().requires_grad_(), bias.clone().requires_grad_()
        h, s = f(fn, xx, mask, 2.5, act=torch.sigmoid, bias=bb)
        ((h ** 2).sum() + s.pow(3).sum()).backward()
        return [h.detach(), s.detach(), xx.grad, bb.grad, lin.weight.grad, lin.bias.grad]

    assert_same(run(checkpoint), run(lambda f, *a, **k: f(*a, **k)))


def test_checkpoint_really_recomputes_and_keeps_only_inputs():
    torch.manual_seed(0)
    net, calls = stack(n=2, p=0.0), []

    def fn(h):
        calls.append(1)
        return net(h)

    x = torch.randn(4, 8, requires_grad=True)
    checkpoint(fn, x).sum().backward()
    assert len(calls) == 2  # forward, then once in backward
    assert saved_tensor_bytes(lambda h: checkpoint(fn, h), x) == x.numel() * x.element_size()
    assert saved_tensor_bytes(fn, x) > 8 * x.numel() * x.element_size()


def test_rng_state_after_backward_is_untouched():
    net, x = stack(n=2, p=0.5), torch.randn(4, 8)
    draws = []
    for run in (net, lambda h: checkpoint(net, h)):
        torch.manual_seed(3)
        run(x.requires_grad_()).sum().backward()
        draws.append(torch.rand(4))
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)


def test_retain_graph_backward_twice():
    net, x = stack(n=2, p=0.2), torch.randn(4, 8)
    for run in (net, lambda h: checkpoint(net, h)):
        net.zero_grad()
        torch.manual_seed(0)
        out = run(x).pow(2).sum()
        out.backward(retain_graph=True)
        out.backward()
        if run is net:
            ref = [p.grad.clone() for p in net.parameters() if p.requires_grad]
    assert_same([p.grad for p in net.parameters() if p.requires_grad], ref)


def test_nested_checkpoint_and_autocast():
    net, x = stack(n=4, p=0.3), torch.randn(3, 8)
    nested = lambda h: checkpoint(lambda y: checkpoint(net[2:], checkpoint(net[:2], y)), h)  # noqa: E731
    assert_same(grads_of(nested, net, x), grads_of(net, net, x))


    def autocast_forward(run):  # forward under autocast, backward outside it, as in training
        def fwd(h):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return run(h)
        return fwd

    assert_same(grads_of(autocast_forward(lambda h: checkpoint(net, h)), net, x),
                grads_of(autocast_forward(net), net, x))


def test_recompute_that_differs_is_an_error():
    net, calls = stack(n=2, p=0.0), []

    def moody(h):  # a different graph the second time
        calls.append(1)
        return net(h) if len(calls) == 1 else net[0](h)

    with pytest.raises(RuntimeError, match="must do the same operations"):
        checkpoint(moody, torch.randn(2, 8, requires_grad=True)).sum().backward()


def test_parameter_gradient_hooks_fire_once():
    """The non-reentrant design: a module used in two checkpointed calls gets its
    gradient accumulated once per backward (what DDP's reducer relies on); the
    reentrant design accumulates once per nested backward."""
    torch.manual_seed(0)
    lin, fired = nn.Linear(4, 4), []
    lin.weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))

    def count(ckpt):
        fired.clear()
        x = torch.randn(2, 4, requires_grad=True)
        ckpt(lin, ckpt(lin, x)).sum().backward()
        return len(fired)

    assert count(checkpoint) == 1
    assert count(lambda f, h: tc.checkpoint(f, h, use_reentrant=True)) == 2


@pytest.mark.parametrize("segments", [1, 3, 4, 16])
def test_checkpoint_sequential_equals_torch(segments):
    net, x = stack(n=16, p=0.2), torch.randn(3, 8)
    mine = grads_of(lambda h: checkpoint_sequential(net, segments, h), net, x)
    ref = grads_of(lambda h: tc.checkpoint_sequential(net, segments, h, use_reentrant=False), net, x)
    assert_same(mine, ref)
    assert_same(mine, grads_of(net, net, x))
    x.requires_grad_()
    assert saved_tensor_bytes(lambda h: checkpoint_sequential(net, segments, h), x) == \
        saved_tensor_bytes(lambda h: tc.checkpoint_sequential(net, segments, h, use_reentrant=False), x)


def test_checkpoint_sequential_bad_segments():
    net = stack(n=4)
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match="segments must be an int in 1..4"):
            checkpoint_sequential(net, bad, torch.randn(2, 8))


def test_saved_bytes_16_blocks_in_4_segments():
    net, x = stack(n=16, width=32), torch.randn(16, 32, requires_grad=True)
    plain = saved_tensor_bytes(net, x)
    ckpt = saved_tensor_bytes(lambda h: checkpoint_sequential(net, 4, h), x)
    assert ckpt <= 0.35 * plain, f"checkpointed {ckpt} bytes vs plain {plain}"


def test_saved_bytes_scale_with_batch_size():
    net = stack(n=8, width=16)
    for run in (net, lambda h: checkpoint_sequential(net, 3, h)):
        sizes = [saved_tensor_bytes(run, torch.randn(b, 16, requires_grad=True)) for b in (4, 8, 16)]
        assert sizes[1] == 2 * sizes[0] and sizes[2] == 4 * sizes[0], sizes


def test_saved_bytes_counts_each_storage_once_and_skips_parameters():
    torch.manual_seed(0)
    lin = nn.Linear(10, 10, bias=False)
    x = torch.randn(4, 10, requires_grad=True)
    # lin saves x (and weight.t(), a parameter); relu saves its output; the
    # second lin saves that same output again: x + one relu output.
    f = lambda h: lin(torch.relu(lin(h)))  # noqa: E731
    assert saved_tensor_bytes(f, x) == 2 * 4 * 10 * 4
    assert saved_tensor_bytes(f, x, count_parameters=True) == 2 * 4 * 10 * 4 + 10 * 10 * 4


def test_peak_memory_without_gpu_says_what_to_use():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(RuntimeError, match="saved_tensor_bytes"):
        peak_memory(lambda: None)


class Checkpointed(nn.Module):
    """``net`` run through ``checkpoint_sequential`` (``segments=None``: plainly)."""

    def __init__(self, net, segments):
        super().__init__()
        self.net, self.segments = net, segments

    def forward(self, x):
        return self.net(x) if self.segments is None else checkpoint_sequential(self.net, self.segments, x)


def tied_stack(p):
    net = stack(n=6, p=p, seed=0)
    net[0].fc2.weight = net[5].fc2.weight  # tied across two checkpoint segments
    return net


def _ddp_train(segments, p, steps=3):
    """Each rank trains a checkpointed and a plain DDP replica on its half of the batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for segs in (segments, None):
        net = tied_stack(p)
        model = DDP(Checkpointed(net, segs), find_unused_parameters=True)  # breaks reentrant
        opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=0.1)
        for step in range(steps):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step)).chunk(world)[rank]
            torch.manual_seed(100 * rank + step)
            opt.zero_grad()
            (model(x) ** 2).mean().backward()
            opt.step()
        out.append({k: v.detach().clone() for k, v in net.state_dict().items()})
    return out


def test_ddp_training_with_checkpoint_equals_plain():
    for ranks in (launch(_ddp_train, nprocs=2, args=(3, 0.2), timeout=60),
                  launch(_ddp_train, nprocs=2, args=(2, 0.0), timeout=60)):
        for ckpt_state, plain_state in ranks:
            for k in plain_state:
                torch.testing.assert_close(ckpt_state[k], plain_state[k], rtol=RTOL, atol=ATOL)
    # and with no dropout, equal to one process on the full batch
    net = tied_stack(0.0)
    opt = torch.optim.SGD([q for q in net.parameters() if q.requires_grad], lr=0.1)
    for step in range(3):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        (net(x) ** 2).mean().backward()
        opt.step()
    ref = net.state_dict()
    for k in ref:
        torch.testing.assert_close(ranks[0][0][k], ref[k], rtol=RTOL, atol=ATOL)


@requires_gpus(1)
def test_peak_memory_on_gpu():
    dev = torch.device("cuda", 0)
    net = stack(n=16, width=256, p=0.1).to(dev)
    x = torch.randn(4096, 256, device=dev, requires_grad=True)  # activations >> gradients

    def step(run):
        def f():
            run(x).float().pow(2).mean().backward()
            net.zero_grad(set_to_none=True)
            x.grad = None
        return f

    plain = peak_memory(step(net))
    ckpt = peak_memory(step(lambda h: checkpoint_sequential(net, 4, h)))
    assert 0 < ckpt < 0.5 * plain, (ckpt, plain)
    mine = grads_of(lambda h: checkpoint_sequential(net, 4, h), net, x)
    assert_same(mine, grads_of(net, net, x))


@requires_gpus(1)
def test_saved_bytes_same_on_cpu_and_gpu():
    # Without dropout: its kernels differ (CUDA saves a 1-byte mask, CPU a float one).
    nets = [stack(n=4, width=64, p=0.0) for _ in range(2)]
    nets[1].to("cuda:0")
    x = torch.randn(32, 64, requires_grad=True)
    xs = [x, x.detach().to("cuda:0").requires_grad_()]
    for k in (1, 2, 4):
        cpu, gpu = (saved_tensor_bytes(lambda h: checkpoint_sequential(net, k, h), xx)
                    for net, xx in zip(nets, xs))
        assert cpu == gpu > 0, (k, cpu, gpu)
