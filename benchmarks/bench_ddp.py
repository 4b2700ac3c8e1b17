"""Step time of NaiveDDP, BucketedDDP and torch DDP on a 20-layer MLP.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_ddp.py

Options: --nprocs N (default 2), --width (default 512), --layers (default 20),
--batch (per rank, default 64), --steps (timed steps, default 15). The backend and each rank's
device follow mgpu_lab's policy: NCCL on cuda:rank when every rank has a GPU, else gloo.

One training step = zero_grad, forward, loss, backward (each wrapper's gradient sync
ends with it, as in a loop written for torch DDP), SGD step.
Prints the median step time of each wrapper (the slowest rank's), its ratio to
torch's DistributedDataParallel measured in the same run (target: BucketedDDP
at its default 25 MB <= 1.15x torch DDP), and a no-communication baseline (each
rank trains alone), whose difference to the others is what synchronisation costs.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mgpu_lab import BucketedDDP, NaiveDDP, launch, rank_device
from mgpu_lab.measure.timing import Table, median_times, print_json


def mlp(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    body = []
    for _ in range(layers):
        body += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*body[:-1])


class _Local(nn.Module):
    """No communication at all: the floor."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def _bench(width, layers, batch, steps):
    rank = dist.get_rank()
    device = rank_device()
    torch.manual_seed(rank)
    x = torch.randn(batch, width, device=device)
    y = torch.randn(batch, width, device=device)
    makers = {
        "no communication": lambda m: _Local(m),
        "NaiveDDP": lambda m: NaiveDDP(m),
        "BucketedDDP (25 MB)": lambda m: BucketedDDP(m, bucket_cap_mb=25.0),
        "BucketedDDP (4 MB)": lambda m: BucketedDDP(m, bucket_cap_mb=4.0),
        "torch DDP (25 MB)": lambda m: DistributedDataParallel(m),
    }
    order = list(makers)
    models = {name: makers[name](mlp(width, layers).to(device)) for name in order}
    opts = {name: torch.optim.SGD(models[name].parameters(), lr=1e-3) for name in order}

    def step(name):
        model, opt = models[name], opts[name]
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    medians = median_times({name: (lambda name=name: step(name)) for name in order}, repeats=steps, warmup=1,
                           device=device, before=dist.barrier)
    out = {}
    for name in order:
        t = torch.tensor([medians[name]], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = t.item()
    buckets = {name: len(m.buckets) for name, m in models.items() if isinstance(m, BucketedDDP)}
    return out, buckets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    times, buckets = launch(_bench, nprocs=args.nprocs,
                            args=(args.width, args.layers, args.batch, args.steps), timeout=600)[0]
    n_params = sum(p.numel() for p in mlp(args.width, args.layers).parameters())
    print(f"{args.layers}-layer MLP, width {args.width}: {n_params / 1e6:.2f} M parameters, "
          f"{n_params * 4 / 2**20:.1f} MB of gradients; batch {args.batch} per rank, "
          f"{args.nprocs} processes; median of {args.steps} steps")
    base = times["torch DDP (25 MB)"]
    table = Table("median step time (the slowest rank's)", {"wrapper": "", "buckets": "", "step ms": ".1f",
                                                           "vs torch DDP": ".2f"})
    for name, t in times.items():
        table.add(name, buckets.get(name, ""), t * 1e3, t / base)
    table.print()
    ratio = times["BucketedDDP (25 MB)"] / base
    print(f"\nBucketedDDP (25 MB) / torch DDP: {ratio:.2f}x (target <= 1.15x): "
          f"{'met' if ratio <= 1.15 else 'NOT met'}")
    print_json("bench_ddp", [table], nprocs=args.nprocs, parameters=n_params, ratio_bucketed_vs_torch=ratio,
               target_met=ratio <= 1.15)

if __name__ == "__main__":
    main()
