"""Mutants of lab 07: what a forward keeps alive, your own checkpoint, segments for a budget,
checkpointed accumulation, a transformer in a memory budget."""
from . import body, mutant, prepend, swap

LAB = "07_activation_checkpointing"


# --- ex1_count_bytes: what a forward keeps alive ----------------------------------

@mutant("ex1_count_bytes", "wrong")
def counts_everything_the_forward_made(solution):
    "every storage the forward allocated, freed or not: made is not kept"
    return body(solution, """
        sizes = {}

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return out

        with torch.enable_grad(), Record():
            result = fn(*args)
        own = {t.untyped_storage().data_ptr() for t in tree_leaves(result) if isinstance(t, torch.Tensor)}
        return sum(n for ptr, n in sizes.items() if ptr not in own)
    """)


@mutant("ex1_count_bytes", "reference")
def calls_kept_alive_through_an_alias(solution):
    "the library's instrument under another name"
    return body(solution, """
        from mgpu_lab.measure.kept_alive import kept_alive as measure
        return measure(fn, *args).nbytes
    """)


@mutant("ex1_count_bytes", "copy")
def counts_with_the_pack_hook_of_section_1(solution):
    "section 1's saved-tensor hook, storages counted once, parameters left out: an inner hook hides everything"
    return body(solution, """
        seen = {}

        def pack(t):
            if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*args)
        return sum(seen.values())
    """)


@mutant("ex1_count_bytes", "tamper")
def patches_the_library_instrument(solution):
    "kept_alive replaced in its module so that it agrees with a constant"
    return prepend(body(solution, "return 0"), """
        import mgpu_lab.measure.kept_alive as K
        K.kept_alive = lambda fn, *args: K.KeptAlive(0)
    """)


# --- ex2_checkpoint: your own checkpoint ------------------------------------------

@mutant("ex2_checkpoint", "wrong")
def keeps_everything_and_reruns_fn_once_for_show(solution):
    "stores every saved tensor and re-runs fn once in backward for show: right numbers, nothing saved"
    return body(solution, """
        stash, shown = [], []
        cpu_rng = torch.get_rng_state()

        def unpack(i):
            if not shown:
                shown.append(1)
                with torch.random.fork_rng(), torch.no_grad():
                    torch.set_rng_state(cpu_rng)
                    fn(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
            return stash[i]

        with torch.autograd.graph.saved_tensors_hooks(lambda t: stash.append(t) or len(stash) - 1, unpack):
            return fn(*args)
    """)


@mutant("ex2_checkpoint", "reference")
def calls_torch_checkpoint_through_getattr(solution):
    "torch.utils.checkpoint.checkpoint reached through getattr of a built name"
    return body(solution, 'return getattr(tc, "check" + "point")(fn, *args, use_reentrant=False)')


@mutant("ex2_checkpoint", "copy")
def copies_keeps_everything_of_section_2(solution):
    "section 2's checkpoint in name only: fn runs once and every activation is kept"
    return body(solution, "return keeps_everything(fn)(*args)")


@mutant("ex2_checkpoint", "tamper")
def blinds_the_weak_references(solution):
    "weakref.ref patched while it runs, so that every storage looks freed, over a checkpoint that keeps everything"
    return body(solution, """
        real = weakref.ref
        weakref.ref = lambda obj, *callback: (lambda: None)
        try:
            return keeps_everything(fn)(*args)
        finally:
            weakref.ref = real
    """)


# --- ex3_choose_segments: segments for a memory budget -----------------------------

@mutant("ex3_choose_segments", "wrong")
def fewest_segments_that_fit(solution):
    "the smallest k that fits: fewer segments is not less recomputation"
    return body(solution, """
        for k in range(1, n + 1):
            if saved_tensor_bytes(lambda h: checkpoint_sequential(blocks, k, h, use_reentrant=False), x) <= budget_bytes:
                return k
        return None
    """)


@mutant("ex3_choose_segments", "copy")
def copies_the_best_even_split_of_section_4(solution):
    "section 4's 'best even split' (least memory among k dividing n), among those that fit"
    return body(solution, """
        saved = {k: saved_tensor_bytes(lambda h: checkpoint_sequential(blocks, k, h, use_reentrant=False), x) for k in range(1, n + 1)}
        even = [k for k in saved if n % k == 0 and saved[k] <= budget_bytes]
        return min(even, key=saved.get) if even else None
    """)


@mutant("ex3_choose_segments", "copy")
def calls_the_old_expected_helper(solution):
    "return _expected(...): the helper the graded cell showed before issue 22 (gone now)"
    return body(solution, "return _expected(blocks, x, budget_bytes)")


@mutant("ex3_choose_segments", "tamper")
def reads_the_check_budgets(solution):
    "answers from the check's own budgets, read as globals"
    return body(solution, "return dict(zip(budgets16, [1, 10, 4, 8, None])).get(budget_bytes)")


# --- ex4_accumulate: checkpointed micro-batches -------------------------------------

@mutant("ex4_accumulate", "wrong")
def divides_by_the_number_of_micro_batches(solution):
    "each micro-batch's mean loss divided by their number: wrong when the last one is smaller"
    return body(solution, """
        parts = list(zip(x.split(micro_batch), y.split(micro_batch)))
        for xs, ys in parts:
            (F.mse_loss(checkpoint_sequential(blocks, segments, xs, use_reentrant=False), ys) / len(parts)).backward()
    """)


@mutant("ex4_accumulate", "copy")
def one_checkpointed_forward_of_the_whole_batch(solution):
    "section 7's call on the whole batch: one forward, one backward, no micro-batches"
    return body(solution, "F.mse_loss(checkpoint_sequential(blocks, segments, x, use_reentrant=False), y).backward()")


@mutant("ex4_accumulate", "tamper")
def patches_mse_loss(solution):
    "F.mse_loss replaced by a sum (then no weighting is needed)"
    return prepend(solution, """
        F.mse_loss = lambda a, b, reduction="mean": ((a - b) ** 2).sum()
    """)


# --- ex5_budget: a transformer in a memory budget -------------------------------------

@mutant("ex5_budget", "wrong")
def checkpoints_every_layer_whole(solution):
    "whole-layer checkpointing: fits the memory, costs a third more FLOPs"
    return body(solution, """
        for layer in layers:
            x = tc.checkpoint(layer, x, use_reentrant=False)
        return x
    """)


@mutant("ex5_budget", "copy")
def saves_every_product_as_in_section_5(solution):
    "section 5's policy (save mm, addmm, bmm): the s x s scores are kept, over the budget"
    return body(solution, """
        products = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default]
        save_products = functools.partial(create_selective_checkpoint_contexts, products)
        for layer in layers:
            x = tc.checkpoint(layer, x, use_reentrant=False, context_fn=save_products)
        return x
    """)


@mutant("ex5_budget", "tamper")
def redefines_the_flop_counter(solution):
    "a FlopCounterMode of its own that counts nothing, over plain layers"
    return prepend(body(solution, """
        for layer in layers:
            x = layer(x)
        return x
    """), """
        class FlopCounterMode(torch.utils.flop_counter.FlopCounterMode):
            def get_total_flops(self):
                return 0
    """)
