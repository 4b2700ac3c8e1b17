# origin: considered alternative
# what I believed: when several ranks hold copies of a K/V head, all-reducing wk's and wv's gradients over the tensor-parallel group makes each copy's gradient whole (like a data-parallel gradient all-reduce).
# visible check said: AssertionError: 4 ranks (8 query heads, 2 K/V heads), rank 0: wk's gradient is not the whole gradient of the heads it holds (largest difference 1.21)
# grader said: 0/4 AssertionError: 4 ranks (8 query heads, 2 K/V heads), rank 0: wk's gradient is not the whole gradient of the heads it holds (largest difference 1.21) (check line 30) The check compared `res` with the solution's, case by case: `res[4][0]['grads']['wk']` is the first to differ (no misconception named)
# misconception: the group's ranks hold different K/V heads (ranks 0-1 head 0, ranks 2-3 head 1), so a sum over the whole group adds other heads' gradients; only the ranks sharing a head may be summed.
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
        # YOUR CODE HERE
        q0 = r * self.heads
        self.kv_heads = max(G // n, 1)
        kv0 = q0 // (H // G)
        self.kv0, self.G = kv0, G
        self.wq = nn.Parameter(attn.wq.weight.detach()[q0 * d:(q0 + self.heads) * d].clone())
        self.wo = nn.Parameter(attn.wo.weight.detach()[:, q0 * d:(q0 + self.heads) * d].clone())
        self.wk = nn.Parameter(attn.wk.weight.detach()[kv0 * d:(kv0 + self.kv_heads) * d].clone())
        self.wv = nn.Parameter(attn.wv.weight.detach()[kv0 * d:(kv0 + self.kv_heads) * d].clone())
        if G < n:   # several ranks hold the same K/V head: sum their gradients
            for p in (self.wk, self.wv):
                p.register_hook(self._sum_over_sharers)

    def _sum_over_sharers(self, grad):
        total = grad.clone()
        dist.all_reduce(total, group=self.group)
        return total

    def forward(self, x):
        # YOUR CODE HERE
        b, s, _ = x.shape
        x = self.f(x, self.group)
        q = F.linear(x, self.wq).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = (F.linear(x, w).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2) for w in (self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.g(F.linear(o.transpose(1, 2).reshape(b, s, -1), self.wo), self.group)
