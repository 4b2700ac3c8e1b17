"""Lab 13, section 7, on a small model: FSDP2 (torch's ``fully_shard``) with gradient accumulation,
four ways, on 4 gloo ranks, and DCP's ``get_state_dict``/``set_state_dict`` resumed on 2.

* the collectives per step follow from the switches (``set_requires_gradient_sync``,
  ``reshard_after_forward``, ``set_reshard_after_backward``): the ring bytes computed from the
  log equal the formula to the byte, and the sockets (``WireMeter``) carry it within 2 % once
  gloo's reduce-scatter is counted at what it sends (an all-reduce's, tests/test_wire.py);
* the bytes held, counted by ``mgpu_lab.measure.fsdp_held.held_bytes``, are the formula's;
* the gradients equal one process's on the whole batch, in all four;
* a checkpoint written by ``dcp.save`` of ``get_state_dict`` on 4 ranks, loaded with
  ``set_state_dict`` on 2, equals one process after the step and after one more, and equals
  ``TrainState(sharded=True)``'s resume to the bit; the full state dict (``cpu_offload``) is all
  on rank 0.
"""
import os
import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mgpu_lab import TrainState, launch

VOCAB, DIM, LAYERS, N, M, BATCH, SEQ = 13, 64, 2, 4, 3, 12, 8
MODES = ("as is", "no sync", "+ keep after forward", "+ keep after backward")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, DIM)                      # 13 rows: padded to 16 over 4 ranks
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(),
                                                           nn.Linear(4 * DIM, DIM)) for i in range(LAYERS)})
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.tok(x)
        for layer in self.layers.values():
            h = h + layer(h)
        return self.output(h)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def _sharded(keep=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Net()
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, reshard_after_forward=not keep)
    fully_shard(model, mesh=mesh)
    return model


