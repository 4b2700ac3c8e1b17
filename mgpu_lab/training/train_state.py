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

5. **Generations that fall back**: ``keep=N`` keeps the newest N saves (``ckpt.pt``,
   ``ckpt.pt.1``, ...; :mod:`~mgpu_lab.training.generations`; sharded: N generation folders);
   ``load`` reads and checks them newest first (each file's SHA-256 too) and warns, naming the
   file, when it passes over an unreadable one, which it renames ``<name>.unreadable`` (set aside:
   the next save keeps the good ones). A save that died leaves temporary files the next save removes.
   Every failure is one :class:`~mgpu_lab.training.checkpoint_file.CheckpointError` naming
   the file, generation and step, the cause and what to do. ``load`` is strict, as torch's
   ``load_state_dict``: tensors the model lacks are refused by name (``strict=False``).

Typical loop (README's; the whole pattern is ``examples/resumable_train.py``)::

    state = TrainState(model, optimizer, scaler, scheduler=scheduler, dataloader=loader,
                       path="ckpt.pt", keep=3)            # a path no save could use: refused now
    state.load()                                         # resumes if a generation exists, else no-op
    for epoch in range(state.epoch, E):
        sampler.set_epoch(epoch)
        for x, y in loader:                              # after load: the rest of the saved epoch
            ...one micro-step; every K-th: an optimizer step and state.step += 1...
            if state.step % every == 0:
                state.save()                             # every rank calls it (it gathers RNG states)

RNG and data loaders: a ``DataLoader`` draws a seed from the global RNG when its
iterator is created (and a shuffling sampler another at the first batch), between the
model's draws. With ``dataloader=`` the checkpoint holds the loader's position in its epoch
and the generators' states as that epoch's iterator was made and at the save; the next
``iter(loader)`` after ``load`` replays the iterator's draws, skips the batches already
seen, then restores the saved generators: exact mid-epoch and at an epoch boundary
(:mod:`~mgpu_lab.training.loader_position`). Without it, ``load`` restores the RNG just
before the model's next forward, after the loop made its iterator and skipped what was
seen (``itertools.islice(loader, state.step * K, None)``): exact mid-epoch only, and data
drawn from the global RNG between ``load`` and that forward is drawn before the restore.
The RNG of a rank that did not exist when the checkpoint was written cannot be restored and
keeps its seed (a warning).
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import wrappers
from ..runtime.distributed import rank_and_world_size
from . import generations, sharded_checkpoint, state_dicts
from .checkpoint_file import (  # noqa: F401  (public here too: mgpu_lab.training.train_state.save_checkpoint)
    CheckpointError, UnsafeCheckpointError, _save_file, checkpoint_error, load_checkpoint, save_checkpoint,
)
from .loader_position import LoaderPosition, rng_state, set_rng_state  # noqa: F401  (rng_state: public here)


class TrainState:
    """Everything a training run needs to continue bit for bit, saved and restored together.

    ``model`` may be wrapped (torch DDP, NaiveDDP, BucketedDDP, FSDP, ``fully_shard``)
    or hold DTensors (``parallelize_module``, a 2-D mesh), or be one pipeline stage
    whose module keeps the full model's names. ``optimizer``, ``scaler``
    (``torch.amp.GradScaler`` or ``mgpu_lab.LossScaler``) and ``scheduler`` are
    anything with ``state_dict``/``load_state_dict``. ``step`` (optimizer steps done) is
    yours to advance; ``epoch`` is the epoch to run next or in progress (pass it to
    ``set_epoch``): with ``dataloader=`` it advances when the loader's epoch ends, else it is
    yours. ``extra`` holds other plain values. ``dataloader``: a ``DataLoader`` (or torchdata's
    ``StatefulDataLoader``) whose position and generators are saved, so that a resumed run
    continues mid-epoch or at an epoch boundary bit for bit (:mod:`~mgpu_lab.training.loader_position`).
    ``path``: where ``save()``/``load()`` go (checked now: a folder for a one-file checkpoint, ``""``,
    a folder no file can be made in are refused); ``keep``: how many generations to keep (an unreadable
    one is passed over and set aside as ``<name>.unreadable``).
    ``sharded=True`` saves a ``torch.distributed.checkpoint`` folder (each rank its pieces)
    instead of one file of full weights. ``state_dict()``, ``save()`` and ``load()`` are
    collectives: every rank calls them.
    """

    def __init__(self, model: nn.Module, optimizer=None, scaler=None, step: int = 0, epoch: int = 0,
                 scheduler=None, *, sharded: bool = False, dataloader=None, path: Optional[str] = None,
                 keep: int = 1):
        wrappers.wrapper_kind(model)  # an unknown wrapper: a TypeError now, not a wrong checkpoint later
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: the number of generations to keep, 1 or more")
        self.model, self.optimizer, self.scaler, self.scheduler = model, optimizer, scaler, scheduler
        self.step, self.epoch, self.sharded, self.keep = step, epoch, bool(sharded), keep
        self.path = None if path is None else os.fspath(path)
        if self.path is not None:
            _check_path(self.path, self.sharded)
        self.extra: Dict[str, Any] = {}
        self._loaded_rng: Optional[List[Dict[str, Any]]] = None
        self._rng_hook = None  # restores the loaded RNG at the model's next forward (no dataloader given)
        self._position = None if dataloader is None else LoaderPosition(dataloader, self)
        if self.path is not None:
            self._check_writable()

    def _check_writable(self) -> None:
        folder = self.path if self.sharded else os.path.dirname(os.path.abspath(self.path))
        if not self.sharded and rank_and_world_size()[0] != 0:
            return  # one file: rank 0 writes it
        try:
            generations.check_writable(folder)
        except OSError as exc:
            raise checkpoint_error("TrainState(path=...): the folder of", self.path, exc) from exc

    def _where(self, path: Optional[str]) -> str:
        if path is None and self.path is None:
            raise ValueError("give a path: save(path)/load(path), or TrainState(..., path=...)")
        return os.fspath(self.path if path is None else path)

    # ------------------------------------------------------------------ what is saved
    def _plain_state(self) -> Dict[str, Any]:
        """Everything but the tensors of model and optimizer, complete on rank 0."""
        if self._rng_hook is not None:  # saved before any forward since load: the loaded RNG
            self.restore_rng()
        pending = self._position is not None and self._position.resume is not None
        mine: Tuple[Any, Any] = (self._position.resume["now"]["global"] if pending else rng_state(),
                                 None if self._position is None else self._position.state())
        rank, world = rank_and_world_size()
        parts: List[Any] = [None] * world
        if world > 1:  # every rank's RNG and data position, gathered to the rank that writes
            dist.gather_object(mine, parts if rank == 0 else None, dst=0)
        else:
            parts = [mine]
        state = {"format": FORMAT, "layout": state_dicts.describe_layout(self.model), "step": self.step,
                 "epoch": self.epoch, "world_size": world, "rng": [p and p[0] for p in parts],
                 "extra": dict(self.extra)}
        if self._position is not None:
            state["data"] = [p and p[1] for p in parts]
            if rank == 0 and all(p[1]["epoch_done"] for p in parts):  # after the epoch's last batch (in the
                state["epoch"] = parts[0][1]["next_epoch"]                # loop or after it): resume at the next
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

    def save(self, path: Optional[str] = None) -> None:
        """Every rank calls it. One file: rank 0 writes ``path`` atomically, keeping ``keep`` generations
        (``path.1``, ...). ``sharded=True``: a folder ``path`` in which each rank writes its pieces (a new
        generation, switched to atomically). A failure raises :class:`CheckpointError`."""
        path = self._where(path)
        _check_path(path, self.sharded)  # a folder, "": refused before any collective, on every rank
        if not self.sharded:
            state = self.state_dict()
            if rank_and_world_size()[0] == 0:
                generations.clear_stale(path)
            _save_file(path, state, f"TrainState.save({path!r})", generation="new",
                       before_replace=lambda: generations.rotate(path, self.keep))
            return
        meta = self._plain_state()
        tensors = sharded_checkpoint.split_state(self.model, self.optimizer, meta)
        try:
            sharded_checkpoint.save(path, tensors, meta, self.step, f"TrainState.save({path!r})", self.keep)
        except CheckpointError:
            raise
        except (Exception, _dcp_failure()) as exc:
            raise checkpoint_error("saving", path, exc, "new", self.step) from exc

    # ------------------------------------------------------------------ loading
    def load(self, path: Optional[str] = None, map_location="cpu", restore_rng: bool = True,
             strict: bool = True) -> bool:
        """Restore from ``path`` if it exists (True), else leave everything as is (False).

        ``path`` is a one-file checkpoint or a sharded folder, written under any layout. Each
        generation is read and checked newest first; an unreadable one is passed over with a
        warning naming it. ``strict`` (torch's ``load_state_dict`` default): tensors the model
        lacks are refused. The RNG is restored at the next ``iter(dataloader)`` (``dataloader=``
        given) or the model's next forward (see the module docstring), or never with
        ``restore_rng=False`` (call ``restore_rng()`` yourself). A failure raises :class:`CheckpointError`."""
        path = self._where(path)
        sharded = os.path.isdir(path)
        if sharded:
            candidates = [(f, "newest" if i == 0 else f"{i} before the newest")
                          for i, f in enumerate(sharded_checkpoint.generations(path))]
            if not candidates and os.listdir(path) and not any(n.startswith(".step-") for n in os.listdir(path)):
                raise CheckpointError(f"{path!r} is a folder without checkpoint generations: not a "
                                      "TrainState(sharded=True) checkpoint; give another path", path=path)
        else:
            candidates = generations.existing(path)
        if not candidates:
            return False
        failures: List[Tuple[str, str, CheckpointError]] = []
        for where, generation in candidates:
            try:
                state, tensors = self._read(where, sharded, map_location)
                break
            except UnsafeCheckpointError:
                raise
            except CheckpointError as exc:
                exc.generation = generation
                failures.append((where, generation, exc))
            except (KeyError, ValueError) as exc:  # readable, but not this model's
                raise _misfit(where, generation, None, exc) from exc
        else:  # the advice is this error's alone: chained is the first generation's own exception (torch's)
            lines = "; ".join(f"{w} ({g} generation, step unknown): {e.cause}" for w, g, e in failures)
            raise CheckpointError(f"loading checkpoint {path!r} failed: {len(failures)} generation(s), none readable: "
                                  f"{lines}. What to do: restore a copy, or start afresh (delete them, or give "
                                  "another path); TrainState(..., keep=N) keeps N generations to fall back on",
                                  path=path, generation=failures[0][1],
                                  cause=failures[0][2].cause) from failures[0][2].__cause__ or failures[0][2]
        if failures:
            self._set_aside(failures, where, generation, state.get("step"))
        elif not sharded and candidates[0][0] != path and not os.path.exists(path + ".unreadable"):
            warnings.warn(f"TrainState.load: {path} is missing (a save was cut short between two renames); "
                          f"loaded {where} ({generation}, step {state.get('step')})", stacklevel=2)
        try:
            self._apply(state, tensors, where, sharded, strict)
        except CheckpointError:
            raise
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            raise _misfit(where, generation, state.get("step"), exc) from exc
        self._restore_counters(state, restore_rng)
        return True

    def _set_aside(self, failures, where: str, generation: str, step) -> None:
        """Rename the unreadable generations ``<name>.unreadable`` (rank 0, once every rank has read), so that
        the next save's rotation never keeps them in place of a good one; warn once (rank 0)."""
        rank, world = rank_and_world_size()
        if world > 1:  # nobody still reads a file rank 0 renames
            dist.barrier()
        if rank != 0:
            return
        bad, moved = [], []
        for file, bad_generation, exc in failures:
            bad.append(f"{file} ({bad_generation} generation) is unreadable: {exc.cause}")
            try:
                os.replace(file, file + ".unreadable")
                moved.append(f"{file}.unreadable")
            except OSError as err:
                moved.append(f"(not {file}: {err.strerror}, so the next save may rotate it)")
        warnings.warn(f"TrainState.load: {'; '.join(bad)}; loaded {where} ({generation}, step {step}) instead. "
                      f"Set aside as {', '.join(moved)}: not a generation any more (keep does not count it); "
                      "delete it, or keep it to inspect", stacklevel=3)

    def _read(self, where: str, sharded: bool, map_location) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
        """Read and check one generation: ``(state, tensors read by this rank)``; CheckpointError if unreadable."""
        if not sharded:
            state = load_checkpoint(where, map_location=map_location)
            if not isinstance(state, dict) or "model" not in state or "step" not in state:
                held = sorted(state)[:6] if isinstance(state, dict) else type(state).__name__
                raise CheckpointError(f"loading checkpoint {where!r} failed: not a TrainState checkpoint (it holds "
                                      f"{held}, no model and step). What to do: save_checkpoint(path, model=...) "
                                      "files load with load_checkpoint", path=where, cause="not a TrainState checkpoint")
            return state, {}
        state = load_checkpoint(os.path.join(where, "meta.pt"), map_location=map_location)
        try:
            sharded_checkpoint.verify(where, state)
            return state, sharded_checkpoint.read_tensors(self.model, self.optimizer, where, _holds(state))
        except (KeyError, ValueError):
            raise
        except (Exception, _dcp_failure()) as exc:  # DCP's CheckpointException is a BaseException
            raise checkpoint_error("loading", where, exc, step=state.get("step")) from exc

    def _apply(self, state: Dict[str, Any], tensors: Dict[str, torch.Tensor], where: str, sharded: bool,
               strict: bool) -> None:
        what = f"{where} ({_holds(state)})"
        model_state = ({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
                       if sharded else state["model"])
        state_dicts.load_model_state(self.model, model_state, what, strict)
        if self.optimizer is not None:
            if "optimizer" not in state:
                raise KeyError(f"{what} has no optimizer state: build TrainState without an optimizer to load it")
            if sharded:
                saved = state["optimizer"]
                opt = {n: dict(v) for n, v in saved["state"].items()}
                for key, value in tensors.items():
                    if key.startswith("optim/"):
                        n, k = key[len("optim/"):].rsplit("/", 1)
                        opt.setdefault(n, {})[k] = value
                state_dicts.load_optimizer_state(self.model, self.optimizer,
                                                 {"state": opt, "param_groups": saved["param_groups"]}, what)
            elif state.get("format", 1) >= 2:
                state_dicts.load_optimizer_state(self.model, self.optimizer, state["optimizer"], what)
            else:
                state_dicts.load_legacy_optimizer(self.model, self.optimizer, state, what)
        for name, part in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            if part is not None and name not in state:
                raise KeyError(f"{what} has no {name} state, but this TrainState has a {name}: "
                               f"resume without it, or from a checkpoint saved with one")
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def _restore_counters(self, state: Dict[str, Any], restore_rng: bool) -> None:
        self.step, self.epoch = state["step"], state["epoch"]
        self.extra = dict(state.get("extra", {}))
        self._loaded_rng = state["rng"]
        rank, world = rank_and_world_size()
        if self._rng_hook is not None:
            self._rng_hook.remove()
            self._rng_hook = None
        again = " and the data loader starts the saved epoch again" if self._position is not None else ""
        if len(self._loaded_rng) != world:
            warnings.warn(f"the checkpoint was written by {len(self._loaded_rng)} rank(s), this run has {world}: "
                          "model, optimizer and counters are restored, but random draws will not continue "
                          "bit for bit" + again, stacklevel=3)
        elif self._position is not None and state.get("data") is not None and restore_rng:
            if self._position.load(state["data"][rank], self._loaded_rng[rank]):
                return
            warnings.warn(f"rank {rank}: the loader's epoch has another number of batches than when the checkpoint "
                          "was written (another batch plan or data-parallel size): model, optimizer, counters and "
                          "the RNG are restored" + again, stacklevel=3)
        if restore_rng:
            self._rng_hook = self.model.register_forward_pre_hook(lambda module, args: self.restore_rng())

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


def _dcp_failure() -> type:
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException


def _check_path(path: str, sharded: bool) -> None:
    """Refuse a ``path=`` that no save could use, naming why (every rank: no file system access beyond a stat)."""
    if path == "":
        raise ValueError("TrainState path='': an empty path; give a file name such as 'ckpt.pt'"
                         + (" (sharded=True: a folder name)" if sharded else ""))
    if not sharded and os.path.isdir(path):
        raise ValueError(f"TrainState path={path!r}: that is a folder, and a one-file checkpoint is a file: give a "
                         f"file name inside it (e.g. {os.path.join(path, 'ckpt.pt')!r}), or sharded=True to save "
                         "a folder of generations there (a sharded checkpoint loads with load(folder) too)")
    if sharded and os.path.isfile(path):
        raise ValueError(f"TrainState path={path!r} (sharded=True): that is a file (a one-file checkpoint?), and a "
                         "sharded checkpoint is a folder: give a folder name (a file loads with load(file))")


def _misfit(where: str, generation: str, step, exc: Exception) -> CheckpointError:
    at = f"generation {generation}" + (f", step {step}" if step is not None else "")
    return CheckpointError(f"loading checkpoint {where!r} ({at}) failed: {exc.args[0] if exc.args else exc}",
                           path=where, generation=generation, step=step, cause="does not fit this TrainState")


def _holds(state: Dict[str, Any]) -> str:
    """What a checkpoint holds, in words, for error messages."""
    layout = state.get("layout") or f"{state.get('world_size', '?')} rank(s), layout not recorded"
    return f"step {state.get('step', '?')}, saved under {layout}, format {state.get('format', 1)}"
