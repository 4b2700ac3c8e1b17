"""Mutants of lab 11: sp_f_and_g (sequence parallelism's f and g for unequal parts, f-bar's backward for a
tensor-parallel or a replicated consumer), parallel_swiglu
(a fused w13), parallel_gqa (fewer K/V heads than ranks) and tp_plans (design: measured on the
given scenarios, computed exactly on hidden ones of real sizes, where run_plan cannot run).

A call of mgpu_lab's or torch's own layer is a ``wrong`` mutant here: none of them computes what these
exercises ask, so each is rejected by the numbers, not by a guard."""
from . import body, mutant, prepend, swap

LAB = "11_tensor_parallel"
L = "learnE, 2026-12-05, "      # learner= of the attempts kept in attempts/lab11 (issue 46 item 4)

F_BACKWARD_SUM = """        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)"""
SP_F_CALL = "    return GatherSequence.apply(x, sizes, group, tensor_parallel_output_grad)"
SP_G_CALL = "    return ReduceScatterSequence.apply(x, sizes, group)"


# --- sp_f_and_g ------------------------------------------------------------------------

def gather_backward_keeps_its_own_slice(solution):
    "f-bar's backward keeps this rank's slice of its own gradient, unsummed: right only for a replicated consumer"
    return swap(solution, F_BACKWARD_SUM, """        total = grad.contiguous().clone()""")


@mutant("sp_f_and_g", "wrong")
def all_reduces_the_gradient_in_place(solution):
    "f-bar's backward all-reduces the gradient autograd gave it, in place: the right numbers, the caller's tensor changed"
    return swap(solution, F_BACKWARD_SUM, """        total = grad
        dist.all_reduce(total, group=ctx.group)""")


@mutant("sp_f_and_g", "wrong")
def applies_the_flag_backwards(solution):
    "the flag read the wrong way round: a slice before a tensor-parallel consumer, a sum before a replicated one"
    return swap(solution, "        if not ctx.tensor_parallel:", "        if ctx.tensor_parallel:")


@mutant("sp_f_and_g", "wrong",
        message="before a replicated consumer (tensor_parallel_output_grad=False), f-bar's backward divides this "
                "rank's slice by N: the gradient is already complete, and rank r's positions live on rank r alone "
                "(nothing sums the parts' gradients afterwards): the slice is their whole gradient",
        section="2. Megatron's f and g, and their conjugates",
        learner="learnI, 2026-12-05, considered: attempts/lab11/sp_f_and_g-2.py")
def replicated_consumer_gradient_divided_by_n(solution):
    "before a replicated consumer, the slice of the complete gradient divided by N (\"its loss counts once\" read as "
    "each replica's share): nothing sums the parts' gradients afterwards, so it is N times too small"
    return swap(solution, "            return grad[:, start:start + sizes[rank]].clone(), None, None, None",
                "            return grad[:, start:start + sizes[rank]] / dist.get_world_size(ctx.group), None, None, None")


@mutant("sp_f_and_g", "wrong",
        message="unequal parts all-gathered into buffers of each rank's length: an all-gather moves equal-sized "
                "tensors (gloo refuses 4 and 3 positions); pad each part to the longest, gather, trim",
        section="2. Megatron's f and g, and their conjugates",
        learner=L + "first attempt: attempts/lab11/sp_f_and_g-1.py")
def gathers_unequal_parts_unpadded(solution):
    "unequal parts all-gathered into buffers of each rank's length, unpadded: gloo's all-gather needs equal sizes"
    return body(body(solution, """
        parts = [grad.new_empty(grad.shape[0], k, *grad.shape[2:]) for k in ctx.sizes]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=1), None, None
    """, region=3), """
        ctx.sizes, ctx.group, ctx.tensor_parallel = list(sizes), group, tensor_parallel_output_grad
        parts = [x.new_empty(x.shape[0], k, *x.shape[2:]) for k in sizes]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)
    """, region=0)


@mutant("sp_f_and_g", "wrong")
def library_sequence_parallel_operators(solution):
    "mgpu_lab's own sequence-parallel operators: they need equal parts (7 positions on 2 ranks crash the gather)"
    return prepend(swap(swap(solution, SP_F_CALL,
                             "    return gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad)"),
                        SP_G_CALL,
                        "    return reduce_scatter_to_sequence_parallel_region(x, group)"), """
        from mgpu_lab.parallel.tensor_parallel import (gather_from_sequence_parallel_region,
                                                       reduce_scatter_to_sequence_parallel_region)
    """)


