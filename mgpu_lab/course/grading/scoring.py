"""What an exercise scores, from the evidence the grader gathered: one pure function.

The evidence about one graded cell comes from four places; the first that speaks
decides (:data:`PRECEDENCE`):

1. **Tampering**: the static pass found the learner's cells patching the kernel
   (:mod:`mgpu_lab.course.grading.tamper`);
2. **ForbiddenCall**: the exercise called what it re-implements, by the static pass or
   the run-time guard (:mod:`mgpu_lab.course.grading.guard`; a courtesy message);
3. **the kernel's error**: the probe, or the learner's code it called, raised (or the
   cell timed out, the kernel died...);
4. **the judge's verdict** on the probe's data (:mod:`mgpu_lab.course.grading.judge`): an
   exception, or none, which scores the points. A failed verdict whose answer matches a
   known misconception (:mod:`mgpu_lab.course.grading.misconceptions`) names it.

A failure of 3. or 4. is explained by the exercise's own cell when it says why
(:attr:`Evidence.attempt`): an exercise left as the lab gave it is "NotAttempted", one
that is not valid Python a "SyntaxError" at its line (not the ``NameError`` it causes).

A graded cell whose exercise was deleted with it scores 0, ``Missing``. Nothing here
runs a kernel: ``tests/test_grader.py`` checks the table with made-up evidence.

What a report may say about a failure is decided here too (:func:`kernel_error`,
:func:`verdict_text`): never text the learner's code chose. An exception raised in
the kernel is named by its type (a builtin's or the library's; any other class is
"Exception") and the learner's line that raised it (cell and line of the learner's own
notebook), never its message; only an assertion of the instructor's judge keeps its
message.
"""
from __future__ import annotations

import builtins
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

RAISED_HIDDEN = "raised in a hidden check of this cell"    # :data:`.hidden.RAISED`
PRECEDENCE = ("Tampering", "ForbiddenCall", "kernel error", "verdict")


@dataclass
class ExerciseScore:
    grade_id: str
    score: float
    max_score: float
    error: Optional[str] = None
    message: str = ""
    observed: str = ""        # what the check observes inside the kernel (not tamper-proof)
    title: str = ""           # the exercise's title, from the notebook's heading
    misconception: Optional[str] = None   # the known misconception its answer showed (an id)
    hint: str = ""            # what the feedback says of it (:func:`.misconceptions.hint`), or
                              # where none matched, what was compared and where it differs

    def outcome(self) -> str:
        """What every report says of it (feedback, Gradescope, PrairieLearn): "passed",
        or the failure and its message, then the known misconception it shows."""
        if not self.error:
            return "passed"
        said = f"{self.error}: {self.message}" if self.message else self.error
        return f"{said} {self.hint}" if self.hint else said


@dataclass
class NotebookGrade:
    path: str
    notebook: str
    student: str = ""
    lab: Optional[str] = None
    exercises: List[ExerciseScore] = field(default_factory=list)
    seconds: float = 0.0
    error: Optional[str] = None            # the notebook could not be graded at all
    notes: List[str] = field(default_factory=list)
    sandboxed: bool = False
    tampering: List[str] = field(default_factory=list)   # what the static pass flagged
    version: str = ""                      # the lab version it was graded against
    submitted_at: float = 0.0              # the file's modification time (policy "latest")
    canvas: Optional[Tuple[str, str]] = None   # (user id, file id) of a Canvas download's file

    @property
    def score(self) -> float:
        return sum(e.score for e in self.exercises)

    @property
    def max_score(self) -> float:
        return sum(e.max_score for e in self.exercises)

    def to_dict(self) -> dict:
        return dict(asdict(self), score=self.score, max_score=self.max_score)


