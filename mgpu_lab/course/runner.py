"""The grader's runner: executes one submission, inside the sandbox, over a pipe.

    python -c COMMAND      (started by the grader, never by hand: ``COMMAND`` below)

The grader writes one JSON line (the submission with every graded cell's source
left out, the limits, the "must not call" lists). Before each graded cell the
runner asks ``{"need": index}``; the grader answers with the cell's *probe*
part (:mod:`mgpu_lab.course.graded_cell`) and the check's inputs as plain data,
which the runner loads into the kernel's namespace before the probe runs. After
it, the runner saves the names the probe bound (``torch.save`` in the kernel)
and sends them back, ``{"answer": index, "names": {...}}``: the grader's judge
process reads them as plain data and decides. The sandbox never holds a judge,
the instructor's notebook, or a graded cell before its turn. At the end: one
line, ``{"results": [...], "violations": {...}}``. The kernel (a child of the
runner) has neither end of the pipe; its output goes to stderr.
"""
from __future__ import annotations

import ast
import base64
import json
import os
import shutil
import sys
import tempfile

GUARD = '__import__("mgpu_lab.course.guard", fromlist=["guard"])'
PLACEHOLDER = "# graded cell: the grader hands its source in when it runs"
MESSAGE_LIMIT = 2000
# How the grader starts this module: ``python -c COMMAND``, which imports the runner
# without running ``mgpu_lab/__init__.py``. That file imports torch (1.5 s of CPU per
# graded notebook), which the runner never uses; the kernel imports the package itself.
COMMAND = ("import runpy, sys, types, importlib.util; "
           "package = types.ModuleType('mgpu_lab'); "
           "package.__path__ = list(importlib.util.find_spec('mgpu_lab').submodule_search_locations); "
           "sys.modules['mgpu_lab'] = package; "
           "runpy.run_module('mgpu_lab.course.runner', run_name='__main__', alter_sys=True)")
ANSWER_LIMIT = 64 * 2**20          # bytes of probe data per graded cell
# Run silently in the kernel around a graded cell (no names left behind).
LOAD = """def _mgpu_lab_io(ship, drop):
    import torch
    ns = get_ipython().user_ns
    for name in drop:
        ns.pop(name, None)
    for name, path in ship.items():
        ns[name] = torch.load(path, weights_only=True)
try:
    _mgpu_lab_io({ship!r}, {drop!r})
finally:
    del _mgpu_lab_io"""
SAVE = """def _mgpu_lab_io(names, folder):
    import os, torch
    ns = get_ipython().user_ns
    for name in names:
        if name in ns:
            try:
                torch.save(ns[name], os.path.join(folder, name + ".pt"))
            except Exception:
                pass
try:
    _mgpu_lab_io({names!r}, {folder!r})
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


def _kernel_pid(client):
    km = client.km
    for owner in (getattr(km, "provisioner", None), getattr(km, "kernel", None)):
        pid = getattr(owner, "pid", None)
        if isinstance(pid, int):
            return pid
    return None


def main() -> int:
    # Keep the protocol's ends to ourselves: the kernel inherits /dev/null and stderr.
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _protect()
    header = json.loads(proto_in.readline())

    import nbformat
    from .kernel import run_notebook, silent
    from .sandbox import Limits, apply_rlimits

    if header.get("sandboxed"):
        apply_rlimits(Limits(**header["limits"]), header.get("cgroup", False))
    nb = nbformat.reads(header["notebook"], as_version=4)
    graded = {int(k): v for k, v in header["graded"].items()}
    trusted = header.get("trusted", [])
    violations = {}

    io_dir = tempfile.mkdtemp(prefix="mgpu-lab-check-")
    collect = {}

    async def before(client, index, cell):
        if index not in graded:
            return
        proto_out.write(json.dumps({"need": index}) + "\n")
        proto_out.flush()
        msg = json.loads(proto_in.readline())
        cell.source, collect[index] = msg["source"], msg["collect"]
        ship = {}
        for name, data in msg["ship"].items():
            ship[name] = os.path.join(io_dir, f"{index}-in-{name}.pt")
            with open(ship[name], "wb") as f:
                f.write(base64.b64decode(data))
        await silent(client, LOAD.format(ship=ship, drop=msg["drop"]))
        forbidden = graded[index].get("forbidden") or []
        if forbidden:
            await silent(client, f"{GUARD}.install({forbidden!r}, {[cell.source] + trusted!r}, "
                                 "get_ipython().user_ns, get_ipython().transform_cell)")

    async def after(client, index, cell, result):
        if header.get("sandboxed"):
            pid = _kernel_pid(client)
            if pid is not None and _reap(pid) and result.error != "DeadKernel":
                # The kernel's dead children stay zombies (and count against the
                # process limit) until it waits for them.
                await silent(client, WAIT_CHILDREN)
        if result.error in ("Timeout", "DeadKernel"):
            return
        if index in graded and graded[index].get("forbidden"):
            reply = await silent(client, "", {"v": f"{GUARD}.uninstall()"})
            value = reply.get("user_expressions", {}).get("v", {})
            try:
                seen = ast.literal_eval(value.get("data", {}).get("text/plain", "[]"))
            except (ValueError, SyntaxError):
                seen = []
            if seen:
                violations[index] = [str(v)[:200] for v in seen][:10]
        if index in graded and result.error is None:
            proto_out.write(json.dumps(await _answer(client, index, collect[index])) + "\n")
            proto_out.flush()

    async def _answer(client, index, names):
        """The probe's names as plain-data bytes (base64); the rest listed as missing."""
        folder = os.path.join(io_dir, f"{index}-out")
        os.makedirs(folder, exist_ok=True)
        await silent(client, SAVE.format(names=names, folder=folder), wait=60.0)
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
        return {"answer": index, "names": answer, "missing": missing}

    results = run_notebook(nb, cwd=os.getcwd(), timeout=header["timeout"],
                           total_timeout=header.get("total_timeout"), progress=False,
                           before=before, after=after, graded_history=False)
    shutil.rmtree(io_dir, ignore_errors=True)
    out = [{"index": r.index, "error": r.error, "message": (r.message or "")[:MESSAGE_LIMIT],
            "seconds": round(r.seconds, 3)} for r in results]
    proto_out.write(json.dumps({"results": out, "violations": violations}) + "\n")
    proto_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
