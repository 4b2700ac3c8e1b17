"""The GPU pass: every GPU test, every lab in a kernel that touched CUDA first, the benchmarks.

    OMP_NUM_THREADS=1 python -m mgpu_lab.course.authoring.gpu_pass --out gpu-results.json

What a GPU machine must show, in one command and one results file:

1. the benchmarks a GPU changes (``--benchmarks``; default: mixed precision, activation
   checkpointing, DataParallel), one at a time with the GPU to themselves, first, so
   that their timings see no other work; the last JSON line of each is kept;
2. ``pytest -m gpu tests`` (the tests marked ``gpu`` are skipped without CUDA);
3. every ``solutions/*.ipynb``, each in a fresh kernel whose first cell initialises
   CUDA (``torch.cuda.init()`` and one tensor on the GPU) before the lab's own cells:
   the design promises that a lab works "also when an earlier cell of the same kernel
   already used the GPU" (``launch`` must then leave fork for a forkserver); the lab
   passes when no cell raised and every graded cell passed (as ``mgpu-lab tour``). The
   text printed by each cell that asks about CUDA is kept (``gpu_cells``): the labs'
   GPU figures. Steps 2 and 3 share ``--jobs`` processes (the labs' multi-rank cells
   run on gloo: NCCL refuses two ranks on one GPU).

The file: ``{"device", "date", "torch", "cuda", "benchmarks", "pytest", "labs", "ok"}``,
written after each step (a crash or a kill keeps what finished). ``--budget S`` starts
nothing after S seconds (what was left is listed as not run), so the pass fits a lease
of GPU time. Exit status 0 when all passed, 1 otherwise, 2 when there is no GPU
(``--allow-cpu`` runs anyway, for trying it on a laptop).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from datetime import datetime, timezone
from multiprocessing import get_context
from pathlib import Path
from typing import List, Optional, Sequence

import nbformat

TOUCH_CUDA = "import torch\ntorch.cuda.init()\n_ = torch.empty(1, device='cuda')"
ROOT = Path(__file__).resolve().parents[3]
GPU_BENCHMARKS = ("bench_amp", "bench_checkpointing", "bench_data_parallel")
ASKS_ABOUT_CUDA = re.compile(r"cuda\.(is_available|device_count)")
KEPT_CHARS = 4000  # of each GPU cell's text, and of a failing step's output
# Labs run without the CUDA cell, and why (their results line says so).
WITHOUT_CUDA_FIRST = {
    "09_lightning": "run in a kernel that did not touch CUDA: Lightning's ddp_notebook forks the kernel, which "
                    "CUDA forbids once initialised (Lightning has no fallback; the lab says so)",
}


def last_json_line(text: str) -> Optional[dict]:
    """The last line of ``text`` that parses as a JSON object (a benchmark's summary)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def with_first_cell(nb, source: str):
    """A copy of ``nb`` whose first cell runs ``source`` (the lab's cells follow, unchanged)."""
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    nb.cells.insert(0, nbformat.v4.new_code_cell(source))
    return nb


def cell_text(cell) -> str:
    """What a code cell printed: its streams and plain-text results, no images."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
        elif out.get("output_type") == "error":
            parts.append(f"{out.get('ename')}: {out.get('evalue')}")
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts)[:KEPT_CHARS]


def run_lab(path: Path, first_cell: str = TOUCH_CUDA, timeout: float = 600.0) -> dict:
    """Run one solution notebook after ``first_cell``; outputs are never written back."""
    from ..grading.kernel import run_notebook
    from ..notebook.cells import nbgrader_meta
    start = time.monotonic()
    note = WITHOUT_CUDA_FIRST.get(path.stem, "")
    nb = with_first_cell(nbformat.read(path, as_version=4), "import torch" if note else first_cell)
    results = run_notebook(nb, cwd=path.parent, timeout=timeout, desc=path.stem, progress=False)
    bad = [r for r in results if bool(r.error) != r.expected_error]
    graded = [r for r in results if nbgrader_meta(nb.cells[r.index]).get("grade")]
    failure = ""
    if bad:
        r = bad[0]
        where = "the CUDA cell" if r.index == 0 else f"cell {r.index - 1}"
        failure = f"{where}: {r.error}: {r.message}" if r.error else f"{where}: tagged raises-exception, raised nothing"
    gpu_cells = [{"cell": i - 1, "text": cell_text(c)} for i, c in enumerate(nb.cells)
                 if i > 0 and c.cell_type == "code" and ASKS_ABOUT_CUDA.search(c.source)]
    return {"lab": path.stem, "ok": not failure, "seconds": round(time.monotonic() - start, 1),
            "graded": f"{sum(1 for r in graded if not r.error)}/{len(graded)}", "failure": failure[:KEPT_CHARS],
            "gpu_cells": gpu_cells, "note": note}


def run_script(argv: Sequence[str], timeout: float, cwd: Path) -> dict:
    """Run a command; its status, duration, last JSON line and the tail of its output."""
    start = time.monotonic()
    try:
        done = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = "timeout", e.stdout or "", f"timed out after {timeout} s"
        out = out.decode() if isinstance(out, bytes) else out
    return {"command": " ".join(map(str, argv)), "ok": code == 0, "status": code,
            "seconds": round(time.monotonic() - start, 1), "summary": last_json_line(out),
            "tail": (out + err)[-KEPT_CHARS:]}


def device_info() -> dict:
    import torch
    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if cuda else "no GPU (CPU only)",
            "gpus": torch.cuda.device_count() if cuda else 0, "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def gpu_pass(out: Path, root: Path = ROOT, notebooks: Optional[List[Path]] = None,
             benchmarks: Optional[List[Path]] = None, pytest_args: Sequence[str] = ("-m", "gpu", "tests"),
             first_cell: str = TOUCH_CUDA, timeout: float = 600.0, jobs: int = 1,
             budget: Optional[float] = None) -> dict:
    """Run the three steps, writing ``out`` after each; returns the results."""
    root = Path(root)
    start = time.monotonic()
    notebooks = sorted((root / "solutions").glob("*.ipynb")) if notebooks is None else notebooks
    if benchmarks is None:
        benchmarks = [root / "benchmarks" / f"{name}.py" for name in GPU_BENCHMARKS]
    results = {**device_info(), "benchmarks": [], "pytest": None, "labs": [], "not_run": [], "ok": False}

    def in_budget(what: str) -> bool:
        if _within(start, budget):
            return True
        results["not_run"].append(what)
        return False

    def save():
        steps = results["benchmarks"] + results["labs"] + ([results["pytest"]] if results["pytest"] else [])
        results["ok"] = bool(results["pytest"] and not results["not_run"] and all(s["ok"] for s in steps))
        Path(out).write_text(json.dumps(results, indent=1) + "\n")

    for path in benchmarks:
        if in_budget(Path(path).name):
            results["benchmarks"].append(run_script([sys.executable, str(path)], timeout, root))
            print(f"benchmark {Path(path).name}: {'ok' if results['benchmarks'][-1]['ok'] else 'FAILED'}", flush=True)
        save()
    tasks = {}  # name -> (function, arguments): the GPU tests, then each lab
    if in_budget("pytest"):
        tasks["pytest"] = (run_script, ([sys.executable, "-m", "pytest", "-p", "mgpu_lab.course", "-q", "-p", "no:cacheprovider",
                                         *pytest_args], timeout * 6, root))
    for path in notebooks:  # a lab not started within the budget is not run
        tasks[Path(path).stem] = (_lab_in_budget, (Path(path), first_cell, timeout, start, budget))

    def record(name, result):
        if name == "pytest":
            results["pytest"] = result
        elif result is None:
            results["not_run"].append(name)
        else:
            results["labs"].append(result)
            print(f"lab {name}: {'ok' if result['ok'] else 'FAILED'} ({result['seconds']} s)", flush=True)
        save()

    if jobs <= 1:
        for name, (fn, args) in tasks.items():
            record(name, fn(*args))
    else:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(fn, *args): name for name, (fn, args) in tasks.items()}
            for done in as_completed(futures):
                record(futures[done], done.result())
    results["labs"].sort(key=lambda r: r["lab"])
    save()
    return results


def _within(start: float, budget: Optional[float]) -> bool:
    """Whether a step may still begin: no budget, or fewer than ``budget`` seconds since ``start``."""
    return budget is None or time.monotonic() - start < budget


def _lab_in_budget(path: Path, first_cell: str, timeout: float, start: float, budget: Optional[float]):
    """``run_lab`` in a pool's process, or None when the budget ran out before it began."""
    return run_lab(path, first_cell, timeout) if _within(start, budget) else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mgpu_lab.course.authoring.gpu_pass", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-results.json"))
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout (solutions/, benchmarks/, tests/)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cell and per benchmark")
    parser.add_argument("--jobs", type=int, default=4, help="labs (and the GPU tests) run at a time")
    parser.add_argument("--budget", type=float, default=None, help="start nothing after this many seconds")
    parser.add_argument("--benchmarks", nargs="*", default=list(GPU_BENCHMARKS), metavar="NAME",
                        help=f"benchmarks/NAME.py to run (default: {' '.join(GPU_BENCHMARKS)})")
    parser.add_argument("--labs", nargs="*", default=None, metavar="NN",
                        help="only these labs (by number: 05 07); default every solution")
    parser.add_argument("--pytest", default="-m gpu tests", metavar="ARGS",
                        help="pytest's arguments for step 2 (default: '-m gpu tests')")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (no CUDA cell)")
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_pass: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU machine, "
              "or pass --allow-cpu to try the steps on CPU", file=sys.stderr)
        return 2
    notebooks = sorted((args.root / "solutions").glob("*.ipynb"))
    if args.labs is not None:
        notebooks = [p for p in notebooks if p.name[:2] in args.labs]
    benchmarks = [args.root / "benchmarks" / f"{name}.py" for name in args.benchmarks]
    first = TOUCH_CUDA if torch.cuda.is_available() else "import torch"
    results = gpu_pass(args.out, root=args.root, notebooks=notebooks, benchmarks=benchmarks, first_cell=first,
                       pytest_args=shlex.split(args.pytest),
                       timeout=args.timeout, jobs=args.jobs, budget=args.budget)
    print(f"{results['device']} {results['date']}: pytest {'ok' if results['pytest'] and results['pytest']['ok'] else 'FAILED'}, "
          f"labs {sum(r['ok'] for r in results['labs'])}/{len(results['labs'])} ok, "
          f"benchmarks {sum(r['ok'] for r in results['benchmarks'])}/{len(results['benchmarks'])} ok, "
          f"not run: {', '.join(results['not_run']) or 'none'} -> {args.out}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
