"""A unit's parameters as one flat, sharded buffer: FSDP's storage and its two collectives.

``FlatGroup`` flattens the parameters of one FSDP unit that share ``requires_grad``
into one vector, zero-pads it to a multiple of N (at most N-1 extra numbers) and
keeps slice ``rank`` as an ``nn.Parameter``: the shard the optimizer updates
(FSDP1 calls it a ``FlatParameter``). The original parameters are removed from
their modules; while the unit computes, the modules' attributes are views into
the gathered full vector.

* ``gather()`` (forward): all-gather the shards (cast to ``param_dtype``) into a
  fresh buffer through the autograd function ``_Gather``, so that autograd routes
  the full vector's gradient back to ``_Gather.backward``;
* ``free()``: drop the buffer's *storage* (``untyped_storage().resize_(0)``). The
  views autograd saved for backward remain valid objects pointing at it;
* ``regather(full)`` (backward): re-allocate that storage and all-gather into it,
  through ``.data`` (an alias with its own version counter, so autograd does not
  see the saved views as modified in place). A unit that ran twice in one forward
  has two such buffers; each call's backward refills its own;
* ``_Gather.backward``: cast the full gradient to ``reduce_dtype``, start an
  asynchronous reduce-scatter and free the storage (once per call of the unit:
  the slices add up); ``finish()`` waits, divides
  by N and adds the slice into the shard's ``.grad`` (in the shard's dtype).
  With ``reduce_grads`` off (``no_sync``) the full gradient is kept and added up
  locally instead, and reduce-scattered with the next synchronised one.

``Comm`` issues the two collectives (through ``comm.py``, which looks them up in
``torch.distributed`` at each call, so ``collective_trace`` sees them) and counts the bytes
this rank sends: one ``all_gather`` per gather and one ``reduce_scatter`` per
synchronised backward, each Ψ_unit·(N-1)/N.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..runtime._diagnosis import collective_failed
from ..runtime.distributed import global_rank
from .comm import all_gather_single, reduce_scatter_single


class Comm:
    """FSDP's process group and its two collectives, with a byte count and an error that says why."""

    def __init__(self, group=None):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.src = global_rank(group, 0)
        self.bytes = {"all-gather": 0, "reduce-scatter": 0}  # sent by this rank, computed

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        self.bytes["all-gather"] += (self.world_size - 1) * shard.numel() * out.element_size()
        self._run(all_gather_single, out, shard, "all-gather")

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor):
        self.bytes["reduce-scatter"] += (self.world_size - 1) * out.numel() * full.element_size()
        return self._run(reduce_scatter_single, out, full, "reduce-scatter", async_op=True)

    def _run(self, fn, out, inp, what: str, async_op: bool = False):
        try:
            return fn(out, inp, group=self.group, async_op=async_op)
        except RuntimeError as e:
            raise collective_failed(f"FSDP {what}", e, self.group, "Every rank must run the same units in "
                                    "the same order (same forward, same backward).") from e


