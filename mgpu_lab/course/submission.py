"""The submission as it will run: the instructor's graded cells put in its place.

Graded cells are matched by nbgrader ``grade_id``: an edited one is replaced,
a duplicated one runs once (its last copy; earlier copies become markdown), a
deleted one is put back after its exercise, or scored 0 (``Missing``) when the
exercise is gone too. The graded cells' sources are left out (a placeholder):
the runner asks for each one when it is about to run. :func:`static_check` is
the grader-side half of "this exercise must not call X" (:mod:`.guard`).
"""
from __future__ import annotations

import ast
import copy
from dataclasses import dataclass
from typing import Dict, List, Optional

import nbformat

from . import guard
from .notebooks import DEMO_TAG, graded_cells, nbgrader_meta
from .runner import PLACEHOLDER


def exercise_of(instructor) -> Dict[str, Optional[str]]:
    """``{graded grade_id: grade_id of the nearest solution cell above it}``."""
    out, last = {}, None
    for cell in instructor.cells:
        meta = nbgrader_meta(cell)
        if meta.get("solution"):
            last = meta.get("grade_id")
        if meta.get("grade") and cell.cell_type == "code" and "grade_id" in meta:
            out[meta["grade_id"]] = last
    return out


def forbidden_of(cell) -> List[str]:
    return list((cell.metadata.get("mgpu_lab") or {}).get("reimplements") or [])


def observed_of(cell) -> str:
    """What a graded cell observes inside the learner's kernel (its metadata says):
    such a check is not tamper-proof, and the report says so."""
    return str((cell.metadata.get("mgpu_lab") or {}).get("observed") or "")


@dataclass
class Prepared:
    nb: nbformat.NotebookNode              # graded cells' sources left out
    graded: Dict[int, str]                 # cell index -> grade_id
    missing: List[str]
    notes: List[str]


def prepare_submission(student, instructor) -> Prepared:
    """The submission with the instructor's graded cells in place (sources left out)."""
    tests, exercise = graded_cells(instructor), exercise_of(instructor)
    cells, notes = [], []
    for cell in student.cells:
        cell = copy.deepcopy(cell)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            if DEMO_TAG in cell.metadata.get("tags", []) and not nbgrader_meta(cell):
                cell = nbformat.v4.new_markdown_cell("(a demo cell: not run when graded)")
        cells.append(cell)
    last = {}
    for index, cell in enumerate(cells):
        gid = nbgrader_meta(cell).get("grade_id")
        if gid in tests and cell.cell_type == "code":
            last.setdefault(gid, []).append(index)
    for gid, where in last.items():
        for index in where[:-1]:
            cells[index] = nbformat.v4.new_markdown_cell(f"(a copy of graded cell {gid})")
        if len(where) > 1:
            notes.append(f"{gid}: graded cell duplicated; its last copy was graded")
    missing = []
    for gid in tests:
        if gid in last:
            continue
        anchors = [i for i, c in enumerate(cells)
                   if exercise[gid] and nbgrader_meta(c).get("grade_id") == exercise[gid]]
        if not anchors:
            missing.append(gid)
            notes.append(f"{gid}: graded cell and its exercise deleted; scored 0")
            continue
        cells.insert(anchors[-1] + 1, nbformat.v4.new_code_cell(
            "", metadata=copy.deepcopy(tests[gid].metadata)))
        notes.append(f"{gid}: graded cell deleted; put back after its exercise")
    graded = {}
    for index, cell in enumerate(cells):
        gid = nbgrader_meta(cell).get("grade_id")
        if gid in tests and cell.cell_type == "code":
            new = nbformat.v4.new_code_cell(PLACEHOLDER,
                                            metadata=copy.deepcopy(tests[gid].metadata))
            cells[index] = new
            graded[index] = gid
    nb = copy.deepcopy(student)
    nb.cells = cells
    return Prepared(nb, graded, missing, notes)


def given_statements(instructor) -> set:
    """Every top-level statement of the lab's given code cells, as ``ast.unparse`` writes it."""
    from .notebooks import make_lab
    out = set()
    for cell in make_lab(instructor).cells:
        meta = nbgrader_meta(cell)
        if cell.cell_type == "code" and not meta.get("solution") and not meta.get("grade"):
            tree = guard._parse(cell.source)
            out.update(ast.unparse(s) for s in (tree.body if tree else []))
    return out


def learners_lines(source: str, given: set, whole: bool = False) -> set:
    """Line numbers of ``source`` that the learner wrote: in statements the lab did not
    give (every line, ``whole``, for a solution cell)."""
    tree = guard._parse(source)
    lines = set()
    for stmt in tree.body if tree else []:
        if whole or ast.unparse(stmt) not in given:
            lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


BINDS = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.FunctionDef, ast.AsyncFunctionDef,
         ast.ClassDef, ast.Import, ast.ImportFrom)


def static_check(student, instructor) -> Dict[str, List[str]]:
    """``{graded grade_id: forbidden references}`` its solution cell names, or reaches
    through a name that a statement of the learner's in a cell above binds to one (an
    alias, a helper, an import: a way round the check from elsewhere), directly or
    through other such names."""
    from . import graded_cell
    tests, exercise = graded_cells(instructor), exercise_of(instructor)
    sources = [c.source for c in student.cells if c.cell_type == "code"]
    aliases = guard.import_aliases(sources)
    given = given_statements(instructor)
    found = {}
    for gid, cell in tests.items():
        forbidden = forbidden_of(cell)
        if not forbidden or not exercise[gid]:
            continue
        hits, bindings = set(), []          # bindings: (names bound, their source)
        for c in student.cells:
            if c.cell_type != "code":
                continue
            meta = nbgrader_meta(c)
            if meta.get("grade_id") == exercise[gid]:
                hits.update(guard.static_violations(c.source, forbidden, aliases))
                hits.update(_reached(c.source, bindings, forbidden, aliases))
                break                        # cells below the exercise cannot serve it
            if meta.get("grade_id") in tests:
                continue
            tree = guard._parse(c.source)
            lines = learners_lines(c.source, given)
            for stmt in tree.body if tree else []:
                if stmt.lineno in lines and isinstance(stmt, BINDS):
                    src = ast.unparse(stmt)
                    bindings.append((graded_cell.bound_names(src), src))
        if hits:
            found[gid] = sorted(hits)
    return found


def _loaded(source: str) -> set:
    tree = guard._parse(source)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} if tree else set()


def _reached(source: str, bindings, forbidden, aliases) -> set:
    """The forbidden references ``source`` reaches through the learner's own bindings."""
    reach = {}                                   # name -> references it leads to
    changed = True
    while changed:                               # helpers calling helpers: to a fixed point
        changed = False
        for names, src in bindings:
            refs = set(guard.static_violations(src, forbidden, aliases))
            for name in _loaded(src) & set(reach):
                refs |= reach[name]
            for name in names:
                if refs - reach.get(name, set()):
                    reach[name] = reach.get(name, set()) | refs
                    changed = True
    return {r for name in _loaded(source) & set(reach) for r in reach[name]}
