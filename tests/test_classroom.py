"""An instructor's class, around the grader: a Canvas download and a roster in, Canvas's
import CSV, nbgrader's gradebook, a one-line-per-student summary and feedback out;
policies, fixed maxima, ``--lab``; feedback that says what went wrong; releases.

One class is graded once (toy labs: ``toy`` and ``toy2``, a copy of it under another lab
id, from tests/data/grader): a Canvas download as Canvas gives it, a zip of
``name_uid_subid_file`` notebooks, with a re-upload (``toy-1``), a late one, a syntax
error, an untouched lab and one made from an older lab version. The other tests read
that run, or need no kernel.
"""
import csv
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from mgpu_lab.cli import main as cli
from mgpu_lab.course.classroom.gradebook import Gradebook
from mgpu_lab.course.notebook.notebooks import make_lab
from mgpu_lab.course.grading.scoring import ExerciseScore, NotebookGrade

DATA = Path(__file__).parent / "data" / "grader"
TOY = DATA / "solutions" / "toy.ipynb"
sys.path.insert(0, str(Path(__file__).parent))
from test_grader import UNSANDBOXED_IF_NEEDED, toy  # noqa: E402

try:
    import nbgrader.api  # noqa: F401
    HAS_NBGRADER = True
except ImportError:
    HAS_NBGRADER = False

ROSTER = """Student,ID,SIS User ID,SIS Login ID,Section,toy (555),Toy two (556),Current Score
    Points Possible,,,,,5,10,
"Doe, Jane",101,s101,jdoe,A,,,
"Smith, John",102,s102,jsmith,A,,,
"Roe, Eric",103,s103,eroe,B,,,
"Absent, Ann",104,s104,aabsent,B,,4,
"""


def solutions(tmp: Path) -> Path:
    folder = tmp / "solutions"
    folder.mkdir(parents=True)
    shutil.copy(TOY, folder / "toy.ipynb")
    two = nbformat.read(TOY, as_version=4)
    two.metadata["mgpu_lab"]["lab"] = "toy2"
    nbformat.write(two, folder / "toy2.ipynb")
    return folder


def canvas_zip(path: Path) -> Path:
    """A Canvas submissions download: flat ``name_uid_subid_file`` names, the files' times
    kept in the zip (Jane's re-upload is the later one)."""
    two = toy()
    two.metadata["mgpu_lab"]["lab"] = "toy2"
    old = toy(add="def add(a, b):\n    return a + b + 1")         # made from an older lab
    old.metadata["mgpu_lab"]["version"] = "0ld0ld0ld0ld"
    files = {"doejane_101_9001_toy.ipynb": (toy(), (2026, 1, 1, 10, 0, 0)),
             "doejane_101_9002_toy-1.ipynb": (toy(mul="def mul(a, b):\n    return a + b"),
                                              (2026, 1, 2, 10, 0, 0)),
             "doejane_101_9003_toy2.ipynb": (two, (2026, 1, 1, 10, 0, 0)),
             "smithjohn_LATE_102_9004_toy.ipynb": (toy(add="def add(a, b):\n    return (a +"),
                                                   (2026, 1, 3, 10, 0, 0)),
             "roeeric_103_9005_toy.ipynb": (make_lab(nbformat.read(TOY, as_version=4)),
                                            (2026, 1, 1, 10, 0, 0)),
             "oldie_106_9006_toy.ipynb": (old, (2026, 1, 1, 10, 0, 0))}
    with zipfile.ZipFile(path, "w") as z:
        for name, (nb, when) in files.items():
            z.writestr(zipfile.ZipInfo(f"submissions/{name}", date_time=when), nbformat.writes(nb))
    return path


