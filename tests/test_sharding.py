"""ShardedOptimizer (ZeRO-1) and FSDP (ZeRO-3) train to the parameters of one process
on the full batch, of torch's ZeroRedundancyOptimizer and of torch's fully_shard (FSDP2),
on gloo with N = 2 and 3.

The model (TiedNet) has a frozen layer, a bias with requires_grad=False, a buffer and
an output projection tied to the embedding; each rank builds it from its own seed.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from conftest import ATOL, RTOL, VOCAB, TiedNet, requires_gpus
from mgpu_lab import FSDP, NaiveDDP, ShardedOptimizer, launch, partition_parameters, zero_bytes_per_rank

BATCH, SEQ, STEPS = 12, 5, 3


def _batches():
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(STEPS)]


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1))


OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.5, momentum=0.9)),
              "adamw": (torch.optim.AdamW, dict(lr=0.02, weight_decay=0.1))}


def _groups(model):
    """Two groups with different learning rates; the frozen parameters are included."""
    return [{"params": [model.embed.weight, model.frozen.weight, model.frozen.bias]},
            {"params": [model.hidden.weight, model.hidden.bias, model.head.bias], "lr_scale": 1}]


def _diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def _sharded_optimizer_cases():
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    out = {}
    for name, (cls, kw) in OPTIMIZERS.items():
        ref = TiedNet(seed=0)
        ref_opt = cls(_groups(ref), **kw)
        ours_model = NaiveDDP(TiedNet(seed=rank))
        ours = ShardedOptimizer(_groups(ours_model.module), cls, **kw)
        torch_model = DistributedDataParallel(TiedNet(seed=0))
        theirs = ZeroRedundancyOptimizer(_groups(torch_model.module), optimizer_class=cls, **kw)
        for step, (x, y) in enumerate(_batches()):
            for opt in (ref_opt, ours, theirs):  # a scheduler-like change of one group's lr
                opt.param_groups[1]["lr"] = kw["lr"] * (1 + step) / 2
            ref_opt.zero_grad()
            _loss(ref, x, y).backward()
            ref_opt.step()
            ours.zero_grad()
            _loss(ours_model, x[lo:hi], y[lo:hi]).backward()
            ours_model.finish_gradient_synchronization()
            ours.step()
            theirs.zero_grad()
            _loss(torch_model, x[lo:hi], y[lo:hi]).backward()
            theirs.step()
        sd = ours.state_dict()
        # Reload into a fresh sharded optimizer and the unsharded one: one more step each.
        again_model = NaiveDDP(TiedNet(seed=0))
        with torch.no_grad():
            for p, q in zip(again_model.module.parameters(), ours_model.module.parameters()):
                p.copy_(q)
        again = ShardedOptimizer(_groups(again_model.module), cls, **kw)
        again.load_state_dict(copy.deepcopy(sd))  # torch aliases loaded state tensors
        unsharded = cls(_groups(ref), **kw)
        unsharded.load_state_dict(copy.deepcopy(sd))
        x, y = _batches()[0]
        for opt, model, xs, ys in ((again, again_model, x[lo:hi], y[lo:hi]), (unsharded, ref, x, y)):
            opt.zero_grad()
            _loss(model, xs, ys).backward()
            if model is again_model:
                model.finish_gradient_synchronization()
            opt.step()
        names = {p: n for n, p in ours_model.module.named_parameters()}
        state_bytes = sum(t.numel() * t.element_size() for s in ours.state.values()
                          for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        out[name] = dict(
            final=[p.detach().clone() for p in ours_model.module.parameters()],
            zero_torch=[p.detach().clone() for p in torch_model.module.parameters()],
            reloaded=[p.detach().clone() for p in again_model.module.parameters()],
            sd=sd, tied=ours_model.module.head.weight is ours_model.module.embed.weight,
            owned=[[names[p] for p in part] for part in ours.partition],
            n_state=len(ours.state), state_bytes=state_bytes,
            lr=[g["lr"] for g in ours.local_optimizer.param_groups],
        )
        out[name]["ref_after_reload"] = [p.detach().clone() for p in ref.parameters()]
    return out


def _reference_run(name):
    """The unsharded optimizer on the full batch, same schedule: final params and state dict."""
    cls, kw = OPTIMIZERS[name]
    ref = TiedNet(seed=0)
    opt = cls(_groups(ref), **kw)
    for step, (x, y) in enumerate(_batches()):
        opt.param_groups[1]["lr"] = kw["lr"] * (1 + step) / 2
        opt.zero_grad()
        _loss(ref, x, y).backward()
        opt.step()
    return [p.detach().clone() for p in ref.parameters()], opt.state_dict()


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_optimizer_matches_unsharded_and_zero_redundancy(world):
    results = launch(_sharded_optimizer_cases, nprocs=world, timeout=180)
    for name in OPTIMIZERS:
        ref_params, ref_sd = _reference_run(name)
        label = f"N={world} {name}"
        for rank, res in enumerate(results):
            r = res[name]
            assert r["tied"], label
            assert _diff(r["final"], ref_params) < 2e-5, (label, rank)
            assert _diff(r["final"], r["zero_torch"]) < 2e-5, (label, rank)
            assert _diff(r["reloaded"], r["ref_after_reload"]) < 2e-5, (label, rank)
            assert r["lr"][1] == OPTIMIZERS[name][1]["lr"] * STEPS / 2, label  # hyperparameters follow
            # the state dict is the unsharded optimizer's, whoever owns what
            assert r["sd"]["param_groups"] == ref_sd["param_groups"], label
            assert sorted(r["sd"]["state"]) == sorted(ref_sd["state"]), label
            for i, s in ref_sd["state"].items():
                for k, v in s.items():
                    torch.testing.assert_close(r["sd"]["state"][i][k], v, rtol=RTOL, atol=ATOL)
            assert r["owned"] == results[0][name]["owned"], label  # the same partition everywhere
        # optimizer state exists once across the group: each trainable parameter has one owner
        assert sum(res[name]["n_state"] for res in results) == 3, label  # embed (tied: once), hidden.w/b
        owned = results[0][name]["owned"]
        # balanced by size: the 512-element embedding alone, the hidden layer (256 + 16) elsewhere
        assert owned == ([["embed.weight"], ["hidden.weight", "hidden.bias"]] if world == 2 else
                         [["embed.weight"], ["hidden.weight"], ["hidden.bias"]]), (label, owned)
        bytes_per_rank = [res[name]["state_bytes"] for res in results]
        assert bytes_per_rank[0] == 512 * 4 * (1 if name == "sgd" else 2), (label, bytes_per_rank)


def test_partition_is_balanced():
    sizes = [512, 256, 256, 16, 16, 100, 7]
    for n in (1, 2, 3, 4):
        parts = partition_parameters(sizes, n)
        assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in p) for p in parts]
        assert max(loads) <= sum(sizes) / n + max(sizes), (n, loads)
    assert partition_parameters([512, 256, 256, 16, 16, 100, 7], 2) == [[0, 5], [1, 2, 3, 4, 6]]  # 612 and 551
    with pytest.raises(ValueError, match="world_size"):
        partition_parameters([1], 0)


def test_zero_formulas():
    psi = 7_500_000_000  # the ZeRO paper's Figure 1: 7.5 B parameters, N = 64
    gb = [zero_bytes_per_rank(psi, 64, s) / 1e9 for s in range(4)]
    assert [round(g, 2) for g in gb] == [120.0, 31.41, 16.64, 1.88]
    with pytest.raises(ValueError, match="stage"):
        zero_bytes_per_rank(1, 2, 4)


# --------------------------------------------------------------------------- FSDP

def _torch_fully_shard(seed, mp=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = TiedNet(seed=seed)
    kw = {} if mp is None else {"mp_policy": mp}
    for m in (model.hidden, model.frozen):  # the tied pair stays in the root, as in ours
        fully_shard(m, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _full_grads(model):
    """The averaged gradients an FSDP model's shards hold, all-gathered, by parameter name."""
    grads = {}
    for g in model.flat_groups:
        if g.shard.grad is None:
            continue
        full = torch.empty(g.padded)
        dist.all_gather_into_tensor(full, g.shard.grad)
        for n, s, o in zip(g.names, g.shapes, g.offsets):
            grads[n] = full[o:o + s.numel()].view(s)
    return grads


