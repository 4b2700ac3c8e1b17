"""The grader's runner: executes one submission, inside the sandbox, over a pipe.

    python -c RUNNER_COMMAND      (started by the grader: :data:`.protocol.RUNNER_COMMAND`)

It speaks :mod:`mgpu_lab.course.grading.protocol`: the grader sends a ``Header`` (the
submission with every graded cell's source left out, the limits, the "must not call"
lists). Before each graded cell the runner sends ``Need``; the grader answers with a
``Probe``: the cell's probe part (:mod:`mgpu_lab.course.notebook.graded_cell`) and the check's
inputs as plain data, which the runner loads into the kernel's namespace before the
probe runs. The probe ends by saving the names it bound (:mod:`.snapshot`, a line the
runner appends: in the probe's own execution, so that nothing the learner's code does
later changes them); the runner sends them back in an ``Answer``, with the learner's
threads still running then: the grader's judge process reads them as plain data and
decides. The sandbox never holds a judge, the instructor's notebook, or a graded cell
before its turn. At the end: ``Results``. The kernel (a
child of the runner, or forked warm into its sandbox when the header says ``warm``:
:mod:`.warm_kernel`) has neither end of the pipe; a cold one's output goes to stderr, a
warm one's to ``/dev/null``.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import sys
import tempfile

from . import guard, snapshot
from .protocol import (ANSWER_LIMIT, Answer, KernelStarted, Need, Outcome, Results, StartKernel,
                       child_pipe)

MESSAGE_LIMIT = 2000
# Run silently in the kernel around a graded cell (no names left behind).
LOAD = """def _mgpu_lab_io(ship, drop):
    import torch
    __import__("mgpu_lab.course.grading.snapshot")   # imported before the probe ends
    ns = get_ipython().user_ns
    for name in drop:
        ns.pop(name, None)
    for name, path in ship.items():
        ns[name] = torch.load(path, weights_only=True)
try:
    _mgpu_lab_io({ship!r}, {drop!r})
finally:
    del _mgpu_lab_io"""
WAIT_CHILDREN = """import os as _os
try:
    while _os.waitpid(-1, _os.WNOHANG)[0]:
        pass
except ChildProcessError:
    pass
del _os"""


def _protect() -> None:
    """No same-user process in the sandbox may ptrace us or read our fds and memory."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        pass


REAP_ROUNDS = 10     # sweeps after a cell that left processes behind, 0.2 s apart, until one finds none


def _reap(kernel_pid) -> int:
    """Inside the sandbox's PID namespace: end every process a cell left behind
    (a fork bomb's children, ranks of a launch that hung), keeping ourselves,
    our ancestors (bwrap) and the kernel. Never called outside the sandbox."""
    import signal
    keep, pid = {os.getpid(), kernel_pid}, os.getpid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        keep.add(pid)
    killed = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in keep and int(entry) != 1:
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def _threads(path):
    """``(count, names)`` of the threads the snapshot saw running (the kernel wrote the file:
    bounded and cleaned again here)."""
    try:
        with open(path) as f:
            data = json.loads(f.read(4096))
        running = min(max(int(data["running"]), 0), 10**6)
        names = [snapshot.clean_name(n) for n in list(data["names"])[:snapshot.NAMES_SHOWN]]
        return running, names
    except Exception:
        return 0, []


def _first_victim() -> None:
    """This process and what it starts (the kernel, its ranks) are the OOM killer's first
    choice, before the grader and its judge outside the sandbox (a container's limit holds
    over them all); the largest of them goes first, the kernel or a rank, not this one."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def _oom_counter(header):
    """``oom_kills()`` for :func:`.kernel.run_notebook`: the sandbox's cgroup's OOM-kill
    count, else (no sandbox) this process's own cgroup's, a container's; None: none here."""
    from .sandbox import oom_file, oom_kills, own_memory_cgroup
    files = list(header.oom_files)
    if not files and not header.sandboxed:
        mine = own_memory_cgroup()
        files = [str(oom_file(mine))] if mine is not None else []
    if oom_kills(files) is None:
        return None
    return lambda: oom_kills(files)


def _kernel_pid(client):
    km = client.km
    for owner in (getattr(km, "provisioner", None), getattr(km, "kernel", None)):
        pid = getattr(owner, "pid", None)
        if isinstance(pid, int):
            return pid
    return None


