"""The autograder: run each submitted notebook in a fresh kernel and score it.

    mgpu-lab grade PATH... [--json FILE] [--csv FILE] [--timeout SECONDS]
                           [--total-timeout SECONDS] [--solutions DIR]

PATH is a notebook or a folder (searched recursively for ``*.ipynb``). The
instructor's copy is the solution notebook with the same file name in
``--solutions`` (default: ``solutions/`` of this checkout). Before running, each
graded test cell of the submission (matched by nbgrader ``grade_id``) is
replaced by the instructor's cell, hidden tests included, so editing a test
away changes nothing; a graded cell the student deleted scores 0 ("Missing").
A graded cell scores its points when it runs without an error, else 0.

Limits, so that one bad submission never costs the run:

- each cell has ``--timeout`` seconds; then the kernel is interrupted (the cell
  scores 0, "Timeout") and, if it does not answer within a few seconds, killed;
- when the kernel dies (``os._exit``, a segfault, out of memory) or was killed,
  a fresh kernel re-runs every earlier cell once (except cells that hung or
  crashed) to rebuild the state, and grading goes on after the bad cell; after
  3 restarts (``kernel.MAX_RESTARTS``) the rest of the notebook scores 0;
- ``--total-timeout`` bounds the whole notebook; cells past it score 0.

(The kernel runner with these limits is :mod:`mgpu_lab.course.kernel`.)

The exit status is 0 even when submissions fail; 2 means bad usage. Student
code runs with your permissions: grade in a container or a throwaway account.
"""
from __future__ import annotations

import copy
import csv
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import monotonic
from typing import List, Optional

import nbformat

from .kernel import run_notebook
from .notebooks import SOLUTIONS_DIR, graded_cells, nbgrader_meta


@dataclass
class ExerciseScore:
    grade_id: str
    score: float
    max_score: float
    error: Optional[str] = None
    message: str = ""


@dataclass
class NotebookGrade:
    path: str
    notebook: str
    exercises: List[ExerciseScore] = field(default_factory=list)
    seconds: float = 0.0
    error: Optional[str] = None

    @property
    def score(self) -> float:
        return sum(e.score for e in self.exercises)

    @property
    def max_score(self) -> float:
        return sum(e.max_score for e in self.exercises)

    def to_dict(self) -> dict:
        return dict(asdict(self), score=self.score, max_score=self.max_score)


def prepare_submission(student, instructor):
    """The submission with the instructor's graded cells; and the missing ids."""
    tests = graded_cells(instructor)
    nb, seen = copy.deepcopy(student), set()
    for index, cell in enumerate(nb.cells):
        gid = nbgrader_meta(cell).get("grade_id")
        if gid in tests:
            new = nbformat.v4.new_code_cell(tests[gid].source,
                                            metadata=copy.deepcopy(tests[gid].metadata))
            if "id" in cell:
                new["id"] = cell["id"]
            nb.cells[index] = new
            seen.add(gid)
    return nb, [gid for gid in tests if gid not in seen]


def grade_notebook(path, solutions=SOLUTIONS_DIR, timeout: float = 120.0,
                   total_timeout: Optional[float] = 1800.0, progress: bool = True) -> NotebookGrade:
    """Score one submission against ``solutions/<same file name>``."""
    path, start = Path(path), monotonic()
    grade = NotebookGrade(str(path), path.name)
    source = Path(solutions) / path.name
    if not source.is_file():
        grade.error = f"NoSolution: no {source}"
        return grade
    instructor = nbformat.read(source, as_version=4)
    tests = graded_cells(instructor)
    try:
        student = nbformat.read(path, as_version=4)
    except Exception as err:  # not JSON, not a notebook: every exercise scores 0
        grade.error = f"UnreadableNotebook: {err}"
        grade.exercises = [ExerciseScore(g, 0.0, float(nbgrader_meta(c)["points"]), "NotRun")
                           for g, c in tests.items()]
        return grade
    nb, missing = prepare_submission(student, instructor)
    results = {r.index: r for r in run_notebook(nb, path.parent, timeout, total_timeout,
                                                desc=f"{path.parent.name}/{path.name}",
                                                progress=progress)}
    first = {}
    for index, cell in enumerate(nb.cells):
        first.setdefault(nbgrader_meta(cell).get("grade_id"), index)
    for gid, cell in tests.items():
        points = float(nbgrader_meta(cell)["points"])
        if gid in missing:
            grade.exercises.append(ExerciseScore(gid, 0.0, points, "Missing",
                                                 "the graded cell was deleted"))
            continue
        r = results[first[gid]]
        grade.exercises.append(ExerciseScore(gid, 0.0 if r.error else points, points,
                                             r.error, brief(r.message)))
    grade.seconds = round(monotonic() - start, 2)
    return grade


