"""Mutants of lab 12: gpipe_window (a GPipe step inside an accumulation window), one_f_one_b_slow (1F1B with
a stage twice as slow) and choose_schedule (design: replayed on small cases, computed exactly at a real
run's size, where a search over the replay does not end in time).

gpipe_window's check forbids the library's schedules (``reimplements``), a courtesy (the guard lives in the
learner's kernel): the schedule is the exercise. Its reference mutant, called for each batch as one step, computes
1/m of its step and the numbers reject it; the library's schedule with the window's weight in the loss would give
the right numbers, which only the guard refuses (INSTRUCTORS' honour-level table says so). one_f_one_b_slow's answer is orders (data): the library's order for equal stages is a ``wrong`` mutant
there, and the numbers reject it."""
from . import body, mutant, prepend, swap

LAB = "12_pipeline_parallel"
L = "learnE, 2026-12-05, "      # learner= of the attempts kept in attempts/lab12 (issue 46 item 4)

SCALE = "scaled = mb_losses[k] * (len(targets[k]) / window_samples) if stage.is_last else None"


# --- gpipe_window ----------------------------------------------------------------------------

def scaled_by_one_over_m(solution):
    "each micro-batch's loss scaled by 1/m, as one step's schedules do: the window's gradient is summed over steps"
    return swap(solution, SCALE, "scaled = mb_losses[k] / m if stage.is_last else None")


@mutant("gpipe_window", "wrong",
        message="1/m of each step times the batch's share of the window (1/(m x steps) for equal batches): right "
                "for equal micro-batches, wrong for 10 samples in 3, 3, 2, 2; each micro-batch weighs "
                "n_k / window_samples",
        learner=L + "considered: attempts/lab12/gpipe_window-1.py")
def scaled_by_one_over_m_times_steps(solution):
    "1/m of the step x the batch's share of the window (1/(m x steps) for equal batches): wrong for 3, 3, 2, 2"
    return swap(solution, SCALE, "scaled = mb_losses[k] / (m * window_samples / len(target)) if stage.is_last else None")


@mutant("gpipe_window", "reference")
def library_schedule_gpipe(solution):
    "mgpu_lab's ScheduleGPipe, called for each batch: 1/m of its own step, not of the window (refused by name too)"
    return body(solution, """
        schedule = ScheduleGPipe(stage, n_microbatches, loss_fn)
        out = schedule.step(x, target=target, losses=losses) if stage.is_first else \\
            schedule.step(target=target, losses=losses)
        if losses:
            losses[:] = [float(v) for v in losses]
        return out
    """)


@mutant("gpipe_window", "copy")
def section_1s_naive_step(solution):
    "section 1's naive step transcribed: the whole batch as one micro-batch, its loss weighted by the window"
    return body(solution, """
        stage.reset()
        out = stage.forward_one_chunk(0, x if stage.is_first else None)
        loss = loss_fn(out, target) if stage.is_last else None
        stage.backward_one_chunk(0, loss * len(target) / window_samples if stage.is_last else None)
        stage.finish()
        if not stage.is_last:
            return None
        losses.append(loss.detach())
        return out.detach()
    """)


@mutant("gpipe_window", "tamper")
def redefines_run_window(solution):
    "a run_window of its own that reports GPipe's timelines whatever ran, and losses scaled by 1/m"
    return prepend(scaled_by_one_over_m(solution), """
        _run_window = run_window
        def run_window(*args, **kwargs):
            out = _run_window(*args, **kwargs)
            out["timelines"] = [gpipe_order(dist.get_rank(), dist.get_world_size(), args[2]) for _ in out["timelines"]]
            return out
    """)


# --- one_f_one_b_slow -------------------------------------------------------------------------

def warm_up_of_equal_stages(solution):
    "1F1B's warm-up of p - i, written out: as short a step, but the stages before the slow one hold more than needed"
    return swap(solution, "    return order(warmups[stage_index])", "    return order(p - stage_index)")


@mutant("one_f_one_b_slow", "wrong")
def warm_up_of_one(solution):
    "a warm-up of one forward on every stage: little held, but the stages wait for each other and the step lengthens"
    return swap(solution, "    return order(warmups[stage_index])", "    return order(1)")


