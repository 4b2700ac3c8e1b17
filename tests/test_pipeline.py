"""Own pipeline schedules (GPipe, 1F1B) equal one process and torch.distributed.pipelining,
on 2 and 3 stages (gloo); the timelines are the schedules' orders; 1F1B's activation
memory (micro-batches held, measured by hooks) stays within num_stages - stage_index.
"""
import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from mgpu_lab import PipelineStage, Schedule1F1B, ScheduleGPipe, launch
from mgpu_lab.parallel.pipeline import (
    PipelineSchedule,
    bubble_fraction,
    check_order,
    gpipe_order,
    held_microbatches,
    one_f_one_b_order,
    simulate_timeline,
)

BATCH, M, WIDTH, LAYERS = 12, 6, 8, 6
TOL = 1e-6


def _model():
    torch.manual_seed(0)
    layers = []
    for i in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH if i < LAYERS - 1 else 4), nn.Tanh()]
    return nn.Sequential(*layers)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 4, generator=g)


class Held(nn.Module):
    """Measures from outside how many micro-batches a stage holds: +1 when the module's
    forward returns, -1 when the gradient of that output is computed (its backward starts)."""

    def __init__(self, module):
        super().__init__()
        self.module, self.live, self.peak = module, 0, 0

    def forward(self, x):
        y = self.module(x)
        self.live += 1
        self.peak = max(self.peak, self.live)
        y.register_hook(self._released)
        return y

    def _released(self, grad):
        self.live -= 1


def _stage_module(model, stage, stages):
    per = len(model) // stages
    return copy.deepcopy(model[stage * per:(stage + 1) * per])


def _run(schedule_cls, stage_module, torch_pipelining=False):
    rank, p = dist.get_rank(), dist.get_world_size()
    x, y = _data()
    if torch_pipelining:
        from torch.distributed import pipelining
        stage = pipelining.PipelineStage(stage_module, rank, p, torch.device("cpu"))
    else:
        stage = PipelineStage(stage_module, rank, p)
    schedule = schedule_cls(stage, M, F.mse_loss)
    losses = []
    if rank == 0:
        out = schedule.step(x)
    elif rank == p - 1:
        out = schedule.step(target=y, losses=losses)
    else:
        out = schedule.step()
    timeline = list(schedule.timeline) if not torch_pipelining else None
    return out, losses, [q.grad.clone() for q in stage_module.parameters()], timeline


def _pipeline_cases():
    from torch.distributed import pipelining
    rank, p = dist.get_rank(), dist.get_world_size()
    model = _model()
    x, y = _data()
    # the reference: one process, the whole batch, the mean of the micro-batches' mean losses
    out_ref = model(x)
    losses_ref = [F.mse_loss(a, b) for a, b in zip(out_ref.chunk(M), y.chunk(M))]
    (sum(losses_ref) / M).backward()
    per = len(model) // p
    grads_ref = [q.grad.clone() for q in model[rank * per:(rank + 1) * per].parameters()]
    results = {}
    for name, ours, theirs in (("GPipe", ScheduleGPipe, pipelining.ScheduleGPipe),
                               ("1F1B", Schedule1F1B, pipelining.Schedule1F1B)):
        held = Held(_stage_module(model, rank, p))
        out, losses, grads, timeline = _run(ours, held)
        t_out, t_losses, t_grads, _ = _run(theirs, _stage_module(model, rank, p), torch_pipelining=True)
        diff = {"grads vs one process": max((a - b).abs().max().item() for a, b in zip(grads, grads_ref)),
                "grads vs torch": max((a - b).abs().max().item() for a, b in zip(grads, t_grads))}
        if rank == p - 1:
            diff["output vs one process"] = (out - out_ref.detach()).abs().max().item()
            diff["output vs torch"] = (out - t_out.detach()).abs().max().item()
            diff["losses vs one process"] = max(abs(a.item() - b.item()) for a, b in zip(losses, losses_ref))
            diff["losses vs torch"] = max(abs(a.item() - b.item()) for a, b in zip(losses, t_losses))
            assert len(losses) == len(t_losses) == M
        else:
            assert out is None
        results[name] = dict(diff=diff, timeline=timeline, measured_peak=held.peak, live_after=held.live)
    return results


@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_equals_one_process_and_torch(stages):
    for rank, results in enumerate(launch(_pipeline_cases, nprocs=stages, timeout=120)):
        for name, r in results.items():
            for what, d in r["diff"].items():
                assert d < TOL, f"{stages} stages, stage {rank}, {name}: {what} differs by {d:.3g}"
            assert r["live_after"] == 0
        assert results["GPipe"]["timeline"] == gpipe_order(rank, stages, M)
        assert results["GPipe"]["timeline"][:M] == [("F", k) for k in range(M)]
        assert results["GPipe"]["measured_peak"] == M
        assert results["1F1B"]["timeline"] == one_f_one_b_order(rank, stages, M)
        assert results["1F1B"]["measured_peak"] == stages - rank, f"stage {rank} held {results['1F1B']['measured_peak']}"


