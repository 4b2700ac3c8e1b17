"""Fully sharded data parallel (ZeRO stage 3) from scratch.

ZeRO-1 shards the optimizer state; ZeRO-3 shards everything. Each rank stores
1/N of every parameter, of its gradient and of its optimizer state, and
rebuilds a layer's full parameters only while that layer computes:

* **forward**: just before a *unit* runs, all-gather its parameters (every rank
  sends its shard, receives the N-1 others); run it; free the full parameters.
* **backward**: just before the unit's backward, all-gather them again; once
  its gradients are complete, *reduce-scatter* them (sum across ranks, each rank
  receives only its own slice), free the full parameters, divide by N.
* **optimizer**: an ordinary optimizer over the local shards (``parameters()``)
  updates 1/N of the model on each rank; nothing else needs sending.

Memory per rank: (params + grads + optimizer state)/N, plus the full parameters
of the unit(s) being computed. Communication per step: two all-gathers and one
reduce-scatter of Ψ, each Ψ·(N-1)/N per rank: 3Ψ·(N-1)/N, 1.5x DDP's all-reduce
(2Ψ·(N-1)/N). Memory bought with bandwidth.

What a unit is
--------------
``FSDP(module, units=...)``: by default every direct child of ``module`` is a
unit (for a transformer, pass the blocks: ``units=model.blocks``, as one applies
``fully_shard`` to each block); a list in ``units`` is one unit of several modules
(``units=[[model.q, model.k], ...]``, as ``fully_shard([q, k])``): one flat group,
gathered when the first of them runs and freed once all of them have. Parameters
of ``module`` outside every unit form the *root* unit, gathered for the whole forward and the whole backward. A
parameter reachable from two units (tied weights: the output head sharing the
embedding) also goes to the root unit, so it is gathered once and its gradient
(both uses summed by autograd) reduce-scattered once; ``units`` reports where each
parameter went. A unit may run several times in one forward (a layer applied
twice, a block shared by two paths), as with ``fully_shard``: each call gathers the
parameters and frees them, each call's backward gathers them again and
reduce-scatters its part of the gradient, and the parts add up in the shard's
``.grad`` (k calls cost k times the communication). Within a unit, the
parameters sharing ``requires_grad`` are one :class:`~mgpu_lab.parallel.flat_param.FlatGroup`;
frozen parameters are sharded and gathered too, but never reduced.

How the hooks work: a forward pre-hook gathers each unit's flat groups, a
forward hook frees them and hooks the unit's outputs (found in any nesting of
tuples, lists, dicts, namedtuples and registered dataclasses by
``torch.utils._pytree``), so that backward gathers them again before the unit's
backward. The first of those hooks queues a callback with autograd's engine that
runs when backward ends: it waits for the reduce-scatters, so the shards'
``.grad`` are complete when ``backward()`` returns (as FSDP2's final callback).

The shards stay reachable from the wrapped module, as FSDP1 registers its flat
parameters (``unit._flat_param``; ``_flat_param_frozen`` for frozen ones): an
optimizer over ``net.parameters()`` gets the same shards as one over
``FSDP(net).parameters()``, as with torch's ``fully_shard``.

Training with it: ``state_dict()`` / ``load_state_dict()`` hold the full weights
under the plain module's names (a collective), so a checkpoint loads into the
unwrapped model; ``no_sync()`` (FSDP2: ``set_requires_gradient_sync(False)``)
adds full gradients up locally, one full gradient per rank, until a synchronised
backward.

Mixed precision, named as FSDP2's ``MixedPrecisionPolicy``: ``param_dtype`` for
the all-gathers (half the bytes) and compute (floating-point inputs of the root
and of every unit are cast; buffers are not), ``reduce_dtype`` for the gradient
reduce-scatter: by default the parameters' own dtype (fp32 master weights sum
their gradients in fp32), where FSDP2 defaults to ``param_dtype``. The options
are keyword-only, as FSDP2's: ``FSDP(module, param_dtype=torch.bfloat16,
units=model.blocks, process_group=pg)``. Every rank must use the same
parameters in every step (as FSDP2 requires).
"""
from __future__ import annotations

import dataclasses
import functools
import pickle
from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._pytree import tree_leaves, tree_map_only

from ..runtime.distributed import require_process_group
from .flat_param import Comm, FlatGroup


def _check_dtype(name: str, dtype) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{name} must be a floating-point torch.dtype, got {dtype!r}")


