"""ShardedOptimizer (ZeRO-1) and FSDP (ZeRO-3) train to the parameters of one process
on the full batch, of torch's ZeroRedundancyOptimizer and of torch's fully_shard (FSDP2),
on gloo with N = 2 and 3. ShardedOptimizer behaves as ZeroRedundancyOptimizer (defaults
and hyper-parameters in param_groups, a scheduler, step(closure, **kwargs), frozen
parameters partitioned, consolidate_state_dict); FSDP is a training wrapper (full
state_dict, no_sync / set_requires_gradient_sync, param_dtype / reduce_dtype, nested inputs).

The model (TiedNet) has a frozen layer, a bias with requires_grad=False, a buffer and
an output projection tied to the embedding; each rank builds it from its own seed.
"""
import copy
import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from conftest import ATOL, RTOL, TiedNet, backward_on_this_gpu, error_text, lm_loss, requires_gpus, token_batches
from mgpu_lab import FSDP, NaiveDDP, ShardedOptimizer, launch
from mgpu_lab.parallel.sharding import zero_bytes_per_rank
from mgpu_lab.parallel.zero import partition_parameters

BATCH, SEQ, STEPS = 12, 5, 3


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
        for step, (x, y) in enumerate(token_batches(STEPS, BATCH, SEQ)):
            for opt in (ref_opt, ours, theirs):  # a scheduler-like change of one group's lr
                opt.param_groups[1]["lr"] = kw["lr"] * (1 + step) / 2
            ref_opt.zero_grad()
            lm_loss(ref, x, y).backward()
            ref_opt.step()
            ours.zero_grad()
            lm_loss(ours_model, x[lo:hi], y[lo:hi]).backward()
            ours_model.finish_gradient_synchronization()
            ours.step()
            theirs.zero_grad()
            lm_loss(torch_model, x[lo:hi], y[lo:hi]).backward()
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
        x, y = token_batches(STEPS, BATCH, SEQ)[0]
        for opt, model, xs, ys in ((again, again_model, x[lo:hi], y[lo:hi]), (unsharded, ref, x, y)):
            opt.zero_grad()
            lm_loss(model, xs, ys).backward()
            if model is again_model:
                model.finish_gradient_synchronization()
            opt.step()
        names = {p: n for n, p in ours_model.module.named_parameters()}
        torch_names = {p: n for n, p in torch_model.module.named_parameters()}
        state_bytes = sum(t.numel() * t.element_size() for s in ours.state.values()
                          for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        out[name] = dict(
            final=[p.detach().clone() for p in ours_model.module.parameters()],
            zero_torch=[p.detach().clone() for p in torch_model.module.parameters()],
            reloaded=[p.detach().clone() for p in again_model.module.parameters()],
            sd=sd, tied=ours_model.module.head.weight is ours_model.module.embed.weight,
            owned=[[names[p] for p in part] for part in ours.partition],
            torch_owned=[[torch_names[p] for g in groups for p in g["params"]]
                         for groups in theirs._partition_parameters()],
            trainable={n for n, p in ours_model.module.named_parameters() if p.requires_grad},
            n_state=len(ours.state), state_bytes=state_bytes,
            lr=[g["lr"] for g in ours.optim.param_groups],
        )
        out[name]["ref_after_reload"] = [p.detach().clone() for p in ref.parameters()]
    return out


def _reference_run(name):
    """The unsharded optimizer on the full batch, same schedule: final params and state dict."""
    cls, kw = OPTIMIZERS[name]
    ref = TiedNet(seed=0)
    opt = cls(_groups(ref), **kw)
    for step, (x, y) in enumerate(token_batches(STEPS, BATCH, SEQ)):
        opt.param_groups[1]["lr"] = kw["lr"] * (1 + step) / 2
        opt.zero_grad()
        lm_loss(ref, x, y).backward()
        opt.step()
    return [p.detach().clone() for p in ref.parameters()], opt.state_dict()


def _partition_by_groups(world):
    """ShardedOptimizer's partition as partition_parameters gives it: over each group's bytes in turn,
    continued from what the groups before gave each rank (torch's ZeroRedundancyOptimizer's order)."""
    model = TiedNet()
    names = {p: n for n, p in model.named_parameters()}
    owned, loads = [[] for _ in range(world)], [0] * world
    for group in _groups(model):
        sizes = [p.numel() * p.element_size() for p in group["params"]]
        for r, part in enumerate(partition_parameters(sizes, world, loads=loads)):
            owned[r] += [names[group["params"][i]] for i in part]
            loads[r] += sum(sizes[i] for i in part)
    return owned


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
        owned, r0 = results[0][name]["owned"], results[0][name]
        # every parameter, frozen ones too, partitioned as ZeroRedundancyOptimizer does it
        assert [sorted(o) for o in owned] == [sorted(o) for o in r0["torch_owned"]], (label, owned)
        assert owned == _partition_by_groups(world), (label, owned)  # one partition function
        assert sorted(n for o in owned for n in o) == sorted(n for n, _ in TiedNet().named_parameters())
        sizes = dict((n, p.numel()) for n, p in TiedNet().named_parameters())
        for rank, res in enumerate(results):  # state only for this rank's trainable parameters
            expected = sum(sizes[n] for n in owned[rank] if n in r0["trainable"]) * 4 * (1 if name == "sgd" else 2)
            assert res[name]["state_bytes"] == expected, (label, rank, res[name]["state_bytes"], expected)


def test_partition_is_balanced():
    sizes = [512, 256, 256, 16, 16, 100, 7]
    for n in (1, 2, 3, 4):
        parts = partition_parameters(sizes, n)
        assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in p) for p in parts]
        assert max(loads) <= sum(sizes) / n + max(sizes), (n, loads)
    assert partition_parameters([512, 256, 256, 16, 16, 100, 7], 2) == [[0, 5], [1, 2, 3, 4, 6]]  # 612 and 551
    # continued from loads already held: rank 0 holds 50 already, so the large item goes to rank 1
    assert partition_parameters([100, 10], 2, loads=[50, 0]) == [[1], [0]]
    with pytest.raises(ValueError, match="one per rank"):
        partition_parameters([1], 2, loads=[0])
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


