# origin: first attempt
# what I believed: padding = "repeat from the start until the length is a multiple of world_size", so appending
#   the first (padded_length - n) indices of the list (indices[:pad]) is enough.
# visible check said: ex1 passed
# grader said: 0/2  WrongCases: `mine` does not hold the cases the check asked for: fewer items than the check asked for
# misconception: when the padding is longer than the dataset (n < padded_length - n, e.g. 1 sample on 4 ranks) the
#   index list must be repeated cyclically (DistributedSampler repeats it as many times as needed); slicing
#   indices[:pad] once leaves the last ranks short or empty.
def shard_indices(n, rank, world_size, drop_last=False):
    """The indices rank `rank` reads: a contiguous block of the padded index list (sequential, for evaluation)."""
    indices = list(range(n))
    if drop_last:
        per_rank = n // world_size
        indices = indices[:per_rank * world_size]
    else:
        per_rank = -(-n // world_size)
        indices += indices[:per_rank * world_size - n]
    return indices[rank * per_rank:(rank + 1) * per_rank]
