"""Warm kernels: each graded notebook's kernel forked, its imports done, into its sandbox.

A graded kernel's start is nearly all imports: ipykernel, then torch and mgpu_lab
(about 2 of the 2.8 s of CPU a kernel of the test suite costs). A grading run starts
one **zygote** (``python -m mgpu_lab.course.grading.warm_kernel``, with the sandbox's
environment): it imports what kernels import (:data:`IMPORTS`: installed code only,
nothing of a lab or a submission) and then only forks. For a notebook, the runner in
its sandbox asks for its kernel (``StartKernel``, :mod:`.protocol`); the grader passes
the request on with the runner's process, and the zygote's fork enters that sandbox
before anything of the notebook runs:

1. it joins the sandbox's cgroup(s) and namespaces (user, mount, network, IPC, UTS,
   cgroup, PID: ``setns``) and forks the kernel, which is then inside the sandbox's
   PID namespace (its parent, outside, exits at once; the init of the grader's own PID
   namespace adopts it, as an orphan goes to its parent's namespace's reaper, and the
   kernel, a member of the sandbox's PID namespace, is still killed when the sandbox's
   init ends);
2. the kernel becomes what bubblewrap makes of a process: its own session, no
   capability (bounding and ambient sets too) and ``no_new_privs``, the sandbox's
   rlimits and OOM score, environment and folder, no file descriptor of the zygote's, stdio on
   ``/dev/null``; fresh import caches, ``random`` and numpy reseeded, ``SIGCHLD`` default;
3. it runs ``ipykernel_launcher`` as ``python -m ipykernel_launcher -f FILE`` does,
   without ``JPY_PARENT_PID`` (ipykernel would end a kernel whose parent is not the
   runner; a warm kernel's is that init, and it ends with the sandbox).

The judges' zygotes of the run (:mod:`.judge_pool`, one per lab, outside the sandbox:
they hold the instructor's checks) start as forks of this zygote too (``ForkJudges``):
their own session, the judge's environment and folder, then ``python -m
mgpu_lab.course.grading.judge_pool`` as a new process would run it, its imports done.

Without a sandbox, where the grader runs the kernel as another user (``--run-as``: a
platform's container without bubblewrap), the fork skips step 1 (nothing to join: the
kernel runs beside the runner, which the grader's own cgroup, a container's, holds) and
becomes that user (groups, gid, uid) in step 2; the grader ends it and its ranks (their
process group) when the notebook ends. Each kernel and judge then shares the zygote's
imports as in the sandbox: lab 13 graded as Gradescope runs it needs 625 MiB, not 876.

A cold kernel and a warm one see the same sandbox (``tests/test_warm_kernel.py`` grades one
notebook of checks both ways, and as the ``--run-as`` user). Where any step fails (no
``setns`` here, the zygote ended), the runner starts its kernel itself, as without a
zygote: slower, never different.
"""
from __future__ import annotations

import ctypes
import fcntl
import gc
import importlib
import os
import random
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from time import monotonic
from typing import Dict, List, Optional

from .kernel import Adopted
from .protocol import (Channel, ForkJudges, Forked, KernelStarted, Reply, StartKernel, child_pipe,
                       forked_pipes)
from .sandbox import Limits, apply_rlimits

# torch._dynamo: DDP, FSDP, DTensor and a TorchDispatchMode import it on first use, about a
# second of CPU in every kernel of labs 03-15 (a second more for the zygote, once per run).
IMPORTS = ["ipykernel.kernelapp", "torch", "torch._dynamo", "mgpu_lab"]
CLONE = {"user": 0x10000000, "mnt": 0x00020000, "net": 0x40000000, "ipc": 0x08000000,
         "uts": 0x04000000, "cgroup": 0x02000000, "pid": 0x20000000}
NS_GET_PARENT = 0xB702             # ioctl: the user namespace that owns this one
START_TIMEOUT = 30.0               # seconds for the zygote to answer a start


# --- the zygote ------------------------------------------------------------------------

def main() -> int:
    pipe = child_pipe()
    sock = socket.socket(fileno=int(sys.argv[sys.argv.index("--socket") + 1]))
    for name in IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # What the imports made stays out of the collector's reach in every fork: a collection in
    # a fork would write to every object's header, copying ~75 MiB of pages per process.
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)     # each fork's parent half exits at once
    own = [pipe.reader.fileno(), pipe.writer.fileno(), sock.fileno()]
    for req in pipe:
        if isinstance(req, StartKernel):
            pipe.send(fork_kernel(req, own))
        elif isinstance(req, ForkJudges):
            pipe.send(fork_judges(req, sock))
    return 0


def is_kernel_command(argv: List[str]) -> bool:
    """Only ``python -m ipykernel_launcher -f FILE`` (this Python) is started warm."""
    return (len(argv) == 5 and argv[0] == sys.executable and argv[1:3] == ["-m", "ipykernel_launcher"]
            and argv[3] == "-f" and os.path.isabs(argv[4]))


