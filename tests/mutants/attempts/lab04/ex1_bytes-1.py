# origin: considered alternative
# what I believed: the busiest rank is the one that sends the biggest chunk (ceil(numel/N) elements) in every one of
#   the 2(N-1) steps, so it sends 2(N-1) * ceil(numel/N) elements.
# visible check said: AssertionError: ring, numel=12, element_size=8, N=5: 192; the busiest rank sends 160
# misconception: no rank sends the biggest chunk every step: each rank sends every chunk but one in each phase (it
#   skips chunk r+1 in scatter-reduce and chunk r+2 in all-gather), so its bytes are 2S minus two chunks of its own,
#   and the busiest rank is the one whose two skipped chunks are the smallest.
def bytes_per_rank(numel, element_size, world_size, algorithm="ring"):
    S = numel * element_size
    N = world_size
    if algorithm == "parameter_server":
        return (N - 1) * S
    if algorithm != "ring":
        raise ValueError(f"unknown algorithm {algorithm!r}")
    biggest = -(-numel // N)   # tensor_split: the first chunks are one element larger
    return 2 * (N - 1) * biggest * element_size   # 2(N-1) steps, the busiest rank sends the biggest chunk each time
