"""Who a student is: a roster row (Canvas user id, then login, then a display name only one
row has), or without a roster a folder's exact name, in collision-free output files; and
how a submission is stored (any bytes in a name, any depth, a zip, a file that is not a
notebook) costs that submission only, and is said.

One class, graded once by the real command with a stand-in for the notebook grader (each
``.ipynb`` here is ``{"score": N}``): identity is all these tests check. The last test
grades two real notebooks (a folder named in bytes that are not UTF-8, a zipped notebook
in a Canvas download) with the real grader.
"""
import contextlib
import csv
import io
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from mgpu_lab.cli import main as cli
from mgpu_lab.course.classroom.handins import MAX_DEPTH, find_submissions, identify, student_name
from mgpu_lab.course.classroom.lms import read_roster
from mgpu_lab.course.grading.scoring import ExerciseScore, NotebookGrade

sys.path.insert(0, str(Path(__file__).parent))
from test_grader import TOY, UNSANDBOXED_IF_NEEDED, toy  # noqa: E402

ROSTER = """Student,ID,SIS User ID,SIS Login ID,Section,toy (555)
    Points Possible,,,,,5
"Nguyen, Anh",300,s300,anguyen1,A,
"Nguyen, Anh",301,s301,anguyen2,A,
"Cole, Carol",302,s302,ccole,A,
"Do, David",303,s303,ddo,A,
"Builder, Bob",101,s101,bob,B,
"Liddell, Alice",102,s102,alice,B,
"Absent, Ann",104,s104,aabsent,B,
"Empty, Zed",304,s304,zempty,B,
"""
BAD = os.fsdecode(b"bad\xff\xfename")            # a folder's name that is not UTF-8
DEPTH = 1100


def notebook(score) -> str:
    return json.dumps({"score": score})


def fake_grade(path, labs, student="", box=None, limits=None, timeout=0, total_timeout=0,
               pool=None, folder=None):
    """The grader's stand-in: the score the file says, for lab ``toy``."""
    return fake_grade_of(student, str(path), json.loads(Path(path).read_bytes())["score"])


def download(path: Path) -> Path:
    """A Canvas download: Anh 301 (not 300, who shares her name), Carol's zipped notebook,
    David's late PDF, Zed's zip without a notebook."""
    carol, zed = path.parent / "carol.zip", path.parent / "zed.zip"
    with zipfile.ZipFile(carol, "w") as z:
        z.writestr("work/toy.ipynb", notebook(4))
        z.writestr("__MACOSX/work/._toy.ipynb", "junk")
    with zipfile.ZipFile(zed, "w") as z:
        z.writestr("readme.txt", "I forgot")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("submissions/nguyenanh_301_9001_toy.ipynb", notebook(5))
        z.write(carol, "submissions/colecarol_302_9002_lab.zip")
        z.writestr("submissions/dodavid_LATE_303_9003_toy.pdf", "%PDF")
        z.write(zed, "submissions/emptyzed_304_9004_x.zip")
    return path


def deep_folder(top: Path) -> Path:
    here = top
    for _ in range(DEPTH):
        here = here / "a"
        os.mkdir(here)
    (here / "toy.ipynb").write_text(notebook(5))
    return here


def remove_deep(top: Path) -> None:
    """shutil.rmtree recurses (Python 3.11): 1,100 levels are removed from the bottom up."""
    here = top
    while (here / "a").is_dir():
        here = here / "a"
    (here / "toy.ipynb").unlink()
    while here != top:
        os.rmdir(here)
        here = here.parent


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """``(exit code, stdout, stderr, tmp)`` of grading the download and a class folder with
    the roster."""
    tmp = tmp_path_factory.mktemp("roster")
    (tmp / "solutions").mkdir()
    shutil.copy(TOY, tmp / "solutions" / "toy.ipynb")
    (tmp / "roster.csv").write_text(ROSTER)
    folders = {"submitted": 1, "alice": 5, "alice_": 0, "bob": 5, "Bob": 0, BAD: 3,
               "deep": 2, "Nguyen, Anh": 1}
    for name, score in folders.items():
        (tmp / "class" / name).mkdir(parents=True)
        (tmp / "class" / name / "toy.ipynb").write_text(notebook(score))
    deep_folder(tmp / "class" / "deep")
    out, err = io.StringIO(), io.StringIO()
    try:
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            mp.setattr("mgpu_lab.course.classroom.grade.grade_notebook", fake_grade)
            code = cli(["grade", str(download(tmp / "submissions.zip")), str(tmp / "class"),
                        "--solutions", str(tmp / "solutions"), "--roster", str(tmp / "roster.csv"),
                        "--canvas", str(tmp / "canvas.csv"), "--csv", str(tmp / "g.csv"),
                        "--json", str(tmp / "g.json"), "--report", str(tmp / "report.txt"),
                        "--feedback", str(tmp / "fb"), "--quiet", "--no-sandbox"])
        yield code, out.getvalue(), err.getvalue(), tmp
    finally:
        remove_deep(tmp / "class" / "deep")


