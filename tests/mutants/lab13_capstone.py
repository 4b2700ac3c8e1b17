"""Mutants of lab 13: parallelize (torchtitan's order), rank_batches (the data plan) and cost_model (design)."""
from . import body, mutant, prepend, swap

LAB = "13_capstone"

RECOMPUTE = ("        block = checkpoint_wrapper(block, context_fn=functools.partial(create_selective_checkpoint_contexts, "
             "policy))\n")
KEEP = "keep = {torch.ops.aten.mm.default, torch.ops._c10d_functional.reduce_scatter_tensor.default}"
UNITS = ("    fully_shard([model.tok, model.pos], mesh=dp)                   # ... the embeddings (used first), ...\n"
         "    fully_shard([model.norm, model.output], mesh=dp)               # ... the head (used last), then the root\n")


# --- parallelize -------------------------------------------------------------------

@mutant("parallelize", "wrong",
        message="lab 11's plan in every block (wo and w2 all-reduced), no sequence or loss parallelism: the norms see "
                "the whole sequence, the logits the whole vocabulary, and the forward all-reduces")
def the_old_recipe_without_sequence_parallelism(solution):
    "the plan this lab gave before: colwise/rowwise in each block, all-reduces, the root as one unit for the rest"
    return body(solution, """
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()}
        keep = {torch.ops.aten.mm.default, torch.ops._c10d_functional.all_reduce.default,
                torch.ops._c10d_functional.wait_tensor.default}

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

        for name, block in list(model.layers.items()):
            parallelize_module(block, mesh["tp"], plan)
            block = checkpoint_wrapper(block, context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
            fully_shard(block, mesh=mesh["dp"])
            model.layers[name] = block
        fully_shard(model, mesh=mesh["dp"])
        return model
    """)


@mutant("parallelize", "wrong",
        message="the policy saves the attention's batched products (aten.bmm): every layer keeps its [b, a, s, s] "
                "tensors, what selective recompute exists to drop")
def saves_the_attention_products(solution):
    "aten.bmm.default saved with the linear products: the s x s scores kept"
    return swap(solution, KEEP, KEEP[:-1] + ", torch.ops.aten.bmm.default}")


@mutant("parallelize", "wrong",
        message="the policy saves the linear products only: recomputing a block runs its reduce-scatters again, "
                "sending their bytes a second time")
def recomputes_the_reduce_scatters(solution):
    "only aten.mm saved: the sub-blocks' reduce-scatters run again in backward"
    return swap(solution, KEEP, "keep = {torch.ops.aten.mm.default}")


@mutant("parallelize", "wrong",
        message="the policy saves the reduce-scatters only: every linear product is recomputed in backward, the "
                "FLOPs selective recompute exists to save (expert13's A1)")
def recomputes_the_linear_products(solution):
    "only reduce_scatter_tensor saved: each block's aten.mm run again in backward"
    return swap(solution, KEEP, "keep = {torch.ops._c10d_functional.reduce_scatter_tensor.default}")


@mutant("parallelize", "wrong",
        message="nothing saved: each block recomputed whole, its reduce-scatters run again in backward (no selective "
                "policy, or a set of operator packets, torch.ops.aten.mm, never equal to the overload the policy "
                "gets, aten.mm.default)",
        learner="learnF, 2026-12-05, considered: attempts/lab13/parallelize-1.py")
def full_recompute(solution):
    "a full recompute of each block: backward runs the reduce-scatters again"
    return swap(solution, "context_fn=functools.partial(create_selective_checkpoint_contexts, policy)", "")


@mutant("parallelize", "wrong",
        message="the plan names the linear layers of this notebook's GPT: a model with another feed-forward (LLaMA's "
                "w1, w2, w3) keeps a layer unsplit; derive the plan from the model's modules")
def the_visible_models_names(solution):
    "the block plan written out for GPT's six linear layers, not derived from the block"
    return swap(solution, """        for sub in ("attention", "feed_forward"):
            for lname, linear in getattr(block, sub).named_children():
                if isinstance(linear, nn.Linear):                  # wo and w2 lead back to the residual stream
                    plan[f"{sub}.{lname}"] = (RowwiseParallel(output_layouts=Shard(1)) if lname in ("wo", "w2")
                                              else ColwiseParallel())
""", """        plan.update({"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                     "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                     "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
""")


@mutant("parallelize", "wrong",
        message="the output projection gathers the logits (output_layouts=Replicate()): each rank holds the whole "
                "vocabulary's logits, which loss parallelism exists to avoid")
