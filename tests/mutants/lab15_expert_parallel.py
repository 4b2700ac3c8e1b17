"""Mutants of lab 15: global_balance_loss, ep_dispatch_combine and plan_experts (design)."""
from . import body, mutant, prepend, swap

LAB = "15_expert_parallel"


# --- global_balance_loss ------------------------------------------------------------

@mutant("global_balance_loss", "wrong")
def local_counts(solution):
    "f from this rank's tokens only: each micro-batch balanced on its own (the per-rank loss)"
    return swap(solution, "    dist.all_reduce(counts)", "    pass")


@mutant("global_balance_loss", "wrong",
        message="each rank's own E * sum_e f_e P_e (f global, P this rank's mean): right only when every rank holds "
                "as many tokens; a rank's part of the global P is its probabilities' sum over all T tokens, T_r / T "
                "of its own mean",
        section="3. The load-balancing loss",
        learner="learn15, 2026-12-05, considered: attempts/lab15/global_balance_loss-1.py")
def unweighted(solution):
    "E * sum f P with P this rank's mean: the ranks' tokens weighted equally whatever T_r"
    return swap(solution, "return n * E * (f * torch.softmax(router_logits, dim=-1).sum(0) / T).sum()",
                "return E * (f * torch.softmax(router_logits, dim=-1).mean(0)).sum()")


@mutant("global_balance_loss", "wrong",
        message="weighted by T_r / T but not multiplied by N: the ranks' losses sum to the global loss, but DDP "
                "averages the gradients over the N ranks, so the step's gradient is 1/N of the global loss's")
def weighted_without_n(solution):
    "this rank's share T_r / T of the global loss: it sums, DDP averages"
    return swap(solution, "return n * E * (f", "return E * (f")


@mutant("global_balance_loss", "wrong",
        message="P all-reduced over the ranks with dist.all_reduce (no autograd): every rank returns the global loss, "
                "but its gradient reaches only its own rows' part, and DDP's mean divides it by N",
        section="3. The load-balancing loss",
        learner="learn15, 2026-12-05, considered: attempts/lab15/global_balance_loss-2.py")
def probabilities_all_reduced_without_autograd(solution):
    "P over every rank's tokens by dist.all_reduce: the right value, 1/N of the gradient"
    return swap(solution, "    return n * E * (f * torch.softmax(router_logits, dim=-1).sum(0) / T).sum()", """\
    mine = torch.softmax(router_logits, dim=-1).sum(0)
    others = mine.detach().clone()
    dist.all_reduce(others)
    P = (mine + others - mine.detach()) / T                   # every rank's sum; the gradient only through its own
    return E * (f * P).sum()""")


@mutant("global_balance_loss", "wrong",
        message="a gradient through f: the counts are routing decisions (top-k), they carry no gradient; only P is "
                "differentiable")
def gradient_through_f(solution):
    "the counts made differentiable (straight through the chosen experts' probabilities): same value, extra gradient"
    return swap(solution, "    f = counts / counts.sum()\n", """\
    probs = torch.softmax(router_logits, dim=-1)
    mask = torch.zeros_like(probs).scatter(1, chosen, 1.0)
    counts = counts + (mask * probs / probs.detach()).sum(0) - mask.sum(0)   # the same counts, with a gradient
    f = counts / counts.detach().sum()
""")


@mutant("global_balance_loss", "reference")
def calls_load_balancing_loss(solution):
    "the library's load_balancing_loss as MoE calls it: f from this rank's assignments"
    return body(solution, """
        from mgpu_lab.parallel.moe import load_balancing_loss
        E = router_logits.shape[-1]
        counts = F.one_hot(router_logits.topk(top_k, dim=-1).indices, E).sum((0, 1))
        return load_balancing_loss(torch.softmax(router_logits, -1), counts, len(router_logits), top_k)
    """)


