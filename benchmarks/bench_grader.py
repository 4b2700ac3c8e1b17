"""What grading costs: the trusted judge against the grader before it, the sandbox, a class,
and the mutation run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_grader.py

Options: --labs (default 00_setup 01_data_parallel 06_gradient_accumulation), --before
COMMIT (the grader whose graded cells ran whole in the learner's kernel; default
c38adb1, the last commit before the trusted judge; needs this git checkout),
--repeats R (default 3), --students N (default 20), --no-mutants (skip (d)).

Prints (a) per lab, the median wall time of ``mgpu-lab grade`` on the solution, the
grader of COMMIT (its own solutions) and today's taking turns, and their ratio
(target: <= 1.3x); (b) the sandbox's overhead on one lab; (c) seconds per notebook for
a class of N toy notebooks with --jobs 1 and 2; (d) the mutation run of
tests/test_mutants.py (every lab with every mutant, --jobs 2); then one JSON line.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from mgpu_lab.course.classroom.grade import find_submissions, grade_class
from mgpu_lab.course.grading.grader import load_solutions
from mgpu_lab.course.grading.sandbox import Limits, Sandbox, probe
from mgpu_lab.measure.timing import Table, median_time, median_times, print_json

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "tests" / "data" / "grader"


def cli_grade(tree: Path, lab: str, sandbox: bool) -> None:
    """``mgpu-lab grade solutions/LAB.ipynb`` with the package and solutions of ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    args = [sys.executable, "-m", "mgpu_lab", "grade", f"solutions/{lab}.ipynb",
            "--solutions", "solutions", "--quiet"] + ([] if sandbox else ["--no-sandbox"])
    out = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    scores = re.findall(r"^solutions/\S+\s+\S+\s+([\d.]+)/([\d.]+)", out.stdout, re.M)
    assert out.returncode == 0 and scores and scores[0][0] == scores[0][1], out.stdout + out.stderr


def old_tree(commit: str, into: Path) -> Path:
    """The package and solutions as they were at ``commit`` (git archive)."""
    archive = subprocess.run(["git", "archive", commit, "mgpu_lab", "solutions"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def grade_all(submissions, labs, box, jobs=1):
    """Grade every submission; each must get full marks (the benchmark grades correct notebooks)."""
    grades = grade_class(submissions, labs, box, Limits(), 300.0, 1800.0, jobs, progress=False)
    assert all(g.score == g.max_score > 0 for g in grades), grades


def mutation_run() -> tuple:
    """``(seconds, notebooks, kill rate line)`` of tests/test_mutants.py's kill-rate test."""
    out = subprocess.run([sys.executable, "-m", "pytest", "tests/test_mutants.py", "-q", "-s",
                          "-k", "kill_rate", "-p", "no:cacheprovider"], cwd=ROOT,
                         capture_output=True, text=True, timeout=3600)
    m = re.search(r"mutation run: (\d+) notebooks graded in (\d+) s", out.stdout)
    rate = re.search(r"kill rate: .*", out.stdout)
    assert m and out.returncode == 0, out.stdout[-3000:]
    return float(m.group(2)), int(m.group(1)), rate.group(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--labs", nargs="+", default=["00_setup", "01_data_parallel",
                                                 "06_gradient_accumulation"])
    p.add_argument("--before", default="c38adb1")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--students", type=int, default=20)
    p.add_argument("--no-mutants", action="store_true")
    args = p.parse_args()

    box = probe([ROOT, Path.home()])
    print(box.describe())
    tables, extra = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        before = old_tree(args.before, Path(tmp))
        judge = Table(f"(a) mgpu-lab grade solutions/LAB.ipynb, {args.before} vs the trusted "
                      f"judge, median of {args.repeats}, {'sandboxed' if box.available else 'no sandbox'}",
                      {"lab": "", "before s": ".1f", "judge s": ".1f", "ratio": ".2f"})
        ratios = {}
        for lab in args.labs:
            med = median_times({"before": lambda: cli_grade(before, lab, box.available),
                                "judge": lambda: cli_grade(ROOT, lab, box.available)},
                               repeats=args.repeats, warmup=0)
            ratios[lab] = med["judge"] / med["before"]
            judge.add(lab, med["before"], med["judge"], ratios[lab])
        judge.print()
        print(f"judge / before: {max(ratios.values()):.2f}x at most (target <= 1.3x)")
        tables.append(judge)
        extra["judge_ratio"] = {k: round(v, 3) for k, v in ratios.items()}

    labs = load_solutions(ROOT / "solutions")
    if box.available:
        solution = [("teacher", ROOT / "solutions" / f"{args.labs[0]}.ipynb")]
        off = Sandbox(False, "benchmark baseline")
        med = median_times({name: (lambda b=b: grade_all(solution, labs, b))
                            for name, b in {"none": off, "sandbox": box}.items()},
                           repeats=args.repeats, warmup=0)
        sand = Table(f"(b) grading solutions/{args.labs[0]}.ipynb in and out of the sandbox",
                     {"sandbox": "", "seconds": ".1f", "ratio": ".2f"})
        for name, t in med.items():
            sand.add(name, t, t / med["none"])
        sand.print()
        tables.append(sand)
        extra["sandbox_ratio"] = round(med["sandbox"] / med["none"], 3)

    per_notebook = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.students):
            shutil.copy(TOY / "submissions" / "full" / "toy.ipynb", Path(tmp) / f"student{i:02d}.ipynb")
        submissions, class_labs = find_submissions([tmp]), load_solutions(TOY / "solutions")
        for jobs in (1, 2):
            seconds = median_time(lambda: grade_all(submissions, class_labs, box, jobs),
                                  repeats=1, warmup=0)
            per_notebook[jobs] = seconds / len(submissions)
    klass = Table(f"(c) a class of {args.students} toy notebooks, "
                  f"{'sandboxed' if box.available else 'no sandbox'}",
                  {"jobs": "", "s/notebook": ".2f", "speed-up": ".2f"})
    for jobs, s in per_notebook.items():
        klass.add(jobs, s, per_notebook[1] / s)
    klass.print()
    tables.append(klass)
    extra["class_s_per_notebook"] = {f"jobs{j}": round(s, 2) for j, s in per_notebook.items()}

    if not args.no_mutants:
        seconds, notebooks, rate = mutation_run()
        print(f"(d) the mutation run: {notebooks} notebooks graded in {seconds:.0f} s; {rate}")
        extra.update(mutation_run_s=seconds, mutation_notebooks=notebooks)
    print_json("bench_grader", tables, sandbox=box.available, **extra)


if __name__ == "__main__":
    main()
