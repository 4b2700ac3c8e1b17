"""A sandbox for every graded kernel: bubblewrap (``bwrap``), limits, nothing else.

The grader runs a submission's notebook (the kernel *and* the client that
drives it, :mod:`mgpu_lab.course.grading.runner`) inside ``bwrap``, Debian's small
setuid-free sandbox tool built on Linux namespaces (no daemon, no image). What
the submission sees:

- a root filesystem that is read-only and holds only what Python needs: the
  system folders (``/usr``, ``/lib*``, ``/bin``, ``/etc``), this Python's
  installation and site-packages, and the ``mgpu_lab`` package folder alone,
  not the checkout around it (so no ``solutions/``, no ``.git``, no home);
- a writable scratch folder of its own (``/sandbox/work``, its cwd and
  ``$HOME``), a private ``/tmp`` and ``/dev/shm``: tmpfs, size-capped, gone
  when it ends;
- its own network namespace with loopback only (gloo over 127.0.0.1 works; any
  other address is unreachable), its own PID, IPC and UTS namespaces, no
  capabilities, no new user namespaces, killed with its parent;
- bounded memory and processes: a cgroup (``memory`` and ``pids``) when the
  grader may create one (root), else ``RLIMIT_DATA`` per process and
  ``RLIMIT_NPROC`` (counted inside the sandbox's user namespace).

What it costs: the namespaces take a few milliseconds. A grading run's kernels are
forked, their imports done, into their sandboxes (:mod:`.warm_kernel`), each made what
this module makes of a process. CUDA devices (``/dev/nvidia*``) are passed through when present.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

WORK = "/sandbox/work"           # the submission's scratch folder, cwd and $HOME
CGROUP_V1, CGROUP_V2 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup")
SYSTEM_DIRS = ["/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc"]
NEWER_OPTIONS = ["--disable-userns", "--size"]  # bubblewrap 0.8 and 0.6; used when there
SECRETS = ["/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/sudoers.d", "/etc/ssh",
           "/etc/ssl/private"]


@dataclass
class Limits:
    memory_gib: float = 8.0       # whole sandbox (cgroup) or per process (RLIMIT_DATA)
    processes: int = 256          # processes and threads inside the sandbox
    scratch_mib: int = 1024       # each of /sandbox/work, /tmp and /dev/shm


@dataclass
class Sandbox:
    """How a graded kernel is confined on this machine (``available`` or why not)."""
    available: bool
    reason: str = ""
    bwrap: Optional[str] = None
    cgroup: Optional[str] = None   # "v1" / "v2" when the grader can make cgroups
    hidden: List[str] = field(default_factory=list)
    options: List[str] = field(default_factory=list)  # of the newer ones, those bwrap knows
    run_as: Optional[Tuple[int, int, str]] = None      # no sandbox: the kernel's (uid, gid, name)

    def describe(self) -> str:
        if not self.available and self.run_as:
            return (f"sandbox: OFF ({self.reason}); submissions run as user {self.run_as[2]} "
                    f"(uid {self.run_as[0]}): they read and write what it may, and its "
                    "processes are limited (memory, count)")
        if not self.available:
            return f"sandbox: OFF ({self.reason}); submissions run with your permissions"
        limits = "cgroup" if self.cgroup else "rlimits"
        return (f"sandbox: bubblewrap ({self.bwrap}); read-only root, scratch folder, "
                f"loopback-only network, memory/process limits by {limits}")


def run_as_user(user: str) -> Tuple[int, int, str]:
    """``(uid, gid, name)`` of ``user`` (a name or a number), for a grader running as root
    without a sandbox (Gradescope's and PrairieLearn's containers): the learner's kernel then
    runs as that user, who cannot read what it may not (the solutions, kept ``0700``).
    ValueError when it cannot be done here."""
    import pwd
    if os.geteuid() != 0:
        raise ValueError("--run-as needs the grader to run as root (it switches user)")
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, ValueError):
        raise ValueError(f"--run-as: no user {user!r} here") from None
    if entry.pw_uid == 0:
        raise ValueError("--run-as: not root (the kernel must not be the grader's user)")
    return entry.pw_uid, entry.pw_gid, entry.pw_name


def cgroup_kind() -> Optional[str]:
    """'v2' or 'v1' when we may create cgroups with memory and pids limits, else None."""
    if os.geteuid() != 0:
        return None
    if (CGROUP_V2 / "cgroup.controllers").is_file():
        ctrl = (CGROUP_V2 / "cgroup.subtree_control").read_text().split()
        return "v2" if {"memory", "pids"} <= set(ctrl) and os.access(CGROUP_V2, os.W_OK) else None
    ok = all(os.access(CGROUP_V1 / c, os.W_OK) for c in ("memory", "pids"))
    return "v1" if ok else None


def probe(hidden: List[Path] = ()) -> Sandbox:
    """Can a sandbox be made here? Runs ``bwrap`` once (a few ms)."""
    if not sys.platform.startswith("linux"):
        return Sandbox(False, f"no sandbox on {sys.platform} (bubblewrap needs Linux)")
    exe = shutil.which("bwrap")
    if exe is None:
        return Sandbox(False, "bwrap not found (Debian/Ubuntu: apt-get install bubblewrap)")
    try:
        out = subprocess.run([exe, "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev",
                              "--proc", "/proc", "true"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return Sandbox(False, f"bwrap failed to start: {err}")
    if out.returncode != 0:
        why = out.stderr.strip().splitlines()[-1:] or [f"exit {out.returncode}"]
        return Sandbox(False, f"bwrap cannot make namespaces here ({why[0]}; "
                              "are user namespaces enabled?)")
    help_text = subprocess.run([exe, "--help"], capture_output=True, text=True).stdout
    options = [o for o in NEWER_OPTIONS if o in help_text]
    return Sandbox(True, bwrap=exe, cgroup=cgroup_kind(), hidden=[str(h) for h in hidden],
                   options=options)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def readable_paths(package_dir: Path, hidden: List[str]) -> List[str]:
    """What the sandbox may read: system folders, this Python, the mgpu_lab package.

    A folder that contains a hidden folder (the instructor's checkout,
    ``solutions/``, the home folder) is left out (a virtual environment inside
    them is fine); the package folder is bound alone, so ``mgpu_lab.__file__``
    leads nowhere.
    """
    checkout = package_dir.parent  # a source checkout around the package stays hidden
    if any((checkout / n).exists() for n in ("solutions", "labs", ".git", "pyproject.toml")):
        hidden = [*hidden, str(checkout)]
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages()]
    prefixes = [os.path.realpath(p) for p in prefixes]
    candidates = prefixes + [os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)]
    paths = [p for p in SYSTEM_DIRS if os.path.exists(p)]
    for p in candidates:
        if any(_inside(h, p) for h in hidden):
            continue  # it would show a hidden folder
        if p not in prefixes and any(_inside(p, h) for h in hidden):
            continue  # a script's folder or PYTHONPATH entry inside the checkout
        if os.path.isdir(p) and not any(_inside(p, q) for q in paths):
            paths = [q for q in paths if not _inside(q, p)] + [p]
    return paths + [str(package_dir)]


def command(box: Sandbox, argv: List[str], limits: Limits, package_dir: Path,
            env: dict) -> tuple:
    """``(argv, cleanup)``: ``argv`` wrapped in bwrap (and a cgroup), and what undoes it."""
    args = [box.bwrap, "--unshare-all", "--unshare-user", "--uid", "1000", "--gid", "1000",
            "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if "--disable-userns" in box.options:
        args.append("--disable-userns")
    args += ["--proc", "/proc", "--dev", "/dev", "--ro-bind-try", "/sys", "/sys"]
    for dev in sorted(Path("/dev").glob("nvidia*")):
        args += ["--dev-bind", str(dev), str(dev)]
    # The writable tmpfs folders before the read-only binds: a Python or package that
    # lives under /tmp (a checkout cloned there) is then bound over the private /tmp.
    size = str(limits.scratch_mib * 2**20)
    for where in (WORK, "/tmp", "/dev/shm"):
        args += (["--size", size] if "--size" in box.options else []) + ["--tmpfs", where]
    for p in readable_paths(package_dir, box.hidden):
        args += ["--ro-bind", p, p]
        real = os.path.realpath(p)
        if real != p:
            args += ["--ro-bind", real, real]
    for secret in SECRETS:  # readable by their owner, and a root grader maps to root
        if os.path.isdir(secret):
            args += ["--tmpfs", secret]
        elif os.path.exists(secret):
            args += ["--ro-bind", "/dev/null", secret]
    args += ["--remount-ro", "/", "--chdir", WORK, "--clearenv"]
    for k, v in env.items():
        args += ["--setenv", k, v]
    cleanup = []
    if box.cgroup:
        cg = _make_cgroup(box.cgroup, limits)
        if cg:
            procs, cleanup = cg
            # Join the cgroup(s), then become bwrap: the whole sandbox is inside.
            join = "".join(f'echo $$ > "{p}" && ' for p in procs)
            return ["/bin/sh", "-c", join + 'exec "$@"', "sh", *args, "--", *argv], cleanup
    return args + ["--", *argv], cleanup


def own_cgroup(controller: str) -> Optional[Path]:
    """The folder of this process's cgroup for ``controller`` (v1: ``memory``, ``pids``;
    ``""``: v2's), as ``/proc/self/cgroup`` names it; None when it has none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (controller in controllers.split(",")) if controller else controllers == "":
            base = CGROUP_V2 if not controller else CGROUP_V1 / controller
            return base / path.lstrip("/")
    return None


