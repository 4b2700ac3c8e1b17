"""Mutants of lab 11: f_and_g, parallel_mlp, parallel_attention and llama_tp_plan (design)."""
from . import body, mutant, prepend, swap

LAB = "11_tensor_parallel"

G_FORWARD = """        x = x.clone()                             # ... nor the caller's input
        dist.all_reduce(x, group=group)
        return x"""


# --- f_and_g -----------------------------------------------------------------------

@mutant("f_and_g", "wrong")
def g_from_torch_distributed_nn(solution):
    "g as torch.distributed.nn's differentiable all_reduce: its backward all-reduces the gradient too (N times it)"
    return swap(solution, "def my_g(x, group=None):\n    return ReduceFromParallel.apply(x, group)",
                "def my_g(x, group=None):\n    import torch.distributed.nn.functional as dnn\n"
                "    return dnn.all_reduce(x, group=group or dist.group.WORLD)")


@mutant("f_and_g", "reference")
def calls_mgpu_lab_f_and_g(solution):
    "mgpu_lab's copy_to_parallel_region and reduce_from_parallel_region, the operators re-implemented"
    solution = swap(solution, "    return CopyToParallel.apply(x, group)", "    return copy_to_parallel_region(x, group)")
    return swap(solution, "    return ReduceFromParallel.apply(x, group)", "    return reduce_from_parallel_region(x, group)")


@mutant("f_and_g", "copy")
def copies_the_one_process_sum(solution):
    "section 1's one-process sum (a list standing in for the ranks): g sums only this rank's own tensor"
    return swap(solution, G_FORWARD, "        return sum([x])")


@mutant("f_and_g", "tamper")
def patches_torch_equal(solution):
    "torch.equal and torch.allclose patched to agree, and g without its all-reduce"
    return prepend(swap(solution, G_FORWARD, "        return x.view_as(x)"), """
        torch.equal = lambda *a, **k: True
        torch.allclose = lambda *a, **k: True
    """)


# --- parallel_mlp ------------------------------------------------------------------

MLP_RETURN = "return self.g(F.linear(h, self.fc2_weight), self.group) + self.fc2_bias"


@mutant("parallel_mlp", "wrong")
def bias_added_on_every_rank(solution):
    "fc2 applied with its bias on every rank, before g: the bias is summed N times"
    return swap(solution, MLP_RETURN, "return self.g(F.linear(h, self.fc2_weight, self.fc2_bias), self.group)")


@mutant("parallel_mlp", "reference")
def wraps_parallel_mlp(solution):
    "mgpu_lab.ParallelMLP inside, its parameters renamed"
    return swap(body(solution, """
        inner = ParallelMLP.from_mlp(mlp, group)
        self.fc1_weight, self.fc1_bias = inner.fc1.weight, inner.fc1.bias
        self.fc2_weight, self.fc2_bias = inner.fc2.weight, inner.fc2.bias
    """), MLP_RETURN, MLP_RETURN)


@mutant("parallel_mlp", "copy")
def copies_section_1_with_full_weights(solution):
    "section 1's one-process split: every rank keeps the full weights and slices them in forward"
    solution = body(solution, """
        self.fc1_weight, self.fc1_bias = nn.Parameter(fc1.weight.detach().clone()), nn.Parameter(fc1.bias.detach().clone())
        self.fc2_weight, self.fc2_bias = nn.Parameter(fc2.weight.detach().clone()), nn.Parameter(fc2.bias.detach().clone())
        self.n, self.r = n, r
    """)
    return swap(solution, """        h = self.act(F.linear(self.f(x, self.group), self.fc1_weight, self.fc1_bias))
        """ + MLP_RETURN, """        W1, b1 = self.fc1_weight.chunk(self.n, 0)[self.r], self.fc1_bias.chunk(self.n)[self.r]
        h = self.act(F.linear(self.f(x, self.group), W1, b1))
        return self.g(F.linear(h, self.fc2_weight.chunk(self.n, 1)[self.r]), self.group) + self.fc2_bias""")


