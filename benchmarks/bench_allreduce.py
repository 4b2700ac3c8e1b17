"""Hand-written ring all-reduce vs dist.all_reduce, 4 KB to 64 MB.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_allreduce.py

Options: --nprocs N (default 2), --min-kb / --max-mb, --seconds (time budget per
size and algorithm). The backend and each rank's device follow
mgpu_lab's policy: NCCL on cuda:rank when every rank has a GPU, else gloo.

Prints, per size: the median time of ``mgpu_lab.ring_allreduce`` and of
``dist.all_reduce`` (the calls interleaved: ring, torch, PS, ring, ...; every
call starts together on all ranks), their ratio (target: ring <= 1.2x at every
size from 1 MB to 64 MB), and for each
the algorithm bandwidth (algBw = S / t) and bus bandwidth (busBw = algBw ·
2(N-1)/N), as nccl-tests define them. Also the parameter server
(``naive_allreduce``; columns "PS") for contrast, and the bytes each rank sent per call.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mgpu_lab import backend, launch, naive_allreduce, rank_device, ring_allreduce
from mgpu_lab.parallel.collectives import bus_bandwidth
from mgpu_lab.measure.timing import Table, median_times, print_json


def _time(fns, tensor, seconds: float, device):
    """Median seconds per call of each fn (the slowest rank's); every call starts together on all ranks.

    The number of calls is fixed from a warm-up round (the slowest rank's), so
    every rank runs the same collectives in the same order.
    """
    steps = {str(i): (lambda fn=fn: fn(tensor)) for i, fn in enumerate(fns)}
    first = torch.tensor([sum(median_times(steps, repeats=1, warmup=1, device=device,
                                           before=dist.barrier).values())], dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    calls = int(min(100, max(9, seconds / max(first.item(), 1e-6))))
    medians = median_times(steps, repeats=calls, warmup=0, device=device, before=dist.barrier)
    t = torch.tensor(list(medians.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's median is the collective's time
    return t.tolist()


def _bench(sizes, seconds):
    device = rank_device()
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
    print(f"all-reduce of float32, {world} processes ({backend(world)}); median time; bandwidth in GB/s (1e9 B/s)")
    table = Table("ring all-reduce vs dist.all_reduce vs a parameter server (PS)",
                  {"size": "", "ring ms": ".3f", "ring algBw": ".2f", "ring busBw": ".2f", "torch ms": ".3f",
                   "torch algBw": ".2f", "torch busBw": ".2f", "ring/torch": ".2f", "PS ms": ".3f",
                   "PS/ring": ".2f", "ring B/rank": "d", "PS B/root": "d"})
    for nbytes, t_ring, t_torch, t_ps, ring_sent, ps_sent in rows:
        ra, rb = bus_bandwidth(nbytes, t_ring, world)
        ta, tb = bus_bandwidth(nbytes, t_torch, world)
        table.add(_fmt_size(nbytes), t_ring * 1e3, ra / 1e9, rb / 1e9, t_torch * 1e3, ta / 1e9, tb / 1e9,
                  t_ring / t_torch, t_ps * 1e3, t_ps / t_ring, ring_sent, ps_sent)
    table.print()
    summary = {}
    big = [(nbytes, t_ring / t_torch) for nbytes, t_ring, t_torch, *_ in rows if 2**20 <= nbytes <= 64 * 2**20]
    if big:
        nbytes, worst = max(big, key=lambda r: r[1])
        print(f"\nring / dist.all_reduce, worst from 1 MB to 64 MB: {worst:.2f}x at {_fmt_size(nbytes)} "
              f"(target <= 1.2x): {'met' if worst <= 1.2 else 'NOT met'}")
        summary = {"worst_ratio_ring_vs_torch_1MB_64MB": worst, "target_met": worst <= 1.2}
    print_json("bench_allreduce", [table], nprocs=world, **summary)

if __name__ == "__main__":
    main()