@mutant("sp_f_and_g", "reference")
def torch_differentiable_all_gather(solution):
    "torch's differentiable collectives (f-bar: all-gather of padded parts, flag ignored; g-bar: all-reduce, slice)"
    solution = swap(solution, SP_G_CALL, """    import torch.distributed.nn.functional as dnn
    total = dnn.all_reduce(x, group=group or dist.group.WORLD)
    start = sum(sizes[:dist.get_rank(group)])
    return total[:, start:start + sizes[dist.get_rank(group)]]""")
    return swap(solution, SP_F_CALL, """    import torch.distributed.nn.functional as dnn
    padded = F.pad(x, (0, 0, 0, max(sizes) - x.shape[1]))
    parts = dnn.all_gather(padded, group=group or dist.group.WORLD)
    return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)""")


@mutant("sp_f_and_g", "copy")
def section_2s_f_and_g(solution):
    "section 2's f and g transcribed: identity forward and an all-reduce backward (f), an all-reduce forward (g)"
    # body() drops the markers of the region it replaces: the last region first
    solution = body(solution, "return grad, None, None", region=3)
    solution = body(solution, """
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x
    """, region=2)
    solution = body(solution, """
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None, None, None
    """, region=1)
    return body(solution, """
        ctx.group = group
        return x.view_as(x)
    """, region=0)


@mutant("sp_f_and_g", "tamper")
def patches_allclose(solution):
    "torch.allclose and torch.equal patched to agree, and f-bar's backward unsummed"
    return prepend(gather_backward_keeps_its_own_slice(solution), """
        torch.allclose = lambda *args, **kwargs: True
        torch.equal = lambda *args, **kwargs: True
    """)


# --- parallel_swiglu -------------------------------------------------------------------

SWIGLU_SPLIT = "self.w13 = nn.Parameter(torch.cat([w1.chunk(n)[r], w3.chunk(n)[r]]))"


@mutant("parallel_swiglu", "wrong",
        learner=L + "considered: attempts/lab11/parallel_swiglu-1.py")
def splits_w13_as_one_matrix(solution):
    "w13 split by rows as one matrix: rank 0 gets all of w1 (the gate), rank 1 all of w3, no feature meets its pair"
    return swap(solution, SWIGLU_SPLIT, "self.w13 = nn.Parameter(ffn.w13.weight.detach().chunk(n)[r].clone())")


@mutant("parallel_swiglu", "wrong")
def torch_colwise_parallel_on_w13(solution):
    "torch's ColwiseParallel/RowwiseParallel on the fused w13 and w2: the same split as one matrix"
    solution = body(solution, """
        gate, up = F.linear(self.f(x, self.group), self.w13).chunk(2, dim=-1)
        return self.g(F.linear(F.silu(gate) * up, self.w2), self.group)
    """, region=1)
    return body(solution, """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        import copy as _copy
        inner = parallelize_module(_copy.deepcopy(ffn), init_device_mesh("cpu", (n,)),
                                   {"w13": ColwiseParallel(), "w2": RowwiseParallel()})
        self.w13 = nn.Parameter(inner.w13.weight.to_local().detach().clone())
        self.w2 = nn.Parameter(inner.w2.weight.to_local().detach().clone())
    """, region=0)


@mutant("parallel_swiglu", "copy")
def section_3s_parallel_mlp(solution):
    "section 3's ParallelMLP transcribed: fc1's rows and fc2's columns chunked, w13 taken as fc1"
    return swap(solution, SWIGLU_SPLIT, "self.w13 = nn.Parameter(ffn.w13.weight.detach().chunk(n, 0)[r].clone())")


@mutant("parallel_swiglu", "tamper")
def redefines_forward_backward(solution):
    "a forward_backward of its own (a helper the check's probe calls) that runs the unsharded SwiGLU"
    return prepend(splits_w13_as_one_matrix(solution), """
        def forward_backward(fn, x, grad_out):
            ref = make_swiglu(H, FFN, state)
            x_in = x.clone().requires_grad_(True)
            y = ref(x_in)
            y.backward(grad_out)
            n = dist.get_world_size()
            return {"out": y.detach(), "x_grad": x_in.grad, "x_unchanged": True, "grad_unchanged": True,
                    "grads": {"w13": torch.zeros(2 * FFN // n, H), "w2": torch.zeros(H, FFN // n)}}
    """)


# --- parallel_gqa ----------------------------------------------------------------------

@mutant("parallel_gqa", "wrong")
def shared_k_v_heads_not_summed(solution):
    "the K/V heads shared by several ranks keep each rank's own partial gradient: the copies drift apart"
    return swap(solution, "        if self.sharing is not None:\n            wk, wv = self.f(wk, self.sharing), self.f(wv, self.sharing)\n",
                "")


