# origin: considered alternative
# what I believed: (considered before my first attempt) the slow stage sets the pace, so for the stages in front of it the pipeline behaves as if it ended at the slow stage: warm-up = distance to the slow stage + 1, s - i + 1; p - i from the slow stage on.
# visible check said: AssertionError: 4 stages, stage 3 slow, m=8: a stage holds 4 micro-batches at once, as many as 1F1B's stage 0
# grader said: 0/4 — AssertionError: check line 28 failed (its message is withheld: it would show hidden cases)
# misconception: the stages in front of the slow stage must keep the slow stage's own in-flight micro-batches (its warm-up p - s) fed, not just one; what the slow pace saves is the hops in front of it: each hop costs a fast stage 1 + 2 = 3 units against the slow stage's 6-unit cycle, so w_i = (p - s) + ceil((s - i)/2).
def one_f_one_b_slow(stage_index, num_stages, n_microbatches, slow_stage):
    """Stage `stage_index`'s actions in one 1F1B step when stage `slow_stage` takes twice as long as the others."""
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