def fork_kernel(req: StartKernel, own: List[int]) -> KernelStarted:
    """Fork a kernel into the sandbox of process ``req.pid``; its pid there, or why not."""
    if not is_kernel_command(req.argv):
        return KernelStarted(None, "not an ipykernel command")
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        try:
            _enter(req, w, own)                       # returns only on failure
        except BaseException as err:
            os.write(w, f"{type(err).__name__}: {err}"[:500].encode())
        os._exit(1)
    os.close(w)
    try:
        text, end = b"", monotonic() + START_TIMEOUT
        while monotonic() < end and select.select([r], [], [], end - monotonic())[0]:
            chunk = os.read(r, 1024)
            if not chunk:
                break
            text += chunk
    finally:
        os.close(r)
    words = text.decode("utf-8", "replace")
    if words.startswith("pid ") and words[4:].isdigit():
        return KernelStarted(int(words[4:]))
    return KernelStarted(None, words or "the fork ended without a word")


def _enter(req: StartKernel, report: int, own: List[int]) -> None:
    """The fork's parent half, outside: join the sandbox, fork the kernel inside, exit."""
    libc = ctypes.CDLL(None, use_errno=True)
    if req.user:                 # no sandbox: the kernel is the user's process, beside the runner
        _fork_kernel(req, report, own, libc)

    def setns(fd: int, kind: str) -> None:
        if libc.setns(fd, CLONE[kind]) != 0:
            raise OSError(ctypes.get_errno(), f"setns({kind}): {os.strerror(ctypes.get_errno())}")

    for procs in req.cgroups:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    fds = {kind: os.open(f"/proc/{req.pid}/ns/{kind}", os.O_RDONLY) for kind in CLONE}
    same = lambda fd, path: os.fstat(fd).st_ino == os.stat(path).st_ino  # noqa: E731
    if same(fds["user"], "/proc/self/ns/user"):
        raise OSError("that process is not in a sandbox of its own")
    # bubblewrap's --disable-userns nests the sandbox's user namespace in the one that owns
    # its mounts: join that one first (its mounts and the rest need its capabilities).
    owner = fcntl.ioctl(fds["user"], NS_GET_PARENT)
    nested = not same(owner, "/proc/self/ns/user")
    setns(owner if nested else fds["user"], "user")
    for kind in ("mnt", "net", "ipc", "uts", "cgroup", "pid"):
        setns(fds[kind], kind)
    if nested:
        setns(fds["user"], "user")
    for fd in [owner, *fds.values()]:
        os.close(fd)
    _fork_kernel(req, report, own, libc)


def _fork_kernel(req: StartKernel, report: int, own: List[int], libc) -> None:
    """Fork the kernel (inside the sandbox's PID namespace, when joined) and end this half: the
    kernel's parent is then the namespace's init, or the grader's."""
    if os.fork() == 0:
        try:
            _become_kernel(req, report, own, libc)
        except BaseException as err:
            os.write(report, f"{type(err).__name__}: {err}"[:500].encode())
        os._exit(1)
    os._exit(0)


def _become_kernel(req: StartKernel, report: int, own: List[int], libc) -> None:
    """Inside the sandbox: become what bubblewrap makes of a process, then the kernel."""
    os.setsid()
    for cap in range(64):                              # EINVAL past the last one
        libc.prctl(24, cap, 0, 0, 0)                   # PR_CAPBSET_DROP
    libc.prctl(47, 4, 0, 0, 0)                         # PR_CAP_AMBIENT, CLEAR_ALL
    if req.user:                                       # the --run-as user's, as a cold kernel
        os.setgroups([])
        os.setgid(req.user[1])
        os.setuid(req.user[0])
        libc.prctl(4, 1, 0, 0, 0)                      # PR_SET_DUMPABLE: as a cold kernel is

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()) != 0:   # v3, all zero
        raise OSError(ctypes.get_errno(), "capset")
    if libc.prctl(38, 1, 0, 0, 0) != 0:                # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "no_new_privs")
    apply_rlimits(Limits(**req.limits), req.cgroup)
    try:                                               # the OOM killer's first choice, as
        with open("/proc/self/oom_score_adj", "w") as f:   # a cold kernel (:mod:`.runner`)
            f.write("1000")
    except OSError:
        pass
    _fresh_process({k: v for k, v in req.env.items() if k != "JPY_PARENT_PID"}, req.cwd)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2, *own):                         # the zygote's pipes: /dev/null now
        os.dup2(null, fd)
    os.write(report, f"pid {os.getpid()}".encode())
    _close_fds_but({0, 1, 2, *own})
    sys.argv = ["-m", *req.argv[3:]]
    try:
        runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    os._exit(code)


