"""The distributed core: who am I (``DistEnv``), joining the group, rank-0 helpers.

A launcher starts one process per device and tells each who it is through
environment variables. torchrun sets::

    RANK              this process's index among all processes (0 .. WORLD_SIZE-1)
    LOCAL_RANK        its index on this machine: which GPU it drives
    WORLD_SIZE        how many processes in all
    LOCAL_WORLD_SIZE  how many on this machine
    GROUP_RANK        this machine's index (the node rank)
    MASTER_ADDR/PORT  where rank 0's rendezvous store listens

The legacy ``python -m torch.distributed.launch`` passed ``--local_rank=N`` (or
``--local-rank=N``) as a command-line argument instead of LOCAL_RANK, and Slurm's
``srun`` sets SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_NODEID.
``dist_env()`` reads all three, in that order, into one ``DistEnv`` value.

Typical script (launched with ``mgpu-lab launch train.py`` or ``torchrun``)::

    env = init_distributed()            # gloo on CPU, nccl + set_device on GPUs
    loader = distributed_loader(dataset, batch_size=32)
    for epoch in range(3):
        for x, y in loader.epoch(epoch):  # calls sampler.set_epoch(epoch)
            ...
    print0("done")                        # printed once, by rank 0
    cleanup()
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .devices import backend as default_backend
from .devices import check_backend, gpu_count

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the job. A single process is rank 0 of 1."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _legacy_local_rank(argv: Sequence[str]) -> Optional[int]:
    """``--local_rank=N``, ``--local_rank N`` or the newer ``--local-rank`` spelling."""
    for i, arg in enumerate(argv):
        match = re.fullmatch(r"--local[_-]rank(?:=(\d+))?", arg)
        if match:
            value = match.group(1) if match.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
            if not value.isdigit():
                raise ValueError(f"{arg} needs an integer value")
            return int(value)
    return None


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist: 'node[03-05,07]' -> 'node03'. (`scontrol show
    hostnames` does the full expansion; the first host is all a rendezvous needs.)"""
    match = re.match(r"([^\[,]+)(?:\[([^\],-]+))?", nodelist)
    if not match:
        return "127.0.0.1"
    return match.group(1) + (match.group(2) or "")


