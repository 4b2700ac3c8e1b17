"""Mutants of lab 05: the scale update rule with hysteresis and a floor, unscale with a flag per parameter
group, an fp16 model with fp32 masters, the fp16 underflow design exercise, parameter groups that skip on their
own.

Each exercise grades a variant torch's scaler and mgpu_lab do not compute (Megatron's hysteresis and floor, flags
per group, masters outside autocast, skipping per group): a reference reached any way scores 0 because it
computes torch's rule; the attack mutants reach it past the guard.
"""
from . import body, mutant, prepend, swap

LAB = "05_mixed_precision"

AMP_COPY = """
        import importlib.util
        import mgpu_lab.training.amp as lib
        spec = importlib.util.spec_from_file_location("mgpu_lab.training.amp_copy", lib.__file__)
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)"""


# --- ex1_update_scale ----------------------------------------------------------

@mutant("ex1_update_scale", "reference")
def attack_linecache_edited(solution):
    "attack: the cached cell sources (linecache) blanked so that a guard reading them sees nothing, then "
    "torch._amp_update_scale_ reached by a built key: torch's rule, no hysteresis, no floor"
    return body(solution, """
        import linecache
        for key, entry in list(linecache.cache.items()):
            if len(entry) == 4:
                linecache.cache[key] = (entry[0], entry[1], ["pass\\n"] * len(entry[2]), entry[3])
        s, t = torch.tensor(float(scale)), torch.tensor(growth_tracker, dtype=torch.int32)
        vars(torch)["_amp_update_scale_"](s, t, torch.tensor(float(found_inf)), growth_factor, backoff_factor,
                                               growth_interval)
        return s.item(), int(t.item()), hysteresis_left
    """)


@mutant("ex1_update_scale", "wrong")
def no_floor(solution):
    "the scale backs off below min_scale"
    return swap(solution, "scale = max(fp32(scale * backoff_factor), min_scale)", "scale = fp32(scale * backoff_factor)")


@mutant("ex1_update_scale", "wrong",
        message="grows when the count reaches growth_interval or more (>=): a tracker that starts above the interval "
                "grows at once; the rule (torch._amp_update_scale_'s) grows only when the incremented tracker equals "
                "the interval, and otherwise keeps counting",
        section="Exercise 1 (3 points): the update rule, with hysteresis and a floor",
        learner="learnC, 2026-12-05, considered: attempts/lab05/ex1_update_scale-1.py")
def grows_at_or_past_the_interval(solution):
    "the growth test >= growth_interval, not ==: a tracker above the interval grows at once"
    return body(solution, """
        f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()
        if found_inf:
            growth_tracker = 0
            hysteresis_left -= 1
            if hysteresis_left <= 0:
                scale = max(f32(scale * backoff_factor), min_scale)
        else:
            growth_tracker += 1
            if growth_tracker >= growth_interval:
                growth_tracker = 0
                hysteresis_left = hysteresis
                grown = f32(scale * growth_factor)
                if not math.isinf(grown):
                    scale = grown
        return scale, growth_tracker, hysteresis_left
    """)


@mutant("ex1_update_scale", "reference")
def kernel_through_getattr(solution):
    "torch._amp_update_scale_ itself, reached through getattr of a built name: no hysteresis, no floor"
    return body(solution, """
        s, t = torch.tensor(float(scale)), torch.tensor(growth_tracker, dtype=torch.int32)
        getattr(torch, "_amp_update" + "_scale_")(s, t, torch.tensor(float(found_inf)),
                                                  growth_factor, backoff_factor, growth_interval)
        return s.item(), int(t.item()), hysteresis_left
    """)


@mutant("ex1_update_scale", "copy")
def section_3_bullets_transcribed(solution):
    "section 3's bullets as Python floats: no hysteresis, no floor, no fp32 rounding, grows to inf, counts with >="
    return body(solution, """
        if found_inf:
            return scale * backoff_factor, 0, hysteresis_left
        if growth_tracker + 1 >= growth_interval:
            return scale * growth_factor, 0, hysteresis_left
        return scale, growth_tracker + 1, hysteresis_left
    """)


@mutant("ex1_update_scale", "tamper")
def patches_torch_equal(solution):
    "torch.equal patched to always agree, and a rule that never changes the scale"
    return prepend(body(solution, "return scale, 0, hysteresis_left"), """
        torch.equal = lambda *args, **kwargs: True
    """)