def main() -> int:
    pipe = child_pipe()
    _protect()
    _first_victim()
    header = pipe.receive()

    import nbformat
    from .kernel import run_notebook, silent
    from .sandbox import Limits, apply_rlimits

    if header.sandboxed or header.limited:
        apply_rlimits(Limits(**header.limits), header.cgroup and header.sandboxed)
    nb = nbformat.reads(header.notebook, as_version=4)
    graded, trusted = header.graded, header.trusted
    violations = {}

    io_dir = tempfile.mkdtemp(prefix="mgpu-lab-check-")
    collect = {}

    async def before(client, index, cell):
        if index not in graded:
            return
        pipe.send(Need(index))
        probe = pipe.receive()
        folder = os.path.join(io_dir, f"{index}-out")
        os.makedirs(folder, exist_ok=True)
        collect[index] = probe.collect
        # Line 1 of a probe is blank (an input's line, or the marker's): IPython drops
        # leading blank lines, which would shift every line a traceback names.
        source = "# the check's probe" + probe.source if probe.source.startswith("\n") else probe.source
        cell.source = source + snapshot.LINE.format(names=probe.collect, folder=folder,
                                                    limit=ANSWER_LIMIT)
        ship = {}
        for name, data in probe.ship.items():
            ship[name] = os.path.join(io_dir, f"{index}-in-{name}.pt")
            with open(ship[name], "wb") as f:
                f.write(base64.b64decode(data))
        await silent(client, LOAD.format(ship=ship, drop=probe.drop))
        if graded[index]:
            await silent(client, guard.install_code(graded[index], [cell.source] + trusted))

    async def after(client, index, cell, result):
        if header.sandboxed:
            pid = _kernel_pid(client)
            killed = _reap(pid) if pid is not None else 0
            for _ in range(REAP_ROUNDS if killed else 0):   # an interrupted fork loop may fork on a
                await asyncio.sleep(0.2)                      # moment after the first sweep: sweep again
                if not _reap(pid):
                    break
            if killed and result.error != "DeadKernel":
                # The kernel's dead children stay zombies (and count against the
                # process limit) until it waits for them.
                await silent(client, WAIT_CHILDREN)
        if result.error in ("Timeout", "DeadKernel"):
            return
        if index in graded and graded[index]:
            reply = await silent(client, "", {"v": guard.UNINSTALL})
            seen = guard.read_violations(reply, graded[index])
            if seen:
                violations[index] = seen
        if index in graded and result.error is None:
            pipe.send(_answer(index, collect[index]))

    def _answer(index, names):
        """The probe's names as plain-data bytes (base64); the rest listed as missing."""
        folder = os.path.join(io_dir, f"{index}-out")
        answer, missing, total = {}, [], 0
        for name in names:
            path = os.path.join(folder, name + ".pt")
            size = os.path.getsize(path) if os.path.isfile(path) else None
            if size is None or total + size > ANSWER_LIMIT:
                missing.append(name)
                continue
            total += size
            with open(path, "rb") as f:
                answer[name] = base64.b64encode(f.read()).decode("ascii")
        running, names = _threads(os.path.join(folder, snapshot.THREADS_FILE))
        return Answer(index, answer, missing, running, names)

    def start_kernel(argv, env, cwd):
        """The grader's warm kernel (:mod:`.warm_kernel`): its pid, or None."""
        pipe.send(StartKernel(argv, env, cwd, os.getpid()))
        reply = pipe.receive()
        return reply.pid if isinstance(reply, KernelStarted) else None

    results = run_notebook(nb, cwd=os.getcwd(), timeout=header.timeout,
                           total_timeout=header.total_timeout, progress=False,
                           before=before, after=after, graded_history=False,
                           start_kernel=start_kernel if header.warm else None,
                           oom_kills=_oom_counter(header))
    shutil.rmtree(io_dir, ignore_errors=True)
    pipe.send(Results([Outcome(r.index, r.error, (r.message or "")[:MESSAGE_LIMIT],
                               round(r.seconds, 3), [list(f) for f in r.frames][-20:])
                       for r in results], violations))
    return 0


if __name__ == "__main__":
    sys.exit(main())