def canvas_rows(tmp: Path) -> dict:
    with open(tmp / "canvas.csv", newline="", encoding="utf-8") as f:
        table = list(csv.reader(f))
    assert table[0][:6] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "toy (555)"]
    return {(r[0], r[1]): r[5] for r in table[2:]}


def test_the_two_nguyens_each_get_their_own_grade(graded):
    code, out, _, tmp = graded
    rows = canvas_rows(tmp)
    assert code == 0
    assert rows[("Nguyen, Anh", "301")] == "5"      # the one who handed in, by her Canvas id
    assert rows[("Nguyen, Anh", "300")] == ""       # the other: untouched
    # a folder named by hand "Nguyen, Anh" is either of them: graded under its own name,
    # in neither row, and said so
    assert rows[("Nguyen, Anh", "")] == "1"
    assert ("not in the roster: Nguyen, Anh: 2 roster rows have the name 'Nguyen, Anh'"
            in out)


def test_Bob_is_not_bob_and_alice_is_not_alice_(graded):
    code, out, err, tmp = graded
    rows = canvas_rows(tmp)
    assert rows[("Builder, Bob", "101")] == "5" and rows[("Bob", "")] == "0"
    assert rows[("Liddell, Alice", "102")] == "5" and rows[("alice_", "")] == "0"
    assert "not in the roster: Bob: no roster rows have the name 'Bob'" in out
    assert "Bob is not in the roster" in err
    alice, other = ((tmp / "fb" / name / "toy.md").read_text() for name in ("alice", "alice_"))
    assert "5 / 5" in alice and "0 / 5" in other and "Student: alice\\_ " in other
    bobs = sorted(p.name for p in (tmp / "fb").iterdir() if p.name.lower().startswith("bob"))
    assert bobs[0] == "bob" and bobs[1].startswith("bob~") and len(bobs) == 2


def test_a_folder_named_submitted_is_one_student(graded):
    _, out, _, tmp = graded
    rows = canvas_rows(tmp)
    assert rows[("submitted", "")] == "1"
    assert rows[("Liddell, Alice", "102")] == "5"       # the others are still there


def test_a_zipped_notebook_and_a_file_that_is_not_one(graded):
    _, out, _, tmp = graded
    rows = canvas_rows(tmp)
    assert rows[("Cole, Carol", "302")] == "4"          # unpacked, her Canvas id kept
    assert rows[("Do, David", "303")] == "" and rows[("Empty, Zed", "304")] == ""
    assert not [who for who in rows if who[0] in ("dodavid", "emptyzed", "colecarol")]
    lines = out.splitlines()
    assert any(line.startswith("not graded: dodavid: ") and "toy.pdf: NotANotebook" in line
               for line in lines)
    assert any(line.startswith("not graded: emptyzed: ") and "a zip with no notebook" in line
               for line in lines)
    feedback = (tmp / "fb" / "dodavid").iterdir()
    assert "only .ipynb files are graded" in next(feedback).read_text()


