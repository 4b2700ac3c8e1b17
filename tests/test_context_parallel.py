"""Ring attention equals F.scaled_dot_product_attention on the gathered sequence, forward and
backward, on 2 and 4 ranks (gloo), causal or not, contiguous or zig-zag; the layouts' helpers
and the ring's replay (idle time of each layout under a causal mask)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import error_text
from mgpu_lab import launch, ring_attention
from mgpu_lab.parallel.pipeline import bubble_fraction
from mgpu_lab.parallel.sequence_layout import (layout_chunks, local_positions, shard_sequence, simulate_ring,
                                               unshard_sequence)

B, H, D = 2, 3, 8
CASES = [(causal, layout) for causal in (False, True) for layout in ("contiguous", "zigzag")]


def _inputs(n, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, 8 * n, D, generator=g).to(dtype) for _ in range(4)]  # q, k, v, grad of the output


def _ring_cases(dtype=torch.float32):
    """On this rank: every (causal, layout) case's output and q/k/v gradients, plus its timeline."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for causal, layout in CASES:
        q, k, v, grad = (shard_sequence(t, n, r, layout) for t in _inputs(n, dtype))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        timeline = []
        y = ring_attention(q, k, v, causal=causal, layout=layout, timeline=timeline)
        y.backward(grad)
        out[causal, layout] = (y.detach(), q.grad, k.grad, v.grad, timeline)
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_ring_attention_equals_sdpa_forward_and_backward(n):
    results = launch(_ring_cases, nprocs=n, timeout=120)
    for causal, layout in CASES:
        q, k, v, grad = (t.requires_grad_() for t in _inputs(n))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        want.backward(grad)
        got = [unshard_sequence([res[causal, layout][i] for res in results], layout) for i in range(4)]
        for name, a, b in zip(("output", "dq", "dk", "dv"), got, (want, q.grad, k.grad, v.grad)):
            assert torch.allclose(a, b, atol=2e-6, rtol=1e-5), \
                f"{n} ranks, causal={causal}, {layout}: {name} differs by {(a - b).abs().max():.2e}"


def test_ring_attention_in_float64_takes_the_matrix_product_path():
    """No fused CPU kernel for float64: the blocks are matrix products (the path GPUs take)."""
    results = launch(lambda: _ring_cases(torch.float64), nprocs=2, timeout=120)
    for causal, layout in CASES:
        q, k, v, grad = (t.requires_grad_() for t in _inputs(2, torch.float64))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        want.backward(grad)
        got = [unshard_sequence([res[causal, layout][i] for res in results], layout) for i in range(4)]
        for a, b in zip(got, (want, q.grad, k.grad, v.grad)):
            assert a.dtype == torch.float64 and torch.allclose(a, b, atol=1e-12), (causal, layout)


def test_ring_attention_in_bfloat16_keeps_the_dtype_and_accumulates_in_float32():
    results = launch(lambda: _ring_cases(torch.bfloat16), nprocs=2, timeout=120)
    for causal, layout in CASES:
        q, k, v, _ = _inputs(2, torch.bfloat16)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        got = unshard_sequence([res[causal, layout][0] for res in results], layout)
        assert got.dtype == torch.bfloat16
        assert (got.float() - want).abs().max() < 2e-2


def test_the_timeline_shows_the_next_block_posted_before_the_current_one_is_computed():
    results = launch(_ring_cases, nprocs=4, timeout=120)
    for res in results:
        timeline = res[True, "zigzag"][4]
        for phase in ("forward", "backward"):
            compute = {step: (a, b) for ph, kind, step, a, b in timeline if ph == phase and kind == "compute"}
            comm = [(step, a, b) for ph, kind, step, a, b in timeline if ph == phase and kind == "comm"]
            assert sorted(compute) == [0, 1, 2, 3], timeline
            assert comm and all(a <= compute[step][0] for step, a, _ in comm if step in compute), \
                f"{phase}: a block's transfer starts before the compute it overlaps"


def _bad_calls():
    q = torch.randn(1, 2, 6, 4)
    errors = {}
    for name, call in {"layout": lambda: ring_attention(q[:, :, :5], q[:, :, :5], q[:, :, :5], layout="zigzag"),
                       "shape": lambda: ring_attention(q, q[:, :1], q)}.items():
        errors[name] = error_text(call, ValueError)
    return errors


