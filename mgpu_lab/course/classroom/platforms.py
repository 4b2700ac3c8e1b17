"""Gradescope's and PrairieLearn's graders: one submission, graded as ``mgpu-lab grade``
grades it, its results in the platform's own format.

    python -m mgpu_lab.course.classroom.platforms gradescope   [--root /autograder]
    python -m mgpu_lab.course.classroom.platforms prairielearn [--root /grade]

``mgpu-lab export`` (:mod:`.export`) writes the scripts that run this: Gradescope's
``run_autograder`` and PrairieLearn's entrypoint. The layouts are the platforms':

- Gradescope (``$AUTOGRADER_ROOT``, default ``/autograder``): ``source/`` (the zip: the
  solutions and :data:`CONFIG`), ``submission/`` (the student's files), and
  ``results/results.json`` (:func:`gradescope_results`: one test per exercise, named by
  its title, with its number, score, max_score, output: the feedback's words, and
  visibility; the submission's ``execution_time``, ``output`` and ``extra_data``, which
  carry the tampering findings).
- PrairieLearn (``$GRADE_ROOT``, default ``/grade``): ``tests/`` (the question's tests:
  the solutions and :data:`CONFIG`), ``student/``, and ``results/results.json``
  (:func:`prairielearn_results`: ``score`` in [0, 1], ``gradable``, ``message``,
  ``tests[]``).

Time: the notebook gets the platform's limit less :data:`RESERVE` seconds in all, each cell
``timeout`` at most; a watchdog writes a result that says so just before the limit, so
that a judge that hangs never costs the student a silent zero. Isolation: bubblewrap
where the container allows it, else the kernel runs as an unprivileged user (``nobody``)
and the solutions' folder is made ``0700`` first (:func:`choose_sandbox`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path
from time import monotonic
from typing import List, Optional, Tuple

CONFIG = "mgpu_lab_config.json"
RESERVE = 45.0               # seconds of the platform's limit kept for start-up and results
DEFAULTS = {"labs": [], "timeout": 120.0, "limit": 600.0, "memory": None, "visibility":
            "visible", "policy": "best", "run_as": "nobody", "sandbox": "auto"}
LAYOUTS = {"gradescope": ("AUTOGRADER_ROOT", "/autograder", "source", "submission"),
           "prairielearn": ("GRADE_ROOT", "/grade", "tests", "student")}
STUDENT = "submission"


def load_config(folder: Path) -> dict:
    config = dict(DEFAULTS)
    config.update(json.loads((folder / CONFIG).read_text(encoding="utf-8")))
    return config


def choose_sandbox(config: dict, secret: Path):
    """bubblewrap when it works here, else (as root) the kernel as ``config["run_as"]`` with
    ``secret`` (the solutions' folder) made unreadable to it; RuntimeError when neither can
    be had (the grader refuses rather than let a submission read the solutions), unless the
    config says ``"sandbox": "off"``. ``$MGPU_LAB_SANDBOX`` (auto, bwrap, run-as, off)
    overrides the config."""
    from ..grading.sandbox import Sandbox, probe, run_as_user
    mode = os.environ.get("MGPU_LAB_SANDBOX") or config["sandbox"]
    if mode == "off":
        return Sandbox(False, "sandbox off in the export")
    box = probe([secret, Path.home()]) if mode in ("auto", "bwrap") else None
    if box is not None and (box.available or mode == "bwrap"):
        return box
    try:
        run_as = run_as_user(str(config["run_as"]))
        runs_python(run_as)
    except (ValueError, OSError, RuntimeError) as err:
        why = f"{box.reason}; " if box is not None else ""
        raise RuntimeError(f"no sandbox can be made here ({why}{err})") from None
    os.chmod(secret, 0o700)
    return Sandbox(False, box.reason if box is not None else "run-as", run_as=run_as)


def runs_python(run_as) -> None:
    """RuntimeError unless ``run_as``'s user can run this Python and import the course (its
    interpreter, libraries and packages must be readable by every user)."""
    import subprocess
    try:
        done = subprocess.run([sys.executable, "-c", "import mgpu_lab.course.grading.runner"],
                              user=run_as[0], group=run_as[1], extra_groups=[], cwd="/",
                              capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"user {run_as[2]} cannot run {sys.executable}: {err}") from None
    if done.returncode != 0:
        raise RuntimeError(f"user {run_as[2]} cannot run {sys.executable} with mgpu_lab: "
                           f"{done.stderr.decode(errors='replace').strip()[-200:]}")


def container_mib() -> int:
    """The memory this container may use, MiB: its cgroup's limit, else the machine's."""
    from ..grading.sandbox import memory_limit_mib, own_memory_cgroup
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    return min(total, memory_limit_mib(own_memory_cgroup()) or total)


def memory_gib(config: dict) -> float:
    """GiB per notebook's sandbox: the config's, else all this container may use (at most 8).
    Not less: the grader, its judge and the kernel share the container (Gradescope's 768 MiB
    by default), and its OOM killer takes the sandbox's processes first (their
    ``oom_score_adj``, :mod:`..grading.runner`), so a kernel that fills it is what dies, and
    its exercise says "out of memory (limit N MiB)"; a sandbox held to half of it killed
    labs that fit the container."""
    if config.get("memory"):
        return float(config["memory"])
    return max(0.5, min(8.0, container_mib() / 1024))


def grade_submission(folder: Path, solutions: Path, config: dict, budget: float):
    """``(Gradebook, sandbox line, {lab: its exercises at 0})`` of every notebook in
    ``folder``, one student's, within ``budget`` seconds."""
    from ..notebook.cells import graded_cells, nbgrader_meta
    from .grade import grade_class
    from ..notebook.exercises import titles
    from .gradebook import Gradebook, lab_points
    from ..grading.grader import load_solutions
    from .handins import handed_in
    from ..grading.sandbox import Limits
    from ..grading.scoring import ExerciseScore
    labs = {lab: nb for lab, nb in load_solutions(solutions).items()
            if not config["labs"] or lab in config["labs"]}
    blanks = {lab: [ExerciseScore(gid, 0.0, float(nbgrader_meta(c)["points"]),
                                  title=titles(nb)[gid]) for gid, c in graded_cells(nb).items()]
              for lab, nb in labs.items()}
    box = choose_sandbox(config, solutions.parent)
    real = os.path.realpath(folder)
    found = handed_in(folder, STUDENT, real) if folder.is_dir() else []
    total = max(30.0, budget)
    grades = grade_class(found, labs, box, Limits(memory_gib=memory_gib(config)),
                         min(float(config["timeout"]), total), total, jobs=1, progress=False)
    for g in grades:
        g.path = os.path.relpath(g.path, folder)
    book = Gradebook(grades, lab_points(labs), config["policy"], sorted(labs))
    return book, box.describe(), blanks


