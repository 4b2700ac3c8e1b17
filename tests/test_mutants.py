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
tampering), never by a crash of the check itself; a vacuity mutant by the case check, a
failed assertion or its own code raising, never by the check raising. The kill rate must be
100 %; the test prints it per lab, and counts in it the judge-level replay of
tests/test_cases.py (every graded cell's results emptied, and cut to their first case).

Besides the hand-written mutants, tests/mutants/generated.py makes for every exercise a
vacuity mutant (the solution with what its functions return emptied; where they return only
numbers or nothing, it says why and the replay stands for it), its first copy with a thread
that empties the probe's results once its cell has ended, and its first reference reached
under another name from a thread-pool worker. The last two take the place of the mutant
they are made from in the rounds (the copy's and the reference's own verdicts stand); the
vacuity mutants fill the slots where an exercise keeps its solution, so the rounds grow
little (121 notebooks instead of 106, when they came; 130 with the later labs' mutants).

**No kill rests on the "must not call X" guard.** The run grades against a copy of the
solutions without their ``reimplements`` metadata, so neither the static pass nor the
run-time guard calls anything forbidden: a mutant that calls the reference (directly,
from a thread, an ``exec`` of a literal, a module copy, a child Python...) must score 0
because what the reference computes is not what the exercise asks for. The guard stays,
for learners, as a courtesy message (tests/test_grader.py checks it).

The run is a child process (niced), started as soon as the session's tests are collected
(tests/conftest.py calls :func:`start_beside`): it grades beside the other tests, taking
the CPU they leave, and the tests here run last, when it is done. Under pytest-xdist
(``./run.sh test``) the workers share one run (:data:`SHARED`).

**Each lab's whole solution** scores full marks in Gradescope's default container: beside
the mutation run, each selected lab's solution is graded alone (``mgpu-lab grade --jobs 1``)
inside a memory cgroup of :data:`MEMORY_MIB` (768 MiB, no swap; every lab, lab 03's torchrun
check included) that holds the whole run: grader, judge, warm zygote,
runner, kernel and its ranks (:class:`MemoryRun`); no process may be killed for memory.
Where no cgroup can be made (not root, no bubblewrap) this is skipped, saying why, unless
``MGPU_LAB_MUTANTS_SOLUTION=1`` (the author's loop, ``mgpu-lab labs check NN``): then the
solution is still graded, without the limit.
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
from mgpu_lab.course.classroom.export import GRADESCOPE_MIB
from mgpu_lab.course.grading.sandbox import probe
from mgpu_lab.course.grading.scoring import RAISED_HIDDEN
from conftest import ROOT, SUMMARY
from mutants import KINDS, all_mutants

MUTANTS = all_mutants()
LABS = sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))
# The first test to use the mutation run waits for it (about 100 notebooks, minutes on 2
# cores), over pytest's default limit per test.
MUTATION_RUN_TIMEOUT = 1200
WITH_SOLUTION = os.environ.get("MGPU_LAB_MUTANTS_SOLUTION") == "1"
MEMORY_MIB = GRADESCOPE_MIB    # Gradescope's default container: grader, judge and kernel together
# Each notebook of the mutation run in 2 GiB (each solution fits in 768 MiB with its grader,
# above): a mutant that allocates without bound (a design searched at a real model's size) is
# stopped there, not at the default 8 GiB, twice over on a CI machine.
MUTATION_RUN_GIB = 2
BOX = probe()
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
    exercise's other mutants (a generated one in place of the mutant it is made from), then
    its untouched cell, then its generated vacuity mutant, one per round."""
    ex = list(exercises(lab))

    def mine(e, tamper):
        ms = [m for m in MUTANTS if m.lab == lab and m.exercise == e and (m.kind == "tamper") == tamper]
        instead = {m.replaces: m for m in ms if m.replaces}
        return [instead.get(m.name, m) for m in ms if not m.generated]

    def added(e):
        return [m for m in MUTANTS if m.lab == lab and m.exercise == e and m.generated and not m.replaces]

    plan = []
    for group in ({e: mine(e, True) for e in ex}, {e: mine(e, False) + [UNTOUCHED] + added(e) for e in ex}):
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


def test_every_exercise_has_its_generated_attacks():
    """tests/mutants/generated.py: a vacuity mutant (or the reason why its results cannot be
    hollowed), a rewrite thread on its first copy, and its first reference renamed in a
    thread-pool worker, each naming its mistake, each in the rounds."""
    from mutants.generated import NOT_HOLLOWED
    missing = []
    for lab in LABS:
        for ex in exercises(lab):
            mine = [m for m in MUTANTS if m.lab == lab and m.exercise == ex]
            gen = {m.kind for m in mine if m.generated}
            need = {"copy"} | ({"reference"} if any(m.kind == "reference" for m in mine) else set())
            if (lab, ex) not in NOT_HOLLOWED:
                need.add("vacuity")
            if not need <= gen:
                missing.append(f"{lab} {ex}: {sorted(need - gen)}")
            placed = {id(m) for row in rounds(lab) for m in row.values()}
            missing += [f"{lab} {ex}: {m.name} is in no round" for m in mine if m.generated and id(m) not in placed]
    assert not missing, "\n".join(missing)
    assert all(lab in LABS and ex in exercises(lab) and why for (lab, ex), why in NOT_HOLLOWED.items())


def _mine(item) -> bool:
    return getattr(getattr(item, "module", None), "__name__", None) == __name__


MEMORY_TEST = "test_each_solution_scores_full_marks_within_768_mib_for_grader_judge_and_kernel"


def _selected_labs(items):
    """``(labs, solutions)``: the labs of the selected mutation tests (``-k 00_setup``
    grades lab 00 only; all of them when the kill-rate test is selected), and of the
    selected solution tests (:data:`MEMORY_TEST`)."""
    labs, solutions = set(), set()
    for item in items:
        if not _mine(item):
            continue
        if item.originalname == "test_kill_rate_is_100_percent":
            labs.update(LABS)
        elif "lab" in getattr(getattr(item, "callspec", None), "params", {}):
            (solutions if item.originalname == MEMORY_TEST else labs).add(item.callspec.params["lab"])
    return sorted(labs), sorted(solutions)


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
    """``mgpu-lab grade --jobs 2`` over every round of the labs, in a child process, its
    files in ``folder``; each lab's solution beside it, alone (:class:`MemoryRun`)."""

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
                "--jobs", "2", "--quiet", "--memory", str(MUTATION_RUN_GIB)]
        if not BOX.available:
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


