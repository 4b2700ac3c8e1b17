"""The judge: where a graded cell's verdict is computed, out of the learner's reach.

    python -m mgpu_lab.course.judge      (started by the grader, never by hand)

A process of the grader's own, with the instructor's code only: it never imports,
unpickles or runs anything the learner wrote. It runs the instructor's cells tagged
``setup`` (imports, models, helpers the checks use); then, per graded cell
(:mod:`mgpu_lab.course.graded_cell`):

1. ``Inputs``: runs the cell's inputs part in a fresh copy of the setup namespace and
   returns the names it bound that are plain data (the grader sends them into the
   learner's kernel) and those that are not (deleted there);
2. ``Judge``: reads the probe's data with ``torch.load(weights_only=True)`` (tensors,
   numbers, strings, lists, dicts — no code can come through), binds it over the inputs'
   names and runs the judge part: its exception, or none, is the verdict.

The messages are :mod:`mgpu_lab.course.protocol`'s; :class:`JudgeProcess` is
the grader's side.
"""
from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
import traceback
from time import monotonic
from typing import Dict, List, Optional, Tuple

from .protocol import Channel, Inputs, Judge, Reply, Setup, child_pipe

MAGIC = re.compile(r"^\s*[%!].*$", re.M)     # IPython line magics and shell escapes
PLAIN = "plain data (tensors, numbers, strings, lists, tuples, dicts)"
VERDICT_LIMIT = 2000


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


def _line(err: BaseException, name: str) -> Optional[int]:
    """The line of the graded cell (compiled as ``name``) where ``err`` was raised."""
    line = None
    for frame in traceback.extract_tb(err.__traceback__):
        if frame.filename == name:
            line = frame.lineno
    return line


def _failure(err: BaseException, missing: List[str], name: str) -> Reply:
    """The verdict of a failed check: the exception's name, message and line of the cell."""
    kind, line = type(err).__name__, _line(err, name)
    if isinstance(err, NameError) and getattr(err, "name", None) in missing:
        return Reply(False, kind, f"`{err.name}`, which the probe computes from your code, "
                                  f"is not {PLAIN}: the grader could not read it", line)
    return Reply(False, kind, str(err)[:VERDICT_LIMIT], line)


def main() -> int:
    pipe = child_pipe()
    base = {"__name__": "__main__"}
    return serve(pipe, base)


def run_setup(cells: List[str], base: dict) -> Reply:
    """Run the lab's setup cells into ``base``."""
    try:
        for i, src in enumerate(cells):
            _run(src, base, f"<setup cell {i}>")
        return Reply(True)
    except BaseException as err:
        return Reply(False, "JudgeError", f"Setup: {type(err).__name__}: {err}"[:VERDICT_LIMIT])


def serve(pipe, base: dict) -> int:
    """Answer requests until the pipe closes; ``base``: the setup namespace."""
    from .graded_cell import bound_names
    spaces: Dict[str, dict] = {}
    for req in pipe:
        try:
            if isinstance(req, Setup):
                pipe.send(run_setup(req.cells, base))
            elif isinstance(req, Inputs):
                ns = dict(base)
                _run(req.source, ns, f"<inputs of {req.id}>")
                ship, drop = {}, []
                for name in bound_names(req.source):
                    data = dumps(ns[name]) if name in ns else None
                    if data is None:
                        drop.append(name)
                    else:
                        ship[name] = data
                spaces[req.id] = ns
                pipe.send(Reply(True, ship=ship, drop=drop))
            elif isinstance(req, Judge):
                ns = spaces.pop(req.id)
                missing = list(req.missing)
                for name in missing:
                    ns.pop(name, None)
                for name, data in req.answer.items():
                    try:
                        ns[name] = loads(data)
                    except Exception:
                        ns.pop(name, None)
                        missing.append(name)
                name = f"<judge of {req.id}>"
                try:
                    _run(req.source, ns, name)
                    pipe.send(Reply(True))
                except BaseException as err:  # the verdict: any exception fails the check
                    pipe.send(_failure(err, missing, name))
            else:
                pipe.send(Reply(False, "JudgeError", f"unknown request {type(req).__name__}"))
        except BaseException as err:
            pipe.send(Reply(False, "JudgeError",
                            f"{type(req).__name__}: {type(err).__name__}: {err}"[:VERDICT_LIMIT]))
    return 0


# --- the grader's side --------------------------------------------------------

class JudgeClient:
    """The grader's end of a judge: every request waits ``timeout`` seconds at most, then
    the judge is killed and :class:`JudgeError` raised."""

    timeout: float
    channel: Channel

    def alive(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _ask(self, what: str, req) -> Reply:
        if not self.alive():
            raise JudgeError("the judge process has ended")
        try:
            self.channel.send(req)
            reply = self.channel.receive(monotonic() + self.timeout)
        except (OSError, ValueError) as err:
            self.close()
            raise JudgeError(f"the judge's pipe failed during {what}: {err}") from None
        if reply is None:
            alive = self.alive() and not self.channel.ended
            self.close()
            raise JudgeError(f"the judge gave no answer to {what} within {self.timeout:g} s"
                             if alive else f"the judge process died during {what}")
        if reply.error == "JudgeError":
            raise JudgeError(reply.message)
        return reply

    def setup(self, cells: List[str]) -> None:
        self._ask("the setup cells", Setup(cells))

    def inputs(self, grade_id: str, source: str) -> Tuple[Dict[str, str], List[str]]:
        """``(names to send, as base64; names to delete in the kernel)``."""
        reply = self._ask(f"{grade_id}'s inputs", Inputs(grade_id, source))
        return reply.ship, reply.drop

    def verdict(self, grade_id: str, source: str, answer: Dict[str, str],
                missing: List[str]) -> Reply:
        """The judge part's :class:`~mgpu_lab.course.protocol.Reply`: ``ok``, or the
        exception's name, its line of the cell, and (an assertion's) message."""
        return self._ask(f"{grade_id}'s judge", Judge(grade_id, source, answer, missing))


class JudgeProcess(JudgeClient):
    """A judge process of its own (one notebook's, or one that a pool could not fork)."""

    def __init__(self, env: dict, cwd: str, timeout: float):
        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, "-m", "mgpu_lab.course.judge"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, cwd=cwd, env=env,
                                     start_new_session=True)
        self.channel = Channel(self.proc.stdin, self.proc.stdout)

    def alive(self) -> bool:
        return self.proc.poll() is None

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
