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
   is chained to it as ``__cause__``. Under a process group a failed write raises on every
   rank: rank 0 sends the outcome to the others before the barrier.
4. **Checked**: ``torch.load`` does not check the zip's CRCs, so a flipped byte inside a tensor
   would load silently. Each file ends with its SHA-256 (the zip's comment, computed as it is
   written); ``load_checkpoint`` checks it first: a mismatch is "corrupt (its checksum differs)".

:class:`~mgpu_lab.training.train_state.TrainState` writes its one-file checkpoints with these.
"""
from __future__ import annotations

import errno
import hashlib
import os
import pickle
import struct
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


TRUNCATED_TODO = "restore a copy, or load an older generation (TrainState(..., keep=N) keeps N), or delete the file"


class ChecksumMismatch(Exception):
    """The file's SHA-256 is not the one recorded when it was written."""


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
    if any(isinstance(e, ChecksumMismatch) for e in chain):
        return ("corrupt (its checksum differs: bytes changed after the save, e.g. a damaged disk or copy)",
                TRUNCATED_TODO)
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
        return ("truncated or corrupt (a save that did not finish, or a damaged copy)", TRUNCATED_TODO)
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
    step = state.get("step") if isinstance(state.get("step"), int) else None
    rank0_writes(lambda: write_atomically(path, lambda f: save_with_checksum(state, f), before_replace),
                 path, what, generation, step)


def rank0_writes(write, path: str, what: str, generation=None, step=None) -> None:
    """Rank 0 runs ``write()``; then every rank learns whether it succeeded (rank 0 sends the outcome)
    and waits at the barrier. A failure raises :class:`CheckpointError` on every rank: on rank 0 the
    cause, on the others that rank 0's save failed, with its message."""
    rank, world = rank_and_world_size()
    error: Optional[CheckpointError] = None
    if rank == 0:
        try:
            write()
        except Exception as exc:
            error = checkpoint_error("saving", path, exc, generation, step)
    if world > 1:
        outcome = [None if error is None else str(error)]
        try:
            dist.broadcast_object_list(outcome, src=0)
        except RuntimeError as exc:
            raise _waited(what, "rank 0 (it writes the file)" if rank else f"ranks {list(range(1, world))}",
                          "for the outcome of the write", exc) from exc
        if outcome[0] is not None and rank != 0:
            raise CheckpointError(f"rank {rank}: {what}: rank 0's save failed (see its error; the other ranks "
                                  f"raise this one). Rank 0: {outcome[0]}", path=path, generation=generation,
                                  step=step, cause="rank 0's save failed")
    if error is not None:
        raise error
    if world > 1:
        _barrier(what)


# --------------------------------------------------------------------------- checksums
# torch.load does not check the zip's CRCs: a flipped byte inside a tensor loads silently. Every
# file written here ends with its SHA-256, as the zip archive's comment (a zip may end with one,
# so torch.load, zipfile and unzip read the file as before): "mgpu_lab-sha256:<64 hex digits>",
# the digest of every byte before the comment. It is computed as the bytes are written (no second
# read at save); load hashes the file before torch.load reads it (a second read, from the page cache).
_MARK = b"mgpu_lab-sha256:"
_COMMENT = len(_MARK) + 64
_EOCD = 22  # a zip's end-of-central-directory record without a comment (also after a zip64 one)


class _Checksummed:
    """A binary file that hashes what goes through it and holds back the last 22 bytes (the zip's end
    record), so that ``finish()`` can give the archive its comment: the digest."""

    def __init__(self, f):
        self._f, self._hash, self._tail = f, hashlib.sha256(), b""

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n >= _EOCD:
            self._put(self._tail)
            self._put(view[:n - _EOCD])
            self._tail = bytes(view[n - _EOCD:])
        else:
            joined = self._tail + bytes(view)
            self._put(joined[:-_EOCD] if len(joined) > _EOCD else b"")
            self._tail = joined[-_EOCD:]
        return n

    def _put(self, data) -> None:
        if len(data):
            self._hash.update(data)
            self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def finish(self) -> None:
        end = self._tail
        if len(end) != _EOCD or end[:4] != b"PK\x05\x06" or end[20:22] != b"\0\0":
            raise RuntimeError("torch.save did not end its file with a zip end record: cannot add a checksum")
        end = end[:20] + struct.pack("<H", _COMMENT)
        self._hash.update(end)
        self._f.write(end + _MARK + self._hash.hexdigest().encode())


def save_with_checksum(obj: Any, f) -> None:
    """``torch.save(obj, f)``, the file ending with its SHA-256 (the zip's comment)."""
    writer = _Checksummed(f)
    torch.save(obj, writer)
    writer.finish()


def verify_checksum(path: str) -> Optional[bool]:
    """True if ``path``'s bytes match the SHA-256 it ends with, False if not, None if it has none
    (written by plain torch.save, or cut short before its end)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < _EOCD + _COMMENT:
            return None
        f.seek(size - _COMMENT)
        comment = f.read(_COMMENT)
        if not comment.startswith(_MARK):
            return None
        f.seek(0)
        digest, left = hashlib.sha256(), size - _COMMENT
        while left:
            chunk = f.read(min(left, 1 << 22))
            if not chunk:
                return False
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest().encode() == comment[len(_MARK):]


def load_checkpoint(path: str, map_location=None) -> Dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``: tensors and plain data only.

    ``map_location`` moves tensors as they load (``"cpu"``, ``rank_device()``, or a
    dict such as ``{"cuda:1": "cuda:0"}``) — use it to load on another device count.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load_checkpoint: no checkpoint at {path!r} (nothing saved yet, or a wrong path)")
    try:
        if verify_checksum(path) is False:
            raise ChecksumMismatch(f"{path}: its SHA-256 is not the one recorded when it was written")
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
    waited_for = f"ranks {list(range(1, world))}" if rank == 0 else "rank 0 (it writes the file)"
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=_group_timeout(), wait_all_ranks=True)
        else:
            dist.barrier()
    except RuntimeError as exc:
        raise _waited(what, waited_for, "at the barrier after the write", exc) from exc


def _waited(what: str, waited_for: str, where: str, exc: BaseException) -> RuntimeError:
    """The error of a collective of a save that failed: a dead (or departed) peer, or a timeout."""
    rank = dist.get_rank()
    if peer_died(str(exc)):  # not a slow peer: a dead (or departed) one
        return RuntimeError(f"rank {rank}: {what} waited for {waited_for} {where}, and one of them died or left "
                            f"({str(exc).strip().splitlines()[0]}). This rank is fine: the cause is in that rank's "
                            "own output (an exception, a death by signal, or it returned without calling save)")
    return RuntimeError(f"rank {rank}: {what} waited up to {_group_timeout().total_seconds():g} s for {waited_for} "
                        f"{where}, and failed: {exc}")