def _fsdp_cases(param_dtype, reduce_dtype=None):
    """Our FSDP against the full batch and FSDP2 with the same MixedPrecisionPolicy; the loop has
    no call after backward (the gradients are reduce-scattered when it returns)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    ref = TiedNet(seed=0)
    # Adam turns rounding differences of near-zero gradients into lr-sized steps: SGD for 16 bits
    make = (lambda ps: torch.optim.AdamW(ps, lr=0.02)) if param_dtype is None else \
        (lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9))
    ref_opt = make([p for p in ref.parameters() if p.requires_grad])
    ours = FSDP(TiedNet(seed=rank), param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    opt = make(ours.parameters())
    mp = None
    if param_dtype is not None:  # ours reduces in fp32 unless asked; FSDP2 in param_dtype unless asked
        from torch.distributed.fsdp import MixedPrecisionPolicy
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype or torch.float32)
    theirs = _torch_fully_shard(0, mp)
    their_opt = make([p for p in theirs.parameters() if p.requires_grad])
    freed_after_forward, gathered_dtypes, in_forward, grad_diffs = [], set(), [], {}
    probe = ours.module.hidden.register_forward_hook(
        lambda m, a, o: in_forward.append(m.weight.untyped_storage().nbytes()), prepend=True)
    for x, y in token_batches(STEPS, BATCH, SEQ):
        ref_opt.zero_grad()
        lm_loss(ref, x, y).backward()
        ref_opt.step()
        opt.zero_grad()
        loss = lm_loss(ours, x[lo:hi], y[lo:hi])
        freed_after_forward.append(max(g.full.untyped_storage().nbytes() for g in ours.flat_groups))
        gathered_dtypes |= {g.full.dtype for g in ours.flat_groups}
        loss.backward()
        if not grad_diffs:  # the first step's gradients: the full batch's, averaged over ranks
            grad_diffs = {n: (g - ref.get_parameter(n).grad).abs().max().item()
                          for n, g in _full_grads(ours).items()}
        freed_after_forward.append(max(g.full.untyped_storage().nbytes() for g in ours.flat_groups))
        opt.step()
        their_opt.zero_grad()
        lm_loss(theirs, x[lo:hi], y[lo:hi]).backward()
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


@pytest.mark.parametrize("dtype, reduce_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                  (torch.bfloat16, None)], ids=["bf16", "fp16", "bf16-reduce-fp32"])
def test_fsdp_mixed_precision(dtype, reduce_dtype):
    results = launch(_fsdp_cases, args=(dtype, reduce_dtype), nprocs=2, timeout=180)
    for r in results:
        assert r["dtypes"] == {dtype} and r["shard_dtypes"] == {torch.float32}
        assert max(r["vs_torch"].values()) < 1e-5, r["vs_torch"]  # the same rounding points as FSDP2
        assert max(r["vs_ref"].values()) < 1e-2, r["vs_ref"]  # 16-bit compute vs fp32
        assert r["moved"] > 1e-2


def _fsdp_errors():
    res = {}
    for key, call in {"dtype": lambda: FSDP(nn.Linear(2, 2), param_dtype=torch.int32),
                      "unit": lambda: FSDP(nn.Linear(2, 2), units=[nn.Linear(2, 2)]),
                      "module": lambda: FSDP(lambda x: x),
                      "optimizer": lambda: ShardedOptimizer(nn.Linear(2, 2).parameters(), "adam"),
                      "load": lambda: ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD,
                                                       lr=0.1).load_state_dict(
                          {"state": {}, "param_groups": [{"params": [0], "lr": 0.1}]})}.items():
        res[key] = error_text(call, (TypeError, ValueError))
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
    grads = _full_grads(model)
    # every rank ran the same input: the average is the local gradient
    res["grad_diff"] = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
    return res


def test_fsdp_explicit_units_and_bad_input():
    for res in launch(_fsdp_errors, nprocs=2, timeout=60):
        assert "floating-point" in res["dtype"]
        assert "submodule" in res["unit"]
        assert "nn.Module" in res["module"]
        assert "optimizer_class" in res["optimizer"]
        assert "groups" in res["load"]
        assert res["units"] == {"0": ["0.weight", "0.bias"], "2": ["2.weight", "2.bias"],
                                "4": ["4.weight", "4.bias"]}
        assert res["grad_diff"] < 1e-6
        assert res["nested"] == {"<root>": ["1.weight", "1.bias"], "0": ["0.0.weight", "0.0.bias"],
                                 "0.1": ["0.1.weight", "0.1.bias"]}, res["nested"]  # the innermost unit


class _Twice(nn.Module):
    """A block applied twice in one forward (with a frozen layer inside), then a head
    that sees the block's output and its input again (a shared path)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.block[2].requires_grad_(False)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.block(self.block(x))
        return self.head(h) + self.head(x)


