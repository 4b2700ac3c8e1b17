"""The gradient's norm over every rank's pieces, whatever the layout, computed once.

Clipping by the global norm ``||g|| = sqrt(sum of every element squared)`` needs every
element exactly once. Each layout holds the gradient its own way: whole on every rank
(DDP: W copies), as DTensor pieces (``fully_shard``: 1/N each; ``parallelize_module``:
sharded over some mesh dimensions, replicated over others; a 2-D mesh: both), as flat
shards (mgpu_lab's FSDP), or split by layers over pipeline stages. torch's
``clip_grad_norm_`` takes one kind at a time: a model mixing DTensor and plain
parameters, or DTensors on two meshes (the 1-D FSDP mesh of a norm's weight, the 2-D
mesh of a tensor-parallel weight), raises.

Here every rank adds up the squares of what it holds, each piece weighted by 1/r, r the
number of ranks holding that same piece (a replicated norm weight on the 2 ranks of a
tensor-parallel group: 1/2 each), and one all-reduce of one number over all ranks sums
every element once. Which rank holds which piece is found once, by name and offset
(``all_gather_object`` of the pieces' names), and cached. Cost per call: one pass over
the local gradients and one all-reduce of a scalar. Every rank must call it together.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..runtime._diagnosis import collective_failed
from ..runtime.distributed import is_dtensor, rank_and_world_size

Piece = Tuple  # (names..., offset or rank): the same on every rank holding the same elements


def piece_of(param: torch.Tensor, names: Sequence[str], flat_rank: int = -1) -> Piece:
    """What part of the model ``param`` holds: its names, and where its elements start."""
    if is_dtensor(param):
        if any(pl.is_partial() for pl in param.placements):
            raise ValueError(f"{names[0]}: a Partial DTensor (a sum not yet reduced) has no norm of its own")
        try:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        except ImportError:  # torch < 2.5
            from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return (*names, tuple(offset))
    return (*names, flat_rank)


def replication(pieces: List[Piece]) -> List[int]:
    """For each of this rank's pieces, how many ranks hold it (a collective, once)."""
    world = rank_and_world_size()[1]
    if world == 1:
        return [1] * len(pieces)
    everyone: List = [None] * world
    dist.all_gather_object(everyone, pieces)
    counts: Dict[Piece, int] = {}
    for theirs in everyone:
        for piece in set(theirs):
            counts[piece] = counts.get(piece, 0) + 1
    return [counts[p] for p in pieces]


class GlobalGradNorm:
    """``norm(grads)`` and ``clip_(grads, max_norm)`` over ``params`` (this rank's), each element once.

    ``pieces[i]`` says what ``params[i]`` holds (:func:`piece_of`); built by the caller, who knows
    the names (``GradientAccumulator`` does it from the model)."""

    def __init__(self, params: List[torch.Tensor], pieces: List[Piece]):
        self.params = params
        self.weights = [1.0 / r for r in replication(pieces)]

    @torch.no_grad()
    def norm(self) -> torch.Tensor:
        device = self.params[0].device if self.params else torch.device("cpu")
        local, weights = [], []
        for p, w in zip(self.params, self.weights):
            if p.grad is not None:
                g = p.grad.to_local() if is_dtensor(p.grad) else p.grad
                local.append(g)
                weights.append(w)
        total = torch.zeros((), dtype=torch.float64, device=device)
        if local:
            norms = torch.stack([n.to(torch.float64) for n in torch._foreach_norm(local)]).to(device)
            total = (norms.square() * torch.tensor(weights, dtype=torch.float64, device=device)).sum()
        if rank_and_world_size()[1] > 1:
            if dist.get_backend() == "nccl" and total.device.type != "cuda":
                total = total.cuda()
            try:
                dist.all_reduce(total)  # the one collective: every element's square, counted once
            except RuntimeError as exc:
                raise collective_failed("the gradient norm (all-reduce)", exc, None,
                                        "Every rank must clip together.") from exc
        return total.sqrt().float().to(device)

    @torch.no_grad()
    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by min(1, max_norm / norm); returns the norm before clipping."""
        total = self.norm()
        grads = [p.grad.to_local() if is_dtensor(p.grad) else p.grad
                 for p in self.params if p.grad is not None]
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_kind: Dict[Tuple, List[torch.Tensor]] = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for (device, dtype), same in by_kind.items():
            torch._foreach_mul_(same, coef.to(device, dtype))
        return total
