"""Expert parallelism: a mixture of experts' experts split across ranks, tokens sent to them.

With E experts on N ranks, rank r holds experts ``[r*E/N, (r+1)*E/N)`` and a copy of the
router. Each rank routes its own tokens, then:

1. **counts**: every rank learns how many of every rank's tokens chose every expert (one
   small all-gather of a ``[k, E]`` count table). From it each rank knows what it will send
   to and receive from every other rank — and, with a capacity, which assignments the
   plain layer would drop (the queue of each expert runs over all ranks' tokens in one
   global order: first choices of rank 0's tokens, of rank 1's, ..., then second choices).
2. **dispatch**: ``all_to_all_single`` sends each kept assignment's token to the rank of its
   expert (the buffer sorted by expert, so each destination's part is contiguous).
3. the local experts run on what arrived (regrouped by expert);
4. **combine**: a second ``all_to_all_single`` returns the outputs to where the tokens came
   from, where they are weighted and summed per token.

Both all-to-alls are differentiable (backward runs the reverse exchange), so the output,
the input's gradient and every expert's gradient equal the plain ``MoE`` on all ranks'
tokens; each rank's router gradient covers its own tokens (sum them over the ranks, as
data parallelism would). ``aux_loss`` on each rank is its share of the plain layer's:
f from every rank's counts, P from its own tokens over all ranks' T; the shares sum to the
plain layer's loss, value and gradient.

Bytes on the wire per rank and step, hidden size h, element size b: the dispatch sends
``(assignments to other ranks' experts) * h * b`` and the combine returns as much — with a
balanced router, ``(N-1)/N * T_r * k * h * b`` each way. ``stats`` records what was sent.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.distributed import global_rank, require_process_group
from .comm import all_gather_single
from .moe import MoE, capacity, choice_counts, load_balancing_loss, route, slot_positions


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with split sizes; backward sends the gradients back the same way.

    ``anchors``: tensors the output does not depend on. A backward collective runs only on the
    ranks whose output requires grad; a rank whose experts received no rows would otherwise
    skip it while the others wait. An anchor that requires grad on every rank (the router's
    weight, in training) makes every rank's output require grad, and join the backward."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, *anchors):
        ctx.args = send_splits, recv_splits, group, len(anchors)
        out = x.new_empty((sum(recv_splits),) + x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits, group, anchors = ctx.args
        return (_AllToAll.apply(grad.contiguous(), recv_splits, send_splits, group),) + (None,) * (3 + anchors)


def all_to_all(x: torch.Tensor, send_splits: List[int], recv_splits: List[int], group=None,
               anchors: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """Rows ``x[sum(send_splits[:d]) : ...]`` go to rank d; the rows from rank s arrive in order (differentiable).

    Every rank must take part in the backward exchange too: pass ``anchors`` (see ``_AllToAll``)
    when what a rank sends may not require grad on every rank."""
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group, *anchors)


class ExpertParallelMoE(nn.Module):
    """This rank's part of an ``MoE``: the router and experts ``[r*E/N, (r+1)*E/N)``.

    ``forward(x)``: this rank's tokens ``[..., hidden]`` in, their outputs out, equal to the plain
    layer on every rank's tokens. ``experts`` holds the local experts; ``first_expert`` is r*E/N.
    After a forward: ``aux_loss`` (this rank's share), ``stats`` (as ``MoE.stats``, over all ranks,
    plus ``sent`` and ``received``: assignments to and from each rank).
    """

    def __init__(self, router: nn.Linear, experts: nn.ModuleList, num_experts: int, top_k: int,
                 capacity_factor, group=None):
        super().__init__()
        require_process_group("ExpertParallelMoE")
        n = dist.get_world_size(group)
        if num_experts % n:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {n} ranks: choose a number of "
                             f"experts divisible by the expert-parallel size")
        self.router, self.experts, self.group = router, experts, group
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.first_expert = dist.get_rank(group) * num_experts // n
        self.aux_loss, self.stats = None, {}

    @classmethod
    def from_moe(cls, moe: MoE, group=None) -> "ExpertParallelMoE":
        """Rank r's part of ``moe`` (group rank 0's weights: every rank ends up with the same model)."""
        require_process_group("ExpertParallelMoE")
        n, r, E = dist.get_world_size(group), dist.get_rank(group), moe.num_experts
        if E % n:
            raise ValueError(f"{E} experts cannot be split evenly over {n} ranks: choose a number of "
                             f"experts divisible by the expert-parallel size")
        weight = moe.router.weight
        full = MoE(moe.hidden, moe.ffn, E, moe.top_k, moe.capacity_factor).to(weight.device, weight.dtype)
        full.load_state_dict(moe.state_dict())                       # a copy: the plain layer stays as it was
        src = global_rank(group, 0)
        with torch.no_grad():
            for p in full.parameters():
                dist.broadcast(p.data, src=src, group=group)
        mine = nn.ModuleList(full.experts[r * E // n:(r + 1) * E // n])
        return cls(full.router, mine, E, moe.top_k, moe.capacity_factor, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, E, k = self.group, self.num_experts, self.top_k
        n, r, local = dist.get_world_size(group), dist.get_rank(group), len(self.experts)
        tokens = x.reshape(-1, x.shape[-1])
        experts, weights, probs = route(self.router(tokens), k)

        # 1. counts: every rank's [k, E] table, then who keeps what
        table = choice_counts(experts, E)
        tables = table.new_empty((n * k, E))
        all_gather_single(tables, table, group=group)
        tables = tables.view(n, k, E)                                            # [N, k, E]
        total = tables.sum(0)
        T_all = int(total.sum()) // k
        C = capacity(T_all, E, k, self.capacity_factor)
        before = (total.cumsum(0) - total) + (tables.cumsum(0) - tables)        # [N, k, E] queue offsets
        kept = tables if C is None else (C - before).clamp(0).minimum(tables)   # assignments served
        keep = torch.ones_like(experts, dtype=torch.bool) if C is None else slot_positions(experts, E, before[r]) < C
        self.aux_loss = load_balancing_loss(probs, total.sum(0), T_all, k)
        per_rank = kept.sum(1).view(n, n, local)                                 # [source, dest, local expert]
        send, recv = per_rank[r].sum(-1).tolist(), per_rank[:, r].sum(-1).tolist()
        self.stats = {"tokens_per_expert": total.sum(0), "capacity": C, "dropped": int((tables - kept).sum()),
                      "sent": send, "received": recv}

        # 2. dispatch: kept assignments sorted by expert, so each destination's rows are contiguous
        token, slot = keep.nonzero(as_tuple=True)
        order = experts[token, slot].argsort(stable=True)
        token, slot = token[order], slot[order]
        arrived = all_to_all(tokens[token], send, recv, group)

        # 3. the local experts, on what arrived regrouped by expert (source by source it is sorted by expert)
        expert_of_row = torch.arange(local, device=x.device).repeat(n).repeat_interleave(per_rank[:, r].reshape(-1))
        regroup = expert_of_row.argsort(stable=True)
        sizes = per_rank[:, r].sum(0).tolist()
        outs = [expert(rows) for expert, rows in zip(self.experts, arrived[regroup].split(sizes)) if len(rows)]
        done = torch.cat(outs) if outs else arrived[:0]
        done = torch.empty_like(done).index_copy(0, regroup, done) if len(done) else done

        # 4. combine: outputs back to their tokens' ranks, weighted, summed per token
        back = all_to_all(done, recv, send, group, anchors=[self.router.weight])   # every rank joins its backward
        out = torch.zeros_like(tokens).index_add(0, token, back * weights[token, slot].unsqueeze(-1).to(back.dtype))
        return out.reshape(x.shape)
