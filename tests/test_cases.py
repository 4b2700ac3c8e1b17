"""The judge owns its cases (mgpu_lab/course/grading/cases.py): every graded cell states what
its probe must send back, the judge checks exactly that before comparing, and an answer
emptied or cut to its first case fails every graded cell (the vacuity replay). No kernel
runs here: the replay goes through the judge's own verdict step, on answers made from the
signatures."""
import base64
import io
import re

import nbformat
import pytest
import torch

from conftest import ROOT
from mgpu_lab.course.grading import cases
from mgpu_lab.course.grading.judge import CASES, judge_answer
from mgpu_lab.course.grading.protocol import Judge
from mgpu_lab.course.notebook import graded_cell
from mgpu_lab.course.notebook.cells import course_meta, graded_cells
from mgpu_lab.course.notebook.notebooks import make_lab

SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
CELLS = [(path.stem, gid, cell) for path in SOLUTIONS
         for gid, cell in graded_cells(nbformat.read(path, as_version=4)).items()]


def _b64(value) -> str:
    buf = io.BytesIO()
    torch.save(value, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _paths(sig, path):
    """Every path of a signature's tree, as the check names them."""
    yield path
    if isinstance(sig, tuple) and sig[0] == "seq":
        for i, s in enumerate(sig[1]):
            yield from _paths(s, f"{path}[{i}]")
    elif isinstance(sig, tuple) and sig[0] == "dict":
        for k, s in sig[1].items():
            yield from _paths(s, f"{path}[{k!r}]")


def test_every_graded_cell_states_the_cases_of_every_name_its_probe_sends():
    assert len(CELLS) >= 72
    for lab, gid, cell in CELLS:
        meta = course_meta(cell)
        assert meta.get("expects"), f"{lab} {gid}: no expects: run `mgpu-lab labs expects solutions/{lab}.ipynb`"
        probe = set(graded_cell.bound_names(graded_cell.split(cell.source).probe))
        assert set(meta["expects"]) <= probe, f"{lab} {gid}: expects names {set(meta['expects']) - probe}, " \
                                              "which the probe no longer binds: run `mgpu-lab labs expects`"
        paths = [p for name, text in meta["expects"].items() for p in _paths(cases.parse(text), name)]
        for pattern, why in meta.get("free", {}).items():
            assert isinstance(why, str) and why, f"{lab} {gid}: free {pattern!r} says why"
            assert any(f.match(p) for f in cases.free_patterns([pattern]) for p in paths), \
                f"{lab} {gid}: free {pattern!r} matches nothing the probe sends"


def test_labs_carry_no_expects():
    for path in SOLUTIONS:
        lab = make_lab(nbformat.read(path, as_version=4))
        assert not any({"expects", "free"} & set(course_meta(c)) for c in lab.cells), path.name


def _verdict(cell, gid, answer):
    """The judge's verdict step on ``answer`` (plain data by name), in an empty namespace."""
    parts = graded_cell.split(cell.source)
    req = Judge(gid, parts.judge, {n: _b64(v) for n, v in answer.items()}, [], cases.cases_of(cell))
    return judge_answer({}, req)


@pytest.mark.parametrize("lab, gid, cell", CELLS, ids=[f"{lab[:2]}-{gid}" for lab, gid, _ in CELLS])
def test_the_vacuity_replay_fails_every_graded_cell(lab, gid, cell):
    """The solution's results (their signatures' example: zeros of the right shapes) pass the
    case check; emptied, or cut to their first case, they fail it, before the judge part runs.
    A result the cell leaves free as a whole (a design answer) must fail at the judge part's
    first assertion (run here in an empty namespace: nothing else of the check is there)."""
    full = {name: cases.example(cases.parse(text)) for name, text in course_meta(cell)["expects"].items()}
    c = cases.cases_of(cell)
    assert cases.check_cases(c["expects"], full, c["free"], c["hidden"]) is None
    for what, rejected, error in replay(gid, cell):
        assert rejected, f"{lab} {gid}: {what} results reached the judge part ({error})"


def replay(gid, cell):
    """``[(what, rejected, the verdict's error)]``: the judge's verdicts on the solution's
    results emptied, and (where that changes them) cut to their first case. Rejected: the
    case check's verdict, or for a result the cell leaves free as a whole (a design answer)
    a failed assertion of the judge part (its first case alone may then pass). Also counted
    in the mutation run's kill rate (tests/test_mutants.py)."""
    full = {name: cases.example(cases.parse(text)) for name, text in course_meta(cell)["expects"].items()}
    whole = set(cases.cases_of(cell)["free"]) & set(full)
    reply = _verdict(cell, gid, {n: cases.emptied(v) for n, v in full.items()})
    out = [("emptied", not reply.ok and (reply.error == CASES or bool(whole) and reply.error == "AssertionError"),
            reply.error)]
    cut = {n: cases.truncated(v) for n, v in full.items()}
    if [cases.signature(v) for v in cut.values()] != [cases.signature(v) for v in full.values()]:
        reply = _verdict(cell, gid, cut)
        out.append(("cut to its first case", not reply.ok and (reply.error == CASES or whole == set(full)),
                    reply.error))
    return out


def test_the_check_names_what_differs_and_veils_hidden_cases():
    expects = {"runs": cases.render(cases.signature({2: [torch.zeros(3, 2)] * 2, 4: [1.0, "a"]}))}
    assert expects["runs"] == "{2: [float32(3, 2)] * 2, 4: [num, str]}"
    good = {"runs": {2: [torch.ones(3, 2)] * 2, 4: [torch.tensor(2.0), "b"]}}   # a 0-dim tensor is a number
    assert cases.check_cases(expects, good) is None
    asked = "does not hold the case the check asked for: "
    wrong = [({"runs": {2: [torch.ones(3, 2)] * 2}}, f"`runs` {asked}no key 4, which the solution's result has there"),
             ({"runs": {2: [torch.ones(3, 2)] * 2, 4: [1, "b"], 3: []}}, "a key '3' the solution's result does not have there"),
             ({"runs": {2: [], 4: [1, "b"]}}, f"`runs[2]` {asked}0 item(s), the check asked for 2"),
             ({"runs": {2: [torch.ones(32768, 1)] * 2, 4: [1, "b"]}},
              f"`runs[2][0]` {asked}a tensor of shape (32768, 1), the check expects (3, 2)"),
             ({"runs": {2: [torch.ones(3, 2, dtype=torch.float64)] * 2, 4: [1, "b"]}}, "dtype torch.float64"),
             ({"runs": {2: [torch.ones(3, 2)] * 2, 4: [1, None]}}, f"`runs[4][1]` {asked}None, the check expects a string"),
             ({}, "`runs` did not come back from your kernel as plain data")]
    for answer, said in wrong:
        assert said in cases.check_cases(expects, answer)
    veiled = cases.check_cases(expects, {"runs": {2: [torch.ones(3, 2)]}}, hidden=[])
    assert veiled == ("`runs` does not hold the cases the check asked for: a dict without a key the solution's "
                      "result has there (what your code returned for a case)")
    assert "hidden check's result" in cases.check_cases({"h": "[num] * 3"}, {"h": [1]}, hidden=["h"])
    assert not re.search(r"\d", cases.check_cases({"h": "[num] * 3"}, {"h": [1]}, hidden=["h"]))
    assert cases.check_cases(expects, {"runs": {2: [torch.ones(5)] * 2, 4: [1, "b"]}}, free=["runs[2][*]"]) is None
    # a hidden design's "no plan fits" (None) against a plan, either way: the judge part's own
    # words decide, not "None where the check expects a list" (which hidden cases have no plan)
    design = {"h": cases.render(cases.signature([None, [1, 2]]))}
    for answer in ([[3, 4], None], [None, None], [[0], [1, 2]]):
        assert cases.check_cases(design, {"h": answer}, hidden=["h"]) is None
        assert cases.check_cases(design, {"h": answer}, hidden=[]) is not None    # a visible one: said
    assert cases.check_cases(design, {"h": [None]}, hidden=["h"]) is not None     # the cases still counted


def test_the_judge_runs_nothing_of_an_answer_without_its_cases_and_drops_names_it_did_not_ask_for():
    source = "\n" * 3 + "assert len(runs) == 0 or runs[0] == 1, 'no'\nassert 'extra' not in dir(), 'extra'\n"
    c = {"expects": {"runs": "[num] * 2"}, "free": [], "hidden": None}
    ok = judge_answer({}, Judge("t", source, {"runs": _b64([1, 2]), "extra": _b64(3)}, [], c))
    assert ok.ok, ok
    empty = judge_answer({}, Judge("t", source, {"runs": _b64([])}, [], c))
    assert (empty.ok, empty.error) == (False, CASES) and "0 item(s), the check asked for 2" in empty.message
    unchecked = judge_answer({}, Judge("t", source, {"runs": _b64([])}, [], {}))
    assert unchecked.ok                      # the loophole the check closes: no expects, no case checked


def test_the_judge_process_checks_the_cases_the_grader_sends(tmp_path):
    """Through the judge's pipe, as the grader asks it: the cases travel with the request and
    a mismatch is the verdict, its words kept in the report."""
    from mgpu_lab.course.grading.judge import JudgeProcess, dumps
    from mgpu_lab.course.grading.scoring import verdict_text
    judge = JudgeProcess(dict(__import__("os").environ), str(tmp_path), 120)
    try:
        judge.setup(["import torch"])
        c = {"expects": {"outs": "[float32(2)] * 3"}, "free": [], "hidden": None}
        source = "assert all(torch.equal(o, torch.ones(2)) for o in outs), 'not ones'\n"
        for answer, ok in (([torch.ones(2)] * 3, True), ([], False), ([torch.ones(32768, 1)] * 3, False)):
            judge.inputs("t", "x = 1")
            reply = judge.verdict("t", source, {"outs": dumps(answer)}, [], c)
            assert reply.ok is ok and (ok or reply.error == CASES), reply
        error, message = verdict_text(reply.error, reply.message, reply.line)
        assert (error, message) == (CASES, "`outs[0]` does not hold the case the check asked for: a tensor of "
                                           "shape (32768, 1), the check expects (2,)")
    finally:
        judge.close()


def test_labs_expects_writes_what_the_solutions_probes_send_and_the_solution_then_passes(tmp_path):
    """``mgpu-lab labs expects`` on the grader's toy lab: the names its judge parts read, as the
    real grader's run of the solution sent them (hidden cases included); grading it again with
    them in place gives full marks."""
    import shutil
    from mgpu_lab.course.authoring.labs_command import write_expects
    from mgpu_lab.course.grading.grader import grade_notebook, load_solutions
    from test_grader import SANDBOX, TOY
    path = tmp_path / "toy.ipynb"
    shutil.copy(TOY, path)
    assert write_expects(path) == ["add_test", "mul_test"]
    written = {gid: course_meta(c)["expects"] for gid, c in graded_cells(nbformat.read(path, as_version=4)).items()}
    assert written == {"add_test": {"mine": "num"}, "mul_test": {"mine": "[num] * 2"}}
    grade = grade_notebook(path, load_solutions(tmp_path), box=SANDBOX)
    assert [(e.grade_id, e.score) for e in grade.exercises] == [("add_test", 2.0), ("mul_test", 3.0)], grade
