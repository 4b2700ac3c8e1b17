"""Tensor parallelism equals the unsharded module, on 2 and 4 ranks (gloo), and torch's
parallelize_module (ColwiseParallel/RowwiseParallel on a CPU DeviceMesh).

Each case: the forward output, the input's gradient on every rank, and each rank's slice
of every weight's gradient, against the module built from the same weights in one process.
With dropout in training mode, ranks seeded differently still agree (the block's own
random streams, Megatron's RNG tracker), and equal the unsharded block drawing the same masks.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from mgpu_lab import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    ParallelTransformerBlock,
    RowParallelLinear,
    launch,
    vocab_parallel_cross_entropy,
)
from mgpu_lab.parallel.rng_tracker import MODEL_PARALLEL, REPLICATED, RNGStatesTracker, model_parallel_rng
from mgpu_lab.parallel.tensor_parallel import scatter_to_sequence_parallel_region
from mgpu_lab.parallel.tensor_parallel_blocks import TransformerBlock

B, S, H, HEADS = 2, 8, 16, 4  # 4 heads: 2 or 1 per rank on 2 and 4 ranks; S divisible by 4
TOL = 2e-5


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _run(ref, ours, x_full, in_slice, out_slice, pairs):
    """Forward and backward of ``ref`` (unsharded) on ``x_full`` and of ``ours`` on this rank's
    ``in_slice`` of it; the largest difference of the output (``out_slice`` of the reference's),
    of the input gradient and of each (local grad, expected slice) pair."""
    x_ref = x_full.clone().requires_grad_(True)
    x_ours = in_slice(x_full).clone().requires_grad_(True)
    y_ref, y_ours = ref(x_ref), ours(x_ours)
    grad_out = _randn(*y_ref.shape, seed=7)
    y_ref.backward(grad_out)
    y_ours.backward(out_slice(grad_out))
    diffs = {"output": (y_ours - out_slice(y_ref)).abs().max().item(),
             "input grad": (x_ours.grad - in_slice(x_ref.grad)).abs().max().item()}
    for name, (got, want) in pairs().items():
        assert got.shape == want.shape, f"{name}: local {tuple(got.shape)} vs expected slice {tuple(want.shape)}"
        diffs[name] = (got - want).abs().max().item()
    return diffs


def _tp_cases():
    n, r = dist.get_world_size(), dist.get_rank()

    def rows(t):  # this rank's slice along dim 0 (output features)
        return t.chunk(n, 0)[r]

    def cols(t):  # along dim 1 (input features)
        return t.chunk(n, 1)[r]

    def last(t):
        return t.chunk(n, -1)[r]

    def full(t):
        return t

    x = _randn(B, S, H, seed=1)
    out = {}
    # built directly, from a seed that differs per rank: every rank keeps a slice of rank 0's layer
    torch.manual_seed(10 + r)
    col, row = ColumnParallelLinear(H, 2 * n), RowParallelLinear(2 * n, H)
    torch.manual_seed(10)
    ref_col, ref_row = nn.Linear(H, 2 * n), nn.Linear(2 * n, H)
    out["built from rank 0's seed"] = {
        "column weight": (col.weight - rows(ref_col.weight)).abs().max().item(),
        "row weight": (row.weight - cols(ref_row.weight)).abs().max().item(),
        "row bias": (row.bias - ref_row.bias).abs().max().item()}
    torch.manual_seed(0)
    lin = nn.Linear(H, 3 * n * 2)
    for gather in (False, True):
        col = ColumnParallelLinear.from_linear(lin, gather_output=gather)
        out[f"column gather_output={gather}"] = _run(
            lin, col, x, full, full if gather else last,
            lambda: {"weight": (col.weight.grad, rows(lin.weight.grad)), "bias": (col.bias.grad, rows(lin.bias.grad))})
        lin.zero_grad()
    lin = nn.Linear(4 * n, H)
    x4 = _randn(B, S, 4 * n, seed=2)
    for parallel_in in (True, False):
        row = RowParallelLinear.from_linear(lin, input_is_parallel=parallel_in)
        out[f"row input_is_parallel={parallel_in}"] = _run(
            lin, row, x4, last if parallel_in else full, full,
            lambda: {"weight": (row.weight.grad, cols(lin.weight.grad)), "bias": (row.bias.grad, lin.bias.grad)})
        lin.zero_grad()

    mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
    pmlp = ParallelMLP.from_mlp(mlp)
    out["mlp"] = _run(mlp, pmlp, x, full, full, lambda: {
        "fc1.weight": (pmlp.fc1.weight.grad, rows(mlp[0].weight.grad)),
        "fc1.bias": (pmlp.fc1.bias.grad, rows(mlp[0].bias.grad)),
        "fc2.weight": (pmlp.fc2.weight.grad, cols(mlp[2].weight.grad)),
        "fc2.bias": (pmlp.fc2.bias.grad, mlp[2].bias.grad)})

    def qkv_slice(t):  # [Q; K; V] rows -> this rank's heads of each
        return torch.cat([rows(part) for part in t.chunk(3)])

    for sp in (False, True):
        block = TransformerBlock(H, HEADS, ffn_hidden=2 * H, causal=True)
        pblock = ParallelTransformerBlock.from_block(block, sequence_parallel=sp)
        seq = (lambda t: t.chunk(n, 1)[r]) if sp else full
        attn, pattn = block.attn, pblock.attn
        out[f"block sequence_parallel={sp}"] = _run(block, pblock, x, seq, seq, lambda: {
            "norm1.weight": (pblock.norm1.weight.grad, block.norm1.weight.grad),
            "norm2.bias": (pblock.norm2.bias.grad, block.norm2.bias.grad),
            "qkv.weight": (pattn.qkv.weight.grad, qkv_slice(attn.in_proj_weight.grad)),
            "qkv.bias": (pattn.qkv.bias.grad, qkv_slice(attn.in_proj_bias.grad)),
            "out.weight": (pattn.out.weight.grad, cols(attn.out_proj.weight.grad)),
            "out.bias": (pattn.out.bias.grad, attn.out_proj.bias.grad),
            "mlp.fc1.weight": (pblock.mlp.fc1.weight.grad, rows(block.mlp[0].weight.grad)),
            "mlp.fc2.bias": (pblock.mlp.fc2.bias.grad, block.mlp[2].bias.grad)})

    # scatter_to_sequence_parallel_region: entering the region, the gradient is all-gathered
    xs = x.clone().requires_grad_(True)
    y = scatter_to_sequence_parallel_region(xs)
    (y * (r + 1)).sum().backward()
    want = torch.cat([torch.full_like(c, k + 1) for k, c in enumerate(x.chunk(n, 1))], 1)
    out["scatter to sequence"] = {"input grad": (xs.grad - want).abs().max().item()}

    # vocabulary-parallel cross-entropy: loss and the gradient of this rank's logits
    vocab = 8 * n
    logits = _randn(B, S, vocab, seed=3) * 4
    target = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(4))
    for reduction in ("mean", "none"):
        z_ref, z_ours = logits.clone().requires_grad_(True), last(logits).clone().requires_grad_(True)
        ref_loss = F.cross_entropy(z_ref.reshape(-1, vocab), target.reshape(-1), reduction=reduction)
        loss = vocab_parallel_cross_entropy(z_ours, target, reduction=reduction)
        weights = _randn(*loss.shape, seed=5)
        (ref_loss * weights.reshape(ref_loss.shape)).sum().backward()
        (loss * weights).sum().backward()
        out[f"vocab cross-entropy {reduction}"] = {
            "loss": (loss.reshape(-1) - ref_loss.reshape(-1)).abs().max().item(),
            "logits grad": (z_ours.grad - last(z_ref.grad)).abs().max().item()}
    return out


@pytest.mark.parametrize("nprocs", [2, 4])
def test_tensor_parallel_equals_unsharded(nprocs):
    for rank, cases in enumerate(launch(_tp_cases, nprocs=nprocs, timeout=120)):
        for case, diffs in cases.items():
            for what, d in diffs.items():
                assert d < TOL, f"{nprocs} ranks, rank {rank}, {case}: {what} differs by {d:.3g}"


def _versus_parallelize_module():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
    ours = ParallelMLP.from_mlp(ref)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    theirs = parallelize_module(ref, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = _randn(B, S, H, seed=1)
    grad_out = _randn(B, S, H, seed=2)
    results = []
    for model in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        y.backward(grad_out)
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
        results.append([y, xi.grad] + grads)
    return [(a - b).abs().max().item() for a, b in zip(*results)]


def test_parallel_mlp_equals_torch_parallelize_module():
    for rank, diffs in enumerate(launch(_versus_parallelize_module, nprocs=2, timeout=120)):
        names = ["output", "input grad", "fc1.weight grad", "fc1.bias grad", "fc2.weight grad", "fc2.bias grad"]
        assert len(diffs) == len(names)
        for name, d in zip(names, diffs):
            assert d < TOL, f"rank {rank}: {name} differs from parallelize_module's by {d:.3g}"


def _frozen_versus_parallelize_module():
    """A frozen fc1 weight and fc2 bias stay frozen, as under torch's ColwiseParallel/RowwiseParallel
    (the same requires_grad); output and gradients equal the unsharded MLP's (None where frozen)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
    ref[0].weight.requires_grad_(False)
    ref[2].bias.requires_grad_(False)
    ours = nn.Sequential(ColumnParallelLinear.from_linear(ref[0]), nn.GELU(), RowParallelLinear.from_linear(ref[2]))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    theirs = parallelize_module(copy.deepcopy(ref), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for model in (ref, ours):
        model(_randn(B, S, H, seed=1)).backward(_randn(B, S, H, seed=2))
    n, r = dist.get_world_size(), dist.get_rank()
    local = {"0.bias": ref[0].bias.grad.chunk(n)[r], "2.weight": ref[2].weight.grad.chunk(n, 1)[r]}
    return dict(
        requires_grad={name: {k: p.requires_grad for k, p in m.named_parameters()}
                       for name, m in (("ours", ours), ("theirs", theirs))},
        y=(ours(_randn(B, S, H, seed=1)) - ref(_randn(B, S, H, seed=1))).abs().max().item(),
        grads={k: None if p.grad is None else (p.grad - local[k]).abs().max().item()
               for k, p in ours.named_parameters()})


def test_from_linear_keeps_a_frozen_weight_frozen_as_colwise_rowwise_parallel():
    for out in launch(_frozen_versus_parallelize_module, nprocs=2, timeout=120):
        assert out["requires_grad"]["ours"] == out["requires_grad"]["theirs"] == {
            "0.weight": False, "0.bias": True, "2.weight": True, "2.bias": False}
        assert out["y"] < TOL
        assert out["grads"]["0.weight"] is None and out["grads"]["2.bias"] is None, out["grads"]
        assert out["grads"]["0.bias"] < TOL and out["grads"]["2.weight"] < TOL, out["grads"]


def _embedding_refused():
    return [str(pytest.raises(TypeError, cls.from_linear, nn.Embedding(8, 4)).value)
            for cls in (ColumnParallelLinear, RowParallelLinear)]


def test_an_embedding_is_refused_naming_torchs_colwise_and_rowwise_parallel():
    col, row = launch(_embedding_refused, nprocs=2, timeout=60)[0]
    assert "nn.Embedding" in col and "parallelize_module" in col and "ColwiseParallel()" in col
    assert "RowwiseParallel()" in row


def _bad_sizes():
    errors = []
    for make in (lambda: ColumnParallelLinear(8, 5),
                 lambda: RowParallelLinear(5, 8),
                 lambda: ParallelAttention(12, 3),
                 lambda: RowParallelLinear(8, 8)(torch.randn(2, 8))):
        try:
            make()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_a_dimension_the_ranks_do_not_divide_is_a_clear_error():
    errors = launch(_bad_sizes, nprocs=2, timeout=60)[0]
    assert "out_features = 5 is not divisible by the tensor-parallel size 2" in errors[0]
    assert "in_features = 5 is not divisible" in errors[1]
    assert "num_heads = 3 is not divisible" in errors[2]
    assert "input_is_parallel=False" in errors[3]


class _Contiguous(nn.Module):
    def forward(self, t):
        return t.contiguous()


def _dropout_with_ranks_seeded_differently():
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    block = TransformerBlock(H, HEADS, dropout=0.5)
    x = _randn(B, S, H, seed=1)
    out = {}
    for name, rng in (("own streams", None), ("per-rank streams only", RNGStatesTracker())):
        if rng is not None:   # what a block without a shared stream does: every rank its own masks
            rng.add(REPLICATED, rank)
            rng.add(MODEL_PARALLEL, 100 + rank)
        ours = ParallelTransformerBlock.from_block(block, rng=rng).train()
        torch.manual_seed(1000 + rank)                      # from here on, each rank its own seed
        y = ours(x)
        y.backward(torch.ones_like(y))
        gathered = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(gathered, y.detach())
        out[name] = {"spread": max((g - gathered[0]).abs().max().item() for g in gathered),
                     "dropped": (y.detach() == x + 0).float().mean().item()}
        if rng is None:
            # the unsharded block drawing from the same replicated stream gives the same output (its
            # attention's output is a transposed view: dropout draws in memory order, so make it contiguous)
            same = model_parallel_rng(seed=ours.rng.seeds[REPLICATED])
            ref_block = copy.deepcopy(block).train()
            ref_block.dropout = nn.Sequential(_Contiguous(), ref_block.dropout)
            with same.fork(REPLICATED):
                ref = ref_block(x)
            out[name]["vs unsharded"] = (y - ref).abs().max().item()
    # the streams themselves: replicated agrees, model-parallel differs, the default stream is untouched
    tracker = model_parallel_rng(seed=None)
    torch.manual_seed(7 + rank)
    expected = torch.rand(3, generator=torch.Generator().manual_seed(7 + rank))
    with tracker.fork(REPLICATED):
        shared = torch.rand(4)
    with tracker.fork(MODEL_PARALLEL):
        own = torch.rand(4)
    after = torch.rand(3)
    draws = [torch.empty(8) for _ in range(n)]
    dist.all_gather(draws, torch.cat([shared, own]))
    out["streams"] = {"replicated equal": all(torch.equal(d[:4], draws[0][:4]) for d in draws),
                      "model-parallel distinct": len({tuple(d[4:].tolist()) for d in draws}) == n,
                      "default untouched": torch.equal(after, expected)}
    return out


@pytest.mark.parametrize("nprocs", [2])
def test_a_block_with_dropout_agrees_across_ranks_seeded_differently(nprocs):
    for rank, out in enumerate(launch(_dropout_with_ranks_seeded_differently, nprocs=nprocs, timeout=120)):
        assert out["own streams"]["spread"] == 0, f"rank {rank}: the ranks' outputs differ"
        assert out["own streams"]["vs unsharded"] < TOL
        assert out["per-rank streams only"]["spread"] > 0.1, "the failure the streams prevent did not show"
        assert all(out["streams"].values()), out["streams"]


def _attention_dropout_is_per_rank_and_selective_recompute_replays_it():
    rank = dist.get_rank()
    torch.manual_seed(0)
    block = TransformerBlock(H, HEADS, dropout=0.1, attention_dropout=0.5)
    x = _randn(B, S, H, seed=1)
    grads, untouched = [], []
    for selective in (False, True):
        rng = model_parallel_rng(seed=123)
        ours = ParallelTransformerBlock.from_block(block, rng=rng, selective_recompute=selective).train()
        torch.manual_seed(5 + rank)
        y = ours(x)
        y.backward(torch.ones_like(y))
        grads.append([y.detach()] + [p.grad for p in ours.parameters()])
        # every mask came from the block's streams: the default one is where the seed left it
        untouched.append(torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(5 + rank))))
        untouched.append(set(rng._states) == {(REPLICATED, "cpu"), (MODEL_PARALLEL, "cpu")})
    spread = [torch.empty_like(grads[0][0]) for _ in range(2)]
    dist.all_gather(spread, grads[0][0])
    return (max((a - b).abs().max().item() for a, b in zip(*grads)), (spread[0] - spread[1]).abs().max().item(),
            all(untouched))


