"""All-reduce by hand: the ring, and the parameter server it replaced.

An all-reduce leaves every rank holding the element-wise reduction (usually the
sum) of everybody's tensor. Data-parallel training runs one per step to average
gradients, so its cost is paid on every step. Two ways to do it with nothing but
point-to-point messages:

* **Parameter server** (``naive_allreduce``): every rank sends its whole tensor
  (S bytes) to one root, the root reduces and sends the result back to each.
  The root sends (N-1)·S and receives (N-1)·S bytes: its link is the bottleneck,
  and it gets worse linearly as N grows.
* **Ring** (``ring_allreduce``, Baidu 2017, Horovod, NCCL): the ranks form a
  logical ring, each talking only to its right neighbour (send) and its left one
  (receive). The tensor is cut into N chunks. *Scatter-reduce*: in N-1 steps each
  rank passes one chunk to the right and adds the chunk arriving from the left;
  afterwards rank r holds the complete sum of chunk (r+1) mod N. *All-gather*: in
  N-1 more steps the finished chunks travel once around the ring. Every rank
  sends 2(N-1) chunks of S/N bytes, 2(N-1)/N·S in all: below 2·S however large N
  gets, and the same on every rank, so no link is a bottleneck.

Both functions work in place and return a ``CommStats`` counted from the messages
actually sent, so it can be checked against ``allreduce_bytes`` (the theory).

Timeouts: every wait here is ``Work.wait()`` on a point-to-point request. On gloo
that wait honours the process group's timeout (``init_process_group(timeout=...)``,
``mgpu_lab.launch`` sets one), so a missing peer raises, naming the ranks this one
was waiting for, instead of hanging; on NCCL the watchdog enforces the same timeout.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..runtime.distributed import global_rank, require_process_group

OPS = ("sum", "avg", "max", "min", "product")


@dataclass
class CommStats:
    """What one rank put on (and took off) the wire during one collective.

    bytes_sent / bytes_received count payload bytes of the messages this rank
    actually sent / received; steps counts the communication steps (the ring
    runs 2(N-1), the parameter server 2: gather to the root, send back).
    Stats add up, so a DDP step can sum those of its buckets.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    steps: int = 0

    def __add__(self, other: "CommStats") -> "CommStats":
        return CommStats(self.bytes_sent + other.bytes_sent,
                         self.bytes_received + other.bytes_received,
                         self.steps + other.steps)


def allreduce_bytes(numel: int, element_size: int, world_size: int,
                    algorithm: str = "ring") -> float:
    """Bytes the busiest rank sends in one all-reduce of S = numel·element_size.

    ``"ring"``: 2(N-1)/N·S on every rank (exact when N divides numel).
    ``"parameter_server"`` (what ``naive_allreduce`` does): (N-1)·S, what the
    root sends; the other ranks send S each, but the root's link sets the time.
    """
    if numel < 0 or element_size <= 0 or world_size < 1:
        raise ValueError(f"need numel >= 0, element_size > 0, world_size >= 1; got "
                         f"{numel}, {element_size}, {world_size}")
    size = numel * element_size
    if algorithm == "ring":
        return 2 * (world_size - 1) * size / world_size
    if algorithm == "parameter_server":
        return float((world_size - 1) * size)
    hint = " (naive_allreduce's pattern is called 'parameter_server')" if algorithm == "naive" else ""
    raise ValueError(f"unknown algorithm {algorithm!r}: use 'ring' or 'parameter_server'{hint}")


def bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> Tuple[float, float]:
    """(algBw, busBw) in bytes/s for an all-reduce of nbytes, as nccl-tests define them.

    algBw = S / t, what the caller sees. busBw = algBw · 2(N-1)/N, the rate each
    link actually carried in a ring: comparable across N and against the hardware's
    link bandwidth, which algBw is not.
    """
    alg = nbytes / seconds
    return alg, alg * 2 * (world_size - 1) / world_size


# --------------------------------------------------------------------------- the schedule

