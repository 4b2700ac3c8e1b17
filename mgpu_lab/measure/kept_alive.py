"""What a forward keeps alive, found without trusting its saved-tensor hooks.

``saved_tensor_bytes`` (``measure/activation_memory.py``) counts what autograd
saves for backward with a saved-tensor *pack hook*. Hooks nest: while ``fn``
runs under a hook of its own (``torch.utils.checkpoint``, CPU offloading, a
checkpoint you wrote), autograd hands the saved tensors to the innermost hook
only, and an outer counter sees none of them, whether the inner hook drops them
(a real checkpoint) or keeps every one (a checkpoint in name only). Selective
checkpointing keeps its cached tensors outside autograd altogether.

``kept_alive`` asks the operators instead. A ``TorchDispatchMode`` sees every
operator that runs below autograd, hooks or not, and keeps a *weak* reference
to the storage of each tensor an operator makes. When ``fn`` returns (its result
held, as a training step holds it until backward), the storages still alive are
the memory the forward keeps::

    report = kept_alive(lambda h: checkpoint(block, h), x)
    report.nbytes        # bytes kept alive
    report.tensors       # [(op, shape, dtype, bytes)], one per storage, largest first
    report.ops           # every operator the mode saw, in order

Counted: storages first made by an operator while ``fn`` ran and still alive
when it returns, except the result's own (you hold those anyway). Not counted:
what existed before ``fn`` ran (inputs, parameters, and views of them), memory
moved out of torch (a numpy copy, a file), and operators run while dispatch
modes are disabled: ``ops`` lists what the mode saw, so a check can tell a
forward it did not see. Costs a Python call per operator: use it to measure,
not to train.
"""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.utils._pytree import tree_leaves

from .measuring_mode import MeasuringMode

__all__ = ["KeptAlive", "kept_alive"]


@dataclass
class KeptAlive:
    """What ``fn``'s forward left alive: total bytes, one row per storage, the operators seen."""

    nbytes: int
    tensors: List[Tuple[str, Tuple[int, ...], str, int]] = field(default_factory=list)
    ops: List[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [f"{'made by':<28} {'shape':<18} {'dtype':<9} {'bytes':>9}"]
        rows += [f"{op:<28} {str(shape):<18} {dtype:<9} {n:>9}" for op, shape, dtype, n in self.tensors]
        rows.append(f"{'total':<57} {self.nbytes:>9}")
        return "\n".join(rows)


def _storage(t: torch.Tensor):
    """``(key, storage)`` of a strided tensor with memory, else None."""
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, no storage
        return None
    if s.nbytes() == 0 or s.device.type == "meta":
        return None
    return (str(s.device), s.data_ptr()), s


class Recorder(MeasuringMode):
    """Weak references to the storage of every tensor an operator makes or reads."""

    def __init__(self):
        super().__init__()
        self.made: Dict[tuple, Tuple[weakref.ref, str, Tuple[int, ...], str]] = {}
        self.before: Dict[tuple, weakref.ref] = {}  # storages that existed before fn
        self.ops: List[str] = []

    def _known(self, key, table) -> bool:
        return key in table and (table[key][0] if table is self.made else table[key])() is not None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                found = _storage(t)
                if found and not self._known(found[0], self.made):
                    self.before[found[0]] = weakref.ref(found[1])
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__)
        self.ops.append(name)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                found = _storage(t)
                if found is None:
                    continue
                key, s = found
                if self._known(key, self.before) or self._known(key, self.made):
                    continue  # a view of memory that existed already (or an in-place result)
                self.made[key] = (weakref.ref(s), name, tuple(t.shape), str(t.dtype).replace("torch.", ""))
        return out


def kept_alive(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> KeptAlive:
    """Run ``fn(*args, **kwargs)`` with grad enabled and report the memory it keeps alive.

    See the module docstring for what is counted. The result is held while the
    count is taken, then dropped.
    """
    recorder = Recorder()
    with torch.enable_grad(), recorder:
        result = fn(*args, **kwargs)
    gc.collect(1)  # young unreachable cycles are not memory the forward keeps (a full collection costs ~0.5 s)
    own = {found[0] for t in tree_leaves(result) if isinstance(t, torch.Tensor)
           for found in [_storage(t)] if found}
    rows = []
    for key, (ref, op, shape, dtype) in recorder.made.items():
        s = ref()
        if s is not None and key not in own:
            rows.append((op, shape, dtype, s.nbytes()))
    del result
    rows.sort(key=lambda r: -r[3])
    return KeptAlive(sum(r[3] for r in rows), rows, recorder.ops)
