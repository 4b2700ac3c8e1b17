"""Pipeline parallelism: consecutive layers on consecutive ranks, micro-batches in flight.

Split a model into stages (``PipelineStage``, stage s on rank ``s % N``). Run
naively, one batch at a time, only one rank computes at any moment. Cut the
batch into ``m`` micro-batches instead, and stage i can run micro-batch k while
stage i+1 runs k-1; what stays idle is the *bubble*, ``(p-1)/(m+p-1)`` of the step
for GPipe and 1F1B alike, ``(p-1)/(v·m+p-1)`` interleaved (``pipeline_orders.py``
has the orders and a noiseless replay of them).

A schedule is an **order** executed on a rank's stages. ``ScheduleGPipe``,
``Schedule1F1B`` (one stage per rank) and ``ScheduleInterleaved1F1B`` (a list of the
rank's stages) have the names, arguments and ``step``/``eval`` of
``torch.distributed.pipelining``; ``PipelineSchedule(stage, m, loss_fn, order=fn)``
runs any order of one stage (write your own: ``check_order`` says what is wrong
with it), ``PipelineScheduleMulti(stages, m, loss_fn, order=fn)`` any order of
several. Gradients are those of the mean loss over the batch: the last stage scales
micro-batch k's loss by its share of the batch, ``n_k / B``, before its backward (``1/m``
when the micro-batches are equal; a batch of 10 in 4 is cut 3, 3, 2, 2 by
``torch.tensor_split``, and weighted 0.3, 0.3, 0.2, 0.2). torch's ``scale_grads=True``
divides the gradients by m after the step instead: the same numbers, up to rounding,
for equal micro-batches, except that torch's also divides gradients accumulated before
the step, and that until its division the gradients add up to m times the mean's (under
a loss scaler, with gradients stored in fp16, the sum can overflow where the mean
would not). torch's multi-stage schedules need equal micro-batches: in torch 2.13 a
stage receives into buffers shaped by the first micro-batch (``ScheduleGPipe`` and
``Schedule1F1B`` on 2 stages: a batch of 10 in 4 stops with a size mismatch;
``ScheduleGPipe`` on 5 in 3 runs its last micro-batch with a stale row, then fails in
the backward). On one stage unequal micro-batches run, and torch gives the mean
of the micro-batch means (a batch of 10 in 4: a gradient off by 0.07 from the batch's,
where these schedules agree to 3e-8; ``tests/test_pipeline.py``).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from .pipeline_orders import (
    Action,
    bubble_fraction,
    check_order,
    gpipe_order,
    held_microbatches,
    interleaved_1f1b_order,
    one_f_one_b_order,
    simulate_timeline,
)
from .pipeline_stage import PipelineStage

__all__ = ["PipelineStage", "PipelineSchedule", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
           "ScheduleInterleaved1F1B", "gpipe_order", "one_f_one_b_order", "interleaved_1f1b_order", "check_order",
           "held_microbatches", "simulate_timeline", "bubble_fraction"]


class PipelineScheduleMulti:
    """Runs ``order(rank, num_ranks, n_local_stages, n_microbatches)`` (actions ``(kind, k,
    stage)``) on this rank's ``stages``: stages ``r, r + N, ...`` of one pipeline, N ranks.

    Every rank calls ``step``: the rank holding stage 0 with the batch, ``step(x)``; the one
    holding the last stage with ``target=y`` (and ``losses=[]`` to receive each
    micro-batch's loss); the others with nothing (what they are given is ignored, as torch
    does). The batch is cut into ``n_microbatches`` along dimension 0 (``torch.tensor_split``).
    The last stage returns the whole batch's output (``return_outputs=False``: nothing).
    ``eval(...)`` runs the forwards only (and the losses, given ``target=``).
    ``loss_fn=None``: forwards only.
    """
    order_fn: Optional[Callable[..., List[Action]]] = None

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable] = None,
                 scale_grads: bool = True, order: Optional[Callable[..., List[Action]]] = None):
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{type(self).__name__} expects mgpu_lab PipelineStages, got {stages!r}")
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
        link, n = stages[0].link, stages[0].link.size
        want = [link.rank + i * n for i in range(len(stages))]
        if sorted(s.stage_index for s in stages) != want or any(s.num_stages != n * len(stages) for s in stages) \
                or any(s.group is not stages[0].group for s in stages):
            raise ValueError(f"{type(self).__name__}: rank {link.rank} of {n} runs stages {want} of "
                             f"{n * len(stages)} (stage s on rank s % N, one group); got stages "
                             f"{[s.stage_index for s in stages]} of {[s.num_stages for s in stages]}")
        for s in stages:
            s.link = link                                      # one line per pair of ranks
        self._stages = {s.stage_index: s for s in stages}
        self.n_microbatches, self.loss_fn, self.scale_grads = n_microbatches, loss_fn, scale_grads
        if order is not None:
            self.order_fn = order
        if self.order_fn is None:
            raise ValueError(f"{type(self).__name__} needs an order: order=fn(...) returning the rank's actions")
        self._timeline: List[Action] = []

    @property
    def _link(self):
        return next(iter(self._stages.values())).link

    @property
    def timeline(self) -> List[Action]:
        """The actions ``(kind, k, stage)`` this rank ran in the last step, in order."""
        return self._timeline

    def order(self) -> List[Action]:
        """This rank's actions, as the order function gives them."""
        return [tuple(a) for a in self.order_fn(self._link.rank, self._link.size, len(self._stages),
                                                self.n_microbatches)]

    def _actions(self, order: List[Action]) -> List[Action]:
        return order

    def step(self, *args, target=None, losses: Optional[list] = None, return_outputs: bool = True):
        """One training step (forwards, then backwards as the order says); returns the whole
        batch's output on the rank holding the last stage."""
        if self.loss_fn is None:
            return self.eval(*args, return_outputs=return_outputs)
        if not torch.is_grad_enabled():
            raise RuntimeError("step() runs backward: call it with gradients enabled (or use eval())")
        return self._run(args, target, losses, return_outputs, backward=True)

    def eval(self, *args, target=None, losses: Optional[list] = None, return_outputs: bool = True):
        """The forwards only, without gradients: the output (and, given target=, each micro-batch's loss)."""
        with torch.no_grad():
            return self._run(args, target, losses, return_outputs, backward=False)

    def _run(self, args, target, losses, return_outputs, backward: bool):
        m, stages = self.n_microbatches, self._stages
        last = any(s.is_last for s in stages.values())
        inputs = targets = None
        if 0 in stages:
            if len(args) != 1 or not torch.is_tensor(args[0]):
                raise ValueError("the first stage's step takes the batch: schedule.step(x)")
            if len(args[0]) < m:
                raise ValueError(f"a batch of {len(args[0])} cannot make {m} micro-batches")
            inputs = torch.tensor_split(args[0], m)
        if last and self.loss_fn is not None and (backward or target is not None):
            if target is None:
                raise ValueError("the last stage's step needs target= (the loss is computed there)")
            targets = torch.tensor_split(target, m)
            if len(target) < m:
                raise ValueError(f"a target of {len(target)} cannot make {m} micro-batches")
        order = [a for a in self.order() if backward or a[0] == "F"]
        check_order(order, m, backward=backward)
        for s in stages.values():
            s.reset()
        self._timeline = []
        outputs, mb_losses = [None] * m, [None] * m
        for kind, k, index in self._actions(order):
            stage = stages[index]
            if kind == "F":
                y = stage.forward_one_chunk(k, inputs[k] if stage.is_first else None)
                if stage.is_last:
                    outputs[k] = y.detach()
                    mb_losses[k] = self.loss_fn(y, targets[k]) if targets is not None else None
            else:
                loss = mb_losses[k] if stage.is_last else None
                if loss is not None and self.scale_grads:
                    loss = loss * (len(targets[k]) / len(target))     # its share of the batch
                stage.backward_one_chunk(k, loss)
            self._timeline.append((kind, k, index))
        self._link.finish()
        if not last:
            return None
        if losses is not None and targets is not None:
            losses.clear()
            losses.extend(loss.detach() for loss in mb_losses)
        return torch.cat(outputs) if return_outputs else None


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Interleaved 1F1B (Narayanan et al., 2021; torch's order): v stages per rank, depth first.
    Bubble ``(p-1)/(v·m+p-1)``; the first rank holds about ``1 + (p-1)/(p·v)`` times 1F1B's
    activations, and every micro-batch crosses v times as many stage boundaries."""
    order_fn = staticmethod(interleaved_1f1b_order)


class PipelineSchedule(PipelineScheduleMulti):
    """Runs ``order(stage_index, num_stages, n_microbatches)`` (actions ``(kind, k)``) on the
    rank's one ``stage``; ``step``, ``eval`` and ``timeline`` as ``PipelineScheduleMulti``."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Optional[Callable] = None,
                 scale_grads: bool = True, order: Optional[Callable[[int, int, int], List[Action]]] = None):
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{type(self).__name__} expects a mgpu_lab PipelineStage, got {type(stage).__name__}")
        if stage.num_stages != stage.link.size:
            raise ValueError(f"{type(self).__name__} runs one stage per rank: {stage.num_stages} stages on "
                             f"{stage.link.size} ranks need ScheduleInterleaved1F1B (a list of each rank's stages)")
        self._stage = stage
        super().__init__([stage], n_microbatches, loss_fn, scale_grads, order=order or self.order_fn)

    @property
    def timeline(self) -> List[Action]:
        """The actions ``(kind, k)`` this stage ran in the last step, in order."""
        return self._stage.timeline

    def order(self) -> List[Action]:
        s = self._stage
        return [tuple(a) for a in self.order_fn(s.stage_index, s.num_stages, self.n_microbatches)]

    def _actions(self, order: List[Action]) -> List[Action]:
        return [(kind, k, self._stage.stage_index) for kind, k in order]


class ScheduleGPipe(PipelineSchedule):
    """GPipe: all forwards, then all backwards."""
    order_fn = staticmethod(gpipe_order)


class Schedule1F1B(PipelineSchedule):
    """1F1B: warm-up forwards, then one backward, one forward; at most ``num_stages - stage_index`` held."""
    order_fn = staticmethod(one_f_one_b_order)
