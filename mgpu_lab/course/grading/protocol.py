"""The messages between the grader and its two kinds of child process, and their pipes.

Both children (the sandboxed *runner*, :mod:`mgpu_lab.course.grading.runner`, and the trusted
*judge*, :mod:`mgpu_lab.course.grading.judge`) speak one JSON line per message over their
stdin and stdout, and start with the same prelude (:func:`child_pipe`): they keep the
two pipe ends to themselves, read ``/dev/null`` as stdin and print to stderr, so that
nothing they run (a kernel, a check's ``print``) can write into the protocol.

The runner's conversation, per submission::

    grader -> runner   Header          the notebook (graded cells left out), limits
    runner -> grader   Need(i)         graded cell i is next
    grader -> runner   Probe           its probe and the check's inputs (plain data)
    runner -> grader   Answer(i)       the names the probe bound, as plain data, saved at
                                       its end; the learner's threads running then
    ...
    runner -> grader   Results         every cell's outcome, the guard's findings

and, when the header says ``warm``, before each kernel start (the first, and each restart)::

    runner -> grader   StartKernel     its command, environment, folder
    grader -> runner   KernelStarted   the warm kernel's pid, or None: start it yourself

The judge's, per request: ``Setup`` | ``Inputs`` | ``Judge`` -> ``Reply``; a judge's
zygote (one per lab, :mod:`mgpu_lab.course.grading.judge_pool`) answers ``Setup`` once, then
``Fork`` -> ``Forked``. In a sandboxed run the judge zygotes are forks of the warm zygote
(:mod:`mgpu_lab.course.grading.warm_kernel`): ``ForkJudges`` -> ``Forked``.
"""
from __future__ import annotations

import json
import os
import select
import sys
from dataclasses import asdict, dataclass, field, fields
from time import monotonic
from typing import Dict, List, Optional

PLACEHOLDER = "# graded cell: the grader hands its source in when it runs"
# How the grader starts the runner: ``python -c RUNNER_COMMAND``, which imports it without
# running ``mgpu_lab/__init__.py``. That file imports torch (1.5 s of CPU per graded
# notebook), which the runner never uses; the kernel imports the package itself.
RUNNER_COMMAND = ("import runpy, sys, types, importlib.util; "
                  "package = types.ModuleType('mgpu_lab'); "
                  "package.__path__ = list(importlib.util.find_spec('mgpu_lab').submodule_search_locations); "
                  "sys.modules['mgpu_lab'] = package; "
                  "runpy.run_module('mgpu_lab.course.grading.runner', run_name='__main__', alter_sys=True)")
ANSWER_LIMIT = 64 * 2**20          # bytes of probe data per graded cell
LINE_LIMIT = 2**28                 # bytes of one message


# --- the runner's messages ---------------------------------------------------------

@dataclass
class Header:
    notebook: str                  # nbformat JSON, graded cells' sources left out
    timeout: float                 # seconds per cell
    total_timeout: Optional[float]
    sandboxed: bool
    limits: dict                   # sandbox.Limits as a dict
    cgroup: bool
    trusted: List[str]             # the instructor's given cells (may call references)
    graded: Dict[int, List[str]]   # graded cell index -> what it must not call
    limited: bool = False          # no sandbox, another user: still set the rlimits
    warm: bool = False             # ask the grader for the kernel (``StartKernel``) first
    oom_files: List[str] = field(default_factory=list)  # the sandbox's cgroup's OOM-kill counter


@dataclass
class Need:
    index: int


@dataclass
class Probe:
    source: str                    # the probe part of the graded cell
    ship: Dict[str, str]           # input name -> torch.save bytes, base64
    drop: List[str]                # input names that are not plain data: deleted
    collect: List[str]             # the names the probe binds: sent back


@dataclass
class Answer:
    index: int
    names: Dict[str, str]          # name -> torch.save bytes, base64
    missing: List[str]             # bound names that could not be sent
    running: int = 0               # the learner's threads still running when the probe ended
    threads: List[str] = field(default_factory=list)   # a few of their names, cleaned


@dataclass
class Outcome:
    """How one code cell ran (from the kernel: nothing in it is trusted text)."""
    index: int
    error: Optional[str] = None    # exception name, or Timeout, DeadKernel, ...
    message: str = ""
    seconds: float = 0.0
    frames: List[List[int]] = field(default_factory=list)  # [cell index, line], outermost first


@dataclass
class Results:
    results: List[Outcome]
    violations: Dict[int, List[str]]   # graded cell index -> references the guard saw called


@dataclass
class StartKernel:
    """Runner -> grader: start my kernel (``pid``: the runner's, in its sandbox). Grader ->
    warm zygote (:mod:`.warm_kernel`): the same, ``pid`` the runner's as the grader sees
    it, with the sandbox's limits and cgroup files; or, with ``user`` (``[uid, gid]``: no
    sandbox, the kernel run as another user), as that user, beside the runner."""
    argv: List[str]
    env: Dict[str, str]
    cwd: str
    pid: int
    limits: dict = field(default_factory=dict)
    cgroup: bool = False
    cgroups: List[str] = field(default_factory=list)
    user: List[int] = field(default_factory=list)


