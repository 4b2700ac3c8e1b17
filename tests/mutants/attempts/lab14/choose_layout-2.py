# origin: considered alternative
# what I believed: the lab names two balancers, zig-zag and Striped Attention; with more chunks than 2N,
#   dealing chunk c to rank c mod N (stripes of chunks) gives every rank one chunk of every stretch of N, so the
#   ranks' work evens out as the chunks get finer.
# visible check said: AssertionError: N=2, 4 chunks: your layout idles 0.200 of the step
# grader said: 0/3  AssertionError: N=2, 4 chunks: your layout idles 0.200 of the step (check line 13) This looks like a known misconception: chunks dealt round-robin (r, r+N, ...), as Striped Attention stripes tokens: at each ring step, a rank whose keys come from a lower rank computes c more chunk pairs than one whose keys come from a higher one; mirror pairs cost the same (see '4. The causal imbalance, and the zig-zag').
# misconception: round-robin chunks balance each rank's total only roughly (rank N-1 always holds the latest chunk of every stretch) and not each step; my replay: idle 0.20 (N=2, 4 chunks) ... 0.11 (N=64, 512 chunks), never <= 0.05 at these sizes.
def choose_layout(world_size, n_chunks):
    # For each rank, the chunks it holds; or None.
    per_rank = n_chunks // world_size
    if world_size == 1:
        return [list(range(n_chunks))]
    if per_rank == 1:
        return None          # one chunk each: someone holds the last chunk, (N-1)/(2N-1) idle whatever the order
    # striped (Brandon et al.): chunk c to rank c mod N, every rank a chunk from each stretch of N
    return [list(range(r, n_chunks, world_size)) for r in range(world_size)]
