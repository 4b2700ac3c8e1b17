"""A submission's student, and its Canvas ids, are decided once (:mod:`.handins`): only a
download's flat file is named by its Canvas name; a notebook in a student's folder is that
folder's, whatever its name; Canvas's import CSV and feedback zip use what was decided and
never read a file's name again. A Canvas name that splits several ways is in no row unless
the roster tells which; a student's notebooks and a zip's files are bounded; a link at the
top of a class folder is not followed. The stand-in grader of test_roster (no kernels).
"""
import contextlib
import csv
import io
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from mgpu_lab.cli import main as cli
from mgpu_lab.course.classroom import handins, lms
from mgpu_lab.course.classroom.gradebook import Gradebook
from mgpu_lab.course.classroom.handins import MAX_NOTEBOOKS, find_submissions, identify
from mgpu_lab.course.classroom.lms import (canvas_file, canvas_files, canvas_name, read_roster,
                                           write_canvas_feedback)

sys.path.insert(0, str(Path(__file__).parent))
from test_grader import TOY  # noqa: E402
from test_roster import fake_grade, fake_grade_of, notebook  # noqa: E402

ROSTER = """Student,ID,SIS User ID,SIS Login ID,Section,toy (555)
    Points Possible,,,,,5
"Builder, Bob",101,,bob,S1,
"Mal, Mallory",202,,mallory,S1,1
"""


def grade(tmp, *paths, roster=None):
    """``(exit code, stdout, stderr, {(Student, ID): toy}, {feedback file: text})``."""
    (tmp / "solutions").mkdir(exist_ok=True)
    shutil.copy(TOY, tmp / "solutions" / "toy.ipynb")
    extra = []
    if roster:
        (tmp / "roster.csv").write_text(roster)
        extra = ["--roster", str(tmp / "roster.csv")]
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        mp.setattr("mgpu_lab.course.classroom.grade.grade_notebook", fake_grade)
        code = cli(["grade", *map(str, paths), "--solutions", str(tmp / "solutions"),
                    "--canvas", str(tmp / "canvas.csv"), "--canvas-feedback", str(tmp / "cfb"),
                    "--quiet", "--no-sandbox"] + extra)
    with open(tmp / "canvas.csv", newline="", encoding="utf-8") as f:
        table = list(csv.reader(f))[2:]
    feedback = {}
    if (tmp / "cfb" / "toy.zip").exists():
        with zipfile.ZipFile(tmp / "cfb" / "toy.zip") as z:
            feedback = {n: z.read(n).decode() for n in z.namelist()}
    ids = [r[1] for r in table if r[1]]
    assert len(ids) == len(set(ids)), "one Canvas id, one row"
    return code, out.getvalue(), err.getvalue(), {(r[0], r[1]): r[5] for r in table}, feedback


def test_a_canvas_name_in_a_students_folder_is_not_an_identity(tmp_path):
    """H1: Mallory's folder holds a file named as Bob's: it is Mallory's, with no Canvas id:
    not a second row of id 101, not Bob's feedback file."""
    (tmp_path / "class" / "mallory").mkdir(parents=True)
    (tmp_path / "class" / "bob_101_11_toy.ipynb").write_text(notebook(5))
    (tmp_path / "class" / "mallory" / "bob_101_11_toy.ipynb").write_text(notebook(0))
    code, _, err, rows, feedback = grade(tmp_path, tmp_path / "class")
    assert code == 0
    assert rows == {("bob", "101"): "5", ("mallory", ""): "0"}
    assert list(feedback) == ["bob_101_11_feedback.txt"]
    assert "5 / 5" in feedback["bob_101_11_feedback.txt"]
    assert "no Canvas feedback for" in err and "(mallory, toy)" in err


def test_with_a_roster_a_stranger_never_takes_a_rows_canvas_id(tmp_path):
    (tmp_path / "class" / "eve").mkdir(parents=True)
    (tmp_path / "class" / "bob_101_11_toy.ipynb").write_text(notebook(5))
    (tmp_path / "class" / "eve" / "bob_101_11_toy.ipynb").write_text(notebook(0))
    _, _, _, rows, feedback = grade(tmp_path, tmp_path / "class", roster=ROSTER)
    assert rows[("Builder, Bob", "101")] == "5" and rows[("eve", "")] == "0"
    assert list(feedback) == ["bob_101_11_feedback.txt"]


def test_two_notebooks_never_write_one_feedback_file(tmp_path):
    book = Gradebook([fake_grade_of("bob", "a.ipynb", 5, ("101", "11")),
                      fake_grade_of("mallory", "b.ipynb", 0, ("101", "11"))], {"toy": 5})
    zips, skipped = write_canvas_feedback(book, tmp_path / "cfb")
    with zipfile.ZipFile(zips[0]) as z:
        assert z.namelist() == ["bob_101_11_feedback.txt"]
        assert "5 / 5" in z.read("bob_101_11_feedback.txt").decode()
    assert len(skipped) == 1 and "b.ipynb (mallory, toy)" in skipped[0]


