"""Mutants of lab 10: ex1_partition (a contiguous partition balanced by bytes), ex2_sharded_step (ZeRO-2's step from
each rank's own gradients), ex3_unit_forward and ex4_unit_backward (an FSDP unit whose shards are sized by share),
ex5_memory_plan (design), ex6_fully_shard (torch's fully_shard on a tied GPT).

Attacks on the "must not call" guard (exec of a string, a worker thread, a module written to disk, a second copy
of a library module) are of kind ``wrong``: what kills them is the twist (the library computes FSDP's and torch's
layouts, not this lab's), which the framework reports as a failed check, not as a forbidden call."""
from . import body, mutant, prepend, swap

LAB = "10_sharding"


# --- ex1_partition -------------------------------------------------------------------

@mutant("ex1_partition", "wrong")
def fills_each_rank_up_to_the_mean(solution):
    "contiguous, each rank filled in turn until it holds total / N: not the lightest heaviest rank (a GPT on 4 ranks)"
    return body(solution, """
        target, parts, load = sum(sizes) / world_size, [[]], 0
        for i, s in enumerate(sizes):
            if load >= target and len(parts) < world_size:
                parts.append([])
                load = 0
            parts[-1].append(i)
            load += s
        return parts + [[] for _ in range(world_size - len(parts))]
    """)


@mutant("ex1_partition", "reference")
def calls_partition_parameters_through_an_alias(solution):
    "mgpu_lab's partition_parameters, imported under another name"
    return body(solution, """
        from mgpu_lab.parallel.zero import partition_parameters as balanced
        return balanced(sizes, world_size)
    """)


@mutant("ex1_partition", "wrong")
def partition_parameters_defined_by_exec(solution):
    "attack (exec of a literal string): my_partition defined in exec'd code calling partition_parameters, which "
    "balances bytes but scatters each rank's parameters (not contiguous)"
    return ('exec("def my_partition(sizes, world_size):\\n"\n'
            '     "    from mgpu_lab.parallel.zero import partition_parameters\\n"\n'
            '     "    return partition_parameters(sizes, world_size)\\n")\n')


@mutant("ex1_partition", "wrong")
def second_copy_of_the_zero_module(solution):
    "attack (a second copy of the library module, loaded from its file): its unguarded partition_parameters, "
    "not contiguous"
    return """
import importlib.util
import mgpu_lab.parallel.zero as _zero
_spec = importlib.util.spec_from_file_location("zero_copy", _zero.__file__)
_copy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_copy)


def my_partition(sizes, world_size):
    return _copy.partition_parameters(sizes, world_size)
""".lstrip()


@mutant("ex1_partition", "copy")
def round_robin_as_the_text_describes(solution):
    "a partition by count (round-robin), the one the exercise's text names: neither contiguous nor balanced in bytes"
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
def sums_instead_of_averaging(solution):
    "each owner keeps the sum of the ranks' gradients (Adam barely notices the factor N; the kept gradient does)"
    return swap(solution, "            flat /= world\n", "")


@mutant("ex2_sharded_step", "wrong")
def all_reduces_every_gradient_as_ddp_does(solution):
    "DDP's all-reduce of every gradient, then ZeRO-1's step: right weights, but every rank keeps every gradient"
    return body(solution, """
        with torch.no_grad():
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= world
            local_optimizer.step()
            for r in range(world):
                theirs = [p for p, o in zip(params, owner) if o == r]
                if not theirs:
                    continue
                flat = (torch.cat([p.reshape(-1) for p in theirs]) if r == rank else
                        torch.empty(sum(p.numel() for p in theirs), dtype=theirs[0].dtype))
                dist.broadcast(flat, src=r)
                offset = 0
                for p in theirs:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
    """)


# Review B's shortcut: every number the check compares is right (weights, the owners' averaged gradients, AdamW's
# state); only the collectives it issued (CollectiveLog in the ranks) show that it is ZeRO-1 behind an all-reduce.
@mutant("ex2_sharded_step", "wrong")
def all_reduces_then_drops_what_it_does_not_own(solution):
    "per parameter: all-reduce, divide, drop the gradient unless owned; local step; one broadcast per parameter"
    return body(solution, """
        with torch.no_grad():
            for p, o in zip(params, owner):
                dist.all_reduce(p.grad)
                p.grad /= world
                if o != rank:
                    p.grad = None
            local_optimizer.step()
            for p, o in zip(params, owner):
                dist.broadcast(p.data, src=o)
    """)


