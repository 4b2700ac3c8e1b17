"""LossScaler reproduces torch.amp.GradScaler exactly; autocast_dtype; amp_step trains.

The parity tests drive a LossScaler and a GradScaler with the same gradient
stream (two identical models, inf and NaN injected on chosen steps, a small
growth_interval so the scale both grows and backs off) and require the same
scale, growth tracker, skipped steps and bit-identical parameters every step.
"""
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import VOCAB, TiedNet, mlp, requires_gpus
from mgpu_lab import LossScaler, amp_step, autocast_dtype, launch

STEPS = 36
# step -> (parameter, value): opt_a owns hidden.*, opt_b owns embed.weight
INJECT = {4: ("hidden", "inf"), 5: ("hidden", "nan"), 6: ("hidden", "inf"), 13: ("embed", "nan"),
          14: ("hidden", "-inf"), 22: ("hidden", "inf"), 30: ("embed", "nan")}


def _batch(step, n=8, seq=5):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (n, seq), generator=g), torch.randint(0, VOCAB, (n, seq), generator=g))


def _drive(scaler, device="cpu", autocast=torch.float16, clip_on=(3, 9, 22), new_scale_at=25):
    """Train TiedNet with two optimizers under ``scaler``; record everything per step."""
    model = TiedNet(seed=0).to(device)
    opt_a = torch.optim.SGD([model.hidden.weight, model.hidden.bias], lr=0.1, momentum=0.9)
    opt_b = torch.optim.Adam([model.embed.weight], lr=0.01)
    log = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in _batch(step))
        for o in (opt_a, opt_b):
            o.zero_grad()
        with torch.autocast(device.split(":")[0] if isinstance(device, str) else device.type, dtype=autocast):
            loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        scaler.scale(loss).backward()
        if step in INJECT:  # one optimizer's gradients get the bad value: the other one still steps
            where, value = INJECT[step]
            (model.hidden.weight if where == "hidden" else model.embed.weight).grad[1, 2] = float(value)
        if step in clip_on:
            scaler.unscale_(opt_a)
            nn.utils.clip_grad_norm_(model.hidden.parameters(), 0.5)
        ret_a, ret_b = scaler.step(opt_a), scaler.step(opt_b)
        if step == new_scale_at:
            scaler.update(1024.0)
        else:
            scaler.update()
        log.append(dict(scale=scaler.get_scale(), tracker=scaler.state_dict()["_growth_tracker"],
                         state={k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                         rets=(ret_a, ret_b)))
    return log


def _assert_same(log, ref):
    assert len(log) == len(ref) == STEPS
    for step, (a, b) in enumerate(zip(log, ref)):
        assert a["scale"] == b["scale"], (step, a["scale"], b["scale"])
        assert a["tracker"] == b["tracker"], (step, a["tracker"], b["tracker"])
        for k in b["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), (step, k)


@pytest.mark.parametrize("interval", [1, 3])
def test_scale_sequence_and_parameters_match_gradscaler(interval):
    kw = dict(init_scale=2.0 ** 14, growth_factor=2.0, backoff_factor=0.5, growth_interval=interval)
    ref = _drive(torch.amp.GradScaler("cpu", **kw))
    log = _drive(LossScaler(**kw))
    _assert_same(log, ref)
    scales = [r["scale"] for r in ref]
    # The stream really exercised the rule: it backed off, grew, and skipped opt_a only.
    assert min(scales) < 2.0 ** 14 and max(scales) > 2.0 ** 14, scales
    assert len(set(scales)) > 5
    before, after = ref[3]["state"], ref[4]["state"]
    assert torch.equal(before["hidden.weight"], after["hidden.weight"])  # step 4: opt_a skipped
    assert not torch.equal(before["embed.weight"], after["embed.weight"])  # opt_b stepped


def test_inexact_factors_and_the_fp32_ceiling_match_gradscaler():
    """backoff 0.3 and growth 3.0 round in fp32; growth stops before fp32 overflows to inf."""
    for kw, dtype in ((dict(init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=2),
                       torch.float16),
                      (dict(init_scale=2.0 ** 120, growth_factor=2.0, backoff_factor=0.5, growth_interval=1),
                       torch.bfloat16)):  # bf16: fp32's range, so only the ceiling stops the growth
        ref = _drive(torch.amp.GradScaler("cpu", **kw), autocast=dtype, new_scale_at=-1)
        log = _drive(LossScaler(**kw), autocast=dtype, new_scale_at=-1)
        _assert_same(log, ref)
    assert max(r["scale"] for r in ref) == 2.0 ** 127  # capped, never inf


def test_bf16_autocast_and_unscale_error_messages():
    ref = _drive(torch.amp.GradScaler("cpu", growth_interval=2), autocast=torch.bfloat16)
    log = _drive(LossScaler(growth_interval=2), autocast=torch.bfloat16)
    _assert_same(log, ref)

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler()
    with pytest.raises(RuntimeError, match="scale\\(loss\\)"):
        scaler.unscale_(opt)
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called since the last update"):
        scaler.step(opt)
    scaler.update()
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    scaler.unscale_(opt)  # allowed again after update()
    with pytest.raises(ValueError, match="growth_factor"):
        LossScaler(growth_factor=1.0)
    half = mlp().half()
    opt = torch.optim.SGD(half.parameters(), lr=0.1)
    s = LossScaler()
    s.scale(half(torch.ones(2, 6, dtype=torch.float16)).sum()).backward()
    with pytest.raises(ValueError, match="master weights"):
        s.step(opt)


@pytest.mark.parametrize("case", ["clean", "huge_but_finite", "inf_and_minus_inf", "nan", "bf16_inf", "empty"])
def test_unscale_matches_the_fused_kernel_on_edge_cases(case):
    """Gradients unscaled bit for bit as GradScaler does; found-inf only for inf/NaN elements
    (finite values whose sum overflows fp32 are not an overflow)."""
    g = torch.Generator().manual_seed(0)
    values = {"clean": [torch.randn(5, generator=g), torch.randn(3, 3, generator=g)],
              "huge_but_finite": [torch.full((4,), 3e38), torch.randn(3, generator=g)],
              "inf_and_minus_inf": [torch.randn(3, generator=g), torch.tensor([float("inf"), -float("inf")])],
              "nan": [torch.tensor([1.0, float("nan")]), torch.randn(2, generator=g)],
              "bf16_inf": [torch.tensor([1.0, float("inf")], dtype=torch.bfloat16), torch.ones(2)],
              "empty": [torch.zeros(0), torch.randn(4, generator=g)]}[case]
    results = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=3000.0), LossScaler(init_scale=3000.0)):
        params = [torch.zeros_like(v, requires_grad=True) for v in values]
        for p, v in zip(params, values):
            p.grad = v.clone()
        opt = torch.optim.SGD(params, lr=1.0)
        scaler.scale(torch.ones(()))
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        results.append(([p.grad for p in params], [p.detach().clone() for p in params], scaler.get_scale()))
    (g_ref, p_ref, s_ref), (g_ours, p_ours, s_ours) = results
    assert s_ours == s_ref, (case, s_ours, s_ref)
    assert s_ref == (1500.0 if case in ("inf_and_minus_inf", "nan", "bf16_inf") else 3000.0)
    for a, b in zip(g_ours + p_ours, g_ref + p_ref):
        assert a.dtype == b.dtype and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), case