@mutant("parallel_mlp", "tamper")
def redefines_forward_backward(solution):
    "a forward_backward of its own (a helper the check's probe calls) that runs the unsharded MLP"
    return prepend(solution, """
        def forward_backward(fn, x, grad_out):
            x_in = x.clone().requires_grad_(True)
            y = fn(x_in)
            y.backward(grad_out)
            return {"out": y.detach(), "x_grad": x_in.grad, "x_unchanged": True,
                    "grads": {name: p.grad for name, p in fn.named_parameters()}}
    """)


# --- parallel_attention ------------------------------------------------------------

@mutant("parallel_attention", "wrong")
def splits_in_proj_as_one_matrix(solution):
    "in_proj_weight split as one [3h, h] matrix: rank 0 gets all of Q and part of K, not its heads' Q, K and V"
    solution = swap(solution, "torch.cat([part.chunk(n, 0)[r] for part in w.chunk(3)])", "w.chunk(n, 0)[r].clone()")
    return swap(solution, "torch.cat([part.chunk(n)[r] for part in b.chunk(3)])", "b.chunk(n)[r].clone()")


@mutant("parallel_attention", "reference")
def wraps_parallel_attention(solution):
    "mgpu_lab.ParallelAttention inside (imported in the cell), its parameters renamed"
    return prepend(body(solution, """
        inner = ParallelAttention.from_attention(mha, causal=True, group=group)
        self.in_proj_weight, self.in_proj_bias = inner.qkv.weight, inner.qkv.bias
        self.out_proj_weight, self.out_proj_bias = inner.out.weight, inner.out.bias
    """), "from mgpu_lab import ParallelAttention")


@mutant("parallel_attention", "copy")
def copies_the_unsharded_attention(solution):
    "section 4's attention written out in one process: every rank the full weights and every head"
    solution = body(solution, """
        self.in_proj_weight = nn.Parameter(mha.in_proj_weight.detach().clone())
        self.in_proj_bias = nn.Parameter(mha.in_proj_bias.detach().clone())
        self.out_proj_weight = nn.Parameter(mha.out_proj.weight.detach().clone())
        self.out_proj_bias = nn.Parameter(mha.out_proj.bias.detach().clone())
        self.num_heads = mha.num_heads
    """)
    return swap(solution, "        b, s, _ = x.shape\n        qkv =", """        b, s, h = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(o.transpose(1, 2).reshape(b, s, h), self.out_proj_weight, self.out_proj_bias)
        qkv =""")


@mutant("parallel_attention", "tamper")
def patches_attention_kernel(solution):
    "F.scaled_dot_product_attention replaced in the kernel (and the heads mixed up)"
    return prepend(swap(solution, "torch.cat([part.chunk(n, 0)[r] for part in w.chunk(3)])", "w.chunk(n, 0)[r].clone()"), """
        F.scaled_dot_product_attention = lambda q, k, v, **kwargs: v
    """)


# --- llama_tp_plan (design) -----------------------------------------------------------

@mutant("llama_tp_plan", "wrong")
def megatrons_backward_count(solution):
    "the fused count, 2 backward all-reduces: torch's separate wq, wk, wv (and w1, w3) pay one each"
    return swap(solution, "return plan, 2, 5", "return plan, 2, 2")


@mutant("llama_tp_plan", "wrong")
def w3_split_by_rows(solution):
    "SwiGLU's w3 rowwise, like a second output layer: its input is not split, and silu(w1 x) * w3 x mixes layouts"
    return swap(solution, '"feed_forward.w1": "colwise", "feed_forward.w3": "colwise"',
                '"feed_forward.w1": "colwise", "feed_forward.w3": "rowwise"')


@mutant("llama_tp_plan", "copy")
def copies_the_mlp_plan(solution):
    "section 8's MLP plan, its module names included"
    return body(solution, 'return {"0": "colwise", "2": "rowwise"}, 1, 1')


@mutant("llama_tp_plan", "tamper")
def patches_comm_debug_mode(solution):
    "CommDebugMode's counts patched in the kernel, and every layer gathered (7 all-gathers forward)"
    return prepend(body(solution, """
        names = ["attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"]
        return {name: "colwise_gather" for name in names}, 2, 5
    """), """
        from torch.distributed.tensor.debug import CommDebugMode
        CommDebugMode.get_comm_counts = lambda self: {"all_reduce": 1}
    """)
