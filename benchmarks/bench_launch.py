"""Launcher benchmarks: start-up time per start method, overhead over torchrun, a soak.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_launch.py             # all three
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_launch.py --only a    # or b, or c

(a) start-up: wall time of ``launch(fn, nprocs=2)`` for a function that returns at
    once (processes started, process group joined, values back, processes gone),
    per start method: fork (the default while CUDA is not initialised here),
    forkserver (the default once it is: the first launch starts the server and
    imports torch there, the later ones fork from it) and spawn (a fresh
    interpreter per rank every time). Median of --repeats launches (target: fork
    and a warm forkserver <= 2 s).
(b) examples/ddp_train.py through ``mgpu-lab launch`` vs plain torchrun, median
    step time ratio (target <= 1.03). Runs alternate, 5 of each, 1000 steps.
(c) soak: 50 consecutive 2-rank launch() calls from one process
    (target 0 failures, 0 orphans).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from mgpu_lab import backend, launch
from mgpu_lab.measure.timing import Table, print_json
from mgpu_lab.runtime.torchrun import free_port

ROOT = Path(__file__).resolve().parents[1]


def past_init():
    return time.time()  # launch() calls fn only after init_process_group returned


def seconds_to_launch(start_method):
    start = time.perf_counter()
    launch(past_init, nprocs=2, start_method=start_method, timeout=120)
    return time.perf_counter() - start


def bench_startup(repeats):
    """Rows (method, first launch s, median of the later ones s)."""
    rows = []
    for method in ("forkserver", "fork", "spawn"):  # forkserver first: its first launch starts the server
        first = seconds_to_launch(method)
        later = [seconds_to_launch(method) for _ in range(repeats)]
        rows.append((method, first, statistics.median(later)))
    return rows


def run_training(command, steps):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command + [str(ROOT / "examples" / "ddp_train.py"), "--steps", str(steps)],
                         env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["median_step_s"]


def bench_overhead(steps=1000, repeats=5):
    ours = [sys.executable, "-m", "mgpu_lab", "launch", "--nproc-per-node", "2"]
    plain = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d"]
    mine, theirs = [], []
    for _ in range(repeats):
        mine.append(run_training(ours, steps))
        theirs.append(run_training(plain + [f"--rdzv-endpoint=127.0.0.1:{free_port()}"], steps))
    return statistics.median(mine), statistics.median(theirs)


def children_of(pid):
    """Living children of ``pid``, the forkserver (which stays, by design) excepted."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] not in "ZX" and b"forkserver" not in cmdline:
                kids.append(int(entry))
    return kids


def bench_soak(runs=50):
    failures = 0
    for _ in range(runs):
        try:
            assert launch(past_init, nprocs=2, timeout=60)
        except Exception as exc:  # count every kind of failure, keep soaking
            failures += 1
            print("failure:", exc, file=sys.stderr)
    time.sleep(0.5)
    return failures, len(children_of(os.getpid()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["a", "b", "c"])
    parser.add_argument("--repeats", type=int, default=5, help="(a): launches per start method after the first")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, backend {backend()}")
    tables, summary = [], {}
    if args.only in (None, "a"):
        table = Table(f"(a) launch() of a 2-rank no-op, seconds (later: median of {args.repeats})",
                      {"start method": "", "first": ".3f", "later": ".3f"})
        for row in bench_startup(args.repeats):
            table.add(*row)
        table.print()
        tables.append(table)
    if args.only in (None, "b"):
        mine, theirs = bench_overhead()
        table = Table("(b) examples/ddp_train.py step time, median of 5 runs",
                      {"launcher": "", "step ms": ".3f", "vs torchrun": ".3f"})
        table.add("mgpu-lab launch", mine * 1e3, mine / theirs)
        table.add("plain torchrun", theirs * 1e3, 1.0)
        table.print()
        tables.append(table)
        summary["overhead_ratio"] = mine / theirs
    if args.only in (None, "c"):
        failures, orphans = bench_soak()
        print(f"\n(c) soak: 50 launches: {failures} failures, {orphans} orphans (target 0 / 0)")
        summary.update(soak_failures=failures, soak_orphans=orphans)
    print_json("bench_launch", tables, **summary)


if __name__ == "__main__":
    main()
