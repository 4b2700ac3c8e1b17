"""The autograder on tiny fixture notebooks (tests/data/grader) and on lab 00.

toy.ipynb has two exercises: add (2 points) and mul (3 points, with hidden
tests). Each folder under submissions/ is one student's toy.ipynb.
"""
import csv
import io
import json
import shutil
from pathlib import Path

import nbformat
import pytest

from mgpu_lab.cli import main as cli
from mgpu_lab.course.grader import grade_notebook, prepare_submission
from mgpu_lab.course.kernel import run_notebook
from mgpu_lab.course.notebooks import make_lab
from conftest import ROOT

DATA = Path(__file__).parent / "data" / "grader"


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade every fixture submission (and the untouched lab) in one CLI run."""
    tmp = tmp_path_factory.mktemp("grade")
    shutil.copytree(DATA / "submissions", tmp / "submissions")
    (tmp / "submissions" / "zero").mkdir()
    lab = make_lab(nbformat.read(DATA / "solutions" / "toy.ipynb", as_version=4))
    nbformat.write(lab, tmp / "submissions" / "zero" / "toy.ipynb")
    code = cli(["grade", str(tmp / "submissions"), "--solutions", str(DATA / "solutions"),
                "--timeout", "3", "--json", str(tmp / "g.json"), "--csv", str(tmp / "g.csv")])
    report = json.loads((tmp / "g.json").read_text())
    by_name = {Path(nb["path"]).parent.name: nb for nb in report["notebooks"]}
    with open(tmp / "g.csv", newline="") as f:
        rows = {Path(r["path"]).parent.name: r for r in csv.DictReader(f)}
    return code, by_name, rows


def scores(nb):
    return {e["grade_id"]: (e["score"], e["max_score"], e["error"]) for e in nb["exercises"]}


def test_exit_zero_even_when_submissions_fail(graded):
    code, by_name, _ = graded
    assert code == 0
    assert set(by_name) == {"full", "zero", "partial", "loop", "stubborn", "crash", "edited"}


def test_full_marks(graded):
    nb = graded[1]["full"]
    assert (nb["score"], nb["max_score"]) == (5, 5)
    assert scores(nb) == {"add_test": (2, 2, None), "mul_test": (3, 3, None)}


def test_untouched_lab_scores_zero_everywhere(graded):
    assert scores(graded[1]["zero"]) == {"add_test": (0, 2, "NotImplementedError"),
                                         "mul_test": (0, 3, "NotImplementedError")}


def test_one_exercise_solved_scores_exactly_its_points(graded):
    nb = graded[1]["partial"]
    assert nb["score"] == 2
    assert scores(nb) == {"add_test": (2, 2, None), "mul_test": (0, 3, "NotImplementedError")}


@pytest.mark.parametrize("name, error", [
    ("loop", "Timeout"),          # while True: interrupted after --timeout 3
    ("stubborn", "Timeout"),      # swallows KeyboardInterrupt: kernel killed, state replayed
    ("crash", "DeadKernel"),      # os._exit(1): kernel restarted, state replayed
])
def test_a_hang_or_crash_costs_that_exercise_only(graded, name, error):
    nb = graded[1][name]
    assert scores(nb) == {"add_test": (0, 2, error), "mul_test": (3, 3, None)}
    assert nb["seconds"] < 60


def test_edited_or_deleted_tests_do_not_help(graded):
    assert scores(graded[1]["edited"]) == {"add_test": (0, 2, "AssertionError"),
                                           "mul_test": (0, 3, "Missing")}


def test_csv_has_one_row_per_notebook(graded):
    rows = graded[2]
    assert len(rows) == 7
    assert rows["partial"]["score"] == "2.0" and rows["partial"]["max_score"] == "5.0"
    assert rows["partial"]["toy:add_test"] == "2.0" and rows["partial"]["toy:mul_test"] == "0.0"
    assert rows["full"]["score"] == "5.0"


def test_instructor_tests_replace_the_students():
    student = nbformat.read(DATA / "submissions" / "edited" / "toy.ipynb", as_version=4)
    instructor = nbformat.read(DATA / "solutions" / "toy.ipynb", as_version=4)
    nb, missing = prepare_submission(student, instructor)
    assert missing == ["mul_test"]
    add_test = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "add_test"]
    assert [c.source for c in add_test] == [instructor.cells[3].source]
    assert student.cells[3].source.startswith("pass")  # the input is not modified


def test_unknown_and_unreadable_notebooks_score_zero(tmp_path):
    (tmp_path / "other.ipynb").write_text("{}")
    other = grade_notebook(tmp_path / "other.ipynb", DATA / "solutions", progress=False)
    assert other.error.startswith("NoSolution") and other.max_score == 0
    (tmp_path / "toy.ipynb").write_text("not a notebook")
    broken = grade_notebook(tmp_path / "toy.ipynb", DATA / "solutions", progress=False)
    assert broken.error.startswith("UnreadableNotebook")
    assert [(e.score, e.max_score) for e in broken.exercises] == [(0, 2), (0, 3)]


@pytest.mark.parametrize("args", [
    ["grade", "no/such/notebook.ipynb"],
    ["grade", str(DATA / "submissions" / "full"), "--timeout", "0"],
    ["grade", str(DATA / "submissions" / "full"), "--solutions", "no/such/dir"],
])
def test_bad_usage_exits_2(args, capsys):
    assert cli(args) == 2
    assert "mgpu-lab grade:" in capsys.readouterr().err


def test_lab00_solution_full_marks_and_lab_zero(tmp_path):
    """The real lab 00: the solution scores full marks, the untouched lab 0 on every exercise."""
    solution = grade_notebook(ROOT / "solutions" / "00_setup.ipynb", progress=False)
    assert solution.error is None and solution.max_score > 0
    assert solution.score == solution.max_score, solution.exercises
    lab = grade_notebook(ROOT / "labs" / "00_setup.ipynb", progress=False)
    assert [e.grade_id for e in lab.exercises] == [e.grade_id for e in solution.exercises]
    assert all(e.score == 0 and e.error for e in lab.exercises), lab.exercises


def test_total_timeout_bounds_the_notebook():
    grade = grade_notebook(DATA / "submissions" / "loop" / "toy.ipynb", DATA / "solutions",
                           timeout=60, total_timeout=3, progress=False)
    assert [(e.grade_id, e.score, e.error) for e in grade.exercises] == [
        ("add_test", 0, "Timeout"), ("mul_test", 0, "TotalTimeout")]
    assert grade.seconds < 30


def test_kernel_runner_reports_every_code_cell_and_stores_outputs(tmp_path):
    """mgpu_lab.course.kernel.run_notebook, shared by grade, labs execute and tour."""
    nb = nbformat.read(DATA / "solutions" / "toy.ipynb", as_version=4)
    nb.cells[1].source = "import os\nprint(os.getcwd())"
    nb.cells[4].source = "raise ValueError('expected')"
    nb.cells[4].metadata["tags"] = ["raises-exception"]
    results = run_notebook(nb, cwd=tmp_path, timeout=30, progress=False)
    assert [r.index for r in results] == [1, 2, 3, 4, 5]
    assert [(r.error, r.expected_error) for r in results] == [
        (None, False), (None, False), (None, False), ("ValueError", True), ("NameError", False)]
    assert nb.cells[1].outputs[0]["text"].strip() == str(tmp_path)   # cwd = the folder given
    assert nb.cells[3].outputs[0]["text"] == "add passed\n"


def test_report_names_the_cause_inside_a_launch_error_and_totals():
    from mgpu_lab.course.grader import ExerciseScore, NotebookGrade, brief, print_report
    launch_error = ("rank 1 failed (then rank(s) [0] failed too):\nTraceback (most recent call last):\n"
                    "  File \"launch.py\", line 249, in _worker\n    value = fn(*args)\nNotImplementedError\n")
    assert brief(launch_error) == "rank 1 failed (then rank(s) [0] failed too): ... NotImplementedError"
    assert brief("x" * 300).endswith("...") and len(brief("x" * 300)) == 200
    grades = [NotebookGrade("a/00.ipynb", "00.ipynb", [ExerciseScore("t", 0.0, 2.0, "LaunchError",
                                                                     brief(launch_error))]),
              NotebookGrade("a/01.ipynb", "01.ipynb", [ExerciseScore("u", 3.0, 3.0)])]
    out = io.StringIO()
    print_report(grades, file=out)
    assert "LaunchError: rank 1 failed" in out.getvalue()
    assert out.getvalue().rstrip().endswith("total: 3/5 over 2 notebooks")
