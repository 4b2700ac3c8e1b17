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

How the hooks work: a forward pre-hook all-gathers into a fresh buffer through an
autograd function (``_Gather``) and points the module's attributes at views of it;
a forward hook frees the buffer's storage (``untyped_storage().resize_(0)``, the
views autograd saved stay valid objects) and puts a hook on the unit's outputs
that re-gathers into the same storage when backward reaches the unit.
``_Gather.backward`` receives the full gradient, starts an asynchronous
reduce-scatter and frees the storage; ``finish_gradient_synchronization()`` waits,
divides by N and adds the slices into the shards' ``.grad``.

Mixed precision: with ``compute_dtype`` the shards are cast before the all-gather
(half the bytes on the wire), compute runs in that dtype (the floating-point
inputs of the root and of every unit are cast, as FSDP2 does; buffers are not), gradients are reduce-scattered in it and added to fp32
shard gradients. Every rank must use the same parameters in every step (as
FSDP2 requires); reduce-scatters are issued in backward order.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _FlatGroup:
    """The parameters of one unit that share requires_grad, as one sharded flat buffer."""

    def __init__(self, fsdp: "FSDP", unit: str, entries, requires_grad: bool):
        self.fsdp, self.unit, self.requires_grad = fsdp, unit, requires_grad
        self.names: List[str] = []
        self.slots: List[List[Tuple[nn.Module, str]]] = []  # where each parameter is used
        self.shapes, self.offsets = [], []
        total = 0
        for name, param, slots in entries:
            self.names.append(name)
            self.slots.append(slots)
            self.shapes.append(param.shape)
            self.offsets.append(total)
            total += param.numel()
        n = fsdp.world_size
        self.numel = total
        self.padded = -(-total // n) * n
        self.shard_numel = self.padded // n
        self.padding = self.padded - total
        first = entries[0][1]
        flat = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1) for _, p, _ in entries], out=flat[:total])
        dist.broadcast(flat, src=fsdp._src, group=fsdp.group)  # everyone starts from rank 0's weights
        lo = fsdp.rank * self.shard_numel
        self.shard = nn.Parameter(flat[lo: lo + self.shard_numel].clone(), requires_grad=requires_grad)
        self.full: Optional[torch.Tensor] = None
        self.pending: List[Tuple[object, torch.Tensor]] = []
        for slots in self.slots:
            for module, attr in slots:
                del module._parameters[attr]

    # --------------------------------------------------------------- gather / free
    @property
    def gathered(self) -> bool:
        return self.full is not None and self.full.untyped_storage().nbytes() > 0

    def gather(self) -> None:
        """Forward: all-gather into a fresh buffer (autograd-tracked), point the modules at it."""
        dtype = self.fsdp.compute_dtype or self.shard.dtype
        self.full = _Gather.apply(self.shard, self, dtype)
        for name_slots, shape, off in zip(self.slots, self.shapes, self.offsets):
            view = self.full[off: off + shape.numel()].view(shape)
            for module, attr in name_slots:
                setattr(module, attr, view)

    @torch.no_grad()
    def regather(self) -> None:
        """Backward: refill the freed storage (the views autograd saved point into it)."""
        if self.full is None or self.gathered:
            return
        buf = self.full.data  # own version counter: autograd's saved views stay valid
        buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        self.fsdp._collective(_all_gather, buf, self.shard.detach().to(buf.dtype), "all-gather")

    def free(self) -> None:
        if self.gathered:
            self.full.untyped_storage().resize_(0)

    @torch.no_grad()
    def reduce_scatter(self, full_grad: torch.Tensor) -> None:
        out = torch.empty(self.shard_numel, dtype=full_grad.dtype, device=full_grad.device)
        work = self.fsdp._collective(_reduce_scatter, out, full_grad.contiguous(), "reduce-scatter",
                                     async_op=True)
        self.pending.append((work, out))

    @torch.no_grad()
    def finish(self) -> None:
        for work, out in self.pending:
            work.wait()  # bounded by the process group's timeout
            out = out.to(self.shard.dtype).div_(self.fsdp.world_size)
            if self.shard.grad is None:
                self.shard.grad = out
            else:
                self.shard.grad.add_(out)
        self.pending.clear()


class _Gather(torch.autograd.Function):
    """shard -> full parameters (all-gather); backward: full grad -> reduce-scatter (async)."""

    @staticmethod
    def forward(ctx, shard, group: _FlatGroup, dtype):
        ctx.group = group
        full = torch.empty(group.padded, dtype=dtype, device=shard.device)
        group.fsdp._collective(_all_gather, full, shard.detach().to(dtype), "all-gather")
        return full

    @staticmethod
    def backward(ctx, grad_full):
        group = ctx.group
        group.reduce_scatter(grad_full)
        group.free()
        return None, None, None


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
        self._units: List[Tuple[str, Optional[nn.Module], List[_FlatGroup]]] = []
        for u in [None] + unit_modules:
            key = id(u) if u is not None else None
            mine = [i for i in params if (owner[i] == {key}) or (u is None and len(owner[i]) > 1)]
            uname = "<root>" if u is None else names[id(u)]
            groups = []
            for rg in (True, False):
                entries = [(pname[i], params[i], slots[i]) for i in mine if params[i].requires_grad == rg]
                if entries:
                    groups.append(_FlatGroup(self, uname, entries, rg))
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
    def flat_groups(self) -> List[_FlatGroup]:
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
