"""The submission as it will run: the instructor's graded cells put in its place.

Graded cells are matched by nbgrader ``grade_id``: an edited one is replaced,
a duplicated one runs once (its last copy; earlier copies become markdown), a
deleted one is put back after its exercise, or scored 0 (``Missing``) when the
exercise is gone too. The graded cells' sources are left out (a placeholder):
the runner asks for each one when it is about to run.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, List, Optional

import nbformat

from ..notebook.cells import DEMO_TAG, exercise_of, graded_cells, nbgrader_meta, tags
from .protocol import PLACEHOLDER


@dataclass
class Prepared:
    nb: nbformat.NotebookNode              # graded cells' sources left out
    graded: Dict[int, str]                 # cell index -> grade_id
    missing: List[str]
    notes: List[str]
    origin: List[Optional[int]]            # cell index -> the submission's own (None: put back)


def prepare_submission(student, instructor) -> Prepared:
    """The submission with the instructor's graded cells in place (sources left out)."""
    tests, exercise = graded_cells(instructor), exercise_of(instructor)
    cells, notes = [], []
    for cell in student.cells:
        cell = copy.deepcopy(cell)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            if DEMO_TAG in tags(cell) and not nbgrader_meta(cell):
                cell = nbformat.v4.new_markdown_cell("(a demo cell: not run when graded)")
        cells.append(cell)
    origin: List[Optional[int]] = list(range(len(cells)))
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
        origin.insert(anchors[-1] + 1, None)
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
    return Prepared(nb, graded, missing, notes, origin)
