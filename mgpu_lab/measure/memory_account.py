"""The device-memory account: how many bytes each device holds during a training step.

Under ``DataParallel`` device 0 does more than its share: it receives every
device's outputs (``gather``), computes the loss on the whole batch and holds
the gradient of the whole output. For a language model whose output is
``batch x seq x vocab`` logits, that is what fills GPU 0 first. This module
measures it, per device, so the imbalance can be drawn as a bar chart::

    acct = account_memory(lambda: step(model, x, y), devices)
    print(acct.table())
    plot_memory({"DataParallel": acct, "balanced": acct2})

How it measures
---------------
* **GPUs** (every entry of ``devices`` a distinct CUDA device): the peak of
  ``torch.cuda.max_memory_allocated(d)`` during ``fn``, minus what was
  allocated when ``fn`` started. This is what the caching allocator really
  handed out; tensors freed during ``fn`` are not counted twice.
* **Virtual devices** (several entries sharing the CPU): there is nothing to
  measure, so the bytes are *accounted*, from outside the algorithm: while an
  account is open, the functions of :mod:`mgpu_lab.parallel.data_parallel`
  (``scatter``'s split, ``replicate``, ``parallel_apply``, ``gather``) are
  wrapped, wherever they were imported, by observers that charge what each call
  places on a device (the algorithm itself contains no accounting code):

  - ``inputs``: each chunk made by ``scatter`` (device i);
  - ``weights``: each replica's parameters and buffers (device i);
  - ``activations``: the tensors autograd saves for backward while replica i
    runs in its thread (device i), and while the calling thread runs, i.e.
    the loss on gathered outputs (device 0); found with
    ``torch.autograd.graph.saved_tensors_hooks``;
  - ``outputs``: what each replica returns (device i);
  - ``gathered``: the concatenated outputs made by ``gather`` (device 0);
  - ``gradients``: the gradient of each replica's output and of the gathered
    output, of each replica's parameters (device i), and of the original
    parameters, where the replicas' gradients are summed (device 0); found with
    tensor hooks when backward produces them.

  A tensor is counted once per device (same address and size). Nothing freed
  is subtracted and gradients of intermediate activations inside a replica are
  not counted, so the figure is the bytes *materialised* by the step, an upper
  bound on the peak of the tensors listed above; the same rules apply to every
  device, which is what a comparison needs.

Cost: the account keeps a reference to every tensor it charged until it closes,
so memory is held longer while it is open. Use it to compare, not to train.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.utils._pytree import tree_iter

from ..runtime.devices import as_devices, device_name

KINDS = ("inputs", "weights", "activations", "outputs", "gathered", "gradients")

_lock = threading.Lock()
_ledger: Optional["_Ledger"] = None
_tls = threading.local()


class _Ledger:
    def __init__(self, devices: List[torch.device]):
        self.devices = devices
        self.bytes = [dict.fromkeys(KINDS, 0) for _ in devices]
        self.seen: set = set()
        self.refs: list = []  # keep charged tensors alive: no address is reused while open
        self.handles: list = []

    def add(self, i: int, t: torch.Tensor, kind: str) -> None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        i = min(i, len(self.devices) - 1)
        nbytes = t.numel() * t.element_size()
        key = (t.data_ptr(), nbytes, i)
        with _lock:
            if key in self.seen:
                return
            self.seen.add(key)
            self.refs.append(t)
            self.bytes[i][kind] += nbytes


def active() -> bool:
    """True while a virtual-device account is open."""
    return _ledger is not None


def _tensors(obj: Any):
    """Every tensor among the leaves of ``obj`` (any container ``torch.utils._pytree`` knows)."""
    return (leaf for leaf in tree_iter(obj) if isinstance(leaf, torch.Tensor))


def _track_grad(led: _Ledger, i: int, t: torch.Tensor) -> None:
    """Charge the gradient of ``t`` to device ``i`` when backward produces it."""
    if t.requires_grad:
        h = t.register_hook(lambda g: led.add(i, g, "gradients"))
        with _lock:
            led.handles.append(h)


@contextlib.contextmanager
def _saved_tensors_charged_to(led: _Ledger, i: int):
    """The tensors autograd saves for backward in this thread are charged to device ``i``."""
    def pack(t):
        led.add(i, t, "activations")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _observers(led: _Ledger, dp) -> Dict[str, Callable]:
    """Wrappers of data_parallel's functions that charge what each call places on a device."""
    originals = {name: getattr(dp, name) for name in ("_scatter_tensor", "replicate", "parallel_apply", "gather")}

    def _scatter_tensor(t, devices, dim):
        chunks = originals["_scatter_tensor"](t, devices, dim)
        for i, c in enumerate(chunks):
            led.add(i, c, "inputs")
        return chunks

    def replicate(module, devices=None):
        replicas = originals["replicate"](module, devices)
        for i, r in enumerate(replicas):
            for t in list(r.parameters()) + list(r.buffers()):
                led.add(i, t, "weights")
                _track_grad(led, i, t)
        if any(t.requires_grad for r in replicas[:1] for t in r.parameters()):
            for p in module.parameters():  # where the replicas' gradients are summed
                _track_grad(led, 0, p)
        return replicas

    def parallel_apply(modules, inputs, kwargs=None, devices=None, **options):
        if devices is None:  # decided from the modules themselves, before they are wrapped
            devices = [dp._device_of(m, x) for m, x in zip(modules, inputs)]

        def observed(i, m):
            def run(*args, **kw):
                with _saved_tensors_charged_to(led, i):
                    out = m(*args, **kw)
                for t in _tensors(out):
                    led.add(i, t, "outputs")
                    _track_grad(led, i, t)
                return out
            return run

        return originals["parallel_apply"]([observed(i, m) for i, m in enumerate(modules)], inputs, kwargs,
                                           devices, **options)

    def gather(outputs, target_device, dim=0):
        result = originals["gather"](outputs, target_device, dim)
        target = dp.as_device(target_device)
        i = next((k for k, d in enumerate(led.devices) if d == target), 0)
        for t in _tensors(result):
            led.add(i, t, "gathered")
            _track_grad(led, i, t)
        return result

    return {"_scatter_tensor": (originals["_scatter_tensor"], _scatter_tensor),
            "replicate": (originals["replicate"], replicate),
            "parallel_apply": (originals["parallel_apply"], parallel_apply),
            "gather": (originals["gather"], gather)}


