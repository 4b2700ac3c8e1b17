"""Vocabulary-parallel cross-entropy: the loss of vocabulary-sharded logits, never gathered.

The output layer of a language model is a ``ColumnParallelLinear(hidden, vocab)``:
rank r computes the logits of tokens ``r*V/N ... (r+1)*V/N``. Gathering them
would put ``b*s*V`` numbers on every rank (V is 32 k to 256 k: the largest
activation of the model). Cross-entropy needs only three numbers per position,
each a reduction over the vocabulary, so each rank reduces its own slice and
the ranks all-reduce ``b*s`` numbers, three times:

1. the max logit (for a stable softmax): local max, all-reduce MAX;
2. the target's logit: the rank that holds the target's id contributes it,
   the others 0; all-reduce SUM;
3. the softmax denominator ``sum(exp(z - max))``: local sum, all-reduce SUM.

``loss = log(denominator) - (target logit - max)``. The backward needs no
communication: ``dL/dz = softmax(z) - onehot(target)`` on the rank's own slice.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, target, group):
        rank, vocab_local = dist.get_rank(group), logits.shape[-1]
        start = rank * vocab_local
        z_max = logits.detach().amax(dim=-1)
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        z = logits.float() - z_max.unsqueeze(-1)
        # the target's logit, from the rank whose slice holds it
        mine = (target >= start) & (target < start + vocab_local)
        local_target = torch.where(mine, target - start, torch.zeros_like(target))
        target_logit = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine
        dist.all_reduce(target_logit, group=group)
        exp = z.exp_()
        denominator = exp.sum(dim=-1)
        dist.all_reduce(denominator, group=group)
        softmax = exp.div_(denominator.unsqueeze(-1))
        ctx.save_for_backward(softmax, mine, local_target)
        ctx.dtype = logits.dtype
        return denominator.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, mine, local_target = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype))
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 reduction: str = "none") -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded ``logits`` ``[..., V/N]`` (rank r: ids ``r*V/N ...``)
    against the full ids ``target`` ``[...]``, the same on every rank; equals
    ``F.cross_entropy(..., reduction=reduction)`` of the gathered logits. ``reduction``: "none"
    (the default, as Megatron's ``vocab_parallel_cross_entropy``: one loss per position, shaped as
    ``target``; mask and average them yourself), "mean" or "sum"."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"vocab_parallel_cross_entropy: target {tuple(target.shape)} must be logits' shape "
                         f"without the vocabulary dimension, {tuple(logits.shape[:-1])}")
    vocab = logits.shape[-1] * dist.get_world_size(group)
    if target.numel() and (target.min() < 0 or target.max() >= vocab):
        raise ValueError(f"vocab_parallel_cross_entropy: target ids must lie in [0, {vocab}) "
                         f"(the vocabulary over all ranks)")
    loss = _VocabParallelCrossEntropy.apply(logits, target, group)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss
