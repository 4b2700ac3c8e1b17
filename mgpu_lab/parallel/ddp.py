"""Your own DistributedDataParallel: first naive, then bucketed with overlap.

Data parallelism keeps one full replica of the model per rank; each rank runs
forward and backward on its own slice of the global batch, then the gradients
are averaged across ranks so every replica takes the same optimizer step. With
equal slices and a loss that is a mean over the slice, the average of the
ranks' gradients is exactly the full-batch gradient, so N ranks train to the
same parameters as one process on the whole batch.

Two ways to average, the same numbers, different speed:

* ``NaiveDDP``: once backward has finished, one blocking all-reduce per
  parameter. Nothing overlaps, and a model with many small parameters pays the
  per-message latency many times.
* ``BucketedDDP``: gradients become ready in roughly reverse parameter order
  during backward. When a *bucket* of parameters (about ``bucket_cap_mb`` of
  gradients) is complete, its gradients are flattened into one message and an
  asynchronous all-reduce starts while autograd keeps computing the earlier
  layers' gradients. Fewer, larger messages, and communication hidden behind
  compute: what ``torch.nn.parallel.DistributedDataParallel`` does (in C++).

Usage (both classes)::

    model = BucketedDDP(net)            # broadcasts rank 0's parameters and buffers
    loss_fn(model(x_local), y_local).backward()   # returns with averaged gradients
    optimizer.step()                    # optimizer over model.parameters()

    with model.no_sync():               # gradient accumulation: no communication,
        loss_fn(model(x1), y1).backward()   # gradients add up locally
    loss_fn(model(x2), y2).backward()   # this backward averages the accumulated sum

The keywords are torch DDP's, where both have them: ``process_group=`` (the
ranks to average over; ``.process_group``), ``bucket_cap_mb=``, and
``device_ids=[rank]`` / ``output_device`` for a module on one GPU (inputs are
moved there in forward; leave them out for a CPU module, as torch asks). As torch
DDP, a module without a parameter that requires grad is refused, and
``_set_params_and_buffers_to_ignore_for_model`` names parameters and buffers
neither broadcast nor averaged.
``register_comm_hook(state, hook)`` replaces the all-reduce by torch's hook
signature (``torch.distributed.algorithms.ddp_comm_hooks`` works), sparse gradients
(``nn.Embedding(sparse=True)``) are averaged as torch DDP does, and a wrapper on the
default process group pickles (``torch.save(model)``; unpickling registers the hooks).

Finishing with backward: a hook on each parameter
(``register_post_accumulate_grad_hook``) runs when its gradient is complete. The
first one of a synchronised backward queues a callback with autograd's engine
(``Variable._execution_engine.queue_callback``), which runs once the whole
backward is done: it waits for the communication and writes the averages into
``.grad``. So any training loop works unchanged, as with torch DDP (whose C++
reducer does the same). ``finish_gradient_synchronization()`` is that callback
called by hand: a no-op when nothing is pending; called outside ``no_sync``
after backward passes that ran inside it, it averages their sum now.

Unused parameters, as torch DDP with ``find_unused_parameters=True``: a
parameter that got no gradient on some rank contributes zeros there and gets
the average; one that *no* rank used keeps its ``grad`` as it was (``None``
after ``zero_grad()``), so the optimizer leaves it alone. Frozen parameters
(``requires_grad=False`` at construction, as DDP reads it) are broadcast at
construction and never reduced; a tied parameter is one tensor, reduced once.
Buffers are broadcast at construction only (DDP re-broadcasts them every
forward). Wrapping a module again (re-running a notebook cell) retires the
previous wrapper: its hooks are removed, and calling it is an error.

Timeouts: every wait is a collective or ``Work.wait()`` and is bounded by the
process group's timeout (gloo honours it; NCCL's watchdog enforces it).
"""
from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from typing import Dict, Iterator, List

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _unflatten_dense_tensors
from torch.utils._pytree import tree_map_only

from ..runtime.distributed import global_rank, require_process_group
from .grad_bucket import GradBucket

_live_wrapper: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


