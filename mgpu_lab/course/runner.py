"""The grader's runner: executes one submission, inside the sandbox, over a pipe.

    python -m mgpu_lab.course.runner      (started by the grader, never by hand)

The grader writes one JSON line (the submission with every graded cell's source
left out, the limits, the "must not call" lists) and answers, one JSON line
each, the runner's ``{"need": index}`` requests with that graded cell's source,
hidden tests included, just before it runs: the sandbox never holds the
instructor's notebook, and never a graded cell before its turn. The runner
answers with one line, ``{"results": [...], "violations": {...}}``. The kernel
(a child of the runner) has neither end of the pipe; its output goes to stderr.
"""
from __future__ import annotations

import ast
import json
import os
import sys

GUARD = '__import__("mgpu_lab.course.guard", fromlist=["guard"])'
PLACEHOLDER = "# graded cell: the grader hands its source in when it runs"
MESSAGE_LIMIT = 2000
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

    async def before(client, index, cell):
        if index not in graded:
            return
        proto_out.write(json.dumps({"need": index}) + "\n")
        proto_out.flush()
        cell.source = json.loads(proto_in.readline())["source"]
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

    results = run_notebook(nb, cwd=os.getcwd(), timeout=header["timeout"],
                           total_timeout=header.get("total_timeout"), progress=False,
                           before=before, after=after, graded_history=False)
    out = [{"index": r.index, "error": r.error, "message": (r.message or "")[:MESSAGE_LIMIT],
            "seconds": round(r.seconds, 3)} for r in results]
    proto_out.write(json.dumps({"results": out, "violations": violations}) + "\n")
    proto_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