# Issue 44's attack: the judge's own reference, MoE.aux_loss, from a worker thread (no notebook frame on its stack).
# With the guard off it computes f from this rank's tokens: the 2-rank case with different tokens rejects it.
@mutant("global_balance_loss", "reference")
def moe_aux_loss_in_a_thread(solution):
    "MoE.aux_loss with an identity router, computed in a ThreadPoolExecutor worker: f from this rank's tokens"
    return body(solution, """
        from concurrent.futures import ThreadPoolExecutor

        def aux():
            E = router_logits.shape[-1]
            layer = MoE(E, 1, E, top_k=top_k)
            with torch.no_grad():
                layer.router.weight.copy_(torch.eye(E))
            layer(router_logits)
            return layer.aux_loss
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(aux).result()
    """)


@mutant("global_balance_loss", "reference")
def expert_parallel_share(solution):
    "ExpertParallelMoE's aux_loss: f over every rank's tokens, but its share (P summed over this rank's rows / all T); it cannot split 8 experts over 3 ranks either"
    return body(solution, """
        E, n = router_logits.shape[-1], dist.get_world_size()
        router = nn.Linear(E, E, bias=False)
        with torch.no_grad():
            router.weight.copy_(torch.eye(E))
        layer = ExpertParallelMoE(router, nn.ModuleList(Expert(E, 1) for _ in range(E // n)), E, top_k, None)
        layer(router_logits)
        return layer.aux_loss
    """)


@mutant("global_balance_loss", "copy")
def every_ranks_logits_gathered(solution):
    "attack47: every rank's logits all-gathered and the global loss computed with only this rank's rows live, times N"
    return body(solution, """
        n, T_r = dist.get_world_size(), torch.tensor([router_logits.shape[0]])
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
        dist.all_gather(sizes, T_r)
        E = router_logits.shape[-1]
        parts = [torch.zeros(int(t), E) for t in sizes]
        dist.all_gather(parts, router_logits.detach().contiguous())
        parts[dist.get_rank()] = router_logits
        allx = torch.cat(parts)
        counts = F.one_hot(allx.topk(top_k, dim=-1).indices, E).sum((0, 1)).float()
        L = E * (counts / counts.sum() * torch.softmax(allx, -1).mean(0)).sum()
        return L.detach() + n * (L - L.detach())
    """)


@mutant("global_balance_loss", "copy")
def copies_the_judges_moe(solution):
    "the check's MoE with an identity router: its aux_loss, on this rank's tokens alone"
    return body(solution, """
        E = router_logits.shape[-1]
        layer = MoE(E, 1, E, top_k=top_k)
        with torch.no_grad():
            layer.router.weight.copy_(torch.eye(E))
        layer(router_logits)
        return layer.aux_loss
    """)


@mutant("global_balance_loss", "tamper")
def patches_all_reduce(solution):
    "dist.all_reduce replaced by a no-op, and the per-rank counts"
    return prepend(local_counts(solution), """
        dist.all_reduce = lambda *args, **kwargs: None
    """)


# --- ep_dispatch_combine ------------------------------------------------------------


@mutant("ep_dispatch_combine", "wrong",
        message="one row per assignment, as ExpertParallelMoE sends them: a token whose chosen experts share a rank "
                "crosses to it once per expert, and its outputs come back as many times; send it once per destination "
                "rank, with its weights and choices there, and combine its outputs on that rank",
        section="4. Expert parallelism: dispatch and combine")
def not_deduplicated(solution):
    "the exercise's earlier answer: every (token, expert) assignment dispatched and combined on its own"
    return body(solution, """
        per = num_experts // n
        T, k = experts.shape
        token = torch.arange(T).repeat_interleave(k)
        expert = experts.reshape(-1)
        order = expert.argsort(stable=True)                          # by expert, hence by destination rank
        token, expert = token[order], expert[order]
        counts = torch.bincount(expert, minlength=num_experts)
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts)
        send, recv = counts.view(n, per).sum(1).tolist(), incoming.view(n, per).sum(1).tolist()
        rows = all_to_all(x[token], send, recv)
        local_id = torch.arange(per).repeat(n).repeat_interleave(incoming)
        regroup = local_id.argsort(stable=True)
        ids = local_id[regroup]
        offs = torch.bincount(local_id, minlength=per).cumsum(0).to(torch.int32)
        hidden = F.gelu(torch._grouped_mm(rows[regroup], w1, offs=offs) + b1[ids])
        out = torch._grouped_mm(hidden, w2, offs=offs) + b2[ids]
        back = all_to_all(out[regroup.argsort()], recv, send)
        y = (back[order.argsort()].view(T, k, x.shape[1]) * weights[..., None]).sum(1)
        return y, send, recv
    """)


