"""Tensor parallelism (Megatron-LM): split each linear layer across N ranks.

A linear layer ``y = x @ W.T`` (``W`` is ``out x in``) can be split two ways:

* **by columns of the output** (``ColumnParallelLinear``): rank r keeps rows
  ``r*out/N ... (r+1)*out/N`` of ``W``. The input ``x`` is the same on every
  rank; each rank computes its slice of the output features. No communication
  in forward. In backward, each rank's ``dL/dx`` only counts its own output
  features, so the N partial input gradients are **summed** (an all-reduce).
* **by rows of the input** (``RowParallelLinear``): rank r keeps columns
  ``r*in/N ... (r+1)*in/N`` of ``W`` and the matching slice of ``x``. Each rank
  computes a partial ``y`` from its input features; the N partial products are
  **summed** (an all-reduce) in forward. Backward needs no communication.

Chained, column then row (``fc1`` then ``fc2`` of an MLP, or the Q/K/V and
output projections of attention), the slice of features the first produces is
exactly the slice the second consumes: the element-wise activation in between
runs on the slice, and the whole block costs one all-reduce forward and one
backward. Megatron names the two conjugate operators at the block's edges:

* **f** (``copy_to_parallel_region``): identity forward, all-reduce backward;
* **g** (``reduce_from_parallel_region``): all-reduce forward, identity backward.

Communication per transformer block (MLP + attention), activations ``b x s x h``:
two all-reduces of ``b*s*h`` elements forward (one g each) and two backward (one
f each), every all-reduce ``2(N-1)/N`` times its bytes per rank on a ring. That
is per layer, on the critical path: TP wants the fast links inside one node.

**Sequence parallelism** (``sequence_parallel=True``): outside the linear layers
(norms, dropout, residual adds) the activations are replicated on every rank,
and computed N times. Split them along the sequence instead: then f becomes an
all-gather along the sequence (backward: reduce-scatter) and g becomes a
reduce-scatter (backward: all-gather). An all-reduce *is* a reduce-scatter then
an all-gather, so the bytes are the same; the norms and dropout now run on
``s/N`` tokens and keep ``1/N`` of their activations. A parameter used on a
sequence shard (the row layer's bias, a norm's weight) gets 1/N of its gradient
on each rank: it is passed through f, whose backward sums the shards.

Layout: tensors are batch-first, ``[batch, seq, features]``; features are split
on the last dimension, the sequence on dimension 1 (``SEQ_DIM``). Every rank
builds the full layer (from the same seed, or ``from_linear``) and rank 0's full
weights are broadcast before each rank keeps its slice, so the shards always
come from one model, as DDP broadcasts rank 0's parameters.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..runtime.distributed import global_rank, require_process_group
from .comm import all_gather_single, reduce_scatter_single

SEQ_DIM = 1


def check_divisible(size: int, world_size: int, what: str) -> int:
    """``size // world_size``, or a ValueError that says what to change."""
    if size % world_size:
        raise ValueError(f"{what} = {size} is not divisible by the tensor-parallel size {world_size}: "
                         f"choose a multiple of {world_size}, or another number of ranks")
    return size // world_size


# --- the collectives along one dimension (no autograd) ---------------------------------

def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone(memory_format=torch.contiguous_format)  # never change a tensor autograd may share
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim``."""
    n = dist.get_world_size(group)
    check_divisible(x.shape[dim], n, f"dimension {dim} of a {tuple(x.shape)} tensor")
    return x.chunk(n, dim)[dist.get_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``."""
    n = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((n * x.shape[0],) + x.shape[1:])
    all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over the ranks; keep this rank's slice along ``dim``."""
    n = dist.get_world_size(group)
    check_divisible(x.shape[dim], n, f"dimension {dim} of a {tuple(x.shape)} tensor")
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // n,) + x.shape[1:])
    reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim)


# --- the conjugate operators, as autograd Functions ------------------------------------

class _CopyToParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromParallelRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    """All-gather along ``dim`` forward; backward keeps this rank's slice of the gradient
    (the consumer is replicated), or reduce-scatters it (``reduce_grad``: the consumer is
    tensor-parallel, each rank holds a partial gradient)."""

    @staticmethod
    def forward(ctx, x, dim, group, reduce_grad):
        ctx.dim, ctx.group, ctx.reduce_grad = dim, group, reduce_grad
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _Scatter(torch.autograd.Function):
    """Keep this rank's slice along ``dim`` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward; all-gather backward (g, sequence-parallel)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_parallel_region(x, group=None):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    return _CopyToParallelRegion.apply(x, group)


def reduce_from_parallel_region(x, group=None):
    """Megatron's g: all-reduce forward, identity backward."""
    return _ReduceFromParallelRegion.apply(x, group)


def gather_from_parallel_region(x, group=None):
    """All-gather the features (last dimension) forward; keep this rank's slice backward."""
    return _Gather.apply(x, -1, group, False)


def scatter_to_parallel_region(x, group=None):
    """Keep this rank's slice of the features forward; all-gather the gradient backward."""
    return _Scatter.apply(x, -1, group)


