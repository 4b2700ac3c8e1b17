"""CollectiveLog, HeldAtOnce and KeptAlive (mgpu_lab.measure.dispatch_watch): the collectives issued, the bytes
held at once, what stays alive."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from mgpu_lab import launch
from mgpu_lab.measure.dispatch_watch import CollectiveLog, HeldAtOnce, KeptAlive


def _every_spelling():
    rank = dist.get_rank()
    t = torch.ones(6) * (rank + 1)
    out, full = torch.empty(3), torch.empty(12)
    with CollectiveLog(compute=True) as log:
        dist.all_reduce(t)
        dist.all_gather_single(full, t)
        dist.reduce_scatter_single(out, t)
        dist.broadcast(t, 0)
        dist.all_reduce(t.double(), async_op=True).wait()
        dist.all_gather([torch.empty(6), torch.empty(6)], t)
        dist.reduce_scatter(out, [t[:3].clone(), t[3:].clone()])
        funcol.all_reduce(t, "sum", dist.group.WORLD).wait()
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))
    outside = torch.empty(6)
    dist.all_reduce(outside)                      # not recorded: the log is closed
    return log.events, log.kinds(), log.wire_bytes(dist.get_world_size())


def test_collective_log_sees_every_spelling_with_dtype_and_size():
    events, kinds, wire = launch(_every_spelling, nprocs=2)[0]
    assert kinds == ["all-reduce", "all-gather", "reduce-scatter", "broadcast", "all-reduce", "all-gather",
                     "reduce-scatter", "all-reduce"]
    assert events[0] == ("all-reduce", "float32", 6)
    assert events[1] == ("all-gather", "float32", 12)      # the largest tensor of the call: the output
    assert events[4] == ("all-reduce", "float64", 6)
    assert events[-1] == ("compute",)
    # a ring sends (N-1)/N of the largest tensor per rank (an all-reduce twice that); the list form of
    # all_gather counts one element of its list
    assert wire[("all-gather", "float32")] == 12 * 4 // 2 + 6 * 4 // 2
    assert wire[("all-reduce", "float64")] == 2 * 6 * 8 // 2


def _functional_and_c10d():
    """Each collective in its functional spelling (what DTensor issues: the output is returned, an all-gather
    given only its shard) and its c10d spelling, the same sizes; on rank 1, whose all-to-all receives more
    than it sends."""
    world, r = dist.group.WORLD, dist.get_rank()
    x, big, small = torch.ones(1000), torch.ones(2000), torch.ones(500)
    split_in, split_out = [1, 5], ([1, 1] if r == 0 else [5, 5])

    def coalesced(*calls):
        with dist._coalescing_manager(async_ops=True) as cm:
            for call in calls:
                call()
        cm.wait()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2,))
    sharded = distribute_tensor(big, mesh, [Shard(0)])          # made outside the logs (it scatters)
    pairs = {
        "all-gather": (lambda: funcol.all_gather_tensor(x, 0, world) + 0,
                       lambda: dist.all_gather_into_tensor(torch.empty(2000), x)),
        "all-gather (DTensor)": (lambda: sharded.full_tensor() + 0,
                                 lambda: dist.all_gather_into_tensor(torch.empty(2000), x)),
        "reduce-scatter": (lambda: funcol.reduce_scatter_tensor(big, "sum", 0, world) + 0,
                           lambda: dist.reduce_scatter_tensor(torch.empty(1000), big)),
        "reduce-scatter (DTensor)": (
            lambda: DTensor.from_local(big.clone(), mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local() + 0,
            lambda: dist.reduce_scatter_tensor(torch.empty(1000), big)),
        "all-reduce": (lambda: funcol.all_reduce(x, "sum", world) + 0, lambda: dist.all_reduce(x.clone())),
        "broadcast": (lambda: funcol.broadcast(x, 0, world) + 0, lambda: dist.broadcast(x.clone(), 0)),
        "all-to-all": (lambda: funcol.all_to_all_single(big, None, None, world) + 0,
                       lambda: dist.all_to_all_single(torch.empty(2000), big)),
        "all-to-all, unequal": (
            lambda: funcol.all_to_all_single(torch.ones(6, 3), split_out, split_in, world) + 0,
            lambda: dist.all_to_all_single(torch.empty(sum(split_out), 3), torch.ones(6, 3), split_out, split_in)),
        "all-gather, coalesced": (
            lambda: [t + 0 for t in funcol.all_gather_into_tensor_coalesced([x, small], world)],
            lambda: coalesced(lambda: dist.all_gather_into_tensor(torch.empty(2000), x),
                              lambda: dist.all_gather_into_tensor(torch.empty(1000), small))),
        "reduce-scatter, coalesced": (
            lambda: [t + 0 for t in funcol.reduce_scatter_tensor_coalesced([big, x], "sum", [0, 0], world)],
            lambda: coalesced(lambda: dist.reduce_scatter_tensor(torch.empty(1000), big),
                              lambda: dist.reduce_scatter_tensor(torch.empty(500), x))),
        "all-reduce, coalesced": (lambda: [t + 0 for t in funcol.all_reduce_coalesced([x, small], "sum", world)],
                                  lambda: dist.all_reduce_coalesced([x.clone(), small.clone()])),
    }
    out = {}
    for name, spellings in pairs.items():
        logs = []
        for call in spellings:
            with CollectiveLog() as log:
                call()
            logs.append((log.events, log.wire_bytes(2)))
        out[name] = logs
    return out


def test_functional_collectives_count_as_their_c10d_spelling():
    """A functional all-gather is logged at its gathered size (DTensor's redistributions included), a coalesced
    call at the sum of its tensors, an all-to-all at its larger side: each equal to its c10d spelling."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logged = launch(_functional_and_c10d, nprocs=2)[1]
    want = {"all-gather": 2000, "all-gather (DTensor)": 2000, "reduce-scatter": 2000,
            "reduce-scatter (DTensor)": 2000, "all-reduce": 1000, "broadcast": 1000, "all-to-all": 2000,
            "all-to-all, unequal": 30, "all-gather, coalesced": 3000, "reduce-scatter, coalesced": 3000,
            "all-reduce, coalesced": 1500}
    for name, (functional, c10d) in logged.items():
        assert functional == c10d, f"{name}: functional {functional}, c10d {c10d}"
        assert [numel for _, _, numel in functional[0]] == [want[name]], f"{name}: {functional[0]}"


def _stash_one():
    keep = []
    with KeptAlive() as watch:
        a = torch.ones(100)            # 400 bytes, kept
        keep.append(a * 2)
        b = torch.ones(100) + 1        # dropped below
        view = torch.ones(50)[:2]      # a 2-number view keeps its 200-byte storage alive
        freed = torch.ones(100) * 3
        freed.untyped_storage().resize_(0)
        del b
    kept = sorted(watch.kept(min_bytes=200))
    return kept, keep, view, freed


def test_kept_alive_finds_what_is_referenced_not_what_was_freed():
    kept, *_ = _stash_one()
    assert kept == sorted([((100,), 400), ((100,), 400), ((50,), 200)])  # a, a * 2, the view's base


def test_held_at_once_counts_storages_from_made_to_freed():
    before = torch.ones(100)
    with HeldAtOnce() as held:
        a = torch.ones(100)            # 400 bytes
        b = a * 2                      # 800 held
        del a                          # 400
        c = torch.ones(150)            # 1000: the peak
        c[:2].add_(1)                  # a view and an in-place result: nothing new
        before.t().mul_(2)             # the same, of a storage made before
        d = before + 1                 # 1400 for a moment
        del d
        e = (b * 2).sum()              # 1000 + 400 + 4 while the sum is made (the peak), then b * 2 is freed
    assert (held.peak, held.held) == (1404, 1004)
    del b
    assert held.held == 604


def test_kept_alive_waits_for_a_thread_that_lets_go_and_reports_what_stays():
    """A storage a background thread (a backend's worker) releases just after the block is
    not reported; one the caller still holds after the wait is."""
    import threading
    import time
    with KeptAlive() as watch:
        held = torch.ones(100) * 2
        lent = [torch.ones(100) * 3]
    releaser = threading.Thread(target=lambda: (time.sleep(0.2), lent.clear()))
    releaser.start()
    assert watch.kept(min_bytes=400) == [((100,), 400)]      # `held` only
    releaser.join()
    del held


def test_measuring_leaves_torchs_compiler_unimported():
    """A fresh process (a forked rank) that measures pays no import of torch._dynamo (a second
    of CPU each): torch's Dynamo wrapper of a dispatch mode is switched off (measuring_mode.py)."""
    import subprocess
    import sys
    code = ("import sys, torch\n"
            "from mgpu_lab.measure.dispatch_watch import CollectiveLog, KeptAlive\n"
            "from mgpu_lab.measure.kept_alive import kept_alive\n"
            "x = torch.ones(4, requires_grad=True)\n"
            "with CollectiveLog(compute=True) as log, KeptAlive() as kept:\n"
            "    (x * 2).sum().backward()\n"
            "report = kept_alive(lambda t: t.exp() * 3, x)\n"
            "assert report.ops and 'torch._dynamo' not in sys.modules, sorted(m for m in sys.modules if 'dynamo' in m)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
