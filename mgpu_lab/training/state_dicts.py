"""A model's and its optimizer's state under the plain model's names, whatever the layout.

A checkpoint resumes under another wrapper, mesh shape or number of ranks when it
keeps every tensor under the name it has in the plain model (``blocks.0.attn.wq.weight``)
and the optimizer's state *per parameter* under the same names, the convention of
``torch.distributed.checkpoint``::

    {"state": {"blocks.0.attn.wq.weight": {"step": ..., "exp_avg": ..., "exp_avg_sq": ...}, ...},
     "param_groups": [{"lr": ..., "betas": ..., "params": ["blocks.0.attn.wq.weight", ...]}, ...]}

Each layout holds a parameter its own way, and this module turns each into that
form and back:

=====================  ==============================================================
plain module, DDP      the whole tensor, on every rank
DTensor (``fully_      this rank's piece; its placements over the mesh say which
shard``, ``parallel-   (a 2-D FSDP x TP parameter is a quarter of the tensor on a
ize_module``, both)    2 x 2 mesh)
mgpu_lab ``FSDP``      one flat shard per unit, holding slices of several parameters
a pipeline stage       only its own parameters (a stage keeps the full model's names:
                       build it as the model with the other stages' layers removed)
ZeRO-1 optimizers      the state of this rank's parameters; consolidated on rank 0
=====================  ==============================================================

*Full* tensors (one file, ``full_state``) are gathered on every rank that holds a
piece, then merged on rank 0 (a pipeline's stages each add their names). *Sharded*
tensors (``sharded_state``, for ``torch.distributed.checkpoint``) stay where they are:
DTensors as they are, plain tensors whole (the writer keeps one copy). Loading takes
either and gives each rank its piece (``load_state``). Every function here is a
collective: every rank calls it.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import wrappers
from ..runtime.distributed import dtensor_module, is_dtensor, rank_and_world_size


@contextmanager
def _quiet_redistribute() -> Iterator[None]:
    """``full_tensor()`` of a 2-D piece logs a warning about sequential all-gathers: correct, only slower."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def describe_layout(model: nn.Module) -> str:
    """How the model is spread over the ranks, in words (written into checkpoints)."""
    kind = wrappers.wrapper_kind(model)
    _, world = rank_and_world_size()
    meshes = {tuple(p.device_mesh.mesh.shape): p.device_mesh.mesh_dim_names
              for p in wrappers.unwrap(model).parameters() if is_dtensor(p)}
    mesh = "; ".join(f"mesh {'x'.join(map(str, s))}{f' {n}' if n else ''}" for s, n in meshes.items())
    return f"{kind} on {world} rank(s)" + (f", DTensor parameters ({mesh})" if mesh else "")


# --------------------------------------------------------------------------- names of parameters

def _fsdp_groups(model: nn.Module) -> Dict[int, Any]:
    """mgpu_lab FSDP: id(flat shard) -> its FlatGroup."""
    model = wrappers.unwrap(model)
    return {id(g.shard): g for g in model.flat_groups} if wrappers.wrapper_kind(model) == "fsdp" else {}


