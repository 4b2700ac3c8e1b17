"""The autograder, as an instructor meets it: a class folder graded in one run.

toy.ipynb (tests/data/grader/solutions) has two exercises: add (2 points, must
not call operator.add) and mul (3 points, hidden tests, must not call
operator.mul or math.prod). The class below is built from it: renamed files,
a second lab-less notebook, cheats, and one notebook per failure a student can
cause. Grading it takes one CLI run (--jobs 3: most notebooks wait on a time limit); lab 00's solution and lab are
graded in another (sandboxed where bubblewrap works).
"""
import csv
import io
import json
import shutil
from pathlib import Path

import nbformat
import pytest

from mgpu_lab.cli import main as cli
from mgpu_lab.course.grading import guard
from mgpu_lab.course.grading.grader import grade_notebook, load_solutions, match_lab
from mgpu_lab.course.grading.kernel import run_notebook
from mgpu_lab.course.notebook.notebooks import make_lab
from mgpu_lab.course.classroom.report import print_details, print_summary
from mgpu_lab.course.grading.sandbox import Limits, Sandbox, probe
from mgpu_lab.course.grading.scoring import ExerciseScore, NotebookGrade, brief
from mgpu_lab.course.grading.submission import prepare_submission
from conftest import ROOT

DATA = Path(__file__).parent / "data" / "grader"
TOY = DATA / "solutions" / "toy.ipynb"
SANDBOX = probe()
# Grading refuses to run without a sandbox unless told --no-sandbox (the toy notebooks
# here are ours); where bubblewrap works, everything below runs sandboxed.
UNSANDBOXED_IF_NEEDED = [] if SANDBOX.available else ["--no-sandbox"]
ADD, MUL = "def add(a, b):\n    return a + b", "def mul(a, b):\n    return a * b"


def toy(add=ADD, mul=MUL, first="import math", lab_id=True):
    """A learner's toy notebook: the lab, with these sources in cells 1, 2 and 4."""
    nb = make_lab(nbformat.read(TOY, as_version=4))
    nb.cells[1].source, nb.cells[2].source, nb.cells[4].source = first, add, mul
    if not lab_id:
        del nb.metadata["mgpu_lab"]
    return nb


def write(nb, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def scores(nb):
    return {e["grade_id"]: (e["score"], e["error"]) for e in nb["exercises"]}


HOSTILE = '''import importlib.util, os, pathlib
pkg = pathlib.Path(importlib.util.find_spec("mgpu_lab").origin).resolve().parent  # = mgpu_lab.__file__
stolen = []
for folder in (pkg.parent / "solutions", pathlib.Path({solutions!r}), pathlib.Path({klass!r})):
    try:
        stolen += [p.read_text()[:10] for p in folder.rglob("*.ipynb")]
    except OSError:
        pass
for target in {targets!r} + [str(pkg.parent / "solutions" / "pwned.txt"), str(pkg.parent / "pwned.txt")]:
    try:
        pathlib.Path(target).write_text("pwned")
    except OSError:
        pass'''


def ring(solution: str):
    """A one-exercise lab whose test launches 2 ranks: must not call dist.all_reduce."""
    from nbformat.v4 import new_code_cell, new_notebook
    return new_notebook(metadata={"mgpu_lab": {"lab": "ring"}}, cells=[
        new_code_cell("import torch, torch.distributed as dist\nfrom mgpu_lab import launch\n"
                      "ar = dist.all_reduce"),
        new_code_cell(solution, metadata={"nbgrader": {"grade_id": "f", "solution": True}}),
        new_code_cell("### PROBE\ndef check():\n    t = torch.ones(1)\n    dist.all_reduce(t)\n"
                      "    return f(), t.item()\ngot = launch(check, nprocs=2)\n"
                      "### JUDGE\nassert got == [(2.0, 2.0)] * 2",
                      metadata={"nbgrader": {"grade_id": "f_test", "grade": True, "points": 1},
                                "mgpu_lab": {"reimplements": ["torch.distributed.all_reduce"]}})])


def build_class(tmp: Path, sandboxed: bool):
    klass = tmp / "class"
    write(ring("def f():\n    t = torch.ones(1)\n    ar(t)  # an alias made in another cell\n"
               "    return t.item()"), klass / "ringo.ipynb")
    write(toy(), klass / "alice" / "lab1.ipynb")                                  # renamed
    write(toy(mul="def mul(a, b):\n    raise NotImplementedError()", lab_id=False),
          klass / "bob" / "toy (1).ipynb")                                        # by grade ids
    write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")]),
          klass / "bob" / "notes.ipynb")                                          # no lab
    write(toy(first="import math, operator\nm = operator.mul",                    # cheats
              add="def add(a, b):\n    return operator.add(a, b)",
              mul="def mul(a, b):\n    return m(a, b)"), klass / "carol.ipynb")
    dave = toy()                                           # edited add_test, deleted mul_test
    dave.cells[3].source = "pass  # no tests"
    del dave.cells[5]
    write(dave, klass / "dave.ipynb")
    eve = toy()                                            # add_test duplicated above add
    eve.cells.insert(1, nbformat.from_dict(dict(json.loads(json.dumps(eve.cells[3])), id="dup")))
    write(eve, klass / "eve.ipynb")
    frank = toy()                                          # mul moved below its test
    frank.cells[4], frank.cells[5] = frank.cells[5], frank.cells[4]
    write(frank, klass / "frank.ipynb")
    for name, add in {
        "loop": "def add(a, b):\n    while True:\n        pass",
        "stubborn": ("def add(a, b):\n    while True:\n        try:\n            while True:\n"
                     "                pass\n        except KeyboardInterrupt:\n            pass"),
        "exit": "import sys\ndef add(a, b):\n    sys.exit(3)",
        "osexit": "import os\ndef add(a, b):\n    os._exit(1)",
        "segv": "import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGSEGV)",
    }.items():
        write(toy(add=add), klass / f"{name}.ipynb")
    write(toy(first="import time\nfrom mgpu_lab import launch",       # a launch that hangs
              add="def add(a, b):\n    return launch(time.sleep, nprocs=2, args=(600,))"),
          klass / "hang.ipynb")
    (klass / "broken.ipynb").write_text("{ not json")
    write(toy(add="def add(a, b):\n    raise ValueError(f'secret-{a}-{b} <b>x</b>')",     # leaks?
              mul="class HIDDEN_MUL_CASE(Exception):\n    pass\ndef mul(a, b):\n"
                  "    raise HIDDEN_MUL_CASE(a, b)"), klass / "leaky.ipynb")
    write(toy(add="raise ValueError('secret')\ndef add(a, b):\n    return a + b"),     # never defined
          klass / "raiser.ipynb")
    if not sandboxed:
        return klass, {}
    outside = {"home": Path.home() / "mgpu_lab_pwned.txt",
               "solutions": tmp / "course" / "solutions" / "pwned.txt",
               "root": tmp / "course" / "pwned.txt", "class": klass / "pwned.txt",
               "tmp": Path("/tmp") / f"mgpu_lab_pwned_{tmp.name}.txt"}
    hostile = HOSTILE.format(solutions=str(tmp / "course" / "solutions"), klass=str(klass),
                             targets=[str(p) for p in outside.values()])
    write(toy(first=hostile, add="def add(a, b):\n    return a + b if not stolen else -1"),
          klass / "mallory.ipynb")
    write(toy(first="import socket",
              add=("def add(a, b):\n    socket.create_connection(('1.1.1.1', 80), timeout=3)\n"
                   "    return a + b"),
              mul=("def mul(a, b):\n    server = socket.create_server(('127.0.0.1', 0))\n"
                   "    socket.create_connection(server.getsockname(), timeout=3).close()\n"
                   "    return a * b")), klass / "netcat.ipynb")
    write(toy(first="import os, time",
              add=("def add(a, b):\n    while True:\n        if os.fork() == 0:\n"
                   "            time.sleep(600)\n            os._exit(0)")), klass / "forker.ipynb")
    write(toy(add="def add(a, b):\n    hog = bytearray(64 * 2**30)\n    return a + b"),
          klass / "hog.ipynb")
    return klass, outside


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grade")
    (tmp / "course" / "solutions").mkdir(parents=True)
    shutil.copy(TOY, tmp / "course" / "solutions" / "toy.ipynb")
    write(ring("def f():\n    t = torch.ones(1)\n    out = [torch.zeros(1), torch.zeros(1)]\n"
               "    dist.all_gather(out, t)\n    return sum(out).item()"),
          tmp / "course" / "solutions" / "ring.ipynb")
    klass, outside = build_class(tmp, SANDBOX.available)
    out = tmp / "out"
    code = cli(["grade", str(klass), "--root", str(tmp / "course"), "--timeout", "10",
                "--jobs", "3", "--memory", "2", "--quiet", "--json", str(tmp / "g.json"),
                "--csv", str(tmp / "g.csv"), "--feedback", str(out)] + UNSANDBOXED_IF_NEEDED)
    report = json.loads((tmp / "g.json").read_text())
    by_name = {nb["student"]: nb for nb in report["notebooks"] if nb["lab"] or nb["error"]}
    by_name["bob/notes"] = next(nb for nb in report["notebooks"] if nb["path"].endswith("notes.ipynb"))
    by_name["bob"] = next(nb for nb in report["notebooks"] if nb["path"].endswith("toy (1).ipynb"))
    with open(tmp / "g.csv", newline="") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    return code, by_name, rows, out, outside, report