def test_fused_optimizer_and_several_losses_match_gradscaler():
    """A fused Adam unscales inside its kernel (GradScaler hands it grad_scale and found_inf);
    scale() of a list of losses scales each one."""
    runs = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=3000.0, growth_interval=2),
                   LossScaler(init_scale=3000.0, growth_interval=2)):
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
        weights, scales = [], []
        for step in range(8):
            opt.zero_grad()
            x = torch.randn(3, 8)
            a, b = scaler.scale([model(x).pow(2).mean(), (model(x).sum(),)])
            (a + b[0]).backward()
            if step == 3:
                model.weight.grad[0, 0] = float("nan")
            if step == 5:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            weights.append(model.weight.detach().clone())
            scales.append(scaler.get_scale())
        runs.append((weights, scales))
    assert runs[0][1] == runs[1][1], runs
    assert runs[0][1][3] == runs[0][1][2] / 2, runs[0][1]  # backed off after the NaN
    for step, (w_ref, w_ours) in enumerate(zip(*(r[0] for r in runs))):
        assert torch.equal(w_ref, w_ours), step
    assert torch.equal(runs[0][0][2], runs[0][0][3])  # the NaN step was skipped


def test_state_dict_round_trip_and_interchange_with_gradscaler():
    a = LossScaler(init_scale=256.0, growth_interval=3)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        opt.zero_grad()
        a.scale(model(torch.ones(2, 6)).sum()).backward()
        if step == 1:
            model[0].weight.grad[0, 0] = float("nan")
        a.step(opt)
        a.update()
    sd = a.state_dict()
    assert sd == {"scale": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                  "growth_interval": 3, "_growth_tracker": 0}, sd
    for other in (LossScaler(), torch.amp.GradScaler("cpu")):
        other.load_state_dict(sd)
        assert other.state_dict() == sd
    torch_sd = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=7).state_dict()
    b = LossScaler()
    b.load_state_dict(torch_sd)
    assert b.state_dict() == torch_sd
    b.scale(torch.ones(())).backward  # lazily created from the loaded state
    assert b.get_scale() == 8.0 and b.get_growth_interval() == 7
    with pytest.raises(RuntimeError, match="empty"):
        b.load_state_dict({})


