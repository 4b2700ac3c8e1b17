# origin: considered alternative
# what I believed: I hesitated over 'the rows of SwiGLU.w13 rank r needs, in the order they have in w13': read as rank r's contiguous block of w13 (rows r*2ffn/N ...), the way a column-parallel layer is split, with w2's matching columns r*ffn/N ...
# visible check said: AssertionError: 2 ranks, rank 0: the output differs from SwiGLU's by 0.343
# grader said: 0/3 — AssertionError: check line 16 failed (its message is withheld: it would show hidden cases) This looks like a known misconception: w13 split by rows as one matrix: rank 0 gets all of w1 (the gate), rank 1 all of w3, no feature meets its pair (see '3. The tensor-parallel MLP, and LLaMA's SwiGLU'). [misconception: splits_w13_as_one_matrix]
# misconception: a contiguous block of the fused w13 gives rank 0 all of w1 and rank 1 all of w3: each rank needs rows r*ffn/N.. of w1 AND the same rows of w3, so that gate and up of the same hidden features meet on one rank.
class MySwiGLU(nn.Module):
    """SwiGLU with a fused w13, its hidden features split over the ranks of `group`."""

    def __init__(self, ffn, f=copy_to_parallel_region, g=reduce_from_parallel_region, group=None):
        super().__init__()
        self.f, self.g, self.group = f, g, group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        hidden_features = ffn.w2.in_features
        if hidden_features % n:
            raise ValueError(f"{hidden_features} hidden features cannot be split over {n} ranks")
        per = hidden_features // n
        rows = slice(r * per, (r + 1) * per)
        self.w13 = nn.Parameter(ffn.w13.weight.detach().chunk(n, dim=0)[r].clone())   # rank r's block of w13
        self.w2 = nn.Parameter(ffn.w2.weight.detach()[:, rows].clone())

    def forward(self, x):
        x = self.f(x)
        gate, up = F.linear(x, self.w13).chunk(2, dim=-1)
        return self.g(F.linear(F.silu(gate) * up, self.w2))