def _fsdp_cases(compute_dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    ref = TiedNet(seed=0)
    # Adam turns rounding differences of near-zero gradients into lr-sized steps: SGD for 16 bits
    make = (lambda ps: torch.optim.AdamW(ps, lr=0.02)) if compute_dtype is None else \
        (lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9))
    ref_opt = make([p for p in ref.parameters() if p.requires_grad])
    ours = FSDP(TiedNet(seed=rank), compute_dtype=compute_dtype)
    opt = make(ours.parameters())
    mp = None
    if compute_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype)
    theirs = _torch_fully_shard(0, mp)
    their_opt = make([p for p in theirs.parameters() if p.requires_grad])
    freed_after_forward, gathered_dtypes, in_forward, grad_diffs = [], set(), [], {}
    probe = ours.module.hidden.register_forward_hook(
        lambda m, a, o: in_forward.append(m.weight.untyped_storage().nbytes()), prepend=True)
    for x, y in _batches():
        ref_opt.zero_grad()
        _loss(ref, x, y).backward()
        ref_opt.step()
        opt.zero_grad()
        loss = _loss(ours, x[lo:hi], y[lo:hi])
        freed_after_forward.append(max(g.full.untyped_storage().nbytes() for g in ours.flat_groups))
        gathered_dtypes |= {g.full.dtype for g in ours.flat_groups}
        loss.backward()
        ours.finish_gradient_synchronization()
        if not grad_diffs:  # the first step's gradients: the full batch's, averaged over ranks
            grad_diffs = {n: (g - ref.get_parameter(n).grad).abs().max().item()
                          for n, g in _full_grads(ours).items()}
        freed_after_forward.append(max(g.full.untyped_storage().nbytes() for g in ours.flat_groups))
        opt.step()
        their_opt.zero_grad()
        _loss(theirs, x[lo:hi], y[lo:hi]).backward()
        their_opt.step()
    probe.remove()
    full = ours.gather_full_params()
    theirs_full = {n: p.full_tensor() for n, p in theirs.named_parameters(remove_duplicate=False)}
    ref_full = dict(ref.named_parameters(remove_duplicate=False))
    held = sum(p.numel() * p.element_size() for p in ours.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in ours.parameters() if p.grad is not None)
    return dict(
        grad_diffs=grad_diffs,
        vs_ref={n: (full[n] - ref_full[n]).abs().max().item() for n in ref_full},
        vs_torch={n: (full[n] - theirs_full[n]).abs().max().item() for n in theirs_full},
        ref_abs={n: p.abs().max().item() for n, p in ref_full.items()},
        names=sorted(full), ref_names=sorted(ref_full),
        freed=freed_after_forward, in_forward=in_forward, dtypes=gathered_dtypes,
        shard_dtypes={p.dtype for p in ours.parameters()},
        held=held, grads=grads, groups=len(ours.flat_groups), units=ours.units,
        moved=max((full[n] - TiedNet(seed=0).get_parameter(n)).abs().max().item() for n in ref_full),
        comm=dict(ours.comm_bytes),
    )


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_matches_full_batch_and_fully_shard(world):
    results = launch(_fsdp_cases, args=(None,), nprocs=world, timeout=180)
    total = sum(p.numel() * 4 for p in TiedNet().parameters())
    for rank, r in enumerate(results):
        label = f"N={world} rank {rank}"
        assert r["names"] == r["ref_names"], label  # every name, the tied one under both
        for n, d in r["vs_ref"].items():  # fp32: the same maths in another order
            assert d <= ATOL + RTOL * r["ref_abs"][n], (label, n, d)
        for n, d in r["vs_torch"].items():
            assert d <= ATOL + RTOL * r["ref_abs"][n], (label, n, d)
        assert sorted(r["grad_diffs"]) == ["embed.weight", "hidden.bias", "hidden.weight"], label
        assert max(r["grad_diffs"].values()) < 1e-6, (label, r["grad_diffs"])
        assert r["moved"] > 1e-2, label
        assert r["units"]["<root>"] == ["embed.weight"], label  # the tied pair goes to the root
        assert r["freed"] == [0] * (2 * STEPS), label  # nothing full left after forward / backward
        assert all(b > 0 for b in r["in_forward"]), label  # ...but full while the unit ran
        # 1/N of the model, plus at most N-1 padding elements per flat group
        assert r["held"] <= total / world + r["groups"] * (world - 1) * 4, (label, r["held"], total)
        assert r["grads"] <= r["held"], label
        # two all-gathers of the trainable groups, one of the frozen ones per backward, one
        # reduce-scatter: the reduce-scatter moves (N-1)/N of the trainable padded bytes
        assert r["comm"]["reduce-scatter"] > 0 and r["comm"]["all-gather"] > r["comm"]["reduce-scatter"], label


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fsdp_mixed_precision(dtype):
    results = launch(_fsdp_cases, args=(dtype,), nprocs=2, timeout=180)
    for r in results:
        assert r["dtypes"] == {dtype} and r["shard_dtypes"] == {torch.float32}
        assert max(r["vs_torch"].values()) < 1e-5, r["vs_torch"]  # the same rounding points as FSDP2
        assert max(r["vs_ref"].values()) < 1e-2, r["vs_ref"]  # 16-bit compute vs fp32
        assert r["moved"] > 1e-2


