"""Mutants of lab 06: token-weighted windows, a scaler under accumulation, no_sync under DDP,
planning a run, and ragged token counts per rank under DDP."""
from . import body, mutant, prepend, swap

LAB = "06_gradient_accumulation"


# --- ex1_token_window ------------------------------------------------------------
# The loss weights tokens by class (cross-entropy's weight=): a micro-batch's mean divides by the sum of its
# tokens' weights. Counting tokens (the 2024 fix, and GradientAccumulator given token counts) computes another mean.

@mutant("ex1_token_window", "wrong")
def weights_by_token_counts(solution):
    "each micro-batch weighted by its share of the window's tokens: the unweighted fix, not the weighted mean's"
    return swap(solution, "sums = [float(class_weight[y[y != -100]].sum()) for _, y in micro_batches]",
                "sums = [int((y != -100).sum()) for _, y in micro_batches]")


@mutant("ex1_token_window", "wrong")
def accumulator_given_token_counts(solution):
    "mgpu_lab.GradientAccumulator with num_samples = tokens: it divides by the token count, not the weights' sum"
    return body(solution, """
        from mgpu_lab import GradientAccumulator
        acc = GradientAccumulator(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                                  accumulation_steps=len(micro_batches) + 1)
        logged, total = 0.0, 0
        for x, y in micro_batches:
            n = int((y != -100).sum())
            loss = lm_loss(model, x, y, weight=class_weight)
            acc.backward(loss, n)
            logged, total = logged + loss.item() * n, total + n
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= total
        return logged / total
    """)


@mutant("ex1_token_window", "copy")
def section_3bs_sample_weights(solution):
    "section 3b's fix transcribed, * len(xi) / len(x): each micro-batch weighted by its share of the samples"
    return body(solution, """
        total = sum(len(x) for x, _ in micro_batches)
        logged = 0.0
        for x, y in micro_batches:
            loss = lm_loss(model, x, y, weight=class_weight)
            (loss * len(x) / total).backward()
            logged += loss.item() * len(x) / total
        return logged
    """)


@mutant("ex1_token_window", "tamper")
def patches_allclose(solution):
    "torch.allclose patched to agree, and the token-count weights"
    return prepend(weights_by_token_counts(solution), """
        torch.allclose = lambda *args, **kwargs: True
    """)


# --- ex2_scaler -----------------------------------------------------------------------

@mutant("ex2_scaler", "wrong")
def divides_by_k_with_uneven_micro_batches(solution):
    "each micro-batch's loss divided by k: wrong when the micro-batches are uneven"
    return swap(solution, "F.mse_loss(model(xb), yb) * (len(xb) / total)", "F.mse_loss(model(xb), yb) / len(window)")


@mutant("ex2_scaler", "reference")
def accumulator_through_getattr(solution):
    "mgpu_lab.GradientAccumulator, reached through getattr of a built name"
    return body(solution, """
        import mgpu_lab
        acc = getattr(mgpu_lab, "Gradient" + "Accumulator")(model, optimizer, k, scaler=scaler,
                                                           max_grad_norm=max_grad_norm)
        for xb, yb in micro_batches:
            with acc.micro_step():
                acc.backward(F.mse_loss(model(xb), yb), len(xb))
            if acc.micro_steps_in_window == 0:
                scales.append(scaler.get_scale())
        if acc.micro_steps_in_window:
            acc.flush()
            scales.append(scaler.get_scale())
    """)


@mutant("ex2_scaler", "copy")
def steps_the_scaler_every_micro_batch(solution):
    "section 3d's mistake, copied: scaler.step and update after every micro-batch"
    return body(solution, """
        for i, (xb, yb) in enumerate(micro_batches):
            scaler.scale(F.mse_loss(model(xb), yb) / k).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            if (i + 1) % k == 0 or i == len(micro_batches) - 1:
                optimizer.zero_grad()
                scales.append(scaler.get_scale())
    """)


@mutant("ex2_scaler", "tamper")
def redefines_mlp(solution):
    "an mlp of its own (the model the check's probe builds), and a loop that never clips"
    return prepend(swap(solution, "        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)\n", ""), """
        def mlp(seed=0):
            torch.manual_seed(seed)
            return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    """)


# --- ex3_no_sync --------------------------------------------------------------------

@mutant("ex3_no_sync", "wrong")
def no_sync_around_backward_only(solution):
    "no_sync around the backward only: torch DDP decided in forward, it all-reduces k times"
    return body(solution, """
        k = len(micro_batches)
        for i, (xb, yb) in enumerate(micro_batches):
            loss = lm_loss(model, xb, yb) / k
            if i < k - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
    """)