def gathers_the_logits(solution):
    "the output projection colwise, its logits all-gathered whole before the loss"
    return swap(solution, '"output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)',
                '"output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())')


@mutant("parallelize", "wrong",
        message="the embeddings, the final norm and the output projection left to the root's unit: gathered for the "
                "whole step, where torchtitan gives the embeddings and the head units of their own")
def the_root_holds_embeddings_and_head(solution):
    "fully_shard of each block and of the root only"
    return swap(solution, UNITS, "")


@mutant("parallelize", "wrong",
        message="each column-parallel projection gathers its own input (ColwiseParallel(input_layouts=Shard(1))): "
                "the same sequence is all-gathered once per projection (wq, wk and wv: three times per attention), "
                "where one gather at the sub-block's input (PrepareModuleInput) serves them all",
        section="2. Exercise (a) (5 points): `parallelize`, torchtitan's plan",
        learner="learn13, 2026-12-05, considered: attempts/lab13/parallelize-2.py")
def each_projection_gathers_its_input(solution):
    "no PrepareModuleInput on the sub-blocks: each colwise linear all-gathers the sequence itself, once per projection"
    solution = swap(solution, '"attention": gather, "feed_forward": gather}', "}")
    return swap(solution, "else ColwiseParallel())", "else ColwiseParallel(input_layouts=Shard(1)))")


@mutant("parallelize", "wrong",
        message="the norms left plain (no SequenceParallel): on the sequence shard they compute the right values, but "
                "each norm weight's gradient is only its rank's positions' share, never summed over tp",
        section="2. Exercise (a) (5 points): `parallelize`, torchtitan's plan",
        learner="learn13, 2026-12-05, considered: attempts/lab13/parallelize-3.py")
def plain_norms_on_the_sequence_shard(solution):
    "the RMSNorms not sequence-parallel: their weights plain over tp, their gradients partial sums"
    solution = swap(solution, '        "norm": SequenceParallel(),\n', "")
    return swap(solution, 'plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),\n                ',
                "plan = {")


@mutant("parallelize", "wrong")
def the_root_sharded_first(solution):
    "fully_shard(model) before the blocks: FSDP's units must be made bottom-up"
    return swap(swap(solution, "    fully_shard(model, mesh=dp)\n", ""),
                "    for name, block in list(model.layers.items()):\n",
                "    fully_shard(model, mesh=dp)\n    for name, block in list(model.layers.items()):\n")


@mutant("parallelize", "wrong")
def no_recompute(solution):
    "TP and FSDP, but no recompute: every activation kept for backward"
    return swap(solution, RECOMPUTE, "")


@mutant("parallelize", "wrong")
def fsdp_before_tp(solution):
    "fully_shard first, then the TP plan: parallelize_module meets weights already sharded over dp"
    return swap(solution, "        parallelize_module(block, tp, plan)\n",
                "        fully_shard(block, mesh=dp)\n        parallelize_module(block, tp, plan)\n")


@mutant("parallelize", "copy")
def copies_lab_11s_fsdp_x_tp(solution):
    "lab 11's FSDP x TP cell: the feed-forward split, the attention whole, no recompute"
    return body(solution, """
        for name, block in list(model.layers.items()):
            parallelize_module(block, mesh["tp"], {"feed_forward.w1": ColwiseParallel(),
                                                   "feed_forward.w2": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model
    """)


@mutant("parallelize", "tamper")
def patches_allclose(solution):
    "torch.allclose patched to agree, and no recompute"
    return prepend(swap(solution, RECOMPUTE, ""), """
        torch.allclose = lambda *args, **kwargs: True
    """)


# --- rank_batches ------------------------------------------------------------------

@mutant("rank_batches", "wrong")
def global_rank_as_the_row(solution):
    "the global rank as the data-parallel index: tensor-parallel partners read different samples"
    return swap(solution, "row = rank // tp", "row = rank")


@mutant("rank_batches", "wrong")
def equal_parts_only(solution):
    "only batches that split into equal micro-batches: a ValueError for 16 samples over 3 rows, which a plan can split"
    return body(solution, """
        if global_batch % (dp * micro_batch):
            raise ValueError("the rows' micro-batches do not split the batch evenly")
        per_row = global_batch // dp
        first = step * global_batch + rank // tp * per_row
        return [list(range(first + k, first + k + micro_batch)) for k in range(0, per_row, micro_batch)]
    """)


