"""A unit's parameters as one flat, sharded buffer: FSDP's storage and its two collectives.

``FlatGroup`` flattens the parameters of one FSDP unit that share ``requires_grad``
into one vector, zero-pads it to a multiple of N (at most N-1 extra numbers) and
keeps slice ``rank`` as an ``nn.Parameter``: the shard the optimizer updates
(FSDP1 calls it a ``FlatParameter``). The original parameters are removed from
their modules; while the unit computes, the modules' attributes are views into
the gathered full vector.

* ``gather()`` (forward): all-gather the shards into a fresh buffer through the
  autograd function ``_Gather``, so that autograd routes the full vector's
  gradient back to ``_Gather.backward``;
* ``free()``: drop the buffer's *storage* (``untyped_storage().resize_(0)``). The
  views autograd saved for backward remain valid objects pointing at it;
* ``regather()`` (backward): re-allocate that storage and all-gather into it,
  through ``.data`` (an alias with its own version counter, so autograd does not
  see the saved views as modified in place);
* ``_Gather.backward``: start an asynchronous reduce-scatter of the full gradient
  and free the storage; ``finish()`` waits, divides by N and adds the slice into
  the shard's ``.grad`` (fp32, whatever dtype was communicated).

Cost: one ``all_gather`` per gather (Ψ_unit·(N-1)/N bytes sent per rank), one
``reduce_scatter`` per backward (the same), the full buffer while the unit runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from .fsdp import FSDP

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class FlatGroup:
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
        if any(p.dtype != first.dtype or p.device != first.device for _, p, _ in entries):
            raise ValueError(f"unit '{unit}': parameters {self.names} mix dtypes or devices; make them "
                             "uniform (model.to(dtype/device)) before wrapping, or put them in different units")
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
    def forward(ctx, shard, group: FlatGroup, dtype):
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
