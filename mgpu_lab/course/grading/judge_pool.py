"""One judge process per lab, forked for each notebook.

A judge starts by importing torch and running the lab's setup cells: a few seconds of
CPU, the same for every notebook of the lab. A class's run (and the mutation run, with
dozens of notebooks per lab) pays it once per lab: the **zygote**, a judge that ran the
setup cells and then only forks, is started on the lab's first notebook; each notebook's
judge is a fork of it, in its own session and working folder, with the zygote's state
as the setup cells left it (the same state a fresh judge would have: setup cells define,
they do not start processes or keep files a check writes; ``docs/AUTHORING.md``).

    python -m mgpu_lab.course.grading.judge_pool      (the zygote; started by :class:`JudgePool`)

In a sandboxed run the zygote is itself a fork, of the run's warm zygote
(:mod:`mgpu_lab.course.grading.warm_kernel`), which imported torch and ``mgpu_lab`` already: a lab's
judges then cost only its setup cells (about 1.5 s of CPU less per lab).

The zygote speaks :mod:`mgpu_lab.course.grading.protocol` on its pipes (``Setup``, then
``Fork`` -> ``Forked``) and takes each child's two pipe ends as file descriptors over a
Unix socket (fd 3). Where anything of this fails, a notebook gets a fresh judge process
of its own (:class:`~mgpu_lab.course.grading.judge.JudgeProcess`), as without a pool.
"""
from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from time import monotonic
from typing import Dict, List, Optional

from .judge import JudgeClient, JudgeError, JudgeProcess, limit_memory, run_setup, serve
from .protocol import Channel, ChildPipe, Fork, Forked, Reply, Setup, child_pipe, forked_pipes


# --- the zygote -------------------------------------------------------------------

def main() -> int:
    pipe = child_pipe()
    limit_memory()
    sock = socket.socket(fileno=int(sys.argv[sys.argv.index("--socket") + 1]))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)      # the forks are reaped by the system
    base = {"__name__": "__main__"}
    for req in pipe:
        if isinstance(req, Setup):
            pipe.send(run_setup(req.cells, base))
        elif isinstance(req, Fork):
            _, fds, _, _ = socket.recv_fds(sock, 16, 2)
            if len(fds) != 2:
                pipe.send(Reply(False, "JudgeError", "no pipe came with the fork request"))
                continue
            gc.freeze()      # the setup's objects stay shared: no collection copies them
            pid = os.fork()
            if pid == 0:                                    # the notebook's judge
                code = 1
                try:
                    code = _child(req.home, fds, base, pipe, sock)
                finally:
                    os._exit(code)
            for fd in fds:
                os.close(fd)
            pipe.send(Forked(pid))
    return 0


def _child(home: str, fds: List[int], base: dict, zygote_pipe: ChildPipe, sock) -> int:
    """A notebook's judge: the zygote's state, its own session, folder and pipes."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)       # its launch() waits for its ranks
    os.setsid()
    sock.close()
    for stream in (zygote_pipe.reader, zygote_pipe.writer):
        try:
            os.close(stream.fileno())
        except OSError:
            pass
    os.chdir(home)
    os.environ.update(HOME=home, TMPDIR=home, MPLCONFIGDIR=os.path.join(home, ".mpl"))
    tempfile.tempdir = None
    _one_thread()
    pipe = ChildPipe(os.fdopen(fds[0], "r", encoding="utf-8"),
                     os.fdopen(fds[1], "w", encoding="utf-8"))
    return serve(pipe, base)


def _one_thread() -> None:
    """The judge's OpenMP threads as its environment says (``OMP_NUM_THREADS``, 1: the judge's
    environment sets it): libgomp read the variable when the warm zygote, started with the
    sandbox's environment, loaded it. A judge that ran a parallel region with more threads
    and then forks (Lightning's ``ddp_notebook`` in lab 09's ex2) leaves children that hang in
    their first large product (GNU OpenMP is not fork-safe; ``mgpu_lab.launch``'s ranks set
    one thread for the same reason)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or 1)))
        except (ValueError, RuntimeError):
            pass


# --- the grader's side --------------------------------------------------------------

class ForkedJudge(JudgeClient):
    """A notebook's judge forked from its lab's zygote (not our child: it is ended by
    closing its pipe, or killed with its session)."""

    def __init__(self, pid: int, stdin, stdout, timeout: float):
        self.pid, self.timeout = pid, timeout
        self.channel = Channel(stdin, stdout)
        self.streams, self.closed = (stdin, stdout), False

    def alive(self) -> bool:
        return not self.closed and not self.channel.ended

    def setup(self, cells) -> None:      # the zygote ran them
        pass

    def close(self) -> None:
        if not self.closed and not self.channel.ended:
            try:                         # past a time limit, or at the end: its whole session
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass
        self.closed = True
        for stream in self.streams:
            try:
                stream.close()
            except OSError:
                pass