def test_orders():
    assert gpipe_order(1, 3, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    # stage 0 of 3: three forwards ahead; the last stage alternates from the start
    assert one_f_one_b_order(0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert one_f_one_b_order(2, 3, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert one_f_one_b_order(0, 4, 2) == gpipe_order(0, 4, 2)  # fewer micro-batches than stages
    for p in (2, 3, 4):
        for m in (1, 3, 8):
            for s in range(p):
                check_order(one_f_one_b_order(s, p, m), m)
                assert held_microbatches(one_f_one_b_order(s, p, m)) == min(m, p - s)
                assert held_microbatches(gpipe_order(s, p, m)) == m
    with pytest.raises(ValueError, match=r"\('B', 0\) comes before \('F', 0\)"):
        check_order([("B", 0), ("F", 0)], 1)
    with pytest.raises(ValueError, match="never runs"):
        check_order([("F", 0), ("F", 1), ("B", 0)], 2)


def test_simulated_timeline_has_the_formula_bubble_and_the_dependencies():
    for p in (1, 2, 3, 4):
        for m in (1, 2, 5, 8):
            for order_fn in (gpipe_order, one_f_one_b_order):
                orders = [order_fn(s, p, m) for s in range(p)]
                timeline = simulate_timeline(orders, forward_time=1.0, backward_time=2.0)
                assert [[(kind, k) for kind, k, _, _ in stage] for stage in timeline] == orders
                end = {(kind, k, s): b for s, stage in enumerate(timeline) for kind, k, _, b in stage}
                for s, stage in enumerate(timeline):
                    for (kind, k, a, b), prev in zip(stage, [None] + stage[:-1]):
                        assert b - a == (1.0 if kind == "F" else 2.0)
                        assert prev is None or a >= prev[3], "a stage runs one action at a time"
                        if kind == "F" and s > 0:
                            assert a >= end[("F", k, s - 1)]
                        if kind == "B":
                            assert a >= end[("B", k, s + 1)] if s < p - 1 else a >= end[("F", k, s)]
                # equal stages: the step lasts (m + p - 1)(tF + tB); the bubble is (p-1)/(m+p-1)
                assert max(b for stage in timeline for *_, b in stage) == (m + p - 1) * 3.0
                spans = [[(a, b) for *_, a, b in stage] for stage in timeline]
                assert abs(bubble_fraction(spans) - (p - 1) / (m + p - 1)) < 1e-12, (order_fn.__name__, p, m)
    assert bubble_fraction([[(0.0, 1.0), (3.0, 4.0)], [(1.0, 3.0)]]) == 0.5
    with pytest.raises(ValueError, match="wait on each other forever"):
        # stage 0 waits for B0 before it sends F1; stage 1 waits for F1 before it runs B0
        simulate_timeline([[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]])


def _custom_order_and_errors():
    rank = dist.get_rank()
    stage = PipelineStage(_stage_module(_model(), rank, 2), rank, 2)
    x, y = _data()
    # a learner's order: 1F1B written out by hand for 2 stages
    mine = lambda s, p, m: one_f_one_b_order(s, p, m)  # noqa: E731
    schedule = PipelineSchedule(stage, M, F.mse_loss, order=mine)
    schedule.step(x) if rank == 0 else schedule.step(target=y)
    timeline = list(schedule.timeline)
    # forwards only (no loss_fn): the last stage returns the model's output, nothing is held
    forward_only = ScheduleGPipe(stage, M)
    out = forward_only.step(x) if rank == 0 else forward_only.step()
    assert forward_only.timeline == [("F", k) for k in range(M)] and not stage._held
    if rank == 1:
        assert (out - _model()(x)).abs().max().item() < TOL
    errors = []
    for call in ((lambda: schedule.step()) if rank == 0 else (lambda: schedule.step(x, target=y)),
                 lambda: PipelineStage(nn.Linear(2, 2), 1 - rank, 2)):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return timeline, errors


def test_custom_order_and_clear_errors():
    (t0, e0), (t1, e1) = launch(_custom_order_and_errors, nprocs=2, timeout=60)
    assert t0 == one_f_one_b_order(0, 2, M) and t1 == one_f_one_b_order(1, 2, M)
    assert "the first stage's step takes the batch" in e0[0]
    assert "call step() without the batch" in e1[0]
    assert "stage i runs on rank i" in e0[1] and "stage i runs on rank i" in e1[1]


def _hand_written_gpipe_step():
    """The GPipe step as a learner writes it with the stage's two actions; equals ScheduleGPipe."""
    rank = dist.get_rank()
    x, y = _data()
    grads = []
    for hand_written in (True, False):
        module = _stage_module(_model(), rank, 2)
        stage = PipelineStage(module, rank, 2)
        if hand_written:
            stage.reset()
            xs, ys, losses = x.tensor_split(M), y.tensor_split(M), []
            for k in range(M):
                out = stage.forward_one_chunk(k, xs[k] if stage.is_first else None)
                if stage.is_last:
                    losses.append(F.mse_loss(out, ys[k]))
            for k in range(M):
                stage.backward_one_chunk(k, losses[k] / M if stage.is_last else None)
            stage.finish()
        else:
            schedule = ScheduleGPipe(stage, M, F.mse_loss)
            schedule.step(x) if rank == 0 else schedule.step(target=y)
        grads.append([q.grad for q in module.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads)), stage.timeline


def test_a_hand_written_gpipe_step_equals_schedule_gpipe():
    for rank, (diff, timeline) in enumerate(launch(_hand_written_gpipe_step, nprocs=2, timeout=60)):
        assert diff < TOL
        assert timeline == gpipe_order(rank, 2, M)


def _one_stage_missing():
    rank = dist.get_rank()
    stage = PipelineStage(_stage_module(_model(), rank, 2), rank, 2, timeout=1.0)
    if rank == 0:
        time.sleep(3)  # never calls step; stays alive so that stage 1 waits, not loses the connection
        return None
    try:
        ScheduleGPipe(stage, M, F.mse_loss).step(target=_data()[1])
    except TimeoutError as e:
        return str(e)
    return "no error"


def test_a_stage_that_never_sends_is_named_after_the_timeout():
    message = launch(_one_stage_missing, nprocs=2, timeout=60)[1]
    assert "pipeline stage 1 waited for stage 0 (rank 0) to send the activations' shape of micro-batch 0" in message
    assert "for 1 s" in message


def _pipeline_of_tensor_parallel_stages():
    """4 ranks as a 2 x 2 grid: pipeline stage = rank // 2, tensor-parallel rank = rank % 2.
    Each stage is a ParallelMLP over its pair; each pipeline runs over one column of the grid."""
    from mgpu_lab import ParallelMLP
    rank = dist.get_rank()
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    stage_index, tp_rank = rank // 2, rank % 2
    torch.manual_seed(0)
    mlps = [nn.Sequential(nn.Linear(WIDTH, 16), nn.GELU(), nn.Linear(16, WIDTH)) for _ in range(2)]
    x, _ = _data()
    y = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(2))
    out_ref = mlps[1](mlps[0](x))
    losses_ref = [F.mse_loss(a, b) for a, b in zip(out_ref.chunk(M), y.chunk(M))]
    (sum(losses_ref) / M).backward()
    mine = ParallelMLP.from_mlp(mlps[stage_index], group=tp_groups[stage_index])
    stage = PipelineStage(mine, stage_index, 2, group=pp_groups[tp_rank])
    schedule = Schedule1F1B(stage, M, F.mse_loss)
    out = schedule.step(x) if stage_index == 0 else schedule.step(target=y)
    ref = mlps[stage_index]
    diffs = [(mine.fc1.weight.grad - ref[0].weight.grad.chunk(2, 0)[tp_rank]).abs().max().item(),
             (mine.fc2.weight.grad - ref[2].weight.grad.chunk(2, 1)[tp_rank]).abs().max().item(),
             (mine.fc2.bias.grad - ref[2].bias.grad).abs().max().item()]
    if stage_index == 1:
        diffs.append((out - out_ref).abs().max().item())
    return diffs


def test_pipeline_of_tensor_parallel_stages_on_a_2x2_grid():
    for rank, diffs in enumerate(launch(_pipeline_of_tensor_parallel_stages, nprocs=4, timeout=120)):
        assert len(diffs) == (3 if rank < 2 else 4)
        assert max(diffs) < TOL, f"rank {rank}: {diffs}"


def _orders_that_disagree():
    rank = dist.get_rank()
    stage = PipelineStage(_stage_module(_model(), rank, 2), rank, 2, timeout=10.0)
    x, y = _data()
    if rank == 0:
        schedule = PipelineSchedule(stage, 2, F.mse_loss, order=lambda s, p, m: gpipe_order(s, p, m))
        try:
            schedule.step(x)
        except RuntimeError:  # stage 1 gave up: the connection closes
            pass
        return None
    reverse = lambda s, p, m: [("F", 1), ("F", 0), ("B", 1), ("B", 0)]  # noqa: E731
    try:
        PipelineSchedule(stage, 2, F.mse_loss, order=reverse).step(target=y)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_neighbours_whose_orders_disagree_are_told():
    message = launch(_orders_that_disagree, nprocs=2, timeout=60)[1]
    assert "stage 1 runs the forward of micro-batch 1, but stage 0 (rank 0) sent micro-batch 0" in message