@mutant("ex1_update_scale", "reference")
def attack_kernel_in_an_exec_string(solution):
    "attack: torch._amp_update_scale_ run from exec of a literal string, past the guard's frame test: torch's rule"
    return body(solution, """
        box = {"s": torch.tensor(float(scale)), "t": torch.tensor(growth_tracker, dtype=torch.int32),
               "f": torch.tensor(float(found_inf)), "g": growth_factor, "b": backoff_factor, "i": growth_interval}
        exec("import torch; torch._amp_update_scale_(s, t, f, g, b, i)", box)
        return box["s"].item(), int(box["t"].item()), hysteresis_left
    """)


# --- ex2_unscale -----------------------------------------------------------------

@mutant("ex2_unscale", "wrong")
def isinf_misses_nan(solution):
    "looks for inf only: a NaN gradient is not found"
    return swap(solution, "if not torch.isfinite(g_).all():", "if torch.isinf(g_).any():")


@mutant("ex2_unscale", "wrong")
def one_flag_for_every_group(solution):
    "one flag for the whole list, as the kernel has it, copied to every group"
    return swap(solution, "                found_inf[k] = 1.0", "                found_inf.fill_(1.0)")


@mutant("ex2_unscale", "wrong",
        message="looks for inf/NaN in the unscaled products: a finite gradient that overflows when multiplied by "
                "inv_scale (a scale below 1) is flagged; the kernel's flag looks at the values before unscaling",
        section="Exercise 2 (3 points): unscale, with a flag per parameter group",
        learner="learnH, 2026-12-05, considered: attempts/lab05/ex2_unscale-1.py")
def checks_after_unscaling(solution):
    "the flag computed on the unscaled products, not on the values before: an overflow of the unscaling is flagged"
    return body(solution, """
        for i, group in enumerate(groups):
            for g in group:
                g.mul_(inv_scale)
                if not torch.isfinite(g).all():
                    found_inf[i] = 1.0
    """)


@mutant("ex2_unscale", "reference")
def fused_kernel_under_an_alias(solution):
    "the fused kernel it re-implements, imported under another name, on the whole list: one flag"
    return body(solution, """
        from torch import _amp_foreach_non_finite_check_and_unscale_ as fused
        grads, flag = [g_ for group in groups for g_ in group], torch.zeros(())
        if grads:
            fused(grads, flag, inv_scale)
        found_inf.fill_(flag.item())
    """)


@mutant("ex2_unscale", "copy")
def section_4_demo(solution):
    "the section 4 demo cell's call of the fused kernel, copied, on each group with one shared flag"
    return body(solution, """
        flag = torch.zeros(())
        for grads in groups:
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale)
        found_inf.fill_(flag.item())
    """)


@mutant("ex2_unscale", "tamper")
def hides_tracebacks(solution):
    "IPython's showtraceback silenced, and gradients unscaled without looking for inf/NaN"
    return prepend(body(solution, """
        for grads in groups:
            for g_ in grads:
                g_.mul_(inv_scale)
    """), """
        get_ipython().showtraceback = lambda *args, **kwargs: None
    """)


@mutant("ex2_unscale", "reference")
def attack_kernel_in_a_worker_thread(solution):
    "attack: the fused kernel run from a worker thread on the whole list, past the guard's frame test: one flag"
    return body(solution, """
        import threading
        grads, flag = [g_ for group in groups for g_ in group], torch.zeros(())
        worker = threading.Thread(target=lambda: grads and torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale))
        worker.start()
        worker.join()
        found_inf.fill_(flag.item())
    """)


# --- ex3_train_master --------------------------------------------------------------

@mutant("ex3_train_master", "wrong")
def the_replica_never_follows(solution):
    "the masters step, but their values are never copied back: the fp16 model trains nothing"
    return swap(solution, "                p.copy_(m)\n", "                pass\n")


@mutant("ex3_train_master", "wrong")
def clips_the_scaled_gradients(solution):
    "clips before unscale_: the norm clipped is S times the true one"
    return swap(solution, "        scaler.unscale_(optimizer)\n", "")