def ring_schedule(world_size: int) -> List[Tuple[str, List[Tuple[int, int, int]]]]:
    """The ring's 2(N-1) steps, as (phase, [(src, dst, chunk), ...]) with one message per rank.

    Steps are numbered from 1 in each phase (step 0 is the start, before any
    message); the list holds scatter-reduce steps 1..N-1, then all-gather steps
    1..N-1. Scatter-reduce step s: rank r sends chunk (r-s+1) mod N to r+1, which
    adds it to its own. All-gather step s: rank r forwards the finished chunk
    (r-s+2) mod N to r+1, which overwrites its copy. ``ring_allreduce`` follows
    exactly this schedule; ``simulate_ring_allreduce`` replays it in one process.
    """
    n = world_size
    steps = [("scatter-reduce", [(r, (r + 1) % n, (r - s + 1) % n) for r in range(n)]) for s in range(1, n)]
    steps += [("all-gather", [(r, (r + 1) % n, (r - s + 2) % n) for r in range(n)]) for s in range(1, n)]
    return steps


@dataclass
class RingState:
    """Every rank's chunks after one step of a simulated ring all-reduce.

    phase: "start", "scatter-reduce" or "all-gather"; step: the step within the
    phase, numbered from 1 (0 for the start, which is a copy of the inputs).
    chunks[r][c]: rank r's copy of chunk c. contributors[r][c]: the ranks whose
    data that copy is the reduction of (all N of them once it is finished).
    messages: the (src, dst, chunk) sent in the step that led here.
    """

    phase: str
    step: int
    chunks: List[List[torch.Tensor]]
    contributors: List[List[frozenset]]
    messages: List[Tuple[int, int, int]]


def simulate_ring_allreduce(tensors: List[torch.Tensor], op: str = "sum") -> List[RingState]:
    """Replay the ring on N tensors in one process (no process group needed).

    Returns 2(N-1)+1 states: states[0] is the start (each rank's own data,
    copied), states[k] the state after k steps (``RingState.step`` counts within
    the phase, from 1). What the lab's step-through widget draws; the last state
    holds the all-reduced chunks.
    """
    n = len(tensors)
    if n < 1 or any(t.shape != tensors[0].shape for t in tensors):
        raise ValueError("give one tensor per rank, all of the same shape")
    if op not in ("sum", "max", "min", "product"):
        raise ValueError(f"simulate_ring_allreduce supports sum, max, min, product; got {op!r}")
    chunks = [[c.clone() for c in torch.tensor_split(t.reshape(-1), n)] for t in tensors]
    contrib = [[frozenset([r]) for _ in range(n)] for r in range(n)]

    def snapshot():  # the chunks are reduced in place: each state keeps copies
        return [[x.clone() for x in c] for c in chunks]

    states = [RingState("start", 0, snapshot(), [list(c) for c in contrib], [])]
    for i, (phase, messages) in enumerate(ring_schedule(n)):
        sent = [(dst, c, chunks[src][c].clone(), contrib[src][c]) for src, dst, c in messages]
        for dst, c, data, who in sent:  # all messages of a step travel at once
            if phase == "scatter-reduce":
                _reduce_into(chunks[dst][c], data, op)
                contrib[dst][c] = contrib[dst][c] | who
            else:
                chunks[dst][c] = data
                contrib[dst][c] = who
        step = i + 1 if phase == "scatter-reduce" else i + 2 - n  # from 1 in each phase
        states.append(RingState(phase, step, snapshot(),
                                [list(c) for c in contrib], messages))
    return states


# --------------------------------------------------------------------------- checks