def test_a_name_in_any_bytes_and_a_deep_folder_cost_their_own_only(graded):
    code, out, err, tmp = graded
    assert code == 0 and "Traceback" not in err
    bad = student_name(BAD)
    assert bad.startswith("bad??name~") and canvas_rows(tmp)[(bad, "")] == "3"
    with open(tmp / "g.csv", newline="", encoding="utf-8") as f:
        students = {r[0]: r[1] for r in list(csv.reader(f))[1:]}
    assert len(students) == 12 and students[bad] == "3.0" and students["deep"] == "2.0"
    report = (tmp / "report.txt").read_text(encoding="utf-8")
    assert bad in report and "TooDeep" in report
    deep = [line for line in out.splitlines() if line.startswith("not graded: deep: ")]
    assert len(deep) == 1 and f"more than {MAX_DEPTH} levels down" in deep[0]
    assert len(deep[0]) < 400
    assert json.loads((tmp / "g.json").read_text())["students"][bad]["total"] == 3
    raw = (tmp / "g.json").read_text(encoding="utf-8")
    assert "\\udc" not in raw, "a lone surrogate (a name's bad bytes) is not valid Unicode in JSON"
    assert (tmp / "fb").joinpath(next(p for p in os.listdir(tmp / "fb")
                                      if p.startswith("bad_name_")), "toy.md").is_file()


def test_roster_students_with_nothing_graded_are_listed_as_missing(graded):
    _, out, _, tmp = graded
    missing = sorted(line for line in out.splitlines() if line.startswith("missing: "))
    assert missing == [f"missing: {who}: in the roster, nothing graded" for who in
                       ("Absent, Ann (ID 104)", "Do, David (ID 303)", "Empty, Zed (ID 304)",
                        "Nguyen, Anh (ID 300)")]
    assert "missing: Absent, Ann" in (tmp / "report.txt").read_text()
    assert any(n.startswith("missing: Nguyen, Anh (ID 300)")
               for n in json.loads((tmp / "g.json").read_text())["notices"])


# --- without kernels, without the command -----------------------------------------------

def test_matching_order_id_then_login_then_a_name_only_one_row_has(tmp_path):
    (tmp_path / "r.csv").write_text(ROSTER)
    roster = read_roster(tmp_path / "r.csv")
    assert roster.match("nguyenanh", "301") == (1, "")
    assert roster.match("anguyen1", "999") == (None, "no roster rows have the Canvas id 999")
    assert roster.match("anguyen1") == (0, "") and roster.match("101") == (4, "")
    assert roster.match("Cole, Carol") == (2, "") and roster.match("cole, carol")[0] is None
    assert roster.match("Nguyen, Anh")[0] is None and roster.match("Bob")[0] is None


def test_both_nguyens_hand_in_and_a_login_folder_is_its_row(tmp_path):
    from mgpu_lab.course.classroom.handins import Submission
    (tmp_path / "r.csv").write_text(ROSTER)
    roster = read_roster(tmp_path / "r.csv")
    subs = [Submission("nguyenanh", Path("nguyenanh_300_1_lab.ipynb"), uid="300"),
            Submission("nguyenanh", Path("nguyenanh_301_2_lab.ipynb"), uid="301"),
            Submission("anguyen2", Path("anguyen2/lab06.ipynb")),
            Submission("nguyenanh", Path("nguyenanh/lab.ipynb"))]
    found, rows, notices = identify(subs, roster)
    assert [s.student for s in found] == ["nguyenanh", "anguyen2", "anguyen2", "nguyenanh_"]
    assert rows == {"nguyenanh": roster.rows[0], "anguyen2": roster.rows[1]}
    assert notices == ["not in the roster: nguyenanh_: no roster rows have the name "
                       "'nguyenanh'; graded under its own name, in no row"]


def test_canvas_csv_of_a_book_made_without_identify_matches_by_id_too(tmp_path):
    from mgpu_lab.course.classroom.gradebook import Gradebook
    from mgpu_lab.course.classroom.lms import write_canvas_csv
    (tmp_path / "r.csv").write_text(ROSTER)
    book = Gradebook([fake_grade_of("nguyenanh", "nguyenanh_301_1_toy.ipynb", 5, ("301", "1")),
                      fake_grade_of("Bob", "Bob/toy.ipynb", 0),
                      fake_grade_of("bob", "bob/toy.ipynb", 5)], {"toy": 5})
    strangers, _ = write_canvas_csv(book, tmp_path / "canvas.csv", read_roster(tmp_path / "r.csv"))
    assert strangers == ["Bob"]
    rows = canvas_rows(tmp_path)
    assert rows[("Nguyen, Anh", "301")] == "5" and rows[("Nguyen, Anh", "300")] == ""
    assert rows[("Builder, Bob", "101")] == "5" and rows[("Bob", "")] == "0"


