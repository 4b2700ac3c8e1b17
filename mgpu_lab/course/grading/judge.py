"""The judge: where a graded cell's verdict is computed, out of the learner's reach.

    python -m mgpu_lab.course.grading.judge      (started by the grader, never by hand)

A process of the grader's own, with the instructor's code only: it never imports,
unpickles or runs anything the learner wrote. It runs the instructor's cells tagged
``setup`` (imports, models, helpers the checks use); then, per graded cell
(:mod:`mgpu_lab.course.notebook.graded_cell`):

1. ``Inputs``: runs the cell's inputs part in a fresh copy of the setup namespace and
   returns the names it bound that are plain data (the grader sends them into the
   learner's kernel) and those that are not (deleted there);
2. ``Judge``: reads the probe's data (:func:`load_answer`: ``torch.load(weights_only=True)``,
   then every tensor checked and copied, within :data:`ELEMENT_LIMIT` elements), checks that
   it holds exactly the cases the check asked for (:mod:`.cases`: keys, lengths, shapes,
   dtypes; a mismatch is the verdict, :data:`CASES`), binds it over the inputs' names and runs
   the judge part: its exception, or none, is the verdict (:func:`judge_answer`).

It runs under the sandbox's memory limit: the grader puts it in a cgroup of ``--memory``
where it can make one (:class:`~.session.Judges`), and :func:`limit_memory` sets
``RLIMIT_DATA`` to the same where no GPU is present (per process: without a cgroup, a
check that starts N processes may use N times as much). A check that needs more fails
as a ``JudgeError`` of its cell (:data:`MEMORY_MESSAGE`), and the judge is started again.
The messages are :mod:`mgpu_lab.course.grading.protocol`'s; :class:`JudgeProcess` is the
grader's side.
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

from . import hidden
from .protocol import Channel, Inputs, Judge, Reply, Setup, child_pipe

MAGIC = re.compile(r"^\s*[%!].*$", re.M)     # IPython line magics and shell escapes
PLAIN = "plain data (tensors, numbers, strings, lists, tuples, dicts)"
ELEMENT_LIMIT = 2**24        # tensor elements in one graded cell's answer, all names together
DEPTH_LIMIT = 32             # nesting of lists, tuples and dicts in an answer
ITEM_LIMIT = 2**20           # values (containers, numbers, strings...) in an answer
MEMORY_ENV = "MGPU_LAB_JUDGE_MEMORY"   # bytes of data the judge may hold (the sandbox's --memory)
MEMORY_MESSAGE = "the check needed more memory than the grader allows (--memory)"
VERDICT_LIMIT = 2000
DIFFERS_LIMIT = 600     # characters of "what was compared and where it first differs"
CASES = "WrongCases"         # the verdict when the answer does not hold the check's cases


class JudgeError(RuntimeError):
    """The judge process failed or did not answer in time (the grader's fault, not the learner's)."""


class NotPlainData(ValueError):
    """An answer that is not plain data, or past the limits: the judge refuses it."""


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


# --- what an answer may be -------------------------------------------------------------

def _dense_copy(t, budget: List[int]):
    """A contiguous copy of a plain strided tensor whose storage holds every element
    (a view with zero or overlapping strides, sized to make the judge allocate, is refused)."""
    import torch
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise NotPlainData(f"a tensor of type {type(t).__name__}")
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise NotPlainData(f"a tensor of layout {t.layout}")
    if t.dim() > 16:
        raise NotPlainData(f"a tensor of {t.dim()} dimensions")
    numel = t.numel()
    budget[0] -= numel
    if budget[0] < 0:
        raise NotPlainData(f"more than {ELEMENT_LIMIT} tensor elements")
    storage = t.untyped_storage().nbytes() // max(1, t.element_size())
    reach = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    if numel and (min(t.stride(), default=0) < 0 or numel > storage or reach >= storage):
        raise NotPlainData("a tensor view whose storage does not hold its elements")
    copy = t.detach().clone(memory_format=torch.contiguous_format)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(copy, requires_grad=t.requires_grad)
    return copy.requires_grad_(t.requires_grad) if copy.is_floating_point() or copy.is_complex() else copy


def checked(value, budget: Optional[List[int]] = None, depth: int = 0):
    """``value`` with every tensor a dense copy (:func:`_dense_copy`); NotPlainData when
    it holds anything else than numbers, strings, tensors and their containers, nests
    deeper than :data:`DEPTH_LIMIT` or holds more than :data:`ITEM_LIMIT` values."""
    import torch
    budget = budget if budget is not None else [ELEMENT_LIMIT, ITEM_LIMIT]
    budget[1] -= 1
    if budget[1] < 0 or depth > DEPTH_LIMIT:
        raise NotPlainData("nested too deep or too many values")
    if isinstance(value, torch.Tensor):
        return _dense_copy(value, budget)
    if isinstance(value, bool) or value is None or isinstance(
            value, (float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
                    torch.memory_format)):
        return value
    if isinstance(value, int):
        if value.bit_length() > 1024:
            raise NotPlainData("an integer of more than 1024 bits")
        return value
    if isinstance(value, torch.Size):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [checked(v, budget, depth + 1) for v in value]
        return items if type(value) is list else type(value)(items)
    if isinstance(value, dict):
        out = type(value)() if type(value) in (dict,) or _is_ordered(value) else {}
        for k, v in value.items():
            out[checked(k, budget, depth + 1)] = checked(v, budget, depth + 1)
        return out
    raise NotPlainData(f"a value of type {type(value).__name__}")


def _is_ordered(value) -> bool:
    from collections import OrderedDict
    return type(value) is OrderedDict


def load_answer(data):
    """A probe's value: :func:`loads`, then :func:`checked`."""
    return checked(loads(data))


