"""Sharding: ZeRO-1 (``ShardedOptimizer``) and ZeRO-3 (``FSDP``), from scratch.

Data parallelism replicates parameters (Ψ), gradients (Ψ) and optimizer state
(K·Ψ) on every rank. The ZeRO stages shard them across the N ranks, in turn:

=========  ============================  ==================  =====================
stage      sharded                       bytes per rank      communication / step
=========  ============================  ==================  =====================
DDP        nothing                       (2+2+K)·Ψ           2Ψ (all-reduce)
ZeRO-1     optimizer state               (2+2+K/N)·Ψ         2Ψ (+Ψ here, see zero)
ZeRO-2     + gradients                   (2+(2+K)/N)·Ψ       2Ψ
ZeRO-3     + parameters (FSDP)           (2+2+K)·Ψ/N         3Ψ (1.5x DDP)
=========  ============================  ==================  =====================

(mixed-precision Adam as in the ZeRO paper: 2 bytes fp16 parameters, 2 fp16
gradients, K = 12 for fp32 master weights, momentum and variance; the
communication figures are the ring's, each times (N-1)/N.)

The two implementations live in their own modules, one concept each:
:mod:`mgpu_lab.parallel.zero` and :mod:`mgpu_lab.parallel.fsdp`.
"""
from .fsdp import FSDP
from .zero import ShardedOptimizer, partition_parameters

__all__ = ["FSDP", "ShardedOptimizer", "partition_parameters", "zero_bytes_per_rank"]


def zero_bytes_per_rank(num_params: int, world_size: int, stage: int,
                        param_bytes: int = 2, grad_bytes: int = 2, state_bytes: int = 12) -> float:
    """The ZeRO paper's memory per rank for stage 0 (DDP), 1, 2 or 3.

    Defaults: mixed-precision Adam, 2 + 2 + 12 = 16 bytes per parameter. For fp32
    Adam without a master copy pass ``param_bytes=4, grad_bytes=4, state_bytes=8``.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n, psi = world_size, num_params
    p, g, k = param_bytes * psi, grad_bytes * psi, state_bytes * psi
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]
