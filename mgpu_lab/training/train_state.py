"""Checkpoints you can resume from: atomic, safe to load, bit for bit, on any layout.

A long run dies: a node reboots, the OOM killer strikes, a rank is preempted.
What saves the week is a checkpoint that (1) is never half-written, (2) can be
loaded without running code from the file, (3) holds *everything* the next
step depends on, so that the resumed run continues exactly as if nothing
happened, and (4) loads on the machines you have *now*.

1. **Atomic** and 2. **safe to load**: :mod:`~mgpu_lab.training.checkpoint_file`
   (``save_checkpoint``: a temporary file, fsync, an atomic rename, rank 0 writes;
   ``load_checkpoint``: ``weights_only=True``, pickled code refused before it runs).
3. **Complete**: ``TrainState`` keeps the model's full weights under the plain
   model's names (so the file loads into a plain model), the optimizer's state
   per parameter name (Adam's moments), the LR scheduler, the loss scaler (its
   scale and growth tracker), the step and the sampler's epoch, and the
   random-number state of *every* rank (dropout draws differ per rank), gathered
   to rank 0 (a few KiB per rank; one file is one atomic rename, where one file per
   rank could leave a mix of two steps after a crash).
4. **Portable**: every tensor is stored under its plain name, whole, and the
   optimizer's state per parameter (:mod:`~mgpu_lab.training.state_dicts`), so a
   checkpoint written under one layout loads under any other: torch DDP, our DDPs,
   our FSDP, ``fully_shard``, ``parallelize_module``, both on a 2-D mesh, pipeline
   stages that keep the full model's names; another number of ranks. With
   ``sharded=True`` each rank writes its own pieces into a
   ``torch.distributed.checkpoint`` folder instead (:mod:`~mgpu_lab.training.sharded_checkpoint`),
   for models too large to gather on one rank; ``load`` reads either kind.

Typical loop (README's; the whole pattern is ``examples/resumable_train.py``)::

    state = TrainState(model, optimizer, scaler, scheduler=scheduler)
    state.load(path)                      # resumes if it exists, else no-op
    for x, y in itertools.islice(loader, state.step * K, None):   # skip what was seen
        ...one micro-step; every K-th: an optimizer step and state.step += 1...
        if state.step % every == 0:
            state.save(path)              # every rank calls it (it gathers RNG states)

RNG and data loaders: a ``DataLoader`` draws a seed from the global RNG when its
iterator is created (and a shuffling sampler another at the first batch). In the
uninterrupted run that happened before any training step, so ``load`` does not
restore the RNG at once: it restores it just before the model's next forward, after
the loop above made its iterator and skipped the batches already seen, as the
uninterrupted run's draws were. Data drawn from the *global* RNG between ``load`` and
the first forward is drawn before the restore: draw it from your own
``torch.Generator``, or call ``restore_rng()`` yourself first. The RNG of a rank that
did not exist when the checkpoint was written cannot be restored and keeps its seed
(a warning).
"""
from __future__ import annotations

import os
import random
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import wrappers
from ..runtime.distributed import rank_and_world_size
from . import sharded_checkpoint, state_dicts
from .checkpoint_file import (  # noqa: F401  (public here too: mgpu_lab.training.train_state.save_checkpoint)
    UnsafeCheckpointError, _barrier, load_checkpoint, save_checkpoint,
)

# --------------------------------------------------------------------------- RNG states

