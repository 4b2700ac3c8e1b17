"""The mixture of experts against its definition token by token (routing, capacity, the
load-balancing loss), and ExpertParallelMoE against the plain layer on all ranks' tokens on 2
and 4 ranks: outputs, the input's gradient, each expert's gradient, the router's summed over
the ranks, the auxiliary loss, the dropped assignments; the collectives it issues."""
import math

import pytest
import torch
import torch.distributed as dist

from mgpu_lab import ExpertParallelMoE, MoE, launch
from mgpu_lab.measure.dispatch_watch import CollectiveLog

HIDDEN, FFN, E, K, T = 6, 10, 8, 2, 12


def _moe(capacity_factor=None, seed=0, top_k=K):
    torch.manual_seed(seed)
    return MoE(HIDDEN, FFN, E, top_k, capacity_factor)


def _by_definition(moe, x):
    """The layer token by token: the GShard queue (first choices, then second choices, each in
    token order), each expert serving its first C assignments; the aux loss from loops."""
    logits = moe.router(x)
    n, k = len(x), moe.top_k
    top = [logits[t].topk(k) for t in range(n)]
    C = math.inf if moe.capacity_factor is None else math.ceil(moe.capacity_factor * n * k / E)
    served, kept = [0] * E, set()
    for j in range(k):
        for t in range(n):
            e = int(top[t].indices[j])
            if served[e] < C:
                kept.add((t, j))
            served[e] += 1
    out = []
    for t in range(n):
        w = torch.softmax(top[t].values, -1)
        out.append(sum((w[j] * moe.experts[int(top[t].indices[j])](x[t]) for j in range(k) if (t, j) in kept),
                       torch.zeros(HIDDEN)))
    counts = [sum(int(e in top[t].indices) for t in range(n)) for e in range(E)]
    probs = torch.softmax(logits, -1).mean(0)
    aux = E * sum(counts[e] / (n * k) * probs[e] for e in range(E))
    return torch.stack(out), aux, n * k - len(kept)


@pytest.mark.parametrize("capacity_factor,top_k", [(None, 2), (1.0, 2), (0.5, 2), (0.75, 1), (0.75, 3)])
def test_moe_equals_its_definition(capacity_factor, top_k):
    moe = _moe(capacity_factor, top_k=top_k)
    x = torch.randn(3, 8, HIDDEN, generator=torch.Generator().manual_seed(1))
    y = moe(x)
    want, aux, dropped = _by_definition(moe, x.reshape(-1, HIDDEN))
    assert y.shape == x.shape
    assert torch.allclose(y.reshape(-1, HIDDEN), want, atol=1e-6)
    assert torch.allclose(moe.aux_loss, aux, atol=1e-6)
    assert moe.stats["dropped"] == dropped and (dropped == 0 if capacity_factor is None else dropped > 0)
    assert int(moe.stats["tokens_per_expert"].sum()) == 24 * top_k


def test_aux_loss_is_one_when_balanced():
    moe = _moe()
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:, 0] = torch.arange(E) * 1e-3   # nearly uniform probabilities
    x = torch.zeros(E, HIDDEN)
    x[:, 0] = torch.tensor([1.0, -1.0] * (E // 2))  # tokens alternate between experts (6, 7) and (0, 1)
    moe(x)
    # f = 1/4 on four experts, P ~ 1/8 each: E * sum f P = 8 * 4 * (1/4) * (1/8) = 1
    assert abs(moe.aux_loss.item() - 1.0) < 1e-2


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="top_k must be between 1 and num_experts"):
        MoE(4, 8, 2, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        MoE(4, 8, 2, capacity_factor=0)
    with pytest.raises(ValueError, match=r"MoE expects \[\.\.\., 4\] inputs"):
        MoE(4, 8, 2)(torch.randn(3, 5))


def _ep(capacity_factor):
    r, n = dist.get_rank(), dist.get_world_size()
    moe = _moe(capacity_factor, seed=r)
    moe(torch.randn(3, HIDDEN))                                      # a layer that has run: aux_loss is set
    ep = ExpertParallelMoE.from_moe(moe)                             # rank 0's weights reach everyone
    g = torch.Generator().manual_seed(1)
    x, grad = torch.randn(n, T + n, HIDDEN, generator=g), torch.randn(n, T + n, HIDDEN, generator=g)
    mine = x[r, : T + r].clone().requires_grad_()                    # ranks with different token counts
    with CollectiveLog() as log:
        y = ep(mine)
        forward = log.kinds()
        ((y * grad[r, : T + r]).sum() + 3 * ep.aux_loss).backward()
    grads = {name: p.grad for name, p in ep.named_parameters()}
    return y.detach(), mine.grad, grads, ep.aux_loss.detach(), dict(ep.stats), forward, log.kinds()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.5])
