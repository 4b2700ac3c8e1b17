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
import shutil
import tempfile
from pathlib import Path

from mgpu_lab.course.classroom import find_submissions, grade_class
from mgpu_lab.course.grader import load_solutions
from mgpu_lab.course.sandbox import Limits, Sandbox, probe
from mgpu_lab.measure.timing import Table, median_time, median_times, print_json

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "tests" / "data" / "grader"


def grade_all(submissions, labs, box, jobs=1):
    """Grade every submission; each must get full marks (the benchmark grades correct notebooks)."""
    grades = grade_class(submissions, labs, box, Limits(), 300.0, 1800.0, jobs, progress=False)
    assert all(g.score == g.max_score > 0 for g in grades), grades


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
    boxes = {"none": off, "sandbox": box} if box.available else {"none": off}
    med = median_times({name: (lambda b=b: grade_all(solution, labs, b)) for name, b in boxes.items()},
                       repeats=args.repeats, warmup=0)  # alternating, no sandbox first
    ratio = med["sandbox"] / med["none"] if "sandbox" in med else None
    grading = Table(f"(a) grading solutions/{args.lab}.ipynb, median of {args.repeats}",
                    {"sandbox": "", "seconds": ".1f", "ratio": ".2f"})
    for name, t in med.items():
        grading.add(name, t, t / med["none"])
    grading.print()
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
            seconds = median_time(lambda: grade_all(submissions, class_labs, box, jobs), repeats=1, warmup=0)
            per_notebook[jobs] = seconds / len(submissions)
    klass = Table(f"(b) a class of {args.students} notebooks ({args.class_notebook.name}), "
                  f"{'sandboxed' if box.available else 'no sandbox'}",
                  {"jobs": "", "s/notebook": ".2f", "speed-up": ".2f"})
    for jobs, s in per_notebook.items():
        klass.add(jobs, s, per_notebook[1] / s)
    klass.print()
    print_json("bench_grader", [grading, klass], lab=args.lab, sandbox=box.available,
               grade_s={k: round(v, 2) for k, v in med.items()},
               sandbox_ratio=round(ratio, 3) if ratio else None, target_met=ratio <= 1.5 if ratio else None,
               class_students=args.students,
               class_s_per_notebook={f"jobs{j}": round(s, 2) for j, s in per_notebook.items()})


if __name__ == "__main__":
    main()