def test_exit_zero_and_every_notebook_reported(graded):
    code, by_name, _, _, _, report = graded
    assert code == 0
    assert len(report["notebooks"]) == 17 + (4 if SANDBOX.available else 0)
    assert report["sandbox"].startswith("sandbox: bubblewrap" if SANDBOX.available
                                        else "sandbox: OFF")
    import os
    left = [p for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids")
            for p in Path(root).glob(f"mgpu-lab-grade-{os.getpid()}-*")]
    assert left == [], "the sandboxes' cgroups must be removed"


def test_renamed_notebook_matched_by_lab_id(graded):
    alice = graded[1]["alice"]
    assert (alice["lab"], alice["score"], alice["max_score"]) == ("toy", 5, 5)
    assert alice["notes"] == []


def test_without_lab_id_matched_by_graded_cell_ids(graded):
    bob = graded[1]["bob"]
    assert bob["lab"] == "toy" and scores(bob) == {"add_test": (2, None),   # mul: the stub
                                                   "mul_test": (0, "NotAttempted")}
    assert "matched by its graded cell ids" in bob["notes"]


def test_notebook_of_no_lab_gets_a_line_and_the_run_goes_on(graded):
    notes = graded[1]["bob/notes"]
    assert notes["lab"] is None and notes["error"].startswith("NoLab")


def test_calling_the_reference_scores_zero_direct_or_through_an_earlier_alias(graded):
    carol = graded[1]["carol"]
    assert scores(carol) == {"add_test": (0, "ForbiddenCall"), "mul_test": (0, "ForbiddenCall")}
    messages = {e["grade_id"]: e["message"] for e in carol["exercises"]}
    assert messages == {"add_test": "this exercise must not call operator.add",   # static
                        "mul_test": "this exercise must not call operator.mul"}   # at run time


def test_the_reference_guard_reaches_ranks_forked_by_launch(graded):
    ringo = graded[1]["ringo"]
    assert ringo["lab"] == "ring" and scores(ringo) == {"f_test": (0, "ForbiddenCall")}
    assert ringo["exercises"][0]["message"] == "this exercise must not call torch.distributed.all_reduce"


def test_edited_tests_replaced_and_deleted_tests_put_back(graded):
    dave = graded[1]["dave"]
    assert scores(dave) == {"add_test": (2, None), "mul_test": (3, None)}
    assert "mul_test: graded cell deleted; put back after its exercise" in dave["notes"]


def test_duplicated_test_graded_once_reordered_cells_cost_their_exercise(graded):
    eve, frank = graded[1]["eve"], graded[1]["frank"]
    assert scores(eve) == {"add_test": (2, None), "mul_test": (3, None)}
    assert any("duplicated" in n for n in eve["notes"])
    assert scores(frank) == {"add_test": (2, None), "mul_test": (0, "NameError")}


