"""Each class called exactly as torch's (or Megatron's) documentation calls its counterpart, and torch's
own test cases adapted: the class swapped, the cases and the asserted values kept (rewritten here; the
torch test each one adapts is named in its docstring). Where mgpu_lab differs on purpose,
docs/DECISIONS.md says so, and the test checks the difference.

torch's documented calls: ``DDP(model, device_ids=[rank])`` (the DDP tutorial), ``DDP(model,
process_group=pg, bucket_cap_mb=25)``; ``ZeroRedundancyOptimizer(ddp.parameters(),
optimizer_class=torch.optim.Adam, lr=0.01)``; ``fully_shard(model, mp_policy=MixedPrecisionPolicy(
param_dtype=..., reduce_dtype=...))`` (keyword-only options); ``checkpoint(fn, x, use_reentrant=False)``;
``scaler = GradScaler()`` / ``GradScaler("cuda")``, ``scaler.scale(loss).backward()``,
``scaler.step(optimizer)``, ``scaler.update()``. Megatron's: ``ColumnParallelLinear(input_size,
output_size, bias=True, gather_output=False)``, ``RowParallelLinear(input_size, output_size, bias=True,
input_is_parallel=True)``, ``vocab_parallel_cross_entropy(vocab_parallel_logits, target)`` (per-token
losses).
"""
import contextlib
import copy
import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as tc
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import mgpu_lab
from conftest import error_text, requires_gpus
from mgpu_lab import (BucketedDDP, ColumnParallelLinear, FSDP, LossScaler, NaiveDDP, RowParallelLinear,
                      ShardedOptimizer, checkpoint, checkpoint_sequential, launch, vocab_parallel_cross_entropy)

TOP_LEVEL = {  # the public API, by concept: what a training script imports
    "runtime": ["backend", "devices", "rank_device", "DistEnv", "dist_env", "init_distributed", "cleanup",
                "is_main_process", "print0", "distributed_loader", "launch", "LaunchError", "CollectiveTimeout"],
    "data parallel": ["DataParallel", "scatter", "replicate", "parallel_apply", "gather",
                      "DataParallelModel", "DataParallelCriterion"],
    "collectives and DDP": ["ring_allreduce", "naive_allreduce", "allreduce_bytes", "CommStats", "NaiveDDP",
                            "BucketedDDP"],
    "sharding": ["ShardedOptimizer", "FSDP"],
    "model parallel": ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelAttention",
                       "ParallelTransformerBlock", "vocab_parallel_cross_entropy", "PipelineStage", "ScheduleGPipe",
                       "Schedule1F1B", "ScheduleInterleaved1F1B", "ring_attention", "MoE", "ExpertParallelMoE"],
    "training": ["autocast_dtype", "LossScaler", "amp_step", "GradientAccumulator", "checkpoint",
                 "checkpoint_sequential", "saved_tensor_bytes", "peak_memory", "save_checkpoint", "load_checkpoint",
                 "TrainState", "UnsafeCheckpointError", "CheckpointError", "batch_plan", "collective_trace", "CollectiveError"],
}
TEACHING_TOOLS = {  # importable from their modules only
    "mgpu_lab.parallel.collectives": ["simulate_ring_allreduce", "ring_schedule", "RingState", "bus_bandwidth"],
    "mgpu_lab.parallel.zero": ["partition_parameters"],
    "mgpu_lab.parallel.sharding": ["zero_bytes_per_rank"],
    "mgpu_lab.parallel.pipeline": ["PipelineSchedule", "gpipe_order", "one_f_one_b_order", "check_order",
                                   "held_microbatches", "simulate_timeline", "bubble_fraction"],
    "mgpu_lab.parallel.tensor_parallel": ["copy_to_parallel_region", "reduce_from_parallel_region",
                                          "gather_from_sequence_parallel_region"],
    "mgpu_lab.parallel.tensor_parallel_blocks": ["TransformerBlock"],
    "mgpu_lab.measure.memory_account": ["MemoryAccount", "account_memory", "plot_memory"],
    "mgpu_lab.measure.trace_compare": ["first_divergence"],
    "mgpu_lab.training.train_state": ["rng_state", "set_rng_state"],
    "mgpu_lab.parallel.wrappers": ["unwrap"],
    "mgpu_lab.training.recompute": ["checkpoint", "checkpoint_sequential"],
    "mgpu_lab.measure.activation_memory": ["saved_tensor_bytes", "peak_memory"],
}