@mutant("ex3_train_master", "reference")
def amp_step_from_the_module_namespace(solution):
    "mgpu_lab.amp_step, looked up in its module's namespace by a built name: autocast on the fp16 model"
    return body(solution, """
        import mgpu_lab.training.amp
        recipe = vars(mgpu_lab.training.amp)["amp_step"]
        for x, y in batches:
            loss = recipe(model, optimizer, loss_fn, (x.half(), y), scaler=scaler, dtype=torch.float16,
                          max_grad_norm=max_grad_norm)
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    """)


@mutant("ex3_train_master", "copy")
def section_7s_autocast_loop(solution):
    "the autocast loop (forward under torch.autocast, the optimizer's own gradients unscaled), on the fp16 model"
    return body(solution, """
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x.half()).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    """)


@mutant("ex3_train_master", "tamper")
def patches_assert_close(solution):
    "torch.testing.assert_close patched to agree, and masters that are never clipped"
    return prepend(swap(solution, "        nn.utils.clip_grad_norm_(masters, max_grad_norm)\n", ""), """
        torch.testing.assert_close = lambda *args, **kwargs: None
    """)


@mutant("ex3_train_master", "wrong")
def attack_autocast_on_an_fp32_mirror(solution):
    "attack: amp_step from a second copy of mgpu_lab's amp module (past the guard) on an fp32 copy of the model "
    "holding the masters' values, under fp16 autocast, copied back: autocast keeps the residual stream in fp32"
    return body(solution, AMP_COPY + """
        import copy as deep
        mirror = deep.deepcopy(model).float()
        with torch.no_grad():
            for mp, m in zip(mirror.parameters(), masters):
                mp.copy_(m)
        mirror_opt = type(optimizer)(mirror.parameters(), **optimizer.defaults)
        for x, y in batches:
            loss = copy.amp_step(mirror, mirror_opt, loss_fn, (x, y), scaler=scaler, dtype=torch.float16,
                                 max_grad_norm=max_grad_norm)
            with torch.no_grad():
                for mp, m, p in zip(mirror.parameters(), masters, params):
                    m.copy_(mp)
                    p.copy_(mp)
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    """)


# --- ex4_underflow (design) ----------------------------------------------------------

@mutant("ex4_underflow", "wrong")
def tiny_targets(solution):
    "tiny targets: a small loss value is not a small gradient at the start, and fp16 trains"
    return body(solution, """
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        y = 1e-4 * torch.tanh(x @ torch.randn(8, 4, generator=g))
        return {"x": x, "y": y, "loss_weight": 1.0, "lr": 0.01, "steps": 50}
    """)


@mutant("ex4_underflow", "wrong",
        message="the output gradients (about 1e-7 here) are not all below fp16's smallest subnormal 2^-24 (6e-8): "
                "many survive as subnormals, Adam divides by their size, and fp16 without a scaler trains like fp32",
        section="2. Small gradients flush to zero",
        learner="learnH, 2026-12-05, considered: attempts/lab05/ex4_underflow-1.py")
def weight_not_small_enough(solution):
    "a loss weight that leaves the gradients near 2^-24, not below it: subnormal, not zero, and Adam still trains"
    return body(solution, """
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1024, 16, generator=g)
        y = x @ torch.randn(16, 64, generator=g)
        # tiny loss weight: the output gradients 2*err/(1024*64)*weight fall below fp16's 2^-24
        return dict(x=x, y=y, loss_weight=1e-3, lr=1e-2, steps=100)
    """)


@mutant("ex4_underflow", "copy")
def section_7_regression(solution):
    "the section 7 regression (its first 1024 rows): fp16 without a scaler did not fail there"
    return body(solution, """
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 16, generator=g)
        y = 0.01 * torch.tanh(x @ torch.randn(16, 64, generator=g))
        return {"x": x[:1024], "y": y[:1024], "loss_weight": 1.0, "lr": 0.01, "steps": 40}
    """)


@mutant("ex4_underflow", "tamper")
def patches_amp_step(solution):
    "mgpu_lab.amp_step replaced in the kernel (the check trains in its own process)"
    return prepend(body(solution, """
        x = torch.randn(64, 4)
        return {"x": x, "y": x.sum(1, keepdim=True), "loss_weight": 1.0, "lr": 0.01, "steps": 10}
    """), """
        import mgpu_lab
        mgpu_lab.amp_step = lambda *args, **kwargs: torch.tensor(float("nan"))
    """)


# --- ex5_group_skipping ----------------------------------------------------------------

