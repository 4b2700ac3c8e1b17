"""Every exercise is proven by the wrong answers it rejects (tests/mutants/).

A lab is filled with its solutions; in each *round* every exercise gets its next
mutant in place of its solution, except one exercise per round that keeps its
solution (so a round also shows that the others keep their full marks). All rounds
of all labs, and each untouched lab, are graded in one ``mgpu-lab grade --jobs 2``
run, sandboxed where bubblewrap works. A mutant is *killed* when its exercise scores
0 for a reason of its kind: a tampering attempt is reported as tampering, a
reference call as a forbidden call (or tampering, for ``getattr`` of a built name),
a wrong answer or a copy by a failed check, never by a crash of the check itself.
The kill rate must be 100 %; the test prints it per lab.
"""
import json
from pathlib import Path
from time import monotonic

import nbformat
import pytest

from mgpu_lab.cli import main as cli
from mgpu_lab.course.cells import exercise_of, graded_cells, nbgrader_meta
from mgpu_lab.course.guard import forbidden_of
from mgpu_lab.course.notebooks import make_lab
from mgpu_lab.course.sandbox import probe
from conftest import ROOT
from mutants import KINDS, all_mutants

MUTANTS = all_mutants()
LABS = sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))
# The first test to use the mutation run grades it (82 notebooks, about 5.5 min on 2 cores),
# over pytest's default limit per test.
MUTATION_RUN_TIMEOUT = 1200
NOT_A_KILL = {"JudgeError", "NotJudged", "NotRun", "GraderError", "Missing"}


def solution(lab):
    return nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)


def exercises(lab):
    """``{exercise grade_id: [its graded cells' grade_ids]}`` in notebook order."""
    out = {}
    for gid, ex in exercise_of(solution(lab)).items():
        out.setdefault(ex, []).append(gid)
    return out


def filled(lab, sources):
    """The student notebook with ``sources[exercise]`` in each exercise cell."""
    nb = make_lab(solution(lab))
    for cell in nb.cells:
        gid = nbgrader_meta(cell).get("grade_id")
        if nbgrader_meta(cell).get("solution") and gid in sources:
            cell.source = sources[gid]
    return nb


def rounds(lab):
    """``[{exercise: mutant or None}]``: round r skips exercise i when r == i mod R."""
    ex = list(exercises(lab))
    mine = {e: [m for m in MUTANTS if m.lab == lab and m.exercise == e] for e in ex}
    R = max((len(v) for v in mine.values()), default=0) + 1
    plan = []
    for r in range(R):
        row = {}
        for i, e in enumerate(ex):
            skip = i % R
            k = None if r == skip else (r if r < skip else r - 1)
            row[e] = mine[e][k] if k is not None and k < len(mine[e]) else None
        plan.append(row)
    return plan


def test_every_exercise_has_three_mutants_of_the_required_kinds():
    """>= 3 mutants per exercise: a wrong answer, a copy, a tampering attempt, and a
    reference call where the exercise re-implements something."""
    missing = []
    for lab in LABS:
        sol = solution(lab)
        tests = graded_cells(sol)
        for ex, gids in exercises(lab).items():
            kinds = [m.kind for m in MUTANTS if m.lab == lab and m.exercise == ex]
            need = {"wrong", "copy", "tamper"}
            if any(forbidden_of(tests[g]) for g in gids):
                need.add("reference")
            if len(kinds) < 3 or not need <= set(kinds):
                missing.append(f"{lab} {ex}: {sorted(kinds)} (needs {sorted(need)})")
    assert not missing, "exercises short of mutants:\n" + "\n".join(missing)
    known = {(lab, ex) for lab in LABS for ex in exercises(lab)}
    stray = [f"{m.lab} {m.exercise} {m.name}" for m in MUTANTS if (m.lab, m.exercise) not in known]
    assert not stray, f"mutants of exercises that do not exist: {stray}"
    assert all(m.kind in KINDS and m.mistake for m in MUTANTS), "every mutant names its mistake"


def _selected_labs(session):
    """The labs of the selected tests (``-k 00_setup`` grades lab 00 only); all of them
    when the kill-rate test is selected."""
    labs = set()
    for item in session.items:
        if item.module.__name__ != __name__:
            continue
        if item.originalname == "test_kill_rate_is_100_percent":
            return LABS
        if "lab" in getattr(getattr(item, "callspec", None), "params", {}):
            labs.add(item.callspec.params["lab"])
    return sorted(labs)