def fork_judges(req: ForkJudges, sock: socket.socket):
    """Fork a lab's judge zygote (``python -m mgpu_lab.course.grading.judge_pool``, as the grader
    would start it, but with this zygote's imports done): ``Forked``, or ``Reply`` why not."""
    _, fds, _, _ = socket.recv_fds(sock, 16, 3)
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return Reply(False, "JudgeError", "no pipes came with the request")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            os.dup2(fds[0], 0)
            os.dup2(fds[1], 1)
            os.dup2(os.open(os.devnull, os.O_RDWR), 2)
            _close_fds_but({0, 1, 2, fds[2]})          # this zygote's pipes and socket too
            _fresh_process(req.env, req.cwd)
            sys.argv = ["-m", "--socket", str(fds[2])]
            runpy.run_module("mgpu_lab.course.grading.judge_pool", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    return Forked(pid)


def _close_fds_but(keep) -> None:
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:
                pass


def _fresh_process(env: Dict[str, str], cwd: str) -> None:
    """What a fork keeps of this zygote that a new process in ``cwd`` with ``env`` would
    not have: its environment, folder, seeds, SIGCHLD handler and import caches."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    random.seed()
    if "numpy" in sys.modules:                         # its global generator too (torch's is
        sys.modules["numpy"].random.seed()             # seeded alike in every process)
    tempfile.tempdir = None
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    sys.path[0] = os.getcwd()                          # as ``python -m`` in this folder
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()


# --- the grader's side ----------------------------------------------------------------

def sandbox_pid(root: int, inner: int) -> Optional[int]:
    """The pid, seen from here, of the process under ``root`` whose pid in its sandbox is
    ``inner`` (the runner tells its own); None when there is none."""
    todo, seen = [root], set()
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/status") as f:
                nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
        except OSError:
            continue
        if len(nspid) > 1 and nspid[-1] == str(inner):
            return pid
        todo += children.get(pid, [])
    return None


class WarmKernels:
    """The zygote of a grading run (``env``: the sandbox's environment); :meth:`start`
    answers a runner's ``StartKernel``."""

    def __init__(self, env: dict):
        self.env, self.lock, self.broken = env, threading.Lock(), ""
        self.home = tempfile.mkdtemp(prefix="mgpu-lab-warm-")
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:                            # importing while the first runner starts
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mgpu_lab.course.grading.warm_kernel", "--socket",
                 str(theirs.fileno())],
                cwd=self.home, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, start_new_session=True, pass_fds=(theirs.fileno(),))
            self.channel = Channel(self.proc.stdin, self.proc.stdout)
        except OSError as err:
            self.proc, self.broken = None, f"the warm zygote did not start ({err})"
        finally:
            theirs.close()

    def start(self, req: StartKernel, root: int, limits: dict, cgroup: bool,
              cgroups: List[str], user=None) -> KernelStarted:
        """Fork the kernel ``req`` asks for into the sandbox under process ``root``; with
        ``user`` (``(uid, gid)``: no sandbox, ``root`` the runner itself), as that user."""
        target = (root if req.pid == root else None) if user else sandbox_pid(root, req.pid)
        if target is None:
            return KernelStarted(None, "the runner's process was not found")
        with self.lock:
            if self.broken:
                return KernelStarted(None, self.broken)
            try:
                self.channel.send(StartKernel(req.argv, req.env, req.cwd, target, limits,
                                              cgroup, cgroups, list(user or [])))
                reply = self.channel.receive(monotonic() + START_TIMEOUT + 60)
            except (OSError, ValueError) as err:
                reply = err
            if not isinstance(reply, KernelStarted):
                self.broken = f"the warm zygote failed ({reply or 'no answer'})"
                self._end()
                return KernelStarted(None, self.broken)
            return reply

    def fork_judges(self, env: dict, cwd: str, sock: socket.socket):
        """A lab's judge zygote forked from this one (``env``, ``cwd``: the judge's;
        ``sock``: its end of the judge pool's socket): a ``Popen``-like handle with its
        pipes, or None (start one yourself: this zygote is gone, or its imports would not
        be the judge's, with another ``PYTHONPATH``)."""
        if env.get("PYTHONPATH") != self.env.get("PYTHONPATH"):
            return None

        def ask(fds):
            with self.lock:
                if self.broken:
                    return None
                try:
                    self.channel.send(ForkJudges(env, cwd))
                    socket.send_fds(self.sock, [b"j"], fds + [sock.fileno()])
                    reply = self.channel.receive(monotonic() + START_TIMEOUT + 60)
                except (OSError, ValueError) as err:
                    reply = err
                if not isinstance(reply, (Forked, Reply)):
                    self.broken = f"the warm zygote failed ({reply or 'no answer'})"
                    self._end()
                return reply
        reply, stdin, stdout = forked_pipes(ask)
        if stdin is None:
            return None
        proc = Adopted(reply.pid)
        proc.stdin, proc.stdout = stdin, stdout
        return proc

    def _end(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                stream.close()

    def close(self) -> None:
        import shutil
        with self.lock:
            self._end()
            self.proc, self.broken = None, "closed"
        self.sock.close()
        shutil.rmtree(self.home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
