"""The tour: run every solution notebook headless, in order, and say how it went.

    mgpu-lab tour [--only NN ...] [--root DIR | --solutions DIR] [--timeout SECONDS]

Each notebook is read into memory and run in a fresh kernel whose working
folder is the notebook's own (as under nbval and in JupyterLab), with the
autograder's limits; outputs are never written back to ``solutions/``. A lab is
``ok`` when no cell raised (cells tagged ``raises-exception`` excepted) and
every graded cell passed. The exit status is 1 when any lab failed, 2 on bad
usage. On a machine with GPUs the same notebooks use them: this is the headless
main job.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from time import monotonic
from typing import List, Optional, Sequence

import nbformat

from ..grading.kernel import run_notebook
from ..notebook.cells import nbgrader_meta
from ..notebook.layout import course_dir


@dataclass
class LabRun:
    lab: str
    seconds: float
    passed: int          # graded cells that passed
    total: int           # graded cells
    failure: str = ""    # first failing cell, for the reader

    @property
    def ok(self) -> bool:
        return not self.failure


def select(solutions: Path, only: Optional[Sequence[str]] = None) -> List[Path]:
    """Solution notebooks in order; ``only`` keeps those whose name starts NN_."""
    notebooks = sorted(Path(solutions).glob("*.ipynb"))
    if not only:
        return notebooks

    def named(p: Path, n: str) -> bool:
        return p.name.split("_")[0] == n or p.stem == n

    chosen = [p for p in notebooks if any(named(p, n) for n in only)]
    unknown = [n for n in only if not any(named(p, n) for p in notebooks)]
    if unknown:
        raise ValueError(f"no solution notebook for {', '.join(unknown)} in {solutions}")
    return chosen


def run_lab(path: Path, timeout: float = 300.0, progress: bool = True) -> LabRun:
    """Run one solution notebook (cwd = its folder, as under nbval); never raises for its errors."""
    start = monotonic()
    nb = nbformat.read(path, as_version=4)  # an in-memory copy: outputs are never written back
    results = run_notebook(nb, cwd=path.parent, timeout=timeout, desc=path.stem, progress=progress)
    graded = [r for r in results if nbgrader_meta(nb.cells[r.index]).get("grade")]
    bad = [r for r in results if bool(r.error) != r.expected_error]
    failure = ""
    if bad:
        r = bad[0]
        failure = (f"cell {r.index}: {r.error}: {r.message}" if r.error
                   else f"cell {r.index}: tagged raises-exception but raised nothing")
    return LabRun(path.stem, monotonic() - start,
                  sum(1 for r in graded if not r.error), len(graded), failure)


def print_table(runs: List[LabRun], file=None) -> None:
    file = file or sys.stdout
    width = max([len("lab")] + [len(r.lab) for r in runs])
    print(f"{'lab':<{width}}  {'seconds':>7}  {'graded':>7}  result", file=file)
    for r in runs:
        print(f"{r.lab:<{width}}  {r.seconds:7.1f}  {f'{r.passed}/{r.total}':>7}  "
              f"{'ok' if r.ok else 'FAILED'}", file=file)
    graded = f"{sum(r.passed for r in runs)}/{sum(r.total for r in runs)}"
    print(f"{'total':<{width}}  {sum(r.seconds for r in runs):7.1f}  {graded:>7}  "
          f"{sum(r.ok for r in runs)}/{len(runs)} ok", file=file)
    for r in runs:
        if not r.ok:
            print(f"{r.lab}: {r.failure}", file=file)


def _cmd_tour(args) -> int:
    from tqdm.auto import tqdm
    try:
        args.solutions = course_dir(args, "solutions")
        notebooks = select(args.solutions, args.only)
    except (ValueError, FileNotFoundError) as err:
        print(f"mgpu-lab tour: {err}", file=sys.stderr)
        return 2
    if not notebooks:
        print(f"mgpu-lab tour: no notebooks in {args.solutions}", file=sys.stderr)
        return 2
    runs = []
    try:
        with tqdm(notebooks, desc="tour", unit="lab", file=sys.stderr) as bar:
            for path in bar:
                bar.set_postfix_str(path.stem)
                runs.append(run_lab(path, timeout=args.timeout))
    except KeyboardInterrupt:
        print("mgpu-lab tour: interrupted", file=sys.stderr)
        print_table(runs)
        return 130
    print_table(runs)
    return 0 if all(r.ok for r in runs) else 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("tour", help="run every solution notebook, headless",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="NN", help="just these labs (00 01 ... or names)")
    p.add_argument("--root", type=Path, help="the course checkout (default: found from cwd)")
    p.add_argument("--solutions", type=Path, help="default: ROOT/solutions")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per cell (300)")
    p.set_defaults(func=_cmd_tour)
