"""mgpu_lab: learn, then do, multi-GPU training in PyTorch.

The top level holds what a training script imports, by concept::

    from mgpu_lab import launch, rank_device, BucketedDDP, ShardedOptimizer, LossScaler

- runtime: ``backend``, ``devices``, ``rank_device``, ``DistEnv``, ``dist_env``,
  ``init_distributed``, ``cleanup``, ``is_main_process``, ``print0``,
  ``distributed_loader``, ``launch``, ``LaunchError``, ``CollectiveTimeout``
- data parallel: ``DataParallel``, ``scatter``, ``replicate``, ``parallel_apply``,
  ``gather``, ``DataParallelModel``, ``DataParallelCriterion``
- collectives and DDP: ``ring_allreduce``, ``naive_allreduce``, ``allreduce_bytes``,
  ``CommStats``, ``NaiveDDP``, ``BucketedDDP``
- sharding: ``ShardedOptimizer`` (ZeRO-1), ``FSDP`` (ZeRO-3)
- model parallel: ``ColumnParallelLinear``, ``RowParallelLinear``, ``ParallelMLP``,
  ``ParallelAttention``, ``ParallelTransformerBlock``, ``vocab_parallel_cross_entropy``,
  ``PipelineStage``, ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
  ``ring_attention`` (context),
  ``MoE``, ``ExpertParallelMoE`` (experts)
- training: ``autocast_dtype``, ``LossScaler``, ``amp_step``, ``GradientAccumulator``,
  ``checkpoint``, ``checkpoint_sequential`` (activation recompute), ``saved_tensor_bytes``,
  ``peak_memory``, ``save_checkpoint``, ``load_checkpoint`` (files), ``TrainState``,
  ``UnsafeCheckpointError``, ``CheckpointError``, ``batch_plan``, ``collective_trace``, ``CollectiveError``

Where a name is torch's, so is the signature (``BucketedDDP(model, process_group=pg)``,
``ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)``, ``checkpoint(fn, x,
use_reentrant=False)``). Teaching tools (simulators, schedule orders, byte formulas,
Megatron's region functions) are imported from their modules, e.g.
``from mgpu_lab.parallel.collectives import simulate_ring_allreduce``.

The library is in four packages, and the arrows run one way::

    runtime/   where code runs: devices, the process group, launch, torchrun, doctor
    parallel/  how work is split: data_parallel, parallel_criterion, collectives, ddp, zero, fsdp,
               tensor_parallel, loss_parallel, pipeline, context_parallel, moe, expert_parallel
    training/  the training step: amp, loss_scaler, grad_accum, recompute, train_state
    measure/   instruments that observe from outside: memory accounting, activation memory,
               collective trace, timing

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

# --- data parallel: DataParallel from scratch and the balanced criterion ---
from .parallel.data_parallel import DataParallel, gather, parallel_apply, replicate, scatter
from .parallel.parallel_criterion import DataParallelCriterion, DataParallelModel

# --- collectives and your own DDP ---
from .parallel.collectives import CommStats, allreduce_bytes, naive_allreduce, ring_allreduce
from .parallel.ddp import BucketedDDP, NaiveDDP

# --- sharding: ZeRO-1 and FSDP ---
from .parallel.zero import ShardedOptimizer
from .parallel.fsdp import FSDP

# --- model parallel: tensor (Megatron), loss parallel, pipeline ---
from .parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .parallel.tensor_parallel_blocks import ParallelAttention, ParallelMLP, ParallelTransformerBlock
from .parallel.loss_parallel import vocab_parallel_cross_entropy
from .parallel.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

# --- context parallelism (ring attention) and expert parallelism (mixture of experts) ---
from .parallel.context_parallel import ring_attention
from .parallel.moe import MoE
from .parallel.expert_parallel import ExpertParallelMoE

# --- training: mixed precision, accumulation, activation recompute, checkpoint files, faults ---
from .training.amp import LossScaler, amp_step, autocast_dtype
from .training.grad_accum import GradientAccumulator
from .training.batch_plan import batch_plan
from .training.recompute import checkpoint, checkpoint_sequential
from .measure.activation_memory import peak_memory, saved_tensor_bytes
from .training.train_state import (
    CheckpointError, TrainState, UnsafeCheckpointError, load_checkpoint, save_checkpoint,
)
from .measure.collective_trace import CollectiveError, collective_trace

__all__ = [
    # runtime
    "backend", "devices", "rank_device", "DistEnv", "dist_env", "init_distributed", "cleanup",
    "is_main_process", "print0", "distributed_loader", "launch", "LaunchError", "CollectiveTimeout",
    # data parallel
    "DataParallel", "scatter", "replicate", "parallel_apply", "gather",
    "DataParallelModel", "DataParallelCriterion",
    # collectives and DDP
    "ring_allreduce", "naive_allreduce", "allreduce_bytes", "CommStats", "NaiveDDP", "BucketedDDP",
    # sharding
    "ShardedOptimizer", "FSDP",
    # model parallel
    "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelAttention",
    "ParallelTransformerBlock", "vocab_parallel_cross_entropy",
    "PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
    "ring_attention", "MoE", "ExpertParallelMoE",
    # training
    "autocast_dtype", "LossScaler", "amp_step", "GradientAccumulator",
    "checkpoint", "checkpoint_sequential", "saved_tensor_bytes", "peak_memory",
    "save_checkpoint", "load_checkpoint", "TrainState", "UnsafeCheckpointError", "CheckpointError",
    "batch_plan", "collective_trace", "CollectiveError",
]
