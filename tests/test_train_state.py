"""Checkpoints: atomic under failures, refusing pickled code, resuming bit for bit."""
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import ROOT, VOCAB, TiedNet, assert_no_children
from mgpu_lab import LossScaler, launch
from mgpu_lab.parallel.wrappers import unwrap
from mgpu_lab.training.train_state import TrainState, UnsafeCheckpointError, load_checkpoint, save_checkpoint


def leftovers(folder):
    return sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))


# --------------------------------------------------------------------------- atomic save

def test_save_then_load_round_trip(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, weights=torch.arange(4.0), step=3, note="hi", nested={"a": [1, 2.5, None]})
    state = load_checkpoint(path)
    assert torch.equal(state["weights"], torch.arange(4.0))
    assert state["step"] == 3 and state["note"] == "hi" and state["nested"] == {"a": [1, 2.5, None]}
    assert leftovers(tmp_path) == []


def test_a_failed_rename_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, step=1, weights=torch.ones(1000))

    def broken_replace(src, dst):
        raise OSError("disk full (injected)")
    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="injected"):
        save_checkpoint(path, step=2, weights=torch.zeros(1000))
    monkeypatch.undo()
    state = load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["weights"], torch.ones(1000))
    assert leftovers(tmp_path) == []  # the temporary file was removed


def test_a_failure_in_the_middle_of_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, step=1, weights=torch.ones(1000))
    real_save = torch.save

    def half_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip file")
        raise RuntimeError("killed mid-write (injected)")
    monkeypatch.setattr(torch, "save", half_save)
    with pytest.raises(RuntimeError, match="mid-write"):
        save_checkpoint(path, step=2, weights=torch.zeros(1000))
    monkeypatch.setattr(torch, "save", real_save)
    assert load_checkpoint(path)["step"] == 1
    assert leftovers(tmp_path) == []


def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    """A real kill: the child writes step 2's bytes, then blocks before the rename; we SIGKILL it."""
    path, ready = tmp_path / "ckpt.pt", tmp_path / "writing"
    child = textwrap.dedent(f"""
        import os, time, torch
        from mgpu_lab.training.train_state import save_checkpoint
        save_checkpoint({str(path)!r}, step=1, weights=torch.ones(100_000))
        def stuck_fsync(fd):
            open({str(ready)!r}, "w").close()
            time.sleep(60)
        os.fsync = stuck_fsync
        save_checkpoint({str(path)!r}, step=2, weights=torch.zeros(100_000))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", child], env=env)
    try:
        for _ in range(600):
            if ready.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert ready.exists(), "the child never reached the write"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    state = load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["weights"], torch.ones(100_000))
    assert len(leftovers(tmp_path)) == 1  # a stray temporary file is all a kill leaves


# --------------------------------------------------------------------------- safe load

class Payload:
    """Unpickling this calls Path.touch(marker): code that runs on load."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_file_with_pickled_code_is_refused_and_nothing_runs(tmp_path):
    path, marker = tmp_path / "evil.pt", tmp_path / "code_ran"
    torch.save({"model": {"w": torch.ones(2)}, "gift": Payload(str(marker))}, path)
    with pytest.raises(UnsafeCheckpointError, match="nothing in it ran") as info:
        load_checkpoint(path)
    assert "weights_only=False" in str(info.value)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # what an unsafe load does: the code runs
    assert marker.exists()


def test_saving_an_object_that_would_not_load_is_refused_before_writing(tmp_path):
    path = tmp_path / "ckpt.pt"
    with pytest.raises(TypeError, match=r"state\['optimizer'\].*state_dict"):
        save_checkpoint(path, optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    assert not path.exists() and leftovers(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(path)


# --------------------------------------------------------------------------- resuming bit for bit

def _train(path, start_fresh, steps, save_at, own_scaler=False):
    """TiedNet under DDP, Adam, a loss scaler, dropout drawn per rank: every piece of state matters."""
    rank = dist.get_rank()
    model = DDP(TiedNet(seed=0))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scaler_cls = LossScaler if own_scaler else functools.partial(torch.amp.GradScaler, "cpu")
    scaler = scaler_cls(init_scale=2.0 ** 10, growth_interval=3)
    torch.manual_seed(100 + rank)  # each rank its own dropout stream
    state = TrainState(model, optimizer, scaler)
    if not start_fresh:
        assert state.load(path)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (steps, 2, 8), generator=g)
    while state.step < steps:
        x = data[state.step, rank]
        logits = F.dropout(model(x), p=0.3)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), x.roll(1).reshape(-1))
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        state.step += 1
        if state.step == save_at:
            state.save(path)
            return None
    return {"model": unwrap(model).state_dict(), "scale": scaler.get_scale(), "rng": torch.rand(3)}


@pytest.mark.parametrize("own_scaler", [False, True], ids=["GradScaler", "LossScaler"])
def test_resume_continues_bit_for_bit_on_two_ranks(tmp_path, own_scaler):
    path = str(tmp_path / "state.pt")
    reference = launch(_train, nprocs=2, args=(path, True, 8, None, own_scaler), timeout=120)
    launch(_train, nprocs=2, args=(path, True, 8, 4, own_scaler), timeout=120)  # "dies" after saving at step 4
    saved = load_checkpoint(path)
    assert saved["step"] == 4 and saved["world_size"] == 2 and len(saved["rng"]) == 2
    assert not any(k.startswith("module.") for k in saved["model"])  # model.module's state
    resumed = launch(_train, nprocs=2, args=(path, False, 8, None, own_scaler), timeout=120)
    for rank in range(2):
        ref, res = reference[rank], resumed[rank]
        for name, tensor in ref["model"].items():
            assert torch.equal(tensor, res["model"][name]), f"rank {rank}: {name} differs after resuming"
        assert ref["scale"] == res["scale"]
        assert torch.equal(ref["rng"], res["rng"]), f"rank {rank}: the RNG stream was not restored"
    assert not torch.equal(reference[0]["rng"], reference[1]["rng"])  # the ranks' streams differ
    assert_no_children()


def test_a_two_rank_checkpoint_loads_into_one_process_on_the_cpu(tmp_path):
    path = str(tmp_path / "state.pt")
    launch(_train, nprocs=2, args=(path, True, 8, 2), timeout=120)
    model = TiedNet(seed=1)
    state = TrainState(model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad]))
    with pytest.warns(UserWarning, match="written by 2 rank"):
        assert state.load(path, map_location="cpu")
    assert state.step == 2
    saved = load_checkpoint(path, map_location="cpu")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved["model"][name])
    assert model.head.weight is model.embed.weight  # tied weights survive a load


def test_load_returns_false_when_there_is_nothing_to_resume(tmp_path):
    model = TiedNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = TrainState(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert state.load(str(tmp_path / "missing.pt")) is False
    assert state.step == 0 and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _save_on_rank0_only(path):
    if dist.get_rank() == 0:
        save_checkpoint(path, step=1)
    return "left"


def test_a_rank_that_skips_the_save_is_named(tmp_path):
    from mgpu_lab import LaunchError
    with pytest.raises(LaunchError) as info:
        launch(_save_on_rank0_only, nprocs=2, args=(str(tmp_path / "c.pt"),), timeout=60)
    assert info.value.rank == 0
    assert "save_checkpoint" in str(info.value) and "ranks [1]" in str(info.value)
    assert_no_children()
