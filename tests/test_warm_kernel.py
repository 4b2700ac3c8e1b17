"""Warm kernels (``mgpu_lab/course/grading/warm_kernel.py``): a kernel forked into its sandbox
sees that sandbox as a kernel started in it does, and grading falls back to a cold
start wherever a warm one cannot be made."""
import json

import pytest

from mgpu_lab.course.grading import warm_kernel
from mgpu_lab.course.grading.judge_pool import JudgePool
from mgpu_lab.course.grading.sandbox import Limits
from mgpu_lab.course.grading.session import JUDGE_TIMEOUT, judge_environment, run_prepared
from mgpu_lab.course.grading.submission import prepare_submission
from test_grader import SANDBOX, TOY, toy
import nbformat

pytestmark = pytest.mark.skipif(not SANDBOX.available, reason=f"no sandbox: {SANDBOX.reason}")

# What a process can see of its confinement; raised, so that it comes back as the
# cell's error message (the run's raw outcome, before any report hides it). The one
# difference left out: a cold kernel has JPY_PARENT_PID, by which ipykernel exits when
# its parent (the runner) changes; a warm one's parent is the init of the grader's PID
# namespace, and it ends with the sandbox (warm_kernel.py).
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


# What a judge's zygote can see of its process, raised from a setup cell (its error comes
# back in the zygote's refusal). Its folder's name is left out of the paths (each zygote
# has its own); the warm zygote's extra imports are not looked at.
JUDGE_FACTS = r'''import hashlib, json, os, resource, signal, sys
def _facts():
    home = os.getcwd()
    links = [os.path.join("/proc/self/fd", fd) for fd in os.listdir("/proc/self/fd")]
    fds = sorted(os.readlink(link).split(":")[0] for link in links if os.path.exists(link))
    env = sorted((k, v.replace(home, "HOME")) for k, v in os.environ.items())
    digest = lambda x: hashlib.sha256(repr(x).encode()).hexdigest()[:16]
    return {"session_leader": os.getsid(0) == os.getpid(), "ids": [os.getuid(), os.getgid()],
            "fds": fds, "env": digest(env), "env_keys": digest([k for k, _ in env]),
            "path": digest([p.replace(home, "HOME") for p in sys.path]), "argv": sys.argv[1:2],
            "as": resource.getrlimit(resource.RLIMIT_AS), "umask": os.umask(0o22),
            "sigchld": str(signal.getsignal(signal.SIGCHLD)), "main": sys.modules["__main__"].__spec__.name,
            "dont_write_bytecode": sys.dont_write_bytecode, "stdio": [os.readlink(f"/proc/self/fd/{i}") for i in (0, 1, 2)]}
raise ValueError(json.dumps(_facts()))'''


def test_a_judge_zygote_forked_warm_sees_what_a_new_one_does(tmp_path):
    """The run's judge zygotes are forks of the warm zygote (imports done): the same
    process as one started anew — session, environment, ``sys.path``, fds, limits."""
    from mgpu_lab.course.grading.judge import JudgeError
    from mgpu_lab.course.grading.judge_pool import Zygote
    def env_of(home):
        return {k: v for k, v in judge_environment(str(home)).items() if k != "PYTHONDONTWRITEBYTECODE"}
    env = env_of(tmp_path)
    warm = warm_kernel.WarmKernels(dict(env, PYTHONDONTWRITEBYTECODE="1"))   # as the sandbox's
    facts = {}
    try:
        for name, spawn in (("warm", warm), ("cold", None)):
            home = tmp_path / name
            home.mkdir()
            with pytest.raises(JudgeError) as refused:
                Zygote(env_of(home), str(home), [JUDGE_FACTS], JUDGE_TIMEOUT, spawn)
            text = str(refused.value)
            facts[name] = json.loads(text[text.index("{"):])
        forked = warm.fork_judges(env, str(tmp_path), __import__("socket").socketpair()[0])
        assert forked is not None and forked.poll() is None     # a fork it is, and alive
        forked.kill()
    finally:
        warm.close()
    assert facts["warm"] == facts["cold"]
    assert facts["cold"]["session_leader"] and facts["cold"]["main"] == "mgpu_lab.course.grading.judge_pool"
    assert facts["cold"]["fds"].count("socket") == 1 and "pipe" in facts["cold"]["fds"]
    assert not facts["cold"]["dont_write_bytecode"]


def test_the_warm_zygote_forks_no_judge_for_another_pythonpath(tmp_path):
    warm = warm_kernel.WarmKernels(dict(judge_environment(str(tmp_path)), PYTHONPATH="/elsewhere"))
    try:
        sock = __import__("socket").socketpair()[0]
        assert warm.fork_judges(judge_environment(str(tmp_path)), str(tmp_path), sock) is None
    finally:
        warm.close()


def test_as_the_run_as_user_a_warm_kernel_is_that_users_as_a_cold_one_is():
    """No sandbox, the kernel run as another user (``--run-as``: a platform's container
    without bubblewrap): the warm kernel is that user's process too, with no capability,
    and sees what a cold one sees (the run's own folders aside)."""
    from mgpu_lab.course.classroom.platforms import runs_python
    from mgpu_lab.course.grading.sandbox import Sandbox, run_as_user
    try:
        user = run_as_user("nobody")
        runs_python(user)
    except (ValueError, OSError, RuntimeError) as err:
        pytest.skip(f"no user nobody who can run this Python here: {err}")
    box = Sandbox(False, "run-as", run_as=user)
    instructor = nbformat.read(TOY, as_version=4)
    seen = []
    for warm in (True, False):
        pool = JudgePool(judge_environment, JUDGE_TIMEOUT) if warm else None
        try:
            # the grader's whole environment is the kernel's here: its names counted, not listed
            facts_code = FACTS.replace('"env": [k for k, _ in env]', '"env": len(env)')
            prepared = prepare_submission(toy(first=facts_code), instructor)
            run = run_prepared(prepared, instructor, box, Limits(), 60.0, 300.0, pool=pool)
        finally:
            if pool is not None:
                pool.close()
        cell = next(i for i, origin in enumerate(prepared.origin) if origin == 1)
        assert run.results[cell].error == "ValueError", run.results[cell]
        facts = json.loads(run.results[cell].message)
        for per_run in ("cwd", "env_sha", "path", "no_new_privs"):   # its scratch folder's name
            facts.pop(per_run)
        seen.append(facts)
    warm, cold = seen
    assert warm["ids"][:4] == [user[0], user[0], user[1], user[1]] and warm["ids"][4] == []
    none = "0000000000000000"
    assert warm.pop("caps") == [none] * 5 and cold.pop("caps")[:3] == [none] * 3  # and no
    assert warm == cold                                          # bounding set: stricter
