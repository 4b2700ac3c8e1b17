"""``mgpu-lab grade``: a class's folder in, a table, JSON, CSV and feedback out.

See :mod:`mgpu_lab.course.grader` for what happens to each notebook. Here: who
handed in what (:func:`find_submissions`), grading N notebooks at once
(``--jobs``: each one is its own sandboxed runner process), and the command.
"""
from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, NamedTuple, Optional

from .grader import grade_notebook, load_solutions
from .layout import course_dir, find_root
from .report import print_table, write_csv, write_feedback, write_json
from .sandbox import Limits, probe
from .scoring import NotebookGrade, brief


class Submission(NamedTuple):
    student: str
    path: Path
    folder: Optional[str] = None     # the real folder it must be in (None: named by hand)


def _notebooks(folder: Path) -> List[Path]:
    return sorted(p for p in folder.rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in p.parts and p.is_file())


def find_submissions(paths) -> List[Submission]:
    """``[(student, notebook, folder)]``. A folder holds a folder per student (any depth
    below it, so nbgrader's ``submitted/<student>/<lab>/`` works: pass ``submitted``)
    and/or flat notebooks (student = file stem). A notebook named on the command line is
    its own student (its path without ``.ipynb``). ``folder``: the real path a found
    notebook must lie in (its student's folder, or the class folder for a flat one):
    one that a symbolic link takes elsewhere is refused when graded."""
    found = []
    for p in map(Path, paths):
        if p.is_dir():
            if (p / "submitted").is_dir():
                p = p / "submitted"
            real = os.path.realpath(p)
            for child in sorted(p.iterdir()):
                if child.is_dir() and child.name != ".ipynb_checkpoints":
                    own = os.path.join(real, child.name)
                    found += [Submission(child.name, nb, own) for nb in _notebooks(child)]
                elif child.suffix == ".ipynb" and child.is_file():
                    found.append(Submission(child.stem, child, real))
        elif p.is_file():
            found.append(Submission(str(p.with_suffix("")), p))
        else:
            raise FileNotFoundError(f"no such notebook or folder: {p}")
    return found


def grade_class(submissions, labs, box, limits, timeout, total_timeout, jobs=1,
                progress=True) -> List[NotebookGrade]:
    """Grade every ``(student, path)``, ``jobs`` at a time; in the input's order. The
    judges of one lab's notebooks are forks of one process (:mod:`.judge_pool`)."""
    from .judge_pool import JudgePool
    from .session import JUDGE_TIMEOUT, judge_environment
    pool = JudgePool(lambda home: judge_environment(home, limits.memory_gib),
                     max(timeout, JUDGE_TIMEOUT))

    def one(item):
        student, path, folder = (tuple(item) + (None,))[:3]
        try:
            return grade_notebook(path, labs, student, box, limits, timeout, total_timeout,
                                  pool, folder)
        except BaseException as err:  # any failure of one notebook (SystemExit too) costs
            return NotebookGrade(str(path), Path(path).name, student,  # that notebook only
                                 error=f"GraderError: {type(err).__name__}: {brief(str(err))}")

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(submissions), desc="grading", unit="notebook", file=sys.stderr)
    grades = []
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool_of_threads:
            for grade in pool_of_threads.map(one, submissions):
                grades.append(grade)
                if bar is not None:
                    bar.update(1)
    finally:
        pool.close()
        if bar is not None:
            bar.close()
    return grades


NO_SANDBOX = """no sandbox can be made here ({reason}), so this refuses to grade.
A submission is code written by someone else: without a sandbox its notebook runs with
your permissions (it can read the solutions and your files, and write anywhere you can).
Install bubblewrap (Debian/Ubuntu: sudo apt-get install bubblewrap; Fedora: sudo dnf
install bubblewrap) on Linux with user namespaces enabled, or, for notebooks you trust,
pass --no-sandbox."""


def _cmd_grade(args) -> int:
    def usage(message: str) -> int:
        print(f"mgpu-lab grade: {message}", file=sys.stderr)
        return 2

    if args.timeout <= 0 or args.total_timeout <= 0 or args.jobs < 1 or args.memory <= 0:
        return usage("--timeout, --total-timeout, --jobs and --memory must be positive")
    try:
        solutions = course_dir(args, "solutions")
    except FileNotFoundError as err:
        return usage(f"{err}; or pass --solutions DIR")
    if not solutions.is_dir() or not any(solutions.glob("*.ipynb")):
        return usage(f"no solution notebooks in {solutions}; pass --solutions DIR or --root DIR")
    try:
        submissions = find_submissions(args.paths)
    except FileNotFoundError as err:
        return usage(str(err))
    if not submissions:
        return usage("no notebooks found in " + " ".join(args.paths))
    hidden = [solutions.resolve(), Path.home()]
    try:
        hidden.append(find_root(solutions))
    except FileNotFoundError:
        pass
    box = probe(hidden) if not args.no_sandbox else None
    if box is None:
        from .sandbox import Sandbox
        box = Sandbox(False, "--no-sandbox")
    line = box.describe()
    print(line, flush=True)                  # the first line says what protects you
    if not box.available and not args.no_sandbox:
        return usage(NO_SANDBOX.format(reason=box.reason))
    labs = load_solutions(solutions)
    limits = Limits(memory_gib=args.memory)
    try:
        grades = grade_class(submissions, labs, box, limits, args.timeout, args.total_timeout,
                             args.jobs, progress=not args.quiet)
    except KeyboardInterrupt:
        print("mgpu-lab grade: interrupted; nothing written", file=sys.stderr)
        return 130
    print_table(grades, line)
    if args.json:
        write_json(grades, args.json, line)
    if args.csv:
        write_csv(grades, args.csv)
    if args.feedback:
        write_feedback(grades, args.feedback)
    failed = [g for g in grades if g.error and g.error.startswith("GraderError")]
    for g in failed:
        print(f"mgpu-lab grade: could not grade {g.path}: {g.error}", file=sys.stderr)
    return 1 if failed else 0


def add_parser(subparsers) -> None:
    from . import grader
    p = subparsers.add_parser("grade", help="score a class's notebooks (sandboxed)",
                              description=grader.__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="notebooks, or class folders (DIR/<student>/..., flat DIR/*.ipynb)")
    p.add_argument("--root", help="the course checkout (default: found from cwd)")
    p.add_argument("--solutions", help="instructor notebooks (default: ROOT/solutions)")
    p.add_argument("--json", metavar="FILE", help="everything, per exercise, as JSON")
    p.add_argument("--csv", metavar="FILE", help="one row per student, a column per lab "
                   "and per exercise")
    p.add_argument("--feedback", metavar="DIR", help="DIR/<student>/<lab>.md for each student")
    p.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (1)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per cell (120)")
    p.add_argument("--total-timeout", type=float, default=1800.0,
                   help="seconds per notebook (1800)")
    p.add_argument("--memory", type=float, default=8.0,
                   help="GiB of memory per notebook's sandbox (8)")
    p.add_argument("--no-sandbox", action="store_true",
                   help="run submissions with your permissions (trusted notebooks only)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_grade)
