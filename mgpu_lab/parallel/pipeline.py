"""Pipeline parallelism: consecutive layers on consecutive ranks, micro-batches in flight.

Split a model into ``p`` stages, stage i on rank i (``PipelineStage``). Run
naively, one batch at a time, only one rank computes at any moment. Cut the
batch into ``m`` micro-batches instead, and stage i can run micro-batch k while
stage i+1 runs k-1. What stays idle is the *bubble*: stage i starts its first
forward after i others and finishes its last backward p-1-i steps before stage
0 does, so with equal stages (forward tF, backward tB) the step takes
``(m + p - 1)(tF + tB)``, of which each rank computes ``m(tF + tB)``: the
bubble fraction is ``(p-1)/(m+p-1)``, for GPipe and 1F1B alike.

A schedule is an **order** (a list of ``("F", k)``, the forward of micro-batch
k, and ``("B", k)``, its backward, for one stage) **executed** on a stage:

* ``gpipe_order``: every forward, then every backward. Stage i holds the
  activations of all m micro-batches at the turn.
* ``one_f_one_b_order``: ``p - i`` forwards (warm-up), then alternately one
  backward and one forward, then the remaining backwards. The same bubble, but
  stage i never holds more than ``p - i`` micro-batches: memory no longer grows
  with m, so m can grow and the bubble shrink.

``ScheduleGPipe`` and ``Schedule1F1B`` have the names and the ``step`` API of
``torch.distributed.pipelining``; ``PipelineSchedule(stage, m, loss_fn,
order=fn)`` runs any order (write your own, and ``check_order`` says what is
wrong with it); ``simulate_timeline`` replays orders on stages of a fixed speed (the
bubble without noise, ``bubble_fraction``). Gradients are those of the mean loss over the batch: the last
stage scales each micro-batch's loss by ``1/m`` before its backward (torch's
``scale_grads=True`` divides the gradients by m after the step instead: the
same numbers, except that torch's also divides gradients accumulated before it).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from .pipeline_stage import Action, PipelineStage

__all__ = ["PipelineStage", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "gpipe_order",
           "one_f_one_b_order", "check_order", "held_microbatches", "simulate_timeline", "bubble_fraction"]


def gpipe_order(stage_index: int, num_stages: int, n_microbatches: int) -> List[Action]:
    """GPipe: all forwards, then all backwards (in the same order)."""
    return [("F", k) for k in range(n_microbatches)] + [("B", k) for k in range(n_microbatches)]


def one_f_one_b_order(stage_index: int, num_stages: int, n_microbatches: int) -> List[Action]:
    """1F1B: ``num_stages - stage_index`` forwards (warm-up), then one backward, one
    forward, ... (steady state), then the remaining backwards (cool-down)."""
    warmup = min(n_microbatches, num_stages - stage_index)
    order = [("F", k) for k in range(warmup)]
    forward, backward = warmup, 0
    while forward < n_microbatches:
        order += [("B", backward), ("F", forward)]
        forward, backward = forward + 1, backward + 1
    return order + [("B", k) for k in range(backward, n_microbatches)]


def check_order(order: List[Action], n_microbatches: int, backward: bool = True) -> None:
    """A usable order runs each micro-batch's forward once, and its backward once, after it
    (``backward=False``: forwards only)."""
    done = set()
    for action in order:
        kind, k = action
        if kind not in ("F", "B") or not 0 <= k < n_microbatches:
            raise ValueError(f"bad action {action!r}: expected ('F' or 'B', micro-batch in 0..{n_microbatches - 1})")
        if action in done:
            raise ValueError(f"{action!r} appears twice in the order")
        if kind == "B" and ("F", k) not in done:
            raise ValueError(f"{action!r} comes before ('F', {k}): a backward needs its forward first")
        done.add(action)
    missing = [a for kind in ("FB" if backward else "F") for a in [(kind, k) for k in range(n_microbatches)] if a not in done]
    if missing:
        raise ValueError(f"the order never runs {missing}")


def held_microbatches(timeline: List[Action]) -> int:
    """The most micro-batches whose activations a stage held at once (forward run, backward not yet)."""
    held = peak = 0
    for kind, _ in timeline:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def simulate_timeline(orders: List[List[Action]], forward_time: float = 1.0,
                      backward_time: float = 2.0) -> List[List[Tuple[str, int, float, float]]]:
    """When each action of ``orders`` (one order per stage, stage i's at index i) runs on
    stages of a fixed speed whose messages take no time: ``[(kind, k, start, end), ...]``
    per stage. Each stage runs its order in turn; ``("F", k)`` also waits for the previous
    stage's ``("F", k)``, ``("B", k)`` for the next stage's ``("B", k)``. A replay of the
    schedule without noise (what the recorded ``spans`` of a real run approach); raises
    ValueError when the orders wait on each other forever."""
    p = len(orders)
    done: Dict[Tuple[str, int, int], float] = {}   # (kind, k, stage) -> end time
    out: List[List[Tuple[str, int, float, float]]] = [[] for _ in range(p)]
    free, nxt = [0.0] * p, [0] * p
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, k = orders[s][nxt[s]]
                dep = ("F", k, s - 1) if kind == "F" else ("B", k, s + 1) if s < p - 1 else ("F", k, s)
                if kind == "F" and s == 0:
                    ready = 0.0
                elif dep in done:
                    ready = done[dep]
                else:
                    break
                start = max(free[s], ready)
                free[s] = done[(kind, k, s)] = start + (forward_time if kind == "F" else backward_time)
                out[s].append((kind, k, start, free[s]))
                nxt[s] += 1
                moved = True
        if not moved:
            waiting = {s: orders[s][nxt[s]] for s in range(p) if nxt[s] < len(orders[s])}
            raise ValueError(f"the orders wait on each other forever: next actions per stage {waiting}")
    return out


def bubble_fraction(spans: List[List[Tuple[float, float]]]) -> float:
    """The idle fraction of a step, averaged over stages: ``spans[i]`` holds stage i's
    (start, end) compute times; the step runs from the earliest start to the latest end."""
    begin = min(a for stage in spans for a, _ in stage)
    length = max(b for stage in spans for _, b in stage) - begin
    return sum(1 - sum(b - a for a, b in stage) / length for stage in spans) / len(spans)


class PipelineSchedule:
    """Runs ``order(stage_index, num_stages, n_microbatches)`` on ``stage``.

    Every rank calls ``step``: the first stage with the batch, ``step(x)``; the last with
    ``step(target=y, losses=[])`` (``losses`` receives each micro-batch's loss); the others
    with nothing (``target=`` and ``losses=`` are ignored there, as torch does). The batch is cut into ``n_microbatches`` along dimension 0 (as
    ``torch.tensor_split``). The last stage returns the output of the whole batch.
    ``loss_fn=None``: forwards only.
    """
    order_fn: Optional[Callable[[int, int, int], List[Action]]] = None

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Optional[Callable] = None,
                 scale_grads: bool = True, order: Optional[Callable[[int, int, int], List[Action]]] = None):
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{type(self).__name__} expects a mgpu_lab PipelineStage, got {type(stage).__name__}")
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
        self._stage, self.n_microbatches, self.loss_fn, self.scale_grads = stage, n_microbatches, loss_fn, scale_grads
        if order is not None:
            self.order_fn = order
        if self.order_fn is None:
            raise ValueError("PipelineSchedule needs an order: order=fn(stage_index, num_stages, n_microbatches)")

    @property
    def timeline(self) -> List[Action]:
        """The actions this stage ran in the last step, in order."""
        return self._stage.timeline

    def order(self) -> List[Action]:
        s = self._stage
        return list(self.order_fn(s.stage_index, s.num_stages, self.n_microbatches))

    def _split(self, args, target):
        s, m = self._stage, self.n_microbatches
        inputs = targets = None
        if s.is_first:
            if len(args) != 1 or not torch.is_tensor(args[0]):
                raise ValueError("the first stage's step takes the batch: schedule.step(x)")
            if len(args[0]) < m:
                raise ValueError(f"a batch of {len(args[0])} cannot make {m} micro-batches")
            inputs = torch.tensor_split(args[0], m)
        elif args:
            raise ValueError(f"stage {s.stage_index} is not the first stage: call step() without the batch")
        if s.is_last and self.loss_fn is not None:
            if target is None:
                raise ValueError("the last stage's step needs target= (the loss is computed there)")
            targets = torch.tensor_split(target, m)
        return inputs, targets

    def step(self, *args, target=None, losses: Optional[list] = None):
        s, m, training = self._stage, self.n_microbatches, self.loss_fn is not None
        if training and not torch.is_grad_enabled():
            raise RuntimeError("step() runs backward: call it with gradients enabled (not under torch.no_grad())")
        inputs, targets = self._split(args, target)
        order = self.order() if training else [a for a in self.order() if a[0] == "F"]
        check_order(order, m, backward=training)
        s.reset()
        outputs, mb_losses = [None] * m, [None] * m
        with torch.set_grad_enabled(training):
            for kind, k in order:
                if kind == "F":
                    y = s.forward_one_chunk(k, inputs[k] if s.is_first else None)
                    if s.is_last:
                        outputs[k] = y.detach()
                        mb_losses[k] = self.loss_fn(y, targets[k]) if training else None
                else:
                    loss = mb_losses[k]
                    s.backward_one_chunk(k, loss / m if loss is not None and self.scale_grads else loss)
        s.finish()
        if not s.is_last:
            return None
        if losses is not None and training:
            losses.clear()
            losses.extend(loss.detach() for loss in mb_losses)
        return torch.cat(outputs)


class ScheduleGPipe(PipelineSchedule):
    """GPipe: all forwards, then all backwards."""
    order_fn = staticmethod(gpipe_order)


class Schedule1F1B(PipelineSchedule):
    """1F1B: warm-up forwards, then one backward, one forward; at most ``num_stages - stage_index`` held."""
    order_fn = staticmethod(one_f_one_b_order)
