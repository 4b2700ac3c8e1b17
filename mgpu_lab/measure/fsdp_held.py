"""The parameter and gradient bytes a rank holds under torch's ``fully_shard`` (FSDP2), counted.

A CPU has no allocator statistics to read (``torch.cuda.memory_allocated`` has no CPU
counterpart), so the bytes are *counted* from FSDP's own tensors: for each ``FSDPParam`` of each
``fully_shard`` unit (torch 2.13, ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``,
private attributes):

- parameters: the rank's shard (``sharded_param``, always held), plus the unsharded parameter
  (``_unsharded_param``) while its storage is allocated (FSDP frees it by resizing the storage
  to 0 when it reshards: ``free_storage``);
- gradients: the sharded gradient (``sharded_param.grad``, after a reduce-scatter), plus an
  unsharded gradient, held between backwards run with ``set_requires_gradient_sync(False)``
  (``_unsharded_param.grad``, or ``unsharded_accumulated_grad`` when a mixed-precision
  policy's ``reduce_dtype`` differs from the parameters').

Each tensor counts at its logical size, padding left out: an unsharded parameter at its own
shape (FSDP's all-gather buffer pads dim 0 to a multiple of the shard count: not counted), a
shard at the rows of the parameter this rank holds (``sharded_param``'s local tensor: the
last rank's may be shorter, or empty; the padded storage under it is not counted). The bytes
are what the tensors' sizes say, not what the allocator holds for them.
"""
from __future__ import annotations

from typing import Tuple

from torch import nn

__all__ = ["held_bytes"]


def _nbytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def held_bytes(model: nn.Module) -> Tuple[int, int]:
    """``(parameters, gradients)``: the bytes this rank holds now for the ``fully_shard`` units
    of ``model`` (see the module's docstring for what counts)."""
    from torch.distributed.fsdp import FSDPModule
    params = grads = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for p in group.fsdp_params:
                params += _nbytes(p.sharded_param)
                whole = getattr(p, "_unsharded_param", None)
                if whole is not None and whole.untyped_storage().nbytes() > 0:
                    params += _nbytes(whole)
                for g in (getattr(whole, "grad", None), p.unsharded_accumulated_grad, p.sharded_param.grad):
                    if g is not None:
                        grads += _nbytes(g)
    return params, grads