@mutant("one_f_one_b_slow", "wrong",
        message="the warm-up halved in front of the slow stage: a warm-up covers the round trip to the first "
                "backward, the slow stage's 2 + 4 included; only the hops in front of the slow stage fit twice in "
                "its cycle",
        section="3. 1F1B: the same bubble, bounded memory",
        learner=L + "first attempt: attempts/lab12/one_f_one_b_slow-1.py")
def warm_up_halved_before_the_slow_stage(solution):
    "half of 1F1B's warm-up on the stages before the slow one: the step lengthens (78 time units, 1F1B's 57)"
    return body(solution, """
        m = n_microbatches
        if stage_index < slow_stage:
            # a slow stage behind takes two fast units per micro-batch: half the forwards in flight suffice
            warmup = -(-(num_stages - stage_index) // 2)
        else:
            warmup = num_stages - stage_index
        warmup = min(max(warmup, 1), m)
        order = [("F", k) for k in range(warmup)]
        for k in range(warmup, m):
            order += [("B", k - warmup), ("F", k)]
        order += [("B", k) for k in range(m - warmup, m)]
        return order
    """)


@mutant("one_f_one_b_slow", "wrong",
        message="the stages in front of the slow one warm up as if the pipeline ended there (s - i + 1): they must "
                "keep the slow stage's own p - s micro-batches in flight fed too; only the hops in front of it cost "
                "less than 1F1B's",
        section="3. 1F1B: the same bubble, bounded memory",
        learner=L + "considered: attempts/lab12/one_f_one_b_slow-2.py")
def warm_up_to_the_slow_stage(solution):
    "the stages in front of the slow one warm up as if the pipeline ended there (s - i + 1)"
    return body(solution, """
        m = n_microbatches
        if stage_index < slow_stage:
            # the slow stage sets the pace, as if the pipeline ended there: cover the distance to it, plus one
            warmup = slow_stage - stage_index + 1
        else:
            warmup = num_stages - stage_index
        warmup = min(max(warmup, 1), m)
        order = [("F", k) for k in range(warmup)]
        for k in range(warmup, m):
            order += [("B", k - warmup), ("F", k)]
        order += [("B", k) for k in range(m - warmup, m)]
        return order
    """)


@mutant("one_f_one_b_slow", "wrong")
def library_one_f_one_b_order(solution):
    "mgpu_lab's one_f_one_b_order, the order for equal stages"
    return body(solution, "return one_f_one_b_order(stage_index, num_stages, n_microbatches)")


@mutant("one_f_one_b_slow", "copy")
def the_gpipe_order(solution):
    "GPipe's order, as the notebook draws it (every forward, then every backward)"
    return body(solution, """
        return [("F", k) for k in range(n_microbatches)] + [("B", k) for k in range(n_microbatches)]
    """)


@mutant("one_f_one_b_slow", "tamper")
def ipython_hides_failures(solution):
    "IPython's exception hook swallowing the failed check, and 1F1B's equal-stage warm-up"
    return prepend(warm_up_of_equal_stages(solution), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)


# --- choose_schedule (design) ------------------------------------------------------------------

@mutant("choose_schedule", "wrong")
def gpipe_holds_one_micro_batch(solution):
    "GPipe counted as holding one micro-batch: micro-batching is believed to cut GPipe's memory"
    return swap(solution, "            if m * rows * per_sample <= case[\"memory_budget\"]:",
                "            if rows * per_sample <= case[\"memory_budget\"]:")


@mutant("choose_schedule", "wrong")
def interleaved_bubble_by_the_formula(solution):
    "interleaving's bubble taken from (p-1)/(2m+p-1) for every m: with fewer micro-batches than devices it is larger"
    return swap(solution, "bubble = (p - 1) / (2 * m + p - 1) if m >= p else (2 * p - m - 1) / (2 * p + m - 1)",
                "bubble = (p - 1) / (2 * m + p - 1)")


@mutant("choose_schedule", "wrong")
def interleaved_holds_as_1f1b(solution):
    "interleaving taken to hold 1F1B's min(m, p) micro-batches: its warm-up runs about 2p half stages ahead"
    return swap(solution, "held = min(m // rounds + 2 * p - 1, 2 * m)", "held = 2 * min(m, p)")


