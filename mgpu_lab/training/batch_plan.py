"""A batch plan: the global batch, split over the data-parallel ranks and into micro-batches.

A run is specified by its *global* batch B (what the optimizer step averages over: the learning
rate is tuned for it), and run on W data-parallel ranks whose memory holds micro-batches of at
most m items. Then each rank takes a share of B per step and splits it into K micro-batches,
accumulating their gradients (:class:`~mgpu_lab.training.grad_accum.GradientAccumulator`)::

    plan = batch_plan(global_batch=256, dp_size=8, micro_batch=16)
    plan.accumulation_steps      # K = 2: each rank 32 items per step, in 2 micro-batches of 16

When W does not divide B the shares are uneven (B=100, W=3: 34, 33, 33) and so are the
micro-batches inside a share (34 in K=3: 12, 11, 11): the accumulator weighs every item equally
whatever the counts (it sums ``loss * num_samples`` and divides by the global count), so the
step is the mean over exactly B items. A plan that would give a rank an empty micro-batch (fewer
items than K, or than ranks) is refused, with the numbers. ``plan.batch_sampler(sampler)`` yields
this rank's micro-batches from its sampler (a ``DistributedSampler``), whole steps only and the
same number of steps on every rank, so the ranks step together: each rank's samples of an epoch
beyond the last whole step are dropped, as ``drop_last=True`` does (200 samples on 2 ranks,
global batch 32: 6 steps of 16 per rank, 4 of each rank's 100 dropped per epoch; global batch 33:
shares 17 and 16, 5 steps, 15 and 20 dropped). Which samples the sampler's shuffle decides, anew each
epoch. It warns once, naming how many, when it drops any; a global batch whose shares divide the
rank's sample count drops none.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple


def _split(n: int, parts: int) -> Tuple[int, ...]:
    """``n`` items in ``parts`` parts, as even as can be (the larger ones first)."""
    return tuple(n // parts + (1 if i < n % parts else 0) for i in range(parts))


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int                          # B: items per optimizer step, all ranks together
    dp_size: int                               # W: data-parallel ranks
    micro_batch: int                           # m: the most items one micro-batch may hold
    accumulation_steps: int                    # K: micro-batches per optimizer step, on every rank
    shares: Tuple[int, ...]                    # items per step, rank by rank (they add up to B)
    micro_batches: Tuple[Tuple[int, ...], ...]  # rank by rank: its K micro-batch sizes

    def steps_per_epoch(self, samples_per_rank: int) -> int:
        """Optimizer steps in an epoch when each rank's sampler yields ``samples_per_rank`` items."""
        return samples_per_rank // max(self.shares)

    def batch_sampler(self, sampler: Sequence[int], rank: Optional[int] = None) -> "PlanBatchSampler":
        """``DataLoader(dataset, batch_sampler=plan.batch_sampler(sampler))``: this rank's micro-batches, whole
        steps only: the samples beyond the epoch's last whole step are dropped (a warning, once, says how many)."""
        if rank is None:
            import torch.distributed as dist
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} is not one of the plan's {self.dp_size} data-parallel ranks")
        return PlanBatchSampler(sampler, self.micro_batches[rank], self, rank)

    def __str__(self) -> str:
        per = "; ".join(f"rank {r}: {s} = {'+'.join(map(str, m))}" for r, (s, m) in
                        enumerate(zip(self.shares, self.micro_batches)))
        return (f"global batch {self.global_batch} over {self.dp_size} rank(s), micro-batches of at most "
                f"{self.micro_batch}: {self.accumulation_steps} accumulation step(s) ({per})")


class PlanBatchSampler:
    """Lists of indices from ``sampler``: the plan's micro-batches of one rank, whole steps only."""

    def __init__(self, sampler, sizes: Tuple[int, ...], plan: BatchPlan, rank: int = 0):
        self.sampler, self.sizes, self.plan, self.rank = sampler, sizes, plan, rank
        self._warned = False

    def __len__(self) -> int:
        return self.plan.steps_per_epoch(len(self.sampler)) * len(self.sizes)

    def __iter__(self) -> Iterator[List[int]]:
        n, steps = len(self.sampler), self.plan.steps_per_epoch(len(self.sampler))
        dropped = n - steps * sum(self.sizes)
        if dropped and not self._warned:
            self._warned = True
            warnings.warn(f"batch_plan: rank {self.rank} reads {steps * sum(self.sizes)} of its sampler's {n} samples "
                          f"per epoch ({steps} whole steps of {sum(self.sizes)}; every rank runs {steps}): the last "
                          f"{dropped} are dropped each epoch, as drop_last=True does (the shuffle decides which). "
                          "A global batch whose per-rank shares divide the sample count drops none", stacklevel=2)
        it = iter(self.sampler)
        for _ in range(steps):
            for size in self.sizes:
                yield [next(it) for _ in range(size)]


def batch_plan(global_batch: int, dp_size: int, micro_batch: int) -> BatchPlan:
    """Split ``global_batch`` items per step over ``dp_size`` ranks in micro-batches of at most
    ``micro_batch``: K (``accumulation_steps``) and each rank's share. Raises ValueError, with
    the numbers, when a rank would get an empty micro-batch."""
    for name, v in (("global_batch", global_batch), ("dp_size", dp_size), ("micro_batch", micro_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"batch_plan: {name} must be a whole number >= 1, got {v!r}")
    if global_batch < dp_size:
        raise ValueError(f"batch_plan: a global batch of {global_batch} over {dp_size} data-parallel ranks leaves "
                         f"{dp_size - global_batch} rank(s) without an item; use a global batch of at least {dp_size}")
    shares = _split(global_batch, dp_size)
    k = -(-shares[0] // micro_batch)  # the largest share decides: every rank runs K micro-steps
    if shares[-1] < k:
        raise ValueError(f"batch_plan: a global batch of {global_batch} over {dp_size} ranks gives shares of "
                         f"{shares[0]} and {shares[-1]} items; the largest needs {k} micro-batches of at most "
                         f"{micro_batch}, and {shares[-1]} items cannot fill {k}. Use a global batch divisible by "
                         f"{dp_size} (e.g. {dp_size * shares[0]}) or micro-batches of {shares[-1]} or more")
    return BatchPlan(global_batch, dp_size, micro_batch, k, shares, tuple(_split(s, k) for s in shares))
