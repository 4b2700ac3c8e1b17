"""Mutants of lab 06: token-weighted windows, a scaler under accumulation, no_sync under DDP,
planning a run, and ragged token counts per rank under DDP."""
from . import body, mutant, prepend, swap

LAB = "06_gradient_accumulation"


# --- ex1_token_window ------------------------------------------------------------
# The loss weights tokens by class (cross-entropy's weight=): a micro-batch's mean divides by the sum of its
# tokens' weights. Counting tokens (the 2024 fix, and GradientAccumulator given token counts) computes another mean.

@mutant("ex1_token_window", "wrong",
        message="weights each micro-batch's weighted mean by its share of the window's real tokens (n_i / N, the 2024 "
                "fix): with class weights a micro-batch's mean divides by the sum of its tokens' weights, not by their "
                "number, so its share is its sum of weights over the window's",
        section="Exercise 1 (3 points): accumulate a window whose loss weights its tokens",
        learner="learnC, 2026-12-05, considered: attempts/lab06/ex1_token_window-1.py")
def weights_by_token_counts(solution):
    "each micro-batch weighted by its share of the window's tokens: the unweighted fix, not the weighted mean's"
    return swap(solution, "sums = [float(class_weight[y[y != -100]].sum()) for _, y in micro_batches]",
                "sums = [int((y != -100).sum()) for _, y in micro_batches]")


@mutant("ex1_token_window", "wrong",
        message="GradientAccumulator given num_samples = the tokens: it weights each micro-batch by its token count "
                "and divides by the window's tokens; a weighted mean divides by the sum of the tokens' weights, so "
                "num_samples must be that sum",
        section="Exercise 1 (3 points): accumulate a window whose loss weights its tokens")
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
# Exercise 2's variant: an fp16 model, fp32 masters, the window accumulated in fp32 (Megatron's main_grad), which
# GradientAccumulator (it accumulates in .grad) does not compute.

GA_COPY = """
        import importlib.util
        import mgpu_lab.training.grad_accum as lib
        spec = importlib.util.spec_from_file_location("mgpu_lab.training.grad_accum_copy", lib.__file__)
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)"""


@mutant("ex2_scaler", "wrong",
        message="divides each micro-batch's loss by k: with uneven micro-batches, and a short last window, each "
                "micro-batch's mean must be weighted by its share of the window's samples, n_i / N",
        section="3b. Dividing by k when micro-batches are uneven or the last window is short")
def divides_by_k_with_uneven_micro_batches(solution):
    "each micro-batch's loss divided by k: wrong when the micro-batches are uneven"
    return swap(solution, "F.mse_loss(model(xb.half()).float(), yb) * (len(xb) / total)",
                "F.mse_loss(model(xb.half()).float(), yb) / len(window)")


@mutant("ex2_scaler", "wrong",
        message="lets the window add up in the fp16 model's .grad and copies it to the masters at the end: every "
                "partial sum is rounded to fp16; add each micro-batch's fp16 gradient into the masters' fp32 .grad "
                "(Megatron's main_grad) and clear the fp16 .grad before the next micro-batch",
        section="Exercise 2 (4 points): accumulation with a loss scaler, fp16 replicas and an fp32 accumulator")
def accumulates_in_the_fp16_grad(solution):
    "the window added up in the fp16 .grad, copied to the masters at its end: every partial sum rounded to fp16"
    solution = swap(solution, """            for p, m in zip(params, masters):
                m.grad += p.grad                # this micro-batch's fp16 gradient, added in fp32
                p.grad = None
""", "")
    return swap(solution, "        scaler.unscale_(optimizer)\n",
                "        for p, m in zip(params, masters):\n            m.grad = p.grad.float()\n            p.grad = None\n"
                "        scaler.unscale_(optimizer)\n")


@mutant("ex2_scaler", "reference")
def accumulator_through_getattr(solution):
    "mgpu_lab.GradientAccumulator, reached through getattr of a built name, on the fp16 model"
    return body(solution, """
        import mgpu_lab
        acc = getattr(mgpu_lab, "Gradient" + "Accumulator")(model, optimizer, k, scaler=scaler,
                                                           max_grad_norm=max_grad_norm)
        for xb, yb in micro_batches:
            with acc.micro_step():
                acc.backward(F.mse_loss(model(xb.half()).float(), yb), len(xb))
            if acc.micro_steps_in_window == 0:
                scales.append(scaler.get_scale())
        if acc.micro_steps_in_window:
            acc.flush()
            scales.append(scaler.get_scale())
    """)


