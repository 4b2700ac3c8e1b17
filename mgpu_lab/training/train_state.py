"""Checkpoints you can resume from: atomic, safe to load, bit for bit.

A long run dies: a node reboots, the OOM killer strikes, a rank is preempted.
What saves the week is a checkpoint that (1) is never half-written, (2) can be
loaded without running code from the file, and (3) holds *everything* the next
step depends on, so that the resumed run continues exactly as if nothing
happened.

1. **Atomic**: ``save_checkpoint`` writes to a temporary file in the same folder,
   flushes and fsyncs it, then ``os.replace``-s it over the old name (a rename
   is atomic on one file system) and fsyncs the folder so the rename itself
   survives a power cut. A crash or a SIGKILL mid-write leaves the previous
   checkpoint whole (and at worst a stray ``.NAME.*.tmp`` file). Under a process
   group only rank 0 writes; the others wait at a barrier until it is done, so
   nobody reads a file that is not there yet. Cost: one file write and one
   barrier per save.
2. **Safe to load**: a ``.pt`` file is a pickle, and unpickling can call any
   function (``os.system`` included). ``load_checkpoint`` uses
   ``torch.load(weights_only=True)``, which only rebuilds tensors, numbers,
   strings and containers; a file that carries anything else is refused with
   ``UnsafeCheckpointError`` before any of it runs. ``save_checkpoint`` refuses to
   write such objects in the first place (store ``obj.state_dict()`` instead).
3. **Complete**: ``TrainState`` keeps the model (without its DDP wrapper, so
   the file loads into a plain model; full weights gathered from FSDP or
   ``fully_shard``), the optimizer (Adam's moments; a sharded optimizer's state
   gathered to rank 0), the LR scheduler, the loss scaler (its scale and growth
   tracker), the step and the sampler's epoch, and the random-number state of
   *every* rank (dropout draws differ per rank). How each wrapper gives and
   takes its state: :mod:`mgpu_lab.parallel.wrappers`.
   Decision: every rank's RNG state is gathered to rank 0 and stored in the one
   file (``state["rng"][rank]``), a few KiB per rank; one file is one atomic
   rename, where one file per rank could leave a mix of two steps after a crash.

Typical loop (the whole pattern is ``examples/resumable_train.py``)::

    state = TrainState(ddp_model, optimizer, scaler, scheduler=scheduler)
    state.load(path)                      # resumes if the file exists, else no-op
    while state.step < total_steps:
        ...one training step...
        state.step += 1
        if state.step % every == 0:
            state.save(path)              # every rank calls it (it gathers RNG states)

RNG and data loaders: a ``DataLoader`` draws a seed from the global RNG each
time an iterator is created. When resuming mid-epoch, build that epoch's
iterator and skip the done batches *before* restoring the RNG
(``load(path, restore_rng=False)`` ... ``restore_rng()``), or the resumed run is
one draw off. Another device count: ``map_location`` (default ``"cpu"`` here)
moves the tensors; the model and optimizer load unchanged; the RNG of a rank
that did not exist before cannot be restored and keeps its seed (a warning).
"""
from __future__ import annotations

import os
import pickle
import random
import tempfile
import warnings
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import wrappers