@dataclass
class Evidence:
    """What the grader knows about one graded cell."""
    missing: bool = False                  # the graded cell and its exercise were deleted
    tampering: List[str] = field(default_factory=list)   # findings that cost this cell
    calls: List[str] = field(default_factory=list)       # references it called
    error: Optional[str] = None            # the kernel's: exception name, Timeout, NotRun...
    message: str = ""                      # what may be said about it
    judged: bool = False                   # the judge gave a verdict
    verdict: Optional[str] = None          # the judge's exception name (None: passed)
    verdict_message: str = ""
    attempt: Optional[Tuple[str, str]] = None   # why the exercise failed, read from its cell:
                                           # ("NotAttempted" | "SyntaxError", message)
    misconception: Optional[str] = None    # the judge's: the known misconception it matches
    hint: str = ""                         # its words (the instructor's notebook's)


# A check's message reaches the report, the feedback and the JSON whole up to this many
# characters (an instructor's sentence with the values it formats); only what a learner's
# answer could make longer (its values, printed) is ever cut, and then said with "...".
MESSAGE_LIMIT = 1000


def brief(message: str, limit: int = 200) -> str:
    """One line for a report: the first line, and the last when there are more.

    A ``LaunchError`` carries the failing rank's whole traceback; its last line
    is the cause (``NotImplementedError``, ``AssertionError: ...``).
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = " ... ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def score(grade_id: str, points: float, evidence: Evidence, observed: str = "") -> ExerciseScore:
    """The exercise's score: its points when no source of :data:`PRECEDENCE` objects."""
    from .guard import message as forbidden_message
    if evidence.missing:
        error, message = "Missing", "the graded cell and its exercise were deleted"
    elif evidence.tampering:
        error, message = "Tampering", "; ".join(evidence.tampering)
    elif evidence.calls:
        error, message = "ForbiddenCall", forbidden_message(evidence.calls)
    elif evidence.attempt and (evidence.error or evidence.verdict or not evidence.judged):
        error, message = evidence.attempt
    elif evidence.error:
        error, message = evidence.error, evidence.message
    elif evidence.judged:
        error, message = evidence.verdict, evidence.verdict_message if evidence.verdict else ""
        if error and (evidence.misconception or evidence.hint):   # the judge's verdict: name it
            return ExerciseScore(grade_id, 0.0, float(points), error,
                                 brief(message or "", MESSAGE_LIMIT),
                                 observed, misconception=evidence.misconception,
                                 hint=evidence.hint)
    else:
        error, message = "NotJudged", "the probe sent nothing"
    return ExerciseScore(grade_id, 0.0 if error else float(points), float(points), error,
                         brief(message or "", MESSAGE_LIMIT), observed)


# --- what may be said about a failure ----------------------------------------------

OURS = {   # failures the runner reports itself: our words, whatever the kernel said
    "Timeout": "the cell ran past its time limit and was interrupted",
    "DeadKernel": "the kernel died (or was killed) running this cell, or could not be restarted",
    "TotalTimeout": "the notebook ran past its total time limit",
    "NoReply": "the kernel sent no reply to this cell",
    "NotRun": "the cell did not run",
    "OutOfMemory": "out of memory",   # with the limit: kernel_error's memory_mib
}
KNOWN = ({n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
          and issubclass(getattr(builtins, n), BaseException)}
         | {"LaunchError", "CollectiveTimeout", "CollectiveError", "ForbiddenCall",
            "OutOfMemoryError", "DistError", "DistBackendError", "DistNetworkError",
            "DistStoreError", "UnsafeCheckpointError", "JudgeError"})
_NOT_DEFINED = re.compile(r"^name '(\w+)' is not defined$")
_ERRNO = re.compile(r"^\[Errno (\d{1,4})\]")
_LAST_WORD = re.compile(r"^(\w+)(?::|$)")


def exception_name(name: Optional[str]) -> str:
    """``name`` when it is a builtin's or the library's exception, else ``Exception``
    (a class the learner's code defined: its name is text the learner chose)."""
    return name if name in KNOWN else "Exception"


