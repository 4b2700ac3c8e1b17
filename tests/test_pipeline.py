"""Own pipeline schedules (GPipe, 1F1B, interleaved 1F1B) equal one process and
torch.distributed.pipelining, on 2 and 3 stages and on 2 ranks x 2 stages (gloo); the
timelines are the schedules' orders (interleaved: torch's, action for action); 1F1B's
activation memory (micro-batches held, measured by hooks) stays within num_stages -
stage_index, interleaving's is measured against it; its bubble is (p-1)/(v·m+p-1).
"""
import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from mgpu_lab import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, launch
from mgpu_lab.parallel.pipeline import (
    PipelineSchedule,
    bubble_fraction,
    check_order,
    gpipe_order,
    held_microbatches,
    interleaved_1f1b_order,
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
    forward returns, -1 when the gradient of that output is computed (its backward starts).
    ``count=``: another Held that counts for it (a rank's stages counted together)."""

    def __init__(self, module, count=None):
        super().__init__()
        self.module, self.live, self.peak = module, 0, 0
        self.count = count if count is not None else self

    def forward(self, x):
        y = self.module(x)
        self.count.live += 1
        self.count.peak = max(self.count.peak, self.count.live)
        y.register_hook(self._released)
        return y

    def _released(self, grad):
        self.count.live -= 1


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


def test_interleaved_order_is_torchs_action_for_action():
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B as Theirs, _ComputationType
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in (2, 4, 6, 8):
                theirs = object.__new__(Theirs)   # torch computes the orders from these four numbers
                theirs.pp_group_size, theirs.n_local_stages, theirs._n_microbatches = p, v, m
                theirs.number_of_rounds = max(1, m // p)
                theirs.microbatches_per_round = m // theirs.number_of_rounds
                if m % theirs.number_of_rounds:
                    with pytest.raises(ValueError, match="multiple of its number of rounds"):
                        interleaved_1f1b_order(0, p, v, m)
                    continue
                for r in range(p):
                    want = [("F" if a.computation_type == _ComputationType.FORWARD else "B", a.microbatch_index,
                             a.stage_index) for a in theirs._calculate_single_rank_operations(r) if a is not None]
                    mine = interleaved_1f1b_order(r, p, v, m)
                    assert mine == want, (p, v, m, r)
                    check_order(mine, m)


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
    # interleaved: v stages per rank, each 1/v of the work: (p-1)/(v·m+p-1) when p divides m
    for p, v, m in ((2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 3, 12)):
        timeline = simulate_timeline([interleaved_1f1b_order(r, p, v, m) for r in range(p)], 1.0 / v, 2.0 / v)
        spans = [[(a, b) for *_, a, b in rank] for rank in timeline]
        assert abs(bubble_fraction(spans) - (p - 1) / (v * m + p - 1)) < 1e-9, (p, v, m)
    # a slow stage sets the pace: stage 1 of 2 twice as slow works without a pause from stage 0's
    # first forward (1) on, m * (2 + 4); stage 0's last backward (2) follows
    timeline = simulate_timeline([one_f_one_b_order(s, 2, 4) for s in range(2)], [1.0, 2.0], [2.0, 4.0])
    assert (timeline[1][0][2], max(b for *_, b in timeline[1]), timeline[0][-1][3]) == (1.0, 1 + 4 * 6, 1 + 4 * 6 + 2)
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
    # torch's eval(): forwards only, losses with target=; return_outputs=False returns nothing
    losses = []
    evaluated = schedule.eval(x) if rank == 0 else schedule.eval(target=y, losses=losses)
    assert schedule.timeline == [("F", k) for k in range(M)] and not stage._held
    if rank == 1:
        assert not evaluated.requires_grad and (evaluated - _model()(x)).abs().max().item() < TOL
        assert len(losses) == M and abs(sum(losses) / M - F.mse_loss(_model()(x), y)).item() < TOL
    no_output = schedule.step(x) if rank == 0 else schedule.step(target=y, return_outputs=False)
    assert no_output is None
    errors = []
    for call in ((lambda: schedule.step()) if rank == 0 else (lambda: schedule.step(x)),
                 lambda: PipelineStage(nn.Linear(2, 2), 1 - rank, 2),
                 lambda: PipelineStage(nn.Linear(2, 2), rank, 2, dist.group.WORLD)):
        try:
            call()
            errors.append("no error")
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    return timeline, errors


def test_custom_order_eval_and_clear_errors():
    (t0, e0), (t1, e1) = launch(_custom_order_and_errors, nprocs=2, timeout=60)
    assert t0 == one_f_one_b_order(0, 2, M) and t1 == one_f_one_b_order(1, 2, M)
    assert "the first stage's step takes the batch" in e0[0]
    assert "the last stage's step needs target=" in e1[0]   # the batch given to the last stage is ignored
    assert "stage s runs on rank s % N" in e0[1] and "stage s runs on rank s % N" in e1[1]
    assert "the fourth argument is the device (torch's order); pass the process group as group=" in e0[2]


def _middle_stage_given_the_batch():
    """Every rank passes the batch and the target, as in a script that does not branch on
    the rank: the stages that do not need them ignore them (torch does)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    x, y = _data()
    module = _stage_module(_model(), rank, p)
    out = Schedule1F1B(PipelineStage(module, rank, p), M, F.mse_loss).step(x, target=y)
    model = _model()
    (sum(F.mse_loss(a, b) for a, b in zip(model(x).tensor_split(M), y.tensor_split(M))) / M).backward()
    per = len(model) // p
    ref = model[rank * per:(rank + 1) * per].parameters()
    return out is None, max((a.grad - b.grad).abs().max().item() for a, b in zip(module.parameters(), ref))


def test_a_middle_stage_given_the_batch_ignores_it():
    results = launch(_middle_stage_given_the_batch, nprocs=3, timeout=60)
    assert [none for none, _ in results] == [True, True, False]
    assert max(d for _, d in results) < TOL


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
    assert "pipeline stage 1 waited for stage 0 (rank 0) to send the activations of micro-batch 0, for 1 s" in message
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


def _orders_that_differ():
    rank = dist.get_rank()
    x, y = _data()
    reverse = lambda s, p, m: [("F", 1), ("F", 0), ("B", 1), ("B", 0)]  # noqa: E731
    deadlock = lambda s, p, m: [("F", 1), ("F", 0), ("B", 0), ("B", 1)] if s else [("F", 0), ("B", 0), ("F", 1), ("B", 1)]  # noqa: E731,E501
    out = []
    for order in (reverse, deadlock):
        module = _stage_module(_model(), rank, 2)
        # In the deadlock, stage 1 gives up first (2 s); stage 0 waits longer, so that stage 1
        # reports its own timeout and not stage 0's exit.
        stage = PipelineStage(module, rank, 2, timeout=2.0 if rank == 1 or order is reverse else 8.0)
        mine = order if rank == 1 or order is deadlock else (lambda s, p, m: gpipe_order(s, p, m))
        try:
            PipelineSchedule(stage, 2, F.mse_loss, order=mine).step(x, target=y)
            out.append([q.grad for q in module.parameters()])
        except (TimeoutError, RuntimeError) as e:
            out.append(str(e))
    return out


def test_stages_whose_orders_differ_keep_early_messages_and_a_deadlock_is_named():
    """Messages that arrive before their action are kept (stage 1 runs the micro-batches in
    reverse: the same gradients); orders that wait on each other end in a TimeoutError that
    names the message waited for and the one that came instead."""
    (reverse0, deadlock0), (reverse1, deadlock1) = launch(_orders_that_differ, nprocs=2, timeout=60)
    model = _model()
    x, y = _data()
    (sum(F.mse_loss(a, b) for a, b in zip(model(x).tensor_split(2), y.tensor_split(2))) / 2).backward()
    for rank, grads in enumerate((reverse0, reverse1)):
        ref = model[rank * LAYERS:(rank + 1) * LAYERS].parameters()
        assert max((a - b.grad).abs().max().item() for a, b in zip(grads, ref)) < TOL
    assert "pipeline stage 1 waited for stage 0 (rank 0) to send the activations of micro-batch 1, for 2 s" \
        in deadlock1
    assert "arrived, still unused: the activations of micro-batch 0 for stage 1" in deadlock1
    assert isinstance(deadlock0, str)


def _interleaved(v=2, m=4):
    """2 ranks x v stages: ours and torch's ScheduleInterleaved1F1B against one process."""
    from torch.distributed import pipelining
    rank, n = dist.get_rank(), dist.get_world_size()
    p = n * v
    model = _model()
    x, y = _data()
    out_ref = model(x)
    losses_ref = [F.mse_loss(a, b) for a, b in zip(out_ref.tensor_split(m), y.tensor_split(m))]
    (sum(losses_ref) / m).backward()
    per = len(model) // p
    result = {}
    for name in ("ours", "torch"):
        count = Held(nn.Identity())
        modules = {s: Held(_stage_module(model, s, p), count) for s in range(rank, p, n)}
        if name == "ours":
            stages = [PipelineStage(mod, s, p) for s, mod in modules.items()]
            schedule = ScheduleInterleaved1F1B(stages, m, F.mse_loss)
        else:
            stages = [pipelining.PipelineStage(mod, s, p, torch.device("cpu")) for s, mod in modules.items()]
            schedule = pipelining.ScheduleInterleaved1F1B(stages, m, F.mse_loss)
        losses = []
        out = schedule.step(*([x] if rank == 0 else []), **({"target": y, "losses": losses} if rank == n - 1 else {}))
        diff = max((a.grad - b.grad).abs().max().item() for s, mod in modules.items()
                   for a, b in zip(mod.parameters(), model[s * per:(s + 1) * per].parameters()))
        if rank == n - 1:
            diff = max(diff, (out - out_ref).abs().max().item(),
                       max(abs(a.item() - b.item()) for a, b in zip(losses, losses_ref)))
        result[name] = {"diff": diff, "timeline": list(getattr(schedule, "timeline", [])),
                        "held": count.peak, "live": count.live}
    # 1F1B on the same 2 ranks, one stage each (twice the layers per stage), to compare what is held
    held = Held(_stage_module(model, rank, n))
    Schedule1F1B(PipelineStage(held, rank, n), m, F.mse_loss).step(x, target=y)
    result["1F1B held"] = held.peak
    return result


def test_interleaved_1f1b_equals_one_process_and_torch_on_2_ranks_x_2_stages():
    for rank, r in enumerate(launch(_interleaved, nprocs=2, timeout=120)):
        for name in ("ours", "torch"):
            assert r[name]["diff"] < TOL, f"rank {rank}, {name}: differs from one process by {r[name]['diff']:.3g}"
        assert r["ours"]["timeline"] == interleaved_1f1b_order(rank, 2, 2, 4)
        assert r["ours"]["live"] == 0
        # micro-batches held at once, counted by hooks: the order's count; each is half a stage of 1F1B's
        assert r["ours"]["held"] == held_microbatches(interleaved_1f1b_order(rank, 2, 2, 4)) == [5, 3][rank]
        assert r["1F1B held"] == 2 - rank


def _one_rank_two_stages():
    model = _model()
    x, y = _data()
    (sum(F.mse_loss(a, b) for a, b in zip(model(x).tensor_split(M), y.tensor_split(M))) / M).backward()
    modules = [_stage_module(_model(), s, 2) for s in range(2)]
    ScheduleInterleaved1F1B([PipelineStage(mod, s, 2) for s, mod in enumerate(modules)], M, F.mse_loss).step(x, target=y)
    grads = [q.grad for mod in modules for q in mod.parameters()]
    return max((a - b.grad).abs().max().item() for a, b in zip(grads, model.parameters()))


def test_stages_beside_each_other_on_one_rank_pass_their_tensors_without_messages():
    assert launch(_one_rank_two_stages, nprocs=1, timeout=60)[0] < TOL


def _unequal_microbatches():
    """A batch of 10 in 4 micro-batches (3, 3, 2, 2), on 2 ranks: GPipe, 1F1B and interleaved
    (2 stages a rank) against the batch's mean loss in one process; torch's GPipe, one stage,
    on the same batch."""
    from torch.distributed import pipelining
    rank = dist.get_rank()
    model = _model()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(10, WIDTH, generator=g), torch.randn(10, 4, generator=g)
    F.mse_loss(model(x), y).backward()
    out = {}
    for name, cls, stages in (("GPipe", ScheduleGPipe, 2), ("1F1B", Schedule1F1B, 2),
                              ("interleaved", ScheduleInterleaved1F1B, 4)):
        mine = [rank + 2 * i for i in range(stages // 2)]
        modules = [_stage_module(model, s, stages) for s in mine]
        for mod in modules:
            mod.zero_grad()
        built = [PipelineStage(mod, s, stages) for s, mod in zip(mine, modules)]
        schedule = cls(built if cls is ScheduleInterleaved1F1B else built[0], 4, F.mse_loss)
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        per = len(model) // stages
        ref = [q.grad for s in mine for q in model[s * per:(s + 1) * per].parameters()]
        out[name] = max((q.grad - r).abs().max().item()
                        for q, r in zip((q for mod in modules for q in mod.parameters()), ref))
    if rank == 0:                       # torch's, on one stage of its own (a group of one)
        group = dist.new_group([0])
        whole = copy.deepcopy(model)
        whole.zero_grad()
        stage = pipelining.PipelineStage(whole, 0, 1, torch.device("cpu"), group=group)
        pipelining.ScheduleGPipe(stage, 4, loss_fn=F.mse_loss).step(x, target=y)
        out["torch"] = max((q.grad - r.grad).abs().max().item() for q, r in zip(whole.parameters(), model.parameters()))
    else:
        dist.new_group([0])
    return out


def test_unequal_micro_batches_are_weighted_by_their_share_of_the_batch():
    for rank, r in enumerate(launch(_unequal_microbatches, nprocs=2, timeout=120)):
        for name in ("GPipe", "1F1B", "interleaved"):
            assert r[name] < TOL, f"rank {rank}, {name}: differs from the batch's gradient by {r[name]:.3g}"
        if rank == 0:   # torch divides by m whatever the sizes: the mean of the micro-batch means
            assert r["torch"] > 1e-2, r["torch"]
