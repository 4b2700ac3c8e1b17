"""The balanced criterion: compute the loss where the outputs are, not on device 0.

``DataParallel`` gathers every device's outputs on device 0 and computes the
loss there, so device 0 holds the whole batch's outputs, the loss's saved
tensors and the output gradient. With a large output (language-model logits,
``batch x seq x vocab``) that is what fills device 0 first.

The fix (from PyTorch-Encoding, by Hang Zhang) is to split the step in two:

- :class:`DataParallelModel` returns the list of per-device outputs, never
  gathering them;
- :class:`DataParallelCriterion` scatters the targets like the inputs, computes
  the loss on each device in parallel, and sends only the per-device scalars to
  device 0.

The original averages the per-device losses. That is wrong when the chunks are
uneven: a batch of 5 on 2 devices gives chunks of 3 and 2 samples, and the
mean of two means weighs each of the 2 samples more than each of the 3. Here
the result is the chunk-size-weighted mean, ``sum_i n_i * loss_i / sum_i n_i``,
which equals the full-batch loss for every loss that is a mean over samples.
``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` with class-index targets divide by
something else: the number of targets that are not ``ignore_index`` (padding),
or the sum of their class weights. For those two, each device computes the
*sum* and its own denominator, and device 0 divides the total sum by the total
denominator: exact again, even when a device's chunk is all padding. A
criterion with ``reduction="sum"`` gets the plain sum of the per-device sums.
For any other loss that is not a mean over samples, return sums and divide
yourself.
"""
from __future__ import annotations

import copy
from typing import Any, List

import torch
from torch import nn

from .data_parallel import DataParallel, first_tensor, parallel_apply, replicate, scatter_kwargs
from ..runtime.devices import Devices, as_devices


class DataParallelModel(DataParallel):
    """``DataParallel`` that returns the list of per-device outputs (one per chunk), on their devices.

    Feed the list to :class:`DataParallelCriterion`, or call
    :func:`mgpu_lab.gather` yourself when you need the whole output (e.g. for
    metrics). With one device the list has one entry.
    """

    def gather(self, outputs: list, output_device: torch.device) -> List[Any]:
        return list(outputs)

    def _single(self, output):
        return [output]


def _class_index_mean(criterion, targets) -> bool:
    """True for CrossEntropyLoss / NLLLoss with reduction='mean' on class-index targets."""
    return (isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)) and criterion.reduction == "mean"
            and len(targets) > 0 and isinstance(targets[0], torch.Tensor) and not targets[0].is_floating_point())


def _denominator(criterion, y: torch.Tensor) -> torch.Tensor:
    """What ``criterion``'s mean divides by on targets ``y``: kept targets, or the sum of their class weights."""
    keep = y != criterion.ignore_index
    if criterion.weight is None:
        return keep.sum().to(torch.float32)
    w = criterion.weight.to(y.device)
    return (w[y.masked_fill(~keep, 0)] * keep).sum().to(torch.float32)


class DataParallelCriterion(nn.Module):
    """Compute ``criterion`` on every device's outputs in parallel; return one scalar on device 0.

    ``forward(outputs, *targets)``: ``outputs`` is the list returned by
    :class:`DataParallelModel`; ``targets`` are whole-batch tensors, split with
    the same ``torch.chunk`` rule as the inputs, so chunk i of the targets
    meets the outputs of chunk i. A per-device output that is a tuple is
    unpacked: the criterion is called as ``criterion(*output_i, *targets_i)``.
    Autocast and grad mode reach the worker threads (see
    :func:`mgpu_lab.parallel_apply`). Only the per-device scalar losses travel
    to device 0 (``device_ids[0]``).
    """

    def __init__(self, criterion: nn.Module, device_ids: Devices = None, dim: int = 0):
        super().__init__()
        if not callable(criterion):
            raise TypeError(f"DataParallelCriterion: criterion must be callable, got {type(criterion).__name__}")
        self.module = criterion
        self.device_ids = as_devices(device_ids)
        self.dim = dim

    def forward(self, outputs, *targets, **kwargs):
        if not isinstance(outputs, (list, tuple)) or isinstance(outputs, torch.Tensor) or not outputs:
            raise TypeError("DataParallelCriterion: expected the list of per-device outputs from "
                            "DataParallelModel; for a gathered output, call the plain criterion")
        n = len(outputs)
        if n > len(self.device_ids):
            raise ValueError(f"DataParallelCriterion: {n} per-device outputs but only "
                             f"{len(self.device_ids)} device_ids; use the same device_ids as the model")
        devs = [t.device if (t := first_tensor(o)) is not None else self.device_ids[i]
                for i, o in enumerate(outputs)]
        tgts, kws = scatter_kwargs(targets, kwargs, devs, self.dim)
        if (targets or kwargs) and len(tgts) != n:
            raise ValueError(f"DataParallelCriterion: the targets split into {len(tgts)} chunks but there are "
                             f"{n} outputs; targets must have the inputs' batch size along dim {self.dim}")
        if not (targets or kwargs):
            tgts, kws = [() for _ in range(n)], [{} for _ in range(n)]
        args = [(tuple(o) if isinstance(o, (list, tuple)) else (o,)) + tuple(t) for o, t in zip(outputs, tgts)]
        sizes = []
        for i in range(n):
            ref = first_tensor(tgts[i]) if targets else None
            ref = ref if ref is not None else first_tensor(outputs[i])
            sizes.append(ref.size(self.dim) if ref is not None and ref.dim() > self.dim else 1)

        criterion, by_count = self.module, _class_index_mean(self.module, tgts[0])
        if by_count:  # sums per device, divided by the global denominator on device 0
            criterion = copy.copy(self.module)
            criterion.reduction = "sum"
        if n == 1:
            losses = [criterion(*args[0], **kws[0])]
        elif isinstance(criterion, nn.Module):
            losses = parallel_apply(replicate(criterion, devs), args, kws, devs)
        else:  # a plain function: nothing to replicate
            losses = parallel_apply([criterion] * n, args, kws, devs)

        dev0 = self.device_ids[0]
        for i, loss in enumerate(losses):
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ValueError(f"DataParallelCriterion: the criterion must return a scalar per device "
                                 f"(reduction='mean' or 'sum'), got {shape} on device {i}")
        losses = [loss.reshape(()).to(dev0) for loss in losses]  # only scalars travel to device 0
        if by_count:
            denominators = [_denominator(self.module, t[0]).to(dev0) for t in tgts]
            return sum(losses[1:], losses[0]) / sum(denominators[1:], denominators[0])
        if getattr(self.module, "reduction", "mean") == "sum":
            return sum(losses[1:], losses[0])
        total = sum(sizes)
        return sum(loss * (s / total) for loss, s in zip(losses, sizes))
