"""Ring attention vs attention on the gathered sequence: step time and peak memory per rank.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_context_parallel.py

Options: --nprocs 2,4 (each a run; more ranks than cores measures the scheduler), --seq 1024,2048
(the whole sequence S), --heads 4, --head-dim 32, --steps 5, --no-causal. CPU: gloo, fp32; with a GPU
per rank, NCCL on cuda:rank in bf16.

Each rank holds S/N positions of q, k and v ([1, heads, S/N, head_dim]). One step is a forward and a
backward (from a gradient of ones) of:

* **ring**: ``mgpu_lab.ring_attention`` (contiguous layout; and ``layout="zigzag"`` when causal);
* **gathered**: sequence parallelism's way: k and v all-gathered along the sequence
  (``gather_from_sequence_parallel_region``: all-gather forward, reduce-scatter backward), then
  ``F.scaled_dot_product_attention`` of the local queries (a fused kernel) with the causal mask
  offset to the rank's positions.

Time: the slowest rank's median, contenders interleaved. Peak memory: the most bytes alive at once
among the tensors the step creates (CPU: every storage an operator makes is counted while it is
alive, seen by a TorchDispatchMode; CUDA: ``torch.cuda.max_memory_allocated``), the fullest
rank's. Formulas (fp32 numbers per head, s = S/N, d = head_dim): the gathered step holds
the full k and v, 2·S·d, and their gradients before the reduce-scatter, 2·S·d more; the ring holds
its own q, k, v, output, two blocks in flight, and one s x s block of scores at a time.
"""
from __future__ import annotations

import argparse
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mgpu_lab import launch, rank_device, ring_attention
from mgpu_lab.measure.timing import Table, median_times, print_json, synchronize
from mgpu_lab.parallel.sequence_layout import shard_sequence
from mgpu_lab.parallel.tensor_parallel import gather_from_sequence_parallel_region


class PeakBytes(TorchDispatchMode):
    """The most bytes held at once by the storages operators made while active (CPU or GPU)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def _free(self, key, nbytes):
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                s = t.untyped_storage()
                key = (s.device, s.data_ptr())
                if s.nbytes() and key not in self.seen:
                    self.seen.add(key)
                    self.live += s.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(s, self._free, key, s.nbytes())
        return out


def _gathered(q, k, v, causal):
    """SP's attention: the whole sequence of k and v on every rank, the local queries against it."""
    rank, s = dist.get_rank(), q.shape[-2]
    k_all, v_all = (gather_from_sequence_parallel_region(t.transpose(1, 2)).transpose(1, 2) for t in (k, v))
    mask = None
    if causal:
        positions = rank * s + torch.arange(s, device=q.device)
        mask = torch.arange(k_all.shape[-2], device=q.device)[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


def _bench(seq, heads, head_dim, steps, causal):
    device = rank_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, heads, seq, head_dim, generator=g) for _ in range(3)]
    contenders = {"gathered + SDPA": ("contiguous", lambda q, k, v: _gathered(q, k, v, causal)),
                  "ring": ("contiguous", lambda q, k, v: ring_attention(q, k, v, causal=causal))}
    if causal:
        contenders["ring, zig-zag"] = ("zigzag", lambda q, k, v: ring_attention(q, k, v, causal=True, layout="zigzag"))
    inputs = {name: [shard_sequence(t, n, rank, layout).to(device, dtype).requires_grad_() for t in full]
              for name, (layout, _) in contenders.items()}

    def step(name):
        for t in inputs[name]:
            t.grad = None
        contenders[name][1](*inputs[name]).sum().backward()

    medians = median_times({name: (lambda name=name: step(name)) for name in contenders}, repeats=steps, warmup=1,
                           device=device, before=dist.barrier)
    peaks = {}
    for name in contenders:
        dist.barrier()
        synchronize(device)
        if device.type == "cuda":
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step(name)
            synchronize(device)
            peaks[name] = torch.cuda.max_memory_allocated(device) - base
        else:
            with PeakBytes() as mode:
                step(name)
            peaks[name] = mode.peak
    out = {}
    for name in contenders:
        t = torch.tensor([medians[name], peaks[name]], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace; the fullest sets the memory
        out[name] = (t[0].item(), int(t[1].item()))
    return out, str(device), str(dtype).replace("torch.", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", default="2,4")
    ap.add_argument("--seq", default="1024,2048")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-causal", action="store_true")
    a = ap.parse_args()
    causal = not a.no_causal
    table = Table(f"forward + backward of one attention layer ({a.heads} heads of {a.head_dim}, "
                  f"{'causal' if causal else 'no mask'}), the slowest / fullest rank",
                  {"N": "", "S": "", "contender": "", "step ms": ".1f", "vs gathered": ".2f", "peak MiB": ".2f",
                   "mem vs gathered": ".2f"})
    summary = {}
    for n in (int(x) for x in a.nprocs.split(",")):
        for seq in (int(x) for x in a.seq.split(",")):
            res, device, dtype = launch(_bench, nprocs=n, args=(seq, a.heads, a.head_dim, a.steps, causal),
                                        timeout=1800)[0]
            base_t, base_m = res["gathered + SDPA"]
            for name, (t, m) in res.items():
                table.add(n, seq, name, t * 1e3, t / base_t, m / 2**20, m / base_m)
            summary[f"N{n}_S{seq}"] = {name: {"time_vs_gathered": round(t / base_t, 3),
                                               "memory_vs_gathered": round(m / base_m, 3)}
                                        for name, (t, m) in res.items()}
    print(f"device {device}, {dtype}; median of {a.steps} steps")
    table.print()
    print_json("bench_context_parallel", [table], device=device, dtype=dtype, causal=causal, summary=summary)


if __name__ == "__main__":
    main()
