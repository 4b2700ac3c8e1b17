"""What an exercise scores, from the evidence the grader gathered: one pure function.

The evidence about one graded cell comes from four places; the first that speaks
decides (:data:`PRECEDENCE`):

1. **Tampering**: the static pass found the learner's cells patching the kernel
   (:mod:`mgpu_lab.course.tamper`);
2. **ForbiddenCall**: the exercise called what it re-implements, by the static pass or
   the run-time guard (:mod:`mgpu_lab.course.guard`; a courtesy message);
3. **the kernel's error**: the probe, or the learner's code it called, raised (or the
   cell timed out, the kernel died...);
4. **the judge's verdict** on the probe's data (:mod:`mgpu_lab.course.judge`): an
   exception, or none, which scores the points.

A graded cell whose exercise was deleted with it scores 0, ``Missing``. Nothing here
runs a kernel: ``tests/test_grader.py`` checks the table with made-up evidence.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Optional

PRECEDENCE = ("Tampering", "ForbiddenCall", "kernel error", "verdict")


@dataclass
class ExerciseScore:
    grade_id: str
    score: float
    max_score: float
    error: Optional[str] = None
    message: str = ""
    observed: str = ""        # what the check observes inside the kernel (not tamper-proof)


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
    elif evidence.error:
        error, message = evidence.error, evidence.message
    elif evidence.judged:
        error, message = evidence.verdict, evidence.verdict_message if evidence.verdict else ""
    else:
        error, message = "NotJudged", "the probe sent nothing"
    return ExerciseScore(grade_id, 0.0 if error else float(points), float(points), error,
                         brief(message or ""), observed)
