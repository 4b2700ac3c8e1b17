"""Activation recompute (gradient checkpointing): trade compute for memory.

Backward needs some of the tensors forward made (a ``Linear`` needs its input
to compute the weight's gradient, a ``GELU`` its input, softmax its output), so
autograd *saves* them and keeps them until backward has used them. For a deep
network that is most of the memory of a training step, and it grows with the
batch size and the sequence length. ``checkpoint(fn, *args)`` keeps only the
inputs of ``fn``; in backward, the first time autograd asks for a tensor ``fn``
saved, ``fn`` runs again (with grad) to make them all, then backward goes on.

Cost: one extra forward of ``fn`` per backward. Gain: the tensors saved inside
``fn`` live only during its part of backward. ``checkpoint_sequential`` cuts a
stack of ``n`` blocks into ``k`` segments and checkpoints each but the last: the
step keeps ``k - 1`` segment inputs plus one segment's activations (about
``n/k`` blocks), which is smallest for ``k`` near ``sqrt(n)``: O(sqrt(n))
memory for about one extra forward pass (Chen et al., 2016).

How it works (the *non-reentrant* design, as ``torch.utils.checkpoint`` with
``use_reentrant=False``): forward runs ``fn`` normally, inside
``torch.autograd.graph.saved_tensors_hooks`` whose pack hook stores a number
instead of the tensor. Backward walks the *original* graph; the unpack hook
recomputes ``fn`` on the saved inputs and hands back the recomputed tensor of
the same number. The recomputed graph is never backpropagated, so each
parameter's gradient hook fires once, in the order it would without
checkpointing: what ``DistributedDataParallel`` expects. (The *reentrant*
design instead wraps ``fn`` in an ``autograd.Function`` whose backward calls
``torch.autograd.backward`` on the recomputed graph, a nested backward per
segment, which is what breaks DDP: lab 07.)

As torch's, the recompute runs once per backward and *stops early*: as soon
as it has made as many tensors as forward saved, it raises out of ``fn``
(what ``fn`` does after its last saving operation is skipped). Each
recomputed tensor is handed out once and then dropped; a second backward
(``retain_graph=True``) recomputes again; reading the same saved tensor twice
in one backward is an error, not a silent second recompute. A recomputed
tensor that does not require grad (a buffer, a mask) is the very object
forward saw.

The CPU and CUDA random-number generators are reset to their state at forward
time for the recompute, so dropout draws the same mask and gradients equal the
un-checkpointed run; the generators are restored afterwards, so checkpointing
does not change the random numbers that later code draws.

A recompute that differs from forward (another number of saved tensors, other
shapes, dtypes or devices) and a saved tensor read twice in one backward raise
``torch.utils.checkpoint.CheckpointError`` (a ``RuntimeError``), as torch's does.

What it saves is measured from outside, by :mod:`mgpu_lab.measure.activation_memory`
(``saved_tensor_bytes``, ``peak_memory``).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

__all__ = ["checkpoint", "checkpoint_sequential"]


class _SaveInputs(torch.autograd.Function):
    """Holds ``fn``'s tensor inputs with ``save_for_backward``: never backpropagated.

    Saving them as autograd-saved tensors (rather than in a closure) means an
    outer ``saved_tensors_hooks`` (``saved_tensor_bytes``, CPU offloading) sees
    what checkpointing keeps, and in-place changes to an input are caught by
    autograd's version check."""

    @staticmethod
    def forward(ctx, dummy, *tensors):
        ctx.save_for_backward(*tensors)
        return dummy.new_empty(0)

    @staticmethod
    def backward(ctx, *grads):  # the output is never used
        raise RuntimeError("mgpu_lab.checkpoint: the input holder was backpropagated (a bug)")


def _cuda_devices(tensors: Sequence[torch.Tensor]) -> List[int]:
    """The CUDA devices whose generators ``fn`` may draw from: those of its inputs,
    and the current one if CUDA is in use (a module's dropout on a GPU)."""
    devs = {t.device.index for t in tensors if t.is_cuda}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devs.add(torch.cuda.current_device())
    return sorted(devs)


class _StopRecompute(Exception):
    """Raised inside the recompute once it has made every tensor forward saved (early stop)."""


def _meta(t: torch.Tensor) -> Tuple[torch.Size, torch.dtype, torch.device]:
    """What the determinism check compares, as torch's does: shape, dtype, device."""
    return t.shape, t.dtype, t.device


def _no_contexts() -> Tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), contextlib.nullcontext()