def limit_memory() -> None:
    """Bound the judge's data (``MGPU_LAB_JUDGE_MEMORY`` bytes, ``RLIMIT_DATA``: heap and
    private mappings, as the sandbox bounds each kernel) where no GPU is present (CUDA maps
    far more than it uses); an allocation past it raises instead of growing."""
    import glob
    import resource
    limit = int(os.environ.get(MEMORY_ENV, "0") or 0)
    if limit > 0 and not glob.glob("/dev/nvidia*"):
        try:
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        except (ValueError, OSError):
            pass


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


def out_of_memory(err: BaseException) -> bool:
    """A ``MemoryError``, or torch's failed allocation (a ``RuntimeError`` of its allocator)."""
    text = str(err)[:1000] if isinstance(err, RuntimeError) else ""
    return isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError" or (
        "can't allocate memory" in text or "CPUAllocator" in text)


def _failure(err: BaseException, missing: List[str], name: str, source: str = "") -> Reply:
    """The verdict of a failed check. Only an ``AssertionError`` keeps its message (the
    instructor's words); any other exception is named with its line of the graded cell:
    its text may quote the learner's data. A failure on a hidden line of ``source`` (the
    judge part) says which hidden check failed, never its line or values (:mod:`.hidden`).
    A check out of memory is the grader's ``JudgeError`` (:data:`MEMORY_MESSAGE`): the
    judge is then started afresh."""
    if out_of_memory(err):
        return Reply(False, "JudgeError", MEMORY_MESSAGE)
    kind, line = type(err).__name__, _line(err, name)
    if isinstance(err, NameError) and getattr(err, "name", None) in missing:
        return Reply(False, kind, f"`{err.name}`, which the probe computes from your code, "
                                  f"is not {PLAIN}: the grader could not read it", line)
    frames = traceback.extract_tb(err.__traceback__)
    secret = hidden.failure(source, kind, line, bool(frames) and frames[-1].filename == name)
    if secret is not None:
        return Reply(False, secret[0], secret[1], None, where="hidden")
    if isinstance(err, AssertionError):
        return Reply(False, kind, str(err)[:VERDICT_LIMIT], line, where="visible")
    return Reply(False, kind, "", line, where="visible" if line else "")


def main() -> int:
    pipe = child_pipe()
    limit_memory()
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


