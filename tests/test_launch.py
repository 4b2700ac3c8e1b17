"""launch(): values, output order, crashes, hangs, no orphans, bad input."""
import inspect
import os
import subprocess
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import mgpu_lab
import mgpu_lab.runtime.launch as launch_module
from mgpu_lab import LaunchError, dist_env, launch


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"  # zombies are dead, just not yet reaped
    except FileNotFoundError:
        return False


def _rank_times_ten():
    return dist.get_rank() * 10


def test_values_come_back_in_rank_order():
    assert launch(_rank_times_ten, nprocs=3) == [0, 10, 20]


def test_collective_and_closure_from_the_caller():
    offset = 5.0  # a closure over a local: works because launch forks

    def fn(scale):
        t = torch.tensor([dist.get_rank() + offset])
        dist.all_reduce(t)
        return (t * scale).item(), dist.get_world_size(), dist_env().rank

    assert launch(fn, nprocs=2, args=(2.0,)) == [(22.0, 2, 0), (22.0, 2, 1)]


def test_output_is_printed_in_rank_order_with_prefix(capfd):
    def fn():
        rank = dist.get_rank()
        time.sleep(0.3 * (1 - rank))  # rank 1 prints first in time
        print(f"python line from {rank}")
        os.write(1, f"fd line from {rank}\n".encode())  # what C++ would write
        os.write(2, f"err line from {rank}\n".encode())

    launch(fn, nprocs=2)
    out, err = capfd.readouterr()
    assert out.splitlines() == [
        "[rank 0] python line from 0", "[rank 0] fd line from 0",
        "[rank 1] python line from 1", "[rank 1] fd line from 1",
    ]
    assert err.splitlines() == ["[rank 0] err line from 0", "[rank 1] err line from 1"]


def test_a_crashed_rank_raises_with_its_traceback():
    def fn():
        if dist.get_rank() == 1:
            raise ValueError("boom on purpose")
        dist.barrier()  # rank 0 waits for a peer that is gone

    with pytest.raises(LaunchError) as info:
        launch(fn, nprocs=2, timeout=60)
    assert info.value.rank == 1
    assert "ValueError: boom on purpose" in str(info.value)
    assert "Traceback" in str(info.value)


def test_a_rank_that_dies_without_python_is_reported():
    def fn():
        if dist.get_rank() == 0:
            os._exit(3)

    with pytest.raises(LaunchError, match="rank 0 exited with code 3"):
        launch(fn, nprocs=2, timeout=60)


def test_a_hang_raises_timeout_naming_the_ranks_and_leaves_no_process(tmp_path, capfd):
    def fn():
        pid = os.fork()  # a grandchild, like a DataLoader worker
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        (tmp_path / f"pids{dist.get_rank()}").write_text(f"{os.getpid()} {pid}")
        if dist.get_rank() == 1:
            time.sleep(120)
        return "done"

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of 2"):
        launch(fn, nprocs=2, timeout=4)
    assert time.monotonic() - start < 20
    pids = [int(p) for f in tmp_path.iterdir() for p in f.read_text().split()]
    assert len(pids) == 4
    time.sleep(0.5)
    assert [pid for pid in pids if _alive(pid)] == []
    # the hung rank printed where it was stuck, before it was killed
    stack = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[rank 1]")]
    assert any("test_launch.py" in line and " in fn" in line for line in stack), stack


def test_no_process_is_left_after_a_crash(monkeypatch):
    """Rank 0 crashes while rank 1 sleeps with a child of its own: nothing of the run is left.
    The ranks are found from the launcher (the processes it started), not from files the ranks
    write: rank 1 may die in gloo's connect before it runs a line, when rank 0 crashed first."""
    started, real_start_ranks = [], launch_module.start_ranks

    def recording_start_ranks(*args):
        ports = real_start_ranks(*args)
        started.extend(args[-1])  # the launcher's list of rank processes
        return ports

    monkeypatch.setattr(launch_module, "start_ranks", recording_start_ranks)

    def fn():
        if dist.get_rank() == 0:
            raise RuntimeError("crash")
        subprocess.Popen(["sleep", "120"])  # in rank 1's process group
        time.sleep(120)  # rank 1 would never finish on its own

    with pytest.raises(LaunchError):
        launch(fn, nprocs=2, timeout=60)
    pids = [proc.pid for proc in started]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)
    left = [p.pid for p in psutil.process_iter() if _group_of(p.pid) in pids and _alive(p.pid)]
    assert not left, f"processes of the run still alive: {left}"