def dist_env(environ: Optional[Mapping[str, str]] = None, argv: Optional[Sequence[str]] = None) -> DistEnv:
    """Read this process's place in the job from torchrun, legacy launch or Slurm.

    Precedence: torchrun's variables (RANK and WORLD_SIZE set), then the legacy
    ``--local_rank`` argument (with WORLD_SIZE/RANK from the environment), then
    Slurm (SLURM_PROCID set), else a single process (rank 0 of 1).
    """
    environ = os.environ if environ is None else environ
    argv = sys.argv[1:] if argv is None else argv
    addr = environ.get("MASTER_ADDR", "127.0.0.1")
    port = _int(environ, "MASTER_PORT", 29500)

    legacy = _legacy_local_rank(argv)
    if "RANK" in environ and "WORLD_SIZE" in environ or legacy is not None:
        world = _int(environ, "WORLD_SIZE", 1)
        local_rank = _int(environ, "LOCAL_RANK", legacy if legacy is not None else 0)
        rank = _int(environ, "RANK", local_rank)
        local_world = _int(environ, "LOCAL_WORLD_SIZE", world if _int(environ, "NNODES", 1) == 1 else 1)
        node = _int(environ, "GROUP_RANK", _int(environ, "NODE_RANK", rank // max(1, local_world)))
        env = DistEnv(rank, local_rank, world, local_world, node, addr, port)
    elif "SLURM_PROCID" in environ:
        world = _int(environ, "SLURM_NTASKS", 1)
        nodes = _int(environ, "SLURM_NNODES", 1)
        tasks_per_node = re.match(r"\d+", environ.get("SLURM_NTASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE", "")))
        local_world = int(tasks_per_node.group(0)) if tasks_per_node else max(1, world // nodes)
        if "MASTER_ADDR" not in environ and "SLURM_NODELIST" in environ:
            addr = _first_slurm_host(environ["SLURM_NODELIST"])
        env = DistEnv(
            rank=_int(environ, "SLURM_PROCID", 0),
            local_rank=_int(environ, "SLURM_LOCALID", 0),
            world_size=world,
            local_world_size=local_world,
            node_rank=_int(environ, "SLURM_NODEID", 0),
            master_addr=addr,
            master_port=port,
        )
    else:
        env = DistEnv(master_addr=addr, master_port=port)

    if not 0 <= env.rank < env.world_size:
        raise ValueError(f"rank {env.rank} is outside world size {env.world_size}: check RANK and WORLD_SIZE")
    if env.local_rank < 0 or env.local_rank >= env.world_size:
        raise ValueError(f"local rank {env.local_rank} is outside world size {env.world_size}: check LOCAL_RANK")
    return env


def init_distributed(backend: Optional[str] = None, timeout: timedelta = DEFAULT_TIMEOUT) -> DistEnv:
    """Join the default process group described by ``dist_env()``; return the ``DistEnv``.

    ``backend=None`` picks with ``devices.backend(LOCAL_WORLD_SIZE)``: nccl when
    every process on this node gets its own GPU, gloo otherwise. On GPUs, the process
    first binds to ``cuda:LOCAL_RANK`` (each process drives one GPU). Every
    collective then waits at most ``timeout`` before it raises. Calling it again
    in a process that already joined returns the environment unchanged.
    """
    env = dist_env()
    if dist.is_initialized():
        return env
    name = check_backend(backend or default_backend(env.local_world_size))
    if name == "nccl":
        if env.local_rank >= gpu_count():
            raise RuntimeError(
                f"LOCAL_RANK={env.local_rank} but only {gpu_count()} GPU(s) are visible on this node: "
                f"start at most {gpu_count()} process(es) per node (--nproc-per-node)."
            )
        torch.cuda.set_device(env.local_rank)
    # Slurm and the legacy launcher may not export what env:// needs.
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    store = _restart_safe_store(env, timeout)
    dist.init_process_group(name, rank=env.rank, world_size=env.world_size, timeout=timeout, store=store)
    return env


def _restart_safe_store(env: DistEnv, timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun after a restart, a store whose keys are fresh for this attempt.

    torchrun's workers share the agent's store across restarts (--max-restarts);
    torch 2.13 reuses its keys, so a restarted rank can read a dead peer's address
    and fail with "Connection refused" or hang (pytorch/pytorch#167288). A prefix
    per attempt avoids that. Otherwise None, and env:// works as usual.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == "0":
        return None  # a first attempt's keys are fresh anyway
    client = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"mgpu_lab/attempt_{attempt}", client)


def cleanup(exit: bool = False) -> None:
    """Leave the process group (safe to call when none was joined).

    ``exit=True`` then ends the process at once (``os._exit(0)``, outputs
    flushed): the last line of a training script. Why: with torch 2.13 on gloo,
    a process group that ``DistributedDataParallel`` used is never freed (its
    C++ reducer keeps it alive), and its threads can abort the interpreter's
    shutdown ("terminate called without an active exception", SIGABRT) after all
    the work is done, which torchrun then reports as a failed rank.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    if exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def require_process_group(who: str) -> None:
    """Raise one clear error when ``who`` (a class or function that communicates) runs before
    ``torch.distributed`` is initialised: every rank must first join a process group."""
    if not dist.is_initialized():
        raise RuntimeError(f"{who} needs a process group, and torch.distributed is not initialised: run it "
                           "inside mgpu_lab.launch(fn, nprocs=N), or in a script started by torchrun or "
                           "mgpu-lab launch after mgpu_lab.init_distributed()")


def rank_and_world_size(group=None) -> Tuple[int, int]:
    """This process's rank in ``group`` and the group's size; ``(0, 1)`` in a process that
    joined no group (a plain single-process run, where "every rank" is this one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, group_rank: int) -> int:
    """The global rank of rank ``group_rank`` of ``group`` (``None``: the default group, the same number).

    ``src=``, ``dst=`` and the point-to-point calls take *global* ranks, whatever ``group``
    is. ``dist.get_global_rank`` translates, but refuses ``None``; this accepts it. (torch
    >= 2.6 also takes group ranks as ``group_src=``/``group_dst=``/``group_peer=``; this works
    on every torch the library supports, and tools that read ``src=`` still see the root.)
    """
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def dtensor_module():
    """torch's DTensor module (``torch.distributed.tensor``; ``_tensor`` before torch 2.5),
    imported on first use: it costs half a second of CPU (sympy, symbolic shapes), which a
    process that never builds a DTensor (a notebook kernel, a rank of ``launch``) skips."""
    try:
        import torch.distributed.tensor as module
    except ImportError:  # torch < 2.5
        import torch.distributed._tensor as module
    return module


def is_dtensor(t) -> bool:
    """``isinstance(t, DTensor)`` without importing DTensor: no DTensor exists before its
    module is loaded."""
    module = sys.modules.get("torch.distributed.tensor") or sys.modules.get("torch.distributed._tensor")
    return module is not None and isinstance(t, module.DTensor)


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when the group runs NCCL, else the CPU.

    Put the model and the data there: NCCL only moves CUDA tensors, gloo is
    used here for CPU tensors.
    """
    if dist.is_initialized() and "nccl" in dist.get_backend():  # "nccl", or "cpu:gloo,cuda:nccl"
        return torch.device("cuda", dist_env().local_rank)
    return torch.device("cpu")


def is_main_process() -> bool:
    """True on global rank 0, and in a plain single-process run."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only: one line per event, not one per process."""
    if is_main_process():
        print(*args, **kwargs)


class DistributedLoader:
    """A DataLoader over a ``DistributedSampler`` that remembers to ``set_epoch``.

    Each rank sees its own 1/world_size of the data; without ``set_epoch`` every
    epoch would shuffle the same way. When the dataset does not divide evenly,
    the sampler pads by repeating samples (``drop_last=False``) so that every rank
    runs the same number of steps (a rank with fewer steps would hang the others
    in their all-reduce); ``drop_last=True`` drops the tail instead.
    """

    def __init__(self, dataset: Dataset, batch_size: int, shuffle: bool = True, drop_last: bool = False,
                 seed: int = 0, **loader_kwargs):
        require_process_group("distributed_loader")
        self.sampler = DistributedSampler(dataset, shuffle=shuffle, drop_last=drop_last, seed=seed)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, **loader_kwargs)

    def epoch(self, epoch: int) -> Iterator:
        """Iterate over this rank's share of one epoch, shuffled by ``epoch``."""
        self.sampler.set_epoch(epoch)
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def distributed_loader(dataset: Dataset, batch_size: int, shuffle: bool = True, drop_last: bool = False,
                       seed: int = 0, **loader_kwargs) -> DistributedLoader:
    """This rank's loader: ``for x, y in distributed_loader(ds, 32).epoch(e)``."""
    return DistributedLoader(dataset, batch_size, shuffle, drop_last, seed, **loader_kwargs)
