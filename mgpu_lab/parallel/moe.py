"""A mixture of experts: a router sends each token to ``top_k`` of ``num_experts`` MLPs.

The router is a Linear layer giving one logit per expert. Each token goes to the experts
of its ``top_k`` largest logits, and its output is their outputs weighted by a softmax over
those k logits (Mixtral's rule). Each token pays for k MLPs, while the layer holds E of
them: parameters grow with E, compute per token does not.

**Capacity.** On a real system each expert processes a fixed-size buffer of
``C = ceil(capacity_factor * T * k / E)`` token slots per step (T tokens): ``capacity_factor
= 1`` is exactly the average load. Assignments beyond an expert's C are **dropped**
(they add nothing to the token's output; the weights are not renormalised). Which ones:
the assignments are taken in one fixed order — every token's first choice (tokens in
order), then every token's second choice, ... (GShard's priority: a first choice is never
dropped for a second choice) — and each expert keeps the first C it is given.
``capacity_factor=None``: no limit, nothing dropped.

**Load balance.** A router left alone sends most tokens to a few experts (which then learn
faster and attract more). The auxiliary loss of Switch Transformer,

    aux_loss = E * sum_e f_e * P_e,

with ``f_e`` the fraction of the T*k assignments that chose expert e (counted before
capacity; no gradient) and ``P_e`` the mean router probability of e (softmax over all E
logits; differentiable), is 1 for a perfectly balanced router and grows as the router
concentrates: add ``alpha * aux_loss`` (alpha ~ 0.01) to the training loss. Switch routes
to one expert (k = 1); f over all T*k assignments for k > 1 is Megatron-LM's
``switch_load_balancing_loss_func``. GShard's top-2 loss counts each token's first choice
only (DeepSpeed's ``top2gating``: ``ce = mean(mask1)``, before capacity).
(Hugging Face's Mixtral loss is k times this: it normalises f by T instead of T*k.)

**Balancing without a loss** (DeepSeek-V3, arXiv 2412.19437, section 2.1.2, "Auxiliary-Loss-Free
Load Balancing"). Each expert e has a bias b_e, added to the routing scores for the top-k
*selection* only (``biased_top_k``); the gating weights still come from the scores alone, so no
gradient ever sees b. At the end of each training step, over the whole batch's load, b_e falls by
gamma if e was overloaded and rises by gamma if it was underloaded (``update_bias``; the paper
calls gamma the bias update speed and sets it to 0.001 for the first 14.3T tokens, 0 for the last
500B, section 4.2). "Overloaded" is not defined further in the paper; here, as in Wang et al.
2024 (arXiv 2408.15664, Algorithm 1: b_e += u * sign(mean load - load_e)), it means above the
mean load over the experts, and an expert exactly at the mean keeps its bias.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """One expert: Linear(hidden, ffn) -> GELU -> Linear(ffn, hidden)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def route(logits: torch.Tensor, top_k: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(experts [T, k], weights [T, k], probs [T, E])``: the k largest logits' experts, the
    softmax over those k logits, and the softmax over all E (for the load-balancing loss)."""
    top = logits.topk(top_k, dim=-1)
    return top.indices, torch.softmax(top.values.float(), -1), torch.softmax(logits.float(), -1)


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: Optional[float]) -> Optional[int]:
    """Slots per expert: ``ceil(capacity_factor * num_tokens * top_k / num_experts)`` (None: unlimited)."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def choice_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[k, E]``: how many tokens chose expert e as their j-th choice."""
    return F.one_hot(experts, num_experts).sum(0)


def slot_positions(experts: torch.Tensor, num_experts: int, before: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[T, k]``: each assignment's place in its expert's queue (0 = first served).

    The queue runs over every token's first choice, then every second choice, ...; within a
    choice, in token order. ``before[j, e]``: assignments to e ahead of these tokens' j-th
    choices (default: the earlier choices of these tokens; expert parallelism adds the tokens
    of the ranks before)."""
    onehot = F.one_hot(experts, num_experts)                       # [T, k, E]
    if before is None:
        counts = onehot.sum(0)
        before = counts.cumsum(0) - counts                         # earlier choices, these tokens
    place = onehot.cumsum(0) - 1 + before                          # [T, k, E]
    return place.gather(-1, experts.unsqueeze(-1)).squeeze(-1)


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """``E * sum_e f_e * P_e``: ``f = counts / (T k)`` (``counts``: assignments per expert of the
    ``num_tokens`` = T tokens' k choices), ``P`` = ``probs`` summed over its rows / T. (Under
    expert parallelism ``probs`` holds this rank's rows only: the ranks' losses sum to the whole.)"""
    T = max(num_tokens, 1)
    return probs.shape[-1] * (counts.float() / (T * top_k) * probs.sum(0) / T).sum()


class MoE(nn.Module):
    """A mixture-of-experts layer: ``forward(x)`` maps ``[..., hidden]`` to the same shape.

    ``router``: Linear(hidden, num_experts, bias=False); ``experts``: ``nn.ModuleList`` of
    ``Expert(hidden, ffn)``. After a forward, ``aux_loss`` is its load-balancing loss and
    ``stats`` holds ``tokens_per_expert`` (assignments per expert, before capacity),
    ``capacity`` (slots per expert or None) and ``dropped`` (assignments dropped).
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int = 2,
                 capacity_factor: Optional[float] = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts ({num_experts}), got {top_k}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive (or None: unlimited), got {capacity_factor}")
        self.hidden, self.ffn, self.num_experts = hidden, ffn, num_experts
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn) for _ in range(num_experts))
        self.aux_loss: Optional[torch.Tensor] = None
        self.stats: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden:
            raise ValueError(f"MoE expects [..., {self.hidden}] inputs, got {tuple(x.shape)}")
        tokens = x.reshape(-1, self.hidden)
        T, E = len(tokens), self.num_experts
        experts, weights, probs = route(self.router(tokens), self.top_k)
        counts = choice_counts(experts, E)
        C = capacity(T, E, self.top_k, self.capacity_factor)
        keep = torch.ones_like(experts, dtype=torch.bool) if C is None else slot_positions(experts, E) < C
        self.aux_loss = load_balancing_loss(probs, counts.sum(0), T, self.top_k)
        self.stats = {"tokens_per_expert": counts.sum(0), "capacity": C, "dropped": int((~keep).sum())}
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = ((experts == e) & keep).nonzero(as_tuple=True)
            if len(token):
                y = expert(tokens[token]) * weights[token, slot].unsqueeze(-1).to(tokens.dtype)
                out = out.index_add(0, token, y)
        return out.reshape(x.shape)


def biased_top_k(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T, k]``: each token's experts chosen on ``scores + bias`` (DeepSeek-V3's selection).

    The bias only chooses: the caller takes the gating weights from ``scores`` at these experts
    (``scores.gather(-1, experts)``), and no gradient flows through the choice or the bias."""
    return (scores.detach() + bias).topk(top_k, dim=-1).indices


def update_bias(bias: torch.Tensor, load: torch.Tensor, speed: float) -> torch.Tensor:
    """The bias after one step: ``bias - speed`` where ``load`` (assignments per expert over the
    step's whole batch) is above its mean over the experts, ``bias + speed`` where below,
    unchanged where equal (DeepSeek-V3's rule, ``speed`` = its gamma)."""
    load = load.to(bias.dtype)
    return bias + speed * torch.sign(load.mean() - load)
