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
for the broadcasts, 3Ψ: the all-reduce is kept so that this optimizer sits behind
any DDP. The ZeRO paper counts 2Ψ for stage 1 and stage 2 alike (§7.2.1): a
reduce-scatter of the gradients (an owner needs only its own) and an all-gather of
the parameters. What stage 2 adds is memory: each rank keeps only the gradients
it owns (Ψ/N).

``ShardedOptimizer`` behaves as torch's ``ZeroRedundancyOptimizer``: it is a
``torch.optim.Optimizer`` whose ``param_groups`` list every parameter and carry
every hyper-parameter of the wrapped optimizer (its defaults included, so an LR
scheduler works without an explicit ``lr``); they are copied into the local
optimizer before each step and back after it (what the local optimizer writes
becomes visible). ``state`` holds the state of this rank's parameters only.
``step(closure=None, **kwargs)`` passes both on. The signature is torch's,
``ShardedOptimizer(params, optimizer_class, process_group=None,
parameters_as_bucket_view=False, **defaults)``; the local optimizer is ``.optim``;
every parameter must be of one dense type (dtype and device), as torch requires.
With ``parameters_as_bucket_view=True`` each rank's trainable parameters are views
of one flat bucket, which the owner broadcasts as it is (no packing copy).

For checkpoints, as torch:
``consolidate_state_dict(to=0)`` on every rank, then ``state_dict()`` on rank 0
(no communication); without it, ``state_dict()`` is a collective that every
rank calls and every rank gets. Either way it is the state dict the *unsharded*
``optimizer_class`` would have (global parameter indices, the current
hyper-parameters), so it loads into either; ``load_state_dict`` takes that full
dict and keeps this rank's part.

Partitioning (torch's): every parameter, frozen or not (one unfrozen later is
then updated by its owner), group by group, largest first, to the rank with the
fewest bytes so far (ties: lowest rank, then registration order), the same on
every rank. A tied parameter is one tensor: it appears once. Only parameters
that require grad are sent after a step.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Type

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..runtime.distributed import global_rank, require_process_group


def partition_parameters(sizes: Sequence[int], world_size: int,
                         loads: Optional[Sequence[int]] = None) -> List[List[int]]:
    """Assign items of the given sizes to ``world_size`` ranks, balanced by size.

    Greedy, largest first, each to the currently lightest rank (ties: lowest rank,
    then lowest index). Returns per rank the sorted indices it owns. The heaviest
    rank carries at most (total / N + largest item) bytes. ``loads``: what each rank
    already holds (default nothing), to continue a partition: ``ShardedOptimizer``
    partitions group after group this way, as torch's ZeroRedundancyOptimizer does.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if loads is not None and len(loads) != world_size:
        raise ValueError(f"loads holds {len(loads)} numbers for {world_size} ranks: give one per rank")
    loads, owned = [0] * world_size if loads is None else list(loads), [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        owned[r].append(i)
        loads[r] += sizes[i]
    return [sorted(o) for o in owned]


def _check_one_dense_type(params: List[torch.Tensor]) -> None:
    """torch's ZeroRedundancyOptimizer's rule: every parameter of one dense type (dtype and device
    kind), so each rank's parameters travel as one flat buffer."""
    types = sorted({torch.typename(p) for p in params})  # torch.FloatTensor, torch.cuda.HalfTensor, ...
    if any(p.is_sparse for p in params) or len(types) > 1:
        raise ValueError(f"ShardedOptimizer (as torch's ZeroRedundancyOptimizer) supports only parameters of one "
                         f"dense type, got {' and '.join(types)}: give it parameters of one dtype and device, "
                         "dense (e.g. one optimizer per dtype)")


