"""Pipeline parallelism: own 1F1B and interleaved 1F1B vs torch's, and the bubble measured against the formulas.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_pipeline.py

Options: --stages 2 (default; one rank per core: more stages than cores measures the
scheduler), --width 512, --layers 2 (per stage), --microbatch 64 (rows per
micro-batch), --m 8 (micro-batches for the step-time comparison), --bubble-m 1 2 4 8,
--forward-ms 100 (0: the bubble of the matmul stages), --steps 10 (step time),
--bubble-steps 3. CPU: gloo; with a GPU per rank, NCCL on cuda:rank.

Step time: each stage is ``layers`` x (Linear(w, 4w) -> ReLU -> Linear(4w, w)); one
step = zero_grad, ``schedule.step`` (forward and backward of every
micro-batch, MSE loss on the last stage), SGD step; own ``Schedule1F1B`` and torch's
``torch.distributed.pipelining.Schedule1F1B`` on the same stages and batch, interleaved,
the slowest rank's median (target: own <= 1.3x torch's); the same for
``ScheduleInterleaved1F1B``, each rank two stages of half the layers (rank r: stages r, r + p).

Bubble: the formula assumes equal stages whose compute dwarfs the messages. Matmuls
on a shared CPU are neither (the ranks slow each other down, a busy machine stretches
any of them), so by default each stage is a ``FixedTimeStage``: a Linear whose forward
takes ``--forward-ms`` and backward twice that, a device of known speed. For each m
(the micro-batch size fixed, so each action costs the same) every stage records the
(start, end) of each forward and backward it ran (``stage.spans``). The step lasts T,
from the common start (after a barrier) to the last stage's end; a stage is idle for
``1 - busy/T`` of it. The figure is the mean over stages, median over steps, against
``(p-1)/(m+p-1)`` (target: within 10 % of it, relative); interleaved, two half stages
per rank (forward ``--forward-ms``/2 each), against ``(p-1)/(2m+p-1)`` (m >= p), with the
micro-batches each rank held at most (``held_microbatches`` of its order: half stages,
against 1F1B's whole ones). What the formula leaves out
adds to the measured bubble: the latency of each message on the critical path (about
2m of them per step; the one-way latency, measured by a ping-pong, is printed), and
any delay of a stage's compute (a sleep that a busy machine wakes late).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from mgpu_lab import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, launch, rank_device
from mgpu_lab.parallel.pipeline import held_microbatches
from mgpu_lab.measure.timing import Table, median_times, print_json


def _stage_module(width: int, layers: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    body = []
    for _ in range(layers):
        body += [nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*body)


class _FixedTime(torch.autograd.Function):
    """Identity that takes ``forward_s`` seconds forward and ``backward_s`` backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class FixedTimeStage(nn.Module):
    """A stage whose compute takes a fixed time (forward ``forward_s``, backward twice
    that), whatever else runs on the machine: a device with a known speed."""

    def __init__(self, width: int, forward_s: float):
        super().__init__()
        self.linear, self.forward_s = nn.Linear(width, width), forward_s

    def forward(self, x):
        return _FixedTime.apply(self.linear(x), self.forward_s, 2 * self.forward_s)


def _step_fn(schedule, opt, x, y):
    def step():
        opt.zero_grad(set_to_none=True)
        schedule.step(x, target=y)     # the stages that do not need the batch or the target ignore them
        opt.step()
    return step


