"""Mutants of lab 07: what a forward keeps alive, your own checkpoint, segments for a budget,
checkpointed accumulation, a transformer in a memory budget."""
from . import body, mutant, prepend, swap

LAB = "07_activation_checkpointing"


# --- ex1_kept_by_module: what each module keeps alive -----------------------------

@mutant("ex1_kept_by_module", "wrong")
def counts_everything_the_forward_made(solution):
    "every storage the forward allocated, freed or not, for the module that made it: made is not kept"
    solution = swap(solution, "made[k], where[k] = weakref.ref(s), running[-1]",
                    "made[k], where[k], sizes[k] = weakref.ref(s), running[-1], s.nbytes()")
    solution = swap(solution, "    made, before, where = {}, {}, {}", "    made, before, where, sizes = {}, {}, {}, {}")
    return swap(solution, """        s = ref()
        if s is not None and k not in own:
            kept[where[k]] = kept.get(where[k], 0) + s.nbytes()""", """        if k not in own:
            kept[where[k]] = kept.get(where[k], 0) + sizes[k]""")


@mutant("ex1_kept_by_module", "wrong")
def the_outermost_module(solution):
    "each storage counted for the outermost module running (the block), not the innermost (its layer)"
    return swap(solution, "made[k], where[k] = weakref.ref(s), running[-1]", "made[k], where[k] = weakref.ref(s), running[min(2, len(running) - 1)]")


@mutant("ex1_kept_by_module", "reference")
def calls_kept_alive_through_an_alias(solution):
    "the library's instrument under another name, its total given to the model"
    return body(solution, """
        from mgpu_lab.measure.kept_alive import kept_alive as measure
        total = measure(model, *args).nbytes
        return {"": total} if total else {}
    """)


@mutant("ex1_kept_by_module", "copy")
def section_1s_pack_hook_by_layer(solution):
    "section 1's saved_by_layer transcribed: the pack hook, per leaf module, parameters left out: an inner hook "
    "hides everything"
    return body(solution, """
        current, kept = [None], {}
        handles = [m.register_forward_pre_hook(lambda m, a, name=name: current.__setitem__(0, name))
                   for name, m in model.named_modules() if not list(m.children())]

        def pack(t):
            if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
                kept[current[0]] = kept.get(current[0], 0) + t.numel() * t.element_size()
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*args)
        for h in handles:
            h.remove()
        return kept
    """)


@mutant("ex1_kept_by_module", "tamper")
def patches_the_library_instrument(solution):
    "kept_alive replaced in its module so that it agrees with a constant"
    return prepend(body(solution, "return {}"), """
        import mgpu_lab.measure.kept_alive as K
        K.kept_alive = lambda fn, *args: K.KeptAlive(0)
    """)