def _check(tensor: torch.Tensor, op: str, group, who: str) -> Tuple[torch.Tensor, int, int]:
    """Validate input; return (flat contiguous working tensor, rank, world_size)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if op not in OPS:
        raise ValueError(f"unsupported op {op!r}: use one of {OPS}")
    if tensor.dtype == torch.bool or tensor.is_complex() or tensor.is_quantized:
        raise TypeError(f"dtype {tensor.dtype} is not supported: use a float or integer "
                        "tensor (view a complex tensor with torch.view_as_real)")
    if op == "avg" and not tensor.is_floating_point():
        raise TypeError(f"op='avg' on {tensor.dtype} would have to round: use op='sum' "
                        "and divide yourself, or convert the tensor to a float dtype")
    require_process_group(who)
    backend = dist.get_backend(group)
    if backend == "nccl" and tensor.device.type != "cuda":
        raise ValueError(f"the nccl backend needs a CUDA tensor, got one on {tensor.device}: "
                         "move it with tensor.cuda() (torch.cuda.current_device())")
    if backend == "gloo" and tensor.device.type != "cpu":
        raise ValueError(f"gloo point-to-point messages need a CPU tensor, got one on "
                         f"{tensor.device}: move it with tensor.cpu() or use nccl")
    # A non-contiguous tensor has no flat view; work on a contiguous copy and
    # copy the result back at the end (one extra copy of S bytes).
    # detach(): a tensor that requires grad (a Parameter) is still reduced in place,
    # outside autograd, as dist.all_reduce does.
    work = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()
    return work.view(-1), dist.get_rank(group), dist.get_world_size(group)


def _reduce_into(acc: torch.Tensor, incoming: torch.Tensor, op: str) -> None:
    if op in ("sum", "avg"):
        acc.add_(incoming)
    elif op == "max":
        torch.maximum(acc, incoming, out=acc)
    elif op == "min":
        torch.minimum(acc, incoming, out=acc)
    else:
        acc.mul_(incoming)


Message = Tuple[Callable, torch.Tensor, int]  # (dist.isend or dist.irecv, tensor, global rank of the peer)


def _p2p(messages: List[Message], group, what: str) -> None:
    """Post point-to-point messages together and wait for all of them.

    Posting every send and receive before waiting on any means neighbours that
    send to each other cannot deadlock. On NCCL (CUDA tensors) the messages must
    also form one group, ``batch_isend_irecv``: a send and a receive between the
    same two GPUs, issued one by one, would each wait for the other. Gloo takes
    them one by one. Empty messages are skipped (both ends know the sizes). A
    wait is bounded by the process group's timeout; when it fails, the error
    says which peers this rank was waiting for.
    """
    messages = [(post, t, peer) for post, t, peer in messages if t.numel() > 0]
    if not messages:
        return
    try:
        if messages[0][1].is_cuda:
            works = dist.batch_isend_irecv([dist.P2POp(post, t, peer, group) for post, t, peer in messages])
        else:
            works = [post(t, peer, group) for post, t, peer in messages]
        for work in works:
            work.wait()
    except RuntimeError as e:
        raise RuntimeError(f"rank {dist.get_rank()}: {what} failed ({e}). Usually a peer never reached "
                           "this collective (it crashed, or took a rank-dependent branch).") from e


_buffers = threading.local()  # each thread's receive buffers, one per dtype, reused across calls


def _receive_buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    """Room for one incoming chunk (``numel`` elements of ``like``'s dtype), to add from.

    Why not ``torch.empty`` on every call: on CPU, a fresh buffer of more than a
    few MB is new memory from the kernel, and the first write to each of its
    4 KB pages is a page fault (the kernel zero-fills the page). Receiving 32 MB
    into fresh memory costs about as much as sending it. So the buffer is kept
    and reused: after the first call, this ring allocates nothing. It holds S/N
    bytes of the largest tensor reduced so far. (On GPUs, PyTorch's caching
    allocator already reuses memory, so a plain ``torch.empty`` is cheap.)
    """
    if like.device.type != "cpu":
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    kept = _buffers.__dict__.setdefault("by_dtype", {})
    if like.dtype not in kept or kept[like.dtype].numel() < numel:
        kept[like.dtype] = torch.empty(numel, dtype=like.dtype)
    return kept[like.dtype][:numel]


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


# --------------------------------------------------------------------------- ring

def ring_allreduce(tensor: torch.Tensor, op: str = "sum", group=None) -> CommStats:
    """All-reduce ``tensor`` in place with a ring of point-to-point messages.

    op: "sum", "avg" (floats only: integers raise rather than round), "max",
    "min" or "product". Any shape, size (also not divisible by N, also smaller
    than N: some chunks are then empty and nothing is sent for them) and float
    or integer dtype. Equal to ``dist.all_reduce`` bit for bit on integers, to
    rounding on floats (the additions happen in ring order).

    Every rank must pass a tensor of the same number of elements and dtype (as
    for ``dist.all_reduce``). A non-contiguous tensor is reduced in a contiguous
    copy that is copied back (S extra bytes).

    Cost per rank: 2(N-1) steps, 2(N-1)/N·S bytes sent and received, one chunk
    of scratch memory to receive into (kept for the next call: see
    ``_receive_buffer``). Returns this rank's ``CommStats``.
    """
    flat, rank, world = _check(tensor, op, group, "ring_allreduce")
    stats = CommStats()
    if world > 1:
        chunks: List[torch.Tensor] = list(torch.tensor_split(flat, world))
        right, left = global_rank(group, (rank + 1) % world), global_rank(group, (rank - 1) % world)
        scratch = _receive_buffer(chunks[0].numel(), flat)  # chunk 0 is the largest
        for i, (phase, messages) in enumerate(ring_schedule(world)):
            if i == world - 1 and op == "avg":
                chunks[(rank + 1) % world].div_(world)  # scatter-reduce done: this rank's finished chunk
            send = chunks[messages[rank][2]]               # message (rank, rank+1, chunk)
            recv_chunk = messages[(rank - 1) % world][2]   # what the left neighbour sends
            if phase == "scatter-reduce":
                incoming = scratch[: chunks[recv_chunk].numel()]
            else:
                incoming = chunks[recv_chunk]               # overwritten in place
            _p2p([(dist.isend, send, right), (dist.irecv, incoming, left)], group,
                 f"sending to rank {right} and receiving from rank {left}")
            if phase == "scatter-reduce":
                _reduce_into(chunks[recv_chunk], incoming, op)
            stats += CommStats(_nbytes(send), _nbytes(incoming), 1)
    if not tensor.is_contiguous():
        with torch.no_grad():
            tensor.copy_(flat.view(tensor.shape))
    return stats


# --------------------------------------------------------------------------- parameter server

def naive_allreduce(tensor: torch.Tensor, root: int = 0, group=None, *,
                    op: str = "sum") -> CommStats:
    """All-reduce in place the parameter-server way: reduce to ``root``, then send back.

    Every other rank sends its tensor (S bytes) to the root and receives the
    result (S bytes). The root receives (N-1)·S and sends (N-1)·S: its link is
    the bottleneck, and it grows with N (the ring's stays below 2·S). The root
    adds the contributions in rank order and needs (N-1)·S of scratch memory.
    ``root`` is a rank within ``group``.
    """
    flat, rank, world = _check(tensor, op, group, "naive_allreduce")
    if not 0 <= root < world:
        raise ValueError(f"root={root} is not a rank of this group (world_size={world})")
    stats = CommStats()
    if world > 1:
        if rank == root:
            others = [r for r in range(world) if r != root]
            peers = [global_rank(group, r) for r in others]
            bufs = {r: torch.empty_like(flat) for r in others}
            _p2p([(dist.irecv, bufs[r], p) for r, p in zip(others, peers)], group,
                 f"receiving from ranks {peers}")
            contributions = [flat.clone() if r == root else bufs[r] for r in range(world)]
            flat.copy_(contributions[0])
            for c in contributions[1:]:
                _reduce_into(flat, c, op)
            if op == "avg":
                flat.div_(world)
            _p2p([(dist.isend, flat, p) for p in peers], group, f"sending to ranks {peers}")
            nbytes = _nbytes(flat) * (world - 1)
            stats = CommStats(nbytes, nbytes, 2)
        else:
            server = global_rank(group, root)
            _p2p([(dist.isend, flat, server)], group, f"sending to root rank {server}")
            _p2p([(dist.irecv, flat, server)], group, f"receiving from root rank {server}")
            stats = CommStats(_nbytes(flat), _nbytes(flat), 2)
    if not tensor.is_contiguous():
        with torch.no_grad():
            tensor.copy_(flat.view(tensor.shape))
    return stats
