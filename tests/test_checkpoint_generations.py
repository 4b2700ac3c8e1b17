"""Checkpoints a practitioner trusts: generations that fall back, errors that name the file,
strict loading, failures found early, no stale temporaries (issue 48). One process, fast."""
import errno
import glob
import os

import pytest
import torch

from mgpu_lab import CheckpointError, TrainState, load_checkpoint
from mgpu_lab.training import sharded_checkpoint


def net(layers=3, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])


def trained_state(path, layers=3, **kwargs):
    model = net(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return TrainState(model, opt, path=path, **kwargs)


def step(state):
    state.model(torch.ones(2, 4)).sum().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.step += 1


def truncate(file):
    data = open(file, "rb").read()
    open(file, "wb").write(data[: len(data) // 2])


def test_keep_n_generations_and_fall_back_past_a_truncated_newest(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    state = trained_state(path, keep=2)
    weights = {}
    for _ in range(3):
        step(state)
        state.save()
        weights[state.step] = {k: v.clone() for k, v in state.model.state_dict().items()}
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt.pt.1"]      # the newest 2 of 3
    assert load_checkpoint(path)["step"] == 3 and load_checkpoint(path + ".1")["step"] == 2
    truncate(path)
    fresh = trained_state(path, keep=2)
    with pytest.warns(UserWarning, match=r"ckpt\.pt \(newest generation\) is unreadable: truncated.*loaded "
                                         r".*ckpt\.pt\.1 \(1 before the newest, step 2\)"):
        assert fresh.load()
    assert fresh.step == 2
    assert all(torch.equal(fresh.model.state_dict()[k], w) for k, w in weights[2].items())
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt.1", "ckpt.pt.unreadable"]   # set aside by the load
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # said once, by the load that set it aside
        assert trained_state(path, keep=2).load()
    os.unlink(path + ".unreadable")                             # as after a save cut short between two renames
    with pytest.warns(UserWarning, match=r"ckpt\.pt is missing.*loaded .*ckpt\.pt\.1"):
        assert trained_state(path, keep=2).load()


def test_a_truncated_one_file_checkpoint_raises_checkpoint_error_naming_the_file(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    state = trained_state(path)
    state.save()
    truncate(path)
    with pytest.raises(CheckpointError, match=r"ckpt\.pt.*newest.*truncated.*What to do") as info:
        trained_state(path).load()
    assert isinstance(info.value, RuntimeError) and info.value.path == path
    assert info.value.__cause__ is not None                 # torch's own exception, chained
    with pytest.raises(CheckpointError, match=r"loading checkpoint .*ckpt\.pt.* failed: truncated"):
        load_checkpoint(path)
    open(path, "wb").write(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match=r"not a checkpoint"):
        load_checkpoint(path)


def test_a_checkpoint_with_extra_layers_is_refused_naming_them(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    trained_state(path, layers=4).save()
    smaller = trained_state(path, layers=3)
    with pytest.raises(CheckpointError, match=r"2 tensor\(s\) this model lacks: \['3\.bias', '3\.weight'\]"
                                              r".*strict=False"):
        smaller.load()
    with pytest.raises(CheckpointError, match=r"3\.weight"):   # sharded too
        folder = str(tmp_path / "sharded")
        TrainState(net(4), path=folder, sharded=True).save()
        TrainState(net(3), path=folder, sharded=True).load()
    assert smaller.load(strict=False)                          # opting out: the 3 layers it has
    assert torch.equal(smaller.model[2].weight, load_checkpoint(path)["model"]["2.weight"])


def test_a_failed_saves_temporaries_do_not_survive_the_next_save(tmp_path, monkeypatch):
    folder = str(tmp_path / "sharded")
    state = trained_state(folder, sharded=True, keep=2)
    state.save()
    import torch.distributed.checkpoint as dcp

    def dies(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(dcp, "save", dies)
    step(state)
    with pytest.raises(CheckpointError, match=r"sharded.*\(generation new, step 1\) failed: out of disk"):
        state.save()
    monkeypatch.undo()
    assert glob.glob(f"{folder}/.step-*.tmp")                  # what the failed save left...
    step(state)
    state.save()
    assert not glob.glob(f"{folder}/.step-*.tmp")              # ...the next save removed
    assert len(sharded_checkpoint.generations(folder)) == 2    # keep=2
    path = str(tmp_path / "ckpt.pt")                          # one file: a save killed mid-write
    open(tmp_path / ".ckpt.pt.abc123.tmp", "wb").write(b"half")
    trained_state(path).save()
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "sharded"]


def test_out_of_disk_is_said_so_not_unexpected_pos(tmp_path, monkeypatch):
    import mgpu_lab.training.atomic_file as atomic_file
    real = atomic_file._Recording.write

    def full(self, data):
        if len(data) > 1000:
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error
        return real(self, data)
    monkeypatch.setattr(atomic_file._Recording, "write", full)
    state = trained_state(str(tmp_path / "ckpt.pt"))
    state.model[0].weight.data = torch.ones(400, 4)            # a record over 1000 bytes
    with pytest.raises(CheckpointError, match=r"ckpt\.pt.*step 0.*out of disk space") as info:
        state.save()
    assert info.value.__cause__.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []                          # no file, no temporary


def test_a_sharded_generation_with_a_damaged_shard_falls_back(tmp_path):
    folder = str(tmp_path / "sharded")
    state = trained_state(folder, sharded=True, keep=2)
    step(state)
    state.save()
    step(state)
    state.save()
    newest = sharded_checkpoint.generations(folder)[0]
    for shard in glob.glob(f"{newest}/*.distcp"):
        truncate(shard)
    fresh = trained_state(folder, sharded=True, keep=2)
    with pytest.warns(UserWarning, match=r"step-00000002.*unreadable.*loaded .*step-00000001"):
        assert fresh.load()
    assert fresh.step == 1


def test_an_unwritable_folder_fails_when_the_state_is_created(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match=r"a_file/ckpt\.pt.*not a folder"):
        trained_state(str(blocker / "ckpt.pt"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a chmod 555 folder anyway (the test above covers "
                                               "construction with a path under a file)")
def test_a_read_only_folder_fails_when_the_state_is_created(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(CheckpointError, match=r"permission denied"):
        trained_state(str(ro / "ckpt.pt"))


def test_an_unreadable_generation_is_set_aside_and_never_takes_a_good_ones_place(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    state = trained_state(path, keep=3)
    for _ in range(3):
        step(state)
        state.save()                                            # steps 3, 2, 1 in ckpt.pt, .1, .2
    truncate(path)
    fresh = trained_state(path, keep=3)
    with pytest.warns(UserWarning, match=r"ckpt\.pt \(newest generation\) is unreadable.*step 2\) instead\. "
                                         r"Set aside as .*ckpt\.pt\.unreadable.*keep does not count it"):
        assert fresh.load() and fresh.step == 2
    step(fresh)
    fresh.save()                                                # step 3 again: the good steps 2 and 1 stay
    assert [load_checkpoint(f"{path}{s}")["step"] for s in ("", ".1", ".2")] == [3, 2, 1]
    assert os.path.exists(path + ".unreadable")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # said once: the next load finds nothing to pass over
        assert trained_state(path, keep=3).load()


def test_a_flipped_byte_is_found_by_its_checksum_and_falls_back(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    state = trained_state(path, keep=2)
    for _ in range(2):
        step(state)
        state.save()
    import zipfile
    assert zipfile.ZipFile(path).comment.startswith(b"mgpu_lab-sha256:")   # still a zip torch.load reads
    assert torch.load(path, weights_only=True)["step"] == 2
    data = bytearray(open(path, "rb").read())
    weight = state.model[1].weight.detach().numpy().tobytes()
    at = data.find(weight)
    assert at > 0
    data[at + 5] ^= 0x10                                        # inside a weight tensor, same size
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupt \(its checksum differs"):
        load_checkpoint(path)
    fresh = trained_state(path, keep=2)
    with pytest.warns(UserWarning, match=r"ckpt\.pt \(newest generation\) is unreadable: corrupt \(its checksum "
                                         r"differs.*loaded .*ckpt\.pt\.1 \(1 before the newest, step 1\)"):
        assert fresh.load() and fresh.step == 1


def test_a_flipped_byte_in_a_sharded_generation_falls_back(tmp_path):
    folder = str(tmp_path / "sharded")
    state = trained_state(folder, sharded=True, keep=2)
    for _ in range(2):
        step(state)
        state.save()
    newest = sharded_checkpoint.generations(folder)[0]
    shard = glob.glob(f"{newest}/*.distcp")[0]
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(shard, "wb").write(bytes(data))
    fresh = trained_state(folder, sharded=True, keep=2)
    with pytest.warns(UserWarning, match=r"step-00000002.*unreadable: corrupt \(its checksum differs.*loaded "
                                         r".*step-00000001.*Set aside as .*step-00000002-\w+\.unreadable"):
        assert fresh.load() and fresh.step == 1
    step(fresh)
    fresh.save()                                                # the set-aside folder is not a generation
    assert [os.path.basename(g)[:13] for g in sharded_checkpoint.generations(folder)] == ["step-00000002",
                                                                                          "step-00000001"]
    assert trained_state(folder, sharded=True, keep=2).load()


def test_keep_1_unreadable_advice_is_said_once_and_agrees(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    trained_state(path).save()
    truncate(path)
    with pytest.raises(CheckpointError, match=r"none readable.*What to do: restore a copy, or start afresh") as info:
        trained_state(path).load()
    chain, e = [], info.value.__cause__
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert chain and not any(isinstance(e, CheckpointError) or "What to do" in str(e) for e in chain)
    assert os.path.exists(path)                                # nothing set aside when nothing loaded


@pytest.mark.parametrize("kind", ["a folder", "empty", "/proc"])
def test_a_path_no_save_could_use_is_refused_when_the_state_is_created(tmp_path, kind):
    if kind == "/proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    path, words, error = {"a folder": (str(tmp_path), r"is a folder.*give a file name inside it.*sharded=True",
                                       ValueError),
                          "empty": ("", r"an empty path", ValueError),
                          "/proc": ("/proc/ckpt.pt", r"the folder exists, but its file system creates no files",
                                    CheckpointError)}[kind]
    with pytest.raises(error, match=words):
        trained_state(path)
    if error is ValueError:                                     # given to save() instead: the same words
        with pytest.raises(error, match=words):
            TrainState(net()).save(path)
    if kind == "a folder":
        trained_state(str(tmp_path), sharded=True)            # a folder of generations: fine
        open(tmp_path / "f.pt", "wb").close()
        with pytest.raises(ValueError, match=r"that is a file.*sharded checkpoint is a folder"):
            trained_state(str(tmp_path / "f.pt"), sharded=True)


@pytest.mark.parametrize("keep", [1, 2, 3, 4])
def test_rotation_keeps_the_newest_in_order_whatever_numbers_are_missing(tmp_path, keep):
    from mgpu_lab.training import generations
    for mask in range(32):
        folder = tmp_path / f"{mask}"
        folder.mkdir()
        path = str(folder / "c")
        present = [n for i, n in enumerate([path] + [f"{path}.{i}" for i in range(1, 5)]) if mask >> i & 1]
        for name in present:
            open(name, "w").write(name)
        generations.rotate(path, keep)
        after = {str(folder / n): open(folder / n).read() for n in os.listdir(folder)}
        assert after.pop(path, None) == (path if path in present else None)   # replaced by the rename, not before
        assert after == {f"{path}.{i + 1}": present[i] for i in range(min(len(present), keep - 1))}, present
