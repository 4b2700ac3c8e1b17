"""OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_data_parallel.py

Two tables, measured side by side in one run:

1. Step time (forward + backward of an MLP) of mgpu_lab's DataParallel against
   the plain module, and, on GPUs, against ``torch.nn.DataParallel``. On CPU the
   2 devices are virtual: the replicas share the same cores, and PyTorch's
   autograd engine runs the whole CPU backward on the calling thread, so only
   the forward runs in parallel; the ratio shows the algorithm's overhead
   (scatter, replicate, threads, gather), not a speedup.
2. Bytes per device for a language-model head, 32k classes: batch 8 x 64
   positions x 32000 logits from a Linear(64 -> 32000): DataParallel (logits gathered
   on device 0, loss there) against DataParallelModel + DataParallelCriterion
   (loss where the logits are). Measured with ``torch.cuda.max_memory_allocated``
   on 2 GPUs or more, accounted on 2 virtual CPU devices elsewhere (one GPU has no other
   device to compare with; see ``mgpu_lab.measure.memory_account``).

Options: --repeats N (median over N timed steps, default 20), --batch B (default 256).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import mgpu_lab
from mgpu_lab import DataParallel, DataParallelCriterion, DataParallelModel
from mgpu_lab.measure.memory_account import account_memory
from mgpu_lab.measure.timing import Table, median_times, print_json


def step_times(batch, repeats):
    """Median ms per step; the contenders take turns, step by step, so they see the same machine load."""
    devs = mgpu_lab.devices(2) if not torch.cuda.is_available() else mgpu_lab.devices()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    net = net.to(devs[0])
    x = torch.randn(batch, 512, device=devs[0])
    y = torch.randint(0, 10, (batch,), device=devs[0])
    contenders = {"plain module, 1 device": net,
                  f"mgpu_lab.DataParallel, {len(devs)} devices": DataParallel(net, devs)}
    if torch.cuda.is_available():
        contenders[f"torch.nn.DataParallel, {len(devs)} devices"] = torch.nn.DataParallel(net, list(range(len(devs))))
    # device=None: synchronise every GPU, since DataParallel runs kernels on all of them
    times = median_times({name: (lambda m=model: F.cross_entropy(m(x), y).backward())
                          for name, model in contenders.items()}, repeats=repeats, warmup=3)
    return devs, [(name, t * 1e3) for name, t in times.items()]


def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def memory(devs, batch=8, seq=64, hidden=64, classes=32000):
    torch.manual_seed(0)
    head = nn.Linear(hidden, classes).to(devs[0])
    x = torch.randn(batch, seq, hidden, device=devs[0])
    y = torch.randint(0, classes, (batch, seq), device=devs[0])

    def dp():
        lm_loss(DataParallel(head, devs)(x), y).backward()

    def balanced():
        DataParallelCriterion(lm_loss, devs)(DataParallelModel(head, devs)(x), y).backward()

    for f in (dp, balanced):  # warm-up (allocator, lazy init)
        f()
    head.zero_grad(set_to_none=True)
    a = account_memory(dp, devs)
    head.zero_grad(set_to_none=True)
    b = account_memory(balanced, devs)
    return a, b


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--batch", type=int, default=256)
    args = p.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{'GPUs: ' + str(torch.cuda.device_count()) if torch.cuda.is_available() else 'CPU only (virtual devices)'}")

    devs, rows = step_times(args.batch, args.repeats)
    base = rows[0][1]
    steps = Table(f"1. Step time, MLP 512-1024-1024-10, batch {args.batch}, median of {args.repeats}",
                  {"contender": "", "ms/step": ".2f", "vs plain": ".2f"})
    for name, ms in rows:
        steps.add(name, ms, ms / base)
    steps.print()

    # one GPU has no "others" to compare device 0 with: then 2 virtual CPU devices, accounted
    a, b = memory(devs[:2] if len(devs) >= 2 else [torch.device("cpu")] * 2)
    mem = Table(f"2. Bytes per device, logits 8 x 64 x 32000 from Linear(64 -> 32000), fp32 ({a.method})",
                {"device": "", "DataParallel MiB": ".2f", "DPModel+DPCriterion MiB": ".2f"})
    for i, name in enumerate(a.devices):
        mem.add(name, a.bytes[i] / 2**20, b.bytes[i] / 2**20)
    mem.print()
    saved = 1 - b.bytes[0] / a.bytes[0]
    print(f"device 0 / mean of the others: DataParallel {a.imbalance():.2f}x, balanced {b.imbalance():.2f}x; "
          f"device 0 saves {saved * 100:.0f}%")
    print_json("bench_data_parallel", [steps, mem], imbalance_dataparallel=a.imbalance(),
               imbalance_balanced=b.imbalance(), device0_saving=saved)

if __name__ == "__main__":
    main()
