"""A collective trace: what each rank called, and the first place where ranks disagree.

Collectives must be called by every rank, in the same order, with matching
shapes and dtypes. When a rank skips one (``if rank == 0: dist.all_reduce(x)``)
or sends another shape, the others wait forever (or until the process group's
timeout: 30 minutes by default on gloo, 10 on NCCL) and the error says only
"timed out". PyTorch helps in two ways: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (set
before the group is made) checks each collective's type and shapes across ranks
before running it, and a stack dump (``launch`` prints one for ranks that hang;
``py-spy dump`` for torchrun jobs) shows where each rank waits. The *history*
(which rank went off script, and at which call) is in torch's flight recorder,
dumped to files on an NCCL timeout and merged afterwards (``torchfrtrace``), or
compared across ranks while they run, here.

``collective_trace`` records it. While it is active, the ``torch.distributed``
collectives are wrapped (patched from outside: the code under test is
unchanged); each call records ``(op, shape, dtype, root, call site)`` in this
rank's sequence, locally and in the process group's store, which every rank
can read even when a peer is stuck or dead. When a traced collective fails or
waits longer than ``timeout`` seconds, it raises ``CollectiveError`` whose
message compares every rank's sequence and names the first collective where
they disagree::

    with collective_trace(timeout=5):
        train()            # any code: yours, mgpu_lab's, a library's

Before each call it also looks at what the peers already recorded at that
position: a peer that made a *different* call there, or left the traced region
without making it, will never match, so it raises at once instead of letting
the backend pair mismatched messages (gloo may abort the process, NCCL may hang
or read garbage). Works inside ``launch()`` and under torchrun (any process
group with a store). DTensor's collectives (``fully_shard``, ``parallelize_module``,
sequence parallelism, ``full_tensor()``) go through
``torch.distributed._functional_collectives`` (``all_reduce``, ``all_gather_single``,
``reduce_scatter_single``, ...) and DTensor's all-to-all: those are traced too, under
their own names. ``report()`` after the region waits until every rank has left it
(at most ``timeout`` seconds, else 60) before it compares, so a rank
that is merely slower is not taken for one that disagrees. A collective that fails
because a peer died says so, rather than blaming a mismatch. Costs 1 + 2·(N-1) small store messages per collective
while active (``benchmarks/bench_faults.py`` measures it); nothing when inactive. Limits: calls made from C++ (torch's DDP
reducer) are not seen — use ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` there; waits on
``async_op=True`` handles and on the ``*_object`` and point-to-point calls are
bounded by the group's timeout, not ``timeout``; point-to-point calls are
recorded but not compared (their peers differ by design).
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import threading
import time
from contextlib import ContextDecorator
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d as c10d

from ..runtime._diagnosis import collective_failed, peer_died
from ..runtime.distributed import require_process_group

from .trace_compare import _END, P2P, Divergence, _key, describe, format_report

# op -> (position, keyword) of the tensor whose shape describes the call
_TENSOR_ARG = {
    "all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
    "all_gather": (1, "tensor"), "all_gather_into_tensor": (1, "input_tensor"),
    "all_gather_single": (1, "input_tensor"),
    "reduce_scatter": (0, "output"), "reduce_scatter_tensor": (1, "input"), "reduce_scatter_single": (1, "input"),
    "all_to_all": (1, "input_tensor_list"), "all_to_all_single": (1, "input"),
    "gather": (0, "tensor"), "scatter": (0, "tensor"), "barrier": (None, None),
    "monitored_barrier": (None, None), "all_gather_object": (None, None), "gather_object": (None, None),
    "broadcast_object_list": (None, None), "scatter_object_list": (None, None),
    "send": (0, "tensor"), "recv": (0, "tensor"), "isend": (0, "tensor"), "irecv": (0, "tensor"),
    "batch_isend_irecv": (None, None),
}
# torch.distributed._functional_collectives (DTensor's): the tensor is the first argument
_FUNCOL_OPS = ("all_reduce", "all_gather_single", "all_gather_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_to_all_single", "all_gather_single_autograd",
               "all_gather_tensor_autograd", "reduce_scatter_single_autograd", "reduce_scatter_tensor_autograd",
               "all_to_all_single_autograd", "all_reduce_coalesced", "broadcast")
_ROOT_ARG = {"broadcast": (1, "src"), "reduce": (1, "dst"), "gather": (2, "dst"), "scatter": (2, "src"),
             "send": (1, "dst"), "recv": (1, "src"), "isend": (1, "dst"), "irecv": (1, "src")}
_TIMED = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
          "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
          "gather", "scatter", "barrier"}
_LIB = os.path.dirname(os.path.dirname(__file__))
# frames never named as a call site: torch, this module, functools, launch, and the library's
# pass-through to torch's all-gather and reduce-scatter (its caller is named instead)
_SKIP_FILES = (os.path.dirname(torch.__file__), __file__.rstrip("c"), os.path.dirname(functools.__file__),
               os.path.join(_LIB, "runtime", "launch.py"), os.path.join(_LIB, "parallel", "comm.py"))
_trace_ids = itertools.count()
_local = threading.local()  # per thread: depth of nested traced calls
_active: List["CollectiveTrace"] = []  # the patching is per process: one trace at a time


class CollectiveError(RuntimeError):
    """A traced collective failed or timed out. ``report`` compares every rank's
    sequence; ``divergence`` is the first place where they disagree (or None)."""

    def __init__(self, message: str, report: str, divergence: Optional["Divergence"]):
        super().__init__(message)
        self.report, self.divergence = report, divergence


class CollectiveTrace(ContextDecorator):
    """Record this rank's collectives while active; see the module docstring."""

    def __init__(self, timeout: Optional[float] = None):
        if timeout is not None and timeout <= 0:
            raise ValueError(f"collective_trace(timeout={timeout!r}): give a positive number of seconds, or None")
        self.timeout = timeout
        self.records: List[dict] = []
        self._saved: Dict[Any, Dict[str, Any]] = {}
        self._store = None
        self._prefix = ""
        self._compared = 0  # collectives published (point-to-point calls are not compared)
        self.rank, self.world_size = 0, 1

    # ------------------------------------------------------------------ activation
    def __enter__(self) -> "CollectiveTrace":
        require_process_group("collective_trace()")
        if _active:
            raise RuntimeError("collective_trace(): a trace is already active in this process")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._prefix = f"mgpu_lab/trace/{next(_trace_ids)}/"
        try:
            self._store = c10d._get_default_store()
        except Exception:  # private API; without a store the report shows this rank only
            self._store = None
        for module in (dist, c10d):
            saved = self._saved.setdefault(module, {})
            for op in _TENSOR_ARG:
                if hasattr(module, op):
                    saved[op] = getattr(module, op)
                    setattr(module, op, self._wrap(op, saved[op]))
        for module, ops in _dtensor_modules():
            saved = self._saved.setdefault(module, {})
            for op in ops:
                if hasattr(module, op):
                    saved[op] = getattr(module, op)
                    setattr(module, op, self._wrap(op, saved[op], funcol=True))
        _active.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        for module, saved in self._saved.items():
            for op, fn in saved.items():
                setattr(module, op, fn)
        self._saved.clear()
        _active.clear()
        self._publish("end", str(self._compared))
        return False

    # ------------------------------------------------------------------ recording
    def _publish(self, key: str, value: str) -> None:
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}{self.rank}/{key}", value)
            except Exception:  # the store is gone (its host died): go on, reporting this rank only
                self._store = None

    def _peek(self, rank: int, key: str) -> Optional[str]:
        full = f"{self._prefix}{rank}/{key}"  # check first: get() would wait for a missing key
        try:
            return self._store.get(full).decode() if self._store and self._store.check([full]) else None
        except Exception:
            return None

    def _wrap(self, op: str, fn, funcol: bool = False):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if getattr(_local, "depth", 0) > 0:  # inside another traced call (*_object): time it, don't record
                return fn(*args, **kwargs) if funcol else self._call(op, fn, args, kwargs)
            record = _describe_funcol(op, args) if funcol else _describe_call(op, args, kwargs)
            record["i"] = len(self.records)
            self.records.append(record)
            if op not in P2P:
                record["n"] = self._compared
                self._compared += 1
                self._publish(str(record["n"]), json.dumps(record))
                self._check_peers(record)
            _local.depth = 1
            try:
                result = fn(*args, **kwargs) if funcol else self._call(op, fn, args, kwargs)
            except RuntimeError as exc:
                raise self._error(record, exc) from exc
            finally:
                _local.depth = 0
            return result
        return traced

    def _check_peers(self, record: dict) -> None:
        """Before entering collective n: a peer that already made a different call n, or
        left the traced region without making it, will never match it. Raise now, rather
        than let the backend pair mismatched messages (gloo aborts the process) or hang."""
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            theirs = self._peek(rank, str(record["n"]))
            if theirs is not None:
                if _key(json.loads(theirs)) != _key(record):
                    raise self._error(record, None)
                continue
            ended = self._peek(rank, "end")  # it left after fewer calls: it will not come
            if ended is not None and int(ended) <= record["n"]:
                raise self._error(record, None)

    def _call(self, op, fn, args, kwargs):
        if self.timeout is None or op not in _TIMED or kwargs.get("async_op"):
            return fn(*args, **kwargs)
        work = fn(*args, **{**kwargs, "async_op": True})
        if work is not None:  # None: this rank is not in the group
            work.wait(timeout=timedelta(seconds=self.timeout))
        return None

    # ------------------------------------------------------------------ reporting
    def wait_for_ranks(self, timeout: Optional[float] = None) -> List[int]:
        """Wait until every rank has left the traced region (at most ``timeout`` seconds: the
        trace's own, else 60); returns the ranks still inside."""
        if self._store is None:
            return []
        if timeout is None:
            timeout = self.timeout if self.timeout is not None else 60.0
        deadline, inside = time.monotonic() + timeout, list(range(self.world_size))
        while True:
            inside = [r for r in inside if self._peek(r, "end") is None]
            if not inside or time.monotonic() >= deadline:
                return inside
            time.sleep(0.01)

    def gather(self) -> Dict[int, List[dict]]:
        """Every rank's compared calls as published in the store (this rank's alone without one),
        ending with an ``<end>`` record for a rank that left the traced region."""
        if self._store is None:
            return {self.rank: [r for r in self.records if r["op"] not in P2P]}
        traces = {}
        for rank in range(self.world_size):
            recs = []
            while True:
                raw = self._peek(rank, str(len(recs)))
                if raw is None:
                    break
                recs.append(json.loads(raw))
            if self._peek(rank, "end") is not None:
                recs.append({"op": _END})
            traces[rank] = recs
        return traces

    def report(self, wait: bool = True) -> str:
        """Every rank's sequence compared; after the region, first wait for every rank to leave it
        (``wait_for_ranks``), so that a slower rank is not reported as one that disagrees."""
        still = self.wait_for_ranks() if wait and not self._saved else []
        text = format_report(self.gather())[0]
        if still:
            text += (f"\n(ranks {still} had not left the traced region after waiting: still running, "
                     "or stuck; their sequences may be incomplete)")
        return text

    def _error(self, record: dict, exc: Optional[Exception]) -> CollectiveError:
        text, div = format_report(self.gather())
        if exc is not None and peer_died(str(exc)):
            dead = collective_failed(f"{describe(record)} (collective #{record.get('n', record['i'])}, at "
                                     f"{record.get('where')})", exc)
            return CollectiveError(f"{dead}\n{text}", text, div)
        if exc is None:
            what = "not started: the ranks disagree (see below)"
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            limit = f" within {self.timeout:g} s" if self.timeout is not None and "timed out" in first.lower() else ""
            what = f"did not complete{limit}: {first}"
        message = f"rank {self.rank}: {describe(record)} (collective #{record.get('n', record['i'])}, at {record.get('where')}) {what}\n{text}"
        return CollectiveError(message, text, div)


