"""README's loop over epochs resumes bit for bit, mid-epoch and at an epoch boundary; the batch plan."""
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import assert_no_children
from mgpu_lab import batch_plan, launch

E, N = 3, 24   # epochs; samples (12 per rank: 3 optimizer steps of 4 per rank, K=2 micro-batches of 2)


class Noisy(torch.utils.data.Dataset):
    """Augmentation from the global RNG in __getitem__ (no workers: the main process's stream),
    and a count of the items read."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(N, 6, generator=g), torch.randint(0, 2, (N,), generator=g)
        self.reads = 0

    def __len__(self):
        return N

    def __getitem__(self, i):
        self.reads += 1
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]


class Stopped(Exception):
    pass


def readme_loop():
    """README's training loop, as it reads."""
    import re
    from conftest import ROOT
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return next(b for b in blocks if "for epoch in range(state.epoch, E)" in b)


def _epoch_loop(path, stop_at, kind):
    """README's loop over epochs, as it reads (FSDP, accumulation, bf16, a schedule, batch_plan, a shuffling
    DistributedSampler, TrainState with the loader), with dropout and augmentation from the global RNG,
    except: 3 epochs of 24 samples, a global batch of 8 in micro-batches of 2, and a save at ``stop_at``
    then a return (not every 100 steps). ``kind``: "plain" (README's DataLoader), "stateful" (torchdata's),
    "shuffle" (DataLoader(shuffle=True): every rank its own order, drawn from the global RNG at each
    epoch's first batch)."""
    from test_train_state import DropoutNet
    torch.manual_seed(10 + dist.get_rank())                      # each rank its own dropout stream
    random.seed(dist.get_rank())
    block = readme_loop()
    swaps = [("E = 10 ", "E = 3 "), ("global_batch=256", "global_batch=8"), ("micro_batch=16", "micro_batch=2"),
             ('path="ckpt.pt"', "path=path"),
             ("if state.step % 100 == 0:\n                state.save()",
              "if state.step == stop_at:\n                state.save()\n                raise Stopped")]
    loader_line = "loader = DataLoader(dataset, batch_sampler=plan.batch_sampler(sampler))"
    if kind == "stateful":
        swaps.append((loader_line, "from torchdata.stateful_dataloader import StatefulDataLoader\n"
                                   + loader_line.replace("DataLoader(", "StatefulDataLoader(")))
    elif kind == "shuffle":
        swaps.append((loader_line, "loader = DataLoader(dataset, batch_size=2, shuffle=True)"))
    for old, new in swaps:
        assert old in block, f"README's loop changed: {old!r} is not in it"
        block = block.replace(old, new)
    scope = {"net": DropoutNet(), "dataset": Noisy(), "loss_fn": F.cross_entropy, "path": path,
             "stop_at": stop_at, "Stopped": Stopped}
    try:
        exec(compile(block, "README.md", "exec"), scope)
    except Stopped:
        return {"reads": scope["dataset"].reads}
    assert scope["K"] == 2
    return {"model": {k: v.clone() for k, v in scope["model"].state_dict().items()}, "rng": torch.rand(2),
            "reads": scope["dataset"].reads, "epoch": scope["state"].epoch, "step": scope["state"].step}


def _full_stopped_resumed(folder, kind, stops):
    """In each rank: the uninterrupted run; then, for a stop at an epoch boundary and one mid-epoch,
    a run that saves and stops and a fresh run that resumes."""
    out = {"full": _epoch_loop(f"{folder}/full.pt", None, kind)}
    for stop in stops:
        path = f"{folder}/stop{stop}.pt"
        out[f"stopped{stop}"] = _epoch_loop(path, stop, kind)
        out[f"resumed{stop}"] = _epoch_loop(path, None, kind)
    return out


@pytest.mark.parametrize("kind", ["plain", "stateful", "shuffle"],
                         ids=["DataLoader+DistributedSampler", "StatefulDataLoader", "DataLoader(shuffle=True)"])
