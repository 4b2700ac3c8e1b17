# origin: considered alternative
# what I believed: the lab names Striped Attention (a round-robin stripe) as an alternative fix to zig-zag, so dealing the chunks round-robin (rank r: r, r+N, r+2N, ...) would balance the causal work too.
# visible check said: AssertionError: N=2, 4 chunks: your layout idles 0.200 of the step
# grader said: choose_layout_test 0/3 AssertionError: N=2, 4 chunks: your layout idles 0.200 of the step (check line 13)
# misconception: round-robin chunks are not balanced at chunk granularity: at each ring step a rank whose key block comes from a lower rank does c(c+1)/2 full chunk products and one from a higher rank c(c-1)/2, a gap of c per step that only mirror pairs (j, n-1-j) cancel.
def choose_layout(world_size, n_chunks):
    # For each rank, the chunks it holds; or None.
    # Striped (round-robin) layout, as Striped Attention does token by token: rank r holds r, r + N, r + 2N, ...
    per = n_chunks // world_size
    if world_size > 1 and per == 1:
        return None        # one chunk per rank: contiguous, idles (N-1)/(2N-1)
    return [list(range(r, n_chunks, world_size)) for r in range(world_size)]
