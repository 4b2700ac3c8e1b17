"""How ``launch()`` starts its ranks (fork when that is safe, else fresh processes)
and tells them where to meet.

* ``fork``: a copy of this process, in milliseconds; ``fn`` and ``args`` are
  inherited, so anything works. Unsafe once CUDA was touched here.
* ``forkserver``: fresh processes copied from a server that imported torch once
  (seconds for the first launch, a fraction of a second after).
* ``spawn``: a new interpreter per rank, every time (seconds each).

For the last two, ``fn`` and ``args`` travel as cloudpickle bytes (by value).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import io
import multiprocessing as mp
import os
import socket
import sys
import types
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

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
        return _dumps((fn, tuple(args)))
    except Exception:  # pickling errors come in several types: find the culprit
        for label, obj in [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)]:
            try:
                _dumps(obj)
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


def _dumps(obj) -> bytes:
    """cloudpickle, knowing torch's operator namespaces (``torch.ops``).

    A function that uses ``torch.ops.aten.mm`` makes cloudpickle send the submodules it
    names, ``torch.ops`` among them; that object is a module of torch's own type, which
    cloudpickle cannot pickle. Any module object that ``sys.modules`` holds under its
    name travels by name instead, as plain modules do.
    """
    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if (isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType
                    and sys.modules.get(obj.__name__) is obj):
                return importlib.import_module, (obj.__name__,)
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    Pickler(buffer).dump(obj)
    return buffer.getvalue()


def _modules_to_send_by_value(fn: Callable) -> List[Any]:
    name = getattr(fn, "__module__", None)
    module = sys.modules.get(name or "")
    if module is None or name == "__main__" or name in sys.builtin_module_names:
        return []
    if importlib.machinery.PathFinder.find_spec(name.split(".")[0], sys.path) is not None:
        return []
    return [module]


def start_ranks(method, job, nprocs, backend, timeout, workdir, procs: list) -> list:
    """Start every rank (appended to ``procs`` as it starts); return the pipe ends for their ports.

    Each rank also gets ``os.environ`` as it is now: a forkserver started by an
    earlier launch holds the environment of that moment, and passes it on."""
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # torch imported once, in the server
    ports = []
    for rank in range(nprocs):
        port_in, port_out = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=run_rank, args=(job, rank, nprocs, port_in, backend, timeout, workdir,
                                                  dict(os.environ)),
                           name=f"mgpu_lab-rank{rank}")
        proc.start()
        procs.append(proc)
        ports.append(port_out)
        port_in.close()
    return ports


def loopback_store(world_size: int, timeout: float) -> dist.TCPStore:
    """The rendezvous store on a free port of 127.0.0.1, listening there only.

    ``TCPStore`` binds its own server to every interface (anyone on the network
    could then write the keys the ranks read); a socket bound here and handed
    over listens on the loopback interface alone. The store owns it from then on.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(world_size)
    except OSError:
        sock.close()
        raise
    port, fd = sock.getsockname()[1], sock.detach()
    try:
        return dist.TCPStore("127.0.0.1", port, world_size=world_size, is_master=True,
                             timeout=timedelta(seconds=timeout), wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def send_port(conn, port: int) -> None:
    """Tell a started rank where the rendezvous store listens.

    Why not create the store first and pass its port as an argument: its server
    thread answers the first ranks while the next ones are forked, and a fork
    taken while that thread holds a libc lock (the resolver's, in getnameinfo)
    gives a child that waits on the lock forever. So every rank is forked while
    the parent runs no thread of ours, and learns the port afterwards.
    """
    try:
        conn.send(port)
    except (BrokenPipeError, OSError):
        pass  # that rank already died: its error is reported like any other
    finally:
        conn.close()