class _Frame:
    """One checkpointed call: its inputs, RNG and autocast state, and the recompute."""

    def __init__(self, fn, args, kwargs, tensor_slots, tensors, saver, *, preserve_rng_state, check,
                 early_stop, recompute_context):
        # The tensors live only in the saver (so an outer hook that offloads them really frees them).
        self.fn = fn
        self.args = [None if isinstance(a, torch.Tensor) else a for a in args]
        self.kwargs = {k: None if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        self.slots = tensor_slots  # where the tensors sit: ("a", index) or ("k", name)
        self.saver = saver  # the _SaveInputs output; its grad_fn holds the inputs
        self.check, self.early_stop, self.recompute_context = check, early_stop, recompute_context
        self.saved_meta: List[Any] = []  # one entry per tensor forward saved, in order
        self.recomputed: Dict[int, List[Optional[torch.Tensor]]] = {}  # per backward; None once handed out
        self.preserve_rng_state = preserve_rng_state
        self.cuda_devices = _cuda_devices(tensors) if preserve_rng_state else []
        self.cpu_rng = torch.get_rng_state() if preserve_rng_state else None
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        self.autocast = {dev: (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
                         for dev in ("cpu", "cuda") if dev == "cpu" or torch.cuda.is_available()}

    def pack(self, t: torch.Tensor) -> int:
        self.saved_meta.append(_meta(t) if self.check else None)
        return len(self.saved_meta) - 1

    def unpack(self, i: int) -> torch.Tensor:
        backward = torch._C._current_graph_task_id()  # which backward asks (-1: none, e.g. grad_fn._saved_x)
        if backward == -1:
            return self.recompute()[i]
        if backward not in self.recomputed:
            self.recomputed[backward] = self.recompute()
        got = self.recomputed[backward]
        t, got[i] = got[i], None  # free it once backward has it
        if t is None:
            raise CheckpointError(
                f"checkpoint: saved tensor {i} of {getattr(self.fn, '__name__', self.fn)!r} was unpacked "
                "twice in one backward. A custom autograd.Function that reads ctx.saved_tensors twice in its "
                "backward does this: read it once and keep the tuple (torch.utils.checkpoint refuses it too).")
        return t

    def recompute(self) -> List[Optional[torch.Tensor]]:
        """Run ``fn`` again on the saved inputs; return what it saves, stopping once it has them all."""
        args, kwargs = list(self.args), dict(self.kwargs)  # fresh copies: the frame may recompute again
        for (kind, key), t in zip(self.slots, self.saver.grad_fn.saved_tensors):
            if kind == "a":
                args[key] = t
            else:
                kwargs[key] = t
        out: List[Optional[torch.Tensor]] = []
        wanted = len(self.saved_meta)

        def keep(t: torch.Tensor) -> torch.Tensor:
            if len(out) == wanted:  # only reachable with early_stop=False
                raise self._mismatch(f"saved more than the {wanted} tensors forward saved")
            out.append(t.detach() if t.requires_grad else t)  # one that needs no grad: the very object
            if self.early_stop and len(out) == wanted:
                raise _StopRecompute  # the rest of fn makes nothing backward needs
            return out[-1]

        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.cuda_devices, enabled=self.preserve_rng_state))
            if self.preserve_rng_state:
                torch.set_rng_state(self.cpu_rng)
                for d, state in zip(self.cuda_devices, self.cuda_rng):
                    torch.cuda.set_rng_state(state, d)
            for dev, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t))
            stack.enter_context(self.recompute_context)
            try:
                self.fn(*args, **kwargs)
            except _StopRecompute:
                pass
        if len(out) != wanted:
            raise self._mismatch(f"saved {len(out)} tensors, forward saved {wanted}")
        if self.check and [_meta(t) for t in out] != self.saved_meta:
            raise self._mismatch("saved tensors whose shapes, dtypes or devices differ from forward's")
        return out

    def _mismatch(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint: the recompute of {getattr(self.fn, '__name__', self.fn)!r} {what}. "
            "fn must do the same operations every time it is called with the same inputs: "
            "no data-dependent branches on global state, no in-place changes to its inputs.")


