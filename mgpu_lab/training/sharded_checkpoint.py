"""A ``torch.distributed.checkpoint`` directory, written atomically: each rank its own pieces.

A one-file checkpoint gathers every tensor whole on rank 0: fine for a model that fits
one process, impossible for one that does not. ``torch.distributed.checkpoint`` (DCP)
lets each rank write its own pieces (DTensor shards, each plain tensor once) and read
back whatever pieces the *loading* layout needs: another mesh shape, another number of
ranks, any mix of DTensor and whole tensors, because every tensor is stored under its
plain name with its global shape and the offsets of each piece.

A directory cannot be renamed over another atomically, so the checkpoint ``path`` is a
folder of generations::

    path/latest                 "step-00000012-5f3a": the one to load (replaced atomically)
    path/step-00000012-5f3a/    DCP's files (.metadata, one .distcp per rank) + meta.pt
    path/.step-....tmp/         a save in progress (or one a crash interrupted)

``save`` writes a new generation under a temporary name, then rank 0 renames it and
replaces ``latest`` (two atomic renames): a crash at any moment leaves ``latest``
pointing at a complete generation. Older generations are removed after the switch.
``meta.pt`` holds what is not a tensor (step, RNG states, scheduler, parameter groups),
written by rank 0 atomically (``atomic_file.py``, as ``save_checkpoint`` writes). Tensors
live under ``model/<name>`` and ``optim/<name>/<state key>``.
"""
from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..runtime.distributed import rank_and_world_size
from .atomic_file import fsync_dir, write_atomically

LATEST = "latest"


def _write_text(path: str, text: str) -> None:
    write_atomically(path, lambda f: f.write(text.encode()))


def latest(path: str) -> Optional[str]:
    """The folder of the newest complete generation under ``path``, or None."""
    pointer = os.path.join(path, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    folder = os.path.join(path, name)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{pointer} names {name!r}, which is not there: the folder was changed by hand")
    return folder


def save(path: str, tensors: Dict[str, torch.Tensor], meta: Dict[str, Any], step: int,
         barrier: Callable[[str], None]) -> str:
    """Every rank calls it with its own ``tensors``; rank 0 also writes ``meta``. Returns the folder."""
    import torch.distributed.checkpoint as dcp
    path = os.fspath(path)
    if os.path.isfile(path):
        raise FileExistsError(f"{path!r} is a file (a one-file checkpoint): a sharded checkpoint is a folder; "
                              "give another path")
    name = [f"step-{step:08d}-{uuid.uuid4().hex[:6]}"]
    if rank_and_world_size()[1] > 1:
        dist.broadcast_object_list(name, src=0)  # every rank writes into the same folder
    tmp, final = os.path.join(path, f".{name[0]}.tmp"), os.path.join(path, name[0])
    os.makedirs(tmp, exist_ok=True)
    dcp.save(tensors, checkpoint_id=tmp, no_dist=not dist.is_initialized())
    if rank_and_world_size()[0] == 0:
        write_atomically(os.path.join(tmp, "meta.pt"), lambda f: torch.save(meta, f))
        fsync_dir(tmp)
        os.replace(tmp, final)               # 1. the generation is complete under its name
        fsync_dir(path)
        _write_text(os.path.join(path, LATEST), name[0] + "\n")   # 2. the switch
        for old in os.listdir(path):         # 3. older generations and interrupted saves
            if old.startswith(("step-", ".step-")) and old != name[0]:
                _remove_tree(os.path.join(path, old))
    if rank_and_world_size()[1] > 1:
        barrier(f"TrainState.save({path!r})")
    return final


def _remove_tree(folder: str) -> None:
    import shutil
    shutil.rmtree(folder, ignore_errors=True)


def stored(folder: str) -> Dict[str, Any]:
    """``{key: TensorStorageMetadata}`` of the tensors in a generation (global shapes, dtypes)."""
    from torch.distributed.checkpoint import FileSystemReader
    return dict(FileSystemReader(folder).read_metadata().state_dict_metadata)


def load(folder: str, targets: Dict[str, torch.Tensor]) -> None:
    """Fill ``targets`` (this rank's pieces, allocated as the loading layout holds them) in place."""
    import torch.distributed.checkpoint as dcp
    dcp.load(targets, checkpoint_id=folder, no_dist=not dist.is_initialized())


def optimizer_keys(metadata: Dict[str, Any]) -> Dict[str, List[str]]:
    """``{parameter name: [state keys]}`` stored under ``optim/<name>/<key>``."""
    out: Dict[str, List[str]] = {}
    for key in metadata:
        if key.startswith("optim/"):
            name, k = key[len("optim/"):].rsplit("/", 1)
            out.setdefault(name, []).append(k)
    return out
