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
``FSDP(module, units=None)``: by default every direct child of ``module`` is a
unit (for a transformer, pass the blocks: ``units=model.blocks``, as one applies
``fully_shard`` to each block). Parameters of ``module`` outside every unit form
the *root* unit, gathered for the whole forward and the whole backward. A
parameter reachable from two units (tied weights: the output head sharing the
embedding) also goes to the root unit, so it is gathered once and its gradient
(both uses summed by autograd) reduce-scattered once; ``units`` reports where each
parameter went. A unit must run at most once per forward.

Within a unit, the parameters are flattened into one buffer per ``requires_grad``
value (FSDP1's ``FlatParameter``), padded to a multiple of N; rank r keeps slice r
of it as an ``nn.Parameter`` (fp32 master weights). Frozen parameters are sharded
and gathered too, but never reduced.

How the hooks work: a forward pre-hook gathers each unit's flat groups
(:mod:`mgpu_lab.parallel.flat_param`), a forward hook frees them and hooks the
unit's outputs, so that backward gathers them again before the unit's backward;
the reduce-scatter starts as soon as a group's full gradient is complete.

Mixed precision: with ``compute_dtype`` the shards are cast before the all-gather
(half the bytes on the wire), compute runs in that dtype (floating-point inputs
of the root and of every unit are cast, as FSDP2 does; buffers are not),
gradients are reduce-scattered in it and added to fp32 shard gradients. Every rank must use the same parameters in every step (as
FSDP2 requires); reduce-scatters are issued in backward order.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .flat_param import FlatGroup, _all_gather


class FSDP(nn.Module):
    """Fully sharded data parallel: every rank stores 1/N of each unit's parameters.

    ``parameters()`` yields the local fp32 shards: build the optimizer over them.
    Call ``finish_gradient_synchronization()`` after backward, before the step.
    """

    def __init__(self, module: nn.Module, compute_dtype: Optional[torch.dtype] = None,
                 units: Optional[Iterable[nn.Module]] = None, group=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype must be a floating-point torch.dtype, got {compute_dtype!r}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: build the model inside "
                               "mgpu_lab.launch(...) or after mgpu_lab.init_distributed()")
        self.module, self.group, self.compute_dtype = module, group, compute_dtype
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._src = 0 if group is None else dist.get_global_rank(group, 0)
        self.comm_bytes = {"all-gather": 0, "reduce-scatter": 0}  # sent by this rank, computed
        unit_modules = list(module.children()) if units is None else list(units)
        names = {id(m): n for n, m in module.named_modules()}
        for m in unit_modules:
            if id(m) not in names or m is module:
                raise ValueError("every unit must be a submodule of the wrapped module (not the module itself)")
        # Which unit uses each parameter (every occurrence, tied ones included).
        owner: Dict[int, set] = {}
        slots: Dict[int, List[Tuple[nn.Module, str]]] = {}
        pname: Dict[int, str] = {}
        params: Dict[int, nn.Parameter] = {}
        for mname, m in module.named_modules(remove_duplicate=False):
            inside = [u for u in unit_modules if mname == names[id(u)] or mname.startswith(names[id(u)] + ".")]
            unit = max(inside, key=lambda u: len(names[id(u)]), default=None)  # the innermost unit
            for attr, p in m._parameters.items():
                if p is None:
                    continue
                owner.setdefault(id(p), set()).add(id(unit) if unit is not None else None)
                if (m, attr) not in [(a, b) for a, b in slots.get(id(p), [])]:
                    slots.setdefault(id(p), []).append((m, attr))
                pname.setdefault(id(p), f"{mname}.{attr}" if mname else attr)
                params[id(p)] = p
        self._aliases = {pname[i]: [f"{names[id(m)]}.{a}".lstrip(".") for m, a in slots[i]] for i in params}
        self._units: List[Tuple[str, Optional[nn.Module], List[FlatGroup]]] = []
        for u in [None] + unit_modules:
            key = id(u) if u is not None else None
            mine = [i for i in params if (owner[i] == {key}) or (u is None and len(owner[i]) > 1)]
            uname = "<root>" if u is None else names[id(u)]
            groups = []
            for rg in (True, False):
                entries = [(pname[i], params[i], slots[i]) for i in mine if params[i].requires_grad == rg]
                if entries:
                    groups.append(FlatGroup(self, uname, entries, rg))
            self._units.append((uname, u, groups))
            if u is not None and groups:
                u.register_forward_pre_hook(self._pre_forward(groups), with_kwargs=True)
                u.register_forward_hook(self._post_forward(groups))
        self._shards = nn.ParameterList([g.shard for _, _, gs in self._units for g in gs])
        with torch.no_grad():
            for b in module.buffers():
                dist.broadcast(b, src=self._src, group=group)
        self._backward_started = False
        self._ran = None

    # --------------------------------------------------------------- introspection
    @property
    def units(self) -> Dict[str, List[str]]:
        """Unit name -> the parameters it holds (``<root>``: outside every unit, or tied across units)."""
        return {n: [p for g in gs for p in g.names] for n, _, gs in self._units if gs}

    @property
    def flat_groups(self) -> List[FlatGroup]:
        return [g for _, _, gs in self._units for g in gs]

    def _collective(self, fn, out, inp, what: str, async_op: bool = False):
        n = self.world_size
        self.comm_bytes[what] += (n - 1) * (out if what == "all-gather" else inp).numel() // n * out.element_size()
        try:
            return fn(out, inp, group=self.group, async_op=async_op)
        except RuntimeError as e:
            raise RuntimeError(f"rank {dist.get_rank()}: FSDP {what} failed ({e}). Every rank must run the "
                               "same units in the same order (same forward, same backward).") from e

    # --------------------------------------------------------------- hooks
    def _pre_forward(self, groups):
        def hook(module, args, kwargs):
            if self._ran is not None:
                if id(module) in self._ran:
                    raise RuntimeError(
                        f"FSDP unit '{groups[0].unit}' ran twice in one forward: its second backward would "
                        "need the parameters the first one already freed. Make the module that calls it "
                        "twice the unit (units=[...]), or leave it out of units (the root unit).")
                self._ran.add(id(module))
            for g in groups:
                g.gather()
            return self._cast(args), self._cast(kwargs)
        return hook

    def _cast(self, obj):
        """Floating-point tensors in ``obj`` to ``compute_dtype`` (FSDP2's cast_forward_inputs)."""
        if self.compute_dtype is None:
            return obj
        if isinstance(obj, torch.Tensor):
            return obj.to(self.compute_dtype) if obj.is_floating_point() else obj
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._cast(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self._cast(v) for k, v in obj.items()}
        return obj

    def _post_forward(self, groups):
        def hook(module, args, output):
            for g in groups:
                g.free()
            self._register_pre_backward(output, groups)
        return hook

    def _register_pre_backward(self, output, groups) -> None:
        tensors = [t for t in _flatten(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return

        def pre_backward(grad):
            if not self._backward_started:  # once per backward: free everything at its end
                self._backward_started = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            for g in groups:
                g.regather()
            return grad
        for t in tensors:
            t.register_hook(pre_backward)

    def _end_of_backward(self) -> None:
        self._backward_started = False
        for g in self.flat_groups:
            g.free()

    # --------------------------------------------------------------- public
    def forward(self, *args, **kwargs):
        root = self._units[0][2]
        for g in root:
            g.gather()
        self._ran = set()  # units entered during this forward
        try:
            out = self.module(*self._cast(args), **self._cast(kwargs))
        finally:
            self._ran = None
        for g in root:
            g.free()
        self._register_pre_backward(out, root)
        return out

    def finish_gradient_synchronization(self) -> None:
        """Wait for the reduce-scatters; each shard's ``.grad`` gets its averaged slice."""
        for g in self.flat_groups:
            g.finish()

    @torch.no_grad()
    def gather_full_params(self) -> Dict[str, torch.Tensor]:
        """Every parameter, full and fp32, under every name it has (tied ones twice). A collective."""
        out: Dict[str, torch.Tensor] = {}
        for g in self.flat_groups:
            full = torch.empty(g.padded, dtype=g.shard.dtype, device=g.shard.device)
            _all_gather(full, g.shard.detach(), group=self.group)
            for name, shape, off in zip(g.names, g.shapes, g.offsets):
                value = full[off: off + shape.numel()].view(shape).clone()
                for alias in self._aliases[name]:
                    out[alias] = value
        return out


def _flatten(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _flatten(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _flatten(o)
