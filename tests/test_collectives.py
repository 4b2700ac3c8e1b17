"""Ring and parameter-server all-reduce against ``dist.all_reduce`` (gloo, N = 2, 3, 4).

Each N is one ``launch()`` that runs every case and returns the numbers; the
asserts run in the parent.
"""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import requires_gpus
from mgpu_lab import CommStats, allreduce_bytes, launch, naive_allreduce, ring_allreduce
from mgpu_lab.parallel.collectives import bus_bandwidth, ring_schedule, simulate_ring_allreduce

SIZES = (0, 1, 3, 7, 1000, 65537, 98304)  # 98304 = 2**15 * 3: divisible by 2, 3 and 4
DTYPES = (torch.float32, torch.int64)


def _inputs(rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 * rank + numel)
    x = torch.randn(numel, generator=g) * 100
    return x.to(dtype)


def _ring_cases():
    """Runs in every rank: each case's ring / naive result, the reference, the stats."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for numel in SIZES:
        for dtype in DTYPES:
            ops = ("sum", "max", "min", "avg") if dtype.is_floating_point else ("sum", "max", "min")
            for op in ops:
                x = _inputs(rank, numel, dtype)
                ref = x.clone()
                if op == "avg":
                    dist.all_reduce(ref)
                    ref /= world
                else:
                    dist.all_reduce(ref, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                             "min": dist.ReduceOp.MIN}[op])
                ring, naive = x.clone(), x.clone()
                ring_stats = ring_allreduce(ring, op=op)
                naive_stats = naive_allreduce(naive, root=world - 1, op=op)
                out.append(dict(numel=numel, dtype=dtype, op=op, ref=ref, ring=ring, naive=naive,
                                ring_stats=ring_stats, naive_stats=naive_stats))
    # Integer product (small values so it does not overflow), bit for bit.
    x = torch.tensor([rank + 1, 2, -1, 3, 0], dtype=torch.int64)
    ref = x.clone()
    dist.all_reduce(ref, op=dist.ReduceOp.PRODUCT)
    ring, naive = x.clone(), x.clone()
    ring_allreduce(ring, op="product")
    naive_allreduce(naive, root=0, op="product")
    out.append(dict(numel=5, dtype=torch.int64, op="product", ref=ref, ring=ring, naive=naive,
                    ring_stats=None, naive_stats=None))
    return out


def _extras():
    """Non-contiguous input, a subgroup, and errors raised before any message."""
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {}
    x = (torch.arange(30, dtype=torch.float32).view(6, 5) * (rank + 1)).t()  # non-contiguous
    ref = x.contiguous()
    dist.all_reduce(ref)
    ring_allreduce(x)
    res["noncontig"] = (x, ref, x.is_contiguous())
    w = torch.nn.Parameter(torch.full((5,), float(rank)))  # requires grad: reduced outside autograd
    ring_allreduce(w)
    res["param"] = (w.detach().clone(), float(sum(range(world))), w.requires_grad)
    members = list(range(1, world))  # every rank but 0, so group ranks != global ranks
    group = dist.new_group(members) if len(members) > 1 else None
    if group is not None and rank in members:
        y = torch.full((11,), float(rank))
        stats = ring_allreduce(y, group=group)
        z = torch.full((11,), float(rank))
        naive_allreduce(z, root=0, group=group)
        res["group"] = (y, z, float(sum(members)), stats)
    for name, call in {
        "int_avg": lambda: ring_allreduce(torch.ones(4, dtype=torch.int64), op="avg"),
        "bool": lambda: ring_allreduce(torch.ones(4, dtype=torch.bool)),
        "op": lambda: ring_allreduce(torch.ones(4), op="mean"),
        "root": lambda: naive_allreduce(torch.ones(4), root=world),
        "not_tensor": lambda: ring_allreduce([1.0, 2.0]),
    }.items():
        try:
            call()
            res[name] = None
        except (TypeError, ValueError) as e:
            res[name] = f"{type(e).__name__}: {e}"
    dist.barrier()
    return res


def _ring_chunk_bytes(numel, element_size, world, rank):
    """Independent count of (sent, received) bytes. Rank r sends every chunk but
    r+1 in scatter-reduce and every chunk but r+2 in all-gather; it receives every
    chunk but r, then every chunk but r+1. Chunk sizes as torch.tensor_split cuts."""
    sizes = [numel // world + (1 if i < numel % world else 0) for i in range(world)]
    sent = 2 * numel - sizes[(rank + 1) % world] - sizes[(rank + 2) % world]
    received = 2 * numel - sizes[rank] - sizes[(rank + 1) % world]
    return sent * element_size, received * element_size


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_and_naive_match_all_reduce(world):
    results = launch(_ring_cases, nprocs=world, timeout=120)
    for i, case in enumerate(results[0]):
        label = f"N={world} numel={case['numel']} {case['dtype']} op={case['op']}"
        for rank in range(world):
            c = results[rank][i]
            if c["dtype"].is_floating_point:
                torch.testing.assert_close(c["ring"], c["ref"], rtol=1e-5, atol=1e-4, msg=label)
                torch.testing.assert_close(c["naive"], c["ref"], rtol=1e-5, atol=1e-4, msg=label)
            else:
                assert torch.equal(c["ring"], c["ref"]), label
                assert torch.equal(c["naive"], c["ref"]), label
            # Every rank ends with the same bits (each chunk is reduced once, by its owner).
            assert torch.equal(c["ring"], results[0][i]["ring"]), label
        if case["ring_stats"] is None:
            continue
        numel, esize = case["numel"], case["ref"].element_size()
        size = numel * esize
        for rank in range(world):
            rs, ns = results[rank][i]["ring_stats"], results[rank][i]["naive_stats"]
            assert rs.steps == 2 * (world - 1), label
            assert (rs.bytes_sent, rs.bytes_received) == _ring_chunk_bytes(numel, esize, world, rank), label
            if numel % world == 0:
                assert rs.bytes_sent == rs.bytes_received == allreduce_bytes(numel, esize, world, "ring"), label
            if rank == world - 1:  # the root
                assert ns.bytes_sent == ns.bytes_received == allreduce_bytes(numel, esize, world, "parameter_server"), label
            else:
                assert ns.bytes_sent == ns.bytes_received == size, label
        # Summed over ranks the ring moves exactly 2(N-1)·S, whatever the size.
        total = sum(results[r][i]["ring_stats"].bytes_sent for r in range(world))
        assert total == 2 * (world - 1) * size, label


@pytest.mark.parametrize("world", [2, 3, 4])
def test_noncontiguous_subgroup_and_errors(world):
    results = launch(_extras, nprocs=world, timeout=120)
    for res in results:
        x, ref, contiguous = res["noncontig"]
        assert not contiguous and torch.equal(x, ref)
        w, expected, requires_grad = res["param"]
        assert requires_grad and torch.equal(w, torch.full((5,), expected))
        if "group" in res:
            y, z, expected, stats = res["group"]
            assert torch.equal(y, torch.full((11,), expected)) and torch.equal(z, y)
            assert stats.steps == 2 * (world - 2)
        assert res["int_avg"].startswith("TypeError") and "op='sum'" in res["int_avg"]
        assert res["bool"].startswith("TypeError")
        assert res["op"].startswith("ValueError") and "'sum'" in res["op"]
        assert res["root"].startswith("ValueError")
        assert res["not_tensor"].startswith("TypeError")
    assert "group" in results[-1] or world == 2


def _missing_peer():
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=1))
    if dist.get_rank() == 0:
        try:
            ring_allreduce(torch.ones(8), group=group)
        except RuntimeError as e:
            return str(e)
        return "no error"
    import time
    time.sleep(2)  # never joins the ring
    return "absent"


def _largest_allocation_of_a_second_call(numel):
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(numel)
    ring_allreduce(x)  # the first call may allocate
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ring_allreduce(x)
    return max([e.cpu_memory_usage for e in prof.events()] + [0]), x[0].item()


def test_the_ring_allocates_nothing_after_its_first_call():
    # A fresh receive buffer per call cost page faults worth ~0.5x of a 64 MB all-reduce on CPU
    # (benchmarks/bench_allreduce.py measures the ring against dist.all_reduce).
    assert launch(_largest_allocation_of_a_second_call, nprocs=2, args=(2**16,)) == [(0, 4.0)] * 2


def test_missing_peer_times_out_instead_of_hanging():
    # The wait honours the process group's timeout (here 1 s): no hang.
    message, _ = launch(_missing_peer, nprocs=2, timeout=60)
    assert "Timed out" in message or "timeout" in message.lower(), message
    assert "rank 0: sending to rank 1 and receiving from rank 1 failed" in message, message  # names the peer


def test_byte_formulas():
    s = 1000 * 4
    assert allreduce_bytes(1000, 4, 1) == 0
    assert [allreduce_bytes(1000, 4, n) for n in (2, 4, 8)] == [s, 1.5 * s, 1.75 * s]
    assert [allreduce_bytes(1000, 4, n, "parameter_server") for n in (2, 4, 8)] == [s, 3 * s, 7 * s]
    with pytest.raises(ValueError, match="parameter_server"):  # one name for the pattern
        allreduce_bytes(1000, 4, 8, "naive")
    for n in range(2, 65):  # the ring stays below 2·S; the parameter server grows with N
        assert allreduce_bytes(1000, 4, n) < 2 * s
        assert allreduce_bytes(1000, 4, n, "parameter_server") == (n - 1) * s
    with pytest.raises(ValueError, match="unknown algorithm"):
        allreduce_bytes(10, 4, 2, "tree")
    with pytest.raises(ValueError):
        allreduce_bytes(10, 4, 0)
    alg, bus = bus_bandwidth(8e6, 0.01, 4)
    assert alg == pytest.approx(8e8) and bus == pytest.approx(8e8 * 1.5)
    assert CommStats(1, 2, 3) + CommStats(10, 20, 30) == CommStats(11, 22, 33)


def test_errors_without_process_group():  # the missing group itself: test_distributed.py
    with pytest.raises(ValueError, match="unsupported op"):
        ring_allreduce(torch.ones(3), op="mean")
    with pytest.raises(TypeError, match="op='sum'"):
        ring_allreduce(torch.ones(3, dtype=torch.int32), op="avg")


def _on_gpu():
    rank = dist.get_rank()
    torch.manual_seed(rank)
    x = torch.randn(10007, device=f"cuda:{rank}")
    ref = x.clone()
    dist.all_reduce(ref)
    stats = ring_allreduce(x)
    return (x - ref).abs().max().item(), stats.bytes_sent


@requires_gpus(2)
def test_ring_on_nccl():
    for err, _ in launch(_on_gpu, nprocs=2):
        assert err < 1e-3


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel", [1, 3, 7, 10])
def test_simulated_ring_step_by_step(world, numel):
    tensors = [_inputs(r, numel, torch.int64) for r in range(world)]
    states = simulate_ring_allreduce(tensors)
    assert len(states) == 2 * (world - 1) + 1
    total = torch.stack(tensors).sum(0)
    everyone = frozenset(range(world))
    for r in range(world):  # the start is a snapshot: each rank holds its own data, unreduced
        assert torch.equal(torch.cat(states[0].chunks[r]), tensors[r])
    # One step numbering everywhere: states[k] is after k steps; RingState.step counts from 1 in each phase.
    assert (states[0].phase, states[0].step, states[0].messages) == ("start", 0, [])
    assert [(st.phase, st.step) for st in states[1:]] == \
        [("scatter-reduce", s) for s in range(1, world)] + [("all-gather", s) for s in range(1, world)]
    for s in range(1, world):  # the schedule as the lab states it: step s sends chunk r-s+1, then r-s+2
        assert states[s].messages == [(r, (r + 1) % world, (r - s + 1) % world) for r in range(world)]
        assert states[world - 1 + s].messages == [(r, (r + 1) % world, (r - s + 2) % world) for r in range(world)]
    for s, state in enumerate(states[1:world]):  # after scatter-reduce step s + 1
        assert state.phase == "scatter-reduce" and state.step == s + 1
        assert sorted(dst for _, dst, _ in state.messages) == list(range(world))  # one message per rank
        for r in range(world):
            # the chunk rank r just added to holds s + 2 ranks' data, the one it sent is unchanged
            assert state.contributors[r][(r - 1 - s) % world] == frozenset((r - k) % world for k in range(s + 2))
    for r in range(world):  # after scatter-reduce rank r owns the finished chunk r+1
        assert states[world - 1].contributors[r][(r + 1) % world] == everyone
        assert torch.equal(states[world - 1].chunks[r][(r + 1) % world],
                           torch.tensor_split(total, world)[(r + 1) % world])
        assert torch.equal(torch.cat(states[-1].chunks[r]), total)
        assert all(c == everyone for c in states[-1].contributors[r])
    # Bytes each rank sends in the replay: the same count the real ring reports.
    for r in range(world):
        sent = sum(states[0].chunks[r][c].numel() * 8 for state in states[1:]
                   for src, _, c in state.messages if src == r)
        expected = _ring_chunk_bytes(numel, 8, world, r)[0] if world > 1 else 0
        assert sent == expected
    assert [phase for phase, _ in ring_schedule(world)] == \
        ["scatter-reduce"] * (world - 1) + ["all-gather"] * (world - 1)


def test_simulated_ring_max_and_bad_input():
    tensors = [torch.tensor([1.0, 5.0, -2.0]), torch.tensor([4.0, 0.0, 3.0]), torch.tensor([2.0, 2.0, 2.0])]
    assert torch.equal(torch.cat(simulate_ring_allreduce(tensors, op="max")[-1].chunks[1]),
                       torch.tensor([4.0, 5.0, 3.0]))
    with pytest.raises(ValueError, match="same shape"):
        simulate_ring_allreduce([torch.ones(2), torch.ones(3)])