def _parent(kind: str, controller: str) -> Path:
    """Where a sandbox's cgroup is made: inside the grader's own (so a container's or a
    measurement's limit holds over the sandbox too) where that can hold it, else the root."""
    root = CGROUP_V2 if kind == "v2" else CGROUP_V1 / controller
    mine = own_cgroup("" if kind == "v2" else controller)
    if mine is None or mine == root or not os.access(mine, os.W_OK):
        return root
    if kind == "v2":   # the controllers must be enabled for its children
        try:
            if not {"memory", "pids"} <= set((mine / "cgroup.subtree_control").read_text().split()):
                return root
        except OSError:
            return root
    return mine


def _make_cgroup(kind: str, limits: Limits, what: str = "grade", pids: bool = True):
    """Create cgroup(s) with the limits (memory, and processes when ``pids``), inside the
    grader's own where they can be (:func:`_parent`); return (cgroup.procs files, folders to
    remove), or None."""
    name = f"mgpu-lab-{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    memory = str(int(limits.memory_gib * 2**30))
    made = []
    try:
        if kind == "v2":
            d = _parent(kind, "") / name
            d.mkdir()
            made.append(d)
            (d / "memory.max").write_text(memory)
            (d / "memory.swap.max").write_text("0") if (d / "memory.swap.max").exists() else None
            if pids:
                (d / "pids.max").write_text(str(limits.processes))
            return [str(d / "cgroup.procs")], [d]
        mem = _parent(kind, "memory") / name
        mem.mkdir()
        made.append(mem)
        (mem / "memory.limit_in_bytes").write_text(memory)
        if (mem / "memory.memsw.limit_in_bytes").exists():      # no swap, as v2's swap.max
            (mem / "memory.memsw.limit_in_bytes").write_text(memory)
        if not pids:
            return [str(mem / "cgroup.procs")], [mem]
        count = _parent(kind, "pids") / name
        count.mkdir()
        made.append(count)
        (count / "pids.max").write_text(str(limits.processes))
        return [str(mem / "cgroup.procs"), str(count / "cgroup.procs")], [mem, count]
    except OSError:
        remove_cgroups(made)
        return None


