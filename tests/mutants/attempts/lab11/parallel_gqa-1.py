# origin: considered alternative
# what I believed: the ranks holding copies of a K/V head must end with the same gradient, so I considered the simple DDP-like way: all-reduce wk's and wv's gradients over the whole tensor-parallel group (instead of summing each K/V head only over the ranks that hold it).
# visible check said: MyParallelGQA passed
# grader said: 0/4 — AssertionError: hidden check 1 of this cell failed (feedback file: 'Exercise 3: tensor-parallel grouped-query attention | 0 / 4 | AssertionError: hidden check 1 of this cell failed')
# misconception: an all-reduce over the whole group adds together the gradients of DIFFERENT K/V heads (2 ranks, G=2: rank 0's head 0 and rank 1's head 1; 4 ranks: heads 0 and 1): only the ranks that hold copies of the same K/V head may sum its gradient.
class _SumSharedKV(torch.autograd.Function):
    # identity forward; backward: each K/V head's gradient summed over the ranks that hold a copy of it
    @staticmethod
    def forward(ctx, w, first_head, kv_total, d, group):
        ctx.first_head, ctx.kv_total, ctx.d, ctx.group = first_head, kv_total, d, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)      # the copies' gradients summed, as DDP sums replicas'
        return grad, None, None, None, None


class MyParallelGQA(nn.Module):
    """Grouped-query attention with its query heads split over the ranks of `group`, and the K/V heads they use."""

    def __init__(self, attn, f=copy_to_parallel_region, g=reduce_from_parallel_region, group=None):
        super().__init__()
        self.f, self.g, self.group = f, g, group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        H, G, d = attn.heads, attn.kv_heads, attn.head_dim
        if H % n or (G % n and n % G):
            raise ValueError(f"{H} query heads and {G} K/V heads cannot be split over {n} ranks")
        self.heads, self.head_dim = H // n, d            # query heads on this rank, and their size
        q_rows = slice(r * self.heads * d, (r + 1) * self.heads * d)
        if G >= n:
            self.kv_heads, first = G // n, r * (G // n)
        else:
            self.kv_heads, first = 1, r // (n // G)
        self.first_kv, self.total_kv = first, G
        kv_rows = slice(first * d, (first + self.kv_heads) * d)
        self.wq = nn.Parameter(attn.wq.weight.detach()[q_rows].clone())
        self.wk = nn.Parameter(attn.wk.weight.detach()[kv_rows].clone())
        self.wv = nn.Parameter(attn.wv.weight.detach()[kv_rows].clone())
        self.wo = nn.Parameter(attn.wo.weight.detach()[:, q_rows].clone())

    def forward(self, x):
        b, s, _ = x.shape
        x = self.f(x)
        wk, wv = (_SumSharedKV.apply(w, self.first_kv, self.total_kv, self.head_dim, self.group)
                  for w in (self.wk, self.wv))
        q = F.linear(x, self.wq).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = (F.linear(x, w).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2) for w in (wk, wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.g(F.linear(o.transpose(1, 2).reshape(b, s, -1), self.wo))
