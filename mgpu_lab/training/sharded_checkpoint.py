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
pointing at a complete generation. After the switch, generations beyond the newest ``keep``
and the temporary folders of saves that died are removed. ``generations`` lists them newest
first (``latest``'s, then the others by step), for a load that falls back when one is unreadable.
``meta.pt`` holds what is not a tensor (step, RNG states, scheduler, parameter groups),
written by rank 0 atomically (``atomic_file.py``, as ``save_checkpoint`` writes, ending with its
SHA-256), with the SHA-256 of each of DCP's files (rank 0 reads them once more at the save; every
loading rank reads them once more to check). Tensors live under ``model/<name>`` and
``optim/<name>/<state key>``. A generation ``load`` found unreadable is renamed ``<name>.unreadable``.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..runtime.distributed import rank_and_world_size
from .atomic_file import fsync_dir, write_atomically
from .checkpoint_file import save_with_checksum

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


def generations(path: str) -> List[str]:
    """The generation folders under ``path``, newest first: ``latest``'s, then the others by step."""
    try:
        names = [n for n in os.listdir(path) if n.startswith("step-") and not n.endswith(".unreadable")
                 and os.path.isdir(os.path.join(path, n))]
    except OSError:
        return []
    names.sort(key=lambda n: (n.split("-")[1], os.path.getmtime(os.path.join(path, n))), reverse=True)
    folders = [os.path.join(path, n) for n in names]
    try:
        newest = latest(path)
    except FileNotFoundError:
        newest = None
    if newest is not None and newest in folders:
        folders.remove(newest)
        folders.insert(0, newest)
    return folders


def save(path: str, tensors: Dict[str, torch.Tensor], meta: Dict[str, Any], step: int,
         what: str, keep: int = 1) -> str:
    """Every rank calls it with its own ``tensors``; rank 0 also writes ``meta``. Returns the folder.
    A failure of rank 0's part raises :class:`CheckpointError` on every rank (``rank0_writes``)."""
    import torch.distributed.checkpoint as dcp
    from .checkpoint_file import rank0_writes
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

    def finish() -> None:  # rank 0, once every rank's pieces are written
        meta["sha256"] = {n: file_sha256(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))
                          if os.path.isfile(os.path.join(tmp, n)) and n != "meta.pt"}
        write_atomically(os.path.join(tmp, "meta.pt"), lambda f: save_with_checksum(meta, f))
        fsync_dir(tmp)
        os.replace(tmp, final)               # 1. the generation is complete under its name
        fsync_dir(path)
        _write_text(os.path.join(path, LATEST), name[0] + "\n")   # 2. the switch
        for old in generations(path)[keep:]:  # 3. generations beyond keep, and interrupted saves
            _remove_tree(old)
        for old in os.listdir(path):
            if old.startswith(".step-") and old != name[0]:
                _remove_tree(os.path.join(path, old))
    rank0_writes(finish, path, what, "new", step)
    return final


def file_sha256(file: str) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify(folder: str, meta: Dict[str, Any]) -> None:
    """Raise ``ChecksumMismatch`` naming the first file of the generation whose SHA-256 differs from the one
    recorded at the save (generations saved before checksums were recorded: nothing to check)."""
    from .checkpoint_file import ChecksumMismatch
    for name, digest in (meta.get("sha256") or {}).items():
        if file_sha256(os.path.join(folder, name)) != digest:
            raise ChecksumMismatch(f"{os.path.join(folder, name)}: its SHA-256 is not the one recorded at the save")


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


def read_tensors(model, optimizer, folder: str, holds: str) -> Dict[str, torch.Tensor]:
    """This rank's pieces of the model's tensors (``model/<name>``) and of the optimizer's state
    (``optim/<name>/<key>``), read from the generation ``folder``, allocated as this layout holds
    them. KeyError if the model has a tensor the generation lacks."""
    from ..parallel import wrappers
    from . import state_dicts
    what = f"{folder} ({holds})"
    have = stored(folder)
    model_targets = wrappers.unwrap(model).state_dict()  # this rank's pieces (mgpu_lab FSDP: whole tensors)
    missing = [k for k in model_targets if f"model/{k}" not in have]
    if missing:
        raise KeyError(f"{what} has no {missing[:5]}: it holds "
                       f"{sum(k.startswith('model/') for k in have)} model tensors; build the same model")
    targets = {f"model/{k}": torch.empty_like(t) for k, t in model_targets.items()}
    opt_keys = optimizer_keys(have)
    if optimizer is not None:
        names, groups = state_dicts.parameter_names(model), state_dicts._fsdp_groups(model)
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            for n in names.get(id(p), []):
                for k in opt_keys.get(n, []):
                    md = have[f"optim/{n}/{k}"]
                    size, dtype = tuple(md.size), md.properties.dtype
                    if id(p) not in groups and len(size) > 0 and size == tuple(p.shape):
                        targets[f"optim/{n}/{k}"] = torch.empty_like(p, dtype=dtype)
                    else:
                        targets[f"optim/{n}/{k}"] = torch.empty(size, dtype=dtype, device=p.device)
    load(folder, targets)
    # strict loading needs the names the model lacks too: the stored names, without their tensors
    targets.update({k: None for k in have if k.startswith("model/") and k not in targets})  # type: ignore[misc]
    return targets


def split_state(model, optimizer, meta: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """This rank's tensors to save (``model/<name>``, ``optim/<name>/<key>``: DTensor pieces as they
    are); the optimizer's plain values (steps, parameter groups) go into ``meta`` on rank 0."""
    from . import state_dicts
    tensors = {f"model/{k}": v for k, v in state_dicts.model_state(model, full=False).items()}
    if optimizer is None:
        return tensors
    opt = state_dicts.optimizer_state(model, optimizer, full=False)
    plain: Dict[str, Dict[str, Any]] = {}
    for name, st in (opt or {"state": {}})["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                tensors[f"optim/{name}/{key}"] = value
            else:
                plain.setdefault(name, {})[key] = value
    merged = state_dicts.merge_optimizer_on_rank0(
        model, optimizer, {"state": plain, "param_groups": opt["param_groups"]} if opt else None)
    if merged is not None:
        meta["optimizer"] = merged
    return tensors