class MemoryRun:
    """Each lab's solution graded alone, one after the other, each in a memory cgroup of
    :data:`MEMORY_MIB` holding the whole ``mgpu-lab grade`` (a child process beside the
    mutation run, niced as it is); ``folder/memory/<lab>.json`` its grades and
    ``<lab>.cgroup.json`` the cgroup's OOM kills and peak. None where no cgroup can be made
    and :data:`WITH_SOLUTION` is not set."""

    def __init__(self, labs, folder: Path):
        self.folder, self.labs = folder / "memory", list(labs)
        self.limited = bool(BOX.cgroup)
        self.rc = self.folder / "rc"

    def begin(self) -> None:
        self.folder.mkdir()
        for lab in self.labs:
            answers = {nbgrader_meta(c)["grade_id"]: c.source for c in solution(lab).cells
                       if nbgrader_meta(c).get("solution")}
            nbformat.write(filled(lab, answers), self.folder / f"{lab}.ipynb")
        grade = [sys.executable, "-m", "mgpu_lab", "grade", "--solutions", str(ROOT / "solutions"),
                 "--jobs", "1", "--quiet"] + ([] if BOX.available else ["--no-sandbox"])
        subprocess.run([sys.executable, "-c", DAEMON, str(self.folder / "log"), str(self.rc),
                        str(self.folder / "pid"), str(NICE), sys.executable, "-c", MEMORY_DAEMON,
                        json.dumps([str(self.folder), self.labs, grade,
                                    {lab: MEMORY_MIB if self.limited else None
                                     for lab in self.labs}])],
                       check=True)

    def result(self, lab: str, timeout: float):
        """``(the notebook's grade, the cgroup's {"oom_kills", "peak_mib", "seconds"})``."""
        end = monotonic() + timeout
        done = self.folder / f"{lab}.cgroup.json"
        while not done.exists() and not self.rc.exists() and monotonic() < end:
            time.sleep(1)
        if not done.exists():
            log = (self.folder / "log").read_text(errors="replace") if (self.folder / "log").exists() else ""
            pytest.fail(f"{lab}'s solution was not graded: {log[-2000:]}")
        stats = json.loads(done.read_text())
        notebooks = json.loads((self.folder / f"{lab}.json").read_text())["notebooks"] \
            if (self.folder / f"{lab}.json").exists() else []
        return (notebooks[0] if notebooks else None), stats


