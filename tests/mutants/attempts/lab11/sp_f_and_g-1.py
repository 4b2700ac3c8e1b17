# origin: first attempt
# what I believed: dist.all_gather can gather parts of different lengths if I give it output buffers of each rank's size (sizes[r]); backward: f-bar sums the gradients (all-reduce) then keeps my slice when the consumer is tensor-parallel, only slices when replicated; g-bar = all-reduce then my slice, backward all-gather.
# visible check said: LaunchError: rank 1 failed first (then rank(s) [0] failed too):
#   Traceback (most recent call last):
#     File "/work/main/mgpu_lab/runtime/_workers.py", line 74, in run_rank
#       value = fn(*args)
#    ... [last line:] RuntimeError: ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (2, 3, 3), got (2, 4, 3))
# grader said: 0/3 — LaunchError: a rank raised RuntimeError; raised in the check's probe, line 15
# misconception: an all-gather (gloo's, and the ring's in general) moves equal-sized buffers: parts of unequal length must be padded to the longest part before the gather and trimmed after (in f-bar's forward and in g-bar's backward).
class GatherSequence(torch.autograd.Function):
    """f-bar: each rank's part [b, sizes[r], h] -> the whole sequence [b, sum(sizes), h] on every rank.
    tensor_parallel_output_grad: True when the whole sequence's consumer is tensor-parallel, False when every
    rank runs it whole (replicated)."""

    @staticmethod
    def forward(ctx, x, sizes, group, tensor_parallel_output_grad):
        ctx.sizes, ctx.group, ctx.tp = list(sizes), group, tensor_parallel_output_grad
        r = dist.get_rank(group)
        parts = [x.new_empty(x.shape[0], k, *x.shape[2:]) for k in sizes]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        r = dist.get_rank(ctx.group)
        start = sum(ctx.sizes[:r])
        g = grad.clone()
        if ctx.tp:
            dist.all_reduce(g, group=ctx.group)
        return g.narrow(1, start, ctx.sizes[r]).contiguous(), None, None, None


class ReduceScatterSequence(torch.autograd.Function):
    """g-bar: each rank's partial sums of every position [b, sum(sizes), h] -> the sums of its own positions."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = list(sizes), group
        r = dist.get_rank(group)
        total = x.clone()
        dist.all_reduce(total, group=group)
        start = sum(sizes[:r])
        return total.narrow(1, start, sizes[r]).contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [grad.new_empty(grad.shape[0], k, *grad.shape[2:]) for k in ctx.sizes]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=1), None, None


def sp_f(x, sizes, group=None, tensor_parallel_output_grad=True):
    return GatherSequence.apply(x, sizes, group, tensor_parallel_output_grad)


def sp_g(x, sizes, group=None):
    return ReduceScatterSequence.apply(x, sizes, group)
