"""A transformer block split across N ranks with the column and row layers.

Megatron's recipe, one pattern twice (see ``tensor_parallel.py`` for the why):

* **MLP**: ``fc1`` column-parallel (rank r computes ffn/N hidden features), the
  activation on that slice, ``fc2`` row-parallel (partial sums, one all-reduce).
* **attention**: the heads are split: rank r computes the Q, K and V of heads
  ``r*H/N ...`` (one column-parallel projection), attends with them alone (the
  heads are independent), and the output projection is row-parallel.

Each costs one all-reduce forward (g) and one backward (f). Everything else of
the block (layer norms, dropout, residual adds) is replicated, or, with
``sequence_parallel=True``, runs on this rank's ``s/N`` positions: the input and
the output of the block are then ``[batch, seq/N, hidden]``.

``TransformerBlock`` is the unsharded reference, built from torch's own modules
(``nn.LayerNorm``, ``nn.MultiheadAttention``, ``nn.Linear``); the parallel
modules are made from one (``from_block``, ``from_attention``, ``from_mlp``)
and compute the same function (in eval mode, or without dropout).

Dropout draws from the block's own streams (``rng_tracker.py``), whatever each
rank's own seed: on the replicated residual stream from one stream shared by the
group (every rank the same mask, so the ranks keep one model), inside the rank's
own heads and, under sequence parallelism, on its own tokens from a per-rank stream
(Megatron's model-parallel RNG tracker).
"""
from __future__ import annotations

import copy

import torch
import torch.utils.checkpoint
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .rng_tracker import MODEL_PARALLEL, REPLICATED, RNGStatesTracker, model_parallel_rng
from .tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    _rank0_copy,
    check_divisible,
    copy_to_parallel_region,
)


def causal_mask(seq: int, device=None) -> torch.Tensor:
    """``-inf`` above the diagonal: position i attends to positions <= i."""
    return torch.full((seq, seq), float("-inf"), device=device).triu(1)


class TransformerBlock(nn.Module):
    """Pre-norm transformer block, unsharded: ``x + drop(attn(ln1(x)))``, then ``x + drop(mlp(ln2(x)))``
    (``attention_dropout``: on the attention probabilities, inside ``attn``)."""

    def __init__(self, hidden: int, num_heads: int, ffn_hidden: int = None, dropout: float = 0.0,
                 causal: bool = True, bias: bool = True, attention_dropout: float = 0.0):
        super().__init__()
        ffn_hidden = ffn_hidden or 4 * hidden
        self.causal = causal
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, num_heads, dropout=attention_dropout, bias=bias, batch_first=True)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, ffn_hidden, bias=bias), nn.GELU(),
                                 nn.Linear(ffn_hidden, hidden, bias=bias))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = causal_mask(x.shape[1], x.device) if self.causal else None
        a = self.attn(h, h, h, need_weights=False, attn_mask=mask, is_causal=self.causal)[0]
        x = x + self.dropout(a)
        return x + self.dropout(self.mlp(self.norm2(x)))


