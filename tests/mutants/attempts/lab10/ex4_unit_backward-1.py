# origin: considered alternative
# what I believed: the probe's grad_y is already the per-rank mean (t / len(x)), so the reduce-scatter's sum over ranks is already the gradient of the batch; dividing again by N would shrink it
# visible check said: AssertionError: 2 ranks, shares (1, 3), rank 0, a 16x8 layer: grad_shard differs from the averaged full-batch gradient by 4.73e-01
# grader said: 0/4 and 0/1: check line 25 failed (its message is withheld: it would show hidden cases) This looks like a known misconception: the reduce-scatter's sum kept as the gradient: N times the average (see '3. ZeRO-3: fully sharded data parallel (FSDP)').
# misconception: each rank's gradient is the mean over its own slice, so the full-batch mean is the average of the N per-rank means: the reduce-scatter's sum must still be divided by N
def unit_backward(ctx, grad_y):
    x, shard = ctx.saved_tensors
    out_f, in_f, shares = ctx.out_features, ctx.in_features, ctx.shares
    world = dist.get_world_size()
    rank = dist.get_rank()
    numel = out_f * (in_f + 1)
    b = shard_bounds(numel, shares)
    longest = max(b[r + 1] - b[r] for r in range(world))
    padded = torch.zeros(longest, dtype=shard.dtype)
    padded[:shard.numel()] = shard
    out = torch.empty(world * longest, dtype=shard.dtype)
    all_gather(out, padded)
    flat = torch.cat([out[r * longest:r * longest + b[r + 1] - b[r]] for r in range(world)])
    weight = flat[:out_f * in_f].view(out_f, in_f)
    grad_x = grad_y @ weight
    gy = grad_y.reshape(-1, out_f)
    dW = gy.t() @ x.reshape(-1, in_f)
    db = gy.sum(0)
    g = torch.cat([dW.reshape(-1), db])
    buf = torch.zeros(world * longest, dtype=g.dtype)
    for r in range(world):
        buf[r * longest:r * longest + b[r + 1] - b[r]] = g[b[r]:b[r + 1]]
    mine = torch.empty(longest, dtype=g.dtype)
    reduce_scatter(mine, buf)
    grad_shard = mine[:b[rank + 1] - b[rank]]
    return grad_x, grad_shard, None, None, None
