"""Writing one file so that a crash never leaves half of it.

The bytes go to a temporary file in the same folder, which is flushed and fsynced;
``os.replace`` then puts it under its name (a rename is atomic on one file system:
readers see the old file or the new one, never a mix), and the folder is fsynced so
that the rename itself survives a power cut. A crash or a SIGKILL mid-write leaves the
previous file whole, and at worst a stray ``.NAME.*.tmp`` beside it.
"""
from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable, Optional


class _Recording:
    """The open file, remembering the first ``OSError`` of a write: ``torch.save`` reports a failed
    write as its own "unexpected pos ..." and drops the errno (ENOSPC, EDQUOT) that says why."""

    def __init__(self, f: BinaryIO):
        self._f, self.error = f, None  # type: BinaryIO, Optional[OSError]

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name):
        return getattr(self._f, name)


def write_atomically(path: str, write: Callable[[BinaryIO], None],
                     before_replace: Optional[Callable[[], None]] = None) -> None:
    """Create or replace ``path`` with what ``write(f)`` writes to a binary file ``f``;
    ``before_replace()`` runs once the bytes are on disk, just before the rename (to keep generations)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            recording = _Recording(f)
            try:
                write(recording)  # type: ignore[arg-type]
            except Exception as exc:
                if recording.error is not None and recording.error is not exc:
                    raise recording.error from exc  # the OS's reason (ENOSPC), not the serializer's words
                raise
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(folder)


def remove_stale(folder: str, prefix: str) -> None:
    """Remove the ``PREFIX*.tmp`` files and folders a killed save left in ``folder`` (only one writer
    saves to a path at a time, so any such name is a dead save's)."""
    import shutil
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix) and name.endswith(".tmp"):
            full = os.path.join(folder, name)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full, ignore_errors=True)
            else:
                try:
                    os.unlink(full)
                except OSError:
                    pass


def fsync_dir(folder: str) -> None:
    """Make the renames and removals inside ``folder`` durable (POSIX; nothing elsewhere)."""
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
