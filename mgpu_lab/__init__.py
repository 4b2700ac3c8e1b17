"""mgpu_lab: learn, then do, multi-GPU training in PyTorch.

Every public name (``__all__``) is importable from the package itself::

    from mgpu_lab import launch, devices, DataParallel, ring_allreduce

The library is in four packages, and the arrows run one way::

    runtime/   where code runs: devices, the process group, launch, torchrun, doctor
    parallel/  how work is split: data_parallel, parallel_criterion, collectives, ddp, zero, fsdp,
               tensor_parallel, pipeline
    training/  the training step: amp, grad_accum, checkpointing, train_state
    measure/   instruments that observe from outside: memory accounting, collective trace, timing

``parallel`` and ``training`` use ``runtime``; ``runtime`` uses neither. The
course machinery (``course/``: labs, grader, tour) uses the library, never the
other way round. One concept per module, named after it.
"""

__version__ = "0.1.0"

# --- runtime: devices, the process group, launching ---
from .runtime.devices import backend, devices
from .runtime.distributed import (
    DistEnv,
    cleanup,
    dist_env,
    distributed_loader,
    init_distributed,
    is_main_process,
    print0,
    rank_device,
)
from .runtime.launch import CollectiveTimeout, LaunchError, launch

# --- parallel: DataParallel from scratch and the balanced criterion ---
from .parallel.data_parallel import DataParallel, gather, parallel_apply, replicate, scatter
from .measure.memory_account import MemoryAccount, account_memory, plot_memory
from .parallel.parallel_criterion import DataParallelCriterion, DataParallelModel

# --- parallel: collectives and your own DDP ---
from .parallel.collectives import (
    CommStats,
    RingState,
    allreduce_bytes,
    bus_bandwidth,
    naive_allreduce,
    ring_allreduce,
    ring_schedule,
    simulate_ring_allreduce,
)
from .parallel.ddp import BucketedDDP, NaiveDDP

# --- training: gradient accumulation ---
from .training.grad_accum import GradientAccumulator

# --- parallel: sharding (ZeRO-1 and FSDP) ---
from .parallel.sharding import FSDP, ShardedOptimizer, partition_parameters, zero_bytes_per_rank

# --- training: mixed precision ---
from .training.amp import LossScaler, amp_step, autocast_dtype

# --- training: faults (resumable checkpoints) ---
from .training.train_state import (
    TrainState,
    UnsafeCheckpointError,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    unwrap,
)

# --- measure: collective trace (faults) ---
from .measure.collective_trace import CollectiveError, collective_trace
from .measure.trace_compare import first_divergence

# --- training: activation checkpointing ---
from .training.checkpointing import checkpoint, checkpoint_sequential, peak_memory, saved_tensor_bytes

# --- parallel: model parallelism (tensor parallel, sequence parallel, loss parallel, pipeline) ---
from .parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_parallel_region,
    gather_from_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_parallel_region,
    scatter_to_sequence_parallel_region,
)
from .parallel.tensor_parallel_blocks import ParallelAttention, ParallelMLP, ParallelTransformerBlock, TransformerBlock
from .parallel.loss_parallel import vocab_parallel_cross_entropy
from .parallel.pipeline import (
    PipelineSchedule,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    check_order,
    gpipe_order,
    held_microbatches,
    one_f_one_b_order,
    simulate_timeline,
    bubble_fraction,
)

__all__ = [
    # runtime
    "backend", "devices", "DistEnv", "cleanup", "dist_env", "distributed_loader", "init_distributed",
    "is_main_process", "print0", "rank_device", "CollectiveTimeout", "LaunchError", "launch",
    # DataParallel from scratch, the balanced criterion, memory accounting
    "DataParallel", "gather", "parallel_apply", "replicate", "scatter",
    "MemoryAccount", "account_memory", "plot_memory", "DataParallelCriterion", "DataParallelModel",
    # collectives and your own DDP
    "CommStats", "RingState", "allreduce_bytes", "bus_bandwidth", "naive_allreduce", "ring_allreduce",
    "ring_schedule", "simulate_ring_allreduce", "BucketedDDP", "NaiveDDP",
    # training: accumulation, mixed precision, faults, activation checkpointing
    "GradientAccumulator", "LossScaler", "amp_step", "autocast_dtype",
    "TrainState", "UnsafeCheckpointError", "load_checkpoint", "rng_state", "save_checkpoint",
    "set_rng_state", "unwrap", "CollectiveError", "collective_trace", "first_divergence",
    "checkpoint", "checkpoint_sequential", "peak_memory", "saved_tensor_bytes",
    # sharding
    "FSDP", "ShardedOptimizer", "partition_parameters", "zero_bytes_per_rank",
    # model parallelism: tensor (Megatron), sequence and loss parallel, pipeline
    "ColumnParallelLinear", "RowParallelLinear", "copy_to_parallel_region",
    "gather_from_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_from_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_parallel_region", "scatter_to_sequence_parallel_region",
    "ParallelAttention", "ParallelMLP", "ParallelTransformerBlock", "TransformerBlock",
    "vocab_parallel_cross_entropy",
    "PipelineSchedule", "PipelineStage", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "check_order",
    "gpipe_order", "held_microbatches", "one_f_one_b_order", "simulate_timeline", "bubble_fraction",
]