@mutant("ex2_sharded_step", "reference")
def shares_with_sharded_optimizers_code(solution):
    "ShardedOptimizer's own _share_parameters, called on a stand-in object, after a step on unaveraged gradients"
    return body(solution, """
        local_optimizer.step()
        parts = [[p for p, o in zip(params, owner) if o == r] for r in range(world)]
        stand_in = types.SimpleNamespace(partition=parts, process_group=None, rank=rank, param_groups=[], _trainable=[],
                                         parameters_as_bucket_view=False)
        ShardedOptimizer._share_parameters(stand_in)
    """)


@mutant("ex2_sharded_step", "wrong")
def zero_redundancy_optimizer_made_in_a_thread(solution):
    "attack (a worker thread calls the reference, out of the guard's sight): torch's ZeroRedundancyOptimizer, "
    "which steps each owner with its own rank's unaveraged gradient and keeps every gradient"
    return body(solution, """
        from concurrent.futures import ThreadPoolExecutor
        import torch.distributed.optim as optimizers
        cache = sharded_step.__dict__.setdefault("cache", {})
        if "zero" not in cache:
            make = vars(optimizers)["ZeroRedundancyOptimizer"]
            with ThreadPoolExecutor(1) as pool:
                cache["zero"] = pool.submit(make, params, optimizer_class=torch.optim.AdamW, lr=0.02).result()
        cache["zero"].step()
    """)


@mutant("ex2_sharded_step", "copy")
def zero1_recipe_of_section_2(solution):
    "section 2's ZeRO-1 recipe (step, then one broadcast per owner) on gradients nobody averaged"
    return body(solution, """
        local_optimizer.step()
        with torch.no_grad():
            for r in range(world):
                theirs = [p for p, o in zip(params, owner) if o == r]
                if not theirs:
                    continue
                flat = (torch.cat([p.reshape(-1) for p in theirs]) if r == rank else
                        torch.empty(sum(p.numel() for p in theirs), dtype=theirs[0].dtype))
                dist.broadcast(flat, src=r)
                offset = 0
                for p in theirs:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
    """)


@mutant("ex2_sharded_step", "tamper")
def redefines_train_zero2(solution):
    "a train_zero2 of its own that answers with one process's training (a redefined helper the probe uses)"
    return prepend(solution, """
        def train_zero2(step_fn, owner, steps=3):
            model = train_full_batch(steps)
            mine = [n for (n, p), o in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], owner)
                    if o == dist.get_rank()]
            return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "grads": {n: p.grad if n in mine else None for n, p in model.named_parameters() if p.requires_grad},
                    "state": {n: [torch.zeros_like(p), torch.zeros_like(p)] if n in mine else None
                              for n, p in model.named_parameters() if p.requires_grad}}
    """)


@mutant("ex2_sharded_step", "wrong")
def every_rank_keeps_every_moment_and_fakes_its_local_state(solution):
    "attack (the record the check reads, rewritten): DDP's all-reduce and a full AdamW on every rank (no optimizer "
    "state sharded), the gradients it does not own dropped, and the local optimizer's state made up (zeros) for the "
    "parameters it owns: the weights and gradients are right, the moments are not AdamW's"
    return body(solution, """
        with torch.no_grad():
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= world
            full = sharded_step.__dict__.setdefault("full", {})
            if id(params[0]) not in full:
                full[id(params[0])] = torch.optim.AdamW(params, lr=0.02)
            full[id(params[0])].step()
            for p, o in zip(params, owner):
                if o != rank:
                    p.grad = None
                else:
                    local_optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                                "exp_avg_sq": torch.zeros_like(p)}
    """)


# --- ex3_unit_forward ----------------------------------------------------------------

@mutant("ex3_unit_forward", "wrong")
def saves_the_full_weight(solution):
    "keeps the gathered weight and bias for backward (no second all-gather): nothing is sharded any more"
    return swap(solution, "ctx.save_for_backward(x, shard)", "ctx.save_for_backward(x, shard, weight, bias)")


@mutant("ex3_unit_forward", "wrong")
def keeps_each_ranks_padding(solution):
    "pads every share to the longest and gathers, but reads the gathered slots as one vector: padding inside the weight"
    return swap(solution, "    flat = torch.cat([slots[r * longest:r * longest + b - a] for r, (a, b) in "
                          "enumerate(zip(bounds, bounds[1:]))])\n",
                "    flat = slots[:bounds[-1]]\n")