# --------------------------------------------------------------------------- the top level

def test_the_top_level_is_what_a_training_script_imports_and_teaching_tools_live_in_their_modules():
    import importlib
    planned = [n for names in TOP_LEVEL.values() for n in names]
    assert sorted(mgpu_lab.__all__) == sorted(planned)
    assert mgpu_lab.__all__ == planned, "__all__ is grouped by concept, in this order"
    for module, names in TEACHING_TOOLS.items():
        mod = importlib.import_module(module)
        for name in names:
            assert hasattr(mod, name), f"{module}.{name}"
            if module.rsplit(".", 1)[-1] not in ("recompute", "activation_memory"):
                assert not hasattr(mgpu_lab, name), f"{name} is a teaching tool: not at the top level"
    assert mgpu_lab.checkpoint is importlib.import_module("mgpu_lab.training.recompute").checkpoint
    with pytest.raises(ImportError):
        importlib.import_module("mgpu_lab.training.checkpointing")  # moved, no alias


def _kinds(fn):
    return {n: p.kind for n, p in inspect.signature(fn).parameters.items()}


def test_signatures_are_torchs_where_the_name_is_torchs():
    kw = inspect.Parameter.KEYWORD_ONLY
    for cls in (NaiveDDP, BucketedDDP):
        kinds = _kinds(cls)
        assert all(kinds[k] == kw for k in ("process_group", "device_ids", "output_device")), cls
        assert "group" not in kinds
    assert _kinds(BucketedDDP)["bucket_cap_mb"] == kw
    zero, theirs = list(_kinds(ShardedOptimizer)), list(_kinds(ZeroRedundancyOptimizer))
    assert zero == theirs, (zero, theirs)  # params, optimizer_class, process_group, ..., **defaults
    fsdp = _kinds(FSDP)
    assert list(fsdp) == ["module", "param_dtype", "reduce_dtype", "units", "process_group"]
    assert all(fsdp[k] == kw for k in list(fsdp)[1:])
    assert list(_kinds(LossScaler))[:6] == list(_kinds(torch.amp.GradScaler))  # device first
    assert inspect.signature(vocab_parallel_cross_entropy).parameters["reduction"].default == "none"


# --------------------------------------------------------------------------- DDP

def _ddp_cases():
    rank = dist.get_rank()
    res = {}
    pg = dist.new_group([0, 1])
    for name, make in {"naive": lambda m: NaiveDDP(m, process_group=pg),
                       "bucketed": lambda m: BucketedDDP(m, process_group=pg, bucket_cap_mb=25),
                       "torch": lambda m: DDP(m, process_group=pg, bucket_cap_mb=25)}.items():
        torch.manual_seed(rank)  # different weights per rank: the wrapper broadcasts rank 0's
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        model = make(net)
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
        model(x).pow(2).sum().backward()
        res[name] = {"grads": [p.grad.clone() for p in net.parameters()],
                     "group": model.process_group is pg}
    # torch DDP's refusals, the same exception type: device_ids for a CPU module, two devices, nothing to train
    frozen = nn.Linear(2, 2).requires_grad_(False)
    bad = {"cpu_device_ids": lambda cls: cls(nn.Linear(2, 2), device_ids=[0]),
           "two_device_ids": lambda cls: cls(nn.Linear(2, 2), device_ids=[0, 1]),
           "nothing_to_train": lambda cls: cls(frozen)}
    for case, call in bad.items():
        for name, cls in {"naive": NaiveDDP, "bucketed": BucketedDDP, "torch": DDP}.items():
            try:
                call(cls)
                res[case, name] = None
            except (ValueError, RuntimeError) as e:
                res[case, name] = (type(e).__name__, str(e))
    return res


def test_ddp_wrappers_take_torchs_keywords_and_refuse_what_torch_refuses():
    for res in launch(_ddp_cases, nprocs=2, timeout=120):
        for name in ("naive", "bucketed"):
            assert res[name]["group"] and res["torch"]["group"]
            for mine, theirs in zip(res[name]["grads"], res["torch"]["grads"]):
                torch.testing.assert_close(mine, theirs)
        for case in ("cpu_device_ids", "two_device_ids", "nothing_to_train"):
            theirs = res[case, "torch"]
            assert theirs is not None
            for name in ("naive", "bucketed"):
                assert res[case, name] is not None and res[case, name][0] == theirs[0], (case, name, res[case, name])
        assert "doesn't have any parameter that requires a gradient" in res["nothing_to_train", "naive"][1]
        assert "device_ids" in res["cpu_device_ids", "bucketed"][1]


