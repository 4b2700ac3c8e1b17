"""``mgpu-lab grade``: a class's folder in; a summary, a report, JSON, CSV, feedback and
the LMS's gradebooks out.

See :mod:`mgpu_lab.course.grading.grader` for what happens to each notebook. Here: grading N
notebooks at once (``--jobs``: each one is its own sandboxed runner process) and the
command; who handed in what is :mod:`.handins`'s, which notebook counts
:mod:`.gradebook`'s, the reports :mod:`.report`'s and :mod:`.lms`'s.
"""
from __future__ import annotations

import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List

from .gradebook import POLICIES, Gradebook, lab_points
from ..grading.grader import grade_notebook, load_solutions
from .handins import Submission, find_submissions, identify, only_labs
from ..notebook.layout import course_dir, find_root
from .lms import (canvas_columns, labs_named, read_roster, write_canvas_csv, write_canvas_feedback,
                  write_nbgrader)
from .report import print_details, print_summary, write_csv, write_feedback, write_json, write_report
from ..grading.sandbox import Limits, Sandbox, probe, run_as_user
from ..grading.scoring import NotebookGrade, brief

__all__ = ["Submission", "find_submissions", "grade_class", "only_labs"]


def grade_class(submissions, labs, box, limits, timeout, total_timeout, jobs=1,
                progress=True) -> List[NotebookGrade]:
    """Grade every ``(student, path)``, ``jobs`` at a time; in the input's order. The
    judges of one lab's notebooks are forks of one process (:mod:`~mgpu_lab.course.grading.judge_pool`)."""
    from ..grading.judge_pool import JudgePool
    from ..grading.session import JUDGE_TIMEOUT, judge_environment
    pool = JudgePool(lambda home: judge_environment(home, limits.memory_gib),
                     max(timeout, JUDGE_TIMEOUT), keep=max(1, jobs))

    def one(item):
        student, path, folder, uid, problem, subid = (tuple(item) + (None,) * 4)[:6]
        canvas = (uid, subid) if uid and subid else None    # decided once, by handins
        if problem:                       # stored so that it cannot be graded: said so
            return NotebookGrade(str(path), Path(path).name, student, error=problem,
                                 canvas=canvas)
        try:
            grade = grade_notebook(path, labs, student, box, limits, timeout, total_timeout,
                                   pool, folder)
        except BaseException as err:  # any failure of one notebook (SystemExit too) costs
            grade = NotebookGrade(str(path), Path(path).name, student,  # that notebook only
                                  error=f"GraderError: {type(err).__name__}: {brief(str(err))}")
        grade.canvas = canvas
        return grade

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
        roster = read_roster(args.roster) if args.roster else None
        run_as = run_as_user(args.run_as) if args.run_as else None
    except (OSError, ValueError, KeyError) as err:
        return usage(str(err))
    if run_as and not args.no_sandbox:
        return usage("--run-as goes with --no-sandbox (in the sandbox the kernel is nobody already)")
    if args.assignment and not args.canvas:
        return usage("--assignment goes with --canvas (it names the lab's column in Canvas's import)")
    with tempfile.TemporaryDirectory(prefix="mgpu-lab-downloads-") as unpacked:
        try:
            found = find_submissions(args.paths, unpacked, keyed=False)
            submissions, rows, notices = identify(found, roster)
            labs = load_solutions(solutions)
            if args.lab:
                submissions, labs = only_labs(submissions, labs, args.lab)
        except (FileNotFoundError, ValueError, OSError) as err:
            return usage(str(err))
        if not submissions:
            return usage("no notebooks found in " + " ".join(args.paths)
                         + (f" for lab {' '.join(args.lab)}" if args.lab else ""))
        if args.canvas:                 # before grading: a column that cannot be chosen
            try:
                unknown = [a for a in args.assignment if not labs_named(a.partition("=")[0], labs)]
                if unknown:
                    raise ValueError(f"--assignment {unknown[0]}: no such lab in this run "
                                     f"(its labs: {', '.join(labs)})")
                canvas_columns(labs, roster, args.assignment)
            except ValueError as err:
                return usage(str(err))
        return _grade(args, solutions, submissions, labs, (roster, rows, notices), run_as,
                      unpacked)


