"""Mutants of lab 01: my_scatter, my_replicate, my_parallel_apply, my_data_parallel (with my_gather)
and lr_for_batch."""
from . import body, mutant, prepend, swap

LAB = "01_data_parallel"


# --- my_scatter --------------------------------------------------------------------

@mutant("my_scatter", "wrong")
def tensor_split_always_n_chunks(solution):
    "torch.tensor_split: always one chunk per device (5 rows over 4: 2, 1, 1, 1), not torch.chunk's 2, 2, 1"
    return swap(solution, "torch.chunk(obj, len(devices), dim)", "torch.tensor_split(obj, len(devices), dim)")


@mutant("my_scatter", "reference")
def library_scatter_through_an_alias(solution):
    "mgpu_lab.scatter itself, under another name"
    return body(solution, """
        spread = mgpu_lab.scatter
        return spread(obj, devices, dim)
    """)


@mutant("my_scatter", "copy")
def copies_the_demos_chunk_line(solution):
    "section 2's torch.chunk line: tensors only, so a tuple, list or dict is not scattered"
    return body(solution, "return list(torch.chunk(obj, len(devices), dim))")


@mutant("my_scatter", "tamper")
def the_three_line_monkeypatch(solution):
    "issue 22's cheat: torch.equal, torch.allclose and assert_close patched, zeros of the right sizes"
    return prepend(swap(solution, "[c.to(d) for c, d in", "[torch.zeros_like(c).to(d) for c, d in"), """
        torch.equal = lambda *a, **k: True
        torch.allclose = lambda *a, **k: True
        torch.testing.assert_close = lambda *a, **k: None
    """)


# --- my_replicate ------------------------------------------------------------------

@mutant("my_replicate", "wrong")
def deep_copies(solution):
    "copy.deepcopy per device: replicas with leaf parameters of their own, no gradient reaches the module"
    return body(solution, """
        import copy
        replicas.append(copy.deepcopy(module).to(device))
    """)


@mutant("my_replicate", "reference")
def calls_mgpu_lab_replicate(solution):
    "mgpu_lab.replicate, one device at a time"
    return body(solution, "replicas.append(mgpu_lab.replicate(module, [device])[0])")


@mutant("my_replicate", "copy")
def copies_the_shallow_copy_line(solution):
    "section 3's `replica.__dict__ = module.__dict__.copy()` alone: the replica shares the module's leaves"
    return body(solution, """
        r = module.__new__(type(module))
        r.__dict__ = module.__dict__.copy()
        replicas.append(r)
    """)


@mutant("my_replicate", "tamper")
def patches_is_leaf(solution):
    "deep copies, and torch.Tensor.is_leaf patched so that they look like autograd copies"
    return prepend(body(solution, """
        import copy
        replicas.append(copy.deepcopy(module).to(device))
    """), """
        torch.Tensor.is_leaf = property(lambda self: False)
    """)


# --- my_parallel_apply --------------------------------------------------------------

@mutant("my_parallel_apply", "wrong")
def one_thread_at_a_time(solution):
    "starts and joins each thread in turn: right numbers, but the replicas never run at the same time"
    return swap(solution, "    for t in threads:\n        t.start()\n    for t in threads:\n        t.join(timeout=60)",
                "    for t in threads:\n        t.start()\n        t.join(timeout=60)")


@mutant("my_parallel_apply", "reference")
def library_parallel_apply_through_getattr(solution):
    "mgpu_lab.parallel_apply reached through getattr of a built name"
    return body(solution, 'return getattr(mgpu_lab, "parallel" + "_apply")(modules, inputs)')


@mutant("my_parallel_apply", "copy")
def copies_the_thread_demo(solution):
    "section 4's threading.Thread demo: threads that start with default grad mode and no autocast"
    return body(solution, """
        results = [None] * len(modules)

        def worker(i):
            args = inputs[i] if isinstance(inputs[i], tuple) else (inputs[i],)
            results[i] = modules[i](*args)

        threads = [threading.Thread(target=worker, args=(i,), name="worker") for i in range(len(modules))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        return results
    """)


@mutant("my_parallel_apply", "tamper")
def hides_the_calling_thread(solution):
    "every replica in the calling thread, with threading.main_thread patched so that it looks like workers"
    return prepend(body(solution, """
        return [m(*(x if isinstance(x, tuple) else (x,))) for m, x in zip(modules, inputs)]
    """), """
        threading.main_thread = lambda: None
    """)


# --- my_data_parallel (and my_gather) -------------------------------------------------

@mutant("my_data_parallel", "wrong")
def gather_detaches(solution):
    "my_gather through .detach(): the right outputs, but no gradient flows back to the module"
    return swap(solution, "torch.cat([o.to(target_device) for o in outputs], dim)",
                "torch.cat([o.detach().to(target_device) for o in outputs], dim)")


@mutant("my_data_parallel", "reference")
def library_gather_under_another_name(solution):
    "mgpu_lab.gather imported under another name"
    return body(solution, """
        from mgpu_lab import gather as collect
        return collect(outputs, target_device, dim)
    """)


@mutant("my_data_parallel", "copy")
def copies_the_checks_reference_line(solution):
    "the check's own reference, the module on the whole batch: nothing scattered (BatchNorm tells)"
    return swap(solution, "    chunks = scatter(x, devices)\n    replicas = replicate(module, devices[: len(chunks)])\n"
                          "    outputs = parallel_apply(replicas, chunks)\n    return my_gather(outputs, devices[0])",
                "    return module(x)")


@mutant("my_data_parallel", "tamper")
def patches_allclose(solution):
    "torch.allclose patched to agree, and the module on the whole batch"
    return prepend(copies_the_checks_reference_line(solution), """
        torch.allclose = lambda *a, **k: True
    """)


# --- lr_for_batch ---------------------------------------------------------------------

@mutant("lr_for_batch", "wrong")
def same_learning_rate(solution):
    "the article's setting: the learning rate tuned for batch B, unchanged for k·B"
    return body(solution, "return lr")


@mutant("lr_for_batch", "wrong")
def doubled_whatever_k(solution):
    "tuned on two devices: twice the learning rate whatever k"
    return body(solution, "return 2 * lr")


@mutant("lr_for_batch", "copy")
def square_root_rule(solution):
    "the square-root rule the lab names for Adam, applied to plain SGD"
    return body(solution, "return lr * (new_batch / batch) ** 0.5")


@mutant("lr_for_batch", "tamper")
def patches_cross_entropy(solution):
    "F.cross_entropy patched to a constant (every curve of the inline check agrees), the learning rate unchanged"
    return prepend(body(solution, "return lr"), """
        F.cross_entropy = lambda *args, **kwargs: torch.tensor(1.0, requires_grad=True)
    """)
