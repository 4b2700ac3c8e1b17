"""NaiveDDP and BucketedDDP train to the parameters of one process on the full batch,
and of torch's DistributedDataParallel (gloo, N = 2, 3, 4), in a loop written for
torch DDP (no extra call after backward).

The model has a frozen layer, a bias with requires_grad=False, a buffer, and an
output projection tied to the embedding. Each rank builds it from a different
seed, so only the broadcast at construction makes the replicas equal. Unused
parameters and a second backward match torch DDP (find_unused_parameters=True);
wrapping a module twice leaves only the second wrapper's hooks.
"""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from conftest import TiedNet, backward_on_this_gpu, error_text, lm_loss, max_param_diff, requires_gpus, token_batches
from mgpu_lab import BucketedDDP, NaiveDDP, launch

BATCH, SEQ, STEPS = 12, 5, 4  # BATCH divisible by 2, 3 and 4


def _optimizer(name, params):
    params = [p for p in params if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.Adam(params, lr=0.02)


def _train_cases():
    """In every rank: train each wrapper, return max parameter differences."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    batches = token_batches(STEPS, BATCH, SEQ)
    out = {}
    for opt_name in ("sgd", "adam"):
        # The single-process reference: rank 0's initial weights, the full batch.
        ref = TiedNet(seed=0)
        ref_opt = _optimizer(opt_name, ref.parameters())
        for x, y in batches:
            ref_opt.zero_grad()
            lm_loss(ref, x, y).backward()
            ref_opt.step()
        torch_ddp = DistributedDataParallel(TiedNet(seed=0))
        wrappers = {
            "naive": NaiveDDP(TiedNet(seed=rank)),
            "bucketed_many": BucketedDDP(TiedNet(seed=rank), bucket_cap_mb=1.1e-3),  # 1153-byte buckets
            "bucketed_one": BucketedDDP(TiedNet(seed=rank)),
            "torch_ddp": torch_ddp,
        }
        launched = {}
        for name, model in wrappers.items():
            opt = _optimizer(opt_name, model.parameters())
            launched[name] = []
            for x, y in batches:
                opt.zero_grad()
                lm_loss(model, x[lo:hi], y[lo:hi]).backward()  # gradients are averaged when it returns
                if isinstance(model, BucketedDDP):
                    launched[name].append(model.buckets_launched_in_backward)
                opt.step()
        for name, model in wrappers.items():  # all trained: compare
            out[(opt_name, name)] = dict(
                vs_full_batch=max_param_diff(model.module, ref),
                moved=max_param_diff(model.module, TiedNet(seed=0)),
                vs_torch_ddp=max_param_diff(model.module, torch_ddp.module),
                frozen_unchanged=max_param_diff(model.module.frozen, TiedNet(seed=0).frozen),
                bias_unchanged=(model.module.head.bias - TiedNet(seed=0).head.bias).abs().max().item(),
                tied=model.module.head.weight is model.module.embed.weight,
                state=model.module.state_dict(),
                buckets=model.buckets if isinstance(model, BucketedDDP) else None,
                launched_during_backward=launched[name],
            )
    return out


def _no_sync_cases():
    """Two micro-batches, the first inside no_sync: local sums, then the full-batch gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    mid = (lo + hi) // 2 if hi - lo > 1 else hi
    x, y = token_batches(STEPS, BATCH, SEQ)[0]
    ref = TiedNet(seed=0)
    lm_loss(ref, x, y).backward()
    full = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    local_ref = TiedNet(seed=0)
    (lm_loss(local_ref, x[lo:mid], y[lo:mid]) * (mid - lo) / (hi - lo)).backward()
    out = {}
    for name, model in {"naive": NaiveDDP(TiedNet(seed=rank)),
                        "bucketed": BucketedDDP(TiedNet(seed=rank), bucket_cap_mb=1e-3)}.items():
        with model.no_sync():
            (lm_loss(model, x[lo:mid], y[lo:mid]) * (mid - lo) / (hi - lo)).backward()
            model.finish_gradient_synchronization()  # a no-op inside no_sync
        inside = max((p.grad - local_ref.get_parameter(n).grad).abs().max().item()
                     for n, p in model.module.named_parameters() if p.grad is not None)
        if mid < hi:
            (lm_loss(model, x[mid:hi], y[mid:hi]) * (hi - mid) / (hi - lo)).backward()
        model.finish_gradient_synchronization()
        synced = max((p.grad - full[n]).abs().max().item()
                     for n, p in model.module.named_parameters() if p.grad is not None)
        out[name] = (inside, synced, sorted(n for n, p in model.module.named_parameters()
                                            if p.grad is not None))
    return out, sorted(full)


def _errors_and_unused():
    rank = dist.get_rank()
    res = {}
    for key, call in {"cap": lambda: BucketedDDP(nn.Linear(2, 2), bucket_cap_mb=0),
                      "module": lambda: NaiveDDP(lambda x: x)}.items():
        res[key] = error_text(call, (TypeError, ValueError))
    # A layer used only on rank 0: the others contribute zeros, nobody hangs.
    def net():
        torch.manual_seed(0)
        return nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    ref = net()
    ref["b"](ref["a"](torch.ones(2, 3))).sum().backward()
    res["expected"] = ref["b"].weight.grad / dist.get_world_size()  # rank 0's, averaged with zeros
    wrappers = {"NaiveDDP": NaiveDDP, "BucketedDDP": BucketedDDP,
                # one bucket per parameter: rank 0 launches b's buckets in backward, the others only in finish
                "BucketedDDP_small": lambda module: BucketedDDP(module, bucket_cap_mb=1e-5)}
    for name, wrap in wrappers.items():
        m = wrap(net())
        h = m.module["a"](torch.ones(2, 3))
        (m.module["b"](h) if rank == 0 else h).sum().backward()
        m.finish_gradient_synchronization()
        res[name] = m.module["b"].weight.grad
    dist.barrier()
    return res


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ddp_matches_full_batch_and_torch_ddp(world):
    results = launch(_train_cases, nprocs=world, timeout=180)
    for key, r in results[0].items():
        label = f"N={world} {key}"
        assert r["vs_full_batch"] < 2e-5, (label, r["vs_full_batch"])
        assert r["vs_torch_ddp"] < 2e-5, (label, r["vs_torch_ddp"])
        assert r["frozen_unchanged"] == 0.0 and r["bias_unchanged"] == 0.0, label
        assert r["tied"], label
        for other in results[1:]:  # every replica holds the same bits
            assert all(torch.equal(v, other[key]["state"][k]) for k, v in r["state"].items()), label
        if key[1] == "bucketed_many":  # reverse parameter order; the tied weight once
            assert r["buckets"] == [["hidden.bias", "hidden.weight"], ["embed.weight"]], label
        if key[1] == "bucketed_one":
            assert r["buckets"] == [["hidden.bias", "hidden.weight", "embed.weight"]], label
        if r["buckets"]:  # every bucket was launched by the hooks, during backward
            assert r["launched_during_backward"] == [len(r["buckets"])] * STEPS, label
        assert r["moved"] > 1e-2, label  # training did change the parameters


@pytest.mark.parametrize("world", [2, 3, 4])
def test_no_sync_accumulates_locally_then_syncs(world):
    results = launch(_no_sync_cases, nprocs=world, timeout=120)
    for rank, (out, full_names) in enumerate(results):
        for name, (inside, synced, names) in out.items():
            assert inside < 1e-6, (world, rank, name, inside)  # local gradient, no communication
            assert synced < 1e-6, (world, rank, name, synced)  # then the full-batch gradient
            assert names == full_names == ["embed.weight", "hidden.bias", "hidden.weight"]


def test_bad_input_and_unused_parameter():
    results = launch(_errors_and_unused, nprocs=2, timeout=60)
    for res in results:
        assert "bucket_cap_mb" in res["cap"]
        assert "nn.Module" in res["module"]
        for name in ("NaiveDDP", "BucketedDDP", "BucketedDDP_small"):
            assert torch.equal(res[name], results[0][name])  # ranks agree
            torch.testing.assert_close(res[name], res["expected"])


def _missing_peer():
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=1))
    model = BucketedDDP(nn.Linear(3, 3), process_group=group)
    if dist.get_rank() == 0:
        try:
            model(torch.ones(1, 3)).sum().backward()  # the end-of-backward callback waits, and fails
        except RuntimeError as e:
            return str(e)
        return "no error"
    time.sleep(2)  # never runs backward: rank 0's all-reduce has no partner
    return "absent"


