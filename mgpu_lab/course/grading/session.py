"""One graded run of a submission: the runner in its sandbox, a judge beside it.

:func:`run_prepared` starts the two processes and holds the conversation of
:mod:`mgpu_lab.course.grading.protocol` between them, in three parts:

- :func:`runner_command`: how the runner starts (inside bubblewrap, or not), with
  which environment and working folder;
- :class:`Judges`: the judge process for this notebook, started again (its setup
  cells re-run) when a step of it fails, which is the grader's failure, not the learner's;
  bounded as the sandbox is: a cgroup of ``--memory`` where one can be made (else
  ``RLIMIT_DATA`` per process, :func:`.judge.limit_memory`), and ``--timeout`` per check;
- :func:`converse`: the protocol loop: a ``Need`` gets the probe and the check's inputs
  (or an empty probe for a cell already scored 0), an ``Answer`` gets its verdict, and
  ``Results`` ends it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import monotonic
from typing import Dict, List, Optional

import nbformat

from ..notebook import graded_cell
from ..notebook.cells import given_sources, graded_cells, setup_sources
from .cases import cases_of
from .guard import forbidden_of
from .judge import MEMORY_ENV, MEMORY_MESSAGE, JudgeError, JudgeProcess
from .protocol import (RUNNER_COMMAND, Answer, Channel, Header, KernelStarted, Need, Outcome,
                       Probe, Results, StartKernel)
from .sandbox import (WORK, Limits, Sandbox, cgroup_kind, cgroup_oom_kills, command, memory_cgroup,
                      memory_limit_mib, oom_file, own_memory_cgroup, remove_cgroups)
from .submission import Prepared

JUDGE_TIMEOUT = 300.0   # seconds for the judge's setup (imports, setup cells), at least
SETTLED = Probe("# scored 0 before it ran: see the report", {}, [], [])


@dataclass
class Verdict:
    """The judge's word on one graded cell (``error`` None: passed)."""
    error: Optional[str] = None
    message: str = ""
    line: Optional[int] = None
    misconception: Optional[str] = None   # the known misconception its answer matches
    differs: str = ""          # else: what was compared and where it first differs
    where: str = ""            # which part of the check caught it: "visible", "hidden"


@dataclass
class RunOutcome:
    results: Dict[int, Outcome] = field(default_factory=dict)     # by cell index
    violations: Dict[int, List[str]] = field(default_factory=dict)
    verdicts: Dict[int, Verdict] = field(default_factory=dict)
    threads: Dict[int, tuple] = field(default_factory=dict)      # (running, names) at probe end
    memory_mib: Optional[int] = None   # the memory limit over the kernel (a cgroup's), MiB


def package_dir() -> Path:
    import mgpu_lab
    return Path(mgpu_lab.__file__).resolve().parent


def runner_command(box: Sandbox, limits: Limits, scratch: str):
    """``(argv, cwd, env, cleanup)`` of the runner: in bubblewrap when the box is
    available (its scratch folder is the sandbox's), else in ``scratch/kernel`` (made
    the property of ``box.run_as``'s user, when the runner is to run as it)."""
    package = package_dir()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
           "PYTHONPATH": str(package.parent), "HOME": WORK if box.available else os.getcwd(),
           "TMPDIR": "/tmp", "JUPYTER_RUNTIME_DIR": "/tmp/jupyter-runtime",
           "IPYTHONDIR": "/tmp/ipython", "MPLCONFIGDIR": "/tmp/matplotlib",
           "PYTHONDONTWRITEBYTECODE": "1", "JUPYTER_PLATFORM_DIRS": "1"}
    for key in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "MKL_NUM_THREADS"):
        if key in os.environ:
            env[key] = os.environ[key]
    argv = [sys.executable, "-c", RUNNER_COMMAND]
    if box.available:
        argv, cleanup = command(box, argv, limits, package, env)
        return argv, "/", env, cleanup
    cwd = os.path.join(scratch, "kernel")
    os.makedirs(cwd)
    env = dict(os.environ, **{k: v for k, v in env.items() if k not in ("TMPDIR", "HOME")},
               HOME=cwd)
    if os.environ.get("PYTHONPATH"):   # as the judges' (:func:`judge_environment`)
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"]] + [
            p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p and p != env["PYTHONPATH"]])
    for k in ("JUPYTER_RUNTIME_DIR", "IPYTHONDIR", "MPLCONFIGDIR"):
        env[k] = os.path.join(cwd, "." + k.lower())
    if box.run_as:                 # its own folder; the judge's stays the grader's
        os.chmod(scratch, 0o711)
        os.chown(cwd, box.run_as[0], box.run_as[1])
        env.update(TMPDIR=cwd, USER=box.run_as[2], LOGNAME=box.run_as[2])
    return argv, cwd, env, []


