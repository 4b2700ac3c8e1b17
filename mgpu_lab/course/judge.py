"""The judge: where a graded cell's verdict is computed, out of the learner's reach.

    python -m mgpu_lab.course.judge      (started by the grader, never by hand)

A process of the grader's own, with the instructor's code only: it never
imports, unpickles or runs anything the learner wrote. Per notebook it runs the
instructor's cells tagged ``setup`` (imports, models, helpers the checks use);
then, per graded cell (:mod:`mgpu_lab.course.graded_cell`):

1. ``inputs``: runs the cell's inputs part in a fresh copy of the setup
   namespace and returns the names it bound that are plain data (the grader
   sends them into the learner's kernel) and those that are not (deleted there);
2. ``judge``: reads the probe's data with ``torch.load(weights_only=True)``
   (tensors, numbers, strings, lists, dicts — no code can come through), binds it
   over the inputs' names and runs the judge part: its exception, or none, is
   the verdict.

Protocol: one JSON line per request on stdin, one per answer on stdout (the
process's own prints go to stderr). :class:`Judge` is the grader's side.
"""
from __future__ import annotations

import base64
import io
import json
import os
import re
import select
import subprocess
import sys
from time import monotonic
from typing import Dict, List, Optional, Tuple

MAGIC = re.compile(r"^\s*[%!].*$", re.M)     # IPython line magics and shell escapes
PLAIN = "plain data (tensors, numbers, strings, lists, tuples, dicts)"


class JudgeError(RuntimeError):
    """The judge process failed or did not answer in time (the grader's fault, not the learner's)."""


def dumps(value) -> Optional[str]:
    """``value`` as base64 of ``torch.save``, or None when it is not plain data."""
    import torch
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        loads(buf.getvalue())
    except Exception:
        return None
    return base64.b64encode(buf.getvalue()).decode("ascii")


def loads(data):
    """Plain data from ``torch.save`` bytes (or their base64): never runs code."""
    import torch
    if isinstance(data, str):
        data = base64.b64decode(data)
    return torch.load(io.BytesIO(data), weights_only=True)


# --- the judge process --------------------------------------------------------

def _run(source: str, ns: dict, name: str) -> None:
    exec(compile(MAGIC.sub("", source), name, "exec"), ns)


def _failure(err: BaseException, missing: List[str]) -> dict:
    message = str(err)
    if isinstance(err, NameError) and getattr(err, "name", None) in missing:
        message = (f"`{err.name}`, which the probe computes from your code, is not "
                   f"{PLAIN}: the grader could not read it")
    return {"ok": False, "error": type(err).__name__, "message": message[:2000]}


def main() -> int:
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from .graded_cell import bound_names
    base = {"__name__": "__main__"}
    spaces: Dict[str, Tuple[dict, List[str]]] = {}

    def reply(msg):
        proto_out.write(json.dumps(msg) + "\n")
        proto_out.flush()

    for line in proto_in:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "setup":
                for i, src in enumerate(req["cells"]):
                    _run(src, base, f"<setup cell {i}>")
                reply({"ok": True})
            elif op == "inputs":
                ns = dict(base)
                _run(req["source"], ns, f"<inputs of {req['id']}>")
                ship, drop = {}, []
                for name in bound_names(req["source"]):
                    data = dumps(ns[name]) if name in ns else None
                    if data is None:
                        drop.append(name)
                    else:
                        ship[name] = data
                spaces[req["id"]] = (ns, [])
                reply({"ok": True, "ship": ship, "drop": drop})
            elif op == "judge":
                ns, _ = spaces.pop(req["id"])
                missing = list(req.get("missing", []))
                for name in missing:
                    ns.pop(name, None)
                for name, data in req["answer"].items():
                    try:
                        ns[name] = loads(data)
                    except Exception:
                        ns.pop(name, None)
                        missing.append(name)
                try:
                    _run(req["source"], ns, f"<judge of {req['id']}>")
                    reply({"ok": True})
                except BaseException as err:  # the verdict: any exception fails the check
                    reply(_failure(err, missing))
            else:
                reply({"ok": False, "error": "JudgeError", "message": f"unknown op {op!r}"})
        except BaseException as err:
            reply({"ok": False, "error": "JudgeError",
                   "message": f"{op}: {type(err).__name__}: {err}"[:2000]})
    return 0


# --- the grader's side --------------------------------------------------------

class Lines:
    """JSON lines from a pipe, each waited for until a deadline (a read may bring several)."""

    def __init__(self, stream, limit: int = 2**28):
        self.fd, self.buf, self.limit = stream.fileno(), b"", limit

    def next(self, deadline: float) -> Optional[str]:
        """The next line, or None at the deadline, at the end of the pipe or past the limit."""
        while b"\n" not in self.buf:
            left = deadline - monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 1 << 20)
            if not chunk or len(self.buf) > self.limit:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode("utf-8", "replace")


class Judge:
    """One judge process per graded notebook. Every request waits ``timeout`` seconds
    at most, then the process is killed and :class:`JudgeError` raised."""

    def __init__(self, env: dict, cwd: str, timeout: float):
        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, "-m", "mgpu_lab.course.judge"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, cwd=cwd, env=env,
                                     start_new_session=True)
        self.lines = Lines(self.proc.stdout)

    def _ask(self, what: str, **req) -> dict:
        if self.proc.poll() is not None:
            raise JudgeError(f"the judge process has ended (exit {self.proc.returncode})")
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        line = self.lines.next(monotonic() + self.timeout)
        if line is None:
            alive = self.proc.poll() is None
            self.close()
            raise JudgeError(f"the judge gave no answer to {what} within {self.timeout:g} s"
                             if alive else f"the judge process died during {what}")
        reply = json.loads(line)
        if reply.get("error") == "JudgeError":
            raise JudgeError(reply["message"])
        return reply

    def setup(self, cells: List[str]) -> None:
        self._ask("the setup cells", op="setup", cells=cells)

    def inputs(self, grade_id: str, source: str) -> Tuple[Dict[str, str], List[str]]:
        """``(names to send, as base64; names to delete in the kernel)``."""
        reply = self._ask(f"{grade_id}'s inputs", op="inputs", id=grade_id, source=source)
        return reply["ship"], reply["drop"]

    def verdict(self, grade_id: str, source: str, answer: Dict[str, str],
                missing: List[str]) -> Tuple[Optional[str], str]:
        """``(None, "")`` when the judge part passes, else ``(exception name, message)``."""
        reply = self._ask(f"{grade_id}'s judge", op="judge", id=grade_id, source=source,
                          answer=answer, missing=missing)
        return (None, "") if reply["ok"] else (reply["error"], reply.get("message", ""))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except OSError:
                pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