def kernel_error(error: str, message: str, frames: Iterable, cells: Dict[int, Tuple[int, int]],
                 graded: Tuple[int, int], probe_names: Iterable[str],
                 hidden: Iterable[int] = (), memory_mib: Optional[int] = None) -> Tuple[str, str]:
    """``(error, message)`` a report may show for a failure in the kernel.

    ``frames``: the traceback's (cell index, line), outermost first; ``cells``: the
    learner's cells, ``{cell index: (index in the learner's notebook, lines)}``;
    ``graded``: the graded cell's ``(index, lines)``; ``probe_names``: the names its
    probe reads (a ``NameError`` for one of them keeps its standard message); ``hidden``:
    the graded cell's hidden lines (a failure there is not placed by its line).
    ``memory_mib``: the memory limit over the kernel, which "OutOfMemory" names.
    """
    if error == "OutOfMemory" and memory_mib:
        return error, f"{OURS[error]} (limit {memory_mib} MiB)"
    if error in OURS:
        return error, OURS[error]
    name, what = exception_name(error), []
    if name == "LaunchError":
        lines = [ln.strip() for ln in (message or "").strip().splitlines() if ln.strip()]
        last = _LAST_WORD.match(lines[-1]) if lines else None
        if last:
            what.append(f"a rank raised {exception_name(last.group(1))}")
    errno = _ERRNO.match(message or "")
    if errno and issubclass(getattr(builtins, name, Exception), OSError):
        what.append(f"[errno {errno.group(1)}: {os.strerror(int(errno.group(1)))}]")
    where, line = _where(frames, cells, graded)
    caller = _probe_caller(frames, graded)
    missing = _NOT_DEFINED.match(message or "")
    if where == "probe" and name == "NameError" and missing and missing.group(1) in set(probe_names):
        what.append(f"name '{missing.group(1)}' is not defined")
    if where == "probe" and line in set(hidden):
        what.append("raised in a hidden part of the check's probe")
    elif where == "probe":          # numbered as the learner's copy, without the hidden lines
        what.append(f"raised in the check's probe, line {line - sum(1 for h in set(hidden) if h < line)}")
    elif where is not None and caller in set(hidden):    # which of its lines a hidden case
        what.append(f"raised in cell {where} (your code), on a hidden case of the check")  # reached
    elif where is not None:                                                 # could tell the case
        what.append(f"raised at line {line} of cell {where} (your code)")
    return name, "; ".join(what)


def _probe_caller(frames, graded) -> Optional[int]:
    """The line of the check's probe that called into the code that raised (its outermost
    frame in the graded cell), or None."""
    for frame in list(frames or []):
        try:
            index, line = int(frame[0]), int(frame[1])
        except (TypeError, ValueError, IndexError):
            continue
        if index == graded[0] and 1 <= line <= graded[1]:
            return line
    return None


def _where(frames, cells, graded):
    """``(cell of the learner's notebook, line)`` of the innermost frame of the learner's
    code, else ``("probe", line)`` for one in the check's probe, else ``(None, None)``."""
    probe_line = None
    for frame in reversed(list(frames or [])):
        try:
            index, line = int(frame[0]), int(frame[1])
        except (TypeError, ValueError, IndexError):
            continue
        if index in cells and 1 <= line <= cells[index][1]:
            return cells[index][0], line
        if index == graded[0] and 1 <= line <= graded[1] and probe_line is None:
            probe_line = line
    return ("probe", probe_line) if probe_line is not None else (None, None)


def verdict_text(error: Optional[str], message: str, line: Optional[int]) -> Tuple[Optional[str], str]:
    """``(error, message)`` of the judge's verdict: an assertion (or an unreadable
    answer) keeps the judge's message; any other exception is named with its line."""
    if error is None:
        return None, ""
    if error == "AssertionError":
        if not line:                  # a hidden check's words (:mod:`.hidden`), or none
            return error, message or "the check failed"
        return error, f"{message} (check line {line})" if message else f"check line {line} failed"
    if error in ("JudgeError", "Settled", "WrongCases") or (
            error == "NameError" and (message or "").startswith("`")):
        return error, message or ""
    return exception_name(error), (f"raised by the check, line {line}" if line else
                                   message if message == RAISED_HIDDEN else "")