def test_readmes_epoch_loop_resumes_bit_for_bit_mid_epoch_and_at_a_boundary(tmp_path, kind):
    if kind == "stateful":
        pytest.importorskip("torchdata.stateful_dataloader")
    per_epoch = 6 if kind == "shuffle" else 3     # optimizer steps per epoch
    stops = (per_epoch, per_epoch + 2)            # at the end of epoch 0; in the middle of epoch 1
    results = launch(_full_stopped_resumed, nprocs=2, args=(str(tmp_path), kind, stops), timeout=120)
    reads = E * N // (1 if kind == "shuffle" else 2)
    for rank, out in enumerate(results):
        full = out["full"]
        assert full["epoch"] == E and full["step"] == E * per_epoch and full["reads"] == reads
        for stop in stops:
            resumed = out[f"resumed{stop}"]
            where = f"rank {rank}, stopped at step {stop} ({'mid-epoch' if stop % per_epoch else 'an epoch boundary'})"
            for name, w in full["model"].items():
                assert torch.equal(resumed["model"][name], w), f"{where}: {name} differs from the uninterrupted run"
            assert torch.equal(resumed["rng"], full["rng"]), f"{where}: the RNG stream differs"
            assert resumed["epoch"] == E and resumed["step"] == E * per_epoch
            # the skipped samples were not read again: the two runs together read what one run read
            assert out[f"stopped{stop}"]["reads"] + resumed["reads"] == full["reads"], where
    assert_no_children()


# --------------------------------------------------------------------------- the batch plan

def test_a_batch_plan_splits_the_global_batch_exactly():
    plan = batch_plan(global_batch=256, dp_size=8, micro_batch=16)
    assert plan.accumulation_steps == 2 and plan.shares == (32,) * 8 and plan.micro_batches[0] == (16, 16)
    plan = batch_plan(global_batch=100, dp_size=3, micro_batch=12)
    assert plan.shares == (34, 33, 33) and sum(plan.shares) == 100
    assert plan.accumulation_steps == 3 and plan.micro_batches == ((12, 11, 11), (11, 11, 11), (11, 11, 11))
    assert all(max(m) <= 12 for m in plan.micro_batches)
    sampler = list(range(40))                     # one rank's sampler: 40 items, steps of at most 34
    batches = list(plan.batch_sampler(sampler, rank=1))
    assert [len(b) for b in batches] == [11, 11, 11] and len(plan.batch_sampler(sampler, rank=1)) == 3


@pytest.mark.parametrize("args, words", [
    ((5, 4, 1), r"shares of 2 and 1 items.*needs 2 micro-batches.*divisible by 4"),
    ((3, 4, 8), r"global batch of 3 over 4 data-parallel ranks leaves 1 rank"),
    ((8, 0, 2), r"dp_size must be a whole number >= 1, got 0"),
])
def test_a_batch_plan_that_cannot_be_kept_is_refused_with_the_numbers(args, words):
    with pytest.raises(ValueError, match=words):
        batch_plan(*args)


def _uneven_shares_equal_one_process():
    """3 ranks, a global batch of 10 (shares 4, 3, 3): the accumulator's step is the full batch's."""
    from mgpu_lab import GradientAccumulator
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 3, generator=g), torch.randn(10, 1, generator=g)
    plan = batch_plan(global_batch=10, dp_size=3, micro_batch=2)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(model, opt, accumulation_steps=plan.accumulation_steps)
    start = sum(plan.shares[:rank])
    for size in plan.micro_batches[rank]:
        idx, start = list(range(start, start + size)), start + size
        with acc.micro_step():
            acc.backward(F.mse_loss(model(x[idx]), y[idx]), num_samples=len(idx))
    return net.weight.detach().clone()


def test_uneven_shares_step_as_one_process_on_the_global_batch():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 3, generator=g), torch.randn(10, 1, generator=g)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    F.mse_loss(net(x), y).backward()
    opt.step()
    for w in launch(_uneven_shares_equal_one_process, nprocs=3, timeout=120):
        torch.testing.assert_close(w, net.weight.detach(), rtol=1e-6, atol=1e-7)


