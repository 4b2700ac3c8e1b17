"""DataParallel from scratch: one process, one thread per device.

``torch.nn.DataParallel`` runs a training step in four moves, and so does this
module, one function each:

1. :func:`scatter` splits the batch into one chunk per device (``torch.chunk``
   sizes: ``ceil(B / n)`` each, the last one smaller; a batch of 5 on 4 devices
   gives chunks 2, 2, 1: only 3 devices work).
2. :func:`replicate` gives every device its own copy of the model. The copies
   are made *through autograd*, so the gradients computed by each copy flow
   back and are summed into the original's ``.grad`` (the all-reduce of
   DataParallel is autograd's own accumulation).
3. :func:`parallel_apply` runs each replica on its chunk in its own Python
   thread. Grad mode and autocast are thread-local in PyTorch, so they are
   carried into each thread by hand.
4. :func:`gather` concatenates the outputs on one device (device 0), where the
   loss is computed.

What it costs: every forward re-copies the weights to every device, and device
0 holds the whole batch's outputs and their gradients (lab 02 measures that).
The Python threads share one GIL, so the CPU time spent in Python (launching
kernels, hooks) does not scale with devices: DataParallel stops scaling beyond a
few GPUs, and DistributedDataParallel (one process per device) replaces it.

Without GPUs, the devices are *virtual*: several entries that are all
``torch.device("cpu")``. Each replica is still a separate module run by its own
thread, so the algorithm (and its numbers) are the same; only the copies are
free, because a replica on the device where the weights live uses a
differentiable view of them instead of a copy.
"""
from __future__ import annotations

import contextlib
import threading
import time
import traceback
import warnings
from typing import Any, List, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_iter

from ..runtime.devices import Devices, as_device, as_devices, device_name


def first_tensor(obj: Any) -> Optional[torch.Tensor]:
    """The first tensor among the leaves of ``obj`` (any container ``torch.utils._pytree``
    knows: tuples, lists, dicts, namedtuples, registered dataclasses...), or None."""
    return next((leaf for leaf in tree_iter(obj) if isinstance(leaf, torch.Tensor)), None)


# --------------------------------------------------------------------- scatter
def _scatter_tensor(t: torch.Tensor, devices: List[torch.device], dim: int) -> list:
    if t.dim() == 0:
        raise ValueError("scatter: cannot split a 0-dim tensor; give it a batch dimension, "
                         "or pass a Python number (it is copied to every device)")
    if t.size(dim) == 0:
        raise ValueError(f"scatter: the batch is empty (size 0 along dim {dim}); pass at least one sample")
    chunks = torch.chunk(t, len(devices), dim)  # may be fewer than len(devices)
    out = []
    for i, c in enumerate(chunks):
        c = c.to(devices[i], non_blocking=devices[i].type == "cuda")  # a view on the same device, a copy elsewhere
        out.append(c)
    return out


def _zip(parts: list, where: str) -> list:
    """zip(*parts) that refuses tensors split into different numbers of chunks."""
    counts = {len(p) for p, from_tensor in parts if from_tensor}
    if len(counts) > 1:
        raise ValueError(f"scatter: the tensors in {where} split into different numbers of chunks "
                         f"{sorted(counts)}: give every tensor the same size along the batch dim")
    return list(zip(*[p for p, _ in parts]))


def scatter(obj: Any, devices: Devices, dim: int = 0) -> list:
    """Split every tensor in ``obj`` (nested tuples/lists/dicts) into per-device chunks.

    Returns one entry per chunk, with ``obj``'s structure. Other objects are
    passed to every chunk unchanged. There are ``len(torch.chunk(x, n))``
    entries, which is fewer than ``n`` devices when the batch is small.
    """
    devices = as_devices(devices)

    def scatter_map(o):  # -> (list of per-device values, whether a tensor set the length)
        if isinstance(o, torch.Tensor):
            return _scatter_tensor(o, devices, dim), True
        if isinstance(o, (tuple, list, dict)) and len(o) > 0:
            values = list(o.values()) if isinstance(o, dict) else list(o)
            parts = [scatter_map(v) for v in values]
            rows = _zip(parts, type(o).__name__)
            has_tensor = any(f for _, f in parts)
            if isinstance(o, dict):
                return [type(o)(zip(o.keys(), r)) for r in rows], has_tensor
            if isinstance(o, tuple) and hasattr(o, "_fields"):  # namedtuple
                return [type(o)(*r) for r in rows], has_tensor
            return [type(o)(r) for r in rows], has_tensor
        return [o for _ in devices], False

    return scatter_map(obj)[0]


