"""Watching code from below the Python API: which collectives it issued, what it left alive.

Both instruments are ``TorchDispatchMode``s: every ATen operator the code under watch
dispatches passes through them while they are active, whichever Python function issued it
(``dist.all_reduce``, ``dist.all_gather_single``, a ``ProcessGroup`` method,
``torch.distributed._functional_collectives``, FSDP's internals, a DTensor redistribution
that Python code asks for: ``redistribute``, ``full_tensor``, a parallel style's hook). The
code under watch needs no change and cannot skip them by calling another spelling of the
same collective. What an operator runs *inside* its own dispatch is not seen: a mode gets
the operator first, and while it runs it the mode is off. So the collectives DTensor issues
while it dispatches an operator on DTensors — ``loss_parallel``'s cross-entropy, a
redistribution DTensor decides on its own to run an operator (implicit redistribution) —
are not logged; only that operator is, once, with DTensor arguments.

* ``CollectiveLog`` records each collective as ``(kind, dtype, numel)``, kind one of
  ``"all-gather"``, ``"reduce-scatter"``, ``"all-reduce"``, ``"broadcast"``... numel is the
  size of the whole collective, the same for every spelling of it: an all-gather's gathered
  output, a reduce-scatter's unreduced input, an all-reduce's or a broadcast's tensor, an
  all-to-all's larger side; for the list forms (``dist.all_gather``, ``dist.reduce_scatter``)
  one element of the list, and for the coalesced forms the sum over the tensors they carry.
  The functional collectives that DTensor issues (``_c10d_functional``) return their output
  rather than receive it: an all-gather there is given its shard and the group's size, and
  its numel is their product. With ``compute=True`` a
  ``("compute",)`` entry for each matrix product, so that the order of
  communication and computation can be read (prefetching)::

      with CollectiveLog() as log:
          loss.backward()
      log.kinds()            # ['all-gather', 'reduce-scatter', ...]

* ``HeldAtOnce`` follows the storages made while it is active from their creation until
  they are freed: ``peak`` is the most bytes they held at one time (what a forward and a
  backward need at once, saved tensors and transient ones together), ``held`` the bytes
  still held now.

* ``OpNames`` records the names of the ATen operators run while active (``names``, a set:
  ``"mm"``, ``"_scaled_dot_product_flash_attention_for_cpu"``...), whichever Python spelling
  called them (``F.scaled_dot_product_attention``, ``torch.ops.aten.<op>``, a library's helper).

* ``KeptAlive`` is :mod:`mgpu_lab.measure.kept_alive`'s recorder as a ``with`` block:
  ``kept(min_bytes)`` lists the storages made while it was active, of at least
  ``min_bytes``, that are still referenced afterwards (saved for backward, stashed in
  a global, cached on an object). A storage that was freed
  (``untyped_storage().resize_(0)``, as FSDP does) counts for nothing.

Cost: one Python call per operator while active (use them on small checks).
Limits: work that never reaches the dispatcher (a TCPStore, a pipe, C++ code
holding tensors it did not get from an operator) is not seen.
"""
from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Dict, List, Tuple

import torch
from torch.utils._pytree import tree_leaves

from .kept_alive import Recorder, _storage
from .measuring_mode import MeasuringMode

KINDS = {
    "_allgather_base_": "all-gather", "allgather_": "all-gather", "allgather_coalesced_": "all-gather",
    "allgather_into_tensor_coalesced_": "all-gather", "all_gather_into_tensor": "all-gather",
    "all_gather_into_tensor_coalesced": "all-gather",
    "_reduce_scatter_base_": "reduce-scatter", "reduce_scatter_": "reduce-scatter",
    "reduce_scatter_tensor_coalesced_": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter_tensor_coalesced": "reduce-scatter",
    "allreduce_": "all-reduce", "allreduce_coalesced_": "all-reduce", "all_reduce": "all-reduce",
    "all_reduce_coalesced": "all-reduce",
    "all_reduce_": "all-reduce", "all_reduce_coalesced_": "all-reduce",
    "all_gather_into_tensor_out": "all-gather", "reduce_scatter_tensor_out": "reduce-scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast", "reduce_": "reduce", "gather_": "gather",
    "scatter_": "scatter", "alltoall_": "all-to-all", "alltoall_base_": "all-to-all", "all_to_all_single": "all-to-all",
}
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
COMPUTE = ("mm", "addmm", "bmm", "baddbmm")
# coalesced forms: one call carries several tensors (c10d: the outputs of an all-gather, the inputs of a
# reduce-scatter), the collective's size is their sum
COALESCED = {"allgather_into_tensor_coalesced_": 0, "reduce_scatter_tensor_coalesced_": 1, "allreduce_coalesced_": 0,
             "all_gather_into_tensor_coalesced": 0, "reduce_scatter_tensor_coalesced": 0,
             "all_reduce_coalesced": 0, "all_reduce_coalesced_": 0}


