"""Every exercise is proven by the wrong answers it rejects (tests/mutants/).

A lab is filled with its solutions; in each *round* every exercise gets its next
variant in place of its solution: one of its mutants, or its cell as the learner
receives it (which must score 0); an exercise whose variants are used up keeps its
solution (so a round also shows that the others keep their full marks). Tampering
attempts have rounds of their own (:func:`rounds`). All rounds of all labs are graded
in one ``mgpu-lab grade --jobs 2`` run (three at a time made no difference: 872 s for
the whole suite against 864 s), sandboxed where bubblewrap works.
A mutant is *killed* when its exercise scores 0 for a reason of its kind: a tampering
attempt is reported as tampering; a wrong answer, a copy or a call of the reference by a
failed check (a reference reached through ``getattr`` of a built name may be reported as
tampering), never by a crash of the check itself. The kill rate must be 100 %; the test
prints it per lab.

**No kill rests on the "must not call X" guard.** The run grades against a copy of the
solutions without their ``reimplements`` metadata, so neither the static pass nor the
run-time guard calls anything forbidden: a mutant that calls the reference (directly,
from a thread, an ``exec`` of a literal, a module copy, a child Python...) must score 0
because what the reference computes is not what the exercise asks for. The guard stays,
for learners, as a courtesy message (tests/test_grader.py checks it).

The run is a child process (niced), started as soon as the session's tests are collected
(tests/conftest.py calls :func:`start_beside`): it grades beside the other tests, taking
the CPU they leave, and the tests here run last, when it is done. Under pytest-xdist
(``./run.sh test``) the workers share one run (:data:`SHARED`). ``MGPU_LAB_MUTANTS_SOLUTION=1``
also grades each selected lab's whole solution, which must score full marks (the
author's loop, ``mgpu-lab labs check NN``, sets it).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from time import monotonic

import nbformat
import pytest

from mgpu_lab.course.notebook.cells import exercise_of, graded_cells, nbgrader_meta
from mgpu_lab.course.grading.guard import forbidden_of
from mgpu_lab.course.notebook.notebooks import make_lab
from mgpu_lab.course.grading.sandbox import probe
from conftest import ROOT, SUMMARY
from mutants import KINDS, all_mutants

MUTANTS = all_mutants()
LABS = sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))
# The first test to use the mutation run waits for it (about 100 notebooks, minutes on 2
# cores), over pytest's default limit per test.
MUTATION_RUN_TIMEOUT = 1200
WITH_SOLUTION = os.environ.get("MGPU_LAB_MUTANTS_SOLUTION") == "1"
NICE = 10
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


UNTOUCHED = "untouched"   # in a round: the exercise as the learner receives it (must score 0)


def rounds(lab):
    """``[{exercise: mutant, UNTOUCHED or None}]`` (None: its solution). First the tampering
    rounds: every exercise's tampering attempts side by side, with nothing else (a kernel
    one exercise tampered with can let another's wrong answer through a check that
    observes the kernel: docs/INSTRUCTORS.md's honour-level points). Then the other rounds: each
    exercise's other mutants, then its untouched cell, one per round."""
    ex = list(exercises(lab))

    def mine(e, tamper):
        return [m for m in MUTANTS if m.lab == lab and m.exercise == e and (m.kind == "tamper") == tamper]

    plan = []
    for group in ({e: mine(e, True) for e in ex}, {e: mine(e, False) + [UNTOUCHED] for e in ex}):
        depth = max((len(v) for v in group.values()), default=0)
        plan += [{e: group[e][r] if r < len(group[e]) else None for e in ex} for r in range(depth)]
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


def _mine(item) -> bool:
    return getattr(getattr(item, "module", None), "__name__", None) == __name__


def _selected_labs(items):
    """The labs of the selected tests (``-k 00_setup`` grades lab 00 only); all of them
    when the kill-rate test is selected."""
    labs = set()
    for item in items:
        if not _mine(item):
            continue
        if item.originalname == "test_kill_rate_is_100_percent":
            return LABS
        if "lab" in getattr(getattr(item, "callspec", None), "params", {}):
            labs.add(item.callspec.params["lab"])
    return sorted(labs)


def without_guard(folder: Path) -> Path:
    """The solutions, copied into ``folder`` without the graded cells' ``reimplements``
    lists: graded against them, nothing is a forbidden call (the guard is off)."""
    folder.mkdir()
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            cell.metadata.get("mgpu_lab", {}).pop("reimplements", None)
        nbformat.write(nb, folder / path.name)
    return folder