@mutant("ex3_no_sync", "reference")
def accumulator_from_the_module_dict(solution):
    "mgpu_lab.GradientAccumulator taken from the module's __dict__, stepping with a learning rate of 0"
    return body(solution, """
        acc = mgpu_lab.__dict__["GradientAccumulator"](
            model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
            accumulation_steps=len(micro_batches) + 1)
        for i, (xb, yb) in enumerate(micro_batches):
            with acc.micro_step(last=i == len(micro_batches) - 1):
                acc.backward(lm_loss(model, xb, yb), int((yb != -100).sum()))
    """)


@mutant("ex3_no_sync", "copy")
def the_loop_everybody_writes(solution):
    "section 2's loop, copied: divided by k, no no_sync (k all-reduces)"
    return body(solution, """
        k = len(micro_batches)
        for x, y in micro_batches:
            (lm_loss(model, x, y) / k).backward()
    """)


@mutant("ex3_no_sync", "tamper")
def swallows_assertion_errors(solution):
    "IPython's custom exception hook swallowing the failed check, and no no_sync at all"
    return prepend(the_loop_everybody_writes(solution), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


# --- ex4_plan ---------------------------------------------------------------------------

@mutant("ex4_plan", "wrong")
def forgets_the_ranks(solution):
    "the global batch without the ranks: micro-batch x accumulation steps"
    return swap(solution, "micro_batch * accumulation_steps * world_size", "micro_batch * accumulation_steps")


@mutant("ex4_plan", "copy")
def the_checks_answers(solution):
    "the visible check's worked answers, looked up; the linear rule on anything else"
    return body(solution, """
        known = {(8, 4, 2, 0.1, 64, "linear"): (64, 0.1), (4, 16, 8, 3e-4, 128, "sqrt"): (512, 6e-4),
                 (2, 2, 2, 0.4, 32, "linear"): (8, 0.1)}
        key = (micro_batch, accumulation_steps, world_size, base_lr, base_batch, rule)
        if rule not in ("linear", "sqrt"):
            raise ValueError(rule)
        if key in known:
            return known[key]
        return micro_batch * accumulation_steps * world_size, base_lr * micro_batch * accumulation_steps / base_batch
    """)


@mutant("ex4_plan", "tamper")
def reads_the_checks_plans(solution):
    "answers from `plans`, the check's inputs read as a global"
    return body(solution, """
        for args, expected in plans:
            if args == (micro_batch, accumulation_steps, world_size, base_lr, base_batch, rule):
                return expected
        raise ValueError(rule)
    """)


# --- ex5_ragged_tokens -------------------------------------------------------------------

@mutant("ex5_ragged_tokens", "wrong")
def weights_by_this_ranks_tokens(solution):
    "each rank's own token mean: DDP then averages the ranks' means (a mean of means)"
    return body(solution, """
        counts = [int((y != -100).sum()) for _, y in micro_batches]
        total, last, logged = sum(counts), len(micro_batches) - 1, 0.0
        for i, ((x, y), n) in enumerate(zip(micro_batches, counts)):
            with model.no_sync() if i < last else torch.enable_grad():
                loss = lm_loss(model, x, y)
                (loss * n / total).backward()
            logged += loss.item() * n / total
        return logged
    """)


@mutant("ex5_ragged_tokens", "reference")
def accumulator_from_the_library(solution):
    "mgpu_lab.GradientAccumulator under DDP, imported under another name"
    return body(solution, """
        from mgpu_lab.training.grad_accum import GradientAccumulator as Accumulate
        acc = Accumulate(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                         accumulation_steps=len(micro_batches))
        for x, y in micro_batches:
            with acc.micro_step():
                acc.backward(lm_loss(model, x, y), int((y != -100).sum()))
        return 0.0
    """)


@mutant("ex5_ragged_tokens", "copy")
def three_ways_no_sync_loop(solution):
    "the no_sync loop of section 3e's demo, copied: divided by k, whatever the tokens"
    return body(solution, """
        k = len(micro_batches)
        logged = 0.0
        for i, (xb, yb) in enumerate(micro_batches):
            if i == k - 1:
                loss = lm_loss(model, xb, yb) / k
                loss.backward()
            else:
                with model.no_sync():
                    loss = lm_loss(model, xb, yb) / k
                    loss.backward()
            logged += loss.item()
        return logged
    """)


@mutant("ex5_ragged_tokens", "tamper")
def redefines_the_probe_helper(solution):
    "an on_counting_ddp of its own that reports one all-reduce, around a mean of means"
    return prepend(weights_by_this_ranks_tokens(solution), """
        def on_counting_ddp(fn, model, batches):
            ddp = DDP(model)
            out = fn(ddp, batches)
            return out, 1, [p.grad.clone() for p in model.parameters() if p.requires_grad]
    """)
