"""Expert parallelism: the MoE step with its two all-to-alls vs the plain layer, and the bytes vs the formula.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_expert_parallel.py

Options: --nprocs 2,4 (each a run; more ranks than cores measures the scheduler), --tokens 1024 (per
rank), --hidden 256, --ffn 1024, --experts 8, --top-k 2, --steps 10, --capacity-factor (default:
none). CPU: gloo, fp32; with a GPU per rank, NCCL on cuda:rank.

Step: forward and backward (from a gradient of ones, plus the auxiliary loss) of

* **expert parallel**: ``ExpertParallelMoE.from_moe(moe)``, rank r holding E/N experts, its own
  tokens dispatched to the experts' ranks and combined back (an all-gather of the ``[k, E]``
  counts, then two ``all_to_all_single``);
* **plain, all experts local**: the same ``MoE`` on the rank's own tokens, every expert on every
  rank (no communication: the compute EP starts from, at N times the expert memory);

interleaved, the slowest rank's median. Bytes: the rows each rank's dispatch sent to other ranks
(``stats["sent"]``, times hidden x 4 bytes; the combine returns as many) against the formula for a
balanced router, ``(N-1)/N * T * k * hidden * 4``; the all-to-alls' sizes as ``CollectiveLog``
saw them. Imbalance: the busiest expert's load over the mean, ``T*N*k/E``.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mgpu_lab import ExpertParallelMoE, MoE, launch, rank_device
from mgpu_lab.measure.dispatch_watch import CollectiveLog
from mgpu_lab.measure.timing import Table, median_times, print_json


def _bench(tokens, hidden, ffn, experts, top_k, steps, capacity_factor):
    device = rank_device()
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = MoE(hidden, ffn, experts, top_k, capacity_factor).to(device)
    ep = ExpertParallelMoE.from_moe(plain)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank)).to(device)
    layers = {"expert parallel (all-to-all)": ep, "plain, all experts local": plain}

    def step(name):
        layer = layers[name]
        layer.zero_grad(set_to_none=True)
        (layer(x).sum() + layer.aux_loss).backward()

    medians = median_times({name: (lambda name=name: step(name)) for name in layers}, repeats=steps, warmup=2,
                           device=device, before=dist.barrier)
    with CollectiveLog() as log:
        ep(x)
    sent = ep.stats["sent"]
    to_others = sum(c for d, c in enumerate(sent) if d != rank) * hidden * 4
    load = ep.stats["tokens_per_expert"].float()
    times = torch.tensor([medians[name] for name in layers], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {"times": dict(zip(layers, times.tolist())), "bytes_to_others": to_others,
            "formula": (n - 1) / n * tokens * top_k * hidden * 4, "collectives": log.events,
            "imbalance": (load.max() / load.mean()).item(), "dropped": ep.stats["dropped"], "device": str(device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", default="2,4")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--capacity-factor", type=float, default=None)
    a = ap.parse_args()
    step_table = Table("forward + backward of one MoE layer, the slowest rank",
                       {"N": "", "contender": "", "step ms": ".1f", "vs plain": ".2f"})
    byte_table = Table("dispatch bytes per rank to other ranks (the combine returns as many)",
                       {"N": "", "rank": "", "KiB": ".1f", "balanced formula KiB": ".1f", "meas/formula": ".3f",
                        "rows per all-to-all (in or out, the larger)": "", "max/mean expert load": ".2f"})
    summary = {}
    for n in (int(v) for v in a.nprocs.split(",")):
        per_rank = launch(_bench, nprocs=n, args=(a.tokens, a.hidden, a.ffn, a.experts, a.top_k, a.steps,
                                                  a.capacity_factor), timeout=1800)
        times = per_rank[0]["times"]
        base = times["plain, all experts local"]
        for name, t in times.items():
            step_table.add(n, name, t * 1e3, t / base)
        for r, res in enumerate(per_rank):
            rows = [numel // a.hidden for kind, _, numel in res["collectives"] if kind == "all-to-all"]
            byte_table.add(n, r, res["bytes_to_others"] / 1024, res["formula"] / 1024,
                           res["bytes_to_others"] / res["formula"], str(rows), res["imbalance"])
        summary[f"N{n}"] = {"ep_vs_plain": round(times["expert parallel (all-to-all)"] / base, 3),
                            "imbalance": round(per_rank[0]["imbalance"], 3), "dropped": per_rank[0]["dropped"]}
    print(f"device {per_rank[0]['device']}; {a.tokens} tokens per rank, hidden {a.hidden}, ffn {a.ffn}, "
          f"{a.experts} experts, top-{a.top_k}, capacity factor {a.capacity_factor}; median of {a.steps} steps")
    step_table.print()
    byte_table.print()
    print_json("bench_expert_parallel", [step_table, byte_table], summary=summary)


if __name__ == "__main__":
    main()
