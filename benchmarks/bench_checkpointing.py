"""Activation checkpointing: saved bytes and step time vs the number of segments.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_checkpointing.py

Options: --steps (timed steps per setting, default 7), --mlp-blocks (default 32),
--width (default 256), --batch (default 64), --tf-layers (default 16), --tf-dropout
(default 0.1), --device (default: cuda:0 when there is a GPU, else cpu).

Two models: a stack of transformer-style MLP blocks (x + fc2(gelu(fc1(x))), 4x
hidden) and a small transformer encoder (nn.TransformerEncoderLayer, pre-norm).
For each number of segments k, one training step (zero_grad, forward through
``mgpu_lab.checkpoint_sequential(model, k, x)``, loss, backward):

* saved bytes: what autograd keeps after forward (``mgpu_lab.saved_tensor_bytes``),
  not what an allocator holds; on a GPU also the allocator's peak during the whole
  step (``mgpu_lab.peak_memory``), which adds one segment's recompute;
* step time: median over ``--steps``, settings interleaved so machine load hits
  all alike. On CPU it is the process's CPU time (``time.process_time``: with
  one thread, the compute time, which other programs on a shared machine do
  not inflate); on a GPU, wall time between ``cuda.synchronize`` calls.

Ratios are against the plain model (no checkpointing) measured in the same run;
``torch.utils.checkpoint.checkpoint_sequential`` (use_reentrant=False) at
sqrt(n) segments is the PyTorch baseline. Target: at k = round(sqrt(n)),
<= 0.35x the plain saved bytes at <= 1.4x the plain step time. The time a
recompute costs is the recomputed blocks' share of the forward, so the script
also times the forward alone (with grad, as a recompute runs) and prints the
ratio that predicts (on CPU,
dropout's random numbers make the transformer's forward unusually expensive
next to its backward). Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.utils.checkpoint as tc
from torch import nn

from mgpu_lab import checkpoint_sequential, peak_memory, saved_tensor_bytes
from mgpu_lab.measure.timing import Table, median_times, print_json


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


def mlp(blocks: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(blocks)])


def transformer(layers: int, d_model: int = 128, dropout: float = 0.1) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model,
                                                      dropout=dropout, batch_first=True, norm_first=True)
                           for _ in range(layers)])


def bench(model: nn.Sequential, x: torch.Tensor, steps: int):
    """Rows (setting, segments, saved bytes, GPU peak or None, median step seconds)."""
    n = len(model)
    device = x.device
    root = round(math.sqrt(n))
    ks = sorted({k for k in (2, 4, root, 8, 16, n) if 2 <= k <= n})
    runs = {"plain": lambda h: model(h)}
    for k in ks:
        runs[f"mgpu_lab k={k}"] = lambda h, k=k: checkpoint_sequential(model, k, h, use_reentrant=False)
    runs[f"torch k={root}"] = lambda h: tc.checkpoint_sequential(model, root, h, use_reentrant=False)
    segs = {"plain": 1, **{f"mgpu_lab k={k}": k for k in ks}, f"torch k={root}": root}

    def step(run):
        model.zero_grad(set_to_none=True)
        run(x).float().pow(2).mean().backward()

    def forward_only():  # with grad, as the recompute runs it (it records a graph)
        model(x)

    todo = {**{name: (lambda run=run: step(run)) for name, run in runs.items()}, "forward": forward_only}
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = median_times(todo, repeats=steps, warmup=1, device=device, clock=clock)
    rows = []
    for name, run in runs.items():
        saved = saved_tensor_bytes(run, x)
        peak = peak_memory(step, run) if device.type == "cuda" else None
        rows.append((name, segs[name], saved, peak, times[name]))
    return rows, root, times["forward"]


def report(title: str, rows, root: int, n: int, forward: float):
    """Print the table of one model; return it and the summary at sqrt(n) segments."""
    base = {r[0]: r for r in rows}["plain"]
    table = Table(title, {"setting": "", "segments": "", "saved MB": ".2f", "saved x plain": ".2f",
                          "peak MB": ".1f", "peak x plain": ".2f", "step ms": ".1f", "step x plain": ".2f"})
    for name, k, saved, peak, t in rows:
        table.add(name, k, saved / 2**20, saved / base[2], None if peak is None else peak / 2**20,
                  None if peak is None else peak / base[3], t * 1e3, t / base[4])
    table.print()
    at = {r[0]: r for r in rows}[f"mgpu_lab k={root}"]
    torch_at = {r[0]: r for r in rows}[f"torch k={root}"]
    out = {"segments": root, "bytes_ratio": round(at[2] / base[2], 3),
           "time_ratio": round(at[4] / base[4], 3),
           "time_vs_torch": round(at[4] / torch_at[4], 3),
           "plain_saved_bytes": base[2], "plain_step_ms": round(base[4] * 1e3, 2)}
    if base[3] is not None:
        out["peak_ratio"] = round(at[3] / base[3], 3)
    share = forward / base[4]
    out["forward_share"] = round(share, 3)
    out["expected_time_ratio"] = round(1 + (root - 1) * (n // root) / n * share, 3)
    print(f"forward alone: {forward * 1e3:.1f} ms = {share:.2f} of a plain step, so recomputing "
          f"{(root - 1) * (n // root)} of {n} blocks should cost about {out['expected_time_ratio']:.2f}x")
    ok = out["bytes_ratio"] <= 0.35 and out["time_ratio"] <= 1.4
    print(f"sqrt(n) = {root} segments: {out['bytes_ratio']:.2f}x bytes (target <= 0.35x), "
          f"{out['time_ratio']:.2f}x time (target <= 1.4x), {out['time_vs_torch']:.2f}x torch's "
          f"checkpoint_sequential: {'met' if ok else 'MISSED'}")
    out["target_met"] = ok
    return table, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--mlp-blocks", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tf-layers", type=int, default=16)
    parser.add_argument("--tf-dropout", type=float, default=0.1)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    clock = "wall time" if device.type == "cuda" else "process CPU time"
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"median of {args.steps} steps ({clock})")
    results = {"device": str(device)}

    model = mlp(args.mlp_blocks, args.width).to(device)
    x = torch.randn(args.batch, args.width, device=device, requires_grad=True)
    rows, root, fwd = bench(model, x, args.steps)
    mlp_table, results["mlp"] = report(f"{args.mlp_blocks}-block MLP, width {args.width} (hidden {4 * args.width}), "
                            f"batch {args.batch}", rows, root, args.mlp_blocks, fwd)

    model = transformer(args.tf_layers, dropout=args.tf_dropout).to(device)
    model.train()
    x = torch.randn(8, 64, 128, device=device, requires_grad=True)
    rows, root, fwd = bench(model, x, args.steps)
    tf_table, results["transformer"] = report(f"{args.tf_layers}-layer transformer encoder, d_model 128, 4 heads, "
                                    f"batch 8 x 64 tokens, dropout {args.tf_dropout}", rows, root,
                                    args.tf_layers, fwd)
    print_json("bench_checkpointing", [mlp_table, tf_table], clock=clock, **results)


if __name__ == "__main__":
    main()
