# origin: later attempt
# what I believed: K = ceil(largest row / micro_batch) on every rank, each row split into K near-equal micro-batches;
#   the only layout with no plan is one where a row gets no sample (G < dp), so that is the only ValueError.
# visible check said: rank_batches passed
# grader said: rank_batches_test 0/3 WrongCases: `plans` does not hold the cases the check asked for: a list with more items than the solution's result there (what your code returned for a case, or the cases themselves)
#   (NB: the grader gave the same 0/3 WrongCases to attempt 3 and to a plan built from mgpu_lab.batch_plan, so this
#   message does not tell which of its cases this attempt gets wrong)
# misconception: a row can be non-empty and still too small: with micro_batch=1 and G not divisible by dp (16 on 3 rows,
#   K=6) the 5-sample rows cannot fill 6 micro-batches, so this returns an empty micro-batch instead of raising; the
#   ValueError condition is "smallest row (G // dp) < K", not "G < dp".
def rank_batches(step, rank, dp, tp, global_batch, micro_batch):
    """The micro-batches (lists of sample indices) rank `rank` of a (dp, tp) mesh reads at optimizer step `step`."""
    d = rank // tp                                  # my row: the tp ranks of a row read the same samples
    base, extra = divmod(global_batch, dp)          # the first `extra` rows read one sample more
    if base == 0:
        raise ValueError(f"global batch {global_batch} < dp={dp}: a row would read no sample")
    biggest = base + (1 if extra else 0)
    K = -(-biggest // micro_batch)                  # the largest row sets K; every row runs K micro-batches
    start = step * global_batch + d * base + min(d, extra)
    size = base + (1 if d < extra else 0)
    samples = list(range(start, start + size))
    q, r = divmod(size, K)                          # my row's samples in K near-equal micro-batches
    out, i = [], 0
    for k in range(K):
        n = q + (1 if k < r else 0)
        out.append(samples[i:i + n])
        i += n
    return out