@pytest.fixture(scope="module")
def klass(tmp_path_factory):
    """The class graded once: ``(exit code, stdout, tmp)``."""
    tmp = tmp_path_factory.mktemp("class")
    sol = solutions(tmp)
    (tmp / "roster.csv").write_text(ROSTER)
    download = canvas_zip(tmp / "submissions.zip")
    db = tmp / "gradebook.db"
    to_nbgrader = ["--nbgrader", str(db), "--nbgrader-assignment", "ps1"] if HAS_NBGRADER else []
    if HAS_NBGRADER:
        _nbgrader_assignment(db)
    import subprocess
    out = subprocess.run(
        [sys.executable, "-m", "mgpu_lab", "grade", str(download), "--solutions", str(sol),
         "--roster", str(tmp / "roster.csv"), "--canvas", str(tmp / "canvas.csv"),
         "--assignment", "toy2=556", "--canvas-feedback", str(tmp / "canvas-feedback"),
         "--policy", "latest", "--csv", str(tmp / "g.csv"), "--json", str(tmp / "g.json"),
         "--report", str(tmp / "report.txt"), "--feedback", str(tmp / "fb"),
         "--jobs", "2", "--quiet", "--timeout", "60"] + to_nbgrader + UNSANDBOXED_IF_NEEDED,
        capture_output=True, text=True, timeout=600, cwd=tmp)
    return out.returncode, out.stdout, out.stderr, tmp


def _nbgrader_assignment(db: Path) -> None:
    """What ``nbgrader generate_assignment ps1`` records of source/ps1/toy.ipynb."""
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    from nbgrader.api import Gradebook as NbgraderBook
    with NbgraderBook(f"sqlite:///{db}") as gb:
        gb.update_or_create_assignment("ps1")
        gb.update_or_create_notebook("toy", "ps1")
        gb.update_or_create_grade_cell("add_test", "toy", "ps1", max_score=2, cell_type="code")
        gb.update_or_create_grade_cell("mul_test", "toy", "ps1", max_score=3, cell_type="code")


def rows(path: Path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_a_canvas_download_and_roster_through_to_canvas_import_csv(klass):
    code, _, err, tmp = klass
    assert code == 0, err
    table = rows(tmp / "canvas.csv")
    assert table[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "toy (555)",
                        "Toy two (556)"]                 # toy2: by --assignment toy2=556
    assert table[1] == ["    Points Possible", "", "", "", "", "5", "5"]
    by_id = {r[1]: r for r in table[2:]}
    assert by_id["101"][5:] == ["2", "5"]            # latest: the re-upload, which lost mul
    assert by_id["102"][5:] == ["3", ""]             # toy2 not handed in: Canvas has nothing
    assert by_id["103"][5:] == ["0", ""]
    assert by_id["104"][5:] == ["", "4"]             # handed in nothing: Canvas's score stays
    assert by_id["101"][:5] == ["Doe, Jane", "101", "s101", "jdoe", "A"]
    assert table[-1][:2] == ["oldie", "106"] and "oldie is not in the roster" in err
    assert "'Toy two (556)' is out of 10 points in Canvas, lab toy2 out of 5" in err
    with zipfile.ZipFile(tmp / "canvas-feedback" / "toy.zip") as z:   # for Re-Upload Submissions
        assert sorted(z.namelist()) == ["doejane_101_9002_feedback.txt", "oldie_106_9006_feedback.txt",
                                        "roeeric_103_9005_feedback.txt", "smithjohn_102_9004_feedback.txt"]
        assert "Notebook: doejane_101_9002_toy-1.ipynb" in z.read("doejane_101_9002_feedback.txt").decode()
    with zipfile.ZipFile(tmp / "canvas-feedback" / "toy2.zip") as z:
        assert z.namelist() == ["doejane_101_9003_feedback.txt"]


def test_summary_one_line_per_student_totals_equal_the_csv_maximum_never_shrinks(klass):
    _, out, _, tmp = klass
    lines = out.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("student")))
    assert lines[head].split() == ["student", "toy", "toy2", "total"]
    shown = {line.split()[0]: line.split()[1:] for line in lines[head + 1: head + 5]}
    csv_rows = {r[0]: r for r in rows(tmp / "g.csv")[1:]}
    assert set(shown) == set(csv_rows) == {"doejane", "smithjohn", "roeeric", "oldie"}
    for student, cells in shown.items():
        total, maximum = cells[-1].split("/")
        assert float(total) == float(csv_rows[student][1]) and maximum == "10"
        assert float(csv_rows[student][2]) == 10         # toy2 missing: the maximum stays
    assert shown["smithjohn"] == ["3/5", "-", "3/10"]
    assert "observes" not in out and "note:" not in out     # details: the report's
    assert "this notebook counts" in (tmp / "report.txt").read_text()


