"""A per-rank timeline of computation and communication, read like a profiler trace.

``Timeline(modules)`` records, on this rank, while active:

* **compute**: each given module's forward (``"F name"``) and backward (``"B name"``:
  from the gradient of its output arriving to the gradient of its input being ready),
  a forward that runs again inside backward (``"R name"``: activation recompute), and
  each optimizer step (``"optimizer"``), by module, tensor and optimizer hooks;
* **communication**: every ``torch.distributed`` collective and DTensor's functional
  ones (``fully_shard``, ``parallelize_module``), from the call to its return, and every
  wait on an asynchronous one (``Work.wait``, DTensor's ``wait_tensor``): the time
  this rank's Python thread spent issuing and waiting for communication. What overlaps
  (a reduce-scatter a backend runs while backward goes on) shows as compute; only the
  *exposed* communication shows as communication, which is what a step pays for.

The spans are ``(lane, name, start, end)``, ``time.perf_counter()`` seconds (one clock for
every process of a machine). ``plot_timeline`` draws every rank's spans, one row per rank,
compute above and communication below, as Perfetto or TensorBoard show a ``torch.profiler``
trace; ``summary`` adds them up. Nothing in the training code changes: hooks and patches
attach while the ``with`` block runs and are removed after. Cost: a Python call per
span (use it on a few steps). One timeline at a time per process.
"""
from __future__ import annotations

import functools
import time
from contextlib import ContextDecorator
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

Span = Tuple[str, str, float, float]   # (lane: "compute" | "comm", name, start, end)
_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
                "all_to_all_single", "gather", "scatter", "barrier")
_FUNCOL = ("all_reduce", "all_gather_single", "all_gather_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
           "all_to_all_single", "wait_tensor")
_active: List["Timeline"] = []


class Timeline(ContextDecorator):
    """Record this rank's compute and communication spans while active (see the module docstring)."""

    def __init__(self, modules: Optional[Dict[str, nn.Module]] = None):
        self.modules = dict(modules or {})
        self.spans: List[Span] = []
        self._handles: list = []
        self._patched: list = []
        self._open: Dict[Tuple[int, str], float] = {}
        self._recompute: Optional[list] = None  # [name, start, last end seen] of a recompute under way
        self._depth = 0

    # ------------------------------------------------------------------ activation
    def __enter__(self) -> "Timeline":
        if _active:
            raise RuntimeError("Timeline: another timeline is already recording in this process")
        _active.append(self)
        for name, m in self.modules.items():
            self._handles.append(m.register_forward_pre_hook(functools.partial(self._pre_forward, name)))
            self._handles.append(m.register_forward_hook(functools.partial(self._post_forward, name)))
            for sub in m.modules():  # where a recompute got to (it stops early, before the module's end)
                self._handles.append(sub.register_forward_hook(self._recomputed_to))
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        self._handles.append(register_optimizer_step_pre_hook(lambda opt, a, k: self._begin("optimizer", "compute")))
        self._handles.append(register_optimizer_step_post_hook(lambda opt, a, k: self._end("optimizer", "compute")))
        for module in (dist, dist.distributed_c10d):
            for op in _COLLECTIVES:
                self._patch(module, op, op)
        for op in _FUNCOL:
            self._patch(funcol, op, "wait" if op == "wait_tensor" else op)
        work = torch._C._distributed_c10d.Work
        self._patched.append((work, "wait", work.wait))
        original = work.wait
        work.wait = lambda w, *a, **k: self._timed("wait", original, (w, *a), k)
        return self

    def __exit__(self, *exc) -> bool:
        self._close_recompute()
        for h in self._handles:
            h.remove()
        for owner, name, fn in reversed(self._patched):
            setattr(owner, name, fn)
        self._handles, self._patched = [], []
        _active.clear()
        return False

    def _patch(self, module, op: str, label: str) -> None:
        fn = getattr(module, op, None)
        if fn is None:
            return
        self._patched.append((module, op, fn))
        setattr(module, op, functools.wraps(fn)(lambda *a, **k: self._timed(label, fn, a, k)))

    # ------------------------------------------------------------------ recording
    def _timed(self, name: str, fn, args, kwargs):
        if self._depth:  # a collective inside a collective (the *_object ones): one span
            return fn(*args, **kwargs)
        self._depth += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth -= 1
            self.spans.append(("comm", name, start, time.perf_counter()))

    def _begin(self, name: str, lane: str, key: int = 0) -> None:
        self._close_recompute()
        self._open[(key, name)] = time.perf_counter()

    def _end(self, name: str, lane: str, key: int = 0) -> None:
        if not name.startswith("R "):
            self._close_recompute()
        start = self._open.pop((key, name), None)
        if start is not None:
            self.spans.append((lane, name, start, time.perf_counter()))

    def _recomputed_to(self, module, args, output) -> None:
        if self._recompute is not None:
            self._recompute[2] = time.perf_counter()

    def _close_recompute(self) -> None:
        """A recompute (torch.utils.checkpoint) stops as soon as it has what backward needs, so the
        module's forward hook may never fire: its span ends at the last submodule it finished."""
        if self._recompute is not None:
            name, start, end = self._recompute
            self._recompute = None
            self._open = {k: v for k, v in self._open.items() if k[1] != name}
            self.spans.append(("compute", name, start, end))

    def _pre_forward(self, name: str, module, args):
        if _in_backward():  # a forward inside backward: recompute
            self._close_recompute()
            now = time.perf_counter()
            self._recompute = [f"R {name}", now, now]
            return
        self._begin(f"F {name}", "compute", id(module))

    def _post_forward(self, name: str, module, args, output):
        if _in_backward():
            self._close_recompute()
            return
        self._end(f"F {name}", "compute", id(module))
        if not torch.is_grad_enabled():
            return
        outs = [t for t in _tensors(output) if t.requires_grad]
        ins = [t for t in _tensors(args) if t.requires_grad]
        key = id(module)
        if outs:
            outs[0].register_hook(lambda g: self._backward_begins(f"B {name}", key))
        for t in ins[:1]:
            t.register_hook(lambda g: self._end(f"B {name}", "compute", key))

    def _backward_begins(self, name: str, key: int) -> None:
        if (key, name) not in self._open:
            self._begin(name, "compute", key)


