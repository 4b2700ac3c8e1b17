"""Activation memory, measured from outside: what autograd saves, and the CUDA allocator's peak.

``saved_tensor_bytes(fn, *args)`` counts the bytes autograd saves for backward
while ``fn`` runs (what is saved, not what an allocator reserved: the same on CPU
and GPU); ``peak_memory(fn, *args)`` is the CUDA allocator's peak during ``fn``.
Both attach by hooks or allocator statistics, so they measure any code: plain,
recomputed (:mod:`mgpu_lab.training.recompute`), tensor- or pipeline-parallel.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

__all__ = ["saved_tensor_bytes", "peak_memory"]


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (``Linear`` saves ``weight.t()``)."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def saved_tensor_bytes(fn: Callable[..., Any], *args: Any, count_parameters: bool = False,
                       **kwargs: Any) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn(*args, **kwargs)`` runs.

    This is the activation memory a forward pass leaves behind (what backward
    will read), measured with ``saved_tensors_hooks``: each storage is counted
    once (two tensors that share memory, like ``relu``'s output and the next
    ``Linear``'s input, are one allocation), at its full size. Parameters (and
    views of them) are weights, not activations, and are left out unless
    ``count_parameters=True``. It counts what is saved, not what an allocator
    reserved, so it is the same on CPU and GPU wherever their kernels save the
    same tensors (dropout does not: CUDA saves a 1-byte mask, the CPU a float
    one). Runs ``fn`` once, with grad enabled, and drops its result.
    """
    seen: Dict[Tuple[str, int], int] = {}
    keep: List[torch.Tensor] = []  # alive until the end, so no address is reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        if count_parameters or not _is_parameter(t):
            s = t.untyped_storage()
            seen.setdefault((str(t.device), s.data_ptr()), s.nbytes())
            keep.append(t)
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    del out
    keep.clear()
    return sum(seen.values())


def peak_memory(fn: Callable[..., Any], *args: Any, device=None, **kwargs: Any) -> int:
    """Peak CUDA memory allocated while ``fn(*args, **kwargs)`` runs, above what was
    allocated when it started, in bytes (``torch.cuda.max_memory_allocated``).

    Pass a whole training step (forward and backward) to see checkpointing's real
    effect: saved activations plus the recompute's transient ones. CUDA only; on
    CPU, use ``saved_tensor_bytes``. ``device`` defaults to the first CUDA tensor
    argument's device, else the current CUDA device.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("peak_memory measures the CUDA caching allocator and needs a GPU; "
                           "on CPU use mgpu_lab.saved_tensor_bytes(fn, *args) to count the "
                           "activation bytes autograd saves")
    if device is None:
        cuda_args = [a for a in list(args) + list(kwargs.values())
                     if isinstance(a, torch.Tensor) and a.is_cuda]
        device = cuda_args[0].device if cuda_args else torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"peak_memory: device must be a CUDA device, got {device}")
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn(*args, **kwargs)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base
