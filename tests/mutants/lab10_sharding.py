"""Mutants of lab 10: ex1_partition, ex2_sharded_step, ex3_unit_forward, ex4_unit_backward (an all-reduce where a
reduce-scatter is asked), ex5_memory_plan (design), ex6_fully_shard (torch's fully_shard on a tied GPT)."""
from . import body, mutant, prepend, swap

LAB = "10_sharding"


# --- ex1_partition -------------------------------------------------------------------

@mutant("ex1_partition", "wrong")
def greedy_without_sorting(solution):
    "each item, in the given order, onto the lightest rank: [1, 1, 2] on 2 ranks gives 3 where 2 is possible"
    return swap(solution, "for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):",
                "for i in range(len(sizes)):")


@mutant("ex1_partition", "reference")
def calls_partition_parameters_through_an_alias(solution):
    "mgpu_lab's partition_parameters, imported under another name"
    return body(solution, """
        from mgpu_lab.parallel.zero import partition_parameters as balanced
        return balanced(sizes, world_size)
    """)


@mutant("ex1_partition", "copy")
def round_robin_as_the_text_describes(solution):
    "a partition by count (round-robin), the one the exercise's text names: balanced in count, not bytes"
    return body(solution, "return [list(range(r, len(sizes), world_size)) for r in range(world_size)]")


@mutant("ex1_partition", "tamper")
def patches_partition_parameters(solution):
    "mgpu_lab.parallel.zero.partition_parameters patched to agree with a round-robin answer"
    return prepend(round_robin_as_the_text_describes(solution), """
        import mgpu_lab.parallel.zero
        mgpu_lab.parallel.zero.partition_parameters = lambda sizes, n: [list(range(r, len(sizes), n)) for r in range(n)]
    """)


# --- ex2_sharded_step ----------------------------------------------------------------

@mutant("ex2_sharded_step", "wrong")
def steps_but_never_shares(solution):
    "each rank updates its own parameters and stops there: the others keep stale copies, the ranks diverge"
    return body(solution, "local_optimizer.step()")


@mutant("ex2_sharded_step", "reference")
def shares_with_sharded_optimizers_code(solution):
    "ShardedOptimizer's own _share_parameters, called on a stand-in object"
    return body(solution, """
        local_optimizer.step()
        parts = [[p for p, o in zip(params, owner) if o == r] for r in range(world)]
        stand_in = types.SimpleNamespace(partition=parts, process_group=None, rank=rank, param_groups=[], _trainable=[],
                                         parameters_as_bucket_view=False)
        ShardedOptimizer._share_parameters(stand_in)
    """)


@mutant("ex2_sharded_step", "copy")
def all_gathers_like_gather_flat(solution):
    "gather_flat's equal-size all-gather copied to share the owners' parameters: their sizes differ"
    return body(solution, """
        local_optimizer.step()
        mine = torch.cat([p.detach().reshape(-1) for p, o in zip(params, owner) if o == rank])
        full = torch.empty(mine.numel() * world)
        all_gather(full, mine)
        with torch.no_grad():
            for r in range(world):
                chunk, offset = full[r * mine.numel():(r + 1) * mine.numel()], 0
                for p in [p for p, o in zip(params, owner) if o == r]:
                    p.copy_(chunk[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
    """)


@mutant("ex2_sharded_step", "tamper")
def redefines_launch(solution):
    "a launch() of its own that answers with one process's training (a redefined helper the probe uses)"
    return prepend(solution, """
        def launch(fn, nprocs=2, **kwargs):
            weights = {n: p.detach().clone() for n, p in train_full_batch(3).named_parameters()}
            return [{"weights": weights, "owns": 1, "state_for": 1}] * nprocs
    """)


# --- ex3_unit_forward ----------------------------------------------------------------

@mutant("ex3_unit_forward", "wrong")
def saves_the_full_weight(solution):
    "keeps the gathered weight and bias for backward (no second all-gather): nothing is sharded any more"
    return swap(solution, "ctx.save_for_backward(x, shard)", "ctx.save_for_backward(x, shard, weight, bias)")


@mutant("ex3_unit_forward", "reference")
def runs_mgpu_lab_fsdp(solution):
    "mgpu_lab.FSDP around an nn.Linear with this rank's shard copied in (the same flat layout)"
    return body(solution, """
        layer = FSDP(nn.Sequential(nn.Linear(in_features, out_features)))
        layer.flat_groups[0].shard.data.copy_(shard.detach())
        ctx.save_for_backward(x, shard)
        ctx.out_features, ctx.in_features = out_features, in_features
        return layer(x)
    """)


@mutant("ex3_unit_forward", "copy")
def uses_gather_flats_padded_buffer(solution):
    "gather_flat's body copied without its [:numel]: the bias takes the padding too"
    return body(solution, """
        full = torch.empty(shard.numel() * dist.get_world_size(), dtype=shard.dtype)
        all_gather(full, shard.detach().contiguous())
        n_weight = out_features * in_features
        ctx.save_for_backward(x, shard)
        ctx.out_features, ctx.in_features = out_features, in_features
        return F.linear(x, full[:n_weight].view(out_features, in_features), full[n_weight:])
    """)


@mutant("ex3_unit_forward", "tamper")
def patches_kept_alive(solution):
    "KeptAlive.kept patched to report nothing, and the full weight saved"
    return prepend(saves_the_full_weight(solution), """
        KeptAlive.kept = lambda self, min_bytes=1: []
    """)


