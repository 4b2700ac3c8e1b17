"""``launch()``: run a function in N processes with the process group ready.

This is ``torch.multiprocessing.spawn`` made safe for notebooks and tests::

    def train(steps):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        ...
        return loss                      # any picklable value

    losses = launch(train, nprocs=2, args=(100,))   # [loss of rank 0, loss of rank 1]

What it does, and why:

* **fork by default** (Linux, macOS when asked): the children inherit the parent's
  memory, so ``fn`` may be defined in a notebook cell or be a closure. CUDA cannot
  survive a fork: if the parent already initialised CUDA, ``launch`` refuses with
  advice instead of letting the children crash. ``start_method="spawn"`` starts
  fresh interpreters instead; then ``fn`` and ``args`` must be picklable, so
  ``fn`` must live in an importable ``.py`` module (not a notebook cell).
* **one rendezvous store, held by the parent** on a free port of 127.0.0.1, made
  once every rank is started (a fork next to the store's running thread can
  deadlock a child) and sent to each rank over a pipe; the port is never given
  up and re-taken, so two launches never race for it.
* **output in rank order**: each rank's stdout and stderr (file descriptors 1 and
  2, so C++ output too) go to files; the parent prints them after the ranks end,
  rank 0 first, each line prefixed ``[rank R]``. Cell outputs are deterministic.
* **failures surface in the parent**: a rank that raises makes ``launch`` raise
  ``LaunchError`` with that rank's traceback (the first rank to fail is the root
  cause; the others usually fail because their peer vanished). A run that
  outlives ``timeout`` seconds raises ``TimeoutError`` naming the ranks still
  running, and each of them first prints its Python stack (where it waits).
  Either way, and on Ctrl-C, every child and its own children are killed
  before ``launch`` returns: no process is left behind.
* **one thread per CPU rank**, as torchrun and DataLoader workers do: GNU
  OpenMP cannot be used in a forked child once the parent has run a parallel
  region (the child hangs in its first large op), and N ranks on N cores are
  busy anyway. Do not raise ``torch.set_num_threads`` inside ``fn``; use
  ``start_method="spawn"`` if a rank needs several threads.
"""
from __future__ import annotations

import ctypes
import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .devices import check_backend, gpu_count, nccl_available

DEFAULT_TIMEOUT = 300.0
FAILURE_GRACE_SECONDS = 3.0  # after a rank fails, how long the others get to notice and exit
STACK_DUMP_SIGNAL = signal.SIGUSR1  # on a timeout, each hung rank prints its Python stacks
STACK_DUMP_SECONDS = 0.5  # how long they get to write them


class LaunchError(RuntimeError):
    """A rank failed. ``rank`` is the first rank that failed; ``failures`` maps every
    failed rank to its error text (traceback, or exit code when it had none)."""

    def __init__(self, rank: int, failures: Dict[int, str]):
        self.rank = rank
        self.failures = failures
        others = sorted(r for r in failures if r != rank)
        also = f" (then rank(s) {others} failed too)" if others else ""
        super().__init__(f"rank {rank} failed{also}:\n{failures[rank]}")


