# origin: first attempt
# what I believed: the interleaved schedule's activations on device 0 are always section 4's '1 + (p-1)/(pv) times 1F1B's' (11 half stages for p=4), whatever m: held halves = min(m, p) * (1 + (p-1)/(p v)) * v, i.e. memory min(m,p)*(1+(p-1)/(2p))*rows*bytes.
# visible check said: choose_schedule passed
# grader said: 3/3 (full marks) — but the answer is wrong on a case the check does not hold: p=4, microbatch_size=1, max_global_batch=7, bytes_per_sample=1 MiB, memory_budget=5.5 MiB, max_bubble=0.2 -> it returns ('interleaved', 6, 1), whose replay holds 12 half stages = 6.0 MiB > 5.5 MiB (the right answer is None)
# misconception: section 4's 1 + (p-1)/(pv) factor holds only when m is a multiple of p (rounds of p micro-batches); device 0 holds (v-1)*(m // max(1, m//p)) + 2(p-1) + 1 half stages (at most v*m), e.g. 12, not 11, for p=4, m=6 — the warm-up grows with the round size.
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
    # (memory of the busiest device, bubble), or None where the schedule cannot run m
    if schedule == "GPipe":
        return m * rows * bytes_per_sample, (p - 1) / (m + p - 1)
    if schedule == "1F1B":
        return min(m, p) * rows * bytes_per_sample, (p - 1) / (m + p - 1)
    # interleaved, v = 2: section 4, 1 + (p-1)/(p v) times 1F1B's activations; bubble (p-1)/(2m+p-1), m >= p
    v = 2
    if m < p or m % max(1, m // p):
        return None
    return min(m, p) * (1 + (p - 1) / (p * v)) * rows * bytes_per_sample, (p - 1) / (v * m + p - 1)


def choose_schedule(case):
    """(schedule, m, microbatch_size) meeting case's memory budget and bubble target, or None."""
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