def judge_environment(home: str, memory_gib: float = Limits.memory_gib) -> dict:
    """The judge runs the instructor's code only: the grader's own environment, and the
    sandbox's memory as its data limit (:mod:`.judge`)."""
    # The package's folder once: a PYTHONPATH that names it too (a checkout's) would make
    # the judges' path differ from the sandbox's, and they would not be forks of the warm
    # zygote (:mod:`.warm_kernel`), each importing torch again (about 100 MiB more).
    here = str(package_dir().parent)
    path = [here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                     if p and p != here]
    env = dict(os.environ, MPLBACKEND="Agg", HOME=home, MPLCONFIGDIR=os.path.join(home, ".mpl"),
               PYTHONPATH=os.pathsep.join(path))
    env.setdefault("OMP_NUM_THREADS", "1")
    env[MEMORY_ENV] = str(int(memory_gib * 2**30))
    return env


class Judges:
    """The notebook's judge (a fork of its lab's zygote when a :class:`JudgePool` is
    given, else a process of its own); a failed step ends it and the next step gets a
    fresh one, set up again.

    Its bounds are the sandbox's, whatever a check computes from the learner's data: each
    judge joins a cgroup of ``memory_gib`` (``cgroup``: the sandbox's kind; a judge the
    kernel's OOM killer ends costs the check it ran, :data:`.judge.MEMORY_MESSAGE`); each
    check (inputs, verdict) has ``timeout`` seconds, the grader's ``--timeout``; only the
    setup (an import of torch, the lab's setup cells) has :data:`JUDGE_TIMEOUT` at least."""

    def __init__(self, setup: List[str], home: str, timeout: float, pool=None,
                 memory_gib: float = Limits.memory_gib, cgroup: Optional[str] = None):
        self.setup_cells, self.home, self.pool, self.memory = setup, home, pool, memory_gib
        self.timeout, self.setup_timeout = timeout, max(timeout, JUDGE_TIMEOUT)
        self.cgroup = memory_cgroup(cgroup, memory_gib)
        self.judge = self._new()

    def _new(self):
        if self.pool is not None:
            judge = self.pool.judge(self.setup_cells, self.home)   # set up already
        else:
            judge = JudgeProcess(judge_environment(self.home, self.memory), self.home,
                                 self.setup_timeout)
        pid = getattr(judge, "pid", None) or getattr(getattr(judge, "proc", None), "pid", None)
        for procs in (self.cgroup[0] if self.cgroup and pid else []):
            try:
                with open(procs, "w") as f:
                    f.write(str(pid))
            except OSError:
                pass
        return judge

    def setup(self) -> None:
        if self.pool is None:
            self.judge.setup(self.setup_cells)
        self.judge.timeout = self.timeout           # each check: the grader's --timeout

    def ask(self, step: str, *args):
        """``judge.step(*args)``; on :class:`JudgeError` (or a process of the judge's ended
        for memory) a fresh judge, and the error raised."""
        killed = cgroup_oom_kills(self.cgroup[1]) if self.cgroup else 0
        try:
            reply = getattr(self.judge, step)(*args)
            if self.cgroup and cgroup_oom_kills(self.cgroup[1]) > killed:
                raise JudgeError(MEMORY_MESSAGE)      # a rank of its launch(), say
            return reply
        except JudgeError as err:
            self.judge.close()
            self.judge = self._new()
            self.setup()
            if self.cgroup and cgroup_oom_kills(self.cgroup[1]) > killed:
                raise JudgeError(MEMORY_MESSAGE) from None
            raise err

    def close(self) -> None:
        self.judge.close()
        if self.cgroup:
            remove_cgroups(self.cgroup[1])


def converse(channel: Channel, judges: Judges, prepared: Prepared, parts: dict,
             settled, deadline: float, tail: list, start_kernel=None, cases=None,
             capture=None) -> RunOutcome:
    """The protocol loop, until the runner's ``Results`` (RuntimeError when it ends without).
    ``start_kernel(StartKernel) -> KernelStarted``: the warm kernels, when there are;
    ``cases``: ``{cell index: what its check asked for}`` (:func:`.cases.cases_of`);
    ``capture``: a dict that gets each graded cell's ``Answer``, by grade id."""
    cases = cases or {}
    out = RunOutcome()
    while True:
        msg = channel.receive(deadline)
        if msg is None:
            raise RuntimeError("the runner gave no result" + (f": {tail[-1][-300:]}" if tail else ""))
        if isinstance(msg, StartKernel):
            channel.send(start_kernel(msg) if start_kernel else KernelStarted(None, "none here"))
        elif isinstance(msg, Need):
            i = msg.index
            if i in settled:
                out.verdicts[i] = Verdict("Settled", "scored 0 by the static pass; not run")
                channel.send(SETTLED)
                continue
            try:
                ship, drop = judges.ask("inputs", prepared.graded[i], parts[i].inputs)
            except JudgeError as err:       # the check itself failed: not the learner's
                ship, drop, out.verdicts[i] = {}, [], Verdict("JudgeError", str(err))
            channel.send(Probe(parts[i].probe, ship, drop, graded_cell.bound_names(parts[i].probe)))
        elif isinstance(msg, Answer):
            i = msg.index
            if i in out.verdicts:
                continue
            if msg.running:
                out.threads[i] = (msg.running, msg.threads)
            try:
                if capture is not None:
                    capture[prepared.graded[i]] = msg
                reply = judges.ask("verdict", prepared.graded[i], parts[i].judge, msg.names,
                                   msg.missing, cases.get(i))
                out.verdicts[i] = Verdict(None if reply.ok else reply.error, reply.message,
                                          reply.line, None if reply.ok else reply.misconception,
                                          "" if reply.ok else reply.differs, reply.where)
            except JudgeError as err:
                out.verdicts[i] = Verdict("JudgeError", str(err))
        elif isinstance(msg, Results):
            out.results = {r.index: r for r in msg.results}
            out.violations = msg.violations
            return out