def memory_cgroup(kind: Optional[str], memory_gib: float):
    """A cgroup of ``memory_gib`` for processes outside the sandbox (a judge and what it
    starts): ``(cgroup.procs files, folders to remove)``, or None where none can be made."""
    return _make_cgroup(kind, Limits(memory_gib=memory_gib), "judge", pids=False) if kind else None


def cgroup_oom_kills(folders) -> int:
    """Processes the kernel's OOM killer ended in these cgroup folders so far (0 where none
    counts them: before Linux 4.13); :func:`oom_kills` over their :func:`oom_file`."""
    return oom_kills([f for f in (oom_file(Path(d)) for d in folders) if f is not None]) or 0


def remove_cgroups(folders, wait: float = 10.0) -> None:
    """End what is left in the sandbox's cgroups, then remove them (retried: a cgroup
    stays busy for a moment after its last process exits)."""
    import signal
    import time
    end = time.monotonic() + wait
    for d in folders:
        while True:
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > end:
                    break  # left for the system; empty cgroups cost nothing
                time.sleep(0.05)


def apply_rlimits(limits: Limits, cgroup: bool) -> None:
    """Inside the sandbox (the runner, before the kernel): per-process limits.

    With a cgroup the memory bound is the cgroup's; ``RLIMIT_DATA`` is still set
    (without GPUs) so a single hog gets ``MemoryError`` instead of the OOM killer.
    """
    import resource
    nproc = limits.processes
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    except (ValueError, OSError):
        pass
    if not any(Path("/dev").glob("nvidia*")):  # CUDA maps far more than it uses
        data = int(limits.memory_gib * 2**30)
        try:
            resource.setrlimit(resource.RLIMIT_DATA, (data, data))
        except (ValueError, OSError):
            pass