def _in_backward() -> bool:
    """Is autograd's engine running a backward in this thread (a recompute, then)?"""
    return torch._C._current_graph_task_id() != -1


def _tensors(tree) -> List[torch.Tensor]:
    from torch.utils._pytree import tree_leaves
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


# --------------------------------------------------------------------------- reading it

def summary(spans: Sequence[Span]) -> Dict[str, float]:
    """Seconds of ``comm`` (the union of communication spans: a rank issuing or waiting),
    ``compute`` (the union of compute spans less the communication inside them: a block's
    forward that waits for an all-reduce computes only the rest), and the ``wall`` from the
    first span's start to the last one's end."""
    out = {"compute": 0.0, "comm": 0.0, "wall": 0.0}
    if not spans:
        return out
    compute = _merged([(s, e) for ln, _, s, e in spans if ln == "compute"])
    comm = _merged([(s, e) for ln, _, s, e in spans if ln == "comm"])
    inside = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in compute for s2, e2 in comm)
    out["comm"] = sum(e - s for s, e in comm)
    out["compute"] = sum(e - s for s, e in compute) - inside
    out["wall"] = max(e for *_, e in spans) - min(s for _, _, s, _ in spans)
    return out


def _merged(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Disjoint intervals covering the same time."""
    out: List[Tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


_COLORS = {"F": "tab:blue", "B": "tab:orange", "R": "tab:purple", "optimizer": "tab:green"}


def plot_timeline(timelines: Sequence[Sequence[Span]], ax=None, title: str = "timeline"):
    """Draw every rank's spans (``timelines[rank]``), one row per rank: compute above
    (forward blue, backward orange, recompute purple, optimizer green), exposed
    communication below (red). Times in milliseconds from the earliest span."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.7 + 0.6 * len(timelines)))
    starts = [s for spans in timelines for _, _, s, _ in spans]
    t0 = min(starts) if starts else 0.0
    for rank, spans in enumerate(timelines):
        y = len(timelines) - 1 - rank
        for lane, name, s, e in sorted(spans, key=lambda sp: sp[2] - sp[3]):  # longest first: nested ones on top
            color = "tab:red" if lane == "comm" else _COLORS.get(name.split(" ")[0], "tab:gray")
            lo = y + (0.45 if lane == "compute" else 0.05)
            ax.broken_barh([((s - t0) * 1e3, max((e - s) * 1e3, 1e-3))], (lo, 0.4), facecolors=color)
    ax.set_yticks([len(timelines) - 1 - r + 0.45 for r in range(len(timelines))],
                  [f"rank {r}" for r in range(len(timelines))])
    ax.set_xlabel("ms")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=n) for n, c in [("forward", "tab:blue"), ("backward", "tab:orange"),
                                                            ("recompute", "tab:purple"), ("optimizer", "tab:green"),
                                                            ("communication", "tab:red")]],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8, frameon=False)
    return ax
