"""Mutants of lab 12: gpipe_step, one_f_one_b (the 1F1B order) and choose_microbatches (design)."""
from . import body, mutant, prepend, swap

LAB = "12_pipeline_parallel"


# --- gpipe_step ------------------------------------------------------------------

@mutant("gpipe_step", "wrong")
def losses_not_scaled_by_one_over_m(solution):
    "each micro-batch's loss back-propagated unscaled: the gradient of the sum, m times the batch mean's"
    return swap(solution, "mb_losses[k] / m if stage.is_last", "mb_losses[k] if stage.is_last")


@mutant("gpipe_step", "reference")
def calls_schedule_gpipe(solution):
    "the library's ScheduleGPipe, the schedule the exercise re-implements"
    return body(solution, """
        schedule = ScheduleGPipe(stage, n_microbatches, loss_fn)
        if stage.is_first:
            return schedule.step(x, target=target, losses=losses)
        return schedule.step(target=target, losses=losses)
    """)


@mutant("gpipe_step", "copy")
def copies_the_naive_split(solution):
    "section 1's naive step: the whole batch as one micro-batch (one forward, one backward)"
    return body(solution, """
        stage.reset()
        out = stage.forward_one_chunk(0, x if stage.is_first else None)
        loss = loss_fn(out, target) if stage.is_last else None
        stage.backward_one_chunk(0, loss)
        stage.finish()
        if not stage.is_last:
            return None
        losses.append(loss.detach())
        return out.detach()
    """)


@mutant("gpipe_step", "tamper")
def redefines_run_pipeline(solution):
    "a run_pipeline of its own that reports GPipe's timeline whatever ran (a redefined helper of the checks)"
    return prepend(solution, """
        _run_pipeline = run_pipeline
        def run_pipeline(*args, **kwargs):
            out = _run_pipeline(*args, **kwargs)
            out["timeline"] = gpipe_order(dist.get_rank(), dist.get_world_size(), args[3])
            return out
    """)


# --- one_f_one_b ------------------------------------------------------------------

@mutant("one_f_one_b", "wrong")
def warm_up_num_stages_everywhere(solution):
    "a warm-up of num_stages forwards on every stage: the later stages hold more than p - i micro-batches"
    return swap(solution, "warmup = min(n_microbatches, num_stages - stage_index)",
                "warmup = min(n_microbatches, num_stages)")


@mutant("one_f_one_b", "reference")
def calls_one_f_one_b_order(solution):
    "mgpu_lab.parallel.pipeline.one_f_one_b_order, the order the exercise re-implements"
    return body(solution, "return one_f_one_b_order(stage_index, num_stages, n_microbatches)")


@mutant("one_f_one_b", "copy")
def copies_the_gpipe_order(solution):
    "GPipe's order, as the notebook draws it (every forward, then every backward)"
    return body(solution, """
        return [("F", k) for k in range(n_microbatches)] + [("B", k) for k in range(n_microbatches)]
    """)


@mutant("one_f_one_b", "tamper")
def ipython_hides_failures(solution):
    "IPython's exception hook swallowing the failed check, and GPipe's order"
    return prepend(body(solution, """
        return [("F", k) for k in range(n_microbatches)] + [("B", k) for k in range(n_microbatches)]
    """), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


# --- choose_microbatches (design) ----------------------------------------------------

@mutant("choose_microbatches", "wrong")
def gpipe_memory_shrinks_with_m(solution):
    "GPipe counted as holding one micro-batch: micro-batching is believed to cut GPipe's memory"
    return swap(solution, "if m * per_microbatch <= budget_bytes:", "if per_microbatch <= budget_bytes:")


@mutant("choose_microbatches", "wrong")
def one_f_one_b_holds_one(solution):
    "1F1B counted as holding one micro-batch per stage (it holds p - i, stage 0 the most)"
    return swap(solution, "if min(m, p) * per_microbatch <= budget_bytes:", "if per_microbatch <= budget_bytes:")


@mutant("choose_microbatches", "copy")
def tries_only_the_demos_m(solution):
    "only the m of the bubble demo, (1, 2, 4, 8)"
    return swap(solution, "for m in range(1, batch_size + 1):", "for m in (1, 2, 4, 8):")


@mutant("choose_microbatches", "tamper")
def patches_held_microbatches(solution):
    "mgpu_lab.parallel.pipeline.held_microbatches patched to count one micro-batch, and the wrong GPipe rule"
    return prepend(swap(solution, "if m * per_microbatch <= budget_bytes:", "if per_microbatch <= budget_bytes:"), """
        mgpu_lab.parallel.pipeline.held_microbatches = lambda timeline: 1
    """)
