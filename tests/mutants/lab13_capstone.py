"""Mutants of lab 13: parallelize (torchtitan's order), rank_batches (the data plan) and cost_model (design)."""
from . import body, mutant, prepend, swap

LAB = "13_capstone"

RECOMPUTE = "        block = checkpoint_wrapper(block, context_fn=selective)   # 2. recompute: what FSDP's unit will hold\n"


# --- parallelize -------------------------------------------------------------------

@mutant("parallelize", "wrong")
def no_recompute(solution):
    "TP and FSDP, but no recompute: every activation kept for backward"
    return swap(solution, RECOMPUTE, "")


@mutant("parallelize", "wrong")
def fsdp_at_the_root_only(solution):
    "one fully_shard at the root: the whole model is one unit, gathered once and kept through backward"
    return swap(solution, "        fully_shard(block, mesh=mesh[\"dp\"])                       # 3. FSDP: each TP shard "
                          "sharded over dp\n", "")


@mutant("parallelize", "wrong",
        message="nothing saved: each block recomputed whole, backward runs the tensor-parallel all-reduces again (no "
                "selective policy, or a set of operator packets, torch.ops.aten.mm, never equal to the overload the "
                "policy gets, aten.mm.default)",
        learner="learnF, 2026-12-05, considered: attempts/lab13/parallelize-1.py")
def full_recompute(solution):
    "a full recompute of each block: backward runs the tensor-parallel all-reduces again"
    return swap(solution, "checkpoint_wrapper(block, context_fn=selective)", "checkpoint_wrapper(block)")


@mutant("parallelize", "wrong")
def fsdp_before_tp(solution):
    "fully_shard first, then the TP plan: parallelize_module meets weights already sharded over dp"
    return swap(solution, "        parallelize_module(block, mesh[\"tp\"], plan)               # 1. TP",
                "        fully_shard(block, mesh=mesh[\"dp\"])\n        parallelize_module(block, mesh[\"tp\"], plan)  # 1. TP")


@mutant("parallelize", "wrong")
def hsdp_on_each_linear_instead_of_tensor_parallel(solution):
    "no tensor parallelism: each linear layer fully_shard-ed on the whole 2-D mesh (HSDP: replicated over dp, "
    "sharded over tp), so its weight lies on both mesh dimensions, but each rank holds half of it, not a quarter"
    return swap(solution, "        parallelize_module(block, mesh[\"tp\"], plan)               # 1. TP: plain Linear weights "
                          "become DTensors\n",
                "        for linear in (block.attention.wq, block.attention.wk, block.attention.wv, block.attention.wo,\n"
                "                       block.feed_forward.w1, block.feed_forward.w2):\n"
                "            fully_shard(linear, mesh=mesh)\n")


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
def the_same_accumulation_on_every_layout(solution):
    "K micro-batches of the 2 x 2 run on every layout: the global batch changes with dp"
    return swap(solution, "per_row = global_batch // dp", "per_row = global_batch // 2")


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

@mutant("cost_model", "wrong",
        message="FSDP's two all-gathers and reduce-scatter counted once per micro-batch: the cost model counts them "
                "once per step (2N/(tp·pp) bytes each), not m times as the small run of section 5 issues them",
        learner="learnF, 2026-12-05, considered: attempts/lab13/cost_model-1.py")
def fsdp_collectives_per_micro_batch(solution):
    "FSDP's all-gathers and reduce-scatter m times per step: data parallelism looks m times dearer"
    return swap(solution, "dp_time = 3 * (dp - 1) / dp", "dp_time = m * 3 * (dp - 1) / dp")


@mutant("cost_model", "wrong")
def tensor_parallel_always_over_nvlink(solution):
    "TP's all-reduces over NVLink whatever tp: a TP group of 16 spans two nodes"
    return swap(solution, "* act / link(tp)", "* act / cluster[\"nvlink\"]")


@mutant("cost_model", "wrong")
def states_not_sharded_over_dp(solution):
    "the model states divided by tp and pp only (DDP's replicas), not by FSDP's dp"
    return swap(solution, "return seconds, 16 * N / gpus +", "return seconds, 16 * N / (tp * pp) +")


@mutant("cost_model", "wrong")
def no_bubble(solution):
    "the pipeline's bubble forgotten: many stages look free"
    return swap(solution, "compute * (1 + (pp - 1) / m)", "compute")


@mutant("cost_model", "copy")
def returns_the_worked_example(solution):
    "the worked example of the text, whatever the layout"
    solution = body(solution, """
        return dict(dp=8, tp=4, pp=1, m=4, recompute="selective")
    """, region=1)
    return body(solution, """
        return 3.869, 39.9e9
    """)


@mutant("cost_model", "tamper")
def patches_abs(solution):
    "builtins.abs patched to 0 (the judge's tolerance), and TP always over NVLink"
    return prepend(swap(solution, "* act / link(tp)", "* act / cluster[\"nvlink\"]"), """
        import builtins
        builtins.abs = lambda x: 0
    """)
