"""What a DDP communication hook receives: one bucket of gradients.

torch DDP calls ``hook(state, bucket)`` once per bucket when its gradients are ready
(``DistributedDataParallel.register_comm_hook``); the hook returns a
``torch.futures.Future`` whose tensor replaces the bucket's buffer. torch's
``torch.distributed.GradBucket`` is a C++ class with no Python constructor, so the
DDP wrappers here hand hooks this class, with the methods hooks call.
"""
from __future__ import annotations

from typing import List

import torch


class GradBucket:
    """What a communication hook receives, as ``torch.distributed.GradBucket`` (whose C++
    class cannot be built from Python): ``index()``, ``buffer()`` (the flat gradients, or one
    sparse gradient), ``gradients()`` (views of it, one per parameter), ``parameters()``,
    ``is_last()``, ``set_buffer(tensor)``."""

    def __init__(self, index: int, count: int, buffer: torch.Tensor, params):
        self._index, self._count, self._buffer, self._params = index, count, buffer, list(params)

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def parameters(self) -> List[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def gradients(self) -> List[torch.Tensor]:
        if self._buffer.is_sparse:
            return [self._buffer]
        sizes = [p.numel() for p in self._params]
        return [v.view_as(p) for v, p in zip(self._buffer.split(sizes), self._params)]