def _accumulate():
    from mgpu_lab.measure.dispatch_watch import CollectiveLog
    from mgpu_lab.measure.fsdp_held import held_bytes
    from mgpu_lab.measure.wire import WireMeter
    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, out = dist.get_rank(), {}
    x, y = _batch(0)
    per_rank = BATCH // N
    for mode in MODES:
        model = _sharded(keep=mode.startswith("+"))
        memory = []
        dist.barrier()
        with WireMeter() as wire, CollectiveLog() as log:
            for j in range(M):
                last = j == M - 1
                if mode != "as is":
                    model.set_requires_gradient_sync(last)
                if mode == "+ keep after backward":
                    model.set_reshard_after_backward(last)
                rows = slice(rank * per_rank + j, rank * per_rank + j + 1)
                loss = _loss(model, x[rows], y[rows]) / M
                memory.append(held_bytes(model))
                loss.backward()
                memory.append(held_bytes(model))
        out[mode] = {"kinds": Counter(log.kinds()), "computed": sum(log.wire_bytes(N).values()),
                     "sent": wire.sent, "memory": memory,
                     "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}
    return out


def _padded(params):
    return sum(-(-p.shape[0] // N) * N * p[0].numel() if p.dim() else p.numel() for p in params) * 4


def test_fsdp_accumulation_collectives_bytes_memory_and_gradients():
    ranks = launch(_accumulate, nprocs=N, timeout=120)
    model = Net()
    x, y = _batch(0)
    _loss(model, x, y).backward()
    root = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
    R, B = _padded(root), _padded(model.layers["0"].parameters())
    whole = sum(p.numel() for p in model.parameters()) * 4
    shard0 = (R + LAYERS * B) // N                    # rank 0 holds full rows: a quarter of the padded model
    gathers = {"as is": (M, 2 * M, M), "no sync": (M, 2 * M, 1), "+ keep after forward": (M, M, 1),
               "+ keep after backward": (1, 1, 1)}
    for mode, (g_root, g_block, rs) in gathers.items():
        for rank, r in enumerate(ranks):
            got = r[mode]
            assert got["kinds"] == Counter({"all-gather": g_root + g_block * LAYERS,
                                            "reduce-scatter": rs * (1 + LAYERS)}), (mode, got["kinds"])
            ring = (g_root * R + g_block * LAYERS * B + rs * (R + LAYERS * B)) * (N - 1) // N
            assert got["computed"] == ring, (mode, got["computed"], ring)
            if got["sent"] is not None:              # Linux: gloo sends its reduce-scatter as an all-reduce
                gloo = ring + rs * (R + LAYERS * B) * (N - 1) // N
                assert gloo <= got["sent"] < 1.02 * gloo, (mode, rank, got["sent"], gloo)
            for name, p in model.named_parameters():
                torch.testing.assert_close(got["grads"][name], p.grad, rtol=0, atol=1e-6, msg=(mode, name))
        memory = ranks[0][mode]["memory"]
        keeps = mode.startswith("+")
        # after the first forward: the shards, the root kept (reshard_after_forward None: False at the root),
        # every block too when kept; no gradient yet
        root_whole = sum(p.numel() for p in root) * 4
        assert memory[0] == (shard0 + (whole if keeps else root_whole), 0), (mode, memory[0])
        # after the first backward: a gradient shard (synced), or the whole gradient (not); parameters kept
        # only by set_reshard_after_backward(False)
        assert memory[1] == (shard0 + (whole if mode == "+ keep after backward" else 0),
                             shard0 if mode == "as is" else whole), (mode, memory[1])
        assert memory[-1] == (shard0, shard0), (mode, memory[-1])     # after the step: shards only


def _adam_step(model, optimizer, step):
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = _batch(10 + step)
    rows = slice(rank * BATCH // n, (rank + 1) * BATCH // n)
    _loss(model, x[rows], y[rows]).backward()
    optimizer.step()
    optimizer.zero_grad()


def _whole(model, optimizer):
    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    return {**{n: full(p) for n, p in model.named_parameters()},
            **{f"{n}.{k}": full(v) for n, p in model.named_parameters() for k, v in optimizer.state[p].items()}}


def _local_bytes(state):
    from torch.utils._pytree import tree_leaves
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
               for t in tree_leaves(state) if isinstance(t, torch.Tensor))


def _save(folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    warnings.filterwarnings("ignore", category=FutureWarning)
    model = _sharded()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _adam_step(model, optimizer, 0)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(folder, "dcp"))
    TrainState(model, optimizer, sharded=True).save(os.path.join(folder, "lab"))
    full = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _local_bytes((model_sd, optim_sd)), _local_bytes(full)


def _resume(folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    warnings.filterwarnings("ignore", category=FutureWarning)
    out = {}
    for how in ("dcp", "lab"):
        model = _sharded()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if how == "lab":
            TrainState(model, optimizer, sharded=True).load(os.path.join(folder, "lab"))
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(folder, "dcp"))
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        loaded = _whole(model, optimizer)
        _adam_step(model, optimizer, 1)
        out[how] = (loaded, _whole(model, optimizer))
    return out


def test_get_set_state_dict_resumes_4_ranks_on_2_as_one_process_and_as_train_state(tmp_path):
    sizes = launch(_save, nprocs=4, args=(str(tmp_path),), timeout=120)
    resumed = launch(_resume, nprocs=2, args=(str(tmp_path),), timeout=120)[0]
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = []
    for step in range(2):
        _loss(model, *_batch(10 + step)).backward()
        optimizer.step()
        optimizer.zero_grad()
        reference.append(_whole(model, optimizer))
    for how in ("dcp", "lab"):
        for got, want in zip(resumed[how], reference):
            assert got.keys() == want.keys()
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-4, msg=(how, k))
    for a, b in zip(resumed["dcp"], resumed["lab"]):
        assert all(torch.equal(a[k], b[k]) for k in a)
    params = sum(p.numel() for p in model.parameters())
    steps = len(list(model.parameters())) * 4         # AdamW's step: a float32 scalar per parameter
    assert [f for _, f in sizes] == [3 * params * 4 + steps, 0, 0, 0]
    assert sum(s for s, _ in sizes) == 3 * params * 4 + N * steps        # the shards add up; steps on every rank