@mutant("ex1_kept_by_module", "wrong")
def attack_second_copy_of_kept_alive(solution):
    "attack: kept_alive from a second copy of its module, loaded from its file past the guard, and each storage "
    "counted for the module that kept... no module: it has none, the total goes to the model"
    return body(solution, """
        import importlib.util
        import mgpu_lab.measure.kept_alive as lib
        spec = importlib.util.spec_from_file_location("__main__", lib.__file__)
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)
        total = copy.kept_alive(model, *args).nbytes
        return {"": total} if total else {}
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


@mutant("ex2_checkpoint", "wrong")
def replays_only_the_default_generators(solution):
    "the RNG replay of torch's checkpoint: the default generators only; a generator argument draws a new mask"
    return swap(swap(solution, "            for g, s in zip(generators, generator_states):\n                g.set_state(s)\n", ""),
                "        for g, s in zip(generators, now):\n            g.set_state(s)", "")


@mutant("ex2_checkpoint", "wrong",
        message="sets a generator argument back to its state before forward for the recompute, and leaves it where the "
                "recompute ends: that is where this call's forward left it, not where the whole forward left it; with "
                "two checkpointed calls drawing from one generator (Megatron's RNG tracker) backward recomputes the "
                "second, then the first, and the generator ends after the first call's draws; save its state before "
                "the recompute and restore it after",
        section="Exercise 2 (5 points): your own checkpoint, generators included",
        learner="learnC, 2026-12-05, considered: attempts/lab07/ex2_checkpoint-1.py")
def generator_left_where_the_recompute_ends(solution):
    "a generator argument replayed for the recompute but not restored after it: with two checkpointed calls sharing "
    "it, it ends after the first call's draws"
    return body(solution, """
        gens = [a for a in args if isinstance(a, torch.Generator)]
        devices = sorted({a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
        cpu_state = torch.get_rng_state()
        cuda_states = [torch.cuda.get_rng_state(d) for d in devices]
        gen_states = [g.get_state() for g in gens]
        recomputed = []

        def recompute():
            inputs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(cpu_state)
                for d, st in zip(devices, cuda_states):
                    torch.cuda.set_rng_state(st, d)
                for g, st in zip(gens, gen_states):
                    g.set_state(st)
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                        lambda t: recomputed.append(t.detach()) or len(recomputed) - 1, lambda i: recomputed[i]):
                    fn(*inputs)

        def pack(t):
            pack.count += 1
            return pack.count - 1
        pack.count = 0

        def unpack(i):
            if not recomputed:
                recompute()
            return recomputed[i]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fn(*args)
    """)


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


@mutant("ex2_checkpoint", "wrong")
def attack_throwaway_forward_under_the_observer(solution):
    "attack (the red team's): under the check's dispatch mode a throwaway forward that keeps nothing; otherwise "
    "torch's reentrant CheckpointFunction, which the guard does not list: it does not replay a generator argument"
    return body(solution, """
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        if _get_current_dispatch_mode_stack():
            with torch.no_grad():
                return fn(*args)
        return tc.CheckpointFunction.apply(fn, True, *args)
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


@mutant("ex3_choose_segments", "wrong",
        message="models the bytes of k segments with section 4's approximation (k - 1) a + (n / k) b: "
                "checkpoint_sequential puts the remainder of n / k into the last segment, which is not checkpointed, "
                "so for a k that does not divide n the model undercounts and the k chosen does not fit; measure every k "
                "(or count the last segment's n - (k - 1) floor(n / k) blocks)",
        section="4. Segments and the $\\sqrt{n}$ rule",
        learner="learnC, 2026-12-05, considered: attempts/lab07/ex3_choose_segments-1.py")
def models_the_bytes_with_n_over_k(solution):
    "the bytes of k segments modelled as (k - 1) a + (n / k) b: a k that does not divide n keeps more than that"
    return body(solution, """
        # section 4's model: M(k) = (k - 1) a + (n / k) b, a = a segment input, b = one block's saved bytes
        a = x.numel() * x.element_size()
        b = saved_tensor_bytes(blocks, x) / n
        best = None
        for k in range(1, n + 1):
            saved = (k - 1) * a + n / k * b
            if saved > budget_bytes:
                continue
            cost = (k - 1) * (n // k)
            if best is None or cost < best[0]:
                best = (cost, k)
        return None if best is None else best[1]
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

@mutant("ex4_accumulate", "wrong",
        learner="learnI, 2026-12-05, considered: attempts/lab07/ex4_accumulate-1.py")
def divides_by_the_number_of_micro_batches(solution):
    "each micro-batch's mean loss divided by their number: wrong when the last one is smaller"
    return body(solution, """
        parts = list(zip(x.split(micro_batch), y.split(micro_batch)))
        for xs, ys in parts:
            (F.mse_loss(checkpoint_sequential(blocks, segments, xs, use_reentrant=False), ys) / len(parts)).backward()
            after_each.append([p.grad.clone() for p in blocks.parameters()])
    """)


@mutant("ex4_accumulate", "copy")
def one_checkpointed_forward_of_the_whole_batch(solution):
    "section 7's call on the whole batch: one forward, one backward, no micro-batches"
    return body(solution, """
        F.mse_loss(checkpoint_sequential(blocks, segments, x, use_reentrant=False), y).backward()
        after_each.append([p.grad.clone() for p in blocks.parameters()])
    """)


@mutant("ex4_accumulate", "wrong")
def no_checkpoint(solution):
    "plain micro-batches: the right gradients, nothing recomputed (the block forwards count it)"
    return swap(solution, "out = checkpoint_sequential(blocks, segments, xs, use_reentrant=False)", "out = blocks(xs)")


@mutant("ex4_accumulate", "tamper")
def patches_mse_loss(solution):
    "F.mse_loss replaced by a sum (then no weighting is needed)"
    return prepend(solution, """
        F.mse_loss = lambda a, b, reduction="mean": ((a - b) ** 2).sum()
    """)


@mutant("ex4_accumulate", "wrong")
def attack_forged_counts_over_one_backward(solution):
    "attack: one plain backward of the whole batch, throwaway block forwards to reach the count the check expects, "
    "and its final gradients reported as every micro-batch's"
    return body(solution, """
        F.mse_loss(blocks(x), y).backward()
        steps = -(-len(x) // micro_batch)
        with torch.no_grad():
            for _ in range(steps * (len(blocks) + (segments - 1) * (len(blocks) // segments)) - len(blocks)):
                blocks[0](x[:1])
        after_each.extend([p.grad.clone() for p in blocks.parameters()] for _ in range(steps))
    """)


# --- ex5_budget: a transformer in a memory budget -------------------------------------

@mutant("ex5_budget", "wrong")
def checkpoints_every_layer_whole(solution):
    "whole-layer checkpointing (keep nothing): fits the memory, costs a third more FLOPs"
    return body(solution, "return []")


@mutant("ex5_budget", "copy")
def saves_every_product_as_in_section_5(solution):
    "section 5's policy (keep mm, addmm, bmm): the s x s scores are kept, over the budget"
    return body(solution, 'return [("mm", None), ("addmm", None), ("bmm", None)]')


@mutant("ex5_budget", "wrong")
def keeps_the_scores_and_the_mlp(solution):
    "the products whose outputs look big kept: attention's s x s scores, and the MLP's; the bytes are in the scores"
    return body(solution, 'return [("addmm", None), ("bmm", (s, s))]')


@mutant("ex5_budget", "wrong",
        message="only the linear layers' outputs (addmm) kept: both attention products are recomputed, a share of "
                "the step's FLOPs that grows with s/h (8 % at s = 64, h = 32; over 10 % for longer sequences): keep "
                "the product that applies the attention to V, and recompute only the s x s scores",
        learner="learnI, 2026-12-05, considered: attempts/lab07/ex5_budget-2.py")
def keeps_only_the_linear_layers(solution):
    "the linear layers' outputs kept, both attention products recomputed: within 10 % of the FLOPs only for short "
    "sequences (the third rule matches nothing: the learner's attempt, padded to the solution's form)"
    return body(solution, 'return [("addmm", None), ("mm", None), ("addmm", (2 * s, 4 * h))]')


@mutant("ex5_budget", "tamper")
def patches_torch_checkpoint(solution):
    "torch.utils.checkpoint.checkpoint replaced by a plain call in the kernel, and section 5's plan"
    return prepend(body(solution, 'return [("mm", None), ("addmm", None), ("bmm", None)]'), """
        tc.checkpoint = lambda fn, *args, **kwargs: fn(*args)
    """)


@mutant("ex5_budget", "wrong")
def attack_pops_the_modes_while_planning(solution):
    "attack (the red team's): the dispatch modes popped and a throwaway forward run while the plan is made, and "
    "section 5's plan: the check measures the plan in its own process"
    return body(solution, """
        from torch.utils._python_dispatch import _pop_mode_temporarily, _get_current_dispatch_mode_stack
        while _get_current_dispatch_mode_stack():
            _pop_mode_temporarily().__enter__()
        plan_forward(transformer_stack(1, h, heads), torch.randn(1, s, h), [])
        return [("mm", None), ("addmm", None), ("bmm", None)]
    """)