def test_a_canvas_id_is_ascii_digits_and_a_name_may_end_in_digits():
    """H2: Canvas (``ContentZipper#sanitize_user_name``) joins ``_<digits>_`` in a name but
    leaves ``mal_101``: such a file's name splits two ways."""
    assert canvas_file("mal_101_202_55_toy.ipynb") is None
    assert [(c.name, c.uid, c.subid) for c in canvas_files("mal_101_202_55_toy.ipynb")] == \
        [("mal", "101", "202"), ("mal_101", "202", "55")]
    for name in ("bob_0101_11_toy.ipynb", "bob_\u0661\u0660\u0661_11_toy.ipynb",
                 "bob_101_011_toy.ipynb", "bob_101_11_"):
        assert canvas_files(name) == [], name
    assert canvas_file("doejane_LATE_101_9_a_1.ipynb").uid == "101"
    assert canvas_name("Builder, Bob") == "builderbob" and canvas_name("Mal_101") == "mal_101"
    assert canvas_name("a_12_b") == "a12b"


def test_an_ambiguous_canvas_name_is_in_no_row_unless_the_roster_tells(tmp_path):
    with zipfile.ZipFile(tmp_path / "d.zip", "w") as z:
        z.writestr("builderbob_101_11_toy.ipynb", notebook(5))
        z.writestr("mal_101_202_55_toy.ipynb", notebook(0))
    code, out, _, rows, feedback = grade(tmp_path, tmp_path / "d.zip", roster=ROSTER)
    assert code == 0
    assert rows == {("Builder, Bob", "101"): "5", ("Mal, Mallory", "202"): "1",
                    ("mal_101_202_55_toy", ""): "0"}
    assert ("ambiguous Canvas name: mal_101_202_55_toy: the user id in its file's name may "
            "be 101 or 202; graded under its own name, in no row") in out
    assert list(feedback) == ["builderbob_101_11_feedback.txt"]
    # the roster's Student, written as Canvas writes it, tells which split is the name
    found, rows_of, notices = identify(find_submissions([tmp_path / "d.zip"], tmp_path / "u"),
                                       read_roster_text(tmp_path, ROSTER.replace(
                                           "Mal, Mallory", "Mal_101")))
    mal = next(s for s in found if "mal" in s.path.name)
    assert (mal.uid, mal.subid, rows_of[mal.student]["ID"]) == ("202", "55", "202")
    assert notices == []


def read_roster_text(tmp, text):
    (tmp / "r2.csv").write_text(text)
    return read_roster(tmp / "r2.csv")


def test_named_notebooks_are_their_folders_students(tmp_path):
    """H3, M1: ``grade sub/*/*.ipynb``: in several folders, each notebook is its folder's
    (a Canvas name there is not an identity), two notebooks of one folder stay one
    student's; in one folder, flat files."""
    for name, score in (("bob/toy.ipynb", 5), ("mallory/bob_101_11_toy.ipynb", 0),
                        ("mallory/copy.ipynb", 1), ("alice/toy.ipynb", 4)):
        (tmp_path / "sub" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "sub" / name).write_text(notebook(score))
    named = sorted((tmp_path / "sub").glob("*/*.ipynb"))
    found = find_submissions(named)
    assert sorted((s.student, s.path.name, s.uid) for s in found) == [
        ("alice", "toy.ipynb", None), ("bob", "toy.ipynb", None),
        ("mallory", "bob_101_11_toy.ipynb", None), ("mallory", "copy.ipynb", None)]
    _, _, _, rows, _ = grade(tmp_path, *named, roster=ROSTER)
    assert rows[("Builder, Bob", "101")] == "5" and rows[("Mal, Mallory", "202")] == "1"
    flat = find_submissions(sorted((tmp_path / "sub" / "mallory").glob("*.ipynb")))
    assert sorted((s.student, s.uid, s.subid) for s in flat) == [("bob", "101", "11"),
                                                                 ("copy", None, None)]


def test_a_students_notebooks_and_a_zips_files_are_bounded(tmp_path, monkeypatch):
    """M2: past MAX_NOTEBOOKS a student's notebooks are listed once, not graded; a zip of
    more than ZIP_ENTRIES files is refused (a student's upload: said so, theirs only)."""
    (tmp_path / "c" / "mallory").mkdir(parents=True)
    for i in range(MAX_NOTEBOOKS + 8):
        (tmp_path / "c" / "mallory" / f"{i:03}.ipynb").write_text(notebook(0))
    found = find_submissions([tmp_path / "c"])
    graded = [s for s in found if s.problem is None]
    assert len(graded) == MAX_NOTEBOOKS and graded[-1].path.name == f"{MAX_NOTEBOOKS - 1:03}.ipynb"
    (over,) = [s for s in found if s.problem]
    assert over.problem == (f"TooMany: more than {MAX_NOTEBOOKS} notebooks: graded the first "
                            f"{MAX_NOTEBOOKS} by name; this one and 7 more not graded")
    monkeypatch.setattr(lms, "ZIP_ENTRIES", 5)
    with zipfile.ZipFile(tmp_path / "up.zip", "w") as z:
        for i in range(6):
            z.writestr(f"{i}.ipynb", notebook(1))
    with zipfile.ZipFile(tmp_path / "d.zip", "w") as z:
        z.write(tmp_path / "up.zip", "malmallory_202_55_up.zip")
    (sub,) = find_submissions([tmp_path / "d.zip"], tmp_path / "u")
    assert sub.problem == "NotANotebook: a zip that could not be unpacked (ValueError)"
    assert not list((tmp_path / "u").rglob("*.ipynb"))
    with pytest.raises(ValueError, match="more than 5 files"):
        find_submissions([tmp_path / "up.zip"], tmp_path / "u2")