class Zygote:
    """A lab's zygote process; :meth:`fork` gives a notebook its judge."""

    def __init__(self, env: dict, home: str, setup: List[str], timeout: float, warm=None):
        self.timeout, self.lock = timeout, threading.Lock()
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:        # a fork of the run's warm zygote (its imports done), else a new process
            self.proc = warm.fork_judges(env, home, theirs) if warm is not None else None
            self.proc = self.proc or subprocess.Popen(
                [sys.executable, "-m", "mgpu_lab.course.grading.judge_pool", "--socket",
                 str(theirs.fileno())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, cwd=home, env=env, start_new_session=True,
                pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self.channel = Channel(self.proc.stdin, self.proc.stdout)
        reply = self._ask(Setup(setup), "the setup cells")
        if not (isinstance(reply, Reply) and reply.ok):
            self.close()
            raise JudgeError(getattr(reply, "message", "") or "the zygote's setup failed")

    def _ask(self, msg, what: str):
        self.channel.send(msg)
        reply = self.channel.receive(monotonic() + self.timeout)
        if reply is None:
            self.close()
            raise JudgeError(f"the judge's zygote gave no answer to {what}")
        return reply

    def fork(self, home: str) -> ForkedJudge:
        def ask(fds):
            with self.lock:
                if self.proc.poll() is not None:
                    raise JudgeError("the judge's zygote has ended")
                socket.send_fds(self.sock, [b"f"], fds)
                return self._ask(Fork(home), "a fork")
        reply, stdin, stdout = forked_pipes(ask)
        if stdin is None:
            raise JudgeError(getattr(reply, "message", "") or "the zygote could not fork")
        return ForkedJudge(reply.pid, stdin, stdout, self.timeout)

    def close(self) -> None:
        for kill in (lambda: os.killpg(self.proc.pid, signal.SIGKILL), self.proc.kill):
            if self.proc.poll() is None:     # its session (its judges), else itself
                try:
                    kill()
                except OSError:
                    pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.sock.close()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class JudgePool:
    """The zygotes of a grading run, one per lab (its setup cells), made on first use, and
    the run's warm kernels (:meth:`warm_kernels`), whose zygote, when there is one, forks
    the judges' zygotes too. ``env_for(home)``: a judge's environment.

    At most ``keep`` zygotes live at once (the least recently used is closed to make room;
    its lab gets a new one when it comes back; ``mgpu-lab grade`` keeps ``--jobs``): each
    holds its lab's setup in memory, and a run over every lab in one 768 MiB container
    cannot hold sixteen (labs 09, 10, 11 and 13 were killed for memory). A notebook's judge is
    in its own session, so closing its lab's zygote does not end it."""

    KEEP = 3

    def __init__(self, env_for, timeout: float, keep: int = KEEP):
        self.env_for, self.timeout, self.keep = env_for, timeout, max(1, keep)
        self.zygotes: Dict[tuple, Optional[Zygote]] = {}    # least recently used first
        self.lock = threading.Lock()
        self.scratch = tempfile.mkdtemp(prefix="mgpu-lab-judges-")
        self.kernels = None

    def warm_kernels(self, env: dict):
        """The run's :class:`~mgpu_lab.course.grading.warm_kernel.WarmKernels` (``env``: the
        sandbox's, the same for every notebook), made on first use."""
        from .warm_kernel import WarmKernels
        with self.lock:
            if self.kernels is None:
                self.kernels = WarmKernels(env)
            return self.kernels

    def judge(self, setup: List[str], home: str) -> JudgeClient:
        """A judge for one notebook whose lab has these setup cells, set up: a fork of the
        lab's zygote, or (no zygote could be made) a fresh process that runs them itself."""
        key = tuple(setup)
        with self.lock:
            if key in self.zygotes:
                self.zygotes[key] = self.zygotes.pop(key)           # now the most recent
            else:
                while len(self.zygotes) >= self.keep:
                    oldest = self.zygotes.pop(next(iter(self.zygotes)))
                    if oldest is not None:
                        with oldest.lock:                          # not while it forks
                            oldest.close()
                folder = tempfile.mkdtemp(dir=self.scratch)
                self.zygotes[key] = None
                for warm in ([self.kernels] if self.kernels is not None else []) + [None]:
                    try:
                        self.zygotes[key] = Zygote(self.env_for(folder), folder, setup,
                                                   self.timeout, warm)
                        break
                    except (JudgeError, OSError):
                        pass
            zygote = self.zygotes[key]
        if zygote is not None:
            try:
                return zygote.fork(home)
            except (JudgeError, OSError):
                pass
        judge = JudgeProcess(self.env_for(home), home, self.timeout)
        judge.setup(setup)
        return judge

    def close(self) -> None:
        import shutil
        for zygote in self.zygotes.values():
            if zygote is not None:
                zygote.close()
        self.zygotes.clear()
        if self.kernels is not None:
            self.kernels.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
