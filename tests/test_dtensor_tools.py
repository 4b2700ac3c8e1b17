"""The training tools on DTensor models (2-D FSDP x TP, TP alone) and when a peer dies:
the global gradient norm, the loss scaler's agreement, the collective trace, the warnings."""
import logging
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from conftest import VOCAB, TinyGPT, lm_loss, parallelize_gpt
from mgpu_lab import LaunchError, LossScaler, launch
from mgpu_lab.measure.collective_trace import collective_trace

logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _batch(seed=0, n=4, seq=8):
    t = torch.randint(0, VOCAB, (n, seq + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def _norm_on_mesh(dp, tp):
    """The norm over a 2-D model's pieces (DTensors on two meshes and plain tensors mixed)."""
    from mgpu_lab.training.grad_norm import GlobalGradNorm, piece_of
    from mgpu_lab.training.state_dicts import parameter_names
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    model = parallelize_gpt(TinyGPT(seed=0), dp, tp)
    x, y = _batch()
    d = dist.get_rank() // tp
    lm_loss(model, x.chunk(dp)[d], y.chunk(dp)[d]).backward()
    params = list(model.parameters())
    names = parameter_names(model)
    meshes = {type(p).__name__ + str(getattr(p, "device_mesh", "")) for p in params}
    return GlobalGradNorm(params, [piece_of(p, names[id(p)]) for p in params]).norm(), len(meshes)


@pytest.mark.parametrize("dp,tp", [(2, 2), (1, 2)])
def test_the_norm_over_mixed_dtensor_and_plain_pieces_equals_one_process(dp, tp):
    norms = launch(_norm_on_mesh, nprocs=dp * tp, args=(dp, tp), timeout=120)
    ref = TinyGPT(seed=0)
    x, y = _batch()
    for d in range(dp):  # data-parallel ranks average their gradients: the mean over the parts
        (lm_loss(ref, x.chunk(dp)[d], y.chunk(dp)[d]) / dp).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    for norm, kinds in norms:
        assert kinds >= 2  # DTensor and plain (TP alone), or DTensors on two meshes (2-D)
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=1e-6)


def _scaler_on_mesh():
    """One rank's local gradient overflows: every rank of the 2 x 2 mesh skips the step."""
    model = parallelize_gpt(TinyGPT(seed=0), 2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=8.0)
    x, y = _batch()
    scaler.scale(lm_loss(model, x, y)).backward()
    if dist.get_rank() == 3:
        w = model.blocks["1"].attn.wq.weight.grad
        w.to_local().view(-1)[0] = float("inf")
    before = [p.detach().to_local().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    same = all(torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters()))
    return same, scaler.get_scale()


def test_the_loss_scaler_skips_on_every_rank_of_the_mesh_when_one_overflows():
    for same, scale in launch(_scaler_on_mesh, nprocs=4, timeout=120):
        assert same and scale == 4.0


def _traced_sequence_parallel():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (2,))
    block = TinyGPT(seed=0).blocks["0"]
    parallelize_module(block, mesh, {
        "norm1": SequenceParallel(), "norm2": SequenceParallel(),
        "attn.wq": ColwiseParallel(input_layouts=Shard(1)), "attn.wk": ColwiseParallel(input_layouts=Shard(1)),
        "attn.wv": ColwiseParallel(input_layouts=Shard(1)), "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "mlp.0": ColwiseParallel(input_layouts=Shard(1)), "mlp.2": RowwiseParallel(output_layouts=Shard(1))})
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0)).chunk(2, dim=1)[dist.get_rank()]
    with collective_trace(timeout=30) as trace:
        block(x).sum().backward()
    return [r["op"] for r in trace.records], trace.report()


def test_the_trace_sees_dtensor_collectives_with_sequence_parallel():
    ops, report = launch(_traced_sequence_parallel, nprocs=2, timeout=120)[0]
    assert "all_gather_single" in ops and "reduce_scatter_single" in ops, ops  # sequence parallel's pair
    assert "the ranks agree" in report


def _slow_broadcaster():
    with collective_trace(timeout=10) as trace:
        x = torch.ones(3)
        dist.all_reduce(x)
        if dist.get_rank() == 1:
            time.sleep(1.0)  # merely slower: rank 0's broadcast returns before rank 1 even calls it
        dist.broadcast(x, src=0)
    return trace.report()


def test_the_report_waits_for_a_slower_rank_before_comparing():
    report = launch(_slow_broadcaster, nprocs=2, timeout=60)[0]
    assert "the ranks agree on their first 2 collective(s)" in report, report


def _fsdp_peer_dies():
    from mgpu_lab import FSDP
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    model(torch.ones(2, 4)).sum().backward()
    if dist.get_rank() == 1:
        os._exit(3)  # as after an uncaught C++ error
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()


def test_a_dead_peer_is_named_as_such_in_fsdp():
    with pytest.raises(LaunchError) as info:
        launch(_fsdp_peer_dies, nprocs=2, timeout=60)
    assert info.value.rank == 1
    text = info.value.failures.get(0, "")
    assert "because rank 1 of its group died or left" in text, text
    assert "same units in the same order" not in text


def _ddp_outside_micro_step():
    from torch.nn.parallel import DistributedDataParallel as DDP
    from mgpu_lab import GradientAccumulator
    model = DDP(torch.nn.Linear(2, 1))
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            acc.backward(model(torch.ones(3, 2)).sum(), num_samples=3)
        with acc.micro_step():
            acc.backward(model(torch.ones(3, 2)).sum(), num_samples=3)
    return [str(w.message) for w in caught]


def test_the_accumulator_warns_once_when_ddp_backward_runs_outside_micro_step():
    messages = launch(_ddp_outside_micro_step, nprocs=2, timeout=60)[0]
    assert len(messages) == 1 and "outside micro_step()" in messages[0] and "2x" in messages[0], messages