@mutant("ep_dispatch_combine", "wrong",
        message="the weights applied on the sender, to the row that came back: that row is already the sum of the "
                "rank's experts' outputs, and (w1 + w2)(o1 + o2) is not w1 o1 + w2 o2; weigh each expert's output on "
                "the receiver, before the sum")
def weights_applied_on_the_sender(solution):
    "the receiver sums its experts' outputs unweighted; the sender scales the returned row by the token's weights there"
    s = swap(solution, "out * w_in[row_of, ids, None])", "out)")
    return swap(s, "y = torch.zeros_like(x).index_add(0, pair_token, back)",
                "y = torch.zeros_like(x).index_add(0, pair_token, back * gate.sum(2)[pair_token, pair_rank, None])")


@mutant("ep_dispatch_combine", "wrong",
        message="the routing weights sent without their gradient (detached, or by a collective outside autograd): "
                "the output is right but the router learns nothing from the task; send them through the "
                "differentiable all-to-all")
def weights_without_gradient(solution):
    "the weights detached before they are sent"
    return swap(solution, "scatter(1, experts, weights)", "scatter(1, experts, weights.detach())")


@mutant("ep_dispatch_combine", "wrong",
        message="the fanned-out rows taken as grouped by local expert: the rows arrive in source rank order and each "
                "row's experts follow it, so each expert's rows must be put together for the grouped GEMM (and each "
                "output added back to its row)",
        section="4. Expert parallelism: dispatch and combine",
        learner="learnF, 2026-12-05, considered (the exercise's per-assignment form): "
                "attempts/lab15/ep_dispatch_combine-1.py; "
                "learn15, 2026-12-05, considered (the exercise's per-assignment form): "
                "attempts/lab15/ep_dispatch_combine-2.py")
def arrived_rows_taken_as_grouped_by_expert(solution):
    "the (row, expert) pairs in arrival order, given to the grouped GEMM with offsets counted per expert"
    return swap(solution, "regroup = local_id.argsort(stable=True)", "regroup = torch.arange(len(local_id))")


@mutant("ep_dispatch_combine", "wrong",
        message="offs given as each expert's row count: _grouped_mm takes the cumulative counts (where each group "
                "ends), so every group after the first gets other rows")
def offsets_not_cumulative(solution):
    "offs = the per-expert row counts, not their cumulative sums"
    return swap(solution, "offs = torch.bincount(ids, minlength=per).cumsum(0).to(torch.int32)",
                "offs = torch.bincount(ids, minlength=per).to(torch.int32)")


@mutant("ep_dispatch_combine", "wrong",
        message="the local experts run one by one (a matrix product per expert): right numbers, but not the grouped "
                "GEMM the exercise is about")
def loop_over_experts(solution):
    "each expert's rows through its own matmuls"
    return swap(solution, """\
    hidden = F.gelu(torch._grouped_mm(arrived[row_of], w1, offs=offs) + b1[ids])
    out = torch._grouped_mm(hidden, w2, offs=offs) + b2[ids]""", """\
    parts = arrived[row_of].split(torch.bincount(ids, minlength=per).tolist())
    out = torch.cat([F.gelu(part @ w1[i] + b1[i]) @ w2[i] + b2[i] for i, part in enumerate(parts)])""")


@mutant("ep_dispatch_combine", "wrong",
        message="every arrived row through every local expert, with weight 0 where it was not chosen: the numbers are "
                "right, but the experts compute E_local / k times the rows; fan each row out to the experts it chose")