def _copy_hyperparameters(src: List[Dict[str, Any]], dst: List[Dict[str, Any]]) -> None:
    for s, d in zip(src, dst):
        d.update({k: v for k, v in s.items() if k != "params"})


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: ``optimizer_class(**defaults)`` over this rank's shard of ``params``.

    Call ``step()`` after the gradients are averaged across ranks; every rank
    then holds the same parameters as an unsharded optimizer would give.
    Costs per step: one broadcast per rank (N messages, Ψ·(N-1)/N bytes received
    per rank) and a flat copy of the largest shard as scratch.
    """

    def __init__(self, params, optimizer_class: Type[torch.optim.Optimizer], process_group=None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, **defaults: Any):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError("optimizer_class must be a torch.optim.Optimizer class "
                            f"(e.g. torch.optim.AdamW), got {optimizer_class!r}")
        if overlap_with_ddp:
            raise NotImplementedError("ShardedOptimizer(overlap_with_ddp=True): stepping inside DDP's communication "
                                      "hook is torch's ZeroRedundancyOptimizer's alone; step after backward here")
        require_process_group("ShardedOptimizer")
        self.process_group = process_group
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.optimizer_class = optimizer_class
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._owner: Dict[torch.Tensor, int] = {}   # parameter -> owning rank (in group)
        self._loads = [0] * self.world_size
        self.optim: Optional[torch.optim.Optimizer] = None  # torch's name for the local optimizer
        self._buckets: List[Optional[torch.Tensor]] = []    # per rank, with parameters_as_bucket_view
        self._trainable: List[bool] = []
        self._consolidated: Optional[Dict[int, Any]] = None  # full state, on the rank it was consolidated to
        self._consolidated_to: Optional[int] = None
        super().__init__(params, defaults=defaults)
        _check_one_dense_type([p for g in self.param_groups for p in g["params"]])
        self.optim = optimizer_class([self._local_group(g) for g in self.param_groups], **defaults)
        self.defaults = self.optim.defaults  # every hyper-parameter, for groups added later
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self.state = self.optim.state  # this rank's parameters only
        self._build_buckets()

    # ------------------------------------------------------------------ partition
    def _assign(self, params: List[torch.Tensor]) -> None:
        """An owner for each parameter not seen yet: ``partition_parameters`` over their bytes,
        continued from what the groups before gave each rank."""
        new = list(dict.fromkeys(p for p in params if p not in self._owner))
        sizes = [p.numel() * p.element_size() for p in new]
        for r, owned in enumerate(partition_parameters(sizes, self.world_size, loads=self._loads)):
            for i in owned:
                self._owner[new[i]] = r
                self._loads[r] += sizes[i]

    def _local_group(self, group: Dict[str, Any]) -> Dict[str, Any]:
        self._assign(group["params"])
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [p for p in group["params"] if self._owner[p] == self.rank]
        return local

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if self.optim is not None:  # after construction: partition the new group too
            _check_one_dense_type([p for g in self.param_groups for p in g["params"]])
            self.optim.add_param_group(self._local_group(self.param_groups[-1]))
            _copy_hyperparameters(self.optim.param_groups[-1:], self.param_groups[-1:])
            self._build_buckets()

    @property
    def partition(self) -> List[List[torch.Tensor]]:
        """Per rank, the parameters it owns, in ``param_groups`` order."""
        out: List[List[torch.Tensor]] = [[] for _ in range(self.world_size)]
        for g in self.param_groups:
            for p in g["params"]:
                out[self._owner[p]].append(p)
        return out

    @torch.no_grad()
    def _build_buckets(self) -> None:
        """``parameters_as_bucket_view=True`` (torch's): each rank's trainable parameters become views
        of one flat tensor, its bucket, so sharing them after a step is one broadcast and no copy.
        Rebuilt when a parameter is frozen or unfrozen (a frozen one gets its own storage back)."""
        self._trainable = [p.requires_grad for g in self.param_groups for p in g["params"]]
        if not self.parameters_as_bucket_view:
            return
        self._buckets = []
        for params in self.partition:
            trainable = [p for p in params if p.requires_grad]
            for p in params:
                if not p.requires_grad:
                    p.data = p.data.clone()  # it may have been a view of an old bucket
            bucket = _flatten_dense_tensors([p.data for p in trainable]) if trainable else None
            for p, view in zip(trainable, _unflatten_dense_tensors(bucket, trainable) if trainable else ()):
                p.data = view
            self._buckets.append(bucket)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def _share_parameters(self) -> None:
        """Each owner broadcasts its updated parameters, packed in one flat buffer (with
        ``parameters_as_bucket_view``: the bucket the parameters are views of)."""
        if [p.requires_grad for g in self.param_groups for p in g["params"]] != self._trainable:
            self._build_buckets()  # a parameter was frozen or unfrozen since
        for r, params in enumerate(self.partition):
            params = [p for p in params if p.requires_grad]
            if not params:
                continue
            src = global_rank(self.process_group, r)
            if self.parameters_as_bucket_view:
                dist.broadcast(self._buckets[r], src=src, group=self.process_group)
                continue
            flat = (_flatten_dense_tensors([p.detach() for p in params]) if r == self.rank else
                    torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device))
            dist.broadcast(flat, src=src, group=self.process_group)
            if r != self.rank:
                for p, value in zip(params, _unflatten_dense_tensors(flat, params)):
                    p.copy_(value)

    def step(self, closure=None, **kwargs):
        """Step this rank's shard (``closure`` and keyword arguments passed on), then share the
        updated parameters with every rank."""
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure, **kwargs)
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._share_parameters()
        self._consolidated = self._consolidated_to = None
        return loss

    # ------------------------------------------------------------------ state dict
    def _global_index(self) -> Dict[torch.Tensor, int]:
        index: Dict[torch.Tensor, int] = {}
        for g in self.param_groups:
            for p in g["params"]:
                index[p] = len(index)
        return index

    def _local_state(self) -> Dict[int, Any]:
        """This rank's optimizer state, by global parameter index."""
        index = self._global_index()
        local_params = [p for lg in self.optim.param_groups for p in lg["params"]]
        return {index[local_params[i]]: s for i, s in self.optim.state_dict()["state"].items()}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's part of the optimizer state on rank ``to`` (every rank calls it);
        then call ``state_dict()`` there."""
        parts: Optional[List[Any]] = [None] * self.world_size if self.rank == to else None
        dist.gather_object(self._local_state(), parts, dst=global_rank(self.process_group, to),
                           group=self.process_group)
        self._consolidated = {i: s for part in parts for i, s in part.items()} if parts is not None else None
        self._consolidated_to = to

    def state_dict(self) -> Dict[str, Any]:
        """The full (unsharded) optimizer state dict. After ``consolidate_state_dict(to)``: on rank
        ``to`` only, no communication; otherwise a collective: call it on every rank."""
        state = self._consolidated
        if state is None:
            if self._consolidated_to is not None:
                raise RuntimeError(f"the state was consolidated on rank {self._consolidated_to} "
                                   f"(consolidate_state_dict(to={self._consolidated_to})): call state_dict() there")
            parts: List[Any] = [None] * self.world_size
            dist.all_gather_object(parts, self._local_state(), group=self.process_group)
            state = {i: s for part in parts for i, s in part.items()}
        index = self._global_index()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
                  for g in self.param_groups]
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
            g.update({k: v for k, v in sg.items() if k != "params"})
            ids = []
            for p, i in zip(g["params"], sg["params"]):
                if self._owner[p] == self.rank:
                    if i in state_dict["state"]:
                        local_state[j] = state_dict["state"][i]
                    ids.append(j)
                    j += 1
            local_groups.append({**{k: v for k, v in sg.items() if k != "params"}, "params": ids})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.optim.state
        self._consolidated = self._consolidated_to = None
