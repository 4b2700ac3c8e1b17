"""Lab 13, exercise (a): plans that are right but not the solution's must score full marks.

torchtitan's ``apply_fsdp`` (a33d0e367) builds the head unit ``fully_shard([norm, output],
reshard_after_forward=False)``: it stays gathered from the end of forward to backward, which the
check must not take for a missing FSDP unit (expert13's A2: 0/5 when the hidden probe ran a forward
without a backward before the counted step)."""
import nbformat

from conftest import ROOT
from mgpu_lab.course.grading.grader import grade_notebook, load_solutions
from mgpu_lab.course.grading.sandbox import probe
from mgpu_lab.course.notebook.cells import nbgrader_meta
from mgpu_lab.course.notebook.notebooks import make_lab

LAB = "13_capstone"
HEAD = "    fully_shard([model.norm, model.output], mesh=dp)"


def _graded_with(tmp_path, old, new):
    solution = nbformat.read(ROOT / "solutions" / f"{LAB}.ipynb", as_version=4)
    nb = make_lab(solution)
    answer = next(c for c in solution.cells if nbgrader_meta(c).get("grade_id") == "parallelize")
    assert old in answer.source, "out of date: the solution's head unit changed"
    for cell in nb.cells:
        if nbgrader_meta(cell).get("grade_id") == "parallelize":
            cell.source = answer.source.replace(old, new)
    path = tmp_path / f"{LAB}.ipynb"
    nbformat.write(nb, path)
    return grade_notebook(path, load_solutions(ROOT / "solutions"), box=probe(), timeout=300)


def test_torchtitans_head_unit_kept_gathered_after_forward_scores_full_marks(tmp_path):
    grade = _graded_with(tmp_path, HEAD, HEAD[:-1] + ", reshard_after_forward=False)")
    scores = {e.grade_id: (e.score, e.max_score, e.message) for e in grade.exercises}
    score, top, message = scores["parallelize_test"]
    assert score == top, message
