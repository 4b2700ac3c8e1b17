# origin: first attempt
# what I believed: a slow stage behind a fast one consumes a micro-batch per two fast time units, so a stage in front of the slow stage needs only half of 1F1B's forwards in flight: warm-up ceil((p - i)/2) before the slow stage, p - i from the slow stage on.
# visible check said: AssertionError: 4 stages, stage 3 slow, m=8: your step lasts 78 time units, 1F1B's 57
# grader said: 0/4 — AssertionError: check line 26 failed (its message is withheld: it would show hidden cases)
# misconception: halving the warm-up ignores the round trip: a stage's warm-up must cover the time until its first backward comes back (the forward down to the last stage and the backwards up, the slow stage's 2 + 4 included), so it cannot shrink by the slow stage's factor; only the slack the slow stage creates in the steady state can be saved (and a stage with fewer in flight than the next one can even deadlock).
def one_f_one_b_slow(stage_index, num_stages, n_microbatches, slow_stage):
    """Stage `stage_index`'s actions in one 1F1B step when stage `slow_stage` takes twice as long as the others."""
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