@mutant("ex3_unit_forward", "reference")
def runs_mgpu_lab_fsdp(solution):
    "mgpu_lab.FSDP around an nn.Linear with this rank's shard copied into its own (FSDP's equal slices)"
    return body(solution, """
        layer = FSDP(nn.Sequential(nn.Linear(in_features, out_features)))
        mine = layer.flat_groups[0].shard
        n = min(mine.numel(), shard.numel())
        with torch.no_grad():
            mine[:n].copy_(shard.detach()[:n])
        ctx.save_for_backward(x, shard)
        ctx.out_features, ctx.in_features, ctx.shares = out_features, in_features, shares
        return layer(x)
    """)


@mutant("ex3_unit_forward", "wrong")
def fsdp_from_a_module_written_to_disk(solution):
    "attack (a module written to disk and imported): unit_forward there runs mgpu_lab.FSDP, whose equal slices put "
    "the shares' numbers in the wrong places"
    return '''
import pathlib, sys, tempfile
_folder = tempfile.mkdtemp()
pathlib.Path(_folder, "lab10_unit.py").write_text(
    "import torch\\n"
    "import torch.nn as nn\\n"
    "from mgpu_lab import FSDP\\n"
    "def unit_forward(ctx, x, shard, out_features, in_features, shares):\\n"
    "    layer = FSDP(nn.Sequential(nn.Linear(in_features, out_features)))\\n"
    "    mine = layer.flat_groups[0].shard\\n"
    "    n = min(mine.numel(), shard.numel())\\n"
    "    with torch.no_grad():\\n"
    "        mine[:n].copy_(shard.detach()[:n])\\n"
    "    ctx.save_for_backward(x, shard)\\n"
    "    ctx.out_features, ctx.in_features, ctx.shares = out_features, in_features, shares\\n"
    "    return layer(x)\\n")
sys.path.insert(0, _folder)
from lab10_unit import unit_forward
'''.lstrip()


@mutant("ex3_unit_forward", "copy")
def pads_to_shard_flats_slice(solution):
    "shard_flat's rule (section 3: FSDP pads the vector to N equal slices) applied to shares: rank 0's share does "
    "not fit its slice"
    return swap(solution, "    longest = max(b - a for a, b in zip(bounds, bounds[1:]))\n",
                "    longest = -(-bounds[-1] // len(shares))\n")


@mutant("ex3_unit_forward", "tamper")
def hides_saved_tensors(solution):
    "torch.autograd.function.FunctionCtx.save_for_backward patched to keep only two tensors, and the full weight saved"
    return prepend(saves_the_full_weight(solution), """
        import torch.autograd.function
        _save = torch.autograd.function.FunctionCtx.save_for_backward
        torch.autograd.function.FunctionCtx.save_for_backward = lambda self, *tensors: _save(self, *tensors[:2])
    """)


# --- ex4_unit_backward ---------------------------------------------------------------

@mutant("ex4_unit_backward", "wrong",
        learner="learnL, 2026-12-05, considered: attempts/lab10/ex4_unit_backward-1.py")
def sums_without_dividing(solution):
    "the reduce-scatter's sum kept as the gradient: N times the average"
    return swap(solution, "grad_shard = mine[:shard.numel()] / world", "grad_shard = mine[:shard.numel()].clone()")


@mutant("ex4_unit_backward", "wrong")
def lays_the_gradient_out_as_fsdp(solution):
    "FSDP's layout for the reduce-scatter (the flat gradient at the start, padded at its end): wrong numbers in every slot but the first"
    return swap(solution, """    send = torch.zeros(longest * world, dtype=shard.dtype, device=shard.device)
    for r, (a, b) in enumerate(pieces):
        send[r * longest:r * longest + b - a] = full_grad[a:b]         # rank r's share at the start of slot r
""", """    send = torch.zeros(longest * world, dtype=shard.dtype, device=shard.device)
    send[:full_grad.numel()] = full_grad
""")


@mutant("ex4_unit_backward", "reference")
def backward_through_mgpu_lab_fsdp(solution):
    "mgpu_lab.FSDP around an nn.Linear, run forward and backward to read the shard's gradient"
    return body(solution, """
        layer = FSDP(nn.Sequential(nn.Linear(in_f, out_f)))
        mine = layer.flat_groups[0].shard
        n = min(mine.numel(), shard.numel())
        with torch.no_grad():
            mine[:n].copy_(shard.detach()[:n])
        xx = x.detach().requires_grad_()
        layer(xx).backward(grad_y)
        layer.finish_gradient_synchronization()
        grad_x, grad_shard = xx.grad, torch.zeros_like(shard)
        grad_shard[:n] = mine.grad[:n]
    """)