@dataclass
class KernelStarted:
    pid: Optional[int]             # the kernel's, in the sandbox; None: start it yourself
    why: str = ""


# --- the judge's messages ----------------------------------------------------------

@dataclass
class Setup:
    cells: List[str]


@dataclass
class Inputs:
    id: str
    source: str


@dataclass
class Judge:
    id: str
    source: str
    answer: Dict[str, str]
    missing: List[str]
    cases: dict = field(default_factory=dict)   # expects, free, hidden: :mod:`.cases`


@dataclass
class Fork:
    """To a judge's zygote: fork a judge for one notebook (its pipe ends come as fds over
    the zygote's socket); ``home``: its working folder."""
    home: str


@dataclass
class Forked:
    pid: int


@dataclass
class ForkJudges:
    """To the warm zygote (:mod:`.warm_kernel`): fork a lab's judge zygote, its imports done
    (its two pipe ends and its socket come as fds over the warm zygote's socket); ``env``
    and ``cwd``: the judge's. Answered ``Forked`` or ``Reply(False, ...)``."""
    env: Dict[str, str]
    cwd: str


@dataclass
class Reply:
    ok: bool
    error: Optional[str] = None
    message: str = ""
    line: Optional[int] = None     # where in the graded cell the check failed
    ship: Dict[str, str] = field(default_factory=dict)
    drop: List[str] = field(default_factory=list)
    misconception: Optional[str] = None   # a failed check: the known one its answer matches
    differs: str = ""              # else: what was compared and where it first differs
    where: str = ""                # which part caught it: "visible", "hidden" ("": neither)


KINDS = {cls.__name__: cls for cls in (Header, Need, Probe, Answer, Results, StartKernel,
                                       KernelStarted, Setup, Inputs, Judge, Fork, Forked, ForkJudges,
                                       Reply)}


def encode(msg) -> str:
    return json.dumps({"kind": type(msg).__name__, **asdict(msg)}) + "\n"


def decode(line: str):
    """The message a line holds; ValueError when it is not one."""
    data = json.loads(line)
    cls = KINDS.get(data.pop("kind", None)) if isinstance(data, dict) else None
    if cls is None:
        raise ValueError(f"not a protocol message: {line[:80]!r}")
    names = {f.name for f in fields(cls)}
    msg = cls(**{k: v for k, v in data.items() if k in names})
    if isinstance(msg, Results):
        msg.results = [Outcome(**r) for r in msg.results]
        msg.violations = {int(k): v for k, v in msg.violations.items()}
    if isinstance(msg, Header):
        msg.graded = {int(k): v for k, v in msg.graded.items()}
    return msg


# --- the child's side -----------------------------------------------------------------

class ChildPipe:
    """A child's end: messages in from stdin, out to stdout (as they were at start)."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    def receive(self):
        line = self.reader.readline()
        return decode(line) if line else None

    def __iter__(self):
        while True:
            msg = self.receive()
            if msg is None:
                return
            yield msg

    def send(self, msg) -> None:
        self.writer.write(encode(msg))
        self.writer.flush()


def child_pipe() -> ChildPipe:
    """The prelude of a child process: keep the protocol's ends to ourselves; stdin
    becomes /dev/null and stdout goes to stderr (so a kernel or a check we start, which
    inherits them, can neither read nor write a message)."""
    reader = os.fdopen(os.dup(0), "r", encoding="utf-8")
    writer = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return ChildPipe(reader, writer)


# --- the grader's side ------------------------------------------------------------

def forked_pipes(ask):
    """The pipes to a process that another one forks for us (a zygote): ``ask(fds)`` sends
    the request with the child's two pipe ends and returns the reply. ``(reply, stdin,
    stdout)``: our ends as files where the reply is ``Forked``, else ``(reply, None, None)``,
    every end closed (also when ``ask`` raises)."""
    child_in, ours_out = os.pipe()
    ours_in, child_out = os.pipe()
    reply = None
    try:
        reply = ask([child_in, child_out])
    finally:
        os.close(child_in)
        os.close(child_out)
        if not isinstance(reply, Forked):
            os.close(ours_out)
            os.close(ours_in)
    if not isinstance(reply, Forked):
        return reply, None, None
    return reply, os.fdopen(ours_out, "wb"), os.fdopen(ours_in, "rb")


class Channel:
    """The grader's end of a child's pipes: send a message, receive one by a deadline."""

    def __init__(self, stdin, stdout, limit: int = LINE_LIMIT):
        self.stdin, self.fd, self.buf, self.limit = stdin, stdout.fileno(), b"", limit
        self.ended = False             # the other end closed its pipe (it exited)

    def send(self, msg) -> None:
        self.stdin.write(encode(msg).encode())
        self.stdin.flush()

    def line(self, deadline: float) -> Optional[str]:
        """The next line, or None at the deadline, at the end of the pipe or past the limit."""
        while b"\n" not in self.buf:
            left = deadline - monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 1 << 20)
            self.ended = not chunk
            if not chunk or len(self.buf) > self.limit:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode("utf-8", "replace")

    def receive(self, deadline: float):
        """The next message, or None (deadline, end of pipe); ValueError for a bad line."""
        line = self.line(deadline)
        return None if line is None else decode(line)
