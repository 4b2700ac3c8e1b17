"""Step time and bytes per rank: DDP, ShardedOptimizer (ZeRO-1), own FSDP, torch fully_shard.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sharding.py

Options: --nprocs 2 4 (default both), --width (default 800), --layers (default 8:
5.1 M parameters; 8 equal layers split evenly over 2 and 4 ranks), --batch (per rank, default 32), --steps (timed, default 8).
CPU: gloo; with a GPU per rank, NCCL on cuda:rank.

One step = zero_grad, forward, loss, backward, gradient sync, AdamW step; the
figure is the median over steps of the slowest rank's time. Bytes per rank are
measured after a step: every storage held by the parameters, their gradients
and the optimizer state on that rank (each storage once; DTensors by their local
shard), against the ZeRO formulas for fp32 AdamW (4 + 4 + 8 bytes per parameter,
no master copy): DDP 16Ψ, ZeRO-1 (8 + 8/N)Ψ, ZeRO-3 16Ψ/N (+ padding). Targets:
own FSDP <= 1.3x torch fully_shard's step time; bytes within 10 % of the formula.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mgpu_lab import FSDP, ShardedOptimizer, launch, rank_device, zero_bytes_per_rank

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
    out = {}
    for kind in KINDS:
        model, opt, params = _make(kind, width, layers, device)
        times = []
        for i in range(steps + 2):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if hasattr(model, "finish_gradient_synchronization"):
                model.finish_gradient_synchronization()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            if i >= 2:
                times.append(dt.item())
        held = torch.tensor(float(held_bytes(params, opt)))
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        out[kind] = dict(step_s=statistics.median(times), bytes=int(held.item()))
        del model, opt, params
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
    rows = []
    print(f"model: {a.layers} x Linear({a.width}, {a.width}), {psi / 1e6:.2f} M parameters, "
          f"batch {a.batch} per rank, AdamW fp32")
    print(f"{'N':>2} {'wrapper':<18} {'step ms':>8} {'vs fully_shard':>14} {'MB/rank':>8} "
          f"{'formula MB':>10} {'meas/formula':>12}")
    for n in a.nprocs:
        res = launch(_bench, nprocs=n, args=(a.width, a.layers, a.batch, a.steps), timeout=600)[0]
        base = res["torch fully_shard"]["step_s"]
        for kind in KINDS:
            r = res[kind]
            formula = zero_bytes_per_rank(psi, n, formula_stage[kind], 4, 4, 8)
            row = dict(nprocs=n, wrapper=kind, step_ms=round(r["step_s"] * 1e3, 2),
                       vs_fully_shard=round(r["step_s"] / base, 3), bytes_per_rank=r["bytes"],
                       formula_bytes=int(formula), measured_over_formula=round(r["bytes"] / formula, 4))
            rows.append(row)
            print(f"{n:>2} {kind:<18} {row['step_ms']:>8.1f} {row['vs_fully_shard']:>13.2f}x "
                  f"{r['bytes'] / 2**20:>8.2f} {formula / 2**20:>10.2f} {row['measured_over_formula']:>12.3f}")
    own = [r["vs_fully_shard"] for r in rows if r["wrapper"] == "own FSDP"]
    mem = [abs(r["measured_over_formula"] - 1) for r in rows]
    print(f"target own FSDP <= 1.3x fully_shard: {'met' if max(own) <= 1.3 else 'NOT met'} "
          f"(worst {max(own):.2f}x); bytes within 10 % of the formula: "
          f"{'met' if max(mem) <= 0.10 else 'NOT met'} (worst {max(mem) * 100:.1f} %)")
    print(json.dumps({"benchmark": "sharding", "params": psi, "rows": rows}))


if __name__ == "__main__":
    main()