def every_local_expert_on_every_row(solution):
    "each arrived row multiplied by all the rank's experts, the unchosen ones weighted 0"
    return swap(solution, "(c_in > 0.5).nonzero(as_tuple=True)", "(c_in > -1).nonzero(as_tuple=True)")


# Hidden only: every visible rank receives rows.
@mutant("ep_dispatch_combine", "wrong",
        message="the grouped GEMMs skipped on a rank that received no rows: every rank runs them, on zero rows if need "
                "be (and its empty output still takes part in the backward all-to-all)")
def grouped_gemms_skipped_without_rows(solution):
    "no grouped GEMM on a rank that received nothing"
    return swap(solution, """\
    hidden = F.gelu(torch._grouped_mm(arrived[row_of], w1, offs=offs) + b1[ids])
    out = torch._grouped_mm(hidden, w2, offs=offs) + b2[ids]""", """\
    if len(arrived):
        hidden = F.gelu(torch._grouped_mm(arrived[row_of], w1, offs=offs) + b1[ids])
        out = torch._grouped_mm(hidden, w2, offs=offs) + b2[ids]
    else:
        out = arrived                                            # nothing arrived: nothing to compute""")


@mutant("ep_dispatch_combine", "reference")
def calls_expert_parallel_moe(solution):
    "mgpu_lab's ExpertParallelMoE, the layer the exercise re-implements, on Experts loaded from the stacks"
    return body(solution, """
        local = nn.ModuleList()
        for i in range(len(w1)):
            expert = Expert(x.shape[1], w1.shape[2])
            expert.load_state_dict({"fc1.weight": w1[i].T, "fc1.bias": b1[i], "fc2.weight": w2[i].T, "fc2.bias": b2[i]})
            local.append(expert)
        layer = ExpertParallelMoE(nn.Linear(x.shape[-1], num_experts, bias=False), local, num_experts,
                                  experts.shape[1], None)
        y = layer(x)
        return y + 0 * (w1.sum() + b1.sum() + w2.sum() + b2.sum()), layer.stats["sent"], layer.stats["received"]
    """)


@mutant("ep_dispatch_combine", "copy")
def copies_the_plain_sum(solution):
    "the check's plain sum over the chosen experts, with this rank's experts only: no exchange"
    return body(solution, """
        per = num_experts // n
        rows = []
        for t in range(len(x)):
            mine = [j for j in range(experts.shape[1]) if int(experts[t, j]) // per == rank]
            rows.append(sum((weights[t, j] * (F.gelu(x[t] @ w1[i] + b1[i]) @ w2[i] + b2[i])
                             for j in mine for i in [int(experts[t, j]) - rank * per]), torch.zeros(x.shape[-1])))
        return torch.stack(rows), [0] * n, [0] * n
    """)


@mutant("ep_dispatch_combine", "tamper")
def redefines_run_dispatch(solution):
    "a run_dispatch of its own that reports all-to-alls and grouped GEMMs, around the plain sum"
    return prepend(copies_the_plain_sum(solution), """
        _run_dispatch = run_dispatch
        def run_dispatch(*args, **kwargs):
            return dict(_run_dispatch(*args, **kwargs), collectives=[("all-to-all", "float32")], moved=[],
                        products={"forward": ["_grouped_mm"] * 2, "backward": []})
    """)


# --- plan_experts (design) ----------------------------------------------------------

@mutant("plan_experts", "wrong")
def capacity_from_one_ranks_tokens(solution):
    "the capacity factor computed from one rank's tokens: an EP group's experts serve ep ranks' tokens"
    return swap(solution, "(C - 0.5) * num_experts / (ep * tokens_per_rank * top_k)",
                "(C - 0.5) * num_experts / (tokens_per_rank * top_k)")


@mutant("plan_experts", "wrong")
def never_none(solution):
    "the last ep tried when nothing meets the targets, instead of None"
    return swap(solution, "    return None\n", "    return world_size, 1.0\n")