def test_latest_policy_and_the_feedback_says_which_notebook_counted(klass):
    _, _, _, tmp = klass
    text = (tmp / "fb" / "doejane" / "toy.md").read_text()
    assert "doejane\\_101\\_9002\\_toy\\-1.ipynb" in text    # the notebook graded
    assert "this notebook counts\\: the latest of the 2 handed in for toy" in text
    assert "doejane\\_101\\_9001\\_toy.ipynb \\(5\\)" in text
    assert "observes" not in "".join(p.read_text() for p in (tmp / "fb").rglob("*.md"))
    report = json.loads((tmp / "g.json").read_text())
    assert report["policy"] == "latest" and report["students"]["doejane"]["total"] == 7
    assert report["students"]["doejane"]["not_counted"] == ["doejane_101_9001_toy.ipynb"]


def test_feedback_names_exercises_a_syntax_error_by_its_line_and_an_untouched_one(klass):
    _, _, _, tmp = klass
    smith = (tmp / "fb" / "smithjohn" / "toy.md").read_text()
    assert ("| add | 0 / 2 | SyntaxError\\: cell 2 \\(your code\\) is not valid Python\\: "
            "'\\(' was never closed, line 2 |") in smith
    assert "NameError" not in smith
    roe = (tmp / "fb" / "roeeric" / "toy.md").read_text()
    assert "| add | 0 / 2 | NotAttempted\\: your cell 2 is as the lab gave it |" in roe
    oldie = (tmp / "fb" / "oldie" / "toy.md").read_text()
    assert "made from version 0ld0ld0ld0ld of the lab" in oldie
    assert "AssertionError\\: add\\(2, 3\\) returned 6 \\(check line 5\\)" in oldie


