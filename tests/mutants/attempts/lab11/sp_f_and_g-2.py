# origin: considered alternative
# what I believed: with tensor_parallel_output_grad=False every rank sends back the same complete gradient and "its loss counts once, not N times", so each rank should take its positions' slice divided by N (each replica contributing 1/N).
# visible check said: AssertionError: 2 ranks ([4, 3] positions), rank 0: with tensor_parallel_output_grad=False (a replicated consumer, every rank the same complete gradient), f-bar's input gradient differs by 0.897
# grader said: (not graded)
# misconception: rank r's part lives on rank r only, so nothing sums the ranks' input gradients afterwards: the complete gradient's slice is the whole gradient of that part; dividing by N undercounts it N times.
class GatherSequence(torch.autograd.Function):
    """f-bar: each rank's part [b, sizes[r], h] -> the whole sequence [b, sum(sizes), h] on every rank.
    tensor_parallel_output_grad: True when the whole sequence's consumer is tensor-parallel, False when every
    rank runs it whole (replicated)."""

    @staticmethod
    def forward(ctx, x, sizes, group, tensor_parallel_output_grad):
        # YOUR CODE HERE
        ctx.sizes, ctx.group, ctx.tp = list(sizes), group, tensor_parallel_output_grad
        n = dist.get_world_size(group)
        longest = max(sizes)
        pad = torch.zeros(x.shape[0], longest, *x.shape[2:], dtype=x.dtype)
        pad[:, :x.shape[1]] = x
        parts = [torch.empty_like(pad) for _ in range(n)]
        dist.all_gather(parts, pad, group=group)
        return torch.cat([p[:, :k] for p, k in zip(parts, sizes)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        # YOUR CODE HERE
        r = dist.get_rank(ctx.group)
        start = sum(ctx.sizes[:r])
        if ctx.tp:
            total = grad.clone()
            dist.all_reduce(total, group=ctx.group)
        else:
            total = grad / dist.get_world_size(ctx.group)   # the replicated loss counts once, not N times
        return total[:, start:start + ctx.sizes[r]].clone(), None, None, None


class ReduceScatterSequence(torch.autograd.Function):
    """g-bar: each rank's partial sums of every position [b, sum(sizes), h] -> the sums of its own positions."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        # YOUR CODE HERE
        ctx.sizes, ctx.group = list(sizes), group
        r = dist.get_rank(group)
        start = sum(sizes[:r])
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total[:, start:start + sizes[r]].clone()

    @staticmethod
    def backward(ctx, grad):
        # YOUR CODE HERE
        n = dist.get_world_size(ctx.group)
        sizes = ctx.sizes
        longest = max(sizes)
        pad = torch.zeros(grad.shape[0], longest, *grad.shape[2:], dtype=grad.dtype)
        pad[:, :grad.shape[1]] = grad
        parts = [torch.empty_like(pad) for _ in range(n)]
        dist.all_gather(parts, pad, group=ctx.group)
        return torch.cat([p[:, :k] for p, k in zip(parts, sizes)], dim=1), None, None


def sp_f(x, sizes, group=None, tensor_parallel_output_grad=True):
    return GatherSequence.apply(x, sizes, group, tensor_parallel_output_grad)


def sp_g(x, sizes, group=None):
    return ReduceScatterSequence.apply(x, sizes, group)
