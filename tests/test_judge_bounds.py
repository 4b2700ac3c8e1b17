"""The judge is bounded as the sandbox is: ``--memory`` (a cgroup where one can be made,
else RLIMIT_DATA) and ``--timeout`` per check, whatever the learner's answer asks for."""
import json
import os
import time

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from mgpu_lab.cli import main as cli
from mgpu_lab.course.grading import sandbox
from mgpu_lab.course.grading.judge import MEMORY_MESSAGE, JudgeError
from mgpu_lab.course.grading.session import Judges
from mgpu_lab.course.notebook.notebooks import make_lab
from conftest import check_cell as check, exercise_cell as exercise
from test_grader import UNSANDBOXED_IF_NEEDED, write

CGROUP = sandbox.cgroup_kind()
NO_GPU = not __import__("glob").glob("/dev/nvidia*")


# A setup cell (it runs in the judge too): the memory limit of the judge's own cgroup.
JUDGE_CGROUP = """import torch
def judge_cgroup_limit():
    for line in open('/proc/self/cgroup'):
        _, controllers, path = line.rstrip('\\n').split(':', 2)
        if 'mgpu-lab-judge' not in path:
            continue
        if 'memory' in controllers.split(','):
            return int(open('/sys/fs/cgroup/memory' + path + '/memory.limit_in_bytes').read())
        if controllers == '':
            return int(open('/sys/fs/cgroup' + path + '/memory.max').read())
    return None"""
EXPECTED_LIMIT = 2 * 2**30 if CGROUP else None         # --memory 2


def bounds_lab():
    """Two exercises: f's judge broadcasts the answer against a (32768,) reference (an answer
    shaped (32768, 1), 128 KiB, makes it allocate 4 GiB); g's is ordinary."""
    return new_notebook(metadata={"mgpu_lab": {"lab": "bounds"}}, cells=[
        new_code_cell(JUDGE_CGROUP, metadata={"tags": ["setup"]}),
        exercise("f", "def f(x):\n    ### BEGIN SOLUTION\n    return x * 2\n    ### END SOLUTION"),
        check("f_test", "x = torch.arange(32768.0)\n### PROBE\nmine = f(x)\n### JUDGE\n"
                        "assert bool(((mine - x * 2).abs() < 0.5).all()), 'f doubles x'"),
        exercise("g", "def g(y):\n    ### BEGIN SOLUTION\n    return y + 1\n    ### END SOLUTION"),
        check("g_test", "y = 3\n### PROBE\ngot = g(y)\n### JUDGE\nassert got == 4, 'g adds one'\n"
                        f"assert judge_cgroup_limit() == {EXPECTED_LIMIT!r}, 'not in a judge cgroup of --memory'"),
    ])


@pytest.mark.skipif(not NO_GPU, reason="with a GPU the judge has no RLIMIT_DATA (the cgroup remains)")
def test_an_answer_that_makes_the_judge_allocate_past_memory_costs_that_cell_only(tmp_path):
    lab = bounds_lab()
    write(lab, tmp_path / "solutions" / "bounds.ipynb")
    learner = make_lab(nbformat.from_dict(json.loads(json.dumps(lab))))
    learner.cells[1].source = "def f(x):\n    return (x * 2).reshape(-1, 1)   # 128 KiB"
    learner.cells[3].source = "def g(y):\n    return y + 1"
    write(learner, tmp_path / "class" / "wide.ipynb")
    assert cli(["grade", str(tmp_path / "class"), "--solutions", str(tmp_path / "solutions"),
                "--timeout", "60", "--memory", "2", "--quiet", "--json", str(tmp_path / "g.json")]
               + UNSANDBOXED_IF_NEEDED) == 0
    [nb] = json.loads((tmp_path / "g.json").read_text())["notebooks"]
    got = {e["grade_id"]: (e["score"], e["error"], e["message"]) for e in nb["exercises"]}
    assert got == {"f_test": (0, "JudgeError", MEMORY_MESSAGE), "g_test": (1, None, "")}, got


def _limit_of(pid: int) -> int:
    """The memory limit of the cgroup process ``pid`` is in (v1 or v2)."""
    for line in open(f"/proc/{pid}/cgroup"):
        _, controllers, path = line.rstrip("\n").split(":", 2)
        if CGROUP == "v1" and "memory" in controllers.split(","):
            return int(open(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes").read())
        if CGROUP == "v2" and controllers == "":
            return int(open(f"/sys/fs/cgroup{path}/memory.max").read())
    raise AssertionError("no memory cgroup")


@pytest.mark.skipif(CGROUP is None, reason="no cgroups can be made here (not root?)")
def test_the_judge_is_in_a_cgroup_of_the_sandboxs_memory_and_an_oom_kill_costs_one_check(tmp_path):
    """Processes a check starts (each under RLIMIT_DATA) together pass the cgroup's limit: the
    OOM killer ends one, that check is a JudgeError saying so, and a fresh judge answers the next."""
    judges = Judges(["import os"], str(tmp_path), timeout=60, memory_gib=0.75, cgroup=CGROUP)
    try:
        judges.setup()
        assert _limit_of(judges.judge.proc.pid) == int(0.75 * 2**30)
        judges.ask("inputs", "hog", "x = 1")
        hog = ("kids = []\nfor _ in range(3):\n    pid = os.fork()\n    if pid == 0:\n"
               "        try:\n            block = b'1' * (300 * 2**20)\n"
               "            __import__('time').sleep(5)\n        finally:\n"
               "            os._exit(0)\n    kids.append(pid)\n"
               "assert all(os.waitpid(k, 0)[1] == 0 for k in kids), 'a child died'")
        killed = sandbox.cgroup_oom_kills(judges.cgroup[1])
        with pytest.raises(JudgeError, match="more memory"):
            judges.ask("verdict", "hog", hog, {}, [])
        assert sandbox.cgroup_oom_kills(judges.cgroup[1]) > killed
        judges.ask("inputs", "next", "x = 1")
        assert judges.ask("verdict", "next", "assert x == 1, 'x'", {}, []).ok
        assert _limit_of(judges.judge.proc.pid) == int(0.75 * 2**30)
    finally:
        judges.close()
    assert not any(os.path.exists(d) for d in judges.cgroup[1])


def test_a_checks_time_limit_is_the_graders_timeout(tmp_path):
    judges = Judges(["import time"], str(tmp_path), timeout=2)
    try:
        judges.setup()
        judges.ask("inputs", "slow", "x = 1")
        start = time.monotonic()
        with pytest.raises(JudgeError, match="time limit \\(2 s\\)"):
            judges.ask("verdict", "slow", "time.sleep(30)", {}, [])
        assert time.monotonic() - start < 10
        judges.ask("inputs", "next", "x = 1")
        assert judges.ask("verdict", "next", "assert x == 1, 'x'", {}, []).ok
    finally:
        judges.close()