class _DataParallelBase(nn.Module):
    """What both DDPs share: the broadcast, the hooks and the end-of-backward callback, ``no_sync``."""

    def __init__(self, module: nn.Module, *, process_group=None, device_ids=None, output_device=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
        require_process_group(type(self).__name__)
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.require_backward_grad_sync = True
        # torch DDP's escape hatch: names set by _set_params_and_buffers_to_ignore_for_model are
        # neither broadcast nor reduced.
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        # module.parameters() yields a shared (tied) parameter once.
        self._params: List[nn.Parameter] = [p for n, p in module.named_parameters()
                                            if p.requires_grad and n not in self.parameters_to_ignore]
        if not self._params:
            raise RuntimeError(f"{type(self).__name__} is not needed when a module doesn't have any parameter "
                               "that requires a gradient (as torch DDP says): there is nothing to average")
        self._names: Dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), name)
        self._check_devices()
        self.device_ids, self.output_device = self._single_device(device_ids, output_device)
        self._broadcast_from_rank0()
        self._used = [False] * len(self._params)  # got a gradient here since the last sync
        self._pending = False                     # gradients accumulated since the last sync
        self._callback_queued = False
        self._retired = False
        self._comm_hook = None  # (state, hook) once register_comm_hook is called
        self._attach()

    def _attach(self) -> None:
        """Hook every parameter (retiring an older wrapper of the same module)."""
        previous = _live_wrapper.get(self.module)
        if previous is not None and previous() is not None:
            previous()._retire()
        _live_wrapper[self.module] = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._param_hook, i))
                       for i, p in enumerate(self._params)]

    def __getstate__(self):
        """Pickling (``torch.save(model)``), as torch DDP: the default process group only; the
        gradient hooks are left out and registered again on unpickling, which needs a process
        group; a communication hook is dropped (torch's lives in the reducer it rebuilds)."""
        if self.process_group is not None and self.process_group != dist.group.WORLD:
            raise RuntimeError(f"{type(self).__name__}: pickling is only supported with the default process "
                               "group (as torch DDP): save model.module, or its state_dict()")
        state = dict(self.__dict__)
        state.pop("_hooks")
        state["_comm_hook"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        require_process_group(type(self).__name__)
        self._callback_queued = False
        self._attach()

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore) -> None:
        """torch DDP's static method: the named parameters and buffers (fully qualified names) of
        ``module`` that a wrapper built afterwards neither broadcasts nor averages."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore

    def _single_device(self, device_ids, output_device):
        """torch DDP's ``device_ids=[rank]`` for a module on one GPU (inputs are moved there in
        forward); None for a CPU module, as torch requires. Returns (device_ids, output_device)."""
        if device_ids is None and output_device is None:
            return None, None
        devices = {p.device for p in self._params}
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element (one device per "
                             "process: torch DDP's multi-device mode is not here)")
        if not device_ids or len(devices) != 1 or next(iter(devices)).type == "cpu":
            raise ValueError(f"device_ids and output_device only work with a module on one GPU (as torch DDP): "
                             f"got device_ids {device_ids}, output_device {output_device}, and module parameters "
                             f"on {sorted(map(str, devices))}; leave them out for a CPU module")
        device = next(iter(devices))
        given = torch.device(device_ids[0]) if not isinstance(device_ids[0], int) else \
            torch.device(device.type, device_ids[0])
        out = given if output_device is None else (torch.device(output_device) if not isinstance(output_device, int)
                                                   else torch.device(device.type, output_device))
        if given != device or out != device:
            raise ValueError(f"device_ids={device_ids}, output_device={output_device}: the module's parameters "
                             f"are on {device}; move it there first (model.to(device)) or pass that device")
        return [device.index], device.index

    def _check_devices(self) -> None:
        backend = dist.get_backend(self.process_group)
        for name, t in self._named_tensors():
            if backend == "nccl" and t.device.type != "cuda":
                raise ValueError(f"{name} is on {t.device} but the backend is nccl: move the "
                                 "model to this rank's GPU (model.to(device)) before wrapping it")
            if backend == "gloo" and t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{name} is on {t.device}, which gloo cannot send")

    def _named_tensors(self):
        """Parameters and buffers, those torch DDP was told to ignore left out."""
        return [(n, t) for n, t in list(self.module.named_parameters()) + list(self.module.named_buffers())
                if n not in self.parameters_to_ignore]

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """Make every replica start from rank 0's weights (N·model bytes from rank 0)."""
        src = global_rank(self.process_group, 0)
        for _, t in self._named_tensors():
            buf = t.detach() if t.is_contiguous() else t.detach().contiguous()
            dist.broadcast(buf, src=src, group=self.process_group)
            if buf.data_ptr() != t.data_ptr():
                t.copy_(buf)

    def _retire(self) -> None:
        """A newer wrapper took this module: remove our hooks so only its ones fire."""
        for h in self._hooks:
            h.remove()
        self._retired = True

    def forward(self, *args, **kwargs):
        if self._retired:
            raise RuntimeError(f"this {type(self).__name__} was replaced by a newer wrapper of the same module "
                               "(a cell run twice?): use the new one")
        self._callback_queued = False  # a backward that failed half-way may have left it set
        if self.device_ids:  # torch DDP moves the inputs to its device
            device = torch.device(self._params[0].device.type, self.device_ids[0])
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(device), (args, kwargs))
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, with no communication.

        The first synchronised backward after it averages the accumulated sums.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook) -> None:
        """torch DDP's: ``hook(state, bucket) -> torch.futures.Future[Tensor]`` replaces the
        all-reduce of each bucket (NaiveDDP: each gradient). ``bucket`` is a :class:`GradBucket`;
        its buffer holds this rank's gradients, *not* divided by the world size; the future's
        tensor (same shape) is written into ``.grad`` as it is. torch's
        ``default_hooks.allreduce_hook`` (with ``state`` the process group or None) averages,
        as no hook does; ``fp16_compress_hook`` sends half the bytes. Once only, as torch's."""
        if not callable(hook):
            raise TypeError("Communication hook must be callable.")
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._comm_hook = (state, hook)

    def _run_comm_hook(self, index: int, count: int, buffer: torch.Tensor, params) -> torch.futures.Future:
        state, hook = self._comm_hook
        fut = hook(state, GradBucket(index, count, buffer, params))
        if not isinstance(fut, torch._C.Future):  # torch.futures.Future, or what Work.get_future() gives
            raise TypeError(f"the communication hook returned {type(fut).__name__}, not a "
                            "torch.futures.Future[torch.Tensor] (torch's rule too)")
        return fut

    # ------------------------------------------------------------------ backward
    def _param_hook(self, i: int, param: torch.Tensor) -> None:
        """Runs once per backward per parameter object, after its gradient
        (all uses of a tied weight summed) is in param.grad."""
        self._used[i] = True
        self._pending = True
        if not self.require_backward_grad_sync:
            return
        if not self._callback_queued:  # the first ready gradient of this backward
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._grad_ready(i)

    def _grad_ready(self, i: int) -> None:
        """Parameter i's gradient is complete in a synchronised backward (BucketedDDP launches here)."""

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._synchronize()

    def finish_gradient_synchronization(self) -> None:
        """Average what is not averaged yet: a no-op after a synchronised backward (its callback
        did it) and inside ``no_sync``; outside, after backward passes inside it, averages them now."""
        if self.require_backward_grad_sync and self._pending:
            self._synchronize()

    def _synchronize(self) -> None:
        raise NotImplementedError

    def _reset(self) -> None:
        self._used = [False] * len(self._params)
        self._pending = False