@mutant("choose_schedule", "wrong",
        message="interleaving's memory taken as section 4's 1 + (p-1)/(pv) times 1F1B's for every m: true only "
                "when p divides m; device 0 holds its warm-up + 1 half stages, 12 and not 11 for p = 4, m = 6",
        section="8. Design exercise (3 points): schedule, micro-batches and their size",
        learner=L + "first attempt: attempts/lab12/choose_schedule-1.py")
def interleaved_memory_by_section_4s_factor(solution):
    "interleaving held as 1 + (p-1)/(pv) times 1F1B's for every m (section 4's m = 8): too little when p does not divide m"
    return body(solution, """
        def _candidates(case):
            if "global_batch" in case:
                B = case["global_batch"]
                for m in range(1, B + 1):
                    if B % m == 0 and B // m >= case["min_microbatch_size"]:
                        yield m, B // m
            else:
                rows = case["microbatch_size"]
                for m in range(1, case["max_global_batch"] // rows + 1):
                    yield m, rows

        def _cost(schedule, p, m, rows, bytes_per_sample):
            if schedule == "GPipe":
                return m * rows * bytes_per_sample, (p - 1) / (m + p - 1)
            if schedule == "1F1B":
                return min(m, p) * rows * bytes_per_sample, (p - 1) / (m + p - 1)
            # interleaved, v = 2: section 4, 1 + (p-1)/(p v) times 1F1B's activations; bubble (p-1)/(2m+p-1), m >= p
            v = 2
            if m < p or m % max(1, m // p):
                return None
            return min(m, p) * (1 + (p - 1) / (p * v)) * rows * bytes_per_sample, (p - 1) / (v * m + p - 1)

        p = case["num_stages"]
        for m, rows in _candidates(case):
            for schedule in ("1F1B", "interleaved", "GPipe"):
                cost = _cost(schedule, p, m, rows, case["bytes_per_sample"])
                if cost is None:
                    continue
                memory, bubble = cost
                if memory <= case["memory_budget"] and bubble <= case["max_bubble"] + 1e-12:
                    return schedule, m, rows
        return None
    """)


@mutant("choose_schedule", "copy")
def the_bubble_demos_micro_batches(solution):
    "only the m of the bubble demos, (4, 8), with 1F1B: no choice where neither fits"
    return body(solution, """
        if "global_batch" in case:
            return "1F1B", 4, case["global_batch"] // 4
        return "1F1B", 4, case["microbatch_size"]
    """)


@mutant("choose_schedule", "copy")
def the_evaluator_in_a_loop(solution):
    "the check's replay (replayed, memory_of, bubble_of) over every m until one fits: past the time limit at scale"
    return body(solution, """
        replayed = {"GPipe": lambda p, m: (simulate_timeline([gpipe_order(s, p, m) for s in range(p)]), 1),
                    "1F1B": lambda p, m: (simulate_timeline([one_f_one_b_order(s, p, m) for s in range(p)]), 1),
                    "interleaved": lambda p, m: (simulate_timeline([interleaved_1f1b_order(r, p, 2, m)
                                                                    for r in range(p)], 0.5, 1.0), 2)}
        memory_of = lambda replay, v, rows, c: max(held_microbatches([a[:-2] for a in rank]) for rank in replay) \\
            * rows * c["bytes_per_sample"] / v
        bubble_of = lambda replay: bubble_fraction([[(a, b) for *_, a, b in rank] for rank in replay])
        p = case["num_stages"]
        if "global_batch" in case:
            B = case["global_batch"]
            shapes = [(m, B // m) for m in range(1, B + 1) if B % m == 0 and B // m >= case["min_microbatch_size"]]
        else:
            shapes = [(m, case["microbatch_size"]) for m in range(1, case["max_global_batch"] // case["microbatch_size"] + 1)]
        for m, rows in shapes:
            for name in replayed:
                try:
                    replay, v = replayed[name](p, m)
                except ValueError:
                    continue
                if memory_of(replay, v, rows, case) <= case["memory_budget"] and bubble_of(replay) <= case["max_bubble"] + 1e-9:
                    return name, m, rows
        return None
    """)


@mutant("choose_schedule", "tamper")
def patches_held_microbatches(solution):
    "mgpu_lab's held_microbatches patched to count one micro-batch, and the wrong GPipe rule"
    return prepend(gpipe_holds_one_micro_batch(solution), """
        import mgpu_lab.parallel.pipeline
        mgpu_lab.parallel.pipeline.held_microbatches = lambda timeline: 1
    """)
