"""kept_alive: what a forward keeps alive, seen below autograd, so that saved-tensor hooks
(a checkpoint's, an offloader's, one that keeps everything) cannot hide it."""
import functools

import torch
import torch.utils.checkpoint as tc
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from mgpu_lab import checkpoint, saved_tensor_bytes
from mgpu_lab.measure.kept_alive import kept_alive


def stack(n=3, width=16, p=0.1, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                         nn.Dropout(p)) for _ in range(n)])


def keeps_everything(net):
    """A "checkpoint" whose own hooks store every saved tensor: outer hooks see nothing."""
    def run(h):
        stash = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: stash.append(t) or len(stash) - 1,
                                                      lambda i: stash[i]):
            return net(h)
    return run


def test_plain_forward_is_what_autograd_saves_minus_the_input():
    net, x = stack(), torch.randn(8, 16, requires_grad=True)
    report = kept_alive(net, x)
    assert report.nbytes == saved_tensor_bytes(net, x) - x.numel() * x.element_size()
    assert report.nbytes == sum(row[3] for row in report.tensors) > 0
    assert {"addmm", "gelu"} <= set(report.ops)


def test_an_inner_hook_hides_nothing():
    net, x = stack(), torch.randn(8, 16, requires_grad=True)
    cheat = keeps_everything(net)
    assert saved_tensor_bytes(cheat, x) == 0  # what the hook-based count sees
    assert kept_alive(cheat, x).nbytes == kept_alive(net, x).nbytes > 0


def test_real_checkpoints_keep_nothing_made_in_forward():
    net, x = stack(), torch.randn(8, 16, requires_grad=True)
    assert kept_alive(lambda h: tc.checkpoint(net, h, use_reentrant=False), x).nbytes == 0
    assert kept_alive(lambda h: tc.checkpoint(net, h, use_reentrant=True), x).nbytes == 0
    assert kept_alive(lambda h: checkpoint(net, h, use_reentrant=False), x).nbytes == 0


def test_selective_checkpointing_cache_is_counted():
    net, x = stack(), torch.randn(8, 16, requires_grad=True)
    ops = [torch.ops.aten.addmm.default]
    ctx = functools.partial(tc.create_selective_checkpoint_contexts, ops)
    report = kept_alive(lambda h: tc.checkpoint(net, h, use_reentrant=False, context_fn=ctx), x)
    assert saved_tensor_bytes(lambda h: tc.checkpoint(net, h, use_reentrant=False, context_fn=ctx), x) == 512
    # the two matmul outputs of each of the 3 layers: 8 x 64 and 8 x 16 floats
    assert report.nbytes == 3 * (8 * 64 + 8 * 16) * 4
    assert {row[0] for row in report.tensors} == {"addmm"}


def test_storage_kept_by_autograd_counts_after_the_tensor_object_died():
    lin, x = nn.Linear(4, 4), torch.randn(3, 4)
    report = kept_alive(lambda h: torch.tanh(lin(h)).sum(), x)  # tanh saves its output
    assert report.nbytes == 3 * 4 * 4 and report.tensors[0][0] == "tanh"


def test_result_views_inputs_and_in_place_results_are_not_counted():
    x = torch.randn(6, 4, requires_grad=True)
    assert kept_alive(lambda h: h.t() * 2, x).nbytes == 0            # mul by a number saves nothing
    assert kept_alive(lambda h: h.exp(), x).nbytes == 0               # saves its result: yours anyway
    y = torch.randn(6, 4)
    lin = nn.Linear(4, 4)
    # relu_ in place on a made tensor; its two views saved by mul: one storage, counted once
    report = kept_alive(lambda h: (lambda r: (r[:3] * r[3:]).sum())(torch.relu_(lin(h))), y)
    assert report.nbytes == 6 * 4 * 4


def test_a_forward_run_with_dispatch_modes_disabled_is_visible_in_ops():
    net, x = stack(), torch.randn(8, 16, requires_grad=True)

    def hidden(h):
        with _disable_current_modes():
            return keeps_everything(net)(h)

    report = kept_alive(hidden, x)
    assert report.nbytes == 0 and "addmm" not in report.ops  # the check must look at ops