# --- killed for memory -------------------------------------------------------------

def oom_file(folder: Path) -> Optional[Path]:
    """The file of memory cgroup ``folder`` that counts its OOM kills (v2 ``memory.events``,
    v1 ``memory.oom_control``: ``oom_kill N``, the cgroup's and its descendants')."""
    for name in ("memory.events", "memory.oom_control"):
        if (folder / name).is_file():
            return folder / name
    return None


def oom_kills(files) -> Optional[int]:
    """How many processes the OOM killer has killed in these cgroups (``oom_file``'s), or
    None when none can be read."""
    total, read = 0, False
    for f in files:
        try:
            text = Path(f).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                total, read = total + int(line.split()[1]), True
    return total if read else None


def own_memory_cgroup() -> Optional[Path]:
    """This process's memory cgroup folder, where it can be read: the path
    ``/proc/self/cgroup`` names, else the mount's root (a container's own cgroup when the
    container has its own cgroup namespace, or the host's path is not mounted in it)."""
    for controller, root in (("memory", CGROUP_V1 / "memory"), ("", CGROUP_V2)):
        mine = own_cgroup(controller)
        for folder in (mine, root):
            if folder is not None and oom_file(folder) is not None:
                return folder
    return None


def memory_limit_mib(folder: Optional[Path]) -> Optional[int]:
    """The memory limit that holds over cgroup ``folder`` (the lowest of its own and its
    ancestors'), in MiB; None when there is none or it cannot be read."""
    if folder is None:
        return None
    limits = []
    try:
        stat = (folder / "memory.stat").read_text().split()
        if "hierarchical_memory_limit" in stat:                          # v1
            limits.append(int(stat[stat.index("hierarchical_memory_limit") + 1]))
        else:                                                            # v2: up to the root
            d = folder
            while (d / "memory.max").is_file():
                value = (d / "memory.max").read_text().strip()
                if value != "max":
                    limits.append(int(value))
                d = d.parent
    except (OSError, ValueError, IndexError):
        return None
    limits = [v for v in limits if v < 2**60]
    return min(limits) // 2**20 if limits else None
