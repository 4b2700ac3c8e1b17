"""``mgpu-lab launch`` (torchrun underneath): one node, two loopback nodes, restarts, errors."""
import json
import os
import socket
import sys

import pytest

from mgpu_lab.runtime.torchrun import free_port
from conftest import ROOT, finish_session, start_session

TRAIN = str(ROOT / "examples" / "ddp_train.py")


def mgpu_lab(*args):
    return start_session([sys.executable, "-m", "mgpu_lab", *args], {**os.environ, "OMP_NUM_THREADS": "1"})


def finish(proc):
    done = finish_session(proc, timeout=180)
    return done.returncode, done.stdout, done.stderr


def summary(out):
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def test_dry_run_is_a_torchrun_command_on_loopback():
    code, out, _ = finish(mgpu_lab("launch", "--dry-run", "--nproc-per-node", "3", TRAIN, "--steps", "5"))
    assert code == 0
    assert out.startswith("torchrun --nnodes 1 --nproc-per-node 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:")
    assert out.strip().endswith(f"{TRAIN} --steps 5")


def test_one_node_two_processes_trains():
    code, out, err = finish(mgpu_lab("launch", TRAIN, "--steps", "20"))
    assert code == 0, err
    result = summary(out)
    assert result["world_size"] == 2 and result["steps"] == 20
    assert out.count('"world_size"') == 1  # rank 0 alone prints


def test_two_nodes_on_loopback_make_world_size_four():
    port = str(free_port())
    common = ["launch", "--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", port]
    node0 = mgpu_lab(*common, "--node-rank", "0", TRAIN, "--steps", "10")
    node1 = mgpu_lab(*common, "--node-rank", "1", TRAIN, "--steps", "10")
    (code0, out0, err0), (code1, out1, err1) = finish(node0), finish(node1)
    assert code0 == 0 and code1 == 0, err0 + err1
    result = summary(out0 + out1)
    assert result["world_size"] == 4 and result["steps"] == 10


def test_max_restarts_restarts_the_group_after_a_failure():
    script = str(ROOT / "tests" / "scripts" / "fail_once.py")
    code, out, err = finish(mgpu_lab("launch", "--max-restarts", "1", script))
    assert code == 0, err
    assert "attempt 1 ok, world size 2" in out
    code, _, err = finish(mgpu_lab("launch", "--max-restarts", "0", script))
    assert code == 1 and "failed" in err
    assert "Root Cause (first observed failure)" in err and "exitcode" in err   # the summary it names


def test_more_cpu_ranks_than_cores_is_said_once_when_launching_never_in_a_dry_run():
    """A launch says it once (``run`` prints the note before torchrun starts); a dry run prints
    the command only: it may be meant for another machine (lab 03 shows two nodes' commands)."""
    from mgpu_lab.runtime.torchrun import cpu_cores, gpu_count, oversubscription_note
    if gpu_count():
        pytest.skip("with GPUs, ranks run on GPUs: no note about CPU cores")
    n = cpu_cores() + 1
    assert f"{n} ranks on {cpu_cores()} CPU core(s)" in oversubscription_note(n)
    assert oversubscription_note(1) is None
    code, out, err = finish(mgpu_lab("launch", "--dry-run", "--nproc-per-node", str(n), TRAIN))
    assert code == 0 and "CPU core" not in err and out.startswith("torchrun ")


def test_a_port_in_use_is_refused_with_advice():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        code, _, err = finish(mgpu_lab("launch", "--master-port", str(port), TRAIN))
    assert code != 0
    assert f"port {port} on 127.0.0.1 is already in use" in err and "--master-port" in err


@pytest.mark.parametrize("n", ["0", "-1"])
def test_no_processes_per_node_is_refused(n):  # 0 once fell back to the default (2) silently
    code, out, err = finish(mgpu_lab("launch", "--dry-run", "--nproc-per-node", n, TRAIN))
    assert code != 0 and "--nproc-per-node must be >= 1" in err and "torchrun" not in out


def test_several_nodes_need_node_rank_and_master_addr():
    code, _, err = finish(mgpu_lab("launch", "--nnodes", "2", TRAIN))
    assert code != 0 and "--node-rank" in err and "--master-addr" in err


def test_doctor_runs_and_names_the_backend():
    code, out, err = finish(mgpu_lab("doctor"))
    assert code == 0, err
    assert "backend" in out and "NCCL_SOCKET_IFNAME" in out
