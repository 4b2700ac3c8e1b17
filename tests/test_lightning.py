"""Lab 09's claims about PyTorch Lightning, checked: a "ddp" script started by torchrun
(`mgpu-lab launch`) or by Lightning itself trains the same weights, and what Lightning's
default environment reads of the multi-node variables. Skipped (reason shown) without the
[lightning] extra."""
import json
import os
import sys
from unittest import mock

import pytest

from conftest import ROOT, finish_session, start_session

L = pytest.importorskip("lightning", reason="PyTorch Lightning missing: pip install 'mgpu-lab[lightning]'")
from lightning.fabric.plugins.environments import LightningEnvironment  # noqa: E402

SCRIPT = str(ROOT / "examples" / "lightning_ddp.py")


def _start(*argv):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    return start_session([sys.executable, *argv], env)


def _result(proc):
    done = finish_session(proc, timeout=150)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, f"rank 0 alone should print one JSON line, got:\n{out}"
    return json.loads(lines[0])


def test_ddp_script_trains_the_same_under_torchrun_and_under_lightnings_own_launcher():
    by_torchrun = _start("-m", "mgpu_lab", "launch", "--nproc-per-node", "2", SCRIPT)
    by_lightning = _start(SCRIPT)
    a, b = _result(by_torchrun), _result(by_lightning)
    assert a["started_by"] == "torchrun" and b["started_by"] == "lightning"
    assert a["world_size"] == b["world_size"] == 2
    assert a["checksum"] == b["checksum"] and a["last_loss"] == b["last_loss"], (a, b)
    assert a["last_loss"] < 2.5  # it trained (from 4.3)


ARTICLE = {"MASTER_ADDR": "192.168.1.10", "MASTER_PORT": "45321", "WORLD_SIZE": "3", "NODE_RANK": "2"}


def test_lightning_reads_master_addr_port_and_node_rank_and_computes_world_size():
    with mock.patch.dict(os.environ, ARTICLE, clear=True):
        env = LightningEnvironment()
        assert (env.main_address, env.main_port, env.node_rank()) == ("192.168.1.10", 45321, 2)
        assert env.world_size() == 1, "WORLD_SIZE is not read: the Trainer sets num_nodes * devices"
        assert not env.creates_processes_externally  # Lightning starts the local ranks itself


def test_local_rank_in_the_environment_means_processes_were_started_externally():
    with mock.patch.dict(os.environ, {**ARTICLE, "LOCAL_RANK": "0"}, clear=True):
        assert LightningEnvironment().creates_processes_externally
    with mock.patch.dict(os.environ, {"GROUP_RANK": "1"}, clear=True):
        assert LightningEnvironment().node_rank() == 1
