# origin: considered alternative (second reading of "the loss is the one of all the ranks' tokens together", cell 13)
# what I believed: every rank should return the global loss L itself: all-reduce the counts and the probability sums,
#   keep the gradient path through this rank's own rows only; then the ranks' mean is L and each rank's gradient is
#   L's gradient for its rows.
# visible check said: 2 ranks holding different tokens (9 and 5): rank 0's gradient divided by N = 2 (DDP's mean) is not the gradient of MoE.aux_loss over every rank's tokens for its rows
# grader said: 0/3 "AssertionError: check line 27 failed (its message is withheld: it would show hidden cases) This looks like a known misconception: P all-reduced over the ranks with dist.all_reduce (no autograd): every rank returns the global loss, but its gradient reaches only its own rows' part, and DDP's mean divides it by N (see '3. The load-balancing loss')."
# misconception: DDP averages the ranks' gradients, so a rank that returns L (whose gradient for its rows is already
#   dL/d(its rows)) ends up N times too small; the per-rank loss must be N times this rank's share of L.
def global_balance_loss(router_logits, top_k):
    # This rank's part of the global-batch loss: averaged over the ranks (values and gradients), E * sum_e f_e P_e
    # with f and P over every rank's tokens.
    E = router_logits.shape[-1]
    probs = torch.softmax(router_logits, dim=-1)
    chosen = router_logits.topk(top_k, dim=-1).indices
    counts = torch.bincount(chosen.reshape(-1), minlength=E).float()
    dist.all_reduce(counts)                       # global counts: f over every rank's tokens
    T = counts.sum() / top_k                      # every rank's tokens
    f = counts / counts.sum()
    local = probs.sum(0)
    others = local.detach().clone()
    dist.all_reduce(others)                       # global probability sums
    P = (others - local.detach() + local) / T     # global P, differentiable through this rank's rows
    return E * (f * P).sum()
