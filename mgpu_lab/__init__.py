"""mgpu_lab: learn, then do, multi-GPU training in PyTorch.

Every public name is importable from the package itself::

    from mgpu_lab import launch, devices, DataParallel, ring_allreduce

One concept per module; the module names say which (see README.md).
"""

__version__ = "0.1.0"

# --- devices and distributed core (issue 2) ---
from .devices import backend, devices
from .distributed import (
    DistEnv,
    cleanup,
    dist_env,
    distributed_loader,
    init_distributed,
    is_main_process,
    print0,
    rank_device,
)
from .launch import LaunchError, launch

# --- DataParallel from scratch and the balanced criterion (issue 4) ---
from .data_parallel import DataParallel, gather, parallel_apply, replicate, scatter
from .memory_account import MemoryAccount, account_memory, plot_memory
from .parallel_criterion import DataParallelCriterion, DataParallelModel

# --- collectives and your own DDP (issue 5) ---
from .collectives import (
    CommStats,
    RingState,
    allreduce_bytes,
    bus_bandwidth,
    naive_allreduce,
    ring_allreduce,
    ring_schedule,
    simulate_ring_allreduce,
)
from .ddp import BucketedDDP, NaiveDDP
