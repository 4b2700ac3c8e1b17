"""Where the test suite's CPU goes, by kind of process (kernels, judges, runners, ranks...).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/suite_cpu.py [COMMAND...]

COMMAND defaults to the suite as ``./run.sh test`` runs it (two xdist workers). Runs it,
reads ``/proc`` every 50 ms and keeps, for each process started after this script, its
CPU seconds (user + system, the last value seen) and its first command line. Prints the
CPU per kind of process (sorted), the notebook kernels' start-up floor, and one JSON
line. Linux only. The polling costs about a tenth of a core, and a process that lives
less than 50 ms is missed: the total is a little below a cgroup's count.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

SUITE = [sys.executable, "-m", "pytest", "-p", "mgpu_lab.course", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder",
         "tests", "solutions", "--nbval", "--nbval-current-env", "--nbval-cell-timeout=300",
         "--nbval-sanitize-with", "solutions/sanitize.cfg", "-q", "-p", "no:cacheprovider"]
# (kind, a piece of its command line), first match wins. A forked rank keeps its parent's.
KINDS = [("notebook kernels and their forked ranks", "ipykernel_launcher"),
         ("notebook kernels and their forked ranks", "course.grading.warm_kernel"),  # forks of the zygote
         ("judges (zygotes and their forks)", "judge"),
         ("runners (one per graded notebook)", "course.grading.runner"),
         ("mgpu-lab commands", "mgpu_lab"), ("mgpu-lab commands", "mgpu-lab"),
         ("torchrun agents", "torch.distributed.run"), ("torchrun agents", "torchrun"),
         ("spawned ranks", "multiprocessing"),
         ("test processes and their forked ranks", "exec(eval(sys.stdin.readline()))"),
         ("pytest", "pytest"), ("JupyterLab and Chromium", "jupyter"), ("JupyterLab and Chromium", "chrom")]


def kind(cmd: str) -> str:
    return next((k for k, piece in KINDS if piece in cmd), "scripts and other processes")


def watch(cmd):
    """``cmd``'s exit status and ``{(pid, start): [cpu seconds, command line]}`` of every process
    started while it ran."""
    tick = os.sysconf("SC_CLK_TCK")
    since = float(open("/proc/uptime").read().split()[0]) * tick
    seen, me = {}, str(os.getpid())
    proc = subprocess.Popen(cmd, stdout=sys.stderr)
    while proc.poll() is None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid == me:
                continue
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1].split()
                if int(fields[19]) < since:
                    continue
                entry = seen.setdefault((pid, fields[19]), [0.0, ""])
                entry[0] = max(entry[0], (int(fields[11]) + int(fields[12])) / tick)
                entry[1] = entry[1] or open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
            except (OSError, IndexError):
                continue
        time.sleep(0.05)
    return proc.returncode, seen


def main() -> int:
    cmd = sys.argv[1:] or SUITE
    start = time.monotonic()
    code, seen = watch(cmd)
    wall = time.monotonic() - start
    by_kind = defaultdict(lambda: [0.0, 0])
    kernels = defaultdict(list)           # one connection file per kernel; its forked ranks share it
    for (pid, _), (cpu, line) in seen.items():
        by_kind[kind(line)][0] += cpu
        by_kind[kind(line)][1] += 1
        if "ipykernel_launcher" in line:       # kernels started cold (warm ones, the
            kernels[line].append((int(pid), cpu))  # zygote's forks, are in their kind's total)
    total = sum(c for c, _ in by_kind.values())
    print(f"{'CPU s':>8} {'procs':>6}  kind")
    for name, (cpu, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"{cpu:8.1f} {n:6d}  {name}")
    firsts = [min(ps)[1] for ps in kernels.values()]
    median = statistics.median(firsts) if firsts else 0.0
    print(f"{total:8.1f} {len(seen):6d}  in all, {wall:.0f} s of wall time")
    print(f"kernels: {len(kernels)}, their own processes {sum(firsts):.1f} s of CPU (median {median:.2f} s each)")
    print(json.dumps({"wall_s": round(wall, 1), "cpu_s": round(total, 1), "kernels": len(kernels),
                      "kernel_median_cpu_s": round(median, 2),
                      "by_kind": {k: round(v[0], 1) for k, v in by_kind.items()}, "exit": code}))
    return code


if __name__ == "__main__":
    sys.exit(main())