def launch(
    fn: Callable[..., Any],
    nprocs: int = 2,
    args: Sequence[Any] = (),
    backend: Optional[str] = None,
    start_method: Optional[str] = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> List[Any]:
    """Run ``fn(*args)`` in ``nprocs`` processes, each a rank of a fresh process group.

    Returns the ranks' return values in rank order. ``backend=None`` picks nccl
    when there is a GPU for every rank (rank r drives ``cuda:r``), else gloo
    (CPU processes); inside ``fn``, ``mgpu_lab.rank_device()`` is the device to use. ``timeout`` (seconds)
    bounds the whole run and every collective inside it.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"launch(nprocs={nprocs!r}): nprocs must be an int >= 1")
    if timeout is None or timeout <= 0:
        raise ValueError(f"launch(timeout={timeout!r}): give a positive number of seconds")
    name = check_backend(backend or default_launch_backend(nprocs))
    if name == "nccl" and nprocs > gpu_count():
        raise ValueError(
            f"launch(nprocs={nprocs}) with nccl needs one GPU per process, but {gpu_count()} are visible: "
            f"use nprocs <= {gpu_count()}, or backend='gloo' to run CPU processes."
        )
    method = _start_method(start_method)
    if method == "spawn":
        _check_picklable(fn, args)

    workdir = tempfile.mkdtemp(prefix="mgpu_lab_launch_")
    ctx = mp.get_context(method)
    procs: List[mp.process.BaseProcess] = []
    store = None
    try:
        ports = []  # the parent's ends of one pipe per rank, to send it the store's port
        for rank in range(nprocs):
            port_in, port_out = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker,
                args=(fn, tuple(args), rank, nprocs, port_in, name, timeout, workdir),
                name=f"mgpu_lab-rank{rank}",
            )
            proc.start()
            port_in.close()
            procs.append(proc)
            ports.append(port_out)
        # The store (and its server thread) exists only once every rank is forked; see _send_port.
        store = dist.TCPStore("127.0.0.1", 0, world_size=nprocs + 1, is_master=True,
                              timeout=timedelta(seconds=timeout), wait_for_workers=False)
        for port_out in ports:
            _send_port(port_out, store.port)
        still_running = _wait_for(procs, timeout)
        _dump_stacks([procs[rank] for rank in still_running])
    finally:
        _kill_all(procs)
        del store
    try:
        _print_outputs(nprocs, workdir)
        results = [_read_result(rank, procs[rank].exitcode, workdir) for rank in range(nprocs)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    failures = {rank: r["error"] for rank, r in enumerate(results) if not r["ok"] and rank not in still_running}
    if failures:
        first = min(failures, key=lambda rank: results[rank]["time"])
        raise LaunchError(first, failures)
    if still_running:
        raise TimeoutError(
            f"launch: rank(s) {still_running} of {nprocs} were still running after {timeout:g} s and were killed. "
            "A rank waiting in a collective that another rank never reached is the usual cause "
            "(a rank-dependent branch, or ranks running different numbers of steps)."
        )
    return [r["value"] for r in results]


def default_launch_backend(nprocs: int) -> str:
    """nccl when NCCL works and every one of ``nprocs`` ranks gets its own GPU, else gloo.

    So the same notebook runs 2 ranks on a laptop (gloo), on a 1-GPU machine
    (gloo: two ranks cannot share one GPU under NCCL) and on 2+ GPUs (nccl).
    """
    return "nccl" if nccl_available() and nprocs <= gpu_count() else "gloo"


# --------------------------------------------------------------------------- parent side

def _start_method(start_method: Optional[str]) -> str:
    method = start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    if method not in mp.get_all_start_methods():
        raise ValueError(f"start_method={method!r} is not available here; use one of {mp.get_all_start_methods()}")
    if method == "fork" and torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA was initialised in this process before launch() forked its workers, and a forked child "
            "cannot use CUDA. Restart the kernel (or process) and call launch() before anything touches the "
            "GPU in the parent (no .cuda(), .to('cuda'), torch.cuda.* calls that create a context). Or pass "
            "start_method='spawn' with fn defined in an importable .py module."
        )
    return method


def _check_picklable(fn: Callable, args: Sequence[Any]) -> None:
    try:
        pickle.dumps((fn, tuple(args)))
    except Exception as exc:  # pickling errors come in several types
        raise ValueError(
            f"start_method='spawn' pickles fn and args, and that failed ({exc}). Define fn at the top level "
            "of an importable .py module (a notebook cell or a closure cannot be pickled), or use 'fork'."
        ) from None


def _send_port(conn, port: int) -> None:
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


def _wait_for(procs: Sequence[mp.process.BaseProcess], timeout: float) -> List[int]:
    """Wait until all ranks exit, a rank fails (then give the rest a grace period),
    or the deadline passes. Returns the ranks still running at the end."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if p.exitcode is None]
        failed = any(p.exitcode not in (None, 0) for p in procs)
        if not alive:
            return []
        if failed:
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_SECONDS)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return [rank for rank, p in enumerate(procs) if p.exitcode is None]
        wait([p.sentinel for p in alive], timeout=min(remaining, 1.0))


