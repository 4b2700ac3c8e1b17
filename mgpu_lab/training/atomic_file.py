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
from typing import BinaryIO, Callable


def write_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Create or replace ``path`` with what ``write(f)`` writes to a binary file ``f``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(folder)


def fsync_dir(folder: str) -> None:
    """Make the renames and removals inside ``folder`` durable (POSIX; nothing elsewhere)."""
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