class NaiveDDP(_DataParallelBase):
    """Average every gradient with its own blocking all-reduce once backward is done.

    Costs per step: one all-reduce of one flag per parameter (which were used,
    on any rank), then one all-reduce per used parameter (for a 20-layer MLP,
    40 messages, each paying the latency), all of it after backward, so compute
    and communication never overlap.
    """

    @torch.no_grad()
    def _synchronize(self) -> None:
        if self._params:
            used = torch.tensor(self._used, dtype=torch.float32, device=self._params[0].device)
            dist.all_reduce(used, group=self.process_group)  # waits; bounded by the group's timeout
            for i, (p, anyone) in enumerate(zip(self._params, used.tolist())):
                if not anyone:  # no rank used it: its grad stays as it is
                    continue
                if p.grad is None:  # unused on this rank only: contribute zeros
                    p.grad = torch.zeros_like(p)
                if self._comm_hook is not None:  # a bucket of one gradient
                    buffer = p.grad if p.grad.is_sparse else p.grad.reshape(-1)
                    result = self._run_comm_hook(i, len(self._params), buffer, [p]).wait()
                    _write_grad(p, result)
                    continue
                dist.all_reduce(p.grad, group=self.process_group)  # sparse too: gloo and NCCL take one
                p.grad.div_(self.world_size)
        self._reset()