def test_disabled_is_a_no_op():
    s = LossScaler(enabled=False)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.ones(2, 6)).sum()
    assert s.scale(loss) is loss
    loss.backward()
    before = model[0].weight.detach().clone()
    model[0].weight.grad[0, 0] = float("inf")  # disabled: no check, the step happens
    s.unscale_(opt)
    s.step(opt)
    s.update()
    assert not torch.equal(before, model[0].weight)
    assert s.get_scale() == 1.0 and s.state_dict() == {} and not s.is_enabled()
    s.load_state_dict({})


def test_autocast_dtype():
    assert autocast_dtype("cpu") == torch.bfloat16
    assert autocast_dtype(torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype="):
        autocast_dtype("meta")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            autocast_dtype("cuda")


def _data(n=256):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 6, generator=g)
    w = torch.randn(6, 4, generator=g)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 4, generator=g)


def _train(dtype, scaler, steps=150):
    model = mlp(seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _data()
    losses = [amp_step(model, opt, nn.functional.mse_loss, (x, y), scaler=scaler, dtype=dtype,
                       max_grad_norm=1.0).item() for _ in range(steps)]
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item(), losses


def test_amp_training_on_cpu_reaches_the_fp32_loss():
    """bf16 (no scaler) and fp16 + LossScaler end within 10% (relative) of fp32's final
    loss, and every run went from the initial loss down by more than 5x."""
    fp32, l32 = _train(torch.float32, None)
    bf16, lbf = _train(torch.bfloat16, None)
    fp16, l16 = _train(torch.float16, LossScaler(init_scale=2.0 ** 16, growth_interval=50))
    for name, final, losses in (("bf16", bf16, lbf), ("fp16", fp16, l16)):
        assert abs(final - fp32) <= 0.10 * fp32, (name, final, fp32)
        assert losses[0] > 5 * final, (name, losses[0], final)
    assert l32[0] > 5 * fp32


def test_amp_step_is_the_gradscaler_recipe():
    """amp_step with a GradScaler equals the documented recipe written out by hand, bit for bit."""
    x, y = _data(64)
    m1, m2 = mlp(seed=1), mlp(seed=1)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    s1 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=2)
    s2 = LossScaler(init_scale=2.0 ** 20, growth_interval=2)
    for _ in range(6):
        o1.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss1 = nn.functional.mse_loss(m1(x), y)
        s1.scale(loss1).backward()
        s1.unscale_(o1)
        nn.utils.clip_grad_norm_(m1.parameters(), 0.1)
        s1.step(o1)
        s1.update()
        loss2 = amp_step(m2, o2, nn.functional.mse_loss, (x, y), scaler=s2, dtype=torch.float16,
                         max_grad_norm=0.1)
        assert torch.equal(loss1.detach(), loss2) and loss2.dtype == torch.float32
        assert s1.get_scale() == s2.get_scale()
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(p1, p2)