def rng_state() -> Dict[str, Any]:
    """This process's random-number state (torch CPU, this rank's CUDA device, ``random``,
    numpy when installed), as tensors and plain numbers so that ``weights_only`` loads it."""
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what ``rng_state()`` returned."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
    if state.get("numpy") is not None:
        import numpy as np
        n = state["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))


# --------------------------------------------------------------------------- resumable training

class TrainState:
    """Everything a training run needs to continue bit for bit, saved and restored together.

    ``model`` may be wrapped (torch DDP, NaiveDDP, BucketedDDP, FSDP, ``fully_shard``)
    or hold DTensors (``parallelize_module``, a 2-D mesh), or be one pipeline stage
    whose module keeps the full model's names. ``optimizer``, ``scaler``
    (``torch.amp.GradScaler`` or ``mgpu_lab.LossScaler``) and ``scheduler`` are
    anything with ``state_dict``/``load_state_dict``. ``step`` (optimizer steps done)
    and ``epoch`` (the sampler's epoch: pass it to ``set_epoch``) are yours to
    advance; ``extra`` holds other plain values. ``sharded=True`` saves a
    ``torch.distributed.checkpoint`` folder (each rank its pieces) instead of one file
    of full weights. ``state_dict()``, ``save()`` and ``load()`` are collectives:
    every rank calls them.
    """

    def __init__(self, model: nn.Module, optimizer=None, scaler=None, step: int = 0, epoch: int = 0,
                 scheduler=None, *, sharded: bool = False):
        wrappers.wrapper_kind(model)  # an unknown wrapper: a TypeError now, not a wrong checkpoint later
        self.model, self.optimizer, self.scaler, self.scheduler = model, optimizer, scaler, scheduler
        self.step, self.epoch, self.sharded = step, epoch, bool(sharded)
        self.extra: Dict[str, Any] = {}
        self._loaded_rng: Optional[List[Dict[str, Any]]] = None
        self._rng_hook = None  # restores the loaded RNG at the model's next forward

    # ------------------------------------------------------------------ what is saved
    def _plain_state(self) -> Dict[str, Any]:
        """Everything but the tensors of model and optimizer, complete on rank 0."""
        if self._rng_hook is not None:  # saved before any forward since load: the loaded RNG
            self.restore_rng()
        rank, world = rank_and_world_size()
        rngs: List[Any] = [None] * world
        if world > 1:  # every rank's RNG, gathered to the rank that writes
            dist.gather_object(rng_state(), rngs if rank == 0 else None, dst=0)
        else:
            rngs = [rng_state()]
        state = {"format": FORMAT, "layout": state_dicts.describe_layout(self.model), "step": self.step,
                 "epoch": self.epoch, "world_size": world, "rng": rngs, "extra": dict(self.extra)}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def state_dict(self) -> Dict[str, Any]:
        """The one-file checkpoint: full weights and per-parameter optimizer state, complete on rank 0."""
        state = self._plain_state()
        state["model"] = state_dicts.merge_on_rank0(state_dicts.model_state(self.model, full=True))
        if self.optimizer is not None:
            state["optimizer"] = state_dicts.merge_optimizer_on_rank0(
                self.model, self.optimizer, state_dicts.optimizer_state(self.model, self.optimizer, full=True))
        return state

    def save(self, path: str) -> None:
        """Every rank calls it. One file: rank 0 writes ``path`` atomically. ``sharded=True``: a
        folder ``path`` in which each rank writes its pieces (a new generation, switched to atomically)."""
        if not self.sharded:
            save_checkpoint(path, **self.state_dict())
            return
        meta = self._plain_state()
        tensors = {f"model/{k}": v for k, v in state_dicts.model_state(self.model, full=False).items()}
        if self.optimizer is not None:
            opt = state_dicts.optimizer_state(self.model, self.optimizer, full=False)
            plain: Dict[str, Dict[str, Any]] = {}
            for name, st in (opt or {"state": {}})["state"].items():
                for key, value in st.items():
                    if torch.is_tensor(value):
                        tensors[f"optim/{name}/{key}"] = value
                    else:
                        plain.setdefault(name, {})[key] = value
            merged = state_dicts.merge_optimizer_on_rank0(
                self.model, self.optimizer, {"state": plain, "param_groups": opt["param_groups"]} if opt else None)
            if merged is not None:
                meta["optimizer"] = merged
        sharded_checkpoint.save(path, tensors, meta, self.step, _barrier)

    # ------------------------------------------------------------------ loading
    def load(self, path: str, map_location="cpu", restore_rng: bool = True) -> bool:
        """Restore from ``path`` if it exists (True), else leave everything as is (False).

        ``path`` is a one-file checkpoint or a sharded folder, written under any layout. The
        RNG is restored at the model's next forward (see the module docstring), or never
        with ``restore_rng=False`` (call ``restore_rng()`` yourself)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            folder = sharded_checkpoint.latest(path)
            if folder is None:
                if os.listdir(path):
                    raise FileNotFoundError(f"{path!r} is a folder without a {sharded_checkpoint.LATEST!r} file: not "
                                            "a TrainState(sharded=True) checkpoint, or its first save did not finish")
                return False
            state = load_checkpoint(os.path.join(folder, "meta.pt"), map_location=map_location)
            self._load_tensors_sharded(folder, state)
        elif os.path.exists(path):
            state = load_checkpoint(path, map_location=map_location)
            self._load_tensors_full(path, state)
        else:
            return False
        for name, part in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            if part is not None and name not in state:
                raise KeyError(f"{path} has no {name} state ({_holds(state)}), but this TrainState has a {name}: "
                               f"resume without it, or from a checkpoint saved with one")
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch = state["step"], state["epoch"]
        self.extra = dict(state.get("extra", {}))
        self._loaded_rng = state["rng"]
        world = rank_and_world_size()[1]
        if len(self._loaded_rng) != world:
            warnings.warn(f"the checkpoint was written by {len(self._loaded_rng)} rank(s), this run has {world}: "
                          "model, optimizer and counters are restored, but random draws will not continue "
                          "bit for bit", stacklevel=2)
        if self._rng_hook is not None:
            self._rng_hook.remove()
            self._rng_hook = None
        if restore_rng:
            self._rng_hook = self.model.register_forward_pre_hook(lambda module, args: self.restore_rng())
        return True

    def _load_tensors_full(self, path: str, state: Dict[str, Any]) -> None:
        what = f"{path} ({_holds(state)})"
        if "model" not in state:
            raise KeyError(f"{what} has no model: it is not a TrainState checkpoint (save_checkpoint(path, "
                           "model=...) writes one)")
        state_dicts.load_model_state(self.model, state["model"], what)
        if self.optimizer is None:
            return
        if "optimizer" not in state:
            raise KeyError(f"{what} has no optimizer state: build TrainState without an optimizer to load it")
        if state.get("format", 1) >= 2:
            state_dicts.load_optimizer_state(self.model, self.optimizer, state["optimizer"], what)
        else:
            _load_legacy_optimizer(self.model, self.optimizer, state, what)

    def _load_tensors_sharded(self, folder: str, meta: Dict[str, Any]) -> None:
        what = f"{folder} ({_holds(meta)})"
        stored = sharded_checkpoint.stored(folder)
        model_targets = wrappers.unwrap(self.model).state_dict()  # this rank's pieces (mgpu_lab FSDP: whole tensors)
        missing = [k for k in model_targets if f"model/{k}" not in stored]
        if missing:
            raise KeyError(f"{what} has no {missing[:5]}: it holds "
                           f"{sum(k.startswith('model/') for k in stored)} model tensors; build the same model")
        targets = {f"model/{k}": torch.empty_like(t) for k, t in model_targets.items()}
        opt_keys = sharded_checkpoint.optimizer_keys(stored)
        if self.optimizer is not None:
            names, groups = state_dicts.parameter_names(self.model), state_dicts._fsdp_groups(self.model)
            for p in (p for g in self.optimizer.param_groups for p in g["params"]):
                for n in names.get(id(p), []):
                    for k in opt_keys.get(n, []):
                        md = stored[f"optim/{n}/{k}"]
                        size, dtype = tuple(md.size), md.properties.dtype
                        if id(p) not in groups and len(size) > 0 and size == tuple(p.shape):
                            targets[f"optim/{n}/{k}"] = torch.empty_like(p, dtype=dtype)
                        else:
                            targets[f"optim/{n}/{k}"] = torch.empty(size, dtype=dtype, device=p.device)
        sharded_checkpoint.load(folder, targets)
        state_dicts.load_model_state(self.model, {k[len("model/"):]: v for k, v in targets.items()
                                                  if k.startswith("model/")}, what)
        if self.optimizer is not None:
            saved = meta.get("optimizer")
            if saved is None:
                raise KeyError(f"{what} has no optimizer state: build TrainState without an optimizer to load it")
            state = {n: dict(v) for n, v in saved["state"].items()}
            for key, value in targets.items():
                if key.startswith("optim/"):
                    n, k = key[len("optim/"):].rsplit("/", 1)
                    state.setdefault(n, {})[k] = value
            state_dicts.load_optimizer_state(self.model, self.optimizer,
                                             {"state": state, "param_groups": saved["param_groups"]}, what)

    def restore_rng(self) -> None:
        """Put back this rank's RNG state from the last ``load`` now (see the module docstring)."""
        if self._rng_hook is not None:
            self._rng_hook.remove()
            self._rng_hook = None
        if self._loaded_rng is None:
            raise RuntimeError("restore_rng(): nothing loaded yet; call load(path) first")
        rank = rank_and_world_size()[0]
        if rank < len(self._loaded_rng):
            set_rng_state(self._loaded_rng[rank])


FORMAT = 2  # 1: optimizer state as the optimizer's own state_dict (FSDP: per rank); 2: per parameter name


def _holds(state: Dict[str, Any]) -> str:
    """What a checkpoint holds, in words, for error messages."""
    layout = state.get("layout") or f"{state.get('world_size', '?')} rank(s), layout not recorded"
    return f"step {state.get('step', '?')}, saved under {layout}, format {state.get('format', 1)}"


def _load_legacy_optimizer(model: nn.Module, optimizer, state: Dict[str, Any], what: str) -> None:
    """Format 1 (before per-parameter state): loads only under the layout that wrote it."""
    saved = state["optimizer"]
    if isinstance(saved, dict) and "per_rank" in saved:
        parts = saved["per_rank"]
        kind = wrappers.wrapper_kind(model)
        n = wrappers.world_size(model) if kind != "local" else 1
        if kind != "fsdp" or len(parts) != n:
            raise ValueError(f"{what}: its optimizer state is mgpu_lab FSDP's per-rank state of {len(parts)} ranks "
                             f"(an older format); this run is {kind} on {n} rank(s). Resume once under FSDP on "
                             f"{len(parts)} ranks and save again: the new format is per parameter and loads anywhere")
        optimizer.load_state_dict(parts[wrappers.unwrap(model).rank])
        return
    try:
        optimizer.load_state_dict(saved)
    except (KeyError, ValueError, IndexError, RuntimeError) as exc:
        raise ValueError(f"{what}: its optimizer state is the optimizer's own state dict (an older format, by "
                         f"parameter index) and does not fit this optimizer ({type(exc).__name__}: {exc}). Resume "
                         "once under the layout that wrote it and save again: the new format loads anywhere") from exc
