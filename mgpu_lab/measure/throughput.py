"""Throughput: tokens per second, and how much of the machine's arithmetic a step uses (MFU).

**Model FLOPs per token** of a decoder trained on sequences of ``s`` tokens (PaLM, Chowdhery
et al. 2022, appendix B; the formula nanoGPT and torchtitan report)::

    6·N + 12·L·h·s

* ``6·N``: each weight of a matmul (N of them: the blocks' linear layers and the output
  projection; an embedding *lookup* multiplies nothing) does one multiply-add (2 FLOPs)
  per token forward and two backward (the input's gradient and its own): 2N + 4N.
* ``12·L·h·s``: attention's two matmuls per layer, ``Q·Kᵀ`` and ``softmax·V``, each
  ``2·s·h`` FLOPs per token forward (s keys of h numbers), three times that with
  backward. Counted whole, as PaLM and ``FlopCounterMode`` count it, although a causal
  mask leaves half the products unused.

Activation recompute runs part of the forward again: *hardware* FLOPs grow, *model*
FLOPs do not. **HFU** (hardware FLOPs utilisation) counts the FLOPs issued, recompute
included; **MFU** counts only the model's, so it does not reward recomputing (PaLM,
appendix B). ``count_flops`` counts the FLOPs a
function really issues (``torch.utils.flop_counter.FlopCounterMode``: every matmul and
attention kernel, norms and element-wise ops aside) to check the formula on a real model.

**MFU** = achieved model FLOP/s ÷ the hardware's *theoretical* peak FLOP/s, its datasheet
figure (PaLM, appendix B; torchtitan's ``get_peak_flops``): :func:`datasheet_peak_flops`
knows a few accelerators (H100 SXM: 989 TFLOP/s dense bf16). A CPU has a theoretical peak too
(cores × clock × FLOPs per cycle) but none this table knows, so
the labs divide by a rate *measured* here (``measure_peak_flops``: matmuls in the training
dtype, back to back, under the same conditions as the run) and call the ratio what it is:
the *fraction of the measured matmul rate*, higher than MFU would be (large bf16 matmuls
measure well below the datasheet's figure).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch
from torch import nn


def decoder_flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> int:
    """Model FLOPs to train on one token: ``6·n_params + 12·n_layers·hidden·seq_len``
    (``n_params``: the matmuls' weights, see ``matmul_parameters``)."""
    for name, v in (("n_params", n_params), ("n_layers", n_layers), ("hidden", hidden), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    return 6 * n_params + 12 * n_layers * hidden * seq_len


def matmul_parameters(model: nn.Module) -> int:
    """N of the formula: the weights of the model's ``nn.Linear`` layers, each counted once
    (a head tied to the embedding counts once, as the head's matmul); global sizes for DTensors."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            total += m.weight.numel()
    return total


def count_flops(fn: Callable[[], object]) -> int:
    """The FLOPs ``fn()`` issues (forward and, if it calls it, backward), counted by
    ``FlopCounterMode``: matmuls and attention; element-wise ops count 0."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def measure_peak_flops(device=None, dtype: torch.dtype = torch.float32, size: int = 512,
                       seconds: float = 0.3) -> float:
    """FLOP/s of back-to-back ``size x size`` matmuls in ``dtype`` on ``device``, measured for
    about ``seconds`` after a warm-up: the peak this process reaches here and now. Use sizes
    like the model's largest matmuls on a CPU (cache-sized); 4096-8192 on a GPU."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):  # warm-up: kernel selection, caches, clocks
        a @ b
    sync()
    reps, start = 0, time.perf_counter()
    while True:
        for _ in range(4):
            a @ b
        reps += 4
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * size ** 3 * reps / elapsed


# Dense bf16 tensor-core peaks from the vendors' datasheets (no sparsity; torchtitan's
# get_peak_flops has the same, but for the H200 NVL, which it counts as an H200 SXM);
# more specific names first.
DATASHEET_BF16 = ((("h100", "nvl"), 835e12), (("h100", "pcie"), 756e12), (("h100",), 989e12),
                  (("h200", "nvl"), 836e12), (("h200",), 989e12), (("a100",), 312e12),
                  (("gb200",), 2.5e15), (("b200",), 2.25e15))


def datasheet_peak_flops(device_name: str) -> Optional[float]:
    """The datasheet's dense bf16 peak FLOP/s of an accelerator named ``device_name``
    (``torch.cuda.get_device_name()``), or None when it is not one this table knows (a CPU)."""
    name = str(device_name).lower()
    for words, flops in DATASHEET_BF16:
        if all(w in name for w in words):
            return flops
    return None


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: the model FLOP/s achieved over what ``devices`` devices of
    ``peak_flops`` each could do (MFU proper with the datasheet peak,
    :func:`datasheet_peak_flops`; with a measured rate, the fraction of that rate)."""
    if peak_flops <= 0 or devices < 1:
        raise ValueError(f"peak_flops must be > 0 and devices >= 1, got {peak_flops!r}, {devices!r}")
    return tokens_per_second * flops_per_token / (peak_flops * devices)


class ThroughputMeter:
    """Times training steps: ``start()`` before a step, ``stop(tokens)`` after it (it waits for
    the GPU). The first ``warmup`` steps are left out (allocation, kernel selection).
    ``tokens_per_second`` over the steps timed since."""

    def __init__(self, warmup: int = 1, device=None):
        self.warmup, self.steps, self.tokens, self.seconds = warmup, 0, 0, 0.0
        self._device = torch.device(device) if device is not None else None
        self._start: Optional[float] = None

    def _sync(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def start(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def stop(self, tokens: int) -> float:
        """End the step that processed ``tokens`` tokens (on this rank); returns its seconds."""
        if self._start is None:
            raise RuntimeError("ThroughputMeter.stop() without start()")
        self._sync()
        elapsed = time.perf_counter() - self._start
        self._start = None
        self.steps += 1
        if self.steps > self.warmup:
            self.tokens += tokens
            self.seconds += elapsed
        return elapsed

    @property
    def tokens_per_second(self) -> float:
        if self.seconds == 0:
            raise RuntimeError(f"no step timed yet after the {self.warmup} warm-up step(s)")
        return self.tokens / self.seconds