def _group_of(pid: int):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_an_unpicklable_return_value_is_an_error():
    with pytest.raises(LaunchError, match="pickle"):
        launch(lambda: threading.Lock(), nprocs=2)  # neither pickle nor cloudpickle (a lambda would be)


@pytest.mark.parametrize("nprocs", [0, -1, 1.5, "2"])
def test_bad_nprocs(nprocs):
    with pytest.raises(ValueError, match="nprocs"):
        launch(_rank_times_ten, nprocs=nprocs)


def test_bad_timeout():
    with pytest.raises(ValueError, match="timeout"):
        launch(_rank_times_ten, timeout=0)
    with pytest.raises(ValueError, match="collective_timeout"):
        launch(_rank_times_ten, collective_timeout=None)


def test_a_run_has_no_deadline_by_default_and_its_collectives_a_timeout():
    # a training run may take hours: launch() sets no deadline unless asked; a hang is
    # found by the collectives' timeout (test_launch_failures.py shows its diagnosis)
    defaults = inspect.signature(launch).parameters
    assert defaults["timeout"].default is None
    assert defaults["collective_timeout"].default == 600

    def fn():
        return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout

    assert launch(fn, nprocs=2, collective_timeout=42) == [__import__("datetime").timedelta(seconds=42)] * 2


@pytest.mark.parametrize("ending", ["destroy_process_group", "mgpu_lab.cleanup"])
def test_fn_may_leave_the_process_group_itself(ending):
    def fn():  # as PyTorch's DDP tutorial ends its function
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        dist.destroy_process_group() if ending == "destroy_process_group" else mgpu_lab.cleanup()
        return t.item(), dist.is_initialized()

    assert launch(fn, nprocs=2) == [(3.0, False), (3.0, False)]


def test_ending_the_process_inside_fn_is_explained():
    with pytest.raises(LaunchError, match=r"cleanup\(exit=True\), which ends a script"):
        launch(lambda: mgpu_lab.cleanup(exit=True), nprocs=2, timeout=60)


def test_the_rendezvous_store_listens_on_loopback_only():
    def fn():
        port = int(os.environ["MASTER_PORT"])
        return sorted({c.laddr.ip for c in psutil.net_connections("tcp")
                       if c.status == psutil.CONN_LISTEN and c.laddr.port == port})

    assert launch(fn, nprocs=2) == [["127.0.0.1"]] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_nccl_without_a_gpu_says_what_to_do():
    with pytest.raises(RuntimeError, match="backend='gloo'"):
        launch(_rank_times_ten, backend="nccl")


def test_spawn_runs_a_module_level_function():
    assert launch(_rank_times_ten, nprocs=2, start_method="spawn", timeout=120) == [0, 10]


def test_one_process_works():
    assert launch(_rank_times_ten, nprocs=1) == [0]


def test_a_parent_that_used_openmp_threads_can_still_launch():
    # GNU OpenMP hangs a forked child's first large op when the parent ran a parallel
    # region; launch() gives each CPU rank one thread, so the child never enters one.
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(1000, 1000)
        a @ a  # a parallel region in the parent

        def big_op():
            x = torch.randn(1000, 1000)
            return float((x @ x).sum() * 0), torch.get_num_threads()

        assert launch(big_op, nprocs=1, timeout=30) == [(0.0, 1)]
    finally:
        torch.set_num_threads(previous)


def test_default_backend_needs_a_gpu_per_rank_for_nccl(monkeypatch):
    import importlib

    launch_module = importlib.import_module("mgpu_lab.runtime.launch")  # the module, not the function
    devices_module = importlib.import_module("mgpu_lab.runtime.devices")

    monkeypatch.setattr(devices_module, "nccl_available", lambda: True)
    monkeypatch.setattr(devices_module, "gpu_count", lambda: 2)
    assert launch_module.default_launch_backend(2) == "nccl"
    assert launch_module.default_launch_backend(3) == "gloo"  # two ranks cannot share a GPU under NCCL
    monkeypatch.setattr(devices_module, "nccl_available", lambda: False)
    assert launch_module.default_launch_backend(1) == "gloo"
