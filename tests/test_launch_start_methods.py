"""launch() from any kernel state: fresh processes (spawn, forkserver) get fn and args by value."""
import importlib.util
import json
import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from conftest import pid_alive
from mgpu_lab import launch
from mgpu_lab.runtime.launch import choose_start_method


def _rank_plus(offset):
    return dist.get_rank() + offset


def test_a_parent_with_cuda_initialised_starts_fresh_processes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert choose_start_method() == "forkserver"
    scale = 10  # a closure and a lambda: what a notebook cell defines
    parent = os.getpid()
    fn = lambda x: (dist.get_rank() * scale + x, os.getppid() != parent)  # noqa: E731
    # os.getppid() != parent: the ranks are children of the forkserver, not forks of this process
    assert launch(fn, nprocs=2, args=(1,), timeout=120) == [(1, True), (11, True)]
    assert launch(fn, nprocs=2, args=(2,), timeout=120) == [(2, True), (12, True)]  # the server is reused


def test_a_function_that_uses_torch_ops_travels_by_value():
    # A notebook's selective-checkpoint policy names torch.ops.aten.mm.default (lab 13): once CUDA was
    # initialised, launch() sends fn by value (as __main__'s), and cloudpickle collects the submodules it
    # names, torch.ops among them, a module of torch's own type: it must travel by name.
    cell = {"__name__": "__main__", "torch": torch}
    exec("def op_name():\n    return str(torch.ops.aten.mm.default)\n", cell)
    assert launch(cell["op_name"], nprocs=1, start_method="spawn", backend="gloo", timeout=120) == ["aten.mm.default"]


def _environment(names):
    """What a rank sees of ``names``: in os.environ, and in the C environment that NCCL reads."""
    import ctypes

    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    return [(os.environ.get(n), (getenv(n.encode()) or b"").decode() or None) for n in names]


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_ranks_see_the_environment_as_it_is_at_each_launch(monkeypatch, start_method):
    if start_method == "fork" and choose_start_method() != "fork":
        pytest.skip("an earlier test of this process touched CUDA: fork is refused (a GPU machine)")
    names = ["MGPU_LAB_TEST_SET_LATER", "MGPU_LAB_TEST_REMOVED_LATER"]
    monkeypatch.delenv(names[0], raising=False)
    monkeypatch.setenv(names[1], "before")
    # the forkserver, if this starts it, copies the environment of this moment
    assert launch(_environment, nprocs=1, args=(names,), start_method=start_method, timeout=120) == [
        [(None, None), ("before", "before")]]
    monkeypatch.setenv(names[0], "INFO")  # as a notebook cell sets NCCL_DEBUG after a first launch
    monkeypatch.delenv(names[1])
    assert launch(_environment, nprocs=2, args=(names,), start_method=start_method, timeout=120) == [
        [("INFO", "INFO"), (None, None)]] * 2


def test_fork_is_refused_only_when_asked_for_explicitly_after_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="start_method=None"):
        launch(_rank_plus, nprocs=2, args=(0,), start_method="fork")


def test_spawn_runs_closures_and_test_module_functions():
    base = 100

    def fn():
        return _rank_plus(base)  # a closure calling a function of this test file

    assert launch(fn, nprocs=2, start_method="spawn", timeout=120) == [100, 101]


def test_a_module_that_a_fresh_process_cannot_import_travels_by_value(tmp_path):
    path = tmp_path / "loaded_by_path.py"
    path.write_text("import torch.distributed as dist\n\ndef fn(x):\n    return dist.get_rank() * x\n")
    spec = importlib.util.spec_from_file_location("loaded_by_path", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["loaded_by_path"] = module  # importable here, but its folder is not on sys.path
    try:
        spec.loader.exec_module(module)
        assert launch(module.fn, nprocs=2, args=(7,), start_method="forkserver", timeout=120) == [0, 7]
    finally:
        del sys.modules["loaded_by_path"]


def test_an_argument_that_cannot_be_serialised_is_named():
    with pytest.raises(ValueError, match=r"args\[1\] \(lock\) cannot be serialised"):
        launch(_rank_plus, nprocs=2, args=(0, threading.Lock()), start_method="forkserver")


NOTEBOOK_CELLS = [
    "import torch.distributed as dist\nfrom mgpu_lab import launch\n\ndef double(x):\n    return 2 * x",
    "from dataclasses import dataclass\n\n@dataclass\nclass Reply:\n    rank: int\n    value: int\n\n"
    "offset = 1\n\ndef fn(x):\n    print('hello from', dist.get_rank())\n"
    "    return Reply(dist.get_rank(), double(x) + offset)",
    "replies = launch(fn, nprocs=2, args=(20,), start_method='spawn', timeout=120)\n"
    "print(replies[1].value, isinstance(replies[1], Reply), [r.rank for r in replies])",
]


def test_a_notebook_kernel_defines_fn_across_cells_and_spawns(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    spec = tmp_path / "kernels" / "this-python"  # a kernel of this very Python, whatever "python3" means here
    spec.mkdir(parents=True)
    spec.joinpath("kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "this python", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK_CELLS])
    nbclient.NotebookClient(nb, timeout=180, kernel_name="this-python").execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    assert text.splitlines() == ["[rank 0] hello from 0", "[rank 1] hello from 1", "41 True [0, 1]"], json.dumps(
        nb.cells[-1].outputs)


def test_no_process_is_left_after_a_crash_in_fresh_processes(tmp_path):
    def fn():
        pid = os.fork()  # a grandchild, like a DataLoader worker
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        (tmp_path / str(dist.get_rank())).write_text(f"{os.getpid()} {pid}")
        if dist.get_rank() == 0:
            raise RuntimeError("crash")
        time.sleep(120)

    from mgpu_lab import LaunchError

    with pytest.raises(LaunchError):
        launch(fn, nprocs=2, start_method="forkserver", timeout=60)
    time.sleep(0.5)
    pids = [int(p) for f in tmp_path.iterdir() for p in f.read_text().split()]
    assert len(pids) == 4 and not [pid for pid in pids if pid_alive(pid)]


def test_forkserver_launches_after_the_first_are_fast():
    launch(_rank_plus, nprocs=2, args=(0,), start_method="forkserver", timeout=120)  # starts the server
    start = time.monotonic()
    launch(_rank_plus, nprocs=2, args=(0,), start_method="forkserver", timeout=120)
    # not a speed target (benchmarks/bench_launch.py measures that): proof that torch is not
    # imported again per rank, which alone takes seconds
    assert time.monotonic() - start < 30


def test_a_fork_poisoned_without_cuda_initialised_is_detected_by_a_probe(monkeypatch):
    # torch.cuda.is_available() marks later forks "bad" without initialising CUDA: a forked
    # probe (which inherits these patches) reports it, and launch() does not fork then
    import mgpu_lab.runtime._start_methods as launch_module

    monkeypatch.setattr(launch_module, "gpu_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True, raising=False)
    assert launch_module.fork_is_poisoned() and choose_start_method() == "forkserver"
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False, raising=False)
    assert not launch_module.fork_is_poisoned() and choose_start_method() == "fork"