def _latency(repeats: int = 50) -> float:
    """Median one-way time of a 1-element message between stages 0 and 1 (ping-pong / 2)."""
    t, times = torch.zeros(1, device=rank_device()), []
    for _ in range(repeats):
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif dist.get_rank() == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def _bench(width, layers, rows, m, bubble_ms, forward_ms, steps, bubble_steps):
    from torch.distributed import pipelining
    rank, p, device = dist.get_rank(), dist.get_world_size(), rank_device()
    module = _stage_module(width, layers, seed=rank).to(device)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(m * rows, width, generator=g).to(device), torch.randn(m * rows, width, generator=g).to(device)

    own_module, torch_module = copy.deepcopy(module), copy.deepcopy(module)
    own = Schedule1F1B(PipelineStage(own_module, rank, p), m, F.mse_loss)
    theirs = pipelining.Schedule1F1B(pipelining.PipelineStage(torch_module, rank, p, device), m, F.mse_loss)
    steps_by_name = {"own Schedule1F1B": _step_fn(own, torch.optim.SGD(own_module.parameters(), lr=1e-4), x, y),
                     "torch Schedule1F1B": _step_fn(theirs, torch.optim.SGD(torch_module.parameters(), lr=1e-4), x, y)}
    # interleaved: two stages of half the layers per rank (rank r runs stages r and r + p of 2p)
    halves = {s: _stage_module(width, max(1, layers // 2), seed=s).to(device) for s in (rank, rank + p)}
    own_halves, torch_halves = copy.deepcopy(halves), copy.deepcopy(halves)
    own_i = ScheduleInterleaved1F1B([PipelineStage(mod, s, 2 * p) for s, mod in own_halves.items()], m, F.mse_loss)
    theirs_i = pipelining.ScheduleInterleaved1F1B(
        [pipelining.PipelineStage(mod, s, 2 * p, device) for s, mod in torch_halves.items()], m, F.mse_loss)
    for name, schedule, mods in (("own ScheduleInterleaved1F1B", own_i, own_halves),
                                 ("torch ScheduleInterleaved1F1B", theirs_i, torch_halves)):
        params = [q for mod in mods.values() for q in mod.parameters()]
        steps_by_name[name] = _step_fn(schedule, torch.optim.SGD(params, lr=1e-4), x, y)
    medians = median_times(steps_by_name, repeats=steps, warmup=2, device=device, before=dist.barrier)
    times = {}
    for name, t in medians.items():
        t = torch.tensor([t], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = t.item()

    # the bubble: spans of every action, the step's common start and end
    bubble, held = {}, {}
    if forward_ms:
        module = FixedTimeStage(width, forward_ms / 1e3).to(device)
        halves = {s: FixedTimeStage(width, forward_ms / 2e3).to(device) for s in (rank, rank + p)}
    for name, cls in (("1F1B", Schedule1F1B), ("GPipe", ScheduleGPipe), ("Interleaved1F1B", ScheduleInterleaved1F1B)):
        for mb in bubble_ms:
            if cls is ScheduleInterleaved1F1B:
                if mb < p:        # the formula (p-1)/(2m+p-1) needs m >= p
                    continue
                stages = [PipelineStage(mod, s, 2 * p) for s, mod in halves.items()]
                schedule, params = cls(stages, mb, F.mse_loss), [q for mod in halves.values() for q in mod.parameters()]
            else:
                stages = [PipelineStage(module, rank, p)]
                schedule, params = cls(stages[0], mb, F.mse_loss), list(module.parameters())
            bx, by = x[:rows].repeat(mb, 1), y[:rows].repeat(mb, 1)
            step = _step_fn(schedule, torch.optim.SGD(params, lr=0.0), bx, by)
            records = []
            for i in range(bubble_steps + 1):
                dist.barrier()
                start = time.perf_counter()
                step()
                end = time.perf_counter()
                busy = sum(b - a for stage in stages for a, b in stage.spans)
                if i:  # the first step warms up
                    records.append((start, end, busy))
            bubble[(name, mb)] = records
            held[(name, mb)] = held_microbatches(schedule.timeline)
    return times, bubble, _latency(), held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--microbatch", type=int, default=64)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--bubble-m", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--forward-ms", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bubble-steps", type=int, default=3)
    a = ap.parse_args()
    p = a.stages
    results = launch(_bench, nprocs=p, timeout=600, args=(a.width, a.layers, a.microbatch, a.m, a.bubble_m,
                                                          a.forward_ms, a.steps, a.bubble_steps))
    times = results[0][0]
    print(f"{p} stages, each {a.layers} x (Linear({a.width}, {4 * a.width}) -> ReLU -> Linear({4 * a.width}, "
          f"{a.width})); micro-batches of {a.microbatch} rows; median of {a.steps} steps "
          f"(bubble: of {a.bubble_steps})")
    base = times["torch Schedule1F1B"]
    step_table = Table(f"median step time, m = {a.m} (the slowest rank's)",
                       {"schedule": "", "step ms": ".1f", "vs torch": ".2f"})
    for name, t in times.items():
        torch_name = "torch " + name.split()[-1]
        step_table.add(name, t * 1e3, t / times[torch_name])
    step_table.print()

    stages = (f"FixedTimeStage: forward {a.forward_ms:g} ms, backward {2 * a.forward_ms:g} ms" if a.forward_ms
              else "the matmul stages above")
    bubble_table = Table(f"bubble fraction ({stages}): measured (idle / step time, mean over ranks) "
                         f"vs (p-1)/(m+p-1), interleaved (p-1)/(2m+p-1); micro-batches held by rank 0 "
                         f"(interleaved: half stages)",
                         {"schedule": "", "m": "", "step ms": ".1f", "measured": ".4f", "formula": ".4f",
                          "meas/formula": ".3f", "held": ""})
    worst = 0.0
    for (name, mb) in results[0][1]:
        per_step = []
        step_ms = []
        for i in range(a.bubble_steps):
            recs = [r[1][(name, mb)][i] for r in results]
            total = max(e for _, e, _ in recs) - min(s for s, _, _ in recs)
            per_step.append(statistics.mean(1 - busy / total for _, _, busy in recs))
            step_ms.append(total * 1e3)
        v = 2 if name == "Interleaved1F1B" else 1
        measured, formula = statistics.median(per_step), (p - 1) / (v * mb + p - 1)
        worst = max(worst, abs(measured / formula - 1))
        bubble_table.add(name, mb, statistics.median(step_ms), measured, formula, measured / formula,
                         results[0][3][(name, mb)])
    bubble_table.print()
    ratio = times["own Schedule1F1B"] / base
    ratio_i = times["own ScheduleInterleaved1F1B"] / times["torch ScheduleInterleaved1F1B"]
    latency = results[0][2]
    print(f"one-way message latency (ping-pong / 2, median): {latency * 1e3:.2f} ms")
    print(f"\nown ScheduleInterleaved1F1B / torch's: {ratio_i:.2f}x (target <= 1.3x): "
          f"{'met' if ratio_i <= 1.3 else 'NOT met'}")
    print(f"own Schedule1F1B / torch's: {ratio:.2f}x (target <= 1.3x): {'met' if ratio <= 1.3 else 'NOT met'}; "
          f"bubble within 10 % of the formula: {'met' if worst <= 0.10 else 'NOT met'} (worst {worst * 100:.1f} %)")
    print_json("bench_pipeline", [step_table, bubble_table], stages=p, ratio_own_vs_torch=round(ratio, 3),
               ratio_interleaved_own_vs_torch=round(ratio_i, 3), worst_bubble_vs_formula=round(worst, 4),
               latency_ms=round(latency * 1e3, 3), target_met=ratio <= 1.3 and ratio_i <= 1.3 and worst <= 0.10)


if __name__ == "__main__":
    main()
