"""ZeRO stage 1 from scratch: shard the optimizer state, keep everything else.

Under data parallelism every rank holds the same parameters, the same
(all-reduced) gradients and the same optimizer state, and runs the same
optimizer step: N copies of work and memory. Adam keeps two fp32 tensors per
parameter (``exp_avg``, ``exp_avg_sq``); in mixed precision the ZeRO paper
counts 12 bytes of optimizer state per parameter (fp32 master weights, momentum,
variance) against 2 + 2 for the fp16 parameters and gradients: the optimizer
state is three quarters of the model's memory.

ZeRO-1 (Rajbhandari et al., 2020) partitions the *parameters* across ranks and
gives each rank an optimizer over its own partition only:

1. gradients are all-reduced as usual (BucketedDDP, torch DDP or by hand);
2. each rank steps its own optimizer, which updates only the parameters it owns;
3. the owners share the updated parameters: here one broadcast per rank of its
   owned parameters packed into one flat buffer (an all-gather of uneven shards).

Memory per rank: parameters Ψ and gradients Ψ as before, optimizer state K·Ψ/N.
Communication per step: the all-reduce (2Ψ·(N-1)/N sent per rank) plus Ψ·(N-1)/N
for the broadcasts; the ZeRO paper gets 2Ψ in total by replacing the all-reduce
with a reduce-scatter (ZeRO-2, each rank only needs its own gradients).

``ShardedOptimizer`` is a ``torch.optim.Optimizer``: ``param_groups`` lists every
parameter (an lr scheduler changes them as usual; they are copied into the local
optimizer before each step), ``state`` holds the state of this rank's parameters
only, ``zero_grad``, ``add_param_group``. ``state_dict()`` is a collective (call
it on every rank): it returns the state dict the *unsharded* ``optimizer_cls``
would have (global parameter indices), so it loads into either; ``load_state_dict``
takes that full dict and keeps this rank's part.

Partitioning: parameters that require grad at construction are assigned greedily,
largest first, to the rank with the fewest bytes so far (ties: lowest rank, then
registration order), the same on every rank. Frozen parameters are owned by no
one and never sent. A tied parameter is one tensor: it appears once.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Type

import torch
import torch.distributed as dist


def partition_parameters(sizes: Sequence[int], world_size: int) -> List[List[int]]:
    """Assign items of the given sizes to ``world_size`` ranks, balanced by size.

    Greedy, largest first, each to the currently lightest rank (ties: lowest rank,
    then lowest index). Returns per rank the sorted indices it owns. The heaviest
    rank carries at most (total / N + largest item) bytes.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads, owned = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        owned[r].append(i)
        loads[r] += sizes[i]
    return [sorted(o) for o in owned]


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: ``optimizer_cls(**kwargs)`` over this rank's shard of ``params``.

    Call ``step()`` after the gradients are averaged across ranks; every rank
    then holds the same parameters as an unsharded optimizer would give.
    Costs per step: one broadcast per rank (N messages, Ψ·(N-1)/N bytes received
    per rank) and a flat copy of the largest shard as scratch.
    """

    def __init__(self, params, optimizer_cls: Type[torch.optim.Optimizer], group=None, **kwargs: Any):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class (e.g. torch.optim.AdamW), "
                            f"got {optimizer_cls!r}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: build the optimizer inside "
                               "mgpu_lab.launch(...) or after mgpu_lab.init_distributed()")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.optimizer_cls = optimizer_cls
        self._owner: Dict[torch.Tensor, int] = {}   # parameter -> owning rank (in group)
        self._loads = [0] * self.world_size
        self._local = None
        super().__init__(params, defaults=kwargs)
        local_groups = [self._local_group(g) for g in self.param_groups]
        self._local = optimizer_cls(local_groups, **kwargs)
        self.state = self._local.state  # this rank's parameters only

    # ------------------------------------------------------------------ partition
    def _assign(self, params: List[torch.Tensor]) -> None:
        trainable = [p for p in params if p.requires_grad and p not in self._owner]
        sizes = [p.numel() * p.element_size() for p in trainable]
        for i in sorted(range(len(trainable)), key=lambda i: (-sizes[i], i)):
            r = min(range(self.world_size), key=lambda r: (self._loads[r], r))
            self._owner[trainable[i]] = r
            self._loads[r] += sizes[i]

    def _local_group(self, group: Dict[str, Any]) -> Dict[str, Any]:
        self._assign(group["params"])
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [p for p in group["params"] if self._owner.get(p) == self.rank]
        return local

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if self._local is not None:  # after construction: partition the new group too
            self._local.add_param_group(self._local_group(self.param_groups[-1]))

    @property
    def partition(self) -> List[List[torch.Tensor]]:
        """Per rank, the parameters it owns, in ``param_groups`` order."""
        out: List[List[torch.Tensor]] = [[] for _ in range(self.world_size)]
        for g in self.param_groups:
            for p in g["params"]:
                if p in self._owner:
                    out[self._owner[p]].append(p)
        return out

    @property
    def local_optimizer(self) -> torch.optim.Optimizer:
        """The ``optimizer_cls`` instance over this rank's shard."""
        return self._local

    # ------------------------------------------------------------------ step
    def _sync_hyperparameters(self) -> None:
        for g, lg in zip(self.param_groups, self._local.param_groups):
            for k, v in g.items():
                if k != "params":
                    lg[k] = v

    @torch.no_grad()
    def _share_parameters(self) -> None:
        """Each owner broadcasts its updated parameters, packed in one flat buffer."""
        for r, params in enumerate(self.partition):
            if not params:
                continue
            src = r if self.group is None else dist.get_global_rank(self.group, r)
            if r == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                                   device=params[0].device)
            if any(p.dtype != flat.dtype or p.device != flat.device for p in params):
                for p in params:  # mixed dtypes/devices: one message per parameter
                    dist.broadcast(p.detach(), src=src, group=self.group)
                continue
            dist.broadcast(flat, src=src, group=self.group)
            if r != self.rank:
                offset = 0
                for p in params:
                    p.copy_(flat[offset: offset + p.numel()].view_as(p))
                    offset += p.numel()

    def step(self, closure=None):
        """Step this rank's shard, then share the updated parameters with every rank."""
        self._sync_hyperparameters()
        loss = self._local.step(closure) if closure is not None else self._local.step()
        self._share_parameters()
        return loss

    # ------------------------------------------------------------------ state dict
    def _global_index(self) -> Dict[torch.Tensor, int]:
        index: Dict[torch.Tensor, int] = {}
        for g in self.param_groups:
            for p in g["params"]:
                index[p] = len(index)
        return index

    def state_dict(self) -> Dict[str, Any]:
        """The full (unsharded) optimizer state dict. A collective: call it on every rank."""
        index = self._global_index()
        local_sd = self._local.state_dict()
        local_params = [p for lg in self._local.param_groups for p in lg["params"]]
        mine = {index[local_params[i]]: s for i, s in local_sd["state"].items()}
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        state = {}
        for part in gathered:
            state.update(part)
        groups = []
        for g, lg in zip(self.param_groups, local_sd["param_groups"]):
            full = {k: v for k, v in lg.items() if k != "params"}
            full["params"] = [index[p] for p in g["params"]]
            groups.append(full)
        return {"state": {i: state[i] for i in sorted(state)}, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full state dict (from ``state_dict()`` or the unsharded optimizer's)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("the state dict's parameter groups do not match this optimizer's "
                             "(build it over the same parameters, in the same groups and order)")
        local_state, local_groups, j = {}, [], 0
        for g, sg in zip(self.param_groups, groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
            ids = []
            for p, i in zip(g["params"], sg["params"]):
                if self._owner.get(p) == self.rank:
                    if i in state_dict["state"]:
                        local_state[j] = state_dict["state"][i]
                    ids.append(j)
                    j += 1
            local_groups.append({**{k: v for k, v in sg.items() if k != "params"}, "params": ids})
        self._local.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self._local.state
