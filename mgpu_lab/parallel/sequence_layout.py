"""Which positions of a sequence each rank holds under context parallelism, and what that costs.

A sequence of ``S`` tokens is cut into equal **chunks**; each rank holds some of them,
concatenated in increasing order of position (its *local* sequence):

* ``"contiguous"``: N chunks, rank r holds chunk r (positions ``r*s ... (r+1)*s - 1``,
  ``s = S/N``);
* ``"zigzag"``: 2N chunks, rank r holds chunks r and 2N-1-r (one from the start and its
  mirror from the end).

Why zigzag: under a causal mask, query i attends to keys 0..i, so the work of a chunk of
queries grows with its position. Contiguously, the last rank does N - 1/2 chunks' worth of
work and the first 1/2: the others wait for the last one. Chunk r and chunk 2N-1-r together
always make 2N chunk-pairs of work, on every rank, and (in a ring) at every step.

``simulate_ring`` replays a ring attention's forward on ranks of fixed speed for any
layout (a list of chunk lists): each rank's compute spans, whose idle fraction
(``mgpu_lab.parallel.pipeline.bubble_fraction``) is the price of the imbalance.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

LAYOUTS = ("contiguous", "zigzag")


def _check_layout(layout: str) -> int:
    """Chunks per rank of a named layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 1 if layout == "contiguous" else 2


def layout_chunks(world_size: int, layout: str = "contiguous") -> List[List[int]]:
    """The chunks each rank holds: ``[[0], [1], ...]`` (contiguous), ``[[0, 2N-1], [1, 2N-2], ...]`` (zigzag)."""
    if _check_layout(layout) == 1:
        return [[r] for r in range(world_size)]
    return [[r, 2 * world_size - 1 - r] for r in range(world_size)]


def local_positions(rank: int, world_size: int, seq_local: int, layout: str = "contiguous") -> torch.Tensor:
    """The global positions of the ``seq_local`` tokens rank ``rank`` holds, in its local order."""
    per = _check_layout(layout)
    if seq_local % per:
        raise ValueError(f"the zigzag layout holds two chunks per rank: the local sequence ({seq_local}) must be even")
    c = seq_local // per
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in layout_chunks(world_size, layout)[rank]])


def shard_sequence(x: torch.Tensor, world_size: int, rank: int, layout: str = "contiguous",
                   dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s part of the full sequence ``x`` (sequence on ``dim``; SDPA's layout is dim 2)."""
    per, S = _check_layout(layout), x.shape[dim]
    if S % (per * world_size):
        raise ValueError(f"a sequence of {S} tokens cannot be cut into {per * world_size} equal chunks "
                         f"({layout} layout, {world_size} ranks): pad it to a multiple of {per * world_size}")
    chunks = x.chunk(per * world_size, dim)
    return torch.cat([chunks[i] for i in layout_chunks(world_size, layout)[rank]], dim)


def unshard_sequence(parts: Sequence[torch.Tensor], layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's part (``parts[r]`` is rank r's): ``shard_sequence``'s inverse."""
    n, per = len(parts), _check_layout(layout)
    chunks = [None] * (per * n)
    for r, part in enumerate(parts):
        for i, piece in zip(layout_chunks(n, layout)[r], part.chunk(per, dim)):
            chunks[i] = piece
    return torch.cat(chunks, dim)


def pair_work(a: int, b: int, chunk_size: int) -> int:
    """Query-key pairs a causal mask allows between query chunk ``a`` and key chunk ``b``."""
    return chunk_size * chunk_size if b < a else chunk_size * (chunk_size + 1) // 2 if a == b else 0


def simulate_ring(layout: Sequence[Sequence[int]], chunk_size: int = 64,
                  causal: bool = True) -> List[List[Tuple[int, float, float]]]:
    """A ring attention forward replayed on ranks of fixed speed (one time unit per query-key pair).

    ``layout[r]`` lists the chunks rank r holds (every chunk ``chunk_size`` tokens). At step i
    rank r attends its queries to the keys of rank r - i (mod N), which it received from rank
    r - 1: rank r starts step i when it has finished step i - 1 and rank r - 1 has started
    step i - 1 (and so passed the block on). Returns each rank's ``(step, start, end)``.
    """
    n = len(layout)
    start = [[0.0] * n for _ in range(n)]  # start[r][i]
    spans: List[List[Tuple[int, float, float]]] = [[] for _ in range(n)]
    for i in range(n):
        for r in range(n):
            src = (r - i) % n
            work = sum(pair_work(a, b, chunk_size) if causal else chunk_size * chunk_size
                       for a in layout[r] for b in layout[src])
            ready = 0.0 if i == 0 else max(spans[r][i - 1][2], start[(r - 1) % n][i - 1])
            start[r][i] = ready
            spans[r].append((i, ready, ready + work))
    return spans