def test_draws_inside_workers_that_cannot_continue_are_said_once_at_save(tmp_path):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    import warnings
    from mgpu_lab import TrainState
    loader = stateful.StatefulDataLoader(Noisy(), batch_size=4, num_workers=1)
    state = TrainState(torch.nn.Linear(6, 2), dataloader=loader, path=str(tmp_path / "ckpt.pt"))
    next(iter(loader))
    with pytest.warns(UserWarning, match=r"StatefulDataLoader and 1 workers: random draws inside the workers"):
        state.save()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state.save()                                   # once
    plain = torch.utils.data.DataLoader(Noisy(), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # no workers: exact, no word
        TrainState(torch.nn.Linear(6, 2), dataloader=plain).save(str(tmp_path / "plain.pt"))


@pytest.mark.parametrize("where", ["at the last batch", "after the loop"])
def test_a_save_at_an_epochs_end_resumes_at_the_next_epoch(tmp_path, where):
    from mgpu_lab import TrainState
    loader = torch.utils.data.DataLoader(Noisy(), batch_size=8)   # 3 batches an epoch
    state = TrainState(torch.nn.Linear(6, 2), dataloader=loader, path=str(tmp_path / "ckpt.pt"))
    for epoch in range(state.epoch, 2):
        for i, _ in enumerate(loader):
            if epoch == 0 and i == 2 and where == "at the last batch":
                state.save()
        if epoch == 0 and where == "after the loop":
            assert state.epoch == 1                                 # the loader's epoch ended
            state.save()
    again = TrainState(torch.nn.Linear(6, 2), dataloader=torch.utils.data.DataLoader(Noisy(), batch_size=8))
    assert again.load(str(tmp_path / "ckpt.pt")) and again.epoch == 1


def _one_process_run(path, stop_at, epochs=2):
    """Dropout, augmentation drawn inside a worker, DataLoader(shuffle=True, num_workers=1)."""
    from mgpu_lab import TrainState
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.3), torch.nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=1)
    torch.manual_seed(5)
    state = TrainState(model, opt, dataloader=loader, path=path)
    state.load()
    for epoch in range(state.epoch, epochs):
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            state.step += 1
            if state.step == stop_at:
                state.save()
                return None
    return [p.detach().clone() for p in model.parameters()], torch.rand(2)


@pytest.mark.parametrize("stop", [6, 8], ids=["at an epoch boundary", "mid-epoch"])
def test_a_plain_loader_with_workers_resumes_bit_for_bit(tmp_path, stop):
    full = _one_process_run(str(tmp_path / "full.pt"), None)
    _one_process_run(str(tmp_path / "cut.pt"), stop)
    resumed = _one_process_run(str(tmp_path / "cut.pt"), None)
    assert all(torch.equal(a, b) for a, b in zip(full[0], resumed[0]))
    assert torch.equal(full[1], resumed[1])


def test_a_batch_plans_dropped_samples_are_said_once_with_the_count():
    import warnings
    for global_batch, dropped in ((32, (4, 4)), (33, (15, 20))):     # 100 samples per rank
        plan = batch_plan(global_batch=global_batch, dp_size=2, micro_batch=8)
        for rank in (0, 1):
            batches = plan.batch_sampler(range(100), rank=rank)
            said = (rf"rank {rank} reads {100 - dropped[rank]} of its sampler's 100 samples per epoch.*"
                    rf"the last {dropped[rank]} are dropped each epoch")
            with pytest.warns(UserWarning, match=said):
                read = sum(len(b) for b in batches)
            assert read == 100 - dropped[rank]
            with warnings.catch_warnings():
                warnings.simplefilter("error")                      # once
                list(batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                              # nothing dropped: no word
        list(batch_plan(global_batch=20, dp_size=2, micro_batch=5).batch_sampler(range(100), rank=1))