def collective_trace(timeout: Optional[float] = None) -> CollectiveTrace:
    """Trace this rank's collectives; each traced wait is bounded by ``timeout`` seconds (None:
    the process group's timeout). Use as ``with collective_trace(5): ...`` or as a decorator."""
    return CollectiveTrace(timeout)


# --------------------------------------------------------------------------- helpers

def _dtensor_modules():
    """Where DTensor looks its collectives up at call time: (module, names to patch)."""
    out = [(funcol, _FUNCOL_OPS)]
    try:
        from torch.distributed.tensor import placement_types
        out.append((placement_types, ("shard_dim_alltoall",)))
    except ImportError:
        pass
    return out


def _describe_funcol(op: str, args) -> dict:
    tensor = args[0] if args else None
    record: Dict[str, Any] = {"op": op, "shape": None, "dtype": None, "root": None, "where": _call_site()}
    if isinstance(tensor, (list, tuple)) and tensor and isinstance(tensor[0], torch.Tensor):
        record["shape"], record["dtype"] = [list(t.shape) for t in tensor], str(tensor[0].dtype).replace("torch.", "")
    elif isinstance(tensor, torch.Tensor):
        record["shape"], record["dtype"] = list(tensor.shape), str(tensor.dtype).replace("torch.", "")
    return record


