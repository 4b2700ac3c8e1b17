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
newest first; when it passes one over (unreadable: truncated, not a checkpoint, its SHA-256
differs) and loads an older one, it renames the bad one ``<name>.unreadable`` and warns once,
naming both: set aside, it is no generation, so the next save's rotation keeps the good ones. The temporary files
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
    (the new one, then the ones on disk newest first as ``path.1``, ``path.2``, ...: a missing number,
    e.g. a newest set aside as unreadable, leaves no gap and costs no good generation). Rank 0 only."""
    folder = os.path.dirname(os.path.abspath(path))
    olds = [name for name, _ in existing(path)]          # newest first: each gets the number of its rank
    for name in olds[max(keep - 1, 0):]:                 # those beyond keep go (path: the new file replaces it)
        if name != path:
            os.unlink(name)
    olds = olds[:max(keep - 1, 0)]
    number = [0 if name == path else int(name.rsplit(".", 1)[1]) for name in olds]
    down = [i for i in range(len(olds)) if number[i] > i + 1]   # to a smaller number (a gap before it)
    up = [i for i in range(len(olds)) if number[i] == i]        # to the next number (path -> path.1, ...)
    for i in down:                                       # in this order no move lands on a file not yet moved
        os.replace(olds[i], older(path, i + 1))
    for i in reversed(up):
        if olds[i] != path:
            os.replace(olds[i], older(path, i + 1))
            continue
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
    try:
        fd, probe = tempfile.mkstemp(prefix=".mgpu_lab-probe.", suffix=".tmp", dir=folder)
    except FileNotFoundError as exc:  # the folder is there (made just above): its file system makes no files
        raise OSError(errno.ENOTSUP, "the folder exists, but its file system creates no files in it (a virtual "
                      "file system such as /proc or /sys?)", folder) from exc
    os.close(fd)
    os.unlink(probe)
