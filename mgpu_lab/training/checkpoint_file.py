"""One checkpoint file: written atomically, loaded without running code from it.

1. **Atomic**: ``save_checkpoint`` writes to a temporary file in the same folder,
   flushes and fsyncs it, then ``os.replace``-s it over the old name (a rename
   is atomic on one file system) and fsyncs the folder so the rename itself
   survives a power cut (``atomic_file.py``). A crash or a SIGKILL mid-write leaves
   the previous checkpoint whole (and at worst a stray ``.NAME.*.tmp`` file). Under a process
   group only rank 0 writes; the others wait at a barrier until it is done, so
   nobody reads a file that is not there yet. Cost: one file write and one
   barrier per save.
2. **Safe to load**: a ``.pt`` file is a pickle, and unpickling can call any
   function (``os.system`` included). ``load_checkpoint`` uses
   ``torch.load(weights_only=True)``, which only rebuilds tensors, numbers,
   strings and containers; a file that carries anything else is refused with
   ``UnsafeCheckpointError`` before any of it runs. ``save_checkpoint`` refuses to
   write such objects in the first place (store ``obj.state_dict()`` instead).
3. **Failures that say what happened**: a save or a load that fails raises one
   :class:`CheckpointError` naming the file, the generation and the step, the cause in
   words (truncated, not a checkpoint, out of disk, permission) and what to do; torch's
   own exception (``EOFError``, "PytorchStreamReader failed ...", "unexpected pos ...")
   is chained to it as ``__cause__``.

:class:`~mgpu_lab.training.train_state.TrainState` writes its one-file checkpoints with these.
"""
from __future__ import annotations

import errno
import os
import pickle
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..runtime._diagnosis import peer_died
from ..runtime.distributed import rank_and_world_size
from .atomic_file import write_atomically

_SAFE_LEAVES = (torch.Tensor, int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device,
                torch.Size)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded. The message names the file, the generation and the
    step, the cause and what to do; ``path``, ``generation``, ``step`` and ``cause`` hold them, and the
    original exception is ``__cause__``."""

    def __init__(self, message: str, *, path: Optional[str] = None, generation: Optional[str] = None,
                 step: Optional[int] = None, cause: str = ""):
        super().__init__(message)
        self.path, self.generation, self.step, self.cause = path, generation, step, cause


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """The file holds pickled objects that loading would have to execute; nothing ran."""


def failure_cause(exc: BaseException) -> Tuple[str, str]:
    """``(cause, what to do)`` in words for an exception raised while writing or reading a file."""
    chain, e = [], exc  # the OS's errno may sit below torch's words
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return ("out of disk space (or over quota)",
                    "free space there or save elsewhere; the previous generations are untouched")
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return ("permission denied (or a read-only file system)",
                    "save into a folder this user can write, or fix its permissions")
        if isinstance(e, (NotADirectoryError, IsADirectoryError, FileExistsError)):
            return (f"a path component is not a folder ({e.strerror}: {e.filename})",
                    "give a path whose folders are folders (or can be created)")
    text = " ".join(str(e) for e in chain)  # DCP's CheckpointException holds its ranks' errors as text
    if "No space left on device" in text or "Disk quota exceeded" in text:
        return ("out of disk space (or over quota)",
                "free space there or save elsewhere; the previous generations are untouched")
    if "Permission denied" in text or "Read-only file system" in text:
        return ("permission denied (or a read-only file system)",
                "save into a folder this user can write, or fix its permissions")
    if any(isinstance(e, EOFError) or (isinstance(e, OSError) and e.errno == errno.EINVAL) for e in chain) or any(
            w in text for w in ("truncated", "central directory", "failed reading zip", "file not found: archive",
                                "Ran out of input", "unexpected EOF", "checksum", "CRC")):
        return ("truncated or corrupt (a save that did not finish, or a damaged copy)",
                "load an older generation (TrainState(..., keep=N) keeps and falls back to them) or delete the file")
    if any(isinstance(e, (pickle.UnpicklingError, KeyError)) for e in chain) or "invalid load key" in text:
        return ("not a checkpoint (not a file torch.save wrote)", "check the path")
    if isinstance(exc, OSError):
        return (f"{exc.strerror or exc}", "check the path and the file system")
    return (f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            "see the chained exception")


def checkpoint_error(action: str, path: str, exc: BaseException, generation: Optional[str] = None,
                     step: Optional[int] = None) -> CheckpointError:
    """A :class:`CheckpointError` for ``exc``, raised while ``action`` ("saving", "loading") ``path``."""
    cause, todo = failure_cause(exc)
    where = ", ".join(x for x in (f"generation {generation}" if generation is not None else "",
                                  f"step {step}" if step is not None else "") if x)
    err = CheckpointError(f"{action} checkpoint {path!r}{f' ({where})' if where else ''} failed: {cause}. "
                          f"What to do: {todo}.", path=path, generation=generation, step=step, cause=cause)
    err.__cause__ = exc
    return err


# --------------------------------------------------------------------------- atomic save, safe load

def save_checkpoint(path: str, **state: Any) -> None:
    """Write ``state`` (tensors, numbers, strings, dicts/lists of them) to ``path`` atomically.

    Under a process group every rank must call it: rank 0 writes, the others
    wait at a barrier until the file is in place. The wait is bounded by the
    process group's timeout and its error names the rank waited for.
    """
    if not state:
        raise ValueError("save_checkpoint(path, **state): give what to save, e.g. model=model.state_dict()")
    _save_file(os.fspath(path), state, f"save_checkpoint({os.fspath(path)!r})")


def _save_file(path: str, state: Dict[str, Any], what: str, before_replace=None, generation=None) -> None:
    """``save_checkpoint``'s work; ``before_replace`` (rank 0, after the write, before the rename)."""
    _check_loadable(state, "state")
    rank, world = rank_and_world_size()
    if rank == 0:
        try:
            write_atomically(path, lambda f: torch.save(state, f), before_replace)
        except Exception as exc:
            step = state.get("step") if isinstance(state.get("step"), int) else None
            raise checkpoint_error("saving", path, exc, generation, step) from exc
    if world > 1:
        _barrier(what)


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
        if "GLOBAL" not in str(exc) and "global" not in str(exc):  # e.g. "Unsupported operand": garbage
            raise checkpoint_error("loading", path, exc) from exc  # damaged, not unsafe
        detail = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "global" in line),
                      str(exc).splitlines()[0] if str(exc) else "")
        raise UnsafeCheckpointError(
            f"load_checkpoint: {path!r} carries pickled Python objects that loading would execute ({detail}). "
            "Refused: nothing in it ran. Checkpoints from save_checkpoint hold only tensors, numbers, strings "
            "and containers. Only if you made this file yourself and trust it: torch.load(path, weights_only=False).",
            path=path, cause="pickled code") from None
    except Exception as exc:  # EOFError, "PytorchStreamReader failed ...", a KeyError from a garbled pickle
        raise checkpoint_error("loading", path, exc) from exc


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
        if peer_died(str(exc)):  # not a slow peer: a dead (or departed) one
            raise RuntimeError(f"rank {rank}: {what} waited for {waited_for} at the barrier after the write, and "
                               f"one of them died or left ({str(exc).strip().splitlines()[0]}). This rank is fine: "
                               "the cause is in that rank's own output (an exception, a death by signal, or it "
                               "returned without calling save)") from exc
        raise RuntimeError(f"rank {rank}: {what} waited up to {timeout.total_seconds():g} s for {waited_for} "
                           f"at the barrier after the write, and failed: {exc}") from exc
