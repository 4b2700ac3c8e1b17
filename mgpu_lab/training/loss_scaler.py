"""Dynamic loss scaling from scratch: ``torch.amp.GradScaler``'s API and numbers.

fp16 gradients below 2**-24 flush to zero. Multiplying the loss by a large
factor S shifts every gradient up by S (chain rule); the scaler divides them by
S again before the optimizer sees them, skips the step when the scaled
gradients overflowed (inf/NaN), and adapts S: times ``backoff_factor`` after an
overflow, times ``growth_factor`` after ``growth_interval`` clean steps in a row.

:class:`LossScaler` gives the same scale sequence, the same skipped steps and
bit-identical parameters as GradScaler on the same gradients. One addition:
under a process group the "found an inf" flag is all-reduced (MAX) so that
every rank skips together, also when ranks' gradients are not synchronised
(accumulation under ``no_sync``, sharded gradients); GradScaler relies on
all-reduced gradients carrying the inf to every rank (torch's FSDP has its own
``ShardedGradScaler`` for this reason). DTensor gradients (``fully_shard``,
``parallelize_module``, both on a 2-D mesh) are read through their local pieces,
and the default group is every rank of the mesh, every pipeline stage too: one
rank's overflow in one shard skips the step on all of them.

Cost per step: one read of every gradient to look for inf/NaN, one in-place
multiply to unscale, a handful of scalar kernels for the update, one
device-to-host sync in ``step()`` (to decide whether to call the optimizer, as
GradScaler does) and, with several ranks, one all-reduce of one float.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from ..runtime._diagnosis import collective_failed
from ..runtime.distributed import rank_and_world_size

READY, UNSCALED, STEPPED = "ready", "unscaled", "stepped"  # per-optimizer stage within an iteration


def _non_finite(grads: List[torch.Tensor]) -> torch.Tensor:
    """1.0 if any element of ``grads`` (one device) is inf or NaN, else 0.0 (a 0-dim fp32 tensor).

    The largest |g| of a tensor is inf or NaN exactly when it holds one. On a
    GPU, one fused multi-tensor kernel computes it for all gradients, without a
    sync. On the CPU that kernel is a slow path, so a cheap screen runs first:
    a tensor whose sum is finite holds no inf/NaN; only tensors whose sum is not
    finite (an inf, a NaN, or finite values summing past fp32's max) get the
    exact check (a CPU "sync" costs nothing).
    """
    if grads[0].device.type != "cpu":
        amax = torch.stack(torch._foreach_norm(grads, float("inf")))
        return (~torch.isfinite(amax)).any().float()
    sums = torch.stack([g.sum().float() for g in grads])
    suspects = [g for g, ok in zip(grads, torch.isfinite(sums).tolist()) if not ok]
    bad = any(not torch.isfinite(g.abs().amax()).item() for g in suspects if g.numel())
    return torch.tensor(float(bad))


def _new_state() -> Dict[str, Any]:
    return {"stage": READY, "found_inf": None}


class LossScaler:
    """Dynamic loss scaling, from scratch, with ``torch.amp.GradScaler``'s API and numbers.

    Usage (the same as GradScaler's)::

        scaler = LossScaler()                      # init_scale=2**16
        with torch.autocast(device.type, dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()              # gradients are S times too large
        scaler.unscale_(optimizer)                 # optional: to clip true gradients
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)                     # skipped if any gradient is inf/NaN
        scaler.update()                            # back off, or grow the scale

    The scale (fp32) and the count of clean steps in a row (the growth tracker,
    int32) are 0-dim tensors on the loss's device, created by the first
    ``scale()``; the update runs as tensor ops, without a sync.

    The signature is ``torch.amp.GradScaler``'s, ``device`` first (accepted for torch's calls, such as
    ``LossScaler("cuda")``; the scale is created on the device of the first loss it scales).
    ``group``: the process group whose ranks skip together (default: the
    default group when ``torch.distributed`` is initialised); ``sync_ranks=False``
    turns the all-reduce off. With ``enabled=False`` every method is a no-op
    and ``step()`` just calls ``optimizer.step()``, so one code path serves
    fp32, bf16 and fp16 runs.
    """

    def __init__(self, device: Optional[str] = None, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 *, group=None, sync_ranks: bool = True):
        if device is not None and not isinstance(device, (str, torch.device)):
            raise TypeError(f"LossScaler(device, init_scale=..., ...): device is torch.amp.GradScaler's first argument, "
                            f"a device type such as 'cuda'; got {device!r} (pass init_scale= by keyword)")
        self.device = device  # torch's argument; the scale lives on the device of the first loss scaled
        self._enabled = bool(enabled)
        if self._enabled:
            if growth_factor <= 1.0:
                raise ValueError(f"growth_factor must be > 1.0, got {growth_factor}")
            if backoff_factor >= 1.0:
                raise ValueError(f"backoff_factor must be < 1.0, got {backoff_factor}")
            if not isinstance(growth_interval, int) or growth_interval < 1:
                raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._scale: Optional[torch.Tensor] = None           # fp32, created by the first scale()
        self._growth_tracker: Optional[torch.Tensor] = None  # int32: clean steps in a row
        self._per_optimizer: Dict[int, Dict[str, Any]] = defaultdict(_new_state)
        self.group = group
        self.sync_ranks = sync_ranks

    def scale(self, outputs):
        """Multiply a tensor (or a list/tuple/iterable of them, nested) by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)
        if isinstance(outputs, Iterable):  # nested lists/tuples of losses
            mapped = map(self.scale, outputs)
            return type(outputs)(mapped) if isinstance(outputs, (list, tuple)) else mapped
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def _lazy_init(self, device: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)

    def _require_scale(self, what: str) -> None:
        if self._scale is None:
            raise RuntimeError(f"LossScaler.{what}() before any scale(loss): call "
                               "scaler.scale(loss).backward() first in every iteration")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and look for inf/NaN.

        At most once per optimizer between two ``update()`` calls, and before
        ``step()``; call it yourself only to see true gradients (clipping).
        """
        if not self._enabled:
            return
        self._require_scale("unscale_")
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] == UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] == STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # fp32 1/S computed in fp64, as torch does (an fp32 reciprocal may be off by an ulp).
        inv_scale = self._scale.double().reciprocal().float()
        state["found_inf"] = self._unscale_grads(optimizer, inv_scale)
        state["stage"] = UNSCALED

    @torch.no_grad()
    def _unscale_grads(self, optimizer: torch.optim.Optimizer, inv_scale: Optional[torch.Tensor]) -> torch.Tensor:
        groups: Dict[tuple, List[torch.Tensor]] = defaultdict(list)  # (device, dtype) -> gradients
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.dtype == torch.float16:
                    raise ValueError(
                        "LossScaler: a parameter has an fp16 gradient. Keep the parameters in fp32 "
                        "(master weights: do not call model.half()) and let torch.autocast cast them "
                        "for the matmuls; unscaling in fp16 would lose the small gradients again.")
                g = p.grad._values() if p.grad.is_sparse else p.grad
                if hasattr(g, "to_local"):  # a DTensor (torch's fully_shard): this rank's shard, in place
                    g = g.to_local()
                groups[(g.device, g.dtype)].append(g)
        found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for (device, _), grads in groups.items():
            # Look before multiplying, then multiply every gradient by 1/S: two passes.
            bad = _non_finite(grads)
            found_inf = torch.maximum(found_inf, bad.to(found_inf.device, non_blocking=True))
            if inv_scale is not None:
                torch._foreach_mul_(grads, inv_scale.to(device, non_blocking=True))
        if self.sync_ranks and rank_and_world_size(self.group)[1] > 1:
            # Every rank must take the same decision: skip if any rank overflowed.
            flag = found_inf
            if dist.get_backend(self.group) == "nccl" and flag.device.type != "cuda":
                flag = flag.cuda()
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)  # bounded by the group's timeout
            except RuntimeError as exc:
                raise collective_failed("LossScaler's found-inf flag (all-reduce)", exc, self.group,
                                        "Every rank must call unscale_/step together.") from exc
            found_inf = flag.to(found_inf.device)
        return found_inf

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale (unless done), then ``optimizer.step(*args, **kwargs)`` unless an inf/NaN was found.

        Returns what ``optimizer.step`` returned, or None when the step was skipped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported with a LossScaler: compute the loss, "
                               "scale it and call backward() yourself, then scaler.step(optimizer).")
        self._require_scale("step")
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] == STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # Fused optimizers (Adam(fused=True), ...) unscale inside their kernel and skip
            # the update themselves when found_inf is set: hand them both, no sync.
            scale = None if state["stage"] == UNSCALED else self._scale
            if state["stage"] == READY:
                state["found_inf"] = self._unscale_grads(optimizer, None)  # check only
            optimizer.grad_scale, optimizer.found_inf = scale, state["found_inf"]
            try:
                result = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale, optimizer.found_inf
        else:
            if state["stage"] == READY:
                self.unscale_(optimizer)
            result = None
            if state["found_inf"].item() == 0:  # the one device-to-host sync of a step
                result = optimizer.step(*args, **kwargs)
        state["stage"] = STEPPED
        return result

    @torch.no_grad()
    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """Adjust the scale for the next iteration (after ``step`` for every optimizer).

        If any optimizer found an inf/NaN: scale *= backoff_factor, tracker = 0.
        Else tracker += 1, and when it reaches growth_interval: scale *=
        growth_factor (unless that overflows fp32), tracker = 0. The products
        are taken in fp64 and rounded to fp32, as ``torch._amp_update_scale_`` does.
        ``new_scale`` sets the scale by hand instead.
        """
        if not self._enabled:
            return
        self._require_scale("update")
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise ValueError("new_scale must be a float or a 1-element tensor without grad")
                self._scale.copy_(new_scale.reshape(()))
            else:
                self._scale.fill_(float(new_scale))
        else:
            flags = [s["found_inf"] for s in self._per_optimizer.values() if s["found_inf"] is not None]
            if not flags:
                raise RuntimeError("update() without any step(): call scaler.step(optimizer) "
                                   "(or unscale_) for at least one optimizer first")
            found = torch.stack([f.to(self._scale.device) for f in flags]).sum() != 0
            scale64 = self._scale.double()
            successful = self._growth_tracker + 1
            grown = (scale64 * self._growth_factor).float()
            grow = (~found) & (successful == self._growth_interval)
            new = torch.where(found, (scale64 * self._backoff_factor).float(),
                              torch.where(grow & torch.isfinite(grown), grown, self._scale))
            self._scale.copy_(new)
            self._growth_tracker.copy_(torch.where(found | grow, torch.zeros_like(successful), successful))
        self._per_optimizer = defaultdict(_new_state)

    def get_scale(self) -> float:
        """The current scale (a sync on GPU); 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale.item()

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def is_enabled(self) -> bool:
        return self._enabled

    # GradScaler's accessors for the three hyper-parameters.
    def get_growth_factor(self) -> float: return self._growth_factor
    def set_growth_factor(self, new_factor: float) -> None: self._growth_factor = float(new_factor)
    def get_backoff_factor(self) -> float: return self._backoff_factor
    def set_backoff_factor(self, new_factor: float) -> None: self._backoff_factor = float(new_factor)
    def get_growth_interval(self) -> int: return self._growth_interval
    def set_growth_interval(self, new_interval: int) -> None: self._growth_interval = int(new_interval)

    def state_dict(self) -> Dict[str, Any]:
        """GradScaler's five entries (interchangeable with it); ``{}`` when disabled."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._get_growth_tracker()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (or a GradScaler's). No-op when disabled."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled scaler.")
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} - set(state_dict)
        if missing:
            raise KeyError(f"scaler state_dict lacks {sorted(missing)}")
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)

    def __repr__(self) -> str:
        if not self._enabled:
            return "LossScaler(enabled=False)"
        return (f"LossScaler(scale={self.get_scale():g}, growth_tracker={self._get_growth_tracker()}, "
                f"growth_interval={self._growth_interval})")
