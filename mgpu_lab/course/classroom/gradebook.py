"""A class's grades: which notebook counts for each student and lab, and the totals.

Every report reads the same :class:`Gradebook` (the summary on screen, the CSV, the
JSON, the feedback, the LMS exports), so their totals agree.

- **Policy** (``--policy``): of several notebooks one student handed in for one lab,
  ``best`` counts the best score (ties: the latest), ``latest`` the latest one (the
  newest modification time; a Canvas download keeps each file's submission time, and
  the ``-N`` Canvas adds to a re-uploaded file's name breaks ties). The notebook that
  counts says so in its notes (and so in the student's feedback), the others too.
- **Maxima.** A lab's maximum is its points in the solutions; a student's maximum is the
  sum over every lab of the run (``--lab``, else every lab some notebook matched),
  handed in or not: a missing lab costs its points, it never shrinks the maximum.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from ..grading.scoring import NotebookGrade

POLICIES = ("best", "latest")
_RESUBMITTED = re.compile(r"-(\d+)$")     # Canvas renames a re-uploaded lab.ipynb lab-1.ipynb


@dataclass
class Entry:
    """One student's lab: the notebook that counts, and the others handed in for it."""
    counted: NotebookGrade
    others: List[NotebookGrade] = field(default_factory=list)


def latest_key(g: NotebookGrade):
    stem = Path(g.path).stem
    again = _RESUBMITTED.search(stem)
    return (g.submitted_at, int(again.group(1)) if again else 0, g.path)


class Gradebook:
    """``grades`` sorted out by student and lab under ``policy``; ``maxima``: each lab's
    points (default: the largest maximum among its notebooks); ``labs``: the labs of the
    run (default: those the notebooks matched)."""

    def __init__(self, grades: Iterable[NotebookGrade], maxima: Optional[Dict[str, float]] = None,
                 policy: str = "best", labs: Optional[Iterable[str]] = None):
        if policy not in POLICIES:
            raise ValueError(f"--policy is one of {', '.join(POLICIES)}, not {policy!r}")
        self.grades, self.policy = list(grades), policy
        found = sorted({g.lab for g in self.grades if g.lab})
        self.labs = sorted(set(labs)) if labs else found
        self.maxima = {lab: float((maxima or {}).get(lab) if (maxima or {}).get(lab) is not None
                                  else max([g.max_score for g in self.grades if g.lab == lab] or [0]))
                       for lab in self.labs}
        self.entries: Dict[str, Dict[str, Entry]] = {}
        self.roster_rows: Dict[str, Dict[str, str]] = {}     # a student's roster row, if any
        self.notices: List[str] = []        # who is in no roster row, who is missing
        self.unmatched: Dict[str, List[NotebookGrade]] = {}   # notebooks of no lab
        handed: Dict[str, Dict[str, List[NotebookGrade]]] = {}
        for g in self.grades:
            if g.lab and g.lab in self.maxima:
                handed.setdefault(g.student, {}).setdefault(g.lab, []).append(g)
            else:
                self.unmatched.setdefault(g.student, []).append(g)
        for student, labs_of in handed.items():
            self.entries[student] = {lab: self._choose(notebooks)
                                     for lab, notebooks in labs_of.items()}
        for student in self.unmatched:
            self.entries.setdefault(student, {})

    def _choose(self, notebooks: List[NotebookGrade]) -> Entry:
        if self.policy == "best":
            order = sorted(notebooks, key=lambda g: (g.score, latest_key(g)), reverse=True)
        else:
            order = sorted(notebooks, key=latest_key, reverse=True)
        counted, others = order[0], order[1:]
        if others:
            what = "best score" if self.policy == "best" else "latest"
            also = ", ".join(f"{Path(o.path).name} ({o.score:g})" for o in others[:5])
            also += f" and {len(others) - 5} more" if len(others) > 5 else ""
            _note(counted, f"this notebook counts: the {what} of the {len(notebooks)} handed "
                           f"in for {counted.lab} (policy {self.policy}; also {also})")
            for o in others:
                _note(o, f"not counted: {Path(counted.path).name} counts for {counted.lab} "
                         f"(policy {self.policy})")
        return Entry(counted, others)

    @property
    def students(self) -> List[str]:
        return sorted(self.entries)

    def counted(self, student: str, lab: str) -> Optional[NotebookGrade]:
        entry = self.entries.get(student, {}).get(lab)
        return entry.counted if entry else None

    def total(self, student: str) -> float:
        return sum(e.counted.score for e in self.entries.get(student, {}).values())

    @property
    def max_total(self) -> float:
        return sum(self.maxima.values())

    def misconceptions(self) -> Dict[str, Dict[str, tuple]]:
        """``{lab: {grade_id: (students counted for the lab, {misconception id: students
        who showed it})}}`` over the notebooks that count, most shown first; only the
        exercises where one was shown."""
        out: Dict[str, Dict[str, tuple]] = {}
        for lab in self.labs:
            counted = [e.counted for s in self.students for l, e in self.entries[s].items() if l == lab]
            found: Dict[str, Dict[str, int]] = {}
            for g in counted:
                for e in g.exercises:
                    if e.misconception:
                        mine = found.setdefault(e.grade_id, {})
                        mine[e.misconception] = mine.get(e.misconception, 0) + 1
            if found:
                out[lab] = {gid: (len(counted), dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))))
                            for gid, c in found.items()}
        return out

    def counted_grades(self) -> List[NotebookGrade]:
        """Every notebook that counts, by student then lab."""
        return [self.entries[s][lab].counted for s in self.students
                for lab in sorted(self.entries[s])]


def _note(grade: NotebookGrade, text: str) -> None:
    if text not in grade.notes:
        grade.notes.append(text)


def as_gradebook(grades, **kwargs) -> Gradebook:
    """``grades`` when it is a :class:`Gradebook` already, else one made of them."""
    return grades if isinstance(grades, Gradebook) else Gradebook(grades, **kwargs)


def lab_points(labs: Dict[str, object]) -> Dict[str, float]:
    """``{lab id: its points}`` of instructor notebooks
    (:func:`~mgpu_lab.course.grading.grader.load_solutions`)."""
    from ..notebook.cells import graded_cells, nbgrader_meta
    return {lab: float(sum(nbgrader_meta(c).get("points", 0) for c in graded_cells(nb).values()))
            for lab, nb in labs.items()}
