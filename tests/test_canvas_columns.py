"""Canvas's import CSV and feedback, from a made-up gradebook (no kernel, no grading): which
column of Canvas's gradebook a lab's scores go to (by its number in the assignment's title,
or ``--assignment``), Points Possible, what a student who handed nothing in gets, and the
feedback files Canvas's "Re-Upload Submissions" takes.

What Canvas does with them is Canvas's own code (instructure/canvas-lms): the importer
(``lib/gradebook_importer.rb``) takes a column ``Title (id)`` by its id, else by its exact
title, else makes a new assignment; it never changes an existing assignment's points; a
blank cell where a score exists is a change (``posted_grade: ""``, in
``process_gradebook_upload.js``). The re-upload (``Assignment#generate_comments_from_files``)
takes a file name's first two all-digit ``_`` parts as the user id and the id of a file of
that user's submission, and ignores any other file.
"""
import csv
import re
import zipfile
from pathlib import Path

import pytest

from mgpu_lab.cli import main as cli
from mgpu_lab.course.classroom.gradebook import Gradebook
from mgpu_lab.course.classroom.lms import (Roster, canvas_columns, canvas_file, names_lab,
                                 read_roster, write_canvas_csv, write_canvas_feedback)
from mgpu_lab.course.grading.scoring import ExerciseScore, NotebookGrade

LAB6, LAB0 = "06_gradient_accumulation", "00_setup"

EXPORT = """Student,ID,SIS User ID,SIS Login ID,Section,HW2 (5010),Lab 6: Gradient accumulation (5006),Lab 0 (5000),Current Score,Assignments Current Score
    Points Possible,,,,,10,100,5,(read only),(read only)
"Doe, Jane",101,s101,jdoe,A,7,,5,,
"Smith, John",102,s102,jsmith,A,8,42,,,
"Absent, Ann",104,s104,aabsent,B,9,13,EX,,
"""


def grade(student, lab, score, maximum, path=None):
    path = path or f"{student}_{ {'doejane': 101, 'smithjohn': 102}.get(student, 1)}_9{lab[:2]}_lab.ipynb"
    ids = canvas_file(path)              # as handins decides it, for a download's flat file
    return NotebookGrade(path, Path(path).name, student, lab, canvas=ids and (ids.uid, ids.subid),
                         exercises=[ExerciseScore("ex1", score, maximum - 1, title="Your *first* `step`"),
                          ExerciseScore("ex2", 0, 1, "AssertionError", "loss <b>off</b> by 2\x1b[31m")])


@pytest.fixture
def book():
    return Gradebook([grade("doejane", LAB6, 14, 16), grade("doejane", LAB0, 4, 5),
                      grade("smithjohn", LAB6, 15, 16)],
                     {LAB6: 16.0, LAB0: 5.0})


@pytest.fixture
def roster(tmp_path):
    (tmp_path / "export.csv").write_text(EXPORT)
    return read_roster(tmp_path / "export.csv")