def test_amp_step_with_two_optimizers_is_the_gradscaler_recipe():
    """A list of optimizers: each unscaled, the norm of all their gradients clipped together,
    each stepped (and skipped on its own inf), the scaler updated once, bit for bit the recipe
    of torch's AMP examples. The inputs' first column is large, so at some steps only the last
    layer's gradients overflow: one optimizer steps while the other skips."""
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(64, 6, generator=g) * torch.tensor([300.0] + [1.0] * 5), torch.randn(64, 4, generator=g))
               for _ in range(16)]
    runs, split_decisions = [], 0
    for by_hand in (True, False):
        model = mlp(seed=2)
        opts = [torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9),
                torch.optim.AdamW(model[2].parameters(), lr=0.01)]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
        log = []
        for x, y in batches:
            before = [p.detach().clone() for p in model.parameters()]
            if by_hand:
                for o in opts:
                    o.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                for o in opts:
                    scaler.unscale_(o)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                for o in opts:
                    scaler.step(o)
                scaler.update()
            else:
                loss = amp_step(model, opts, nn.functional.mse_loss, (x, y), scaler=scaler,
                                dtype=torch.float16, max_grad_norm=1.0)
            moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
            split_decisions += moved[0] != moved[2]
            log.append((loss.item(), scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
        runs.append(log)
    assert split_decisions >= 2, "the case must make one optimizer skip while the other steps"
    for (l1, s1, p1), (l2, s2, p2) in zip(*runs):
        assert l1 == l2 and s1 == s2
        assert all(torch.equal(a, b) for a, b in zip(p1, p2))


def _one_rank_overflows(sync):
    """No gradient all-reduce here: only the scaler's flag connects the ranks."""
    rank = dist.get_rank()
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=2.0 ** 10, growth_interval=2, sync_ranks=sync)
    skipped = []
    for step in range(5):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.full((2, 6), float(rank + step))).pow(2).mean()
        scaler.scale(loss).backward()
        if rank == 1 and step == 2:
            model[2].bias.grad[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        skipped[-1] = (skipped[-1], scaler.get_scale())
    return skipped


def test_an_inf_on_one_rank_skips_the_step_on_every_rank():
    results = launch(_one_rank_overflows, nprocs=2, args=(True,), timeout=60)
    assert results[0] == results[1], results
    assert [s for s, _ in results[0]] == [False, False, True, False, False]
    assert [sc for _, sc in results[0]] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
    alone = launch(_one_rank_overflows, nprocs=2, args=(False,), timeout=60)
    assert alone[0][2] == (False, 2048.0) and alone[1][2] == (True, 1024.0)  # without the all-reduce they diverge


@requires_gpus(1)
def test_matches_gradscaler_on_cuda_fp16():
    kw = dict(init_scale=2.0 ** 14, growth_interval=3)
    ref = _drive(torch.amp.GradScaler("cuda", **kw), device="cuda")
    log = _drive(LossScaler(**kw), device="cuda")
    _assert_same(log, ref)


@requires_gpus(1)
def test_autocast_dtype_on_cuda_and_fp16_training():
    major, _ = torch.cuda.get_device_capability(0)
    assert autocast_dtype("cuda") == (torch.bfloat16 if major >= 8 or torch.version.hip else torch.float16)
    assert autocast_dtype(0) == autocast_dtype("cuda:0")
    model = mlp(seed=3).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = (t.cuda() for t in _data())
    scaler = LossScaler()
    first = amp_step(model, opt, nn.functional.mse_loss, (x, y), scaler=scaler, dtype=torch.float16)
    for _ in range(100):
        last = amp_step(model, opt, nn.functional.mse_loss, (x, y), scaler=scaler, dtype=torch.float16)
    assert math.isfinite(last.item()) and last.item() < first.item() / 3
    assert scaler._scale.device.type == "cuda"
