# origin: considered alternative
# what I believed: The class weights are already applied inside each micro-batch's weighted mean (lm_loss with weight=); to combine the micro-batches I only need each one's share of the window's real tokens, n_i / N, as in the fix of sections 3b/3c.
# visible check said: AssertionError: window 0: returned loss 4.148707, the window's weighted mean is 4.177682
# grader said: 0/3: AssertionError: check line 27 failed (its message is withheld: it would show hidden cases) This looks like a known misconception: each micro-batch weighted by its share of the window's tokens: the unweighted fix, not the weighted mean's (see '3. The classic mistakes, each shown then fixed').
# misconception: A weighted mean's denominator is the sum of the weights, not the token count: each micro-batch's weighted mean must be weighted by its share of the window's total WEIGHT (sum of class_weight[y] over real tokens), not of its tokens.
def accumulate_window(model, micro_batches, class_weight):
    total = sum(int((y != -100).sum()) for _, y in micro_batches)
    logged = 0.0
    for x, y in micro_batches:
        n_i = int((y != -100).sum())
        loss = lm_loss(model, x, y, weight=class_weight)
        (loss * n_i / total).backward()
        logged += loss.item() * n_i / total
    return logged
