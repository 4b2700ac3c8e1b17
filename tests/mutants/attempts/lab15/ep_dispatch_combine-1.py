# origin: considered alternative
# what I believed: each source sends its rows sorted by expert, so after the dispatch all-to-all a rank's received rows are grouped by its local expert (counts summed over sources per expert).
# visible check said: AssertionError: 2 ranks, rank 0: y
# grader said: ep_dispatch_combine_test 0/5 AssertionError: check line 26 failed (its message is withheld: it would show hidden cases)
# misconception: all_to_all_single concatenates the received pieces in source-rank order, so the rows are grouped by source first and by local expert only within each source's piece; the expert of each row comes from the [source, local expert] count table in that order.
def ep_dispatch_combine(x, experts, weights, local_experts, num_experts):
    # This rank's tokens through every rank's experts: (y, sent, received).
    rank, n = dist.get_rank(), dist.get_world_size()
    T, k = experts.shape
    per = num_experts // n
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)                  # assignments sorted by expert = by destination
    token_of = torch.arange(T).repeat_interleave(k)[order]
    rows = x[token_of]
    counts = torch.bincount(flat, minlength=num_experts)       # per expert
    # 1. counts: rank d gets my counts for its experts
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts)
    recv = recv.view(n, per)                                  # [source, local expert]
    send_counts = counts.view(n, per).sum(1).tolist()
    recv_counts = recv.sum(1).tolist()
    # 2. dispatch
    got = all_to_all(rows, send_counts, recv_counts)
    # 3. local experts: received rows are grouped by expert (each source sent them sorted by expert)
    local_id = torch.arange(per).repeat_interleave(recv.sum(0))
    out = torch.zeros_like(got)
    for i, expert in enumerate(local_experts):
        sel = local_id == i
        out[sel] = expert(got[sel])
    # 4. combine
    back = all_to_all(out, recv_counts, send_counts)
    y_flat = torch.zeros_like(back)
    y_flat[order] = back
    y = (y_flat.view(T, k, -1) * weights[..., None]).sum(1)
    return y, send_counts, recv_counts