# --- the platforms' formats ----------------------------------------------------------

def exercises_of(book, lab: str, blanks: dict) -> Tuple[list, Optional[object]]:
    """``(exercises, the grade that counts)`` of ``lab``; its exercises at 0 (``blanks``),
    "not handed in", when no notebook of it counts."""
    g = book.counted(STUDENT, lab)
    if g is not None and g.exercises:
        return g.exercises, g
    from ..grading.scoring import ExerciseScore
    shown = blanks.get(lab, [])
    why = g.error if g is not None and g.error else f"no notebook of lab {lab} was handed in"
    return [ExerciseScore(e.grade_id, 0.0, e.max_score, "NotGraded", why, title=e.title)
            for e in shown], g


def summary(book) -> List[str]:
    """What the whole submission's output says: each lab's score and notebook, its notes,
    tampering found, notebooks of no lab."""
    lines = []
    for lab in book.labs:
        g = book.counted(STUDENT, lab)
        if g is None:
            lines.append(f"{lab}: 0/{book.maxima[lab]:g}: no notebook of this lab was handed in")
            continue
        lines.append(f"{lab}: {g.score:g}/{book.maxima[lab]:g} (notebook {g.path})"
                     + (f": not graded: {g.error}" if g.error else ""))
        lines += [f"  {note}" for note in g.notes]
        if g.tampering:
            lines.append(f"  TAMPERING: {len(g.tampering)} finding(s): " + "; ".join(g.tampering))
    for g in book.unmatched.get(STUDENT, []):
        lines.append(f"not graded: {g.path}: {g.error or 'not a notebook of this assignment'}")
    if not book.grades:
        lines.append("no notebook (.ipynb) in the submission")
    return lines