# Grades each lab's solution in a memory cgroup of its own (argv: [folder, labs, the grade
# command, {lab: the limit in MiB or null}]); writes <lab>.json and <lab>.cgroup.json.
MEMORY_DAEMON = """import json, subprocess, sys, time
from pathlib import Path
from mgpu_lab.course.grading.sandbox import Limits, _make_cgroup, oom_file, oom_kills, probe, remove_cgroups
folder, labs, grade, limits = json.loads(sys.argv[1])
folder = Path(folder)
for lab in labs:
    prefix, cleanup, limit = [], [], limits[lab]
    if limit:
        made = _make_cgroup(probe().cgroup, Limits(memory_gib=limit / 1024, processes=4096))
        if made:
            procs, cleanup = made
            prefix = ["/bin/sh", "-c", "".join(f'echo $$ > "{p}" && ' for p in procs) + 'exec "$@"', "sh"]
    memory = next((d for d in cleanup if oom_file(d) is not None), None)
    start = time.monotonic()
    rc = subprocess.call(prefix + grade + [str(folder / f"{lab}.ipynb"), "--json", str(folder / f"{lab}.json")],
                         stdout=subprocess.DEVNULL)
    stats = {"rc": rc, "seconds": round(time.monotonic() - start, 1), "limit_mib": limit if memory else None,
             "oom_kills": oom_kills([oom_file(memory)]) if memory else None, "peak_mib": None}
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        if memory is not None and (memory / name).exists():
            stats["peak_mib"] = round(int((memory / name).read_text()) / 2**20)
    remove_cgroups(cleanup)
    (folder / f"{lab}.cgroup.json").write_text(json.dumps(stats))
"""


def stop(folder: Path) -> None:
    """End a mutation run (and its solutions' run) that is still going, and remove its folder."""
    for where in (folder, folder / "memory"):
        rc, pid = where / "rc", where / "pid"
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


def _run(selected, config) -> MutationRun:
    labs, solutions = selected
    shared = os.environ.get(SHARED)
    folder = Path(shared) if shared else Path(tempfile.mkdtemp(prefix="mgpu-lab-mutants-"))
    if not shared:
        config.add_cleanup(lambda: stop(folder))
    run = MutationRun(labs, folder)
    run.memory = MemoryRun(solutions, folder) if solutions and (BOX.cgroup or WITH_SOLUTION) else None
    try:
        (folder / "claimed").mkdir()       # atomic: of xdist's workers, one starts the run
    except FileExistsError:
        return run
    if labs:
        run.begin()
    if run.memory is not None:
        run.memory.begin()
    return run


def start_beside(config, items) -> None:
    """From tests/conftest.py, once the tests are collected: start the mutation run of the
    selected labs now, and move its tests to the end of the session."""
    mine = [item for item in items if _mine(item)]
    items[:] = [item for item in items if not _mine(item)] + mine
    selected = _selected_labs(mine)
    if any(selected) and not config.option.collectonly and "run" not in _RUN:
        _RUN["run"] = _run(selected, config)


@pytest.fixture(scope="module")
def mutation_run(request):
    """The mutation run's result (started beside the other tests, or now)."""
    if "run" not in _RUN:
        _RUN["run"] = _run(_selected_labs(request.session.items), request.config)
    return _RUN["run"].result(MUTATION_RUN_TIMEOUT)


