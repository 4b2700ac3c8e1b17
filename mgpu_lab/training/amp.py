"""Mixed precision: autocast picks the dtype per op; a loss scaler keeps fp16 gradients alive.

Mixed-precision training runs the matrix multiplications (linear, conv, bmm...)
in a 16-bit format, which halves their memory traffic and, on tensor cores,
multiplies their speed, while the parameters ("master weights"), the optimizer
state and the numerically touchy ops (losses, and on CUDA softmax, norms,
reductions) stay in fp32. ``torch.autocast`` does the per-op casting; the two
16-bit formats differ in what they need on top:

* bf16 (1 sign, 8 exponent, 7 fraction bits) has fp32's range: gradients do
  not underflow, no scaler is needed (:func:`autocast_dtype` prefers it).
* fp16 (1-5-10) is more precise, but its smallest subnormal is 2**-24 ~ 6e-8:
  small gradients flush to zero in backward. :class:`LossScaler`
  (``loss_scaler.py``) multiplies the loss by a large factor and divides the
  gradients by it again before the step.

:func:`amp_step` is one training step with both, for the later labs and your
own loops.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from .loss_scaler import LossScaler

__all__ = ["LossScaler", "amp_step", "autocast_dtype"]

def autocast_dtype(device: Union[str, int, torch.device]) -> torch.dtype:
    """The 16-bit dtype to autocast to on ``device``: bf16 where it runs natively, else fp16.

    CPU: bf16. CUDA: bf16 on compute capability 8.0+ (Ampere, Hopper, ...) and
    on ROCm, fp16 on older GPUs (V100, T4: bf16 there is emulated and slow).
    MPS: fp16. fp16 needs a loss scaler; bf16 does not.
    """
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cpu":
        return torch.bfloat16
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"autocast_dtype({device}): CUDA is not available on this machine")
        if torch.version.hip:
            return torch.bfloat16
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.bfloat16 if torch.cuda.get_device_capability(index) >= (8, 0) else torch.float16
    if device.type == "mps":
        return torch.float16
    if device.type == "xpu":
        return torch.bfloat16
    raise ValueError(f"autocast_dtype: no policy for device type {device.type!r}; "
                     "pass dtype= explicitly (torch.bfloat16 or torch.float16)")



def amp_step(model: nn.Module, optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
             loss_fn: Callable, batch, scaler: Optional[LossScaler] = None,
             dtype: Optional[torch.dtype] = None, max_grad_norm: Optional[float] = None) -> torch.Tensor:
    """One mixed-precision training step; returns the (unscaled, detached) loss.

    ``batch`` is ``(inputs, targets)``; ``inputs`` may be a tuple of model
    arguments. The step: zero the gradients, forward and loss under
    ``torch.autocast`` (``dtype``: default :func:`autocast_dtype` of the
    model's device; ``torch.float32`` turns autocast off), backward of the
    scaled loss, unscale, clip to ``max_grad_norm`` (if given), step (skipped on
    inf/NaN), update. ``scaler`` may be None (bf16, fp32) or any object with
    GradScaler's API (a :class:`LossScaler` or a ``torch.amp.GradScaler``).
    ``optimizer`` may be a list of optimizers (parts of the model with optimizers
    of their own): each is unscaled and stepped, each skips its step on its own
    inf/NaN (GradScaler's per-optimizer decision), the norm clipped is the norm
    of all their gradients together, and the scaler is updated once.
    Nothing here waits for the device except the scaler's ``step``.
    """
    inputs, targets = batch
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    device = next(model.parameters()).device
    dtype = autocast_dtype(device) if dtype is None else dtype
    ctx = (nullcontext() if dtype == torch.float32
           else torch.autocast(device.type, dtype=dtype))
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    with ctx:
        out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        loss = loss_fn(out, targets)
    if scaler is None:
        loss.backward()
        if max_grad_norm is not None:
            nn.utils.clip_grad_norm_(params, max_grad_norm)
        for opt in optimizers:
            opt.step()
    else:
        scaler.scale(loss).backward()
        if max_grad_norm is not None:
            for opt in optimizers:
                scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(params, max_grad_norm)
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
    return loss.detach()
