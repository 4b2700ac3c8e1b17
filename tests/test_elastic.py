"""Elastic restarts: rank 1 dies twice (os._exit, then SIGKILL); torchrun restarts the group,
which resumes from the last checkpoint and ends with exactly an uninterrupted run's weights."""
import json
import os
import sys
import time

import psutil
import torch

from conftest import ROOT, assert_no_children, run_session
from mgpu_lab import launch, load_checkpoint

sys.path.insert(0, str(ROOT / "examples"))
import resumable_train  # noqa: E402

SCRIPT = str(ROOT / "examples" / "resumable_train.py")


def _reference(argv):
    return resumable_train.train(resumable_train.parse(argv))


def test_a_killed_rank_is_restarted_and_the_run_ends_bit_for_bit_equal(tmp_path):
    ref = launch(_reference, nprocs=2, args=(["--ckpt", str(tmp_path / "ref" / "state.pt")],), timeout=120)[0]

    ckpt, out = tmp_path / "run" / "state.pt", tmp_path / "final.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = run_session([sys.executable, "-m", "mgpu_lab", "launch", "--nproc-per-node", "2", "--max-restarts", "2",
                      SCRIPT, "--ckpt", str(ckpt), "--out", str(out), "--die", "7:exit,15:kill"], env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1: dying at step 7 (exit)" in proc.stdout and "rank 1: dying at step 15 (kill)" in proc.stdout
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    # attempt 0 died at 7 (last checkpoint 4), attempt 1 resumed at 4 and died at 15 (checkpoint 12, an epoch end)
    assert summary == {**summary, "attempt": 2, "resumed_from": 12, "steps": 24}
    final = load_checkpoint(out)
    for name, tensor in ref["model"].items():
        assert torch.equal(tensor, final["model"][name]), f"{name} differs from the uninterrupted run"
    assert torch.equal(ref["rng"], final["rng"])

    assert_no_children()
    time.sleep(0.5)
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"])  # torchrun's workers run in their own sessions
            if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))]
    assert not left, f"processes left behind: {left}"
