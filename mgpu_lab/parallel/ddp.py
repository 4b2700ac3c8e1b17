"""Your own DistributedDataParallel: first naive, then bucketed with overlap.

Data parallelism keeps one full replica of the model per rank; each rank runs
forward and backward on its own slice of the global batch, then the gradients
are averaged across ranks so every replica takes the same optimizer step. With
equal slices and a loss that is a mean over the slice, the average of the
ranks' gradients is exactly the full-batch gradient, so N ranks train to the
same parameters as one process on the whole batch.

Two ways to average, the same numbers, different speed:

* ``NaiveDDP``: after ``loss.backward()``, one blocking all-reduce per parameter.
  Communication starts only when backward has finished (nothing overlaps), and
  a model with many small parameters pays the per-message latency many times.
* ``BucketedDDP``: gradients become ready in roughly reverse parameter order
  during backward. A hook on each parameter copies its gradient into a flat
  *bucket* (about ``bucket_cap_mb`` of gradients); when a bucket is full it
  starts an asynchronous all-reduce while autograd keeps computing the earlier
  layers' gradients. ``finish_gradient_synchronization()`` waits for the buckets
  and averages. Fewer, larger messages, and communication hidden behind compute:
  what ``torch.nn.parallel.DistributedDataParallel`` does (in C++).

Usage (both classes)::

    model = BucketedDDP(net)            # broadcasts rank 0's parameters and buffers
    loss_fn(model(x_local), y_local).backward()
    model.finish_gradient_synchronization()
    optimizer.step()                    # optimizer over model.parameters()

    with model.no_sync():               # gradient accumulation: no communication,
        loss_fn(model(x1), y1).backward()   # gradients add up locally
    loss_fn(model(x2), y2).backward()   # this backward syncs the accumulated sum
    model.finish_gradient_synchronization()

What they handle: parameters with ``requires_grad=False`` (never communicated,
still broadcast at construction), tied weights (a parameter shared by two
modules is one tensor: it is reduced once, its gradient already holds both
uses), and a parameter that got no gradient on a rank (it contributes zeros and
receives the average, so ranks never disagree about what to send). Which
parameters require grad is read at construction, as DDP does. Buffers are
broadcast at construction only (DDP re-broadcasts them every forward).

Timeouts: every wait is a collective or ``Work.wait()`` and is bounded by the
process group's timeout (gloo honours it; NCCL's watchdog enforces it).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List

import torch
import torch.distributed as dist
from torch import nn


class _DataParallelBase(nn.Module):
    """What both DDPs share: the broadcast, ``.module``, forward, ``no_sync``."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: build the model inside "
                               "mgpu_lab.launch(...) or after mgpu_lab.init_distributed()")
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.require_backward_grad_sync = True
        # module.parameters() yields a shared (tied) parameter once.
        self._params: List[nn.Parameter] = [p for p in module.parameters() if p.requires_grad]
        self._names: Dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), name)
        self._check_devices()
        self._broadcast_from_rank0()

    def _check_devices(self) -> None:
        backend = dist.get_backend(self.group)
        for name, t in list(self.module.named_parameters()) + list(self.module.named_buffers()):
            if backend == "nccl" and t.device.type != "cuda":
                raise ValueError(f"{name} is on {t.device} but the backend is nccl: move the "
                                 "model to this rank's GPU (model.to(device)) before wrapping it")
            if backend == "gloo" and t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{name} is on {t.device}, which gloo cannot send")

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """Make every replica start from rank 0's weights (N·model bytes from rank 0)."""
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            buf = t.detach() if t.is_contiguous() else t.detach().contiguous()
            dist.broadcast(buf, src=src, group=self.group)
            if buf.data_ptr() != t.data_ptr():
                t.copy_(buf)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, with no communication.

        The first synchronised backward after it (and its
        ``finish_gradient_synchronization()``) averages the accumulated sums.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError


