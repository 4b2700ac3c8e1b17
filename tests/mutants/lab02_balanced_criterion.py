"""Mutants of lab 02: parallel_forward, chunk_sizes and combine_losses, parallel_criterion and
masked_parallel_criterion."""
from . import body, mutant, prepend, swap

LAB = "02_balanced_criterion"


# --- parallel_forward ------------------------------------------------------------------

@mutant("parallel_forward", "wrong")
def one_chunk_after_another(solution):
    "the module itself on each chunk, in the calling thread: no replicas, nothing in parallel"
    return body(solution, "return [module(c) for c in mgpu_lab.scatter(x, devices)]")


@mutant("parallel_forward", "reference")
def calls_data_parallel_model(solution):
    "mgpu_lab.DataParallelModel, what the exercise re-implements"
    return body(solution, "return DataParallelModel(module, devices)(x)")


@mutant("parallel_forward", "copy")
def splits_the_gathered_output(solution):
    "section 1's DataParallel forward, cut back into chunks: the whole output was gathered on device 0"
    return body(solution, "return list(DataParallel(module, devices)(x).split(-(-len(x) // len(devices))))")


@mutant("parallel_forward", "tamper")
def redefines_account_memory(solution):
    "a stand-in for account_memory (a name the check uses) that charges nothing, over a gathering forward"
    return prepend(body(solution, "return list(DataParallel(module, devices)(x).split(-(-len(x) // len(devices))))"), """
        account_memory = lambda fn, devices: mgpu_lab.measure.memory_account.account_memory(lambda: None, devices)
    """)


# --- chunk_sizes and combine_losses -----------------------------------------------------

WEIGHTED = "    total = sum(sizes)\n    return sum(loss * (n / total) for loss, n in zip(losses, sizes))"


@mutant("combine_losses", "wrong")
def equal_chunks_of_the_floor(solution):
    "batch_size // n rows on every device: the remainder is lost, and torch.chunk's uneven chunks are not"
    return body(solution, "return [batch_size // n] * n")


@mutant("combine_losses", "reference")
def sizes_from_torch_chunk(solution):
    "chunk_sizes through torch.chunk itself"
    return body(solution, "return [len(c) for c in torch.chunk(torch.empty(batch_size), n)]")


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


@mutant("parallel_criterion", "reference")
def calls_data_parallel_criterion(solution):
    "mgpu_lab.DataParallelCriterion, what the exercise re-implements"
    return body(solution, "return DataParallelCriterion(criterion, devices)(outputs, targets)")


@mutant("parallel_criterion", "copy")
def copies_exercise_2s_check_loop(solution):
    "exercise 2's check, per_device = [criterion(p, t) ...]: rightly weighted, but in the calling thread"
    return body(solution, IN_TURN)


@mutant("parallel_criterion", "tamper")
def disables_forward_pre_hooks(solution):
    "nn.Module.register_forward_pre_hook patched to do nothing (the check's thread probe), losses in turn"
    return prepend(body(solution, IN_TURN), """
        nn.Module.register_forward_pre_hook = lambda self, hook, **kwargs: None
    """)


# --- masked_parallel_criterion ------------------------------------------------------------

ROWS_WEIGHTED = """
    chunks = mgpu_lab.scatter(targets, devices)[: len(outputs)]
    sizes = [len(t) for t in chunks]
    losses = [F.cross_entropy(o.flatten(0, 1), t.flatten(), ignore_index=ignore_index).to(devices[0])
              for o, t in zip(outputs, chunks)]
    return sum(n * loss for n, loss in zip(sizes, losses)) / sum(sizes)
"""


@mutant("masked_parallel_criterion", "wrong")
def weights_by_rows_not_tokens(solution):
    "exercise 2's rule (weights by rows) where the loss averages over kept tokens; NaN for an all-padding chunk"
    return body(solution, ROWS_WEIGHTED)


@mutant("masked_parallel_criterion", "reference")
def concatenates_the_logits(solution):
    "every device's logits concatenated on device 0 (torch.cat), then the full loss: a gather by hand"
    return body(solution, """
        logits = torch.cat([o.to(devices[0]) for o in outputs])
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
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
    "IPython's exception hook swallowing the check's failed assertions, over the rows-weighted loss"
    return prepend(body(solution, ROWS_WEIGHTED), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)