@mutant("ex2_scaler", "copy")
def steps_the_scaler_every_micro_batch(solution):
    "section 3d's mistake, copied: unscale, step and update after every micro-batch"
    return body(solution, """
        for i, (xb, yb) in enumerate(micro_batches):
            scaler.scale(F.mse_loss(model(xb.half()).float(), yb) / k).backward()
            for p, m in zip(params, masters):
                m.grad = p.grad.float()
                p.grad = None
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(masters, max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
            if (i + 1) % k == 0 or i == len(micro_batches) - 1:
                scales.append(scaler.get_scale())
    """)


@mutant("ex2_scaler", "tamper")
def redefines_mlp(solution):
    "an mlp of its own (the model the check's probe builds), and a loop that never clips"
    return prepend(swap(solution, "        torch.nn.utils.clip_grad_norm_(masters, max_grad_norm)\n", ""), """
        def mlp(seed=0):
            torch.manual_seed(seed)
            return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    """)


@mutant("ex2_scaler", "wrong")
def attack_second_copy_of_the_accumulator(solution):
    "attack: GradientAccumulator from a second copy of its module, loaded from its file past the guard; it "
    "accumulates in the fp16 .grad and its scaler finds no masters' gradients"
    return body(solution, GA_COPY + """
        acc = copy.GradientAccumulator(model, optimizer, k, scaler=scaler, max_grad_norm=max_grad_norm)
        for xb, yb in micro_batches:
            with acc.micro_step():
                acc.backward(F.mse_loss(model(xb.half()).float(), yb), len(xb))
            if acc.micro_steps_in_window == 0:
                scales.append(scaler.get_scale())
        if acc.micro_steps_in_window:
            acc.flush()
            scales.append(scaler.get_scale())
    """)


# --- ex3_no_sync --------------------------------------------------------------------

@mutant("ex3_no_sync", "wrong",
        message="enters no_sync() around the backward only: torch's DDP decides in forward whether the coming "
                "backward communicates, so every micro-batch still all-reduces and the ranks hold equal gradients "
                "before the window ends; wrap forward and backward of every micro-batch but the last",
        section="3e. All-reducing on every micro-step")
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
            after_each.append(grads(model.module))
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
            after_each.append(grads(model.module))
    """)


@mutant("ex3_no_sync", "copy")
def the_loop_everybody_writes(solution):
    "section 2's loop, copied: divided by k, no no_sync (k all-reduces)"
    return body(solution, """
        k = len(micro_batches)
        for x, y in micro_batches:
            (lm_loss(model, x, y) / k).backward()
            after_each.append(grads(model.module))
    """)


@mutant("ex3_no_sync", "tamper")
def swallows_assertion_errors(solution):
    "IPython's custom exception hook swallowing the failed check, and no no_sync at all"
    return prepend(the_loop_everybody_writes(solution), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


@mutant("ex3_no_sync", "wrong",
        message="runs every micro-batch inside no_sync(), the last one too: no backward all-reduces, so each rank "
                "ends with its own running sum; the last micro-batch's forward and backward must run outside no_sync",
        section="3e. All-reducing on every micro-step")
def no_sync_for_every_micro_batch(solution):
    "no_sync around every micro-batch, the last one too: nothing is ever averaged"
    return swap(solution, "        if i < k - 1:", "        if True:")


@mutant("ex3_no_sync", "wrong")
def attack_second_copy_of_the_accumulator(solution):
    "attack: GradientAccumulator from a second copy of its module, loaded from its file past the guard: the "
    "right final gradients, but its running sums are of loss * count, not the window's mean"
    return body(solution, GA_COPY + """
        acc = copy.GradientAccumulator(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                                       accumulation_steps=len(micro_batches) + 1)
        for i, (xb, yb) in enumerate(micro_batches):
            with acc.micro_step(last=i == len(micro_batches) - 1):
                acc.backward(lm_loss(model, xb, yb), int((yb != -100).sum()))
            after_each.append(grads(model.module))
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
def weights_by_this_ranks_weight(solution):
    "each rank's own weighted mean: DDP then averages the ranks' means (a mean of means)"
    return body(solution, """
        counts = [w.sum().item() for _, _, w in micro_batches]
        total, last, logged = sum(counts), len(micro_batches) - 1, 0.0
        for i, ((x, y, w), n) in enumerate(zip(micro_batches, counts)):
            with model.no_sync() if i < last else torch.enable_grad():
                loss = weighted_loss(model, x, y, w)
                (loss * n / total).backward()
            logged += loss.item() * n / total
        return logged
    """)


