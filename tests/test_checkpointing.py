"""Activation checkpointing: same gradients as a plain run and as torch.utils.checkpoint,
fewer saved bytes, and correct under torch DDP."""
import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as tc
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import ATOL, RTOL, TiedNet, VOCAB, requires_gpus
from mgpu_lab import checkpoint, checkpoint_sequential, launch, peak_memory, saved_tensor_bytes


def torch_checkpoint(fn, *args, **kwargs):
    return tc.checkpoint(fn, *args, use_reentrant=False, **kwargs)


# The semantics below are torch's: each such test runs torch's checkpoint and ours on the same case.
def our_checkpoint(fn, *args, **kwargs):
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


TORCH_AND_OURS = pytest.mark.parametrize("ckpt", [torch_checkpoint, our_checkpoint], ids=["torch", "mgpu_lab"])


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
    mine = grads_of(lambda h: checkpoint(net, h, use_reentrant=False), net, x)
    ref = grads_of(lambda h: tc.checkpoint(net, h, use_reentrant=False), net, x)
    assert_same(mine, plain)
    assert_same(mine, ref)
    other_masks = grads_of(net, net, x, seed=2)  # the comparison can fail: dropout matters
    assert (other_masks[0] - plain[0]).abs().max() > 1e-3


def test_checkpoint_tied_weights_and_integer_input():
    net, idx = TiedNet(), torch.randint(0, VOCAB, (4, 6))
    assert_same(grads_of(lambda i: checkpoint(net, i, use_reentrant=False), net, idx), grads_of(net, net, idx))


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

    assert_same(run(our_checkpoint), run(lambda f, *a, **k: f(*a, **k)))


def test_checkpoint_really_recomputes_and_keeps_only_inputs():
    torch.manual_seed(0)
    net, calls = stack(n=2, p=0.0), []

    def fn(h):
        calls.append(1)
        return net(h)

    x = torch.randn(4, 8, requires_grad=True)
    checkpoint(fn, x, use_reentrant=False).sum().backward()
    assert len(calls) == 2  # forward, then once in backward
    assert saved_tensor_bytes(lambda h: checkpoint(fn, h, use_reentrant=False), x) == x.numel() * x.element_size()
    assert saved_tensor_bytes(fn, x) > 8 * x.numel() * x.element_size()


def test_rng_state_after_backward_is_untouched():
    net, x = stack(n=2, p=0.5), torch.randn(4, 8)
    draws = []
    for run in (net, lambda h: checkpoint(net, h, use_reentrant=False)):
        torch.manual_seed(3)
        run(x.requires_grad_()).sum().backward()
        draws.append(torch.rand(4))
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)


def test_retain_graph_backward_twice():
    net, x = stack(n=2, p=0.2), torch.randn(4, 8)
    for run in (net, lambda h: checkpoint(net, h, use_reentrant=False)):
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
    ckpt = functools.partial(checkpoint, use_reentrant=False)
    nested = lambda h: ckpt(lambda y: ckpt(net[2:], ckpt(net[:2], y)), h)  # noqa: E731
    assert_same(grads_of(nested, net, x), grads_of(net, net, x))


    def autocast_forward(run):  # forward under autocast, backward outside it, as in training
        def fwd(h):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return run(h)
        return fwd

    assert_same(grads_of(autocast_forward(lambda h: checkpoint(net, h, use_reentrant=False)), net, x),
                grads_of(autocast_forward(net), net, x))


@TORCH_AND_OURS
def test_recompute_that_differs_is_torchs_checkpoint_error(ckpt):
    net, calls = stack(n=2, p=0.0), []

    def moody(h):  # a different graph the second time
        calls.append(1)
        return net(h) if len(calls) == 1 else net[0](h)

    with pytest.raises(torch.utils.checkpoint.CheckpointError) as err:  # a RuntimeError, as torch's
        ckpt(moody, torch.randn(2, 8, requires_grad=True)).sum().backward()
    if ckpt is our_checkpoint:
        assert "must do the same operations" in str(err.value)