def test_a_link_at_the_top_of_a_class_folder_is_not_followed(tmp_path):
    """M3: ``evil -> /`` is listed as a link, never walked."""
    (tmp_path / "c" / "bob").mkdir(parents=True)
    (tmp_path / "c" / "bob" / "toy.ipynb").write_text(notebook(5))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret.ipynb").write_text(notebook(5))
    os.symlink(tmp_path / "elsewhere", tmp_path / "c" / "evil")
    found = find_submissions([tmp_path / "c"])
    assert [(s.student, s.path.name, s.problem) for s in found] == [
        ("bob", "toy.ipynb", None),
        ("evil", "evil", "Link: a link to a folder, not followed")]


def test_a_file_named_dot_ipynb_is_listed(tmp_path):
    """L4: a flat file named exactly ``.ipynb`` is a notebook like any other."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / ".ipynb").write_text(notebook(1))
    assert [s.path.name for s in find_submissions([tmp_path / "c"])] == [".ipynb"]


def test_a_roster_row_keeps_its_own_name_and_the_stranger_is_decorated(tmp_path):
    """L1: Bob's login is bbuilder; a folder ``bob`` is a stranger: it becomes ``bob_``, the
    row (found by the Canvas id of a download's file named ``bob``) stays ``bob``."""
    (tmp_path / "class" / "bob").mkdir(parents=True)
    (tmp_path / "class" / "bob_101_11_toy.ipynb").write_text(notebook(5))
    (tmp_path / "class" / "bob" / "toy.ipynb").write_text(notebook(0))
    roster = read_roster_text(tmp_path, "Student,ID,SIS Login ID\n\"Builder, Bob\",101,bbuilder\n")
    found, rows, notices = identify(find_submissions([tmp_path / "class"], keyed=False), roster)
    assert sorted((s.student, s.path.name) for s in found) == [
        ("bob", "bob_101_11_toy.ipynb"), ("bob_", "toy.ipynb")]
    assert list(rows) == ["bob"] and rows["bob"]["ID"] == "101"
    assert notices == ["not in the roster: bob_: no roster rows have the name 'bob'; graded "
                       "under its own name, in no row"]


def test_the_other_notebooks_of_a_lab_are_named_five_at_most():
    """L3: the note of the notebook that counts names 5 others, then how many more."""
    book = Gradebook([fake_grade_of("bob", f"{i:02}.ipynb", i % 5, None) for i in range(12)],
                     {"toy": 5})
    (note,) = [n for n in book.counted("bob", "toy").notes if n.startswith("this notebook")]
    assert note.count(".ipynb") == 5 and note.endswith(" and 6 more)")


def test_a_student_named_points_possible_is_a_student(tmp_path):
    """L5: only Canvas's own Points Possible row (no ID) is skipped."""
    roster = read_roster_text(tmp_path, "Student,ID,toy (1)\n    Points Possible,,5\n"
                                        "Points Possible,77,3\n")
    assert [r["ID"] for r in roster.rows] == ["77"] and roster.points == {"toy (1)": "5"}


def test_one_canvas_id_is_in_one_row_of_the_import(tmp_path):
    """H1: a book made without identify, where two students carry Bob's id: Bob's row has
    his score; the other is added without an id, and warned."""
    from mgpu_lab.course.classroom.lms import write_canvas_csv
    book = Gradebook([fake_grade_of("bob", "a.ipynb", 5, ("101", "11")),
                      fake_grade_of("eve", "b.ipynb", 0, ("101", "12")),
                      fake_grade_of("zed", "c.ipynb", 1)], {"toy": 5})
    strangers, warnings = write_canvas_csv(book, tmp_path / "c.csv",
                                           read_roster_text(tmp_path, ROSTER))
    with open(tmp_path / "c.csv", newline="") as f:
        rows = [r[:2] + r[5:] for r in list(csv.reader(f))[2:]]
    assert rows == [["Builder, Bob", "101", "5"], ["Mal, Mallory", "202", "1"],
                    ["eve", "", "0"], ["zed", "", "1"]]
    assert strangers == ["eve", "zed"]
    assert [w for w in warnings if "Canvas id" in w] == [
        "eve: the Canvas id 101 is another row's already: written without an id"]