def judge_answer(ns: dict, req: Judge) -> Reply:
    """The verdict on one probe's answer, in ``ns`` (the inputs part's namespace): the
    answer loaded, checked against the cases the check asked for (:mod:`.cases`), then the
    judge part run."""
    from .cases import check_cases
    missing = list(req.missing)
    for name in missing:
        ns.pop(name, None)
    answer = {}
    for name, data in req.answer.items():
        try:
            ns[name] = answer[name] = load_answer(data)
        except Exception:
            ns.pop(name, None)
            missing.append(name)
    cases = req.cases or {}
    known = cases.get("misconceptions") if "expects" in cases else None
    ref = cases.get("reference") if "expects" in cases else None
    seen = _fingerprint(answer, missing, cases) if known or ref else None   # before the check runs
    if "expects" in cases:              # exactly the names the solution sends, and their cases
        for name in set(answer) - set(cases["expects"]):
            ns.pop(name, None)
        problem = check_cases(cases["expects"], answer, cases.get("free", ()),
                              cases.get("hidden"), missing)
        if problem:
            where = "hidden" if problem.startswith("a hidden check's") else "visible"
            return _named(Reply(False, CASES, problem[:VERDICT_LIMIT], where=where), seen, cases)
    name = f"<judge of {req.id}>"
    try:
        _run(req.source, ns, name)
        return Reply(True)
    except BaseException as err:  # the verdict: any exception fails the check
        return _named(_failure(err, missing, name, req.source), seen, cases)


def _fingerprint(answer: dict, missing: List[str], cases: dict):
    """``(fingerprint, paths, values)`` of the answer over the names the check reads
    (:mod:`.misconceptions`), taken before the judge part runs (it may change the tensors
    it reads), where it has the containers of a known misconception or of the solution's
    reference; None if not, or if it fails."""
    from .misconceptions import answer_nodes, could_match, fingerprint
    try:
        sent = {k: v for k, v in answer.items() if k not in missing}
        ref = cases.get("reference")
        shapes = list(cases.get("misconceptions") or []) + ([ref] if ref else [])
        if not could_match(sent, cases["expects"], shapes):
            return None
        paths, values = answer_nodes(sent, cases["expects"], ref, cases.get("free", ())) \
            if ref else ([], {})
        return fingerprint(sent, cases["expects"], cases.get("free", ())), paths, values
    except Exception:
        return None


def _named(reply: Reply, seen, cases: dict) -> Reply:
    """A failed verdict with the known misconception its answer matches, if any, else
    what was compared and where it first differs (:func:`.misconceptions.first_difference`;
    a case mismatch says that itself; never on a failure of the grader's: out of memory, a
    judge error)."""
    from .misconceptions import closest, first_difference
    if seen is None or reply.ok or reply.error == "JudgeError":
        return reply
    try:
        found = closest(seen[0], cases.get("misconceptions"))
    except Exception:
        found = None
    if found is not None:
        reply.misconception = found[0]
    elif cases.get("reference") and reply.error != CASES:
        try:
            reply.differs = first_difference(seen[0], seen[1], cases["reference"], seen[2],
                                             cases.get("veiled") or (),
                                             cases.get("several") or ())[:DIFFERS_LIMIT]
        except Exception:
            reply.differs = ""
    return reply


def serve(pipe, base: dict) -> int:
    """Answer requests until the pipe closes; ``base``: the setup namespace."""
    from ..notebook.graded_cell import bound_names
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
                pipe.send(judge_answer(spaces.pop(req.id), req))
            else:
                pipe.send(Reply(False, "JudgeError", f"unknown request {type(req).__name__}"))
        except BaseException as err:
            pipe.send(Reply(False, "JudgeError", MEMORY_MESSAGE if out_of_memory(err) else
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
            raise JudgeError(f"the check ran past its time limit ({self.timeout:g} s) in {what}"
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
                missing: List[str], cases: Optional[dict] = None) -> Reply:
        """The judge part's :class:`~mgpu_lab.course.grading.protocol.Reply`: ``ok``, or the
        exception's name, its line of the cell, and (an assertion's) message; ``cases``: what
        the check asked for (:func:`.cases.cases_of`), checked first."""
        return self._ask(f"{grade_id}'s judge", Judge(grade_id, source, answer, missing,
                                                       cases or {}))


class JudgeProcess(JudgeClient):
    """A judge process of its own (one notebook's, or one that a pool could not fork)."""

    def __init__(self, env: dict, cwd: str, timeout: float):
        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, "-m", "mgpu_lab.course.grading.judge"],
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
