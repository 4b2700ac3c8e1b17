"""`mgpu-lab export`, run as the platforms run it.

The Gradescope zip is unzipped into temporary roots laid out as Gradescope's
(``source/``, ``submission/``, ``results/``) and its ``run_autograder`` runs there on lab
00 solved (full marks: under half a core where cgroups or taskset allow, within
Gradescope's default 10 minutes), untouched (0) and with tampering (and a try at reading
the solutions); the PrairieLearn question the same way in ``/grade``-like roots (its
kernel run as user ``nobody`` where a Python that user can run is at hand, else in the
sandbox). Each ``results.json`` is checked against the platform's schema and against
``mgpu-lab grade --json`` of the same notebooks. All these runs go at once, in one fixture.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from time import monotonic
from unittest import mock

import jsonschema
import nbformat
import pytest

from mgpu_lab.cli import main as cli
from conftest import ROOT

sys.path.insert(0, str(Path(__file__).parent))
from test_grader import UNSANDBOXED_IF_NEEDED  # noqa: E402

LAB = "00_setup"
GRADESCOPE_LIMIT = 600         # Gradescope's default timeout, seconds
VISIBILITY = {"enum": ["hidden", "after_due_date", "after_published", "visible"]}
FORMAT = {"enum": ["text", "html", "simple_format", "md", "ansi"]}
GRADESCOPE_SCHEMA = {          # gradescope-autograders.readthedocs.io, "Autograder Specifications"
    "type": "object", "additionalProperties": False,
    "properties": {
        "score": {"type": "number"}, "execution_time": {"type": "number"},
        "output": {"type": "string"}, "output_format": FORMAT, "test_output_format": FORMAT,
        "test_name_format": FORMAT, "visibility": VISIBILITY, "stdout_visibility": VISIBILITY,
        "extra_data": {"type": "object"}, "leaderboard": {"type": "array"},
        "tests": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "properties": {"score": {"type": "number"}, "max_score": {"type": "number"},
                           "status": {"enum": ["passed", "failed"]}, "name": {"type": "string"},
                           "name_format": FORMAT, "number": {"type": "string"},
                           "output": {"type": "string"}, "output_format": FORMAT,
                           "tags": {"type": "array"}, "visibility": VISIBILITY,
                           "extra_data": {"type": "object"}}}}},
    "anyOf": [{"required": ["score"]}, {"required": ["tests"]}]}
PRAIRIELEARN_SCHEMA = {        # prairielearn.readthedocs.io, "External Grading": Grading results
    "type": "object", "required": ["gradable", "score", "message", "tests"],
    "properties": {
        "gradable": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 1},
        "message": {"type": "string"}, "output": {"type": "string"},
        "format_errors": {"type": ["string", "array"]},
        "tests": {"type": "array", "items": {
            "type": "object", "required": ["name", "points", "max_points"],
            "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                           "points": {"type": "number"}, "max_points": {"type": "number"},
                           "message": {"type": "string"}, "output": {"type": "string"}}}}}}
STEAL = """import glob
stolen = []
for root in {roots!r}:
    for path in glob.glob(root + "/**/*.ipynb", recursive=True):
        try:
            stolen.append(open(path).read()[:10])
        except OSError:
            pass
"""


def notebooks(roots):
    """Lab 00 solved, untouched, and tampered with (exercise 1 replaces torch.equal;
    exercise 2, otherwise solved, answers wrong if it could list the solutions)."""
    solved = nbformat.read(ROOT / "solutions" / f"{LAB}.ipynb", as_version=4)
    tampered = nbformat.read(ROOT / "solutions" / f"{LAB}.ipynb", as_version=4)
    for cell in tampered.cells:
        gid = (cell.metadata.get("nbgrader") or {}).get("grade_id")
        if gid == "rank_slice":
            cell.source = "import torch\ntorch.equal = lambda *a, **k: True\n" + cell.source
        if gid == "global_mean":
            cell.source = STEAL.format(roots=roots) + cell.source.replace(
                "### BEGIN SOLUTION", "### BEGIN SOLUTION\n    assert not stolen, stolen", 1)
    return {"solved": solved, "untouched": nbformat.read(ROOT / "labs" / f"{LAB}.ipynb",
                                                         as_version=4),
            "tampered": tampered}


@pytest.fixture(scope="module")
def public():
    """``(python, folder)``: a Python that user ``nobody`` can run, with this environment's
    packages (None where there is none), and a folder every user can reach. The Python is
    this one, else (an interpreter under /root, as pyenv's) the system's of the same version
    with a ``.pth`` that adds this environment's site-packages."""
    import tempfile
    folder = Path(tempfile.mkdtemp(prefix="mgpu-lab-public-"))
    folder.chmod(0o755)
    yield _public_python(folder), folder
    shutil.rmtree(folder, ignore_errors=True)


def _public_python(folder: Path):
    if os.geteuid() != 0 or not shutil.which("runuser"):
        return None

    def runs(python):
        return subprocess.run(["runuser", "-u", "nobody", "--", python, "-c",
                               "import mgpu_lab.course.grading.runner, torch"],
                              capture_output=True, cwd="/", timeout=120).returncode == 0
    if runs(sys.executable):
        return sys.executable
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not system.exists():
        return None
    venv = folder / "venv"
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)], check=True,
                   capture_output=True)
    import site
    lines = [f"import site; site.addsitedir({p!r})" for p in site.getsitepackages()]
    pth = next(venv.glob("lib/python*/site-packages")) / "mgpu_lab_tests.pth"
    pth.write_text("\n".join(lines) + "\n")
    return str(venv / "bin" / "python") if runs(str(venv / "bin" / "python")) else None


