# origin: considered alternative
# what I believed: the global mean is the per-rank means weighted by their rows, sum(n_i * mean_i) / sum(n_i) (the formula the lab gives for losses), so each rank sends n_i * mean_i and n_i.
# visible check said: passed ("global_mean passed"); with a rank holding 0 rows (tried by hand on 2 ranks, 3 + 0 rows) it returns [nan, nan] on every rank
# grader said: 2/2 passed (the hidden check has no rank with 0 rows, although the exercise says "possibly with 0 rows on some rank")
# misconception: a rank with 0 rows has a NaN mean (0/0), and 0 * NaN is NaN, so weighting per-rank means poisons the all-reduce; send each rank's row sum (an empty sum is 0) and count instead.
def global_mean(local_rows: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 of the rows held by all ranks (call it on every rank)."""
    # weight each rank's mean by its number of rows: sum n_i * mean_i / sum n_i
    n = torch.tensor(float(local_rows.shape[0]), dtype=local_rows.dtype, device=local_rows.device)
    weighted = local_rows.mean(dim=0) * n
    dist.all_reduce(weighted)
    dist.all_reduce(n)
    return weighted / n
