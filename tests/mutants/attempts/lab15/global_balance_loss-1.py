# origin: considered alternative
# what I believed: "global-batch" form means both f and P over every rank's tokens: P's sums all-reduced (differentiably, torch.distributed.nn) and divided by the total token count, the same loss on every rank.
# visible check said: AssertionError: 2 ranks holding different tokens: rank 0's gradient, scaled by T_r / T, should be that of MoE.aux_loss over both ranks' tokens for its rows
# grader said: global_balance_loss_test 0/3 AssertionError: 2 ranks holding different tokens: rank 0's gradient, scaled by T_r / T, should be... (check line 30)
# misconception: only f is global (counts all-reduced, no gradient); P is this rank's own mean over its T_r tokens; a differentiable all-reduce of P's sums makes every rank's loss the whole loss and its backward sums N ranks' gradients into each rank's logits.
def global_balance_loss(router_logits, top_k):
    # This rank's E * sum_e f_e P_e: f over every rank's assignments, P over this rank's tokens.
    # "global batch": f and P both over every rank's tokens (P's sum all-reduced with autograd)
    import torch.distributed.nn.functional as dnn
    E = router_logits.shape[-1]
    probs = torch.softmax(router_logits, dim=-1)
    chosen = router_logits.topk(top_k, dim=-1).indices
    counts = torch.bincount(chosen.flatten(), minlength=E).float()
    dist.all_reduce(counts)                       # every rank's assignments
    f = counts / counts.sum()
    tokens = torch.tensor([float(len(router_logits))])
    dist.all_reduce(tokens)
    P = dnn.all_reduce(probs.sum(0)) / tokens
    return E * (f * P).sum()