@contextlib.contextmanager
def _observing(led: _Ledger):
    """Swap data_parallel's functions for observers in every module that holds them, then back."""
    import sys

    from ..parallel import data_parallel as dp

    swapped = []
    for name, (original, observer) in _observers(led, dp).items():
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict) and namespace.get(name) is original:
                namespace[name] = observer
                swapped.append((namespace, name, original))
    try:
        yield
    finally:
        for namespace, name, original in swapped:
            namespace[name] = original


@dataclass
class MemoryAccount:
    """Bytes per device during one call of a step function; ``method`` says how they were obtained."""

    devices: List[str]
    bytes: List[int]
    method: str
    breakdown: List[Dict[str, int]] = field(default_factory=list)

    def imbalance(self) -> float:
        """Device 0's bytes over the mean of the others (1.0 = balanced)."""
        rest = self.bytes[1:]
        if not rest or sum(rest) == 0:
            return float("inf") if self.bytes[0] else 1.0
        return self.bytes[0] / (sum(rest) / len(rest))

    def table(self, unit: str = "MiB") -> str:
        scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
        kinds = [k for k in KINDS if any(b.get(k) for b in self.breakdown)]
        head = f"{'device':<26}{'total ' + unit:>12}" + "".join(f"{k:>12}" for k in kinds)
        lines = [head]
        for i, name in enumerate(self.devices):
            row = f"{name:<26}{self.bytes[i] / scale:>12.2f}"
            row += "".join(f"{self.breakdown[i].get(k, 0) / scale:>12.2f}" for k in kinds)
            lines.append(row)
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"MemoryAccount ({self.method})\n{self.table()}"


def account_memory(fn: Callable[[], Any], devices: Optional[Sequence[torch.device]] = None) -> MemoryAccount:
    """Run ``fn()`` (a forward and backward) and return the bytes each device held.

    ``devices`` are those the step uses, device 0 first (default
    :func:`mgpu_lab.runtime.devices`). See the module docstring for what is counted.
    """
    global _ledger

    devs = as_devices(devices)
    names = [device_name(devs, i) for i in range(len(devs))]
    if all(d.type == "cuda" for d in devs) and len(set(devs)) == len(devs):
        base = []
        for d in devs:
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)
            base.append(torch.cuda.memory_allocated(d))
        fn()
        peak = []
        for d, b in zip(devs, base):
            torch.cuda.synchronize(d)
            peak.append(torch.cuda.max_memory_allocated(d) - b)
        return MemoryAccount(names, peak, "measured: torch.cuda.max_memory_allocated",
                             [{"measured": p} for p in peak])
    with _lock:
        if _ledger is not None:
            raise RuntimeError("account_memory: an account is already open (accounts do not nest)")
        _ledger = led = _Ledger(devs)
    try:
        with _observing(led), _saved_tensors_charged_to(led, 0):  # the calling thread works on device 0
            fn()
    finally:
        with _lock:
            _ledger = None
        for h in led.handles:
            h.remove()
    totals = [sum(b.values()) for b in led.bytes]
    return MemoryAccount(names, totals, "accounted on virtual devices", led.bytes)


def plot_memory(accounts: Dict[str, MemoryAccount], ax=None, unit: str = "MiB"):
    """Grouped bar chart: one group per device, one bar per account. Returns the axes."""
    import matplotlib.pyplot as plt

    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    labels = list(accounts)
    n_dev = max(len(a.bytes) for a in accounts.values())
    width = 0.8 / len(labels)
    for k, label in enumerate(labels):
        acc = accounts[label]
        xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(acc.bytes))]
        ax.bar(xs, [b / scale for b in acc.bytes], width, label=label)
    ax.set_xticks(range(n_dev))
    ax.set_xticklabels([f"device {i}" for i in range(n_dev)])
    ax.set_ylabel(unit)
    ax.set_title("bytes materialised per device during forward + backward")
    ax.legend()
    return ax
