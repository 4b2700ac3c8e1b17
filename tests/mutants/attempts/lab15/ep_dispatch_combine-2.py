# origin: considered alternative (I hesitated over the arrival order, cell 21 "Work out in which order the rows arrive")
# what I believed: every sender sorted its rows by expert before the dispatch, so the received rows are already grouped
#   by local expert and offs = cumulative per-expert totals can be used on them directly (and no un-permute after).
# visible check said: 2 ranks, rank 0: y
# grader said: 0/5 "AssertionError: check line 35 failed (its message is withheld: it would show hidden cases) This looks like a known misconception: the arrived rows taken as grouped by local expert: all_to_all_single puts them in source rank order, each source's piece grouped by expert, so rows go through the wrong experts; the [source, local expert] count table says which (see '4. Expert parallelism: dispatch and combine')."
# misconception: all_to_all_single concatenates by SOURCE rank; within each source's piece the rows are by expert, so
#   with N > 1 senders the experts' rows are interleaved (src0:e0,e1 | src1:e0,e1) and must be regrouped (and put back).
def ep_dispatch_combine(x, experts, weights, w1, b1, w2, b2, num_experts):
    # This rank's tokens through every rank's experts, this rank's experts as grouped GEMMs: (y, sent, received).
    rank, n = dist.get_rank(), dist.get_world_size()
    E_local = num_experts // n
    T, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)                 # assignments grouped by expert -> by destination rank
    token_of = order // k
    counts = torch.bincount(flat, minlength=num_experts)     # [E]: rows for each expert
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)              # [N * E_local]: from rank s, for my expert i
    send = counts.view(n, E_local).sum(1).tolist()
    recv_table = recv_counts.view(n, E_local)
    recv = recv_table.sum(1).tolist()
    rows = all_to_all(x[token_of], send, recv)
    # the senders sorted their rows by expert, so the rows arrive grouped by expert
    offs = torch.cumsum(recv_table.sum(0), 0).to(torch.int32)
    ids = torch.repeat_interleave(torch.arange(E_local), recv_table.sum(0))
    h = F.gelu(torch._grouped_mm(rows, w1, offs=offs) + b1[ids])
    out = torch._grouped_mm(h, w2, offs=offs) + b2[ids]
    returned = all_to_all(out, recv, send)                   # in the order this rank sent them
    y = torch.zeros_like(x).index_add(0, token_of, returned * weights.reshape(-1)[order, None])
    return y, send, recv
