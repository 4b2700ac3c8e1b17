"""The collective trace: a skipped collective, a shape mismatch and a stuck rank are
reported within the timeout, naming the ranks and the operation; no process is left."""
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, assert_no_children, run_session
from mgpu_lab import LaunchError, launch
from mgpu_lab.measure.collective_trace import collective_trace
from mgpu_lab.measure.trace_compare import first_divergence, format_report

TIMEOUT = 3.0


def rec(op, shape=None, dtype="float32", root=None):
    return {"op": op, "shape": shape, "dtype": dtype, "root": root}


def test_first_divergence_finds_the_first_disagreement():
    same = [rec("all_reduce", [4]), rec("broadcast", [4], root=0)]
    assert first_divergence({0: same, 1: same}) is None
    div = first_divergence({0: same + [rec("all_reduce", [1])], 1: same + [rec("barrier", dtype=None)]})
    assert div.index == 2 and div.calls[0]["op"] == "all_reduce" and div.calls[1]["op"] == "barrier"
    assert div.diverging_ranks == [0, 1]  # two ranks: the trace cannot say which one is "wrong"
    three = {0: same + [rec("all_reduce", [8])], 1: same + [rec("all_reduce", [8])], 2: same + [rec("all_reduce", [7])]}
    assert first_divergence(three).diverging_ranks == [2]  # the odd one out
    short = first_divergence({0: same, 1: same[:1], 2: same})
    assert short.index == 1 and short.calls[1] is None and short.diverging_ranks == [1]
    text, div = format_report({0: same, 1: same})
    assert div is None and "rank 1: 2 call(s) recorded, the last: broadcast(shape=[4], float32, root=0)" in text
    text, div = format_report({0: same + [{"op": "<end>"}], 1: same + [rec("barrier", dtype=None)]})
    assert "rank 0: (none: it left the traced region)" in text and "rank 1: barrier()" in text
    # point-to-point calls differ by design and are not compared
    assert first_divergence({0: [rec("send", [2], root=1)] + same, 1: [rec("recv", [2], root=0)] + same}) is None


def _program(kind):
    rank = dist.get_rank()
    with collective_trace(timeout=TIMEOUT) as trace:
        x = torch.ones(4)
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
        if kind == "skip" and rank == 0:
            dist.all_reduce(x)  # only rank 0 gets here
        if kind == "shape":
            dist.all_reduce(torch.ones(4 + rank))
        if kind == "stuck" and rank == 1:
            time.sleep(60)  # stuck outside any collective (a dead lock, an endless loop, I/O)
        dist.barrier()
    assert dist.all_reduce is not trace._saved.get(dist, {}).get("all_reduce")
    return [r["op"] for r in trace.records]


def _run(kind):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_program, nprocs=2, args=(kind,), timeout=60)
    elapsed = time.monotonic() - start
    assert_no_children()
    return info.value, elapsed


def test_a_clean_program_records_its_sequence_and_unpatches():
    ops = launch(_program, nprocs=2, args=("clean",), timeout=60)
    assert ops == [["all_reduce", "broadcast", "barrier"]] * 2
    assert_no_children()


def _single_names():
    """torch's names of the one-tensor all-gather and reduce-scatter (renamed in torch 2.13)."""
    if hasattr(dist, "all_gather_single"):
        return "all_gather_single", "reduce_scatter_single"
    return "all_gather_into_tensor", "reduce_scatter_tensor"