@pytest.mark.skipif(not HAS_NBGRADER, reason="nbgrader is not installed (the [test] extra has it)")
def test_scores_land_where_nbgrader_export_reads_them(klass):
    """`mgpu-lab grade --nbgrader gradebook.db`, then nbgrader's own `nbgrader export`."""
    _, _, _, tmp = klass
    import subprocess
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    done = subprocess.run([sys.executable, "-m", "nbgrader", "export", "--to", "nb.csv",
                           "--CourseDirectory.db_url", f"sqlite:///{tmp / 'gradebook.db'}"],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    exported = {r["student_id"]: r for r in csv.DictReader(open(tmp / "nb.csv"))}
    assert {s: (float(r["score"]), float(r["max_score"])) for s, r in exported.items()} == {
        "doejane": (2.0, 5.0), "smithjohn": (3.0, 5.0), "roeeric": (0.0, 5.0),
        "oldie": (3.0, 5.0)}


def test_lab_grades_one_lab_of_a_class_folder(klass, tmp_path, capsys):
    _, _, _, tmp = klass
    folder = tmp_path / "download"
    with zipfile.ZipFile(tmp / "submissions.zip") as z:
        z.extractall(folder)
    assert cli(["grade", str(folder / "submissions"), "--solutions", str(tmp / "solutions"),
                "--lab", "toy2", "--quiet", "--json", str(tmp_path / "g.json")]
               + UNSANDBOXED_IF_NEEDED) == 0
    report = json.loads((tmp_path / "g.json").read_text())
    assert [(n["student"], n["lab"], n["score"]) for n in report["notebooks"]] == [
        ("doejane", "toy2", 5.0)]
    assert report["labs"] == {"toy2": 5.0}
    assert capsys.readouterr().out.splitlines()[1].split() == ["student", "toy2", "total"]


# --- without kernels ---------------------------------------------------------------------

def grade(student, lab, score, path, when=0.0, error=None):
    return NotebookGrade(path, Path(path).name, student, lab,
                         [ExerciseScore("t", score, 5.0, error)], submitted_at=when)


def test_policies_best_and_latest_and_a_maximum_that_never_shrinks():
    grades = [grade("a", "00", 5, "a/first.ipynb", when=1), grade("a", "00", 2, "a/second.ipynb", when=2),
              grade("a", "06", 4, "a/six.ipynb"), grade("b", "00", 3, "b/x.ipynb")]
    best = Gradebook(grades, {"00": 5, "06": 5}, "best")
    assert (best.total("a"), best.total("b"), best.max_total) == (9, 3, 10)
    assert best.counted("a", "00").path == "a/first.ipynb" and best.counted("b", "06") is None
    latest = Gradebook(grades, {"00": 5, "06": 5}, "latest")
    assert latest.total("a") == 6 and latest.counted("a", "00").path == "a/second.ipynb"
    assert any("the latest of the 2" in n for n in latest.counted("a", "00").notes)
    with pytest.raises(ValueError):
        Gradebook(grades, policy="first")
    # Canvas's "-1" of a re-upload breaks a tie of times
    again = [grade("c", "00", 1, "c_1_2_lab.ipynb", when=5), grade("c", "00", 0, "c_1_3_lab-1.ipynb", when=5)]
    assert Gradebook(again, policy="latest").counted("c", "00").path == "c_1_3_lab-1.ipynb"


def test_canvas_file_names_and_a_zip_read_flat(tmp_path):
    from mgpu_lab.course.classroom.handins import find_submissions
    from mgpu_lab.course.classroom.lms import canvas_file
    assert canvas_file("doejane_LATE_101_9004_lab 00-1.ipynb").__dict__ == dict(
        name="doejane", uid="101", subid="9004", late=True, file="lab 00-1.ipynb")
    assert canvas_file("alice.ipynb") is None
    with zipfile.ZipFile(tmp_path / "d.zip", "w") as z:
        for name in ("doejane_101_1_a.ipynb", "doejane_202_2_a.ipynb", "../../evil.ipynb",
                     "bob_3_3_a.ipynb"):
            z.writestr(name, "{}")
    found = find_submissions([tmp_path / "d.zip"], tmp_path / "unpacked")
    assert sorted(s.student for s in found) == ["bob", "doejane_101", "doejane_202", "evil"]
    assert all(Path(s.path).parent == tmp_path / "unpacked" / "0-d" for s in found)


def test_named_notebooks_each_in_a_folder_are_their_folders_students(tmp_path):
    from mgpu_lab.course.classroom.handins import find_submissions
    for path in ("alice/lab.ipynb", "bob/lab.ipynb", "flat/cy.ipynb", "flat/dee.ipynb"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("{}")
    assert [s.student for s in find_submissions([tmp_path / "alice/lab.ipynb",
                                                 tmp_path / "bob/lab.ipynb"])] == ["alice", "bob"]
    assert [s.student for s in find_submissions([tmp_path / "flat/cy.ipynb",
                                                 tmp_path / "flat/dee.ipynb"])] == ["cy", "dee"]


def test_what_a_student_left_explains_the_failure_without_a_kernel():
    """The exercise's own cell says why its check failed: untouched, or not Python (and a
    syntax error in another cell explains a NameError)."""
    from mgpu_lab.course.grading.grader import attempts_of
    from mgpu_lab.course.grading.submission import prepare_submission
    instructor = nbformat.read(TOY, as_version=4)
    lab = make_lab(instructor)
    lab.cells[1].source = "import math\nx = ("                    # a given cell, broken
    found = attempts_of(prepare_submission(lab, instructor), instructor)
    assert found["add_test"][0] == "NotAttempted" and found["mul_test"][0] == "NotAttempted"
    mine = toy(add="def add(a, b):\n    return a +", first="import math")
    found = attempts_of(prepare_submission(mine, instructor), instructor)
    assert found["add_test"] == ("SyntaxError", "cell 2 (your code) is not valid Python: "
                                                "invalid syntax, line 2", True)
    assert found["mul_test"][2] is False       # explains mul_test's NameError only
    mine = toy(first="import math\nx = (")
    found = attempts_of(prepare_submission(mine, instructor), instructor)
    assert found["add_test"][0] == "SyntaxError" and found["add_test"][2] is False


# --- releases and authoring ----------------------------------------------------------------

def course(tmp: Path, edit=None) -> Path:
    """A checkout with the toy lab's solution (``edit(nb)`` applied to it)."""
    (tmp / "solutions").mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(TOY, as_version=4)
    nb.metadata["mgpu_lab"]["lab"] = "01_toy"
    if edit:
        edit(nb)
    nbformat.write(nb, tmp / "solutions" / "01_toy.ipynb")
    return tmp


def test_labs_build_refuses_an_assert_without_a_message_hidden_ones_too(tmp_path, capsys):
    def hidden(nb):
        nb.cells[5].source = nb.cells[5].source.replace("cases += [(-1, 4)]",
                                                        "cases += [(-1, 4)]\nassert cases")
    assert cli(["labs", "build", "--root", str(course(tmp_path, hidden))]) == 2
    err = capsys.readouterr().err
    assert "cell 5 (mul_test): line 4: an assert without a message" in err
    assert not (tmp_path / "labs" / "01_toy.ipynb").exists()


def test_labs_build_refuses_a_heading_that_states_other_points(tmp_path, capsys):
    def heading(nb):
        nb.cells.insert(4, nbformat.v4.new_markdown_cell("### Exercise 2 (2 points): `mul`"))
    root = course(tmp_path, heading)
    assert cli(["labs", "build", "--root", str(root)]) == 2
    assert "its heading says 2 points, its exercise's graded cells 3" in capsys.readouterr().err

    def right(nb):
        nb.cells.insert(4, nbformat.v4.new_markdown_cell("### Exercise 2 (3 points): `mul`"))
    assert cli(["labs", "build", "--root", str(course(tmp_path, right))]) == 0


def test_an_exercise_with_two_graded_cells_states_their_sum():
    from mgpu_lab.course.notebook.exercises import points_mismatches, titles

    def cell(kind, gid, points=0):
        c = nbformat.v4.new_code_cell("x = 1" if kind == "solution" else "### PROBE\n### JUDGE\n")
        c.metadata["nbgrader"] = {"grade_id": gid, "points": points, "solution": kind == "solution",
                                  "grade": kind == "grade", "locked": kind == "grade"}
        return c

    def notebook(heading):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_markdown_cell(f"### Exercise 1 {heading}: a folder"),
                    cell("solution", "ex"), cell("grade", "ex_test", 2), cell("grade", "ex_fsync_test", 1)]
        return nb
    assert points_mismatches(notebook("(2 + 1 points)")) == []
    assert points_mismatches(notebook("(3 points)")) == []
    assert "its heading says 2 points, its exercise's graded cells 3" in points_mismatches(notebook("(2 points)"))[0]
    assert titles(notebook("(2 + 1 points)")) == {"ex_test": "Exercise 1: a folder (check 1 of 2)",
                                                  "ex_fsync_test": "Exercise 1: a folder (check 2 of 2)"}


def test_a_lab_version_changes_with_its_graded_cells_only(tmp_path):
    from mgpu_lab.course.notebook.exercises import lab_version
    assert cli(["labs", "build", "--root", str(course(tmp_path))]) == 0
    built = nbformat.read(tmp_path / "labs" / "01_toy.ipynb", as_version=4)
    first = built.metadata["mgpu_lab"]["version"]
    assert first == lab_version(nbformat.read(tmp_path / "solutions" / "01_toy.ipynb", as_version=4))

    def prose(nb):
        nb.cells[0].source += "\nMore words."
    course(tmp_path, prose)
    assert cli(["labs", "build", "--root", str(tmp_path)]) == 0
    assert nbformat.read(tmp_path / "labs" / "01_toy.ipynb", as_version=4).metadata[
        "mgpu_lab"]["version"] == first

    def points(nb):
        nb.cells[5].metadata["nbgrader"]["points"] = 4
    course(tmp_path, points)
    assert cli(["labs", "build", "--root", str(tmp_path)]) == 0
    assert nbformat.read(tmp_path / "labs" / "01_toy.ipynb", as_version=4).metadata[
        "mgpu_lab"]["version"] != first
