"""What fault tolerance costs: an atomic checkpoint vs torch.save, a traced collective vs an untraced one.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_faults.py

Options: --mb (checkpoint size in MiB, default 64), --repeats (default 5),
--calls (all-reduces per measurement, default 300), --numel (elements per
all-reduce, default 1024).

(a) ``save_checkpoint`` (temporary file, fsync, rename, fsync the folder) against
a plain ``torch.save`` of the same state to the same folder: the median of
``--repeats`` saves each, and the ratio. The fsync is most of the difference: it
waits for the disk, where ``torch.save`` returns once the page cache has the bytes.
(b) one small all-reduce on 2 gloo ranks, untraced and inside
``collective_trace(timeout=...)``: the median time per call (the slowest rank's)
and the ratio; the trace adds 1 + 2(N-1) store round trips per call. No
target: both are prices paid on purpose (a checkpoint costs what the disk
costs; the trace is switched on while hunting a hang), measured so you know them.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

from mgpu_lab import collective_trace, launch, save_checkpoint
from mgpu_lab.measure.timing import Table, median_time, median_times, print_json


def bench_save(mb: int, repeats: int):
    state = {"weights": torch.randn(mb * 2 ** 20 // 4), "step": 1}
    folder = tempfile.mkdtemp(prefix="bench_faults_")
    times = median_times({"torch.save": lambda: torch.save(state, os.path.join(folder, "plain.pt")),
                          "save_checkpoint": lambda: save_checkpoint(os.path.join(folder, "atomic.pt"), **state)},
                         repeats=repeats, warmup=0)
    for name in ("plain.pt", "atomic.pt"):
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)
    return times["torch.save"], times["save_checkpoint"]


def _allreduce_times(calls: int, numel: int):
    x = torch.ones(numel)

    def calls_in_a_row():
        for _ in range(calls):
            dist.all_reduce(x)

    plain = median_time(calls_in_a_row, repeats=3, warmup=0, before=dist.barrier) / calls
    with collective_trace(timeout=60):
        traced = median_time(calls_in_a_row, repeats=3, warmup=0, before=dist.barrier) / calls
    return plain, traced


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--numel", type=int, default=1024)
    args = parser.parse_args()

    plain_save, atomic_save = bench_save(args.mb, args.repeats)
    ranks = launch(_allreduce_times, nprocs=2, args=(args.calls, args.numel), timeout=300)
    plain_ar = max(r[0] for r in ranks)
    traced_ar = max(r[1] for r in ranks)

    table = Table("what fault tolerance costs", {"measurement": "", "unit": "", "baseline": ".1f", "ours": ".1f",
                                                 "ratio": ".2f"})
    table.add(f"save {args.mb} MiB: torch.save vs save_checkpoint", "ms", plain_save * 1e3, atomic_save * 1e3,
              atomic_save / plain_save)
    table.add(f"all_reduce({args.numel}) x2 ranks: untraced vs traced", "us", plain_ar * 1e6, traced_ar * 1e6,
              traced_ar / plain_ar)
    table.print()
    print_json("bench_faults", [table], save_mb=args.mb, torch_save_s=round(plain_save, 4),
               save_checkpoint_s=round(atomic_save, 4), save_ratio=round(atomic_save / plain_save, 3),
               allreduce_numel=args.numel, untraced_us=round(plain_ar * 1e6, 1), traced_us=round(traced_ar * 1e6, 1),
               trace_overhead_us=round((traced_ar - plain_ar) * 1e6, 1), trace_ratio=round(traced_ar / plain_ar, 3),
               device="cpu/gloo")


if __name__ == "__main__":
    main()
