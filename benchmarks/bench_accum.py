"""Gradient accumulation: no_sync vs an all-reduce on every micro-step; activation memory of B vs k x B/k.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_accum.py

Options: --nprocs N (default 2), --width (default 1024), --layers (default 5:
5.25 M parameters), --micro (micro-batch per rank, default 8), --k (default 4),
--steps (timed windows, default 10). CPU: gloo; with GPUs, NCCL on cuda:rank.

(a) One window = k micro-batches of forward+backward through torch's
DistributedDataParallel, then one SGD step, driven by mgpu_lab's
GradientAccumulator: inside ``acc.micro_step()`` (no_sync on the first k-1
micro-steps: gradients are all-reduced once per window) or without it (DDP
all-reduces them on every micro-step: k times). DDP sends gradients in buckets
(a 1 MB first bucket, then 25 MB ones: 2 messages for this model); the bucket
all-reduces are counted with a DDP comm hook;
window time is the median over --steps windows of the slowest rank, both
variants interleaved in one run. Target: no_sync / every-step <= 0.9.

(b) Memory: the bytes autograd saves for backward (a saved-tensors hook, CPU
and GPU) for one batch of B = k x micro vs the largest of its k micro-batches,
and on CUDA the peak allocated memory of each.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from mgpu_lab import GradientAccumulator, launch, rank_device
from mgpu_lab.measure.timing import Table, median_times, print_json


def mlp(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    body = []
    for _ in range(layers):
        body += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*body[:-1])


def saved_bytes(fn, params=()) -> int:
    """Bytes of the distinct tensors autograd saves for backward while ``fn()`` runs,
    not counting the parameters (saved too, but alive anyway): the activations."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key[0] not in skip:
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _bench(width, layers, micro, k, steps):
    rank = dist.get_rank()
    device = rank_device()
    torch.manual_seed(rank)
    xs = [torch.randn(micro, width, device=device) for _ in range(k)]
    ys = [torch.randn(micro, width, device=device) for _ in range(k)]
    variants = ("no_sync (micro_step)", "all-reduce every micro-step")
    accs, counts = {}, {}
    for v in variants:
        model = DistributedDataParallel(mlp(width, layers).to(device))
        counts[v] = [0]

        def hook(state, bucket, c=counts[v]):
            c[0] += 1
            return allreduce_hook(None, bucket)
        model.register_comm_hook(None, hook)
        accs[v] = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=1e-3), k)

    def window(v):
        acc = accs[v]
        for x, y in zip(xs, ys):
            if v.startswith("no_sync"):
                with acc.micro_step():
                    acc.backward(nn.functional.mse_loss(acc.model(x), y), len(x))
            else:
                acc.backward(nn.functional.mse_loss(acc.model(x), y), len(x))

    # warm-up here, not in median_times: the all-reduce count starts after it
    for v in variants:  # (DDP rebuilds its buckets after the first step)
        window(v)
        window(v)
    for v in variants:
        counts[v][0] = 0
    medians = median_times({v: (lambda v=v: window(v)) for v in variants}, repeats=steps, warmup=0,
                           device=device, before=dist.barrier)
    out = {}
    for v in variants:
        t = torch.tensor([medians[v]], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[v] = dict(seconds=t.item(), allreduces_per_window=counts[v][0] / steps)
    return out


def _memory(width, layers, micro, k):
    device = rank_device() if dist.is_initialized() else torch.device("cpu")
    model = mlp(width, layers).to(device)
    torch.manual_seed(1)
    x, y = torch.randn(k * micro, width, device=device), torch.randn(k * micro, width, device=device)

    def big():
        nn.functional.mse_loss(model(x), y).backward()

    def one_micro(i):
        xi, yi = x[i::k].clone(), y[i::k].clone()
        return lambda: nn.functional.mse_loss(model(xi), yi).backward()
    params = list(model.parameters())
    res = {"saved B": saved_bytes(big, params),
           "saved B/k": max(saved_bytes(one_micro(i), params) for i in range(k))}
    if device.type == "cuda":
        for name, fns in (("peak B", [big]), ("peak k x B/k", [one_micro(i) for i in range(k)])):
            model.zero_grad(set_to_none=False)
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            for fn in fns:
                fn()
            torch.cuda.synchronize(device)
            res[name] = torch.cuda.max_memory_allocated(device) - base
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    n_params = sum(p.numel() for p in mlp(args.width, args.layers).parameters())
    res = launch(_bench, nprocs=args.nprocs, args=(args.width, args.layers, args.micro, args.k, args.steps),
                 timeout=600)[0]
    mem = launch(_memory, nprocs=1, args=(args.width, args.layers, args.micro, args.k), timeout=600)[0]
    print(f"{args.layers}-layer MLP, width {args.width}: {n_params / 1e6:.2f} M parameters, "
          f"{n_params * 4 / 2**20:.1f} MB of gradients; k = {args.k} micro-batches of {args.micro} per rank, "
          f"{args.nprocs} processes (torch DDP); median of {args.steps} windows")
    base = res["all-reduce every micro-step"]["seconds"]
    table = Table("window time (the slowest rank's)", {"variant": "", "bucket all-reduces/window": ".1f",
                                                        "window ms": ".1f", "vs every-step": ".2f"})
    for v, r in res.items():
        table.add(v, r["allreduces_per_window"], r["seconds"] * 1e3, r["seconds"] / base)
    table.print()
    ratio = res["no_sync (micro_step)"]["seconds"] / base
    print(f"\nno_sync / every-step: {ratio:.2f}x (target <= 0.9): {'met' if ratio <= 0.9 else 'NOT met'}")
    memory = Table(f"activation memory, batch B = {args.k * args.micro} vs micro-batch B/k = {args.micro}",
                   {"measure": "", "MiB": ".2f"})
    for name, b in mem.items():
        memory.add(name, b / 2**20)
    memory.print()
    print(f"saved B / saved B/k = {mem['saved B'] / mem['saved B/k']:.2f} (k = {args.k})")
    print_json("bench_accum", [table, memory], params_m=round(n_params / 1e6, 2), k=args.k, nprocs=args.nprocs,
               ratio_no_sync_vs_every_step=round(ratio, 3), target_met=ratio <= 0.9, memory_bytes=mem)

if __name__ == "__main__":
    main()