def scatter_kwargs(inputs: tuple, kwargs: Optional[dict], devices: Devices, dim: int = 0):
    """Scatter positional and keyword arguments together: one ``(args, kwargs)`` pair per chunk.

    Their tensors must split into the same number of chunks; other arguments
    (``scale=0.5``) go to every chunk. No arguments at all: one empty chunk.
    """
    if not inputs and not kwargs:
        return [()], [{}]
    parts = scatter((tuple(inputs), dict(kwargs or {})), devices, dim)
    return [args for args, _ in parts], [kws for _, kws in parts]


# ------------------------------------------------------------------- replicate
def replicate(module: nn.Module, devices: Devices) -> List[nn.Module]:
    """One replica of ``module`` per device, connected to it through autograd.

    A replica is a shallow copy of each submodule whose parameters are
    differentiable copies of the original's: ``p.to(device)`` on another device,
    a differentiable view ``p.view_as(p)`` on the device where ``p`` lives (no
    bytes copied). ``loss.backward()`` therefore sums every replica's gradient
    into ``module``'s ``.grad``. Buffers (BatchNorm statistics) are aliased by
    replica 0 only, so its updates persist, as in ``torch.nn.DataParallel``;
    the other replicas get detached copies. Shared submodules and tied
    parameters stay shared inside each replica.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"replicate: expected an nn.Module, got {type(module).__name__}")
    devices = as_devices(devices)
    grad = torch.is_grad_enabled()

    def copy_param(p, i, dev):
        c = p.view_as(p) if p.device == dev else p.to(dev, copy=True)  # recorded by autograd
        return c if grad and p.requires_grad else c.detach()  # (nothing recorded then anyway)

    def copy_buffer(b, i, dev):
        return b if (i == 0 and b.device == dev) else b.detach().to(dev, copy=True)

    replicas = []
    for i, dev in enumerate(devices):
        tensors, mods = {}, {}

        def rep(m):
            if id(m) in mods:
                return mods[id(m)]
            r = m.__new__(type(m))
            r.__dict__ = m.__dict__.copy()
            r._parameters, r._buffers, r._modules = {}, {}, {}
            r._is_replica = True
            mods[id(m)] = r
            for store, copy in (("_parameters", copy_param), ("_buffers", copy_buffer)):
                for k, t in getattr(m, store).items():
                    if t is not None and id(t) not in tensors:  # a tied tensor is copied once
                        tensors[id(t)] = copy(t, i, dev)
                    getattr(r, store)[k] = None if t is None else tensors[id(t)]
            for k, child in m._modules.items():
                r._modules[k] = None if child is None else rep(child)
            return r

        replicas.append(rep(module))
    return replicas


# -------------------------------------------------------------- parallel_apply
def _autocast_state() -> list:
    """The autocast settings of the calling thread, per device type, to re-enter in a worker."""
    return [(dt, torch.get_autocast_dtype(dt)) for dt in ("cpu", "cuda") if torch.is_autocast_enabled(dt)]


def _device_of(module: nn.Module, inp: Any) -> torch.device:
    """Where a replica runs: its input's device, else its parameters', else the CPU."""
    t = first_tensor(inp)
    if t is None:
        t = next(iter(list(module.parameters()) + list(module.buffers())), None)
    return torch.device("cpu") if t is None else t.device


def parallel_apply(modules: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Optional[Sequence[dict]] = None,
                   devices: Devices = None, timeout: float = 600.0) -> list:
    """Run ``modules[i](*inputs[i], **kwargs[i])``, one thread per replica; return the outputs in order.

    Grad mode and autocast (CPU and CUDA, with their dtypes) are read in the
    calling thread and re-entered in every worker; on CUDA each worker runs on
    its device's current stream. An exception in a worker is re-raised here,
    naming the replica and its device. A worker still running after
    ``timeout`` seconds raises ``TimeoutError``.
    """
    n = len(modules)
    if len(inputs) != n:
        raise ValueError(f"parallel_apply: {n} modules but {len(inputs)} inputs; pass one input per replica")
    kwargs = [{} for _ in range(n)] if kwargs is None else list(kwargs)
    if len(kwargs) != n:
        raise ValueError(f"parallel_apply: {n} modules but {len(kwargs)} kwargs dicts")
    inputs = [x if isinstance(x, (list, tuple)) else (x,) for x in inputs]
    devs = [_device_of(m, x) for m, x in zip(modules, inputs)] if devices is None else as_devices(devices)[:n]
    if len(devs) < n:
        raise ValueError(f"parallel_apply: {n} modules but only {len(devs)} devices")
    grad_enabled, autocast = torch.is_grad_enabled(), _autocast_state()
    streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devs]
    results, errors = [None] * n, [None] * n

    def worker(i):
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad_enabled))
                if streams[i] is not None:
                    stack.enter_context(torch.cuda.device(devs[i]))
                    stack.enter_context(torch.cuda.stream(streams[i]))
                for dt, dtype in autocast:
                    stack.enter_context(torch.autocast(dt, dtype=dtype))
                results[i] = modules[i](*inputs[i], **kwargs[i])
        except BaseException as e:  # re-raised in the calling thread
            errors[i] = (e, traceback.format_exc())

    if n == 1:
        worker(0)
    else:
        threads = [threading.Thread(target=worker, args=(i,), name=f"replica-{i}", daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [i for i, t in enumerate(threads) if t.is_alive()]
        if alive:
            raise TimeoutError(f"parallel_apply: replicas {alive} still running after {timeout} s")
    for i, err in enumerate(errors):
        if err is not None:
            e, tb = err
            msg = f"Caught {type(e).__name__} in replica {i} on device {device_name(devs, i)}.\nOriginal {tb}"
            try:
                new = type(e)(msg)
            except Exception:
                new = RuntimeError(msg)
            raise new from e
    return results


# ---------------------------------------------------------------------- gather
def gather(outputs: Sequence[Any], target_device: Any, dim: int = 0) -> Any:
    """Concatenate per-device outputs (nested tuples/lists/dicts) on ``target_device``.

    Differentiable: backward slices the gradient and sends each piece back to
    its device. 0-dim outputs (per-device losses) become a vector, with a
    warning, as in ``torch.nn.DataParallel``. ``target_device=-1`` means CPU.
    """
    if len(outputs) == 0:
        raise ValueError("gather: no outputs to gather")
    target = as_device(target_device)

    def gather_map(outs):
        out = outs[0]
        if isinstance(out, torch.Tensor):
            if not all(isinstance(o, torch.Tensor) for o in outs):
                raise TypeError("gather: a tensor on one device but not on another")
            if all(o.dim() == 0 for o in outs):
                warnings.warn("gather: all outputs are scalars; returning them as a vector (one per device)", stacklevel=2)
                outs = [o.view(1) for o in outs]
            # non_blocking only towards a GPU: a CPU result must not be read before its copy lands
            res = torch.cat([o.to(target, non_blocking=target.type == "cuda") for o in outs], dim)
            return res
        if out is None:
            return None
        if isinstance(out, dict):
            if any(set(o) != set(out) for o in outs):
                raise ValueError("gather: the per-device dicts have different keys")
            return type(out)((k, gather_map([o[k] for o in outs])) for k in out)
        if isinstance(out, (list, tuple)):
            if any(len(o) != len(out) for o in outs):
                raise ValueError("gather: the per-device sequences have different lengths")
            vals = [gather_map(list(v)) for v in zip(*outs)]
            return type(out)(*vals) if hasattr(out, "_fields") else type(out)(vals)
        raise TypeError(f"gather: cannot gather {type(out).__name__}; return tensors "
                        "(or tuples/lists/dicts of tensors) from the module")

    return gather_map(list(outputs))


# ---------------------------------------------------------------- DataParallel
class DataParallel(nn.Module):
    """``torch.nn.DataParallel``, written with the four functions above.

    ``forward`` scatters the inputs over ``device_ids``, replicates the module,
    runs the replicas in parallel and gathers the outputs on ``output_device``
    (default: ``device_ids[0]``, where the module must live). With one device
    it calls the module directly. The wrapped module is ``.module`` (so a
    ``state_dict`` has ``module.`` prefixes, as with PyTorch's).
    """

    def __init__(self, module: nn.Module, device_ids: Devices = None, output_device: Any = None, dim: int = 0):
        super().__init__()
        self.module = module
        self.device_ids = as_devices(device_ids)
        self.output_device = self.device_ids[0] if output_device is None else as_device(output_device)
        self.dim = dim

    def _check_module_device(self):
        src = self.device_ids[0]
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            if t.device != src:
                raise ValueError(f"{type(self).__name__}: the module's parameters and buffers must be on "
                                 f"device_ids[0] = {src}, found one on {t.device}; call module.to('{src}') first")

    def forward(self, *inputs, **kwargs):
        self._check_module_device()
        ins, kws = scatter_kwargs(inputs, kwargs, self.device_ids, self.dim)
        if len(self.device_ids) == 1:
            return self._single(self.module(*ins[0], **kws[0]))
        used = self.device_ids[: len(ins)]
        replicas = replicate(self.module, used)
        outputs = parallel_apply(replicas, ins, kws, used)
        return self.gather(outputs, self.output_device)

    def _single(self, output):
        return output

    def gather(self, outputs: list, output_device: torch.device) -> Any:
        return gather(outputs, output_device, dim=self.dim)