@mutant("ex5_group_skipping", "wrong")
def skips_the_whole_optimizer(solution):
    "GradScaler.step: the whole optimizer skips when any group overflowed"
    return body(solution, """
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=dtype):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            steps = [all(torch.isfinite(p.grad).all() for p in g["params"]) for g in optimizer.param_groups]
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
            stepped.append([all(steps)] * len(steps))
    """)


@mutant("ex5_group_skipping", "wrong")
def clips_before_leaving_out_the_overflow(solution):
    "the norm of every gradient clipped, the overflowed group's inf included: the others are scaled to nothing"
    solution = swap(solution, "        nn.utils.clip_grad_norm_(kept, max_grad_norm)\n", "")
    return swap(solution, "        steps, kept = [], []\n",
                "        steps, kept = [], []\n        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)\n")


@mutant("ex5_group_skipping", "wrong",
        message="unscales the gradients itself (exercise 2's unscale_grads_) instead of with scaler.unscale_(optimizer): "
                "GradScaler.update() decides from the found-inf flags that unscale_ records, and finds none "
                "('No inf checks were recorded prior to update')",
        section="11. For real: one scaler, parameter groups that skip on their own",
        learner="learnC, 2026-12-05, considered: attempts/lab05/ex5_group_skipping-1.py")
def own_unscale_then_update(solution):
    "the per-group flags of exercise 2's unscale_grads_, the gradients unscaled by hand: scaler.update() has no flags"
    return body(solution, """
        for x, y in batches:
            optimizer.zero_grad()
            with torch.autocast(device_type, dtype=dtype):
                out = model(x)
                loss = loss_fn(out, y)
            scaler.scale(loss).backward()
            # the per-group flags of exercise 2
            inv = torch.tensor(scaler.get_scale()).double().reciprocal().float()
            groups = [[p.grad for p in group["params"] if p.grad is not None] for group in optimizer.param_groups]
            flags = unscale_grads_(groups, inv)
            ok = [bool(f == 0) for f in flags]
            for group, o in zip(optimizer.param_groups, ok):
                if not o:
                    for p in group["params"]:
                        p.grad = None
            stepping = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if stepping:
                torch.nn.utils.clip_grad_norm_(stepping, max_grad_norm)
            optimizer.step()
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
            stepped.append(ok)
    """)


@mutant("ex5_group_skipping", "reference")
def amp_step_through_getattr(solution):
    "mgpu_lab.amp_step, reached through getattr of a built name: GradScaler's decision for the whole optimizer"
    return body(solution, """
        import mgpu_lab
        step = getattr(mgpu_lab, "amp" + "_step")
        for x, y in batches:
            scale = scaler.get_scale()
            losses.append(step(model, optimizer, loss_fn, (x, y), scaler=scaler, dtype=dtype,
                               max_grad_norm=max_grad_norm).item())
            scales.append(scaler.get_scale())
            stepped.append([scales[-1] >= scale] * len(optimizer.param_groups))
    """)


@mutant("ex5_group_skipping", "copy")
def section_9_loop(solution):
    "section 9's scale / step / update loop: no unscale_, no clipping, the whole optimizer skips"
    return body(solution, """
        for x, y in batches:
            optimizer.zero_grad()
            with torch.autocast(device_type, dtype=dtype):
                loss = loss_fn(model(x), y)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
            stepped.append([scales[-1] >= scale] * len(optimizer.param_groups))
    """)


@mutant("ex5_group_skipping", "tamper")
def patches_assert_close(solution):
    "torch.testing.assert_close patched to agree, and a loop that clips nothing"
    return prepend(swap(solution, "        nn.utils.clip_grad_norm_(kept, max_grad_norm)\n", ""), """
        torch.testing.assert_close = lambda *args, **kwargs: None
    """)


@mutant("ex5_group_skipping", "wrong")
def attack_second_copy_of_amp_step(solution):
    "attack: amp_step from a second copy of mgpu_lab's amp module, loaded from its file past the guard; it skips "
    "the whole optimizer"
    return body(solution, AMP_COPY + """
        for x, y in batches:
            scale = scaler.get_scale()
            losses.append(copy.amp_step(model, optimizer, loss_fn, (x, y), scaler=scaler, dtype=dtype,
                                        max_grad_norm=max_grad_norm).item())
            scales.append(scaler.get_scale())
            stepped.append([scales[-1] >= scale] * len(optimizer.param_groups))
    """)