def _fsdp_errors():
    res = {}
    for key, call in {"dtype": lambda: FSDP(nn.Linear(2, 2), compute_dtype=torch.int32),
                      "unit": lambda: FSDP(nn.Linear(2, 2), units=[nn.Linear(2, 2)]),
                      "module": lambda: FSDP(lambda x: x),
                      "optimizer": lambda: ShardedOptimizer(nn.Linear(2, 2).parameters(), "adam"),
                      "load": lambda: ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD,
                                                       lr=0.1).load_state_dict(
                          {"state": {}, "param_groups": [{"params": [0], "lr": 0.1}]})}.items():
        try:
            call()
            res[key] = None
        except (TypeError, ValueError) as e:
            res[key] = str(e)
    # explicit units: a Sequential of blocks, each block one unit, no root parameters
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(seq)
    model = FSDP(seq, units=[seq[0], seq[2], seq[4]])
    x = torch.randn(6, 4)
    for _ in range(2):  # two backward passes accumulate before one finish_gradient_synchronization()
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    model.finish_gradient_synchronization()
    res["units"] = model.units
    torch.manual_seed(0)
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)), nn.Linear(2, 2))
    res["nested"] = FSDP(nested, units=[nested[0], nested[0][1]]).units
    twice = FSDP(nn.Sequential(nn.Linear(2, 2)))
    twice.module.forward = lambda x: twice.module[0](twice.module[0](x))  # one unit, called twice
    try:
        twice(torch.ones(1, 2))
        res["twice"] = None
    except RuntimeError as e:
        res["twice"] = str(e)
    grads = _full_grads(model)
    # every rank ran the same input: the average is the local gradient
    res["grad_diff"] = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
    return res