@mutant("ex5_ragged_tokens", "wrong")
def counts_tokens_not_weights(solution):
    "every real token counted 1, whatever its weight: the weighted means mixed by token counts"
    return swap(solution, "        n = w.sum().item()", "        n = float((y != -100).sum())")


@mutant("ex5_ragged_tokens", "wrong",
        message="divides each rank's weighted loss sums by the window's weight over all ranks, then lets DDP combine "
                "them: DDP averages the ranks' gradients (it divides by the number of ranks), so the gradient is "
                "world_size times too small; multiply by the number of ranks as well (W / N)",
        section="The real case: ragged token counts on every rank",
        learner="learnC, 2026-12-05, considered: attempts/lab06/ex5_ragged_tokens-1.py")
def forgets_ddps_average_over_ranks(solution):
    "each rank's weighted loss sums divided by the global weight, DDP's average over the ranks not undone"
    return body(solution, """
        world = dist.get_world_size()
        local_w = sum(w.sum() for _, _, w in micro_batches).reshape(1).float()
        total = local_w.clone()
        dist.all_reduce(total)                       # the window's weight over all ranks
        W = total.item()
        local_loss = 0.0
        for i, (x, y, w) in enumerate(micro_batches):
            def step():
                per_token = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="none")
                loss_sum = (per_token * w.reshape(-1)).sum()
                (loss_sum / W).backward()            # the share of the global weight
                return loss_sum.item()
            if i < len(micro_batches) - 1:
                with model.no_sync():
                    local_loss += step()
            else:
                local_loss += step()
        loss = torch.tensor([local_loss])
        dist.all_reduce(loss)
        return loss.item() / W
    """)


@mutant("ex5_ragged_tokens", "reference")
def accumulator_from_the_library(solution):
    "mgpu_lab.GradientAccumulator under DDP, imported under another name, counting the tokens"
    return body(solution, """
        from mgpu_lab.training.grad_accum import GradientAccumulator as Accumulate
        acc = Accumulate(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                         accumulation_steps=len(micro_batches))
        for x, y, w in micro_batches:
            with acc.micro_step():
                acc.backward(weighted_loss(model, x, y, w), int((y != -100).sum()))
        return 0.0
    """)


@mutant("ex5_ragged_tokens", "copy")
def three_ways_no_sync_loop(solution):
    "the no_sync loop of section 3e's demo, copied: divided by k, whatever the tokens and their weights"
    return body(solution, """
        k = len(micro_batches)
        logged = 0.0
        for i, (xb, yb, wb) in enumerate(micro_batches):
            if i == k - 1:
                loss = weighted_loss(model, xb, yb, wb) / k
                loss.backward()
            else:
                with model.no_sync():
                    loss = weighted_loss(model, xb, yb, wb) / k
                    loss.backward()
            logged += loss.item()
        return logged
    """)


@mutant("ex5_ragged_tokens", "tamper")
def redefines_the_probe_helper(solution):
    "an on_ddp of its own, around a mean of means"
    return prepend(weights_by_this_ranks_weight(solution), """
        def on_ddp(fn, model, batches):
            ddp = DDP(model)
            out = fn(ddp, batches)
            return out, [p.grad.clone() for p in model.parameters() if p.requires_grad]
    """)


@mutant("ex5_ragged_tokens", "wrong")
def attack_second_copy_of_the_accumulator(solution):
    "attack: GradientAccumulator from a second copy of its module, loaded from its file past the guard, "
    "counting tokens as its documentation's example does: the weights are lost (and it steps and clears)"
    return body(solution, GA_COPY + """
        acc = copy.GradientAccumulator(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                                       accumulation_steps=len(micro_batches))
        logged = 0.0
        for x, y, w in micro_batches:
            with acc.micro_step():
                loss = weighted_loss(model, x, y, w)
                acc.backward(loss, int((y != -100).sum()))
            logged += loss.item() / len(micro_batches)
        return logged
    """)
