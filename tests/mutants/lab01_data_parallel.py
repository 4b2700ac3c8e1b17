"""Mutants of lab 01: my_scatter (shares by weight), my_replicate (bf16 replicas of fp32 masters),
my_parallel_apply (inference mode carried), my_data_parallel (with my_gather: per-device means weighted by
rows) and lr_for_batch.

Issue 29's attacks on the "must not call" guard (a reference reached past it) are kind ``wrong``:
they must score 0 because the reference computes something else than the exercise asks, whether or
not the guard sees them, and tests/test_mutants.py counts a ``reference`` kill only when it does."""
from . import body, mutant, prepend, swap

LAB = "01_data_parallel"


# --- my_scatter --------------------------------------------------------------------

@mutant("my_scatter", "wrong")
def tensor_split_always_n_chunks(solution):
    "torch.tensor_split: always one chunk per device (5 rows over 4: 2, 1, 1, 1), not torch.chunk's 2, 2, 1"
    return swap(solution, "torch.chunk(obj, len(devices), dim)", "torch.tensor_split(obj, len(devices), dim)")


@mutant("my_scatter", "wrong")
def missing_rows_to_the_last_device(solution):
    "shares rounded down, the missing rows all to the last device (as torch.chunk's last chunk takes the rest)"
    return swap(solution, """            by_remainder = sorted(range(len(weights)), key=lambda i: (-(rows * weights[i] % total), i))
            for i in by_remainder[:rows - sum(sizes)]:              # the missing rows, largest remainders first
                sizes[i] += 1""", """            sizes[-1] += rows - sum(sizes)""")


@mutant("my_scatter", "reference")
def library_scatter_through_an_alias(solution):
    "mgpu_lab.scatter itself, under another name: torch.chunk's chunks, whatever the weights"
    return body(solution, """
        spread = mgpu_lab.scatter
        return spread(obj, devices, dim)
    """)