@pytest.mark.parametrize("preserve_rng_state", [True, False])
@pytest.mark.parametrize("determinism_check", ["default", "none"])
def test_torch_keywords_are_for_checkpoint_not_for_fn(preserve_rng_state, determinism_check):
    net, x = stack(n=3, p=0.3), torch.randn(4, 8)
    kw = dict(preserve_rng_state=preserve_rng_state, determinism_check=determinism_check, early_stop=True)
    mine = grads_of(lambda h: checkpoint(net, h, use_reentrant=False, **kw), net, x)
    assert_same(mine, grads_of(lambda h: torch_checkpoint(net, h, **kw), net, x))
    plain = grads_of(net, net, x)
    if preserve_rng_state:
        assert_same(mine, plain)
    else:  # the recompute draws other dropout masks, as torch's does
        assert max((m - p).abs().max().item() for m, p in zip(mine[1:], plain[1:])) > 1e-3
    mine = grads_of(lambda h: checkpoint_sequential(net, 2, h, use_reentrant=False,
                                                    preserve_rng_state=preserve_rng_state), net, x)
    assert_same(mine, grads_of(lambda h: tc.checkpoint_sequential(
        net, 2, h, use_reentrant=False, preserve_rng_state=preserve_rng_state), net, x))


def test_torch_keywords_we_do_not_implement_say_what_to_do():
    net, x = stack(n=2), torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"use_reentrant=True\)"):
        checkpoint(net, x, use_reentrant=True)
    with pytest.raises(ValueError, match="determinism_check should be one of"):
        checkpoint(net, x, determinism_check="strict", use_reentrant=False)
    with pytest.raises(ValueError, match="debug=True"):
        checkpoint(net, x, debug=True, use_reentrant=False)


@TORCH_AND_OURS
def test_context_fn_wraps_the_forward_and_the_recompute(ckpt):
    log = []

    @contextlib.contextmanager
    def context(name):
        log.append(f"enter {name}")
        try:
            yield
        finally:
            log.append(f"exit {name}")

    def fn(h):
        log.append("fn")
        return torch.tanh(h) * 2

    out = ckpt(fn, torch.randn(3, requires_grad=True), context_fn=lambda: (context("forward"), context("recompute")))
    log.append("backward")
    out.sum().backward()
    assert log == ["enter forward", "fn", "exit forward", "backward", "enter recompute", "fn", "exit recompute"]


def test_selective_checkpointing_from_torch_works():
    """torch's selective activation checkpointing (keep the matmuls, recompute the rest) is a context_fn."""
    context_fn = functools.partial(tc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)

    def fn(h):
        return torch.sigmoid(torch.mm(torch.mm(h, w1).relu(), w2)).sin()

    def run(ckpt):
        w1.grad = w2.grad = None
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = ckpt(fn, x)
        out.pow(2).sum().backward()
        return [out.detach(), x.grad, w1.grad, w2.grad]

    mine = run(lambda f, h: checkpoint(f, h, context_fn=context_fn, use_reentrant=False))
    assert_same(mine, run(lambda f, h: torch_checkpoint(f, h, context_fn=context_fn)))
    assert_same(mine, run(lambda f, h: f(h)))


class _MulRecordingSaved(torch.autograd.Function):
    """x * m (m needs no grad); its backward records the m it gets back from autograd."""

    seen = []

    @staticmethod
    def forward(ctx, x, m):
        ctx.save_for_backward(m)
        return x * m

    @staticmethod
    def backward(ctx, grad):
        m, = ctx.saved_tensors
        _MulRecordingSaved.seen.append(m)
        return grad * m, None


@TORCH_AND_OURS
def test_a_saved_tensor_that_needs_no_grad_comes_back_as_the_same_object(ckpt):
    buffer, mask = torch.randn(5), torch.randn(5)  # one the function closes over (a module's buffer), one argument

    def fn(h, m):
        return _MulRecordingSaved.apply(_MulRecordingSaved.apply(h, buffer).sin(), m)

    _MulRecordingSaved.seen.clear()
    ckpt(fn, torch.randn(5, requires_grad=True), mask).sum().backward()
    assert len(_MulRecordingSaved.seen) == 2
    assert _MulRecordingSaved.seen[0] is mask and _MulRecordingSaved.seen[1] is buffer


@TORCH_AND_OURS
@pytest.mark.parametrize("early_stop", [True, False])
def test_the_recompute_stops_once_it_has_every_saved_tensor(ckpt, early_stop):
    log = []

    def fn(h):
        log.append("start")
        y = torch.tanh(h)  # saves its output: the last tensor fn saves
        log.append("end")
        return y * 3

    ckpt(fn, torch.randn(3, requires_grad=True), early_stop=early_stop).sum().backward()
    assert log == ["start", "end", "start"] + ([] if early_stop else ["end"])