class FlatGroup:
    """The parameters of one unit that share requires_grad, as one sharded flat buffer."""

    def __init__(self, unit: str, entries, requires_grad: bool, comm: Comm,
                 param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None):
        self.unit, self.requires_grad, self.comm = unit, requires_grad, comm
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
        n = comm.world_size
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
        dist.broadcast(flat, src=comm.src, group=comm.group)  # everyone starts from rank 0's weights
        lo = comm.rank * self.shard_numel
        self.shard = nn.Parameter(flat[lo: lo + self.shard_numel].clone(), requires_grad=requires_grad)
        self.param_dtype = param_dtype or first.dtype
        self.reduce_dtype = reduce_dtype or first.dtype
        self.reduce_grads = True  # False under no_sync: keep the full gradient, add up locally
        self.full: Optional[torch.Tensor] = None  # the last gathered buffer (a unit may run twice)
        self.refilled: List[torch.Tensor] = []    # buffers regathered in this backward
        self.unsharded_grad: Optional[torch.Tensor] = None
        self.pending: List[Tuple[object, torch.Tensor]] = []  # reduce-scatters in flight: (work, output)
        for slots in self.slots:
            for module, attr in slots:
                del module._parameters[attr]

    # --------------------------------------------------------------- gather / free
    @property
    def gathered(self) -> bool:
        return self.full is not None and self.full.untyped_storage().nbytes() > 0

    def gather(self) -> None:
        """Forward: all-gather into a fresh buffer (autograd-tracked), point the modules at it."""
        self.full = _Gather.apply(self.shard, self)
        for name_slots, shape, off in zip(self.slots, self.shapes, self.offsets):
            view = self.full[off: off + shape.numel()].view(shape)
            for module, attr in name_slots:
                setattr(module, attr, view)

    @torch.no_grad()
    def regather(self, full: Optional[torch.Tensor] = None) -> None:
        """Backward: refill the freed storage of ``full`` (one call's gathered buffer; by default
        the last one): the views autograd saved for that call's backward point into it."""
        full = self.full if full is None else full
        if full is None or full.untyped_storage().nbytes() > 0:
            return
        buf = full.data  # own version counter: autograd's saved views stay valid
        buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        self.comm.all_gather(buf, self.shard.detach().to(buf.dtype))
        self.refilled.append(full)

    def free(self, full: Optional[torch.Tensor] = None) -> None:
        """Drop the storage of ``full`` (by default the last gathered buffer)."""
        full = self.full if full is None else full
        if full is not None and full.untyped_storage().nbytes() > 0:
            full.untyped_storage().resize_(0)

    def free_all(self) -> None:
        """End of backward: drop every buffer refilled in it (a frozen group's has no backward to free it)."""
        for full in self.refilled + [self.full]:
            self.free(full)
        self.refilled.clear()

    # --------------------------------------------------------------- gradients
    @torch.no_grad()
    def reduce_scatter(self, full_grad: torch.Tensor) -> None:
        """Backward: start reducing this unit's full gradient (or keep it, under no_sync)."""
        grad = full_grad.to(self.reduce_dtype)
        if self.unsharded_grad is not None:  # accumulated under no_sync: send the sum
            grad = self.unsharded_grad.add_(grad)
            self.unsharded_grad = None
        if not self.reduce_grads:
            self.unsharded_grad = grad
            return
        out = torch.empty(self.shard_numel, dtype=grad.dtype, device=grad.device)
        self.pending.append((self.comm.reduce_scatter(out, grad.contiguous()), out))

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the reduce-scatters and add each averaged slice into ``shard.grad``;
        outside no_sync, first send what backward passes under no_sync accumulated."""
        if self.reduce_grads and self.unsharded_grad is not None:
            grad, self.unsharded_grad = self.unsharded_grad, None
            out = torch.empty(self.shard_numel, dtype=grad.dtype, device=grad.device)
            self.pending.append((self.comm.reduce_scatter(out, grad), out))
        for work, out in self.pending:
            try:
                work.wait()  # bounded by the process group's timeout
            except RuntimeError as e:
                raise collective_failed("FSDP reduce-scatter", e, self.comm.group,
                                        "Every rank must run the same units in the same order.") from e
            out = out.to(self.shard.dtype).div_(self.comm.world_size)
            if self.shard.grad is None:
                self.shard.grad = out
            else:
                self.shard.grad.add_(out)
        self.pending.clear()


class _Gather(torch.autograd.Function):
    """shard -> full parameters (all-gather); backward: full grad -> reduce-scatter (async)."""

    @staticmethod
    def forward(ctx, shard, group: FlatGroup):
        ctx.group = group
        full = torch.empty(group.padded, dtype=group.param_dtype, device=shard.device)
        group.comm.all_gather(full, shard.detach().to(group.param_dtype))
        ctx.storage = full.untyped_storage()  # this call's buffer (not the tensor: no reference cycle)
        return full

    @staticmethod
    def backward(ctx, grad_full):
        ctx.group.reduce_scatter(grad_full)
        ctx.storage.resize_(0)  # free this call's full parameters
        return None, None
