"""Devices and backends: what this machine has, and the CPU "virtual cluster".

On a machine with GPUs, each device is a ``cuda:i`` and processes talk over
NCCL. On a laptop there are no GPUs, so the labs use *virtual devices*: several
workers on the CPU (threads for DataParallel, processes for DDP) that talk over
gloo. The algorithms are the same; only the speed differs.

    >>> devices()          # no GPU: two virtual devices on the CPU
    [device(type='cpu'), device(type='cpu')]
    >>> backend()
    'gloo'
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

DEFAULT_VIRTUAL_DEVICES = 2

Devices = Optional[Sequence[Any]]  # device_ids as users write them: ints, strings, torch.devices, or None


def gpu_count() -> int:
    """How many CUDA GPUs this process can see (honours CUDA_VISIBLE_DEVICES).

    Asked through ``torch.cuda.device_count()``, which uses NVML when it can and
    so neither creates a CUDA context nor "poisons" later forks, unlike
    ``torch.cuda.is_available()`` (which calls ``cuInit``).
    """
    return torch.cuda.device_count() if torch.cuda._is_compiled() else 0


def devices(n: Optional[int] = None) -> List[torch.device]:
    """The devices to train on: the first ``n`` CUDA GPUs, or ``n`` CPU virtual devices.

    With GPUs, ``n=None`` means all of them, and asking for more than there are
    is an error (a silent fallback would hide a misconfigured machine). Without
    GPUs, ``n=None`` means 2 virtual devices, all ``torch.device("cpu")``.
    """
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"devices(n): n must be a positive int, got {n!r}")
    count = gpu_count()
    if count == 0:
        return [torch.device("cpu")] * (n or DEFAULT_VIRTUAL_DEVICES)
    if n is not None and n > count:
        raise ValueError(
            f"devices({n}): only {count} GPU(s) visible. Ask for at most {count}, "
            "or check CUDA_VISIBLE_DEVICES."
        )
    return [torch.device("cuda", i) for i in range(n or count)]


def as_device(d: Any) -> torch.device:
    """``3`` -> ``cuda:3`` (``cpu`` without GPUs), ``-1`` -> ``cpu``, strings and devices as given."""
    if isinstance(d, torch.device):
        return d
    if isinstance(d, str):
        return torch.device(d)
    if isinstance(d, int) and not isinstance(d, bool):
        if d < 0 or gpu_count() == 0:
            return torch.device("cpu")
        return torch.device("cuda", d)
    raise TypeError(f"expected a device (int, str or torch.device), got {d!r}")


def as_devices(device_ids: Devices = None) -> List[torch.device]:
    """Normalise ``device_ids``: ``None`` means :func:`devices` (all GPUs, or 2 virtual CPUs).

    Integers name GPUs; without GPUs, ``device_ids=[0, 1, 2]`` means three
    virtual devices on the CPU.
    """
    if device_ids is None:
        return devices()
    out = [as_device(d) for d in device_ids]
    if not out:
        raise ValueError("device_ids is empty: pass at least one device, or None for all of them")
    return out


def device_name(devices: Sequence[torch.device], i: int) -> str:
    """``cuda:1``, or ``cpu (virtual device 1)`` when several entries share the CPU."""
    d = devices[i]
    shared = sum(1 for e in devices if e == d) > 1
    return f"{d} (virtual device {i})" if shared else str(d)


def nccl_available() -> bool:
    """True when CUDA GPUs are visible and this torch build has NCCL."""
    return gpu_count() > 0 and dist.is_available() and dist.is_nccl_available()


def backend(processes_per_node: int = 1) -> str:
    """The backend for ``processes_per_node`` processes on each machine: the one policy.

    ``"nccl"`` when CUDA and NCCL are usable and every process gets its own GPU
    (process ``LOCAL_RANK`` drives ``cuda:LOCAL_RANK``), else ``"gloo"`` (CPU
    processes). So the same code runs 2 processes on a laptop (gloo), on a
    1-GPU machine (gloo: two processes cannot share one GPU under NCCL) and on
    2+ GPUs (nccl). ``launch()`` and ``init_distributed()`` choose with it;
    inside a process, ``rank_device()`` then names the device to use.
    """
    return "nccl" if nccl_available() and processes_per_node <= gpu_count() else "gloo"


def process_group_backend(name: str) -> str:
    """What ``launch()``'s ranks give ``init_process_group``: an NCCL group carries CPU tensors too.

    ``"cpu:gloo,cuda:nccl"`` for ``"nccl"`` (torch's own default group where CUDA is available):
    CUDA tensors go through NCCL, CPU tensors through gloo, so a cell that keeps a flag, a count
    or a small example on the CPU runs unchanged on GPUs (NCCL alone refuses CPU tensors).
    ``dist.get_backend()`` then names both: ask ``rank_device()`` for the device to use.
    ``init_distributed()`` (torchrun, several machines) keeps plain NCCL: gloo would need its
    own connections between the machines, one more thing to fail.
    """
    return "cpu:gloo,cuda:nccl" if name == "nccl" else name


def check_backend(name: str) -> str:
    """Validate a backend name for this machine, with advice when it cannot work."""
    name = name.lower()
    if name not in ("nccl", "gloo", "mpi"):
        raise ValueError(f"unknown backend {name!r}: use 'nccl' (GPUs), 'gloo' (CPU) or None to choose")
    if name == "nccl" and not nccl_available():
        reason = "no CUDA GPU is visible" if gpu_count() == 0 else "this torch build has no NCCL"
        raise RuntimeError(
            f"backend='nccl' needs CUDA GPUs and NCCL, but {reason}. "
            "Use backend='gloo' on CPU, or backend=None to pick the right one."
        )
    if name == "mpi" and not dist.is_mpi_available():
        raise RuntimeError("backend='mpi' needs a torch built with MPI; use 'gloo' or 'nccl'.")
    return name