class NaiveDDP(_DataParallelBase):
    """Average every gradient with its own blocking all-reduce after backward.

    Costs per step: one all-reduce per parameter that requires grad (for a
    20-layer MLP, 40 messages, each paying the latency), all of it after
    backward, so compute and communication never overlap.
    """

    def __init__(self, module: nn.Module, group=None):
        super().__init__(module, group)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Call after ``backward()``, before ``optimizer.step()``. No-op in ``no_sync``."""
        if not self.require_backward_grad_sync:
            return
        for p in self._params:
            if p.grad is None:  # unused on this rank: contribute zeros
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.group)  # waits; bounded by the group's timeout
            p.grad.div_(self.world_size)


class _Bucket:
    def __init__(self, params: List[nn.Parameter]):
        self.params = params
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.ready = 0
        self.work = None


class BucketedDDP(_DataParallelBase):
    """Bucket gradients and all-reduce them asynchronously during backward.

    Parameters that require grad are packed, in reverse registration order (the
    order backward produces their gradients), into buckets of at most
    ``bucket_cap_mb`` MiB (a larger parameter gets a bucket of its own; a dtype
    or device change starts a new bucket). A ``register_post_accumulate_grad_hook``
    on each parameter counts it ready; when a bucket is complete, it and any
    complete buckets after it are launched in bucket order (the same order on
    every rank, as collectives require) with ``dist.all_reduce(async_op=True)``.

    Costs: one extra copy of the gradients (the flat buckets, gradient-sized
    memory); one message per bucket instead of per parameter. A huge cap gives
    one bucket and no overlap; a tiny cap gives per-parameter messages.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group=None):
        if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        super().__init__(module, group)
        self.bucket_cap_mb = float(bucket_cap_mb)
        cap = self.bucket_cap_mb * 1024 * 1024
        groups: List[List[nn.Parameter]] = []
        size = 0
        for p in reversed(self._params):
            nbytes = p.numel() * p.element_size()
            last = groups[-1][-1] if groups else None
            if (last is None or size + nbytes > cap
                    or p.dtype != last.dtype or p.device != last.device):
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        self._buckets = [_Bucket(ps) for ps in groups]
        self._next_bucket = 0  # buckets launch strictly in this order
        self._hooks = []
        for b, bucket in enumerate(self._buckets):
            for p in bucket.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(b)))

    @property
    def buckets(self) -> List[List[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._names[id(p)] for p in b.params] for b in self._buckets]

    @property
    def buckets_in_flight(self) -> int:
        """Buckets launched since the last ``finish_gradient_synchronization()``;
        right after a full backward it equals ``len(self.buckets)`` (all overlapped)."""
        return self._next_bucket

    def _make_hook(self, b: int):
        def hook(param: torch.Tensor) -> None:
            # Runs once per backward per parameter object, after its gradient
            # (all uses of a tied weight summed) is in param.grad.
            if not self.require_backward_grad_sync:
                return
            bucket = self._buckets[b]
            if bucket.work is not None:
                raise RuntimeError("a second backward ran before finish_gradient_synchronization(): "
                                   "call it after every synchronised backward, or wrap the extra "
                                   "backward passes in model.no_sync()")
            bucket.ready += 1
            while (self._next_bucket < len(self._buckets)
                   and self._buckets[self._next_bucket].ready >= len(self._buckets[self._next_bucket].params)):
                self._launch(self._buckets[self._next_bucket])
                self._next_bucket += 1
        return hook

    @torch.no_grad()
    def _launch(self, bucket: _Bucket) -> None:
        for p, off in zip(bucket.params, bucket.offsets):
            view = bucket.buffer[off: off + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
        bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket, average, write the results into ``.grad``.

        Buckets not launched during backward (a parameter got no gradient, or
        backward ran inside ``no_sync``) are launched here, in order. No-op
        inside ``no_sync``.
        """
        if not self.require_backward_grad_sync:
            return
        for bucket in self._buckets[self._next_bucket:]:
            self._launch(bucket)
        for b, bucket in enumerate(self._buckets):
            try:
                bucket.work.wait()  # bounded by the process group's timeout
            except RuntimeError as e:
                raise RuntimeError(
                    f"rank {dist.get_rank()}: the all-reduce of bucket {b} ({self.buckets[b]}) failed ({e}). "
                    "Every rank must run the same number of synchronised backward passes, each followed "
                    "by finish_gradient_synchronization().") from e
            bucket.buffer.div_(self.world_size)
            for p, off in zip(bucket.params, bucket.offsets):
                avg = bucket.buffer[off: off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)
            bucket.work, bucket.ready = None, 0
        self._next_bucket = 0