def test_expert_parallel_equals_the_plain_layer_on_all_tokens(n, capacity_factor):
    results = launch(lambda: _ep(capacity_factor), nprocs=n, timeout=120)
    moe = _moe(capacity_factor)
    g = torch.Generator().manual_seed(1)
    x, grad = torch.randn(n, T + n, HIDDEN, generator=g), torch.randn(n, T + n, HIDDEN, generator=g)
    tokens = torch.cat([x[r, : T + r] for r in range(n)]).requires_grad_()
    y = moe(tokens)
    ((y * torch.cat([grad[r, : T + r] for r in range(n)])).sum() + 3 * moe.aux_loss).backward()
    rows = torch.tensor([T + r for r in range(n)]).cumsum(0) - torch.tensor([T + r for r in range(n)])
    plain = dict(moe.named_parameters())
    for r, (y_r, dx, grads, aux, stats, _, _) in enumerate(results):
        assert torch.allclose(y_r, y[rows[r]: rows[r] + T + r], atol=1e-6), f"rank {r}: output"
        assert torch.allclose(dx, tokens.grad[rows[r]: rows[r] + T + r], atol=1e-6), f"rank {r}: input gradient"
        assert stats["dropped"] == moe.stats["dropped"] and stats["capacity"] == moe.stats["capacity"]
        assert torch.equal(stats["tokens_per_expert"], moe.stats["tokens_per_expert"])
        for name, got in grads.items():
            if name.startswith("experts."):
                _, i, rest = name.split(".", 2)
                want = plain[f"experts.{int(i) + r * E // n}.{rest}"].grad
                assert (got is None) == (want is None), name
                assert got is None or torch.allclose(got, want, atol=1e-6), f"rank {r}: {name}"
    router = sum(grads["router.weight"] for _, _, grads, *_ in results)
    assert torch.allclose(router, moe.router.weight.grad, atol=1e-6), "router gradients summed over the ranks"
    assert abs(sum(res[3] for res in results) - moe.aux_loss.item()) < 1e-5, "aux losses summed over the ranks"
    sent = torch.tensor([res[4]["sent"] for res in results])
    assert torch.equal(sent, torch.tensor([res[4]["received"] for res in results]).T), "rank r sends what d receives"
    assert int(sent.sum()) == n * T * K + K * sum(range(n)) - moe.stats["dropped"]


def test_expert_parallel_issues_one_count_all_gather_and_two_all_to_alls_each_way():
    results = launch(lambda: _ep(None), nprocs=2, timeout=60)
    for *_, forward, everything in results:
        assert forward == ["all-gather", "all-to-all", "all-to-all"], forward
        assert everything == forward + ["all-to-all", "all-to-all"], everything


def _idle_experts():
    """All tokens routed to rank 0's experts; the inputs need no gradient, the experts do."""
    r = dist.get_rank()
    moe = _moe()
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:2, 0] = torch.tensor([2.0, 1.0])
    ep = ExpertParallelMoE.from_moe(moe)
    x = torch.rand(T, HIDDEN, generator=torch.Generator().manual_seed(r)) + 1   # positive: experts 0 and 1 win
    ep(x).sum().backward()
    return ep.stats["received"], [p.grad is None for p in ep.experts.parameters()]


def test_ranks_whose_experts_got_no_tokens_still_join_the_backward():
    results = launch(_idle_experts, nprocs=4, timeout=60, collective_timeout=30)
    assert results[0][0] == [T * K] * 4 and results[1][0] == [0, 0, 0, 0]
    assert not any(results[0][1]) and all(results[3][1])


def _uneven():
    ExpertParallelMoE.from_moe(MoE(4, 8, 6))


def test_experts_not_divisible_by_ranks_is_a_clear_error():
    with pytest.raises(Exception, match="6 experts cannot be split evenly over 4 ranks"):
        launch(_uneven, nprocs=4, timeout=60)
