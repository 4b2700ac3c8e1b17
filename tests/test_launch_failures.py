"""launch(): rank 0's output live, the root cause of a failure, where hung ranks wait, no orphans."""
import ctypes
import io
import os
import signal
import sys
import time

import pytest
import torch.distributed as dist

from conftest import pid_alive
from mgpu_lab import LaunchError, launch


class _Watcher(io.StringIO):
    """A stdout that creates ``flag`` as soon as ``needle`` is written to it."""

    def __init__(self, needle, flag):
        super().__init__()
        self.needle, self.flag = needle, flag

    def write(self, text):
        if self.needle in self.getvalue() + text:
            self.flag.touch()
        return super().write(text)


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_rank_0_output_reaches_the_parent_while_it_runs(tmp_path, monkeypatch, stream):
    flag = tmp_path / "parent_saw_it"
    watcher = _Watcher("[rank 0] step 1", flag)
    monkeypatch.setattr(sys, stream, watcher)

    def fn():
        if dist.get_rank() == 0:
            out = sys.stdout if stream == "stdout" else sys.stderr
            out.write("step 1\r")  # a progress bar's update: no newline yet
            out.flush()
            deadline = time.monotonic() + 20
            while not flag.exists() and time.monotonic() < deadline:
                time.sleep(0.01)  # ends only once the parent has shown the line: it arrived live
            out.write("step 2\n")
            return flag.exists()
        print("rank 1 done")
        return True

    assert launch(fn, nprocs=2, timeout=90) == [True, True]
    assert watcher.getvalue() == "[rank 0] step 1\r[rank 0] step 2\n" + (
        "[rank 1] rank 1 done\n" if stream == "stdout" else "")


def test_a_rank_killed_by_sigkill_is_the_root_cause_and_named(tmp_path):
    def fn():
        (tmp_path / str(dist.get_rank())).write_text(str(os.getpid()))
        if dist.get_rank() == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
        dist.barrier()  # rank 0 waits here, then fails because its peer vanished
        dist.barrier()

    with pytest.raises(LaunchError) as info:
        launch(fn, nprocs=2, timeout=60)
    assert info.value.rank == 1
    assert "rank 1 was killed by signal SIGKILL" in str(info.value)
    assert "out-of-memory" in str(info.value)
    pids = [int(f.read_text()) for f in tmp_path.iterdir()]
    assert len(pids) == 2 and not any(pid_alive(pid) for pid in pids)


def test_a_segfault_names_the_signal_and_shows_the_python_stack():
    def crash_here():
        ctypes.string_at(0)  # reads address 0: SIGSEGV

    def fn():
        if dist.get_rank() == 0:
            time.sleep(0.3)
            crash_here()
        dist.barrier()

    with pytest.raises(LaunchError) as info:
        launch(fn, nprocs=2, timeout=60)
    assert info.value.rank == 0
    message = str(info.value)
    assert "rank 0 was killed by signal SIGSEGV" in message
    assert "in crash_here" in message and "test_launch_failures.py" in message  # faulthandler's stack


def test_a_rank_that_returned_while_a_peer_waits_in_a_collective_is_named():
    def fn():
        if dist.get_rank() == 0:
            dist.barrier()  # rank 1 never calls it

    with pytest.raises((LaunchError, TimeoutError)) as info:
        launch(fn, nprocs=2, timeout=15)
    assert "rank 1 returned from fn while rank 0 was still in barrier()" in str(info.value)
    assert "test_launch_failures.py" in str(info.value)  # where the barrier was called


def test_a_hang_says_where_each_rank_waits():
    def fn():
        if dist.get_rank() == 1:
            time.sleep(120)  # never reaches the barrier
        dist.barrier()

    with pytest.raises(TimeoutError) as info:
        launch(fn, nprocs=2, timeout=4)
    message = str(info.value)
    assert "rank 0 was in barrier() (called at test_launch_failures.py:" in message
    assert "rank 1 was in test_launch_failures.py:" in message and " in fn" in message


def test_without_a_deadline_a_hang_ends_at_the_collective_timeout_saying_where_each_rank_waits():
    def fn():
        if dist.get_rank() == 1:
            while True:
                time.sleep(0.05)  # never reaches the barrier
        dist.barrier()

    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        launch(fn, nprocs=2, collective_timeout=3)  # no timeout=: the run itself has no deadline
    assert time.monotonic() - start < 30
    assert isinstance(info.value, LaunchError) and info.value.rank == 0
    message = str(info.value)
    assert "rank 0 waited 3 s in a collective (collective_timeout) and timed out" in message
    assert "rank 0 was in barrier() (called at test_launch_failures.py:" in message
    assert "rank 1 was in test_launch_failures.py:" in message and " in fn" in message


def test_collective_timeouts_are_recognised():
    from mgpu_lab.runtime._diagnosis import collective_timed_out

    gloo = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
            "600000ms for recv operation to complete")
    nccl = ("[rank0]:[E1122 10:01:02.123456 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
            "ran for 600011 milliseconds before timing out.")
    assert collective_timed_out(gloo) and collective_timed_out(nccl)
    assert not collective_timed_out("RuntimeError: Connection closed by peer [127.0.0.1]:12345")


def test_a_rank_that_failed_because_its_peer_died_is_never_the_root_cause():
    from mgpu_lab.runtime._diagnosis import root_cause
    bystander = {"ok": False, "type": "RuntimeError", "time": 1.0,
                 "error": "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:43156"}
    raised = {"ok": False, "type": "ValueError", "time": 2.0, "error": "ValueError: boom"}
    killed = {"ok": False, "time": float("inf"), "error": "rank 1 was killed by signal SIGKILL"}
    # the bystander (rank 0) was seen ending first: on a loaded machine it can be
    assert root_cause([0, 1], {0: 0, 1: 1}, [bystander, raised]) == 1
    assert root_cause([0, 1], {0: 0, 1: 1}, [bystander, killed]) == 1
    assert root_cause([0, 1], {0: 0, 1: 1}, [bystander, dict(bystander)]) == 0   # all bystanders: the first seen
    assert root_cause([0, 1], {0: 0, 1: 1}, [raised, killed]) == 0


def test_the_root_cause_is_the_first_rank_seen_failing_even_with_a_traceback():
    def fn():
        dist.barrier()  # both ranks are past init_process_group
        if dist.get_rank() == 0:
            raise ValueError("first")
        time.sleep(1.0)
        os._exit(2)  # fails later, and without a traceback

    with pytest.raises(LaunchError) as info:
        launch(fn, nprocs=2, timeout=60)
    assert info.value.rank == 0 and "ValueError: first" in str(info.value)
    assert "rank 1 exited with code 2" in info.value.failures[1]