def gradescope_results(book, config: dict, seconds: float, sandbox_line: str,
                       blanks: dict) -> dict:
    """Gradescope's ``results.json``: one test per exercise."""
    tests, several = [], len(book.labs) > 1
    for i, lab in enumerate(book.labs, 1):
        exercises, g = exercises_of(book, lab, blanks)
        for j, e in enumerate(exercises, 1):
            tests.append({"name": f"{lab}: {e.title or e.grade_id}" if several
                          else (e.title or e.grade_id),
                          "number": f"{i}.{j}", "score": e.score, "max_score": e.max_score,
                          "status": "passed" if not e.error else "failed",
                          "output": e.outcome(), "visibility": config["visibility"],
                          "extra_data": {"lab": lab, "grade_id": e.grade_id, "error": e.error}})
    counted = [book.counted(STUDENT, lab) for lab in book.labs]
    tampering = [t for g in counted if g is not None for t in g.tampering]
    return {"execution_time": int(round(seconds)), "output": "\n".join(summary(book)),
            "output_format": "text", "test_output_format": "text", "test_name_format": "text",
            "visibility": config["visibility"], "stdout_visibility": "hidden",
            "extra_data": {"tampering": tampering, "sandbox": sandbox_line,
                           "policy": book.policy,
                           "notebooks": [{"path": g.path, "lab": g.lab, "score": g.score,
                                          "error": g.error, "version": g.version}
                                         for g in book.grades]},
            "tests": tests}


def prairielearn_results(book, config: dict, sandbox_line: str, blanks: dict) -> dict:
    """PrairieLearn's ``results.json``: ``score`` in [0, 1]; ``gradable`` false (no attempt
    used up) when no notebook of the question could be read at all."""
    tests = []
    for lab in book.labs:
        exercises, _ = exercises_of(book, lab, blanks)
        tests += [{"name": e.title or e.grade_id, "description": f"{lab} {e.grade_id}",
                   "points": e.score, "max_points": e.max_score, "message": e.outcome(),
                   "output": ""} for e in exercises]
    graded = [g for g in book.grades if g.lab and g.exercises]
    total = sum(book.total(s) for s in book.students)
    out = {"gradable": bool(graded), "score": total / book.max_total if book.max_total else 0.0,
           "message": "\n".join(summary(book)), "output": sandbox_line, "tests": tests}
    if not graded:
        out["format_errors"] = summary(book)
    return out


# --- the entry point ---------------------------------------------------------------------

def write_results(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def watchdog(platform: str, results: Path, seconds: float, config: dict) -> threading.Timer:
    """At ``seconds``, write a result that says the grading ran out of time, and exit."""
    def fire():
        why = (f"grading ran past {config['limit']:g} s, the platform's limit: the notebook "
               "or its checks took too long; ask your instructor")
        data = ({"score": 0.0, "execution_time": int(seconds), "output": why,
                 "output_format": "text", "tests": []} if platform == "gradescope"
                else {"gradable": True, "score": 0.0, "message": why, "tests": []})
        write_results(results, data)
        print(why, flush=True)
        os._exit(0)
    timer = threading.Timer(max(1.0, seconds), fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mgpu_lab.course.classroom.platforms")
    parser.add_argument("platform", choices=sorted(LAYOUTS))
    parser.add_argument("--root", help="the platform's root folder (default: its variable, "
                        "else its usual path)")
    args = parser.parse_args(argv)
    start = monotonic()
    variable, default, config_dir, submission = LAYOUTS[args.platform]
    root = Path(args.root or os.environ.get(variable) or default)
    config = load_config(root / config_dir)
    results = root / "results" / "results.json"
    timer = watchdog(args.platform, results, float(config["limit"]) - 10.0, config)
    try:
        book, line, blanks = grade_submission(root / submission, root / config_dir / "solutions",
                                              config, float(config["limit"]) - RESERVE
                                              - (monotonic() - start))
    except RuntimeError as err:          # the grader cannot run here: the instructor's to fix
        why = f"the grader cannot run here: {err}; see mgpu-lab's docs/INSTRUCTORS.md (Platforms)"
        write_results(results, {"score": 0.0, "output": why, "tests": []}
                      if args.platform == "gradescope"
                      else {"gradable": False, "message": why, "format_errors": [why]})
        print(why, file=sys.stderr)
        return 1
    data = (gradescope_results(book, config, monotonic() - start, line, blanks)
            if args.platform == "gradescope" else
            prairielearn_results(book, config, line, blanks))
    timer.cancel()
    write_results(results, data)
    print(line)
    print("\n".join(summary(book)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