def half_a_core(name: str):
    """``(command prefix, what it is, cleanup)`` that runs a command on half a CPU core:
    a cgroup's CPU quota (v2, else v1) when this process may make one, else one core by
    taskset, else nothing."""
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
    if (v2 / "cgroup.controllers").exists():
        where, knob, value = v2 / name, "cpu.max", "50000 100000"
    else:
        where, knob, value = v1 / name, "cpu.cfs_quota_us", "50000"
    try:
        where.mkdir()
        (where / knob).write_text(value)
        procs = where / "cgroup.procs"
        return (["/bin/sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh"],
                "half a core (a cgroup's CPU quota)", lambda: _rmdir(where))
    except OSError:
        _rmdir(where)
    if shutil.which("taskset"):
        return ["taskset", "-c", "0"], "one core (taskset)", lambda: None
    return [], "every core", lambda: None


def _rmdir(folder: Path) -> None:
    for _ in range(50):
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            import time
            time.sleep(0.1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, public):
    """Every platform run and `mgpu-lab grade --json` of the same notebooks, at once."""
    tmp = tmp_path_factory.mktemp("platforms")
    assert cli(["export", "gradescope", "00", "-o", str(tmp / "autograder.zip"),
                "--root", str(ROOT)]) == 0
    assert cli(["export", "prairielearn", "00", "-o", str(tmp / "pl"), "--root", str(ROOT)]) == 0
    python = public[0]
    roots = {}
    for kind in ("solved", "untouched", "tampered"):
        gs = tmp / f"gs-{kind}"
        for part in ("source", "submission", "results"):
            (gs / part).mkdir(parents=True)
        with zipfile.ZipFile(tmp / "autograder.zip") as z:
            z.extractall(gs / "source")
        for name in ("run_autograder", "setup.sh"):     # unzip keeps no mode bits
            (gs / "source" / name).chmod(0o755)
        shutil.copy(gs / "source" / "run_autograder", gs / "run_autograder")
        pl = public[1] / f"pl-{kind}"       # where every user can reach it, as /grade is
        (pl / "student").mkdir(parents=True)
        shutil.copytree(tmp / "pl" / LAB / "tests", pl / "tests")
        roots[kind] = (gs, pl)
    klass = tmp / "class"
    for kind, (gs, pl) in roots.items():
        nbformat.write(notebooks([str(gs / "source")])[kind], gs / "submission" / "lab.ipynb")
        nbformat.write(notebooks([str(pl / "tests")])[kind], pl / "student" / f"{LAB}.ipynb")
        (klass / kind).mkdir(parents=True)
        nbformat.write(notebooks([str(gs / "source")])[kind], klass / kind / "lab.ipynb")
    prefix, slow, cleanup = half_a_core(f"mgpu-lab-test-{os.getpid()}")
    procs, start = {}, monotonic()
    env = dict(os.environ, OMP_NUM_THREADS="1", MGPU_LAB_PYTHON=sys.executable)
    env.pop("MGPU_LAB_SANDBOX", None)
    try:
        for kind, (gs, pl) in roots.items():
            cmd = (prefix if kind == "solved" else []) + [str(gs / "run_autograder")]
            procs[("gradescope", kind)] = subprocess.Popen(
                cmd, cwd=gs, env=dict(env, AUTOGRADER_ROOT=str(gs)),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            plenv = dict(env, GRADE_ROOT=str(pl))
            if python:                       # the fallback: the kernel as user nobody
                plenv.update(MGPU_LAB_PYTHON=python, MGPU_LAB_SANDBOX="run-as")
            procs[("prairielearn", kind)] = subprocess.Popen(
                ["bash", str(pl / "tests" / "run.sh")], cwd=pl, env=plenv,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        grade = subprocess.run(
            [sys.executable, "-m", "mgpu_lab", "grade", str(klass), "--root", str(ROOT),
             "--json", str(tmp / "grade.json"), "--quiet"] + UNSANDBOXED_IF_NEEDED,
            env=env, capture_output=True, text=True, timeout=GRADESCOPE_LIMIT)
        out, seconds = {}, {}
        for key, proc in procs.items():
            out[key] = proc.communicate(timeout=GRADESCOPE_LIMIT)[0]
            seconds[key] = monotonic() - start
    finally:
        cleanup()
    results = {}
    for kind, (gs, pl) in roots.items():
        for platform, root in (("gradescope", gs), ("prairielearn", pl)):
            path = root / "results" / "results.json"
            assert path.exists(), out[(platform, kind)]
            results[(platform, kind)] = json.loads(path.read_text())
    graded = {nb["student"]: nb for nb in json.loads((tmp / "grade.json").read_text())["notebooks"]}
    return dict(results=results, graded=graded, out=out, seconds=seconds, slow=slow,
                python=python, tmp=tmp, grade=grade)


def test_the_zip_holds_setup_run_autograder_and_solutions(tmp_path, capsys):
    assert cli(["export", "gradescope", "00", "06", "-o", str(tmp_path / "a.zip"),
                "--root", str(ROOT), "--limit", "1200"]) == 0
    said = capsys.readouterr().out
    with zipfile.ZipFile(tmp_path / "a.zip") as z:
        names = set(z.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
        config = json.loads(z.read("mgpu_lab_config.json"))
        setup = z.read("setup.sh").decode()
        run_autograder = z.read("run_autograder").decode()
    # The export states the memory it needs: these labs fit Gradescope's default container.
    fits = "every lab here grades within Gradescope's default 768 MiB"
    assert fits in said and fits in run_autograder
    from mgpu_lab.course.classroom import export
    assert export.memory_line(["00_setup", "03_ddp_and_launching"]).startswith(  # torchrun's check too
        "memory: every lab here grades within Gradescope's default 768 MiB")
    with mock.patch.dict(export.NEEDS_MIB, {"03_ddp_and_launching": 1280}):  # a lab that needed more: said
        assert export.memory_line(["00_setup", "03_ddp_and_launching"]).startswith(
            "memory: give the autograder at least 1280 MiB")
    assert {"setup.sh", "run_autograder", "solutions/00_setup.ipynb",
            "solutions/06_gradient_accumulation.ipynb",
            "mgpu_lab_package/pyproject.toml", "mgpu_lab_package/mgpu_lab/course/classroom/platforms.py"} <= names
    assert modes["run_autograder"] & 0o111 and modes["setup.sh"] & 0o111
    assert config["labs"] == ["00_setup", "06_gradient_accumulation"] and config["limit"] == 1200
    assert "bubblewrap" in setup and "[course]" in setup and "whl/cpu" in setup
    (tmp_path / "setup.sh").write_text(setup)
    assert subprocess.run(["bash", "-n", str(tmp_path / "setup.sh")]).returncode == 0
    assert cli(["export", "prairielearn", "99", "-o", str(tmp_path / "pl"), "--root", str(ROOT)]) == 2


def test_gradescope_results_follow_its_schema_one_test_per_exercise(runs):
    for kind in ("solved", "untouched", "tampered"):
        data = runs["results"][("gradescope", kind)]
        jsonschema.validate(data, GRADESCOPE_SCHEMA)
        assert [t["number"] for t in data["tests"]] == ["1.1", "1.2"]
        assert [t["name"] for t in data["tests"]] == [
            "Exercise 1: rank_slice, balanced with the larger slices last",
            "Exercise 2: a correct global mean — design it yourself"]
        assert data["output_format"] == data["test_output_format"] == "text"
    solved = runs["results"][("gradescope", "solved")]
    assert [(t["score"], t["max_score"], t["output"]) for t in solved["tests"]] == [
        (3, 3, "passed"), (2, 2, "passed")]
    untouched = runs["results"][("gradescope", "untouched")]
    assert sum(t["score"] for t in untouched["tests"]) == 0
    assert all(t["output"].startswith("NotAttempted: ") for t in untouched["tests"])


def test_gradescope_flags_tampering_and_the_solutions_stay_out_of_reach(runs):
    data = runs["results"][("gradescope", "tampered")]
    first, second = data["tests"]
    assert first["score"] == 0 and first["output"].startswith("Tampering: ")
    assert second["score"] == 2, second["output"]        # it could not list source/
    assert data["extra_data"]["tampering"] and "TAMPERING" in data["output"]


def test_gradescope_and_prairielearn_score_what_mgpu_lab_grade_scores(runs):
    for kind, nb in runs["graded"].items():
        want = [(e["score"], e["max_score"], "passed" if not e["error"] else
                 f"{e['error']}: {e['message']}" if e["message"] else e["error"])
                for e in nb["exercises"]]
        gs = runs["results"][("gradescope", kind)]
        assert [(t["score"], t["max_score"], t["output"]) for t in gs["tests"]] == want, kind
        pl = runs["results"][("prairielearn", kind)]
        assert [(t["points"], t["max_points"]) for t in pl["tests"]] == [(s, m) for s, m, _ in want]
        assert pl["score"] == pytest.approx(nb["score"] / nb["max_score"])


def test_prairielearn_results_follow_its_schema(runs):
    for kind in ("solved", "untouched", "tampered"):
        data = runs["results"][("prairielearn", kind)]
        jsonschema.validate(data, PRAIRIELEARN_SCHEMA)
        assert data["gradable"] is True
    assert runs["results"][("prairielearn", "solved")]["score"] == 1.0
    assert runs["results"][("prairielearn", "untouched")]["score"] == 0.0
    tampered = runs["results"][("prairielearn", "tampered")]
    assert [t["points"] for t in tampered["tests"]] == [0, 2]   # tests/ stayed out of reach
    if runs["python"]:
        assert "run as user nobody" in tampered["output"]


def test_grading_a_lab_on_half_a_core_ends_within_gradescopes_default_limit(runs):
    seconds = runs["seconds"][("gradescope", "solved")]
    data = runs["results"][("gradescope", "solved")]
    print(f"lab 00 on {runs['slow']}: {seconds:.0f} s (Gradescope's default limit: "
          f"{GRADESCOPE_LIMIT} s; run_autograder says {data['execution_time']} s)")
    assert seconds < GRADESCOPE_LIMIT and data["execution_time"] < GRADESCOPE_LIMIT


def test_prairielearn_question_folder(runs):
    info = json.loads((runs["tmp"] / "pl" / LAB / "info.json").read_text())
    options = info["externalGradingOptions"]
    assert info["gradingMethod"] == "External" and options["enabled"] is True
    assert options["entrypoint"] == "/grade/tests/run.sh" and options["timeout"] <= 600
    assert (runs["tmp"] / "pl" / LAB / "tests" / "solutions" / f"{LAB}.ipynb").exists()
    assert "pl-file-upload" in (runs["tmp"] / "pl" / LAB / "question.html").read_text()
    assert "FROM python" in (runs["tmp"] / "pl" / "image" / "Dockerfile").read_text()


def test_no_notebook_in_a_submission_is_said_and_scores_zero(tmp_path):
    """Gradescope's empty submission and PrairieLearn's: not gradable there, a 0 here."""
    from mgpu_lab.course.classroom.gradebook import Gradebook
    from mgpu_lab.course.classroom.platforms import gradescope_results, prairielearn_results
    from mgpu_lab.course.grading.scoring import ExerciseScore
    blanks = {LAB: [ExerciseScore("a_test", 0.0, 3.0, title="Exercise 1")]}
    book = Gradebook([], {LAB: 3.0}, "best", [LAB])
    config = {"visibility": "visible"}
    gs = gradescope_results(book, config, 1.0, "sandbox: x", blanks)
    jsonschema.validate(gs, GRADESCOPE_SCHEMA)
    assert gs["tests"][0]["score"] == 0 and "no notebook" in gs["output"]
    pl = prairielearn_results(book, config, "sandbox: x", blanks)
    jsonschema.validate(pl, PRAIRIELEARN_SCHEMA)
    assert pl["gradable"] is False and pl["format_errors"]


def test_a_grader_run_by_another_user_than_the_installer(public):
    """`mgpu-lab grade` as user nobody, with the environment root installed: it needs to
    read Python and its packages, the solutions and the class, and to write its outputs
    and $TMPDIR (docs/INSTRUCTORS.md, "Who may run the grader")."""
    python, folder = public
    if python is None:
        pytest.skip("no Python here that user nobody can run (docs/INSTRUCTORS.md says what it needs)")
    work = folder / "work"
    (work / "solutions").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "data" / "grader" / "solutions" / "toy.ipynb", work / "solutions")
    (work / "class" / "alice").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "data" / "grader" / "solutions" / "toy.ipynb",
                work / "class" / "alice" / "toy.ipynb")
    (work / "out").mkdir()
    subprocess.run(["chown", "-R", "nobody", str(work / "out")], check=True)
    subprocess.run(["chmod", "-R", "a+rX", str(work)], check=True)
    done = subprocess.run(["runuser", "-u", "nobody", "--", "env", "OMP_NUM_THREADS=1",
                           python, "-m", "mgpu_lab", "grade", str(work / "class"),
                           "--solutions", str(work / "solutions"), "--quiet", "--no-sandbox",
                           "--json", str(work / "out" / "g.json")],
                          cwd=work / "out", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((work / "out" / "g.json").read_text())["notebooks"][0]["score"] == 5
