# origin: considered alternative
# what I believed: torch.tensor_split already balances floor/ceil with the larger slices first; taking its slices from the other end (rank r gets slice n-1-r) puts the larger slices on the last ranks.
# visible check said: AssertionError: 5 rows over 2 ranks: 2 + 3, the larger slice last
# grader said: 0/3 ForbiddenCall: this exercise must not call torch.Tensor.tensor_split, torch.tensor_split
# misconception: reversing which slice a rank takes also reverses the rows' order (rank 0 gets the batch's last rows), so the slices are no longer contiguous in rank order; only the sizes must be reversed, not the slices.
def rank_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s rows of `batch`: balanced slices, the larger ones on the last ranks (a view)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    if batch.dim() == 0 or batch.shape[0] < world_size:
        raise ValueError(f"a batch of {batch.shape[0] if batch.dim() else 0} rows cannot feed "
                         f"{world_size} ranks: use a global batch of at least world_size rows")
    # tensor_split puts the larger slices first; take them from the other end so the larger ones go to the last ranks
    return torch.tensor_split(batch, world_size)[world_size - 1 - rank]
