"""Tensor parallelism: own ParallelMLP step vs torch's parallelize_module, and bytes per block vs the formula.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_tensor_parallel.py

Options: --nprocs 2 (default; more ranks than cores measures the scheduler), --batch 8,
--seq 128, --hidden 256 (ffn 4x), --heads 8, --steps 20. CPU: gloo; with a GPU per rank,
NCCL on cuda:rank.

Step time: one step = zero_grad, forward, MSE loss, backward, SGD step of the MLP
``Linear(h, 4h) -> GELU -> Linear(4h, h)`` on ``[b, s, h]`` activations: own
``ParallelMLP`` against the same MLP given to ``parallelize_module`` with
``{"0": ColwiseParallel(), "2": RowwiseParallel()}`` on a ``DeviceMesh``, interleaved,
the slowest rank's median (target: own <= 1.3x torch's). The unsharded MLP (each rank
the whole of it) is printed for context.

Communication: the collectives of one forward and one backward, recorded by
``collective_trace`` for the own modules (shapes, so bytes) and by torch's
``CommDebugMode`` for parallelize_module (counts). Formula per transformer block:
two all-reduces of ``b*s*h`` elements forward (after attention and after the MLP) and
two backward; half of that for the MLP alone. Each all-reduce sends ``2(N-1)/N`` times
its size per rank on a ring.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from mgpu_lab import ParallelMLP, ParallelTransformerBlock, allreduce_bytes, launch, rank_device
from mgpu_lab.parallel.tensor_parallel_blocks import TransformerBlock
from mgpu_lab.measure.collective_trace import collective_trace
from mgpu_lab.measure.timing import Table, median_times, print_json


def _mlp(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))


def _torch_tp(mlp: nn.Module, device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _all_reduce_bytes(records) -> tuple:
    sizes = [torch.Size(r["shape"]).numel() * torch.empty(0, dtype=getattr(torch, r["dtype"])).element_size()
             for r in records if r["op"] == "all_reduce"]
    return len(sizes), sum(sizes)


def _communication(module, x) -> dict:
    """All-reduces (count, bytes) of one forward and of one backward of ``module`` on this rank."""
    x = x.clone().requires_grad_(True)
    with collective_trace() as fwd:
        y = module(x)
    with collective_trace() as bwd:
        y.backward(torch.ones_like(y))
    return {"forward": _all_reduce_bytes(fwd.records), "backward": _all_reduce_bytes(bwd.records)}


def _torch_counts(module, x) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode
    x = x.clone().requires_grad_(True)
    counts = {}
    for phase in ("forward", "backward"):
        mode = CommDebugMode()
        with mode:
            if phase == "forward":
                y = module(x)
            else:
                y.backward(torch.ones_like(y))
        counts[phase] = mode.get_total_counts()
    return counts


def _bench(batch, seq, hidden, heads, steps):
    device = rank_device()
    torch.manual_seed(dist.get_rank())
    x = torch.randn(batch, seq, hidden, device=device)
    y = torch.randn(batch, seq, hidden, device=device)
    full = _mlp(hidden).to(device)
    models = {"own ParallelMLP": ParallelMLP.from_mlp(full),
              "torch parallelize_module": _torch_tp(copy.deepcopy(full), device),
              "unsharded (no TP)": copy.deepcopy(full)}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}

    def step(name):
        opts[name].zero_grad(set_to_none=True)
        F.mse_loss(models[name](x), y).backward()
        opts[name].step()

    medians = median_times({name: (lambda name=name: step(name)) for name in models}, repeats=steps, warmup=3,
                           device=device, before=dist.barrier)
    times = {}
    for name, t in medians.items():
        t = torch.tensor([t], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        times[name] = t.item()
    torch.manual_seed(0)
    block = ParallelTransformerBlock.from_block(TransformerBlock(hidden, heads).to(device))
    comm = {"own ParallelMLP": _communication(models["own ParallelMLP"], x),
            "own ParallelTransformerBlock": _communication(block, x),
            "torch parallelize_module": _torch_counts(models["torch parallelize_module"], x)}
    return times, comm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    n = a.nprocs
    times, comm = launch(_bench, nprocs=n, args=(a.batch, a.seq, a.hidden, a.heads, a.steps), timeout=600)[0]
    print(f"MLP {a.hidden} -> {4 * a.hidden} -> {a.hidden} on [{a.batch}, {a.seq}, {a.hidden}] activations, "
          f"{n} ranks; median of {a.steps} steps")
    base = times["torch parallelize_module"]
    step_table = Table("median step time (the slowest rank's)", {"contender": "", "step ms": ".2f",
                                                                 "vs parallelize_module": ".2f"})
    for name, t in times.items():
        step_table.add(name, t * 1e3, t / base)
    step_table.print()

    act = a.batch * a.seq * a.hidden * 4  # bytes of one b*s*h fp32 activation
    comm_table = Table("all-reduces per step and the bytes entering them (per rank), vs the formula",
                       {"module": "", "phase": "", "all-reduces": "", "formula": "", "MB": ".3f",
                        "formula MB": ".3f", "meas/formula": ".3f", "ring MB sent/rank": ".3f"})
    worst = 0.0
    for module, per_phase in (("own ParallelMLP", 1), ("own ParallelTransformerBlock", 2),
                              ("torch parallelize_module", 1)):
        for phase in ("forward", "backward"):
            got = comm[module][phase]
            count, nbytes = got if isinstance(got, tuple) else (got, None)
            formula = per_phase * act
            ratio = nbytes / formula if nbytes is not None else None
            if ratio is not None:
                worst = max(worst, abs(ratio - 1))
            comm_table.add(module, phase, count, per_phase, nbytes / 2**20 if nbytes is not None else None,
                           formula / 2**20, ratio,
                           allreduce_bytes(nbytes // 4, 4, n) / 2**20 if nbytes is not None else None)
    comm_table.print()
    ratio = times["own ParallelMLP"] / base
    counts_match = all(comm["torch parallelize_module"][p] == comm["own ParallelMLP"][p][0]
                       for p in ("forward", "backward"))
    print(f"\nown ParallelMLP / parallelize_module: {ratio:.2f}x (target <= 1.3x): {'met' if ratio <= 1.3 else 'NOT met'}"
          f"; bytes vs formula: worst {worst * 100:.1f} % off; all-reduce counts equal torch's: {counts_match}")
    print_json("bench_tensor_parallel", [step_table, comm_table], nprocs=n, ratio_own_vs_torch=round(ratio, 3),
               worst_bytes_vs_formula=round(worst, 4), counts_match_torch=counts_match,
               target_met=ratio <= 1.3 and worst <= 0.01 and counts_match)


if __name__ == "__main__":
    main()