def fake_grade_of(student, path, score, canvas=None):
    return NotebookGrade(path, Path(path).name, student, "toy",
                         [ExerciseScore("add_test", float(score), 5.0)], canvas=canvas)


def test_a_download_s_file_names_in_any_bytes_and_length(tmp_path):
    from mgpu_lab.course.classroom.lms import file_name
    long = "doejane_101_9_" + "é" * 200 + ".ipynb"
    assert len(os.fsencode(file_name(long))) <= 200 and file_name(long).endswith(".ipynb")
    assert file_name(long).startswith("doejane_101_9_") and file_name("a\0b") == "a?b"
    with zipfile.ZipFile(tmp_path / "d.zip", "w") as z:
        z.writestr(long, notebook(1))
        z.writestr("bob_7_8_lab.ipynb", notebook(2))
    found = find_submissions([tmp_path / "d.zip"], tmp_path / "unpacked")
    assert sorted((s.student, s.uid) for s in found) == [("bob", "7"), ("doejane", "101")]


def test_without_a_roster_distinct_names_are_distinct_students(tmp_path):
    for name in ("submitted", "alice", "alice_", "Bob", "bob", "x\x1b[31m" + "y" * 100):
        (tmp_path / "c" / name).mkdir(parents=True)
        (tmp_path / "c" / name / "lab.ipynb").write_text("{}")
    found = find_submissions([tmp_path / "c"])
    names = [s.student for s in found]
    assert len(set(names)) == 6 and {"submitted", "alice", "alice_", "Bob", "bob"} < set(names)
    long = next(n for n in names if n.startswith("x"))
    assert long.isprintable() and len(long) <= 53 and "\x1b" not in long
    assert student_name("bob") == "bob" and student_name("a~b") != "a~b"
    # one student found twice (a download's id and a folder) stays one; a name two
    # students share gets an id
    again, rows, notices = identify(found)
    assert [s.student for s in again] == names and rows == {} and notices == []


def test_feedback_files_are_distinct_for_distinct_names(tmp_path):
    from mgpu_lab.course.classroom.report import write_feedback
    names = ["alice", "alice_", "Alice", "alice.", "a/b", "a_b", "..", "?x"]
    grades = [NotebookGrade(f"{n}.ipynb", "lab.ipynb", n, "toy",
                            [ExerciseScore("t", 1.0, 1.0)]) for n in names]
    paths = write_feedback(grades, tmp_path / "fb")
    assert len({p.parent.name.lower() for p in paths}) == len(names)
    assert all(p.parent.parent == tmp_path / "fb" for p in paths)


def test_real_grades_for_a_name_not_in_utf8_and_a_zipped_notebook(tmp_path):
    """The real grader (a kernel each): both score full marks, each under its own name."""
    import nbformat
    (tmp_path / "solutions").mkdir()
    shutil.copy(TOY, tmp_path / "solutions" / "toy.ipynb")
    (tmp_path / "class" / BAD).mkdir(parents=True)
    nbformat.write(toy(), tmp_path / "class" / BAD / "toy.ipynb")
    nbformat.write(toy(), tmp_path / "lab.ipynb")
    with zipfile.ZipFile(tmp_path / "upload.zip", "w") as z:
        z.write(tmp_path / "lab.ipynb", "my lab/lab.ipynb")
    with zipfile.ZipFile(tmp_path / "submissions.zip", "w") as z:
        z.write(tmp_path / "upload.zip", "colecarol_302_9002_upload.zip")
    assert cli(["grade", str(tmp_path / "submissions.zip"), str(tmp_path / "class"),
                "--solutions", str(tmp_path / "solutions"), "--json", str(tmp_path / "g.json"),
                "--quiet", "--jobs", "2", "--timeout", "60"] + UNSANDBOXED_IF_NEEDED) == 0
    students = json.loads((tmp_path / "g.json").read_text())["students"]
    assert {s: v["total"] for s, v in students.items()} == {student_name(BAD): 5.0,
                                                              "colecarol": 5.0}
