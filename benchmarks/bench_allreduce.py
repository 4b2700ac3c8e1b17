"""Hand-written ring all-reduce vs dist.all_reduce, 4 KB to 64 MB.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_allreduce.py

Options: --nprocs N (default 2), --min-kb / --max-mb, --seconds (time budget per
size and algorithm). On CPU this runs gloo; with GPUs, NCCL on cuda:rank.

Prints, per size: the median time of ``mgpu_lab.ring_allreduce`` and of
``dist.all_reduce``, their ratio (target: ring <= 1.5x at 16 MB), and for each
the algorithm bandwidth (algBw = S / t) and bus bandwidth (busBw = algBw ·
2(N-1)/N), as nccl-tests define them. Also the parameter server
(``naive_allreduce``; columns "PS") for contrast, and the bytes each rank sent per call.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from mgpu_lab import bus_bandwidth, devices, launch, naive_allreduce, ring_allreduce


def _time(fns, tensor, seconds: float, device):
    """Median seconds per call of each fn; every call starts together on all ranks.

    The calls are interleaved (ring, torch, ring, torch, ...) so that drifting
    load on a shared machine hits every algorithm alike. The number of calls is
    fixed from a warm-up round (the slowest rank's), so every rank runs the same
    collectives in the same order.
    """
    def once(fn) -> float:
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    for fn in fns:
        once(fn)  # warm-up (connections, allocations)
    first = torch.tensor([sum(once(fn) for fn in fns)], dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    calls = int(min(100, max(5, seconds / max(first.item(), 1e-6))))
    times = [[] for _ in fns]
    for _ in range(calls):
        for i, fn in enumerate(fns):
            times[i].append(once(fn))
    t = torch.tensor([statistics.median(ts) for ts in times], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's median is the collective's time
    return t.tolist()


def _bench(sizes, seconds):
    rank, world = dist.get_rank(), dist.get_world_size()
    device = devices(world)[rank]
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        ring_sent = ring_allreduce(x.clone()).bytes_sent
        ps_sent = naive_allreduce(x.clone()).bytes_sent
        t_ring, t_torch, t_ps = _time([ring_allreduce, dist.all_reduce, naive_allreduce], x, seconds, device)
        rows.append((nbytes, t_ring, t_torch, t_ps, ring_sent, ps_sent))
    return rows


def _fmt_size(n: int) -> str:
    return f"{n // 2**20} MB" if n >= 2**20 else f"{n // 2**10} KB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--min-kb", type=int, default=4)
    parser.add_argument("--max-mb", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    sizes, n = [], args.min_kb * 2**10
    while n <= args.max_mb * 2**20:
        sizes.append(n)
        n *= 4
    rows = launch(_bench, nprocs=args.nprocs, args=(sizes, args.seconds), timeout=600)[0]
    world = args.nprocs
    print(f"all-reduce of float32, {world} processes ({dist.Backend.NCCL if torch.cuda.is_available() else 'gloo'}); "
          "median time; bandwidth in GB/s (1e9 B/s)")
    head = (f"{'size':>7} | {'ring ms':>8} {'algBw':>6} {'busBw':>6} | {'torch ms':>8} {'algBw':>6} "
            f"{'busBw':>6} | {'ring/torch':>10} | {'PS ms':>8} {'PS/ring':>7} | {'ring B/rank':>11} {'PS B/root':>10}")
    print(head)
    print("-" * len(head))
    for nbytes, t_ring, t_torch, t_ps, ring_sent, ps_sent in rows:
        ra, rb = bus_bandwidth(nbytes, t_ring, world)
        ta, tb = bus_bandwidth(nbytes, t_torch, world)
        print(f"{_fmt_size(nbytes):>7} | {t_ring * 1e3:8.3f} {ra / 1e9:6.2f} {rb / 1e9:6.2f} | "
              f"{t_torch * 1e3:8.3f} {ta / 1e9:6.2f} {tb / 1e9:6.2f} | {t_ring / t_torch:9.2f}x | "
              f"{t_ps * 1e3:8.3f} {t_ps / t_ring:6.2f}x | {ring_sent:11d} {ps_sent:10d}")
    at16 = [r for r in rows if r[0] == 16 * 2**20]
    if at16:
        ratio = at16[0][1] / at16[0][2]
        print(f"\nring / dist.all_reduce at 16 MB: {ratio:.2f}x (target <= 1.5x): "
              f"{'met' if ratio <= 1.5 else 'NOT met'}")


if __name__ == "__main__":
    main()