def _ignore_cases():
    """torch's distributed_test ``test_ddp_ignore_params_arg``, adapted: the named parameters and buffer are
    neither broadcast at construction nor averaged; the others are."""
    rank = dist.get_rank()
    res = {}
    for name, cls in {"naive": NaiveDDP, "bucketed": BucketedDDP, "torch": DDP}.items():
        torch.manual_seed(rank)
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        net.register_buffer("seen", torch.full((1,), float(rank)))
        cls._set_params_and_buffers_to_ignore_for_model(net, ["1.weight", "1.bias", "seen"])
        model = cls(net)
        start = {n: p.detach().clone() for n, p in net.named_parameters()}
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))
        model(x).sum().backward()
        res[name] = {"start": start, "seen": net.seen.item(),
                     "grads": {n: p.grad.clone() for n, p in net.named_parameters()}}
    return res


def test_params_and_buffers_to_ignore_as_torch_ddp():
    results = launch(_ignore_cases, nprocs=2, timeout=120)
    for name in ("naive", "bucketed", "torch"):
        r0, r1 = results[0][name], results[1][name]
        assert r0["seen"] == 0 and r1["seen"] == 1, name  # the ignored buffer is not broadcast
        assert torch.equal(r0["start"]["0.weight"], r1["start"]["0.weight"]), name      # broadcast
        assert not torch.equal(r0["start"]["1.weight"], r1["start"]["1.weight"]), name  # ignored: each rank's own
        torch.testing.assert_close(r0["grads"]["0.weight"], r1["grads"]["0.weight"])   # averaged
        assert not torch.allclose(r0["grads"]["1.weight"], r1["grads"]["1.weight"]), name  # local
    for r in results:
        for name in ("naive", "bucketed"):
            for n, g in r["torch"]["grads"].items():
                torch.testing.assert_close(r[name]["grads"][n], g, msg=lambda m: f"{name} {n}: {m}")