def table(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


@pytest.mark.parametrize("title, named", [
    ("Lab 6: Gradient accumulation (5006)", True), ("Lab 06 (1)", True), ("Lab-06", True),
    ("LAB06", True), ("Lab #6 (2)", True), ("6. Gradient accumulation (3)", True),
    ("06 gradient accumulation", True), ("06_gradient_accumulation (4)", True),
    ("HW2 (5010)", False), ("Lab 16 (7)", False), ("Lab 6.5", False), ("6.5 reading", False),
    ("Lab 60", False), ("Prelab 6", False), ("Week 6 lab", False)])
def test_a_column_names_a_lab_by_its_number_in_the_usual_ways(title, named):
    assert names_lab(title, LAB6) is named


def test_lab_6_takes_lab_06s_scores_and_the_points_possible_row_is_read(book, roster, tmp_path):
    assert roster.points["Lab 6: Gradient accumulation (5006)"] == "100"
    strangers, warnings = write_canvas_csv(book, tmp_path / "import.csv", roster)
    rows = table(tmp_path / "import.csv")
    assert rows[0][5:] == ["Lab 0 (5000)", "Lab 6: Gradient accumulation (5006)"]
    assert rows[1][5:] == ["5", "16"]
    by_id = {r[1]: r[5:] for r in rows[2:]}
    assert by_id["101"] == ["4", "14"]
    assert by_id["102"] == ["", "15"]
    # Handed nothing in: what Canvas has (a blank cell would clear Canvas's 13 and its EX).
    assert by_id["104"] == ["EX", "13"]
    assert strangers == []
    assert not any("Lab 0" in w for w in warnings)


def test_points_possible_other_than_the_labs_maximum_warns(book, roster, tmp_path):
    _, warnings = write_canvas_csv(book, tmp_path / "import.csv", roster)
    [warning] = [w for w in warnings if "Lab 6" in w]
    assert "100 points in Canvas" in warning and "out of 16" in warning
    assert "set them to 16 in Canvas" in warning


def test_two_candidate_columns_are_an_error_naming_them(book, tmp_path):
    roster = Roster(["Student", "ID", "Lab 6 (1)", "Lab 06 reflection (2)", "Lab 0 (3)"], [])
    with pytest.raises(ValueError) as err:
        write_canvas_csv(book, tmp_path / "import.csv", roster)
    assert "'Lab 6 (1)', 'Lab 06 reflection (2)'" in str(err.value)
    assert "--assignment 06=1" in str(err.value)
    assert not (tmp_path / "import.csv").exists()


def test_assignment_maps_a_lab_by_id_or_by_title(book, tmp_path):
    roster = Roster(["Student", "ID", "Lab 6 (1)", "Lab 06 reflection (2)", "HW2 (5010)"],
                    [{"Student": "Doe, Jane", "ID": "101"}])
    write_canvas_csv(book, tmp_path / "a.csv", roster, ["06=1", "0=HW2"])
    assert table(tmp_path / "a.csv")[0][5:] == ["HW2 (5010)", "Lab 6 (1)"]
    write_canvas_csv(book, tmp_path / "b.csv", roster, [f"{LAB6}=lab 06 reflection"])
    assert "Lab 06 reflection (2)" in table(tmp_path / "b.csv")[0]
    with pytest.raises(ValueError, match="no column of the roster is assignment '77'.*HW2"):
        write_canvas_csv(book, tmp_path / "c.csv", roster, ["06=77"])
    with pytest.raises(ValueError, match="give LAB=ID"):
        canvas_columns([LAB6], roster, ["06"])
    # Without a roster, an id is Canvas's "Title (id)": the importer takes it by its id.
    assert canvas_columns([LAB6], None, ["06=5006"])[0] == {LAB6: f"{LAB6} (5006)"}


def test_a_lab_no_column_names_is_left_out_and_said_so_never_a_new_assignment(tmp_path):
    book = Gradebook([grade("doejane", LAB6, 14, 16)], {LAB6: 16.0})
    roster = Roster(["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "HW2 (5010)"],
                    [{"Student": "Doe, Jane", "ID": "101"}])
    _, warnings = write_canvas_csv(book, tmp_path / "import.csv", roster)
    assert table(tmp_path / "import.csv")[0] == ["Student", "ID", "SIS User ID", "SIS Login ID",
                                                  "Section"]
    [warning] = warnings
    assert LAB6 in warning and "HW2 (5010)" in warning and "--assignment 06=" in warning
    # Without a roster the lab id is the column (a new assignment), with a warning.
    _, warnings = write_canvas_csv(book, tmp_path / "bare.csv")
    assert table(tmp_path / "bare.csv")[0][5:] == [LAB6]
    assert "new assignment" in warnings[0] and "--assignment 06=ID" in warnings[0]


def test_feedback_files_are_named_as_canvas_re_upload_reads_them(book, tmp_path):
    plain = grade("alice", LAB6, 1, 16, path="alice.ipynb")      # not from a Canvas download
    late = grade("roeeric", LAB6, 2, 16, path="roeeric_LATE_103_7007_lab.ipynb")
    book = Gradebook(book.grades + [plain, late], {LAB6: 16.0, LAB0: 5.0})
    zips, skipped = write_canvas_feedback(book, tmp_path / "canvas-fb")
    assert sorted(p.name for p in zips) == [f"{LAB0}.zip", f"{LAB6}.zip"]
    with zipfile.ZipFile(tmp_path / "canvas-fb" / f"{LAB6}.zip") as z:
        names = sorted(z.namelist())
        text = z.read("doejane_101_906_feedback.txt").decode()
    assert names == ["doejane_101_906_feedback.txt", "roeeric_103_7007_feedback.txt",
                     "smithjohn_102_906_feedback.txt"]
    for name in names:   # Canvas: the first two all-digit parts are the user and the file
        assert [p for p in name.split("_") if re.fullmatch(r"\d+", p)][:2] == \
            name.split("_")[1:3]
    assert skipped and "alice.ipynb" in skipped[0]
    # Plain text: said as it is, no markdown escapes, no terminal escapes.
    assert "Your *first* `step`  14 / 15  passed" in text
    assert "AssertionError: loss <b>off</b> by 2?[31m" in text
    assert "\\" not in text and "\x1b" not in text
    assert text.startswith(f"{LAB6}: 14 / 16\n")


def test_grade_refuses_before_grading_when_a_column_cannot_be_chosen(tmp_path, capsys):
    """The grade command checks --assignment and the roster's columns before it runs a
    notebook: no notebook is graded here (they could not be)."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "r.csv").write_text("Student,ID,Lab 0 (1),Lab 00 quiz (2)\n")
    (tmp_path / "nb.ipynb").write_text("{}")
    base = ["grade", str(tmp_path / "nb.ipynb"), "--root", str(root), "--lab", "00",
            "--roster", str(tmp_path / "r.csv"), "--no-sandbox", "--quiet"]
    assert cli(base + ["--canvas", str(tmp_path / "c.csv")]) == 2
    err = capsys.readouterr().err
    assert "'Lab 0 (1)', 'Lab 00 quiz (2)'" in err and "--assignment 00=1" in err
    assert cli(base + ["--canvas", str(tmp_path / "c.csv"), "--assignment", "07=1"]) == 2
    assert "--assignment 07=1: no such lab in this run" in capsys.readouterr().err
    assert cli(base + ["--assignment", "00=1"]) == 2
    assert "--assignment goes with --canvas" in capsys.readouterr().err
