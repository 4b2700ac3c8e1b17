"""The GPU pass: every GPU test, every lab in a kernel that touched CUDA first, every benchmark.

    OMP_NUM_THREADS=1 python -m mgpu_lab.course.gpu_pass --out gpu-results.json

What a GPU machine must show, in one command and one results file:

1. ``pytest -m gpu tests`` (the tests marked ``gpu`` are skipped without CUDA);
2. every ``solutions/*.ipynb``, each in a fresh kernel whose first cell initialises
   CUDA (``torch.cuda.init()`` and one tensor on the GPU) before the lab's own cells:
   the design promises that a lab works "also when an earlier cell of the same kernel
   already used the GPU" (``launch`` must then leave fork for a forkserver); the lab
   passes when no cell raised and every graded cell passed (as ``mgpu-lab tour``);
3. every ``benchmarks/bench_*.py``, whose last JSON line is kept.

The file: ``{"device", "date", "torch", "cuda", "pytest", "labs", "benchmarks", "ok"}``,
written after each step (a crash keeps what finished). Exit status 0 when all passed, 1
otherwise, 2 when there is no GPU (``--allow-cpu`` runs anyway, for trying it on a laptop).
Costs: as long as the three together (about 15-30 minutes on one GPU).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import List, Optional, Sequence

import nbformat

TOUCH_CUDA = "import torch\ntorch.cuda.init()\n_ = torch.empty(1, device='cuda')"
ROOT = Path(__file__).resolve().parents[2]


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


def run_lab(path: Path, first_cell: str = TOUCH_CUDA, timeout: float = 600.0) -> dict:
    """Run one solution notebook after ``first_cell``; outputs are never written back."""
    from .kernel import run_notebook
    from .cells import nbgrader_meta
    start = time.monotonic()
    nb = with_first_cell(nbformat.read(path, as_version=4), first_cell)
    results = run_notebook(nb, cwd=path.parent, timeout=timeout, desc=path.stem, progress=False)
    bad = [r for r in results if bool(r.error) != r.expected_error]
    graded = [r for r in results if nbgrader_meta(nb.cells[r.index]).get("grade")]
    failure = ""
    if bad:
        r = bad[0]
        where = "the CUDA cell" if r.index == 0 else f"cell {r.index - 1}"
        failure = f"{where}: {r.error}: {r.message}" if r.error else f"{where}: tagged raises-exception, raised nothing"
    return {"lab": path.stem, "ok": not failure, "seconds": round(time.monotonic() - start, 1),
            "graded": f"{sum(1 for r in graded if not r.error)}/{len(graded)}", "failure": failure}


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
            "tail": (out + err)[-2000:]}


def device_info() -> dict:
    import torch
    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if cuda else "no GPU (CPU only)",
            "gpus": torch.cuda.device_count() if cuda else 0, "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def gpu_pass(out: Path, root: Path = ROOT, notebooks: Optional[List[Path]] = None,
             benchmarks: Optional[List[Path]] = None, pytest_args: Sequence[str] = ("-m", "gpu", "tests"),
             first_cell: str = TOUCH_CUDA, timeout: float = 600.0) -> dict:
    """Run the three steps, writing ``out`` after each; returns the results."""
    root = Path(root)
    notebooks = sorted((root / "solutions").glob("*.ipynb")) if notebooks is None else notebooks
    benchmarks = sorted((root / "benchmarks").glob("bench_*.py")) if benchmarks is None else benchmarks
    results = {**device_info(), "pytest": None, "labs": [], "benchmarks": [], "ok": False}

    def save():
        results["ok"] = bool(results["pytest"] and results["pytest"]["ok"]
                             and all(r["ok"] for r in results["labs"] + results["benchmarks"]))
        Path(out).write_text(json.dumps(results, indent=1) + "\n")

    results["pytest"] = run_script([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    *pytest_args], timeout * 6, root)
    save()
    for path in notebooks:
        results["labs"].append(run_lab(Path(path), first_cell, timeout))
        print(f"lab {Path(path).stem}: {'ok' if results['labs'][-1]['ok'] else 'FAILED'}", flush=True)
        save()
    for path in benchmarks:
        results["benchmarks"].append(run_script([sys.executable, str(path)], timeout, root))
        print(f"benchmark {Path(path).name}: {'ok' if results['benchmarks'][-1]['ok'] else 'FAILED'}", flush=True)
        save()
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mgpu_lab.course.gpu_pass", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-results.json"))
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout (solutions/, benchmarks/, tests/)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cell and per benchmark")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (no CUDA cell)")
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_pass: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU machine, "
              "or pass --allow-cpu to try the steps on CPU", file=sys.stderr)
        return 2
    first = TOUCH_CUDA if torch.cuda.is_available() else "import torch"
    results = gpu_pass(args.out, root=args.root, first_cell=first, timeout=args.timeout)
    print(f"{results['device']} {results['date']}: pytest {'ok' if results['pytest']['ok'] else 'FAILED'}, "
          f"labs {sum(r['ok'] for r in results['labs'])}/{len(results['labs'])} ok, "
          f"benchmarks {sum(r['ok'] for r in results['benchmarks'])}/{len(results['benchmarks'])} ok -> {args.out}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
