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
``metadata.mgpu_lab.lab``: the grader knows a submission whatever its name.

The course commands work on the checkout they are run in: ``labs/`` and
``solutions/`` are found by walking up from the current folder (or ``--root``).
The wheel ships the labs too (:mod:`.layout`), so that
``mgpu-lab labs copy DIR`` gives a learner the labs without a clone.

    mgpu-lab labs build [--check] [--root DIR] [--solutions DIR] [--labs DIR]
    mgpu-lab labs execute [NOTEBOOK ...]
    mgpu-lab labs copy DIR
"""
from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path
from typing import Iterable, List

import nbformat

from . import graded_cell
from .layout import _cmd_copy, course_dir

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
# A warning printed in a kernel names the cell's temporary file, e.g.
# /tmp/ipykernel_4242/3141592653.py; it changes on every run.
KERNEL_PATH = re.compile(r"(?:[A-Za-z]:)?[\w./\\~-]*ipykernel_\d+[/\\]\d+\.py")


class MarkerError(ValueError):
    """A solution notebook's markers or nbgrader metadata are malformed."""


def lab_id(nb):
    """The lab a notebook belongs to (``metadata.mgpu_lab.lab``), or None."""
    value = (nb.get("metadata", {}).get("mgpu_lab") or {}).get("lab")
    return value if isinstance(value, str) and value else None


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


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def graded_cells(nb) -> dict:
    """``{grade_id: cell}`` for every graded test cell, in notebook order."""
    return {nbgrader_meta(c)["grade_id"]: c for c in nb.cells
            if nbgrader_meta(c).get("grade") and "grade_id" in nbgrader_meta(c)}


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


ANSWER_KEY_TAG = "answer-key"
SETUP_TAG = "setup"    # also runs in the grader's judge process, before the checks
DEMO_TAG = "demo"      # shows something; defines nothing a check needs: not run when graded


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
    lab.metadata.pop("widgets", None)  # saved widget state belongs to outputs
    lab.cells = [c for c in lab.cells if ANSWER_KEY_TAG not in c.metadata.get("tags", [])]
    for cell in lab.cells:
        cell.source = strip_solution(cell.source, cell.cell_type)
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
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
    """
    solutions, labs = Path(solutions), Path(labs)
    if not solutions.is_dir():
        raise FileNotFoundError(f"no solutions folder at {solutions}")
    stale = []
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
            text = _text(make_lab(solution, src.stem))
        except MarkerError as err:
            raise MarkerError(f"{src}: {err}") from None
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


def execute_notebook(path: Path, timeout: float = 600.0) -> List[str]:
    """Run a solution in place (cwd = its folder), store outputs; list failures."""
    from .kernel import run_notebook  # the grader's kernels and time limits

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    results = run_notebook(nb, cwd=path.parent, timeout=timeout, desc=path.name)
    failures = [f"{path.name} cell {r.index}: {r.error}: {r.message}"
                for r in results if r.error and not r.expected_error]
    clean_outputs(nb)
    nbformat.write(nb, path)
    return failures


def _cmd_build(args) -> int:
    try:
        args.solutions, args.labs = course_dir(args, "solutions"), course_dir(args, "labs")
        stale = build_labs(args.solutions, args.labs, check=args.check, only=args.notebooks)
    except (MarkerError, FileNotFoundError) as err:
        print(f"mgpu-lab labs build: {err}", file=sys.stderr)
        return 2
    for item in stale:
        print(f"{'stale' if args.check else 'written'}: {item}")
    if args.check and stale:
        print("labs/ is out of date: run `mgpu-lab labs build`", file=sys.stderr)
        return 1
    if not stale:
        print(f"labs up to date ({args.labs})")
    return 0


def _cmd_execute(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as in CI: same numbers
    if not args.notebooks:
        try:
            args.solutions = course_dir(args, "solutions")
        except FileNotFoundError as err:
            print(f"mgpu-lab labs execute: {err}", file=sys.stderr)
            return 2
    paths: Iterable[Path] = args.notebooks or sorted(Path(args.solutions).glob("*.ipynb"))
    failures = []
    for path in paths:
        if not Path(path).is_file():
            print(f"mgpu-lab labs execute: no such notebook {path}", file=sys.stderr)
            return 2
        failed = execute_notebook(Path(path), timeout=args.timeout)
        note = f", {len(failed)} cell(s) failed" if failed else ""
        print(f"{path}: executed, outputs stored{note}")
        failures += failed
    for line in failures:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failures else 0


def add_parser(subparsers) -> None:
    labs = subparsers.add_parser("labs", help="build labs/ from solutions/, or re-execute them",
                                 description=__doc__.split("\n\n")[0])
    sub = labs.add_subparsers(dest="labs_command", metavar="ACTION")
    sub.required = True
    build = sub.add_parser("build", help="generate labs/ from solutions/")
    build.add_argument("notebooks", nargs="*", metavar="SOLUTION",
                       help="only these solution notebooks (default: all)")
    build.add_argument("--check", action="store_true",
                       help="write nothing; exit 1 when labs/ is stale")
    build.add_argument("--root", type=Path, help="the course checkout (default: found from cwd)")
    build.add_argument("--solutions", type=Path, help="default: ROOT/solutions")
    build.add_argument("--labs", type=Path, help="default: ROOT/labs")
    build.set_defaults(func=_cmd_build)
    execute = sub.add_parser("execute", help="run solution notebooks in place and store outputs")
    execute.add_argument("notebooks", nargs="*", type=Path,
                         help="default: every notebook in --solutions")
    execute.add_argument("--root", type=Path, help="the course checkout (default: found from cwd)")
    execute.add_argument("--solutions", type=Path, help="default: ROOT/solutions")
    execute.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    execute.set_defaults(func=_cmd_execute)
    copy_ = sub.add_parser("copy", help="copy the lab notebooks into a folder, to work in")
    copy_.add_argument("dest", type=Path, metavar="DIR")
    copy_.add_argument("--root", type=Path, help="take ROOT/labs (default: this checkout's, "
                       "else the labs installed with the package)")
    copy_.set_defaults(func=_cmd_copy)

