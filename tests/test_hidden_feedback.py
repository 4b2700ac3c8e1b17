"""Hidden cases stay hidden: feedback on a failed hidden check says which check failed and
what kind of mistake it was, never the case's inputs, expected values or lines."""
import json

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

from mgpu_lab.cli import main as cli
from mgpu_lab.course.grading.hidden import WITHHELD, failure, hidden_lines, shows_hidden, visible_line
from mgpu_lab.course.grading.scoring import verdict_text
from mgpu_lab.course.notebook.notebooks import make_lab
from conftest import check_cell as check, exercise_cell as exercise
from test_grader import UNSANDBOXED_IF_NEEDED, write

MUL_TEST = '''cases = [(2, 3)]
### BEGIN HIDDEN TESTS
cases += [(17, 29)]
budget = {"memory_gib": 12345}
### END HIDDEN TESTS
### PROBE
mine = [mul(a, b) for a, b in cases]
### JUDGE
assert mine[0] == 6, f"mul(2, 3) gave {mine[0]}"
### BEGIN HIDDEN TESTS
assert mine[1] > 0, "a product of positive numbers is positive"
assert mine[1] == math.prod(cases[1]), f"case {cases[1]} in {budget}: expected {math.prod(cases[1])}, got {mine[1]}"
### END HIDDEN TESTS'''
NEG_TEST = '''x = 5
### PROBE
got = neg(x)
### BEGIN HIDDEN TESTS
far = neg(123456) + 0
### END HIDDEN TESTS
### JUDGE
assert got == -5, f"neg(5) gave {got}"
### BEGIN HIDDEN TESTS
ratio = 1 / (far + 123457)
### END HIDDEN TESTS'''


def secret_lab():
    return new_notebook(metadata={"mgpu_lab": {"lab": "secret"}}, cells=[
        new_code_cell("import math", metadata={"tags": ["setup"]}),
        exercise("mul", "def mul(a, b):\n    ### BEGIN SOLUTION\n    return a * b\n    ### END SOLUTION"),
        check("mul_test", MUL_TEST),
        exercise("neg", "def neg(a):\n    ### BEGIN SOLUTION\n    return -a\n    ### END SOLUTION"),
        check("neg_test", NEG_TEST),
    ])


def test_feedback_on_failed_hidden_checks_shows_no_case_value_nor_hidden_line(tmp_path):
    lab = secret_lab()
    write(lab, tmp_path / "solutions" / "secret.ipynb")
    learners = {   # hidden check 2 (formatted), hidden check 1 (a literal); hidden judge / probe lines
        "ann": ("return a * b if a < 10 else a + b", "return -a if a < 100 else -123457"),
        "ben": ("return a * b if a < 10 else -1", "return -a if a < 100 else None"),
        "cat": ("return a * b", "return -a"),
        "dan": ("return a * b + 1", "return -a"),    # a visible check whose message shows mine
    }
    for name, (mul, neg) in learners.items():
        nb = make_lab(nbformat.from_dict(json.loads(json.dumps(lab))))
        nb.cells[1].source = f"def mul(a, b):\n    {mul}"
        nb.cells[3].source = f"def neg(a):\n    {neg}"
        write(nb, tmp_path / "class" / f"{name}.ipynb")
    out = tmp_path / "feedback"
    assert cli(["grade", str(tmp_path / "class"), "--solutions", str(tmp_path / "solutions"),
                "--timeout", "30", "--memory", "2", "--quiet", "--json", str(tmp_path / "g.json"),
                "--feedback", str(out)] + UNSANDBOXED_IF_NEEDED) == 0
    got = {nb["student"]: {e["grade_id"]: (e["score"], e["error"], e["message"])
                           for e in nb["exercises"]}
           for nb in json.loads((tmp_path / "g.json").read_text())["notebooks"]}
    assert got["ann"] == {
        "mul_test": (0, "AssertionError", "hidden check 2 of this cell failed"),
        "neg_test": (0, "ZeroDivisionError", "raised in a hidden check of this cell")}
    assert got["ben"] == {
        "mul_test": (0, "AssertionError",
                     "hidden check 1 of this cell failed: a product of positive numbers is positive"),
        "neg_test": (0, "TypeError", "raised in a hidden part of the check's probe")}
    assert got["cat"] == {"mul_test": (1, None, ""), "neg_test": (1, None, "")}
    assert got["dan"]["mul_test"] == (0, "AssertionError", f"check line 5 failed ({WITHHELD})")
    feedback = "".join(p.read_text() for p in out.rglob("*.md"))
    messages = " ".join(m for student in got.values() for _, _, m in student.values())
    assert "hidden check 2 of this cell failed" in feedback
    for secret in ("17", "29", "493", "46", "12345", "123456", "123457", "memory_gib"):
        assert secret not in messages, secret
    for secret in ("(17, 29)", "17, 29", "493", "12345", "123456", "123457", "memory_gib"):
        assert secret not in feedback, secret
    every = feedback + messages
    for line in range(2, 14):        # no line of either cell is named, but dan's visible one
        assert f"line {line}" not in every.replace("check line 5 failed", ""), line
    # the line as the learner's copy numbers it (the lab has no hidden regions): its assert
    lab_cell = make_lab(lab).cells[2].source.splitlines()
    assert visible_line(MUL_TEST, 9) == 5 and lab_cell[4].lstrip().startswith("assert")


def test_a_visible_check_keeps_its_line_and_message():
    assert hidden_lines(MUL_TEST) == {2, 3, 4, 5, 10, 11, 12, 13}
    assert failure(MUL_TEST, "AssertionError", 9, True) is None          # visible: as before
    assert verdict_text("AssertionError", "mul(2, 3) gave 5", 9) == (
        "AssertionError", "mul(2, 3) gave 5 (check line 9)")
    assert failure(MUL_TEST, "AssertionError", 11, False) == (       # raised by a helper
        "AssertionError", "hidden check 1 of this cell failed")


def test_a_visible_message_that_would_show_hidden_cases_is_withheld():
    """A visible assert keeps its formatted message unless what it formats was fed by hidden
    lines (read top to bottom): MUL_TEST's probe maps the hidden-extended cases to mine."""
    assert shows_hidden(MUL_TEST, 9)
    apart = ("cases = [(2, 3)]\n### BEGIN HIDDEN TESTS\nmore = [(17, 29)]\nc = more[0]\n"
             "### END HIDDEN TESTS\n### PROBE\nmine = [mul(a, b) for a, b in cases]\n"
             "### BEGIN HIDDEN TESTS\nhid = [mul(a, b) for a, b in more]\n### END HIDDEN TESTS\n"
             "### JUDGE\nfor c, m in zip(cases, mine):\n    assert m == math.prod(c), f'mul{c} gave {m}'\n"
             "### BEGIN HIDDEN TESTS\nfor c, m in zip(more, hid):\n    assert m == math.prod(c), 'mul'\n"
             "### END HIDDEN TESTS\nassert len(mine) == 1, f'{len(mine)} results, one per case'\n"
             "assert len(hid) == 1, f'{len(hid)} results'")
    lines = apart.splitlines()
    visible, counted, hidden = (lines.index(s) + 1 for s in (
        "    assert m == math.prod(c), f'mul{c} gave {m}'",
        "assert len(mine) == 1, f'{len(mine)} results, one per case'", "assert len(hid) == 1, f'{len(hid)} results'"))
    assert not shows_hidden(apart, visible) and not shows_hidden(apart, counted)
    assert shows_hidden(apart, hidden)
