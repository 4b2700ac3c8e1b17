"""Mutants of lab 02: parallel_forward (chunks of chosen sizes), balanced_sizes and combine_losses
(BalancedDataParallel's gpu0_bsz), parallel_criterion (targets split with the outputs' sizes) and
masked_parallel_criterion (the sequence-level loss).

Issue 29's attacks on the "must not call" guard (a reference reached past it) are kind ``wrong``:
they must score 0 because the reference computes something else than the exercise asks, whether or
not the guard sees them, and tests/test_mutants.py counts a ``reference`` kill only when it does."""
from . import body, mutant, prepend, swap

LAB = "02_balanced_criterion"

NO_WAIT = """
    class _NoWait:
        def __init__(self, parties, timeout=None):
            self.parties = parties
        def wait(self):
            return 0
    threading.Barrier = _NoWait
"""


# --- parallel_forward ------------------------------------------------------------------

@mutant("parallel_forward", "wrong")
def one_chunk_after_another(solution):
    "the module itself on each chunk, in the calling thread: no replicas, nothing in parallel (the Meeting breaks)"
    return body(solution, "return [module(c.to(d)) for c, d in zip(x.split(sizes), devices) if len(c) > 0]")


@mutant("parallel_forward", "wrong")
def torch_chunks_whatever_the_sizes(solution):
    "mgpu_lab.scatter's torch.chunk chunks, the sizes ignored (what DataParallelModel does)"
    return body(solution, """
        chunks = mgpu_lab.scatter(x, devices)
        replicas = mgpu_lab.replicate(module, devices[: len(chunks)])
        return mgpu_lab.parallel_apply(replicas, chunks)
    """)


@mutant("parallel_forward", "reference")
def calls_data_parallel_model(solution):
    "mgpu_lab.DataParallelModel, what the exercise re-implements: torch.chunk's chunks"
    return body(solution, "return DataParallelModel(module, devices)(x)")


@mutant("parallel_forward", "wrong")
def the_reference_built_in_a_worker_thread(solution):
    "issue 29 attack, a worker thread: DataParallelModel built where no cell is on the stack; torch.chunk's chunks"
    return body(solution, """
        from concurrent.futures import ThreadPoolExecutor
        from mgpu_lab.parallel import parallel_criterion as pc
        with ThreadPoolExecutor(1) as pool:
            wrapper = pool.submit(vars(pc)["DataParallelModel"], module, devices).result()
        return wrapper(x)
    """)


@mutant("parallel_forward", "copy")
def splits_the_gathered_output(solution):
    "section 1's DataParallel forward, cut into the sizes: gathered on device 0, each replica on torch.chunk's rows"
    return body(solution, "return list(DataParallel(module, devices)(x).split([s for s in sizes if s > 0]))")


@mutant("parallel_forward", "tamper")
def disarms_the_replicas_meeting(solution):
    "threading.Barrier replaced by one that never waits (the check's Meeting), and the chunks in turn"
    return prepend(one_chunk_after_another(solution), NO_WAIT)


# --- balanced_sizes and combine_losses --------------------------------------------------

WEIGHTED = "    total = sum(sizes)\n    return sum(loss * (n / total) for loss, n in zip(losses, sizes))"
SPREAD = "    return [first] + [each + (i < extra) for i in range(n - 1)]"


@mutant("combine_losses", "wrong")
def extra_rows_to_the_last_devices(solution):
    "the rest shared evenly, but the leftover rows on the last devices instead of devices 1, 2, ..."
    return swap(solution, SPREAD, "    return [first] + [each + (i >= n - 1 - extra) for i in range(n - 1)]")


@mutant("combine_losses", "wrong")
def leftover_rows_lost(solution):
    "every other device floor(rest / (n - 1)) rows, the leftover rows forgotten"
    return swap(solution, SPREAD, "    return [first] + [each] * (n - 1)")


@mutant("combine_losses", "wrong")
def torch_chunk_sizes(solution):
    "torch.chunk's sizes (the lab's old exercise), whatever gpu0_bsz"
    return body(solution, """
        step = -(-batch_size // n)
        return [min(step, max(0, batch_size - i * step)) for i in range(n)]
    """)


@mutant("combine_losses", "copy")
def copies_the_demos_mean_of_means(solution):
    "section 3's demo, torch.stack(per_device).mean(): every device weighted the same"
    return swap(solution, WEIGHTED, "    return torch.stack(list(losses)).mean()")


@mutant("combine_losses", "tamper")
def setattr_on_torch(solution):
    "torch.allclose replaced through setattr, and the plain mean of the losses"
    return prepend(swap(solution, WEIGHTED, "    return sum(losses) / len(losses)"), """
        setattr(torch, "allclose", lambda *a, **k: True)
    """)


# --- parallel_criterion ----------------------------------------------------------------

WEIGHTED_ON_0 = "    return sum(n * loss for n, loss in zip(sizes, losses)) / sum(sizes)"
IN_TURN = """
    sizes = [len(o) for o in outputs]
    losses = [criterion(o, t).to(devices[0]) for o, t in zip(outputs, targets.split(sizes))]
    return sum(n * loss for n, loss in zip(sizes, losses)) / sum(sizes)
"""