class MutationRun:
    """``mgpu-lab grade --jobs 2`` over every round of the labs (and each solution,
    :data:`WITH_SOLUTION`), in a child process, its files in ``folder``."""

    def __init__(self, labs, folder: Path):
        self.folder, self.plan, self.notebooks = folder, {}, {}
        for lab in labs:
            sol = solution(lab)
            answers = {nbgrader_meta(c)["grade_id"]: c.source for c in sol.cells
                       if nbgrader_meta(c).get("solution")}
            for r, row in enumerate(rounds(lab)):
                sources = dict(answers)
                for ex, m in row.items():
                    if m is UNTOUCHED:
                        del sources[ex]                       # the lab's own cell stays
                    elif m is not None:
                        new = m.make(answers[ex])
                        assert new != answers[ex], f"{lab} {m.name} changes nothing"
                        sources[ex] = new
                self.plan[f"{lab}--round{r}"] = (lab, row)
                self.notebooks[f"{lab}--round{r}"] = sources
            if WITH_SOLUTION:
                self.plan[f"{lab}--solution"] = (lab, {ex: None for ex in exercises(lab)})
                self.notebooks[f"{lab}--solution"] = answers
        self.out = folder / "grades.json"
        self.log, self.rc, self.pid = (folder / n for n in ("log", "rc", "pid"))
        self.start = monotonic()

    def begin(self) -> None:
        """Write the notebooks and start grading them."""
        klass = self.folder / "class"
        klass.mkdir()
        for name, sources in self.notebooks.items():
            nbformat.write(filled(self.plan[name][0], sources), klass / f"{name}.ipynb")
        args = [sys.executable, "-m", "mgpu_lab", "grade", str(klass), "--solutions",
                str(without_guard(self.folder / "solutions")), "--json", str(self.out),
                "--jobs", "2", "--quiet"]
        if not probe().available:
            args.append("--no-sandbox")
        # A daemon (its parent exits at once): the tests that check that they leave no
        # process behind do not see it. Niced: it takes the CPU the other tests leave
        # idle, and yields it to them (their time limits are tighter than its own).
        subprocess.run([sys.executable, "-c", DAEMON, str(self.log), str(self.rc),
                        str(self.pid), str(NICE), *args], check=True)

    def result(self, timeout: float):
        """``(plan, {student: graded notebook}, seconds)``, waiting ``timeout`` seconds at
        most for the run to end."""
        end = monotonic() + timeout
        while not self.rc.exists() and monotonic() < end:
            time.sleep(1)
        if not self.rc.exists():
            stop(self.folder)
            pytest.fail(f"the mutation run did not end in {timeout:g} s more")
        time.sleep(0.2)
        output = self.log.read_text(errors="replace")
        assert self.rc.read_text().strip() == "0", output[-3000:]
        seconds = monotonic() - self.start
        graded = {n["student"]: n for n in json.loads(self.out.read_text())["notebooks"]}
        return self.plan, graded, seconds


def stop(folder: Path) -> None:
    """End a mutation run that is still going, and remove its folder."""
    rc, pid = folder / "rc", folder / "pid"
    if not rc.exists() and pid.exists():
        try:
            os.killpg(int(pid.read_text()), 9)
        except (OSError, ValueError):
            pass
    shutil.rmtree(folder, ignore_errors=True)


DAEMON = """import os, subprocess, sys
log, rc, pid, nice = sys.argv[1:5]
if os.fork():
    os._exit(0)
os.setsid()
os.nice(int(nice))
open(pid, "w").write(str(os.getpid()))
code = subprocess.call(sys.argv[5:], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
open(rc + ".tmp", "w").write(str(code))
os.rename(rc + ".tmp", rc)
"""


_RUN = {}
# Under pytest-xdist the controller makes one folder for the run (:func:`share_with_workers`)
# and names it here; every worker collects this file, the first to claim the folder starts
# the run, and the tests here (one file, so one worker) wait for it.
SHARED = "MGPU_LAB_MUTATION_RUN"


def share_with_workers(config) -> None:
    """From tests/conftest.py, in pytest-xdist's controller: the folder the workers' one
    mutation run will use, removed (the run ended) when the session ends."""
    folder = Path(tempfile.mkdtemp(prefix="mgpu-lab-mutants-"))
    os.environ[SHARED] = str(folder)
    config.add_cleanup(lambda: stop(folder))


def _run(labs, config) -> MutationRun:
    shared = os.environ.get(SHARED)
    folder = Path(shared) if shared else Path(tempfile.mkdtemp(prefix="mgpu-lab-mutants-"))
    if not shared:
        config.add_cleanup(lambda: stop(folder))
    run = MutationRun(labs, folder)
    try:
        (folder / "claimed").mkdir()       # atomic: of xdist's workers, one starts the run
    except FileExistsError:
        return run
    run.begin()
    return run


def start_beside(config, items) -> None:
    """From tests/conftest.py, once the tests are collected: start the mutation run of the
    selected labs now, and move its tests to the end of the session."""
    mine = [item for item in items if _mine(item)]
    items[:] = [item for item in items if not _mine(item)] + mine
    labs = _selected_labs(mine)
    if labs and not config.option.collectonly and "run" not in _RUN:
        _RUN["run"] = _run(labs, config)


@pytest.fixture(scope="module")
def mutation_run(request):
    """The mutation run's result (started beside the other tests, or now)."""
    if "run" not in _RUN:
        _RUN["run"] = _run(_selected_labs(request.session.items), request.config)
    return _RUN["run"].result(MUTATION_RUN_TIMEOUT)


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
            m = row[ex]
            got = [score[g] for g in gids]
            if m is UNTOUCHED:
                if any(e["score"] for e in got):
                    problems.append(f"{name} {ex}: an untouched exercise scored points")
            elif m is None:
                bad = [f"{e['grade_id']} {e['score']}/{e['max_score']} {e['error']}: "
                       f"{e['message'][:150]}" for e in got if e["score"] != e["max_score"]]
                if bad:
                    problems.append(f"{name} {ex}: the solution lost points: {bad}")
            else:
                ok = {"tamper": {"Tampering"}}
                killed = all(e["score"] == 0 and e["error"] and e["error"] not in NOT_A_KILL
                             and e["error"] != "ForbiddenCall"
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
def test_kill_rate_is_100_percent(mutation_run, record_property):
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
    # Printed at the end of the session (tests/conftest.py), also from an xdist worker.
    record_property(SUMMARY, "\n".join(
        [f"mutation run: {len(plan)} notebooks graded in {seconds:.0f} s", *rows,
         f"  kill rate: {killed}/{total} = {100.0 * killed / max(total, 1):.1f} %"]))
    assert total and killed == total