@mutant("rank_batches", "wrong")
def micro_batches_counted_per_row(solution):
    "each row its own fewest micro-batches: a smaller row runs fewer, and the others wait in its missing collective"
    return swap(solution, "K = -(-(base + (extra > 0)) // micro_batch)", "K = -(-(base + (row < extra)) // micro_batch)")


@mutant("rank_batches", "wrong")
def rows_filled_in_order(solution):
    "rows filled in order, ceil(G / dp) samples each, the last taking what is left: unbalanced, and its K differs"
    return body(solution, """
        per = -(-global_batch // dp)
        first = step * global_batch + rank // tp * per
        last = min(first + per, (step + 1) * global_batch)
        return [list(range(a, min(a + micro_batch, last))) for a in range(first, last, micro_batch)]
    """)


@mutant("rank_batches", "wrong",
        learner="learn13b, 2026-12-05, later attempt: attempts/lab13/rank_batches-2.py")
def no_error_when_a_row_is_too_small(solution):
    "no ValueError where the smallest row has fewer samples than K: it gets an empty micro-batch"
    return swap(solution, "if base < K:", "if False:")


@mutant("rank_batches", "wrong",
        message="each row cut into micro-batches of micro_batch samples, as a DataLoader batches: a row one sample "
                "larger runs one micro-batch more (16 over 3 rows of at most 5: 2, 1, 1), the other rows wait in its "
                "missing reduce-scatter; and a ValueError only where a row is empty",
        section="3. Exercise (b) (3 points): the data plan, whatever the layout",
        learner="learn13b, 2026-12-05, first attempt: attempts/lab13/rank_batches-1.py")
def rows_chunked_by_micro_batch(solution):
    "each row chunked into micro_batch-sized pieces: rows of unequal size run different numbers of micro-batches"
    return body(solution, """
        d = rank // tp
        base, extra = divmod(global_batch, dp)
        if base == 0:
            raise ValueError(f"global batch {global_batch} < dp={dp}: a row would read no sample")
        start = step * global_batch + d * base + min(d, extra)
        size = base + (1 if d < extra else 0)
        samples = list(range(start, start + size))
        return [samples[i:i + micro_batch] for i in range(0, size, micro_batch)]
    """)


@mutant("rank_batches", "reference")
def the_librarys_batch_plan_over_every_rank(solution):
    "mgpu_lab.batch_plan over all dp·tp ranks, as for plain data parallelism: tensor-parallel partners read apart"
    return body(solution, """
        from mgpu_lab import batch_plan
        plan = batch_plan(global_batch, dp * tp, micro_batch)
        row = rank
        first = step * global_batch + sum(plan.shares[:row])
        out = []
        for size in plan.micro_batches[row]:
            out.append(list(range(first, first + size)))
            first += size
        return out
    """)


@mutant("rank_batches", "copy")
def copies_the_one_process_batch(solution):
    "section 1's one-process batch, the whole step on every rank as one micro-batch"
    return body(solution, """
        return [list(range(step * global_batch, (step + 1) * global_batch))]
    """)


@mutant("rank_batches", "tamper")
def patches_sorted(solution):
    "builtins.sorted patched to return the step's samples, and every row reading the same ones"
    return prepend(swap(solution, "row = rank // tp", "row = 0"), """
        import builtins
        builtins.sorted = lambda xs: list(range(min(xs), min(xs) + len(xs)))
    """)


# --- cost_model --------------------------------------------------------------------
# The design is judged by measurement: the visible check holds predict to the text's measured worked example
# (dp=2, tp=2, m=2, selective), the hidden one to runs of section 2's plan that the judge makes and to 7B layouts.

@mutant("cost_model", "wrong",
        message="FSDP's all-gathers and reduce-scatter counted once per step: FSDP2 issues them every micro-batch "
                "(section 5 shows it) unless told otherwise (set_requires_gradient_sync, reshard_after_forward)")
def fsdp_once_per_step(solution):
    "FSDP's collectives once per step whatever m (the cost model this lab used to dictate)"
    return swap(solution, "dp_sent = m * (dp - 1)", "dp_sent = (dp - 1)")


@mutant("cost_model", "wrong",
        message="selective recompute counted as sending nothing more: its policy saves the reduce-scatters but not "
                "the gathered inputs, so backward all-gathers each sub-block's input again (2 per block)")