class _Bag(nn.Module):
    """torch's test_sparse_gradients model: an EmbeddingBag with sparse=True, then a Linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(10, 3, mode="sum", sparse=True)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(self.bag(x))


def _sparse_cases():
    """Two backward passes without zero_grad (sparse gradients add up); the last rank's second
    batch leaves rows the first one used. Compared with torch DDP and with one process."""
    rank, res = dist.get_rank(), {}
    batches = [torch.tensor([[rank, 5], [7, rank + 2]]), torch.tensor([[rank + 3, 3]])]
    for name, cls in {"torch": DDP, "naive": NaiveDDP, "bucketed": BucketedDDP,
                      "bucketed_small": lambda m: BucketedDDP(m, bucket_cap_mb=1e-6)}.items():
        model = _Bag()
        ddp = cls(model)
        for x in batches:
            ddp(x).sum().backward()
        res[name] = {n: p.grad for n, p in model.named_parameters()}
        res[name + "_buckets"] = getattr(ddp, "buckets", None)
    ref = _Bag()  # the mean of the ranks' losses, in one process
    for step in range(2):
        sum(ref(torch.tensor([[r, 5], [7, r + 2]]) if step == 0 else torch.tensor([[r + 3, 3]])).sum()
            for r in range(dist.get_world_size())).div(dist.get_world_size()).backward()
    res["full_batch"] = {n: p.grad for n, p in ref.named_parameters()}
    return res


def test_sparse_gradients_averaged_as_torch_ddp():
    """torch's test_sparse_gradients (distributed_test.py) adapted: DDP all-reduces the sparse gradient
    of an EmbeddingBag(sparse=True) in a bucket of its own (divided by N first), and it stays sparse."""
    for res in launch(_sparse_cases, nprocs=2, timeout=60):
        for name in ("torch", "naive", "bucketed", "bucketed_small"):
            assert res[name]["bag.weight"].is_sparse, name
            for n, g in res["full_batch"].items():
                torch.testing.assert_close(res[name][n].to_dense(), g.to_dense(), msg=lambda m: f"{name} {n}: {m}")
        assert res["bucketed_buckets"] == [["fc.bias", "fc.weight"], ["bag.weight"]]


def _device_ids_on_a_gpu():
    device = mgpu_lab.rank_device()
    res = {}
    for name, cls in {"naive": NaiveDDP, "bucketed": BucketedDDP, "torch": DDP}.items():
        torch.manual_seed(0)
        net = nn.Linear(4, 2).to(device)
        model = cls(net, device_ids=[device.index])  # the DDP tutorial's call
        out = model(torch.randn(3, 4))               # a CPU input: DDP moves it to its device
        out.sum().backward()
        res[name] = (out.device.type, model.device_ids, net.weight.grad.cpu())
    return res


@requires_gpus(1)
def test_device_ids_as_the_ddp_tutorial_calls_it():
    for res in launch(_device_ids_on_a_gpu, nprocs=1, timeout=120):
        for name in ("naive", "bucketed"):
            assert res[name][:2] == res["torch"][:2]
            torch.testing.assert_close(res[name][2], res["torch"][2])


# --------------------------------------------------------------------------- ZeroRedundancyOptimizer

def _zero_single_rank(cls):
    """torch's TestZeroRedundancyOptimizerSingleRank, adapted (world size 1): its cases and values."""
    res = {}
    # test_state_dict
    x = torch.tensor([1.0], requires_grad=True)
    o = cls([x], optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    x.backward()
    o.step()
    res["after_step"] = (x.item(), o.optim.state[x]["momentum_buffer"].item())
    o.zero_grad()
    o.consolidate_state_dict(to=0)
    sd = o.state_dict()
    g = sd["param_groups"][0]
    res["sd"] = (g["lr"], g["momentum"], g["nesterov"], g["weight_decay"], g["dampening"],
                 all(g[k] == o.param_groups[0][k] for k in g if k != "params"))
    o = cls([x], optimizer_class=torch.optim.SGD, lr=0.01)
    o.load_state_dict(sd)
    res["reloaded"] = (o.optim.state[x]["momentum_buffer"].item(), o.param_groups[0]["lr"])
    x.backward()
    o.step()
    res["after_reload"] = (round(x.item(), 6), round(o.optim.state[x]["momentum_buffer"].item(), 6))
    # test_lr_scheduler
    a, b = torch.tensor([1.0], requires_grad=True), torch.tensor([1.0], requires_grad=True)
    oa, ob = cls([a], optimizer_class=torch.optim.SGD, lr=0.01), torch.optim.SGD([b], lr=0.01)
    sa, sb = torch.optim.lr_scheduler.StepLR(oa, 1), torch.optim.lr_scheduler.StepLR(ob, 1)
    same = []
    for _ in range(5):
        for t, opt, sched in ((a, oa, sa), (b, ob, sb)):
            t.backward()
            opt.zero_grad()
            opt.step()
            sched.step()
        same.append(torch.equal(a, b))
    res["scheduler"] = same

    # test_step_with_kwargs, test_step_with_extra_inner_key, test_step_without_closure
    class WithKwarg(torch.optim.SGD):
        def step(self, closure=None, kwarg=None):
            super().step()
            kwarg.append(5)

    class WithNewKey(torch.optim.SGD):
        def step(self, closure=None):
            super().step()
            self.param_groups[0]["new_key"] = 0.1

    class WithoutClosure(torch.optim.SGD):
        def step(self):
            return super().step()
    kwarg = []
    for key, (opt_cls, step_kwargs) in {"kwargs": (WithKwarg, {"kwarg": kwarg}), "new_key": (WithNewKey, {}),
                                        "no_closure": (WithoutClosure, {})}.items():
        t = torch.tensor([1.0], requires_grad=True)
        o = cls([t], optimizer_class=opt_cls, lr=0.1)
        t.backward()
        o.step(**step_kwargs)
        res[key] = (round(t.item(), 6), o.param_groups[0].get("new_key"))
    res["kwarg"] = kwarg
    # test_zero_grad
    m = nn.Linear(1, 1)
    o = cls(m.parameters(), optimizer_class=torch.optim.SGD, lr=0.01)
    m(torch.rand(1)).backward(torch.rand(1))
    o.zero_grad()
    res["zero_grad"] = (m.weight.grad, m.bias.grad)
    # test_constructor: (input, expected error)
    m = nn.Sequential(nn.Linear(5, 10), nn.Linear(10, 10), nn.Linear(10, 10))
    cases = {"empty": [], "tensor": torch.randn(1), "float": 1.2,
             "dicts": [{"params": [lin.weight for lin in m]}, {"params": [lin.bias for lin in m]}],
             "invalid item": list(m.parameters()) + [42], "generator": m.parameters(), "list": list(m.parameters())}
    res["constructor"] = {}
    for key, params in cases.items():
        try:
            cls(params, optimizer_class=torch.optim.SGD, lr=0.01)
            res["constructor"][key] = None
        except (TypeError, ValueError) as e:
            res["constructor"][key] = type(e).__name__
    o = cls([{"params": [lin.weight for lin in m], "weight_decay": 0.0},
             {"params": [lin.bias for lin in m], "weight_decay": 0.01}],
            optimizer_class=torch.optim.AdamW, lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    res["groups"] = (len(o.param_groups), len(o.optim.param_groups))
    # test_same_dense_param_type: sparse or mixed dense types are a ValueError
    res["dense_type"] = []
    for params in ([torch.sparse_coo_tensor(size=(2, 3))], [torch.FloatTensor(1), torch.DoubleTensor(1)],
                   [torch.FloatTensor(1), torch.FloatTensor(1), torch.sparse_coo_tensor(size=(2, 3))]):
        try:
            cls(params, optimizer_class=torch.optim.SGD, lr=0.01)
            res["dense_type"].append(None)
        except ValueError as e:
            res["dense_type"].append(type(e).__name__)
    return res


def test_zero_redundancy_optimizers_single_rank_tests_pass():
    ours, theirs = launch(lambda: (_zero_single_rank(ShardedOptimizer), _zero_single_rank(ZeroRedundancyOptimizer)),
                          nprocs=1, timeout=120)[0]
    for res in (ours, theirs):  # torch's asserted values, then ours equal to torch's
        assert res["after_step"] == (pytest.approx(0.9), 1.0)
        assert res["sd"] == (0.1, 0.9, False, 0.0, 0.0, True)
        assert res["reloaded"] == (1.0, 0.1)
        assert res["after_reload"] == (0.71, 1.9)
        assert all(res["scheduler"])
        assert res["kwargs"][0] == res["new_key"][0] == res["no_closure"][0] == 0.9
        assert res["new_key"][1] == 0.1 and res["kwarg"] == [5]
        assert res["zero_grad"] == (None, None)
        assert res["constructor"] == {"empty": "ValueError", "tensor": "TypeError", "float": "TypeError",
                                      "dicts": None, "invalid item": "TypeError", "generator": None, "list": None}
        assert res["groups"] == (2, 2)
        assert res["dense_type"] == ["ValueError"] * 3
    assert ours == theirs


def _zero_distributed():
    """torch's ``test_step_with_closure`` (both bucket views) and the documented call after DDP."""
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {}
    for bucket_view in (False, True):
        x = torch.tensor([float(rank + 1)])
        m = nn.Linear(1, 1)
        with torch.no_grad():
            m.weight.fill_(1.0)
            m.bias.fill_(2.0)
        o = ShardedOptimizer(m.parameters(), optimizer_class=torch.optim.SGD, parameters_as_bucket_view=bucket_view,
                             lr=0.1)
        m(x).backward(x)
        for p in m.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        target = torch.tensor([(rank + 1) * 1.0 + 2.0 + 1.0])

        def closure():
            o.zero_grad()
            loss = F.l1_loss(m(x), target)
            loss.backward()
            return loss
        loss = o.step(closure=closure)
        two = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # two parameters per rank
        ShardedOptimizer(two.parameters(), torch.optim.SGD, parameters_as_bucket_view=bucket_view, lr=0.1)
        storages = len({p.untyped_storage().data_ptr() for p in two.parameters()})  # a bucket per rank, or one each
        res[bucket_view] = (loss.item(), m.weight.item(), m.bias.item(), storages)
    # the documented call, next to torch's, after a DDP wrapper: the same weights
    weights = {}
    for name, (wrap, zero) in {"ours": (BucketedDDP, ShardedOptimizer), "torch": (DDP, ZeroRedundancyOptimizer)}.items():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
        ddp = wrap(model)
        opt = zero(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        for step in range(3):
            opt.zero_grad()
            ddp(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))).sum().backward()
            opt.step()
        weights[name] = [p.detach().clone() for p in model.parameters()]
    res["weights"] = weights
    res["overlap"] = error_text(lambda: ShardedOptimizer([nn.Parameter(torch.ones(1))], torch.optim.SGD,
                                                         overlap_with_ddp=True, lr=0.1), NotImplementedError)
    return res


def test_zero_redundancy_optimizers_step_with_closure_and_documented_call():
    for res in launch(_zero_distributed, nprocs=2, timeout=120):
        for bucket_view in (False, True):
            loss, weight, bias, storages = res[bucket_view]
            assert loss == 1.0 and weight == pytest.approx(1.1) and bias == pytest.approx(2.1), res[bucket_view]
        assert res[False][3] == 4 and res[True][3] == 2  # param.data intact, or views of its owner's bucket
        for mine, theirs in zip(res["weights"]["ours"], res["weights"]["torch"]):
            torch.testing.assert_close(mine, theirs)
        assert "overlap_with_ddp" in res["overlap"]


# --------------------------------------------------------------------------- FSDP2's keywords

def _fsdp_keywords():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    rank = dist.get_rank()
    pg = dist.new_group([0, 1])
    res = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for name in ("ours", "torch"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
        if name == "ours":
            model = FSDP(net, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, units=[net[0], net[2]],
                         process_group=pg)
            res["group"] = model.process_group is pg
        else:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            # fully_shard's default mesh is on CUDA wherever CUDA is available; these ranks are on the CPU
            mesh = init_device_mesh("cpu", (2,))
            for layer in (net[0], net[2]):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            model = fully_shard(net, mesh=mesh, mp_policy=policy)
        out = model(x)
        out.float().sum().backward()
        res[name] = out.detach().float()
    # a positional dtype, as before: FSDP2's options are keywords
    res["positional"] = error_text(lambda: FSDP(nn.Linear(2, 2), torch.bfloat16), TypeError)
    return res


def test_fsdp_takes_fsdp2s_keywords():
    for res in launch(_fsdp_keywords, nprocs=2, timeout=120):
        assert res["group"] and res["ours"].dtype == torch.float32
        torch.testing.assert_close(res["ours"], res["torch"])
        assert res["positional"] is not None and "positional" in res["positional"]


# --------------------------------------------------------------------------- checkpoint

def test_checkpoint_use_reentrant_left_out_warns_as_torch():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    for theirs, ours, args in ((tc.checkpoint, checkpoint, (lin, x)),
                               (tc.checkpoint_sequential, checkpoint_sequential, (nn.Sequential(lin, nn.Tanh()), 2, x))):
        for fn in (theirs, ours):
            with pytest.warns(UserWarning, match="use_reentrant parameter should be passed explicitly"):
                fn(*args)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours(*args, use_reentrant=False)  # passed explicitly: silent


def _recompute_count(ck, early_stop_global):
    calls = []

    def fn(h):
        y = h.sin()          # saves h
        calls.append("end")  # after its last saving operation: skipped by an early-stopping recompute
        return y
    context = contextlib.nullcontext() if early_stop_global is None else tc.set_checkpoint_early_stop(early_stop_global)
    with context:
        out = ck(fn, torch.randn(3, requires_grad=True), use_reentrant=False)
    out.sum().backward()
    return len(calls)


def test_torchs_global_set_checkpoint_early_stop_is_honoured():
    for setting in (None, True, False):
        theirs, ours = _recompute_count(tc.checkpoint, setting), _recompute_count(checkpoint, setting)
        assert ours == theirs == (2 if setting is False else 1), (setting, ours, theirs)


def test_torchs_non_reentrant_checkpoint_tests_pass():
    """torch's test_autograd cases for ``use_reentrant=False``, adapted: correct gradients, dict inputs and
    outputs, a detached input, and a recompute that differs from forward (an error; the text is ours)."""
    a = torch.randn(2, 2, requires_grad=True)
    torch.exp(a).sum().backward()
    expected, a.grad = a.grad.clone(), None
    checkpoint(torch.exp, a, use_reentrant=False).sum().backward()
    assert torch.equal(a.grad, expected)  # test_checkpointing_without_reentrant_correct_grad

    class DictModule(nn.Module):  # test_checkpointing_without_reentrant_arbitrary_input_output
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(5, 5)

        def forward(self, inputs):
            return {"out": self.layer(inputs["x"]) * inputs["scale"]}
    torch.manual_seed(0)
    model, x = DictModule(), torch.randn(3, 5, requires_grad=True)
    model_ck = copy.deepcopy(model)
    out = model({"x": x, "scale": 2.0})["out"]
    out_ck = checkpoint(model_ck, {"x": x, "scale": 2.0}, use_reentrant=False)["out"]
    assert torch.equal(out, out_ck)
    out.sum().backward()
    out_ck.sum().backward()
    for p, q in zip(model.parameters(), model_ck.parameters()):
        assert torch.equal(p.grad, q.grad)

    detached = torch.randn(2, 2)  # test_checkpointing_without_reentrant_detached_tensor
    w = torch.randn(2, 2, requires_grad=True)
    checkpoint(lambda d, ww: d @ ww, detached, w, use_reentrant=False).sum().backward()
    assert torch.equal(w.grad, detached.t() @ torch.ones(2, 2))

    for ck in (tc.checkpoint, checkpoint):  # test_checkpoint_detects_non_determinism: same error type
        calls = []

        def moody(h):  # the recompute saves a tensor of another shape
            calls.append(1)
            return (h if len(calls) == 1 else h.repeat(2)).sin()
        with pytest.raises(tc.CheckpointError, match="(?i)recompute"):  # torch's type; the recompute is caught
            ck(moody, torch.randn(3, requires_grad=True), use_reentrant=False).sum().backward()


# --------------------------------------------------------------------------- GradScaler

def _amp_docs_loop(scaler_cls, *args):
    """torch's AMP example: scale, backward, step, update; an inf gradient on step 2 skips that step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls(*args, init_scale=2.0 ** 8, growth_interval=2)
    scales = []
    for step in range(5):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step == 2:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()], scaler.state_dict()


def test_loss_scaler_called_as_the_amp_examples_call_grad_scaler():
    theirs = _amp_docs_loop(torch.amp.GradScaler, "cpu")
    for args in (("cpu",), ()):  # GradScaler("cpu"), and GradScaler() as torch's AMP examples write it
        ours = _amp_docs_loop(LossScaler, *args)
        assert ours[0] == theirs[0] == [256.0, 512.0, 256.0, 256.0, 512.0]
        for a, b in zip(ours[1], theirs[1]):
            assert torch.equal(a, b)
        assert ours[2] == theirs[2]
    with pytest.raises(TypeError, match="init_scale= by keyword"):
        LossScaler(2.0 ** 10)  # init_scale is torch's second argument, not its first


# --------------------------------------------------------------------------- Megatron's tensor parallel

def _megatron_calls():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full1, full2 = nn.Linear(8, 16), nn.Linear(16, 8)
    col = ColumnParallelLinear(8, 16, True, False)   # (input_size, output_size, bias, gather_output)
    row = RowParallelLinear(16, 8, True, True)       # (input_size, output_size, bias, input_is_parallel)
    with torch.no_grad():
        col.weight.copy_(full1.weight.chunk(world, 0)[rank])
        col.bias.copy_(full1.bias.chunk(world, 0)[rank])
        row.weight.copy_(full2.weight.chunk(world, 1)[rank])
        row.bias.copy_(full2.bias)
    x = torch.randn(3, 8)
    out, ref = row(F.gelu(col(x))), full2(F.gelu(full1(x)))
    logits = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 12, (2, 5), generator=torch.Generator().manual_seed(2))
    losses = vocab_parallel_cross_entropy(logits.chunk(world, -1)[rank], target)  # Megatron's call
    expected = F.cross_entropy(logits.reshape(-1, 12), target.reshape(-1), reduction="none").reshape(2, 5)
    return (out - ref).abs().max().item(), losses.shape == target.shape, (losses - expected).abs().max().item()


def test_tensor_parallel_layers_called_as_megatron_calls_them():
    for mlp_diff, per_token, loss_diff in launch(_megatron_calls, nprocs=2, timeout=60):
        assert mlp_diff < 1e-5 and per_token and loss_diff < 1e-5
