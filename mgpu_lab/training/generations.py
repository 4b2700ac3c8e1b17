"""Generations of a one-file checkpoint: the newest N kept, an unreadable newest passed over.

One file is one point of failure: a save that was cut short (a full disk, a crash between the
write and the rename on a file system that does not order them, a damaged copy) leaves nothing
to resume from. ``TrainState(..., keep=N)`` keeps the newest N saves, logrotate's way::

    ckpt.pt      the newest (what load_checkpoint("ckpt.pt") and any other reader open)
    ckpt.pt.1    the one before
    ckpt.pt.2    ...up to ckpt.pt.<N-1>

A save writes the new file under a temporary name first (``atomic_file``), then shifts the
older names up by one, hard-links the current ``ckpt.pt`` as ``ckpt.pt.1``, and renames the new
file over ``ckpt.pt``: at every moment each name holds a complete file. ``load`` tries them
newest first and warns, naming the file and why, when it passes one over. The temporary files
of a save that was killed (``.ckpt.pt.*.tmp``) are removed by the next save.
"""
from __future__ import annotations

import errno
import os
import re
import tempfile
from typing import List, Tuple

from .atomic_file import fsync_dir, remove_stale


def older(path: str, i: int) -> str:
    return f"{path}.{i}"


def existing(path: str) -> List[Tuple[str, str]]:
    """``[(file, generation in words)]`` of ``path``'s generations on disk, newest first."""
    folder, base = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(base) + r"\.(\d+)$")
    try:
        numbers = sorted(int(m.group(1)) for m in map(pattern.match, os.listdir(folder)) if m)
    except OSError:
        numbers = []
    found = [(path, "newest")] if os.path.isfile(path) else []
    return found + [(older(path, i), f"{i} before the newest") for i in numbers if os.path.isfile(older(path, i))]


def clear_stale(path: str) -> None:
    """The temporary files a killed save of ``path`` left (``.ckpt.pt.<random>.tmp``)."""
    folder, base = os.path.split(os.path.abspath(path))
    remove_stale(folder, f".{base}.")


def rotate(path: str, keep: int) -> None:
    """Before a new file is renamed over ``path``: make room so that ``keep`` generations remain
    (the new one, ``path`` as ``path.1``, ...). Rank 0 only."""
    folder = os.path.dirname(os.path.abspath(path))
    for name, _ in existing(path):  # those that would be shifted beyond keep go
        if name != path and int(name.rsplit(".", 1)[1]) >= keep - 1:
            os.unlink(name)
    for i in range(keep - 2, 0, -1):
        if os.path.isfile(older(path, i)):
            os.replace(older(path, i), older(path, i + 1))
    if keep > 1 and os.path.isfile(path):
        link = os.path.join(folder, f".{os.path.basename(path)}.rotate.tmp")  # a dead save's: clear_stale removed it
        try:
            os.link(path, link)          # path stays whole; its second name becomes path.1
            os.replace(link, older(path, 1))
        except OSError:                  # no hard links here: a moment without path (load falls back)
            os.replace(path, older(path, 1))
    fsync_dir(folder)


def check_writable(folder: str) -> None:
    """Create ``folder`` if needed and write one small file in it: an unwritable folder fails now,
    not at the first save an hour later. Raises the OSError."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", folder)
    os.makedirs(folder, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".mgpu_lab-probe.", suffix=".tmp", dir=folder)
    os.close(fd)
    os.unlink(probe)
