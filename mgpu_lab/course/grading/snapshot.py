"""The probe's results, serialised at the end of the probe itself (in the learner's kernel).

The runner appends one line to a graded cell's probe (:data:`LINE`): it calls :func:`take`
in the same execution, right after the probe's last statement, before control returns to
anything the learner wrote. A thread the learner started, or a later cell, that empties or
rewrites the probe's names afterwards changes nothing the judge sees.

:func:`take` works in two steps:

1. **copy**, while no other Python thread runs: the switch interval is raised and the copy
   calls nothing that releases the GIL (pure Python over plain containers, tensor bytes
   read with ``ctypes.string_at``); a tensor that is not on the CPU is copied there
   (``Tensor.to``, which lets other threads run for that copy);
2. **save**: the private copy is ``torch.save``\\ d, one file per name, into the runner's
   folder; the Python threads still running that are not the kernel's own are listed
   (a count and a few cleaned names, :data:`THREADS_FILE`).

What does not fit the answer's limits (bytes, values, nesting) is not saved (the runner
reports it missing); what is not plain data is saved as it is (the judge refuses it). The
files lie in the runner's scratch folder, which the kernel's user can write: code that
rewrites *them* forges the grader's files (tampering, beyond this module's reach).
"""
from __future__ import annotations

import json
import os
import re
import sys
import threading

THREADS_FILE = "threads.json"   # never a probe name's file (``<identifier>.pt``)
SWITCH_INTERVAL = 1.0           # seconds another thread waits for the GIL during the copy
DEPTH_LIMIT = 32
ITEM_LIMIT = 2**20
NAME_LIMIT, NAMES_SHOWN = 40, 5
# Threads that are not the learner's: the kernel's own, and tqdm's monitor (a progress bar's)
KERNEL_MODULES = ("ipykernel", "IPython", "jupyter_client", "zmq", "tornado", "traitlets", "tqdm")
# The line the runner appends to the probe: one line (a traceback through it names the line
# after the probe, the visible ``### JUDGE`` marker, never a hidden one), and no global name
# (a learner's ``get_ipython`` or ``__import__`` would be called instead): a lambda's own
# ``__globals__`` is the kernel's namespace, its ``__builtins__`` the interpreter's.
LINE = ("(lambda: 0).__builtins__['__import__']('mgpu_lab.course.grading.snapshot', None, None, "
        "['take']).take((lambda: 0).__globals__, {names!r}, {folder!r}, {limit!r})\n")


class _TooLarge(Exception):
    pass


class _Tensor:
    """A tensor copied in step 1: its storage's bytes and how the view reads them."""

    def __init__(self, t, data: bytes, key):
        self.data, self.key, self.dtype = data, key, t.dtype
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()
        self.requires_grad, self.parameter = t.requires_grad, type(t) is not torch.Tensor


torch = None            # imported by :func:`take` (the runner imports this module too, not torch)


def _copy(value, budget: list, memo: dict, depth: int = 0):
    """Step 1: ``value`` with its plain containers and CPU tensors copied (GIL held)."""
    budget[1] -= 1
    if budget[1] < 0 or depth > DEPTH_LIMIT:
        raise _TooLarge
    kind = type(value)
    if kind in (list, tuple, set, frozenset):
        return kind(_copy(v, budget, memo, depth + 1) for v in list(value))
    if kind is dict:
        return {_copy(k, budget, memo, depth + 1): _copy(v, budget, memo, depth + 1)
                for k, v in list(value.items())}
    if kind in (torch.Tensor, torch.nn.Parameter):
        return _copy_tensor(value, budget, memo)
    return value        # immutable scalars; anything else goes as it is (the judge decides)


def _copy_tensor(t, budget: list, memo: dict):
    import ctypes
    plain = (t.layout == torch.strided and not t.is_quantized and not t.is_nested
             and not t.is_conj() and not t.is_neg())
    if not plain or t.device.type != "cpu":
        return t        # copied in step 2 (``Tensor.to``/``clone``, other threads may run)
    storage = t.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes())
    if key not in memo:
        if key[1] > budget[0]:
            raise _TooLarge
        budget[0] -= key[1]
        memo[key] = ctypes.string_at(key[0], key[1]) if key[1] else b""
    return _Tensor(t, memo[key], key)


def _rebuild(value, memo: dict):
    """Step 2: the copy as tensors again (our own objects now: other threads may run)."""
    kind = type(value)
    if kind in (list, tuple, set, frozenset):
        return kind(_rebuild(v, memo) for v in value)
    if kind is dict:
        return {_rebuild(k, memo): _rebuild(v, memo) for k, v in value.items()}
    if kind is _Tensor:
        if value.key not in memo:
            memo[value.key] = torch.frombuffer(bytearray(value.data), dtype=torch.uint8) \
                if value.data else torch.empty(0, dtype=torch.uint8)
        t = torch.empty(0, dtype=value.dtype).set_(memo[value.key].untyped_storage(),
                                                   value.offset, value.size, value.stride)
        if value.parameter:
            return torch.nn.Parameter(t, requires_grad=value.requires_grad)
        return t.requires_grad_(value.requires_grad) if t.is_floating_point() or t.is_complex() else t
    if kind in (torch.Tensor, torch.nn.Parameter):      # not on the CPU, or not plain
        copy = value.detach().to("cpu", copy=True)
        if kind is torch.nn.Parameter:
            return torch.nn.Parameter(copy, requires_grad=value.requires_grad)
        return copy.requires_grad_(value.requires_grad) if copy.is_floating_point() else copy
    return value


def running_threads() -> list:
    """Python threads alive other than the main one and those of :data:`KERNEL_MODULES`."""
    main, out = threading.main_thread(), []
    for t in threading.enumerate():
        target = getattr(t, "_target", None)
        owner = getattr(target, "__self__", None)
        modules = (type(t).__module__, getattr(target, "__module__", None) or "",
                   type(owner).__module__ if owner is not None else "")
        if t is main or any(m.split(".")[0] in KERNEL_MODULES for m in modules if m):
            continue
        out.append(t)
    return out


def clean_name(name) -> str:
    """A thread's name as a report may show it (the learner chose it)."""
    return re.sub(r"[^\w .()-]", "?", str(name))[:NAME_LIMIT]


def take(ns: dict, names, folder: str, limit: int) -> None:
    """Save ``ns[name]`` for each of ``names`` into ``folder`` (``name.pt``), within ``limit``
    bytes of tensor storage in all, and the threads still running (:data:`THREADS_FILE`)."""
    global torch
    import ctypes  # noqa: F401  (imported before the copy: an import may let other threads run)
    import torch
    copies, old = {}, sys.getswitchinterval()
    try:
        sys.setswitchinterval(SWITCH_INTERVAL)
        budget, memo = [limit, ITEM_LIMIT], {}
        for name in names:
            if name in ns:
                before, held = list(budget), dict(memo)
                try:
                    copies[name] = _copy(ns[name], budget, memo)
                except Exception:         # past the limits (the next name may fit), or odd
                    budget[:], memo = before, held
        threads = running_threads()
    finally:
        sys.setswitchinterval(old)
    try:
        with open(os.path.join(folder, THREADS_FILE), "w") as f:
            json.dump({"running": len(threads),
                       "names": [clean_name(t.name) for t in threads[:NAMES_SHOWN]]}, f)
    except Exception:
        pass
    memo = {}
    for name, copy in copies.items():
        try:
            torch.save(_rebuild(copy, memo), os.path.join(folder, name + ".pt"))
        except Exception:
            pass