def test_bad_inputs_are_clear_errors():
    errors = launch(_bad_calls, nprocs=2)[0]
    assert "must be even" in errors["layout"] and "[batch, heads, seq_local, head_dim]" in errors["shape"]
    with pytest.raises(RuntimeError, match="process group"):
        ring_attention(*[torch.randn(1, 1, 4, 2)] * 3)
    with pytest.raises(ValueError, match="cannot be cut into 8 equal chunks.*pad it to a multiple of 8"):
        shard_sequence(torch.randn(1, 1, 12, 2), 4, 0, "zigzag")
    with pytest.raises(ValueError, match="cannot be cut into 4 equal chunks"):
        shard_sequence(torch.randn(1, 1, 10, 2), 4, 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        layout_chunks(2, "striped")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_sharding_round_trips_and_positions_match(layout):
    x = torch.arange(2 * 24).view(1, 2, 24, 1)
    parts = [shard_sequence(x, 3, r, layout) for r in range(3)]
    assert torch.equal(unshard_sequence(parts, layout), x)
    for r, part in enumerate(parts):
        assert torch.equal(part[0, 0, :, 0], local_positions(r, 3, 8, layout))
    assert layout_chunks(3, layout) == ([[0], [1], [2]] if layout == "contiguous" else [[0, 5], [1, 4], [2, 3]])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_replayed_idle_time_contiguous_vs_zigzag(n):
    """Causal: the contiguous layout idles (N-1)/(2N-1) of the time (as chunks grow), zig-zag none."""
    c = 256
    contiguous = bubble_fraction([[(a, b) for _, a, b in r] for r in simulate_ring(layout_chunks(n), c)])
    zigzag = bubble_fraction([[(a, b) for _, a, b in r] for r in simulate_ring(layout_chunks(n, "zigzag"), c // 2)])
    assert abs(contiguous - (n - 1) / (2 * n - 1)) < 2e-3, contiguous
    assert zigzag == 0.0
    full = simulate_ring(layout_chunks(n), c, causal=False)
    assert bubble_fraction([[(a, b) for _, a, b in r] for r in full]) == 0.0


def test_a_rank_waits_for_the_block_its_left_neighbour_passes_on():
    """Rank 1's step 2 needs rank 3's block, which rank 0 forwards when it starts its step 1 (at 21),
    though rank 1 itself was free from 7."""
    spans = simulate_ring([[1, 5, 7], [3], [4], [0, 2, 6]], chunk_size=2)
    assert spans[1][1] == (1, 3.0, 7.0) and spans[0][1][1] == 21.0 and spans[1][2] == (2, 21.0, 29.0)


def test_a_blocks_rows_columns_and_mask_are_the_causal_pairs():
    """_block's O(s) answer against the s x s matrix of allowed pairs, for random increasing positions."""
    from mgpu_lab.parallel.context_parallel import _block
    g = torch.Generator().manual_seed(0)
    kinds = set()
    cases = [(torch.arange(6), torch.arange(6, 12))]       # every key after every query: skipped
    for _ in range(200):
        q_pos = torch.randperm(24, generator=g)[:6].sort().values
        cases.append((q_pos, torch.randperm(24, generator=g)[:6].sort().values if torch.rand(1, generator=g) < 0.8
                      else q_pos))
    for q_pos, k_pos in cases:
        allowed = k_pos[None, :] <= q_pos[:, None]
        block = _block(q_pos, k_pos, causal=True)
        if block is None:
            assert not allowed.any()
            kinds.add("skipped")
            continue
        rows, cols, mask = block
        rows = torch.arange(6) if rows is None else rows
        cols = torch.arange(6) if cols is None else cols
        assert torch.equal(rows, allowed.any(1).nonzero().squeeze(1))
        assert torch.equal(cols, allowed.any(0).nonzero().squeeze(1))
        sub = allowed[rows][:, cols]
        want = torch.ones_like(sub) if mask is None else torch.ones_like(sub).tril() if isinstance(mask, str) else mask
        assert torch.equal(sub, want) and (mask != "causal" or torch.equal(q_pos[rows], k_pos[cols]))
        kinds.add("mask" if torch.is_tensor(mask) else str(mask))
    assert kinds == {"skipped", "None", "causal", "mask"}, kinds
