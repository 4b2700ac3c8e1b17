"""Gradient accumulation: the gradient of a large batch, k micro-batches at a time.

A batch of B items that does not fit in memory is split into k micro-batches;
each runs forward and backward and its gradient is *added* into ``.grad``
(PyTorch never clears it by itself); after the k-th, one optimizer step. The
activations of only one micro-batch are alive at a time, so activation memory
is about 1/k of the large batch's, for the same gradient and k times the
kernel launches (small micro-batches use the device less well).

"The same gradient" needs care. The step must use the gradient of the *mean*
loss over all N items of the window. Dividing each micro-batch's mean loss by
k is right only when all micro-batches hold the same number of items; with
uneven micro-batches, a short last window, or a language model whose
micro-batches hold different numbers of tokens, it weighs items unequally.
This class is exact in every case: it back-propagates ``loss * num_samples``
(the micro-batch's *sum* of item losses), adds the item counts, and divides
the accumulated gradient by the window's total N just before the step, when N
is finally known.

Usage::

    acc = GradientAccumulator(model, optimizer, accumulation_steps=4,
                              scaler=None, max_grad_norm=1.0)
    for x, y in loader:
        with acc.micro_step():                        # no_sync unless the window ends here
            loss = loss_fn(model(x), y)               # the micro-batch's MEAN loss
            stepped = acc.backward(loss, num_samples=len(x))   # or its token count
    acc.flush()                                       # a partial last window, weighted right

Under data parallelism (torch's ``DistributedDataParallel``, or mgpu_lab's
``NaiveDDP``/``BucketedDDP``) the gradients should cross the network once per
window, not once per micro-batch: ``micro_step()`` enters ``no_sync()`` for
every micro-batch but the last of a window. Wrap the *forward* in it too:
torch DDP decides in forward whether the coming backward all-reduces. A window
that ends by ``flush()`` (its last micro-batch ran inside ``no_sync``) is
all-reduced by hand, once (one flat message per dtype for torch DDP).
``micro_step(last=True)`` closes a window early when the loop knows a
micro-batch is the last. Used without ``micro_step()``, the numbers are the same
(averaging is linear) but every micro-step all-reduces. Sharded models
(mgpu_lab's ``FSDP``, torch's ``fully_shard``) reduce-scatter every micro-batch
and their gradient shards add up: ``no_sync`` would keep a full gradient on
every rank, the memory sharding exists to save (DeepSpeed refuses ``no_sync``
under ZeRO-2/3 for this reason). How each wrapper is told apart and spoken to:
:mod:`mgpu_lab.parallel.wrappers` (an unknown wrapper is an error). N is the
*global* count: one extra all-reduce of one number per window. The ranks
average gradients over the W ranks, so the factor applied is W / N; clipping
(``max_grad_norm``) uses the norm of the whole gradient, over all shards.
Every rank must run the same number of micro-steps and call ``flush()``
together (they are collectives).

DTensor models (``fully_shard``, ``parallelize_module``, both on a 2-D mesh): N is
summed over the *data-parallel* group the model's FSDP reduces over (the
tensor-parallel ranks of a row read the same items), and clipping uses the norm over
every rank's pieces of any mix of DTensor and plain parameters, computed once
(:mod:`~mgpu_lab.training.grad_norm`). A pipeline stage (``model=stage``; mgpu_lab's
or torch's) runs its backward inside the schedule's ``step()``: give the schedule a
loss *summed* over the micro-batch's items (``reduction="sum"``, ``scale_grads=False``)
and tell the accumulator what that step held with ``record(num_samples)``; the norm
then spans every stage.

With a loss scaler (the ``torch.amp.GradScaler`` API: ``scale``, ``unscale_``,
``step``, ``update``, ``get_scale``; ``mgpu_lab.LossScaler`` has it too) every
micro-batch's loss is scaled; unscale, the 1/N division, clipping, step and
update happen once per window. An inf/NaN anywhere in the window poisons the
summed gradient, so the whole window's step is skipped and the scale backs off
once. Because micro-losses are sums (``loss * num_samples``), the scale settles
about N times lower than without accumulation; the scaler finds that itself.

Costs: no extra memory (gradients accumulate in ``.grad``); per window, one
``_foreach_mul_`` pass over the gradients (the W/N factor) and, under DDP, one
all-reduce of a single number (the item count).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from numbers import Number
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import wrappers
from ..runtime._diagnosis import collective_failed
from . import state_dicts
from .grad_norm import GlobalGradNorm, piece_of


class GradientAccumulator:
    """Accumulate ``accumulation_steps`` micro-batches, then take one exact optimizer step.

    ``backward(loss, num_samples)`` takes the micro-batch's mean loss and the
    number of items it averages over, and returns True when it took an
    optimizer step. The step's gradient is the gradient of the mean loss over
    all items of the window (all ranks' under DDP). Gradients are zeroed at
    construction and after every window. Counters: ``optimizer_steps``,
    ``skipped_steps`` (windows skipped by the scaler), ``last_grad_norm``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, accumulation_steps: int,
                 scaler=None, max_grad_norm: Optional[float] = None):
        module = getattr(model, "submod", getattr(model, "module", None)) if _is_stage(model) else model
        self._pipeline = module is not model  # a pipeline stage: other ranks hold the other layers
        model = module
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module (the DDP wrapper if there is one) or a pipeline stage, "
                            f"got {type(model).__name__}")
        if not hasattr(optimizer, "step") or not hasattr(optimizer, "zero_grad"):
            raise TypeError(f"optimizer must be a torch optimizer, got {type(optimizer).__name__}")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, Number) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        if scaler is not None:
            missing = [m for m in ("scale", "unscale_", "step", "update", "get_scale") if not hasattr(scaler, m)]
            if missing:
                raise TypeError(f"scaler lacks {missing}: pass a torch.amp.GradScaler or mgpu_lab.LossScaler")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.accumulation_steps, self.max_grad_norm = accumulation_steps, max_grad_norm
        self._kind = wrappers.wrapper_kind(model)  # a TypeError for a wrapper it does not know
        self._group = wrappers.process_group(model)
        self.world_size = wrappers.world_size(model)
        self._uses_no_sync = self._kind in ("torch_ddp", "ddp")  # sharded ones reduce every micro-batch
        self._params: List[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        self._micro = 0          # micro-steps done in the current window
        self._count = 0          # local items in the current window (int, float or tensor)
        self._unsynced = False   # the window holds gradients no rank has exchanged yet
        self._ctx = None         # the open micro_step(): {"sync", "last", "backward"}
        self._warned_no_sync = False
        self._norm: Optional[GlobalGradNorm] = None  # built at the first clipping (a collective)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: Optional[torch.Tensor] = None
        self._zero_grad()

    @property
    def micro_steps_in_window(self) -> int:
        """Micro-steps accumulated since the last optimizer step."""
        return self._micro

    @contextmanager
    def micro_step(self, last: bool = False) -> Iterator["GradientAccumulator"]:
        """Wrap one micro-batch's forward and backward.

        Under DDP it enters ``no_sync()`` unless this micro-batch ends the
        window (the k-th, or ``last=True``), so gradients are communicated once
        per window. Otherwise (one process, sharded models) it only records ``last``.
        """
        if self._ctx is not None:
            raise RuntimeError("micro_step() is already open: one micro-batch at a time")
        closes = bool(last) or self._micro + 1 >= self.accumulation_steps
        self._ctx = {"sync": closes or not self._uses_no_sync, "last": bool(last), "backward": False}
        try:
            with (wrappers.no_sync(self.model) if not self._ctx["sync"] else nullcontext()):
                yield self
        finally:
            self._ctx = None

    def backward(self, loss: torch.Tensor, num_samples) -> bool:
        """Back-propagate one micro-batch; step when its window is complete.

        ``loss``: the micro-batch's MEAN loss (a scalar tensor); ``num_samples``:
        how many items (samples, or tokens) that mean is over, an int or a
        one-element tensor, local to this rank. Returns True when an optimizer
        step was taken (False on micro-steps and on windows the scaler skipped).
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss must be a scalar tensor (the micro-batch's mean loss), got "
                             f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        if not loss.requires_grad:
            raise ValueError("loss does not require grad: compute it from the model's output, outside torch.no_grad()")
        num_samples = self._enter_backward(num_samples)
        summed = loss.reshape(()) * num_samples           # sum semantics: exact whatever the counts
        (self.scaler.scale(summed) if self.scaler is not None else summed).backward()
        return self._after_backward(num_samples)

    def record(self, num_samples) -> bool:
        """Count a micro-batch whose backward already ran elsewhere (a pipeline schedule's
        ``step()``), with the *sum* of its items' losses (scaled by the scaler, if any);
        step when the window is complete. Returns True when an optimizer step was taken."""
        return self._after_backward(self._enter_backward(num_samples))

    def _enter_backward(self, num_samples):
        if isinstance(num_samples, torch.Tensor):
            if num_samples.numel() != 1:
                raise ValueError(f"num_samples must be one number, got a tensor of shape {tuple(num_samples.shape)}")
            num_samples = num_samples.detach().reshape(())
        elif isinstance(num_samples, bool) or not isinstance(num_samples, Number) or num_samples < 0:
            raise ValueError("num_samples must be a count >= 0 (the items the mean loss averages over), "
                             f"got {num_samples!r}")
        if self._ctx is not None:
            if self._ctx["backward"]:
                raise RuntimeError("backward() called twice in one micro_step(): open one micro_step() per micro-batch")
            self._ctx["backward"] = True
        elif self._uses_no_sync and self.accumulation_steps > 1 and not self._warned_no_sync:
            self._warned_no_sync = True
            warnings.warn(f"GradientAccumulator: backward outside micro_step() under {type(self.model).__name__}: "
                          "every micro-batch all-reduces its gradients (the numbers are right, the traffic is "
                          f"{self.accumulation_steps}x). Wrap each micro-batch's forward and backward in "
                          "`with acc.micro_step():`", stacklevel=3)
        return num_samples

    def _after_backward(self, num_samples) -> bool:
        self._micro += 1
        self._count = self._count + num_samples

        if self._kind == "torch_ddp":   # torch DDP decided in forward
            synced = self._ctx["sync"] if self._ctx is not None else self.model.require_backward_grad_sync
            self._unsynced = not synced
        elif self._kind in ("ddp", "fsdp"):  # they finish with backward and know what is left
            self._unsynced = True
        if self._micro >= self.accumulation_steps or (self._ctx is not None and self._ctx["last"]):
            return self._step()
        return False

    def flush(self) -> bool:
        """Step on a partial last window (weighted by its real item count).

        Returns True when a step was taken; False when the window was empty or
        the scaler skipped it. Under DDP every rank must call it.
        """
        if self._micro == 0:
            return False
        if self._ctx is not None:
            raise RuntimeError("flush() inside micro_step(): call it after the loop")
        return self._step()

    # -- the once-per-window part --------------------------------------------

    def _global_count(self) -> float:
        if self._kind == "local":
            return float(self._count)
        device = self._params[0].device if self._params else torch.device("cpu")
        t = torch.as_tensor(self._count, dtype=torch.float64).reshape(1).to(device)
        try:
            dist.all_reduce(t, group=self._group)
        except RuntimeError as exc:
            raise collective_failed("GradientAccumulator's item count (all-reduce)", exc, self._group,
                                    "Every rank must run the same number of micro-steps.") from exc
        return t.item()

    def _step(self) -> bool:
        if self._unsynced:  # the window's last backward ran under no_sync (flush), or ours: a no-op if done
            wrappers.synchronize_gradients(self.model, self._params)
        total = self._global_count()
        if not total > 0:
            raise ValueError(f"the window holds {total} items in all: num_samples must add up to more than 0")
        before = self.scaler.get_scale() if self.scaler is not None else None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [_local(p.grad) for p in self._params if p.grad is not None]
        if grads:  # ranks averaged (W ranks) sums of items: back to the mean over N items
            torch._foreach_mul_(grads, self.world_size / total)
        if self.max_grad_norm is not None:
            self.last_grad_norm = self._clip()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            stepped = not self.scaler.get_scale() < before   # the scale backs off only on overflow
        else:
            self.optimizer.step()
            stepped = True
        self.optimizer_steps += stepped
        self.skipped_steps += not stepped
        self._zero_grad()
        self._micro, self._count, self._unsynced = 0, 0, False
        return stepped

    def _clip(self) -> torch.Tensor:
        """Clip by the norm of the whole gradient: every rank's pieces when the model is spread
        over ranks (sharded, DTensor, pipeline), this process's gradients otherwise."""
        spread = self._pipeline or self._kind in ("fsdp", "fully_shard") or any(
            _is_dtensor(p) for p in self._params)
        if not spread:
            return wrappers.clip_grad_norm_(self.model, self._params, self.max_grad_norm)
        if self._norm is None:
            names = state_dicts.parameter_names(self.model)
            flat_rank = wrappers.unwrap(self.model).rank if self._kind == "fsdp" else -1
            self._norm = GlobalGradNorm(self._params, [piece_of(p, names[id(p)], flat_rank) for p in self._params])
        return self._norm.clip_(self.max_grad_norm)

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def __repr__(self) -> str:  # noqa: D105
        ddp = "one process" if self._kind == "local" else type(self.model).__name__
        return (f"GradientAccumulator(accumulation_steps={self.accumulation_steps}, {ddp}, "
                f"world_size={self.world_size}, "
                f"scaler={type(self.scaler).__name__ if self.scaler is not None else None}, "
                f"max_grad_norm={self.max_grad_norm})")


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor gradient (scaled in place), or the tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _is_stage(model) -> bool:
    """A pipeline stage (mgpu_lab's PipelineStage, torch.distributed.pipelining's), not an nn.Module."""
    if isinstance(model, nn.Module):
        return False
    from ..parallel.pipeline_stage import PipelineStage
    if isinstance(model, PipelineStage):
        return True
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:
        return False
    return isinstance(model, _PipelineStageBase)