def selective_recompute_gathers_nothing_again(solution):
    "selective recompute counted as no recompute: the 2 all-gathers it runs again per block forgotten"
    return swap(solution, 'tp_collectives = {"none": (4, 4), "selective": (6, 4), "full": (6, 5)}',
                'tp_collectives = {"none": (4, 4), "selective": (4, 4), "full": (6, 5)}')


@mutant("cost_model", "wrong",
        message="gloo's reduce-scatter counted as a ring's, (dp-1)/dp of the tensor: gloo sends what an all-reduce "
                "sends, twice that (section 5, tests/test_wire.py)")
def ring_reduce_scatter_on_gloo(solution):
    "gloo's reduce-scatter as a ring's (N-1)/N"
    return swap(solution, 'gloo = 2 if cluster["backend"] == "gloo" else 1', "gloo = 1")


@mutant("cost_model", "wrong",
        message="the state without the optimizer's: Adam keeps two moments per parameter, 8 bytes more in fp32")
def state_without_the_optimizer(solution):
    "parameters and gradients only: Adam's two moments forgotten"
    return swap(solution, "state = 16 * (L * block + root)", "state = 8 * (L * block + root)")


@mutant("cost_model", "wrong",
        message="FSDP's padding forgotten: each parameter's rows are padded to a multiple of dp, and rank 0 holds "
                "the larger piece (the 91-row embedding and output projection as 23 rows each on dp = 4)")
def fsdp_without_padding(solution):
    "each parameter divided evenly by dp, no padding"
    return swap(solution, "sum(-(-rows // dp) * cols", "sum(rows / dp * cols")


@mutant("cost_model", "wrong",
        message="a full recompute repeats both forward reduce-scatters: torch's checkpoint stops recomputing at "
                "the last tensor backward needs (w2's input), so w2's reduce-scatter is not run again",
        learner="learn13, 2026-12-05, considered: attempts/lab13/cost_model-2.py")
def full_recompute_repeats_both_reduce_scatters(solution):
    "full recompute counted as the whole forward again (both reduce-scatters), not torch's early stop"
    return swap(solution, '"full": (6, 5)}', '"full": (6, 6)}')


@mutant("cost_model", "wrong")
def choice_ignores_memory(solution):
    "choose_layout takes the fastest layout whether or not it fits in the memory"
    return swap(solution, 'if p["state"] + p["activations"] <= cluster["memory"] and (best is None',
                "if (best is None")


@mutant("cost_model", "wrong")
def measures_instead_of_predicting(solution):
    """attack: the evaluator in a loop: predict runs the small layouts with section 2's parallelize and reads the
    wire meter, and falls back on the per-step model without the recompute's gathers where it cannot run (the 7B layouts)"""
    solution = swap(solution, "dp_sent = m * (dp - 1)", "dp_sent = (dp - 1)")
    solution = swap(solution, 'tp_collectives = {"none": (4, 4), "selective": (6, 4), "full": (6, 5)}',
                    'tp_collectives = {"none": (4, 4), "selective": (4, 4), "full": (4, 4)}')
    return swap(solution, "    return dict(seconds=seconds, sent=dp_sent + tp_sent,", """    if cluster["backend"] == "gloo":
        def run():
            from torch.distributed.tensor.parallel import loss_parallel
            from mgpu_lab.measure.wire import WireMeter
            net = parallelize(GPT(), init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")))
            opt = torch.optim.AdamW(net.parameters(), lr=LR)
            row = dist.get_rank() // tp * (global_batch // dp)
            for step in range(2):
                opt.zero_grad()
                dist.barrier()
                with WireMeter() as wire:
                    for k in range(m):
                        lo = step * global_batch + row + k * b
                        with loss_parallel():
                            (lm_loss(net, *sample(range(lo, lo + b))) / m).backward()
                opt.step()
            return wire.sent
        sent = launch(run, nprocs=4, backend="gloo")[0]
        return dict(seconds=seconds, sent=0.985 * sent, state=state, activations=0.0)
    return dict(seconds=seconds, sent=dp_sent + tp_sent,""")


@mutant("cost_model", "copy")
def returns_the_worked_example(solution):
    "the text's measured worked example, whatever the layout"
    return body(solution, """
        return dict(seconds=1.0, sent=0.99 * 2086496, state=451072, activations=0.0)
    """)


@mutant("cost_model", "tamper")
def patches_abs(solution):
    "builtins.abs patched to 0 (the judge's tolerance), and FSDP once per step"
    return prepend(swap(solution, "dp_sent = m * (dp - 1)", "dp_sent = (dp - 1)"), """
        import builtins
        builtins.abs = lambda x: 0
    """)