def _grade(args, solutions, submissions, labs, who, run_as, unpacked) -> int:
    hidden = [solutions.resolve(), Path.home()]
    try:
        hidden.append(find_root(solutions))
    except FileNotFoundError:
        pass
    box = probe(hidden) if not args.no_sandbox else Sandbox(False, "--no-sandbox", run_as=run_as)
    line = box.describe()
    print(line, flush=True)                  # the first line says what protects you
    if not box.available and not args.no_sandbox:
        print(f"mgpu-lab grade: {NO_SANDBOX.format(reason=box.reason)}", file=sys.stderr)
        return 2
    limits = Limits(memory_gib=args.memory)
    try:
        grades = grade_class(submissions, labs, box, limits, args.timeout, args.total_timeout,
                             args.jobs, progress=not args.quiet)
    except KeyboardInterrupt:
        print("mgpu-lab grade: interrupted; nothing written", file=sys.stderr)
        return 130
    for g in grades:                  # a download's notebook, named after the zip it came in
        if g.path.startswith(unpacked):
            g.path = str(Path(g.path).name)
    book = Gradebook(grades, lab_points(labs), args.policy,
                     labs if args.lab else None)
    roster, rows, notices = who
    book.roster_rows = {s: row for s, row in rows.items() if s in book.entries}
    graded = [row for s, row in book.roster_rows.items() if book.entries[s]]
    book.notices = notices + [f"missing: {roster.label(i)}: in the roster, nothing graded"
                              for i, row in enumerate(roster.rows if roster else [])
                              if not any(r is row for r in graded)]
    if args.details:
        print_details(book)
    print_summary(book, line)
    for path, write in ((args.json, lambda p: write_json(book, p, line)),
                        (args.csv, lambda p: write_csv(book, p)),
                        (args.report, lambda p: write_report(book, p, line)),
                        (args.feedback, lambda p: write_feedback(book, p))):
        if path:
            write(path)
    if args.canvas:
        strangers, warnings = write_canvas_csv(book, args.canvas, roster, args.assignment)
        for student in strangers:
            print(f"mgpu-lab grade: {student} is not in the roster: added at the end of "
                  f"{args.canvas} with the id Canvas gave (or none)", file=sys.stderr)
        for warning in warnings:
            print(f"mgpu-lab grade: warning: {warning}", file=sys.stderr)
    if args.canvas_feedback:
        zips, skipped = write_canvas_feedback(book, args.canvas_feedback)
        for why in skipped:
            print(f"mgpu-lab grade: no Canvas feedback for {why}", file=sys.stderr)
        for path in zips:
            print(f"{path}: upload it to the lab's assignment in Canvas (Re-Upload Submissions)")
    if args.nbgrader:
        count, skipped = write_nbgrader(book, args.nbgrader, args.nbgrader_assignment)
        for why in skipped:
            print(f"mgpu-lab grade: not in the nbgrader gradebook: {why}", file=sys.stderr)
        print(f"{count} scores written to {args.nbgrader} (nbgrader export reads them)")
    failed = [g for g in grades if g.error and g.error.startswith("GraderError")]
    for g in failed:
        print(f"mgpu-lab grade: could not grade {g.path}: {g.error}", file=sys.stderr)
    return 1 if failed else 0


def add_parser(subparsers) -> None:
    from ..grading import grader
    p = subparsers.add_parser("grade", help="score a class's notebooks (sandboxed)",
                              description=grader.__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="notebooks, class folders (DIR/<student>/..., flat DIR/*.ipynb), or "
                        "a Canvas submissions download (its zip or its folder)")
    p.add_argument("--root", help="the course checkout (default: found from cwd)")
    p.add_argument("--solutions", help="instructor notebooks (default: ROOT/solutions)")
    p.add_argument("--lab", nargs="+", metavar="NN", help="grade only these labs of the folder")
    p.add_argument("--policy", choices=POLICIES, default="best",
                   help="of several notebooks for one lab, which counts (best)")
    p.add_argument("--json", metavar="FILE", help="everything, per exercise, as JSON")
    p.add_argument("--csv", metavar="FILE", help="one row per student, a column per lab "
                   "and per exercise")
    p.add_argument("--report", metavar="FILE", help="the instructor's report: the summary, "
                   "then every notebook's details")
    p.add_argument("--details", action="store_true",
                   help="print every notebook's details above the summary")
    p.add_argument("--feedback", metavar="DIR", help="DIR/<student>/<lab>.md for each student")
    p.add_argument("--canvas-feedback", metavar="DIR", help="DIR/<lab>.zip of plain-text "
                   "feedback named for Canvas's Re-Upload Submissions (a Canvas download's "
                   "notebooks)")
    p.add_argument("--roster", metavar="CSV", help="who the students are (Canvas's gradebook "
                   "export, or any CSV with a folder/ID/SIS Login ID column)")
    p.add_argument("--canvas", metavar="FILE", help="Canvas's gradebook import CSV (with "
                   "--roster: its identity columns and assignment columns)")
    p.add_argument("--assignment", action="append", default=[], metavar="LAB=ID|TITLE",
                   help="the Canvas assignment of a lab's column (06=5006, or "
                        "\"06=Lab 6: Gradient accumulation\"); repeat it per lab (default: "
                        "the roster's one column whose title names the lab: Lab 6, Lab-06, 6. ...)")
    p.add_argument("--nbgrader", metavar="DB", help="write the scores into this nbgrader "
                   "gradebook (gradebook.db), where `nbgrader export` reads them")
    p.add_argument("--nbgrader-assignment", metavar="NAME",
                   help="the nbgrader assignment (default: each notebook's folder)")
    p.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (1)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per cell (120)")
    p.add_argument("--total-timeout", type=float, default=1800.0,
                   help="seconds per notebook (1800)")
    p.add_argument("--memory", type=float, default=8.0,
                   help="GiB of memory per notebook's sandbox (8)")
    p.add_argument("--no-sandbox", action="store_true",
                   help="run submissions with your permissions (trusted notebooks only)")
    p.add_argument("--run-as", metavar="USER", help="with --no-sandbox, as root: run the "
                   "kernels as USER (e.g. nobody), who must not be able to read the solutions")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_grade)