@mutant("ex4_unit_backward", "wrong")
def fsdp_run_with_the_log_popped(solution):
    "attack (popping the observer's dispatch mode): mgpu_lab.FSDP's backward run with CollectiveLog off the stack, "
    "then the two collectives the log expects issued on zeros"
    return body(solution, """
        from torch.utils._python_dispatch import _pop_mode_temporarily
        import mgpu_lab
        make = vars(mgpu_lab)["FSDP"]
        with _pop_mode_temporarily():
            layer = make(nn.Sequential(nn.Linear(in_f, out_f)))
            mine = layer.flat_groups[0].shard
            n = min(mine.numel(), shard.numel())
            with torch.no_grad():
                mine[:n].copy_(shard.detach()[:n])
            xx = x.detach().requires_grad_()
            layer(xx).backward(grad_y)
            layer.finish_gradient_synchronization()
        bounds = shard_bounds(out_f * (in_f + 1), shares)
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        all_gather(torch.empty(longest * world), torch.zeros(longest))
        reduce_scatter(torch.empty(longest), torch.zeros(longest * world))
        grad_x, grad_shard = xx.grad, torch.zeros_like(shard)
        grad_shard[:n] = mine.grad[:n]
    """)


@mutant("ex4_unit_backward", "copy")
def slices_the_local_gradient_with_shard_by_share(solution):
    "the given shard_by_share applied to this rank's own gradient: no communication, no average over ranks"
    return body(solution, """
        bounds = shard_bounds(out_f * (in_f + 1), shares)
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        padded = torch.zeros(longest, dtype=shard.dtype)
        padded[:shard.numel()] = shard.detach()
        slots = torch.empty(longest * world, dtype=shard.dtype)
        all_gather(slots, padded)
        flat = torch.cat([slots[r * longest:r * longest + b - a] for r, (a, b) in enumerate(zip(bounds, bounds[1:]))])
        grad_x = grad_y @ flat[:out_f * in_f].view(out_f, in_f)
        g2, x2 = grad_y.reshape(-1, out_f), x.reshape(-1, in_f)
        grad_shard = shard_by_share(torch.cat([(g2.T @ x2).reshape(-1), g2.sum(0)]), dist.get_rank(), shares)
    """)


@mutant("ex4_unit_backward", "tamper")
def hides_the_all_reduce_from_the_log(solution):
    "CollectiveLog patched to record nothing, and the unaveraged local gradient"
    return prepend(slices_the_local_gradient_with_shard_by_share(solution), """
        CollectiveLog.__torch_dispatch__ = lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {}))
    """)


# --- ex5_memory_plan -----------------------------------------------------------------

@mutant("ex5_memory_plan", "wrong",
        learner="learnL, 2026-12-05, considered: attempts/lab10/ex5_memory_plan-1.py")
def the_formula_without_granularity(solution):
    "the ZeRO formulas (Psi/N exactly): whole parameters and padding ignored, wrong at N = 3"
    return swap(solution, "held = [16 * psi, 8 * psi + 8 * own, 4 * psi + 12 * own, 16 * shards]",
                "held = [int(zero_bytes_per_rank(psi, world_size, s, 4, 4, 8)) for s in range(4)]")


@mutant("ex5_memory_plan", "wrong",
        message="ZeRO-3 counted as 16 Psi / N: every unit's flat vector is padded to a multiple of N, so the fullest "
                "rank holds 16 bytes for each of the ceil(numel / N) numbers of every unit's shard",
        section="4. Bytes per rank, measured against the formulas",
        learner="learnL, 2026-12-05, considered: attempts/lab10/ex5_memory_plan-2.py")
def zero3_without_padding(solution):
    "ZeRO-1 and ZeRO-2 from the real partition, but ZeRO-3 as 16 Psi / N: each unit's padding to a multiple of N ignored"
    return swap(solution, "held = [16 * psi, 8 * psi + 8 * own, 4 * psi + 12 * own, 16 * shards]",
                "held = [16 * psi, 8 * psi + 8 * own, 4 * psi + 12 * own, 16 * psi // world_size]")


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

@mutant("ex6_fully_shard", "wrong", learner="learnD, 2026-12-05, considered: attempts/lab10/ex6_fully_shard-1.py")
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
