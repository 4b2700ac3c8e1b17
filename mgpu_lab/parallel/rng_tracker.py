"""Random numbers under tensor parallelism: which dropout masks the ranks must share.

In a tensor-parallel group some activations are **replicated** (every rank holds the
same ``[b, s, h]``: the block's output, the residual stream) and some are the rank's
**own** (its heads' attention probabilities, its slice of the features, its tokens
under sequence parallelism). Dropout on a replicated activation must draw the same
mask on every rank, or the "replicas" differ and the ranks silently train different
models; dropout on a rank's own part must draw *different* masks on different ranks,
or head 0 on rank 0 and head 2 on rank 1 get the same mask.

Megatron-LM keeps two streams (``CudaRNGStatesTracker``): the default generator,
seeded alike on the ranks of a group, and a "model-parallel" state seeded
``seed + 2718 + tp_rank``, entered with ``fork()`` around the dropout of the rank's
own part. ``model_parallel_rng(group)`` builds both here, and agrees on the seed by
broadcasting rank 0's, so it holds whatever each rank's own seed is. (DTensor's RNG,
``torch.distributed.tensor._random``, does the same job for DTensor ops on CUDA: it
shares one seed and offsets each shard's Philox counter, so a sharded dropout draws
the shard of one full mask. On CPU it only warns, and each rank draws its own.)

``fork(name)`` swaps the state into the device's default generator for the block
inside it, so every random op in there (``F.dropout``, SDPA's dropout) draws from
it, and the default stream continues afterwards as if nothing happened. Around
activation recompute (``torch.utils.checkpoint``), fork *outside* the checkpointed
function: the checkpoint saves the forked state and replays it.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Tuple

import torch
import torch.distributed as dist

from ..runtime.distributed import global_rank, rank_device

MODEL_PARALLEL_OFFSET = 2718   # Megatron's: the model-parallel seed is seed + 2718 + tp_rank
REPLICATED, MODEL_PARALLEL = "replicated", "model-parallel"


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    raise ValueError(f"RNGStatesTracker: no default generator for a {device.type} device (cpu or cuda)")


class RNGStatesTracker:
    """Named random-number streams, each entered with ``fork(name)`` (Megatron's tracker)."""

    def __init__(self):
        self.seeds: Dict[str, int] = {}
        self._states: Dict[Tuple[str, str], torch.Tensor] = {}   # (name, device) -> generator state

    def add(self, name: str, seed: int) -> None:
        if name in self.seeds:
            raise ValueError(f"RNGStatesTracker: a stream named {name!r} exists already")
        self.seeds[name] = int(seed)

    @contextlib.contextmanager
    def fork(self, name: str, device=None) -> Iterator[None]:
        """Inside: the default generator of ``device`` (default cpu) draws from stream ``name``."""
        if name not in self.seeds:
            raise KeyError(f"RNGStatesTracker: no stream named {name!r}; add(name, seed) first "
                           f"(streams: {sorted(self.seeds)})")
        device = torch.device(device if device is not None else "cpu")
        key = (name, str(device))
        if key not in self._states:   # first use on this device: a generator seeded with the stream's seed
            self._states[key] = torch.Generator(device=device).manual_seed(self.seeds[name]).get_state()
        generator = _default_generator(device)
        outside = generator.get_state()
        generator.set_state(self._states[key])
        try:
            yield
        finally:
            self._states[key] = generator.get_state()
            generator.set_state(outside)


def model_parallel_rng(group=None, seed=None) -> RNGStatesTracker:
    """The two streams of a tensor-parallel group: ``"replicated"`` (one seed on every rank of
    ``group``: rank 0's) and ``"model-parallel"`` (``seed + 2718 + rank in group``). ``seed``:
    default, a number drawn from rank 0's default generator (so seeding rank 0 decides it)."""
    if seed is None:
        seed = torch.randint(2**62, (1,)).item()
    if dist.is_initialized():
        agreed = torch.tensor([int(seed)], dtype=torch.int64)
        if dist.get_backend(group) == "nccl":
            agreed = agreed.to(rank_device())
        dist.broadcast(agreed, src=global_rank(group, 0), group=group)
        seed, rank = agreed.item(), dist.get_rank(group)
    else:
        rank = 0
    tracker = RNGStatesTracker()
    tracker.add(REPLICATED, seed)
    tracker.add(MODEL_PARALLEL, seed + MODEL_PARALLEL_OFFSET + rank)
    return tracker