def _fsdp_step():
    """The library's own collectives are seen: FSDP's all-gathers and reduce-scatters, DDP's all-reduce."""
    from mgpu_lab import FSDP, BucketedDDP
    torch.manual_seed(0)
    fsdp = FSDP(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    ddp = BucketedDDP(torch.nn.Linear(2, 2))
    with collective_trace(timeout=TIMEOUT) as trace:
        fsdp(torch.ones(1, 2)).sum().backward()
        ddp(torch.ones(1, 2)).sum().backward()
    return [(r["op"], r["where"].split(" ")[0]) for r in trace.records]


def test_the_trace_sees_the_collectives_of_fsdp_and_ddp():
    ops = launch(_fsdp_step, nprocs=2, timeout=60)[0]
    # two units gathered for forward; in backward each gathered again, then its gradient reduce-scattered;
    # then DDP's one bucket
    ag, rs = _single_names()
    assert [op for op, _ in ops] == [ag, ag, ag, rs, ag, rs, "all_reduce"], ops
    assert all(where.startswith(("mgpu_lab/parallel/flat_param.py", "mgpu_lab/parallel/ddp.py"))
               for _, where in ops), ops


def _sequence_parallel_step():
    """Sequence parallelism's all-gathers and reduce-scatters (Megatron's f and g along the sequence)."""
    from mgpu_lab.parallel.tensor_parallel_blocks import ParallelTransformerBlock
    torch.manual_seed(0)
    block = ParallelTransformerBlock(8, 2, 16, sequence_parallel=True)
    x = torch.randn(1, 2, 8, requires_grad=True)  # this rank's 2 positions of 4
    with collective_trace(timeout=30) as trace:
        block(x).sum().backward()
    return [(r["op"], r["where"].split(" ")[0]) for r in trace.records]


def test_the_trace_sees_the_collectives_of_sequence_parallelism():
    ops = launch(_sequence_parallel_step, nprocs=2, timeout=60)[0]
    ag, rs = _single_names()
    names = [op for op, _ in ops]
    # forward: gather before attention's QKV, reduce-scatter after its output projection, the same for
    # the MLP; backward: the conjugate of each (and the all-reduces of the parameters used on a shard)
    assert names[:4] == [ag, rs, ag, rs], ops
    assert names.count(ag) == names.count(rs) == 4, ops
    assert all(where.startswith("mgpu_lab/parallel/tensor_parallel.py") for _, where in ops), ops


def test_a_collective_only_rank_0_calls_is_named_within_the_timeout():
    err, elapsed = _run("skip")
    assert elapsed < TIMEOUT + 10
    text = "\n".join(err.failures.values())
    assert "ranks disagree at collective #2" in text
    assert "rank 0: all_reduce(shape=[4], float32)" in text
    assert "rank 1: barrier()" in text
    assert "test_collective_trace.py" in text  # the call site


def test_mismatched_shapes_are_named():
    err, elapsed = _run("shape")
    assert elapsed < TIMEOUT + 10
    text = "\n".join(err.failures.values())
    assert "rank 0: all_reduce(shape=[4], float32)" in text and "rank 1: all_reduce(shape=[5], float32)" in text


def test_a_rank_stuck_outside_collectives_times_out_the_others_with_its_state():
    err, elapsed = _run("stuck")
    assert elapsed < TIMEOUT + 10
    assert err.rank == 0
    text = err.failures[0]
    assert "CollectiveError" in text and "barrier() (collective #2" in text and f"did not complete within {TIMEOUT:g} s" in text
    assert "ranks disagree at collective #2" in text and "rank 0: barrier()" in text
    assert "rank 1: (no call yet: still running, or stuck before it)" in text


def test_a_timeout_must_be_positive():  # outside a process group: test_distributed.py
    with pytest.raises(ValueError, match="positive"):
        collective_trace(timeout=0)


def test_the_trace_works_under_torchrun():
    script = str(ROOT / "tests" / "scripts" / "skip_collective.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = run_session([sys.executable, "-m", "mgpu_lab", "launch", "--nproc-per-node", "2", script], env)
    assert proc.returncode == 1
    assert time.monotonic() - start < 5 + 30  # the trace's timeout, plus torchrun's start and stop
    assert "ranks disagree at collective #1" in proc.stderr
    assert "rank 0: all_reduce(shape=[3], float32)" in proc.stderr and "rank 1: barrier()" in proc.stderr
    assert_no_children()