@TORCH_AND_OURS
def test_extra_work_at_the_end_of_the_recompute_is_tolerated(ckpt):
    calls = []

    def fn(h):
        calls.append(1)
        y = torch.tanh(h)
        if len(calls) > 1:
            torch.exp(h * 2)  # the recompute does more after the last tensor forward saved
        return y

    x = torch.randn(3, requires_grad=True)
    ckpt(fn, x).sum().backward()
    torch.testing.assert_close(x.grad, 1 - torch.tanh(x.detach()) ** 2)


class _ReadsSavedTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors
        ctx.saved_tensors  # a second read of the same saved tensor in one backward
        return grad * 2


@TORCH_AND_OURS
def test_a_saved_tensor_read_twice_in_one_backward_is_an_error_not_a_second_recompute(ckpt):
    calls = []

    def fn(h):
        calls.append(1)
        return _ReadsSavedTwice.apply(h.sin())

    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="unpacked"):
        ckpt(fn, torch.randn(3, requires_grad=True)).sum().backward()
    assert len(calls) == 2  # forward, one recompute


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

    assert count(our_checkpoint) == 1
    assert count(lambda f, h: tc.checkpoint(f, h, use_reentrant=True)) == 2


@pytest.mark.parametrize("segments", [1, 3, 4, 16])
def test_checkpoint_sequential_equals_torch(segments):
    net, x = stack(n=16, p=0.2), torch.randn(3, 8)
    mine = grads_of(lambda h: checkpoint_sequential(net, segments, h, use_reentrant=False), net, x)
    ref = grads_of(lambda h: tc.checkpoint_sequential(net, segments, h, use_reentrant=False), net, x)
    assert_same(mine, ref)
    assert_same(mine, grads_of(net, net, x))
    x.requires_grad_()
    assert saved_tensor_bytes(lambda h: checkpoint_sequential(net, segments, h, use_reentrant=False), x) == \
        saved_tensor_bytes(lambda h: tc.checkpoint_sequential(net, segments, h, use_reentrant=False), x)


def test_checkpoint_sequential_bad_segments():
    net = stack(n=4)
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match="segments must be an int in 1..4"):
            checkpoint_sequential(net, bad, torch.randn(2, 8), use_reentrant=False)


def test_saved_bytes_16_blocks_in_4_segments():
    net, x = stack(n=16, width=32), torch.randn(16, 32, requires_grad=True)
    plain = saved_tensor_bytes(net, x)
    ckpt = saved_tensor_bytes(lambda h: checkpoint_sequential(net, 4, h, use_reentrant=False), x)
    assert ckpt <= 0.35 * plain, f"checkpointed {ckpt} bytes vs plain {plain}"


def test_saved_bytes_scale_with_batch_size():
    net = stack(n=8, width=16)
    for run in (net, lambda h: checkpoint_sequential(net, 3, h, use_reentrant=False)):
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
        if self.segments is None:
            return self.net(x)
        return checkpoint_sequential(self.net, self.segments, x, use_reentrant=False)


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
    ckpt = peak_memory(step(lambda h: checkpoint_sequential(net, 4, h, use_reentrant=False)))
    assert 0 < ckpt < 0.5 * plain, (ckpt, plain)
    mine = grads_of(lambda h: checkpoint_sequential(net, 4, h, use_reentrant=False), net, x)
    assert_same(mine, grads_of(net, net, x))


@requires_gpus(1)
def test_saved_bytes_same_on_cpu_and_gpu():
    # Without dropout: its kernels differ (CUDA saves a 1-byte mask, CPU a float one).
    nets = [stack(n=4, width=64, p=0.0) for _ in range(2)]
    nets[1].to("cuda:0")
    x = torch.randn(32, 64, requires_grad=True)
    xs = [x, x.detach().to("cuda:0").requires_grad_()]
    for k in (1, 2, 4):
        cpu, gpu = (saved_tensor_bytes(lambda h: checkpoint_sequential(net, k, h, use_reentrant=False), xx)
                    for net, xx in zip(nets, xs))
        assert cpu == gpu > 0, (k, cpu, gpu)
