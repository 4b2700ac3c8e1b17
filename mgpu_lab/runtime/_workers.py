"""The child side of ``launch()``: what one rank does, from start to ``os._exit``.

A rank gets its job either as objects (``fork``: the child inherited them) or as
bytes made by cloudpickle (``spawn``/``forkserver``: a fresh process, so ``fn``
and ``args`` travel by value). Either way it then

1. takes the launching process's environment as it was at the call,
2. leads its own process group and dies with its parent (no orphans),
3. sends fds 1 and 2 to its files in the launch's folder (C++ output too),
4. enables ``faulthandler``: a fatal signal (SIGSEGV, SIGABRT, ...) prints the
   Python stack, and SIGUSR1 prints every thread's stack (where a hung rank waits),
5. joins the process group, runs ``fn(*args)`` (which may leave the group
   itself), writes its result file, exits.
"""
from __future__ import annotations

import ctypes
import faulthandler
import io
import os
import pickle
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Dict

import torch
import torch.distributed as dist

from .devices import process_group_backend

STACK_DUMP_SIGNAL = signal.SIGUSR1  # on a timeout, each hung rank prints its Python stacks
INITIALISED_KEY = "mgpu_lab/initialised"  # in the launch's store: how many ranks finished init_process_group


def output_path(workdir: str, rank: int, stream: str) -> str:
    """``stream`` is ``out``, ``err`` or ``result``."""
    return os.path.join(workdir, f"rank{rank}.{stream}")


def run_rank(job, rank, world_size, port_in, backend, timeout, workdir, environ) -> None:
    """Entry point of every rank. ``job`` is ``(fn, args)`` or cloudpickle bytes of it;
    ``environ`` the launching process's ``os.environ``; ``timeout`` the collectives' (seconds)."""
    _adopt_environment(environ)
    os.setsid()  # own process group: the parent can kill this rank and all it started
    _die_with_parent()
    _redirect_output(rank, workdir)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    by_value = isinstance(job, bytes)
    result: Dict[str, Any]
    try:
        if by_value:
            job = pickle.loads(job)  # cloudpickle's bytes load with pickle (cloudpickle is imported as needed)
        fn, args = job
        if not port_in.poll(timeout):  # the parent sends the store's port once every rank is started
            raise TimeoutError(f"rank {rank}: the launching process sent no rendezvous port within {timeout:g} s")
        port = port_in.recv()
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
        )
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)  # see "one thread per CPU rank" in launch's docstring
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group(process_group_backend(backend), store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        store.add(INITIALISED_KEY, 1)
        value = fn(*args)
        result = {"ok": True, "value": value, "time": time.time()}
        payload = _dumps(result, by_value)
        _wait_until_every_rank_initialised(store, world_size, timeout)
        if dist.is_initialized():  # fn may have left the group itself (destroy_process_group, cleanup)
            dist.destroy_process_group()
    except BaseException as exc:  # report everything, KeyboardInterrupt and SystemExit included
        text = traceback.format_exc()  # raised again in the parent, so not printed here
        result = {"ok": False, "time": time.time(), "error": text, "type": type(exc).__name__}
        payload = pickle.dumps(result)
    with open(output_path(workdir, rank, "result"), "wb") as f:
        f.write(payload)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)  # skip the parent's atexit handlers (a notebook kernel's)


def _adopt_environment(environ: Dict[str, str]) -> None:
    """Make ``os.environ`` (and the C environment NCCL and gloo read) equal ``environ``."""
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)


def _wait_until_every_rank_initialised(store, world_size: int, timeout: float) -> None:
    """A rank whose fn returns at once must not exit while a peer still connects to it
    inside init_process_group (gloo's connectFullMesh then fails with "Connection closed
    by peer"). If a peer never gets there, the parent kills this rank after its grace period."""
    deadline = time.monotonic() + timeout
    while store.add(INITIALISED_KEY, 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.005)


def _dumps(result: Dict[str, Any], by_value: bool) -> bytes:
    """A rank started fresh may return instances of classes that came by value
    (defined in a notebook cell): cloudpickle sends those back by value too."""
    if by_value:
        import cloudpickle
        return cloudpickle.dumps(result)
    return pickle.dumps(result)


def _redirect_output(rank: int, workdir: str) -> None:
    """Point fds 1 and 2 at this rank's files, and sys.stdout/err at them (line-buffered)."""
    for fd, stream_name in ((1, "out"), (2, "err")):
        target = os.open(output_path(workdir, rank, stream_name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    sys.stdin = open(os.devnull)


def _die_with_parent() -> None:
    """Linux: ask the kernel to kill this rank if its parent dies (no orphans even on SIGKILL)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