def parameter_names(model: nn.Module) -> Dict[int, List[str]]:
    """id(parameter the optimizer sees) -> the plain model's names of what it holds (a tied
    parameter: its first name; an FSDP flat shard: every parameter in it)."""
    groups = _fsdp_groups(model)
    if groups:
        return {i: list(g.names) for i, g in groups.items()}
    return {id(p): [_plain_name(name)] for name, p in wrappers.unwrap(model).named_parameters()}


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _plain_name(name: str) -> str:
    """The name without what wrappers insert (``checkpoint_wrapper``, ``torch.compile``): the one
    ``state_dict()`` gives, so that a checkpoint loads with or without them."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


# --------------------------------------------------------------------------- pieces of tensors

def _full(t: torch.Tensor) -> torch.Tensor:
    if is_dtensor(t):
        with _quiet_redistribute():
            return t.full_tensor().detach()
    return t.detach()


def _piece_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` laid out as ``like`` (a DTensor, or a whole tensor)."""
    if not is_dtensor(like):
        return full.detach().to(like.device)
    if is_dtensor(full):  # loaded in place by torch.distributed.checkpoint: already the piece
        return full
    dt = dtensor_module()
    d = dt.distribute_tensor(full.detach().to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return dt.DTensor.from_local(d.to_local().clone(), like.device_mesh, like.placements, run_check=False,
                              shape=d.shape, stride=d.stride())


def _fsdp_full(model: nn.Module, group, shard_value: torch.Tensor) -> torch.Tensor:
    """All-gather a value shaped like an FSDP flat shard into the whole flat vector."""
    full = torch.empty(group.padded, dtype=shard_value.dtype, device=shard_value.device)
    wrappers.unwrap(model)._comm.all_gather(full, shard_value.detach().contiguous())
    return full


def _split_flat(group, flat: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {n: flat[o: o + s.numel()].view(s).clone() for n, s, o in zip(group.names, group.shapes, group.offsets)}


def _flat_piece(group, values: Dict[str, torch.Tensor], device) -> torch.Tensor:
    flat = torch.zeros(group.padded, dtype=values[group.names[0]].dtype, device=device)
    for n, s, o in zip(group.names, group.shapes, group.offsets):
        flat[o: o + s.numel()] = values[n].reshape(-1).to(device)
    lo = group.comm.rank * group.shard_numel
    return flat[lo: lo + group.shard_numel].clone()


# --------------------------------------------------------------------------- the model

def model_state(model: nn.Module, full: bool = True) -> Dict[str, torch.Tensor]:
    """The plain model's state dict on this rank: whole tensors (``full``), or DTensor pieces as
    they are. mgpu_lab FSDP gathers whole tensors either way."""
    kind = wrappers.wrapper_kind(model)
    if kind == "fsdp":
        return wrappers.unwrap(model).state_dict()
    sd = wrappers.unwrap(model).state_dict()
    return {k: _full(v) if full else v for k, v in sd.items()}


def load_model_state(model: nn.Module, state: Dict[str, torch.Tensor], what: str = "the checkpoint",
                     strict: bool = False) -> None:
    """Load a plain model's state (whole tensors, or pieces laid out as this model's) into any layout.
    Every name this rank's module has must be there; ``strict``: and no name that no rank's module
    has (names this rank lacks may be another stage's)."""
    module = wrappers.unwrap(model)
    targets = module.state_dict()  # this rank's pieces (mgpu_lab FSDP: whole tensors, gathered)
    missing = [k for k in targets if k not in state]
    if missing:
        raise KeyError(f"{what} has no {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                       f"({len(missing)} of this model's {len(targets)} tensors). It holds "
                       f"{_sample(state)}: build the same model (the names must match the plain module's) "
                       "before wrapping it")
    if strict:
        refuse_unexpected(model, state, what)
    for k, t in targets.items():
        if tuple(state[k].shape) != tuple(t.shape):
            raise ValueError(f"{what}: {k} has shape {tuple(state[k].shape)}, this model's {tuple(t.shape)}: "
                             "build the model with the checkpoint's sizes")
    if wrappers.wrapper_kind(model) == "fsdp":
        module.load_state_dict({k: _full(state[k]) for k in targets})
    else:
        with torch.no_grad():
            module.load_state_dict({k: _piece_like(state[k], t) for k, t in targets.items()})


def _sample(d: Dict[str, Any], n: int = 4) -> str:
    keys = list(d)
    return f"{len(keys)} tensors ({', '.join(keys[:n])}{', ...' if len(keys) > n else ''})"


# --------------------------------------------------------------------------- the optimizer

def _zero(optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from ..parallel.zero import ShardedOptimizer
    return isinstance(optimizer, (ShardedOptimizer, ZeroRedundancyOptimizer))


def optimizer_state(model: nn.Module, optimizer, full: bool = True) -> Optional[Dict[str, Any]]:
    """The optimizer's state per parameter name (see the module docstring): whole tensors
    (``full``) or pieces. ZeRO optimizers: complete on rank 0, None elsewhere."""
    names, groups = parameter_names(model), _fsdp_groups(model)
    if _zero(optimizer):
        optimizer.consolidate_state_dict(to=0)
        if rank_and_world_size()[0] != 0:
            return None
    sd = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    unknown = [i for i, p in enumerate(params) if id(p) not in names]
    if unknown:
        raise ValueError(f"the optimizer holds {len(unknown)} tensor(s) that are not parameters of the model: "
                         "build it over model.parameters() (for mgpu_lab FSDP: FSDP(net).parameters(), or "
                         "net.parameters() after wrapping)")
    state: Dict[str, Dict[str, Any]] = {}
    for i, p in enumerate(params):
        if i not in sd["state"]:
            continue
        group, these = groups.get(id(p)), names[id(p)]
        for n in these:
            state[n] = {}
        for key, value in sd["state"][i].items():
            shaped = torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == tuple(p.shape)
            if group is not None and shaped:
                for n, t in _split_flat(group, _fsdp_full(model, group, value)).items():
                    state[n][key] = t
            else:
                for n in these:
                    state[n][key] = (_full(value) if full else value) if torch.is_tensor(value) else value
    param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                     "params": [n for i in g["params"] for n in names[id(params[i])]]}
                    for g in sd["param_groups"]]
    return {"state": state, "param_groups": param_groups}


def load_optimizer_state(model: nn.Module, optimizer, saved: Dict[str, Any], what: str = "the checkpoint") -> None:
    """Load what ``optimizer_state`` gave (from any layout) into this optimizer, on every rank."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) or "param_groups" not in saved:
        raise ValueError(f"{what}: the optimizer state is not per parameter name")
    names, groups = parameter_names(model), _fsdp_groups(model)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"{what} holds {len(saved['param_groups'])} parameter group(s), this optimizer "
                         f"{len(optimizer.param_groups)}: build it with the same groups")
    index, state, out_groups = 0, {}, []
    for g, sg in zip(optimizer.param_groups, saved["param_groups"]):
        ids, allowed = [], set(sg["params"])
        for p in g["params"]:
            these = names.get(id(p))
            if these is None:
                raise ValueError("the optimizer holds a tensor that is not a parameter of the model")
            absent = [n for n in these if n not in allowed]
            if absent:
                raise KeyError(f"{what}: {absent[:3]} not in the same parameter group there (or not there at all; "
                               f"the group holds {len(allowed)} names): build the optimizer's groups as saved")
            have = [n in saved["state"] for n in these]
            if all(have):
                state[index] = _state_piece(p, these, groups.get(id(p)), saved["state"])
            elif any(have):
                raise KeyError(f"{what}: optimizer state for only some of {these}")
            ids.append(index)
            index += 1
        out_groups.append({**{k: v for k, v in sg.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": out_groups})  # ZeRO: keeps its part


def _state_piece(p, names: List[str], group, saved_state) -> Dict[str, Any]:
    first = saved_state[names[0]]
    out = {}
    for key, value in first.items():
        if not torch.is_tensor(value):
            out[key] = value
        elif group is not None:
            shapes = dict(zip(group.names, group.shapes))
            if value.dim() > 0 and tuple(value.shape) == tuple(shapes[names[0]]):
                out[key] = _flat_piece(group, {n: _full(saved_state[n][key]) for n in names}, p.device)
            else:
                out[key] = value.clone()
        elif value.dim() > 0 and tuple(value.shape) == tuple(p.shape):
            out[key] = _piece_like(value, p)
        elif value.dim() > 0:
            raise ValueError(f"optimizer state {key!r} of {names[0]} has shape {tuple(value.shape)}, the parameter "
                             f"{tuple(p.shape)}: build the model with the checkpoint's sizes")
        else:
            out[key] = value.clone()
    return out


# --------------------------------------------------------------------------- merging on rank 0

def merge_on_rank0(local: Dict[str, Any]) -> Dict[str, Any]:
    """The union of every rank's ``{name: value}`` on rank 0 (each name sent once, by the lowest
    rank holding it; nothing is sent when rank 0 holds every name, as without pipelines)."""
    rank, world = rank_and_world_size()
    if world == 1:
        return local
    keys: List[Any] = [None] * world
    dist.all_gather_object(keys, list(local))
    owner: Dict[str, int] = {}
    for r, ks in enumerate(keys):
        for k in ks:
            owner.setdefault(k, r)
    if all(r == 0 for r in owner.values()):
        return local if rank == 0 else {}
    mine = {k: v for k, v in local.items() if owner[k] == rank} if rank else {}
    parts: Optional[List[Any]] = [None] * world if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if rank != 0:
        return {}
    merged = dict(local)
    for part in parts[1:]:
        merged.update(part)
    return merged


def merge_optimizer_on_rank0(model: nn.Module, optimizer, state: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """``optimizer_state`` of every rank merged on rank 0 (a pipeline's stages hold different names)."""
    rank, world = rank_and_world_size()
    if world == 1 or _zero(optimizer):  # ZeRO: already complete on rank 0
        return state
    merged = merge_on_rank0(state["state"])
    groups: Optional[List[Any]] = [None] * world if rank == 0 else None
    dist.gather_object([g["params"] for g in state["param_groups"]], groups, dst=0)
    if rank != 0:
        return None
    param_groups = []
    for i, g in enumerate(state["param_groups"]):
        seen = list(g["params"])
        for other in groups[1:]:
            seen += [n for n in other[i] if n not in seen]
        param_groups.append({**g, "params": seen})
    return {"state": merged, "param_groups": param_groups}


def refuse_unexpected(model: nn.Module, saved: Dict[str, Any], what: str) -> None:
    """torch's ``load_state_dict(strict=True)``: names the model lacks are refused. A pipeline stage
    holds only its names: the ranks' names together are the model's."""
    names = set(wrappers.unwrap(model).state_dict())
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, sorted(names))
        names = set().union(*every)
    unexpected = sorted(set(saved) - names)
    if unexpected:
        raise KeyError(f"{what} holds {len(unexpected)} tensor(s) this model lacks: {unexpected[:6]}"
                       f"{' ...' if len(unexpected) > 6 else ''}. Build the model the checkpoint was saved from "
                       "(the same layers), or load(..., strict=False) to ignore them")


def load_legacy_optimizer(model: nn.Module, optimizer, state: Dict[str, Any], what: str) -> None:
    """Format 1 (before per-parameter state): loads only under the layout that wrote it."""
    saved = state["optimizer"]
    if isinstance(saved, dict) and "per_rank" in saved:
        parts = saved["per_rank"]
        kind = wrappers.wrapper_kind(model)
        n = wrappers.world_size(model) if kind != "local" else 1
        if kind != "fsdp" or len(parts) != n:
            raise ValueError(f"{what}: its optimizer state is mgpu_lab FSDP's per-rank state of {len(parts)} ranks "
                             f"(an older format); this run is {kind} on {n} rank(s). Resume once under FSDP on "
                             f"{len(parts)} ranks and save again: the new format is per parameter and loads anywhere")
        optimizer.load_state_dict(parts[wrappers.unwrap(model).rank])
        return
    try:
        optimizer.load_state_dict(saved)
    except (KeyError, ValueError, IndexError, RuntimeError) as exc:
        raise ValueError(f"{what}: its optimizer state is the optimizer's own state dict (an older format, by "
                         f"parameter index) and does not fit this optimizer ({type(exc).__name__}: {exc}). Resume "
                         "once under the layout that wrote it and save again: the new format loads anywhere") from exc
