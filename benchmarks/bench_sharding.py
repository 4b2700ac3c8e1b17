"""Step time and bytes per rank: DDP, ShardedOptimizer (ZeRO-1), own FSDP, torch fully_shard.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sharding.py

Options: --nprocs 2 4 (default both), --width (default 800), --layers (default 8:
5.1 M parameters; 8 equal layers split evenly over 2 and 4 ranks), --batch (per rank, default 32), --steps (timed, default 8).
CPU: gloo; with a GPU per rank, NCCL on cuda:rank.

One step = zero_grad, forward, loss, backward (gradient sync ends with it), AdamW step; the four
wrappers take turns step by step (interleaved), and the figure is the slowest rank's
median step time. Bytes per rank are
measured after a step: every storage held by the parameters, their gradients
and the optimizer state on that rank (each storage once; DTensors by their local
shard), against the ZeRO formulas for fp32 AdamW (4 + 4 + 8 bytes per parameter,
no master copy): DDP 16Ψ, ZeRO-1 (8 + 8/N)Ψ, ZeRO-3 16Ψ/N (+ padding). Targets:
own FSDP <= 1.3x torch fully_shard's step time; bytes within 10 % of the formula.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mgpu_lab import FSDP, ShardedOptimizer, launch, rank_device
from mgpu_lab.parallel.sharding import zero_bytes_per_rank
from mgpu_lab.measure.timing import Table, median_times, print_json

LR = 1e-3


def mlp(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    body = []
    for _ in range(layers):
        body += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*body[:-1])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(params, optimizer) -> int:
    """Bytes of the distinct storages behind params, their grads and the optimizer state."""
    seen, total = set(), 0
    tensors = []
    for p in params:
        tensors.append(_local(p.detach()))
        if p.grad is not None:
            tensors.append(_local(p.grad))
    for state in optimizer.state.values():
        tensors += [_local(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _make(kind: str, width: int, layers: int, device):
    model = mlp(width, layers).to(device)
    if kind == "DDP":
        model = DistributedDataParallel(model)
        return model, torch.optim.AdamW(model.parameters(), lr=LR), list(model.parameters())
    if kind == "ShardedOptimizer":
        model = DistributedDataParallel(model)
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR), list(model.parameters())
    if kind == "own FSDP":
        model = FSDP(model, units=[m for m in model if isinstance(m, nn.Linear)])
        return model, torch.optim.AdamW(model.parameters(), lr=LR), list(model.parameters())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR), list(model.parameters())


KINDS = ("DDP", "ShardedOptimizer", "own FSDP", "torch fully_shard")


def _bench(width, layers, batch, steps):
    device = rank_device()
    torch.manual_seed(dist.get_rank())
    x = torch.randn(batch, width, device=device)
    y = torch.randn(batch, width, device=device)
    made = {kind: _make(kind, width, layers, device) for kind in KINDS}

    def step(kind):
        model, opt, _ = made[kind]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()  # every wrapper's gradients are ready when it returns
        opt.step()

    medians = median_times({kind: (lambda kind=kind: step(kind)) for kind in KINDS}, repeats=steps, warmup=2,
                           device=device, before=dist.barrier)
    out = {}
    for kind in KINDS:
        _, opt, params = made[kind]
        t = torch.tensor([medians[kind], float(held_bytes(params, opt))], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace; the fullest rank's bytes
        out[kind] = dict(step_s=t[0].item(), bytes=int(t[1].item()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--width", type=int, default=800)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    psi = sum(p.numel() for p in mlp(a.width, a.layers).parameters())
    formula_stage = {"DDP": 0, "ShardedOptimizer": 1, "own FSDP": 3, "torch fully_shard": 3}
    print(f"model: {a.layers} x Linear({a.width}, {a.width}), {psi / 1e6:.2f} M parameters, "
          f"batch {a.batch} per rank, AdamW fp32; median of {a.steps} steps")
    table = Table("median step time (the slowest rank's) and bytes per rank",
                  {"wrapper": "", "N": "", "step ms": ".1f", "vs fully_shard": ".2f", "MB/rank": ".2f",
                   "formula MB": ".2f", "meas/formula": ".3f"})
    own, mem = [], []
    for n in a.nprocs:
        res = launch(_bench, nprocs=n, args=(a.width, a.layers, a.batch, a.steps), timeout=600)[0]
        base = res["torch fully_shard"]["step_s"]
        for kind in KINDS:
            r = res[kind]
            formula = zero_bytes_per_rank(psi, n, formula_stage[kind], 4, 4, 8)
            table.add(kind, n, r["step_s"] * 1e3, r["step_s"] / base, r["bytes"] / 2**20, formula / 2**20,
                      r["bytes"] / formula)
            if kind == "own FSDP":
                own.append(r["step_s"] / base)
            mem.append(abs(r["bytes"] / formula - 1))
    table.print()
    print(f"target own FSDP <= 1.3x fully_shard: {'met' if max(own) <= 1.3 else 'NOT met'} "
          f"(worst {max(own):.2f}x); bytes within 10 % of the formula: "
          f"{'met' if max(mem) <= 0.10 else 'NOT met'} (worst {max(mem) * 100:.1f} %)")
    print_json("bench_sharding", [table], params=psi, worst_own_fsdp_vs_fully_shard=round(max(own), 3),
               worst_bytes_vs_formula=round(max(mem), 4), target_met=max(own) <= 1.3 and max(mem) <= 0.10)


if __name__ == "__main__":
    main()