def test_a_missing_peer_times_out_naming_the_bucket():
    message, _ = launch(_missing_peer, nprocs=2, timeout=60)
    assert "Timed out" in message and "rank 0: the all-reduce of bucket 0 (['bias', 'weight'])" in message, message


def test_bucket_cap_mb_must_be_positive():  # outside a process group: test_distributed.py
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketedDDP(nn.Linear(2, 2), bucket_cap_mb=-1)


def _gpu_equivalence():
    model, ref = backward_on_this_gpu(lambda net: BucketedDDP(net, bucket_cap_mb=1e-3), BATCH, SEQ)
    return max((p.grad - ref.get_parameter(n).grad).abs().max().item()
               for n, p in model.module.named_parameters() if p.grad is not None)


@requires_gpus(2)
def test_bucketed_ddp_on_nccl():
    assert max(launch(_gpu_equivalence, nprocs=2)) < 1e-4


# --------------------------------------------------------------------------- as torch DDP does it

class _ThreeLayers(nn.Module):
    """Layer b is used only when asked; layer "never" never is."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.never = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x, use_b):
        h = self.a(x)
        return (self.b(h) if use_b else h).sum()


def _three_layers():
    return _ThreeLayers()


def _forward(m, x, use_b):
    return m(x, use_b)


def _like_torch_ddp():
    """A loop written for torch DDP (no call after backward) against torch DDP itself, with
    find_unused_parameters=True: layer b is used on rank 0 only, layer "never" by no rank."""
    rank = dist.get_rank()
    x = torch.arange(6.0).reshape(2, 3) + rank
    out = {}
    for name, wrap in {"torch": lambda m: DistributedDataParallel(m, find_unused_parameters=True),
                       "NaiveDDP": NaiveDDP, "BucketedDDP": BucketedDDP,
                       "BucketedDDP_small": lambda m: BucketedDDP(m, bucket_cap_mb=1e-5)}.items():
        model = wrap(_three_layers())
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        grads, never_grad = [], []
        for step in range(2):
            opt.zero_grad()
            _forward(model, x, use_b=rank == 0).backward()
            if step == 1:  # a second backward before the step: the gradients add up, averaged
                _forward(model, x * 2, use_b=True).backward()
            grads.append({n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None})
            never_grad.append(model.module.never.weight.grad)
            opt.step()
        out[name] = dict(grads=grads, never_grad=never_grad,
                         never_moved=(model.module.never.weight - _three_layers().never.weight).abs().max().item(),
                         weights={n: p.detach().clone() for n, p in model.module.named_parameters()})
    return out


def test_finishes_with_backward_and_treats_unused_parameters_as_torch_ddp():
    for res in launch(_like_torch_ddp, nprocs=2, timeout=120):
        ref = res["torch"]
        assert ref["never_grad"] == [None, None] and ref["never_moved"] == 0.0  # torch's behaviour
        for name in ("NaiveDDP", "BucketedDDP", "BucketedDDP_small"):
            r = res[name]
            assert r["never_grad"] == [None, None], name  # no rank used it: grad stays None
            assert r["never_moved"] == 0.0, name          # and AdamW leaves it alone
            for mine, theirs in zip(r["grads"], ref["grads"]):
                assert sorted(mine) == sorted(theirs), name
                for n in theirs:
                    torch.testing.assert_close(mine[n], theirs[n], msg=lambda m: f"{name} {n}: {m}")
            for n, w in ref["weights"].items():
                torch.testing.assert_close(r["weights"][n], w, msg=lambda m: f"{name} {n}: {m}")


def _wrap_twice():
    """Re-running a notebook cell wraps the same module again: only the new wrapper may act."""
    rank = dist.get_rank()
    calls = []
    all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)
    out = {}
    for name, wrap in {"NaiveDDP": NaiveDDP, "BucketedDDP": BucketedDDP}.items():
        net = _three_layers()
        first = wrap(net)
        model = wrap(net)  # the cell, run again
        ref = _three_layers()
        dist.all_reduce = counting
        try:
            for _ in range(2):  # a second step: the old hooks would have made it fail
                calls.clear()
                model.zero_grad()
                _forward(model, torch.ones(2, 3) * (rank + 1), use_b=True).backward()
        finally:
            dist.all_reduce = all_reduce
        _forward(ref, torch.ones(2, 3) * 1.5, use_b=True).backward()  # the average of the ranks' inputs
        out[name] = dict(calls=list(calls), old=error_text(lambda: first(torch.ones(1, 3)), RuntimeError),
                         diff=max((p.grad - ref.get_parameter(n).grad).abs().max().item()
                                  for n, p in net.named_parameters() if p.grad is not None))
    return out


def test_wrapping_a_module_again_leaves_no_hooks_of_the_first_wrapper():
    for res in launch(_wrap_twice, nprocs=2, timeout=60):
        assert res["NaiveDDP"]["calls"] == [6] + [9, 3] * 2, res  # the used flags, then a and b (w, b)
        assert res["BucketedDDP"]["calls"] == [36 + 6], res       # one bucket + one flag per parameter
        for r in res.values():
            assert r["diff"] < 1e-6, r
            assert "replaced by a newer wrapper" in r["old"], r


def _mean_hook(state, bucket):
    """A custom hook as torch's docs write one: all-reduce the buffer, divide, record the bucket."""
    state.append((bucket.index(), bucket.is_last(), len(bucket.parameters()), len(bucket.gradients())))
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))