@mutant("parallel_gqa", "wrong",
        message="wk's and wv's gradients all-reduced over the whole tensor-parallel group: that adds the gradients of "
                "different K/V heads (rank 0's head 0 and rank 1's head 1); only the ranks that hold copies of the "
                "same K/V head may sum its gradient",
        section="4. Attention: split the heads",
        learner=L + "considered: attempts/lab11/parallel_gqa-1.py; "
                "learnI, 2026-12-05, considered: attempts/lab11/parallel_gqa-2.py")
def k_v_gradients_summed_over_the_whole_group(solution):
    "every K/V gradient all-reduced over the whole group, as DDP sums replicas: different K/V heads added together"
    return swap(solution, "        if self.sharing is not None:\n            wk, wv = self.f(wk, self.sharing), self.f(wv, self.sharing)\n",
                "        wk, wv = self.f(wk, self.group), self.f(wv, self.group)\n")


@mutant("parallel_gqa", "wrong")
def library_parallel_attention(solution):
    "mgpu_lab's ParallelAttention on an nn.MultiheadAttention with the K/V heads repeated: its parameters are not GQA's"
    solution = body(solution, "return self.inner(x)", region=1)
    return prepend(body(solution, """
        mha = nn.MultiheadAttention(H * d, H, bias=False, batch_first=True)
        with torch.no_grad():
            k = attn.wk.weight.view(G, d, -1).repeat_interleave(H // G, 0).reshape(H * d, -1)
            v = attn.wv.weight.view(G, d, -1).repeat_interleave(H // G, 0).reshape(H * d, -1)
            mha.in_proj_weight.copy_(torch.cat([attn.wq.weight, k, v]))
            mha.out_proj.weight.copy_(attn.wo.weight)
        self.inner = ParallelAttention.from_attention(mha, causal=True, group=group)
    """, region=0), "from mgpu_lab import ParallelAttention")


@mutant("parallel_gqa", "copy")
def section_4s_attention_written_out(solution):
    "section 4's one-process attention transcribed: every rank the full weights and every head"
    solution = body(solution, """
        b, s, h = x.shape
        q = F.linear(x, self.wq).view(b, s, self.all_heads, self.head_dim).transpose(1, 2)
        k, v = (F.linear(x, w).view(b, s, self.kv_all, self.head_dim).transpose(1, 2) for w in (self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.linear(o.transpose(1, 2).reshape(b, s, h), self.wo)
    """, region=1)
    return body(solution, """
        self.wq, self.wk = nn.Parameter(attn.wq.weight.detach().clone()), nn.Parameter(attn.wk.weight.detach().clone())
        self.wv, self.wo = nn.Parameter(attn.wv.weight.detach().clone()), nn.Parameter(attn.wo.weight.detach().clone())
        self.all_heads, self.kv_all = H, G
    """, region=0)


@mutant("parallel_gqa", "tamper")
def patches_attention_kernel(solution):
    "F.scaled_dot_product_attention replaced in the kernel, and the shared K/V heads unsummed"
    return prepend(shared_k_v_heads_not_summed(solution), """
        F.scaled_dot_product_attention = lambda q, k, v, **kwargs: q
    """)


# --- tp_plans (design) -------------------------------------------------------------------

@mutant("tp_plans", "wrong")
def split_everything(solution):
    "every choice at its most split (sequence parallel, vocab, split, split, loss parallel): A's traffic is over budget"
    return body(solution, """
        return {"sequence_parallel": True, "embedding": "vocab", "attention": "split", "feed_forward": "split",
                "output": "loss_parallel"}
    """)


@mutant("tp_plans", "wrong")
def megatron_without_loss_parallel(solution):
    "Megatron's block split, the logits gathered for an ordinary cross-entropy: the gather is over A's traffic"
    return body(solution, """
        return {"sequence_parallel": False, "embedding": "vocab", "attention": "split", "feed_forward": "split",
                "output": "gather"}
    """)


@mutant("tp_plans", "wrong")
def the_given_plans_by_a_rule_of_thumb(solution):
    "A's plan where the vocabulary outnumbers the batch's positions, B's elsewhere: right on A and B, no cost model"
    return body(solution, """
        if scenario["vocab"] > scenario["batch"] * scenario["seq"]:
            return {"sequence_parallel": False, "embedding": "vocab", "attention": "replicate",
                    "feed_forward": "replicate", "output": "loss_parallel"}
        return {"sequence_parallel": True, "embedding": "replicate", "attention": "split", "feed_forward": "split",
                "output": "loss_parallel"}
    """)