def _numel(func, args, kwargs, tensors) -> Tuple[torch.dtype, int]:
    """(dtype, numel) of the whole collective ``func(*args, **kwargs)``: see the module's docstring."""
    name, functional = func._opname, func.namespace == "_c10d_functional"
    if name in COALESCED:
        group = [t for t in tree_leaves(args[COALESCED[name]]) if isinstance(t, torch.Tensor)]
        numel = sum(t.numel() for t in group)
        if functional and name == "all_gather_into_tensor_coalesced":
            numel *= args[1]                       # inputs are the shards: the gathered outputs are group_size times
        return group[0].dtype, numel
    if functional and name == "all_gather_into_tensor":     # (input, group_size, group_name): no output given
        return args[0].dtype, args[0].numel() * args[1]
    if functional and name == "all_to_all_single":          # (input, output_split_sizes, input_split_sizes, group)
        x, out_splits = args[0], args[1]
        out = sum(out_splits) * (x.numel() // x.shape[0]) if out_splits and x.dim() else x.numel()
        return x.dtype, max(x.numel(), int(out))
    big = max(tensors, key=lambda t: t.numel())
    return big.dtype, big.numel()


class CollectiveLog(MeasuringMode):
    """Records the collectives run while active: ``events`` is a list of ``(kind, dtype, numel)``
    (and ``("compute",)`` for each matrix product when ``compute=True``)."""

    def __init__(self, compute: bool = False):
        super().__init__()
        self.compute = compute
        self.events: List[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._opname
        if func.namespace in COLLECTIVE_NAMESPACES:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if tensors and name in KINDS:  # wait_tensor and friends carry the tensor of a call already recorded
                dtype, numel = _numel(func, args, kwargs, tensors)
                self.events.append((KINDS[name], str(dtype).replace("torch.", ""), numel))
        elif self.compute and name in COMPUTE:
            self.events.append(("compute",))
        return func(*args, **kwargs)

    def kinds(self) -> List[str]:
        """The kinds of the collectives, in order (compute entries left out)."""
        return [e[0] for e in self.events if e[0] != "compute"]

    def wire_bytes(self, world_size: int) -> dict:
        """``{(kind, dtype): bytes}`` one rank sends over a ring, *computed*: (N-1)/N of each
        collective's size (an all-reduce twice that). What the sockets carried is
        measured by :class:`mgpu_lab.measure.wire.WireMeter`."""
        out: dict = {}
        for e in self.events:
            if e[0] == "compute":
                continue
            kind, dtype, numel = e
            size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            sent = (world_size - 1) * numel * size // world_size * (2 if kind == "all-reduce" else 1)
            out[(kind, dtype)] = out.get((kind, dtype), 0) + sent
        return out


class KeptAlive(Recorder):
    """:func:`mgpu_lab.measure.kept_alive.kept_alive`'s recorder as a context manager, to
    watch a block of code rather than one call: ``kept(min_bytes)`` afterwards."""

    def kept(self, min_bytes: int = 1, settle: float = 1.0) -> List[Tuple[Tuple[int, ...], int]]:
        """``[(shape, storage bytes)]`` of the storages made while active that are still
        referenced and hold at least ``min_bytes`` (one entry per storage).

        A finished collective's buffers can stay referenced for a moment by the
        backend's own thread (gloo lets go of its work object just after the call has
        returned), so a storage is given up to ``settle`` seconds to be released; what
        the code under watch keeps stays alive through that wait and is reported."""
        gc.collect()
        deadline = time.monotonic() + settle
        while True:
            rows = []
            for ref, _, shape, _ in self.made.values():
                storage = ref()
                if storage is not None and storage.nbytes() >= min_bytes:
                    rows.append((shape, storage.nbytes()))
                del storage
            if not rows or time.monotonic() >= deadline:
                return rows
            time.sleep(0.02)


class OpNames(MeasuringMode):
    """The names of the operators run while active: ``names``, a set of ``func._opname``."""

    def __init__(self):
        super().__init__()
        self.names: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._opname)
        return func(*args, **(kwargs or {}))


class HeldAtOnce(MeasuringMode):
    """The bytes held at once by the storages made while active: ``peak`` the most at any
    time, ``held`` now; also ``largest``, the bytes of the largest tensor an operator returned
    (made, viewed or written), and ``written_before``, the bytes operators wrote in place (or
    through ``out=``) into storages that existed before.

    A storage counts from the operator that makes it until it is freed (a weak reference's
    finalizer: no reference left, in Python or in C++), at its size when made. Not counted:
    storages that existed before (inputs, parameters, and the views and in-place results of
    operators on them). A storage that a backend's thread still references for a moment
    after a collective returns counts until that thread lets go (gloo does so just after the
    call), so compare peaks of code that communicates alike, not to the byte."""

    def __init__(self):
        super().__init__()
        self.held = 0
        self.peak = 0
        self.largest = 0          # the bytes of the largest tensor an operator returned (a view: its own size)
        self.written_before = 0   # bytes operators wrote into storages that existed before (in place, out=)
        self._lock = threading.RLock()   # a finalizer may run inside the block that holds it
        self._made: Dict[tuple, Tuple[weakref.ref, int]] = {}   # key -> (storage, bytes) of the live ones
        self._before: Dict[tuple, weakref.ref] = {}

    @staticmethod
    def _alive(entry) -> bool:
        return entry is not None and (entry[0] if isinstance(entry, tuple) else entry)() is not None

    def _freed(self, key, token) -> None:
        with self._lock:
            entry = self._made.get(key)
            if entry is not None and entry[0] is token:    # not a newer storage at the same address
                del self._made[key]
                self.held -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                found = _storage(t)
                if found and not self._alive(self._made.get(found[0])):
                    self._before[found[0]] = weakref.ref(found[1])
        out = func(*args, **kwargs)
        mutates = func._schema.is_mutable
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                found = _storage(t)
                if found is None:
                    continue
                key, s = found
                self.largest = max(self.largest, t.numel() * t.element_size())
                with self._lock:
                    if self._alive(self._before.get(key)):
                        if mutates:
                            self.written_before += t.numel() * t.element_size()
                        continue   # a view or an in-place result of memory that existed before
                    if self._alive(self._made.get(key)):
                        continue   # a view or an in-place result of memory made here
                    token, n = weakref.ref(s), s.nbytes()
                    self._made[key] = (token, n)
                    self.held += n
                    self.peak = max(self.peak, self.held)
                weakref.finalize(s, self._freed, key, token)
        return out
