# origin: first attempt
# what I believed: split the step's G samples over the dp rows as evenly as possible (first G % dp rows one more), then
#   cut each row's part into chunks of micro_batch, the usual DataLoader batching; a ValueError only if a row gets nothing.
# visible check said: AssertionError: dp=3, tp=1, global batch 16, micro-batch 5, step 0: the ranks run [1, 2] micro-batches: every rank must run the same number
# grader said: rank_batches_test 0/3 WrongCases: `plans` does not hold the cases the check asked for: a list with more items than the solution's result there (what your code returned for a case, or the cases themselves)
# misconception: chunking each row by micro_batch gives rows of unequal size a different number of micro-batches; K must be set by the largest row (ceil(ceil(G/dp)/mb)) and every row split into exactly K pieces.
def rank_batches(step, rank, dp, tp, global_batch, micro_batch):
    """The micro-batches (lists of sample indices) rank `rank` of a (dp, tp) mesh reads at optimizer step `step`."""
    d = rank // tp                                  # my row: the tp ranks of a row read the same samples
    base, extra = divmod(global_batch, dp)          # the first `extra` rows read one sample more
    if base == 0:
        raise ValueError(f"global batch {global_batch} < dp={dp}: a row would read no sample")
    start = step * global_batch + d * base + min(d, extra)
    size = base + (1 if d < extra else 0)
    samples = list(range(start, start + size))
    return [samples[i:i + micro_batch] for i in range(0, size, micro_batch)]