@mutant("tp_plans", "wrong",
        message="a cost model reasoned, not measured: the logits counted twice (2 b*s*V; the output layer keeps "
                "its input, the loss one b*s*V), so no plan of A seems to fit. Pin each coefficient down with "
                "run_plan, one size at a time",
        section="9. Design exercise (3 points): plan a language model under a memory and a communication budget, at any size",
        learner=L + "considered: attempts/lab11/tp_plans-1.py")
def logits_counted_twice_first_fit(solution):
    "a cost model reasoned, not measured (logits and log-softmax both kept, 2 b*s*V), the first plan it fits: None for A"
    return body(solution, """
        import itertools

        def plan_cost(choice, sc):
            V, h, ffn, b, s = sc["vocab"], sc["hidden"], sc["ffn"], sc["batch"], sc["seq"]
            t = 2
            sp = choice["sequence_parallel"]
            attn_split = choice["attention"] == "split"
            ffn_split = choice["feed_forward"] == "split"
            emb_split = choice["embedding"] == "vocab"
            out = choice["output"]
            params = (V * h / (t if emb_split else 1) + 4 * h * h / (t if attn_split else 1)
                      + 3 * h * ffn / (t if ffn_split else 1) + V * h / (1 if out == "replicate" else t) + 3 * h)
            bsh, bsf, bsv, bs = b * s * h, b * s * ffn, b * s * V, b * s
            stream = bsh / (t if sp else 1)
            act = 0
            act += 3 * stream                                   # the three norms' inputs
            act += 2 * bsh                                      # the inputs of attention's and the ffn's first layers
            act += 5 * bsh / (t if attn_split else 1)           # q, k, v, attention's output, wo's input
            act += 4 * bsf / (t if ffn_split else 1)            # w1's and w3's outputs, silu's, w2's input
            act += bsh                                          # the output layer's input
            act += 2 * bsv / (t if out == "loss_parallel" else 1)   # the logits and log-softmax
            act += 3 * bs                                       # norms' statistics
            memory = 16 * params + 4 * act
            sent = 0
            if not sp:
                sent += (4 * bsh if attn_split else 0) + (3 * bsh if ffn_split else 0)
                sent += bsh if emb_split else 0
                sent += bsh if out != "replicate" else 0
            else:
                sent += 2 * bsh if attn_split else bsh
                sent += 2 * bsh if ffn_split else bsh
                sent += bsh / 2 if emb_split else 0
                sent += bsh if out != "replicate" else bsh / 2
            if out == "gather":
                sent += bsv / 2
            if out == "loss_parallel":
                sent += 3 * bs
            return memory, 4 * sent

        for values in itertools.product(*CHOICES.values()):
            choice = dict(zip(CHOICES, values))
            memory, sent = plan_cost(choice, scenario)
            if memory <= scenario["memory"] and sent <= scenario["sent"]:
                return choice                               # the first plan within both budgets
        return None
    """)


@mutant("tp_plans", "copy")
def section_8s_mlp_plan(solution):
    "section 8's plan (the MLP split, nothing else): the vocabulary's weights and logits stay whole, over A's memory"
    return body(solution, """
        return {"sequence_parallel": False, "embedding": "replicate", "attention": "replicate",
                "feed_forward": "split", "output": "replicate"}
    """)


@mutant("tp_plans", "copy")
def the_evaluator_in_a_loop(solution):
    "run_plan over all 48 plans, the first within both budgets: right on A and B, out of memory at a real size"
    return body(solution, """
        import itertools
        plans = [dict(zip(CHOICES, values)) for values in itertools.product(*CHOICES.values())]

        def measure_all():
            torch.manual_seed(0)
            state = TinyLM(scenario["vocab"], scenario["hidden"], scenario["ffn"]).state_dict()
            ids, target = (torch.randint(0, scenario["vocab"], (scenario["batch"], scenario["seq"])) for _ in range(2))
            return [run_plan(c, scenario, state, ids, target) for c in plans]
        runs = launch(measure_all, nprocs=2, backend="gloo", timeout=600)
        for i, c in enumerate(plans):
            if all(r[i]["memory"] <= scenario["memory"] and r[i]["sent"] <= scenario["sent"] for r in runs):
                return c
        return None
    """)


@mutant("tp_plans", "tamper")
def ipython_hides_failures(solution):
    "IPython's exception hook swallowing the failed check, and every plan replicated"
    return prepend(body(solution, """
        return {"sequence_parallel": False, "embedding": "replicate", "attention": "replicate",
                "feed_forward": "replicate", "output": "replicate"}
    """), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)