_SAFE_LEAVES = (torch.Tensor, int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device,
                torch.Size)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The file holds pickled objects that loading would have to execute; nothing ran."""


# --------------------------------------------------------------------------- atomic save, safe load

def save_checkpoint(path: str, **state: Any) -> None:
    """Write ``state`` (tensors, numbers, strings, dicts/lists of them) to ``path`` atomically.

    Under a process group every rank must call it: rank 0 writes, the others
    wait at a barrier until the file is in place. The wait is bounded by the
    process group's timeout and its error names the rank waited for.
    """
    if not state:
        raise ValueError("save_checkpoint(path, **state): give what to save, e.g. model=model.state_dict()")
    _check_loadable(state, "state")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        _atomic_save(state, os.fspath(path))
    if dist.is_initialized() and dist.get_world_size() > 1:
        _barrier(f"save_checkpoint({os.fspath(path)!r})")


def load_checkpoint(path: str, map_location=None) -> Dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``: tensors and plain data only.

    ``map_location`` moves tensors as they load (``"cpu"``, ``rank_device()``, or a
    dict such as ``{"cuda:1": "cuda:0"}``) — use it to load on another device count.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load_checkpoint: no checkpoint at {path!r} (nothing saved yet, or a wrong path)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "global" in line),
                      str(exc).splitlines()[0] if str(exc) else "")
        raise UnsafeCheckpointError(
            f"load_checkpoint: {path!r} carries pickled Python objects that loading would execute ({detail}). "
            "Refused: nothing in it ran. Checkpoints from save_checkpoint hold only tensors, numbers, strings "
            "and containers. Only if you made this file yourself and trust it: torch.load(path, weights_only=False)."
        ) from None


def _atomic_save(state: Dict[str, Any], path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never a mix
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if hasattr(os, "O_DIRECTORY"):  # POSIX: make the rename itself durable
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _check_loadable(obj: Any, where: str) -> None:
    """Refuse, before writing, what ``weights_only=True`` would refuse when loading."""
    if isinstance(obj, _SAFE_LEAVES):
        return
    if isinstance(obj, (dict, OrderedDict)):
        for key, value in obj.items():
            if not isinstance(key, (str, int, float, bool, type(None), tuple)):
                raise TypeError(f"save_checkpoint: {where} has a key of type {type(key).__name__}; use str or int keys")
            _check_loadable(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, (list, tuple, set)):
        for i, value in enumerate(obj):
            _check_loadable(value, f"{where}[{i}]")
        return
    if type(obj) in torch.serialization.get_safe_globals():
        return
    hint = " (store its .state_dict())" if hasattr(obj, "state_dict") else ""
    raise TypeError(
        f"save_checkpoint: {where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
        f"load_checkpoint (weights_only=True) would refuse{hint}. Save tensors, numbers, strings and containers."
    )


def _group_timeout() -> timedelta:
    try:
        pg = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return pg._get_backend(device).options._timeout
    except Exception:  # private API: fall back to torch's default
        return dist.distributed_c10d.default_pg_timeout


def _barrier(what: str) -> None:
    """Wait for every rank, bounded by the group's timeout; the error names who was waited for.

    On gloo, ``monitored_barrier``: rank 0 collects every other rank and names the
    ones that did not arrive; the others wait for rank 0. On NCCL a plain barrier
    (its watchdog enforces the timeout).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = _group_timeout()
    waited_for = f"ranks {list(range(1, world))}" if rank == 0 else "rank 0 (it writes the file)"
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier()
    except RuntimeError as exc:
        raise RuntimeError(f"rank {rank}: {what} waited up to {timeout.total_seconds():g} s for {waited_for} "
                           f"at the barrier after the write, and failed: {exc}") from exc


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

    ``model`` may be wrapped (torch DDP, NaiveDDP, BucketedDDP, FSDP, ``fully_shard``):
    the plain model's full state is saved, so the file loads into a plain model.
    ``optimizer``, ``scaler`` (``torch.amp.GradScaler`` or ``mgpu_lab.LossScaler``)
    and ``scheduler`` are anything with ``state_dict``/``load_state_dict``.
    ``step`` (optimizer steps done) and ``epoch`` (the sampler's epoch: pass it to
    ``set_epoch``) are yours to advance; ``extra`` holds other plain values.
    ``state_dict()`` and ``save()`` are collectives: every rank calls them; the state dict is
    complete on rank 0, the rank that writes.
    """

    def __init__(self, model: nn.Module, optimizer=None, scaler=None, step: int = 0, epoch: int = 0,
                 scheduler=None):
        wrappers.wrapper_kind(model)  # an unknown wrapper: a TypeError now, not a wrong checkpoint later
        self.model, self.optimizer, self.scaler, self.scheduler = model, optimizer, scaler, scheduler
        self.step, self.epoch = step, epoch
        self.extra: Dict[str, Any] = {}
        self._loaded_rng: Optional[List[Dict[str, Any]]] = None

    def state_dict(self) -> Dict[str, Any]:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        rngs: List[Any] = [None] * world
        if world > 1:  # every rank's RNG, gathered to the rank that writes
            dist.gather_object(rng_state(), rngs if rank == 0 else None, dst=0)
        else:
            rngs = [rng_state()]
        state = {"model": wrappers.model_state_dict(self.model, rank0_only=True), "step": self.step,
                 "epoch": self.epoch, "world_size": world, "rng": rngs, "extra": dict(self.extra)}
        if self.optimizer is not None:  # complete on rank 0 (the one that writes)
            state["optimizer"] = wrappers.optimizer_state_dict(self.model, self.optimizer)
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def save(self, path: str) -> None:
        """Every rank calls it; rank 0 writes ``path`` atomically."""
        save_checkpoint(path, **self.state_dict())

    def load(self, path: str, map_location="cpu", restore_rng: bool = True) -> bool:
        """Restore from ``path`` if it exists (True), else leave everything as is (False)."""
        if not os.path.exists(path):
            return False
        state = load_checkpoint(path, map_location=map_location)
        wrappers.load_model_state_dict(self.model, state["model"])
        if self.optimizer is not None:  # moves its state to the params' device
            wrappers.load_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        for name, part in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            if part is not None and name not in state:
                raise KeyError(f"{path} has no {name} state, but this TrainState has a {name}")
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch = state["step"], state["epoch"]
        self.extra = dict(state.get("extra", {}))
        self._loaded_rng = state["rng"]
        if restore_rng:
            self.restore_rng()
        return True

    def restore_rng(self) -> None:
        """Put back this rank's RNG state from the last ``load`` (see the module docstring)."""
        if self._loaded_rng is None:
            raise RuntimeError("restore_rng(): nothing loaded yet; call load(path) first")
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if len(self._loaded_rng) != world:
            warnings.warn(f"the checkpoint was written by {len(self._loaded_rng)} rank(s), this run has {world}: "
                          "model, optimizer and counters are restored, but random draws will not continue "
                          "bit for bit", stacklevel=2)
        if rank < len(self._loaded_rng):
            set_rng_state(self._loaded_rng[rank])
