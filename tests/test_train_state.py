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
from mgpu_lab.training.train_state import (
    CheckpointError, TrainState, UnsafeCheckpointError, load_checkpoint, save_checkpoint,
)


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
    with pytest.raises(CheckpointError, match="injected"):
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


# --------------------------------------------------------------------------- a single-epoch loop, bit for bit

class DropoutNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(),
                                                              torch.nn.Dropout(0.3)) for _ in range(2))
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _readme_loop(path, die_at):
    """The single-epoch loop without ``dataloader=`` (FSDP, accumulation, bf16, a schedule, TrainState,
    ``islice`` skipping what was seen; README's before it went over epochs: tests/test_resume_epochs.py),
    with dropout and a shuffling DataLoader. ``die_at``: rank 1 is SIGKILLed at that step."""
    import itertools
    from torch.utils.data import DataLoader, TensorDataset
    from mgpu_lab import FSDP, GradientAccumulator, LossScaler, autocast_dtype, rank_device
    K, device = 2, rank_device()
    torch.manual_seed(10 + dist.get_rank())          # each rank its own dropout stream and shuffle
    net = DropoutNet()
    g = torch.Generator().manual_seed(3)
    loader = DataLoader(TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 2, (64,), generator=g)),
                        batch_size=4, shuffle=True)
    model = FSDP(net.to(device), units=net.blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    dtype = autocast_dtype(device)
    scaler = LossScaler(enabled=dtype == torch.float16)
    acc = GradientAccumulator(model, optimizer, accumulation_steps=K, scaler=scaler, max_grad_norm=1.0)
    state = TrainState(model, optimizer, scaler, scheduler=scheduler)
    state.load(path)
    for x, y in itertools.islice(loader, state.step * K, None):
        with acc.micro_step(), torch.autocast(device.type, dtype=dtype):
            acc.backward(F.cross_entropy(model(x), y), num_samples=len(x))
        if acc.micro_steps_in_window == 0:
            scheduler.step()
            state.step += 1
            if state.step % 3 == 0:
                state.save(path)
            if state.step == die_at and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    return {k: v.clone() for k, v in model.state_dict().items()}, torch.rand(2)


def test_a_single_epoch_loop_resumes_bit_for_bit_with_dropout_and_a_shuffling_loader(tmp_path):
    from mgpu_lab import LaunchError
    full = launch(_readme_loop, nprocs=2, args=(str(tmp_path / "full.pt"), None), timeout=120)
    path = str(tmp_path / "ckpt.pt")
    with pytest.raises(LaunchError, match="SIGKILL"):
        launch(_readme_loop, nprocs=2, args=(path, 5), timeout=120)   # saved at step 3, killed at 5
    assert load_checkpoint(path)["step"] == 3
    resumed = launch(_readme_loop, nprocs=2, args=(path, None), timeout=120)
    for rank in range(2):
        for name, w in full[rank][0].items():
            assert torch.equal(resumed[rank][0][name], w), f"rank {rank}: {name} differs after resuming"
        assert torch.equal(resumed[rank][1], full[rank][1]), f"rank {rank}: the RNG stream differs"


# --------------------------------------------------------------------------- portable checkpoints

def _fsdp_parameters():
    from mgpu_lab import FSDP
    net = TiedNet(seed=0)
    model = FSDP(net, units=[net.hidden])
    return [id(p) for p in net.parameters()] == [id(p) for p in model.parameters()], len(list(net.parameters()))


def test_fsdp_keeps_the_shards_reachable_from_the_wrapped_module():
    same, count = launch(_fsdp_parameters, nprocs=2, timeout=60)[0]
    assert same and count == 3  # the root's trainable and frozen shards, the unit's


WRAPPERS_ACROSS = ("fsdp", "torch_ddp", "fully_shard")


def _portable(path, save_under, load_under, steps):
    """Train TiedNet under ``save_under`` for 2 steps and save; or load under ``load_under`` and go on."""
    from conftest import wrap
    rank, world = dist.get_rank(), dist.get_world_size()
    model = wrap(load_under or save_under, TiedNet(seed=0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
    state = TrainState(model, opt)
    if load_under:
        assert state.load(path)
    while state.step < steps:
        g = torch.Generator().manual_seed(state.step)
        x = torch.randint(0, VOCAB, (4, 4), generator=g).chunk(world)[rank]
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, VOCAB), x.roll(1, 1).reshape(-1)).backward()
        opt.step()
        state.step += 1
    if not load_under:
        state.save(path)
    from mgpu_lab.training.state_dicts import model_state
    return model_state(model)


def test_a_checkpoint_resumes_under_another_wrapper_and_rank_count(tmp_path):
    """Saved under FSDP, torch DDP or fully_shard on 2 ranks; resumed under each other one on 2 ranks,
    and in one process: the weights after two more steps equal the one-process run's."""
    def path(w):
        return str(tmp_path / f"{w}.pt")
    for w in WRAPPERS_ACROSS:
        launch(_portable, nprocs=2, args=(path(w), w, None, 2), timeout=120)
    reference = TiedNet(seed=0)
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=0.02)
    for step in range(4):
        x = torch.randint(0, VOCAB, (4, 4), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        F.cross_entropy(reference(x).reshape(-1, VOCAB), x.roll(1, 1).reshape(-1)).backward()
        opt.step()
    for saved in WRAPPERS_ACROSS:
        for loaded in [w for w in WRAPPERS_ACROSS if w != saved]:
            got = launch(_portable, nprocs=2, args=(path(saved), None, loaded, 4), timeout=120)[0]
            for name, w in reference.state_dict().items():
                torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"saved under {saved}, resumed under {loaded}: {name}: {m}")
        one = TiedNet(seed=1)  # one process: the plain model, from any of them
        state = TrainState(one, torch.optim.AdamW([p for p in one.parameters() if p.requires_grad], lr=0.02))
        with pytest.warns(UserWarning, match="written by 2 rank"):
            state.load(path(saved))
        assert state.optimizer.state_dict()["state"], saved  # Adam's moments came along


