"""What grading costs: the sandbox's overhead, and a class of 20 notebooks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_grader.py

Options: --lab NN_name (the solution graded in and out of the sandbox, default
01_data_parallel), --repeats R (default 3, alternating sandbox/no sandbox),
--students N (default 20), --class-notebook / --class-solutions (what each
student hands in, default the toy lab of tests/data/grader: a kernel start and
two graded cells, so the figure is the grader's own cost per notebook).

Prints (a) the median time to grade the solution with and without the
bubblewrap sandbox, and their ratio (target: <= 1.5x); (b) seconds per notebook
for the class with --jobs 1 and --jobs 2; then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from mgpu_lab.course.classroom import find_submissions, grade_class
from mgpu_lab.course.grader import load_solutions
from mgpu_lab.course.sandbox import Limits, Sandbox, probe

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "tests" / "data" / "grader"


def timed_grade(submissions, labs, box, jobs=1):
    start = time.perf_counter()
    grades = grade_class(submissions, labs, box, Limits(), 300.0, 1800.0, jobs, progress=False)
    return time.perf_counter() - start, grades


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lab", default="01_data_parallel")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--students", type=int, default=20)
    p.add_argument("--class-notebook", type=Path, default=TOY / "submissions" / "full" / "toy.ipynb")
    p.add_argument("--class-solutions", type=Path, default=TOY / "solutions")
    args = p.parse_args()

    box = probe([ROOT, Path.home()])
    print(box.describe())
    off = Sandbox(False, "benchmark baseline")
    labs = load_solutions(ROOT / "solutions")
    solution = [("teacher", ROOT / "solutions" / f"{args.lab}.ipynb")]
    times = {"sandbox": [], "none": []}
    for _ in range(args.repeats):
        for name, b in (("none", off), ("sandbox", box)):
            if name == "sandbox" and not box.available:
                continue
            seconds, grades = timed_grade(solution, labs, b)
            g = grades[0]
            assert g.score == g.max_score > 0, (name, g)
            times[name].append(seconds)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    ratio = med["sandbox"] / med["none"] if "sandbox" in med else None
    print(f"\n(a) grading solutions/{args.lab}.ipynb, median of {args.repeats}")
    print(f"{'':<12} {'seconds':>8} {'ratio':>7}")
    for name in ("none", "sandbox"):
        if name in med:
            print(f"{name:<12} {med[name]:8.1f} {med[name] / med['none']:6.2f}x")
    if ratio is not None:
        print(f"sandbox / no sandbox: {ratio:.2f}x (target <= 1.5x): "
              f"{'ok' if ratio <= 1.5 else 'OVER'}")

    per_notebook = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.students):
            shutil.copy(args.class_notebook, Path(tmp) / f"student{i:02d}.ipynb")
        submissions = find_submissions([tmp])
        class_labs = load_solutions(args.class_solutions)
        for jobs in (1, 2):
            seconds, grades = timed_grade(submissions, class_labs, box, jobs)
            assert all(g.score == g.max_score > 0 for g in grades), grades
            per_notebook[jobs] = seconds / len(submissions)
    print(f"\n(b) a class of {args.students} notebooks ({args.class_notebook.name}), "
          f"{'sandboxed' if box.available else 'no sandbox'}")
    print(f"{'jobs':<6} {'s/notebook':>10} {'speed-up':>9}")
    for jobs, s in per_notebook.items():
        print(f"{jobs:<6} {s:10.2f} {per_notebook[1] / s:8.2f}x")
    print(json.dumps({"bench": "grader", "lab": args.lab, "sandbox": box.available,
                      "grade_s": {k: round(v, 2) for k, v in med.items()},
                      "sandbox_ratio": round(ratio, 3) if ratio else None,
                      "class_students": args.students,
                      "class_s_per_notebook": {f"jobs{j}": round(s, 2)
                                               for j, s in per_notebook.items()}}))


if __name__ == "__main__":
    main()
