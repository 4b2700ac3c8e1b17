"""GradientAccumulator trains exactly as one large batch per window.

Single process: even, uneven, token-weighted (padded sequences, TiedNet with a
frozen layer and tied weights) and tail (flush) windows, each against a
reference that back-propagates the window's items in one batch; SGD with
momentum (Adam would hide a wrong constant factor). Two gloo processes: torch
DDP, BucketedDDP and NaiveDDP, with different item counts on each rank, equal
the single-process reference, and communicate gradients once per window
(counted with a DDP comm hook / the buckets launched). The loss scaler:
update once per window, an overflow skips the whole window and halves the scale.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from conftest import ATOL, RTOL, VOCAB, TiedNet, max_param_diff, mlp
from mgpu_lab import BucketedDDP, GradientAccumulator, LossScaler, NaiveDDP, launch

SEQ = 5


def _sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3, momentum=0.9)


def _mse_batches(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g), torch.randn(n, 4, generator=g)) for n in sizes]


def _tokens(n, seed):
    """n padded sequences: labels -100 on a random tail of each (different token counts)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    keep = torch.randint(1, SEQ + 1, (n, 1), generator=g)
    y[torch.arange(SEQ).expand(n, SEQ) >= keep] = -100
    return x, y


def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)


def _assert_same(a, b):
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(pa, pb, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _train_mse(sizes, k, *, accumulate):
    """Micro-batches of the given sizes: through the accumulator, or windows of k as one batch."""
    model = mlp(0)
    opt = _sgd(model)
    batches = _mse_batches(sizes)
    if accumulate:
        acc = GradientAccumulator(model, opt, k)
        stepped = []
        for x, y in batches:
            with acc.micro_step():
                stepped.append(acc.backward(nn.functional.mse_loss(model(x), y), len(x)))
        stepped.append(acc.flush())
        return model, stepped
    for w in range(0, len(batches), k):
        x = torch.cat([b[0] for b in batches[w:w + k]])
        y = torch.cat([b[1] for b in batches[w:w + k]])
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, None


@pytest.mark.parametrize("case, sizes, k", [
    ("even", [4] * 8, 4),
    ("uneven", [1, 5, 3, 7, 2, 6, 4, 1, 9], 3),
    ("tail", [4, 4, 4, 4, 4, 2, 3], 3),  # two full windows, then flush() on 1 micro-batch of 3
])
def test_equals_the_large_batch(case, sizes, k):
    model, stepped = _train_mse(sizes, k, accumulate=True)
    ref, _ = _train_mse(sizes, k, accumulate=False)
    _assert_same(model, ref)
    windows = -(-len(sizes) // k)
    assert sum(stepped) == windows and stepped[k - 1] is True
    if case != "even":  # the naive loss / k really differs here (the test can tell)
        naive = mlp(0)
        opt = _sgd(naive)
        batches = _mse_batches(sizes)
        for i, (x, y) in enumerate(batches):
            (nn.functional.mse_loss(naive(x), y) / k).backward()
            if (i + 1) % k == 0 or i == len(batches) - 1:
                opt.step()
                opt.zero_grad()
        assert max_param_diff(naive, ref) > 1e-3


def test_token_weighted_windows_with_tied_and_frozen_params():
    """Different token counts per micro-batch: the step equals the mean over all the window's tokens."""
    micro = [_tokens(n, seed) for seed, n in enumerate([3, 2, 4, 1, 3, 2, 2])]  # k=3: 3+3+flush(1)
    model, ref = TiedNet(0), TiedNet(0)
    acc = GradientAccumulator(model, _sgd(model), 3, max_grad_norm=0.5)
    for x, y in micro:
        with acc.micro_step():
            acc.backward(_ce(model, x, y), num_samples=(y != -100).sum())
    assert acc.flush() and acc.optimizer_steps == 3
    opt = _sgd(ref)
    for w in range(0, len(micro), 3):
        opt.zero_grad()
        _ce(ref, torch.cat([m[0] for m in micro[w:w + 3]]), torch.cat([m[1] for m in micro[w:w + 3]])).backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.5)
        opt.step()
    _assert_same(model, ref)
    assert model.head.weight is model.embed.weight
    assert max_param_diff(model.frozen, TiedNet(0).frozen) == 0 and max_param_diff(model, TiedNet(0)) > 1e-3


def test_last_closes_the_window_early():
    model = mlp(0)
    acc = GradientAccumulator(model, _sgd(model), 4)
    (x, y), = _mse_batches([3])
    with acc.micro_step(last=True):
        assert acc.backward(nn.functional.mse_loss(model(x), y), 3) is True
    assert acc.micro_steps_in_window == 0 and acc.flush() is False


SCALERS = {  # torch's, and mgpu_lab's own: the same API and numbers
    "GradScaler": lambda **kw: torch.amp.GradScaler("cpu", **kw),
    "LossScaler": lambda **kw: LossScaler(**kw),
}


@pytest.mark.parametrize("make_scaler", SCALERS.values(), ids=SCALERS.keys())
def test_scaler_updates_once_per_window_and_an_overflow_skips_the_window(make_scaler):
    k, max_norm = 2, 0.05
    batches = _mse_batches([3, 5, 4, 2, 6, 1, 3, 3])   # 4 windows; window 2 overflows
    model, ref = mlp(0), mlp(0)
    scaler = make_scaler(init_scale=1024.0, growth_interval=2)
    acc = GradientAccumulator(model, _sgd(model), k, scaler=scaler, max_grad_norm=max_norm)
    scales, stepped, snapshot = [], [], None
    for i, (x, y) in enumerate(batches):
        if i == 2:
            snapshot = copy.deepcopy(model)
        with acc.micro_step():
            loss = nn.functional.mse_loss(model(x), y)
            if i == 2:
                loss = loss * float("inf")
            stepped.append(acc.backward(loss, len(x)))
            scales.append(scaler.get_scale())
        if i == 3:
            _assert_same(model, snapshot)  # the whole window was skipped
    assert stepped == [False, True, False, False, False, True, False, True]
    # growth_interval=2 counts windows, not micro-steps; the overflow halves once, then resets growth
    assert scales == [1024.0, 1024.0, 1024.0, 512.0, 512.0, 512.0, 512.0, 1024.0]
    assert (acc.optimizer_steps, acc.skipped_steps) == (3, 1)
    opt = _sgd(ref)
    for w in (0, 4, 6):                                # the windows that stepped
        opt.zero_grad()
        x = torch.cat([batches[w][0], batches[w + 1][0]])
        y = torch.cat([batches[w][1], batches[w + 1][1]])
        nn.functional.mse_loss(ref(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
    assert norm > max_norm  # clipping was active
    _assert_same(model, ref)


def test_bad_input_is_refused_with_advice():
    model = mlp(0)
    opt = _sgd(model)
    with pytest.raises(ValueError, match="accumulation_steps"):
        GradientAccumulator(model, opt, 0)
    with pytest.raises(TypeError, match="GradScaler"):
        GradientAccumulator(model, opt, 2, scaler=object())
    acc = GradientAccumulator(model, opt, 2)
    out = model(torch.randn(3, 6))
    with pytest.raises(ValueError, match="scalar"):
        acc.backward(out, 3)
    with pytest.raises(ValueError, match="count >= 0"):
        acc.backward(out.mean(), -1)
    with pytest.raises(ValueError, match="more than 0"):
        acc.backward(out.mean(), 0)
        acc.backward(model(torch.randn(3, 6)).mean(), 0)


class _UnknownWrapper(nn.Module):
    """A data-parallel wrapper mgpu_lab does not know: it communicates in finish_gradient_synchronization."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        raise AssertionError("an all-reduce mgpu_lab cannot know it must call")


def test_an_unknown_wrapper_is_refused_and_data_parallel_is_one_process():
    from mgpu_lab import TrainState
    from mgpu_lab.parallel.wrappers import unwrap
    model = _UnknownWrapper(mlp(0))
    for make in (lambda: GradientAccumulator(model, _sgd(model), 2), lambda: TrainState(model), lambda: unwrap(model)):
        with pytest.raises(TypeError, match="not a data-parallel wrapper mgpu_lab knows"):
            make()
    dp = nn.DataParallel(mlp(0))  # one process: accumulates like the plain module
    acc = GradientAccumulator(dp, _sgd(dp), 2)
    for x, y in _mse_batches([3, 5]):
        with acc.micro_step():
            acc.backward(nn.functional.mse_loss(dp(x), y), len(x))
    ref, _ = _train_mse([3, 5], 2, accumulate=False)
    _assert_same(dp.module, ref)
    assert unwrap(dp) is dp.module
    compiled = torch.compile(dp)  # compiled lazily: nothing runs here
    assert unwrap(compiled) is dp.module
    with pytest.raises(TypeError, match="not a data-parallel wrapper"):
        unwrap(torch.compile(model))


# -- two gloo processes ------------------------------------------------------

K, MICRO = 3, 7  # two full windows, then flush() on one micro-batch


def _rank_micro(j, rank):
    """Rank `rank`'s micro-batch j: 1 to 3 sequences, uneven across ranks and steps."""
    return _tokens(1 + (j + 2 * rank) % 3, seed=100 * j + rank)


def _ddp_cases():
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = TiedNet(0)
    opt = _sgd(ref)
    for w in range(0, MICRO, K):
        parts = [_rank_micro(j, r) for j in range(w, min(w + K, MICRO)) for r in range(world)]
        opt.zero_grad()
        _ce(ref, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])).backward()
        opt.step()
    out = {}
    for name in ("torch", "torch_every_step", "bucketed", "bucketed_every_step", "naive"):
        net = TiedNet(seed=rank)  # the wrappers broadcast rank 0's weights
        if name.startswith("torch"):
            model = DistributedDataParallel(net)
            comms = []

            def hook(state, bucket, comms=comms):
                comms.append(bucket.buffer().numel())
                return allreduce_hook(None, bucket)
            model.register_comm_hook(None, hook)
        else:
            model = BucketedDDP(net) if name.startswith("bucketed") else NaiveDDP(net)
            comms = []
            if name.startswith("bucketed"):
                launch_bucket = model._launch
                model._launch = lambda bucket, f=launch_bucket, comms=comms: (comms.append(1), f(bucket))[1]
        acc = GradientAccumulator(model, _sgd(model), K)
        for j in range(MICRO):
            x, y = _rank_micro(j, rank)
            if name.endswith("every_step"):  # no micro_step(): correct, but syncs every micro-step
                acc.backward(_ce(model, x, y), (y != -100).sum())
            else:
                with acc.micro_step():
                    acc.backward(_ce(model, x, y), (y != -100).sum())
        acc.flush()
        out[name] = dict(diff=max_param_diff(model.module, ref), comms=len(comms),
                         moved=max_param_diff(model.module, TiedNet(0)),
                         tied=model.module.head.weight is model.module.embed.weight,
                         frozen=max_param_diff(model.module.frozen, TiedNet(0).frozen))
    return out


def test_ddp_communicates_once_per_window_and_equals_one_process():
    for rank, out in enumerate(launch(_ddp_cases, nprocs=2, timeout=120)):
        for name, r in out.items():
            assert r["diff"] < 1e-5 and r["moved"] > 1e-3, (rank, name, r)
            assert r["tied"] and r["frozen"] == 0, (rank, name, r)
        # TiedNet's gradients fit one bucket. torch DDP: the two full windows all-reduce in
        # backward; the flushed window was in no_sync and is all-reduced by hand (not a hook).
        assert out["torch"]["comms"] == 2, out["torch"]
        assert out["torch_every_step"]["comms"] == MICRO, out["torch_every_step"]
        assert out["bucketed"]["comms"] == 3, out["bucketed"]          # flush launches it too
        assert out["bucketed_every_step"]["comms"] == MICRO, out["bucketed_every_step"]
