"""The hidden judges of the design exercises of labs 11 and 12 compute their cases' costs from exact formulas
(the hidden cases are too large for the lab's own evaluator to run in the grader's time and memory). Here those
formulas, taken from the solution's graded cell as the grader runs it, equal the evaluator wherever it runs."""
import itertools

import nbformat
import pytest

from conftest import ROOT
from mgpu_lab.course.notebook.cells import nbgrader_meta


def _graded(lab, exercise):
    """The namespace of the lab's setup cells, the exercise's solution and its graded cell, run top to bottom
    (hidden parts included, as nbval runs them)."""
    nb = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    ns = {}
    for cell in nb.cells:
        if "setup" in cell.metadata.get("tags", []):
            exec(cell.source, ns)
    cells = {nbgrader_meta(c).get("grade_id"): c.source for c in nb.cells}
    exec(cells[exercise], ns)
    exec(cells[exercise + "_test"], ns)
    return ns


def test_lab12_choose_schedule_judges_with_the_replays_numbers():
    ns = _graded("12_pipeline_parallel", "choose_schedule")
    exact, replayed = ns["exact"], ns["replayed"]
    held_microbatches = ns["held_microbatches"]
    for p, m, name in itertools.product(range(1, 9), range(1, 41), replayed):
        try:
            replay, v = replayed[name](p, m)
        except ValueError:
            assert exact(name, p, m) is None, (name, p, m)
            continue
        held = max(held_microbatches([a[:-2] for a in rank]) for rank in replay)
        assert exact(name, p, m)[:2] == (held, v), (name, p, m)
        assert exact(name, p, m)[2] == pytest.approx(ns["bubble_of"](replay), abs=1e-12), (name, p, m)
