"""Labs from solutions: one source, two notebooks.

``solutions/NN_name.ipynb`` is the only notebook anyone edits. ``labs/`` is made
from it by ``mgpu-lab labs build`` with a small pure-Python generator over
nbformat (nbgrader's own ``generate_assignment`` would bring a database and a
course directory layout with it; we only need its cell conventions):

- code between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` becomes
  ``# YOUR CODE HERE`` + ``raise NotImplementedError()`` at the marker's
  indentation (in a markdown cell: ``YOUR ANSWER HERE``);
- lines between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` go away;
- outputs and execution counts are cleared; graded (locked) cells are made
  read-only in JupyterLab.

Cells carry nbgrader-style metadata ``nbgrader: {grade_id, points, solution,
grade, locked}``; :func:`check_notebook` says what is wrong with a solution.
Every lab (and its solution) carries its lab id, the solution's file stem, in
``metadata.mgpu_lab.lab``: the grader knows a submission whatever its name. Every lab
also carries its version (``metadata.mgpu_lab.version``, :func:`.exercises.lab_version`):
it changes when a graded cell changes, and a submission made from another version is
graded with a note saying so.

The commands that use it (``mgpu-lab labs build/execute/copy/check``) are in
:mod:`~mgpu_lab.course.authoring.labs_command`.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Iterable, List

import nbformat

from . import graded_cell
from .cells import ANSWER_KEY_TAG, graded_cells, lab_id, nbgrader_meta, tags
from .exercises import asserts_without_message, lab_version, points_mismatches

__all__ = ["MarkerError", "strip_solution", "check_notebook", "lint_notebook", "make_lab",
           "build_labs",
           "clean_outputs", "graded_cells", "lab_id", "nbgrader_meta"]

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
# A warning printed in a kernel names the cell's temporary file, e.g.
# /tmp/ipykernel_4242/3141592653.py; it changes on every run.
KERNEL_PATH = re.compile(r"(?:[A-Za-z]:)?[\w./\\~-]*ipykernel_\d+[/\\]\d+\.py")


class MarkerError(ValueError):
    """A solution notebook's markers or nbgrader metadata are malformed."""


def _replace_regions(source: str, begin: str, end: str, replacement) -> str:
    """Replace every ``begin``..``end`` region (marker lines included).

    ``replacement(indent)`` gives the lines that stand in for a region. Nested
    or unclosed markers raise :class:`MarkerError` naming the line.
    """
    out: List[str] = []
    start = None
    for lineno, line in enumerate(source.split("\n"), 1):
        stripped = line.strip()
        if stripped == begin:
            if start is not None:
                raise MarkerError(f"line {lineno}: {begin!r} inside the region "
                                  f"opened on line {start} (nested markers)")
            start = lineno
            out.extend(replacement(line[: len(line) - len(line.lstrip())]))
        elif stripped == end:
            if start is None:
                raise MarkerError(f"line {lineno}: {end!r} without {begin!r}")
            start = None
        elif start is None:
            out.append(line)
    if start is not None:
        raise MarkerError(f"line {start}: {begin!r} is never closed with {end!r}")
    return "\n".join(out)


def strip_solution(source: str, cell_type: str = "code") -> str:
    """The learner's version of one cell's source."""
    if cell_type == "code":
        def stub(indent):
            return [f"{indent}# YOUR CODE HERE", f"{indent}raise NotImplementedError()"]
    else:
        def stub(indent):
            return [f"{indent}YOUR ANSWER HERE"]
    source = _replace_regions(source, BEGIN_SOLUTION, END_SOLUTION, stub)
    return _replace_regions(source, BEGIN_HIDDEN, END_HIDDEN, lambda indent: [])


def check_notebook(nb) -> None:
    """Raise :class:`MarkerError` when markers and metadata disagree."""
    seen = set()
    for index, cell in enumerate(nb.cells):
        meta = nbgrader_meta(cell)
        where = f"cell {index}"
        try:
            strip_solution(cell.source, cell.cell_type)
        except MarkerError as err:
            raise MarkerError(f"{where}: {err}") from None
        if meta:
            gid = meta.get("grade_id")
            if not gid:
                raise MarkerError(f"{where}: nbgrader metadata without a grade_id")
            if gid in seen:
                raise MarkerError(f"{where}: grade_id {gid!r} used twice")
            seen.add(gid)
            if meta.get("grade") and not isinstance(meta.get("points"), (int, float)):
                raise MarkerError(f"{where} ({gid}): a graded cell needs numeric 'points'")
        if BEGIN_SOLUTION in cell.source and not meta.get("solution"):
            raise MarkerError(f"{where}: solution markers in a cell without "
                              "nbgrader metadata {'solution': true, 'grade_id': ...}")
        if meta.get("grade") and cell.cell_type == "code":
            try:
                graded_cell.split(cell.source)
            except ValueError as err:
                raise MarkerError(f"{where} ({meta.get('grade_id')}): {err}") from None
        if BEGIN_HIDDEN in cell.source and not meta.get("grade"):
            raise MarkerError(f"{where}: hidden tests in a cell that is not graded "
                              "(nbgrader metadata {'grade': true, 'points': N})")