@pytest.fixture(scope="module")
def mutation_run(tmp_path_factory, request):
    """Grade every round of every (selected) lab, and every untouched lab, in one run."""
    klass = tmp_path_factory.mktemp("mutants") / "class"
    klass.mkdir()
    plan = {}
    for lab in _selected_labs(request.session):
        sol = solution(lab)
        answers = {nbgrader_meta(c)["grade_id"]: c.source for c in sol.cells
                   if nbgrader_meta(c).get("solution")}
        for r, row in enumerate(rounds(lab)):
            sources = dict(answers)
            for ex, m in row.items():
                if m is not None:
                    new = m.make(answers[ex])
                    assert new != answers[ex], f"{lab} {m.name} changes nothing"
                    sources[ex] = new
            name = f"{lab}--round{r}"
            nbformat.write(filled(lab, sources), klass / f"{name}.ipynb")
            plan[name] = (lab, row)
        nbformat.write(make_lab(sol), klass / f"{lab}--untouched.ipynb")
        plan[f"{lab}--untouched"] = (lab, None)
    out = klass.parent / "grades.json"
    args = ["grade", str(klass), "--solutions", str(ROOT / "solutions"), "--json", str(out),
            "--jobs", "2", "--quiet"]
    if not probe().available:
        args.append("--no-sandbox")
    start = monotonic()
    assert cli(args) == 0
    seconds = monotonic() - start
    graded = {n["student"]: n for n in json.loads(out.read_text())["notebooks"]}
    return plan, graded, seconds


def _verdicts(plan, graded, lab):
    """``(kills, survivors, problems)`` of one lab's rounds."""
    kills, survivors, problems = [], [], []
    for name, (lab_, row) in plan.items():
        if lab_ != lab:
            continue
        nb = graded[name]
        if nb.get("error"):
            problems.append(f"{name}: not graded: {nb['error']}")
            continue
        score = {e["grade_id"]: e for e in nb["exercises"]}
        for ex, gids in exercises(lab).items():
            m = None if row is None else row[ex]
            got = [score[g] for g in gids]
            if row is None:                                   # the untouched lab
                if any(e["score"] for e in got):
                    problems.append(f"{name} {ex}: an untouched exercise scored points")
            elif m is None:
                bad = [f"{e['grade_id']} {e['score']}/{e['max_score']} {e['error']}: "
                       f"{e['message'][:150]}" for e in got if e["score"] != e["max_score"]]
                if bad:
                    problems.append(f"{name} {ex}: the solution lost points beside mutants: {bad}")
            else:
                ok = {"tamper": {"Tampering"}, "reference": {"ForbiddenCall", "Tampering"}}
                killed = all(e["score"] == 0 and e["error"] and e["error"] not in NOT_A_KILL
                             and e["error"] in ok.get(m.kind, {e["error"]}) for e in got)
                why = "; ".join(f"{e['grade_id']} {e['score']}/{e['max_score']} {e['error']}: "
                                f"{(e['message'] or '')[:120]}" for e in got)
                (kills if killed else survivors).append(f"{ex} {m.kind} {m.name}: {why}")
    return kills, survivors, problems


@pytest.mark.slow
@pytest.mark.timeout(MUTATION_RUN_TIMEOUT)
@pytest.mark.parametrize("lab", LABS)
def test_each_mutant_scores_zero_on_its_exercise_and_the_others_keep_full_marks(
        mutation_run, lab):
    plan, graded, _ = mutation_run
    kills, survivors, problems = _verdicts(plan, graded, lab)
    assert not problems, "\n".join(problems)
    assert not survivors, f"{lab}: mutants that survived:\n" + "\n".join(survivors)
    assert kills, f"{lab}: no mutant was graded"


@pytest.mark.slow
@pytest.mark.timeout(MUTATION_RUN_TIMEOUT)
def test_kill_rate_is_100_percent(mutation_run, capsys):
    plan, graded, seconds = mutation_run
    rows, total, killed = [], 0, 0
    for lab in LABS:
        kills, survivors, _ = _verdicts(plan, graded, lab)
        if not kills and not survivors:
            continue
        n = len(kills) + len(survivors)
        total, killed = total + n, killed + len(kills)
        rows.append(f"  {lab:<28} {len(exercises(lab)):>2} exercises  {n:>3} mutants  "
                    f"{len(kills):>3} killed")
    with capsys.disabled():
        print(f"\nmutation run: {len(plan)} notebooks graded in {seconds:.0f} s")
        print("\n".join(rows))
        print(f"  kill rate: {killed}/{total} = {100.0 * killed / max(total, 1):.1f} %")
    assert total and killed == total
