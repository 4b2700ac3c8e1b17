"""Mixed precision: one transformer block's training step in fp32, tf32, bf16 and fp16 + scaler.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_amp.py

Options: --dim (default 1024 on a GPU, 256 on CPU), --seq (512 / 128), --batch
(16 / 8), --steps (timed steps per mode, default 20), --threads (CPU threads,
default 1: torch.set_num_threads).

One step = zero_grad, forward + loss under autocast, backward (of the scaled
loss), unscale, step, update: ``mgpu_lab.amp_step`` on an
``nn.TransformerEncoderLayer`` with AdamW. Modes, each timed in the same run
and interleaved (so drifting load hits all alike), median step time:

* fp32: tf32 off (``torch.backends.cuda.matmul.allow_tf32 = False``)
* tf32: fp32 matmuls on tensor cores with a 10-bit fraction (Ampere+; CUDA only)
* bf16: autocast to bf16, no scaler
* fp16: autocast to fp16 with ``mgpu_lab.LossScaler`` (CUDA only: CPUs have no
  fast fp16 matmul, so a CPU figure would measure emulation)

Memory: "activation" is the bytes autograd saves for backward during one
forward (a saved_tensors_hooks count, the same on every device); on CUDA also
the peak allocated memory of a step. Everything is printed as a ratio to fp32.
Targets (H100): bf16 <= 0.5x fp32 time and <= 0.6x activation memory.

Scaler overhead: the same fp16 (CUDA) or bf16 (CPU) step with
``mgpu_lab.LossScaler`` vs ``torch.amp.GradScaler``, interleaved; and the
scaler's own work alone (unscale_ + step with a no-op optimizer + update) over
the block's gradients. Target: LossScaler's step <= 1.05x GradScaler's.
The last line is the results as JSON.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from mgpu_lab import LossScaler, amp_step, devices
from mgpu_lab.measure.timing import Table, median_times, print_json, synchronize


def block(dim: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(dim, max(1, dim // 64), 4 * dim, dropout=0.0,
                                      batch_first=True).to(device)


def loss_fn(out, target):
    return out.float().pow(2).mean()


def saved_bytes(model, x, dtype) -> int:
    """Bytes autograd keeps for backward during one forward (each storage counted once)."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.device)] = t.untyped_storage().nbytes()
        return t
    ctx = torch.autocast(x.device.type, dtype=dtype) if dtype != torch.float32 else torch.autocast(
        x.device.type, enabled=False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        loss_fn(model(x), None)
    return sum(n for (ptr, _), n in seen.items() if ptr not in params)  # activations, not weights


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


class _NoOpOptimizer(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    device = devices(1)[0]
    gpu = device.type == "cuda"
    dim = args.dim or (1024 if gpu else 256)
    seq = args.seq or (512 if gpu else 128)
    batch = args.batch or (16 if gpu else 8)
    torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(device) if gpu else f"CPU ({torch.get_num_threads()} thread(s))"

    modes = {"fp32": (torch.float32, None, False)}
    if gpu:
        modes["tf32"] = (torch.float32, None, True)
    modes["bf16"] = (torch.bfloat16, None, False)
    if gpu:
        modes["fp16+scaler"] = (torch.float16, "scaler", False)
    x = torch.randn(batch, seq, dim, device=device)
    models = {m: block(dim, device) for m in modes}
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-4) for m in modes}
    scalers = {m: LossScaler() if s else None for m, (_, s, _) in modes.items()}

    def make_step(mode):
        dtype, _, tf32 = modes[mode]

        def step():
            set_tf32(tf32)
            amp_step(models[mode], opts[mode], loss_fn, (x, None), scaler=scalers[mode], dtype=dtype)
        return step

    times = median_times({m: make_step(m) for m in modes}, repeats=args.steps, warmup=1, device=device)
    set_tf32(False)
    act = {m: saved_bytes(models[m], x, modes[m][0]) for m in modes}
    peak = {}
    if gpu:
        for m in modes:
            make_step(m)()
            synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            make_step(m)()
            synchronize(device)
            peak[m] = torch.cuda.max_memory_allocated(device)
        set_tf32(False)

    # Scaler overhead: the same low-precision step with each scaler.
    low = torch.float16 if gpu else torch.bfloat16
    sc_models = {k: block(dim, device) for k in ("LossScaler", "GradScaler")}
    sc_opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in sc_models.items()}
    sc = {"LossScaler": LossScaler(), "GradScaler": torch.amp.GradScaler(device.type)}
    step_times = median_times(
        {k: (lambda k=k: amp_step(sc_models[k], sc_opts[k], loss_fn, (x, None), scaler=sc[k], dtype=low))
         for k in sc}, repeats=args.steps, warmup=1, device=device)
    # The scaler's own work alone, on the block's (already computed) gradients.
    noop = {k: _NoOpOptimizer(sc_models[k].parameters()) for k in sc}
    fresh = {"LossScaler": LossScaler(), "GradScaler": torch.amp.GradScaler(device.type)}
    for k, s in fresh.items():
        s.scale(torch.ones((), device=device))  # create the scale on the device

    def scaler_only(k):
        s, opt = fresh[k], noop[k]
        s.unscale_(opt)
        s.step(opt)
        s.update()
    own = median_times({k: (lambda k=k: scaler_only(k)) for k in fresh}, repeats=max(args.steps, 50), warmup=1,
                       device=device)

    n_params = sum(p.numel() for p in models["fp32"].parameters())
    print(f"device: {name}; TransformerEncoderLayer d={dim}, batch {batch} x seq {seq}, "
          f"{n_params / 1e6:.1f} M parameters; median of {args.steps} interleaved steps")
    if not gpu:
        print("CPU: measured fp32 and bf16 only (tf32 and fast fp16 are GPU features)")
    columns = {"mode": "", "step ms": ".2f", "vs fp32": ".2f", "activations MiB": ".1f", "act. vs fp32": ".2f"}
    if gpu:
        columns.update({"peak MiB": ".0f", "peak vs fp32": ".2f"})
    table = Table("median step time and memory, as ratios to fp32", columns)
    for m in modes:
        row = [m, times[m] * 1e3, times[m] / times["fp32"], act[m] / 2**20, act[m] / act["fp32"]]
        if gpu:
            row += [peak[m] / 2**20, peak[m] / peak["fp32"]]
        table.add(*row)
    table.print()
    ratio = step_times["LossScaler"] / step_times["GradScaler"]
    scalers_table = Table(f"{str(low)[6:]} step and scaler alone (unscale_ + step + update, "
                          f"{sum(1 for _ in sc_models['LossScaler'].parameters())} gradients)",
                          {"scaler": "", "step ms": ".2f", "vs GradScaler": ".3f", "alone us": ".0f",
                           "alone vs GradScaler": ".2f"})
    for k in sc:
        scalers_table.add(k, step_times[k] * 1e3, step_times[k] / step_times["GradScaler"], own[k] * 1e6,
                          own[k] / own["GradScaler"])
    scalers_table.print()
    print(f"\nLossScaler / GradScaler step: {ratio:.3f}x (target <= 1.05x): "
          f"{'met' if ratio <= 1.05 else 'NOT met'}")
    derived = (step_times["GradScaler"] + own["LossScaler"] - own["GradScaler"]) / step_times["GradScaler"]
    print(f"LossScaler's extra work per step, from the scaler-alone timings: "
          f"{(own['LossScaler'] - own['GradScaler']) * 1e6:.0f} us = {derived:.4f}x of a GradScaler step "
          "(steadier than the step ratio on a loaded machine)")
    if gpu:
        r_t, r_m = times["bf16"] / times["fp32"], act["bf16"] / act["fp32"]
        print(f"bf16 vs fp32: time {r_t:.2f}x (target <= 0.5x), activations {r_m:.2f}x (target <= 0.6x)")
    print_json("bench_amp", [table, scalers_table], device=name, dim=dim, seq=seq, batch=batch,
               activation_bytes=act, peak_bytes=peak, losscaler_vs_gradscaler_step=round(ratio, 4),
               losscaler_vs_gradscaler_step_derived=round(derived, 4), target_met=ratio <= 1.05,
               bf16_time_vs_fp32=round(times["bf16"] / times["fp32"], 3),
               bf16_activations_vs_fp32=round(act["bf16"] / act["fp32"], 3))


if __name__ == "__main__":
    main()
