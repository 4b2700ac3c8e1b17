"""The autograder: score a class's notebooks, each in a sandboxed fresh kernel.

    mgpu-lab grade PATH... [--root DIR | --solutions DIR] [--json FILE] [--csv FILE]
                   [--feedback DIR] [--jobs N] [--timeout S] [--total-timeout S]
                   [--no-sandbox] [--memory GIB]

PATH is a notebook, or a class folder: ``DIR/<student>/**/*.ipynb`` (so
nbgrader's ``submitted/<student>/<lab>/`` too) and flat ``DIR/*.ipynb`` (the
student is the file's stem). A submission is matched to its lab by the lab id
that ``labs build`` writes into every notebook (``metadata.mgpu_lab.lab``), or
else by its graded cells' ids, never by file name; one that matches no lab gets
a line in the report and the run goes on.

Before running, every graded cell is the instructor's (hidden tests included):
an edited one is replaced, a duplicated one runs once (its last copy), a deleted
one is put back after its exercise (scored 0, "Missing", when the exercise is
gone too). Cells tagged ``demo`` are not run. A graded cell is split in three
(:mod:`mgpu_lab.course.graded_cell`): its inputs and judge run in a judge
process of ours (:mod:`mgpu_lab.course.judge`), its probe in the sandboxed
kernel; it scores its points when the probe and the judge raise nothing, the
learner's cells show no tampering (:mod:`mgpu_lab.course.tamper`) and, for a
from-scratch exercise, no reference it re-implements is called
(:mod:`mgpu_lab.course.guard`). Cells have ``--timeout`` seconds, the notebook
``--total-timeout``; a dead kernel is restarted and the earlier cells replayed
(:mod:`mgpu_lab.course.kernel`). Everything runs in a sandbox
(:mod:`mgpu_lab.course.sandbox`): without one the command refuses unless told
``--no-sandbox``; the first line says which. The exit status is 0 whatever the
scores; 1 when the grader itself failed on a notebook; 2 on bad usage.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import monotonic
from typing import Dict, List, Optional

import nbformat

from . import graded_cell, guard, runner
from .judge import Judge, JudgeError, Lines
from .notebooks import SETUP_TAG, graded_cells, lab_id, nbgrader_meta
from .sandbox import WORK, Limits, Sandbox, command, remove_cgroups
from .submission import (Prepared, forbidden_of, observed_of, prepare_submission,
                         static_check)
from .tamper import tampering


@dataclass
class ExerciseScore:
    grade_id: str
    score: float
    max_score: float
    error: Optional[str] = None
    message: str = ""
    observed: str = ""        # what the check observes inside the kernel (not tamper-proof)


@dataclass
class NotebookGrade:
    path: str
    notebook: str
    student: str = ""
    lab: Optional[str] = None
    exercises: List[ExerciseScore] = field(default_factory=list)
    seconds: float = 0.0
    error: Optional[str] = None            # the notebook could not be graded at all
    notes: List[str] = field(default_factory=list)
    sandboxed: bool = False
    tampering: List[str] = field(default_factory=list)   # what the static pass flagged

    @property
    def score(self) -> float:
        return sum(e.score for e in self.exercises)

    @property
    def max_score(self) -> float:
        return sum(e.max_score for e in self.exercises)

    def to_dict(self) -> dict:
        return dict(asdict(self), score=self.score, max_score=self.max_score)


def brief(message: str, limit: int = 200) -> str:
    """One line for a report: the first line, and the last when there are more.

    A ``LaunchError`` carries the failing rank's whole traceback; its last line
    is the cause (``NotImplementedError``, ``AssertionError: ...``).
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = " ... ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- which lab is this? -----------------------------------------------------

def load_solutions(solutions) -> Dict[str, nbformat.NotebookNode]:
    """``{lab id: instructor notebook}`` for every notebook in ``solutions``."""
    labs = {}
    for path in sorted(Path(solutions).glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        labs[lab_id(nb) or path.stem] = nb
    return labs


def _grade_ids(nb) -> set:
    return {nbgrader_meta(c).get("grade_id") for c in nb.cells} - {None}


def match_lab(student, labs: Dict[str, nbformat.NotebookNode]):
    """``(lab id, how)`` or ``(None, why not)``: by metadata, else by grade ids."""
    wanted = lab_id(student)
    if wanted in labs:
        return wanted, "lab id"
    ids = _grade_ids(student)
    overlap = sorted(((len(ids & _grade_ids(nb)), lab) for lab, nb in labs.items()), reverse=True)
    if overlap and overlap[0][0] > 0 and (len(overlap) == 1 or overlap[1][0] < overlap[0][0]):
        return overlap[0][1], "graded cell ids"
    if wanted:
        return None, f"its lab id {wanted!r} names no lab in the solutions folder"
    return None, "no lab id and no graded cell of any lab: not a lab notebook?"


# --- running it --------------------------------------------------------------

def _environment(package_dir: Path, sandboxed: bool) -> dict:
    home = WORK if sandboxed else os.getcwd()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
           "PYTHONPATH": str(package_dir.parent), "HOME": home, "TMPDIR": "/tmp",
           "JUPYTER_RUNTIME_DIR": "/tmp/jupyter-runtime", "IPYTHONDIR": "/tmp/ipython",
           "MPLCONFIGDIR": "/tmp/matplotlib", "PYTHONDONTWRITEBYTECODE": "1",
           "JUPYTER_PLATFORM_DIRS": "1"}
    for key in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "MKL_NUM_THREADS"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