def test_a_checkpoint_that_cannot_load_says_what_it_holds_and_what_to_do(tmp_path):
    path = str(tmp_path / "fsdp.pt")
    launch(_portable, nprocs=2, args=(path, "fsdp", None, 1), timeout=120)
    other = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with pytest.raises(CheckpointError, match=r"saved under fsdp on 2 rank\(s\).*build the same model"):
        TrainState(other).load(path)
    old = load_checkpoint(path)  # the format before per-parameter state: FSDP's optimizer state per rank
    old.pop("format")
    old["optimizer"] = {"per_rank": [{"state": {}, "param_groups": []}] * 2}
    save_checkpoint(path, **old)
    model = TiedNet(seed=0)
    state = TrainState(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    with pytest.raises(CheckpointError, match=r"per-rank state of 2 ranks.*Resume once under FSDP on 2 ranks"):
        state.load(path)


def test_a_sharded_checkpoint_survives_a_crash_mid_save(tmp_path, monkeypatch):
    from mgpu_lab.training import sharded_checkpoint
    model = TiedNet(seed=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
    F.cross_entropy(model(torch.arange(8).view(2, 4)).reshape(-1, VOCAB), torch.arange(8)).backward()
    opt.step()
    folder = str(tmp_path / "ckpt")
    state = TrainState(model, opt, step=1, sharded=True)
    state.save(folder)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def crash(*args, **kwargs):
        raise OSError("the node lost power")
    monkeypatch.setattr(sharded_checkpoint, "_write_text", crash)   # after the tensors, before the switch
    state.step = 2
    with torch.no_grad():
        model.hidden.weight.add_(1.0)
    with pytest.raises(CheckpointError, match="lost power"):
        state.save(folder)
    monkeypatch.undo()
    fresh = TiedNet(seed=3)
    again = TrainState(fresh, torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad]))
    assert again.load(folder) and again.step == 1   # the previous generation, whole
    for name, w in saved.items():
        assert torch.equal(fresh.state_dict()[name], w), name
    assert again.optimizer.state_dict()["state"]


def _rank0_save_fails(folder):
    import errno
    from mgpu_lab.training import checkpoint_file, sharded_checkpoint
    rank = dist.get_rank()
    out = {}
    for kind in ("file", "sharded"):
        state = TrainState(DDP(torch.nn.Linear(2, 2)), path=f"{folder}/{kind}", sharded=kind == "sharded", keep=2)
        module = checkpoint_file if kind == "file" else sharded_checkpoint
        real = module.write_atomically
        if rank == 0:
            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")
            module.write_atomically = full
        try:
            state.save()
            out[kind] = "saved"
        except Exception as exc:
            out[kind] = (type(exc).__name__, str(exc))
        module.write_atomically = real
        state.save()                                   # the group is still usable
    # two generations, the newest truncated by rank 0: every rank falls back, rank 0 sets it aside, warns once
    state = TrainState(DDP(torch.nn.Linear(2, 2)), path=f"{folder}/gen.pt", keep=2)
    for _ in range(2):
        state.step += 1
        state.save()
    if rank == 0:
        data = open(f"{folder}/gen.pt", "rb").read()
        open(f"{folder}/gen.pt", "wb").write(data[:len(data) // 2])
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh = TrainState(DDP(torch.nn.Linear(2, 2)), path=f"{folder}/gen.pt", keep=2)
        out["loaded"] = (fresh.load(), fresh.step, [str(w.message) for w in caught if "unreadable" in str(w.message)])
    return out


def test_every_rank_raises_checkpoint_error_when_rank_0s_save_fails(tmp_path):
    results = launch(_rank0_save_fails, nprocs=2, args=(str(tmp_path),), timeout=120)
    for kind in ("file", "sharded"):
        (type0, text0), (type1, text1) = results[0][kind], results[1][kind]
        assert type0 == type1 == "CheckpointError", (text0, text1)
        assert "out of disk space" in text0
        assert text1.startswith(f"rank 1: TrainState.save(") and "rank 0's save failed (see its error" in text1
        assert "out of disk space" in text1 and "died or left" not in text1
    (ok0, step0, said0), (ok1, step1, said1) = results[0]["loaded"], results[1]["loaded"]
    assert ok0 and ok1 and step0 == step1 == 1
    assert len(said0) == 1 and "is now" not in said0[0] and "Set aside as" in said0[0] and said1 == []
    assert {"file", "gen.pt.1", "gen.pt.unreadable"} <= set(os.listdir(tmp_path))
    assert not {"file.1", "gen.pt"} & set(os.listdir(tmp_path))       # the failed save left nothing
    assert_no_children()