def _check_crashed(e) -> bool:
    """Whether the check itself raised (not an assertion, not the case check, not the
    learner's code): no kill for a vacuity mutant, whose hollow results the case check or
    the learner's own code must stop."""
    return e["error"] not in ("WrongCases", "AssertionError") and (
        (e["message"] or "").startswith("raised by the check") or e["message"] == RAISED_HIDDEN)


def _verdicts(plan, graded, lab):
    """``(kills, survivors, problems)`` of one lab's rounds."""
    from mgpu_lab.course.grading.misconceptions import of_cell
    stored = {g: {x["id"] for x in of_cell(c)} for g, c in graded_cells(solution(lab)).items()}
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
                             and e["error"] in ok.get(m.kind, {e["error"]})
                             and not (m.kind == "vacuity" and _check_crashed(e)) for e in got)
                why = "; ".join(f"{e['grade_id']} {e['score']}/{e['max_score']} {e['error']}: "
                                f"{(e['message'] or '')[:120]}" for e in got)
                # a misconception the solution stores must be named in its feedback, not only scored 0
                unnamed = [e["grade_id"] for e in got if m.misconception
                           and m.name in stored.get(e["grade_id"], ()) and e.get("misconception") != m.name]
                if killed and unnamed:
                    killed, why = False, f"{why}; not named as misconception {m.name} in {unnamed}"
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
@pytest.mark.parametrize("lab", LABS)
def test_each_solution_scores_full_marks_within_768_mib_for_grader_judge_and_kernel(lab, request):
    """Gradescope's default container (768 MiB, every lab): the
    whole grading of the lab's solution (grader, judge, kernel and its ranks) in a memory
    cgroup of that size, no process killed for memory, full marks (docs/INSTRUCTORS.md has
    each lab's peak)."""
    if "run" not in _RUN:
        _RUN["run"] = _run(_selected_labs(request.session.items), request.config)
    memory = getattr(_RUN["run"], "memory", None)
    if memory is None:
        why = BOX.reason or "not root, or no memory and pids controllers"
        pytest.skip(f"no memory cgroup can be made here ({why}): the solutions are graded in "
                    f"{MEMORY_MIB} MiB where one can")
    nb, stats = memory.result(lab, MUTATION_RUN_TIMEOUT)
    assert nb is not None and not nb.get("error"), f"{lab}: not graded: {nb and nb.get('error')} {stats}"
    lost = [f"{e['grade_id']} {e['score']}/{e['max_score']} {e['error']}: {e['message'][:150]}"
            for e in nb["exercises"] if e["score"] != e["max_score"]]
    assert not lost and nb["score"] == nb["max_score"] > 0, f"{lab}: the solution lost points: {lost}"
    if memory.limited:
        assert stats["limit_mib"] == MEMORY_MIB and stats["oom_kills"] == 0, \
            f"{lab}: killed for memory in {MEMORY_MIB} MiB: {stats}"


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
    # The judge-level replay (tests/test_cases.py): every graded cell's results emptied, and
    # cut to their first case, through the judge's verdict step (about 2 s).
    from test_cases import CELLS, replay
    verdicts = [(lab, gid, what, ok, error) for lab, gid, cell in CELLS for what, ok, error in replay(gid, cell)]
    rejected = sum(ok for *_, ok, _ in verdicts)
    generated = sum(1 for row in plan.values() for m in row[1].values() if getattr(m, "generated", False))
    # Printed at the end of the session (tests/conftest.py), also from an xdist worker.
    record_property(SUMMARY, "\n".join(
        [f"mutation run: {len(plan)} notebooks graded in {seconds:.0f} s ({generated} generated mutants)", *rows,
         f"  judge-level replay: {len(CELLS)} graded cells, {rejected}/{len(verdicts)} emptied or first-case-only "
         f"answers rejected",
         f"  kill rate: {killed + rejected}/{total + len(verdicts)} = "
         f"{100.0 * (killed + rejected) / max(total + len(verdicts), 1):.1f} %"]))
    assert total and killed == total
    assert rejected == len(verdicts), [v for v in verdicts if not v[3]]
