# origin: considered alternative (the first form that came to mind from the Qwen paragraph, cell 13; I weighed it before deriving)
# what I believed: the global-batch loss only needs the counts to be global: all-reduce the expert counts for f, keep
#   each rank's own mean probability P_r; the ranks' P_r average to the global P, so the mean of E*sum f*P_r is L.
# visible check said: 2 ranks holding different tokens (9 and 5): the mean of the ranks' losses is 1.26711, MoE.aux_loss over every rank's tokens is 1.25606
# grader said: 0/3 "AssertionError: check line 23 failed (its message is withheld: it would show hidden cases) This looks like a known misconception: each rank's own E * sum_e f_e P_e (f global, P this rank's mean): right only when every rank holds as many tokens; a rank's part of the global P is its probabilities' sum over all T tokens, T_r / T of its own mean (see '3. The load-balancing loss')."
# misconception: the mean of per-rank means is the global mean only when every rank holds as many tokens; with T_r
#   uneven each rank must weight its probability sum by N/T (global T), not 1/T_r.
def global_balance_loss(router_logits, top_k):
    # This rank's part of the global-batch loss: averaged over the ranks (values and gradients), E * sum_e f_e P_e
    # with f and P over every rank's tokens.
    E = router_logits.shape[-1]
    probs = torch.softmax(router_logits, dim=-1)
    chosen = router_logits.topk(top_k, dim=-1).indices
    counts = torch.bincount(chosen.reshape(-1), minlength=E).float()
    dist.all_reduce(counts)                       # global counts: f over every rank's tokens
    f = counts / counts.sum()
    P = probs.mean(0)                             # this rank's mean probability
    return E * (f * P).sum()