@mutant("my_scatter", "wrong")
def exec_of_a_literal_string(solution):
    "issue 29 attack, exec of a literal string: mgpu_lab.scatter from code that is not a cell; chunk's chunks, not the shares"
    return body(solution, """
        scope = {"obj": obj, "devices": devices, "dim": dim}
        exec("import mgpu_lab\\nout = mgpu_lab.scatter(obj, devices, dim)", scope)
        return scope["out"]
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
    "copy.deepcopy per device, cast to the dtype: replicas with leaf parameters of their own, no gradient reaches the module"
    return body(solution, """
        import copy
        r = copy.deepcopy(module).to(device)
        replicas.append(r if dtype is None else r.to(dtype))
    """)


@mutant("my_replicate", "wrong",
        message="every replica on the buffer's device uses the module's own buffer: on virtual devices (all the CPU) "
                "that is every replica, all updating the same running statistics; only the first replica aliases "
                "them, the others get detached copies",
        section="3. Replicate: copies that stay connected",
        learner="learnA, 2026-12-05, considered: attempts/lab01/my_replicate-1.py")
def aliases_buffers_wherever_they_live(solution):
    "the buffers aliased by every replica on the buffer's device (like view_as for parameters), not by the first only"
    return swap(solution, "(b if i == 0 and b.device == device", "(b if b.device == device")


@mutant("my_replicate", "wrong")
def casts_batchnorm_too(solution):
    "every floating-point parameter cast to the dtype, BatchNorm's included (apex keeps them fp32)"
    return swap(solution, " and not isinstance(m, nn.modules.batchnorm._BatchNorm)", "")


@mutant("my_replicate", "reference")
def calls_mgpu_lab_replicate(solution):
    "mgpu_lab.replicate, one device at a time: the parameters keep their dtype"
    return body(solution, "replicas.append(mgpu_lab.replicate(module, [device])[0])")


@mutant("my_replicate", "wrong")
def a_second_copy_of_the_library_module(solution):
    "issue 29 attack, the library module loaded again from its file (unguarded): its replicate keeps fp32"
    return body(solution, """
        import importlib.util
        spec = importlib.util.spec_from_file_location("mgpu_lab.parallel.dp_copy", mgpu_lab.parallel.data_parallel.__file__)
        dp_copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(dp_copy)
        replicas.append(dp_copy.replicate(module, [device])[0])
    """)


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
    return prepend(deep_copies(solution), """
        torch.Tensor.is_leaf = property(lambda self: False)
    """)


# --- my_parallel_apply --------------------------------------------------------------

@mutant("my_parallel_apply", "wrong")
def one_thread_at_a_time(solution):
    "starts and joins each thread in turn: the replicas never run at the same time (the meeting breaks)"
    return swap(solution, "    for t in threads:\n        t.start()\n    for t in threads:\n        t.join(timeout=60)",
                "    for t in threads:\n        t.start()\n        t.join(timeout=60)")


@mutant("my_parallel_apply", "wrong")
def forgets_inference_mode(solution):
    "grad mode and autocast carried, inference mode not (what torch's and mgpu_lab's parallel_apply do)"
    return swap(solution, "                if inference:\n                    stack.enter_context(torch.inference_mode())\n", "")


@mutant("my_parallel_apply", "reference")
def library_parallel_apply_through_getattr(solution):
    "mgpu_lab.parallel_apply reached through getattr of a built name"
    return body(solution, 'return getattr(mgpu_lab, "parallel" + "_apply")(modules, inputs)')


@mutant("my_parallel_apply", "wrong")
def the_unguarded_original_the_guard_stores(solution):
    "issue 29 attack, the guard's stored original: mgpu_lab's parallel_apply from the module's globals; no inference mode"
    return body(solution, """
        from mgpu_lab.parallel import data_parallel as dp
        stored = [v[2] for k, v in vars(dp).items() if k.startswith("__mgpu_lab_guard")]
        apply = stored[0] if stored else vars(dp)["parallel_apply"]
        return apply(modules, inputs)
    """)


@mutant("my_parallel_apply", "copy")
def copies_the_thread_demo(solution):
    "section 4's threading.Thread demo: threads that start with default grad mode, no inference mode, no autocast"
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
def disarms_the_meeting(solution):
    "threading.Barrier replaced by one that never waits, and every replica in the calling thread, in turn"
    return prepend(body(solution, """
        with torch.inference_mode(torch.is_inference_mode_enabled()):
            return [m(*(x if isinstance(x, tuple) else (x,))) for m, x in zip(modules, inputs)]
    """), """
        class _NoWait:
            def __init__(self, parties, timeout=None):
                self.parties = parties
            def wait(self):
                return 0
        threading.Barrier = _NoWait
    """)


# --- my_data_parallel (and my_gather) -------------------------------------------------

@mutant("my_data_parallel", "wrong")
def gather_detaches(solution):
    "my_gather through .detach(): the right outputs, but no gradient flows back to the module"
    return swap(solution, "torch.cat([o.to(target_device) for o in outputs], dim)",
                "torch.cat([o.detach().to(target_device) for o in outputs], dim)")


@mutant("my_data_parallel", "wrong")
def mean_of_the_devices_losses(solution):
    "the per-device losses averaged (Hugging Face Trainer's loss.mean()): every device weighs the same"
    return swap(solution, "sum(n * o.to(target_device) for n, o in zip(sizes, outputs)) / sum(sizes)",
                "torch.stack([o.to(target_device) for o in outputs]).mean()")


@mutant("my_data_parallel", "reference")
def library_gather_under_another_name(solution):
    "mgpu_lab.gather imported under another name: the per-device losses as a vector"
    return body(solution, """
        from mgpu_lab import gather as collect
        return collect(outputs, target_device, dim)
    """)


@mutant("my_data_parallel", "wrong")
def a_module_written_to_disk(solution):
    "issue 29 attack, a module written to disk and imported: mgpu_lab.gather from a file, a vector of losses"
    return body(solution, """
        import importlib, pathlib, sys, tempfile
        folder = tempfile.mkdtemp()
        pathlib.Path(folder, "collect_outputs.py").write_text("import mgpu_lab\\n"
            "def collect(outputs, target_device, dim):\\n    return mgpu_lab.gather(outputs, target_device, dim)\\n")
        sys.path.insert(0, folder)
        return importlib.import_module("collect_outputs").collect(outputs, target_device, dim)
    """)


@mutant("my_data_parallel", "copy")
def copies_the_checks_reference_line(solution):
    "the check's own reference, the module on the whole batch: nothing scattered (BatchNorm tells)"
    return body(solution, "return module(*(inputs if isinstance(inputs, tuple) else (inputs,)))", region=1)


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


@mutant("lr_for_batch", "wrong",
        message="scales the learning rate by sqrt(k), which keeps the noise of a step the same; with plain SGD a step "
                "on k·B samples goes about as far as a step on B samples, so matching k small steps takes k times "
                "the learning rate (the linear rule)",
        section="7. One device with batch *B* vs DataParallel with batch *2B*",
        learner="learnA, 2026-12-05, considered: attempts/lab01/lr_for_batch-1.py")
def square_root_for_sgd(solution):
    "the square-root rule (the gradient's noise kept constant) for plain SGD: too small a step per sample"
    return body(solution, "return lr * (new_batch / batch) ** 0.5")


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
