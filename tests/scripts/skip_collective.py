"""Rank 0 alone calls an all_reduce (a rank-dependent branch); the trace names it.

    mgpu-lab launch --nproc-per-node 2 tests/scripts/skip_collective.py
"""
import torch
import torch.distributed as dist

from mgpu_lab import cleanup, init_distributed
from mgpu_lab.measure.collective_trace import collective_trace

env = init_distributed()
with collective_trace(timeout=5):
    x = torch.ones(3)
    dist.all_reduce(x)
    if env.rank == 0:
        dist.all_reduce(x)  # the bug: only rank 0 logs this metric
    dist.barrier()
cleanup()
