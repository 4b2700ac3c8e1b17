"""Memory of grading each lab's solution: a cgroup's peak over the whole ``mgpu-lab grade``.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py [--labs 00 13] [--limit-mib 768]
                                                        [--cores 0.5] [--memory GIB]

For each lab, ``mgpu-lab grade solutions/LAB.ipynb --jobs 1`` runs inside a memory cgroup
of its own (root only; v2 or v1, made inside this process's cgroup, as the sandbox's
cgroups are then made inside it): grader, warm zygote, judges, runner, kernel and its
ranks together, as in a Gradescope container. ``--limit-mib`` bounds it (no swap),
``--cores`` adds a CPU quota, ``--memory`` is passed to the grader (the sandbox's own
limit). Printed per lab: the cgroup's peak (page cache included, as the limit counts it),
the highest sampled anonymous + shmem memory (what cannot be reclaimed), each process
kind's proportional set size (PSS) at the sample where their sum was highest, the OOM
kills, the score and the wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from time import monotonic, sleep

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mgpu_lab.course.grading.sandbox import CGROUP_V1, CGROUP_V2, own_cgroup  # noqa: E402

ROLES = ["grader", "zygote", "judge", "runner", "kernel", "ranks"]


class Group:
    """A memory (and, with ``cores``, CPU) cgroup of this benchmark's."""

    def __init__(self, name: str, limit_mib, cores):
        self.v2 = (CGROUP_V2 / "cgroup.controllers").is_file()
        base = own_cgroup("" if self.v2 else "memory") or (CGROUP_V2 if self.v2 else CGROUP_V1 / "memory")
        self.mem = base / name
        self.mem.mkdir()
        self.dirs, self.cpu = [self.mem], None
        if limit_mib:
            value = str(int(limit_mib * 2**20))
            if self.v2:
                (self.mem / "memory.max").write_text(value)
                (self.mem / "memory.swap.max").write_text("0")
            else:
                (self.mem / "memory.limit_in_bytes").write_text(value)
                if (self.mem / "memory.memsw.limit_in_bytes").exists():
                    (self.mem / "memory.memsw.limit_in_bytes").write_text(value)
        if cores:
            if self.v2:
                (self.mem / "cpu.max").write_text(f"{int(cores * 100000)} 100000")
            else:
                self.cpu = (own_cgroup("cpu") or CGROUP_V1 / "cpu") / name
                self.cpu.mkdir()
                (self.cpu / "cpu.cfs_quota_us").write_text(str(int(cores * 100000)))
                self.dirs.append(self.cpu)

    def prefix(self):
        join = "".join(f'echo $$ > "{d / "cgroup.procs"}" && ' for d in self.dirs)
        return ["/bin/sh", "-c", join + 'exec "$@"', "sh"]

    def peak(self) -> int:
        return int((self.mem / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")).read_text())

    def unreclaimable(self) -> int:
        stat = dict(line.split() for line in (self.mem / "memory.stat").read_text().splitlines())
        keys = ("anon", "shmem") if self.v2 else ("total_rss", "total_shmem")
        return sum(int(stat.get(k, 0)) for k in keys)

    def oom_kills(self, seen: dict) -> int:
        """OOM kills in the group and the cgroups inside it so far (v1 counts each cgroup's
        own, and the sandbox's are gone when its notebook ends: ``seen`` keeps them)."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        inner = [] if self.v2 else [d for d in self.mem.rglob("*") if d.is_dir()]
        for d in [self.mem, *inner]:
            try:
                text = (d / name).read_text()
            except OSError:
                continue
            seen[str(d)] = sum(int(line.split()[1]) for line in text.splitlines()
                               if line.startswith("oom_kill "))
        return sum(seen.values())

    def pids(self):
        out = []
        for d in [self.mem, *[p for p in self.mem.rglob("*") if p.is_dir()]]:
            try:
                out += [(int(p), d != self.mem) for p in (d / "cgroup.procs").read_text().split()]
            except OSError:
                pass
        return out

    def remove(self):
        for d in self.dirs:
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except OSError:
                    sleep(0.1)


def _read(pid: int, what: str) -> str:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def roles(group: Group, grader: int):
    """``{pid: (role, pss KiB)}`` of the processes in the group now."""
    found = {}
    for pid, sandboxed in group.pids():
        stat = _read(pid, "stat")
        if not stat:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        rollup = dict(line.split()[:2] for line in _read(pid, "smaps_rollup").splitlines()[1:])
        pss, private = (int(rollup.get(k, "0:").rstrip(":") or 0) for k in ("Pss:", "Private_Dirty:"))
        found[pid] = [ppid, _read(pid, "cmdline").replace("\0", " "), sandboxed, pss, None, private]
    def role(pid, depth=0):
        ppid, cmd, sandboxed, _, known, _ = found[pid]
        if known:
            return known
        parent = role(ppid, depth + 1) if ppid in found and depth < 50 else None
        if pid == grader:
            r = "grader"
        elif sandboxed:
            r = ("runner" if "bwrap" in cmd or "grading.runner" in cmd else
                 "ranks" if parent in ("kernel", "ranks") else "kernel")
        elif parent == "grader" and "warm_kernel" in cmd:
            r = "zygote"
        else:
            r = "judge" if parent in ("zygote", "judge") or "judge" in cmd else "grader"
        found[pid][4] = r
        return r
    return {pid: (role(pid), v[3], v[5], v[1][:60]) for pid, v in found.items()}


def measure(lab: str, args, out: Path) -> dict:
    group = Group(f"mgpu-lab-mem-{os.getpid()}-{lab[:2]}", args.limit_mib, args.cores)
    argv = [sys.executable, "-m", "mgpu_lab", "grade", str(ROOT / "solutions" / f"{lab}.ipynb"),
            "--jobs", "1", "--json", str(out), "--quiet"]
    if args.memory:
        argv += ["--memory", str(args.memory)]
    if args.no_sandbox or args.run_as:
        argv.append("--no-sandbox")
    if args.run_as:
        argv += ["--run-as", args.run_as]
    # This checkout's package, from the folder (``python -m`` in ROOT): a PYTHONPATH would
    # differ from the sandbox's, and the judges would not be forks of the warm zygote.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    best = {"total": 0, "by": {}, "unreclaimable": 0}
    done, kills = threading.Event(), {}
    start = monotonic()
    proc = subprocess.Popen(group.prefix() + argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)

    def sample():
        while not done.is_set():
            try:
                now = roles(group, proc.pid)
                by = {r: sum(v[1] for v in now.values() if v[0] == r) for r in ROLES}
                if sum(by.values()) > best["total"]:
                    best["total"], best["by"] = sum(by.values()), by
                    best["procs"] = sorted((v[0], pid, v[1] // 1024, v[2] // 1024, v[3])
                                           for pid, v in now.items())
                best["unreclaimable"] = max(best["unreclaimable"], group.unreclaimable())
                group.oom_kills(kills)
            except (OSError, ValueError, KeyError, IndexError):
                pass
            done.wait(0.2)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    _, err = proc.communicate()
    wall = monotonic() - start
    done.set()
    t.join()
    row = {"lab": lab, "peak_mib": group.peak() / 2**20, "oom_kills": group.oom_kills(kills),
           "unreclaimable_mib": best["unreclaimable"] / 2**20, "wall_s": wall,
           "pss_mib": {r: v / 1024 for r, v in best["by"].items()}, "rc": proc.returncode,
           "processes": best.get("procs", [])}
    group.remove()
    try:
        nb = json.loads(out.read_text())["notebooks"][0]
        row["score"], row["max"] = nb["score"], nb["max_score"]
        row["failed"] = [f"{e['grade_id']}: {e['error']}: {e['message']}" for e in nb["exercises"]
                         if e["error"]]
    except (OSError, ValueError, KeyError, IndexError):
        row["score"], row["max"], row["failed"] = None, None, [err.decode(errors="replace")[-300:]]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labs", nargs="+", help="lab numbers or ids (default: all)")
    parser.add_argument("--limit-mib", type=float, help="the cgroup's memory limit (none)")
    parser.add_argument("--cores", type=float, help="a CPU quota, cores (none)")
    parser.add_argument("--memory", type=float, help="the grader's --memory, GiB")
    parser.add_argument("--no-sandbox", action="store_true", help="grade unsandboxed: a cold "
                        "kernel and judge, as on a platform without bubblewrap (its --run-as)")
    parser.add_argument("--run-as", help="unsandboxed, the kernel run as this user, as on a "
                        "platform without bubblewrap (this Python must be one it can run)")
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--detail", action="store_true", help="each process at the highest sample")
    args = parser.parse_args()
    labs = sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))
    if args.labs:
        labs = [lab for lab in labs if any(lab == a or lab[:2] == a.zfill(2) for a in args.labs)]
    print(f"limit {args.limit_mib or 'none'} MiB, cores {args.cores or 'all'}, "
          f"--memory {args.memory or 'default'}{', unsandboxed' if args.no_sandbox else ''}"
          f"{', kernel run as ' + args.run_as if args.run_as else ''}")
    head = " ".join(f"{r:>7}" for r in ROLES)
    print(f"{'lab':<26} {'peak':>6} {'unrecl':>6} {head} {'oom':>3} {'score':>7} {'wall s':>6}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for lab in labs:
            row = measure(lab, args, Path(tmp) / f"{lab}.json")
            rows.append(row)
            pss = " ".join(f"{row['pss_mib'].get(r, 0):7.0f}" for r in ROLES)
            score = f"{row['score']:g}/{row['max']:g}" if row["score"] is not None else "-"
            print(f"{lab:<26} {row['peak_mib']:6.0f} {row['unreclaimable_mib']:6.0f} {pss} "
                  f"{row['oom_kills']:3} {score:>7} {row['wall_s']:6.1f}", flush=True)
            if args.detail:
                for role, pid, pss, private, cmd in row["processes"]:
                    print(f"    {role:<7} {pid:>7} pss {pss:4} MiB, private dirty {private:4} MiB  {cmd}")
            for f in row["failed"]:
                print(f"    {f[:200]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
