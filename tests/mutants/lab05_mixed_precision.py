"""Mutants of lab 05: the scale update rule, unscale with inf detection, the AMP loop,
the fp16 underflow design exercise, and one scaler for two optimizers."""
from . import body, mutant, prepend, swap

LAB = "05_mixed_precision"


# --- ex1_update_scale ----------------------------------------------------------

@mutant("ex1_update_scale", "wrong")
def tracker_survives_an_overflow(solution):
    "the count of clean steps is not reset when an overflow backs the scale off"
    return swap(solution, "return fp32(scale * backoff_factor), 0",
                "return fp32(scale * backoff_factor), growth_tracker")


@mutant("ex1_update_scale", "reference")
def kernel_through_getattr(solution):
    "torch._amp_update_scale_ itself, reached through getattr of a built name"
    return body(solution, """
        s, t = torch.tensor(float(scale)), torch.tensor(growth_tracker, dtype=torch.int32)
        getattr(torch, "_amp_update" + "_scale_")(s, t, torch.tensor(float(found_inf)),
                                                  growth_factor, backoff_factor, growth_interval)
        return s.item(), int(t.item())
    """)


@mutant("ex1_update_scale", "copy")
def section_3_bullets_transcribed(solution):
    "section 3's bullets as Python floats: no fp32 rounding, grows to inf, counts with >="
    return body(solution, """
        if found_inf:
            return scale * backoff_factor, 0
        if growth_tracker + 1 >= growth_interval:
            return scale * growth_factor, 0
        return scale, growth_tracker + 1
    """)


@mutant("ex1_update_scale", "tamper")
def patches_torch_equal(solution):
    "torch.equal patched to always agree, and a rule that never changes the scale"
    return prepend(body(solution, "return scale, 0"), """
        torch.equal = lambda *args, **kwargs: True
    """)


# --- ex2_unscale -----------------------------------------------------------------

@mutant("ex2_unscale", "wrong")
def isinf_misses_nan(solution):
    "looks for inf only: a NaN gradient is not found"
    return swap(solution, "if not torch.isfinite(g_).all():", "if torch.isinf(g_).any():")


@mutant("ex2_unscale", "reference")
def fused_kernel_under_an_alias(solution):
    "the fused kernel it re-implements, imported under another name"
    return body(solution, """
        from torch import _amp_foreach_non_finite_check_and_unscale_ as fused
        if grads:
            fused(grads, found_inf, inv_scale)
    """)


@mutant("ex2_unscale", "copy")
def section_4_demo(solution):
    "the section 4 demo cell's call of the fused kernel, copied"
    return body(solution, """
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    """)


@mutant("ex2_unscale", "tamper")
def hides_tracebacks(solution):
    "IPython's showtraceback silenced, and gradients unscaled without looking for inf/NaN"
    return prepend(body(solution, """
        for g_ in grads:
            g_.mul_(inv_scale)
    """), """
        get_ipython().showtraceback = lambda *args, **kwargs: None
    """)


# --- ex3_train_amp -----------------------------------------------------------------

@mutant("ex3_train_amp", "wrong")
def clips_the_scaled_gradients(solution):
    "clips before unscale_: the norm clipped is S times the true one"
    return swap(solution, "        scaler.unscale_(optimizer)\n", "")


@mutant("ex3_train_amp", "reference")
def amp_step_from_the_module_namespace(solution):
    "mgpu_lab.amp_step, looked up in its module's namespace by a built name"
    return body(solution, """
        import mgpu_lab.training.amp
        recipe = vars(mgpu_lab.training.amp)["amp" + "_step"]
        for x, y in batches:
            loss = recipe(model, optimizer, loss_fn, (x, y), scaler=scaler, dtype=dtype, max_grad_norm=max_grad_norm)
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    """)


@mutant("ex3_train_amp", "copy")
def calls_the_old_reference_loop(solution):
    "return reference_loop(...): the helper the graded cell showed before issue 22 (gone now)"
    return body(solution, "return reference_loop(model, optimizer, batches, scaler, dtype, max_grad_norm)")


@mutant("ex3_train_amp", "tamper")
def reads_the_checks_batches(solution):
    "trains on amp_batches, the check's input read as a global, instead of its argument"
    return swap(solution, "    for x, y in batches:", "    for x, y in amp_batches:")


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


# --- ex5_two_optimizers ----------------------------------------------------------------

@mutant("ex5_two_optimizers", "wrong")
def updates_after_each_optimizer(solution):
    "scaler.update() after each optimizer's step: the second is unscaled by a scale it never had"
    return body(solution, """
        for x, y in batches:
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=dtype):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            for opt in optimizers:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], max_grad_norm)
                scaler.step(opt)
                scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    """)


@mutant("ex5_two_optimizers", "reference")
def amp_step_through_getattr(solution):
    "mgpu_lab.amp_step given the list, reached through getattr of a built name"
    return body(solution, """
        import mgpu_lab
        step = getattr(mgpu_lab, "amp" + "_step")
        for x, y in batches:
            losses.append(step(model, optimizers, loss_fn, (x, y), scaler=scaler, dtype=dtype,
                               max_grad_norm=max_grad_norm).item())
            scales.append(scaler.get_scale())
    """)


@mutant("ex5_two_optimizers", "copy")
def section_9_loop_per_optimizer(solution):
    "section 9's scale / step / update loop, once per optimizer, with no unscale_ and no clipping"
    return body(solution, """
        for x, y in batches:
            for opt in optimizers:
                opt.zero_grad()
            with torch.autocast(device_type, dtype=dtype):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            for opt in optimizers:
                scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    """)


@mutant("ex5_two_optimizers", "tamper")
def patches_assert_close(solution):
    "torch.testing.assert_close patched to agree, and a loop that clips nothing"
    return prepend(swap(solution, "        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)\n", ""), """
        torch.testing.assert_close = lambda *args, **kwargs: None
    """)