def _describe_call(op: str, args, kwargs) -> dict:
    record: Dict[str, Any] = {"op": op, "shape": None, "dtype": None, "root": None, "where": _call_site()}
    pos, name = _TENSOR_ARG[op]
    tensor = kwargs.get(name, args[pos] if pos is not None and len(args) > pos else None) if name else None
    if isinstance(tensor, (list, tuple)) and tensor and isinstance(tensor[0], torch.Tensor):
        record["shape"], record["dtype"] = [list(t.shape) for t in tensor], str(tensor[0].dtype).replace("torch.", "")
    elif isinstance(tensor, torch.Tensor):
        record["shape"], record["dtype"] = list(tensor.shape), str(tensor.dtype).replace("torch.", "")
    if op in _ROOT_ARG:
        pos, name = _ROOT_ARG[op]
        root = kwargs.get(name, args[pos] if len(args) > pos else None)
        record["root"] = root if isinstance(root, int) else None
    return record


def _short(filename: str) -> str:
    if "ipykernel_" in filename or filename.startswith("<"):
        return "<cell>"
    parts = filename.replace("\\", "/").split("/")
    if "mgpu_lab" in parts[:-1]:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("mgpu_lab"):])
    return parts[-1]


def _call_site(depth: int = 2) -> str:
    """The first two frames outside torch and this module: 'ddp.py:136 in f < train.py:40 in main'."""
    frame, sites = sys._getframe(2), []
    while frame is not None and len(sites) < depth:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIP_FILES):
            sites.append(f"{_short(filename)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(sites)
