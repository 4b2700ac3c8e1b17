"""Fails on torchrun's first attempt, succeeds after one restart (tests --max-restarts).

    mgpu-lab launch --max-restarts 1 tests/scripts/fail_once.py
"""
import os

import torch.distributed as dist

from mgpu_lab import cleanup, init_distributed, print0

env = init_distributed()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if attempt == 0 and env.rank == 1:
    raise SystemExit("rank 1 fails on the first attempt")
dist.barrier()
print0(f"attempt {attempt} ok, world size {env.world_size}")
cleanup()
