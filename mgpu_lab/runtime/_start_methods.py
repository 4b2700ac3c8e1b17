"""How ``launch()`` starts its ranks: fork when that is safe, else fresh processes.

* ``fork``: a copy of this process, in milliseconds; ``fn`` and ``args`` are
  inherited, so anything works. Unsafe once CUDA was touched here.
* ``forkserver``: fresh processes copied from a server that imported torch once
  (seconds for the first launch, a fraction of a second after).
* ``spawn``: a new interpreter per rank, every time (seconds each).

For the last two, ``fn`` and ``args`` travel as cloudpickle bytes (by value).
"""
from __future__ import annotations

import importlib.machinery
import multiprocessing as mp
import os
import sys
from typing import Any, Callable, List, Optional, Sequence

import torch

from ._workers import run_rank
from .devices import gpu_count

FORKSERVER_PRELOAD = ["torch", "torch.distributed", "cloudpickle", "mgpu_lab.runtime._workers"]


def choose_start_method(start_method: Optional[str] = None) -> str:
    """``fork`` when available and safe for CUDA (see :func:`fork_is_poisoned`); else
    ``forkserver``, else ``spawn``."""
    available = mp.get_all_start_methods()
    if start_method is None:
        if "fork" in available and not fork_is_poisoned():
            return "fork"
        return "forkserver" if "forkserver" in available else "spawn"
    if start_method not in available:
        raise ValueError(f"start_method={start_method!r} is not available here; use one of {available}")
    if start_method == "fork" and fork_is_poisoned():
        raise ValueError(
            "start_method='fork' cannot work once CUDA is initialised in this process (a forked child cannot "
            "use CUDA). Leave start_method=None and launch() starts fresh processes for you."
        )
    return start_method


def fork_is_poisoned() -> bool:
    """Would a forked child be unable to use CUDA?

    True once this process initialised CUDA (``torch.cuda.is_initialized()``),
    and also after calls that only touched the driver, such as
    ``torch.cuda.is_available()``: torch then marks every later fork as "bad"
    and CUDA raises in the child. That mark is visible only in a child, so with
    GPUs visible a probe is forked (milliseconds) and asked.
    """
    if torch.cuda.is_initialized():
        return True
    if gpu_count() == 0 or not hasattr(torch.cuda, "_is_in_bad_fork"):
        return False  # without a GPU, nothing can poison a fork
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0


def serialize_job(fn: Callable, args: Sequence[Any]) -> bytes:
    """``(fn, args)`` as cloudpickle bytes, for ranks started as fresh processes.

    Functions of ``__main__`` (a notebook, a script) travel by value; so do those
    of a module a fresh process could not import by name (a test file loaded by
    path); functions of importable modules travel by reference. An argument that
    cannot be serialised is named in the error.
    """
    import cloudpickle

    by_value = [m for m in _modules_to_send_by_value(fn)]
    for module in by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps((fn, tuple(args)))
    except Exception:  # pickling errors come in several types: find the culprit
        for label, obj in [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)]:
            try:
                cloudpickle.dumps(obj)
            except Exception as exc:
                raise ValueError(
                    f"launch() starts fresh processes here and sends them fn and args by value, but {label} "
                    f"({type(obj).__name__}) cannot be serialised: {exc}. Pass something that can (create "
                    "locks, files, sockets and generators inside fn instead)."
                ) from None
        raise
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)


def _modules_to_send_by_value(fn: Callable) -> List[Any]:
    name = getattr(fn, "__module__", None)
    module = sys.modules.get(name or "")
    if module is None or name == "__main__" or name in sys.builtin_module_names:
        return []
    if importlib.machinery.PathFinder.find_spec(name.split(".")[0], sys.path) is not None:
        return []
    return [module]


def start_ranks(method, job, nprocs, backend, timeout, workdir, procs: list) -> list:
    """Start every rank (appended to ``procs`` as it starts); return the pipe ends for their ports."""
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # torch imported once, in the server
    ports = []
    for rank in range(nprocs):
        port_in, port_out = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=run_rank, args=(job, rank, nprocs, port_in, backend, timeout, workdir),
                           name=f"mgpu_lab-rank{rank}")
        proc.start()
        procs.append(proc)
        ports.append(port_out)
        port_in.close()
    return ports