def _twice_cases():
    """fully_shard supports a unit that runs twice in one forward (torch's test_fully_shard_training
    multi-forward cases compare it with DDP): ours, torch's fully_shard, torch DDP and one process
    on the full batch, each two SGD steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    lo, hi = rank * 8 // world, (rank + 1) * 8 // world
    ref, ddp_net = _Twice(), _Twice()
    ours = FSDP(_Twice(seed=rank))  # units: block and head, each run twice
    net = _Twice(seed=rank)
    ours_inner = FSDP(net, units=[net.block[0]])  # a Linear inside the block; the rest in the root
    theirs = _Twice()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(theirs.block, mesh=mesh)
    fully_shard(theirs.head, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    ddp = DistributedDataParallel(ddp_net)
    models = {"ref": ref, "ours": ours, "ours_inner": ours_inner, "fully_shard": theirs, "ddp": ddp}
    opts = {k: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for k, m in models.items()}
    grads = {}
    for step in range(2):
        for k, m in models.items():
            opts[k].zero_grad()
            xs, ys = (x, y) if k == "ref" else (x[lo:hi], y[lo:hi])
            nn.functional.mse_loss(m(xs), ys).backward()
            if step == 0:
                if isinstance(m, FSDP):
                    grads[k] = _full_grads(m)
                else:
                    grads[k] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                                for n, p in m.named_parameters() if p.grad is not None}
                    grads[k] = {n.removeprefix("module."): g for n, g in grads[k].items()}
            opts[k].step()
    params = {k: (m.gather_full_params() if isinstance(m, FSDP) else
                  {n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                   for n, p in m.named_parameters()}) for k, m in models.items()}
    storage = max(g.full.untyped_storage().nbytes() for m in (ours, ours_inner) for g in m.flat_groups)
    return grads, params, storage


def test_a_unit_that_runs_twice_in_one_forward_matches_ddp_and_fully_shard():
    for grads, params, storage in launch(_twice_cases, nprocs=2, timeout=120):
        assert sorted(grads["ref"]) == ["block.0.bias", "block.0.weight", "head.bias", "head.weight"]
        for k in ("ours", "ours_inner", "fully_shard", "ddp"):
            assert sorted(grads[k]) == sorted(grads["ref"]), k
            for n, g in grads["ref"].items():
                torch.testing.assert_close(grads[k][n], g, msg=lambda m: f"{k} grad {n}: {m}")
            for n, p in params["ref"].items():
                torch.testing.assert_close(params[k][n], p, msg=lambda m: f"{k} param {n}: {m}")
        assert storage == 0  # every gathered buffer freed after backward, the frozen group's included


class _Four(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(self.a(x))))))


def _grouped_cases():
    """units=[[a, b], c] against fully_shard([a, b]), fully_shard(c), fully_shard(root): one flat group
    for a and b, gathered once in forward and once in backward; the same gradients and parameters."""
    import io
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    x, y = torch.randn(8, 4), torch.randn(8, 2 * 2)
    lo, hi = rank * 8 // world, (rank + 1) * 8 // world
    net = _Four(seed=rank)
    ours = FSDP(net, units=[[net.a, net.b], net.c])
    theirs = _Four()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard([theirs.a, theirs.b], mesh=mesh)
    fully_shard(theirs.c, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    gathers = []
    gather = ours._comm.all_gather
    ours._comm.all_gather = lambda out, shard: (gathers.append(out.numel()), gather(out, shard))
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
            opt.step()
    ours._comm.all_gather = gather
    theirs_full = {n: p.full_tensor() for n, p in theirs.named_parameters()}
    full = ours.gather_full_params()
    pickled = error_text(lambda: torch.save(ours, io.BytesIO()))
    torch_pickled = error_text(lambda: torch.save(theirs, io.BytesIO()))
    return dict(units=ours.units, gathers=gathers, diff={n: (full[n] - p).abs().max().item()
                                                         for n, p in theirs_full.items()},
                pickled=pickled, torch_pickled=torch_pickled)


def test_a_list_of_modules_is_one_unit_as_fully_shard_of_a_list():
    for r in launch(_grouped_cases, nprocs=2, timeout=120):
        assert r["units"] == {"<root>": ["d.weight", "d.bias"], "a+b": ["a.weight", "a.bias", "b.weight", "b.bias"],
                              "c": ["c.weight", "c.bias"]}
        assert r["gathers"] == [20, 40, 20, 20, 20, 40] * 2  # forward: root, a+b, c; backward: root, c, a+b
        assert max(r["diff"].values()) < 1e-6, r["diff"]
        assert "does not pickle" in r["pickled"] and "state_dict" in r["pickled"]
        assert r["torch_pickled"] is not None  # torch's fully_shard model does not pickle either


def _gpu_fsdp():
    model, _ = backward_on_this_gpu(FSDP, BATCH, SEQ)
    return max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)


@requires_gpus(2)
def test_fsdp_on_nccl():
    assert all(g > 0 for g in launch(_gpu_fsdp, nprocs=2))


# --------------------------------------------------------------------------- FSDP as a training wrapper

class _Pair(NamedTuple):
    x: torch.Tensor
    scale: torch.Tensor


@dataclasses.dataclass
class _Out:
    y: torch.Tensor


@dataclasses.dataclass
class _Unregistered:
    y: torch.Tensor


class _Structured(nn.Module):
    """Inputs and outputs nested in a namedtuple, a dict, a list and a (registered) dataclass."""

    def __init__(self, out_cls=_Out):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.out_cls = nn.Linear(4, 4), nn.Linear(4, 2), out_cls

    def forward(self, pair, extra):
        h = self.first(pair.x * pair.scale)
        return {"out": [self.out_cls(self.second(h + extra["bias"]))]}


def _fsdp_training_pieces():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils._pytree import register_dataclass
    register_dataclass(_Out)
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    res = {}
    # state_dict: the plain model's keys, order and values; load_state_dict puts them back
    model = FSDP(TiedNet(seed=rank))
    sd = model.state_dict()
    plain = TiedNet(seed=0)
    res["keys"] = (list(sd) == list(plain.state_dict()))
    res["values"] = max((sd[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    res["rank0_only"] = len(model.state_dict(rank0_only=True))
    other = FSDP(TiedNet(seed=5))
    other.load_state_dict(TiedNet(seed=3).state_dict())
    res["loaded"] = max((v - TiedNet(seed=3).state_dict()[k]).abs().max().item()
                        for k, v in other.state_dict().items())
    # no_sync / set_requires_gradient_sync: two micro-batches, the first local; equals the full batch
    # and FSDP2 accumulating the same way
    x, y = token_batches(STEPS, BATCH, SEQ)[0]
    ref = TiedNet(seed=0)
    lm_loss(ref, x, y).backward()
    mid = (lo + hi) // 2
    theirs = _torch_fully_shard(0)
    for name, m in {"no_sync": FSDP(TiedNet(seed=rank)), "set_requires": FSDP(TiedNet(seed=rank)),
                    "fully_shard": theirs}.items():
        parts = [(x[lo:mid], y[lo:mid]), (x[mid:hi], y[mid:hi])]
        for i, (xs, ys) in enumerate(parts):
            if i == 0 and name == "no_sync":
                with m.no_sync():
                    (lm_loss(m, xs, ys) * len(xs) / (hi - lo)).backward()
                res["local_after_no_sync"] = [p.grad for p in m.parameters()]
            else:
                m.set_requires_gradient_sync(i == 1)
                (lm_loss(m, xs, ys) * len(xs) / (hi - lo)).backward()
        grads = _full_grads(m) if name != "fully_shard" else \
            {n: p.grad.full_tensor() for n, p in m.named_parameters() if p.grad is not None}
        res[name] = max((g - ref.get_parameter(n).grad).abs().max().item() for n, g in grads.items())
    # structured inputs and outputs, cast to param_dtype by pytree; an unregistered dataclass is refused
    torch.manual_seed(1)
    pair, extra = _Pair(torch.randn(3, 4), torch.tensor(2.0)), {"bias": torch.randn(4)}
    plain = _Structured()
    plain(pair, extra)["out"][0].y.float().pow(2).sum().backward()
    for dtype in (None, torch.bfloat16):
        m = FSDP(_Structured(), param_dtype=dtype)
        out = m(pair, extra)["out"][0].y
        out.float().pow(2).sum().backward()
        grads = _full_grads(m)
        res[f"structured_{dtype}"] = (out.dtype, max((g - plain.get_parameter(n).grad).abs().max().item()
                                                     for n, g in grads.items()))
    res["unregistered"] = error_text(lambda: FSDP(_Structured(_Unregistered))(pair, extra), TypeError)
    return res


def test_fsdp_state_dict_no_sync_and_structured_inputs():
    for rank, res in enumerate(launch(_fsdp_training_pieces, nprocs=2, timeout=120)):
        assert res["keys"] and res["values"] == 0.0  # rank 0's weights, under the plain names, in order
        assert res["loaded"] == 0.0
        assert res["rank0_only"] == (len(TiedNet().state_dict()) if rank == 0 else 0)
        for name in ("no_sync", "set_requires", "fully_shard"):
            assert res[name] < 1e-6, (name, res[name])  # accumulated locally, then the full-batch gradient
        assert all(g is None for g in res["local_after_no_sync"])  # nothing reduced inside no_sync
        assert res["structured_None"][0] == torch.float32 and res["structured_None"][1] < 1e-6
        assert res["structured_torch.bfloat16"][0] == torch.bfloat16 and res["structured_torch.bfloat16"][1] < 0.1
        assert "register_dataclass(_Unregistered)" in res["unregistered"], res["unregistered"]


# --------------------------------------------------------------------------- ShardedOptimizer as ZeRO

class _KwargSGD(torch.optim.SGD):
    """SGD whose step takes a keyword and writes a hyper-parameter back into its groups."""

    def step(self, closure=None, factor=1.0):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            g["seen_factor"] = factor
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor)
        super().step()
        return loss


def _zero_like_torch():
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    res = {}
    # defaults in the outer groups: a scheduler without an explicit lr; a frozen layer unfrozen later
    runs = {}
    for name, make in {"ours": lambda ps: ShardedOptimizer(ps, optimizer_class=torch.optim.AdamW),
                       "bucket_view": lambda ps: ShardedOptimizer(ps, torch.optim.AdamW,
                                                                  parameters_as_bucket_view=True),
                       "torch": lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW)}.items():
        model = DistributedDataParallel(TiedNet(seed=0))
        opt = make(_groups(model.module))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        for step, (x, y) in enumerate(token_batches(STEPS, BATCH, SEQ)):
            if step == 1:
                model.module.frozen.weight.requires_grad_(True)
                model = DistributedDataParallel(model.module)  # DDP reads requires_grad at construction
            opt.zero_grad()
            lm_loss(model, x[lo:hi], y[lo:hi]).backward()
            opt.step()
            sched.step()
        runs[name] = dict(groups=[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                          weights={n: p.detach().clone() for n, p in model.module.named_parameters()})
        if name != "bucket_view":
            opt.consolidate_state_dict(to=0)
            if rank == 0:
                runs[name]["sd"] = opt.state_dict()
            elif name == "ours":
                runs[name]["sd_elsewhere"] = error_text(opt.state_dict, RuntimeError)
    res["runs"] = runs
    unfrozen = runs["ours"]["weights"]["frozen.weight"]
    res["unfrozen_moved"] = (unfrozen - TiedNet(seed=0).frozen.weight).abs().max().item()
    # step(closure, **kwargs) goes through, and what the local optimizer writes comes back
    stepped = {}
    for name, opt_cls in {"ours": ShardedOptimizer, "torch": ZeroRedundancyOptimizer}.items():
        model = DistributedDataParallel(TiedNet(seed=0))
        opt = opt_cls([p for p in model.parameters() if p.requires_grad], optimizer_class=_KwargSGD, lr=0.1)
        x, y = token_batches(STEPS, BATCH, SEQ)[0]

        def closure():
            opt.zero_grad()
            loss = lm_loss(model, x[lo:hi], y[lo:hi])
            loss.backward()
            return loss
        loss = opt.step(closure, factor=0.5)
        stepped[name] = dict(loss=loss.item(), seen=[g.get("seen_factor") for g in opt.param_groups],
                             weights={n: p.detach().clone() for n, p in model.module.named_parameters()})
    res["stepped"] = stepped
    return res


def test_sharded_optimizer_behaves_as_zero_redundancy_optimizer():
    for rank, res in enumerate(launch(_zero_like_torch, nprocs=2, timeout=120)):
        ours, view, theirs = res["runs"]["ours"], res["runs"]["bucket_view"], res["runs"]["torch"]
        assert ours["groups"] == theirs["groups"] == view["groups"], (ours["groups"], theirs["groups"])
        assert "betas" in ours["groups"][0] and ours["groups"][0]["lr"] == 1e-3 / (1 + STEPS)  # defaults, scheduled
        for n, w in theirs["weights"].items():
            torch.testing.assert_close(ours["weights"][n], w, rtol=RTOL, atol=ATOL, msg=lambda m: f"{n}: {m}")
            assert torch.equal(view["weights"][n], ours["weights"][n])  # parameters_as_bucket_view: the same numbers
        assert res["unfrozen_moved"] > 1e-4  # unfrozen after a step: its owner updates it
        if rank == 0:  # consolidate_state_dict(to=0), then state_dict() on rank 0, as torch
            assert ours["sd"]["param_groups"] == theirs["sd"]["param_groups"]  # the current lr included
            assert sorted(ours["sd"]["state"]) == sorted(theirs["sd"]["state"])
            for i, s in theirs["sd"]["state"].items():
                for k, v in s.items():
                    torch.testing.assert_close(ours["sd"]["state"][i][k], v, rtol=RTOL, atol=ATOL)
        else:
            assert "consolidated on rank 0" in ours["sd_elsewhere"]
        s_ours, s_theirs = res["stepped"]["ours"], res["stepped"]["torch"]
        assert s_ours["seen"] == s_theirs["seen"] == [0.5], (s_ours["seen"], s_theirs["seen"])
        assert s_ours["loss"] == s_theirs["loss"]
        for n, w in s_theirs["weights"].items():
            torch.testing.assert_close(s_ours["weights"][n], w, rtol=RTOL, atol=ATOL)