@pytest.mark.parametrize("name, error", [
    ("loop", "Timeout"),          # while True: interrupted after --timeout
    ("stubborn", "Timeout"),      # swallows KeyboardInterrupt: kernel killed, state replayed
    ("exit", "SystemExit"),       # sys.exit() in the exercise
    ("osexit", "DeadKernel"),     # os._exit(1): kernel restarted, state replayed
    ("segv", "DeadKernel"),       # a crash by signal
    ("hang", "Timeout"),          # a launch() whose ranks never end
])
def test_a_hang_or_crash_costs_that_exercise_only(graded, name, error):
    nb = graded[1][name]
    assert scores(nb) == {"add_test": (0, error), "mul_test": (3, None)}, nb
    assert nb["seconds"] < 90


def test_unreadable_notebook_is_reported(graded):
    assert graded[1]["broken"]["error"].startswith("UnreadableNotebook")


def test_csv_one_row_per_student_a_column_per_lab_and_exercise(graded):
    rows = graded[2]
    assert rows["bob"]["toy"] == "2.0" and rows["bob"]["toy:add_test"] == "2.0"
    assert rows["bob"]["toy:mul_test"] == "0.0" and rows["bob"]["max_total"] == "6.0"  # + ring
    assert rows["alice"]["total"] == "5.0"
    columns = list(rows["alice"])
    assert columns[:3] == ["student", "total", "max_total"]
    assert columns[columns.index("toy"):][:3] == ["toy", "toy:add_test", "toy:mul_test"]
    assert rows["ringo"]["ring"] == "0.0" and rows["ringo"]["toy"] == ""


def test_feedback_per_student_and_lab_without_hidden_tests(graded):
    out = graded[3]
    text = (out / "frank" / "toy.md").read_text()
    assert "| mul | 0 / 3 | NameError\\: name 'mul' is not defined; raised in the check" in text
    every = "".join(p.read_text() for p in out.rglob("*.md"))
    assert "mul(-1, 4)" not in every and "BEGIN HIDDEN" not in every
    assert (out / "carol" / "toy.md").exists() and (out / "bob" / "toy.md").exists()


def sandboxed(test):
    reason = f"no sandbox here: {SANDBOX.reason}"
    return pytest.mark.skipif(not SANDBOX.available, reason=reason)(test)


@sandboxed
def test_sandbox_nothing_read_nothing_written_correct_score(graded):
    _, by_name, _, _, outside, _ = graded
    assert scores(by_name["mallory"]) == {"add_test": (2, None), "mul_test": (3, None)}
    assert [p for p in outside.values() if p.exists()] == []
    assert not (ROOT / "pwned.txt").exists() and not (ROOT / "solutions" / "pwned.txt").exists()


@sandboxed
def test_sandbox_loopback_only(graded):
    netcat = graded[1]["netcat"]
    assert scores(netcat) == {"add_test": (0, "OSError"), "mul_test": (3, None)}
    assert "unreachable" in netcat["exercises"][0]["message"]


@sandboxed
def test_sandbox_fork_bomb_and_memory_hog_cost_that_exercise_only(graded):
    forker = scores(graded[1]["forker"])   # forks until the sandbox's process limit (or --timeout)
    assert forker["add_test"] in [(0, "BlockingIOError"), (0, "Timeout")] and forker["mul_test"] == (3, None)
    assert scores(graded[1]["hog"]) == {"add_test": (0, "MemoryError"), "mul_test": (3, None)}


# Shared memory (a MAP_SHARED mapping) counts in the cgroup and not in RLIMIT_DATA: the
# sandbox's cgroup limit, not the per-process rlimit (a MemoryError), is what stops it.
OOM = ("import mmap\ndef add(a, b):\n    m = mmap.mmap(-1, 2**31)\n"
       "    for i in range(0, len(m), 4096):\n        m[i] = 1\n    return a + b")


@pytest.mark.skipif(not SANDBOX.cgroup, reason="no memory cgroup can be made here (not root, "
                    "no bubblewrap, or no memory and pids controllers)")
def test_a_kernel_killed_for_memory_says_out_of_memory_and_the_limit(tmp_path):
    """A cell that fills the sandbox's memory (--memory 0.5) is killed by the OOM killer:
    "OutOfMemory: out of memory (limit 512 MiB)", not "DeadKernel"; the next exercise,
    in the restarted kernel, keeps its marks."""
    write(toy(add=OOM), tmp_path / "class" / "oom.ipynb")
    assert cli(["grade", str(tmp_path / "class"), "--solutions", str(DATA / "solutions"),
                "--memory", "0.5", "--timeout", "60", "--quiet", "--json",
                str(tmp_path / "g.json")]) == 0
    nb = json.loads((tmp_path / "g.json").read_text())["notebooks"][0]
    add = next(e for e in nb["exercises"] if e["grade_id"] == "add_test")
    assert (add["score"], add["error"], add["message"]) == (
        0, "OutOfMemory", "out of memory (limit 512 MiB)"), nb["exercises"]
    assert scores(nb)["mul_test"] == (3, None)


def test_lab00_solution_full_marks_and_lab_zero_in_the_sandbox(tmp_path, capsys):
    """The real lab 00, renamed: the solution scores full marks, the untouched lab 0."""
    shutil.copy(ROOT / "solutions" / "00_setup.ipynb", tmp_path / "teacher.ipynb")
    shutil.copy(ROOT / "labs" / "00_setup.ipynb", tmp_path / "blank.ipynb")
    assert cli(["grade", str(tmp_path), "--root", str(ROOT), "--jobs", "2", "--quiet",
                "--json", str(tmp_path / "g.json")] + UNSANDBOXED_IF_NEEDED) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("sandbox: bubblewrap" if SANDBOX.available else "sandbox: OFF")
    grades = {nb["student"]: nb for nb in json.loads((tmp_path / "g.json").read_text())["notebooks"]}
    solution, lab = grades["teacher"], grades["blank"]
    assert solution["lab"] == lab["lab"] == "00_setup" and solution["max_score"] > 0
    assert solution["score"] == solution["max_score"], solution["exercises"]
    assert [e["grade_id"] for e in lab["exercises"]] == [e["grade_id"] for e in solution["exercises"]]
    assert all(e["score"] == 0 and e["error"] for e in lab["exercises"]), lab["exercises"]