def gather_from_sequence_parallel_region(x, group=None, tensor_parallel_output_grad=True):
    """Sequence-parallel f: all-gather the sequence forward; reduce-scatter the gradient
    backward (or just keep this rank's slice when the consumer is not tensor-parallel)."""
    return _Gather.apply(x, SEQ_DIM, group, tensor_parallel_output_grad)


def scatter_to_sequence_parallel_region(x, group=None):
    """Enter a sequence-parallel region: keep this rank's part of the sequence forward;
    all-gather the gradient backward."""
    return _Scatter.apply(x, SEQ_DIM, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    """Sequence-parallel g: reduce-scatter along the sequence forward; all-gather backward."""
    return _ReduceScatter.apply(x, SEQ_DIM, group)


# --- the two linear layers ---------------------------------------------------------------

def _rank0_copy(t: torch.Tensor, group) -> torch.Tensor:
    """A copy of ``t`` as rank 0 of ``group`` holds it (the shards come from one model)."""
    t = t.detach().clone()
    dist.broadcast(t, src=global_rank(group, 0), group=group)
    return t


class _ParallelLinear(nn.Module):
    split_dim: int  # of the full weight: 0 (rows, output features) or 1 (columns, input features)

    def __init__(self, linear: nn.Linear, group, sequence_parallel: bool):
        super().__init__()
        require_process_group(type(self).__name__)
        if isinstance(linear, nn.Embedding):
            style, dim = (("ColwiseParallel", "the embedding dimension") if self.split_dim == 0 else
                          ("RowwiseParallel", "the vocabulary"))
            raise TypeError(f"mgpu_lab's {type(self).__name__} splits an nn.Linear, not an nn.Embedding: to split "
                            f"an embedding along {dim} use torch's parallelize_module(model, mesh, "
                            f"{{'embed': {style}()}}) from torch.distributed.tensor.parallel")
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{type(self).__name__}.from_linear expects an nn.Linear, got {type(linear).__name__}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        which = "out_features" if self.split_dim == 0 else "in_features"
        check_divisible(linear.weight.shape[self.split_dim], self.world_size, f"{type(self).__name__}: {which}")
        weight = _rank0_copy(linear.weight, group)
        # requires_grad carried over, as torch's ColwiseParallel/RowwiseParallel keep a frozen weight frozen
        self.weight = nn.Parameter(weight.chunk(self.world_size, self.split_dim)[self.rank].clone(),
                                   requires_grad=linear.weight.requires_grad)
        bias = None
        if linear.bias is not None:
            bias = _rank0_copy(linear.bias, group)
            bias = bias.chunk(self.world_size)[self.rank].clone() if self.split_dim == 0 else bias
            bias = nn.Parameter(bias, requires_grad=linear.bias.requires_grad)
        self.bias = bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rank={self.rank}/{self.world_size}, local weight={tuple(self.weight.shape)}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear`` split by output features: rank r keeps rows ``r*out/N ...`` of the weight and bias.
    ``from_linear`` keeps each parameter's ``requires_grad`` (a frozen layer stays frozen, as torch's
    ``ColwiseParallel`` keeps it).

    Input: replicated ``[..., in_features]`` (with ``sequence_parallel``: this rank's part of
    the sequence, all-gathered first). Output: this rank's ``out/N`` features, or all of
    them with ``gather_output=True``. Backward all-reduces the input's gradient (f).
    """
    split_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None, sequence_parallel: bool = False, device=None, dtype=None):
        linear = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        super().__init__(linear, group, sequence_parallel)
        self.gather_output = gather_output

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, gather_output: bool = False,
                    sequence_parallel: bool = False) -> "ColumnParallelLinear":
        self = cls.__new__(cls)
        _ParallelLinear.__init__(self, linear, group, sequence_parallel)
        self.gather_output = gather_output
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_parallel_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear`` split by input features: rank r keeps columns ``r*in/N ...`` of the weight.
    ``from_linear`` keeps ``requires_grad``, as ``ColumnParallelLinear.from_linear``.

    Input: this rank's ``in/N`` features (``input_is_parallel=True``, what a column layer
    produced), or the full replicated input, sliced here. Forward sums the partial
    products (g: all-reduce; with ``sequence_parallel`` a reduce-scatter along the
    sequence), then adds the full bias, which every rank keeps.
    """
    split_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group=None, sequence_parallel: bool = False, device=None, dtype=None):
        linear = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        super().__init__(linear, group, sequence_parallel)
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, input_is_parallel: bool = True,
                    sequence_parallel: bool = False) -> "RowParallelLinear":
        self = cls.__new__(cls)
        _ParallelLinear.__init__(self, linear, group, sequence_parallel)
        self.input_is_parallel = input_is_parallel
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, self.group)
        elif x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"RowParallelLinear on rank {self.rank}: expected this rank's {self.weight.shape[1]} "
                             f"input features, got {x.shape[-1]} (pass input_is_parallel=False for a full input)")
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)
            return y if self.bias is None else y + copy_to_parallel_region(self.bias, self.group)
        y = reduce_from_parallel_region(y, self.group)
        return y if self.bias is None else y + self.bias
