"""Grading a lab as Gradescope runs it, on half a CPU core: is it within the 10 minutes?

    OMP_NUM_THREADS=1 python benchmarks/bench_platforms.py [--labs 00 06 13] [--cores 0.5]

For each lab: ``mgpu-lab export gradescope LAB``, the zip unzipped into a root laid out as
Gradescope's, the lab's solution as the submission, and ``run_autograder`` run under a
cgroup CPU quota of ``--cores`` cores (v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``; root
only; else one core by taskset). Prints each lab's wall time, the ``execution_time`` the
autograder reports, its score, and the share of Gradescope's default limit (600 s) used.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from time import monotonic

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 600.0


def quota(cores: float, name: str):
    """``(command prefix, what, cleanup)`` for a CPU quota of ``cores``."""
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
    if (v2 / "cgroup.controllers").exists():
        where, knob, value = v2 / name, "cpu.max", f"{int(cores * 100000)} 100000"
    else:
        where, knob, value = v1 / name, "cpu.cfs_quota_us", str(int(cores * 100000))
    try:
        where.mkdir()
        (where / knob).write_text(value)
        return (["/bin/sh", "-c", f'echo $$ > "{where / "cgroup.procs"}" && exec "$@"', "sh"],
                f"{cores:g} core (cgroup quota)", where)
    except OSError:
        return (["taskset", "-c", "0"] if shutil.which("taskset") else []), "one core (taskset)", None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labs", nargs="+", default=["00", "06", "13"])
    parser.add_argument("--cores", type=float, default=0.5)
    args = parser.parse_args()
    prefix, what, cgroup = quota(args.cores, f"mgpu-lab-bench-{os.getpid()}")
    print(f"run_autograder on {what}; Gradescope's default limit: {LIMIT:g} s")
    print(f"{'lab':<28} {'wall s':>7} {'reported s':>10} {'score':>8} {'of limit':>8}")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for lab in args.labs:
                root = Path(tmp) / lab
                for part in ("source", "submission", "results"):
                    (root / part).mkdir(parents=True)
                subprocess.run([sys.executable, "-m", "mgpu_lab", "export", "gradescope", lab,
                                "-o", str(root / "a.zip"), "--root", str(ROOT)], check=True,
                               capture_output=True)
                with zipfile.ZipFile(root / "a.zip") as z:
                    z.extractall(root / "source")
                    labs = json.loads(z.read("mgpu_lab_config.json"))["labs"]
                shutil.copy(ROOT / "solutions" / f"{labs[0]}.ipynb", root / "submission")
                env = dict(os.environ, AUTOGRADER_ROOT=str(root), MGPU_LAB_PYTHON=sys.executable,
                           OMP_NUM_THREADS="1")
                start = monotonic()
                subprocess.run(prefix + ["bash", str(root / "source" / "run_autograder")],
                               env=env, capture_output=True, timeout=2 * LIMIT)
                wall = monotonic() - start
                data = json.loads((root / "results" / "results.json").read_text())
                score = sum(t.get("score", 0) for t in data.get("tests", []))
                best = sum(t.get("max_score", 0) for t in data.get("tests", []))
                print(f"{labs[0]:<28} {wall:7.1f} {data.get('execution_time', 0):10} "
                      f"{score:>4g}/{best:<3g} {wall / LIMIT:8.0%}", flush=True)
    finally:
        if cgroup is not None:
            try:
                cgroup.rmdir()
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