def test_without_a_sandbox_grading_refuses_unless_told_no_sandbox(monkeypatch, capsys):
    """Sandboxed by default: no bubblewrap is an error that says how to install it and why."""
    import mgpu_lab.course.classroom.grade as classroom
    monkeypatch.setattr(classroom, "probe", lambda hidden=(): Sandbox(False, "bwrap not found"))
    assert cli(["grade", str(TOY), "--solutions", str(DATA / "solutions")]) == 2
    out = capsys.readouterr()
    assert out.out.splitlines()[0].startswith("sandbox: OFF (bwrap not found)")
    assert "apt-get install bubblewrap" in out.err and "--no-sandbox" in out.err
    assert "your permissions" in out.err


def test_no_sandbox_grades_and_says_so(monkeypatch, capsys, tmp_path):
    assert cli(["grade", str(TOY), "--solutions", str(DATA / "solutions"), "--no-sandbox",
                "--quiet", "--json", str(tmp_path / "g.json")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == \
        "sandbox: OFF (--no-sandbox); submissions run with your permissions"
    report = json.loads((tmp_path / "g.json").read_text())
    assert report["sandbox"].startswith("sandbox: OFF")
    assert report["notebooks"][0]["sandboxed"] is False and report["notebooks"][0]["score"] == 5


def test_a_probe_already_scored_zero_is_neither_run_nor_judged(tmp_path, monkeypatch):
    """An exercise the static pass has scored 0 (here: tampering) is settled: its probe,
    which would loop until the cell's time limit, is not run, and its judge is not
    asked; the next exercise is graded as usual."""
    import mgpu_lab.course.grading.session as session
    judged = []

    class Recording(session.JudgeProcess):
        def verdict(self, grade_id, *args, **kwargs):
            judged.append(grade_id)
            return super().verdict(grade_id, *args, **kwargs)

    monkeypatch.setattr(session, "JudgeProcess", Recording)
    write(toy(add="math.pi = 3.0\ndef add(a, b):\n    while True:\n        pass"),
          tmp_path / "sneaky.ipynb")
    box = SANDBOX if SANDBOX.available else Sandbox(False, "no bubblewrap here")
    grade = grade_notebook(tmp_path / "sneaky.ipynb", load_solutions(DATA / "solutions"),
                           box=box, timeout=120)
    assert {e.grade_id: (e.score, e.error) for e in grade.exercises} == {
        "add_test": (0.0, "Tampering"), "mul_test": (3.0, None)}
    assert judged == ["mul_test"]
    assert grade.seconds < 120, "the looping probe ran to its time limit"


def test_a_notebook_whose_every_check_is_settled_statically_starts_no_kernel(monkeypatch, tmp_path):
    """Tampering in every exercise: each scores 0 as tampering, and no kernel is started
    for a notebook with nothing left to run."""
    from mgpu_lab.course.grading import grader

    def no_run(*args, **kwargs):
        raise AssertionError("a kernel was started")

    monkeypatch.setattr(grader, "run_prepared", no_run)
    write(toy(add="math.pi = 3.0\ndef add(a, b):\n    return a + b",
              mul="math.e = 2.0\ndef mul(a, b):\n    return a * b"), tmp_path / "all.ipynb")
    grade = grade_notebook(tmp_path / "all.ipynb", load_solutions(DATA / "solutions"),
                           box=Sandbox(False, "test"))
    assert grade.error is None
    assert {e.grade_id: (e.score, e.error) for e in grade.exercises} == {
        "add_test": (0.0, "Tampering"), "mul_test": (0.0, "Tampering")}


# --- the pieces, without kernels -----------------------------------------------

@pytest.mark.parametrize("evidence, want", [
    (dict(), ("NotJudged", 0.0)),
    (dict(judged=True), (None, 4.0)),
    (dict(judged=True, verdict="AssertionError", verdict_message="off by one"),
     ("AssertionError", 0.0)),
    (dict(error="NotImplementedError", judged=True), ("NotImplementedError", 0.0)),
    (dict(calls=["operator.add"], error="ValueError", judged=True), ("ForbiddenCall", 0.0)),
    (dict(tampering=["cell 2: line 1: replaces torch.equal"], calls=["operator.add"],
          error="ValueError", judged=True), ("Tampering", 0.0)),
    (dict(missing=True, tampering=["x"], calls=["y"]), ("Missing", 0.0)),
])
def test_scoring_precedence_tampering_then_forbidden_call_then_error_then_verdict(evidence, want):
    """The table, without kernels: the first source of evidence that objects decides."""
    from mgpu_lab.course.grading.scoring import PRECEDENCE, Evidence, score
    assert PRECEDENCE == ("Tampering", "ForbiddenCall", "kernel error", "verdict")
    got = score("t", 4, Evidence(**evidence))
    assert (got.error, got.score, got.max_score) == (*want, 4.0)
    if got.error == "ForbiddenCall":
        assert got.message == "this exercise must not call operator.add"
    if got.error == "AssertionError":
        assert got.message == "off by one"


def test_match_by_lab_id_then_grade_ids_never_file_name():
    labs = load_solutions(DATA / "solutions")
    assert match_lab(toy(), labs) == ("toy", "lab id")
    assert match_lab(toy(lab_id=False), labs) == ("toy", "graded cell ids")
    other = toy()
    other.metadata["mgpu_lab"]["lab"] = "99_nope"
    assert match_lab(other, labs) == ("toy", "graded cell ids")
    lost = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    assert match_lab(lost, labs)[0] is None


def test_prepare_submission_uses_the_instructors_cells_without_their_source():
    instructor = nbformat.read(TOY, as_version=4)
    student = toy()
    student.cells[3].source = "pass"
    del student.cells[5]
    prepared = prepare_submission(student, instructor)
    assert prepared.missing == [] and sorted(prepared.graded.values()) == ["add_test", "mul_test"]
    text = nbformat.writes(prepared.nb)
    assert "mul(-1, 4)" not in text and "assert add" not in text   # sources come one at a time
    assert student.cells[3].source == "pass"                       # the input is not modified
    gone = toy()
    del gone.cells[4:6]                                            # exercise and test deleted
    assert prepare_submission(gone, instructor).missing == ["mul_test"]


def test_static_check_resolves_import_aliases_and_tensor_methods():
    from mgpu_lab.course.notebook.cells import import_aliases, parse
    aliases = import_aliases([parse("import torch.distributed as d\nfrom mgpu_lab import scatter as sc")])
    src = "def f(x):\n    sc(x)\n    x.chunk(2)\n    d.all_reduce(x)\n    torch.nn.parallel.scatter_gather.scatter"
    forbidden = ["mgpu_lab.scatter", "torch.Tensor.chunk", "torch.distributed.all_reduce",
                 "torch.nn.parallel.scatter"]
    assert guard.static_violations(src, forbidden, dict(aliases, torch="torch")) == sorted(forbidden)
    assert guard.static_violations("def f(x):\n    return x[:2]", forbidden, aliases) == []
    # A cell that starts with IPython syntax is still read (the kernel runs it as Python).
    magic = "%matplotlib inline\nfrom mgpu_lab import scatter as s2\ndef f(x):\n    return s2(x)"
    assert import_aliases([parse(magic)]) == {"s2": "mgpu_lab.scatter"}
    assert guard.static_violations(magic, forbidden, {}) == ["mgpu_lab.scatter"]


def test_runtime_guard_catches_aliases_in_globals_and_closures():
    import linecache
    import statistics
    ns = {"statistics": statistics}

    def cell(src, name):
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        exec(compile(src, name, "exec"), ns)

    cell("f = statistics.median\ndef mine(xs):\n    return f(xs)\n"
         "def make():\n    g = statistics.median\n    return lambda xs: g(xs)\nhidden = make()",
         "<student>")
    test = "assert statistics.median([1, 2, 3]) == 2"
    assert guard.install(["statistics.median"], [test], ns,
                         extra_cells=["<student>", "<test>"]) == ["statistics.median"]
    try:
        cell(test, "<test>")                                   # the instructor may call it
        for call in ("mine([1])", "hidden([1])"):              # the learner may not
            with pytest.raises(guard.ForbiddenCall, match="must not call statistics.median"):
                cell(call, "<student>")
    finally:
        assert guard.uninstall() == ["statistics.median"]
    cell("assert mine([1, 2, 3]) == 2 and hidden([5]) == 5", "<student>")  # restored


def test_runtime_guard_catches_the_reference_handed_to_a_thread_as_its_work():
    """A worker thread has no frame of the cell that sent it the reference itself
    (pool.submit(ref, ...), Thread(target=ref), a partial): still a call of the learner's."""
    import concurrent.futures
    import functools
    import linecache
    import statistics
    ns = {"statistics": statistics, "cf": concurrent.futures, "functools": functools}

    def cell(src, name):
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        exec(compile(src, name, "exec"), ns)

    guard.install(["statistics.median"], [], ns, extra_cells=["<student>"])
    try:
        for call in ("cf.ThreadPoolExecutor(1).submit(getattr(statistics, 'med' + 'ian'), [1]).result()",
                     "cf.ThreadPoolExecutor(1).submit(functools.partial(statistics.median, [1])).result()",
                     # attack47: passed on through torch's code, no frame of the cell or of a library
                     "import torch.utils._pytree as pt\n"
                     "cf.ThreadPoolExecutor(1).submit(pt.tree_map, statistics.median, [[1]]).result()"):
            with pytest.raises(guard.ForbiddenCall, match="must not call statistics.median"):
                cell(call, "<student>")
        import threading
        done = []
        worker = threading.Thread(target=lambda: done.append(statistics.median([1, 3])))
        worker.start(), worker.join()           # a library's own thread, its own code: allowed
        assert done == [2]
    finally:
        guard.uninstall()


FROM_SCRATCH = {  # lab -> graded cells of from-scratch exercises (labs 00-04)
    "00_setup": ["rank_slice_test"],
    "01_data_parallel": ["my_scatter_test", "my_replicate_test", "my_parallel_apply_test",
                         "my_data_parallel_test"],
    "02_balanced_criterion": ["parallel_forward_test", "parallel_criterion_test"],
    "03_ddp_and_launching": ["ex1_shard_indices_test", "ex4_sync_batch_stats_test"],
    "04_ring_allreduce_and_ddp": ["ex1_bytes_test", "ex2_ring_test", "ex3_naive_sync_test",
                                  "ex4_buckets_test", "ex5_bucketed_test"],
}


@pytest.mark.parametrize("lab", sorted(FROM_SCRATCH))
def test_a_cheat_calling_the_reference_scores_zero_in_every_from_scratch_exercise(lab):
    """Each from-scratch exercise names its references; a solution calling one is caught,
    the instructor's solution is not."""
    from mgpu_lab.course.notebook.cells import exercise_of, graded_cells
    from mgpu_lab.course.grading.guard import forbidden_of, notebook_violations as static_check
    from mgpu_lab.course.notebook.notebooks import BEGIN_SOLUTION, END_SOLUTION
    solution = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    assert static_check(solution, solution) == {}
    tests, exercise = graded_cells(solution), exercise_of(solution)
    for gid in FROM_SCRATCH[lab]:
        names = forbidden_of(tests[gid])
        assert names, f"{lab} {gid}: no metadata mgpu_lab.reimplements"
        for name in names:
            cheat = nbformat.from_dict(json.loads(json.dumps(solution)))
            cell = next(c for c in cheat.cells
                        if c.metadata.get("nbgrader", {}).get("grade_id") == exercise[gid])
            head, rest = cell.source.split(BEGIN_SOLUTION, 1)
            indent = head[head.rfind("\n") + 1:]
            call = (f"x.{name.rsplit('.', 1)[1]}(2)" if name.startswith("torch.Tensor.")
                    else f"{name}()")
            cell.source = head + f"return {call}\n" + indent + rest.split(END_SOLUTION, 1)[1]
            assert name in static_check(cheat, solution).get(gid, []), (lab, gid, cell.source)


def test_report_names_the_cause_inside_a_launch_error_and_totals():
    launch_error = ("rank 1 failed (then rank(s) [0] failed too):\nTraceback (most recent call last):\n"
                    "  File \"launch.py\", line 249, in _worker\n    value = fn(*args)\nNotImplementedError\n")
    assert brief(launch_error) == "rank 1 failed (then rank(s) [0] failed too): ... NotImplementedError"
    assert brief("x" * 300).endswith("...") and len(brief("x" * 300)) == 200
    grades = [NotebookGrade("a/00.ipynb", "00.ipynb", "a", "00", [ExerciseScore(
                  "t", 0.0, 2.0, "LaunchError", brief(launch_error))]),
              NotebookGrade("a/01.ipynb", "01.ipynb", "a", "01", [ExerciseScore("u", 3.0, 3.0)])]
    out = io.StringIO()
    print_details(grades, file=out)
    assert "LaunchError: rank 1 failed" in out.getvalue()
    out = io.StringIO()
    print_summary(grades, "sandbox: OFF (test)", file=out)
    assert out.getvalue().splitlines()[1].split() == ["a", "0/2", "3/3", "3/5"]
    assert "class: 3/5 over 1 students, 2 notebook(s) counted of 2" in out.getvalue()


def test_total_timeout_bounds_the_notebook():
    labs = load_solutions(DATA / "solutions")
    grade = grade_notebook(DATA / "submissions" / "loop" / "toy.ipynb", labs, "loop",
                           Sandbox(False, "test"), Limits(), timeout=60, total_timeout=3)
    assert [(e.grade_id, e.score, e.error) for e in grade.exercises] == [
        ("add_test", 0, "Timeout"), ("mul_test", 0, "TotalTimeout")]
    assert grade.seconds < 40


def test_kernel_runner_reports_every_code_cell_and_stores_outputs(tmp_path):
    """mgpu_lab.course.grading.kernel.run_notebook, shared by grade, labs execute and tour."""
    nb = nbformat.read(TOY, as_version=4)
    nb.cells[1].source = "import os\nprint(os.getcwd())"
    nb.cells[4].source = "raise ValueError('expected')"
    nb.cells[4].metadata["tags"] = ["raises-exception"]
    results = run_notebook(nb, cwd=tmp_path, timeout=30, progress=False)
    assert [r.index for r in results] == [1, 2, 3, 4, 5]
    assert [(r.error, r.expected_error) for r in results] == [
        (None, False), (None, False), (None, False), ("ValueError", True), ("NameError", False)]
    assert nb.cells[1].outputs[0]["text"].strip() == str(tmp_path)   # cwd = the folder given
    assert nb.cells[3].outputs[0]["text"] == "add passed\n"


def test_a_checks_own_time_limit_lowers_the_graders_and_never_raises_it(tmp_path):
    """``metadata.mgpu_lab.timeout`` on a cell: that many seconds for it, not ``--timeout``'s."""
    cells = [nbformat.v4.new_code_cell("import time\ntime.sleep(30)", metadata={"mgpu_lab": {"timeout": 2}}),
             nbformat.v4.new_code_cell("time.sleep(3)", metadata={"mgpu_lab": {"timeout": 600}}),
             nbformat.v4.new_code_cell("x = 1", metadata={"mgpu_lab": {"timeout": "soon"}})]
    results = run_notebook(nbformat.v4.new_notebook(cells=cells), cwd=tmp_path, timeout=2.5, progress=False)
    assert [r.error for r in results] == ["Timeout", "Timeout", None]
    assert results[0].seconds < 10


@pytest.mark.parametrize("args", [
    ["grade", "no/such/notebook.ipynb", "--solutions", str(DATA / "solutions")],
    ["grade", str(DATA / "submissions" / "full"), "--timeout", "0"],
    ["grade", str(DATA / "submissions" / "full"), "--solutions", "no/such/dir"],
    ["grade", str(DATA / "submissions" / "full"), "--jobs", "0"],
])
def test_bad_usage_exits_2(args, capsys):
    assert cli(args) == 2
    assert "mgpu-lab grade:" in capsys.readouterr().err


def test_h3_a_learners_exception_is_reported_by_type_and_line_never_its_message(graded):
    """H3: an exception raised in the learner's code carries no text of the learner's into
    the report: its type (a class of the learner's own is "Exception") and the learner's
    line; the feedback neither."""
    leaky = graded[1]["leaky"]
    assert scores(leaky) == {"add_test": (0, "ValueError"), "mul_test": (0, "Exception")}
    messages = {e["grade_id"]: e["message"] for e in leaky["exercises"]}
    assert messages["add_test"] == "raised at line 2 of cell 2 (your code)"
    assert messages["mul_test"] == "raised at line 4 of cell 4 (your code)"
    text = (graded[3] / "leaky" / "toy.md").read_text()
    assert "secret" not in text and "HIDDEN" not in text and "<b>" not in text


def test_an_exercise_cell_that_raised_is_named_not_the_probes_error(graded):
    """The learner's exercise cell raised before defining ``add``: the report names that
    cell's error (type, cell, line), not the check's NameError that follows from it; the
    other exercise is scored as usual."""
    raiser = graded[1]["raiser"]
    assert scores(raiser) == {"add_test": (0, "ValueError"), "mul_test": (3, None)}
    message = next(e["message"] for e in raiser["exercises"] if e["grade_id"] == "add_test")
    assert "your exercise cell raised it" in message and "line 1 of cell 2" in message
    assert "secret" not in message


def test_find_submissions_layouts(tmp_path):
    from mgpu_lab.course.classroom.grade import find_submissions
    for path in ("course/submitted/ann/ps1/lab.ipynb", "course/submitted/ben/ps1/x/y.ipynb",
                 "course/submitted/ben/.ipynb_checkpoints/y-checkpoint.ipynb",
                 "flat/cy.ipynb", "flat/dee/01 (1).ipynb"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("{}")
    found = find_submissions([tmp_path / "course/submitted", tmp_path / "flat"])
    assert [(s, p.name) for s, p, *_ in found] == [("ann", "lab.ipynb"), ("ben", "y.ipynb"),
                                               ("cy", "cy.ipynb"), ("dee", "01 (1).ipynb")]
    with pytest.raises(FileNotFoundError):
        find_submissions([tmp_path / "nope"])


def test_a_package_under_tmp_is_bound_over_the_private_tmp(tmp_path):
    """A checkout cloned under /tmp (as CI may do) keeps its Python visible in the sandbox:
    the private /tmp and /dev/shm are mounted first, the read-only binds over them."""
    from mgpu_lab.course.grading import sandbox
    package = tmp_path / "clone" / "mgpu_lab"
    package.mkdir(parents=True)
    argv, _ = sandbox.command(Sandbox(True, bwrap="bwrap"), ["python"], Limits(), package, {})
    pairs = [(argv[i], argv[i + 1]) for i in range(len(argv) - 1)]
    assert pairs.index(("--tmpfs", "/tmp")) < pairs.index(("--ro-bind", str(package)))
    assert pairs.index(("--dev", "/dev")) < pairs.index(("--tmpfs", "/dev/shm"))



# --- the harms of issue 29 (each test failed before its fix) ------------------------

def _toy_instructor(**metadata):
    inst = nbformat.read(TOY, as_version=4)
    inst.cells[3].metadata["mgpu_lab"] = metadata           # add_test
    return inst


def test_h1_the_static_pass_never_imports_a_module_a_submission_names(tmp_path, monkeypatch):
    """A name in a never-run branch, under a forbidden reference's package, named a module
    that exits on import: the static pass imported it and the whole class's run ended."""
    import sys
    from mgpu_lab.course.grading.grader import static_pass
    package = tmp_path / "evil_pkg_c28"
    package.mkdir()
    (package / "__init__.py").write_text("def f(a, b):\n    return a + b\n")
    (package / "boom.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n"
                                     "raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    inst = _toy_instructor(reimplements=["evil_pkg_c28.f"])
    bomb = toy(first="import evil_pkg_c28",
               add="def add(a, b):\n    if False:\n        evil_pkg_c28.boom.x()\n    return a + b")
    assert static_pass(bomb, inst) == ([], {})
    assert not (tmp_path / "ran").exists() and "evil_pkg_c28.boom" not in sys.modules
    cheat = toy(first="import evil_pkg_c28 as e", add="def add(a, b):\n    return e.f(a, b)")
    assert static_pass(cheat, inst)[1] == {"add_test": ["evil_pkg_c28.f"]}


@pytest.mark.parametrize("failure", [SystemExit(3), KeyboardInterrupt(), RuntimeError("bug")],
                         ids=["SystemExit", "KeyboardInterrupt", "grader exception"])
def test_h1_one_notebooks_failure_of_any_kind_costs_that_notebook_only(tmp_path, monkeypatch,
                                                                       failure):
    """The table, CSV, JSON and feedback of everyone else are written."""
    import mgpu_lab.course.classroom.grade as classroom

    def fake(path, labs, student, *args, **kwargs):
        if student == "bad":
            raise failure
        return NotebookGrade(str(path), Path(path).name, student, "toy",
                             [ExerciseScore("add_test", 2.0, 2.0)])
    monkeypatch.setattr(classroom, "grade_notebook", fake)
    for student in ("ann", "bad", "cy"):
        write(toy(), tmp_path / "class" / student / "lab.ipynb")
    out = tmp_path / "out"
    code = cli(["grade", str(tmp_path / "class"), "--solutions", str(DATA / "solutions"),
                "--no-sandbox", "--quiet", "--json", str(tmp_path / "g.json"),
                "--csv", str(tmp_path / "g.csv"), "--feedback", str(out)])
    assert code == 1                                   # the grader failed on one notebook
    report = {nb["student"]: nb for nb in json.loads((tmp_path / "g.json").read_text())["notebooks"]}
    assert report["bad"]["error"].startswith(f"GraderError: {type(failure).__name__}")
    assert report["ann"]["score"] == report["cy"]["score"] == 2
    with open(tmp_path / "g.csv", newline="") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    assert rows["ann"]["total"] == rows["cy"]["total"] == "2.0"
    assert (out / "ann" / "toy.md").exists() and (out / "cy" / "toy.md").exists()


def test_h6_the_static_pass_is_linear_a_chain_4x_longer_costs_under_10x():
    """A chain of helpers, each calling the next, the last an alias of the reference,
    defined in the order that made the old fixed point quadratic (N = 300: 32 s). The cost
    is compared between two lengths in one process (linear: 4x, quadratic: 16x), not
    against a clock, which a loaded machine stretches (5000 aliases: 0.76 s idle, 1.04 s
    beside the suite); each length's best of three runs."""
    import gc
    import time
    from mgpu_lab.course.notebook.cells import parse
    from mgpu_lab.course.grading.grader import static_pass
    solution = nbformat.read(TOY, as_version=4)

    def cpu_for(n):
        chain = ("import operator\n" + "".join(f"def a{i}(x, y):\n    return a{i + 1}(x, y)\n"
                                                for i in range(n)) + f"a{n} = operator.add\n")
        nb = toy(first=chain, add="def add(a, b):\n    return a0(a, b)")
        parse(chain)                                   # Python's own parser: not ours to time
        best = float("inf")
        for _ in range(3):
            gc.collect()
            gc.disable()                               # a collection lands in one run or another
            try:
                cpu = time.process_time()
                tampered, static = static_pass(nb, solution)
                best = min(best, time.process_time() - cpu)
            finally:
                gc.enable()
            assert static == {"add_test": ["operator.add"]}   # found through all n
        return best

    short, long = cpu_for(1000), cpu_for(4000)
    assert long < 10 * short, f"{long:.2f} s of CPU for 4000 aliases, {short:.2f} s for 1000"


def test_h1_a_submission_the_static_pass_cannot_read_costs_that_notebook_only(tmp_path,
                                                                             monkeypatch):
    """Its own time limit (and a bound on a cell's size): the notebook scores 0 on every
    exercise, "Unanalysable", without running; nothing else is affected."""
    import mgpu_lab.course.grading.grader as grader
    labs = load_solutions(DATA / "solutions")
    write(toy(add="x = 1\n" * 200_000 + "def add(a, b):\n    return a + b"), tmp_path / "big.ipynb")
    grade = grade_notebook(tmp_path / "big.ipynb", labs, box=Sandbox(False, "test"))
    assert grade.error.startswith("Unanalysable") and grade.max_score == 5
    assert [(e.score, e.error) for e in grade.exercises] == [(0.0, "Unanalysable")] * 2
    monkeypatch.setattr(grader, "STATIC_TIMEOUT", 0.0)
    write(toy(), tmp_path / "slow.ipynb")
    grade = grade_notebook(tmp_path / "slow.ipynb", labs, box=Sandbox(False, "test"))
    assert grade.error == "Unanalysable: the static pass ran past 0 s" and grade.seconds < 30


def test_h2_csv_escapes_formulas_and_feedback_escapes_markdown_and_html(tmp_path):
    from mgpu_lab.course.classroom.report import write_csv, write_feedback
    evil = '=HYPERLINK("http://evil.example/?q=1","click")'
    message = "<img src=x onerror=alert(1)> [click](http://evil.example) | *bold* www.evil.example"
    grades = [NotebookGrade("c/a.ipynb", "a.ipynb", evil, "toy",
                            [ExerciseScore("add_test", 0.0, 2.0, "AssertionError", message)],
                            notes=["@SUM(A1:A9)"]),
              NotebookGrade("c/b.ipynb", "b.ipynb", "-2+3", "toy", [ExerciseScore("add_test", 2.0, 2.0)])]
    write_csv(grades, tmp_path / "g.csv")
    with open(tmp_path / "g.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert sorted(r[0] for r in rows[1:]) == sorted(["'" + evil, "'-2+3"])
    assert not [c for r in rows for c in r if c.startswith(("=", "+", "-", "@", "\t", "\r"))]
    write_feedback(grades, tmp_path / "fb")
    text = "".join(p.read_text() for p in (tmp_path / "fb").rglob("*.md"))
    for raw in ("<img", "](", "*bold*", "| *", "www.evil", "http://"):
        assert raw not in text, raw
    assert "&lt;img" in text and "\\[click\\]\\(" in text


def test_h5_a_symlink_out_of_the_submission_folder_is_refused_unread(tmp_path):
    """A symbolic link to the instructor's solution scored full marks: a submission is read
    only where its folder really is."""
    klass = tmp_path / "class"
    (klass / "alice").mkdir(parents=True)
    (klass / "alice" / "lab.ipynb").symlink_to(TOY)                     # a file elsewhere
    (klass / "bob").symlink_to(DATA / "solutions", target_is_directory=True)   # a folder
    (klass / "cy.ipynb").symlink_to(TOY)                                # a flat one
    write(toy(), klass / "dee" / "lab.ipynb")
    (klass / "dee" / "again.ipynb").symlink_to(klass / "dee" / "lab.ipynb")   # inside: fine
    assert cli(["grade", str(klass), "--solutions", str(DATA / "solutions"), "--no-sandbox",
                "--quiet", "--json", str(tmp_path / "g.json")]) == 0
    report = {Path(nb["path"]).relative_to(klass).as_posix(): nb
              for nb in json.loads((tmp_path / "g.json").read_text())["notebooks"]}
    for name in ("alice/lab.ipynb", "cy.ipynb"):
        assert report[name]["error"] == "Refused: a symbolic link out of the submission folder"
        assert report[name]["score"] == 0
    assert not any(name.startswith("bob/") for name in report)   # a linked folder is not walked
    assert report["bob"]["error"].startswith("Link: ") and report["bob"]["score"] == 0
    assert report["dee/lab.ipynb"]["score"] == report["dee/again.ipynb"]["score"] == 5


def test_h3_what_a_report_may_say_about_a_kernel_error_without_kernels():
    from mgpu_lab.course.grading.scoring import kernel_error, verdict_text
    cells, graded = {2: (2, 3)}, (4, 6)
    assert kernel_error("ValueError", "secret 3 4", [(4, 1), (2, 3)], cells, graded, {"add"}) == (
        "ValueError", "raised at line 3 of cell 2 (your code)")
    # called from a hidden probe line: the learner's line would tell which branch a hidden case took
    assert kernel_error("ValueError", "x", [(4, 1), (2, 3)], cells, graded, set(), hidden={1}) == (
        "ValueError", "raised in cell 2 (your code), on a hidden case of the check")
    assert kernel_error("NameError", "name 'mul' is not defined", [(4, 3)], cells, graded, {"mul"},
                        hidden={1, 2})[1] == "name 'mul' is not defined; raised in the check's probe, line 1"
    assert kernel_error("HIDDEN_3_4", "x", [(2, 1)], cells, graded, set()) == (
        "Exception", "raised at line 1 of cell 2 (your code)")
    assert kernel_error("NameError", "name 'mul' is not defined", [(4, 2)], cells, graded,
                        {"mul"})[1] == "name 'mul' is not defined; raised in the check's probe, line 2"
    assert kernel_error("NameError", "name 'secret_7' is not defined", [(4, 2)], cells, graded,
                        {"mul"})[1] == "raised in the check's probe, line 2"
    assert kernel_error("Timeout", "learner's text", [], cells, graded, set())[1] == \
        "the cell ran past its time limit and was interrupted"
    assert kernel_error("LaunchError", "rank 1 failed\n  File x\nSecretError: 3 4", [(4, 1)],
                        cells, graded, set())[1].startswith("a rank raised Exception")
    assert kernel_error("ValueError", "x", [(2, 99), (7, 1)], cells, graded, set())[1] == ""
    assert kernel_error("OutOfMemory", "learner's text", [], cells, graded, set(), memory_mib=512) == (
        "OutOfMemory", "out of memory (limit 512 MiB)")
    assert verdict_text("TypeError", "got 'secret'", 5) == ("TypeError", "raised by the check, line 5")
    assert verdict_text("AssertionError", "off by one", 5) == ("AssertionError",
                                                              "off by one (check line 5)")