def run_prepared(prepared: Prepared, instructor, box: Sandbox, limits: Limits,
                 timeout: float, total_timeout: Optional[float], settled=frozenset(),
                 pool=None, capture=None) -> RunOutcome:
    """Run the submission in the runner (sandboxed when ``box.available``), each graded
    cell's probe in its kernel and its judge here, in a judge process (forked from
    ``pool``'s zygote of the lab, when given: :mod:`mgpu_lab.course.grading.judge_pool`; and,
    sandboxed, the kernel forked warm from ``pool``'s: :mod:`mgpu_lab.course.grading.warm_kernel`).

    ``settled``: indices of graded cells already scored 0 by the static pass: their
    probes are not run (an empty probe is sent in its place) and not judged; the
    learner's cells around them still run. ``capture``: see :func:`converse`.
    """
    tests = graded_cells(instructor)
    parts = {i: graded_cell.split(tests[gid].source) for i, gid in prepared.graded.items()}
    cases = {i: cases_of(tests[gid]) for i, gid in prepared.graded.items()}
    header = Header(nbformat.writes(prepared.nb), timeout, total_timeout, box.available,
                    asdict(limits), bool(box.cgroup), given_sources(instructor),
                    {i: forbidden_of(tests[gid]) for i, gid in prepared.graded.items()},
                    limited=bool(box.run_as) and not box.available)
    with tempfile.TemporaryDirectory(prefix="mgpu-lab-grade-") as scratch:
        argv, cwd, env, cleanup = runner_command(box, limits, scratch)
        home = os.path.join(scratch, "judge")
        os.makedirs(home, mode=0o700)
        user = {} if box.available or not box.run_as else dict(
            user=box.run_as[0], group=box.run_as[1], extra_groups=[])
        # Warm kernels: in the sandbox, or (no sandbox) as the --run-as user (a platform's
        # container without bubblewrap), where each cold kernel and judge would import torch
        # again: about 250 MiB more in Gradescope's 768 MiB.
        as_user = None if box.available else box.run_as
        warm = (pool.warm_kernels(env) if pool is not None and (box.available or as_user)
                else None)
        header.warm = warm is not None
        started: List[int] = []
        memory = next((d for d in cleanup if oom_file(d) is not None), None)
        header.oom_files = [str(oom_file(memory))] if memory is not None else []
        memory_mib = memory_limit_mib(memory or own_memory_cgroup())
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=cwd, env=env, start_new_session=True,
                                **user)
        def start_kernel(msg):
            reply = warm.start(msg, proc.pid, asdict(limits), bool(box.cgroup),
                               [str(d / "cgroup.procs") for d in cleanup],
                               as_user[:2] if as_user else None)
            if as_user and reply.pid is not None:
                started.append(reply.pid)      # no PID namespace ends it with the runner
            return reply
        tail: list = []
        threading.Thread(target=_drain, args=(proc.stderr, tail), daemon=True).start()
        judges = None
        try:
            channel = Channel(proc.stdin, proc.stdout)
            channel.send(header)
            judges = Judges(setup_sources(instructor), home, timeout, pool, limits.memory_gib,
                            box.cgroup if box.available else cgroup_kind())
            judges.setup()                                      # while the kernel starts
            deadline = monotonic() + (total_timeout or 24 * 3600) + 60
            out = converse(channel, judges, prepared, parts, settled, deadline, tail,
                           start_kernel if warm is not None else None, cases, capture)
            out.memory_mib = memory_mib
            return out
        finally:
            if judges is not None:
                judges.close()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pid in started:                 # a warm kernel as --run-as's user, its ranks
                try:
                    if os.stat(f"/proc/{pid}").st_uid == as_user[0]:   # not a pid reused
                        os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            remove_cgroups(cleanup)


def _drain(stream, tail: list, keep: int = 4096) -> None:
    """Read the runner's stderr to its end, keeping only its last few KiB."""
    buf = b""
    for chunk in iter(lambda: stream.read1(65536), b""):
        buf = (buf + chunk)[-keep:]
        tail[:] = [buf.decode("utf-8", "replace")]