class FSDP(nn.Module):
    """Fully sharded data parallel: every rank stores 1/N of each unit's parameters.

    ``parameters()`` yields the local fp32 shards: build the optimizer over them.
    Gradients are reduce-scattered and averaged by the time ``backward()`` returns.
    """

    def __init__(self, module: nn.Module, *, param_dtype: Optional[torch.dtype] = None,
                 reduce_dtype: Optional[torch.dtype] = None, units: Optional[Iterable] = None,
                 process_group=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
        _check_dtype("param_dtype", param_dtype)
        _check_dtype("reduce_dtype", reduce_dtype)
        require_process_group("FSDP")
        self.module, self.process_group = module, process_group
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self._comm = Comm(process_group)
        self.rank, self.world_size = self._comm.rank, self._comm.world_size
        self._state_keys = list(module.state_dict().keys())  # the plain module's, in its order
        # A unit is a module, or a list of modules sharded as one group (fully_shard([a, b])).
        specs = [tuple(u) if isinstance(u, (list, tuple)) else (u,)
                 for u in (module.children() if units is None else units)]
        names = {id(m): n for n, m in module.named_modules()}
        for m in (m for spec in specs for m in spec):
            if id(m) not in names or m is module:
                raise ValueError("every unit must be a submodule of the wrapped module (not the module itself), "
                                 "or a list of submodules sharded together")
        member_of = {id(m): k for k, spec in enumerate(specs) for m in spec}
        # Which unit uses each parameter (every occurrence, tied ones included).
        owner: Dict[int, set] = {}
        slots: Dict[int, List[Tuple[nn.Module, str]]] = {}
        pname: Dict[int, str] = {}
        params: Dict[int, nn.Parameter] = {}
        for mname, m in module.named_modules(remove_duplicate=False):
            inside = [u for u in member_of if mname == names[u] or mname.startswith(names[u] + ".")]
            unit = max(inside, key=lambda u: len(names[u]), default=None)  # the innermost unit
            for attr, p in m._parameters.items():
                if p is None:
                    continue
                owner.setdefault(id(p), set()).add(member_of[unit] if unit is not None else None)
                if (m, attr) not in [(a, b) for a, b in slots.get(id(p), [])]:
                    slots.setdefault(id(p), []).append((m, attr))
                pname.setdefault(id(p), f"{mname}.{attr}" if mname else attr)
                params[id(p)] = p
        self._aliases = {pname[i]: [f"{names[id(m)]}.{a}".lstrip(".") for m, a in slots[i]] for i in params}
        self._units: List[Tuple[str, Optional[nn.Module], List[FlatGroup]]] = []
        self._to_run: List[set] = [set() for _ in specs]  # members of a unit yet to finish this call
        for k, spec in [(None, None)] + list(enumerate(specs)):
            mine = [i for i in params if (owner[i] == {k}) or (k is None and len(owner[i]) > 1)]
            uname = "<root>" if k is None else "+".join(names[id(m)] for m in spec)
            groups = []
            for rg in (True, False):
                entries = [(pname[i], params[i], slots[i]) for i in mine if params[i].requires_grad == rg]
                if entries:
                    groups.append(FlatGroup(uname, entries, rg, self._comm, param_dtype, reduce_dtype))
            self._units.append((uname, None if k is None else spec[0], groups))
            for m in (spec if k is not None and groups else ()):  # bound methods, not closures
                m.register_forward_pre_hook(functools.partial(self._pre_forward, k, spec), with_kwargs=True)
                m.register_forward_hook(functools.partial(self._post_forward, k))
        self._shards = nn.ParameterList([g.shard for _, _, gs in self._units for g in gs])
        for _, u, gs in self._units:  # reachable from the plain module too, as fully_shard keeps them:
            for g in gs:              # an optimizer over net.parameters() gets the same shards
                (module if u is None else u).register_parameter(
                    "_flat_param" if g.requires_grad else "_flat_param_frozen", g.shard)
        with torch.no_grad():
            for b in module.buffers():
                dist.broadcast(b, src=self._comm.src, group=process_group)
        self._backward_started = False

    def __getstate__(self):
        raise pickle.PicklingError(
            "mgpu_lab's FSDP does not pickle (torch's fully_shard models do not either): save the full "
            "weights with torch.save(model.state_dict(), path) (a collective), or a sharded checkpoint with "
            "torch.distributed.checkpoint / TrainState(sharded=True)")

    # --------------------------------------------------------------- introspection
    @property
    def units(self) -> Dict[str, List[str]]:
        """Unit name -> the parameters it holds (``<root>``: outside every unit, or tied across units)."""
        return {n: [p for g in gs for p in g.names] for n, _, gs in self._units if gs}

    @property
    def flat_groups(self) -> List[FlatGroup]:
        return [g for _, _, gs in self._units for g in gs]

    @property
    def comm_bytes(self) -> Dict[str, int]:
        """Bytes this rank sent, per collective (computed, not measured)."""
        return self._comm.bytes

    # --------------------------------------------------------------- hooks
    def _pre_forward(self, k, spec, module, args, kwargs):
        """Gather unit k's parameters when the first of its modules starts (fully_shard's group hooks)."""
        groups = self._units[k + 1][2]
        if not self._to_run[k]:
            self._to_run[k].update(spec)
            for g in groups:
                g.gather()
        return self._cast((args, kwargs), f"the input of unit '{groups[0].unit}'")

    def _cast(self, tree, what: str):
        """Floating-point tensors in ``tree`` to ``param_dtype`` (FSDP2's cast_forward_inputs)."""
        if self.param_dtype is None:
            return tree
        _leaves(tree, what)
        return tree_map_only(torch.Tensor, lambda t: t.to(self.param_dtype) if t.is_floating_point() else t, tree)

    def _post_forward(self, k, module, args, output):
        """Free unit k's parameters when the last of its modules has run (a module that does not run
        keeps its unit's parameters gathered until that unit's backward)."""
        self._to_run[k].discard(module)
        if not self._to_run[k]:
            groups = self._units[k + 1][2]
            self._release(output, groups, f"the output of unit '{groups[0].unit}'")

    def _release(self, output, groups, what: str) -> None:
        """Free this call's full parameters; hook its output so its backward gathers them again."""
        fulls = [g.full for g in groups]  # this call's buffers (the unit may run again)
        for g in groups:
            g.free()
        leaves = [output] if isinstance(output, torch.Tensor) else _leaves(output, what)  # the usual case: fast
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]

        def pre_backward(grad):
            if not self._backward_started:  # once per backward: finish everything at its end
                self._backward_started = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            for g, full in zip(groups, fulls):
                g.regather(full)
            return grad
        for t in tensors:
            t.register_hook(pre_backward)

    def _end_of_backward(self) -> None:
        self._backward_started = False
        for g in self.flat_groups:
            g.free_all()
        self.finish_gradient_synchronization()

    # --------------------------------------------------------------- public
    def forward(self, *args, **kwargs):
        self._backward_started = False  # a backward that failed half-way may have left it set
        root = self._units[0][2]
        for g in root:
            g.gather()
        args, kwargs = self._cast((args, kwargs), "the input")
        try:
            out = self.module(*args, **kwargs)
        finally:
            for to_run in self._to_run:  # a group whose modules did not all run stays gathered
                to_run.clear()
        self._release(out, root, "the output")
        return out

    def finish_gradient_synchronization(self) -> None:
        """Wait for the reduce-scatters (the end-of-backward callback does it); outside ``no_sync``,
        reduce-scatter what backward passes inside it accumulated. A no-op when nothing is pending."""
        for g in self.flat_groups:
            g.finish()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch: False keeps full gradients and adds them up locally (no communication)."""
        for g in self.flat_groups:
            g.reduce_grads = bool(requires_gradient_sync)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full gradients locally; the next synchronised
        backward (or ``finish_gradient_synchronization()`` outside) reduce-scatters the sum."""
        previous = [g.reduce_grads for g in self.flat_groups]
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for g, p in zip(self.flat_groups, previous):
                g.reduce_grads = p

    @torch.no_grad()
    def gather_full_params(self) -> Dict[str, torch.Tensor]:
        """Every parameter, full and fp32, under every name it has (tied ones twice). A collective."""
        out: Dict[str, torch.Tensor] = {}
        for g in self.flat_groups:
            full = torch.empty(g.padded, dtype=g.shard.dtype, device=g.shard.device)
            self._comm.all_gather(full, g.shard.detach())
            for name, shape, off in zip(g.names, g.shapes, g.offsets):
                value = full[off: off + shape.numel()].view(shape).clone()
                for alias in self._aliases[name]:
                    out[alias] = value
        return out

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False, *, rank0_only: bool = False):
        """The plain module's state dict: full weights and buffers, its names, its order. A collective;
        with ``rank0_only`` the other ranks get an empty dict."""
        full = {**self.gather_full_params(), **self.module.state_dict()}  # the module holds only buffers now
        out = {} if destination is None else destination
        if not rank0_only or self.rank == 0:
            for k in self._state_keys:
                out[prefix + k] = full[k]
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load full weights (a plain module's state dict): each rank keeps its shards' slices."""
        missing = [k for k in self._state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._state_keys]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for FSDP({type(self.module).__name__}): "
                               f"missing keys {missing}, unexpected keys {unexpected}")
        for g in self.flat_groups:
            if any(n not in state_dict for n in g.names):
                continue  # missing (strict=False): keep the current values
            full = torch.zeros(g.padded, dtype=g.shard.dtype, device=g.shard.device)
            for name, shape, off in zip(g.names, g.shapes, g.offsets):
                full[off: off + shape.numel()] = state_dict[name].reshape(-1)
            lo = self.rank * g.shard_numel
            g.shard.copy_(full[lo: lo + g.shard_numel])
        buffers = {k: v for k, v in state_dict.items() if k in self.module.state_dict()}
        self.module.load_state_dict(buffers, strict=False)
        return _IncompatibleKeys(missing, unexpected)


def _leaves(tree, what: str) -> list:
    """The leaves of a nested structure, by ``torch.utils._pytree``; a dataclass it cannot
    look into is an error (its tensors would be missed), not a silent leaf."""
    leaves = tree_leaves(tree)
    for leaf in leaves:
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            name = type(leaf).__name__
            raise TypeError(f"FSDP: {what} holds a {name} dataclass, which torch.utils._pytree cannot look into, "
                            f"so its tensors would be missed. Register it once: "
                            f"torch.utils._pytree.register_dataclass({name})")
    return leaves
