# origin: considered alternative
# what I believed: an expert that received no rows has nothing to compute, so skipping it (if sel.any()) is a harmless saving.
# visible check said: ep_dispatch_combine passed
# grader said: ep_dispatch_combine_test 0/5 LaunchError: raised in a hidden part of the check's probe
# misconception: a rank whose experts receive no rows must still run them (on zero rows) so that what it sends back in the combine requires grad; otherwise it skips the backward all-to-all that every other rank waits in.
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
    # 3. local experts: received rows are by source, then by expert
    local_id = torch.arange(per).repeat(n).repeat_interleave(recv.reshape(-1))
    out = torch.zeros_like(got)
    for i, expert in enumerate(local_experts):
        sel = local_id == i
        if sel.any():                                         # an expert with no rows has nothing to do
            out[sel] = expert(got[sel])
    # 4. combine
    back = all_to_all(out, recv_counts, send_counts)
    y_flat = torch.zeros_like(back)
    y_flat[order] = back
    y = (y_flat.view(T, k, -1) * weights[..., None]).sum(1)
    return y, send_counts, recv_counts