def _write_grad(p: nn.Parameter, value: torch.Tensor) -> None:
    """``value`` (flat, or sparse) as ``p``'s gradient."""
    if value.is_sparse:
        p.grad = value
    elif p.grad is None or p.grad.is_sparse:
        p.grad = value.view_as(p).clone()
    else:
        p.grad.copy_(value.view_as(p.grad))


class _Bucket:
    def __init__(self, indices: List[int], params: List[nn.Parameter], sparse: bool = False):
        self.indices, self.params, self.sparse = indices, params, sparse
        self.ready = 0     # gradients complete in this synchronised backward
        self.work = None   # the all-reduce in flight (or the comm hook's future)
        self.flags = None  # with a comm hook: the used flags' own all-reduce (work, tensor)
        self.parts: List[torch.Tensor] = []  # what was flattened: the gradients, then the used flags
        self.flat = None   # kept from step to step: a fresh gradient-sized buffer would cost page faults


def _sparse_params(module: nn.Module) -> set:
    """ids of the weights torch DDP expects a sparse gradient for: ``nn.Embedding``/``EmbeddingBag``
    with ``sparse=True`` (its ``expect_sparse_gradient``)."""
    return {id(m.weight) for m in module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


def _empty_sparse(p: nn.Parameter) -> torch.Tensor:
    """No rows: an embedding's sparse gradient on a rank that did not use it."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long, device=p.device),
                                   p.new_empty((0,) + p.shape[1:]), p.shape)


class BucketedDDP(_DataParallelBase):
    """Bucket gradients and all-reduce them asynchronously during backward.

    Parameters that require grad are packed, in reverse registration order (the
    order backward produces their gradients), into buckets of at most
    ``bucket_cap_mb`` MiB (a larger parameter gets a bucket of its own; a dtype
    or device change starts a new bucket). Each parameter's hook counts it
    ready; when a bucket is complete, it and any complete buckets after it are
    launched in bucket order (the same order on every rank, as collectives
    require) with ``dist.all_reduce(async_op=True)``. Buckets still incomplete
    when backward ends (a parameter unused here) are launched by the callback.

    A message is the bucket's gradients flattened into one buffer, plus one
    number per parameter: 1 where this rank used it. After the all-reduce, a 0
    there means no rank did; ``_unflatten_dense_tensors`` gives the averages back
    as views. Costs: one gradient-sized flat buffer, kept; one message per
    bucket instead of per parameter. A huge cap gives one bucket and no
    overlap; a tiny cap gives per-parameter messages.

    Sparse gradients (``nn.Embedding``/``EmbeddingBag(sparse=True)``), as torch DDP:
    the weight gets a bucket of its own, and its sparse gradient is divided by N
    and all-reduced as it is (indices and values: the message grows with the
    rows used, not the vocabulary). With ``register_comm_hook`` the hook gets
    the gradients alone (the used flags go in a small all-reduce of their own).
    """

    def __init__(self, module: nn.Module, *, process_group=None, bucket_cap_mb: float = 25.0,
                 device_ids=None, output_device=None):
        if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        super().__init__(module, process_group=process_group, device_ids=device_ids, output_device=output_device)
        self.bucket_cap_mb = float(bucket_cap_mb)
        cap = self.bucket_cap_mb * 1024 * 1024
        sparse = _sparse_params(module)
        groups: List[List[int]] = []
        size = 0
        for i in reversed(range(len(self._params))):
            p, nbytes = self._params[i], self._params[i].numel() * self._params[i].element_size()
            last = self._params[groups[-1][-1]] if groups else None
            if (last is None or size + nbytes > cap or id(p) in sparse or id(last) in sparse
                    or p.dtype != last.dtype or p.device != last.device):
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += nbytes
        self._buckets = [_Bucket(ix, [self._params[i] for i in ix], id(self._params[ix[0]]) in sparse)
                         for ix in groups]
        self._bucket_of = {i: b for b, ix in enumerate(groups) for i in ix}
        self._next_bucket = 0  # buckets launch strictly in this order
        self.buckets_launched_in_backward = 0

    @property
    def buckets(self) -> List[List[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._names[id(p)] for p in b.params] for b in self._buckets]

    def _grad_ready(self, i: int) -> None:
        bucket = self._buckets[self._bucket_of[i]]
        if self._params[i].grad.is_sparse != bucket.sparse:
            raise RuntimeError(f"BucketedDDP: {self._names[id(self._params[i])]} got a "
                               f"{'sparse' if not bucket.sparse else 'dense'} gradient; torch DDP expects sparse "
                               "gradients for nn.Embedding/EmbeddingBag(sparse=True) weights only, as here")
        bucket.ready += 1
        while (self._next_bucket < len(self._buckets)
               and self._buckets[self._next_bucket].ready == len(self._buckets[self._next_bucket].params)):
            self._launch(self._next_bucket)
            self._next_bucket += 1

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        bucket, hooked = self._buckets[b], self._comm_hook is not None
        if bucket.sparse:
            p = bucket.params[0]
            grad = p.grad if p.grad is not None else _empty_sparse(p)
            bucket.parts, buffer = [grad], grad
            if not hooked:
                grad.div_(self.world_size)  # as torch's reducer: divide, then all-reduce in place
        else:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
            used = torch.tensor([float(self._used[i]) for i in bucket.indices], dtype=grads[0].dtype,
                                device=grads[0].device)
            bucket.parts = grads + ([] if hooked else [used])
            if bucket.flat is None or bucket.flat.numel() != sum(t.numel() for t in bucket.parts):
                bucket.flat = torch.empty(sum(t.numel() for t in bucket.parts), dtype=used.dtype,
                                          device=used.device)
            torch.cat([t.reshape(-1) for t in bucket.parts], out=bucket.flat)  # _flatten_dense_tensors, in place
            buffer = bucket.flat
            if hooked:
                bucket.flags = (dist.all_reduce(used, group=self.process_group, async_op=True), used)
        if hooked:
            bucket.work = self._run_comm_hook(b, len(self._buckets), buffer, bucket.params)
        else:
            bucket.work = dist.all_reduce(buffer, group=self.process_group, async_op=True)

    @torch.no_grad()
    def _synchronize(self) -> None:
        """Launch the buckets backward did not complete, wait for all, write the averages into ``.grad``."""
        self.buckets_launched_in_backward = self._next_bucket
        for b in range(self._next_bucket, len(self._buckets)):
            self._launch(b)
        for b, bucket in enumerate(self._buckets):
            try:
                result = bucket.work.wait()  # bounded by the process group's timeout
                if bucket.flags is not None:
                    bucket.flags[0].wait()
            except RuntimeError as e:
                raise RuntimeError(
                    f"rank {dist.get_rank()}: the all-reduce of bucket {b} ({self.buckets[b]}) failed ({e}). "
                    "Every rank must run the same synchronised backward passes (and none skips backward).") from e
            self._write_back(bucket, result if self._comm_hook is not None else None)
            bucket.work, bucket.flags, bucket.parts, bucket.ready = None, None, [], 0
        self._next_bucket = 0
        self._reset()

    def _write_back(self, bucket: _Bucket, hooked) -> None:
        """The bucket's averages (or its comm hook's result) into ``.grad``."""
        if bucket.sparse:
            p, total = bucket.params[0], bucket.parts[0] if hooked is None else hooked
            if p.grad is not None or total._nnz() > 0:  # no rank used it: its grad stays None
                p.grad = total
            return
        if hooked is None:
            *averages, used = _unflatten_dense_tensors(bucket.flat.div_(self.world_size), bucket.parts)
        else:
            averages, used = _unflatten_dense_tensors(hooked, bucket.parts), bucket.flags[1]
        # A bucket complete here holds only parameters this rank used: no need to read the flags.
        anyone = [True] * len(bucket.params) if bucket.ready == len(bucket.params) else (used > 0).tolist()
        for p, avg, u in zip(bucket.params, averages, anyone):
            if not u:  # no rank used it: its grad stays as it is
                continue
            if p.grad is None:
                p.grad = avg.clone()
            else:
                p.grad.copy_(avg)
