# origin: considered alternative
# what I believed: to get the whole-batch mean from per-micro-batch mean losses, divide each micro-batch's loss by the number of micro-batches (as in plain gradient accumulation).
# visible check said: ex4 passed (the visible case has 12 rows in micro-batches of 4: equal sizes)
# grader said: 0/3 AssertionError: 10 rows in micro-batches of 3: the gradient differs from the full-batch backward (check line 19) This looks like a known misconception: each micro-batch's mean loss divided by their number: wrong when the last one is smaller (see '7. Checkpointing and gradient accumulation').
# misconception: dividing by the number of micro-batches weights a smaller last micro-batch's rows too heavily; each micro-batch's mean must be weighted by its share of the rows.
def accumulate_checkpointed(blocks, x, y, micro_batch, segments):
    after_each = []
    # YOUR CODE HERE
    n_micro = math.ceil(x.shape[0] / micro_batch)
    for start in range(0, x.shape[0], micro_batch):
        xb, yb = x[start:start + micro_batch], y[start:start + micro_batch]
        out = checkpoint_sequential(blocks, segments, xb, use_reentrant=False)
        loss = F.mse_loss(out, yb) / n_micro
        loss.backward()
        after_each.append([p.grad.clone() for p in blocks.parameters()])
    return after_each