def test_attention_dropout_draws_per_rank_and_selective_recompute_draws_it_again():
    for rank, (recompute_diff, spread, untouched) in enumerate(
            launch(_attention_dropout_is_per_rank_and_selective_recompute_replays_it, nprocs=2, timeout=120)):
        assert recompute_diff < TOL, f"rank {rank}: recomputing the core attention changed the numbers"
        assert spread == 0, f"rank {rank}: the outputs differ across ranks"
        assert untouched, f"rank {rank}: a mask was drawn from the default generator, not the block's streams"


def test_from_block_refuses_a_block_of_another_layout_naming_what_differs():
    """A LLaMA-style block (RMSNorm, separate projections, SwiGLU) has no from_block path."""
    from mgpu_lab.parallel.tensor_parallel_blocks import TransformerBlock, _block_layout_problems

    class LlamaBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.RMSNorm(8), torch.nn.RMSNorm(8)
            self.q, self.k, self.v, self.o = (torch.nn.Linear(8, 8, bias=False) for _ in range(4))
            self.w1, self.w2, self.w3 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 16)

    assert _block_layout_problems(TransformerBlock(8, 2)) == []
    with pytest.raises(TypeError) as err:
        ParallelTransformerBlock.from_block(LlamaBlock())
    message = str(err.value)
    assert "norm1 is a RMSNorm, not a LayerNorm" in message and "no attn" in message
    assert "parallelize_module" in message
