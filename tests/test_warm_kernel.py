"""Warm kernels (``mgpu_lab/course/warm_kernel.py``): a kernel forked into its sandbox
sees that sandbox as a kernel started in it does, and grading falls back to a cold
start wherever a warm one cannot be made."""
import json

import pytest

from mgpu_lab.course import warm_kernel
from mgpu_lab.course.judge_pool import JudgePool
from mgpu_lab.course.sandbox import Limits
from mgpu_lab.course.session import JUDGE_TIMEOUT, judge_environment, run_prepared
from mgpu_lab.course.submission import prepare_submission
from test_grader import SANDBOX, TOY, toy
import nbformat

pytestmark = pytest.mark.skipif(not SANDBOX.available, reason=f"no sandbox: {SANDBOX.reason}")

# What a process can see of its confinement; raised, so that it comes back as the
# cell's error message (the run's raw outcome, before any report hides it). The one
# difference left out: a cold kernel has JPY_PARENT_PID, by which ipykernel exits when
# its parent (the runner) changes; a warm one's parent is the sandbox's init, and it
# ends with the sandbox (warm_kernel.py).
FACTS = r'''import ctypes, errno, hashlib, json, os, resource, socket, sys
def _facts():
    status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        socket.create_connection(("1.1.1.1", 80), timeout=2)
        net = "reached"
    except OSError as err:
        net = errno.errorcode.get(err.errno, str(err.errno))
    try:
        open("/usr/pwned", "w")
        usr = "written"
    except OSError as err:
        usr = errno.errorcode.get(err.errno, str(err.errno))
    env = sorted(kv for kv in os.environ.items() if kv[0] != "JPY_PARENT_PID")
    return {
        "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), os.getgroups()],
        "caps": [status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")],
        "no_new_privs": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip(),
        "session_leader": os.getsid(0) == os.getpid(), "host": os.uname().nodename,
        "new_userns": libc.unshare(0x10000000), "new_netns": libc.unshare(0x40000000),
        "net": net, "usr": usr, "root": sorted(os.listdir("/")), "cwd": os.getcwd(),
        "cgroup": open("/proc/self/cgroup").read(),
        "rlimits": [resource.getrlimit(getattr(resource, k)) for k in
                    ("RLIMIT_NPROC", "RLIMIT_DATA", "RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_CORE")],
        "env": [k for k, _ in env], "env_sha": hashlib.sha256(repr(env).encode()).hexdigest(),
        "path": hashlib.sha256(repr(sys.path).encode()).hexdigest(), "argv": sys.argv[1:2],
        "pids_in_view": len([p for p in os.listdir("/proc") if p.isdigit()]) > 0,
        "executable": sys.executable, "dont_write_bytecode": sys.dont_write_bytecode,
    }
raise ValueError(json.dumps(_facts()))'''


def facts_of_a_kernel(pool):
    instructor = nbformat.read(TOY, as_version=4)
    prepared = prepare_submission(toy(first=FACTS), instructor)
    run = run_prepared(prepared, instructor, SANDBOX, Limits(), 60.0, 300.0, pool=pool)
    cell = next(i for i, origin in enumerate(prepared.origin) if origin == 1)
    assert run.results[cell].error == "ValueError", run.results[cell]
    return json.loads(run.results[cell].message)


def test_a_warm_kernel_sees_its_sandbox_as_a_cold_one_does_and_is_the_fallback(monkeypatch):
    """One run warm, one where no warm kernel can be made (the runner starts its own)."""
    started = []
    start = warm_kernel.WarmKernels.start
    monkeypatch.setattr(warm_kernel.WarmKernels, "start",
                        lambda self, *a: started.append(start(self, *a)) or started[-1])
    pool = JudgePool(judge_environment, JUDGE_TIMEOUT)
    try:
        warm = facts_of_a_kernel(pool)
        monkeypatch.setattr(warm_kernel, "sandbox_pid", lambda root, inner: None)
        cold = facts_of_a_kernel(pool)
    finally:
        pool.close()
    assert [s.pid is not None for s in started] == [True, False], started
    assert warm == cold
    assert cold["caps"] == ["0000000000000000"] * 5 and cold["no_new_privs"] == "1"
    assert cold["new_userns"] == cold["new_netns"] == -1 and cold["net"] != "reached"
    assert cold["usr"] == "EROFS" and cold["host"] == "sandbox" and cold["cwd"] == "/sandbox/work"


def test_the_zygote_starts_only_this_pythons_ipykernel():
    import sys
    ok = [sys.executable, "-m", "ipykernel_launcher", "-f", "/tmp/k.json"]
    assert warm_kernel.is_kernel_command(ok)
    for bad in (["/bin/sh", *ok[1:]], ok[:3] + ["-c", "x"], ok[:4] + ["k.json"], ok + ["--x"],
                [sys.executable, "-m", "evil", "-f", "/tmp/k.json"]):
        assert not warm_kernel.is_kernel_command(bad), bad