# --- ex4_unit_backward ---------------------------------------------------------------

@mutant("ex4_unit_backward", "wrong")
def all_reduce_then_slice(solution):
    "an all-reduce of the whole gradient, then this rank's slice: the right numbers, every rank holds all of them"
    return swap(solution, """    grad_shard = torch.empty_like(shard)
    reduce_scatter(grad_shard, full_grad)  # sum over ranks of slice `rank`
    grad_shard /= world""", """    dist.all_reduce(full_grad)
    rank = dist.get_rank()
    grad_shard = full_grad[rank * shard.numel():(rank + 1) * shard.numel()].clone() / world""")


@mutant("ex4_unit_backward", "reference")
def backward_through_mgpu_lab_fsdp(solution):
    "mgpu_lab.FSDP around an nn.Linear, run forward and backward to read the shard's gradient"
    return body(solution, """
        layer = FSDP(nn.Sequential(nn.Linear(in_f, out_f)))
        layer.flat_groups[0].shard.data.copy_(shard.detach())
        xx = x.detach().requires_grad_()
        layer(xx).backward(grad_y)
        layer.finish_gradient_synchronization()
        grad_x, grad_shard = xx.grad, layer.flat_groups[0].shard.grad
    """)


@mutant("ex4_unit_backward", "copy")
def slices_the_local_gradient_with_shard_flat(solution):
    "the given shard_flat applied to this rank's own gradient: no communication, no average over ranks"
    return body(solution, """
        n_weight = out_f * in_f
        weight = gather_flat(shard, n_weight + out_f)[:n_weight].view(out_f, in_f)
        grad_x = grad_y @ weight
        g2, x2 = grad_y.reshape(-1, out_f), x.reshape(-1, in_f)
        grad_shard = shard_flat(torch.cat([(g2.T @ x2).reshape(-1), g2.sum(0)]), dist.get_rank(), world)
    """)


@mutant("ex4_unit_backward", "tamper")
def hides_the_all_reduce_from_the_log(solution):
    "CollectiveLog patched to record a reduce-scatter whatever runs, and the all-reduce then slice"
    return prepend(all_reduce_then_slice(solution), """
        CollectiveLog.__torch_dispatch__ = lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {}))
    """)


# --- ex5_memory_plan -----------------------------------------------------------------

@mutant("ex5_memory_plan", "wrong")
def the_formula_without_granularity(solution):
    "the ZeRO formulas (Psi/N exactly): whole parameters and padding ignored, wrong at N = 3"
    return swap(solution, "held = [16 * psi, 8 * psi + 8 * own, 4 * psi + 12 * own, 16 * shards]",
                "held = [int(zero_bytes_per_rank(psi, world_size, s, 4, 4, 8)) for s in range(4)]")


@mutant("ex5_memory_plan", "wrong")
def least_memory_first(solution):
    "picks the stage that uses least memory (ZeRO-3 first), not the one that communicates least"
    return swap(solution, "for stage in (0, 1, 2, 3):", "for stage in (3, 2, 1, 0):")


@mutant("ex5_memory_plan", "copy")
def the_papers_bytes_from_section_1(solution):
    "section 1's widget layout, 2 + 2 + 12 (the paper's), instead of the autocast recipe's 4 + 4 + 8"
    return swap(solution, "held = [16 * psi, 8 * psi + 8 * own, 4 * psi + 12 * own, 16 * shards]",
                "held = [16 * psi, 4 * psi + 12 * own, 2 * psi + 14 * own, 16 * shards]")


@mutant("ex5_memory_plan", "tamper")
def patches_zero_bytes_per_rank(solution):
    "mgpu_lab.parallel.sharding.zero_bytes_per_rank patched, and the formula answer"
    return prepend(the_formula_without_granularity(solution), """
        import mgpu_lab.parallel.sharding
        mgpu_lab.parallel.sharding.zero_bytes_per_rank = lambda *args, **kwargs: 0
    """)


# --- ex6_fully_shard -----------------------------------------------------------------

@mutant("ex6_fully_shard", "wrong")
def reduces_in_bf16(solution):
    "MixedPrecisionPolicy(param_dtype=bf16) alone: reduce_dtype follows it, the gradients are summed in bf16"
    return swap(solution, "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16)")


@mutant("ex6_fully_shard", "wrong")
def root_keeps_the_default_reshard(solution):
    "reshard_after_forward given to the blocks only: the root keeps the default (None: it does not reshard)"
    return swap(solution, "fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)",
                "fully_shard(model, mesh=mesh, mp_policy=policy)")


@mutant("ex6_fully_shard", "copy")
def copies_the_tinylm_demo(solution):
    "section 6's TinyLM demo copied: the hidden and frozen layers as units (TinyGPT has neither)"
    return body(solution, """
        for unit in (model.hidden, model.frozen):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    """)


@mutant("ex6_fully_shard", "tamper")
def redefines_train_sharded(solution):
    "a train_sharded of its own that reports what the check wants (a redefined helper the probe uses)"
    return prepend(solution, """
        def train_sharded(shard_fn, mixed_precision=False, reshard_after_forward=True, steps=3, lr=1e-2):
            return {"units": ["<root>", "blocks.0", "blocks.1", "blocks.2"], "tied": True}
    """)
