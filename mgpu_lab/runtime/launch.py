"""``launch()``: run a function in N processes with the process group ready.

This is ``torch.multiprocessing.spawn`` made safe for notebooks and tests::

    def train(steps):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        ...
        return loss                      # any picklable value

    losses = launch(train, nprocs=2, args=(100,))   # [loss of rank 0, loss of rank 1]

What it does, and why:

* **fork when that is safe, fresh processes otherwise.** A forked child inherits
  the parent's memory, so ``fn`` may be a notebook cell's function, a closure or
  a lambda, and starting costs milliseconds. But CUDA cannot survive a fork: once
  the parent initialised CUDA (any ``.cuda()``, a ``torch.cuda`` call that made a
  context), ``launch`` starts the ranks from a **forkserver** instead: a clean
  process with torch already imported, started once (about 2 s) and forked for
  every later launch (a fraction of a second). ``fn`` and ``args`` then travel by
  value with ``cloudpickle``, so the same cell works unchanged; an argument that
  cannot be serialised (a lock, an open file) is named in the error.
  ``start_method="spawn"`` (a new interpreter per rank, seconds each time) and
  ``"forkserver"`` can be asked for. Scripts that launch in fresh processes need
  the usual ``if __name__ == "__main__":`` guard (notebooks do not).
* **the environment of the call**: each rank starts from this process's
  ``os.environ`` as it is when ``launch`` is called (a forkserver started by an
  earlier launch would otherwise hand out its own old copy, and ``NCCL_DEBUG``
  set in a later cell would never reach the ranks). A variable torch reads only
  at import keeps the value it had when the forkserver started.
* **one rendezvous store, held by the parent** on a free port of 127.0.0.1 (it
  listens on the loopback interface only: nothing outside this machine can
  reach it), made once every rank is started (a fork next to the store's
  running thread can deadlock a child) and sent to each rank over a pipe; the
  port is never given up and re-taken, so two launches never race for it.
* **output**: each rank's stdout and stderr (fds 1 and 2, so C++ output too) go
  to files. Rank 0's appear live, as they are written (progress bars, prints in
  a long loop); the other ranks' are printed when they end, in rank order. Every
  line is prefixed ``[rank R]``, and a cell's final output is deterministic.
* **failures surface in the parent** as ``LaunchError`` with the root cause:
  the rank the parent saw fail first (a rank that only saw a peer go away comes
  last), with its traceback, or the signal that
  killed it (and the Python stack ``faulthandler`` printed), and where the
  other ranks waited ("rank 1 returned from fn while rank 0 was still in
  barrier()"). After a failure, a hang or Ctrl-C, every rank and its own
  children are killed: no process is left behind.
* **no deadline for the run, a timeout for every collective.** A training run
  may take hours, so ``timeout=None`` by default; a hang is found by the process
  group's timeout instead, ``collective_timeout``: 10 minutes by default, as
  ``init_distributed`` and torch's NCCL default (long enough for the ranks to
  wait at a barrier while rank 0 evaluates or saves). The rank that waited too long
  raises; ``launch`` then prints the stacks of the ranks still running and
  raises a ``TimeoutError`` (also a ``LaunchError``) saying where every rank
  was. Pass ``collective_timeout=30`` in a notebook to see a hang in seconds,
  or ``timeout=`` to bound the whole run: past it, the same diagnosis.
* **fn may leave the group itself**: ``dist.destroy_process_group()`` or
  ``mgpu_lab.cleanup()`` at its end, as PyTorch's DDP tutorial writes it, works.
* **one thread per CPU rank**, as torchrun and DataLoader workers do: GNU
  OpenMP cannot be used in a forked child once the parent has run a parallel
  region (the child hangs in its first large op), and N ranks on N cores are
  busy anyway. Do not raise ``torch.set_num_threads`` inside a forked ``fn``.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from . import _diagnosis as diagnosis
from ._rank_output import RankOutput
from ._start_methods import choose_start_method, loopback_store, send_port, serialize_job, start_ranks
from ._workers import STACK_DUMP_SIGNAL, output_path
from .devices import backend as backend_for
from .devices import check_backend, gpu_count
from .distributed import DEFAULT_TIMEOUT

DEFAULT_COLLECTIVE_TIMEOUT = DEFAULT_TIMEOUT.total_seconds()  # init_distributed's; why: "no deadline for the run" above
FAILURE_GRACE_SECONDS = 3.0  # after a rank fails, how long the others get to notice and exit
STACK_DUMP_SECONDS = 0.5  # how long hung ranks get to print their stacks
OUTPUT_POLL_SECONDS = 0.1  # how often rank 0's new output is echoed


class LaunchError(RuntimeError):
    """A rank failed. ``rank`` is the root cause: the first rank the parent saw fail, not
    counting ranks that failed only because a peer went away.
    ``failures`` maps every failed rank to its error text (traceback, or how it died)."""

    def __init__(self, rank: int, failures: Dict[int, str], note: str = ""):
        self.rank = rank
        self.failures = failures
        others = sorted(r for r in failures if r != rank)
        also = f" (then rank(s) {others} failed too)" if others else ""
        super().__init__(f"{note}rank {rank} failed first{also}:\n{failures[rank]}")


class CollectiveTimeout(LaunchError, TimeoutError):
    """A rank waited ``collective_timeout`` seconds in a collective: a hang, found by the
    process group's timeout. The message says where every rank was."""