def _dump_stacks(procs: Sequence[mp.process.BaseProcess]) -> None:
    """Ask hung ranks to write every thread's Python stack to their stderr (printed
    with their output): where each rank waits is what debugging a hang needs."""
    for proc in procs:
        try:
            os.kill(proc.pid, STACK_DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    if procs:
        time.sleep(STACK_DUMP_SECONDS)


def _kill_all(procs: Sequence[mp.process.BaseProcess]) -> None:
    """SIGKILL each rank's whole process group (its DataLoader workers too), then reap."""
    for proc in procs:
        if proc.pid is None:
            continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # each rank leads its own group (see _worker)
        except (ProcessLookupError, PermissionError):
            pass
        if proc.exitcode is None:
            proc.kill()
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=10)


def _print_outputs(nprocs: int, workdir: str) -> None:
    for stream_name, stream in (("out", sys.stdout), ("err", sys.stderr)):
        for rank in range(nprocs):
            path = os.path.join(workdir, f"rank{rank}.{stream_name}")
            if not os.path.exists(path):
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f.read().splitlines():
                    print(f"[rank {rank}] {line}", file=stream)
        stream.flush()


def _read_result(rank: int, exitcode: Optional[int], workdir: str) -> Dict[str, Any]:
    path = os.path.join(workdir, f"rank{rank}.result")
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        pass
    if exitcode is None:
        how = "was killed (still running)"
    elif exitcode < 0:
        how = f"was killed by signal {signal.Signals(-exitcode).name}"
    else:
        how = f"exited with code {exitcode}"
    return {"ok": False, "time": float("inf"),
            "error": f"rank {rank} {how} without a Python traceback (see its [rank {rank}] output above)"}


# --------------------------------------------------------------------------- child side

def _worker(fn, args, rank, world_size, port_in, backend, timeout, workdir) -> None:
    os.setsid()  # own process group: the parent can kill this rank and all it started
    _die_with_parent()
    _redirect_output(rank, workdir)
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    result: Dict[str, Any]
    try:
        if not port_in.poll(timeout):  # see _send_port
            raise TimeoutError(f"rank {rank}: the launching process sent no rendezvous port within {timeout:g} s")
        port = port_in.recv()
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
        )
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)  # see "one thread per CPU rank" in the module docstring
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        value = fn(*args)
        result = {"ok": True, "value": value, "time": time.time()}
        payload = pickle.dumps(result)
        dist.destroy_process_group()
    except BaseException as exc:  # report everything, KeyboardInterrupt and SystemExit included
        text = traceback.format_exc()  # raised again in the parent, so not printed here
        result = {"ok": False, "time": time.time(), "error": text, "type": type(exc).__name__}
        try:
            payload = pickle.dumps(result)
        except Exception:
            payload = pickle.dumps({**result, "type": "Exception"})
    with open(os.path.join(workdir, f"rank{rank}.result"), "wb") as f:
        f.write(payload)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)  # skip the parent's atexit handlers (a notebook kernel's)


def _redirect_output(rank: int, workdir: str) -> None:
    """Point fds 1 and 2 at this rank's files, and sys.stdout/err at them (line-buffered)."""
    for fd, stream_name in ((1, "out"), (2, "err")):
        target = os.open(os.path.join(workdir, f"rank{rank}.{stream_name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    sys.stdin = open(os.devnull)


def _die_with_parent() -> None:
    """Linux: ask the kernel to kill this rank if the parent dies (no orphans even on SIGKILL)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
