"""What kind of model is this? One answer for every piece that needs to know.

A training loop treats a model differently depending on how it is spread over
the ranks: who averages the gradients and when, how to turn that off for
gradient accumulation, where the full weights are for a checkpoint.
``GradientAccumulator``, ``TrainState`` and ``unwrap`` ask this module, and this
module asks the model's class, never its attributes:

=============  =========================  ==============================================
kind           the model is               gradients; checkpoint
=============  =========================  ==============================================
"local"        a plain module (also       one process, nothing to communicate;
               nn/mgpu_lab DataParallel)  ``state_dict()`` of the module
"torch_ddp"    torch DistributedData-     all-reduced in backward (decided in forward);
               Parallel                   ``.module.state_dict()``
"ddp"          NaiveDDP, BucketedDDP      all-reduced when backward ends; ``.module``
"fsdp"         mgpu_lab's FSDP            reduce-scattered into shards; its full
                                          ``state_dict()``; optimizer state per rank
"fully_shard"  a module torch's           DTensor shards; ``torch.distributed.checkpoint``
               ``fully_shard`` ran on     full state dicts
=============  =========================  ==============================================

A model that looks like a data-parallel wrapper (it has ``no_sync``,
``finish_gradient_synchronization``, ``set_requires_gradient_sync`` or
``require_backward_grad_sync``) but is none of these is refused with a
``TypeError``: treating it as a plain module could silently skip its communication.
``torch.compile``'s wrapper is looked through: the model it compiled is what counts.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from ..runtime.distributed import global_rank, rank_and_world_size
from .data_parallel import DataParallel
from .ddp import _DataParallelBase
from .fsdp import FSDP
from .zero import ShardedOptimizer

_WRAPPER_METHODS = ("no_sync", "finish_gradient_synchronization", "set_requires_gradient_sync",
                    "require_backward_grad_sync")


def _compiled(model):
    """The module ``torch.compile`` wrapped (its ``OptimizedModule`` keeps it as ``_orig_mod``), or ``model``."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def wrapper_kind(model: nn.Module) -> str:
    """``"local"``, ``"torch_ddp"``, ``"ddp"``, ``"fsdp"`` or ``"fully_shard"``; TypeError for an unknown wrapper."""
    model = _compiled(model)
    if isinstance(model, DistributedDataParallel):
        return "torch_ddp"
    if isinstance(model, _DataParallelBase):
        return "ddp"
    if isinstance(model, FSDP):
        return "fsdp"
    if _is_fully_shard(model):
        return "fully_shard"
    if isinstance(model, (nn.DataParallel, DataParallel)):
        return "local"
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module (the wrapper if there is one), got {type(model).__name__}")
    odd = [m for m in _WRAPPER_METHODS if hasattr(model, m)]
    if odd:
        raise TypeError(
            f"{type(model).__name__} has {odd} but is not a data-parallel wrapper mgpu_lab knows (torch "
            "DistributedDataParallel, NaiveDDP, BucketedDDP, FSDP, torch fully_shard, or a plain module): "
            "its gradients might never be synchronised. Wrap the model in one of those.")
    return "local"