def launch(
    fn: Callable[..., Any],
    nprocs: int = 2,
    args: Sequence[Any] = (),
    backend: Optional[str] = None,
    start_method: Optional[str] = None,
    timeout: Optional[float] = None,
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT,
) -> List[Any]:
    """Run ``fn(*args)`` in ``nprocs`` processes, each a rank of a fresh process group.

    Returns the ranks' return values in rank order. ``backend=None`` picks nccl
    when there is a GPU for every rank (rank r drives ``cuda:r``), else gloo
    (CPU processes); inside ``fn``, ``mgpu_lab.rank_device()`` is the device to
    use. ``start_method=None`` forks when that is safe, else uses a forkserver
    (see the module docstring). ``timeout`` (seconds; ``None``: no deadline)
    bounds the whole run, ``collective_timeout`` (seconds, 10 minutes) every
    collective inside it; a hang past either raises ``TimeoutError`` saying
    where each rank waits.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"launch(nprocs={nprocs!r}): nprocs must be an int >= 1")
    for label, seconds in (("timeout", timeout), ("collective_timeout", collective_timeout)):
        if (seconds is not None or label != "timeout") and not (isinstance(seconds, (int, float)) and seconds > 0):
            raise ValueError(f"launch({label}={seconds!r}): give a positive number of seconds"
                             + (" (or None: no deadline)" if label == "timeout" else ""))
    name = check_backend(backend or default_launch_backend(nprocs))
    if name == "nccl" and nprocs > gpu_count():
        raise ValueError(
            f"launch(nprocs={nprocs}) with nccl needs one GPU per process, but {gpu_count()} are visible: "
            f"use nprocs <= {gpu_count()}, or backend='gloo' to run CPU processes."
        )
    method = choose_start_method(start_method)
    job = (fn, tuple(args)) if method == "fork" else serialize_job(fn, args)

    workdir = tempfile.mkdtemp(prefix="mgpu_lab_launch_")
    output = RankOutput(workdir, nprocs)
    procs: List[mp.process.BaseProcess] = []
    store = None
    try:
        try:
            ports = start_ranks(method, job, nprocs, name, collective_timeout, workdir, procs)
            # The store (and its server thread) exists only once every rank is started; see send_port.
            store = loopback_store(nprocs + 1, collective_timeout)
            for port_out in ports:
                send_port(port_out, store.port)
            still_running, seen = _supervise(procs, timeout, output)
            _dump_stacks([procs[rank] for rank in still_running])
        finally:
            _kill_all(procs)
            del store
            output.finish()
        results = [_read_result(rank, procs[rank].exitcode, workdir, output) for rank in range(nprocs)]
        waits = {rank: _where(rank, results[rank], output) for rank in range(nprocs) if not results[rank]["ok"]}
        timed_out = {rank for rank in waits
                     if diagnosis.collective_timed_out(results[rank]["error"] + output.text(rank, "err"))}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _outcome(results, still_running, seen, waits, timeout, timed_out, collective_timeout)


def default_launch_backend(nprocs: int) -> str:
    """nccl when every one of ``nprocs`` ranks gets its own GPU, else gloo: ``devices.backend(nprocs)``."""
    return backend_for(nprocs)


# --------------------------------------------------------------------------- parent side

def _supervise(procs, timeout: Optional[float], output: RankOutput) -> Tuple[List[int], Dict[int, int]]:
    """Echo rank 0's output and wait until all ranks exit, a rank fails (then give the
    rest a grace period), or the deadline (if any) passes. Returns the ranks still running
    and, for each rank that ended, the order in which the parent saw it end (0 first)."""
    deadline = time.monotonic() + (float("inf") if timeout is None else timeout)
    seen: Dict[int, int] = {}
    wake = 0
    while True:
        # A rank has ended when its sentinel is ready (a dying process closes it as it releases its
        # files, before its exit code can be read: a rank killed while it had many threads may take
        # longer to become a zombie than its peer takes to raise "connection closed").
        ready = set(wait([p.sentinel for r, p in enumerate(procs) if r not in seen], timeout=0))
        for rank, proc in enumerate(procs):
            if rank not in seen and (proc.sentinel in ready or proc.exitcode is not None):
                seen[rank] = wake  # ranks seen in the same wake-up tie
        wake += 1
        output.pump()
        alive = [p for p in procs if p.exitcode is None]
        if not alive:  # a rank that ended since the scan above was seen now, after those of the scan
            return [], {rank: seen.get(rank, wake) for rank in range(len(procs))}
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_SECONDS)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return [rank for rank, p in enumerate(procs) if p.exitcode is None], seen
        wait([p.sentinel for p in alive], timeout=min(remaining, OUTPUT_POLL_SECONDS))


def _dump_stacks(procs) -> None:
    """Ask hung ranks to write every thread's Python stack to their stderr (printed
    with their output, and read to say where each rank waits)."""
    for proc in procs:
        try:
            os.kill(proc.pid, STACK_DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    if procs:
        time.sleep(STACK_DUMP_SECONDS)


def _kill_all(procs) -> None:
    """SIGKILL each rank's whole process group (its DataLoader workers too), then reap."""
    for proc in procs:
        if proc.pid is None:
            continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # each rank leads its own group (see run_rank)
        except (ProcessLookupError, PermissionError):
            pass
        if proc.exitcode is None:
            proc.kill()
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=10)