class ParallelMLP(nn.Module):
    """``Linear(hidden, ffn) -> activation -> Linear(ffn, hidden)``, ffn split across the ranks."""

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = True, activation: nn.Module = None,
                 group=None, sequence_parallel: bool = False):
        super().__init__()
        full = nn.Sequential(nn.Linear(hidden, ffn_hidden, bias=bias), activation or nn.GELU(),
                             nn.Linear(ffn_hidden, hidden, bias=bias))
        self._build(full, group, sequence_parallel)

    @classmethod
    def from_mlp(cls, mlp: nn.Sequential, group=None, sequence_parallel: bool = False) -> "ParallelMLP":
        """From ``nn.Sequential(Linear, element-wise activation, Linear)``."""
        layers = list(mlp)
        if len(layers) != 3 or not isinstance(layers[0], nn.Linear) or not isinstance(layers[2], nn.Linear):
            raise ValueError("ParallelMLP.from_mlp expects nn.Sequential(nn.Linear, activation, nn.Linear), "
                             f"got {mlp}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._build(mlp, group, sequence_parallel)
        return self

    def _build(self, mlp, group, sequence_parallel):
        fc1, act, fc2 = list(mlp)
        self.fc1 = ColumnParallelLinear.from_linear(fc1, group, sequence_parallel=sequence_parallel)
        self.act = copy.deepcopy(act)
        self.fc2 = RowParallelLinear.from_linear(fc2, group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ParallelAttention(nn.Module):
    """Multi-head self-attention with the heads split across the ranks (``num_heads % N == 0``).

    The attention dropout (``nn.MultiheadAttention``'s ``dropout``) acts on this rank's own
    heads: it draws from the per-rank stream of ``rng`` (default: its own
    ``model_parallel_rng(group)``). ``selective_recompute=True`` keeps nothing of the core
    attention (scores, softmax, dropout) for the backward and recomputes it there (Megatron's
    selective activation recomputation).
    """

    def __init__(self, hidden: int, num_heads: int, bias: bool = True, causal: bool = False, dropout: float = 0.0,
                 group=None, sequence_parallel: bool = False, rng: RNGStatesTracker = None,
                 selective_recompute: bool = False):
        super().__init__()
        self._build(nn.MultiheadAttention(hidden, num_heads, dropout=dropout, bias=bias, batch_first=True), causal,
                    group, sequence_parallel, rng, selective_recompute)

    @classmethod
    def from_attention(cls, mha: nn.MultiheadAttention, causal: bool = False, group=None,
                       sequence_parallel: bool = False, rng: RNGStatesTracker = None,
                       selective_recompute: bool = False) -> "ParallelAttention":
        """From a batch-first ``nn.MultiheadAttention`` used as self-attention."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._build(mha, causal, group, sequence_parallel, rng, selective_recompute)
        return self

    def _build(self, mha, causal, group, sequence_parallel, rng, selective_recompute):
        if not (mha.batch_first and mha._qkv_same_embed_dim and mha.bias_k is None):
            raise ValueError("ParallelAttention: expected nn.MultiheadAttention(..., batch_first=True) "
                             "without kdim/vdim or add_bias_kv")
        n = dist.get_world_size(group)
        self.heads = check_divisible(mha.num_heads, n, "ParallelAttention: num_heads")  # heads on this rank
        self.head_dim, self.causal, self.dropout_p = mha.head_dim, causal, mha.dropout
        # nn.MultiheadAttention stacks [all Q; all K; all V]. Reorder the rows to
        # [Q, K, V of rank 0's heads; Q, K, V of rank 1's heads; ...]: then a plain
        # column split gives each rank its own heads' Q, K and V (one f for all three).
        hidden = mha.embed_dim
        qkv = nn.Linear(hidden, 3 * hidden, bias=mha.in_proj_bias is not None)
        with torch.no_grad():
            parts = [mha.in_proj_weight.chunk(3)] + ([mha.in_proj_bias.chunk(3)] if qkv.bias is not None else [])
            for dst, (q, k, v) in zip([qkv.weight, qkv.bias], parts):
                dst.copy_(torch.cat([torch.cat(t) for t in zip(q.chunk(n), k.chunk(n), v.chunk(n))]))
        self.qkv = ColumnParallelLinear.from_linear(qkv, group, sequence_parallel=sequence_parallel)
        self.out = RowParallelLinear.from_linear(mha.out_proj, group, sequence_parallel=sequence_parallel)
        self.rng = rng if rng is not None else model_parallel_rng(group)
        self.selective_recompute = selective_recompute

    def _core(self, q, k, v):
        dropout_p = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [b, s, heads * head_dim] each (s: the whole sequence)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        with self.rng.fork(MODEL_PARALLEL, x.device):   # this rank's heads: its own masks
            if self.selective_recompute and torch.is_grad_enabled():
                o = torch.utils.checkpoint.checkpoint(self._core, q, k, v, use_reentrant=False)
            else:
                o = self._core(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


def _block_layout_problems(block) -> list:
    """What keeps ``block`` from being read as a :class:`TransformerBlock` (empty: nothing)."""
    want = {"norm1": nn.LayerNorm, "norm2": nn.LayerNorm, "attn": nn.MultiheadAttention, "dropout": nn.Dropout}
    problems = [f"no {name} ({kind.__name__})" if getattr(block, name, None) is None else
                f"{name} is a {type(getattr(block, name)).__name__}, not a {kind.__name__}"
                for name, kind in want.items() if not isinstance(getattr(block, name, None), kind)]
    mlp = getattr(block, "mlp", None)
    if not (isinstance(mlp, nn.Sequential) and len(mlp) == 3 and isinstance(mlp[0], nn.Linear)
            and isinstance(mlp[2], nn.Linear)):
        problems.append("mlp is not Linear -> activation -> Linear (an nn.Sequential of three)")
    if not isinstance(getattr(block, "causal", None), bool):
        problems.append("no causal flag (a bool)")
    return problems


class ParallelTransformerBlock(nn.Module):
    """``TransformerBlock`` with attention heads and MLP features split across the ranks.

    With ``sequence_parallel=True`` the input and output are this rank's part of the
    sequence, ``[batch, seq/N, hidden]`` (``scatter_to_sequence_parallel_region``).
    Dropout: the residual stream's from ``rng``'s replicated stream (its per-rank one under
    sequence parallelism), the attention's from the per-rank one; ``rng`` defaults to
    ``model_parallel_rng(group)``, one seed agreed by the group.
    """

    def __init__(self, hidden: int, num_heads: int, ffn_hidden: int = None, dropout: float = 0.0,
                 causal: bool = True, bias: bool = True, group=None, sequence_parallel: bool = False,
                 attention_dropout: float = 0.0, rng: RNGStatesTracker = None, selective_recompute: bool = False):
        super().__init__()
        self._build(TransformerBlock(hidden, num_heads, ffn_hidden, dropout, causal, bias, attention_dropout), group,
                    sequence_parallel, rng, selective_recompute)

    @classmethod
    def from_block(cls, block: TransformerBlock, group=None, sequence_parallel: bool = False,
                   rng: RNGStatesTracker = None, selective_recompute: bool = False) -> "ParallelTransformerBlock":
        """This rank's part of ``block``, a :class:`TransformerBlock` (or a block of the same
        layout: ``norm1``/``norm2`` LayerNorms, ``attn`` an ``nn.MultiheadAttention``, ``mlp``
        ``Linear -> activation -> Linear``, ``dropout``, ``causal``). Any other block (a LLaMA
        block: RMSNorm, separate q/k/v projections, SwiGLU) is refused, naming what differs:
        shard it with ``torch.distributed.tensor.parallel.parallelize_module`` and a plan
        (``ColwiseParallel``/``RowwiseParallel`` per projection; labs 11 and 13)."""
        problems = _block_layout_problems(block)
        if problems:
            raise TypeError(f"ParallelTransformerBlock.from_block takes mgpu_lab's TransformerBlock layout; "
                            f"{type(block).__name__} differs: {'; '.join(problems)}. For another block, use "
                            f"torch.distributed.tensor.parallel.parallelize_module with a ColwiseParallel/"
                            f"RowwiseParallel plan per projection")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._build(block, group, sequence_parallel, rng, selective_recompute)
        return self

    def _build(self, block, group, sequence_parallel, rng, selective_recompute):
        self.group, self.sequence_parallel = group, sequence_parallel
        self.rng = rng if rng is not None else model_parallel_rng(group)
        self.norm1, self.norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
        with torch.no_grad():
            for p in list(self.norm1.parameters()) + list(self.norm2.parameters()):
                p.copy_(_rank0_copy(p, group))
        self.attn = ParallelAttention.from_attention(block.attn, block.causal, group, sequence_parallel, self.rng,
                                                     selective_recompute)
        self.mlp = ParallelMLP.from_mlp(block.mlp, group, sequence_parallel)
        self.dropout = copy.deepcopy(block.dropout)

    def _norm(self, norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return norm(x)  # replicated input: every rank computes the full (same) gradient
        # On a sequence shard each rank's weight gradient is a partial sum: f sums them.
        weight = None if norm.weight is None else copy_to_parallel_region(norm.weight, self.group)
        bias = None if norm.bias is None else copy_to_parallel_region(norm.bias, self.group)
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # replicated activations: one mask for the group; a sequence shard: this rank's own
        with self.rng.fork(MODEL_PARALLEL if self.sequence_parallel else REPLICATED, x.device):
            return self.dropout(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self._norm(self.norm1, x)))
        return x + self._drop(self.mlp(self._norm(self.norm2, x)))
