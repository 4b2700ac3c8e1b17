"""Context parallelism: ring attention, the sequence split across ranks for attention itself.

Sequence parallelism (lab 11) splits the norms and dropout along the sequence and gathers
the sequence again before attention, where tensor parallelism splits the heads: each rank
holds the keys and values of all S tokens for a/N of the heads. Gathering the keys and
values of every head instead (Llama 3's all-gather context parallelism, torch's default)
holds those of all S tokens on every rank (and, without a fused kernel, an ``s x S`` block
of scores). Ring attention never gathers. Rank r holds its queries, keys and values (``s = S/N`` positions); the key/value
blocks travel around the ring (rank r sends to r+1 and receives from r-1), and after N steps
each rank has attended its queries to every block. Each step's partial result is merged
into the running one by the **log-sum-exp** (``lse``, the log of a row's softmax denominator
over the keys seen so far): the online softmax's re-basing (lab 14, exercise 1), a whole
block at a time, exactly the attention over the keys of both. The next block's receive is
posted before the current block is computed: communication hides behind computation.

Backward runs the same ring. Each rank recomputes a block's probabilities from the saved
``lse`` (nothing ``s x S`` is kept), adds its queries' contribution to that block's key and
value gradients, and passes those gradients on with the block: after the ring, each block's
dK and dV, summed over every rank's queries, are back with their owner.

Each block is one attention call that also returns its lse: on CPU (fp32, bf16) torch's fused
flash-attention kernel, which keeps no block of scores; elsewhere (GPUs, fp64) matrix products,
which hold one ``s x s`` block of scores at a time. (torch's ``context_parallel`` uses the fused
CUDA kernels on GPUs.) Memory per rank: q, k, v, the output, its lse and two blocks in flight,
O(s); the gathered attention holds the keys and values of all S positions. Communication per
rank and step: one block of k and v forward; k, v and their gradients backward.

Causal masks: with the contiguous layout rank r skips the blocks of later ranks, so the
last rank works N - 1/2 blocks and the first 1/2; ``layout="zigzag"`` balances it
(``sequence_layout``). ``timeline=[]`` records each rank's spans: compute, the time blocked
waiting for a block (communication not hidden) and each message's flight.
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..runtime.distributed import global_rank, require_process_group
from .sequence_layout import local_positions

Block = Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]  # rows, cols, mask


class _Exchange:
    """Send ``tensors`` to the next rank of the ring and receive as many from the previous one.

    Posted at once, waited for later (``wait``): what happens in between overlaps the transfer."""

    def __init__(self, tensors: List[torch.Tensor], group):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        nxt, prv = global_rank(group, (r + 1) % n), global_rank(group, (r - 1) % n)
        self.sent = [t.contiguous() for t in tensors]   # kept alive until the sends complete
        self.bufs = [torch.empty_like(t) for t in self.sent]
        self.posted = time.perf_counter()
        if self.sent[0].is_cuda:  # NCCL: one group, so that a send and a receive between two GPUs cannot block
            ops = [dist.P2POp(dist.isend, t, group=group, peer=nxt) for t in self.sent]
            self.works = dist.batch_isend_irecv(ops + [dist.P2POp(dist.irecv, b, group=group, peer=prv)
                                                       for b in self.bufs])
        else:
            self.works = [dist.isend(t, nxt, group=group) for t in self.sent]
            self.works += [dist.irecv(b, prv, group=group) for b in self.bufs]

    def wait(self, timer, step) -> List[torch.Tensor]:
        start = time.perf_counter()
        for w in self.works:
            w.wait()
        timer.span("wait", step, start)
        timer.span("comm", step, self.posted)
        return self.bufs


def _block(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> Optional[Block]:
    """Which query rows and key columns of a block have work, and the mask between them.

    Positions are increasing (as every layout holds them). ``None``: nothing to compute (every
    key is later than every query). Otherwise ``(rows, cols, mask)``: ``None`` for all rows /
    all columns; mask ``None`` (every pair allowed), ``"causal"`` (queries and keys at the same
    positions: SDPA's ``is_causal``) or a bool tensor. O(s): no s x s matrix unless a mask needs it."""
    if not causal:
        return None, None, None
    rows, cols = q_pos >= k_pos[0], k_pos <= q_pos[-1]     # queries that see a key, keys that a query sees
    if not rows.any():
        return None
    qs, ks = q_pos[rows], k_pos[cols]
    if ks[-1] <= qs[0]:
        mask = None
    elif torch.equal(qs, ks):
        mask = "causal"
    else:
        mask = ks[None, :] <= qs[:, None]
    return None if rows.all() else rows.nonzero().squeeze(1), None if cols.all() else cols.nonzero().squeeze(1), mask


def _take(t: torch.Tensor, idx: Optional[torch.Tensor]) -> torch.Tensor:
    return t if idx is None else t.index_select(-2, idx)


def _fused(q: torch.Tensor, mask) -> bool:
    """Use the CPU flash-attention kernel (no block of scores in memory)? On GPUs, and for an
    arbitrary mask, the blocks are computed with matrix products instead."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and not torch.is_tensor(mask)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the precision partial results are accumulated in: fp32, or fp64 for fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q, k, scale, mask):
    s = (_wide(q) @ _wide(k).transpose(-2, -1)) * scale
    if mask is None:
        return s
    if not torch.is_tensor(mask):  # "causal"
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return s.masked_fill(~mask, float("-inf"))


def _attend(q, k, v, scale, mask):
    """``(out, lse)`` of the queries over one block of keys, in fp32."""
    if _fused(q, mask):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, mask is not None,
                                                                             scale=scale)
        return out.float(), lse
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse.unsqueeze(-1)) @ _wide(v), lse


def _attend_backward(dout, q, k, v, out, lse, scale, mask):
    """``(dq, dk, dv)`` of one block, given the whole output and lse of the queries (fp32)."""
    if _fused(q, mask):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, mask is not None, scale=scale)
        return [g.float() for g in grads]
    q, k, v = _wide(q), _wide(k), _wide(v)
    p = torch.exp(_scores(q, k, scale, mask) - lse.unsqueeze(-1))                 # the block's probabilities
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(-1, keepdim=True))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ dout


def _merge(out, lse, rows, out_b, lse_b):
    """Merge a block's (out_b, lse_b) into the running (out, lse) on ``rows`` (in place)."""
    o, l = _take(out, rows), (lse if rows is None else lse.index_select(-1, rows))
    new = torch.logaddexp(l, lse_b)
    o = o * torch.exp(l - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1)
    if rows is None:
        out.copy_(o), lse.copy_(new)
    else:
        out.index_copy_(-2, rows, o), lse.index_copy_(-1, rows, new)


class _Timer:
    """Appends ``(phase, kind, step, start, end)`` to ``timeline`` (a no-op without one)."""

    def __init__(self, timeline, phase):
        self.timeline, self.phase = timeline, phase

    def span(self, kind, step, start):
        if self.timeline is not None:
            self.timeline.append((self.phase, kind, step, start, time.perf_counter()))


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, causal, group, layout, scale, timeline):
        n, r, s = dist.get_world_size(group), dist.get_rank(group), q.shape[-2]
        q_pos = local_positions(r, n, s, layout).to(q.device)
        wide = torch.promote_types(q.dtype, torch.float32)   # partial results accumulate in fp32 (fp64 for fp64)
        out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=wide, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=wide, device=q.device)
        timer, kv = _Timer(timeline, "forward"), [k, v]
        for i in range(n):
            if i < n - 1:
                incoming = _Exchange(kv, group)          # the next block is on its way ...
            block = _block(q_pos, local_positions((r - i) % n, n, s, layout).to(q.device), causal)
            start = time.perf_counter()
            if block is not None:                        # ... while this one is computed
                rows, cols, mask = block
                _merge(out, lse, rows, *_attend(_take(q, rows), _take(kv[0], cols), _take(kv[1], cols), scale, mask))
            timer.span("compute", i, start)
            if i < n - 1:
                kv = incoming.wait(timer, i)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = causal, group, layout, scale, timeline
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, group, layout, scale, timeline = ctx.config
        n, r, s = dist.get_world_size(group), dist.get_rank(group), q.shape[-2]
        q_pos = local_positions(r, n, s, layout).to(q.device)
        dout, wide = _wide(dout), out.dtype
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        timer, kv, grads = _Timer(timeline, "backward"), [k, v], None
        for i in range(n):
            if i < n - 1:
                incoming = _Exchange(kv, group)
            block = _block(q_pos, local_positions((r - i) % n, n, s, layout).to(q.device), causal)
            start = time.perf_counter()
            dk = torch.zeros(kv[0].shape, dtype=wide, device=q.device)
            dv = torch.zeros(kv[1].shape, dtype=wide, device=q.device)
            if block is not None:
                rows, cols, mask = block
                dqb, dkb, dvb = _attend_backward(
                    _take(dout, rows), _take(q, rows), _take(kv[0], cols), _take(kv[1], cols), _take(out, rows),
                    lse if rows is None else lse.index_select(-1, rows), scale, mask)
                if rows is None:
                    dq += dqb
                else:
                    dq.index_add_(-2, rows, dqb)
                if cols is None:
                    dk, dv = dkb, dvb
                else:
                    dk.index_copy_(-2, cols, dkb), dv.index_copy_(-2, cols, dvb)
            timer.span("compute", i, start)
            if grads is not None:                        # this block's gradients from the ranks before ...
                dk_in, dv_in = grads.wait(timer, i)
                dk, dv = dk + dk_in, dv + dv_in
            grads = _Exchange([dk, dv], group)           # ... passed on with our part added
            if i < n - 1:
                kv = incoming.wait(timer, i)
        dk, dv = grads.wait(timer, n)                    # after N steps: this rank's own block, complete
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, group=None,
                   layout: str = "contiguous", scale: Optional[float] = None,
                   timeline: Optional[list] = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` over the whole sequence, each rank holding a part of it.

    ``q``, ``k``, ``v``: this rank's ``[batch, heads, seq_local, head_dim]`` (SDPA's layout), the
    positions ``layout`` gives it (``"contiguous"``: rank r holds ``r*s ... (r+1)*s - 1``;
    ``"zigzag"``: chunks r and 2N-1-r of 2N; ``sequence_layout.shard_sequence`` cuts a full
    sequence either way). Returns this rank's rows of the output. Backward gives each rank the
    gradients of its q, k and v, k's and v's summed over every rank's queries. Every rank of
    ``group`` calls it with the same shapes. ``timeline``: a list that receives this rank's
    ``(phase, kind, step, start, end)`` spans, kind "compute", "wait" or "comm".
    """
    require_process_group("ring_attention")
    if q.dim() != 4 or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        raise ValueError("ring_attention: q, k, v are [batch, heads, seq_local, head_dim] with the same batch, "
                         f"heads and sequence (k with q's head_dim), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank: seq_local ({q.shape[-2]}) must be even")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, causal, group, layout, scale, timeline)