def _read_result(rank: int, exitcode: Optional[int], workdir: str, output: RankOutput) -> Dict[str, Any]:
    try:
        with open(output_path(workdir, rank, "result"), "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        pass
    except Exception as exc:  # a value that came back by value but cannot be rebuilt here
        return {"ok": False, "time": float("inf"), "type": type(exc).__name__,
                "error": f"rank {rank}'s return value could not be unpickled in the parent: {exc!r}"}
    return {"ok": False, "time": float("inf"),
            "error": diagnosis.exit_without_result(rank, exitcode, output.text(rank, "err"))}


def _where(rank: int, result: Dict[str, Any], output: RankOutput) -> Optional[str]:
    if "type" in result:  # it raised: its traceback says where
        return diagnosis.where(diagnosis.traceback_frames(result["error"]))
    return diagnosis.hung_rank_place(output.text(rank, "err"))


HANG_ADVICE = ("A rank waiting in a collective that another rank never reached is the usual cause "
               "(a rank-dependent branch, or ranks running different numbers of steps).")


def _places(ranks, waits) -> str:
    return "".join(f"\n  rank {rank} was in {waits.get(rank) or 'an unknown place'}" for rank in ranks)


def _outcome(results, still_running, seen, waits, timeout, timed_out, collective_timeout) -> List[Any]:
    nprocs = len(results)
    returned = [rank for rank, r in enumerate(results) if r["ok"]]
    failures = {rank: r["error"] for rank, r in enumerate(results) if not r["ok"] and rank not in still_running}
    if failures:
        first = diagnosis.root_cause(list(failures), seen, results)
        if first in timed_out:  # a hang, found by the process group's timeout
            note = (f"launch: rank {first} waited {collective_timeout:g} s in a collective (collective_timeout) "
                    f"and timed out.{_places(sorted(waits), waits)}\n"
                    + diagnosis.returned_while_waiting(returned, waits) + HANG_ADVICE + "\n")
            raise CollectiveTimeout(first, failures, note)
        note = diagnosis.returned_while_waiting(returned, {first: waits.get(first)})
        if still_running:
            note += (f"(rank(s) {still_running} were still running {FAILURE_GRACE_SECONDS:g} s later and were "
                     f"killed){_places(still_running, waits)}\n")
        raise LaunchError(first, failures, note)
    if still_running:
        raise TimeoutError(
            f"launch: rank(s) {still_running} of {nprocs} were still running after {timeout:g} s and were killed."
            f"{_places(still_running, waits)}\n"
            + diagnosis.returned_while_waiting(returned, {r: waits.get(r) for r in still_running}) + HANG_ADVICE
        )
    return [r["value"] for r in results]