def brief(message: str, limit: int = 200) -> str:
    """One line for a report: the first line, and the last when there are more.

    A ``LaunchError`` carries the failing rank's whole traceback; its last line
    is the cause (``NotImplementedError``, ``AssertionError: ...``).
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = " ... ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def find_notebooks(paths) -> List[Path]:
    found = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        elif p.is_file():
            found.append(p)
        else:
            raise FileNotFoundError(f"no such notebook or folder: {p}")
    return found


def print_report(grades: List[NotebookGrade], file=None) -> None:
    file = file or sys.stdout
    for g in grades:
        print(f"\n{g.path}: {g.score:g}/{g.max_score:g}  ({g.seconds:.1f} s)"
              + (f"  [{g.error}]" if g.error else ""), file=file)
        if g.exercises:
            width = max(len("grade_id"), *(len(e.grade_id) for e in g.exercises))
            print(f"  {'grade_id':<{width}}  score    max  error", file=file)
            for e in g.exercises:
                why = f"{e.error}: {e.message}" if e.error and e.message else e.error or ""
                print(f"  {e.grade_id:<{width}}  {e.score:5g}  {e.max_score:5g}  "
                      f"{why if len(why) <= 90 else why[:87] + '...'}", file=file)
    if len(grades) > 1:
        print(f"\ntotal: {sum(g.score for g in grades):g}/{sum(g.max_score for g in grades):g}"
              f" over {len(grades)} notebooks", file=file)


def write_csv(grades: List[NotebookGrade], path) -> None:
    columns = []
    for g in grades:
        for e in g.exercises:
            key = f"{Path(g.notebook).stem}:{e.grade_id}"
            if key not in columns:
                columns.append(key)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "notebook", "score", "max_score", "error"] + columns)
        for g in grades:
            scores = {f"{Path(g.notebook).stem}:{e.grade_id}": e.score for e in g.exercises}
            writer.writerow([g.path, g.notebook, g.score, g.max_score, g.error or ""]
                            + [scores.get(c, "") for c in columns])


def _cmd_grade(args) -> int:
    if args.timeout <= 0 or args.total_timeout <= 0:
        print("mgpu-lab grade: --timeout and --total-timeout must be positive", file=sys.stderr)
        return 2
    if not Path(args.solutions).is_dir():
        print(f"mgpu-lab grade: no solutions folder {args.solutions}; pass --solutions DIR",
              file=sys.stderr)
        return 2
    try:
        notebooks = find_notebooks(args.paths)
    except FileNotFoundError as err:
        print(f"mgpu-lab grade: {err}", file=sys.stderr)
        return 2
    if not notebooks:
        print("mgpu-lab grade: no notebooks found in " + " ".join(args.paths), file=sys.stderr)
        return 2
    try:
        grades = [grade_notebook(p, args.solutions, args.timeout, args.total_timeout)
                  for p in notebooks]
    except KeyboardInterrupt:
        print("mgpu-lab grade: interrupted; nothing written", file=sys.stderr)
        return 130
    print_report(grades)
    if args.json:
        Path(args.json).write_text(json.dumps({"notebooks": [g.to_dict() for g in grades]},
                                              indent=2) + "\n", encoding="utf-8")
    if args.csv:
        write_csv(grades, args.csv)
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("grade", help="score students' notebooks",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", metavar="PATH", help="notebooks or folders of notebooks")
    p.add_argument("--json", metavar="FILE", help="write per-exercise scores as JSON")
    p.add_argument("--csv", metavar="FILE", help="write one row per notebook as CSV")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per cell (120)")
    p.add_argument("--total-timeout", type=float, default=1800.0,
                   help="seconds per notebook (1800)")
    p.add_argument("--solutions", default=str(SOLUTIONS_DIR),
                   help="instructor notebooks, matched by file name")
    p.set_defaults(func=_cmd_grade)
