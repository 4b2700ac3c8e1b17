"""DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437, section 2.1.2): the bias chooses, the
scores weigh, and after each step the bias moves by gamma against the expert's load."""
import torch

from mgpu_lab.parallel.moe import biased_top_k, update_bias


def test_the_bias_moves_by_gamma_against_the_load():
    bias = torch.tensor([0.5, -0.2, 0.0, 0.1])
    load = torch.tensor([9, 1, 5, 5])                 # mean 5: overloaded, underloaded, at the mean twice
    new = update_bias(bias, load, speed=0.001)
    assert torch.equal(new, bias + torch.tensor([-0.001, 0.001, 0.0, 0.0]))
    assert torch.equal(bias, torch.tensor([0.5, -0.2, 0.0, 0.1]))          # a new tensor: the old one is kept


def test_gamma_zero_freezes_the_bias():
    bias = torch.randn(8)
    assert torch.equal(update_bias(bias, torch.arange(8), speed=0.0), bias)


def test_the_bias_chooses_and_the_scores_weigh():
    scores = torch.tensor([[3.0, 2.0, 1.0, 0.0]], requires_grad=True)
    assert biased_top_k(scores, torch.zeros(4), 2).tolist() == [[0, 1]]
    experts = biased_top_k(scores, torch.tensor([0.0, 0.0, 1.5, 0.0]), 2)    # 1 + 1.5 > 2: expert 2 replaces 1
    assert experts.tolist() == [[0, 2]]
    gates = torch.softmax(scores.gather(-1, experts), -1)                   # the gating: unbiased scores
    assert torch.allclose(gates, torch.softmax(torch.tensor([[3.0, 1.0]]), -1))
    gates[0, 1].backward()
    assert scores.grad[0, 1] == 0 and scores.grad[0, 3] == 0 and scores.grad[0, 2] != 0


def test_repeated_steps_even_out_a_skewed_router():
    # tokens whose scores all favour expert 0: the bias alone spreads them
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(256, 4, generator=g) * 0.1 + torch.tensor([1.0, 0.0, 0.0, 0.0])
    bias = torch.zeros(4)
    first = torch.bincount(biased_top_k(scores, bias, 1).flatten(), minlength=4)
    for _ in range(2000):
        bias = update_bias(bias, torch.bincount(biased_top_k(scores, bias, 1).flatten(), minlength=4), 0.001)
    load = torch.bincount(biased_top_k(scores, bias, 1).flatten(), minlength=4)
    assert first.max() == 256 and load.max() <= 1.2 * 64