@mutant("parallel_criterion", "wrong")
def plain_mean_of_the_device_losses(solution):
    "the widely copied version: the plain mean of the per-device losses, wrong with uneven chunks"
    return swap(solution, WEIGHTED_ON_0, "    return sum(losses) / len(losses)")


@mutant("parallel_criterion", "wrong")
def targets_split_with_torch_chunk(solution):
    "the targets scattered with mgpu_lab.scatter (torch.chunk), not with the outputs' sizes (the lab's old answer)"
    return swap(solution, "    target_chunks = [t.to(o.device) for t, o in zip(targets.split(sizes), outputs)]",
                "    target_chunks = mgpu_lab.scatter(targets, devices)[: len(outputs)]")


@mutant("parallel_criterion", "reference")
def calls_data_parallel_criterion(solution):
    "mgpu_lab.DataParallelCriterion, what the exercise re-implements: torch.chunk's targets"
    return body(solution, "return DataParallelCriterion(criterion, devices)(outputs, targets)")


@mutant("parallel_criterion", "copy")
def copies_exercise_2s_check_loop(solution):
    "exercise 2's check, per_device = [criterion(p, t) ...]: rightly split and weighted, but in the calling thread"
    return body(solution, IN_TURN)


@mutant("parallel_criterion", "wrong")
def exec_of_a_literal_string(solution):
    "issue 29 attack, exec of a literal string: DataParallelCriterion from code that is not a cell; torch.chunk's targets"
    return body(solution, """
        scope = {"criterion": criterion, "outputs": outputs, "targets": targets, "devices": devices}
        exec("import mgpu_lab\\nloss = mgpu_lab.DataParallelCriterion(criterion, devices)(outputs, targets)", scope)
        return scope["loss"]
    """)


@mutant("parallel_criterion", "tamper")
def disarms_the_criterions_meeting(solution):
    "threading.Barrier replaced by one that never waits (the check's Meeting), and the losses in turn"
    return prepend(body(solution, IN_TURN), NO_WAIT)


# --- masked_parallel_criterion ------------------------------------------------------------

TOKEN_LEVEL = """
    chunks = mgpu_lab.scatter(targets, devices)[: len(outputs)]
    total, count = 0.0, 0
    for out, t in zip(outputs, chunks):
        total = total + F.cross_entropy(out.flatten(0, 1), t.flatten(), ignore_index=ignore_index,
                                        reduction="sum").to(devices[0])
        count = count + (t != ignore_index).sum().to(devices[0])
    return total / count
"""


@mutant("masked_parallel_criterion", "wrong")
def token_level(solution):
    "the token-level loss, sums and kept-token counts (the lab's old answer): a long sequence weighs more"
    return body(solution, TOKEN_LEVEL)


@mutant("masked_parallel_criterion", "wrong",
        learner="learnA, 2026-12-05, considered: attempts/lab02/masked_parallel_criterion-1.py")
def counts_sequences_that_are_all_padding(solution):
    "divides by every sequence of the batch, the all-padding ones included (they have no loss)"
    return swap(solution, "        count = count + has_tokens.sum().to(devices[0])",
                "        count = count + torch.tensor(len(t), device=devices[0])")


@mutant("masked_parallel_criterion", "reference")
def concatenates_the_logits(solution):
    "every device's logits concatenated on device 0 (torch.cat), then the full loss: a gather by hand, token level"
    return body(solution, """
        logits = torch.cat([o.to(devices[0]) for o in outputs])
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
    """)


@mutant("masked_parallel_criterion", "wrong")
def a_second_copy_of_the_library_module(solution):
    "issue 29 attack, the library module loaded again from its file: its DataParallelCriterion, token level"
    return body(solution, """
        import importlib.util
        from mgpu_lab.parallel import parallel_criterion as pc
        spec = importlib.util.spec_from_file_location("mgpu_lab.parallel.pc_copy", pc.__file__)
        pc_copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pc_copy)
        class PerToken(nn.CrossEntropyLoss):
            def forward(self, logits, target):
                return super().forward(logits.flatten(0, 1), target.flatten())
        return pc_copy.DataParallelCriterion(PerToken(ignore_index=ignore_index), devices)(outputs, targets)
    """)


@mutant("masked_parallel_criterion", "copy")
def copies_the_demos_mean_of_means(solution):
    "section 3's demo, torch.stack(per_device).mean(), with ignore_index"
    return body(solution, """
        chunks = mgpu_lab.scatter(targets, devices)[: len(outputs)]
        per_device = [F.cross_entropy(o.flatten(0, 1), t.flatten(), ignore_index=ignore_index).to(devices[0])
                      for o, t in zip(outputs, chunks)]
        return torch.stack(per_device).mean()
    """)


@mutant("masked_parallel_criterion", "tamper")
def ipython_swallows_assertions(solution):
    "IPython's exception hook swallowing the check's failed assertions, over the token-level loss"
    return prepend(body(solution, TOKEN_LEVEL), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)
