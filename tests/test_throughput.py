"""Throughput and MFU (the FLOP formula against a FLOP count of a real decoder, a measured peak),
and the per-rank timeline of compute and communication recorded from spans."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
import pytest

from conftest import TinyGPT
from mgpu_lab import launch
from mgpu_lab.measure.throughput import (ThroughputMeter, count_flops, decoder_flops_per_token, matmul_parameters,
                                         measure_peak_flops, mfu)
from mgpu_lab.measure.timeline import Timeline, plot_timeline, summary


@pytest.mark.parametrize("dim,layers,seq", [(32, 2, 16), (64, 3, 32)])
def test_the_flop_formula_equals_a_count_of_the_real_model(dim, layers, seq):
    model = TinyGPT(vocab=50, dim=dim, heads=4, layers=layers, seq=seq)
    x = torch.randint(0, 50, (3, seq))
    counted = count_flops(lambda: F.cross_entropy(model(x).reshape(-1, 50), x.reshape(-1)).backward())
    n = matmul_parameters(model)
    assert n == sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert counted / x.numel() == decoder_flops_per_token(n, layers, dim, seq)  # 6N + 12·L·h·s, exactly
    with pytest.raises(ValueError, match="seq_len"):
        decoder_flops_per_token(n, layers, dim, -1)


def test_a_tied_head_counts_once():
    model = TinyGPT(dim=16)
    before = matmul_parameters(model)
    model.head.weight = model.embed.weight
    assert matmul_parameters(model) == before  # the head's matmul; the lookup multiplies nothing


def test_the_peak_is_measured_and_mfu_follows():
    peak = measure_peak_flops(dtype=torch.float32, size=128, seconds=0.05)
    assert peak > 1e6
    assert mfu(1000.0, 2e6, peak, devices=2) == pytest.approx(1000.0 * 2e6 / (2 * peak))
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)
    meter = ThroughputMeter(warmup=1)
    for tokens in (5, 10, 10):
        meter.start()
        meter.stop(tokens)
    assert meter.steps == 3 and meter.tokens == 20 and meter.tokens_per_second > 0
    with pytest.raises(RuntimeError, match="without start"):
        meter.stop(1)


def _recorded_step():
    """One step of a fully_shard-ed decoder whose blocks recompute their activations."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = TinyGPT(seed=0)
    for name, block in list(model.blocks.items()):
        model.blocks[name] = checkpoint_wrapper(block)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 32, (2, 8))
    blocks = {f"block {n}": b._checkpoint_wrapped_module for n, b in model.blocks.items()}
    with Timeline(blocks) as tl:
        F.cross_entropy(model(x).reshape(-1, 32), x.reshape(-1)).backward()
        opt.step()
        model(x)  # a forward after backward is a forward again
    return tl.spans


def test_the_timeline_records_compute_recompute_and_communication_per_rank():
    timelines = launch(_recorded_step, nprocs=2, timeout=120)
    for spans in timelines:
        names = [name for _, name, _, _ in spans]
        for expected in ("F block 0", "F block 1", "B block 1", "B block 0", "R block 0", "R block 1",
                         "optimizer", "all_gather_single", "reduce_scatter_single"):
            assert expected in names, (expected, names)
        assert names.count("F block 0") == 2  # the forward after the step is not a recompute
        assert names.index("B block 1") < names.index("B block 0")  # backward runs the blocks in reverse
        assert all(end >= start for _, _, start, end in spans)
        total = summary(spans)
        assert total["compute"] > 0 and total["comm"] > 0 and total["compute"] + total["comm"] <= total["wall"] + 1e-6
    import matplotlib
    matplotlib.use("Agg")
    ax = plot_timeline(timelines)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]


def test_summary_counts_nested_spans_once():
    spans = [("compute", "F a", 0.0, 1.0), ("comm", "all_reduce", 0.2, 0.4), ("comm", "wait", 0.3, 0.5),
             ("compute", "optimizer", 1.5, 2.0)]
    assert summary(spans) == pytest.approx({"compute": 1.2, "comm": 0.3, "wall": 2.0})