JUDGE_TIMEOUT = 300.0   # seconds for each step of the judge process, at least


def _judge_environment(package_dir: Path, home: str) -> dict:
    """The judge runs the instructor's code only: the grader's own environment."""
    env = dict(os.environ, MPLBACKEND="Agg", HOME=home, MPLCONFIGDIR=os.path.join(home, ".mpl"),
               PYTHONPATH=os.pathsep.join([str(package_dir.parent)]
                                          + ([os.environ["PYTHONPATH"]]
                                             if os.environ.get("PYTHONPATH") else [])))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def setup_sources(instructor) -> List[str]:
    """The instructor's cells tagged ``setup``: they run in the judge before any check."""
    return [c.source for c in instructor.cells
            if c.cell_type == "code" and SETUP_TAG in c.metadata.get("tags", [])]


def run_prepared(prepared: Prepared, instructor, box: Sandbox, limits: Limits,
                 timeout: float, total_timeout: Optional[float], settled=frozenset()):
    """Run the submission in the runner (sandboxed when ``box.available``), each
    graded cell's probe in its kernel and its judge here, in a :class:`Judge`.

    ``settled``: indices of graded cells already scored 0 by the static pass
    (tampering, a call of the reference): their probes are not run (an empty probe
    is sent in its place) and not judged; the learner's cells around them still run.

    Returns ``(results, violations, verdicts)`` keyed by cell index: the runner's
    cell results, the references a cell called, and the judge's
    ``(error, message)`` for each graded cell whose probe ran.
    """
    import mgpu_lab
    package_dir = Path(mgpu_lab.__file__).resolve().parent
    tests = graded_cells(instructor)
    parts = {i: graded_cell.split(tests[gid].source) for i, gid in prepared.graded.items()}
    trusted = [c.source for c in instructor.cells if c.cell_type == "code"
               and not nbgrader_meta(c).get("solution") and not nbgrader_meta(c).get("grade")]
    header = {"notebook": nbformat.writes(prepared.nb), "timeout": timeout,
              "total_timeout": total_timeout, "sandboxed": box.available,
              "limits": asdict(limits), "cgroup": bool(box.cgroup), "trusted": trusted,
              "graded": {i: {"grade_id": gid, "forbidden": forbidden_of(tests[gid])}
                         for i, gid in prepared.graded.items()}}
    argv = [sys.executable, "-c", runner.COMMAND]
    cleanup = []
    scratch = tempfile.TemporaryDirectory(prefix="mgpu-lab-grade-")
    env = _environment(package_dir, box.available)
    if box.available:
        argv, cleanup = command(box, argv, limits, package_dir, env)
        cwd = "/"
    else:
        cwd = env["HOME"] = os.path.join(scratch.name, "kernel")
        os.makedirs(cwd)
        env = dict(os.environ, **{k: v for k, v in env.items() if k not in ("TMPDIR",)})
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
        for k in ("JUPYTER_RUNTIME_DIR", "IPYTHONDIR", "MPLCONFIGDIR"):
            env[k] = os.path.join(cwd, "." + k.lower())
    judge_home = os.path.join(scratch.name, "judge")
    os.makedirs(judge_home)
    def _fresh(old=None):
        if old is not None:
            old.close()
        # The judge runs our code, not the learner's: its steps (an import of torch, a
        # reference training run) get their own limit, not the learner's per-cell one.
        new = Judge(_judge_environment(package_dir, judge_home), judge_home,
                    max(timeout, JUDGE_TIMEOUT))
        if old is not None:
            new.setup(setup_sources(instructor))
        return new

    judge = _fresh()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=cwd, env=env, start_new_session=True)
    tail = []
    drain = threading.Thread(target=_drain, args=(proc.stderr, tail), daemon=True)
    drain.start()
    deadline = monotonic() + (total_timeout or 24 * 3600) + 60
    verdicts, lines = {}, Lines(proc.stdout)
    try:
        proc.stdin.write((json.dumps(header) + "\n").encode())
        proc.stdin.flush()
        judge.setup(setup_sources(instructor))      # while the kernel starts
        while True:
            line = lines.next(deadline)
            if line is None:
                raise RuntimeError("the runner gave no result"
                                   + (f": {tail[-1][-300:]}" if tail else ""))
            msg = json.loads(line)
            if "need" in msg:
                i = int(msg["need"])
                if i in settled:
                    verdicts[i] = ("Settled", "scored 0 by the static pass; not run")
                    reply = {"source": "# scored 0 before it ran: see the report", "ship": {},
                             "drop": [], "collect": []}
                else:
                    try:
                        ship, drop = judge.inputs(prepared.graded[i], parts[i].inputs)
                    except JudgeError as err:       # the check itself failed: not the learner's
                        ship, drop, verdicts[i] = {}, [], ("JudgeError", str(err))
                        judge = _fresh(judge)
                    reply = {"source": parts[i].probe, "ship": ship, "drop": drop,
                             "collect": graded_cell.bound_names(parts[i].probe)}
                proc.stdin.write((json.dumps(reply) + "\n").encode())
                proc.stdin.flush()
            elif "answer" in msg:
                i = int(msg["answer"])
                if i in verdicts:
                    continue
                try:
                    verdicts[i] = judge.verdict(prepared.graded[i], parts[i].judge,
                                                msg["names"], msg["missing"])
                except JudgeError as err:
                    verdicts[i] = ("JudgeError", str(err))
                    judge = _fresh(judge)
            else:
                return ({r["index"]: r for r in msg["results"]},
                        {int(k): v for k, v in msg.get("violations", {}).items()}, verdicts)
    finally:
        judge.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        remove_cgroups(cleanup)
        scratch.cleanup()