def _comm_hook_cases():
    """Each wrapper with torch's allreduce_hook, fp16_compress_hook and a custom hook, against torch DDP
    with the same hook; TiedNet (frozen layer, tied weights), two steps."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    out = {}
    hooks = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
             "custom": _mean_hook}
    for hook_name, hook in hooks.items():
        for name, cls in {"torch": DistributedDataParallel, "naive": NaiveDDP, "bucketed": BucketedDDP}.items():
            net = TiedNet(seed=rank)
            model = cls(net)
            state = [] if hook_name == "custom" else None
            model.register_comm_hook(state, hook)
            opt = _optimizer("sgd", model.parameters())
            for x, y in token_batches(2, BATCH, SEQ):
                opt.zero_grad()
                lm_loss(model, x[lo:hi], y[lo:hi]).backward()
                opt.step()
            out[hook_name, name] = dict(net.named_parameters())
            if state is not None:
                out["calls", name] = state
            out["twice", name] = error_text(lambda: model.register_comm_hook(None, hook), RuntimeError)
    return out


def test_register_comm_hook_as_torch_ddp():
    for res in launch(_comm_hook_cases, nprocs=2, timeout=120):
        for hook in ("allreduce", "fp16", "custom"):
            for name in ("naive", "bucketed"):
                for n, p in res[hook, "torch"].items():
                    tol = dict(atol=1e-3, rtol=1e-3) if hook == "fp16" else {}
                    torch.testing.assert_close(res[hook, name][n], p, **tol, msg=lambda m: f"{hook} {name} {n}: {m}")
        assert res["calls", "bucketed"] == [(0, True, 3, 3)] * 2  # one bucket (25 MiB), once per step
        assert len(res["calls", "naive"]) == 2 * 3  # a bucket per trainable parameter
        for name in ("naive", "bucketed"):
            assert "can only be called once" in res["twice", name]


def _pickle_cases():
    import io
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    out = {}
    for name, cls in {"torch": DistributedDataParallel, "naive": NaiveDDP, "bucketed": BucketedDDP}.items():
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        buf, wrapped = io.BytesIO(), cls(TiedNet(seed=rank))
        wrapped.register_comm_hook(None, allreduce_hook)
        torch.save(wrapped, buf)  # torch.save(model), as torch DDP allows
        buf.seek(0)
        model = torch.load(buf, weights_only=False)
        model.register_comm_hook(None, allreduce_hook)  # the hook was dropped (torch's reducer is rebuilt)
        opt = _optimizer("adam", model.parameters())
        for x, y in token_batches(2, BATCH, SEQ):
            opt.zero_grad()
            lm_loss(model, x[lo:hi], y[lo:hi]).backward()
            opt.step()
        out[name] = dict(model.module.named_parameters())
    group = dist.new_group([0, 1])
    out["group"] = error_text(lambda: torch.save(BucketedDDP(TiedNet(), process_group=group), io.BytesIO()),
                              RuntimeError)
    return out


def test_a_wrapped_model_pickles_and_trains_after_loading_as_torch_ddp():
    for res in launch(_pickle_cases, nprocs=2, timeout=120):
        for name in ("naive", "bucketed"):
            for n, p in res["torch"].items():
                torch.testing.assert_close(res[name][n], p, msg=lambda m: f"{name} {n}: {m}")
        assert "default process group" in res["group"]