def _is_fully_shard(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # an older torch
        return False
    return isinstance(model, FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose ``state_dict()`` is the plain model's: ``.module`` of DDP and DataParallel
    wrappers; an FSDP or a fully_shard module itself."""
    model = _compiled(model)
    while wrapper_kind(model) in ("torch_ddp", "ddp") or isinstance(model, (nn.DataParallel, DataParallel)):
        model = model.module
    return model


def process_group(model: nn.Module):
    """The process group the model's gradients are averaged over (None: the default group)."""
    model, kind = _compiled(model), wrapper_kind(model)
    if kind in ("torch_ddp", "ddp", "fsdp"):
        return model.process_group
    if kind == "fully_shard":  # the mesh dimension FSDP shards over (dp of a 2-D dp x tp mesh)
        return _fully_shard_group(model)
    return None


def _fully_shard_group(model: nn.Module):
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None) if isinstance(m, FSDPModule) else None
        if group is not None:  # private API (torch >= 2.6); else the parameters' own 1-D mesh
            return group.mesh_info.shard_process_group
    return next(p for p in model.parameters()).device_mesh.get_group()


def world_size(model: nn.Module) -> int:
    return 1 if wrapper_kind(model) == "local" else dist.get_world_size(process_group(model))


def is_sharded(model: nn.Module) -> bool:
    """Do the ranks hold different slices of the gradients (FSDP, fully_shard)?"""
    return wrapper_kind(model) in ("fsdp", "fully_shard")


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside add gradients up locally, without communication."""
    kind = wrapper_kind(model)
    if kind == "fully_shard":
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif kind == "local":
        yield
    else:
        with model.no_sync():
            yield


@torch.no_grad()
def synchronize_gradients(model: nn.Module, params: List[torch.Tensor]) -> None:
    """Average now what backward passes under ``no_sync`` accumulated (a window that ends by hand)."""
    kind = wrapper_kind(model)
    if kind in ("ddp", "fsdp"):
        model.finish_gradient_synchronization()
    elif kind == "torch_ddp":  # one flat all-reduce per dtype and device
        group, by_type = model.process_group, {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_type.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in by_type.values():
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)  # bounded by the process group's timeout
            for g, avg in zip(grads, _unflatten_dense_tensors(flat.div_(dist.get_world_size(group)), grads)):
                g.copy_(avg)
    elif kind == "fully_shard":
        raise RuntimeError("torch's fully_shard has no call that reduce-scatters gradients accumulated under "
                           "set_requires_gradient_sync(False): run the last backward of the window with it on")


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, params: List[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip by the (2-)norm of the whole gradient, over all ranks' shards when they are sharded."""
    if wrapper_kind(model) != "fsdp":
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # fully_shard: DTensors know their shards
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    grads = [p.grad for p in params if p.grad is not None]  # disjoint shards: add up squared norms
    squares = sum((g.float().norm() ** 2 for g in grads), torch.zeros((), device=params[0].device))
    dist.all_reduce(squares, group=model.process_group)
    total = squares.sqrt()
    if grads:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0).to(grads[0].dtype))
    return total


# --------------------------------------------------------------------------- checkpoints

def _full_options(rank0_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)


def model_state_dict(model: nn.Module, rank0_only: bool = False) -> Dict[str, Any]:
    """The plain model's state dict, full weights (a collective for sharded models; with
    ``rank0_only`` their other ranks get an empty dict)."""
    model, kind = _compiled(model), wrapper_kind(model)
    if kind == "fsdp":
        return model.state_dict(rank0_only=rank0_only)
    if kind == "fully_shard":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(model, options=_full_options(rank0_only))
    return unwrap(model).state_dict()


def load_model_state_dict(model: nn.Module, state_dict: Dict[str, Any]) -> None:
    """Load a plain model's state dict (full weights, on every rank) into any kind."""
    model = _compiled(model)
    if wrapper_kind(model) == "fully_shard":
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(model, state_dict, options=_full_options(False))
    else:
        unwrap(model).load_state_dict(state_dict)


def optimizer_state_dict(model: nn.Module, optimizer) -> Any:
    """The optimizer's state for a checkpoint, complete on rank 0 (every rank calls it).

    ZeRO optimizers: consolidated on rank 0; fully_shard: torch's full optimizer state dict;
    an optimizer over FSDP's shards: every rank's own state dict, gathered (resume on as many
    ranks); otherwise ``optimizer.state_dict()``.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model, kind = _compiled(model), wrapper_kind(model)
    rank = rank_and_world_size()[0]
    if isinstance(optimizer, (ShardedOptimizer, ZeroRedundancyOptimizer)):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if rank == 0 else None
    if kind == "fully_shard":
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return get_optimizer_state_dict(model, optimizer, options=_full_options(True))
    if kind == "fsdp":
        group = model.process_group
        parts = [None] * dist.get_world_size(group) if model.rank == 0 else None
        dist.gather_object(optimizer.state_dict(), parts, dst=global_rank(group, 0), group=group)
        return {"per_rank": parts}
    return optimizer.state_dict()


def load_optimizer_state_dict(model: nn.Module, optimizer, state_dict: Any) -> None:
    """Load what ``optimizer_state_dict`` returned on rank 0, on every rank."""
    model, kind = _compiled(model), wrapper_kind(model)
    if kind == "fully_shard":
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        set_optimizer_state_dict(model, optimizer, state_dict, options=_full_options(False))
    elif kind == "fsdp" and not isinstance(optimizer, ShardedOptimizer):
        parts = state_dict["per_rank"]
        if len(parts) != model.world_size:
            raise ValueError(f"the optimizer state was saved by {len(parts)} ranks holding FSDP shards; this run "
                             f"has {model.world_size}: resume on {len(parts)} ranks (the shards differ)")
        optimizer.load_state_dict(parts[model.rank])
    else:
        optimizer.load_state_dict(state_dict)