def _drain(stream, tail: list, keep: int = 4096) -> None:
    """Read the runner's stderr to its end, keeping only its last few KiB."""
    buf = b""
    for chunk in iter(lambda: stream.read1(65536), b""):
        buf = (buf + chunk)[-keep:]
        tail[:] = [buf.decode("utf-8", "replace")]


def grade_notebook(path, labs, student: str = "", box: Optional[Sandbox] = None,
                   limits: Optional[Limits] = None, timeout: float = 120.0,
                   total_timeout: Optional[float] = 1800.0) -> NotebookGrade:
    """Score one submission against the matching lab in ``labs`` (see :func:`load_solutions`)."""
    from .sandbox import probe
    path, start = Path(path), monotonic()
    box = box or probe()
    grade = NotebookGrade(str(path), path.name, student or path.stem, sandboxed=box.available)
    try:
        submission = nbformat.read(path, as_version=4)
    except Exception as err:  # not JSON, not a notebook
        grade.error = f"UnreadableNotebook: {brief(str(err))}"
        return grade
    grade.lab, how = match_lab(submission, labs)
    if grade.lab is None:
        grade.error = f"NoLab: {how}"
        return grade
    instructor = labs[grade.lab]
    if how != "lab id":
        grade.notes.append(f"matched by its {how}")
    prepared = prepare_submission(submission, instructor)
    grade.notes += prepared.notes
    static = static_check(submission, instructor)
    tampered = tampering(submission, instructor)
    grade.tampering = [f"{where}: {what}" for where, what, _ in tampered]
    zeroed = set(static) | {gid for _, _, gids in tampered for gid in gids}
    settled = {i for i, gid in prepared.graded.items() if gid in zeroed}
    try:
        results, runtime, verdicts = run_prepared(prepared, instructor, box, limits or Limits(),
                                                  timeout, total_timeout, settled)
    except Exception as err:
        results, runtime, verdicts = {}, {}, {}
        grade.error = f"GraderError: {brief(str(err))}"
    where = {gid: i for i, gid in prepared.graded.items()}
    for gid, cell in graded_cells(instructor).items():
        points = float(nbgrader_meta(cell)["points"])
        observed = observed_of(cell)
        if gid in prepared.missing:
            grade.exercises.append(ExerciseScore(gid, 0.0, points, "Missing",
                                                 "the graded cell and its exercise were deleted"))
            continue
        r = results.get(where[gid], {"error": "NotRun", "message": ""})
        calls = static.get(gid) or runtime.get(where[gid])
        raised = re.search(guard.MESSAGE.format(r"([\w.]+)"), r.get("message") or "")
        if not calls and raised:     # raised in a rank that launch() forked
            calls = [raised.group(1)]
        cheats = [f"{w}: {what}" for w, what, gids in tampered if gid in gids]
        if cheats:
            error, message = "Tampering", "; ".join(cheats)
        elif calls:
            error, message = "ForbiddenCall", guard.MESSAGE.format(", ".join(calls))
        elif r["error"]:
            error, message = r["error"], brief(r.get("message") or "")
        else:
            error, message = verdicts.get(where[gid], ("NotJudged", "the probe sent nothing"))
            message = brief(message or "")
        grade.exercises.append(ExerciseScore(gid, 0.0 if error else points, points, error,
                                             message, observed))
    grade.seconds = round(monotonic() - start, 2)
    return grade