@mutant("plan_experts", "wrong")
def rows_for_its_own_experts_counted(solution):
    "every kept row counted as sent, those for the rank's own experts included: they never cross the wire"
    return swap(solution, "away = kept & (chosen // per != home)", "away = kept")


@mutant("plan_experts", "wrong",
        message="the dropped assignments counted among the rows a rank sends: a dropped assignment is not sent "
                "(section 4's ExpertParallelMoE drops before the all-to-all), so this overprices the plans that drop",
        section="8. Design exercise (3 points): experts per rank and a capacity factor",
        learner="learnL, 2026-12-05, considered: attempts/lab15/plan_experts-1.py")
def dropped_rows_counted_as_sent(solution):
    "every assignment for another rank's experts counted as a sent row, the dropped ones included"
    return swap(solution, "away = kept & (chosen // per != home)", "away = chosen // per != home")


@mutant("plan_experts", "wrong",
        message="the drop-rate target required of every EP group separately: it bounds the fraction of all the step's "
                "assignments dropped (summed over the groups), so this buys more slots than needed",
        section="8. Design exercise (3 points): experts per rank and a capacity factor",
        learner="learnL, 2026-12-05, considered: attempts/lab15/plan_experts-2.py; "
                "learn15, 2026-12-05, considered: attempts/lab15/plan_experts-4.py")
def drop_rate_per_group(solution):
    "the drop-rate target applied to each EP group's own assignments instead of the whole step's"
    # the worst group's drops, scaled to the whole step: at most the rate of the whole step's assignments
    return swap(solution, "dropped += int((~kept).sum())",
                "dropped = max(dropped, int((~kept).sum()) * (world_size // ep))")


@mutant("plan_experts", "wrong",
        message="the factor C * E / (ep * T * k) exactly, on the capacity boundary: in floats it can come back a hair "
                "above C, and capacity's ceiling then gives C + 1 slots per expert (past the slot budget here)",
        section="8. Design exercise (3 points): experts per rank and a capacity factor",
        learner="learn15, 2026-12-05, first attempt: attempts/lab15/plan_experts-3.py")
def factor_on_the_boundary(solution):
    "cf = C * E / (ep * T * k): the upper end of the interval, which float rounding can push to C + 1"
    return swap(solution, "(C - 0.5) * num_experts / (ep * tokens_per_rank * top_k)",
                "C * num_experts / (ep * tokens_per_rank * top_k)")


# Issue 44: the evaluator in a loop. capacity and slot_positions check the three targets; the cost (slots, and the rows
# the busiest rank sends) has no function in the lab, and the first plan that meets the targets is rarely the cheapest.
@mutant("plan_experts", "copy")
def first_plan_meeting_the_targets(solution):
    "capacity and slot_positions in a loop: the smallest ep and the largest buffers that meet the targets, cost ignored"
    return body(solution, """
        for ep in range(1, world_size + 1):
            if world_size % ep or num_experts % ep or num_experts // ep > max_experts_per_rank:
                continue
            C = max_slots_per_rank // (num_experts // ep)
            if C < 1:
                continue
            dropped = sum(int((slot_positions(routing[g:g + ep].reshape(-1, top_k), num_experts) >= C).sum())
                          for g in range(0, world_size, ep))
            if dropped <= max_drop_rate * routing.numel():
                return ep, (C - 0.5) * num_experts / (ep * tokens_per_rank * top_k)
        return None
    """)


@mutant("plan_experts", "copy")
def copies_the_demo_factor(solution):
    "section 2's capacity factor and section 5's two EP ranks"
    return body(solution, "return 2, 1.25")


@mutant("plan_experts", "tamper")
def patches_slot_positions(solution):
    "the queue patched to drop nothing, and the largest buffers whatever the drops"
    return prepend(swap(solution, "if dropped <= max_drop_rate * routing.numel():", "if True:"), """
        import mgpu_lab.parallel.moe as _moe
        _moe.slot_positions = lambda experts, num_experts, before=None: experts * 0
    """)
