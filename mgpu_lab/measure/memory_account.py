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
  measure, so the bytes are *accounted*. While an account is open, the
  functions of :mod:`mgpu_lab.parallel.data_parallel` and
  :mod:`mgpu_lab.parallel.parallel_criterion` charge every tensor they place on a
  device to that device:

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


def charge(i: int, t: Any, kind: str) -> None:
    """Charge tensor ``t`` to device index ``i`` (no-op unless a virtual account is open)."""
    led = _ledger
    if led is not None and isinstance(t, torch.Tensor):
        led.add(i, t, kind)


def charge_on(device: torch.device, t: Any, kind: str) -> None:
    """Charge ``t`` to the first account device equal to ``device`` (device 0 for virtual CPUs), and its gradient."""
    led = _ledger
    if led is None:
        return
    i = next((k for k, d in enumerate(led.devices) if d == device), 0)
    charge(i, t, kind)
    track_grad(i, t, "gradients")


def track_grad(i: int, t: Any, kind: str = "gradients") -> None:
    """Charge the gradient of ``t`` to device ``i`` when backward produces it."""
    led = _ledger
    if led is None or not isinstance(t, torch.Tensor) or not t.requires_grad:
        return

    def hook(g):
        led.add(i, g, kind)

    h = t.register_hook(hook)
    with _lock:
        led.handles.append(h)


def charge_output(i: int, out: Any) -> None:
    """Charge every tensor in a replica's (nested) output to device ``i``, and its gradient."""
    if _ledger is None:
        return
    stack = [out]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            charge(i, o, "outputs")
            track_grad(i, o, "gradients")
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)


@contextlib.contextmanager
def worker_scope(i: int):
    """Inside a replica's thread: charge the tensors saved for backward to device ``i``."""
    led = _ledger
    if led is None:
        yield
        return

    def pack(t):
        led.add(i, t, "activations")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


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
        with worker_scope(0):  # the calling thread works on device 0
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
