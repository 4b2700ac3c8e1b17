"""Launcher benchmarks: start-up time, overhead over torchrun, and a soak.

    python benchmarks/bench_launch.py            # all three
    python benchmarks/bench_launch.py --only a   # or b, or c

(a) launch() to every rank past init_process_group, 2 processes, median of 10
    (target <= 2 s).
(b) examples/ddp_train.py through `mgpu-lab launch` vs plain torchrun, median
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

from mgpu_lab import launch
from mgpu_lab.runtime.torchrun import free_port

ROOT = Path(__file__).resolve().parents[1]


def past_init():
    return time.time()  # launch() calls fn only after init_process_group returned


def bench_startup(repeats=10):
    delays = []
    for _ in range(repeats):
        start = time.time()
        delays.append(max(launch(past_init, nprocs=2)) - start)
    return statistics.median(delays)


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
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] not in "ZX":
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
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["a", "b", "c"])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, backend "
          f"{'nccl' if torch.cuda.is_available() else 'gloo'}")
    print(f"{'benchmark':<58}{'figure':>14}  target")
    if args.only in (None, "a"):
        print(f"{'(a) launch() -> all ranks past init, 2 procs, median of 10':<58}"
              f"{bench_startup():>12.3f} s  <= 2 s")
    if args.only in (None, "b"):
        mine, theirs = bench_overhead()
        print(f"{'(b) step time, mgpu-lab launch':<58}{mine * 1e3:>11.3f} ms")
        print(f"{'    step time, plain torchrun':<58}{theirs * 1e3:>11.3f} ms")
        print(f"{'    ratio mgpu-lab launch / torchrun':<58}{mine / theirs:>14.3f}  <= 1.03")
    if args.only in (None, "c"):
        failures, orphans = bench_soak()
        print(f"{'(c) soak: 50 launches, failures / orphans':<58}{f'{failures} / {orphans}':>14}  0 / 0")


if __name__ == "__main__":
    main()