def test_fsdp_explicit_units_and_bad_input():
    for res in launch(_fsdp_errors, nprocs=2, timeout=60):
        assert "floating-point" in res["dtype"]
        assert "submodule" in res["unit"]
        assert "nn.Module" in res["module"]
        assert "optimizer_cls" in res["optimizer"]
        assert "groups" in res["load"]
        assert "ran twice in one forward" in res["twice"], res["twice"]
        assert res["units"] == {"0": ["0.weight", "0.bias"], "2": ["2.weight", "2.bias"],
                                "4": ["4.weight", "4.bias"]}
        assert res["grad_diff"] < 1e-6
        assert res["nested"] == {"<root>": ["1.weight", "1.bias"], "0": ["0.0.weight", "0.0.bias"],
                                 "0.1": ["0.1.weight", "0.1.bias"]}, res["nested"]  # the innermost unit


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with pytest.raises(RuntimeError, match="not initialised"):
        FSDP(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="not initialised"):
        ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)


def _gpu_fsdp():
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    x, y = (t.to(device) for t in _batches()[0])
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    ref = TiedNet(seed=0).to(device)
    _loss(ref, x, y).backward()
    model = FSDP(TiedNet(seed=rank).to(device))
    _loss(model, x[lo:hi], y[lo:hi]).backward()
    model.finish_gradient_synchronization()
    return max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)


@requires_gpus(2)
def test_fsdp_on_nccl():
    assert all(g > 0 for g in launch(_gpu_fsdp, nprocs=2))