def checkpoint(fn: Callable[..., Any], *args: Any, use_reentrant: Optional[bool] = None,
               preserve_rng_state: bool = True, determinism_check: str = "default",
               context_fn: Callable[[], Tuple[Any, Any]] = _no_contexts, early_stop: bool = True,
               debug: bool = False, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, keeping only its inputs for backward; ``fn`` runs again in backward.

    Returns what ``fn`` returns; gradients (with respect to the inputs and to any
    parameters ``fn`` uses) equal those of a plain call, dropout included.
    Arguments may be tensors that require grad or not, and non-tensors (passed
    through unchanged). Under ``torch.no_grad()`` this is just ``fn(*args)``.
    ``fn`` must be deterministic given its inputs and the RNG state, and must not
    modify its inputs in place.

    The keywords are ``torch.utils.checkpoint.checkpoint``'s, with the same
    meaning (any other keyword goes to ``fn``): ``use_reentrant`` (only the
    non-reentrant design is here: pass ``False``; ``None`` warns as torch does, then runs the
    non-reentrant design where torch would run the reentrant one), ``preserve_rng_state``
    (``False``: no RNG replay, cheaper, for an ``fn`` without randomness),
    ``determinism_check`` (``"default"`` compares the recomputed tensors' shapes,
    dtypes and devices with forward's, ``"none"`` does not), ``context_fn`` (returns
    two context managers: forward runs in the first, the recompute in the second;
    torch's ``create_selective_checkpoint_contexts`` works), ``early_stop``
    (``False``: the recompute runs ``fn`` to its end; torch's global
    ``torch.utils.checkpoint.set_checkpoint_early_stop(enable)`` overrides it, as in torch).
    ``debug=True`` is torch's alone.
    """
    if not callable(fn):
        raise TypeError(f"checkpoint(fn, *args): fn must be callable, got {type(fn).__name__}")
    if use_reentrant is None:
        _warn_use_reentrant("checkpoint")
    elif use_reentrant:
        raise ValueError("mgpu_lab.checkpoint is the non-reentrant design only (use_reentrant=False); for "
                         "the reentrant one call torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)")
    early_stop = _torch_early_stop(early_stop)
    if determinism_check not in ("default", "none"):
        raise ValueError(f"determinism_check should be one of ['default', 'none'], but got {determinism_check!r}")
    if debug:
        raise ValueError("checkpoint(debug=True): the operator traces are torch's; call "
                         "torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, debug=True)")
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    slots = [("a", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    slots += [("k", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    tensors = [args[key] if kind == "a" else kwargs[key] for kind, key in slots]
    dummy = torch.empty(0, requires_grad=True)
    saver = _SaveInputs.apply(dummy, *tensors)  # before our hooks: outer hooks see the inputs
    forward_context, recompute_context = context_fn()
    frame = _Frame(fn, args, kwargs, slots, tensors, saver, preserve_rng_state=preserve_rng_state,
                   check=determinism_check == "default", early_stop=early_stop,
                   recompute_context=recompute_context)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack), forward_context:
        return fn(*args, **kwargs)


def _warn_use_reentrant(name: str) -> None:
    """torch's warning for a call that leaves ``use_reentrant`` out (torch then runs the reentrant design)."""
    warnings.warn(f"mgpu_lab.{name}: the use_reentrant parameter should be passed explicitly, as "
                  "torch.utils.checkpoint asks. Only the non-reentrant design is here, so use_reentrant=False "
                  "runs; torch's default would run the reentrant one.", stacklevel=3)


def _torch_early_stop(early_stop: bool) -> bool:
    """torch's global ``set_checkpoint_early_stop(enable)``, read at call time, overrides the keyword."""
    import torch.utils.checkpoint as tc
    enabled = getattr(tc, "_enable_checkpoint_early_stop", None)
    return early_stop if enabled is None else enabled


def _segments(n: int, segments: int) -> List[Tuple[int, int]]:
    """torch's split: ``segments - 1`` segments of ``n // segments`` blocks, the rest last."""
    size = n // segments
    bounds = [(s, s + size) for s in range(0, size * (segments - 1), size)]
    return bounds + [(size * (segments - 1), n)]


def checkpoint_sequential(modules, segments: int, x: torch.Tensor, use_reentrant: Optional[bool] = None,
                          preserve_rng_state: bool = True) -> torch.Tensor:
    """Run ``modules`` (an ``nn.Sequential`` or a list of callables) on ``x`` in
    ``segments`` pieces, checkpointing every piece but the last (whose activations
    backward needs at once anyway). Same split as ``torch.utils.checkpoint.checkpoint_sequential``:
    ``segments - 1`` pieces of ``len(modules) // segments`` blocks, the remainder last.

    Memory: ``segments - 1`` piece inputs plus the last piece's activations, and
    during backward one piece's recomputed activations at a time. ``use_reentrant``
    (pass ``False``; ``None`` warns as torch does) and ``preserve_rng_state`` as in :func:`checkpoint`.
    """
    funcs = list(modules.children()) if isinstance(modules, nn.Sequential) else list(modules)
    if not funcs:
        raise ValueError("checkpoint_sequential: no modules to run")
    if not isinstance(segments, int) or isinstance(segments, bool) or not 1 <= segments <= len(funcs):
        raise ValueError(f"checkpoint_sequential: segments must be an int in 1..{len(funcs)} "
                         f"(the number of modules), got {segments!r}")

    def run(start: int, end: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def piece(h):
            for f in funcs[start:end]:
                h = f(h)
            return h
        return piece

    if use_reentrant is None:
        _warn_use_reentrant("checkpoint_sequential")
        use_reentrant = False
    bounds = _segments(len(funcs), segments)
    for start, end in bounds[:-1]:
        x = checkpoint(run(start, end), x, use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state)
    return run(*bounds[-1])(x)