def lint_notebook(nb) -> None:
    """What ``labs build`` refuses beyond :func:`check_notebook`: an ``assert`` of a graded
    cell without a message, a heading that states other points than the metadata. (Not
    checked by :func:`make_lab`: a notebook that fails it still grades.)"""
    problems = asserts_without_message(nb) + points_mismatches(nb)
    if problems:
        raise MarkerError("\n  " + "\n  ".join(problems))


def make_lab(solution, lab: str = None) -> nbformat.NotebookNode:
    """The lab notebook generated from a solution notebook (a new object).

    ``lab`` (the lab id, default: the solution's own) goes into the metadata.
    Cells tagged ``answer-key`` (answers to the "going further" questions) stay
    in the solution only."""
    check_notebook(solution)
    lab_name = lab or lab_id(solution)
    lab = copy.deepcopy(solution)
    if lab_name:
        lab.metadata.setdefault("mgpu_lab", {})["lab"] = lab_name
    lab.metadata.setdefault("mgpu_lab", {})["version"] = lab_version(solution)
    lab.metadata.pop("widgets", None)  # saved widget state belongs to outputs
    lab.cells = [c for c in lab.cells if ANSWER_KEY_TAG not in tags(c)]
    for cell in lab.cells:
        cell.source = strip_solution(cell.source, cell.cell_type)
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        course = cell.metadata.get("mgpu_lab", {})
        for key in ("expects", "free", "misconceptions", "reference", "several"):   # the grader's
            course.pop(key, None)
        if "mgpu_lab" in cell.metadata and not course:
            del cell.metadata["mgpu_lab"]
        meta = nbgrader_meta(cell)
        if meta.get("locked") or meta.get("grade"):
            cell.metadata["editable"] = False
            cell.metadata["deletable"] = False
    nbformat.validate(lab)
    return lab


def _text(nb) -> str:
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def build_labs(solutions: Path, labs: Path, check: bool = False,
               only: Iterable[str] = ()) -> List[str]:
    """Generate ``labs/`` from ``solutions/``; return what was (or is) stale.

    With ``check=True`` nothing is written: the returned list names each lab
    that is missing, differs from its solution, has no solution, or a solution
    without its lab id (``metadata.mgpu_lab.lab``, which a build writes).
    A solution that :func:`check_notebook` refuses is skipped and the others are built;
    then one :class:`MarkerError` names every refused notebook and why.
    """
    solutions, labs = Path(solutions), Path(labs)
    if not solutions.is_dir():
        raise FileNotFoundError(f"no solutions folder at {solutions}")
    stale, refused = [], []
    wanted = set()
    only = {Path(o).name for o in only}
    for src in sorted(solutions.glob("*.ipynb")):
        wanted.add(src.name)
        if only and src.name not in only:
            continue
        solution = nbformat.read(src, as_version=4)
        if lab_id(solution) != src.stem:   # the id travels with the solution too
            stale.append(f"{src} (no lab id)")
            if not check:
                solution.metadata.setdefault("mgpu_lab", {})["lab"] = src.stem
                src.write_text(_text(solution), encoding="utf-8")
        try:
            lint_notebook(solution)
            text = _text(make_lab(solution, src.stem))
        except MarkerError as err:
            refused.append(f"{src}: {err}")
            continue
        dest = labs / src.name
        if not dest.exists() or dest.read_text(encoding="utf-8") != text:
            stale.append(f"{dest} ({'missing' if not dest.exists() else 'stale'})")
            if not check:
                labs.mkdir(parents=True, exist_ok=True)
                dest.write_text(text, encoding="utf-8")
    for orphan in sorted(labs.glob("*.ipynb")) if labs.is_dir() and not only else []:
        if orphan.name not in wanted:
            stale.append(f"{orphan} (no solution {solutions / orphan.name})")
            if not check:
                orphan.unlink()
    if refused:
        error = MarkerError("\n".join(refused))
        error.stale = stale                  # what was written (or is stale) all the same
        raise error
    return stale


def clean_outputs(nb) -> None:
    """Make executed outputs storable: no temp kernel paths, no timing metadata."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = KERNEL_PATH.sub("<cell>", out["text"])
            if "traceback" in out:
                out["traceback"] = [KERNEL_PATH.sub("<cell>", t) for t in out["traceback"]]
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/") and isinstance(value, str):
                    out["data"][mime] = KERNEL_PATH.sub("<cell>", value)

